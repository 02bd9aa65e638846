//! `lockstep`: the thin command-line front end. One module per subcommand.

mod args;
mod cc;
mod fs;
mod inject;
mod kv;
mod run;

use clap::{Parser, Subcommand};

// Counted, for the per-request allocation counts that tests bound (kv's `kv_allocations`).
#[global_allocator]
static ALLOCATOR: lockstep_core::alloc_count::Counting = lockstep_core::alloc_count::Counting;

/// lockstep turns silent data corruption into a detected stop or a masked fault.
#[derive(Parser)]
#[command(name = "lockstep", version, about, long_about = None, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    Run(run::RunArgs),
    Inject(Box<inject::InjectArgs>),
    Kv(kv::KvArgs),
    Fs(fs::FsArgs),
    /// Compile and link C with libsei's handler hardening (gcc arguments; see `lockstep cc --help`)
    Cc(CompilerArgs),
    /// Compile and link C++ with libsei's handler hardening (g++ arguments)
    #[command(name = "c++")]
    Cxx(CompilerArgs),
}

/// The compiler's own arguments, passed through unparsed.
#[derive(clap::Args)]
#[command(disable_help_flag = true)]
struct CompilerArgs {
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, num_args = 0..)]
    args: Vec<std::ffi::OsString>,
}

fn main() {
    // The compiler wrappers take gcc's arguments verbatim: no parsing by clap.
    let mut raw = std::env::args_os().skip(1);
    match raw.next().as_deref().and_then(|a| a.to_str()) {
        Some("cc") => std::process::exit(cc::main(lockstep_sei::Lang::C, raw.collect())),
        Some("c++") => std::process::exit(cc::main(lockstep_sei::Lang::Cxx, raw.collect())),
        _ => {}
    }
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            // clap prints help/version to stdout with exit 0; usage errors are one line, exit 2.
            if !e.use_stderr() {
                // (help to a closed stdout has nowhere to go)
                let _ = e.print();
                std::process::exit(0);
            }
            eprintln!("{}", args::one_line(&e));
            std::process::exit(lockstep_core::exit::USAGE);
        }
    };
    let code = match cli.command {
        Command::Run(args) => run::main(args),
        Command::Inject(args) => inject::main(*args),
        Command::Kv(args) => kv::main(args),
        Command::Fs(args) => fs::main(args),
        Command::Cc(args) => cc::main(lockstep_sei::Lang::C, args.args),
        Command::Cxx(args) => cc::main(lockstep_sei::Lang::Cxx, args.args),
    };
    std::process::exit(code);
}

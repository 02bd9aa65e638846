//! `lockstep`: the thin command-line front end. One module per subcommand.

mod inject;
mod run;

use clap::{Parser, Subcommand};

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
}

fn main() {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            // clap prints help/version to stdout with exit 0 and usage errors with exit 2.
            let code = if e.use_stderr() { lockstep_core::exit::USAGE } else { 0 };
            let _ = e.print();
            std::process::exit(code);
        }
    };
    let code = match cli.command {
        Command::Run(args) => run::main(args),
        Command::Inject(args) => inject::main(*args),
    };
    std::process::exit(code);
}

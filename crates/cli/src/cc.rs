//! `lockstep cc` / `lockstep c++`: GCC with libsei's hardening added. Arguments go to
//! the compiler unchanged (so `make CC="lockstep cc"` works), except `--sei-mode`.
//! Known `-fgnu-tm` failures are retried or explained (lockstep_sei::diagnose).

use std::ffi::OsString;
use std::io::{IsTerminal, Write};
use std::os::unix::ffi::OsStringExt;
use std::process::{Command, Stdio};

use lockstep_core::exit;
use lockstep_sei::diagnose::{self, Remedy};
use lockstep_sei::{Install, Lang, WrapError};

const HELP: &str = "\
lockstep cc / lockstep c++: compile and link with libsei's handler hardening (SEI)

Usage: lockstep cc [--sei-mode ecc|dup] [GCC ARGUMENTS...]
       make CC=\"lockstep cc\"
       lockstep cc --print-include-dir | --print-lib

Adds -fgnu-tm, the directory of <sei.h> and, when linking, libsei (the whole archive,
before the -litm that gcc appends, so that no _ITM_ symbol reaches the real libitm).
Annotate handlers with SEI_HANDLER / sei_begin + SEI_ATOMIC + sei_end (see docs/sei.md).

Options (everything else goes to the compiler):
  --sei-mode ecc|dup   default memory mode compiled in; SEI_MODE=ecc|dup overrides it at run time
  --print-include-dir  print the directory of sei.h and sei_native.h, e.g. for the native build:
                         gcc -DSEI_NATIVE -I\"$(lockstep cc --print-include-dir)\" ...
  --print-lib          print the path of libsei.a, to link by hand with
                         gcc -fgnu-tm ... -Wl,--whole-archive LIB -Wl,--no-whole-archive -pthread

When gcc -fgnu-tm fails, lockstep cc says why on stderr (lines starting \"lockstep cc:\"):
  - a GCC 12 refusal to inline always_inline functions (an empty reason): it retries once
    with -fno-ipa-pure-const, then with always_inline turned off, and builds
  - a GCC crash in its TM instrumentation: it retries once with -fno-ivopts
  - \"unsafe function call ... within atomic transaction\": for each function named, the
    calls down to the one GCC cannot instrument, and the sei.h function that replaces it
The compiler's exit status is kept.

Environment:
  LOCKSTEP_CC, LOCKSTEP_CXX  the compiler to wrap (default gcc / g++); it must be GCC
  LOCKSTEP_SEI_DIR           where libsei is unpacked (default ~/.cache/lockstep)

Run-time environment of hardened programs:
  SEI_MODE=ecc|dup   memory mode (ecc trusts hardware ECC; dup keeps a software copy)
  SEI_BARRIER=0      turn the checking barrier off
  SEI_MAX_WORDS=N    words one handler may write (default 1048576, 8 MiB)

A hardened program exits with status 86 and one line on stderr when a check fails.
";

pub fn main(lang: Lang, args: Vec<OsString>) -> i32 {
    if args.len() == 1 && (args[0] == "--help" || args[0] == "-h") {
        print!("{HELP}");
        return 0;
    }
    let name = if lang == Lang::C { "lockstep cc" } else { "lockstep c++" };
    let install = match lockstep_sei::install() {
        Ok(i) => i,
        Err(e) => {
            eprintln!("{name}: {}", WrapError::Install(e));
            return 1;
        }
    };
    if args.len() == 1 && (args[0] == "--print-include-dir" || args[0] == "--print-lib") {
        let path = if args[0] == "--print-lib" {
            install.archive()
        } else {
            install.include_dir()
        };
        let mut line = path.into_os_string().into_vec();
        line.push(b'\n');
        return match std::io::stdout().write_all(&line) {
            Ok(()) => 0,
            Err(_) => 1,
        };
    }
    compile(name, lang, &args, &install)
}

/// Runs the compiler, retries once per [`Remedy`] when GCC fails in a way that the
/// remedy avoids, and explains the failures it cannot avoid. GCC's stderr is held back
/// so that a failure that a retry avoids is not shown; stdin and stdout are the caller's.
fn compile(name: &str, lang: Lang, args: &[OsString], install: &Install) -> i32 {
    // Without a terminal on its stderr gcc drops its colours; give them back.
    let colour = wants_colour(args).then(|| OsString::from("-fdiagnostics-color=always"));
    // A source read from stdin cannot be read a second time.
    let can_retry = !diagnose::reads_stdin(args);
    let sources = diagnose::sources(args);
    let label = match sources.as_slice() {
        [one] => format!("{}: ", one.display()),
        _ => String::new(),
    };
    let mut applied: Vec<Remedy> = Vec::new();
    loop {
        let mut full: Vec<OsString> = args.to_vec();
        full.extend(applied.iter().flat_map(|r| r.flags()).map(OsString::from));
        let mut cmd: Command = match lockstep_sei::command(lang, &full[..], install) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("{name}: {e}");
                return exit::USAGE;
            }
        };
        cmd.args(colour.iter());
        let out = match cmd
            .stdin(Stdio::inherit())
            .stdout(Stdio::inherit())
            .stderr(Stdio::piped())
            .output()
        {
            Ok(out) => out,
            Err(e) => {
                eprintln!("{name}: cannot run the compiler: {e}");
                return 1;
            }
        };
        let status = out.status.code().unwrap_or(1);
        let text = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() && can_retry {
            if let Some((remedy, why)) = diagnose::next_remedy(&text, &applied) {
                eprintln!("{name}: {label}retrying with {}: {why}", remedy.flags().join(" "));
                applied.push(remedy);
                continue;
            }
        }
        // (gcc's own messages to a closed stderr have nowhere to go)
        let _ = std::io::stderr().write_all(&out.stderr);
        if out.status.success() {
            return 0;
        }
        if let Some(ice) = diagnose::internal_compiler_error(&text) {
            eprintln!("{name}: {label}{}", diagnose::ice_explanation(&ice));
            if applied.contains(&Remedy::NoIvopts) {
                eprintln!("{name}: {label}it crashed with -fno-ivopts too; try -O0 for this file");
            } else if ice.in_tm {
                eprintln!("{name}: {label}-fno-ivopts avoids the known crash; add it to this file's flags");
            }
        }
        for line in diagnose::trace_unsafe_calls(lang, &full, &text, install) {
            eprintln!("{name}: {line}");
        }
        return status;
    }
}

/// True when gcc would colour its diagnostics on our terminal and the caller did not
/// choose: `-fdiagnostics-color=auto` (gcc's default) looks at a terminal that is now a pipe.
fn wants_colour(args: &[OsString]) -> bool {
    let chosen = args.iter().any(|a| {
        let a = a.to_string_lossy();
        a.starts_with("-fdiagnostics-color") || a.starts_with("-fno-diagnostics-color")
    });
    let term_ok = std::env::var("TERM").is_ok_and(|t| !t.is_empty() && t != "dumb");
    let disabled =
        std::env::var_os("GCC_COLORS").is_some_and(|c| c.is_empty()) || std::env::var_os("NO_COLOR").is_some();
    !chosen && term_ok && !disabled && std::io::stderr().is_terminal()
}

//! `lockstep cc` / `lockstep c++`: GCC with libsei's hardening added. Arguments go to
//! the compiler unchanged (so `make CC="lockstep cc"` works), except `--sei-mode`.

use std::ffi::OsString;
use std::process::Command;

use lockstep_core::exit;
use lockstep_sei::{Lang, WrapError};

const HELP: &str = "\
lockstep cc / lockstep c++: compile and link with libsei's handler hardening (SEI)

Usage: lockstep cc [--sei-mode ecc|dup] [GCC ARGUMENTS...]
       make CC=\"lockstep cc\"

Adds -fgnu-tm, the directory of <sei.h> and, when linking, libsei (the whole archive,
before the -litm that gcc appends, so that no _ITM_ symbol reaches the real libitm).
Annotate handlers with SEI_HANDLER / sei_begin + SEI_ATOMIC + sei_end (see docs/sei.md).

Options (everything else goes to the compiler):
  --sei-mode ecc|dup  default memory mode compiled in; SEI_MODE=ecc|dup overrides it at run time

Environment:
  LOCKSTEP_CC, LOCKSTEP_CXX  the compiler to wrap (default gcc / g++); it must be GCC
  LOCKSTEP_SEI_DIR           where libsei is unpacked (default ~/.cache/lockstep)

Run-time environment of hardened programs:
  SEI_MODE=ecc|dup   memory mode (ecc trusts hardware ECC; dup keeps a software copy)
  SEI_BARRIER=0      turn the checking barrier off
  SEI_MAX_WORDS=N    words one handler may write (default 1024)

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
    let mut cmd: Command = match lockstep_sei::command(lang, &args, &install) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{name}: {e}");
            return exit::USAGE;
        }
    };
    match cmd.status() {
        Ok(status) => status.code().unwrap_or(1),
        Err(e) => {
            eprintln!("{name}: cannot run the compiler: {e}");
            1
        }
    }
}

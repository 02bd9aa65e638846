//! Exit statuses of the `lockstep` binary. This is the one place they are defined;
//! `docs/run.md` lists them for users.

/// Corruption detected; lockstep stopped the program to prevent propagation
/// (DMR divergence, no majority in TMR, libsei abort, a daemon refusing to continue).
pub const DETECTED: i32 = 86;
/// Bad command line.
pub const USAGE: i32 = 2;
/// lockstep itself could not continue: an unsupported system call, a kernel feature
/// that is missing, or an internal error. The message on stderr names the cause.
pub const LOCKSTEP_FAILURE: i32 = 125;
/// The command exists but could not be executed (permissions, bad format).
pub const CANNOT_EXECUTE: i32 = 126;
/// The command was not found.
pub const NOT_FOUND: i32 = 127;
/// A program killed by signal `n` is reported as `SIGNAL_BASE + n`, like a shell does.
pub const SIGNAL_BASE: i32 = 128;

/// Human description of an exit status, for summaries.
pub fn describe(status: i32) -> &'static str {
    match status {
        0 => "success",
        DETECTED => "corruption detected, stopped",
        USAGE => "usage error",
        LOCKSTEP_FAILURE => "lockstep failure",
        CANNOT_EXECUTE => "command not executable",
        NOT_FOUND => "command not found",
        s if s > SIGNAL_BASE => "killed by a signal",
        _ => "program error",
    }
}

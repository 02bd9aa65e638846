//! The fast path's in-process part (issue 16, part B; in progress).
//!
//! `shim/lockstep_fast.c` is built by `build.rs` into a shared library that a replica
//! loads with `LD_PRELOAD`. With `LOCKSTEP_FAST` set it intercepts every syscall of the
//! process in process: Syscall User Dispatch finds each syscall site once (a SIGSYS, which
//! the monitor lets through: see `signals.rs`), and the site is rewritten into a call of the
//! shim's trampoline. Today the shim passes every call on to the kernel, where the
//! monitor's seccomp filter still stops the replica as before: the interception works and
//! is measured, the shared-memory channel that will let calls skip the monitor is the next
//! step. `lockstep run` does not load the shim by itself yet.

/// Where the build put the shim (for tests and benchmarks of this build tree).
pub const SHIM_PATH: &str = env!("LOCKSTEP_FAST_SHIM");

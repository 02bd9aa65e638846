//! Tracee primitives shared by `lockstep run` and `lockstep inject`.
//!
//! * [`ptrace`]: stops, resumes, registers and events of one traced thread.
//! * [`mem`]: reading and writing a tracee's memory.
//! * [`seccomp`]: the BPF filter that decides which syscalls stop, and the user-notification
//!   listener used to install file descriptors into a tracee.
//! * [`syscalls`]: the one table that classifies every x86-64 syscall.
//! * [`syscall_names`]: the kernel's names of all x86-64 syscalls, for messages.
//! * [`regs`]: register names, for fault injection and diagnostics.
//! * [`remote`]: making a stopped tracee run syscalls of our choosing.
//! * [`cpu`]: another process's CPU time (the clock of time-based injection points).
//! * [`syscall_counter`]: counting a thread's syscalls without stopping it.
//!
//! This crate knows nothing about replicas or votes.

pub mod cpu;
pub mod mem;
pub mod ptrace;
pub mod regs;
pub mod remote;
pub mod seccomp;
pub mod syscall_counter;
pub mod syscall_names;
pub mod syscalls;

pub use ptrace::{Regs, Stop, Tid};

/// A syscall number that no kernel implements: natively it fails with ENOSYS, so
/// `lockstep_trace()` is a no-op outside lockstep. Under lockstep the monitor folds its
/// buffer into the caller's signature. Keep in sync with `clib/include/lockstep.h`.
pub const SYS_LOCKSTEP_TRACE: u64 = 0x4c53;
/// A syscall number the filter answers with a user notification. The monitor rewrites a
/// follower's syscall to this number to install file descriptors into it.
pub const SYS_LOCKSTEP_INSTALL: u64 = 0x4c54;
/// The fast path's call to the monitor (`lockstep_fast(op, ...)`): the shim's hello at
/// start, and a follower's report of a divergence it found in the shared ring.
pub const SYS_LOCKSTEP_FAST: u64 = 0x4c55;
/// Address of the fast path's syscall gate (`syscall; ret` on page 0, mapped by the shim).
/// With `--backend fast` the seccomp filter allows the calls made from it (outputs stop
/// there for strict checks). Its return address, 0x600, differs from the `syscall` at
/// 0x5fe in eight bits: an instruction pointer with one or two bits flipped after a call
/// cannot run that call again, unseen, through the gate (a fault campaign found one that
/// did, with the gate at 0x600, and it consumed a request nobody answered).
pub const FAST_GATE: u64 = 0x5fe;

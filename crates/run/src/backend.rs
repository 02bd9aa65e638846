//! The seam between the monitor's policy (who executes what, votes, recovery) and the
//! mechanism that stops and steers replica threads.
//!
//! Today the only mechanism is ptrace + seccomp. Everything the monitor does to a replica
//! goes through [`Backend`], so an in-process fast path (for example a syscall shim that
//! talks to the monitor over shared memory) can replace it without touching the policy.

use lockstep_trace::{mem, ptrace, Regs, Stop, Tid};
use std::io;

/// How to resume a stopped replica thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resume {
    /// Run until the next intercepted syscall or event.
    Run,
    /// Run, delivering this signal now.
    Signal(i32),
    /// Run the syscall we are stopped at and stop again at its exit.
    ToExit,
}

/// Mechanism for steering replica threads.
pub trait Backend {
    fn regs(&self, tid: Tid) -> io::Result<Regs>;
    fn set_regs(&self, tid: Tid, regs: &Regs) -> io::Result<()>;
    fn read(&self, tid: Tid, addr: u64, buf: &mut [u8]) -> io::Result<()>;
    fn write(&self, tid: Tid, addr: u64, data: &[u8]) -> io::Result<()>;
    fn resume(&self, tid: Tid, how: Resume) -> io::Result<()>;
    /// Stops a thread that is blocked in a syscall (the syscall returns ERESTART*).
    fn interrupt(&self, tid: Tid) -> io::Result<()>;
    /// The next stop of any replica thread; `None` when interrupted by lockstep's own
    /// signals (timer tick, forwarded signals).
    fn wait_any(&self) -> io::Result<Option<(Tid, Stop)>>;
    /// The next stop of one thread.
    fn wait_tid(&self, tid: Tid) -> io::Result<Stop>;
    /// A stop of one thread if it has one to report now.
    fn try_wait_tid(&self, tid: Tid) -> io::Result<Option<Stop>>;
    /// The message of the event the thread is stopped at (a new thread's id, ...).
    fn event_msg(&self, tid: Tid) -> io::Result<u64>;
    /// The signal the thread is about to receive.
    fn siginfo(&self, tid: Tid) -> io::Result<libc::siginfo_t>;
    /// Replaces the siginfo of the signal the thread is stopped to receive.
    fn set_siginfo(&self, tid: Tid, info: &libc::siginfo_t) -> io::Result<()>;
    /// Sends `sig` to one thread.
    fn signal_thread(&self, tgid: Tid, tid: Tid, sig: i32) -> io::Result<()>;
    /// SIGKILLs a thread or process; it may already be gone.
    fn kill(&self, pid: Tid);
    /// Arms or disarms the execution breakpoint of a stopped thread (see `catch_up.rs`).
    fn set_breakpoint(&self, tid: Tid, at: Option<u64>) -> io::Result<()>;
    /// From now on, resume `tid` (if any) one instruction at a time, except into a
    /// syscall exit (`Resume::ToExit`): its next stops are single-step SIGTRAPs.
    fn single_step(&self, tid: Option<Tid>);
    fn read_vec(&self, tid: Tid, addr: u64, len: usize) -> io::Result<Vec<u8>> {
        let mut v = vec![0u8; len];
        self.read(tid, addr, &mut v)?;
        Ok(v)
    }
}

/// The ptrace backend.
#[derive(Default)]
pub struct Ptrace {
    /// The thread being single-stepped (a fault injection in progress), or 0.
    stepping: std::cell::Cell<Tid>,
}

impl Backend for Ptrace {
    fn regs(&self, tid: Tid) -> io::Result<Regs> {
        ptrace::get_regs(tid)
    }
    fn set_regs(&self, tid: Tid, regs: &Regs) -> io::Result<()> {
        ptrace::set_regs(tid, regs)
    }
    fn read(&self, tid: Tid, addr: u64, buf: &mut [u8]) -> io::Result<()> {
        mem::read(tid, addr, buf)
    }
    fn write(&self, tid: Tid, addr: u64, data: &[u8]) -> io::Result<()> {
        mem::write(tid, addr, data)
    }
    fn resume(&self, tid: Tid, how: Resume) -> io::Result<()> {
        if tid == self.stepping.get() {
            match how {
                Resume::Run => return ptrace::step(tid, 0),
                Resume::Signal(sig) => return ptrace::step(tid, sig),
                Resume::ToExit => {}
            }
        }
        match how {
            Resume::Run => ptrace::cont(tid, 0),
            Resume::Signal(sig) => ptrace::cont(tid, sig),
            Resume::ToExit => ptrace::cont_syscall(tid, 0),
        }
    }
    fn interrupt(&self, tid: Tid) -> io::Result<()> {
        ptrace::interrupt(tid)
    }
    fn wait_any(&self) -> io::Result<Option<(Tid, Stop)>> {
        ptrace::wait_any()
    }
    fn wait_tid(&self, tid: Tid) -> io::Result<Stop> {
        ptrace::wait_tid(tid)
    }
    fn try_wait_tid(&self, tid: Tid) -> io::Result<Option<Stop>> {
        let mut status = 0;
        // SAFETY: non-blocking waitpid on one traced thread.
        let r = unsafe { libc::waitpid(tid, &mut status, libc::WNOHANG | libc::__WALL) };
        match r {
            0 => Ok(None),
            r if r == tid => Ok(Some(ptrace::decode(status))),
            _ => Err(io::Error::last_os_error()),
        }
    }
    fn event_msg(&self, tid: Tid) -> io::Result<u64> {
        ptrace::event_msg(tid)
    }
    fn siginfo(&self, tid: Tid) -> io::Result<libc::siginfo_t> {
        ptrace::siginfo(tid)
    }
    fn set_siginfo(&self, tid: Tid, info: &libc::siginfo_t) -> io::Result<()> {
        ptrace::set_siginfo(tid, info)
    }
    fn signal_thread(&self, tgid: Tid, tid: Tid, sig: i32) -> io::Result<()> {
        ptrace::tgkill(tgid, tid, sig)
    }
    fn kill(&self, pid: Tid) {
        ptrace::kill(pid, libc::SIGKILL)
    }
    fn single_step(&self, tid: Option<Tid>) {
        self.stepping.set(tid.unwrap_or(0));
    }
    fn set_breakpoint(&self, tid: Tid, at: Option<u64>) -> io::Result<()> {
        ptrace::set_breakpoint(tid, at)
    }
}

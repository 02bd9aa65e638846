//! Thin, checked wrappers around ptrace(2) and waitpid(2) for one thread (a "tid").

use std::io;

pub type Tid = libc::pid_t;
pub type Regs = libc::user_regs_struct;

pub const OPTIONS: libc::c_int = libc::PTRACE_O_TRACESYSGOOD
    | libc::PTRACE_O_TRACESECCOMP
    | libc::PTRACE_O_TRACEFORK
    | libc::PTRACE_O_TRACEVFORK
    | libc::PTRACE_O_TRACECLONE
    | libc::PTRACE_O_TRACEEXEC
    | libc::PTRACE_O_EXITKILL;

/// What `waitpid` reported for a traced thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// The thread exited with this status.
    Exited(i32),
    /// The thread was killed by this signal.
    Killed(i32),
    /// Syscall entry, reported because the seccomp filter said TRACE.
    Seccomp,
    /// Syscall exit (we resumed with PTRACE_SYSCALL).
    SyscallExit,
    /// A ptrace event: fork, vfork, clone, exec, vfork-done.
    Event(i32),
    /// PTRACE_EVENT_STOP: group-stop, PTRACE_INTERRUPT, or a new child's first stop.
    EventStop(i32),
    /// A signal is about to be delivered.
    Signal(i32),
}

fn check(ret: libc::c_long) -> io::Result<libc::c_long> {
    if ret == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

fn req(request: libc::c_uint, tid: Tid, addr: usize, data: usize) -> io::Result<libc::c_long> {
    // SAFETY: raw ptrace; the kernel validates every argument for the given tid.
    check(unsafe { libc::ptrace(request, tid, addr, data) })
}

pub fn seize(tid: Tid) -> io::Result<()> {
    req(libc::PTRACE_SEIZE, tid, 0, OPTIONS as usize).map(drop)
}

/// Resume, delivering `sig` if the thread is in a signal-delivery-stop.
pub fn cont(tid: Tid, sig: i32) -> io::Result<()> {
    req(libc::PTRACE_CONT, tid, 0, sig as usize).map(drop)
}

/// Resume until the next syscall entry or exit.
pub fn cont_syscall(tid: Tid, sig: i32) -> io::Result<()> {
    req(libc::PTRACE_SYSCALL, tid, 0, sig as usize).map(drop)
}

/// Execute one instruction, delivering `sig` first if the thread is in a
/// signal-delivery-stop.
pub fn step(tid: Tid, sig: i32) -> io::Result<()> {
    req(libc::PTRACE_SINGLESTEP, tid, 0, sig as usize).map(drop)
}

/// Stop a running thread (interrupting a blocking syscall with ERESTART*).
pub fn interrupt(tid: Tid) -> io::Result<()> {
    req(libc::PTRACE_INTERRUPT, tid, 0, 0).map(drop)
}

pub fn detach(tid: Tid) -> io::Result<()> {
    detach_with(tid, 0)
}

/// Detaches, delivering `sig` if the thread is in a signal-delivery-stop.
pub fn detach_with(tid: Tid, sig: i32) -> io::Result<()> {
    req(libc::PTRACE_DETACH, tid, 0, sig as usize).map(drop)
}

pub fn get_regs(tid: Tid) -> io::Result<Regs> {
    // SAFETY: all-zero is a valid user_regs_struct.
    let mut regs: Regs = unsafe { std::mem::zeroed() };
    req(libc::PTRACE_GETREGS, tid, 0, &mut regs as *mut Regs as usize)?;
    Ok(regs)
}

pub fn set_regs(tid: Tid, regs: &Regs) -> io::Result<()> {
    req(libc::PTRACE_SETREGS, tid, 0, regs as *const Regs as usize).map(drop)
}

pub fn event_msg(tid: Tid) -> io::Result<u64> {
    let mut msg: libc::c_ulong = 0;
    req(
        libc::PTRACE_GETEVENTMSG,
        tid,
        0,
        &mut msg as *mut libc::c_ulong as usize,
    )?;
    Ok(msg)
}

/// Arms (Some(address)) or disarms (None) an execution breakpoint in debug register 0 of
/// a stopped thread. A hit stops the thread with SIGTRAP (`si_code` TRAP_HWBKPT) before
/// the instruction runs; the kernel sets the resume flag, so continuing runs it.
pub fn set_breakpoint(tid: Tid, at: Option<u64>) -> io::Result<()> {
    const DR7_LOCAL_ENABLE_0: usize = 1;
    let debugreg = |n: usize| std::mem::offset_of!(libc::user, u_debugreg) + n * 8;
    match at {
        Some(addr) => {
            req(libc::PTRACE_POKEUSER, tid, debugreg(0), addr as usize)?;
            req(libc::PTRACE_POKEUSER, tid, debugreg(7), DR7_LOCAL_ENABLE_0).map(drop)
        }
        None => req(libc::PTRACE_POKEUSER, tid, debugreg(7), 0).map(drop),
    }
}

/// `si_code` of a SIGTRAP raised by a hardware breakpoint.
pub const TRAP_HWBKPT: i32 = 4;

pub fn siginfo(tid: Tid) -> io::Result<libc::siginfo_t> {
    // SAFETY: all-zero is a valid siginfo_t.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    req(
        libc::PTRACE_GETSIGINFO,
        tid,
        0,
        &mut info as *mut libc::siginfo_t as usize,
    )?;
    Ok(info)
}

/// Replaces the siginfo of the signal that thread `tid` is stopped to receive.
pub fn set_siginfo(tid: Tid, info: &libc::siginfo_t) -> io::Result<()> {
    req(libc::PTRACE_SETSIGINFO, tid, 0, info as *const libc::siginfo_t as usize)?;
    Ok(())
}

/// Sends `sig` to exactly thread `tid` of process `tgid`.
pub fn tgkill(tgid: Tid, tid: Tid, sig: i32) -> io::Result<()> {
    // SAFETY: plain syscall with integer arguments.
    check(unsafe { libc::syscall(libc::SYS_tgkill, tgid, tid, sig) }).map(drop)
}

pub fn kill(pid: Tid, sig: i32) {
    // SAFETY: plain syscall; failure (already gone) is fine.
    unsafe {
        libc::kill(pid, sig);
    }
}

/// Decodes a raw wait status of a traced thread.
pub fn decode(status: libc::c_int) -> Stop {
    if libc::WIFEXITED(status) {
        return Stop::Exited(libc::WEXITSTATUS(status));
    }
    if libc::WIFSIGNALED(status) {
        return Stop::Killed(libc::WTERMSIG(status));
    }
    let sig = libc::WSTOPSIG(status);
    let event = (status >> 16) & 0xffff;
    if sig == libc::SIGTRAP | 0x80 {
        return Stop::SyscallExit;
    }
    match event {
        0 => Stop::Signal(sig),
        libc::PTRACE_EVENT_SECCOMP => Stop::Seccomp,
        libc::PTRACE_EVENT_STOP => Stop::EventStop(sig),
        e => Stop::Event(e),
    }
}

/// Waits for any traced thread. `Ok(None)` when interrupted by a signal of our own
/// (so the caller can look at its timers and flags).
pub fn wait_any() -> io::Result<Option<(Tid, Stop)>> {
    let mut status = 0;
    // SAFETY: plain waitpid.
    let tid = unsafe { libc::waitpid(-1, &mut status, libc::__WALL) };
    if tid == -1 {
        let err = io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EINTR) {
            return Ok(None);
        }
        return Err(err);
    }
    Ok(Some((tid, decode(status))))
}

/// Waits for one specific thread; `Ok(None)` when interrupted by a signal of our own (a
/// timer tick), so that the caller can look at its deadline.
pub fn wait_tid_interruptible(tid: Tid) -> io::Result<Option<Stop>> {
    let mut status = 0;
    // SAFETY: plain waitpid.
    let r = unsafe { libc::waitpid(tid, &mut status, libc::__WALL) };
    if r == -1 {
        let err = io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EINTR) {
            return Ok(None);
        }
        return Err(err);
    }
    Ok(Some(decode(status)))
}

/// Waits for one specific thread.
pub fn wait_tid(tid: Tid) -> io::Result<Stop> {
    loop {
        if let Some(stop) = wait_tid_interruptible(tid)? {
            return Ok(stop);
        }
    }
}

/// The syscall number at a syscall stop.
pub fn syscall_nr(regs: &Regs) -> u64 {
    regs.orig_rax
}

/// The six syscall arguments, in ABI order.
pub fn syscall_args(regs: &Regs) -> [u64; 6] {
    [regs.rdi, regs.rsi, regs.rdx, regs.r10, regs.r8, regs.r9]
}

/// Replaces the syscall at a seccomp stop so that the kernel skips it and returns `ret`.
pub fn skip_with_result(regs: &mut Regs, ret: i64) {
    regs.orig_rax = u64::MAX;
    regs.rax = ret as u64;
}

/// Makes a thread stopped at syscall exit (or at a skipped entry) run the same syscall
/// instruction again when resumed: the kernel's own restart, done by hand so that all
/// replicas restart identically.
pub fn rewind_to_syscall(regs: &mut Regs, nr: u64) {
    regs.orig_rax = u64::MAX;
    regs.rax = nr;
    regs.rip -= 2; // `syscall` is 0f 05
}

/// Kernel-internal "restart me" return values that a tracer sees at syscall exit.
pub fn is_restart(ret: i64) -> bool {
    matches!(ret, -512 | -513 | -514 | -516)
}

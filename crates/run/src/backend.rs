//! The seam between the monitor's policy (who executes what, votes, recovery) and the
//! mechanism that stops and steers replica threads.
//!
//! Everything the monitor does to or learns about a replica goes through [`Backend`]:
//! registers, memory, resumption, waiting, and what it reads from `/proc`. The mechanism
//! is ptrace + seccomp ([`Ptrace`]); `crate::scripted` drives the same policy from
//! hand-written syscall streams in unit tests, without any process.
//!
//! Errors: a call on a thread that is gone (`ESRCH`) is expected (its death arrives
//! through `wait_any`); any other failure to steer a replica is that replica's failure,
//! and [`Checked`] reports it to the monitor rather than letting it pass silently.

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

/// A command to a replica thread. The policy decides; the backend carries the command
/// out ([`Backend::apply`]). Every change the monitor makes to a replica is one of these.
#[derive(Clone, Copy, Debug)]
pub enum Action<'a> {
    SetRegs(Tid, &'a Regs),
    /// Writes bytes into the thread's memory.
    Write(Tid, u64, &'a [u8]),
    Resume(Tid, Resume),
    /// Stops a thread that runs or is blocked in a syscall (which returns ERESTART*).
    Interrupt(Tid),
    /// Replaces the siginfo of the signal the thread is stopped to receive.
    SetSiginfo(Tid, &'a libc::siginfo_t),
    /// Sends a signal to one thread: (thread group, thread, signal).
    Signal(Tid, Tid, i32),
    /// SIGKILLs a thread or process; it may already be gone.
    Kill(Tid),
    /// Arms or disarms the execution breakpoint of a stopped thread (see `catch_up.rs`).
    Breakpoint(Tid, Option<u64>),
    /// From now on, resume this thread (if any) one instruction at a time, except into a
    /// syscall exit (`Resume::ToExit`): its next stops are single-step SIGTRAPs.
    SingleStep(Option<Tid>),
}

impl Action<'_> {
    /// The thread the command is for (0 for `SingleStep(None)`).
    pub fn tid(&self) -> Tid {
        match *self {
            Action::SetRegs(t, _)
            | Action::Write(t, _, _)
            | Action::Resume(t, _)
            | Action::Interrupt(t)
            | Action::SetSiginfo(t, _)
            | Action::Signal(_, t, _)
            | Action::Kill(t)
            | Action::Breakpoint(t, _) => t,
            Action::SingleStep(t) => t.unwrap_or(0),
        }
    }
}

/// Mechanism for steering replica threads: queries, and [`Action`]s carried out.
pub trait Backend {
    /// Carries out one command.
    fn apply(&self, action: Action<'_>) -> io::Result<()>;
    fn regs(&self, tid: Tid) -> io::Result<Regs>;
    fn read(&self, tid: Tid, addr: u64, buf: &mut [u8]) -> io::Result<()>;
    /// The next stop of any replica thread; `None` when interrupted by lockstep's own
    /// signals (timer tick, forwarded signals).
    fn wait_any(&self) -> io::Result<Option<(Tid, Stop)>>;
    /// What the backend has cost so far, as counts (`--stats`, and the counter tests).
    fn counts(&self) -> MonitorCounts {
        MonitorCounts::default()
    }
    /// The next stop of one thread.
    fn wait_tid(&self, tid: Tid) -> io::Result<Stop>;
    /// A stop of one thread if it has one to report now.
    fn try_wait_tid(&self, tid: Tid) -> io::Result<Option<Stop>>;
    /// The next stop of one thread, or `None` when lockstep's own timer tick (or a
    /// forwarded signal) comes first.
    fn wait_tid_or_tick(&self, tid: Tid) -> io::Result<Option<Stop>> {
        self.try_wait_tid(tid)
    }
    /// The message of the event the thread is stopped at (a new thread's id, ...).
    fn event_msg(&self, tid: Tid) -> io::Result<u64>;
    /// The signal the thread is about to receive.
    fn siginfo(&self, tid: Tid) -> io::Result<libc::siginfo_t>;
    /// A NUL-terminated string of at most `limit` bytes (without the NUL).
    fn read_cstr(&self, tid: Tid, addr: u64, limit: usize) -> io::Result<Vec<u8>>;
    /// The text of `/proc/PID/FILE` (`status`, `stat`, `statm`, `fdinfo/3`, ...).
    fn proc_read(&self, pid: Tid, file: &str) -> io::Result<String>;
    /// Where `/proc/PID/FILE` links to (`fd/3`).
    fn proc_link(&self, pid: Tid, file: &str) -> io::Result<std::path::PathBuf>;
    /// The size of the file behind descriptor `fd` of process `pid`.
    fn fd_file_len(&self, pid: Tid, fd: i32) -> Option<u64>;
    /// Whether descriptor `fd` of process `pid` is a regular file (one with an offset
    /// that reads and writes move); false when it cannot be told.
    fn fd_is_regular_file(&self, _pid: Tid, _fd: i32) -> bool {
        false
    }
    /// Whether any process (including a zombie) has `pid` as its parent.
    fn has_children(&self, pid: Tid) -> bool;
    /// The CPU time (all threads) process `pid` has used so far; None once it is gone.
    fn process_cpu(&self, pid: Tid) -> Option<std::time::Duration>;
    /// The CPU time thread `tid` alone has used so far; None when it is gone or unknown.
    fn thread_cpu(&self, _tid: Tid) -> Option<std::time::Duration> {
        None
    }
    /// Pins thread `tid` to one CPU; a failure leaves its current placement.
    fn pin(&self, tid: Tid, cpu: usize);
    /// Reaps every child that is left after `Action::Kill`s, within a bounded time.
    fn reap_all(&self);

    // The commands by name, for readable call sites.
    fn set_regs(&self, tid: Tid, regs: &Regs) -> io::Result<()> {
        self.apply(Action::SetRegs(tid, regs))
    }
    fn write(&self, tid: Tid, addr: u64, data: &[u8]) -> io::Result<()> {
        self.apply(Action::Write(tid, addr, data))
    }
    fn resume(&self, tid: Tid, how: Resume) -> io::Result<()> {
        self.apply(Action::Resume(tid, how))
    }
    fn interrupt(&self, tid: Tid) -> io::Result<()> {
        self.apply(Action::Interrupt(tid))
    }
    fn set_siginfo(&self, tid: Tid, info: &libc::siginfo_t) -> io::Result<()> {
        self.apply(Action::SetSiginfo(tid, info))
    }
    fn signal_thread(&self, tgid: Tid, tid: Tid, sig: i32) -> io::Result<()> {
        self.apply(Action::Signal(tgid, tid, sig))
    }
    fn kill(&self, pid: Tid) {
        // Fire and forget: a process that is already gone needs no kill, and a live one's
        // death arrives through `wait_any`.
        let _ = self.apply(Action::Kill(pid));
    }
    fn set_breakpoint(&self, tid: Tid, at: Option<u64>) -> io::Result<()> {
        self.apply(Action::Breakpoint(tid, at))
    }
    fn single_step(&self, tid: Option<Tid>) {
        // It only marks the thread that later resumes single-step; no backend fails it.
        let _ = self.apply(Action::SingleStep(tid));
    }
    fn read_vec(&self, tid: Tid, addr: u64, len: usize) -> io::Result<Vec<u8>> {
        let mut v = vec![0u8; len];
        self.read(tid, addr, &mut v)?;
        Ok(v)
    }
}

/// Exact counts of what the monitor's thread spent: each is a context switch or a file
/// read that a request can cost, so a regression shows as a count, whatever the noise.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MonitorCounts {
    /// Stops of replica threads the monitor took (each `waitpid` that reported one).
    pub stops: u64,
    /// Files of /proc the monitor read or looked at.
    pub proc_reads: u64,
}

/// The ptrace backend.
#[derive(Default)]
pub struct Ptrace {
    /// The thread being single-stepped (a fault injection in progress), or 0.
    stepping: std::cell::Cell<Tid>,
    stops: std::cell::Cell<u64>,
    proc_reads: std::cell::Cell<u64>,
}

impl Ptrace {
    fn stopped<T>(&self, got: io::Result<T>, is_stop: impl Fn(&T) -> bool) -> io::Result<T> {
        if got.as_ref().is_ok_and(is_stop) {
            self.stops.set(self.stops.get() + 1);
        }
        got
    }

    fn proc(&self) {
        self.proc_reads.set(self.proc_reads.get() + 1);
    }
}

impl Backend for Ptrace {
    fn apply(&self, action: Action<'_>) -> io::Result<()> {
        match action {
            Action::SetRegs(tid, regs) => ptrace::set_regs(tid, regs),
            Action::Write(tid, addr, data) => mem::write(tid, addr, data),
            Action::Resume(tid, how) if tid == self.stepping.get() && how != Resume::ToExit => {
                let sig = if let Resume::Signal(sig) = how { sig } else { 0 };
                ptrace::step(tid, sig)
            }
            Action::Resume(tid, Resume::Run) => ptrace::cont(tid, 0),
            Action::Resume(tid, Resume::Signal(sig)) => ptrace::cont(tid, sig),
            Action::Resume(tid, Resume::ToExit) => ptrace::cont_syscall(tid, 0),
            Action::Interrupt(tid) => ptrace::interrupt(tid),
            Action::SetSiginfo(tid, info) => ptrace::set_siginfo(tid, info),
            Action::Signal(tgid, tid, sig) => ptrace::tgkill(tgid, tid, sig),
            Action::Kill(pid) => {
                ptrace::kill(pid, libc::SIGKILL);
                Ok(())
            }
            Action::Breakpoint(tid, at) => ptrace::set_breakpoint(tid, at),
            Action::SingleStep(tid) => {
                self.stepping.set(tid.unwrap_or(0));
                Ok(())
            }
        }
    }
    fn regs(&self, tid: Tid) -> io::Result<Regs> {
        ptrace::get_regs(tid)
    }
    fn read(&self, tid: Tid, addr: u64, buf: &mut [u8]) -> io::Result<()> {
        mem::read(tid, addr, buf)
    }
    fn wait_any(&self) -> io::Result<Option<(Tid, Stop)>> {
        self.stopped(ptrace::wait_any(), Option::is_some)
    }
    fn counts(&self) -> MonitorCounts {
        MonitorCounts {
            stops: self.stops.get(),
            proc_reads: self.proc_reads.get(),
        }
    }
    fn wait_tid(&self, tid: Tid) -> io::Result<Stop> {
        self.stopped(ptrace::wait_tid(tid), |_| true)
    }
    fn wait_tid_or_tick(&self, tid: Tid) -> io::Result<Option<Stop>> {
        self.stopped(ptrace::wait_tid_interruptible(tid), Option::is_some)
    }
    fn try_wait_tid(&self, tid: Tid) -> io::Result<Option<Stop>> {
        let mut status = 0;
        // SAFETY: non-blocking waitpid on one traced thread.
        let r = unsafe { libc::waitpid(tid, &mut status, libc::WNOHANG | libc::__WALL) };
        let got = match r {
            0 => Ok(None),
            r if r == tid => Ok(Some(ptrace::decode(status))),
            _ => Err(io::Error::last_os_error()),
        };
        self.stopped(got, Option::is_some)
    }
    fn event_msg(&self, tid: Tid) -> io::Result<u64> {
        ptrace::event_msg(tid)
    }
    fn siginfo(&self, tid: Tid) -> io::Result<libc::siginfo_t> {
        ptrace::siginfo(tid)
    }
    fn read_cstr(&self, tid: Tid, addr: u64, limit: usize) -> io::Result<Vec<u8>> {
        mem::read_cstr(tid, addr, limit)
    }
    fn proc_read(&self, pid: Tid, file: &str) -> io::Result<String> {
        self.proc();
        std::fs::read_to_string(format!("/proc/{pid}/{file}"))
    }
    fn proc_link(&self, pid: Tid, file: &str) -> io::Result<std::path::PathBuf> {
        self.proc();
        std::fs::read_link(format!("/proc/{pid}/{file}"))
    }
    fn fd_file_len(&self, pid: Tid, fd: i32) -> Option<u64> {
        self.proc();
        std::fs::metadata(format!("/proc/{pid}/fd/{fd}")).ok().map(|m| m.len())
    }
    fn fd_is_regular_file(&self, pid: Tid, fd: i32) -> bool {
        self.proc();
        std::fs::metadata(format!("/proc/{pid}/fd/{fd}")).is_ok_and(|m| m.is_file())
    }
    fn has_children(&self, pid: Tid) -> bool {
        self.proc();
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return true;
        };
        dir.flatten()
            .filter(|e| e.file_name().to_string_lossy().bytes().all(|b| b.is_ascii_digit()))
            .any(|e| {
                std::fs::read_to_string(e.path().join("stat"))
                    .ok()
                    .and_then(|st| {
                        st.rsplit_once(')')
                            .and_then(|(_, rest)| rest.split_whitespace().nth(1).map(str::to_string))
                    })
                    .and_then(|ppid| ppid.parse::<Tid>().ok())
                    == Some(pid)
            })
    }
    fn process_cpu(&self, pid: Tid) -> Option<std::time::Duration> {
        self.proc();
        lockstep_trace::cpu::process_cpu(pid)
    }
    fn thread_cpu(&self, tid: Tid) -> Option<std::time::Duration> {
        self.proc();
        lockstep_trace::cpu::thread_cpu(tid)
    }
    fn pin(&self, tid: Tid, cpu: usize) {
        // SAFETY: a zeroed set with one CPU; failure leaves the thread where it was.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set);
        }
    }
    fn reap_all(&self) {
        // Bounded so that a kernel surprise cannot hang us.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while std::time::Instant::now() < deadline {
            let mut status = 0;
            // SAFETY: plain waitpid.
            let r = unsafe { libc::waitpid(-1, &mut status, libc::__WALL) };
            if r < 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                break;
            }
        }
    }
}

/// A backend that remembers every failure to steer a replica thread, other than the
/// thread being gone (`ESRCH`: its death arrives through `wait_any`). The monitor takes
/// them after each stop and treats each as that replica's failure: a register write or a
/// resume that did not happen must never pass silently.
///
/// Reads and memory writes are not recorded: a corrupted replica's bad pointer makes them
/// fail, and the vote (or the count `data::apply_outputs` returns) judges that.
pub struct Checked {
    inner: Box<dyn Backend>,
    failures: std::cell::RefCell<Vec<(Tid, &'static str, io::Error)>>,
}

const SET_REGS: &str = "setting its registers";

/// Commands whose failure the caller leaves to the monitor, so that no call site drops a
/// `Result`: a failure to steer a thread (registers, resume, interrupt, signal, siginfo,
/// breakpoint) is recorded by [`Checked`] and fails its replica at the monitor's next
/// look; a memory write that fails (a corrupted replica's bad pointer) shows in what the
/// replica does next, which the vote judges. `ESRCH` (the thread is gone) arrives as its
/// death through `wait_any`.
pub struct Steer<'a>(&'a Checked);

impl Steer<'_> {
    pub fn set_regs(&self, tid: Tid, regs: &Regs) {
        let _recorded = self.0.set_regs(tid, regs);
    }
    pub fn resume(&self, tid: Tid, how: Resume) {
        let _recorded = self.0.resume(tid, how);
    }
    pub fn interrupt(&self, tid: Tid) {
        let _recorded = self.0.interrupt(tid);
    }
    pub fn set_siginfo(&self, tid: Tid, info: &libc::siginfo_t) {
        let _recorded = self.0.set_siginfo(tid, info);
    }
    pub fn signal_thread(&self, tgid: Tid, tid: Tid, sig: i32) {
        let _recorded = self.0.signal_thread(tgid, tid, sig);
    }
    pub fn set_breakpoint(&self, tid: Tid, at: Option<u64>) {
        let _recorded = self.0.set_breakpoint(tid, at);
    }
    pub fn write(&self, tid: Tid, addr: u64, data: &[u8]) {
        let _judged_by_the_vote = self.0.write(tid, addr, data);
    }
}

/// At most this many steering failures are kept between two looks: each names a thread,
/// and one is enough to fail its replica.
const MAX_FAILURES: usize = 64;

impl Checked {
    pub fn new(inner: Box<dyn Backend>) -> Self {
        Checked {
            inner,
            failures: std::cell::RefCell::new(Vec::new()),
        }
    }

    /// The commands whose failure the monitor handles by itself (see [`Steer`]).
    pub fn steer(&self) -> Steer<'_> {
        Steer(self)
    }

    /// The failures since the last call: (thread, what failed, why).
    pub fn take_failures(&self) -> Vec<(Tid, &'static str, io::Error)> {
        std::mem::take(&mut *self.failures.borrow_mut())
    }

    /// Whether steering `tid` failed since the last [`Checked::take_failures`].
    pub fn failed(&self, tid: Tid) -> bool {
        self.failures.borrow().iter().any(|(t, _, _)| *t == tid)
    }

    fn check<T>(&self, tid: Tid, what: &'static str, result: io::Result<T>) -> io::Result<T> {
        if let Err(e) = &result {
            let mut failures = self.failures.borrow_mut();
            if e.raw_os_error() != Some(libc::ESRCH) && failures.len() < MAX_FAILURES {
                failures.push((tid, what, io::Error::new(e.kind(), e.to_string())));
            }
        }
        result
    }
}

impl Backend for Checked {
    fn apply(&self, action: Action<'_>) -> io::Result<()> {
        let tid = action.tid();
        let what = match action {
            Action::SetRegs(..) => SET_REGS,
            Action::Resume(..) => {
                // A thread whose registers could not be set stays stopped: resumed, it
                // would run from a state nobody chose (an output a follower was to skip).
                if self
                    .failures
                    .borrow()
                    .iter()
                    .any(|(t, what, _)| *t == tid && *what == SET_REGS)
                {
                    return Err(io::Error::other("its registers could not be set"));
                }
                "resuming it"
            }
            Action::Interrupt(_) => "interrupting it",
            Action::SetSiginfo(..) => "setting its siginfo",
            Action::Breakpoint(..) => "setting its breakpoint",
            // Not steering failures: a bad pointer of a corrupted replica (judged by the
            // vote), a signal to a thread that is gone, a kill of a dead thread.
            Action::Write(..) | Action::Signal(..) | Action::Kill(_) | Action::SingleStep(_) => {
                return self.inner.apply(action)
            }
        };
        self.check(tid, what, self.inner.apply(action))
    }
    fn regs(&self, tid: Tid) -> io::Result<Regs> {
        self.inner.regs(tid)
    }
    fn read(&self, tid: Tid, addr: u64, buf: &mut [u8]) -> io::Result<()> {
        self.inner.read(tid, addr, buf)
    }
    fn wait_any(&self) -> io::Result<Option<(Tid, Stop)>> {
        self.inner.wait_any()
    }
    fn counts(&self) -> MonitorCounts {
        self.inner.counts()
    }
    fn wait_tid(&self, tid: Tid) -> io::Result<Stop> {
        self.inner.wait_tid(tid)
    }
    fn try_wait_tid(&self, tid: Tid) -> io::Result<Option<Stop>> {
        self.inner.try_wait_tid(tid)
    }
    fn wait_tid_or_tick(&self, tid: Tid) -> io::Result<Option<Stop>> {
        self.inner.wait_tid_or_tick(tid)
    }
    fn event_msg(&self, tid: Tid) -> io::Result<u64> {
        self.inner.event_msg(tid)
    }
    fn siginfo(&self, tid: Tid) -> io::Result<libc::siginfo_t> {
        self.inner.siginfo(tid)
    }
    fn read_cstr(&self, tid: Tid, addr: u64, limit: usize) -> io::Result<Vec<u8>> {
        self.inner.read_cstr(tid, addr, limit)
    }
    fn proc_read(&self, pid: Tid, file: &str) -> io::Result<String> {
        self.inner.proc_read(pid, file)
    }
    fn proc_link(&self, pid: Tid, file: &str) -> io::Result<std::path::PathBuf> {
        self.inner.proc_link(pid, file)
    }
    fn fd_file_len(&self, pid: Tid, fd: i32) -> Option<u64> {
        self.inner.fd_file_len(pid, fd)
    }
    fn fd_is_regular_file(&self, pid: Tid, fd: i32) -> bool {
        self.inner.fd_is_regular_file(pid, fd)
    }
    fn has_children(&self, pid: Tid) -> bool {
        self.inner.has_children(pid)
    }
    fn process_cpu(&self, pid: Tid) -> Option<std::time::Duration> {
        self.inner.process_cpu(pid)
    }
    fn thread_cpu(&self, tid: Tid) -> Option<std::time::Duration> {
        self.inner.thread_cpu(tid)
    }
    fn pin(&self, tid: Tid, cpu: usize) {
        self.inner.pin(tid, cpu)
    }
    fn reap_all(&self) {
        self.inner.reap_all()
    }
}

//! The traced process tree of a target at a time-based injection point: every thread and
//! child is traced (PTRACE_O_TRACECLONE/FORK/VFORK), so any of them can be the victim, and
//! their stops are passed on so the program runs as it would untraced.
//!
//! Each campaign worker thread traces its own targets, so waits use `__WNOTHREAD`: one
//! worker never reaps another worker's tracees.

use crate::fault::Rng;
use crate::target::{ending_of, Ending};
use lockstep_trace::syscall_counter::SyscallCounter;
use lockstep_trace::{ptrace, Stop, Tid};
use std::io;
use std::time::{Duration, Instant};

/// How long stray members of a finished target's process group are reaped for.
const REAP_GRACE: Duration = Duration::from_millis(500);

pub struct Tree {
    root: Tid,
    /// Ends of this worker's children outside the tree (server mode's client).
    pub foreign: Vec<(Tid, Ending)>,
    /// How the root ended, once it has.
    pub root_end: Option<Ending>,
    tasks: Vec<Tid>,
    /// Announced by a fork/clone event; their first (SIGSTOP) stop is not a real signal.
    unborn: Vec<Tid>,
    /// Processes of the tree (root and forked children) and the CPU time last seen for
    /// each; the last value is kept after a process ends so the total never shrinks.
    procs: Vec<(Tid, Duration)>,
    /// The tree's CPU time when the root exec'd the target: time-based points count from
    /// there, so that inject's own child (before its exec) is never the one faulted.
    exec_cpu: Option<Duration>,
    /// The root was detached after its fault (it was alone): no stops are left to pass on.
    detached: bool,
    /// Server mode, until the injection: the root thread's syscalls, counted as
    /// `--at syscall:K` counts them, so that a time-based point can be replayed there.
    root_syscalls: Option<RootSyscalls>,
}

/// How the root's syscalls are counted: by a perf counter where the kernel lets us (the
/// root runs on), else by a ptrace stop at each entry and exit.
enum RootSyscalls {
    /// Opened at the root's exec.
    Counter(Option<SyscallCounter>),
    Stops(SyscallCount),
}

/// Syscall entries of one thread since its exec (PTRACE_SYSCALL stops, entry and exit
/// alike, told apart by alternation; the exec's own exit stop follows its event).
#[derive(Clone, Copy, Debug, Default)]
struct SyscallCount {
    after_exec: bool,
    in_syscall: bool,
    entered: u64,
}

/// The outcome of stopping a victim.
pub enum Victim {
    Stopped(Tid),
    /// No thread matched the filter.
    None,
    /// The root ended first.
    Ended(Ending),
}

/// The next stop of any of this thread's tracees, without blocking. None: nothing yet
/// (or no tracee left).
pub fn poll() -> io::Result<Option<(Tid, Stop)>> {
    let mut status = 0;
    // SAFETY: non-blocking waitpid.
    let r = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG | libc::__WALL | libc::__WNOTHREAD) };
    if r > 0 {
        return Ok(Some((r, ptrace::decode(status))));
    }
    if r == 0 {
        return Ok(None);
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::ECHILD) | Some(libc::EINTR) => Ok(None),
        _ => Err(e),
    }
}

/// Called while a target runs towards its injection point with nothing else to do; false
/// when the point can no longer come (a server's client workload is over).
pub type OnIdle<'a> = &'a mut dyn FnMut() -> io::Result<bool>;

/// How a run towards an injection point ended.
pub enum Until {
    /// The point (or the deadline) came.
    Reached,
    /// The target ended first.
    Ended(Ending),
    /// `on_idle` gave up: the fault is not applied.
    GaveUp,
}

/// How long a worker sleeps when its tree has nothing to report.
const IDLE: Duration = Duration::from_micros(200);

/// The longest nap of a worker whose tree is quiet after its injection: how late, at
/// most, it notices the end of a run.
const QUIET_NAP_MAX: Duration = Duration::from_millis(1);

/// The longest sleep on the way to a far time-based point: how late, at most, `on_idle`
/// runs (server mode starts its client there once the port is open).
const FAR_NAP_MAX: Duration = Duration::from_millis(2);

/// The shortest sleep before a time-based point (shorter ones are dominated by the
/// wake-up itself).
const MIN_NAP: Duration = Duration::from_micros(20);

pub fn idle() {
    std::thread::sleep(IDLE);
}

impl Tree {
    pub fn new(root: Tid) -> Self {
        Tree {
            root,
            foreign: Vec::new(),
            root_end: None,
            tasks: vec![root],
            unborn: Vec::new(),
            procs: vec![(root, Duration::ZERO)],
            exec_cpu: None,
            detached: false,
            root_syscalls: None,
        }
    }

    /// The tree of a process that is past its exec already (a fork-server copy): its CPU
    /// time counts from now.
    pub fn past_exec(root: Tid) -> Self {
        let mut tree = Tree::new(root);
        tree.exec_cpu = Some(tree.cpu());
        tree
    }

    /// Counts the root thread's syscalls from its exec until [`Tree::root_syscalls_done`].
    pub fn count_root_syscalls(&mut self) {
        self.root_syscalls = Some(if SyscallCounter::available() {
            RootSyscalls::Counter(None)
        } else {
            RootSyscalls::Stops(SyscallCount::default())
        });
    }

    /// Whether the stopped `victim` is the whole tree (no thread or child has appeared),
    /// so that it can be detached once its fault is in; remembers the answer.
    pub fn detach_after_fault(&mut self, victim: Tid) -> bool {
        self.detached = victim == self.root
            && self.tasks == [self.root]
            && self.unborn.is_empty()
            && self.procs.len() == 1
            && self.root_syscalls.is_none();
        self.detached
    }

    pub fn detached(&self) -> bool {
        self.detached
    }

    /// Resumes the stopped root (to its next syscall stop while they are counted).
    pub fn resume_root(&self) -> io::Result<()> {
        self.resume(self.root, 0)
    }

    /// The root's syscall entries since its exec, and stops counting them.
    pub fn root_syscalls_done(&mut self) -> Option<u64> {
        match self.root_syscalls.take()? {
            RootSyscalls::Counter(counter) => counter?.read().ok(),
            RootSyscalls::Stops(count) => count.after_exec.then_some(count.entered),
        }
    }

    fn resume(&self, tid: Tid, sig: i32) -> io::Result<()> {
        if tid == self.root && matches!(self.root_syscalls, Some(RootSyscalls::Stops(_))) {
            ptrace::cont_syscall(tid, sig)
        } else {
            ptrace::cont(tid, sig)
        }
    }

    /// Passes one stop on. Some(ending) when it was the root's end.
    pub fn handle(&mut self, tid: Tid, stop: Stop) -> io::Result<Option<Ending>> {
        match stop {
            Stop::Exited(_) | Stop::Killed(_) => {
                if !self.tasks.contains(&tid) {
                    self.foreign.extend(ending_of(stop).map(|e| (tid, e)));
                }
                self.tasks.retain(|&t| t != tid);
                if tid == self.root {
                    self.root_end = ending_of(stop);
                    return Ok(self.root_end);
                }
            }
            Stop::Event(e)
                if e == libc::PTRACE_EVENT_FORK || e == libc::PTRACE_EVENT_VFORK || e == libc::PTRACE_EVENT_CLONE =>
            {
                if let Ok(new) = ptrace::event_msg(tid) {
                    let new = new as Tid;
                    if !self.tasks.contains(&new) {
                        self.tasks.push(new);
                        self.unborn.push(new);
                    }
                    if e != libc::PTRACE_EVENT_CLONE {
                        self.procs.push((new, Duration::ZERO));
                    }
                }
                // A task that cannot be resumed is gone: its exit arrives as a stop.
                let _ = self.resume(tid, 0);
            }
            Stop::Signal(libc::SIGSTOP) if self.unborn.contains(&tid) || !self.tasks.contains(&tid) => {
                // A new task's first stop (it may arrive before its parent's event).
                self.unborn.retain(|&t| t != tid);
                if !self.tasks.contains(&tid) {
                    self.tasks.push(tid);
                }
                // A task that cannot be resumed is gone: its exit arrives as a stop.
                let _ = self.resume(tid, 0);
            }
            Stop::Signal(sig) => {
                // A task that cannot be resumed is gone: its exit arrives as a stop.
                let _ = self.resume(tid, sig);
            }
            Stop::Event(libc::PTRACE_EVENT_EXEC) if tid == self.root && self.exec_cpu.is_none() => {
                self.exec_cpu = Some(self.cpu());
                let from_exec = SyscallCount {
                    after_exec: true,
                    in_syscall: true,
                    entered: 0,
                };
                match &mut self.root_syscalls {
                    // Stopped in the exec's return: the counter sees the syscalls after it.
                    Some(RootSyscalls::Counter(counter)) => match SyscallCounter::open(tid) {
                        Ok(opened) => *counter = Some(opened),
                        Err(_) => self.root_syscalls = Some(RootSyscalls::Stops(from_exec)),
                    },
                    Some(RootSyscalls::Stops(count)) => *count = from_exec,
                    None => {}
                }
                // A task that cannot be resumed is gone: its exit arrives as a stop.
                let _ = self.resume(tid, 0);
            }
            Stop::SyscallExit if tid == self.root => {
                if let Some(RootSyscalls::Stops(count)) = &mut self.root_syscalls {
                    count.in_syscall = !count.in_syscall;
                    if count.in_syscall && count.after_exec {
                        count.entered += 1;
                    }
                }
                // A task that cannot be resumed is gone: its exit arrives as a stop.
                let _ = self.resume(tid, 0);
            }
            _ => {
                // A task that cannot be resumed is gone: its exit arrives as a stop.
                let _ = self.resume(tid, 0);
            }
        }
        Ok(None)
    }

    /// The CPU time the tree has used so far (every process, ended ones included).
    pub fn cpu(&mut self) -> Duration {
        for (pid, seen) in &mut self.procs {
            if let Some(now) = lockstep_trace::cpu::process_cpu(*pid) {
                *seen = (*seen).max(now);
            }
        }
        self.procs.iter().map(|p| p.1).sum()
    }

    /// Passes stops on until the tree has used `cpu` of CPU time since its exec, or until
    /// `deadline`, calling `on_idle` whenever there is nothing to pass on.
    pub fn run_until_cpu(&mut self, cpu: Duration, deadline: Instant, on_idle: OnIdle) -> io::Result<Until> {
        loop {
            match poll()? {
                Some((tid, stop)) => {
                    if let Some(ending) = self.handle(tid, stop)? {
                        return Ok(Until::Ended(ending));
                    }
                }
                None if Instant::now() >= deadline => return Ok(Until::Reached),
                None => {
                    let left = self.exec_cpu.map(|base| (base + cpu).saturating_sub(self.cpu()));
                    if left == Some(Duration::ZERO) {
                        return Ok(Until::Reached);
                    }
                    if !on_idle()? {
                        return Ok(Until::GaveUp);
                    }
                    // The tree cannot use CPU time faster than wall time per CPU, so
                    // sleeping what is left, shared out over the CPUs, does not overshoot the
                    // point by more than a wake-up; far from the point the worker then
                    // wakes (and takes a CPU from the target) less often.
                    let nap = match left {
                        Some(left) if left < IDLE => left.max(MIN_NAP),
                        Some(left) => (left / crate::target::online_cpus()).clamp(IDLE, FAR_NAP_MAX),
                        None => IDLE,
                    };
                    std::thread::sleep(nap);
                }
            }
        }
    }

    /// Chooses a victim thread (weighted by the CPU time it has used, so that idle helper
    /// threads are rarely hit; the root when there is no generator, as in a replay) and
    /// stops it.
    pub fn stop_victim(
        &mut self,
        rng: Option<&mut Rng>,
        filter: Option<&str>,
        deadline: Instant,
    ) -> io::Result<Victim> {
        let candidates: Vec<(Tid, u64)> = self
            .tasks
            .iter()
            .copied()
            .filter(|t| !self.unborn.contains(t))
            .filter(|&t| filter.is_none_or(|f| process_name(t).as_deref() == Some(f)))
            .map(|t| (t, thread_cpu_ns(t) + 1))
            .collect();
        let victim = match rng {
            _ if candidates.is_empty() => return Ok(Victim::None),
            None => candidates.iter().find(|c| c.0 == self.root).unwrap_or(&candidates[0]).0,
            Some(rng) => {
                let total: u64 = candidates.iter().map(|c| c.1).sum();
                let mut at = rng.below(total);
                candidates
                    .iter()
                    .find(|c| {
                        let hit = at < c.1;
                        at = at.saturating_sub(c.1);
                        hit
                    })
                    .expect("weights sum to total")
                    .0
            }
        };
        // SAFETY: tkill of our own tracee.
        unsafe { libc::syscall(libc::SYS_tkill, victim, libc::SIGSTOP) };
        loop {
            match poll()? {
                Some((tid, Stop::Signal(libc::SIGSTOP))) if tid == victim => return Ok(Victim::Stopped(victim)),
                Some((tid, stop)) => {
                    let gone = tid == victim && matches!(stop, Stop::Exited(_) | Stop::Killed(_));
                    if let Some(ending) = self.handle(tid, stop)? {
                        return Ok(Victim::Ended(ending));
                    }
                    if gone {
                        return Ok(Victim::None);
                    }
                }
                None if Instant::now() >= deadline => return Ok(Victim::None),
                None => idle(),
            }
        }
    }

    /// Passes stops on until `pid`, a child of this worker outside the tree, ends (its
    /// ending), or until the deadline (None).
    /// The worker sleeps until `pid` exits (its pidfd) or a nap ends; the naps grow while
    /// the tree is quiet, as in [`Tree::finish`], so that a worker does not take the CPU
    /// from the server and its client every few hundred microseconds.
    pub fn wait_foreign(&mut self, pid: Tid, deadline: Instant) -> io::Result<Option<Ending>> {
        // None where the kernel has no pidfd_open: the wait then polls.
        let exit_fd = lockstep_trace::seccomp::pidfd_open(pid).ok();
        let mut nap = IDLE;
        loop {
            if let Some(&(_, ending)) = self.foreign.iter().find(|f| f.0 == pid) {
                return Ok(Some(ending));
            }
            match poll()? {
                Some((tid, stop)) => {
                    self.handle(tid, stop)?;
                    nap = IDLE;
                }
                None if Instant::now() >= deadline => return Ok(None),
                None => {
                    match &exit_fd {
                        Some(fd) => wait_readable(fd, nap),
                        None => std::thread::sleep(nap),
                    }
                    nap = (nap * 2).min(QUIET_NAP_MAX);
                }
            }
        }
    }

    /// After the injection: passes stops on until the root ends (then the rest of its
    /// process group is killed and reaped), or kills the group at the deadline or once
    /// the tree has used more than `cpu_limit`.
    pub fn finish(
        &mut self,
        deadline: Instant,
        cpu_limit: Option<Duration>,
        scratch: &std::path::Path,
    ) -> io::Result<Ending> {
        let root = self.root;
        // Nothing is due at a precise moment any more: the naps grow while the tree is
        // quiet (each wake-up of a worker takes the CPU from a target), and shrink again
        // when it stops.
        let mut nap = IDLE;
        let ending = loop {
            if let Some(ending) = self.root_end {
                break ending;
            }
            match poll()? {
                Some((tid, stop)) => {
                    self.handle(tid, stop)?;
                    nap = IDLE;
                }
                None if Instant::now() >= deadline || cpu_limit.is_some_and(|l| self.cpu() > l) => {
                    crate::hang::record(root, scratch);
                    kill_and_reap_all(root);
                    return Ok(Ending::TimedOut);
                }
                None => {
                    std::thread::sleep(nap);
                    nap = (nap * 2).min(QUIET_NAP_MAX);
                }
            }
        };
        kill_and_reap_all(root);
        Ok(ending)
    }
}

/// Kills the target's process group and reaps it, for at most [`REAP_GRACE`], then
/// reaps whatever else of this worker's has already ended (a task that left the group is
/// not waited for). Children outside the group (the fork server's stopped snapshots) are
/// left alone. Never blocks on one pid: a traced group leader is only reported after its
/// threads.
pub fn kill_and_reap_all(root: Tid) {
    // SAFETY: SIGKILL to the target's own process group.
    unsafe {
        libc::kill(-root, libc::SIGKILL);
    }
    let reap = |pid: Tid| {
        // SAFETY: non-blocking waitpid for this thread's children.
        unsafe {
            libc::waitpid(
                pid,
                std::ptr::null_mut(),
                libc::WNOHANG | libc::__WALL | libc::__WNOTHREAD,
            )
        }
    };
    let until = Instant::now() + REAP_GRACE;
    loop {
        let r = reap(-root);
        if r < 0 || (r == 0 && Instant::now() >= until) {
            break; // ECHILD: nothing of the group left
        }
        if r == 0 {
            idle();
        }
    }
    while reap(-1) > 0 {}
}

/// Sleeps until `fd` is readable or `timeout` has passed.
pub(crate) fn wait_readable(fd: &std::os::fd::OwnedFd, timeout: Duration) {
    let mut pfd = libc::pollfd {
        fd: std::os::fd::AsRawFd::as_raw_fd(fd),
        events: libc::POLLIN,
        revents: 0,
    };
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: ppoll on one pollfd we own, with a timeout and no signal mask.
    unsafe { libc::ppoll(&mut pfd, 1, &ts, std::ptr::null()) };
}

/// The CPU time a thread has used, in nanoseconds: the scheduler's own count
/// (`/proc/TID/schedstat`), precise where the clock ticks of `stat` (10 ms) would give a
/// server's main thread and its idle helpers the same one or two ticks.
fn thread_cpu_ns(tid: Tid) -> u64 {
    if let Some(ns) = std::fs::read_to_string(format!("/proc/{tid}/schedstat"))
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
    {
        return ns;
    }
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{tid}/stat")) else {
        return 0;
    };
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return 0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    // Fields 14 and 15 of stat(5) (utime, stime, in USER_HZ ticks); `rest` starts at field 3.
    let field = |i: usize| f.get(i - 3).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    (field(14) + field(15)) * 10_000_000
}

/// The name (comm) of the process a thread belongs to.
pub fn process_name(tid: Tid) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{tid}/status")).ok()?;
    let tgid = status.lines().find_map(|l| l.strip_prefix("Tgid:"))?.trim().to_string();
    Some(
        std::fs::read_to_string(format!("/proc/{tgid}/comm"))
            .ok()?
            .trim()
            .to_string(),
    )
}

//! Running one target process: natively (golden runs) or traced up to an injection point,
//! injected, then let go and watched until it exits or hangs.

use crate::fault::{self, Applied, Model, Rng, Scope, Width};
use crate::step::{Progress, StepFault};
use crate::tree::{OnIdle, Tree, Until, Victim};
use lockstep_trace::{ptrace, Stop, Tid};
use serde::{Deserialize, Serialize};
use std::ffi::CString;
use std::io;
use std::path::Path;
use std::time::{Duration, Instant};

/// Targets currently running (their process-group ids), so an interrupted campaign can
/// kill them all at once.
static RUNNING: std::sync::Mutex<Vec<Tid>> = std::sync::Mutex::new(Vec::new());

pub(crate) fn register_running(pid: Tid) {
    RUNNING.lock().unwrap_or_else(|e| e.into_inner()).push(pid);
}

pub(crate) fn forget_running(pids: impl Iterator<Item = Tid>) {
    let pids: Vec<Tid> = pids.collect();
    RUNNING
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .retain(|p| !pids.contains(p));
}

/// SIGKILLs the process group of every running target.
pub fn kill_running_targets() {
    for &pid in RUNNING.lock().unwrap_or_else(|e| e.into_inner()).iter() {
        // SAFETY: plain kill of a process group we created.
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
            libc::kill(pid, libc::SIGKILL);
        }
    }
}

/// When the fault is injected.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Point {
    /// Once the target has used `at_us` microseconds of CPU time (all its processes; a
    /// replica's own in `--replica` mode). Time-based because no performance counters exist
    /// here, so only as precise as the polling (about 0.2 ms); see docs/inject.md.
    Time { at_us: u64 },
    /// After the k-th syscall of the main thread has returned (1-based, counted from the
    /// program's execve), then `steps` single-steps further. Exactly reproducible.
    Syscall { k: u64, steps: u64 },
}

impl std::str::FromStr for Point {
    type Err = String;
    /// `syscall:K` or `syscall:K+steps:D`.
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("bad --at '{s}' (expected syscall:K or syscall:K+steps:D)");
        let rest = s.strip_prefix("syscall:").ok_or_else(bad)?;
        let (k, steps) = match rest.split_once("+steps:") {
            Some((k, d)) => (k, d.parse().map_err(|_| bad())?),
            None => (rest, 0),
        };
        let k: u64 = k.parse().map_err(|_| bad())?;
        if k == 0 {
            return Err(bad());
        }
        Ok(Point::Syscall { k, steps })
    }
}

/// How a run ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Ending {
    Exited(i32),
    Signaled(i32),
    TimedOut,
    /// Server mode: the server exited by itself (not because it was told to stop).
    ServerExited(i32),
}

/// What one run did.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub ending: Ending,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub wall: Duration,
    /// The fault, if it was applied (None: the process ended first, or no fault planned).
    pub applied: Option<Applied>,
    /// Server mode: how long the server took to open its port.
    pub startup: Option<Duration>,
    /// The compared files' contents (filled in by the campaign).
    pub files: Vec<Option<Vec<u8>>>,
    /// CPU time the target used (measured in fault-free runs; server mode: while the
    /// client ran), the range time-based injection points are drawn from.
    pub cpu: Duration,
    /// `--replica`: detection events (divergence, timeout, halt) the run monitor emitted.
    pub lockstep_detections: u64,
    /// Server mode: how the client ended (`ending` is the run's, where the server's fate
    /// comes first).
    pub client_ending: Option<Ending>,
    /// The run started as a fork-server copy that had done this much of the program's CPU
    /// time (see [`crate::fork_server`]).
    pub from_snapshot: Option<Duration>,
}

/// What to inject, if anything.
#[derive(Clone, Debug)]
pub enum Plan {
    None,
    Fresh {
        model: Model,
        width: Width,
        scope: Scope,
        point: Point,
        rng: Rng,
    },
    Replay {
        point: Point,
        applied: Applied,
    },
}

fn cstrings(argv: &[String]) -> io::Result<Vec<CString>> {
    argv.iter()
        .map(|a| CString::new(a.as_str()).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in argument")))
        .collect()
}

/// Runs `argv` once with stdout/stderr captured in files under `scratch`.
pub fn run(argv: &[String], plan: &Plan, limits: impl Into<Limits>, scratch: &Path) -> io::Result<Outcome> {
    run_with_env(argv, plan, limits, scratch, &[])
}

/// When a run counts as hung.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Wall time from the start.
    pub wall: Duration,
    /// CPU time of the target's processes (not in server or replica mode): a CPU-bound
    /// hang is caught as soon as it has burnt this much, rather than at the wall deadline.
    pub cpu: Option<Duration>,
}

impl From<Duration> for Limits {
    fn from(wall: Duration) -> Limits {
        Limits { wall, cpu: None }
    }
}

/// Like [`run`], with extra environment variables for the target.
pub fn run_with_env(
    argv: &[String],
    plan: &Plan,
    limits: impl Into<Limits>,
    scratch: &Path,
    env: &[(String, String)],
) -> io::Result<Outcome> {
    // Traced even without a plan: a golden run is followed to its exec, where its CPU
    // time starts to count (see `detach_after_exec`).
    let child = Child::spawn(argv, true, scratch, "", env)?;
    let result = supervise(&child, plan, limits.into(), None);
    child.forget();
    result
}

/// Like [`run`] for a fresh time-based plan, started from the worker's fork server when
/// one of its snapshots comes before the point (see [`crate::fork_server`]).
pub fn run_from_fork_server(
    server: &mut crate::fork_server::ForkServer,
    argv: &[String],
    plan: &Plan,
    limits: Limits,
    scratch: &Path,
) -> io::Result<Outcome> {
    let Plan::Fresh {
        point: Point::Time { at_us },
        ..
    } = plan
    else {
        return run(argv, plan, limits, scratch);
    };
    let Some((child, done)) = server.start(Duration::from_micros(*at_us), scratch)? else {
        return run(argv, plan, limits, scratch);
    };
    let limits = Limits {
        wall: limits.wall,
        cpu: limits.cpu.map(|cpu| cpu.saturating_sub(done)),
    };
    let result = supervise(&child, plan, limits, Some(done));
    child.forget();
    result
}

/// Makes the calling worker thread preempt its targets as soon as it wakes up: a worker
/// that checks a time-based point every few hundred microseconds must get the CPU then,
/// not after the target's time slice, or a program of a few milliseconds ends before its
/// point is seen. The lowest real-time priority, reset for every child it forks (the
/// targets run as normal processes). Without the privilege, nothing changes.
pub fn prefer_worker_thread() {
    let param = libc::sched_param { sched_priority: 1 };
    // SAFETY: plain sched_setscheduler on the calling thread.
    unsafe {
        libc::sched_setscheduler(0, libc::SCHED_FIFO | libc::SCHED_RESET_ON_FORK, &param);
    }
}

/// A target process, started in its own process group with its stdout and stderr in
/// files, and registered so that Ctrl-C can kill it.
pub(crate) struct Child {
    pub pid: Tid,
    pub started: Instant,
    pub out_path: std::path::PathBuf,
    pub err_path: std::path::PathBuf,
}

impl Child {
    /// The run's workspace, where its output files are.
    fn workspace(&self) -> &Path {
        self.out_path.parent().unwrap_or(Path::new("."))
    }

    /// Forks and execs `argv`; a traced child stops itself before the exec. `name`
    /// prefixes the output files' names.
    pub fn spawn(
        argv: &[String],
        traced: bool,
        scratch: &Path,
        name: &str,
        env: &[(String, String)],
    ) -> io::Result<Child> {
        std::fs::create_dir_all(scratch)?;
        let out_path = scratch.join(format!("{name}stdout"));
        let err_path = scratch.join(format!("{name}stderr"));
        let out = std::fs::File::create(&out_path)?;
        let err = std::fs::File::create(&err_path)?;
        let args = cstrings(argv)?;
        let mut ptrs: Vec<*const libc::c_char> = args.iter().map(|a| a.as_ptr()).collect();
        ptrs.push(std::ptr::null());
        // The environment is built before fork: the child must not allocate.
        let vars: Vec<CString> = std::env::vars()
            .filter(|(k, _)| !env.iter().any(|(e, _)| e == k))
            .chain(env.iter().cloned())
            .filter_map(|(k, v)| CString::new(format!("{k}={v}")).ok())
            .collect();
        let mut envp: Vec<*const libc::c_char> = vars.iter().map(|v| v.as_ptr()).collect();
        envp.push(std::ptr::null());
        let started = Instant::now();
        // SAFETY: fork; the child only calls async-signal-safe functions before exec.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            return Err(io::Error::last_os_error());
        }
        if pid == 0 {
            use std::os::fd::AsRawFd;
            // SAFETY: child side; never returns.
            unsafe {
                libc::setpgid(0, 0);
                libc::dup2(out.as_raw_fd(), 1);
                libc::dup2(err.as_raw_fd(), 2);
                let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY);
                libc::dup2(null, 0);
                // Nothing else of inject's (or of whoever started it) reaches the target.
                libc::syscall(libc::SYS_close_range, 3, u32::MAX, 0);
                if traced {
                    libc::ptrace(libc::PTRACE_TRACEME, 0, 0, 0);
                    libc::raise(libc::SIGSTOP);
                }
                libc::execvpe(ptrs[0], ptrs.as_ptr(), envp.as_ptr());
                libc::_exit(127);
            }
        }
        register_running(pid);
        Ok(Child {
            pid,
            started,
            out_path,
            err_path,
        })
    }

    /// Removes the child from the Ctrl-C registry once it has been reaped.
    pub fn forget(&self) {
        forget_running(std::iter::once(self.pid));
    }

    pub fn outputs(&self) -> (Vec<u8>, Vec<u8>) {
        (
            std::fs::read(&self.out_path).unwrap_or_default(),
            std::fs::read(&self.err_path).unwrap_or_default(),
        )
    }
}

/// Follows a spawned child (or, `from` Some, a fork-server copy that has done that much
/// of the program's CPU time) to its end, injecting per `plan`.
fn supervise(child: &Child, plan: &Plan, limits: Limits, from: Option<Duration>) -> io::Result<Outcome> {
    let pid = child.pid;
    let mut tree = match from {
        Some(_) => Tree::past_exec(pid),
        None => Tree::new(pid),
    };
    let deadline = child.started + limits.wall;
    let mut exec_cpu = Duration::ZERO;
    let (applied, ended) = match plan {
        Plan::None => match detach_after_exec(pid)? {
            Ok(at_exec) => {
                exec_cpu = at_exec;
                (None, None)
            }
            Err(ending) => (None, Some(ending)),
        },
        _ => {
            let driven = match from {
                Some(done) => drive_stopped(pid, plan, deadline, &mut tree, &mut || Ok(true), done)?,
                None => drive_to_injection(pid, plan, deadline, &mut tree, &mut || Ok(true))?,
            };
            match driven {
                Driven::Injected(a) => (Some(a), None),
                Driven::NotApplied => (None, None),
                Driven::Ended(e) => (None, Some(e)),
            }
        }
    };
    let mut cpu = Duration::ZERO;
    let ending = match ended {
        Some(e) => e,
        None if traced_tree(plan) && !tree.detached() => tree.finish(deadline, limits.cpu, child.workspace())?,
        None => {
            let (ending, used) = wait_until(pid, deadline, limits.cpu, child.workspace())?;
            cpu = used.saturating_sub(exec_cpu);
            ending
        }
    };
    if !matches!(plan, Plan::None) {
        // A traced target that ended early, timed out while stepped, or left children.
        crate::tree::kill_and_reap_all(pid);
    }
    let (stdout, stderr) = child.outputs();
    Ok(Outcome {
        ending,
        stdout,
        stderr,
        wall: child.started.elapsed(),
        applied,
        startup: None,
        files: Vec::new(),
        cpu,
        lockstep_detections: 0,
        client_ending: None,
        from_snapshot: from,
    })
}

/// Takes a traced child that stopped itself before its exec through the exec, reads its
/// CPU time there and lets it go untraced. A golden run's CPU time then counts from the
/// same moment as an injection run's time-based point: what the forked child spends
/// before (its copy of inject's address space, torn down by the exec) is not the
/// program's. Err(ending): it ended before its exec (command not found).
pub(crate) fn detach_after_exec(pid: Tid) -> io::Result<Result<Duration, Ending>> {
    if let Err(ending) = await_pre_exec_stop(pid)? {
        return Ok(Err(ending));
    }
    // SAFETY: plain ptrace on our stopped child.
    unsafe {
        libc::ptrace(libc::PTRACE_SETOPTIONS, pid, 0, libc::PTRACE_O_TRACEEXEC);
    }
    ptrace::cont(pid, 0)?;
    loop {
        match ptrace::wait_tid(pid)? {
            Stop::Event(libc::PTRACE_EVENT_EXEC) => break,
            stop @ (Stop::Exited(_) | Stop::Killed(_)) => return Ok(Err(ended(stop))),
            Stop::Signal(sig) => ptrace::cont(pid, sig)?,
            _ => ptrace::cont(pid, 0)?,
        }
    }
    let at_exec = lockstep_trace::cpu::process_cpu(pid).unwrap_or_default();
    ptrace::detach_with(pid, 0)?;
    Ok(Ok(at_exec))
}

/// Waits for the stop a traced child makes itself before its exec (`Child::spawn`);
/// Err(ending) if it ended instead.
fn await_pre_exec_stop(pid: Tid) -> io::Result<Result<(), Ending>> {
    Ok(match ptrace::wait_tid(pid)? {
        Stop::Signal(libc::SIGSTOP) => Ok(()),
        other => Err(ending_of(other).unwrap_or(Ending::Exited(127))),
    })
}

/// The ending of a process whose stop says it exited or was killed.
fn ended(stop: Stop) -> Ending {
    ending_of(stop).expect("an exit or a kill is an ending")
}

/// Time-based points trace the whole process tree (any thread or child can be the
/// victim); syscall points follow the main thread only.
pub(crate) fn traced_tree(plan: &Plan) -> bool {
    matches!(
        plan,
        Plan::Fresh {
            point: Point::Time { .. },
            ..
        } | Plan::Replay {
            point: Point::Time { .. },
            ..
        }
    )
}

/// Where driving a traced child ended.
pub(crate) enum Driven {
    Injected(Applied),
    /// The injection point was reached but the fault found nothing to corrupt.
    NotApplied,
    /// The process ended (and was reaped) before the injection point.
    Ended(Ending),
}

pub(crate) fn ending_of(stop: Stop) -> Option<Ending> {
    match stop {
        Stop::Exited(c) => Some(Ending::Exited(c)),
        Stop::Killed(s) => Some(Ending::Signaled(s)),
        _ => None,
    }
}

/// Takes the stopped child to its injection point and applies the fault. A syscall point
/// follows the main thread and detaches afterwards; a time point traces the whole tree,
/// chooses the victim thread there, and keeps passing on the tree's stops (see [`Tree`]).
/// At a time point, `on_idle` runs while the target runs towards the point (server mode
/// starts its client there once the port is open).
pub(crate) fn drive_to_injection(
    pid: Tid,
    plan: &Plan,
    deadline: Instant,
    t: &mut Tree,
    on_idle: OnIdle,
) -> io::Result<Driven> {
    if let Err(ending) = await_pre_exec_stop(pid)? {
        return Ok(Driven::Ended(ending));
    }
    let tree = traced_tree(plan);
    let mut options = libc::PTRACE_O_TRACESYSGOOD | libc::PTRACE_O_TRACEEXEC | libc::PTRACE_O_EXITKILL;
    if tree {
        options |= libc::PTRACE_O_TRACECLONE | libc::PTRACE_O_TRACEFORK | libc::PTRACE_O_TRACEVFORK;
    }
    // SAFETY: plain ptrace on our stopped child.
    unsafe {
        libc::ptrace(libc::PTRACE_SETOPTIONS, pid, 0, options);
    }
    drive_stopped(pid, plan, deadline, t, on_idle, Duration::ZERO)
}

/// [`drive_to_injection`] from a stopped, traced process with its options set: a fresh
/// child at its pre-exec stop, or a fork-server copy that has already run `done` of the
/// program's CPU time (a time point then comes that much sooner).
pub(crate) fn drive_stopped(
    pid: Tid,
    plan: &Plan,
    deadline: Instant,
    t: &mut Tree,
    on_idle: OnIdle,
    done: Duration,
) -> io::Result<Driven> {
    let tree = traced_tree(plan);
    let (point, scope) = match plan {
        Plan::Fresh { point, scope, .. } => (*point, Some(scope)),
        Plan::Replay { point, .. } => (*point, None),
        Plan::None => unreachable!("traced only with a plan"),
    };
    let victim = match point {
        Point::Syscall { k, steps } => match run_to_syscall(pid, k, steps, deadline, on_idle)? {
            Until::Reached => pid,
            Until::Ended(ending) => return Ok(Driven::Ended(ending)),
            Until::GaveUp => return Ok(Driven::NotApplied),
        },
        Point::Time { at_us } => {
            t.resume_root()?;
            match t.run_until_cpu(Duration::from_micros(at_us).saturating_sub(done), deadline, on_idle)? {
                Until::Reached => {}
                Until::Ended(ending) => return Ok(Driven::Ended(ending)),
                Until::GaveUp => return Ok(Driven::NotApplied),
            }
            let mut rng = match plan {
                Plan::Fresh { rng, .. } => Some(Rng::new(rng.clone().next_u64() ^ 0x7468_7264)),
                _ => None,
            };
            let filter = scope.and_then(|s| s.pid_filter.as_deref());
            match t.stop_victim(rng.as_mut(), filter, deadline)? {
                Victim::Stopped(tid) => tid,
                Victim::None => return Ok(Driven::NotApplied),
                Victim::Ended(ending) => return Ok(Driven::Ended(ending)),
            }
        }
    };
    // A lone process (no thread or child so far) is detached once its fault is in: nothing
    // is left to pass on, and the wait for its end then needs no wake-ups (see
    // `wait_until`). A tree stays traced: any later stop must be passed on.
    let tree = tree && !t.detach_after_fault(victim);
    let applied = match plan {
        Plan::Fresh { model, .. }
        | Plan::Replay {
            applied: Applied { model, .. },
            ..
        } if model.needs_steps() => {
            let stepper = match plan {
                Plan::Fresh { model, width, rng, .. } => StepFault::fresh(*model, *width, rng.clone()),
                Plan::Replay { applied, .. } => StepFault::replay(applied.clone()),
                Plan::None => unreachable!(),
            };
            match step_until_applied(victim, stepper, deadline, tree)? {
                Stepped::Applied(a) => a,
                Stepped::Released(a) => return Ok(Driven::Injected(a)),
                Stepped::GaveUp => {
                    release(victim, tree, 0)?;
                    return Ok(Driven::NotApplied);
                }
                Stepped::Ended(e) => return Ok(Driven::Ended(e)),
            }
        }
        Plan::Fresh {
            model,
            width,
            scope,
            rng,
            ..
        } => {
            let mut rng = rng.clone();
            fault::apply(victim, victim, *model, *width, scope, &mut rng)?
        }
        Plan::Replay { applied, .. } => {
            fault::reapply(victim, applied)?;
            applied.clone()
        }
        Plan::None => unreachable!(),
    };
    let root_syscalls = t.root_syscalls_done();
    let applied = Applied {
        process: crate::tree::process_name(victim),
        syscalls: root_syscalls.filter(|_| victim == pid && matches!(point, Point::Time { .. })),
        ..applied
    };
    release(victim, tree, 0)?;
    Ok(Driven::Injected(applied))
}

/// Lets the victim go after the injection: a lone traced process is detached; a traced
/// tree stays traced (its stops are passed on until it ends).
fn release(victim: Tid, tree: bool, sig: i32) -> io::Result<()> {
    if tree {
        ptrace::cont(victim, sig)
    } else {
        ptrace::detach_with(victim, sig)
    }
}

/// Steps syscall by syscall until the k-th syscall after exec has returned, then `steps`
/// instructions further. A server's main thread that does not get there while its client
/// runs (`on_idle` gives up) is left running, its syscall stops passed on by the tree.
fn run_to_syscall(pid: Tid, k: u64, steps: u64, deadline: Instant, on_idle: OnIdle) -> io::Result<Until> {
    let mut after_exec = false;
    let mut entries = 0u64;
    let mut in_syscall = false;
    ptrace::cont_syscall(pid, 0)?;
    loop {
        let stop = match wait_tid_or_idle(pid, deadline, on_idle)? {
            Waited::Stop(stop) => stop,
            Waited::Deadline => return Ok(Until::Ended(Ending::TimedOut)),
            Waited::GaveUp => return Ok(Until::GaveUp),
        };
        match stop {
            stop @ (Stop::Exited(_) | Stop::Killed(_)) => return Ok(Until::Ended(ended(stop))),
            Stop::Event(libc::PTRACE_EVENT_EXEC) => {
                after_exec = true;
                in_syscall = true; // the execve's own exit stop follows
                entries = 0;
            }
            Stop::SyscallExit => {
                if in_syscall {
                    in_syscall = false;
                    if after_exec && entries == k {
                        break;
                    }
                } else {
                    in_syscall = true;
                    if after_exec {
                        entries += 1;
                    }
                }
            }
            Stop::Signal(sig) => {
                ptrace::cont_syscall(pid, sig)?;
                continue;
            }
            _ => {}
        }
        ptrace::cont_syscall(pid, 0)?;
    }
    for _ in 0..steps {
        ptrace::step(pid, 0)?;
        if let stop @ (Stop::Exited(_) | Stop::Killed(_)) = ptrace::wait_tid(pid)? {
            return Ok(Until::Ended(ended(stop)));
        }
    }
    Ok(Until::Reached)
}

enum Waited {
    Stop(Stop),
    Deadline,
    GaveUp,
}

/// The next stop of `pid`, calling `on_idle` while it has none to report. Most stops are
/// already there (a syscall stop comes back within microseconds), so a run that needs no
/// `on_idle` work rarely sleeps.
fn wait_tid_or_idle(pid: Tid, deadline: Instant, on_idle: OnIdle) -> io::Result<Waited> {
    let mut spins = 0u32;
    loop {
        if let Some(stop) = try_stop(pid)? {
            return Ok(Waited::Stop(stop));
        }
        if Instant::now() >= deadline {
            return Ok(Waited::Deadline);
        }
        spins += 1;
        if spins < 64 {
            std::thread::yield_now();
        } else if !on_idle()? {
            return Ok(Waited::GaveUp);
        } else {
            crate::tree::idle();
        }
    }
}

enum Stepped {
    Applied(Applied),
    /// Applied, and the victim already released.
    Released(Applied),
    GaveUp,
    Ended(Ending),
}

/// Single-steps `pid` until the step fault is in place. Signals that arrive meanwhile are
/// delivered with the next step.
fn step_until_applied(pid: Tid, mut stepper: StepFault, deadline: Instant, tree: bool) -> io::Result<Stepped> {
    let mut signal = 0;
    loop {
        match stepper.on_stop(pid)? {
            Progress::Done(applied) => return Ok(Stepped::Applied(applied)),
            Progress::GaveUp => return Ok(Stepped::GaveUp),
            Progress::Step => {}
        }
        loop {
            ptrace::step(pid, std::mem::take(&mut signal))?;
            match wait_stop_until(pid, deadline)? {
                None => return Ok(Stepped::Ended(Ending::TimedOut)),
                Some(stop @ (Stop::Exited(_) | Stop::Killed(_))) => {
                    return Ok(Stepped::Ended(ending_of(stop).expect("end")))
                }
                Some(Stop::Signal(libc::SIGTRAP)) => break,
                Some(Stop::Signal(sig)) => {
                    if let Some(applied) = stepper.on_signal(pid)? {
                        // The armed instruction raised `sig`: let it go, delivering it.
                        release(pid, tree, sig)?;
                        return Ok(Stepped::Released(applied));
                    }
                    signal = sig; // delivered with the next step
                }
                Some(_) => {}
            }
        }
    }
}

/// The stop `pid` (a tracee of this thread) has to report, without waiting: None when
/// it has none yet.
pub(crate) fn try_stop(pid: Tid) -> io::Result<Option<Stop>> {
    let mut status = 0;
    // SAFETY: non-blocking waitpid on our traced child.
    let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG | libc::__WALL) };
    if r == pid {
        return Ok(Some(ptrace::decode(status)));
    }
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
    Ok(None)
}

/// The next stop of `pid`, or None once `deadline` passed.
fn wait_stop_until(pid: Tid, deadline: Instant) -> io::Result<Option<Stop>> {
    let mut spins = 0u32;
    loop {
        if let Some(stop) = try_stop(pid)? {
            return Ok(Some(stop));
        }
        if Instant::now() >= deadline {
            return Ok(None); // the caller kills and reaps the whole target
        }
        // A single-step stop arrives within microseconds: spin briefly before sleeping.
        spins += 1;
        if spins < 100 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

/// SIGKILLs a target that overran its deadline (its whole process group) and reaps it.
fn kill_and_reap(pid: Tid) {
    let mut status = 0;
    // SAFETY: kill our own child's process group, then reap the child.
    unsafe {
        libc::kill(-pid, libc::SIGKILL);
        libc::kill(pid, libc::SIGKILL);
        libc::waitpid(pid, &mut status, libc::__WALL);
    }
}

/// Waits for the (untraced) child to end, killing its process group at the deadline.
/// Returns how it ended and the CPU time it and its waited-for children used.
fn wait_until(
    pid: Tid,
    deadline: Instant,
    cpu_limit: Option<Duration>,
    scratch: &Path,
) -> io::Result<(Ending, Duration)> {
    let exit_fd = lockstep_trace::seccomp::pidfd_open(pid).ok();
    loop {
        let mut status = 0;
        // SAFETY: zeroed rusage is a valid out-parameter.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: non-blocking wait4 on our child.
        let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
        let cpu = || {
            let t = |tv: libc::timeval| Duration::new(tv.tv_sec as u64, tv.tv_usec as u32 * 1000);
            t(usage.ru_utime) + t(usage.ru_stime)
        };
        if r == pid {
            if libc::WIFEXITED(status) {
                return Ok((Ending::Exited(libc::WEXITSTATUS(status)), cpu()));
            }
            if libc::WIFSIGNALED(status) {
                return Ok((Ending::Signaled(libc::WTERMSIG(status)), cpu()));
            }
            continue;
        }
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        let now = Instant::now();
        let cpu_left = match cpu_limit {
            Some(limit) => {
                let used = lockstep_trace::cpu::process_cpu(pid).unwrap_or_default();
                Some(limit.saturating_sub(used))
            }
            None => None,
        };
        if now >= deadline || cpu_left == Some(Duration::ZERO) {
            crate::hang::record(pid, scratch);
            kill_and_reap(pid);
            return Ok((Ending::TimedOut, Duration::ZERO));
        }
        // The process cannot burn CPU time faster than wall time per CPU, so a nap of what
        // is left, shared out over the CPUs, does not pass the limit by more than a nap.
        let cpu_nap = cpu_left.map_or(WAIT_NAP_MAX, |left| left / online_cpus());
        let nap = cpu_nap.min(deadline - now).clamp(WAIT_NAP_MIN, WAIT_NAP_MAX);
        match &exit_fd {
            Some(fd) => crate::tree::wait_readable(fd, nap),
            None => std::thread::sleep(WAIT_NAP_MIN),
        }
    }
}

/// How often, at most and at least, the wait for an untraced target looks at its CPU time.
const WAIT_NAP_MAX: Duration = Duration::from_millis(100);
const WAIT_NAP_MIN: Duration = Duration::from_millis(1);

pub(crate) fn online_cpus() -> u32 {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    n.clamp(1, 1024) as u32
}

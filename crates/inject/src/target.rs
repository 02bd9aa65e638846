//! Running one target process: natively (golden runs) or traced up to an injection point,
//! injected, then let go and watched until it exits or hangs.

use crate::fault::{self, Applied, Model, Rng, Scope, Width};
use crate::step::{Progress, StepFault};
use lockstep_trace::{ptrace, Stop, Tid};
use serde::{Deserialize, Serialize};
use std::ffi::CString;
use std::io;
use std::path::Path;
use std::time::{Duration, Instant};

/// Targets currently running (their process-group ids), so an interrupted campaign can
/// kill them all at once.
static RUNNING: std::sync::Mutex<Vec<Tid>> = std::sync::Mutex::new(Vec::new());

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
    /// After `at_us` microseconds of the target's run (time-based: no performance counters
    /// exist here, so this is only as precise as scheduling; see docs/inject.md).
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
pub fn run(argv: &[String], plan: &Plan, timeout: Duration, scratch: &Path) -> io::Result<Outcome> {
    run_with_env(argv, plan, timeout, scratch, &[])
}

/// Like [`run`], with extra environment variables for the target.
pub fn run_with_env(
    argv: &[String],
    plan: &Plan,
    timeout: Duration,
    scratch: &Path,
    env: &[(String, String)],
) -> io::Result<Outcome> {
    std::fs::create_dir_all(scratch)?;
    let out_path = scratch.join("stdout");
    let err_path = scratch.join("stderr");
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
    let traced = !matches!(plan, Plan::None);
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
            if traced {
                libc::ptrace(libc::PTRACE_TRACEME, 0, 0, 0);
                libc::raise(libc::SIGSTOP);
            }
            libc::execvpe(ptrs[0], ptrs.as_ptr(), envp.as_ptr());
            libc::_exit(127);
        }
    }
    drop((out, err));
    RUNNING.lock().unwrap_or_else(|e| e.into_inner()).push(pid);
    let result = supervise(pid, traced, plan, started, timeout, &out_path, &err_path);
    RUNNING.lock().unwrap_or_else(|e| e.into_inner()).retain(|&p| p != pid);
    result
}

fn supervise(
    pid: Tid,
    traced: bool,
    plan: &Plan,
    started: Instant,
    timeout: Duration,
    out_path: &Path,
    err_path: &Path,
) -> io::Result<Outcome> {
    let deadline = started + timeout;
    let (applied, ended) = if traced {
        match drive_to_injection(pid, plan, deadline)? {
            Driven::Injected(a) => (Some(a), None),
            Driven::NotApplied => (None, None),
            Driven::Ended(e) => (None, Some(e)),
        }
    } else {
        (None, None)
    };
    let ending = match ended {
        Some(e) => e,
        None => wait_until(pid, deadline)?,
    };
    Ok(Outcome {
        ending,
        stdout: std::fs::read(out_path).unwrap_or_default(),
        stderr: std::fs::read(err_path).unwrap_or_default(),
        wall: started.elapsed(),
        applied,
    })
}

/// Where driving a traced child ended.
enum Driven {
    Injected(Applied),
    /// The injection point was reached but the fault found nothing to corrupt.
    NotApplied,
    /// The process ended (and was reaped) before the injection point.
    Ended(Ending),
}

fn ending_of(stop: Stop) -> Option<Ending> {
    match stop {
        Stop::Exited(c) => Some(Ending::Exited(c)),
        Stop::Killed(s) => Some(Ending::Signaled(s)),
        _ => None,
    }
}

/// Takes the stopped child to its injection point, applies the fault and detaches.
fn drive_to_injection(pid: Tid, plan: &Plan, deadline: Instant) -> io::Result<Driven> {
    // The child stopped itself before exec.
    match ptrace::wait_tid(pid)? {
        Stop::Signal(libc::SIGSTOP) => {}
        other => {
            return Ok(Driven::Ended(ending_of(other).unwrap_or(Ending::Exited(127))));
        }
    }
    // SAFETY: plain ptrace on our stopped child.
    unsafe {
        libc::ptrace(
            libc::PTRACE_SETOPTIONS,
            pid,
            0,
            libc::PTRACE_O_TRACESYSGOOD | libc::PTRACE_O_TRACEEXEC | libc::PTRACE_O_EXITKILL,
        );
    }
    let point = match plan {
        Plan::Fresh { point, .. } | Plan::Replay { point, .. } => *point,
        Plan::None => unreachable!("traced only with a plan"),
    };
    let reached = match point {
        Point::Syscall { k, steps } => run_to_syscall(pid, k, steps)?,
        Point::Time { at_us } => run_for(pid, Duration::from_micros(at_us), deadline)?,
    };
    if let Some(ending) = reached {
        return Ok(Driven::Ended(ending));
    }
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
            match step_until_applied(pid, stepper, deadline)? {
                Stepped::Applied(a) => a,
                Stepped::Detached(a) => return Ok(Driven::Injected(a)),
                Stepped::GaveUp => return Ok(Driven::NotApplied),
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
            fault::apply(pid, pid, *model, *width, scope, &mut rng)?
        }
        Plan::Replay { applied, .. } => {
            fault::reapply(pid, applied)?;
            applied.clone()
        }
        Plan::None => unreachable!(),
    };
    ptrace::detach_with(pid, 0)?;
    Ok(Driven::Injected(applied))
}

/// Steps syscall by syscall until the k-th syscall after exec has returned, then `steps`
/// instructions further. Some(ending) when the process ended first.
fn run_to_syscall(pid: Tid, k: u64, steps: u64) -> io::Result<Option<Ending>> {
    let mut after_exec = false;
    let mut entries = 0u64;
    let mut in_syscall = false;
    ptrace::cont_syscall(pid, 0)?;
    loop {
        match ptrace::wait_tid(pid)? {
            stop @ (Stop::Exited(_) | Stop::Killed(_)) => return Ok(ending_of(stop)),
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
        // SAFETY: single-step our stopped child.
        if unsafe { libc::ptrace(libc::PTRACE_SINGLESTEP, pid, 0, 0) } < 0 {
            return Err(io::Error::last_os_error());
        }
        if let stop @ (Stop::Exited(_) | Stop::Killed(_)) = ptrace::wait_tid(pid)? {
            return Ok(ending_of(stop));
        }
    }
    Ok(None)
}

enum Stepped {
    Applied(Applied),
    /// Applied, and the process already detached.
    Detached(Applied),
    GaveUp,
    Ended(Ending),
}

/// Single-steps `pid` until the step fault is in place. Signals that arrive meanwhile are
/// delivered with the next step.
fn step_until_applied(pid: Tid, mut stepper: StepFault, deadline: Instant) -> io::Result<Stepped> {
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
                        // The armed instruction raised `sig`: detach, delivering it.
                        ptrace::detach_with(pid, sig)?;
                        return Ok(Stepped::Detached(applied));
                    }
                    signal = sig; // delivered with the next step
                }
                Some(_) => {}
            }
        }
    }
}

/// The next stop of `pid`, or None once `deadline` passed (the process group is then
/// killed and reaped).
fn wait_stop_until(pid: Tid, deadline: Instant) -> io::Result<Option<Stop>> {
    let mut spins = 0u32;
    loop {
        let mut status = 0;
        // SAFETY: non-blocking waitpid on our traced child.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG | libc::__WALL) };
        if r == pid {
            return Ok(Some(ptrace::decode(status)));
        }
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        if Instant::now() >= deadline {
            // SAFETY: kill the target's process group, then reap it.
            unsafe {
                libc::kill(-pid, libc::SIGKILL);
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut status, libc::__WALL);
            }
            return Ok(None);
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

/// Lets the child run for `after`, then stops it. Some(ending) when it ended first.
fn run_for(pid: Tid, after: Duration, deadline: Instant) -> io::Result<Option<Ending>> {
    let t0 = Instant::now();
    ptrace::cont(pid, 0)?;
    let until = (t0 + after).min(deadline);
    loop {
        let mut status = 0;
        // SAFETY: non-blocking waitpid on our child.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG | libc::__WALL) };
        if r == pid {
            match ptrace::decode(status) {
                stop @ (Stop::Exited(_) | Stop::Killed(_)) => return Ok(ending_of(stop)),
                Stop::Signal(sig) => ptrace::cont(pid, sig)?,
                _ => ptrace::cont(pid, 0)?,
            }
        }
        if Instant::now() >= until {
            break;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    ptrace::kill(pid, libc::SIGSTOP);
    loop {
        match ptrace::wait_tid(pid)? {
            stop @ (Stop::Exited(_) | Stop::Killed(_)) => return Ok(ending_of(stop)),
            Stop::Signal(libc::SIGSTOP) => return Ok(None),
            Stop::Signal(sig) => ptrace::cont(pid, sig)?,
            _ => ptrace::cont(pid, 0)?,
        }
    }
}

/// Waits for the (untraced) child to end, killing its process group at the deadline.
fn wait_until(pid: Tid, deadline: Instant) -> io::Result<Ending> {
    loop {
        let mut status = 0;
        // SAFETY: non-blocking waitpid on our child.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            if libc::WIFEXITED(status) {
                return Ok(Ending::Exited(libc::WEXITSTATUS(status)));
            }
            if libc::WIFSIGNALED(status) {
                return Ok(Ending::Signaled(libc::WTERMSIG(status)));
            }
            continue;
        }
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        if Instant::now() >= deadline {
            // SAFETY: kill the target's process group, then reap it.
            unsafe {
                libc::kill(-pid, libc::SIGKILL);
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut status, 0);
            }
            return Ok(Ending::TimedOut);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

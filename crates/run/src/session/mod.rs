//! The monitor: replicas, logical processes and tasks, and the event loop.
//!
//! Nouns (after rr):
//! * a **replica** is one copy of the whole program (its own process tree);
//! * a **process** is a logical process: the same process in every replica;
//! * a **task** is a logical thread: the same thread in every replica, matched by creation
//!   order; its per-replica threads are **slots**;
//! * a **rendezvous** is the point where every live replica's slot of a task has stopped
//!   at the same kind of event (a syscall, a fault, an RDTSC, its death).
//!
//! The replica set lives in `replica.rs`, tasks and slots in `task.rs`, each with private
//! state; this module tree holds the policy over them and its own state is private to it.
//! Each task moves through [`Phase`]s: `Collect` (waiting for arrivals), then one of the
//! execution phases, then back to `Collect`. See `rendezvous.rs` for the decisions.

pub mod catch_up;
mod fast_session;
pub mod plan;
pub mod rendezvous;
pub mod shared_map;
pub mod signals;

use crate::backend::{Backend, Checked, Ptrace, Resume};
use crate::options::Options;
use crate::replica::Removal;
use crate::session::signals::SigSet;
use crate::spawn;
use crate::stats::Stats;
use crate::Error;
use lockstep_core::{exit, Event, EventSink};
use lockstep_trace::seccomp::{Gate, Listener};
use lockstep_trace::syscalls::Class;
use lockstep_trace::{ptrace, Regs, Stop, Tid};
use std::collections::{HashMap, HashSet};
use std::ffi::CString;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

pub use crate::task::{
    Arrival, Death, InputRecord, Phase, ProcId, ReplicaId, Slot, SlotState, Task, TaskId, MAX_QUEUED_INPUTS,
    MAX_QUEUED_INPUT_BYTES, PREVIEW,
};

/// A logical process: the same process in every replica.
pub struct Process {
    logical_pid: i32,
    parent: Option<ProcId>,
    tasks: Vec<TaskId>,
    /// exit_group or a fatal signal is under way: deaths are expected.
    exiting: bool,
    /// Signals the program itself sent to this process (`kill`, `tgkill`, ...): a death
    /// by one of them is the program's doing in every replica, not a fault.
    sent_by_program: SigSet,
    /// Shared file mappings: the leader's maps the file, each follower's is a private copy
    /// (see `shared_map.rs`). Compared at msync, munmap, fsync and exit.
    shared_maps: Vec<crate::session::shared_map::SharedMap>,
}

/// One replica as its mechanism started it, stopped at its first intercepted syscall.
pub struct Started {
    pub main: Tid,
    /// Its pid as the program sees it (in its own PID namespace, if any).
    pub own_pid: i32,
    pub cpu: Option<usize>,
    /// Where its descriptor installs are answered (ptrace backend only).
    pub listener: Option<Rc<Listener>>,
    /// The PID namespace's init, or 0.
    pub stub: Tid,
}

/// Signals lockstep itself received, as a bit mask, set by the signal handler.
pub(crate) static RECEIVED: AtomicU64 = AtomicU64::new(0);
pub(crate) const FORWARDED: [i32; 6] = [
    libc::SIGINT,
    libc::SIGTERM,
    libc::SIGHUP,
    libc::SIGQUIT,
    libc::SIGUSR1,
    libc::SIGUSR2,
];

extern "C" fn on_signal(sig: libc::c_int) {
    if sig != libc::SIGALRM {
        RECEIVED.fetch_or(1 << sig, Ordering::SeqCst);
    }
}

fn install_signal_handlers() {
    // SAFETY: the handler only touches an atomic; no SA_RESTART so waitpid returns EINTR.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_signal as *const () as usize;
        libc::sigemptyset(&mut sa.sa_mask);
        for sig in FORWARDED.iter().chain([libc::SIGALRM].iter()) {
            libc::sigaction(*sig, &sa, std::ptr::null_mut());
        }
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
    // Descriptor installs wait for a seccomp notification and for the follower's stops at
    // once (Listener::recv).
    lockstep_trace::seccomp::block_sigchld();
    set_tick(TICK);
}

/// The period of the tick that wakes waitpid so that timeouts and forwarded signals are
/// handled.
pub(crate) const TICK: std::time::Duration = std::time::Duration::from_millis(50);

/// The finer tick while a time-based replica fault waits for its moment.
pub(crate) const INJECTION_TICK: std::time::Duration = std::time::Duration::from_millis(1);

pub(crate) fn set_tick(period: std::time::Duration) {
    let tick = libc::timeval {
        tv_sec: 0,
        tv_usec: period.as_micros() as libc::suseconds_t,
    };
    let timer = libc::itimerval {
        it_interval: tick,
        it_value: tick,
    };
    // SAFETY: plain setitimer; the handler only touches an atomic.
    unsafe {
        libc::setitimer(libc::ITIMER_REAL, &timer, std::ptr::null_mut());
    }
}

/// The most replicas that are alive at once (TMR).
pub const MAX_LIVE: usize = 3;

/// The live members of a group or of a task's rendezvous. Computed at every stop, so it is
/// a fixed-size set rather than a heap allocation.
#[derive(Clone, Copy, Debug, Default)]
pub struct Members {
    ids: [ReplicaId; MAX_LIVE],
    len: usize,
}

impl std::ops::Deref for Members {
    type Target = [ReplicaId];
    fn deref(&self) -> &[ReplicaId] {
        &self.ids[..self.len]
    }
}

impl FromIterator<ReplicaId> for Members {
    fn from_iter<I: IntoIterator<Item = ReplicaId>>(iter: I) -> Self {
        let mut m = Members::default();
        for id in iter {
            assert!(m.len < MAX_LIVE, "more than {MAX_LIVE} live replicas");
            m.ids[m.len] = id;
            m.len += 1;
        }
        m
    }
}

impl IntoIterator for Members {
    type Item = ReplicaId;
    type IntoIter = std::iter::Take<std::array::IntoIter<ReplicaId, MAX_LIVE>>;
    fn into_iter(self) -> Self::IntoIter {
        self.ids.into_iter().take(self.len)
    }
}

/// Why the event loop stopped early.
pub enum Stopped {
    /// Corruption detected and contained: exit 86.
    Halt,
    Failure(Error),
}

impl From<Error> for Stopped {
    fn from(e: Error) -> Self {
        Stopped::Failure(e)
    }
}

pub struct Session {
    opts: Options,
    be: Checked,
    replicas: crate::replica::Replicas,
    tasks: Vec<Task>,
    processes: Vec<Process>,
    by_tid: HashMap<Tid, (TaskId, ReplicaId)>,
    /// Threads that stopped before we learned which task they belong to.
    early_stops: HashSet<Tid>,
    report: crate::report::Report,
    stats: Stats,
    started: Instant,
    root_death: Option<Death>,
    /// Where the program's status goes if its processes outlive its first one.
    front: crate::front::Front,
    reintegration_due: bool,
    /// Tasks to settle again after a vote-out: a call the voted-out leader was executing
    /// for them (their followers are parked at it), or a meeting that may now be complete.
    unsettled: Vec<TaskId>,
    reintegration_note_given: bool,
    scratch: Vec<u8>,
    /// LOCKSTEP_DEBUG set: trace every stop on stderr.
    debug: bool,
    /// LOCKSTEP_DUMP_AFTER=SECONDS: once the run has lasted that long, describe the
    /// session's state on stderr and trace every stop from then on (a hang or livelock
    /// that tracing from the start would hide by its slowness).
    dump_after: Option<std::time::Duration>,
    /// Fault injection, when asked for (see `injection.rs`).
    hook: Option<Box<dyn crate::injection::FaultHook>>,
    /// The fast path's ring (`--backend fast`).
    fast: Option<crate::fast::FastPath>,
    /// A signal was delivered without a common state (said once; see `catch_up.rs`).
    said_loose_signal: bool,
    /// Each replica's CPU time at its main thread's exit_group (for LOCKSTEP_CPU_REPORT).
    replica_cpu: Vec<Option<std::time::Duration>>,
    /// Threads of voted-out replicas, killed once the stop at hand is handled: the healthy
    /// replicas go on first (killing wakes the victim, which can take the CPU from us).
    doomed: Vec<Tid>,
    /// Threads of a voted-out leader that were in the kernel running a call for everyone
    /// (a read of a pipe the replicas share, say). Once killed they are waited out of the
    /// call before anything else runs: a dying reader woken by SIGKILL still takes data
    /// that arrives before it is scheduled, and the new leader's run of the same call
    /// would then wait for data that is gone.
    doomed_in_calls: Vec<Tid>,
    /// Doomed threads that had not left their call when `CALL_EXIT_LIMIT` was up.
    stuck_in_calls: Vec<Tid>,
    /// Divergence events whose messages are written after the stop (see `rendezvous.rs`).
    divergences: Vec<rendezvous::PendingDivergence>,
}

/// Resolves CMD like execvp would, so a missing binary is reported before anything starts.
fn resolve(cmd: &str) -> Result<String, Error> {
    use std::os::unix::fs::PermissionsExt;
    let executable = |p: &std::path::Path| {
        p.metadata()
            .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            .unwrap_or(false)
    };
    if cmd.contains('/') {
        let p = std::path::Path::new(cmd);
        if !p.exists() {
            return Err(Error::NotFound(format!("{cmd}: no such file")));
        }
        return Ok(cmd.to_string());
    }
    let path = std::env::var("PATH").unwrap_or_else(|_| "/usr/local/bin:/usr/bin:/bin".into());
    for dir in path.split(':').filter(|d| !d.is_empty()) {
        let candidate = std::path::Path::new(dir).join(cmd);
        if executable(&candidate) {
            return Ok(candidate.to_string_lossy().into_owned());
        }
    }
    Err(Error::NotFound(format!("{cmd}: command not found")))
}

/// A process's pid in its innermost PID namespace (the last `NSpid` of its status).
fn innermost_pid(pid: Tid) -> Option<i32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find_map(|l| l.strip_prefix("NSpid:"))?;
    line.split_whitespace().last()?.parse().ok()
}

fn allowed_cpus() -> Vec<usize> {
    // SAFETY: zeroed cpu_set_t filled by the kernel.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    }
}

fn cstring(s: &str) -> Result<CString, Error> {
    CString::new(s).map_err(|_| Error::Usage(format!("argument contains a NUL byte: {s:?}")))
}

impl Session {
    pub fn start(opts: Options, front: crate::front::Front) -> Result<Session, Error> {
        if !(2..=MAX_LIVE as u32).contains(&opts.replicas) {
            return Err(Error::Usage(format!(
                "unsupported replica count {} (use -r 2 for DMR or -r 3 for TMR)",
                opts.replicas
            )));
        }
        let Some(cmd) = opts.command.first() else {
            return Err(Error::Usage(
                "no command given (usage: lockstep run [OPTIONS] -- CMD [ARGS...])".into(),
            ));
        };
        let path = cstring(&resolve(cmd)?)?;
        let argv = opts.command.iter().map(|a| cstring(a)).collect::<Result<Vec<_>, _>>()?;
        let avail = allowed_cpus();
        for c in opts.cpus.iter().chain(opts.monitor_cpu.iter()) {
            if !avail.contains(c) {
                return Err(Error::Usage(format!("CPU {c} is not available (allowed: {avail:?})")));
            }
        }
        let cpus: &[usize] = if opts.cpus.is_empty() { &avail } else { &opts.cpus };
        let placement: Vec<usize> = match cpus.len() {
            0 => Vec::new(),
            n => (0..opts.replicas as usize).map(|id| cpus[id % n]).collect(),
        };
        let fast = crate::fast::FastPath::for_run(&opts, &path, &placement)?;
        let envp = std::env::vars_os()
            .filter(|(k, _)| fast.is_none() || !crate::fast::REPLACED_VARIABLES.iter().any(|v| k == v))
            .map(|(k, v)| {
                let mut kv = k.into_encoded_bytes();
                kv.push(b'=');
                kv.extend(v.into_encoded_bytes());
                CString::new(kv).map_err(|_| Error::Usage("environment contains a NUL byte".into()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        // The fast path's files are reached through a process that holds them: the
        // namespace stub (pid 1 there), or lockstep itself without namespaces.
        // SAFETY: getpid has no preconditions.
        let own_pid = unsafe { libc::getpid() };
        let with_fast = |holder: i32| -> Vec<CString> {
            let mut env = envp.clone();
            if let Some(f) = &fast {
                env.extend(f.environment(holder));
            }
            env
        };
        let (env_ns, env_plain) = (with_fast(1), with_fast(own_pid));
        let (env_ns_ptrs, env_plain_ptrs) = (spawn::ptrs(&env_ns), spawn::ptrs(&env_plain));
        let close_fds: Vec<i32> = fast.iter().flat_map(|f| f.fds()).collect();
        let events = EventSink::new(opts.events.as_deref(), !opts.quiet)
            .map_err(|e| Error::Io("creating the events file", e))?;
        install_signal_handlers();
        let gate = match (&fast, opts.output_check) {
            (None, _) => Gate::Absent,
            (Some(_), crate::OutputCheck::Strict | crate::OutputCheck::StrictStop) => Gate::StopOutputs,
            (Some(_), crate::OutputCheck::Fast) => Gate::AllowAll,
        };
        let filter = lockstep_trace::seccomp::build_filter(gate);
        let argv_ptrs = spawn::ptrs(&argv);
        let mut started = Vec::new();
        // SAFETY: geteuid has no preconditions.
        let mut namespaces = unsafe { libc::geteuid() } == 0;
        for id in 0..opts.replicas {
            let cpu = (!cpus.is_empty()).then(|| cpus[id as usize % cpus.len()]);
            let plan = spawn::Plan {
                path: &path,
                argv: &argv_ptrs,
                envp: if namespaces { &env_ns_ptrs } else { &env_plain_ptrs },
                cpu,
                namespaces,
                pid: front.caller_pid(),
                filter: &filter,
                close_fds: &close_fds,
            };
            let spawned = match spawn::spawn(&plan) {
                Err(Error::Io("clone", e)) if namespaces && id == 0 && e.raw_os_error() == Some(libc::EPERM) => {
                    namespaces = false;
                    let plan = spawn::Plan {
                        namespaces,
                        envp: &env_plain_ptrs,
                        ..plan
                    };
                    spawn::spawn(&plan)?
                }
                other => other?,
            };
            started.push(Started {
                main: spawned.main,
                own_pid: 0,
                cpu,
                listener: Some(Rc::new(spawned.listener)),
                stub: spawned.stub,
            });
        }
        if let Some(cpu) = opts.monitor_cpu {
            // SAFETY: a zeroed set with one CPU, applied to ourselves only; the replicas
            // already have their own.
            unsafe {
                let mut set: libc::cpu_set_t = std::mem::zeroed();
                libc::CPU_SET(cpu, &mut set);
                libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
            }
        }
        // The program's pid as the program sees it: inside our namespaces, the one it got
        // there (lockstep's own pid where the kernel allowed choosing it; the stub is 1);
        // without namespaces, replica 0's.
        for s in started.iter_mut() {
            s.own_pid = if namespaces {
                innermost_pid(s.main).unwrap_or(s.main)
            } else {
                s.main
            };
        }
        let mut session = Session::assemble(opts, front, Box::new(Ptrace::default()), started, events)?;
        session.fast = fast;
        Ok(session)
    }

    /// The monitor over replicas that `be` has started, each stopped at its first
    /// intercepted syscall. A replica whose own pid differs from the first one's is
    /// translated.
    pub fn assemble(
        opts: Options,
        front: crate::front::Front,
        be: Box<dyn Backend>,
        started: Vec<Started>,
        events: EventSink,
    ) -> Result<Session, Error> {
        assert_eq!(started.len(), opts.replicas as usize, "one start per replica");
        let logical_pid = started[0].own_pid;
        let mains: Vec<Tid> = started.iter().map(|s| s.main).collect();
        let replicas = crate::replica::Replicas::new(started, logical_pid);
        let want = opts.replicas;
        let mut session = Session {
            opts,
            be: Checked::new(be),
            said_loose_signal: false,
            replica_cpu: vec![None; want as usize],
            doomed: Vec::new(),
            doomed_in_calls: Vec::new(),
            stuck_in_calls: Vec::new(),
            divergences: Vec::new(),
            replicas,
            tasks: Vec::new(),
            processes: vec![Process {
                logical_pid,
                parent: None,
                tasks: vec![0],
                exiting: false,
                sent_by_program: SigSet::default(),
                shared_maps: Vec::new(),
            }],
            by_tid: HashMap::new(),
            early_stops: HashSet::new(),
            report: crate::report::Report::new(events),
            stats: Stats::default(),
            started: Instant::now(),
            root_death: None,
            front,
            reintegration_due: false,
            unsettled: Vec::new(),
            reintegration_note_given: false,
            scratch: Vec::with_capacity(4096),
            debug: std::env::var_os("LOCKSTEP_DEBUG").is_some(),
            dump_after: std::env::var("LOCKSTEP_DUMP_AFTER")
                .ok()
                .and_then(|s| s.parse::<u64>().ok())
                .map(std::time::Duration::from_secs),
            hook: None,
            fast: None,
        };
        session.hook = crate::injection::Injector::asked_for(&session)?
            .map(|i| Box::new(i) as Box<dyn crate::injection::FaultHook>);
        let mut task = session.new_task(0, logical_pid);
        for (r, &m) in mains.iter().enumerate() {
            task.place(r as ReplicaId, Slot::new(m, m, SlotState::Running));
            session.by_tid.insert(m, (0, r as ReplicaId));
        }
        session.tasks.push(task);
        // Every replica is stopped at its first execve: record those arrivals.
        for &m in &mains {
            let handled = session.on_stop(m, Stop::Seccomp);
            session.finish_vote_outs();
            session.flush_events();
            handled.map_err(|s| match s {
                Stopped::Failure(e) => e,
                Stopped::Halt => Error::Setup("halted during start-up".into()),
            })?;
        }
        Ok(session)
    }

    pub fn new_task(&self, process: ProcId, logical_tid: i32) -> Task {
        Task::new(self.tasks.len(), process, logical_tid, self.replicas.ids())
    }

    /// Runs the event loop to the end and returns lockstep's exit status.
    pub fn run(mut self) -> Result<i32, Error> {
        let result = self.event_loop(false);
        let finished = result.is_ok();
        let status = match result {
            Ok(()) => Ok(self.root_death.map(Death::exit_status).unwrap_or(0)),
            Err(Stopped::Halt) => Ok(exit::DETECTED),
            Err(Stopped::Failure(e)) => Err(e),
        };
        if let (true, Ok(code)) = (finished, &status) {
            self.outlived(*code);
        }
        self.kill_everything();
        self.write_cpu_report();
        self.flush_events();
        self.print_stats();
        status
    }

    /// Runs until the program's first process has exited, or with `survivors`, until
    /// every process of the program has.
    fn event_loop(&mut self, survivors: bool) -> Result<(), Stopped> {
        while if survivors {
            self.survivors() > 0
        } else {
            self.root_death.is_none()
        } {
            if self.dump_after.is_some_and(|after| self.started.elapsed() >= after) {
                self.dump_after = None;
                eprintln!(
                    "lockstep: state after {:?}\n{}",
                    self.started.elapsed(),
                    self.describe_state()
                );
                self.debug = true; // and every stop from now on
            }
            self.forward_received_signals()?;
            self.check_timeouts()?;
            self.check_ring_progress()?;
            self.catch_up_signals();
            self.with_hook((), |hook, s| hook.before_wait(s));
            self.finish_vote_outs();
            self.flush_events();
            let Some((tid, stop)) = self.be.wait_any().map_err(|e| Error::Io("waitpid", e))? else {
                continue;
            };
            let t0 = Instant::now();
            let at = self.by_tid.get(&tid).copied();
            let handled = self.on_stop(tid, stop);
            self.finish_vote_outs();
            self.stats.monitor_time += t0.elapsed();
            let handled = handled
                .and_then(|()| self.fail_unsteerable())
                .and_then(|()| self.settle_after_vote_out());
            let handled = match (handled, at) {
                (Err(Stopped::Failure(e)), Some((task, r))) if !matches!(e, Error::Unsupported(_)) => {
                    Err(Stopped::Failure(self.internal_failure(task, r, e)))
                }
                (other, _) => other,
            };
            self.flush_events();
            handled?;
        }
        Ok(())
    }

    /// Every task's phase and slots, and its lane of the fast path's ring (LOCKSTEP_DUMP_AFTER).
    fn describe_state(&self) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        for (id, task) in self.tasks.iter().enumerate() {
            if task.is_finished() {
                continue;
            }
            let waited = task.waiting_since().map(|t| t.elapsed());
            // (writing into a String cannot fail)
            let _ = writeln!(out, "task {id}: {:?}, waiting for {waited:?}", task.phase());
            for r in self.live_slots(id) {
                let slot = self.slot(id, r);
                // (writing into a String cannot fail)
                let _ = writeln!(
                    out,
                    "  replica {r}: tid {}, {:?}, arrival {:?}",
                    slot.tid(),
                    slot.state(),
                    slot.arrival()
                );
            }
            let Some(fast) = self.fast.as_ref() else { continue };
            let Some(lane) = fast.lane_of(id) else { continue };
            for r in self.live_slots(id) {
                // (writing into a String cannot fail)
                let _ = writeln!(
                    out,
                    "  ring lane {lane}, replica {r}: published {:?}, consumed {:?}, awaiting {:?}, sleeping {}",
                    fast.published(lane, r),
                    fast.consumed(lane, r),
                    fast.awaiting(lane, r),
                    fast.sleeping(lane, r)
                );
            }
        }
        out
    }

    /// SIGKILLs every replica process and namespace, then reaps what is left.
    /// Names the syscall during which the monitor itself failed, in an event and in the
    /// error lockstep exits with (125).
    fn internal_failure(&mut self, task: TaskId, r: ReplicaId, cause: Error) -> Error {
        let nr = match self.tasks[task].phase() {
            Phase::Leader { nr, .. }
            | Phase::LeaderFirst { nr, .. }
            | Phase::Followers { nr, .. }
            | Phase::All { nr, .. } => Some(nr),
            Phase::Collect => match self.tasks[task].slot(r).and_then(|s| s.arrival()) {
                Some(Arrival::Syscall { nr, .. }) => Some(nr),
                _ => None,
            },
        };
        let syscall = nr
            .map(lockstep_trace::syscalls::name)
            .unwrap_or_else(|| "a stop".into());
        self.emit(
            Event::new("run", "internal", "stop")
                .replica(r)
                .object(syscall.clone())
                .message(format!(
                    "lockstep failed while replicating {syscall} (task {task}, replica {r}): {cause}"
                )),
        );
        Error::Internal {
            syscall,
            cause: Box::new(cause),
        }
    }

    /// Processes of the program other than its first one that are still running.
    fn survivors(&self) -> usize {
        self.processes
            .iter()
            .skip(1)
            .filter(|p| !p.exiting && p.tasks.iter().any(|&t| !self.tasks[t].is_finished()))
            .count()
    }

    /// The program's first process exited with `status`. Processes that outlive it stay
    /// replicated: the caller gets the status now and the monitor detaches, then goes on
    /// until the last of them exits. With `--kill-orphans` they are killed, and that is said.
    fn outlived(&mut self, status: i32) {
        let n = self.survivors();
        if n == 0 {
            return;
        }
        let (plural, verb, stay) = if n == 1 {
            ("process", "outlives", "stays")
        } else {
            ("processes", "outlive", "stay")
        };
        if !self.front.can_detach() {
            self.emit(Event::new("run", "orphans", "kill").message(format!(
                "killing {n} {plural} that outlived the program's first process (--kill-orphans)"
            )));
            self.flush_events();
            return;
        }
        self.emit(Event::new("run", "detach", "continue").message(format!(
            "the program's first process ended with status {status}; {n} {plural} {verb} it and {stay} replicated until the last one exits (lockstep returns and detaches)"
        )));
        self.flush_events();
        self.print_stats();
        self.front.detach(status);
        let result = self.event_loop(true);
        let how = match result {
            Ok(()) => "the last process of the program exited".to_string(),
            Err(Stopped::Halt) => "stopped after a detection".to_string(),
            Err(Stopped::Failure(e)) => format!("lockstep failed: {e}"),
        };
        self.emit(Event::new("run", "exit", "stop").message(how));
    }

    pub fn kill_everything(&mut self) {
        self.finish_vote_outs();
        for (&tid, _) in self.by_tid.iter() {
            self.be.kill(tid);
        }
        for stub in self.replicas.stubs() {
            self.be.kill(stub);
        }
        self.be.reap_all();
        self.by_tid.clear();
    }

    /// Queues an event (see `report.rs`).
    pub fn emit(&mut self, event: Event) {
        self.report.emit(event);
    }

    pub fn flush_events(&mut self) {
        self.describe_divergences();
        self.report.flush();
    }

    // ----- what the fault hook (`injection.rs`) may see and steer -----

    pub fn options(&self) -> &Options {
        &self.opts
    }

    /// The mechanism: every steering failure through it is its replica's failure.
    pub fn backend(&self) -> &Checked {
        &self.be
    }

    pub fn replicas(&self) -> &crate::replica::Replicas {
        &self.replicas
    }

    /// The program's first thread (task 0), where replica faults counted in syscall
    /// stops go in.
    pub fn main_task(&self) -> Option<&Task> {
        self.tasks.first()
    }

    /// The threads of replica `r` that are alive (time-based replica faults choose among
    /// them): (task, tid).
    pub fn live_threads(&self, r: ReplicaId) -> Vec<(TaskId, lockstep_trace::Tid)> {
        self.tasks
            .iter()
            .enumerate()
            .filter(|(_, t)| !t.is_finished())
            .filter_map(|(i, t)| t.slot(r).filter(|s| !s.is_dead()).map(|s| (i, s.tid())))
            .collect()
    }

    pub fn task(&self, task: TaskId) -> &Task {
        &self.tasks[task]
    }

    pub fn report(&self) -> &crate::report::Report {
        &self.report
    }

    pub fn live_replicas(&self) -> Members {
        self.replicas.live()
    }

    /// Replicas of `task` that take part in its rendezvous.
    pub fn live_slots(&self, task: TaskId) -> Members {
        let t = &self.tasks[task];
        self.replicas
            .live()
            .into_iter()
            .filter(|&r| t.slot(r).is_some())
            .collect()
    }

    pub fn slot(&self, task: TaskId, r: ReplicaId) -> &Slot {
        self.tasks[task].slot(r).expect("slot exists")
    }

    pub fn slot_mut(&mut self, task: TaskId, r: ReplicaId) -> &mut Slot {
        self.tasks[task].slot_mut(r).expect("slot exists")
    }

    /// Resumes a slot; a thread that vanished meanwhile is not an error here (its death
    /// is reported by waitpid and handled there).
    pub fn resume(&mut self, task: TaskId, r: ReplicaId, how: Resume, state: SlotState) {
        let leader = self.replicas.leader();
        let slot = self.slot_mut(task, r);
        let arrival = slot.arrival();
        slot.leave(state);
        let tid = slot.tid();
        if let (Some(Arrival::Syscall { nr, args }), true) = (arrival, r != leader) {
            // Outputs run once, in the leader: a follower leaves one only skipped (or
            // rewritten into lockstep's own calls). One whose registers could not be set
            // is not resumed at all (backend::Checked).
            let desc = lockstep_trace::syscalls::describe(nr);
            if desc.is_some_and(|d| lockstep_trace::syscalls::classify(d, &args) == Class::Output) {
                let regs = self.be.regs(tid);
                assert!(
                    regs.is_err() || regs.is_ok_and(|r| r.orig_rax != nr) || self.be.failed(tid),
                    "follower {r} of task {task} is never resumed into output {}",
                    lockstep_trace::syscalls::name(nr)
                );
            }
        }
        self.be.steer().resume(tid, how);
    }

    // ----- stops -----

    pub fn on_stop(&mut self, tid: Tid, stop: Stop) -> Result<(), Stopped> {
        if self.debug {
            let at = self
                .by_tid
                .get(&tid)
                .map(|&(t, r)| format!("task {t} replica {r} phase {:?}", self.tasks[t].phase()));
            eprintln!(
                "lockstep debug: tid {tid} {stop:?} {}",
                at.unwrap_or_else(|| "unknown".into())
            );
        }
        let Some(&(task, r)) = self.by_tid.get(&tid) else {
            match stop {
                // A new thread can report its first stop before its parent's clone event.
                Stop::EventStop(_) | Stop::Signal(_) => {
                    self.early_stops.insert(tid);
                }
                _ => {}
            }
            return Ok(());
        };
        if self.with_hook(false, |hook, s| hook.at_stop(s, tid, stop)) {
            return Ok(());
        }
        if !self.replicas.is_alive(r) {
            // A voted-out replica that we already killed; only its death remains.
            if matches!(stop, Stop::Exited(_) | Stop::Killed(_)) {
                self.by_tid.remove(&tid);
            } else {
                self.be.steer().resume(tid, Resume::Run);
            }
            return Ok(());
        }
        let catching_up = self.tasks[task].catch_up.is_some() || self.slot(task, r).breakpoint_armed();
        if catching_up && self.on_catch_up_stop(task, r, &stop) {
            return Ok(());
        }
        match stop {
            Stop::Exited(code) => self.on_death(task, r, Death::Exited(code)),
            Stop::Killed(sig) => self.on_death(task, r, Death::Killed(sig)),
            Stop::Seccomp => self.on_seccomp(task, r),
            Stop::SyscallExit => self.on_syscall_exit(task, r),
            Stop::Event(e)
                if e == libc::PTRACE_EVENT_FORK || e == libc::PTRACE_EVENT_VFORK || e == libc::PTRACE_EVENT_CLONE =>
            {
                self.on_clone_event(task, r, e)?;
                self.resume_same(task, r);
                Ok(())
            }
            Stop::Event(libc::PTRACE_EVENT_EXEC) => {
                self.on_exec_event(task, r);
                self.resume_same(task, r);
                Ok(())
            }
            Stop::Event(_) | Stop::EventStop(_) => {
                self.slot_mut(task, r).started();
                if matches!(stop, Stop::EventStop(_)) {
                    self.with_hook((), |hook, s| hook.at_event_stop(s, task, r));
                }
                if matches!(stop, Stop::EventStop(_)) {
                    self.at_fast_interrupt(task, r);
                }
                self.resume_same(task, r);
                Ok(())
            }
            Stop::Signal(sig) => self.on_signal(task, r, sig),
        }
    }

    /// Calls the fault hook, if there is one, with the session (`default` without one).
    fn with_hook<T>(
        &mut self,
        default: T,
        f: impl FnOnce(&mut dyn crate::injection::FaultHook, &mut Session) -> T,
    ) -> T {
        let Some(mut hook) = self.hook.take() else {
            return default;
        };
        let out = f(&mut *hook, self);
        self.hook = Some(hook);
        out
    }

    /// Whether fault injection is single-stepping a thread now.
    pub(crate) fn injection_stepping(&self) -> bool {
        self.hook.as_ref().is_some_and(|h| h.stepping())
    }

    /// Resumes after an event stop the way the thread was running before.
    pub(crate) fn resume_same(&mut self, task: TaskId, r: ReplicaId) {
        let slot = self.slot(task, r);
        let how = if slot.state() == SlotState::Executing {
            Resume::ToExit
        } else {
            Resume::Run
        };
        self.be.steer().resume(slot.tid(), how);
    }

    fn on_seccomp(&mut self, task: TaskId, r: ReplicaId) -> Result<(), Stopped> {
        let tid = self.slot(task, r).tid();
        let Ok(mut regs) = self.be.regs(tid) else {
            return Ok(());
        };
        if self.slot_mut(task, r).take_rerun() {
            self.be.steer().resume(tid, Resume::ToExit);
            return Ok(());
        }
        self.slot_mut(task, r).count_stop();
        if r == self.replicas.leader() {
            // A call the kernel restarted without a delivery stop (another thread took the
            // signal): whatever interrupted it is over.
            self.tasks[task].signals.clear_interrupted();
        }
        if task == 0 && ptrace::syscall_nr(&regs) == libc::SYS_exit_group as u64 {
            let cpu = Some(self.replica_cpu_now(r));
            // Reintegrated replicas get new ids.
            if self.replica_cpu.len() <= r as usize {
                self.replica_cpu.resize(r as usize + 1, None);
            }
            self.replica_cpu[r as usize] = cpu;
        }
        if !self.with_hook(true, |hook, s| hook.at_syscall(s, task, r, &mut regs)) {
            return Ok(()); // the replica was killed or set spinning
        }
        let nr = ptrace::syscall_nr(&regs);
        let args = ptrace::syscall_args(&regs);
        if self.debug {
            eprintln!(
                "lockstep debug:   syscall {} {args:x?}",
                lockstep_trace::syscalls::name(nr)
            );
        }
        if regs.rip == lockstep_trace::FAST_GATE + 2 {
            // Only strict output checks stop calls made from the fast gate.
            return self.check_gate_output(task, r, nr, &args);
        }
        let process = self.tasks[task].process();
        if self.processes[process].exiting && self.slot(task, r).signals.expecting_any() {
            // This process is being killed by a signal we sent: do not park the thread at
            // a rendezvous; let it return so the signal is delivered.
            ptrace::skip_with_result(&mut regs, -(libc::EINTR as i64));
            self.be.steer().set_regs(tid, &regs);
            self.be.steer().resume(tid, Resume::Run);
            return Ok(());
        }
        if nr == libc::SYS_munmap as u64 && !self.unmaps_shared(task, &args) {
            // Nothing of ours goes away: a local effect, no meeting.
            self.be.steer().resume(tid, Resume::Run);
            return Ok(());
        }
        if let Some(clock) = crate::clock::clock_of(nr, &args) {
            self.answer_clock(task, r, regs, nr, args, clock);
            return Ok(());
        }
        if Self::is_fast_report(nr, &args) {
            return self.on_fast_report(task, r, args);
        }
        if self.opts.compare == crate::CompareMode::Io && self.consume_queued_input(task, r, regs, nr)? {
            return Ok(());
        }
        // Re-arrival during an all-replica phase: a replica whose call was interrupted
        // runs it again, unless nobody completed it, in which case all meet again.
        if let Phase::All { .. } = self.tasks[task].phase() {
            let someone_done = self
                .live_slots(task)
                .iter()
                .any(|&o| self.slot(task, o).state() == SlotState::Done);
            let slot = self.slot_mut(task, r);
            if someone_done {
                slot.rejoin(regs);
                self.be.steer().resume(tid, Resume::ToExit);
                return Ok(());
            }
            slot.arrive(regs, Arrival::Syscall { nr, args });
            let all_back = self
                .live_slots(task)
                .iter()
                .all(|&o| self.slot(task, o).state() == SlotState::Arrived);
            if all_back {
                self.tasks[task].recollect();
                return self.try_decide(task);
            }
            return Ok(());
        }
        self.slot_mut(task, r).arrive(regs, Arrival::Syscall { nr, args });
        self.tasks[task].note_arrival();
        self.try_decide(task)
    }

    /// `--compare io`: a replica behind the leader gets the leader's recorded result for
    /// its next input at once. A different call than the leader made is not served: it
    /// becomes an ordinary arrival, and the next vote (which compares how many inputs each
    /// replica consumed) finds the divergence.
    fn consume_queued_input(&mut self, task: TaskId, r: ReplicaId, mut regs: Regs, nr: u64) -> Result<bool, Stopped> {
        let consumed = self.slot(task, r).consumed();
        let Some(record) = self.tasks[task].inputs.get(consumed) else {
            return Ok(false);
        };
        if record.nr != nr {
            return Ok(false);
        }
        let desc = lockstep_trace::syscalls::describe(nr).expect("recorded calls are in the table");
        let tid = self.slot(task, r).tid();
        let args = ptrace::syscall_args(&regs);
        if record.ret == -(libc::EFAULT as i64) {
            self.check_leader_efault(task, r, desc, &args)?;
        }
        let record = self.tasks[task].inputs.get(consumed).expect("found above");
        crate::data::apply_outputs(&self.be, tid, desc, &args, record.ret, &record.outputs);
        self.stats.bytes_copied += record.outputs.bytes();
        ptrace::skip_with_result(&mut regs, record.ret);
        self.be.steer().set_regs(tid, &regs);
        self.be.steer().resume(tid, Resume::Run);
        self.slot_mut(task, r).consumed_input(consumed);
        self.trim_inputs(task);
        Ok(true)
    }

    /// Drops recorded inputs every live replica has consumed.
    pub fn trim_inputs(&mut self, task: TaskId) {
        let min = self
            .live_slots(task)
            .iter()
            .filter(|&&r| !self.slot(task, r).is_dead())
            .map(|&r| self.slot(task, r).consumed())
            .min()
            .unwrap_or(u64::MAX);
        self.tasks[task].inputs.trim(min);
    }

    /// Answers a clock read at once from the task's sequence for that clock.
    fn answer_clock(&mut self, task: TaskId, r: ReplicaId, mut regs: Regs, nr: u64, args: [u64; 6], clock: i32) {
        let live = self.live_replicas();
        let (tgid, tid) = (self.slot(task, r).tgid(), self.slot(task, r).tid());
        let seq = self.tasks[task].clock(clock);
        let ts = seq.next(r, &live, || crate::clock::read(clock, tgid, tid));
        self.stats.clock_reads += 1;
        let (sec, nsec) = (ts.tv_sec, ts.tv_nsec);
        let result = match nr as i64 {
            libc::SYS_clock_gettime => {
                let mut b = [0u8; 16];
                b[..8].copy_from_slice(&sec.to_le_bytes());
                b[8..].copy_from_slice(&nsec.to_le_bytes());
                if args[1] != 0 && self.be.write(tid, args[1], &b).is_err() {
                    -(libc::EFAULT as i64)
                } else {
                    0
                }
            }
            libc::SYS_gettimeofday => {
                let mut b = [0u8; 16];
                b[..8].copy_from_slice(&sec.to_le_bytes());
                b[8..].copy_from_slice(&(nsec / 1000).to_le_bytes());
                let ok = (args[0] == 0 || self.be.write(tid, args[0], &b).is_ok())
                    && (args[1] == 0 || self.be.write(tid, args[1], &[0u8; 8]).is_ok());
                if ok {
                    0
                } else {
                    -(libc::EFAULT as i64)
                }
            }
            _ => {
                if args[0] != 0 {
                    self.be.steer().write(tid, args[0], &sec.to_le_bytes());
                }
                sec
            }
        };
        ptrace::skip_with_result(&mut regs, result);
        self.be.steer().set_regs(tid, &regs);
        self.be.steer().resume(tid, Resume::Run);
    }

    /// With LOCKSTEP_CPU_REPORT=PATH (set by `lockstep inject --replica` for its golden
    /// runs), writes the replicas' mean CPU time at their exit_group: the range of its
    /// time-based points.
    fn write_cpu_report(&mut self) {
        if let Some(mut hook) = self.hook.take() {
            hook.finish(self);
        }
        let Some(path) = std::env::var_os(lockstep_inject::fault::CPU_REPORT_ENV) else {
            return;
        };
        let seen: Vec<f64> = self
            .replica_cpu
            .iter()
            .flatten()
            .map(|d| d.as_secs_f64() * 1e6)
            .collect();
        if !seen.is_empty() {
            let mean = seen.iter().sum::<f64>() / seen.len() as f64;
            if let Err(e) = std::fs::write(&path, format!("{{\"cpu_us\": {mean:.0}}}\n")) {
                eprintln!(
                    "lockstep run: cannot write the CPU report {}: {e}",
                    std::path::Path::new(&path).display()
                );
            }
        }
    }

    /// The CPU time replica `r`'s first process has used (the clock of time-based replica
    /// faults, so that a point means the same share of the program's execution as natively).
    pub(crate) fn replica_cpu_now(&self, r: ReplicaId) -> std::time::Duration {
        self.tasks
            .first()
            .and_then(|t| t.slot(r))
            .and_then(|slot| self.be.process_cpu(slot.tgid()))
            .unwrap_or_default()
    }

    /// The instruction at `rip`, if it is one lockstep traps (RDTSC, RDTSCP, CPUID).
    pub(crate) fn trapped_insn(&self, tid: Tid, rip: u64) -> Option<TrappedInsn> {
        let mut insn = [0u8; 3];
        self.be.read(tid, rip, &mut insn).ok()?;
        match insn {
            [0x0f, 0x31, _] => Some(TrappedInsn::Rdtsc(2)),
            [0x0f, 0x01, 0xf9] => Some(TrappedInsn::Rdtsc(3)),
            [0x0f, 0xa2, _] => Some(TrappedInsn::Cpuid),
            _ => None,
        }
    }

    pub(crate) fn arrive(&mut self, task: TaskId, r: ReplicaId, regs: Regs, arrival: Arrival) -> Result<(), Stopped> {
        self.slot_mut(task, r).arrive(regs, arrival);
        self.tasks[task].note_arrival();
        self.try_decide(task)
    }

    pub(crate) fn on_death(&mut self, task: TaskId, r: ReplicaId, death: Death) -> Result<(), Stopped> {
        let tid = self.slot(task, r).tid();
        self.by_tid.remove(&tid);
        let was_leader_executing = matches!(
            self.tasks[task].phase(),
            Phase::Leader { .. } | Phase::LeaderFirst { .. }
        ) && r == self.replicas.leader();
        self.slot_mut(task, r).die(death);
        let process = self.tasks[task].process();
        let expected = self.processes[process].exiting
            || matches!(death, Death::Killed(sig) if self.processes[process].sent_by_program.contains(sig));
        if was_leader_executing {
            if let Some(why) = self.moved_a_file_offset(task, r).filter(|_| !expected) {
                return Err(self.halt(why));
            }
            self.tasks[task].recollect();
        }
        if let Phase::All { .. } | Phase::Followers { .. } = self.tasks[task].phase() {
            // The others finish their part; this replica's death is judged at the next vote.
            return self.maybe_complete_all(task);
        }
        if !expected && matches!(death, Death::Killed(_)) {
            // A replica thread died alone: that replica is faulty. No need to wait for
            // the next rendezvous, where the others might be a long time coming.
            let msg = format!(
                "replica {r} died ({}) while the others are alive",
                describe_death(death)
            );
            return self.replica_failed(task, r, "divergence", msg);
        }
        self.tasks[task].note_arrival();
        self.try_decide(task)
    }

    fn on_clone_event(&mut self, task: TaskId, r: ReplicaId, event: i32) -> Result<(), Stopped> {
        let tid = self.slot(task, r).tid();
        let child = self.be.event_msg(tid).map_err(|e| Error::Io("PTRACE_GETEVENTMSG", e))? as Tid;
        let thread = event == libc::PTRACE_EVENT_CLONE && self.clone_is_thread(task, r);
        let child_task = match self.tasks[task].spawned() {
            Some(t) => t,
            None => {
                let parent_process = self.tasks[task].process();
                let process = if thread {
                    parent_process
                } else {
                    self.processes.push(Process {
                        logical_pid: 0,
                        parent: Some(parent_process),
                        tasks: Vec::new(),
                        exiting: false,
                        sent_by_program: SigSet::default(),
                        // A forked child has the same mappings (and private copies).
                        shared_maps: self.processes[parent_process].shared_maps.clone(),
                    });
                    self.processes.len() - 1
                };
                let t = self.new_task(process, 0);
                let id = t.id();
                self.tasks.push(t);
                self.processes[process].tasks.push(id);
                self.tasks[task].set_spawned(Some(id));
                id
            }
        };
        let tgid = if thread { self.slot(task, r).tgid() } else { child };
        let state = if self.early_stops.remove(&child) {
            SlotState::Running
        } else {
            SlotState::Starting
        };
        let slot = Slot::child_of(self.slot(task, r), child, tgid, state);
        self.tasks[child_task].place(r, slot);
        self.by_tid.insert(child, (child_task, r));
        if state == SlotState::Running {
            self.be.steer().resume(child, Resume::Run);
        }
        Ok(())
    }

    /// Whether the clone that replica `r`'s thread of `task` is stopped in starts a thread.
    /// A clone3's flags are read from that thread's own memory: it is stopped at the
    /// event, while the leader may already be dead and not yet voted out (its memory is
    /// gone, and a thread taken for a process would never get a lane in the fast path's
    /// ring: found as a hang after a leader died while its worker was being started).
    fn clone_is_thread(&self, task: TaskId, r: ReplicaId) -> bool {
        match self.tasks[task].phase() {
            Phase::All { nr, args } if nr == libc::SYS_clone as u64 => args[0] & libc::CLONE_THREAD as u64 != 0,
            Phase::All { nr, .. } if nr == libc::SYS_clone3 as u64 => {
                let tid = self.slot(task, r).tid();
                let mut flags = [0u8; 8];
                self.be
                    .regs(tid)
                    .and_then(|regs| self.be.read(tid, regs.rdi, &mut flags))
                    .is_ok()
                    && u64::from_le_bytes(flags) & libc::CLONE_THREAD as u64 != 0
            }
            _ => false,
        }
    }

    fn on_exec_event(&mut self, task: TaskId, r: ReplicaId) {
        // A multi-threaded exec: the execing thread takes over the thread-group id.
        let tid = self.slot(task, r).tid();
        let former = self.be.event_msg(tid).unwrap_or(tid as u64) as Tid;
        if former != tid {
            if let Some((t, rr)) = self.by_tid.remove(&former) {
                debug_assert_eq!(rr, r);
                self.by_tid.insert(tid, (t, r));
                self.slot_mut(t, r).took_over(tid);
            }
        }
    }

    // ----- timeouts -----

    fn check_timeouts(&mut self) -> Result<(), Stopped> {
        let now = Instant::now();
        for task in 0..self.tasks.len() {
            let t = &self.tasks[task];
            // Waiting for arrivals, or for the replicas that have not finished their part of
            // a call every replica runs (a follower's wait4 for a child that never exits).
            // The leader alone in the kernel (Leader, LeaderFirst) is the program waiting,
            // not a straggler.
            let collecting = t.phase() == Phase::Collect;
            let finishing = matches!(t.phase(), Phase::All { .. } | Phase::Followers { .. });
            if t.is_finished() || !(collecting || finishing) {
                continue;
            }
            let Some(first) = t.waiting_since() else {
                continue;
            };
            let waited = now.duration_since(first);
            // A replica that came with a fault while every other one waits for it in the
            // fast path's ring is judged at once (below): those ran the same code up to
            // their call without the fault, so it cannot be the program's own.
            let fault_came = collecting && t.slots().any(|s| matches!(s.arrival(), Some(Arrival::Fault { .. })));
            if waited < self.opts.timeout && !fault_came {
                continue;
            }
            let live = self.live_slots(task);
            let missing: Vec<ReplicaId> = live
                .iter()
                .copied()
                .filter(|&r| {
                    let slot = self.slot(task, r);
                    if collecting {
                        slot.arrival().is_none()
                    } else {
                        !matches!(slot.state(), SlotState::Done | SlotState::Dead)
                    }
                })
                .collect();
            if missing.is_empty() {
                continue;
            }
            if collecting && self.waiting_in_ring(task, &missing) {
                // The missing replicas wait in the fast path's ring for the ones that came
                // here: those left the ring's sequence of calls (a fault on the way).
                let came: Vec<ReplicaId> = live.iter().copied().filter(|r| !missing.contains(r)).collect();
                return self.left_the_ring(task, &came, live.len(), waited);
            }
            if waited < self.opts.timeout {
                continue;
            }
            let msg = format!(
                "replica(s) {missing:?} did not reach the rendezvous of task {task} within {:.1} s",
                self.opts.timeout.as_secs_f64()
            );
            self.stragglers_timed_out(
                task,
                &missing,
                live.len(),
                msg,
                format!("no majority reached the rendezvous of task {task} in time"),
            )?;
            if collecting {
                self.try_decide(task)?;
            } else {
                self.maybe_complete_all(task)?;
            }
        }
        Ok(())
    }

    // ----- failures -----

    /// A fault was detected: counted, and reported as `event`.
    pub(crate) fn detected(&mut self, event: Event) {
        self.stats.divergences += 1;
        self.emit(event);
    }

    /// `stragglers` (of `live` replicas) did not keep up with `task` (`what` says how): a
    /// timeout event, then the straggler voted out when the others are a majority, else a
    /// halt (`halt_why`).
    pub(crate) fn stragglers_timed_out(
        &mut self,
        task: TaskId,
        stragglers: &[ReplicaId],
        live: usize,
        what: String,
        halt_why: String,
    ) -> Result<(), Stopped> {
        self.detected(
            Event::new("run", "timeout", "vote")
                .object(format!("task {task}"))
                .message(what),
        );
        self.vote_out_or_halt(stragglers, live, |r| format!("replica {r} is a straggler"), halt_why)
    }

    /// `culprits` (of `live` replicas) failed: the one voted out (`vote_why` says why)
    /// when the others are a majority, else a halt.
    pub(crate) fn vote_out_or_halt(
        &mut self,
        culprits: &[ReplicaId],
        live: usize,
        vote_why: impl FnOnce(ReplicaId) -> String,
        halt_why: String,
    ) -> Result<(), Stopped> {
        match culprits {
            [r] if (live - 1) * 2 > live => self.vote_out(*r, vote_why(*r)),
            _ => Err(self.halt(halt_why)),
        }
    }

    /// A replica failed outside a vote (it died alone).
    pub(crate) fn replica_failed(
        &mut self,
        task: TaskId,
        r: ReplicaId,
        kind: &'static str,
        msg: String,
    ) -> Result<(), Stopped> {
        self.detected(
            Event::new("run", kind, "vote")
                .replica(r)
                .object(format!("task {task}"))
                .message(msg),
        );
        if self.live_replicas().len() <= 2 {
            return Err(self.halt(format!("replica {r} failed and no majority is left")));
        }
        self.vote_out(r, format!("replica {r} failed"))?;
        // Its slots no longer count: rendezvous that waited only for it can go on.
        for t in 0..self.tasks.len() {
            if !self.tasks[t].is_finished() {
                if self.tasks[t].phase() == Phase::Collect {
                    self.try_decide(t)?;
                } else {
                    self.maybe_complete_all(t)?;
                }
            }
        }
        Ok(())
    }

    /// Replicas the backend failed to steer (a register write or a resume that did not
    /// happen) fail: silence would leave them running from a state nobody chose.
    fn fail_unsteerable(&mut self) -> Result<(), Stopped> {
        for (tid, what, cause) in self.be.take_failures() {
            let Some(&(task, r)) = self.by_tid.get(&tid) else {
                continue;
            };
            if !self.replicas.is_alive(r) {
                continue;
            }
            let msg = format!("lockstep could not steer replica {r} ({what} failed: {cause})");
            self.replica_failed(task, r, "divergence", msg)?;
        }
        Ok(())
    }

    /// Removes replica `r`: kills its threads and, if it led, elects a new leader.
    pub fn vote_out(&mut self, r: ReplicaId, why: String) -> Result<(), Stopped> {
        let t0 = Instant::now();
        let was_leader = r == self.replicas.leader();
        let ring_stays_on = if was_leader {
            self.lose_leader(r).map_err(|why| self.halt(why))?
        } else {
            self.drop_follower_from_ring(r)
        };
        if let Some(fast) = &self.fast {
            // Posted outputs wait for this replica's votes no more.
            fast.commit_gone(r);
        }
        if !ring_stays_on {
            self.fast_off();
        }
        let removal = self.replicas.remove(r);
        for t in &self.tasks {
            if let Some(s) = t.slot(r) {
                if !s.is_dead() {
                    self.doomed.push(s.tid());
                }
            }
        }
        let us = t0.elapsed().as_micros() as u64;
        self.emit(
            Event::new("run", "vote", "kill")
                .replica(r)
                .duration_us(us)
                .message(format!("{why}: replica {r} voted out")),
        );
        // Every other task may have been waiting on the voted-out replica.
        for t in 0..self.tasks.len() {
            if !self.tasks[t].is_finished() {
                if was_leader && matches!(self.tasks[t].phase(), Phase::Leader { .. } | Phase::LeaderFirst { .. }) {
                    // The dead leader was executing this call: the new one runs it again,
                    // once the old one is out of it (`finish_vote_outs`), unless the old
                    // one finished it and so took input or gave output for everyone.
                    if let Some(tid) = self.tasks[t].slot(r).map(|s| s.tid()) {
                        let in_call = self.where_in_call(tid);
                        if !matches!(in_call, InCall::Finished(_)) {
                            if let Some(why) = self.moved_a_file_offset(t, r) {
                                return Err(self.halt(why));
                            }
                        }
                        match in_call {
                            InCall::Inside => self.doomed_in_calls.push(tid),
                            InCall::Left => {}
                            InCall::Finished(ret) => {
                                if let Phase::Leader { nr, class, .. } = self.tasks[t].phase() {
                                    if call_had_effect(class, ret) {
                                        return Err(self.halt(format!(
                                            "the voted-out leader had finished {}() for every replica (it returned \
                                             {ret}) before its result was handed on: running it again would lose \
                                             or repeat what it did",
                                            lockstep_trace::syscalls::name(nr)
                                        )));
                                    }
                                }
                            }
                        }
                    }
                    self.tasks[t].recollect();
                    self.tasks[t].signals.clear_interrupted();
                }
                self.unsettled.push(t);
            }
        }
        if was_leader {
            let Removal::NewLeader(new) = removal else {
                return Err(self.halt("no replica left".into()));
            };
            let ring = if ring_stays_on {
                format!(", in the fast path's ring too (it goes on from replica {r}'s last record)")
            } else {
                String::new()
            };
            self.emit(
                Event::new("run", "leader", "elect")
                    .replica(new)
                    .message(format!("replica {new} is the new leader{ring}")),
            );
            self.leader_replaced_for_maps();
            // The faulty leader may have run inputs ahead that the others have not consumed:
            // those inputs were taken from the outside world and cannot be replayed.
            let lost = self
                .tasks
                .iter()
                .any(|t| !t.is_finished() && t.slot(new).is_some_and(|s| s.consumed() < t.inputs.produced()));
            if lost {
                return Err(self.halt("the faulty leader had run inputs ahead of the other replicas".into()));
            }
        }
        if self.opts.reintegrate && self.replicas.short() {
            self.reintegration_due = true;
        }
        Ok(())
    }

    /// Describes the divergences found while the last stop was handled, then kills the
    /// threads of the replicas voted out (their memory is read for the description).
    fn finish_vote_outs(&mut self) {
        self.describe_divergences();
        for tid in std::mem::take(&mut self.doomed) {
            self.be.kill(tid);
        }
        let in_calls = std::mem::take(&mut self.doomed_in_calls);
        let stuck = wait_out_of_calls(&self.be, &in_calls, CALL_EXIT_LIMIT);
        self.stuck_in_calls.extend(stuck);
    }

    /// After a vote-out: meetings that were waiting for the voted-out replica decide, and
    /// calls its dead leader was executing run again with the new leader.
    fn settle_after_vote_out(&mut self) -> Result<(), Stopped> {
        if let Some(tid) = self.stuck_in_calls.first() {
            return Err(self.halt(format!(
                "thread {tid} of the voted-out leader did not leave its call within {CALL_EXIT_LIMIT:?} of \
                 being killed, so the call may still take input or give output that its new leader would repeat"
            )));
        }
        while let Some(t) = self.unsettled.pop() {
            match self.tasks[t].phase() {
                Phase::All { .. } | Phase::Followers { .. } => self.maybe_complete_all(t)?,
                Phase::Collect => self.try_decide(t)?,
                Phase::Leader { .. } | Phase::LeaderFirst { .. } => {}
            }
        }
        Ok(())
    }

    /// Stops everything: corruption was detected and cannot be masked.
    pub fn halt(&mut self, why: String) -> Stopped {
        self.emit(
            Event::new("run", "halt", "halt")
                .message(format!("{why}; stopping all replicas (exit {})", exit::DETECTED)),
        );
        self.kill_everything();
        self.flush_events();
        Stopped::Halt
    }

    fn print_stats(&mut self) {
        if self.opts.stats {
            self.stats.fast_calls = self.fast_calls();
            self.stats.order = self.order_counts();
            self.stats.checked_outputs = self
                .fast
                .as_ref()
                .filter(|_| self.opts.output_check.is_strict())
                .map(|f| f.checked_outputs);
            self.stats.commits = self.fast.as_ref().and_then(|f| f.committer()).map(|c| c.counts());
            self.stats.monitor = self.be.counts();
            eprint!("{}", self.stats.render(self.started.elapsed()));
        }
    }

    /// Logical pid -> replica-local pid.
    pub fn to_local(&self, r: ReplicaId, pid: i32) -> i32 {
        self.replicas.to_local(r, pid)
    }

    /// Replica-local pid -> logical pid.
    pub fn to_logical(&self, r: ReplicaId, pid: i32) -> i32 {
        self.replicas.to_logical(r, pid)
    }
}

pub(crate) enum TrappedInsn {
    Rdtsc(u8),
    Cpuid,
}

/// Where a voted-out leader's thread is in the call it was running for everyone.
enum InCall {
    /// Still in the kernel.
    Inside,
    /// Stopped with the call's result not yet handed on (a stop the monitor has not
    /// handled: another task's stop was handled first).
    Finished(i64),
    /// Out of it otherwise (at another stop, or gone).
    Left,
}

/// Whether a call of `class` that returned `ret` changed the world: took input, gave
/// output, or made a descriptor (an accepted connection, a pipe).
fn call_had_effect(class: Class, ret: i64) -> bool {
    match class {
        Class::FdCreate => ret >= 0,
        _ => ret > 0,
    }
}

impl Session {
    /// Whether the call that the leader lost in `task` was running may have moved a
    /// regular file's offset (a `read`, `write`, `readv` or `writev`, which the kernel
    /// does not undo when the thread dies, and which completes in microseconds): run
    /// again, it would skip or repeat data. The reason to stop the run instead, if so.
    /// The descriptor is looked at in another replica, which shares the file with the lost
    /// leader `lost`.
    fn moved_a_file_offset(&self, task: TaskId, lost: ReplicaId) -> Option<String> {
        const MOVE_THE_OFFSET: [i64; 4] = [libc::SYS_read, libc::SYS_write, libc::SYS_readv, libc::SYS_writev];
        let Phase::Leader { nr, args, .. } = self.tasks[task].phase() else {
            return None;
        };
        let other = self.live_slots(task).into_iter().find(|&x| x != lost)?;
        let pid = self.slot(task, other).tgid();
        (MOVE_THE_OFFSET.contains(&(nr as i64)) && self.be.fd_is_regular_file(pid, args[0] as i32)).then(|| {
            format!(
                "the leader was lost inside {}() of a regular file (descriptor {}): it may have moved the file's \
                 offset, so running the call again could skip or repeat data",
                lockstep_trace::syscalls::name(nr),
                args[0] as i32
            )
        })
    }

    /// Takes thread `tid`'s pending stop, if it has one, to see where it is in its call.
    fn where_in_call(&self, tid: Tid) -> InCall {
        match self.be.try_wait_tid(tid) {
            Ok(None) => InCall::Inside,
            Ok(Some(Stop::SyscallExit)) => match self.be.regs(tid) {
                Ok(regs) => InCall::Finished(regs.rax as i64),
                Err(_) => InCall::Left,
            },
            Ok(Some(_)) | Err(_) => InCall::Left,
        }
    }
}

/// How long a killed leader's thread may take to leave the call it was running for
/// everyone. A thread woken by SIGKILL leaves at once unless the kernel holds it in an
/// uninterruptible wait (a disk or a network file system that does not answer).
pub(crate) const CALL_EXIT_LIMIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Waits (at most `limit` in all) until each of the killed threads `tids` is out of the
/// kernel call it was in: at its exit stop (ptrace `t`), a zombie, or gone. Returns the
/// threads still inside when the time was up.
pub(crate) fn wait_out_of_calls(be: &dyn Backend, tids: &[Tid], limit: std::time::Duration) -> Vec<Tid> {
    let deadline = Instant::now() + limit;
    let mut pause = std::time::Duration::from_micros(20);
    let mut inside: Vec<Tid> = tids.to_vec();
    loop {
        inside.retain(|&tid| !left_its_call(be, tid));
        if inside.is_empty() || Instant::now() >= deadline {
            return inside;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(std::time::Duration::from_millis(5));
    }
}

/// Whether killed thread `tid` has left the kernel call it was in. Once SIGKILL is sent a
/// thread is runnable (`R`) until it runs; its next state is the exit stop, a zombie, or
/// nothing at all (a thread in an uninterruptible wait stays `D`).
fn left_its_call(be: &dyn Backend, tid: Tid) -> bool {
    // None: reaped.
    matches!(thread_state(be, tid), None | Some('t' | 'T' | 'Z' | 'X' | 'x'))
}

/// Thread `tid`'s state letter in `/proc/TID/stat` (`R`, `S`, `t`, `Z`...); None when the
/// thread is gone or the line cannot be read.
pub(crate) fn thread_state(be: &dyn Backend, tid: Tid) -> Option<char> {
    let stat = be.proc_read(tid, "stat").ok()?;
    // The state follows the command name, which is in parentheses and may hold any byte.
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.trim_start().chars().next())
}

pub fn describe_death(d: Death) -> String {
    match d {
        Death::Exited(c) => format!("exited with {c}"),
        Death::Killed(s) => format!("killed by signal {s}"),
    }
}

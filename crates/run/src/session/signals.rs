//! Asynchronous signals. Each replica raises its own copies (SIGCHLD from its own
//! children, SIGALRM from its own timers); they are all suppressed at their delivery stops.
//! The leader's copy, or a signal lockstep itself received and forwards, decides what the
//! program gets, and it gets it at the same point in every replica:
//!
//! - The leader is blocked in a call it runs for everyone (an input, `pselect`, `pause`,
//!   `nanosleep`, `wait4`, ...) and the signal interrupts it: the leader takes the signal
//!   there, natively, and every follower, parked at the entry of the same call, takes it
//!   "inside" the same call (`deliver_interrupted`). The call ends the same way everywhere
//!   (EINTR, or restarted after the handler under `SA_RESTART`), and a mask that the call
//!   itself installs (`pselect`, `ppoll`, `epoll_pwait`, `sigsuspend`) is in force while
//!   the handler runs, as natively.
//! - Otherwise the signal waits for the task's next rendezvous. A call the leader runs for
//!   everyone then runs with the signal pending in the leader (so it returns at once if it
//!   would block, like a native call the signal reached first), and the followers get the
//!   signal when they are released from the call (`mirror`). Any other call is rewound and
//!   the handler runs just before it in every replica (`deliver_before`).
//! - A fatal signal kills the logical process in every replica; an ignored one is dropped.

use crate::backend::{Backend, Resume};
use crate::options::CompareMode;
use crate::session::{
    Arrival, Phase, ProcId, ReplicaId, Session, SlotState, Stopped, TaskId, TrappedInsn, FORWARDED, RECEIVED,
};
use lockstep_core::le;
use lockstep_trace::syscalls::{self, Class};
use lockstep_trace::{ptrace, Regs, Tid};
use std::sync::atomic::Ordering;

/// A set of signals (bit N-1 for signal N): those lockstep sent to a thread on purpose and
/// lets through at their delivery stops.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SigSet(u64);

impl SigSet {
    fn bit(sig: i32) -> u64 {
        debug_assert!((1..=64).contains(&sig), "signal {sig}");
        1u64 << ((sig - 1) & 63)
    }

    pub fn add(&mut self, sig: i32) {
        self.0 |= Self::bit(sig);
    }

    pub fn contains(self, sig: i32) -> bool {
        self.0 & Self::bit(sig) != 0
    }

    /// Removes `sig`; whether it was there.
    pub fn take(&mut self, sig: i32) -> bool {
        let had = self.contains(sig);
        self.0 &= !Self::bit(sig);
        had
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    pub fn iter(self) -> impl Iterator<Item = i32> {
        (1..=64).filter(move |&s| self.contains(s))
    }
}

/// The leader's call that a signal interrupted: how the kernel left it at the syscall exit,
/// kept while the leader (rewound meanwhile) goes on to the signal's delivery stop.
pub struct Interrupted {
    pub nr: u64,
    /// The leader's registers at the exit: the restart code in `rax`, `orig_rax` the call.
    pub regs: Regs,
}

/// What a task knows about asynchronous signals on their way to it.
#[derive(Default)]
pub struct TaskSignals {
    /// Signals waiting to be delivered at this task's next rendezvous.
    pending: Vec<i32>,
    /// Since when the first of `pending` has waited (see `catch_up.rs`).
    pending_since: Option<std::time::Instant>,
    /// We interrupted the current execution to deliver a pending signal.
    kicked: bool,
    /// The leader's call that a signal interrupted, until the signal's delivery stop.
    interrupted: Option<Interrupted>,
    /// Signals the leader takes at the current call, for the followers when they are
    /// released from it.
    mirror: SigSet,
    /// What the leader's own copy of each signal carried (sender, code, timer value,
    /// child status), for the copies lockstep raises in every replica.
    leader_siginfo: Vec<(i32, libc::siginfo_t)>,
    /// The call the last handler ran before (`deliver_before`). Met again with a signal
    /// pending, the call runs first: a timer that fires faster than its handler and a
    /// rendezvous take together (a loaded machine) would otherwise rewind that call for
    /// ever. Natively the kernel runs the call, then the handler.
    rewound_for: Option<(u64, [u64; 6])>,
}

impl TaskSignals {
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Whether a signal pending at call `nr` with `args` is delivered before it: not when
    /// the last handler already ran before this very call (see `rewound_for`).
    pub fn deliver_before_call(&mut self, nr: u64, args: [u64; 6]) -> bool {
        if self.rewound_for == Some((nr, args)) {
            self.rewound_for = None;
            return false;
        }
        self.has_pending()
    }

    /// The oldest pending signal.
    pub fn first_pending(&self) -> Option<i32> {
        self.pending.first().copied()
    }

    /// Where `sig` is in the pending queue.
    pub fn pending_index(&self, sig: i32) -> Option<usize> {
        self.pending.iter().position(|&s| s == sig)
    }

    /// Since when the oldest pending signal has waited.
    pub fn pending_since(&self) -> Option<std::time::Instant> {
        self.pending_since
    }

    /// A catch-up gave up: the pending signals wait afresh.
    pub fn restart_wait(&mut self) {
        self.pending_since = Some(std::time::Instant::now());
    }

    /// Whether lockstep interrupted the current execution to deliver a signal.
    pub fn kicked(&self) -> bool {
        self.kicked
    }

    pub fn clear_kick(&mut self) {
        self.kicked = false;
    }

    /// A signal interrupted the leader's call `it.nr`.
    pub fn interrupt(&mut self, it: Interrupted) {
        self.interrupted = Some(it);
    }

    /// Whatever interrupted the leader's call is over.
    pub fn clear_interrupted(&mut self) {
        self.interrupted = None;
    }

    /// Signals the leader takes at the current call.
    pub fn mirror(&self) -> SigSet {
        self.mirror
    }

    /// The current call is over: its mirrored signals were handed out.
    pub fn take_mirror(&mut self) -> SigSet {
        std::mem::take(&mut self.mirror)
    }
}

/// What one replica's thread expects of signals.
#[derive(Default)]
pub struct SlotSignals {
    /// Signals we sent on purpose: let them through at their delivery stops.
    deliver: SigSet,
    /// Signals the thread sent itself at its current call: its own copy is let through if
    /// it is delivered before the thread's next intercepted syscall (right after the call).
    own: SigSet,
    /// The call this follower runs in place of its own, and what to do at its exit.
    stand_in: Option<StandIn>,
}

impl SlotSignals {
    /// Whether lockstep sent the thread a signal it has not taken yet.
    pub fn expecting_any(&self) -> bool {
        !self.deliver.is_empty()
    }

    /// The thread took `sig` synchronously (`rt_sigtimedwait`): no copy of it is to run a
    /// handler later.
    pub fn taken(&mut self, sig: i32) {
        self.deliver.take(sig);
        self.own.take(sig);
    }

    /// The thread reached its next intercepted call: signals it sent itself before are
    /// ordinary signals from now on.
    pub fn forget_own(&mut self) {
        self.own = SigSet::default();
    }

    /// The follower runs `stand_in` in place of its own call.
    pub fn stand_in(&mut self, stand_in: StandIn) {
        assert!(self.stand_in.is_none(), "one stand-in call at a time");
        self.stand_in = Some(stand_in);
    }

    pub fn take_stand_in(&mut self) -> Option<StandIn> {
        self.stand_in.take()
    }
}

/// What a follower does at the exit of the call it was given in place of its own.
pub struct StandIn {
    /// Registers to put back (its own call's entry state) with `rax` = `ret`.
    pub restore: Option<Regs>,
    pub ret: i64,
    /// Signals to raise in the follower now, before it returns to the program.
    pub signals: SigSet,
    /// A shared file mapping's contents to copy in (its stand-in was an anonymous mmap).
    pub copy: Option<crate::session::shared_map::MapCopy>,
}

/// Whether a signal-delivery stop is the thread's own fault (a bad access, an illegal
/// instruction, a trap) rather than a signal sent to it: the kernel marks those with a
/// positive `si_code`.
pub(crate) fn is_synchronous_fault(sig: i32, info: Option<&libc::siginfo_t>) -> bool {
    let code = info.map_or(0, |i| i.si_code);
    matches!(
        sig,
        libc::SIGSEGV | libc::SIGBUS | libc::SIGILL | libc::SIGFPE | libc::SIGTRAP
    ) && code > 0
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SignalFate {
    Handled,
    Ignored,
    Fatal,
}

impl Session {
    /// A signal-delivery stop of replica `r`'s thread of `task`.
    pub(crate) fn on_signal(&mut self, task: TaskId, r: ReplicaId, sig: i32) -> Result<(), Stopped> {
        let tid = self.slot(task, r).tid();
        let info = self.be.siginfo(tid).ok();
        if sig == libc::SIGSYS && info.is_some_and(|i| i.si_code == SYS_USER_DISPATCH) {
            // The replica's in-process interception found a syscall site (fast path,
            // `shim/lockstep_fast.c`): synchronous, at the same site in every replica, and
            // handled inside the replica. It is delivered at once.
            self.be.steer().resume(tid, Resume::Signal(sig));
            return Ok(());
        }
        if let Some(done) = self.at_ring_raise(task, r, sig, info.as_ref()) {
            return done;
        }
        if r == self.replicas.leader() {
            if let Some(native) = info.filter(|i| !raised_by_lockstep(i) && !is_synchronous_fault(sig, Some(i))) {
                self.remember_leader_siginfo(task, sig, native);
            }
        }
        if r == self.replicas.leader() && self.tasks[task].signals.interrupted.is_some() {
            let sent = self.slot(task, r).signals.deliver.contains(sig);
            let nr = self.tasks[task]
                .signals
                .interrupted
                .as_ref()
                .map(|i| i.nr)
                .unwrap_or(u64::MAX);
            let tgid = self.slot(task, r).tgid();
            if (sent || self.disposition(tgid, sig) == SignalFate::Handled) && self.followers_parked_at(task, nr) {
                self.slot_mut(task, r).signals.deliver.take(sig);
                return self.deliver_interrupted(task, sig);
            }
            // Not deliverable as an interruption: the leader, already rewound, runs its
            // call again and the signal waits for the next rendezvous like any other.
            self.tasks[task].signals.interrupted = None;
            if self.slot_mut(task, r).signals.deliver.take(sig) {
                self.async_signal(task, sig);
                self.resume_same(task, r);
                return Ok(());
            }
        }
        // The process is being killed by a fatal signal lockstep sent to every replica
        // (`kill_process`): whatever stops this thread now (its own copy of the signal,
        // suppressed before the kill began, or the SIGSEGV the kernel forces on an exec
        // that such a signal interrupted), it dies by that signal, as the others do.
        let process = self.tasks[task].process();
        if self.processes[process].exiting && !self.slot(task, r).signals.deliver.contains(sig) {
            if let Some(fatal) = self.slot(task, r).signals.deliver.iter().next() {
                self.slot_mut(task, r).signals.deliver.take(fatal);
                self.be.steer().resume(tid, Resume::Signal(fatal));
                return Ok(());
            }
        }
        // `deliver` before `own_signals`: one delivery consumes one mark, in this order.
        if self.slot_mut(task, r).signals.deliver.take(sig) {
            // Lockstep's own copy (tgkill) stands in for the leader's: the handler sees
            // what the leader's copy carried, in every replica.
            if let Some(leader_info) = self
                .leader_siginfo(task, sig)
                .filter(|_| info.is_some_and(|i| raised_by_lockstep(&i)))
            {
                self.be.steer().set_siginfo(tid, &leader_info);
            }
            self.be.steer().resume(tid, Resume::Signal(sig));
            return Ok(());
        }
        if self.slot_mut(task, r).signals.own.take(sig) {
            self.be.steer().resume(tid, Resume::Signal(sig));
            return Ok(());
        }
        if is_synchronous_fault(sig, info.as_ref()) {
            let regs = self.be.regs(tid).ok();
            if let Some(regs) = regs {
                if sig == libc::SIGSEGV {
                    match self.trapped_insn(tid, regs.rip) {
                        Some(TrappedInsn::Rdtsc(len)) => return self.arrive(task, r, regs, Arrival::Rdtsc { len }),
                        Some(TrappedInsn::Cpuid) => {
                            let arrival = Arrival::Cpuid {
                                leaf: regs.rax as u32,
                                subleaf: regs.rcx as u32,
                            };
                            return self.arrive(task, r, regs, arrival);
                        }
                        None => {}
                    }
                }
                // SAFETY: si_addr is valid for these fault signals.
                let addr = info.map(|i| unsafe { i.si_addr() } as u64).unwrap_or(0);
                return self.arrive(task, r, regs, Arrival::Fault { sig, addr });
            }
        }
        // Asynchronous: suppressed now, delivered at the same point in every replica.
        // The leader's copy stands for all replicas (each replica generates its own).
        if r == self.replicas.leader() {
            self.async_signal(task, sig);
        }
        self.resume_same(task, r);
        Ok(())
    }

    fn remember_leader_siginfo(&mut self, task: TaskId, sig: i32, info: libc::siginfo_t) {
        let kept = &mut self.tasks[task].signals.leader_siginfo;
        match kept.iter_mut().find(|(s, _)| *s == sig) {
            Some(entry) => entry.1 = info,
            None => kept.push((sig, info)),
        }
    }

    fn forget_leader_siginfo(&mut self, task: TaskId, sig: i32) {
        self.tasks[task].signals.leader_siginfo.retain(|(s, _)| *s != sig);
    }

    pub(crate) fn leader_siginfo(&self, task: TaskId, sig: i32) -> Option<libc::siginfo_t> {
        self.tasks[task]
            .signals
            .leader_siginfo
            .iter()
            .find(|(s, _)| *s == sig)
            .map(|(_, info)| *info)
    }

    /// What the program's process does with `sig`, read from /proc.
    fn disposition(&self, tgid: Tid, sig: i32) -> SignalFate {
        let status = self.be.proc_read(tgid, "status").unwrap_or_default();
        let mask = |key: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
                .unwrap_or(0)
        };
        let bit = 1u64 << (sig - 1);
        // A blocked signal never reaches a delivery stop while blocked, so only the
        // handler and ignore masks matter here.
        if mask("SigCgt:") & bit != 0 {
            return SignalFate::Handled;
        }
        if mask("SigIgn:") & bit != 0 {
            return SignalFate::Ignored;
        }
        match sig {
            libc::SIGCHLD | libc::SIGURG | libc::SIGWINCH | libc::SIGCONT => SignalFate::Ignored,
            // Job control is not replicated: stopping one replica would look like a hang.
            libc::SIGSTOP | libc::SIGTSTP | libc::SIGTTIN | libc::SIGTTOU => SignalFate::Ignored,
            _ => SignalFate::Fatal,
        }
    }

    /// An asynchronous signal for `task` (its leader copy, or forwarded by lockstep).
    pub(crate) fn async_signal(&mut self, task: TaskId, sig: i32) {
        let tgid = self.slot(task, self.replicas.leader()).tgid();
        match self.disposition(tgid, sig) {
            SignalFate::Ignored => {}
            SignalFate::Fatal => self.kill_process(self.tasks[task].process(), sig),
            SignalFate::Handled => {
                if !self.tasks[task].signals.pending.contains(&sig) {
                    self.tasks[task].signals.pending.push(sig);
                }
                self.tasks[task]
                    .signals
                    .pending_since
                    .get_or_insert_with(std::time::Instant::now);
                self.kick(task);
            }
        }
    }

    /// Removes the `i`th pending signal of `task`; the next one, if any, waits from now.
    pub(crate) fn take_pending(&mut self, task: TaskId, i: usize) -> i32 {
        let t = &mut self.tasks[task];
        let sig = t.signals.pending.remove(i);
        t.signals.pending_since = (!t.signals.pending.is_empty()).then(std::time::Instant::now);
        self.withdraw_ring_signal(task, sig);
        sig
    }

    /// Interrupts a task that is blocked in a syscall so a pending signal can be delivered.
    fn kick(&mut self, task: TaskId) {
        let (nr, leader_only) = match self.tasks[task].phase() {
            Phase::Leader { nr, .. } | Phase::LeaderFirst { nr, .. } => (nr, true),
            Phase::All { nr, .. } => (nr, false),
            _ => {
                self.fast_kick(task);
                return;
            }
        };
        if !lockstep_trace::syscalls::describe(nr)
            .map(|d| d.blocking)
            .unwrap_or(false)
        {
            return;
        }
        self.tasks[task].signals.kicked = true;
        for r in self.live_slots(task) {
            if (!leader_only || r == self.replicas.leader()) && self.slot(task, r).state() == SlotState::Executing {
                self.be.steer().interrupt(self.slot(task, r).tid());
            }
        }
    }

    /// Kills logical process `p` with `sig` in every replica, at whatever point each is:
    /// the signal is fatal and unhandled, so no user code runs after it anyway.
    fn kill_process(&mut self, p: ProcId, sig: i32) {
        if self.debug {
            eprintln!("lockstep debug: killing process {p} with signal {sig}");
        }
        self.processes[p].exiting = true;
        let tasks = self.processes[p].tasks.clone();
        for &t in &tasks {
            self.abandon_catch_up(t);
        }
        for t in tasks {
            for r in self.live_slots(t) {
                let slot = self.slot(t, r);
                if slot.state() == SlotState::Dead {
                    continue;
                }
                let (tgid, tid, state) = (slot.tgid(), slot.tid(), slot.state());
                self.slot_mut(t, r).signals.deliver.add(sig);
                self.be.steer().signal_thread(tgid, tid, sig);
                if matches!(state, SlotState::Arrived | SlotState::Done) {
                    // Parked: let it return (EINTR) so the signal is delivered.
                    let mut regs = self.slot(t, r).regs();
                    if state == SlotState::Arrived {
                        ptrace::skip_with_result(&mut regs, -(libc::EINTR as i64));
                        self.be.steer().set_regs(tid, &regs);
                    }
                    self.resume(t, r, Resume::Run, SlotState::Running);
                }
            }
            self.tasks[t].recollect();
        }
    }

    pub(crate) fn forward_received_signals(&mut self) -> Result<(), Stopped> {
        let got = RECEIVED.swap(0, Ordering::SeqCst);
        if got == 0 {
            return Ok(());
        }
        for sig in FORWARDED {
            if got & (1 << sig) == 0 {
                continue;
            }
            // Like timeout(1) with its process group: every process of the program gets
            // the signal, each through its first live thread.
            for p in 0..self.processes.len() {
                if self.processes[p].exiting {
                    continue;
                }
                let leader = self.replicas.leader();
                let target = self.processes[p].tasks.iter().copied().find(|&t| {
                    !self.tasks[t].is_finished() && self.tasks[t].slot(leader).is_some_and(|s| !s.is_dead())
                });
                if let Some(t) = target {
                    // It comes from outside, the same in every replica: no leader's copy
                    // speaks for it.
                    self.forget_leader_siginfo(t, sig);
                    self.async_signal(t, sig);
                }
            }
        }
        Ok(())
    }

    /// The program is about to send a signal to some of its own processes, each replica
    /// to its own copies (`kill`, `tkill`, `tgkill`, `rt_sigqueueinfo`,
    /// `rt_tgsigqueueinfo`, `pidfd_send_signal`). Deaths by that signal are then expected;
    /// they are voted like any other death. A pid of 0 or below (a process group, or
    /// everyone) marks every process of the program.
    pub(crate) fn note_program_signal(&mut self, task: TaskId, nr: u64, args: &[u64; 6]) {
        let (target, sig) = match nr as i64 {
            libc::SYS_kill | libc::SYS_rt_sigqueueinfo => (Some(args[0] as i32), args[1] as i32),
            libc::SYS_tkill => (self.process_of_tid(args[0] as i32), args[1] as i32),
            libc::SYS_tgkill | libc::SYS_rt_tgsigqueueinfo => (Some(args[0] as i32), args[2] as i32),
            libc::SYS_pidfd_send_signal => (self.pidfd_target(task, args[0] as i32), args[1] as i32),
            _ => return,
        };
        if !(1..=64).contains(&sig) {
            return;
        }
        // A signal to itself reaches each replica right after this very call, at the same
        // point in all of them: each replica's own copy is let through there, as natively
        // (a handler runs before the next instruction, `raise` works).
        let me = self.processes[self.tasks[task].process()].logical_pid;
        let to_self = match nr as i64 {
            libc::SYS_tkill => args[0] as i32 == self.tasks[task].logical_tid(),
            libc::SYS_tgkill | libc::SYS_rt_tgsigqueueinfo => args[1] as i32 == self.tasks[task].logical_tid(),
            _ => matches!(target, Some(pid) if pid == me || pid <= 0),
        };
        if to_self {
            for r in self.live_slots(task) {
                // Blocked, it stays pending in every replica and is delivered where the
                // program unblocks it (the same point everywhere): let it through then.
                if signal_blocked(&self.be, self.slot(task, r).tid(), sig) {
                    self.slot_mut(task, r).signals.deliver.add(sig);
                } else {
                    self.slot_mut(task, r).signals.own.add(sig);
                }
            }
        }
        for p in 0..self.processes.len() {
            let hit = match target {
                Some(pid) if pid > 0 => self.processes[p].logical_pid == pid,
                Some(_) => true,
                // A pidfd we cannot resolve: expect the death anywhere rather than call
                // the program's own kill a fault.
                None => true,
            };
            if hit {
                self.processes[p].sent_by_program.add(sig);
            }
        }
    }

    /// The logical pid of the process that has logical thread `tid`.
    fn process_of_tid(&self, tid: i32) -> Option<i32> {
        let task = self.tasks.iter().find(|t| t.logical_tid() == tid && !t.is_finished())?;
        Some(self.processes[task.process()].logical_pid)
    }

    /// The logical pid a pidfd of the leader's refers to: from its fdinfo for a pidfd, or
    /// from its path for a `/proc/<pid>` directory (each replica's own /proc shows the
    /// program's pids).
    fn pidfd_target(&self, task: TaskId, fd: i32) -> Option<i32> {
        let leader_tgid = self.slot(task, self.replicas.leader()).tgid();
        let info = self.be.proc_read(leader_tgid, &format!("fdinfo/{fd}")).ok()?;
        if let Some(real) = info.lines().find_map(|l| l.strip_prefix("Pid:")) {
            let &(task, _) = self.by_tid.get(&real.trim().parse().ok()?)?;
            return Some(self.processes[self.tasks[task].process()].logical_pid);
        }
        let path = self.be.proc_link(leader_tgid, &format!("fd/{fd}")).ok()?;
        path.to_str()?.strip_prefix("/proc/")?.parse().ok()
    }

    /// A handled signal that is due at a rendezvous, where every replica is stopped at
    /// `nr`. A call the leader runs for everyone runs with the signal pending in the
    /// leader: it ends early exactly as a native call does when a signal is already there
    /// (and `deliver_interrupted` takes over), or completes, and then the signal reaches
    /// every replica right after it. Any other call is rewound and the handler runs first.
    pub(crate) fn deliver_at_rendezvous(
        &mut self,
        task: TaskId,
        nr: u64,
        args: [u64; 6],
        sig: i32,
    ) -> Result<(), Stopped> {
        let class = syscalls::describe(nr).map(|d| self.class_of(task, d, &args));
        let leader_runs = matches!(
            class,
            Some(Class::Input | Class::Output | Class::FdCreate | Class::AllAfterLeader)
        );
        if !leader_runs {
            self.deliver_before(task, nr, args, sig);
            return Ok(());
        }
        self.stats.signals_delivered += 1;
        self.tasks[task].signals.kicked = false;
        if self.debug {
            eprintln!(
                "lockstep debug: signal {sig} pending in task {task} during {}",
                syscalls::name(nr)
            );
        }
        let leader = self.replicas.leader();
        self.raise(task, leader, sig);
        self.tasks[task].signals.mirror.add(sig);
        self.execute(task, nr, args)
    }

    /// Sends `sig` to replica `r`'s thread of `task` and lets it through at delivery.
    pub(crate) fn raise(&mut self, task: TaskId, r: ReplicaId, sig: i32) {
        let (tid, tgid) = (self.slot(task, r).tid(), self.slot(task, r).tgid());
        self.slot_mut(task, r).signals.deliver.add(sig);
        self.be.steer().signal_thread(tgid, tid, sig);
    }

    /// The signals the leader took at this call, for a follower being released from it.
    pub(crate) fn raise_mirrored(&mut self, task: TaskId, f: ReplicaId) {
        let mirror = self.tasks[task].signals.mirror;
        for sig in mirror.iter() {
            self.raise(task, f, sig);
        }
    }

    /// Whether every live follower is parked at the entry of the call `nr` that the leader
    /// ran (with `--compare io`: at that very input, not behind it).
    pub(crate) fn followers_parked_at(&self, task: TaskId, nr: u64) -> bool {
        let produced = self.tasks[task].inputs.produced();
        let io = self.opts.compare == CompareMode::Io;
        self.live_slots(task).iter().all(|&f| {
            let s = self.slot(task, f);
            f == self.replicas.leader()
                || s.state() == SlotState::Dead
                || (s.state() == SlotState::Arrived
                    && matches!(s.arrival(), Some(Arrival::Syscall { nr: n, .. }) if n == nr)
                    && (!io || s.consumed() == produced))
        })
    }

    /// The leader's call `nr` was interrupted and `sig` is to run its handler: the leader
    /// takes it where it is, and each follower takes it inside the same call. A follower's
    /// own call is replaced by `ppoll(NULL, 0, NULL, mask)` (with the temporary mask its
    /// call would install, if any), which returns at once because the signal is pending;
    /// at its exit the follower's registers are put back with the leader's restart code,
    /// so the kernel ends or restarts the call as it does in the leader.
    fn deliver_interrupted(&mut self, task: TaskId, sig: i32) -> Result<(), Stopped> {
        let it = self.tasks[task]
            .signals
            .interrupted
            .take()
            .expect("an interrupted call");
        self.stats.signals_delivered += 1;
        let ret = it.regs.rax as i64;
        let leader = self.replicas.leader();
        let ltid = self.slot(task, leader).tid();
        let lead_args = ptrace::syscall_args(&it.regs);
        if self.debug {
            eprintln!(
                "lockstep debug: signal {sig} interrupts {} = {ret} in task {task}",
                syscalls::name(it.nr)
            );
        }
        let mut signals = std::mem::take(&mut self.tasks[task].signals.mirror);
        signals.add(sig);
        for f in self.live_slots(task) {
            if f == leader || self.slot(task, f).state() != SlotState::Arrived {
                continue;
            }
            let entry = self.slot(task, f).regs();
            let ftid = self.slot(task, f).tid();
            let fargs = ptrace::syscall_args(&entry);
            copy_time_left(&self.be, ltid, ftid, it.nr, &lead_args, &fargs);
            for s in signals.iter() {
                self.raise(task, f, s);
            }
            let (mask, size) = temporary_mask(&self.be, ftid, it.nr, &fargs);
            let mut regs = entry;
            regs.orig_rax = libc::SYS_ppoll as u64;
            (regs.rdi, regs.rsi, regs.rdx, regs.r10, regs.r8) = (0, 0, 0, mask, size);
            self.be.steer().set_regs(ftid, &regs);
            self.slot_mut(task, f)
                .signals
                .stand_in(crate::session::signals::StandIn {
                    restore: Some(entry),
                    ret,
                    signals: SigSet::default(),
                    copy: None,
                });
            self.resume(task, f, Resume::ToExit, SlotState::Executing);
        }
        self.be.steer().set_regs(ltid, &it.regs);
        self.resume(task, leader, Resume::Signal(sig), SlotState::Running);
        Ok(())
    }

    /// A follower reached the exit of the call it ran in place of its own (see
    /// `deliver_interrupted`, and descriptor installs that carry signals).
    pub(crate) fn finish_stand_in(&mut self, task: TaskId, f: ReplicaId, s: StandIn) -> Result<(), Stopped> {
        let tid = self.slot(task, f).tid();
        if let Some(mut regs) = s.restore {
            regs.rax = s.ret as u64;
            self.be.steer().set_regs(tid, &regs);
        }
        if let Some(copy) = &s.copy {
            let got = self.be.regs(tid).map(|r| r.rax as i64).unwrap_or(-1);
            self.fill_map_copy(task, f, got, copy)?;
            if !self.replicas.is_alive(f) {
                return Ok(());
            }
        }
        for sig in s.signals.iter() {
            self.raise(task, f, sig);
        }
        self.resume(task, f, Resume::Run, SlotState::Running);
        Ok(())
    }

    /// Delivers `sig` to every replica just before the syscall they are stopped at: the
    /// call is skipped and rewound, so it runs again once the handler returns.
    fn deliver_before(&mut self, task: TaskId, nr: u64, args: [u64; 6], sig: i32) {
        self.stats.signals_delivered += 1;
        self.tasks[task].signals.kicked = false;
        if self.debug {
            eprintln!(
                "lockstep debug: delivering signal {sig} to task {task} before {}",
                syscalls::name(nr)
            );
        }
        self.tasks[task].signals.rewound_for = Some((nr, args));
        for r in self.live_slots(task) {
            let mut regs = self.slot(task, r).regs();
            ptrace::rewind_to_syscall(&mut regs, nr);
            let (tid, tgid) = (self.slot(task, r).tid(), self.slot(task, r).tgid());
            self.be.steer().set_regs(tid, &regs);
            self.slot_mut(task, r).signals.deliver.add(sig);
            self.be.steer().signal_thread(tgid, tid, sig);
            self.resume(task, r, Resume::Run, SlotState::Running);
        }
    }
}

/// Whether a pending signal is one lockstep raised itself with `tgkill`: the replicas run
/// in their own pid namespaces, where a sender outside (the monitor) shows as pid 0.
fn raised_by_lockstep(info: &libc::siginfo_t) -> bool {
    // SAFETY: si_pid is valid for SI_TKILL signals, which is checked first.
    info.si_code == libc::SI_TKILL && unsafe { info.si_pid() } == 0
}

/// `si_code` of a SIGSYS raised by Syscall User Dispatch.
const SYS_USER_DISPATCH: i32 = 2;

/// Whether thread `tid` blocks `sig` (its `SigBlk` in /proc).
pub(super) fn signal_blocked(be: &dyn Backend, tid: Tid, sig: i32) -> bool {
    let Ok(status) = be.proc_read(tid, "status") else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("SigBlk:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .is_some_and(|mask| mask & (1u64 << (sig - 1)) != 0)
}

/// The signal mask that call `nr` installs while it waits, as (pointer, size) in the
/// calling thread: (0, 8) for calls that install none.
fn temporary_mask(be: &dyn Backend, tid: Tid, nr: u64, args: &[u64; 6]) -> (u64, u64) {
    const SIGSET: u64 = 8;
    match nr as i64 {
        libc::SYS_ppoll => (args[3], args[4]),
        libc::SYS_epoll_pwait | libc::SYS_epoll_pwait2 => (args[4], args[5]),
        libc::SYS_rt_sigsuspend => (args[0], args[1]),
        // The sixth argument points at { const sigset_t *ss; size_t ss_len; }.
        libc::SYS_pselect6 if args[5] != 0 => {
            let mut pair = [0u8; 16];
            match be.read(tid, args[5], &mut pair) {
                Ok(()) => (le::u64_at(&pair, 0), le::u64_at(&pair, 8)),
                Err(_) => (0, SIGSET),
            }
        }
        _ => (0, SIGSET),
    }
}

/// Copies the time left that an interrupted relative sleep wrote in the leader into the
/// follower (the kernel writes it only when the sleep is interrupted).
fn copy_time_left(be: &dyn Backend, leader: Tid, follower: Tid, nr: u64, lead: &[u64; 6], own: &[u64; 6]) {
    const TIMER_ABSTIME: u64 = 1;
    let (l, f) = match nr as i64 {
        libc::SYS_nanosleep => (lead[1], own[1]),
        libc::SYS_clock_nanosleep if lead[1] & TIMER_ABSTIME == 0 => (lead[3], own[3]),
        _ => return,
    };
    if l == 0 || f == 0 {
        return;
    }
    let mut ts = [0u8; 16];
    if be.read(leader, l, &mut ts).is_ok() {
        // As for any copy into a follower: a refused write shows in the vote.
        let _judged_by_the_vote = be.write(follower, f, &ts);
    }
}

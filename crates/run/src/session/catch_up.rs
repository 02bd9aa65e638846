//! Signals for a task that makes no system call. A pending signal normally waits for the
//! task's next rendezvous (`signals.rs`), but a program that computes without calls
//! (`alarm(1)` then a CPU loop, a timeout around pure computation) never reaches one: the
//! signal would wait forever.
//!
//! Without branch counters (none here) there is no exact instruction count to meet at, so
//! the replicas meet at an identical register state instead:
//!
//! 1. Every replica's thread is interrupted where it runs (`Stopping` → `Parked`).
//! 2. If every replica is in the same state, the signal goes in there.
//! 3. Otherwise the leader's state is the target. Each other replica runs on with an
//!    execution breakpoint at the target's instruction and stops at each hit; it is parked
//!    at the hit whose registers equal the target's (`Hunting` → `Matched`), and the
//!    signal then goes into every replica at that state.
//! 4. A replica that does not meet the target within the budget (it was already past it,
//!    or the state never recurs) ends the attempt: the signal then goes into every replica
//!    where it is, said once on stderr. Each replica still sees a valid schedule of the
//!    signal, but not the same one: if their outputs then differ, that is a divergence.
//!
//! A replica reaching a syscall or any other stop during the attempt ends it: the signal
//! then waits for that rendezvous as usual.

use crate::backend::{Backend, Resume};
use crate::session::{Phase, ReplicaId, Session, SlotState, TaskId};
use lockstep_core::Event;
use lockstep_trace::{ptrace, Regs, Stop};
use std::time::{Duration, Instant};

/// How long a signal may wait for a rendezvous before the replicas are stopped to take it.
pub const CATCH_UP_AFTER: Duration = Duration::from_millis(200);
/// How long the replicas may hunt for the leader's state.
const HUNT_TIME: Duration = Duration::from_millis(300);
/// How many breakpoint hits one replica may take while hunting.
const HUNT_HITS: u32 = 100_000;

// One per replica of one task, and only during an attempt: boxing the registers would
// only add allocations.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Copy, Debug)]
enum Hunt {
    /// Interrupted; its stop has not come yet.
    Stopping,
    /// Stopped where the interrupt found it.
    Parked(Regs),
    /// Running towards the target, with a breakpoint at the target's instruction.
    Hunting { hits: u32 },
    /// Stopped in the target's state.
    Matched,
}

pub struct CatchUp {
    sig: i32,
    target: Option<Regs>,
    hunt_until: Option<Instant>,
    replicas: Vec<(ReplicaId, Hunt)>,
}

impl CatchUp {
    fn hunt(&self, r: ReplicaId) -> Option<Hunt> {
        self.replicas.iter().find(|(id, _)| *id == r).map(|&(_, h)| h)
    }

    fn set(&mut self, r: ReplicaId, hunt: Hunt) {
        if let Some(entry) = self.replicas.iter_mut().find(|(id, _)| *id == r) {
            entry.1 = hunt;
        }
    }
}

/// Whether two threads stopped in user code are in the same state: every register, with
/// the flags the debug machinery itself sets (trap, resume) masked out, and without
/// `orig_rax`, which only says how the thread entered the kernel to stop.
fn same_state(a: &Regs, b: &Regs) -> bool {
    const DEBUG_FLAGS: u64 = (1 << 8) | (1 << 16);
    let mut a = *a;
    let mut b = *b;
    a.eflags &= !DEBUG_FLAGS;
    b.eflags &= !DEBUG_FLAGS;
    (a.orig_rax, b.orig_rax) = (0, 0);
    regs_bytes(&a) == regs_bytes(&b)
}

/// The registers as bytes, for comparing every field at once (called at each breakpoint
/// hit, so without a copy).
pub(super) fn regs_bytes(r: &Regs) -> &[u8] {
    // SAFETY: user_regs_struct is plain u64 fields without padding; the slice borrows `r`.
    unsafe { std::slice::from_raw_parts(r as *const Regs as *const u8, std::mem::size_of::<Regs>()) }
}

impl Session {
    /// Starts a catch-up for every task whose signal has waited too long for a rendezvous
    /// while all its replicas run, and ends hunts that ran out of time.
    pub(crate) fn catch_up_signals(&mut self) {
        let now = Instant::now();
        for task in 0..self.tasks.len() {
            if let Some(until) = self.tasks[task].catch_up.as_ref().and_then(|c| c.hunt_until) {
                if now >= until {
                    self.finish_catch_up(task, false);
                }
                continue;
            }
            let t = &self.tasks[task];
            let due = t
                .signals
                .pending_since()
                .is_some_and(|since| now.duration_since(since) >= CATCH_UP_AFTER);
            if due && self.ring_takes_signals(task) {
                // The leader makes calls on the fast path: it takes the signal at one.
                self.tasks[task].signals.restart_wait();
                continue;
            }
            let t = &self.tasks[task];
            if !due
                || t.is_finished()
                || t.catch_up.is_some()
                || t.phase() != Phase::Collect
                || t.waiting_since().is_some()
            {
                continue;
            }
            if self.injection_stepping() || self.processes[t.process()].exiting {
                continue;
            }
            let live = self.live_slots(task);
            // A replica in a stop the event loop has not taken yet (at a syscall, most
            // likely) is about to arrive: an interrupt now would stay pending past it.
            if live.iter().any(|&r| {
                self.slot(task, r).state() != SlotState::Running || in_trace_stop(&self.be, self.slot(task, r).tid())
            }) {
                continue;
            }
            let Some(sig) = self.tasks[task].signals.first_pending() else {
                continue;
            };
            for &r in live.iter() {
                self.be.steer().interrupt(self.slot(task, r).tid());
            }
            self.tasks[task].catch_up = Some(CatchUp {
                sig,
                target: None,
                hunt_until: None,
                replicas: live.iter().map(|&r| (r, Hunt::Stopping)).collect(),
            });
        }
    }

    /// A stop of replica `r` of `task`, which has a catch-up under way, or has a
    /// breakpoint left armed. Returns true when the stop was the catch-up's own.
    pub(crate) fn on_catch_up_stop(&mut self, task: TaskId, r: ReplicaId, stop: &Stop) -> bool {
        let tid = self.slot(task, r).tid();
        let hit = matches!(stop, Stop::Signal(libc::SIGTRAP))
            && self.be.siginfo(tid).is_ok_and(|i| i.si_code == ptrace::TRAP_HWBKPT);
        let hunt = self.tasks[task].catch_up.as_ref().and_then(|c| c.hunt(r));
        match (hunt, stop) {
            (Some(Hunt::Stopping), Stop::EventStop(_)) => {
                let regs = self.be.regs(tid);
                match regs {
                    Ok(regs) => self.catch_up_mut(task).set(r, Hunt::Parked(regs)),
                    Err(_) => {
                        self.abandon_catch_up(task);
                        return false;
                    }
                }
                self.advance_catch_up(task);
                true
            }
            (Some(Hunt::Hunting { hits }), _) if hit => {
                let target = self.tasks[task].catch_up.as_ref().and_then(|c| c.target);
                let regs = self.be.regs(tid);
                if let (Ok(regs), Some(target)) = (regs, target) {
                    if same_state(&regs, &target) {
                        self.disarm(task, r);
                        self.catch_up_mut(task).set(r, Hunt::Matched);
                        self.advance_catch_up(task);
                        return true;
                    }
                }
                if hits + 1 >= HUNT_HITS {
                    self.finish_catch_up(task, false);
                } else {
                    self.catch_up_mut(task).set(r, Hunt::Hunting { hits: hits + 1 });
                }
                // Stopped at the hit: on it goes, to the next hit or into the signal.
                self.be.steer().resume(tid, Resume::Run);
                true
            }
            _ if hit && self.slot(task, r).breakpoint_armed() => {
                // A hit of a breakpoint left armed by an attempt that ended meanwhile.
                self.disarm(task, r);
                self.be.steer().resume(tid, Resume::Run);
                true
            }
            _ => {
                if self.slot(task, r).breakpoint_armed() {
                    self.disarm(task, r);
                }
                if hunt.is_some() {
                    self.abandon_catch_up(task);
                }
                false
            }
        }
    }

    fn catch_up_mut(&mut self, task: TaskId) -> &mut CatchUp {
        self.tasks[task].catch_up.as_mut().expect("a catch-up under way")
    }

    fn disarm(&mut self, task: TaskId, r: ReplicaId) {
        let tid = self.slot(task, r).tid();
        self.be.steer().set_breakpoint(tid, None);
        self.slot_mut(task, r).set_breakpoint_armed(false);
    }

    /// Every replica has stopped where the interrupt found it, or met the target.
    fn advance_catch_up(&mut self, task: TaskId) {
        let c = self.tasks[task].catch_up.as_ref().expect("a catch-up under way");
        if c.replicas
            .iter()
            .any(|(_, h)| matches!(h, Hunt::Stopping | Hunt::Hunting { .. }))
        {
            return;
        }
        if c.target.is_some() {
            self.finish_catch_up(task, true);
            return;
        }
        let leader = self.replicas.leader();
        let Some(Hunt::Parked(target)) = c.hunt(leader) else {
            self.abandon_catch_up(task);
            return;
        };
        let in_syscall = |regs: &Regs| regs.orig_rax as i64 >= 0;
        if c.replicas
            .iter()
            .any(|(_, h)| matches!(h, Hunt::Parked(p) if in_syscall(p)))
        {
            // Inside a call the filter lets through (a futex wait): no user state to meet
            // at, and the rendezvous may never come.
            let all_alike = c
                .replicas
                .iter()
                .all(|(_, h)| matches!(h, Hunt::Parked(p) if same_state(p, &target) && p.orig_rax == target.orig_rax));
            self.finish_catch_up(task, all_alike);
            return;
        }
        let parked: Vec<(ReplicaId, Regs)> = c
            .replicas
            .iter()
            .filter_map(|&(r, h)| match h {
                Hunt::Parked(regs) => Some((r, regs)),
                _ => None,
            })
            .collect();
        let c = self.catch_up_mut(task);
        c.target = Some(target);
        c.hunt_until = Some(Instant::now() + HUNT_TIME);
        let mut hunting = false;
        for (r, regs) in parked {
            if r == leader {
                continue;
            }
            if same_state(&regs, &target) {
                self.catch_up_mut(task).set(r, Hunt::Matched);
                continue;
            }
            let tid = self.slot(task, r).tid();
            if self.be.set_breakpoint(tid, Some(target.rip)).is_err() {
                self.finish_catch_up(task, false);
                return;
            }
            self.slot_mut(task, r).set_breakpoint_armed(true);
            self.catch_up_mut(task).set(r, Hunt::Hunting { hits: 0 });
            self.be.steer().resume(tid, Resume::Run);
            hunting = true;
        }
        if !hunting {
            self.finish_catch_up(task, true);
        }
    }

    /// Sends the signal into every replica: at the met state (`exact`), or where each is.
    fn finish_catch_up(&mut self, task: TaskId, exact: bool) {
        let Some(c) = self.tasks[task].catch_up.take() else {
            return;
        };
        let sig = c.sig;
        if let Some(i) = self.tasks[task].signals.pending_index(sig) {
            self.take_pending(task, i);
        }
        self.stats.signals_delivered += 1;
        if exact {
            self.stats.signals_met += 1;
        } else {
            self.stats.signals_loose += 1;
        }
        if !self.said_loose_signal {
            self.said_loose_signal = true;
            let how = if exact {
                "at a state where every replica's registers agree (their memory may not)".to_string()
            } else {
                format!(
                    "where each replica is, since they met at no common state within {} ms",
                    HUNT_TIME.as_millis()
                )
            };
            self.emit(Event::new("run", "signal", "continue").message(format!(
                "signal {sig} reached task {task} while it made no system call; it is delivered {how}. If the replicas then differ, that is reported as a divergence (run.md, \"Signals\")"
            )));
        }
        for (r, hunt) in c.replicas {
            if self.slot(task, r).state() == SlotState::Dead {
                continue;
            }
            self.raise(task, r, sig);
            if matches!(hunt, Hunt::Parked(_) | Hunt::Matched) {
                if self.slot(task, r).breakpoint_armed() {
                    self.disarm(task, r);
                }
                self.be.steer().resume(self.slot(task, r).tid(), Resume::Run);
            }
        }
    }

    /// Ends an attempt that a replica's syscall (or another stop) overtook: the replicas
    /// stopped by it run on, and the signal waits for the rendezvous as usual.
    pub(crate) fn abandon_catch_up(&mut self, task: TaskId) {
        let Some(c) = self.tasks[task].catch_up.take() else {
            return;
        };
        for (r, hunt) in c.replicas {
            if matches!(hunt, Hunt::Parked(_) | Hunt::Matched) {
                if self.slot(task, r).breakpoint_armed() {
                    self.disarm(task, r);
                }
                self.be.steer().resume(self.slot(task, r).tid(), Resume::Run);
            }
        }
        // Not at once again: the rendezvous is near.
        self.tasks[task].signals.restart_wait();
    }
}

/// Whether thread `tid` sits in a ptrace stop (state `t` in /proc).
fn in_trace_stop(be: &dyn Backend, tid: lockstep_trace::Tid) -> bool {
    super::thread_state(be, tid) == Some('t')
}

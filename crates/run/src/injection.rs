//! Fault injection's way into the monitor: `lockstep inject --replica` (a fault from
//! the injector's engine, passed in `LOCKSTEP_REPLICA_FAULT`) and `--test-flip`
//! (deterministic test faults). The monitor's core calls one [`FaultHook`] at four
//! points and knows nothing else about injection; with nothing asked for there is no
//! hook. Every bit flip goes through the injector's own engine
//! (`lockstep_inject::fault`), so there is one flipper.

use crate::backend::{Backend, Resume};
use crate::options::{FlipAt, FlipSpec, FlipTarget};
use crate::session::{set_tick, Phase, ReplicaId, Session, SlotState, TaskId, INJECTION_TICK, TICK};
use crate::Error;
use lockstep_core::Event;
use lockstep_inject::fault::{reapply, Applied, Model};
use lockstep_trace::{ptrace, Regs, Stop, Tid};

/// What the monitor lets a fault injector do, at fixed points of its event loop.
pub trait FaultHook {
    /// Before each wait for the next stop: a time-based fault whose moment has come.
    fn before_wait(&mut self, s: &mut Session);
    /// Replica `r`'s thread of `task` stopped at a syscall entry with `regs` (refreshed if
    /// the hook changed them). False: the replica will not arrive at this call.
    fn at_syscall(&mut self, s: &mut Session, task: TaskId, r: ReplicaId, regs: &mut Regs) -> bool;
    /// Replica `r`'s thread of `task` stopped at an event stop (the hook's interrupt).
    fn at_event_stop(&mut self, s: &mut Session, task: TaskId, r: ReplicaId);
    /// A stop the hook may own (its single-steps). True: handled, the monitor ignores it.
    fn at_stop(&mut self, s: &mut Session, tid: Tid, stop: Stop) -> bool;
    /// Whether a thread is being single-stepped now (catch-ups wait for it).
    fn stepping(&self) -> bool;
    /// At the end of the run.
    fn finish(&mut self, s: &Session);
}

/// A replica fault applied by single-stepping one thread (see lockstep_inject::step).
struct Stepping {
    tid: Tid,
    replica: ReplicaId,
    /// Single-steps still to go before the fault's own work starts (`--at syscall:K+steps:D`).
    skip: u64,
    /// dest/addr: the stepping engine; None: a fault applied at a stop, once `skip` is done.
    stepper: Option<lockstep_inject::step::StepFault>,
    fault: lockstep_inject::fault::ReplicaFault,
}

/// Applies a replica fault that needs no stepping to the stopped thread `tid` of process
/// `tgid`: freshly drawn from its seed, or exactly as recorded for a replay.
fn apply_at_stop(
    fault: &lockstep_inject::fault::ReplicaFault,
    tgid: Tid,
    tid: Tid,
) -> std::io::Result<lockstep_inject::fault::Applied> {
    use lockstep_inject::fault::{apply, reapply, Rng, Scope};
    if let Some(applied) = &fault.replay {
        return reapply(tid, applied).map(|()| applied.clone());
    }
    let scope = Scope {
        region: fault.region,
        libs: fault.libs,
        pid_filter: None,
    };
    apply(tgid, tid, fault.model, fault.width, &scope, &mut Rng::new(fault.seed))
}

fn stop_is_signal_without_fault(stop: Stop, result: &Option<std::io::Result<lockstep_inject::fault::Applied>>) -> bool {
    matches!(stop, Stop::Signal(sig) if sig != libc::SIGTRAP) && result.is_none()
}

/// The injector behind `lockstep inject --replica` and `--test-flip`.
pub struct Injector {
    flips: Vec<FlipSpec>,
    /// Which flips struck already (a FirstCall flip strikes once).
    fired: Vec<bool>,
    /// The injector's fault and the replica it goes to, until it is applied.
    fault: Option<(lockstep_inject::fault::ReplicaFault, ReplicaId)>,
    /// A dest/addr fault in progress: its thread is single-stepped.
    stepping: Option<Stepping>,
    /// Where the injector wants the applied fault (and, beside it, the detections).
    record: Option<std::path::PathBuf>,
    /// The thread a time-based replica fault goes into, chosen when its moment comes.
    victim: TaskId,
    /// A `kill-in-call` flip's thread, killed once the monitor lets it run its call.
    kill_in_call: Option<(TaskId, ReplicaId)>,
}

impl Injector {
    /// The hook for what the options and the environment ask for; None when nothing is.
    pub fn asked_for(s: &Session) -> Result<Option<Injector>, Error> {
        let fault = Self::read_replica_fault(s)?;
        if fault.is_none() && s.options().flips.is_empty() {
            return Ok(None);
        }
        let injector = Injector {
            flips: s.options().flips.clone(),
            fired: vec![false; s.options().flips.len()],
            record: fault.as_ref().map(|f| f.0.record.clone()),
            fault,
            stepping: None,
            victim: 0,
            kill_in_call: None,
        };
        if let Some((us, r)) = injector.fault.as_ref().and_then(|f| Some((f.0.after_us?, f.1))) {
            injector.arm_cpu_timer(s, r, us);
        }
        Ok(Some(injector))
    }

    /// The fault passed by `lockstep inject --replica`, if any, with its replica resolved.
    fn read_replica_fault(s: &Session) -> Result<Option<(lockstep_inject::fault::ReplicaFault, ReplicaId)>, Error> {
        use lockstep_inject::fault::{ReplicaChoice, ReplicaFault, Rng, REPLICA_FAULT_ENV};
        let Some(json) = std::env::var_os(REPLICA_FAULT_ENV) else {
            return Ok(None);
        };
        let fault: ReplicaFault = serde_json::from_str(&json.to_string_lossy())
            .map_err(|e| Error::Usage(format!("bad {REPLICA_FAULT_ENV}: {e}")))?;
        let n = s.options().replicas as u64;
        let mut rng = Rng::new(fault.seed ^ 0x5245_504c);
        let replica = match fault.replica {
            ReplicaChoice::Leader => 0,
            ReplicaChoice::Follower => 1 + rng.below(n - 1) as ReplicaId,
            ReplicaChoice::Any => rng.below(n) as ReplicaId,
        };
        Ok(Some((fault, replica)))
    }

    /// The thread of replica `r` a time-based fault goes into: one of its live threads,
    /// with a chance proportional to the CPU time it has used (as `lockstep inject`
    /// chooses its victim in a process tree), drawn from the fault's seed. A replay
    /// draws again, so with several busy threads it may strike another one.
    fn choose_victim(s: &Session, r: ReplicaId, seed: u64) -> TaskId {
        let threads = s.live_threads(r);
        // Microseconds, plus one so that a thread that has not run yet can be drawn too.
        let cpu = |tid| s.backend().thread_cpu(tid).map_or(0, |t| t.as_micros() as u64) + 1;
        let weights: Vec<(TaskId, u64)> = threads.iter().map(|&(task, tid)| (task, cpu(tid))).collect();
        let total: u64 = weights.iter().map(|w| w.1).sum();
        if total == 0 {
            return 0;
        }
        let mut pick = lockstep_inject::fault::Rng::new(seed ^ 0x7468_7265_6164).below(total);
        for (task, w) in weights {
            if pick < w {
                return task;
            }
            pick -= w;
        }
        0
    }

    /// A time-based replica fault whose moment has come is applied where the replica is:
    /// the victim thread (`choose_victim`) is interrupted (PTRACE_INTERRUPT) and the fault
    /// goes in at that stop, unless it reaches a syscall stop first.
    fn interrupt_for_replica_fault(&mut self, s: &mut Session) {
        let Some((fault, r)) = &self.fault else {
            return;
        };
        let r = *r;
        let Some(us) = fault.after_us else {
            return;
        };
        if fault.interrupted || s.replica_cpu_now(r) < std::time::Duration::from_micros(us) {
            return;
        }
        if let Some((fault, _)) = &mut self.fault {
            fault.interrupted = true;
        }
        set_tick(TICK);
        let alive = s.replicas().is_alive(r);
        let seed = self.fault.as_ref().map_or(0, |f| f.0.seed);
        let victim = if alive { Self::choose_victim(s, r, seed) } else { 0 };
        self.victim = victim;
        let Some((tid, state)) = s.task(victim).slot(r).map(|slot| (slot.tid(), slot.state())) else {
            return;
        };
        match state {
            _ if !alive => {}
            // Parked at a syscall whose vote is still open: the fault goes in there, as if
            // it had struck just before the syscall instruction, so the vote sees the
            // corrupted call. (An interrupt would stay pending and stop the replica at an
            // unexpected moment.)
            SlotState::Arrived if s.task(victim).phase() == Phase::Collect => {
                let Ok(mut regs) = s.backend().regs(tid) else {
                    return;
                };
                self.apply_replica_fault(s, victim, r, &mut regs);
                s.slot_mut(victim, r).rearrive(regs);
            }
            // Parked after its call was decided (a follower while the leader executes, or
            // a replica waiting for the others to finish): a register flipped now would
            // bypass the vote that already happened. The fault waits for the next tick.
            SlotState::Arrived | SlotState::Done => {
                if let Some((fault, _)) = &mut self.fault {
                    fault.interrupted = false;
                }
            }
            _ => {
                s.backend().steer().interrupt(tid);
            }
        }
    }

    /// Whether the replica fault goes in now, at a stop of replica `r`'s thread of `task`.
    fn replica_fault_due(&self, s: &Session, task: TaskId, r: ReplicaId) -> bool {
        let Some((fault, target)) = &self.fault else {
            return false;
        };
        if *target != r {
            return false;
        }
        let stops = s.slot(0, r).stops();
        match (fault.at_stop, fault.after_us) {
            (Some(k), _) => task == 0 && stops == k,
            // Time-based faults go in at the stop the monitor's interrupt causes, wherever
            // the victim thread is then, not at the next syscall (which would bias them
            // towards syscall boundaries).
            (None, Some(_)) => task == self.victim && fault.interrupted,
            (None, None) => task == 0 && stops == 1,
        }
    }

    /// Arms a timer on replica `r`'s CPU clock that wakes the event loop (SIGALRM) when
    /// the replica has used `us` of CPU time, so the interrupt comes while it runs. If
    /// the kernel refuses, the 1 ms tick does the checking.
    fn arm_cpu_timer(&self, s: &Session, r: ReplicaId, us: u64) {
        set_tick(INJECTION_TICK);
        let Some(slot) = s.main_task().and_then(|t| t.slot(r)) else {
            return;
        };
        // MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED), as in lockstep_trace::cpu.
        let clock = ((!slot.tgid()) << 3) | 2;
        // SAFETY: timer_create/timer_settime with fully initialised arguments; the timer
        // lives until the monitor exits.
        unsafe {
            let mut ev: libc::sigevent = std::mem::zeroed();
            ev.sigev_notify = libc::SIGEV_SIGNAL;
            ev.sigev_signo = libc::SIGALRM;
            let mut timer: libc::timer_t = std::mem::zeroed();
            if libc::timer_create(clock, &mut ev, &mut timer) != 0 {
                return;
            }
            let spec = libc::itimerspec {
                it_interval: libc::timespec { tv_sec: 0, tv_nsec: 0 },
                it_value: libc::timespec {
                    tv_sec: (us / 1_000_000) as libc::time_t,
                    tv_nsec: ((us % 1_000_000) * 1000) as libc::c_long,
                },
            };
            libc::timer_settime(timer, 0, &spec, std::ptr::null_mut());
        }
    }

    /// Applies the injector's fault to replica `r` (stopped at a syscall entry), records
    /// what changed for the injector, and refreshes `regs`.
    fn apply_replica_fault(&mut self, s: &mut Session, task: TaskId, r: ReplicaId, regs: &mut Regs) {
        use lockstep_inject::fault::Rng;
        use lockstep_inject::step::StepFault;
        let Some((fault, _)) = self.fault.take() else {
            return;
        };
        let (tgid, tid) = (s.slot(task, r).tgid(), s.slot(task, r).tid());
        let model = fault.replay.as_ref().map_or(fault.model, |a| a.model);
        if model.needs_steps() || fault.steps > 0 {
            // The fault goes on an instruction after this syscall: step from its return.
            let stepper = model.needs_steps().then(|| match &fault.replay {
                Some(applied) => StepFault::replay(applied.clone()),
                None => StepFault::fresh(model, fault.width, Rng::new(fault.seed)),
            });
            self.stepping = Some(Stepping {
                tid,
                replica: r,
                skip: fault.steps,
                stepper,
                fault,
            });
            s.backend().single_step(Some(tid));
            return;
        }
        let result = apply_at_stop(&fault, tgid, tid);
        if result.is_ok() {
            if let Ok(fresh) = s.backend().regs(tid) {
                *regs = fresh;
            }
        }
        let at = match task {
            0 => format!("at syscall stop {}", s.slot(task, r).stops()),
            _ => format!(
                "in task {task} (a thread) at its syscall stop {}",
                s.slot(task, r).stops()
            ),
        };
        self.report_replica_fault(s, r, &fault.record, result, &at);
    }

    /// Records an applied replica fault for the injector and emits its event.
    fn report_replica_fault(
        &mut self,
        s: &mut Session,
        r: ReplicaId,
        record: &std::path::Path,
        result: std::io::Result<lockstep_inject::fault::Applied>,
        at: &str,
    ) {
        match result {
            Ok(applied) => {
                if let Err(e) = std::fs::write(record, serde_json::to_string(&applied).unwrap_or_default()) {
                    eprintln!(
                        "lockstep run: cannot write the injection record {}: {e}",
                        record.display()
                    );
                }
                let what = match (&applied.register, applied.address) {
                    (Some(reg), _) => format!("{reg} ^= {:#x}", applied.mask),
                    (None, Some(addr)) => format!("memory at {addr:#x} ^= {:#x}", applied.mask),
                    _ => String::new(),
                };
                let place = applied
                    .ip
                    .and_then(|ip| s.replicas().is_alive(r).then(|| code_location(s, r, ip)).flatten())
                    .map(|where_| format!(" at {where_}"))
                    .unwrap_or_default();
                let msg = format!(
                    "injected {:?} fault into replica {r} {at}: {what}{place}",
                    applied.model
                );
                s.emit(Event::new("run", "inject", "flip").replica(r).message(msg));
            }
            Err(e) => {
                s.emit(
                    Event::new("run", "inject", "fail")
                        .replica(r)
                        .message(format!("injection failed: {e}")),
                );
            }
        }
    }

    /// A stop of the thread a dest/addr fault is stepping. Returns true when the stop was
    /// the stepping's own (a single-step trap) and has been handled.
    fn on_step_stop(&mut self, s: &mut Session, tid: Tid, stop: Stop) -> bool {
        use lockstep_inject::step::Progress;
        let Some(mut st) = self.stepping.take() else {
            return false;
        };
        let (result, own) = match stop {
            Stop::Signal(libc::SIGTRAP) if st.skip > 0 => {
                st.skip -= 1;
                s.backend().steer().resume(tid, Resume::Run);
                self.stepping = Some(st);
                return true;
            }
            Stop::Signal(libc::SIGTRAP) => match st.stepper.as_mut().map(|f| f.on_stop(tid)) {
                Some(Ok(Progress::Step)) => {
                    s.backend().steer().resume(tid, Resume::Run);
                    self.stepping = Some(st);
                    return true;
                }
                Some(Ok(Progress::Done(applied))) => (Some(Ok(applied)), true),
                Some(Ok(Progress::GaveUp)) => (None, true),
                Some(Err(e)) => (Some(Err(e)), true),
                // A fault applied at a stop, once the steps are done.
                None => (Some(apply_at_stop(&st.fault, st.tid, tid)), true),
            },
            // The armed instruction faulted: the fault is in; the signal is handled as usual.
            Stop::Signal(_) => (st.stepper.as_mut().and_then(|f| f.on_signal(tid).transpose()), false),
            // The thread went to a syscall or an event: keep stepping after it.
            Stop::Seccomp | Stop::SyscallExit | Stop::Event(_) | Stop::EventStop(_) => {
                self.stepping = Some(st);
                return false;
            }
            Stop::Exited(_) | Stop::Killed(_) => (None, false),
        };
        if stop_is_signal_without_fault(stop, &result) {
            // A signal that arrived while the fault was not yet armed: keep stepping.
            self.stepping = Some(st);
            return false;
        }
        s.backend().single_step(None);
        if let Some(result) = result {
            self.report_replica_fault(s, st.replica, &st.fault.record, result, "by single-stepping");
        }
        if own {
            s.backend().steer().resume(tid, Resume::Run);
        }
        own
    }

    /// Applies a test-only fault. Returns false when the replica will not arrive.
    fn apply_flip(&mut self, s: &mut Session, task: TaskId, r: ReplicaId, flip: &FlipSpec, regs: &mut Regs) -> bool {
        let tid = s.slot(task, r).tid();
        let what = match &flip.target {
            FlipTarget::Register(name) => {
                let applied = Applied::flip(Model::Reg, Some(name.clone()), None, 1u64 << flip.bit);
                if reapply(tid, &applied).is_ok() {
                    if let Ok(fresh) = s.backend().regs(tid) {
                        *regs = fresh;
                    }
                }
                format!("bit {} of {name}", flip.bit)
            }
            FlipTarget::Memory { base, offset } => {
                let mut copy = *regs;
                let addr = lockstep_trace::regs::by_name(&mut copy, base)
                    .map(|v| v.wrapping_add(*offset as u64))
                    .unwrap_or(0);
                // A test flip at an unmapped address changes nothing: the run goes on
                // unfaulted, and the test that asked for it sees no detection.
                let _ = reapply(tid, &Applied::flip(Model::Mem, None, Some(addr), 1u64 << flip.bit));
                format!("bit {} of the byte at {base}{offset:+} ({addr:#x})", flip.bit)
            }
            FlipTarget::Kill => {
                s.backend().kill(tid);
                s.slot_mut(task, r).leave(SlotState::Running);
                "SIGKILL".to_string()
            }
            FlipTarget::KillInCall => {
                self.kill_in_call = Some((task, r));
                "SIGKILL once it runs this call".to_string()
            }
            FlipTarget::Hang => {
                // `jmp .` at the return address, then skip the syscall: the thread spins.
                s.backend().steer().write(tid, regs.rip, &[0xeb, 0xfe]);
                let mut spin = *regs;
                ptrace::skip_with_result(&mut spin, 0);
                s.backend().steer().set_regs(tid, &spin);
                s.backend().steer().resume(tid, Resume::Run);
                s.slot_mut(task, r).leave(SlotState::Running);
                "an endless loop".to_string()
            }
        };
        let keep_going = matches!(
            flip.target,
            FlipTarget::Register(_) | FlipTarget::Memory { .. } | FlipTarget::KillInCall
        );
        let at = match flip.at {
            FlipAt::Stop(k) => format!("syscall stop {k}"),
            FlipAt::FirstCall(nr) => format!("its first {}", lockstep_trace::syscalls::name(nr)),
        };
        let msg = format!("test flip: injected {what} into replica {r} at {at}");
        s.emit(Event::new("run", "inject", "flip").replica(r).message(msg));
        keep_going
    }
}

impl Injector {
    /// A `kill-in-call` flip's replica dies as soon as the monitor has let it run the
    /// call it stopped at (before the monitor looks at any stop after that decision).
    fn kill_in_its_call(&mut self, s: &mut Session) {
        let Some((task, r)) = self.kill_in_call else {
            return;
        };
        let slot = s.slot(task, r);
        if slot.is_dead() {
            self.kill_in_call = None;
        } else if slot.state() == SlotState::Executing {
            self.kill_in_call = None;
            let tid = slot.tid();
            s.backend().kill(tid);
            // Dead before the monitor handles the next stop, memory gone, as a replica
            // that a fault killed a moment earlier would be.
            crate::session::wait_out_of_calls(s.backend(), &[tid], crate::session::CALL_EXIT_LIMIT);
        }
    }
}

impl FaultHook for Injector {
    fn before_wait(&mut self, s: &mut Session) {
        self.interrupt_for_replica_fault(s);
        self.kill_in_its_call(s);
    }

    fn at_syscall(&mut self, s: &mut Session, task: TaskId, r: ReplicaId, regs: &mut Regs) -> bool {
        let stops = s.slot(task, r).stops();
        let nr = ptrace::syscall_nr(regs);
        let mut flips = Vec::new();
        for (flip, fired) in self.flips.iter().zip(self.fired.iter_mut()) {
            // Stops are counted in the first thread; a first call is any thread's.
            let due = match flip.at {
                FlipAt::Stop(k) => task == 0 && k == stops,
                FlipAt::FirstCall(n) => n == nr && !*fired,
            };
            if flip.replica == r && due {
                *fired = true;
                flips.push(flip.clone());
            }
        }
        for flip in flips {
            if !self.apply_flip(s, task, r, &flip, regs) {
                return false; // the replica was killed or set spinning
            }
        }
        if self.replica_fault_due(s, task, r) {
            self.apply_replica_fault(s, task, r, regs);
        }
        true
    }

    fn at_event_stop(&mut self, s: &mut Session, task: TaskId, r: ReplicaId) {
        if self.replica_fault_due(s, task, r) {
            // The stop our interrupt asked for: the fault goes in wherever the thread is,
            // not only at a syscall.
            if let Ok(mut regs) = s.backend().regs(s.slot(task, r).tid()) {
                self.apply_replica_fault(s, task, r, &mut regs);
            }
        }
    }

    fn at_stop(&mut self, s: &mut Session, tid: Tid, stop: Stop) -> bool {
        self.stepping.as_ref().is_some_and(|st| st.tid == tid) && self.on_step_stop(s, tid, stop)
    }

    fn stepping(&self) -> bool {
        self.stepping.is_some()
    }

    fn finish(&mut self, s: &Session) {
        if let Some(record) = &self.record {
            let path = lockstep_inject::fault::detections_path(record);
            if let Err(e) = std::fs::write(&path, format!("{}\n", s.report().detections())) {
                eprintln!(
                    "lockstep run: cannot write the detection record {}: {e}",
                    path.display()
                );
            }
        }
    }
}

/// `ip` in replica `r`'s main process as "file+0xoffset" (or "[anon]+0x..."), from its maps.
fn code_location(s: &Session, r: ReplicaId, ip: u64) -> Option<String> {
    let pid = s.main_task()?.slot(r)?.tgid();
    let maps = s.backend().proc_read(pid, "maps").ok()?;
    maps.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let (start, end) = fields.next()?.split_once('-')?;
        let (start, end) = (u64::from_str_radix(start, 16).ok()?, u64::from_str_radix(end, 16).ok()?);
        if !(start..end).contains(&ip) {
            return None;
        }
        let offset = u64::from_str_radix(fields.nth(1)?, 16).ok()?;
        let file = fields.nth(2).unwrap_or("[anon]");
        Some(format!("{file}+{:#x}", ip - start + offset))
    })
}

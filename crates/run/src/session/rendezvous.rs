//! What happens when every live replica of a task has arrived: vote, then execute the
//! syscall according to its class, deliver a fault or a signal, or emulate RDTSC.

use super::plan::{self, Command};
use crate::backend::{Backend, Resume};
use crate::data::{self, PREVIEW};
use crate::options::CompareMode;
use crate::session::signals::{Interrupted, StandIn};
use crate::session::{
    describe_death, Arrival, Death, InputRecord, Phase, ReplicaId, Session, Slot, SlotState, Stopped, TaskId,
};
use crate::Error;
use lockstep_core::le;
use lockstep_core::Event;
use lockstep_trace::syscalls::{self, Class, Desc, NewFds};
use lockstep_trace::{ptrace, Tid, SYS_LOCKSTEP_INSTALL, SYS_LOCKSTEP_TRACE};
use std::time::Instant;

/// Whether a call the leader ran ended because a signal arrived: a restart code, or the
/// EINTR that some blocking calls (`epoll_wait`, `epoll_pwait`, `rt_sigtimedwait`) return
/// directly.
fn interrupted_by_signal(nr: u64, ret: i64) -> bool {
    ptrace::is_restart(ret) || (ret == -(libc::EINTR as i64) && syscalls::describe(nr).is_some_and(|d| d.blocking))
}

/// Whether thread `tid` is on its way out: gone, a zombie, or with SIGKILL pending.
fn thread_is_dying(be: &dyn Backend, tid: Tid) -> bool {
    let Ok(status) = be.proc_read(tid, "status") else {
        return true;
    };
    let field = |key: &str| status.lines().find_map(|l| l.strip_prefix(key)).map(str::trim);
    let sigkill = 1u64 << (libc::SIGKILL - 1);
    let pending = |key: &str| field(key).and_then(|v| u64::from_str_radix(v, 16).ok()).unwrap_or(0) & sigkill != 0;
    matches!(field("State:").and_then(|s| s.chars().next()), Some('Z' | 'X'))
        || pending("SigPnd:")
        || pending("ShdPnd:")
}

/// What the replicas are compared on at one rendezvous.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Key {
    met: Met,
    /// `--compare io`: inputs consumed so far (a replica that skipped or added one differs).
    inputs: u64,
}

/// What a replica met the others at, reduced to what is voted on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Met {
    /// A death, a fault, a trapped instruction: compared as they are.
    Stop(Arrival),
    /// A syscall: its number, and the digest voted for it (its own data, or the replica's
    /// history, depending on the compare mode and on whether it is an output).
    Syscall { nr: u64, voted: u64 },
}

const AT_NULL: u64 = 0;
const AT_IGNORE: u64 = 1;
const AT_RANDOM: u64 = 25;
const AT_SYSINFO_EHDR: u64 = 33;
const NR_CLONE: u64 = libc::SYS_clone as u64;

fn is_nr(nr: u64, sys: libc::c_long) -> bool {
    nr == sys as u64
}

/// What a replica arrived with at a vote, kept to describe a divergence after the vote.
#[derive(Clone, Copy)]
pub(super) struct Seen {
    replica: ReplicaId,
    tid: Tid,
    arrival: Arrival,
    preview: [u8; PREVIEW],
    preview_len: u8,
    signature: lockstep_core::Signature,
}

/// A divergence event queued by a vote that voted a replica out, whose message is written
/// once the healthy replicas have gone on: masking does not wait for the description.
/// The victim stays stopped until then (`Session::finish_vote_outs`).
pub(super) struct PendingDivergence {
    /// The event's place in the report's queue.
    event: usize,
    task: TaskId,
    /// Index into `seen` of the voted-out replica.
    faulty: usize,
    seen: Vec<Seen>,
}

impl Session {
    pub fn try_decide(&mut self, task: TaskId) -> Result<(), Stopped> {
        let t = &self.tasks[task];
        if t.is_finished() || t.phase() != Phase::Collect {
            return Ok(());
        }
        if self.opts.compare == CompareMode::Io && self.leader_may_run_ahead(task) {
            return self.run_input_ahead(task);
        }
        let live = self.live_slots(task);
        // Every live replica must have its thread for this task (a new thread may not be
        // registered in all replicas yet) and that thread must have arrived.
        if live.is_empty()
            || live.len() != self.live_replicas().len()
            || live.iter().any(|&r| self.slot(task, r).arrival().is_none())
            || self.awaiting_program_kill(task, &live)
        {
            return Ok(());
        }
        // While a process is going down, wait until every replica's thread is gone.
        let exiting = self.processes[t.process()].exiting;
        if exiting && live.iter().any(|&r| self.slot(task, r).state() != SlotState::Dead) {
            return Ok(());
        }
        if self.check_ring_consumption(task, &live)? {
            return Ok(());
        }
        self.decide(task, &live)
    }

    /// A replica's thread was killed by a signal the program itself sent (SIGKILL, which
    /// no tracer sees coming): the other replicas' copies are being killed too, wherever
    /// they happen to be, so their last stops are not compared with the death. The vote
    /// waits until every copy has died.
    fn awaiting_program_kill(&self, task: TaskId, live: &[ReplicaId]) -> bool {
        let sent = self.processes[self.tasks[task].process()].sent_by_program;
        let killed = |r: ReplicaId| matches!(self.slot(task, r).arrival(), Some(Arrival::Died(Death::Killed(s))) if sent.contains(s));
        live.iter().any(|&r| killed(r)) && !live.iter().all(|&r| killed(r))
    }

    /// Whether the program sent SIGKILL to this task's process and one of its copies is
    /// already dying (a zombie, or SIGKILL pending).
    fn dying_by_program_kill(&self, task: TaskId, members: &[ReplicaId]) -> bool {
        let sent = self.processes[self.tasks[task].process()].sent_by_program;
        sent.contains(libc::SIGKILL)
            && members
                .iter()
                .any(|&r| thread_is_dying(&self.be, self.slot(task, r).tid()))
    }

    /// The class of the leader's call `desc(args)` of `task`: the table's, refined by its
    /// arguments, and for `openat2` by the flags in its `open_how` (read from the leader).
    pub(crate) fn class_of(&self, task: TaskId, desc: &Desc, args: &[u64; 6]) -> Class {
        let tid = self.slot(task, self.replicas.leader()).tid();
        let path_arg = match desc.nr as i64 {
            libc::SYS_open => Some(args[0]),
            libc::SYS_openat | libc::SYS_openat2 => Some(args[1]),
            _ => None,
        };
        // Every replica has its own /proc (its own PID namespace, the same pids): an open
        // below it is each replica's own (`/proc/self`, `/proc/<pid>` used as a pidfd...).
        if let Some(path) = path_arg.filter(|&p| p != 0) {
            if self.be.read_cstr(tid, path, 8).is_ok_and(|p| p.starts_with(b"/proc/")) {
                return Class::All;
            }
        }
        if desc.nr == libc::SYS_openat2 as u64 && args[2] != 0 {
            let mut flags = [0u8; 8];
            if self.be.read(tid, args[2], &mut flags).is_ok() {
                return syscalls::open_class(u64::from_le_bytes(flags));
            }
        }
        syscalls::classify(desc, args)
    }

    /// `--compare io` synchronises at outputs only: an input the leader reaches is run at
    /// once, without waiting for the followers, unless a signal is to be delivered, a
    /// replica is to be re-integrated, or too many results already wait for slow followers.
    fn leader_may_run_ahead(&self, task: TaskId) -> bool {
        let t = &self.tasks[task];
        let Some(slot) = t.slot(self.replicas.leader()) else {
            return false;
        };
        let Some(Arrival::Syscall { nr, args }) = slot.arrival() else {
            return false;
        };
        let input = syscalls::describe(nr)
            .map(|d| self.class_of(task, d, &args) == Class::Input)
            .unwrap_or(false);
        // recvmsg may carry descriptors, which are installed into followers at a rendezvous.
        input
            && !is_nr(nr, libc::SYS_recvmsg)
            && slot.state() == SlotState::Arrived
            && slot.consumed() == t.inputs.produced()
            && !t.signals.has_pending()
            && !self.reintegration_due
            && t.inputs.has_room()
            && !self.processes[t.process()].exiting
    }

    fn run_input_ahead(&mut self, task: TaskId) -> Result<(), Stopped> {
        let Some(Arrival::Syscall { nr, args }) = self.slot(task, self.replicas.leader()).arrival() else {
            return Ok(());
        };
        self.stats.count(Class::Input);
        self.tasks[task].begin(Phase::Leader {
            nr,
            args,
            class: Class::Input,
        });
        self.resume(task, self.replicas.leader(), Resume::ToExit, SlotState::Executing);
        Ok(())
    }

    /// The comparison key of replica `r` at this rendezvous; folds the call into the
    /// replica's running signature as a side effect (once per rendezvous).
    fn key(&mut self, task: TaskId, r: ReplicaId) -> Key {
        let slot = self.slot(task, r);
        let inputs = if self.opts.compare == CompareMode::Io {
            slot.consumed()
        } else {
            0
        };
        let met = match slot.arrival().expect("arrived") {
            Arrival::Syscall { nr, args } => {
                let tid = slot.tid();
                let desc = syscalls::describe(nr);
                let is_output = is_output(nr, desc, &args);
                let mode = self.opts.compare;
                let mut digest = if mode != CompareMode::Io || is_output {
                    let d = data::digest_call(&self.be, tid, nr, desc, &args, &mut self.scratch);
                    self.stats.bytes_compared += d.bytes;
                    d
                } else {
                    data::CallDigest::default()
                };
                // Shared file mappings this call concerns: their contents are part of it.
                if let Some(maps) = self.shared_maps_crc(task, r, nr, &args) {
                    digest.crc = lockstep_core::checksum::crc32c_append(digest.crc, &maps.to_le_bytes());
                }
                let preview = is_output.then_some((&digest.preview, digest.preview_len));
                let signature = self
                    .slot_mut(task, r)
                    .fold_call(nr, digest.crc, mode != CompareMode::Io, preview);
                let call = (digest.crc as u64) << 32 | (digest.bytes & 0xffff_ffff);
                let voted = match mode {
                    CompareMode::Io if is_output => call,
                    CompareMode::Io => 0,
                    // The history (signature) is voted at outputs; every other call's own
                    // arguments are voted before it runs, so a faulty leader cannot run an
                    // input with corrupted arguments and hand its result to the others.
                    CompareMode::Args if is_output => signature,
                    CompareMode::Args => call,
                    CompareMode::Every => signature,
                };
                Met::Syscall { nr, voted }
            }
            other => Met::Stop(other),
        };
        Key { met, inputs }
    }

    /// What replica `r` arrived with at this rendezvous, for describing it later.
    fn seen(&self, task: TaskId, r: ReplicaId) -> Seen {
        let slot = self.slot(task, r);
        let kept = slot.preview();
        let mut preview = [0; PREVIEW];
        preview[..kept.len()].copy_from_slice(kept);
        Seen {
            replica: r,
            tid: slot.tid(),
            arrival: slot.arrival().expect("arrived"),
            preview,
            preview_len: kept.len() as u8,
            signature: *slot.signature(),
        }
    }

    /// Descriptions of what each member arrived with: bare, and as "replica N: ..." values.
    fn arrival_texts(&self, seen: &[Seen]) -> (Vec<String>, Vec<String>) {
        let texts: Vec<String> = seen.iter().map(|s| self.describe_seen(s)).collect();
        let values = seen
            .iter()
            .zip(&texts)
            .map(|(s, t)| format!("replica {}: {t}", s.replica))
            .collect();
        (texts, values)
    }

    /// What a replica arrived with, for event messages. Only called when a vote fails, so
    /// the hot path builds no strings.
    fn describe_seen(&self, seen: &Seen) -> String {
        match seen.arrival {
            Arrival::Died(d) => describe_death(d),
            Arrival::Fault { sig, addr } => format!("signal {sig} at {addr:#x}"),
            Arrival::Rdtsc { .. } => "rdtsc".into(),
            Arrival::Cpuid { leaf, subleaf } => format!("cpuid leaf {leaf:#x}.{subleaf}"),
            Arrival::Syscall { nr, args } => {
                let name = syscalls::name(nr);
                let desc = syscalls::describe(nr);
                match desc {
                    Some(_) if is_output(nr, desc, &args) => {
                        let kept = &seen.preview[..seen.preview_len as usize];
                        format!("{name}({}) {}", args[0] as i64, data::escape_preview(kept))
                    }
                    _ if self.opts.compare != CompareMode::Io => format!("{name} signature {}", seen.signature),
                    _ => name,
                }
            }
        }
    }

    /// Where the data two replicas pass to the same call first differ: their lengths, the
    /// offset of the first differing byte, and up to 16 bytes from a little before it in
    /// each (for divergence messages; empty when they are not at the same call).
    fn first_difference(&self, a: &Seen, b: &Seen) -> String {
        const BEFORE: usize = 8;
        const SHOWN: usize = 16;
        let (Arrival::Syscall { nr, args }, Arrival::Syscall { nr: nr_b, args: args_b }) = (a.arrival, b.arrival)
        else {
            return String::new();
        };
        if nr != nr_b {
            return String::new();
        }
        let desc = syscalls::describe(nr);
        let mut chunk = Vec::new();
        let mut first_buffer = |tid: Tid, args: &[u64; 6]| {
            let d = data::digest_call(&self.be, tid, nr, desc, args, &mut chunk);
            // Only the (first) buffer: the number and plain values are shown elsewhere.
            d.first_buffer
                .map(|(addr, len)| (tid, addr, len))
                .unwrap_or((tid, 0, 0))
        };
        let (fa, fb) = (first_buffer(a.tid, &args), first_buffer(b.tid, &args_b));
        let Some(at) = data::first_difference(&self.be, fa, fb) else {
            return format!(
                "; {} bytes each, identical data (the difference is in the history or the arguments)",
                fa.2
            );
        };
        let from = at.saturating_sub(BEFORE);
        let show = |(tid, addr, len): (Tid, u64, usize)| {
            let n = len.saturating_sub(from).min(SHOWN);
            let bytes = self.be.read_vec(tid, addr + from as u64, n).unwrap_or_default();
            data::escape_preview(&bytes)
        };
        format!(
            "; replica {} passes {} bytes, replica {} {}; first difference at byte {at}: {} / {} (from byte {from})",
            a.replica,
            fa.2,
            b.replica,
            fb.2,
            show(fa),
            show(fb)
        )
    }

    /// Writes the messages of the divergence events that votes left for later (see
    /// [`PendingDivergence`]), while the voted-out replicas are still stopped.
    pub(super) fn describe_divergences(&mut self) {
        for pending in std::mem::take(&mut self.divergences) {
            let (texts, values) = self.arrival_texts(&pending.seen);
            // Compared with one of the majority: the first replica that is not the faulty one.
            let other = if pending.faulty == 0 { 1 } else { 0 };
            let faulty = &pending.seen[pending.faulty];
            let diff = self.first_difference(faulty, &pending.seen[other]);
            let message = format!(
                "replica {} diverged at task {}: {}; the majority has {}{diff}{}",
                faulty.replica,
                pending.task,
                texts[pending.faulty],
                texts[other],
                self.race_hint(pending.task)
            );
            self.report.amend(pending.event, |event| {
                event.values = values;
                event.message = message;
            });
        }
    }

    fn decide(&mut self, task: TaskId, live: &[ReplicaId]) -> Result<(), Stopped> {
        let t0 = Instant::now();
        let mut members: Vec<ReplicaId> = live.to_vec();
        let keys: Vec<Key> = members.iter().map(|&r| self.key(task, r)).collect();
        if self.debug {
            for (m, k) in members.iter().zip(&keys) {
                let text = self.describe_seen(&self.seen(task, *m));
                eprintln!("lockstep debug: rendezvous task {task} replica {m}: {k:?} {text}");
            }
        }
        if members.len() > 1 {
            self.stats.votes += 1;
        }
        // When the first vote found a divergence: masking time is measured from here.
        let mut detected: Option<Instant> = None;
        let plan = plan::vote_plan(&members, &keys);
        let unanimous = plan == [Command::Agree { masked: false }];
        if !unanimous && self.dying_by_program_kill(task, &members) {
            // A copy that the program's own SIGKILL is taking down may already be unreadable:
            // not a divergence. Its death is reported next, and the vote waits for all.
            return Ok(());
        }
        for command in plan {
            match command {
                Command::Agree { masked } => {
                    if masked {
                        let us = detected.map_or(0, |since| since.elapsed().as_micros() as u64);
                        let msg = format!("fault masked; {} replicas continue", members.len());
                        self.emit(
                            Event::new("run", "mask", "continue")
                                .object(format!("task {task}"))
                                .duration_us(us)
                                .message(msg),
                        );
                    }
                }
                Command::VoteOut(r) => {
                    detected.get_or_insert_with(Instant::now);
                    let i = members.iter().position(|&m| m == r).expect("a member is voted out");
                    self.stats.divergences += 1;
                    // Describing the divergence reads memory and builds strings: it waits
                    // until the healthy replicas go on (`describe_divergences`), with what
                    // each replica arrived with kept here and the victim kept stopped.
                    let seen: Vec<Seen> = members.iter().map(|&m| self.seen(task, m)).collect();
                    let event = self.report.emit(
                        Event::new("run", "divergence", "vote")
                            .replica(r)
                            .object(format!("task {task}"))
                            .duration_us(t0.elapsed().as_micros() as u64),
                    );
                    self.divergences.push(PendingDivergence {
                        event,
                        task,
                        faulty: i,
                        seen,
                    });
                    self.vote_out(r, format!("majority agrees that replica {r} is faulty"))?;
                    members.remove(i);
                }
                Command::Halt => {
                    self.stats.divergences += 1;
                    let seen: Vec<Seen> = members.iter().map(|&m| self.seen(task, m)).collect();
                    let (_, values) = self.arrival_texts(&seen);
                    let diff = self.first_difference(&seen[0], &seen[1]);
                    self.emit(
                        Event::new("run", "divergence", "halt")
                            .object(format!("task {task}"))
                            .values(values.clone())
                            .message(format!(
                                "replicas disagree at task {task}: {}{diff}{}",
                                values.join(" / "),
                                self.race_hint(task)
                            )),
                    );
                    return Err(self.halt("no majority agrees on the faulty replica".into()));
                }
                other => unreachable!("a vote plans only vote-outs, agreement or a halt: {other:?}"),
            }
        }
        let leader = self.replicas.leader();
        let arrival = self.slot(task, leader).arrival().expect("arrived");
        self.tasks[task].stop_waiting();
        if let Arrival::Syscall { nr, args } = arrival {
            self.agreed_on_maps(task, nr, &args);
        }
        // A rendezvous is a barrier for this task: clock reads start a fresh sequence, so
        // extra reads before it (a timing-dependent poll) cannot shift later values.
        self.tasks[task].restart_clocks();
        match arrival {
            Arrival::Died(death) => {
                self.tasks[task].finish();
                if let Some(fast) = self.fast.as_mut() {
                    fast.release_lane(task);
                }
                if task == 0 {
                    self.root_death = Some(death);
                }
                Ok(())
            }
            Arrival::Fault { sig, .. } => {
                // Every replica faulted identically: the program's own behaviour.
                let plan = plan::fault_plan(&self.live_slots(task), sig);
                self.carry_out(task, plan)
            }
            Arrival::Rdtsc { len } => {
                self.stats.rdtsc += 1;
                // SAFETY: RDTSC has no preconditions; the monitor itself is not trapped.
                let tsc = unsafe { core::arch::x86_64::_rdtsc() };
                let plan = plan::answer_plan(&self.stopped_regs(task), plan::Answer::Tsc { len, tsc });
                self.carry_out(task, plan)
            }
            Arrival::Cpuid { leaf, subleaf } => {
                // The monitor itself is not trapped: it answers from the CPU it runs on.
                // `__cpuid_count` became safe in Rust 1.94; the block keeps the declared
                // minimum (1.89) building.
                #[allow(unused_unsafe)]
                // SAFETY: CPUID has no preconditions on x86_64.
                let v = unsafe { core::arch::x86_64::__cpuid_count(leaf, subleaf) };
                let answer = plan::Answer::Cpuid([v.eax, v.ebx, v.ecx, v.edx]);
                let plan = plan::answer_plan(&self.stopped_regs(task), answer);
                self.carry_out(task, plan)
            }
            Arrival::Syscall { nr, args } => {
                if self.tasks[task].signals.deliver_before_call(nr, args) {
                    let sig = self.take_pending(task, 0);
                    return self.deliver_at_rendezvous(task, nr, args, sig);
                }
                if self.reintegration_due && !starts_a_thread(nr, args) && self.reintegrate(task)? {
                    return Ok(());
                }
                self.execute(task, nr, args)
            }
        }
    }

    pub(crate) fn execute(&mut self, task: TaskId, nr: u64, args: [u64; 6]) -> Result<(), Stopped> {
        assert_eq!(
            self.tasks[task].phase(),
            Phase::Collect,
            "task {task} executes a call only after a vote"
        );
        assert!(
            self.live_slots(task)
                .iter()
                .all(|&r| self.slot(task, r).arrival().is_some()),
            "every live replica of task {task} has arrived before its call executes"
        );
        let desc = syscalls::describe(nr);
        let class = desc
            .map(|d| self.class_of(task, d, &args))
            .unwrap_or(Class::Unsupported);
        self.stats.count(class);
        if let Err(why) = self.commit_before(task, nr, &args) {
            return Err(self.halt(why));
        }
        let plan = plan::execution_plan(class, nr, args, self.replicas.leader(), &self.live_slots(task));
        self.carry_out(task, plan)
    }

    /// The registers every live replica of `task` stopped with, for a plan to answer from.
    fn stopped_regs(&self, task: TaskId) -> Vec<(ReplicaId, lockstep_trace::Regs)> {
        self.live_slots(task)
            .iter()
            .map(|&r| (r, self.slot(task, r).regs()))
            .collect()
    }

    /// Carries out a plan of the policy's (`plan.rs`) for `task`, in order. A failed
    /// register write or resume is the replica's failure (`Checked`), found at its next stop.
    fn carry_out(&mut self, task: TaskId, plan: Vec<Command>) -> Result<(), Stopped> {
        for command in plan {
            match command {
                Command::Emulate { nr, args } => return self.emulate(task, nr, args),
                Command::Refuse { nr } => {
                    let name = syscalls::name(nr);
                    let msg =
                        format!("unsupported system call {name} (number {nr}); lockstep cannot replicate it safely");
                    self.emit(
                        Event::new("run", "unsupported", "stop")
                            .object(name)
                            .message(msg.clone()),
                    );
                    self.kill_everything();
                    return Err(Stopped::Failure(Error::Unsupported(format!("lockstep run: {msg}"))));
                }
                Command::Begin(phase) => self.tasks[task].begin(phase),
                Command::Exiting => {
                    let process = self.tasks[task].process();
                    self.processes[process].exiting = true;
                }
                Command::PrepareForAll { nr, args } => {
                    self.tasks[task].set_spawned(None);
                    self.note_program_signal(task, nr, &args);
                }
                Command::TranslatePids { replica, nr, args } => self.translate_pid_args(task, replica, nr, &args),
                Command::SetRegs(r, regs) => {
                    // A failure is recorded by the backend and fails the replica.
                    self.be.steer().set_regs(self.slot(task, r).tid(), &regs.0);
                }
                Command::Resume(r, how, state) => self.resume(task, r, how, state),
                Command::VoteOut(_) | Command::Halt | Command::Agree { .. } => {
                    unreachable!("votes are carried out in decide: {command:?}")
                }
                Command::CopyResults(_)
                | Command::InstallFds { .. }
                | Command::RaiseMirrored(_)
                | Command::Recollect
                | Command::FoldResult(..) => {
                    unreachable!("a call's completion is carried out in carry_out_completion: {command:?}")
                }
            }
        }
        Ok(())
    }

    /// Syscalls answered by the monitor: every replica gets the same answer.
    fn emulate(&mut self, task: TaskId, nr: u64, args: [u64; 6]) -> Result<(), Stopped> {
        if nr == lockstep_trace::SYS_LOCKSTEP_FAST {
            let result = self.fast_hello(task, &args);
            return self.answer_fast_hello(task, result);
        }
        let process = self.tasks[task].process();
        let result: i64 = match nr as i64 {
            libc::SYS_getpid => self.processes[process].logical_pid as i64,
            libc::SYS_gettid => self.tasks[task].logical_tid() as i64,
            libc::SYS_getppid => match self.processes[process].parent {
                Some(p) => self.processes[p].logical_pid as i64,
                // The root's parent is the namespace stub (pid 1), or lockstep itself.
                None if self.replicas.stub(self.replicas.leader()) > 0 => 1,
                // SAFETY: getpid has no preconditions.
                None => (unsafe { libc::getpid() }) as i64,
            },
            // Replicas stay on the cores lockstep chose.
            libc::SYS_sched_setaffinity => 0,
            libc::SYS_prctl if args[0] == syscalls::PR_GET_TSC => {
                const PR_TSC_ENABLE: u32 = 1;
                for r in self.live_slots(task) {
                    let (tid, own) = (
                        self.slot(task, r).tid(),
                        ptrace::syscall_args(&self.slot(task, r).regs()),
                    );
                    self.be.steer().write(tid, own[1], &PR_TSC_ENABLE.to_le_bytes());
                }
                0
            }
            libc::SYS_prctl => 0,
            libc::SYS_rseq => -(libc::ENOSYS as i64),
            n if n as u64 == SYS_LOCKSTEP_TRACE => {
                for r in self.live_slots(task) {
                    let (tid, own) = (
                        self.slot(task, r).tid(),
                        ptrace::syscall_args(&self.slot(task, r).regs()),
                    );
                    let len = (own[1] as usize).min(data::MAX_BUFFER);
                    let bytes = self
                        .be
                        .read_vec(tid, own[0], len)
                        .unwrap_or_else(|_| b"<EFAULT>".to_vec());
                    self.slot_mut(task, r).fold_bytes(&bytes);
                }
                0
            }
            _ => -(libc::ENOSYS as i64),
        };
        self.answer_each(task, |_| result);
        Ok(())
    }

    /// Skips the call every live replica of `task` is stopped at, with `result_of(r)` as
    /// replica `r`'s result, and lets them run.
    pub(crate) fn answer_each(&mut self, task: TaskId, result_of: impl Fn(ReplicaId) -> i64) {
        for r in self.live_slots(task) {
            let mut regs = self.slot(task, r).regs();
            ptrace::skip_with_result(&mut regs, result_of(r));
            self.be.steer().set_regs(self.slot(task, r).tid(), &regs);
            self.resume(task, r, Resume::Run, SlotState::Running);
        }
    }

    pub fn on_syscall_exit(&mut self, task: TaskId, r: ReplicaId) -> Result<(), Stopped> {
        let tid = self.slot(task, r).tid();
        let Ok(mut regs) = self.be.regs(tid) else {
            return Ok(());
        };
        let ret = regs.rax as i64;
        if let Some(stand_in) = self.slot_mut(task, r).signals.take_stand_in() {
            return self.finish_stand_in(task, r, stand_in);
        }
        match self.tasks[task].phase() {
            Phase::Leader { nr, args, .. } | Phase::LeaderFirst { nr, args } if interrupted_by_signal(nr, ret) => {
                // Interrupted (by a signal or our kick): run it again from the start; the
                // followers are still parked at the same call. Whatever the kernel already
                // wrote into the leader's in/out buffers is given to them too.
                if let Some(desc) = syscalls::describe(nr) {
                    for f in self.live_slots(task) {
                        let fslot = self.slot(task, f);
                        if f != r && fslot.state() == SlotState::Arrived {
                            let fargs = ptrace::syscall_args(&fslot.regs());
                            data::sync_inout(&self.be, tid, fslot.tid(), desc, &args, &fargs);
                        }
                    }
                }
                // A signal of the leader's own interrupted it (not our kick): if it is to be
                // handled, its delivery stop comes next, and the leader takes it as the
                // kernel left the call (`deliver_interrupted`).
                if !self.tasks[task].signals.kicked() {
                    self.tasks[task].signals.interrupt(Interrupted { nr, regs });
                }
                ptrace::rewind_to_syscall(&mut regs, nr);
                self.be.steer().set_regs(tid, &regs);
                self.tasks[task].end();
                self.resume(task, r, Resume::Run, SlotState::Running);
                Ok(())
            }
            Phase::Leader { nr, args, class } => self.finish_leader_call(task, nr, args, class, ret),
            Phase::LeaderFirst { nr, args } => {
                self.slot_mut(task, r).finish(ret);
                self.tasks[task].hand_to_followers();
                let reaped = self.reaped_child(task, nr, &args, ret);
                for f in self.live_slots(task) {
                    if f == self.replicas.leader() || self.slot(task, f).state() != SlotState::Arrived {
                        continue;
                    }
                    match reaped {
                        // The leader's WNOHANG wait found nothing: so do the followers.
                        Some(0) => {
                            let ftid = self.slot(task, f).tid();
                            let mut regs = self.slot(task, f).regs();
                            ptrace::skip_with_result(&mut regs, 0);
                            self.be.steer().set_regs(ftid, &regs);
                            self.slot_mut(task, f).finish(0);
                        }
                        // Reap exactly the child the leader reaped, whatever finished first here.
                        Some(child) => {
                            self.wait_for_child(task, f, nr, self.to_local(f, child));
                            self.resume(task, f, Resume::ToExit, SlotState::Executing);
                        }
                        None => {
                            self.translate_pid_args(task, f, nr, &args);
                            self.resume(task, f, Resume::ToExit, SlotState::Executing);
                        }
                    }
                }
                self.maybe_complete_all(task)
            }
            Phase::Followers { nr, .. } | Phase::All { nr, .. }
                if ptrace::is_restart(ret) && !self.tasks[task].signals.kicked() =>
            {
                ptrace::rewind_to_syscall(&mut regs, nr);
                self.be.steer().set_regs(tid, &regs);
                self.resume(task, r, Resume::Run, SlotState::Rerun);
                Ok(())
            }
            Phase::Followers { .. } => {
                self.slot_mut(task, r).finish(ret);
                self.tasks[task].note_arrival();
                self.maybe_complete_all(task)
            }
            Phase::All { nr, .. } => {
                if self.tasks[task].signals.kicked() && ptrace::is_restart(ret) {
                    ptrace::rewind_to_syscall(&mut regs, nr);
                    self.be.steer().set_regs(tid, &regs);
                    self.resume(task, r, Resume::Run, SlotState::Running);
                    return Ok(());
                }
                self.slot_mut(task, r).finish(ret);
                self.tasks[task].note_arrival();
                self.maybe_complete_all(task)
            }
            Phase::Collect => {
                // An exit we did not ask for (e.g. after a rewind race): just go on.
                self.be.steer().resume(tid, Resume::Run);
                Ok(())
            }
        }
    }

    /// The leader finished an input, output or descriptor-creating call: hand its result
    /// to the parked followers.
    /// The leader's call failed with EFAULT. If follower `f`'s own buffers for the same
    /// call are readable, the leader's pointer was corrupted: its EFAULT must not reach
    /// healthy replicas (they would all fail the same way, and the error would escape as a
    /// wrong answer). The leader has already consumed or refused the input, so the group
    /// stops rather than guess (exit 86, also under TMR).
    pub fn check_leader_efault(
        &mut self,
        task: TaskId,
        f: ReplicaId,
        desc: &syscalls::Desc,
        fargs: &[u64; 6],
    ) -> Result<(), Stopped> {
        let ftid = self.slot(task, f).tid();
        if !data::buffers_readable(&self.be, ftid, desc, fargs) {
            return Ok(()); // the follower's buffers are bad too: a genuine EFAULT
        }
        let leader = self.replicas.leader();
        self.detected(
            Event::new("run", "divergence", "halt")
                .replica(leader)
                .object(desc.name.to_string())
                .message(format!(
                    "{} failed with EFAULT in the leader (replica {leader}) but replica {f}'s buffers are valid: the leader's pointer was corrupted",
                    desc.name
                )),
        );
        Err(self.halt(format!("the leader's {} was given a corrupted pointer", desc.name)))
    }

    fn finish_leader_call(
        &mut self,
        task: TaskId,
        nr: u64,
        args: [u64; 6],
        class: Class,
        ret: i64,
    ) -> Result<(), Stopped> {
        if is_nr(nr, libc::SYS_mmap) {
            return self.finish_shared_map(task, args, ret);
        }
        if is_nr(nr, libc::SYS_rt_sigtimedwait) && (1..=64).contains(&ret) {
            // The leader took signal `ret` synchronously; the followers' own copies of it
            // stay pending and must not run a handler later (`signals.rs`, raise to self).
            for r in self.live_slots(task) {
                self.slot_mut(task, r).signals.taken(ret as i32);
            }
        }
        let leader = self.replicas.leader();
        let (ltid, ltgid) = (self.slot(task, leader).tid(), self.slot(task, leader).tgid());
        let desc = syscalls::describe(nr).expect("executed calls are in the table");
        let outputs = data::collect_outputs(&self.be, ltid, desc, &args, ret);
        let mut fds: Vec<i32> = Vec::new();
        if class == Class::FdCreate && ret >= 0 {
            fds = new_fds(desc, &args, ret, &outputs);
        }
        fds.extend(&outputs.passed_fds);
        // `--compare io`: inputs are counted, and followers not at this very input get it
        // later from the task's queue.
        let io_input = self.opts.compare == CompareMode::Io && class == Class::Input;
        let index = self.tasks[task].inputs.produced();
        if ret == -(libc::EFAULT as i64) {
            for f in self.live_slots(task) {
                if f != leader && self.slot(task, f).state() == SlotState::Arrived {
                    let fargs = ptrace::syscall_args(&self.slot(task, f).regs());
                    self.check_leader_efault(task, f, desc, &fargs)?;
                }
            }
        }
        // The followers parked at this very call (under `--compare io`, one at an earlier
        // input takes this one from the queue later).
        let mut waiting = Vec::new();
        for f in self.live_slots(task) {
            if f == leader || self.slot(task, f).state() != SlotState::Arrived {
                continue;
            }
            if io_input {
                let at_this_input = matches!(self.slot(task, f).arrival(), Some(Arrival::Syscall { nr: n, .. }) if n == nr)
                    && self.slot(task, f).consumed() == index;
                if !at_this_input {
                    continue;
                }
                self.slot_mut(task, f).consumed_input(index);
            }
            waiting.push((f, self.slot(task, f).regs()));
        }
        let plan = plan::completion_plan(leader, &waiting, ret, !fds.is_empty());
        let call = LeaderCall {
            desc,
            outputs: &outputs,
            fds: &fds,
            leader_tgid: ltgid,
            ret,
        };
        let died = self.carry_out_completion(task, plan, &call)?;
        self.tasks[task].signals.take_mirror();
        if io_input {
            self.slot_mut(task, leader).consumed_input(index);
            let behind = self
                .live_slots(task)
                .iter()
                .any(|&f| !self.slot(task, f).is_dead() && self.slot(task, f).consumed() <= index);
            let record = behind.then_some(InputRecord {
                index,
                nr,
                ret,
                outputs,
            });
            self.tasks[task].inputs.produce(record);
        }
        for (f, death) in died {
            self.on_death(task, f, death)?;
        }
        Ok(())
    }

    /// Carries out a completion plan (`plan::completion_plan`) for the leader's `call`.
    /// Returns the followers that died on their way to a descriptor install (killed by the
    /// program itself, say): they are judged once the call is over.
    fn carry_out_completion(
        &mut self,
        task: TaskId,
        plan: Vec<Command>,
        call: &LeaderCall,
    ) -> Result<Vec<(ReplicaId, Death)>, Stopped> {
        let mut died = Vec::new();
        for command in plan {
            match command {
                Command::CopyResults(f) => {
                    let ftid = self.slot(task, f).tid();
                    let fargs = ptrace::syscall_args(&self.slot(task, f).regs());
                    if data::apply_outputs(&self.be, ftid, call.desc, &fargs, call.ret, call.outputs) > 0 {
                        self.emit(Event::new("run", "copy", "continue").replica(f).message(format!(
                            "could not copy {}'s results into replica {f} (its buffers differ); the next vote decides",
                            call.desc.name
                        )));
                    }
                    self.stats.bytes_copied += call.outputs.bytes();
                }
                Command::InstallFds { replica, ret } => {
                    if let Some(death) = self.install_fds(task, replica, call.leader_tgid, call.fds, ret)? {
                        died.push((replica, death));
                    }
                }
                Command::RaiseMirrored(f) => self.raise_mirrored(task, f),
                Command::Recollect => self.tasks[task].recollect(),
                other => self.carry_out(task, vec![other])?,
            }
        }
        Ok(died)
    }

    /// Waits for follower `ftid`'s descriptor-install notification; `how` is how the
    /// follower was resumed into its install call (to the call's exit, when signals wait
    /// for it there). The follower may stop on its way: a `PTRACE_INTERRUPT` that
    /// `lockstep inject --replica` issued and that was still pending, or a signal of its
    /// own (a timer), which also interrupts the install (the kernel restarts it, and it
    /// notifies again). Such stops are passed on at once, so that a timer that fires more
    /// often than a poll lasts cannot starve the install. It may also die on the way
    /// (`Err(death)`), for example killed by its own parent. A follower that faults on the
    /// way (it restarted its interrupted call at a corrupted address), makes another call,
    /// or does not arrive within the straggler timeout has gone astray and is killed.
    fn await_install_notification(
        &mut self,
        listener: &lockstep_trace::seccomp::Listener,
        ftid: Tid,
        how: Resume,
    ) -> Result<Result<lockstep_trace::seccomp::Notif, Death>, Stopped> {
        use lockstep_trace::Stop;
        // A wait ends early when the follower stops (SIGCHLD): the bound only matters for
        // the straggler timeout.
        const POLL: std::time::Duration = std::time::Duration::from_millis(10);
        let since = Instant::now();
        loop {
            let stop = self.be.try_wait_tid(ftid);
            if self.debug {
                if let Ok(Some(stop)) = &stop {
                    eprintln!("lockstep debug: tid {ftid} {stop:?} while waiting for its descriptor install");
                }
            }
            match stop {
                Ok(Some(Stop::Exited(code))) => return Ok(Err(Death::Exited(code))),
                Ok(Some(Stop::Killed(sig))) => return Ok(Err(Death::Killed(sig))),
                // Resumed to the exit: the install itself, interrupted (a restart code) or
                // entering again after its restart (-ENOSYS at a syscall-entry stop).
                Ok(Some(Stop::SyscallExit)) if self.at_own_install(ftid) => {
                    self.be.steer().resume(ftid, how);
                }
                // Another syscall instead of the install: its registers were corrupted (it
                // did not restart the call). Faulty; it must not run anything unsupervised.
                Ok(Some(Stop::Seccomp | Stop::SyscallExit)) => return Ok(Err(self.kill_stray(ftid))),
                // Its own fault: passing over it would only make the same instruction fault
                // again until the limit, as a busy loop.
                Ok(Some(Stop::Signal(sig)))
                    if crate::session::signals::is_synchronous_fault(sig, self.be.siginfo(ftid).ok().as_ref()) =>
                {
                    return Ok(Err(self.kill_stray(ftid)))
                }
                // An asynchronous signal is suppressed here as everywhere in a follower: the
                // leader's copy is delivered to every replica at the same point.
                Ok(Some(Stop::Signal(_))) => {
                    self.be.steer().resume(ftid, how);
                }
                Ok(Some(_)) => {
                    self.be.steer().resume(ftid, Resume::Run);
                }
                _ => {}
            }
            match listener.recv(POLL) {
                Ok(notif) => return Ok(Ok(notif)),
                // ENOENT: the follower's call was interrupted before we took the
                // notification; it restarts the call, which notifies again. EINTR: it (or
                // another child) stopped, or lockstep's own tick.
                Err(e)
                    if !matches!(e.kind(), std::io::ErrorKind::TimedOut | std::io::ErrorKind::Interrupted)
                        && e.raw_os_error() != Some(libc::ENOENT) =>
                {
                    return Err(Error::Io("waiting for the descriptor-install notification", e).into())
                }
                Err(_) => {}
            }
            if since.elapsed() >= self.opts.timeout {
                return Ok(Err(self.kill_stray(ftid)));
            }
        }
    }

    /// Whether follower `tid`, at a syscall stop, is in its install call: interrupted
    /// (a restart code) or entering it again after the restart.
    fn at_own_install(&self, tid: Tid) -> bool {
        self.be.regs(tid).is_ok_and(|r| {
            r.orig_rax == SYS_LOCKSTEP_INSTALL
                && (ptrace::is_restart(r.rax as i64) || r.rax as i64 == -(libc::ENOSYS as i64))
        })
    }

    /// Kills a follower thread that went astray during a descriptor install and returns
    /// its death, which is then judged like any replica dying alone.
    fn kill_stray(&mut self, tid: Tid) -> Death {
        self.be.kill(tid);
        self.death_of(tid).unwrap_or(Death::Killed(libc::SIGKILL))
    }

    /// Makes follower `f` return `ret` from its call while installing the leader's open
    /// file descriptions at the same descriptor numbers (seccomp user notification).
    /// `Some(death)`: the follower died before it got there.
    fn install_fds(
        &mut self,
        task: TaskId,
        f: ReplicaId,
        leader_tgid: Tid,
        fds: &[i32],
        ret: i64,
    ) -> Result<Option<Death>, Stopped> {
        // The leader's process died since its call returned (killed by the program, or a
        // fault): the follower stays parked at its call, and the leader's death decides.
        let leader_gone = |e: &std::io::Error| e.raw_os_error() == Some(libc::ESRCH);
        let Some(listener) = self.replicas.listener(f) else {
            return Err(Error::Unsupported("this backend cannot install descriptors in a follower".into()).into());
        };
        let pidfd = match lockstep_trace::seccomp::pidfd_open(leader_tgid) {
            Ok(fd) => fd,
            Err(e) if leader_gone(&e) => return Ok(None),
            Err(e) => return Err(Error::Io("pidfd_open", e).into()),
        };
        let mut ours = Vec::new();
        for &fd in fds {
            let dup = match lockstep_trace::seccomp::pidfd_getfd(&pidfd, fd) {
                Ok(dup) => dup,
                Err(e) if leader_gone(&e) => return Ok(None),
                Err(e) => return Err(Error::Io("pidfd_getfd", e).into()),
            };
            ours.push((fd, dup, fd_cloexec(&self.be, leader_tgid, fd)));
        }
        let ftid = self.slot(task, f).tid();
        let mut regs = self.slot(task, f).regs();
        regs.orig_rax = SYS_LOCKSTEP_INSTALL;
        self.be.steer().set_regs(ftid, &regs);
        // To the install's exit: a reply alone does not prove that the install ended (a
        // signal that comes with the reply makes the kernel restart the call), and signals
        // the leader took at this call reach the follower there, not before (a pending
        // signal would abort the notification wait).
        self.resume(task, f, Resume::ToExit, SlotState::Executing);
        // ENOENT (ESRCH for a descriptor the follower had not taken yet): the notification
        // is gone. The follower died, or a signal of its own (a timer) interrupted its
        // wait; then it restarts the call, which notifies again (installing at the same
        // numbers again replaces what is there). A death shows at the next wait.
        let gone = |e: &std::io::Error| matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ESRCH));
        'notification: loop {
            let notif = match self.await_install_notification(&listener, ftid, Resume::ToExit)? {
                Ok(notif) => notif,
                Err(death) => return Ok(Some(death)),
            };
            if notif.pid as Tid != ftid {
                return Err(Stopped::Failure(Error::Setup(format!(
                    "descriptor install: expected thread {ftid}, got {}",
                    notif.pid
                ))));
            }
            for (fd, dup, cloexec) in &ours {
                use std::os::fd::AsRawFd;
                match listener.add_fd(notif.id, dup.as_raw_fd(), *fd, *cloexec) {
                    Ok(_) => {}
                    Err(e) if gone(&e) => continue 'notification,
                    Err(e) => return Err(Error::Io("SECCOMP_IOCTL_NOTIF_ADDFD", e).into()),
                }
            }
            match listener.respond(notif.id, ret) {
                Ok(()) => {}
                Err(e) if gone(&e) => continue 'notification,
                Err(e) => return Err(Error::Io("SECCOMP_IOCTL_NOTIF_SEND", e).into()),
            }
            match self.await_install_exit(ftid)? {
                Ok(true) => break,
                Ok(false) => {
                    self.be.steer().resume(ftid, Resume::ToExit);
                }
                Err(death) => return Ok(Some(death)),
            }
        }
        let signals = self.tasks[task].signals.mirror();
        let stand_in = StandIn {
            restore: None,
            ret,
            signals,
            copy: None,
        };
        self.finish_stand_in(task, f, stand_in)?;
        Ok(None)
    }

    /// Follower `ftid` was answered in its install: waits for the call's exit, which
    /// normally comes at once (a blocking wait, woken by the stop itself; lockstep's tick
    /// lets it give up on a follower gone astray after the straggler timeout). True: it
    /// ended; false: a signal interrupted it as the answer came, and it restarts.
    fn await_install_exit(&mut self, ftid: Tid) -> Result<Result<bool, Death>, Stopped> {
        use lockstep_trace::Stop;
        let since = Instant::now();
        loop {
            let stop = match self.be.wait_tid_or_tick(ftid) {
                Ok(Some(stop)) => Ok(stop),
                Ok(None) => {
                    if since.elapsed() >= self.opts.timeout {
                        return Ok(Err(self.kill_stray(ftid)));
                    }
                    continue;
                }
                Err(e) => Err(e),
            };
            match stop {
                Ok(Stop::SyscallExit) => {
                    let interrupted = self.at_own_install(ftid);
                    return Ok(Ok(!interrupted));
                }
                Ok(Stop::Exited(code)) => return Ok(Err(Death::Exited(code))),
                Ok(Stop::Killed(sig)) => return Ok(Err(Death::Killed(sig))),
                Ok(Stop::Signal(sig))
                    if crate::session::signals::is_synchronous_fault(sig, self.be.siginfo(ftid).ok().as_ref()) =>
                {
                    return Ok(Err(self.kill_stray(ftid)))
                }
                Ok(Stop::Seccomp) => return Ok(Err(self.kill_stray(ftid))),
                Ok(_) => {
                    self.be.steer().resume(ftid, Resume::ToExit);
                }
                Err(_) => return Ok(Err(self.death_of(ftid).unwrap_or(Death::Killed(libc::SIGKILL)))),
            }
        }
    }

    /// Waits for the death of a thread that is known to be dying (its seccomp notification
    /// vanished, or we killed it); `None` if it cannot be waited for. Never a blocking
    /// wait for that one thread: a dying process's main thread is reported only once
    /// every other thread of it was reaped, which only the event loop's wait for any
    /// thread does (seen in a fault campaign: the monitor waited for ever for a killed
    /// multi-threaded replica's main thread, a hang). A zombie counts as dead; the event
    /// loop reaps it later and ignores it (`by_tid` no longer names it).
    fn death_of(&mut self, tid: Tid) -> Option<Death> {
        loop {
            match self.be.try_wait_tid(tid) {
                Ok(Some(lockstep_trace::Stop::Exited(code))) => return Some(Death::Exited(code)),
                Ok(Some(lockstep_trace::Stop::Killed(sig))) => return Some(Death::Killed(sig)),
                Ok(Some(_)) => self.be.steer().resume(tid, Resume::Run),
                // A zombie, or gone from /proc.
                Ok(None) if matches!(super::thread_state(&self.be, tid), None | Some('Z' | 'X')) => {
                    return Some(Death::Killed(libc::SIGKILL))
                }
                Ok(None) => std::thread::sleep(std::time::Duration::from_millis(1)),
                Err(_) => return None,
            }
        }
    }

    /// Every replica has finished its part of an all-replica call: compare the results.
    pub fn maybe_complete_all(&mut self, task: TaskId) -> Result<(), Stopped> {
        let (nr, args, leader_first) = match self.tasks[task].phase() {
            Phase::All { nr, args } => (nr, args, false),
            Phase::Followers { nr, args } => (nr, args, true),
            _ => return Ok(()),
        };
        let live: Vec<ReplicaId> = self
            .live_slots(task)
            .into_iter()
            .filter(|&r| self.slot(task, r).state() != SlotState::Dead)
            .collect();
        if live.is_empty() || live.iter().any(|&r| self.slot(task, r).state() != SlotState::Done) {
            return Ok(());
        }
        // A leader that died in the call (and is not voted out yet) has no result: the
        // replica that will lead in its place gives it. Its stale result would have been
        // every replica's, and a clone's parent given 0 goes on as the child.
        let leader = Some(self.replicas.leader())
            .filter(|l| live.contains(l))
            .unwrap_or(live[0]);
        let lead_ret = self.slot(task, leader).result();
        let returns_pid = [libc::SYS_clone, libc::SYS_clone3, libc::SYS_fork, libc::SYS_vfork]
            .iter()
            .any(|&s| is_nr(nr, s));
        let waits = is_nr(nr, libc::SYS_wait4) || is_nr(nr, libc::SYS_waitid);
        if returns_pid && lead_ret > 0 {
            if let Some(child) = self.tasks[task].spawned() {
                self.tasks[child].set_logical_tid(lead_ret as i32);
                let p = self.tasks[child].process();
                if self.processes[p].logical_pid == 0 {
                    self.processes[p].logical_pid = lead_ret as i32;
                }
            }
        }
        // Results as the program sees them (pids translated to logical ones).
        let mut results = Vec::new();
        for &r in &live {
            let own = self.slot(task, r).result();
            let logical = if returns_pid && own > 0 {
                if own != lead_ret {
                    self.replicas.learn_pid(r, lead_ret as i32, own as i32);
                }
                lead_ret
            } else if waits && own > 0 {
                self.to_logical(r, own as i32) as i64
            } else {
                own
            };
            results.push(logical);
        }
        let desc = syscalls::describe(nr);
        let name = syscalls::name(nr);
        // Per-replica outputs that legitimately differ (rusage, siginfo times) come from
        // the leader, like inputs.
        let outputs = match (leader_first || waits, desc) {
            (true, Some(d)) => Some(data::collect_outputs(
                &self.be,
                self.slot(task, leader).tid(),
                d,
                &args,
                lead_ret,
            )),
            _ => None,
        };
        // Registers at the call's exit, as the kernel left them. A replica whose registers
        // cannot be read is failing (the backend records it); its result is left alone.
        let ended: Vec<(ReplicaId, lockstep_trace::Regs, i64)> = live
            .iter()
            .zip(&results)
            .map(|(&r, &result)| {
                let regs = self.be.regs(self.slot(task, r).tid()).unwrap_or_else(|_| {
                    let mut regs = self.slot(task, r).regs();
                    regs.rax = result as u64;
                    regs
                });
                (r, regs, result)
            })
            .collect();
        let succeeded_exec = (is_nr(nr, libc::SYS_execve) || is_nr(nr, libc::SYS_execveat)) && lead_ret == 0;
        if is_nr(nr, libc::SYS_munmap) && lead_ret == 0 {
            self.forget_unmapped(task, &args);
        }
        if succeeded_exec {
            self.after_exec(task, &live);
        }
        self.tasks[task].end();
        self.tasks[task].signals.clear_kick();
        let fold = self.opts.compare != CompareMode::Io;
        let plan = plan::all_done_plan(leader, &ended, outputs.is_some(), fold);
        // The vote's members and results as it goes, for the divergence's description.
        let (mut members, mut results): (Vec<ReplicaId>, Vec<i64>) = ended.iter().map(|e| (e.0, e.2)).unzip();
        for command in plan {
            match command {
                Command::CopyResults(f) => {
                    if let (Some(o), Some(d)) = (&outputs, desc) {
                        let own = ptrace::syscall_args(&self.slot(task, f).regs());
                        data::apply_outputs(&self.be, self.slot(task, f).tid(), d, &own, lead_ret, o);
                    }
                }
                Command::FoldResult(r, v) => self.slot_mut(task, r).fold_u64(v as u64),
                Command::RaiseMirrored(f) => self.raise_mirrored(task, f),
                Command::Agree { .. } => {}
                Command::VoteOut(r) => {
                    self.stats.divergences += 1;
                    let values = describe_results(&members, &results, &name);
                    self.emit(
                        Event::new("run", "divergence", "vote")
                            .replica(r)
                            .object(format!("task {task}"))
                            .values(values)
                            .message(format!("replica {r} got a different result from {name}")),
                    );
                    self.vote_out(r, format!("majority agrees that replica {r} is faulty"))?;
                    let i = members.iter().position(|&m| m == r).expect("a member is voted out");
                    members.remove(i);
                    results.remove(i);
                }
                Command::Halt => {
                    self.stats.divergences += 1;
                    let values = describe_results(&members, &results, &name);
                    self.emit(
                        Event::new("run", "divergence", "halt")
                            .values(values.clone())
                            .message(format!("results of {name} differ: {}", values.join(" / "))),
                    );
                    return Err(self.halt("no majority agrees on the result".into()));
                }
                other => self.carry_out(task, vec![other])?,
            }
        }
        self.tasks[task].signals.take_mirror();
        Ok(())
    }

    /// Makes the fresh images identical: hides the vDSO (so time is a syscall) and gives
    /// every replica the leader's AT_RANDOM bytes.
    fn after_exec(&mut self, task: TaskId, live: &[ReplicaId]) {
        let leader = self.replicas.leader();
        let mut random = None;
        let mut order: Vec<ReplicaId> = vec![leader];
        order.extend(live.iter().copied().filter(|&r| r != leader));
        for r in order {
            let tid = self.slot(task, r).tid();
            let Some(at_random) = patch_auxv(&self.be, tid) else {
                continue;
            };
            match random {
                None => random = self.be.read_vec(tid, at_random, 16).ok(),
                Some(ref bytes) => {
                    self.be.steer().write(tid, at_random, bytes);
                }
            }
        }
    }

    /// The logical pid the leader's wait4/waitid reaped (0: none was ready), or None when
    /// the call failed and the followers should simply repeat it.
    fn reaped_child(&self, task: TaskId, nr: u64, args: &[u64; 6], ret: i64) -> Option<i32> {
        let leader = self.replicas.leader();
        if is_nr(nr, libc::SYS_wait4) {
            return (ret >= 0).then(|| self.to_logical(leader, ret as i32));
        }
        if is_nr(nr, libc::SYS_waitid) && ret == 0 && args[2] != 0 {
            let mut pid = [0u8; 4];
            self.be
                .read(self.slot(task, leader).tid(), args[2] + 16, &mut pid)
                .ok()?;
            return Some(self.to_logical(leader, i32::from_le_bytes(pid)));
        }
        None
    }

    /// Rewrites a follower's wait call to wait for exactly `pid`, blocking: that child's
    /// exit rendezvous has released every replica of it, so it is about to be a zombie
    /// here too even if it is not one yet.
    fn wait_for_child(&mut self, task: TaskId, f: ReplicaId, nr: u64, pid: i32) {
        let tid = self.slot(task, f).tid();
        let mut regs = self.slot(task, f).regs();
        let no_hang = !(libc::WNOHANG as u64);
        if is_nr(nr, libc::SYS_wait4) {
            regs.rdi = pid as i64 as u64;
            regs.rdx &= no_hang;
        } else {
            regs.rdi = libc::P_PID as u64;
            regs.rsi = pid as u64;
            regs.r10 &= no_hang;
        }
        self.be.steer().set_regs(tid, &regs);
    }

    /// Pid arguments are logical; a re-integrated replica may use other numbers.
    fn translate_pid_args(&mut self, task: TaskId, r: ReplicaId, nr: u64, args: &[u64; 6]) {
        if !self.replicas.translates(r) {
            return;
        }
        let positions: &[usize] = match nr as i64 {
            libc::SYS_kill
            | libc::SYS_tkill
            | libc::SYS_wait4
            | libc::SYS_getpgid
            | libc::SYS_getsid
            | libc::SYS_pidfd_open => &[0],
            libc::SYS_prlimit64
            | libc::SYS_sched_setscheduler
            | libc::SYS_sched_setparam
            | libc::SYS_rt_sigqueueinfo => &[0],
            libc::SYS_tgkill | libc::SYS_setpgid | libc::SYS_rt_tgsigqueueinfo => &[0, 1],
            libc::SYS_waitid if args[0] == libc::P_PID as u64 || args[0] == libc::P_PGID as u64 => &[1],
            _ => return,
        };
        let tid = self.slot(task, r).tid();
        let mut regs = self.slot(task, r).regs();
        let mut changed = false;
        for &i in positions {
            let old = args[i] as i64 as i32;
            let new = self.to_local(r, old);
            if new != old {
                changed = true;
                match i {
                    0 => regs.rdi = new as i64 as u64,
                    _ => regs.rsi = new as i64 as u64,
                }
            }
        }
        if changed {
            self.be.steer().set_regs(tid, &regs);
        }
    }

    /// Forks a fresh replica from a healthy one when the program is a single
    /// single-threaded process (not at a call that starts a thread: see
    /// `starts_a_thread`). Returns true when it did (the task's replicas will
    /// arrive again at the same call).
    fn reintegrate(&mut self, task: TaskId) -> Result<bool, Stopped> {
        let live_tasks: Vec<TaskId> = (0..self.tasks.len())
            .filter(|&t| !self.tasks[t].is_finished())
            .collect();
        if live_tasks != [task] {
            if !self.reintegration_note_given {
                self.reintegration_note_given = true;
                self.emit(Event::new("run", "reintegrate", "defer").message(format!(
                    "re-integration waits: the program has {} live threads/processes, only a single single-threaded process can be forked",
                    live_tasks.len()
                )));
            }
            return Ok(false);
        }
        let t0 = Instant::now();
        let live = self.live_slots(task);
        let source = live
            .iter()
            .copied()
            .find(|&r| r != self.replicas.leader())
            .unwrap_or(self.replicas.leader());
        // A fork does not copy child processes: a source with children (even zombies it
        // has not reaped yet) would give the new replica a different wait() result.
        if self.be.has_children(self.slot(task, source).tgid()) {
            return Ok(false);
        }
        let dead = self.replicas.free_cpu();
        let stid = self.slot(task, source).tid();
        let saved = self.slot(task, source).regs();
        let nr = saved.orig_rax;
        let mut inject = saved;
        inject.orig_rax = NR_CLONE;
        inject.rdi = (libc::CLONE_PARENT | libc::SIGCHLD) as u64;
        inject.rsi = 0;
        inject.rdx = 0;
        inject.r10 = 0;
        inject.r8 = 0;
        self.be
            .set_regs(stid, &inject)
            .map_err(|e| Error::Io("PTRACE_SETREGS", e))?;
        self.be
            .resume(stid, Resume::ToExit)
            .map_err(|e| Error::Io("PTRACE_SYSCALL", e))?;
        let mut child: Tid = 0;
        // A signal of the source's own pending when the fork starts (a timer that fired
        // while it waited at this meeting) fails it with ERESTARTNOINTR. The kernel then
        // delivers that signal (suppressed below) and runs the fork again: a few tries
        // here, or a timer faster than a meeting would postpone it at every meeting.
        const ERESTARTNOINTR: i64 = 513;
        let mut tries = 0;
        loop {
            match self.be.wait_tid(stid).map_err(|e| Error::Io("waitpid", e))? {
                lockstep_trace::Stop::Event(libc::PTRACE_EVENT_FORK) => {
                    child = self
                        .be
                        .event_msg(stid)
                        .map_err(|e| Error::Io("PTRACE_GETEVENTMSG", e))? as Tid;
                    self.be.steer().resume(stid, Resume::ToExit);
                }
                // The failed fork's exit, then (after the signal) the retried fork's entry,
                // which a syscall stop shows with -ENOSYS in rax.
                lockstep_trace::Stop::SyscallExit
                    if child == 0
                        && tries < 8
                        && self.be.regs(stid).is_ok_and(|r| {
                            r.rax as i64 == -ERESTARTNOINTR
                                || (r.rax as i64 == -(libc::ENOSYS as i64) && r.orig_rax == NR_CLONE)
                        }) =>
                {
                    tries += 1;
                    self.be.steer().resume(stid, Resume::ToExit);
                }
                lockstep_trace::Stop::SyscallExit => break,
                lockstep_trace::Stop::Signal(sig) => {
                    // Keep the leader's copy for deterministic delivery later.
                    if source == self.replicas.leader() {
                        self.async_signal(task, sig);
                    }
                    self.be.steer().resume(stid, Resume::ToExit);
                }
                lockstep_trace::Stop::Exited(_) | lockstep_trace::Stop::Killed(_) => {
                    return Err(Stopped::Failure(Error::Setup("the re-integration source died".into())))
                }
                _ => {
                    self.be.steer().resume(stid, Resume::ToExit);
                }
            }
        }
        let local_pid = self.be.regs(stid).map(|r| r.rax as i64).unwrap_or(-1);
        // The source runs the interrupted call again from scratch (it stands at the exit of
        // the fork now), and so does the new replica.
        let mut rewound = saved;
        ptrace::rewind_to_syscall(&mut rewound, nr);
        self.be.steer().set_regs(stid, &rewound);
        if child <= 0 || local_pid <= 0 {
            // A signal of the source's own that came during every try (ERESTARTNOINTR)
            // only postpones it to the next meeting; anything else ends the attempts.
            if local_pid != -ERESTARTNOINTR {
                self.emit(
                    Event::new("run", "reintegrate", "fail")
                        .replica(source)
                        .message(format!("fork of replica {source} failed ({local_pid})")),
                );
                self.reintegration_due = false;
            }
            // It arrives at its call again, and the meeting is decided then.
            self.resume(task, source, Resume::Run, SlotState::Running);
            return Ok(true);
        }
        loop {
            match self.be.wait_tid(child).map_err(|e| Error::Io("waitpid", e))? {
                lockstep_trace::Stop::EventStop(_) | lockstep_trace::Stop::Signal(libc::SIGSTOP) => break,
                lockstep_trace::Stop::Exited(_) | lockstep_trace::Stop::Killed(_) => {
                    return Err(Stopped::Failure(Error::Setup("the new replica died at birth".into())))
                }
                _ => {}
            }
        }
        self.early_stops.remove(&child);
        self.be.steer().set_regs(child, &rewound);
        if let Some(cpu) = dead {
            self.be.pin(child, cpu);
        }
        let process = self.tasks[task].process();
        let logical = self.processes[process].logical_pid;
        self.fast_off();
        let id = self.replicas.add_fork(source, dead, local_pid as i32, logical);
        let ids = self.replicas.ids();
        for t in self.tasks.iter_mut() {
            t.grow(ids);
        }
        self.tasks[task].fork_clocks(source, id);
        let slot = Slot::fork_of(self.slot(task, source), child);
        self.tasks[task].place(id, slot);
        self.by_tid.insert(child, (task, id));
        self.reintegration_due = self.replicas.short();
        if !self.reintegration_due {
            // Every replica is stopped at this call: the fast path's next ring is attached
            // right after it.
            self.arm_next_ring(task);
        }
        self.resume(task, source, Resume::Run, SlotState::Running);
        self.be.steer().resume(child, Resume::Run);
        self.stats.reintegrations += 1;
        let rss = self
            .be
            .proc_read(child, "statm")
            .ok()
            .and_then(|s| s.split_whitespace().nth(1).and_then(|v| v.parse::<u64>().ok()))
            .unwrap_or(0)
            * 4;
        let us = t0.elapsed().as_micros() as u64;
        self.emit(
            Event::new("run", "reintegrate", "fork")
                .replica(id)
                .values(vec![format!("source={source}"), format!("resident_kib={rss}")])
                .duration_us(us)
                .message(format!(
                    "replica {id} forked from replica {source} ({rss} KiB resident); back to {} replicas",
                    self.live_replicas().len()
                )),
        );
        Ok(true)
    }
}

/// Whether a call is an externally visible output, voted on in every compare mode.
/// What the leader's call left for the followers: its results in memory, the descriptors
/// it created or received, and its return value.
struct LeaderCall<'a> {
    desc: &'a Desc,
    outputs: &'a data::Outputs,
    fds: &'a [i32],
    leader_tgid: Tid,
    ret: i64,
}

/// One line per vote member: `replica R: NAME = RESULT`.
fn describe_results(members: &[ReplicaId], results: &[i64], name: &str) -> Vec<String> {
    members
        .iter()
        .zip(results)
        .map(|(m, v)| format!("replica {m}: {name} = {v}"))
        .collect()
}

fn is_output(nr: u64, desc: Option<&Desc>, args: &[u64; 6]) -> bool {
    is_nr(nr, libc::SYS_exit_group)
        || desc
            .map(|d| syscalls::classify(d, args) == Class::Output)
            .unwrap_or(false)
}

/// The descriptors a descriptor-creating call produced in the leader.
fn new_fds(desc: &Desc, args: &[u64; 6], ret: i64, outputs: &data::Outputs) -> Vec<i32> {
    if desc.nr == libc::SYS_ioctl as u64 && args[1] == syscalls::TIOCGPTPEER {
        return vec![ret as i32];
    }
    match desc.new_fds {
        NewFds::None => Vec::new(),
        NewFds::Ret => vec![ret as i32],
        NewFds::PairAt(i) => outputs
            .at(args[i as usize])
            .filter(|b| b.len() >= 8)
            .map(|b| vec![le::i32_at(b, 0), le::i32_at(b, 4)])
            .unwrap_or_default(),
    }
}

/// Whether descriptor `fd` of process `pid` is close-on-exec.
fn fd_cloexec(be: &dyn Backend, pid: Tid, fd: i32) -> bool {
    be.proc_read(pid, &format!("fdinfo/{fd}"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("flags:").map(|v| v.trim().to_string()))
        })
        .and_then(|v| u64::from_str_radix(&v, 8).ok())
        .map(|flags| flags & libc::O_CLOEXEC as u64 != 0)
        .unwrap_or(false)
}

/// Walks the new stack at exec (argc, argv, envp, auxv) and hides the vDSO. Returns the
/// address of the 16 AT_RANDOM bytes.
fn patch_auxv(be: &dyn Backend, tid: Tid) -> Option<u64> {
    let regs = be.regs(tid).ok()?;
    let word = |addr: u64| -> Option<u64> {
        let mut b = [0u8; 8];
        be.read(tid, addr, &mut b).ok()?;
        Some(u64::from_le_bytes(b))
    };
    let mut p = regs.rsp;
    let argc = word(p)?;
    p += 8 * (argc + 2); // argc, argv[], NULL
    while word(p)? != 0 {
        p += 8; // envp[]
    }
    p += 8;
    let mut random = None;
    for _ in 0..64 {
        let (kind, value) = (word(p)?, word(p + 8)?);
        match kind {
            AT_NULL => break,
            AT_SYSINFO_EHDR => {
                be.write(tid, p, &AT_IGNORE.to_le_bytes()).ok()?;
            }
            AT_RANDOM => random = Some(value),
            _ => {}
        }
        p += 16;
    }
    random
}

/// Whether a call may start a thread (a clone with CLONE_THREAD, or a clone3, whose flags
/// are in memory). Re-integration does not fork at one: the new replica would make the
/// same call and be threaded at once, and the fast path's next ring, attached as the call
/// returns, would race with the new thread's request for a lane, differently in each
/// replica.
fn starts_a_thread(nr: u64, args: [u64; 6]) -> bool {
    (nr == libc::SYS_clone as u64 && args[0] & libc::CLONE_THREAD as u64 != 0) || nr == libc::SYS_clone3 as u64
}

//! The monitor's nouns below the session: a logical **task** (the same thread in every
//! replica) and its per-replica **slots**.
//!
//! Their state is private: it changes only through the transitions below, which assert
//! the invariants the policy relies on (a task leaves `Collect` only from `Collect`; a
//! dead slot stays dead; a slot that executes its part of a call has arrived first). The
//! policy that decides the transitions lives in `session.rs` and `rendezvous.rs`; what a
//! task knows about signals and `--compare io` inputs lives in the nouns
//! [`crate::session::signals::TaskSignals`] and [`InputQueue`].

use crate::session::signals::{SlotSignals, TaskSignals};
use lockstep_core::{exit, Signature};
use lockstep_trace::syscalls::Class;
use lockstep_trace::{Regs, Tid};
use std::collections::{HashMap, VecDeque};
use std::time::Instant;

pub type TaskId = usize;
pub type ProcId = usize;
pub type ReplicaId = u32;

pub use crate::data::PREVIEW;

/// How a thread ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Death {
    Exited(i32),
    Killed(i32),
}

impl Death {
    pub fn exit_status(self) -> i32 {
        match self {
            Death::Exited(c) => c,
            Death::Killed(s) => exit::SIGNAL_BASE + s,
        }
    }
}

/// What a slot stopped at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arrival {
    Syscall {
        nr: u64,
        args: [u64; 6],
    },
    /// A synchronous fault (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGTRAP).
    Fault {
        sig: i32,
        addr: u64,
    },
    /// A trapped RDTSC (2 bytes) or RDTSCP (3 bytes).
    Rdtsc {
        len: u8,
    },
    /// A trapped CPUID (only where the CPU supports CPUID faulting) for leaf/subleaf.
    Cpuid {
        leaf: u32,
        subleaf: u32,
    },
    Died(Death),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotState {
    /// Auto-attached, waiting for its first stop.
    Starting,
    Running,
    /// Stopped at a rendezvous (also: parked while the leader executes).
    Arrived,
    /// Inside a syscall we will see the exit of.
    Executing,
    /// Finished its part of an all-replica syscall; stopped at the syscall exit.
    Done,
    /// Its part was interrupted by one of its own (suppressed) signals: it runs the same
    /// call again when it next stops at it.
    Rerun,
    Dead,
}

/// One replica's thread of a task.
pub struct Slot {
    tid: Tid,
    /// The slot's process id (thread group) in our namespace.
    tgid: Tid,
    state: SlotState,
    arrival: Option<Arrival>,
    /// Its registers at its latest arrival.
    regs: Regs,
    signature: Signature,
    /// Intercepted syscall stops so far (for test flips).
    stops: u64,
    /// Result of this slot's execution in an all-replica phase.
    result: i64,
    /// The first bytes of the buffer of the output call it arrived at (for messages),
    /// kept from the comparison so that describing a divergence reads no memory.
    preview: [u8; PREVIEW],
    preview_len: u8,
    /// `--compare io`: inputs of this task this replica has executed or been given.
    consumed: u64,
    /// What it expects of signals (see `signals.rs`).
    pub(crate) signals: SlotSignals,
    /// A catch-up left an execution breakpoint in the thread (see `catch_up.rs`).
    breakpoint_armed: bool,
}

impl Slot {
    pub fn new(tid: Tid, tgid: Tid, state: SlotState) -> Self {
        Slot {
            tid,
            tgid,
            state,
            arrival: None,
            // SAFETY: all-zero is a valid user_regs_struct.
            regs: unsafe { std::mem::zeroed() },
            signature: Signature::new(),
            stops: 0,
            result: 0,
            preview: [0; PREVIEW],
            preview_len: 0,
            consumed: 0,
            signals: SlotSignals::default(),
            breakpoint_armed: false,
        }
    }

    /// A new thread or process of the same replica: it continues its parent's history.
    pub fn child_of(parent: &Slot, tid: Tid, tgid: Tid, state: SlotState) -> Self {
        Slot {
            signature: parent.signature,
            ..Slot::new(tid, tgid, state)
        }
    }

    /// A re-integrated replica's thread, forked from `source`'s: it has seen what `source`
    /// has seen.
    pub fn fork_of(source: &Slot, tid: Tid) -> Self {
        Slot {
            signature: source.signature,
            stops: source.stops,
            consumed: source.consumed,
            ..Slot::new(tid, tid, SlotState::Running)
        }
    }

    pub fn tid(&self) -> Tid {
        self.tid
    }

    /// A multi-threaded exec: this thread took over the thread-group id `tid`.
    pub fn took_over(&mut self, tid: Tid) {
        self.tid = tid;
    }

    pub fn tgid(&self) -> Tid {
        self.tgid
    }

    pub fn state(&self) -> SlotState {
        self.state
    }

    pub fn is_dead(&self) -> bool {
        self.state == SlotState::Dead
    }

    pub fn arrival(&self) -> Option<Arrival> {
        self.arrival
    }

    /// Its registers at its latest arrival.
    pub fn regs(&self) -> Regs {
        self.regs
    }

    pub fn signature(&self) -> &Signature {
        &self.signature
    }

    pub fn stops(&self) -> u64 {
        self.stops
    }

    /// Its result in the all-replica phase that just ended.
    pub fn result(&self) -> i64 {
        self.result
    }

    pub fn consumed(&self) -> u64 {
        self.consumed
    }

    /// The first bytes of the output it arrived at.
    pub fn preview(&self) -> &[u8] {
        &self.preview[..self.preview_len as usize]
    }

    /// Stopped at `arrival` with `regs`: it waits at the rendezvous.
    pub fn arrive(&mut self, regs: Regs, arrival: Arrival) {
        assert!(!self.is_dead(), "thread {} arrives after its death", self.tid);
        self.regs = regs;
        self.state = SlotState::Arrived;
        self.arrival = Some(arrival);
    }

    /// A fault changed its registers while it waits for a vote: the vote sees the call as
    /// the fault left it.
    pub fn rearrive(&mut self, regs: Regs) {
        assert_eq!(self.state, SlotState::Arrived, "only a waiting thread is re-read");
        if let Some(Arrival::Syscall { .. }) = self.arrival {
            self.arrival = Some(Arrival::Syscall {
                nr: lockstep_trace::ptrace::syscall_nr(&regs),
                args: lockstep_trace::ptrace::syscall_args(&regs),
            });
        }
        self.regs = regs;
    }

    /// Stopped again at a call the others already completed: it runs its own part now.
    pub fn rejoin(&mut self, regs: Regs) {
        assert!(!self.is_dead(), "thread {} rejoins after its death", self.tid);
        self.regs = regs;
        self.state = SlotState::Executing;
        self.arrival = None;
    }

    /// Counts an intercepted syscall stop; signals it sent itself at the previous call
    /// and that were not delivered right after it are ordinary signals from now on.
    pub fn count_stop(&mut self) {
        self.stops += 1;
        self.signals.forget_own();
    }

    /// Resumed into `state`; it keeps its arrival only while it stays parked at it.
    pub fn leave(&mut self, state: SlotState) {
        assert!(
            !self.is_dead() || state == SlotState::Dead,
            "thread {} is resumed after its death",
            self.tid
        );
        self.state = state;
        if state != SlotState::Arrived {
            self.arrival = None;
        }
    }

    /// Whether a catch-up left an execution breakpoint in it.
    pub fn breakpoint_armed(&self) -> bool {
        self.breakpoint_armed
    }

    /// A catch-up set (`true`) or removed (`false`) an execution breakpoint in it.
    pub fn set_breakpoint_armed(&mut self, armed: bool) {
        self.breakpoint_armed = armed;
    }

    /// Its first stop after it was auto-attached.
    pub fn started(&mut self) {
        if self.state == SlotState::Starting {
            self.state = SlotState::Running;
        }
    }

    /// An interrupted part runs again at its next stop: returns whether it was one.
    pub fn take_rerun(&mut self) -> bool {
        let rerun = self.state == SlotState::Rerun;
        if rerun {
            self.state = SlotState::Executing;
        }
        rerun
    }

    /// Its part of an all-replica call finished with `result`.
    pub fn finish(&mut self, result: i64) {
        assert!(!self.is_dead(), "a dead thread {} finishes no call", self.tid);
        self.result = result;
        self.state = SlotState::Done;
    }

    pub fn die(&mut self, death: Death) {
        self.state = SlotState::Dead;
        self.arrival = Some(Arrival::Died(death));
    }

    /// Folds the call it arrived at into its history and returns the history's value.
    /// `preview` is what describes the call's output in messages.
    pub fn fold_call(&mut self, nr: u64, crc: u32, fold: bool, preview: Option<(&[u8; PREVIEW], u8)>) -> u64 {
        match preview {
            Some((bytes, len)) => {
                self.preview = *bytes;
                self.preview_len = len;
            }
            None => self.preview_len = 0,
        }
        if fold {
            self.signature.begin_event();
            self.signature.fold_u64(nr);
            self.signature.fold_u32(crc);
        }
        self.signature.digest() ^ self.signature.events.rotate_left(17)
    }

    /// Folds bytes every replica must agree on into its history.
    pub fn fold_bytes(&mut self, bytes: &[u8]) {
        self.signature.fold_bytes(bytes);
    }

    pub fn fold_u64(&mut self, value: u64) {
        self.signature.fold_u64(value);
    }

    /// `--compare io`: it executed or was given input `index`.
    pub fn consumed_input(&mut self, index: u64) {
        debug_assert!(index >= self.consumed, "inputs are consumed in order");
        self.consumed = index + 1;
    }
}

/// Where a task is in its current rendezvous.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Collect,
    /// The leader executes an input/output/fd-creating call; followers are parked.
    Leader {
        nr: u64,
        args: [u64; 6],
        class: Class,
    },
    /// The leader executes a call that every replica then executes (wait4).
    LeaderFirst {
        nr: u64,
        args: [u64; 6],
    },
    /// Followers execute after the leader.
    Followers {
        nr: u64,
        args: [u64; 6],
    },
    /// Every replica executes the call at once.
    All {
        nr: u64,
        args: [u64; 6],
    },
}

/// A logical thread: the same thread in every replica.
pub struct Task {
    id: TaskId,
    process: ProcId,
    /// Indexed by replica id.
    slots: Vec<Option<Slot>>,
    phase: Phase,
    /// When the first replica arrived at the current rendezvous (for straggler timeouts).
    first_arrival: Option<Instant>,
    /// The logical child created by the clone/fork rendezvous in progress.
    spawned: Option<TaskId>,
    /// The logical thread id the program sees.
    logical_tid: i32,
    finished: bool,
    /// Asynchronous signals on their way to this task (see `signals.rs`).
    pub(crate) signals: TaskSignals,
    /// Replicas being brought to a common state to take a signal (see `catch_up.rs`).
    pub(crate) catch_up: Option<crate::session::catch_up::CatchUp>,
    /// Clock values, per clock id (see `clock.rs`).
    clocks: HashMap<i32, crate::clock::Sequence>,
    /// `--compare io`: the leader's inputs the followers have not all consumed.
    pub(crate) inputs: InputQueue,
}

impl Task {
    pub fn new(id: TaskId, process: ProcId, logical_tid: i32, replica_ids: usize) -> Self {
        Task {
            id,
            process,
            slots: (0..replica_ids).map(|_| None).collect(),
            phase: Phase::Collect,
            first_arrival: None,
            spawned: None,
            logical_tid,
            finished: false,
            signals: TaskSignals::default(),
            catch_up: None,
            clocks: HashMap::new(),
            inputs: InputQueue::default(),
        }
    }

    pub fn id(&self) -> TaskId {
        self.id
    }

    pub fn process(&self) -> ProcId {
        self.process
    }

    pub fn logical_tid(&self) -> i32 {
        self.logical_tid
    }

    /// The program learns a new thread's id from its parent's clone result.
    pub fn set_logical_tid(&mut self, tid: i32) {
        self.logical_tid = tid;
    }

    pub fn slot(&self, r: ReplicaId) -> Option<&Slot> {
        self.slots.get(r as usize).and_then(|s| s.as_ref())
    }

    pub fn slot_mut(&mut self, r: ReplicaId) -> Option<&mut Slot> {
        self.slots.get_mut(r as usize).and_then(|s| s.as_mut())
    }

    /// Every replica's thread of this task that exists.
    pub fn slots(&self) -> impl Iterator<Item = &Slot> {
        self.slots.iter().flatten()
    }

    /// Replica `r`'s thread of this task appeared.
    pub fn place(&mut self, r: ReplicaId, slot: Slot) {
        let cell = &mut self.slots[r as usize];
        assert!(cell.is_none(), "task {} has one thread per replica", self.id);
        *cell = Some(slot);
    }

    /// Makes room for replica ids up to `ids` (a re-integrated replica gets a new id).
    pub fn grow(&mut self, ids: usize) {
        if self.slots.len() < ids {
            self.slots.resize_with(ids, || None);
        }
    }

    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// Starts executing the call the replicas met at.
    pub fn begin(&mut self, phase: Phase) {
        assert_eq!(
            self.phase,
            Phase::Collect,
            "task {} executes one call at a time",
            self.id
        );
        assert_ne!(phase, Phase::Collect);
        self.phase = phase;
    }

    /// The leader finished a call that the followers now run.
    pub fn hand_to_followers(&mut self) {
        let Phase::LeaderFirst { nr, args } = self.phase else {
            panic!("task {}: followers run after the leader only in LeaderFirst", self.id);
        };
        self.phase = Phase::Followers { nr, args };
        self.first_arrival = Some(Instant::now());
    }

    /// The rendezvous is over: the task collects arrivals again.
    pub fn end(&mut self) {
        self.phase = Phase::Collect;
        self.first_arrival = None;
    }

    /// Back to collecting with the arrivals kept (every replica is back at the call).
    pub fn recollect(&mut self) {
        self.phase = Phase::Collect;
    }

    /// When the first replica arrived at the current rendezvous.
    pub fn waiting_since(&self) -> Option<Instant> {
        self.first_arrival
    }

    /// A replica arrived: the straggler clock starts if it has not.
    pub fn note_arrival(&mut self) {
        self.first_arrival.get_or_insert_with(Instant::now);
    }

    /// Nobody waits any more (the arrivals were served without a rendezvous).
    pub fn stop_waiting(&mut self) {
        self.first_arrival = None;
    }

    /// The sequence of values of clock `id` (see `clock.rs`).
    pub fn clock(&mut self, id: i32) -> &mut crate::clock::Sequence {
        self.clocks.entry(id).or_default()
    }

    /// A rendezvous is a barrier for the task: clock reads start fresh sequences.
    pub fn restart_clocks(&mut self) {
        self.clocks.clear();
    }

    /// Replica `id` was forked from `source`: it reads the clocks `source` would read.
    pub fn fork_clocks(&mut self, source: ReplicaId, id: ReplicaId) {
        for seq in self.clocks.values_mut() {
            seq.fork(source, id);
        }
    }

    pub fn spawned(&self) -> Option<TaskId> {
        self.spawned
    }

    pub fn set_spawned(&mut self, child: Option<TaskId>) {
        self.spawned = child;
    }

    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// Every replica's thread of this task is gone.
    pub fn finish(&mut self) {
        self.finished = true;
        self.first_arrival = None;
    }
}

/// The result of an input the leader ran without waiting for the followers.
pub struct InputRecord {
    pub(crate) index: u64,
    pub(crate) nr: u64,
    pub(crate) ret: i64,
    pub(crate) outputs: crate::data::Outputs,
}

/// At most this many inputs may wait for slow followers; beyond it the leader waits too.
pub const MAX_QUEUED_INPUTS: usize = 256;
/// At most this many bytes of input results may wait for slow followers (per task).
pub const MAX_QUEUED_INPUT_BYTES: u64 = 64 << 20;

/// `--compare io`: the inputs the leader ran ahead of the followers, in order, bounded by
/// [`MAX_QUEUED_INPUTS`] and [`MAX_QUEUED_INPUT_BYTES`].
#[derive(Default)]
pub struct InputQueue {
    records: VecDeque<InputRecord>,
    /// Inputs the leader has run so far (the next record's index).
    produced: u64,
    bytes: u64,
}

impl InputQueue {
    /// Inputs the leader has run so far.
    pub fn produced(&self) -> u64 {
        self.produced
    }

    /// Whether the leader may run another input ahead without overrunning the bounds.
    pub fn has_room(&self) -> bool {
        self.records.len() < MAX_QUEUED_INPUTS && self.bytes < MAX_QUEUED_INPUT_BYTES
    }

    /// The leader ran input number `produced()`; followers still behind get `record` later.
    pub fn produce(&mut self, record: Option<InputRecord>) {
        if let Some(record) = record {
            assert_eq!(record.index, self.produced, "inputs are recorded in order");
            self.bytes += record.outputs.bytes();
            self.records.push_back(record);
        }
        self.produced += 1;
    }

    pub fn get(&self, index: u64) -> Option<&InputRecord> {
        self.records.iter().find(|rec| rec.index == index)
    }

    /// Drops the records every live replica has consumed (`min` is the least consumed).
    pub fn trim(&mut self, min: u64) {
        while self.records.front().is_some_and(|rec| rec.index < min) {
            if let Some(rec) = self.records.pop_front() {
                self.bytes -= rec.outputs.bytes();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::Outputs;

    fn regs_at(nr: u64) -> Regs {
        // SAFETY: all-zero is a valid user_regs_struct.
        let mut regs: Regs = unsafe { std::mem::zeroed() };
        regs.orig_rax = nr;
        regs
    }

    fn syscall(nr: u64) -> Arrival {
        Arrival::Syscall { nr, args: [0; 6] }
    }

    #[test]
    fn a_slot_keeps_its_arrival_only_while_it_stays_parked() {
        let mut slot = Slot::new(10, 10, SlotState::Running);
        slot.arrive(regs_at(1), syscall(1));
        assert_eq!((slot.state(), slot.arrival()), (SlotState::Arrived, Some(syscall(1))));
        slot.leave(SlotState::Arrived);
        assert_eq!(slot.arrival(), Some(syscall(1)));
        slot.leave(SlotState::Executing);
        assert_eq!((slot.state(), slot.arrival()), (SlotState::Executing, None));
        slot.finish(-4);
        assert_eq!((slot.state(), slot.result()), (SlotState::Done, -4));
    }

    #[test]
    #[should_panic(expected = "arrives after its death")]
    fn a_dead_slot_never_arrives_again() {
        let mut slot = Slot::new(10, 10, SlotState::Running);
        slot.die(Death::Killed(9));
        assert_eq!(slot.arrival(), Some(Arrival::Died(Death::Killed(9))));
        slot.arrive(regs_at(1), syscall(1));
    }

    #[test]
    #[should_panic(expected = "resumed after its death")]
    fn a_dead_slot_is_never_resumed() {
        let mut slot = Slot::new(10, 10, SlotState::Running);
        slot.die(Death::Exited(0));
        slot.leave(SlotState::Running);
    }

    #[test]
    fn a_fault_while_parked_changes_the_call_the_vote_sees() {
        let mut slot = Slot::new(10, 10, SlotState::Running);
        slot.arrive(regs_at(1), syscall(1));
        let mut flipped = regs_at(3);
        flipped.rdi = 7;
        slot.rearrive(flipped);
        assert_eq!(
            slot.arrival(),
            Some(Arrival::Syscall {
                nr: 3,
                args: [7, 0, 0, 0, 0, 0]
            })
        );
    }

    #[test]
    fn children_and_forks_continue_their_source_s_history() {
        let mut parent = Slot::new(10, 10, SlotState::Running);
        parent.arrive(regs_at(1), syscall(1));
        let folded = parent.fold_call(1, 0xabcd, true, None);
        parent.count_stop();
        parent.consumed_input(0);
        let mut child = Slot::child_of(&parent, 11, 10, SlotState::Starting);
        assert_eq!(child.fold_call(1, 0, false, None), folded);
        assert_eq!((child.stops(), child.consumed()), (0, 0));
        let fork = Slot::fork_of(&parent, 12);
        assert_eq!((fork.stops(), fork.consumed(), fork.tgid()), (1, 1, 12));
    }

    #[test]
    fn a_task_runs_one_call_at_a_time() {
        let mut task = Task::new(0, 0, 100, 2);
        let call = Phase::LeaderFirst { nr: 61, args: [0; 6] };
        task.note_arrival();
        task.begin(call);
        task.hand_to_followers();
        assert_eq!(task.phase(), Phase::Followers { nr: 61, args: [0; 6] });
        assert!(task.waiting_since().is_some(), "the followers' part is timed");
        task.end();
        assert_eq!((task.phase(), task.waiting_since()), (Phase::Collect, None));
        let result = std::panic::catch_unwind(move || {
            let mut task = Task::new(0, 0, 100, 2);
            task.begin(call);
            task.begin(call);
        });
        assert!(result.is_err(), "a second call while one executes is refused");
    }

    #[test]
    #[should_panic(expected = "one thread per replica")]
    fn a_task_has_one_thread_per_replica() {
        let mut task = Task::new(0, 0, 100, 2);
        task.place(1, Slot::new(10, 10, SlotState::Running));
        task.place(1, Slot::new(11, 11, SlotState::Running));
    }

    fn record(index: u64, bytes: usize) -> InputRecord {
        InputRecord {
            index,
            nr: 0,
            ret: bytes as i64,
            outputs: Outputs {
                pieces: vec![(0x1000, vec![0; bytes])],
                passed_fds: Vec::new(),
            },
        }
    }

    #[test]
    fn the_input_queue_is_bounded_and_trimmed_in_order() {
        let mut queue = InputQueue::default();
        queue.produce(None);
        for i in 1..MAX_QUEUED_INPUTS as u64 {
            assert!(queue.has_room());
            queue.produce(Some(record(i, 1)));
        }
        assert!(queue.has_room(), "one slot left");
        queue.produce(Some(record(MAX_QUEUED_INPUTS as u64, 1)));
        assert!(!queue.has_room(), "at most {MAX_QUEUED_INPUTS} inputs wait");
        assert_eq!(queue.get(5).map(|r| r.index), Some(5));
        queue.trim(200);
        assert!(queue.get(199).is_none() && queue.get(200).is_some());
        assert!(queue.has_room());

        let mut big = InputQueue::default();
        big.produce(Some(record(0, MAX_QUEUED_INPUT_BYTES as usize)));
        assert!(!big.has_room(), "at most {MAX_QUEUED_INPUT_BYTES} bytes wait");
        big.trim(1);
        assert!(big.has_room());
    }
}

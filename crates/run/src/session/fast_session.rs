//! What the monitor does for the fast path (`fast.rs` holds the ring itself):
//!
//! * the shim's hellos: each replica learns its number, the ring's first thread gets lane
//!   0, and each thread the program starts later gets a free lane of its own (its records,
//!   votes and clock values), matched across replicas by creation order;
//! * a follower's DIVERGED report: a record that does not match the follower's own call;
//! * at every rendezvous of a task with a lane, every follower must have consumed exactly
//!   what the leader published in it (a replica that skipped or added calls differs);
//! * signals: a signal to deliver is posted to the lane's mailbox; the leader takes it as a
//!   SIGNAL record at its next call (a blocked fast call is ended for it), and every
//!   replica raises it on itself there (`at_ring_raise` lets those raises through);
//! * strict output checks: a leader's output from the fast gate runs only after the
//!   monitor compared it with every follower's vote (`fast_check.rs`);
//! * a change of the replica set switches the ring off; once re-integration makes it whole
//!   again, the replicas attach the next epoch's ring (`arm_next_ring`).

use crate::backend::{Backend, Resume};
use crate::fast::{Lane, DIVERGED_CRC, DIVERGED_LEADER, DIVERGED_STATE, OP_DIVERGED, OP_HELLO, OP_HELLO_THREAD};
use crate::session::{ReplicaId, Session, SlotState, Stopped, TaskId};
use lockstep_core::events::Event;
use lockstep_trace::{syscalls, Regs, FAST_GATE, SYS_LOCKSTEP_FAST};

impl Session {
    /// Whether `nr, args` is a replica's DIVERGED report, which is answered on arrival
    /// (the other replicas are not at a matching call).
    pub(crate) fn is_fast_report(nr: u64, args: &[u64; 6]) -> bool {
        nr == SYS_LOCKSTEP_FAST && args[0] == OP_DIVERGED
    }

    /// A DIVERGED report: a follower found a record in the leader's ring that does not
    /// match its own call or fails its CRC, or the leader found its own record wrong.
    pub(crate) fn on_fast_report(&mut self, task: TaskId, r: ReplicaId, args: [u64; 6]) -> Result<(), Stopped> {
        let Some(fast) = &self.fast else {
            return Ok(()); // not ours: the call fails with ENOSYS at its rendezvous
        };
        let (seq, own_nr, own_digest, lead_nr, lead_digest) = (args[1], args[2], args[3], args[4], args[5]);
        let own = crate::fast::call_name(own_nr);
        let leader = self.replicas.leader();
        if lead_nr == DIVERGED_CRC || lead_nr == DIVERGED_LEADER {
            fast.switch_off();
            // The leader's call ran, and what it gave is known to nobody for sure: no
            // replica can be given its result, so no vote can mask this.
            let what = if lead_nr == DIVERGED_CRC {
                format!("the leader's fast-path record #{seq} fails its CRC32C check (replica {r} was at {own})")
            } else {
                format!(
                    "leader {leader}'s record of its fast-path call #{seq} ({own}) does not match what the call returned \
                     (or that result is out of range for the call)"
                )
            };
            self.detected(
                Event::new("run", "divergence", "halt")
                    .replica(leader)
                    .object(format!("task {task}"))
                    .message(what.clone()),
            );
            return Err(self.halt(format!("{what}; no replica can be given that call's result")));
        }
        let what = |nr: u64, digest: u64, replica: ReplicaId| {
            let maps = match crate::fast::is_sync(nr) {
                true => self
                    .be
                    .proc_read(self.slot(task, replica).tgid(), "maps")
                    .unwrap_or_default(),
                false => String::new(),
            };
            match crate::fast::is_sync(nr) {
                true => record_text(nr, digest, &maps),
                false => format!("{} with digest {digest:016x}", crate::fast::call_name(nr)),
            }
        };
        if lead_nr != DIVERGED_STATE {
            match self.weigh_posted_votes(task, r, seq, own_digest) {
                PostedVerdict::NotPosted => {}
                PostedVerdict::AuthorGone => return self.resume_reporter(task, r),
                PostedVerdict::LeaderOdd => {
                    let msg = format!(
                        "leader {leader} posted output #{seq} of task {task} as {}, its followers made {}",
                        what(lead_nr, lead_digest, leader),
                        what(own_nr, own_digest, r)
                    );
                    self.replica_failed(task, leader, "divergence", msg)?;
                    return self.resume_reporter(task, r);
                }
            }
        }
        // The reporter fails: voted out (the ring stays on without it in a threaded
        // program, see `drop_follower_from_ring`; otherwise it is switched off), or a halt.
        let msg = if lead_nr == DIVERGED_STATE {
            format!(
                "replica {r}'s own fast-path state is corrupt: its wait for record #{seq} of task {task} ({}) gave an \
                 answer that cannot be",
                what(own_nr, own_digest, r)
            )
        } else {
            format!(
                "replica {r} diverged at task {task}: fast-path call #{seq} is {}; leader {leader} ran {}{}",
                what(own_nr, own_digest, r),
                what(lead_nr, lead_digest, leader),
                self.race_hint(task)
            )
        };
        self.replica_failed(task, r, "divergence", msg)
    }

    /// A follower found posted output `seq` of `task` different from its own call (its
    /// digest `own`, which it voted): the leader's word is not the truth here, as it is
    /// for an input, because the leader did not wait for anyone. With another follower
    /// alive, its vote decides (waiting for it up to POSTED_VOTE_PATIENCE): the same as
    /// the reporter's, and the leader is the odd one.
    fn weigh_posted_votes(&self, task: TaskId, r: ReplicaId, seq: u64, own: u64) -> PostedVerdict {
        /// How long the monitor waits for the other follower's vote on a posted output.
        const POSTED_VOTE_PATIENCE: std::time::Duration = std::time::Duration::from_secs(2);
        let Some(fast) = &self.fast else {
            return PostedVerdict::NotPosted;
        };
        let Some(lane) = fast.lane_of(task) else {
            return PostedVerdict::NotPosted;
        };
        let ring = fast.ring();
        let author = ring.author_of(lane, seq);
        let Some(posted) = ring.posted(lane, author, seq) else {
            return PostedVerdict::NotPosted;
        };
        let leader_region = fast.region(self.replicas.leader());
        if ring.is_lost(author) || Some(author) != leader_region {
            return PostedVerdict::AuthorGone; // its record was judged already
        }
        let Some(me) = fast.region(r) else {
            return PostedVerdict::NotPosted;
        };
        let others: Vec<u32> = self
            .live_replicas()
            .into_iter()
            .filter_map(|x| fast.region(x))
            .filter(|&x| x != author && x != me && !ring.is_lost(x))
            .collect();
        let deadline = std::time::Instant::now() + POSTED_VOTE_PATIENCE;
        for other in others {
            loop {
                match ring.post_vote(lane, seq, other) {
                    Some(vote) if vote == own && vote != posted.digest => return PostedVerdict::LeaderOdd,
                    Some(_) => break,
                    None if std::time::Instant::now() >= deadline || ring.passed(lane, other) >= seq => break,
                    None => std::thread::sleep(std::time::Duration::from_micros(50)),
                }
            }
        }
        PostedVerdict::NotPosted
    }

    /// Lets follower `r` of `task`, stopped at its DIVERGED report, go on: it makes its
    /// call through the monitor.
    fn resume_reporter(&mut self, task: TaskId, r: ReplicaId) -> Result<(), Stopped> {
        let tid = self.slot(task, r).tid();
        if let Ok(mut regs) = self.be.regs(tid) {
            lockstep_trace::ptrace::skip_with_result(&mut regs, 0);
            self.be.steer().set_regs(tid, &regs);
        }
        self.be.steer().resume(tid, Resume::Run);
        Ok(())
    }

    /// For a divergence at `task` in a program whose threads take places in the leader's
    /// order: each thread's latest place there, the task's own first, named by its call
    /// (and call site). A data race, the one cause of a divergence without a fault that the
    /// order cannot remove, is between the task and one of the others, through memory
    /// that they touched after those events. Empty when no other thread has a place.
    pub(super) fn race_hint(&self, task: TaskId) -> String {
        /// How many other threads the hint names.
        const THREADS: usize = 4;
        let Some(fast) = self.fast.as_ref() else {
            return String::new();
        };
        let Some(lane) = fast.lane_of(task) else {
            return String::new();
        };
        let recent = fast.recent_order(usize::MAX);
        // Each lane once, by its latest place (newest first), the task's own lane first.
        let mut latest: Vec<&crate::fast::OrderPlace> = Vec::new();
        for p in &recent {
            if !latest.iter().any(|q| q.lane == p.lane) {
                latest.push(p);
            }
        }
        latest.sort_by_key(|p| p.lane != lane);
        let others = latest.iter().filter(|p| p.lane != lane).count();
        if others == 0 {
            return String::new();
        }
        let maps = self
            .be
            .proc_read(self.slot(task, self.replicas.leader()).tgid(), "maps")
            .unwrap_or_default();
        let named: Vec<String> = latest
            .iter()
            .take(THREADS + 1)
            .map(|p| {
                let who = match fast.task_of(p.lane) {
                    Some(t) if t == task => format!("task {t} (this one)"),
                    Some(t) => format!("task {t}"),
                    None => format!("lane {}", p.lane),
                };
                let call = fast
                    .leader_record_call(p.lane, p.seq)
                    .map_or("a call no longer in the ring".to_string(), |(nr, digest)| {
                        record_text(nr, digest, &maps)
                    });
                format!("{who}: {call} (#{})", p.index)
            })
            .collect();
        let more = match others.saturating_sub(THREADS) {
            0 => String::new(),
            n => format!(" and {n} more threads"),
        };
        format!(
            "; each thread's latest event in the leader's order: {}{more}. Without a fault, a data race between \
             task {task} and another thread, through memory that they touch after these events, would explain the \
             difference (docs/run.md, \"The leader's order\")",
            named.join("; ")
        )
    }

    /// The shim's hello: each replica gets its number in the ring (its region) and the
    /// calling thread a lane.
    /// * `OP_HELLO` attaches a ring through lane 0: the first ring, by the main thread of
    ///   the program's first image with the replica set untouched; a later one, after the
    ///   monitor armed it. `args[5]`: where the shim reads the epoch to attach next.
    /// * `OP_HELLO_THREAD`, from a thread the program started (the shim's start routine,
    ///   before the program's own): a free lane of the ring in use, if the thread belongs
    ///   to the ring's process. `args[5]`: the epoch the shim uses.
    pub(crate) fn fast_hello(&mut self, task: TaskId, args: &[u64; 6]) -> i64 {
        let live = self.live_replicas();
        let leader = self.replicas.leader();
        let process = self.tasks[task].process();
        let first_image = process == 0 && task == 0;
        let whole = live.len() == self.opts.replicas as usize;
        let untouched = whole && live.iter().enumerate().all(|(i, &r)| i == r as usize);
        // Only for a first hello after the set changed (see `relay_first` below).
        let relay = (!untouched && whole && first_image && args[0] == OP_HELLO).then(|| self.ring_members(&live));
        let ring_process = self
            .fast
            .as_ref()
            .and_then(|f| f.task_of(0))
            .map(|t| self.tasks[t].process());
        let Some(fast) = &mut self.fast else {
            return -(libc::ENOSYS as i64);
        };
        if (args[0] != OP_HELLO && args[0] != OP_HELLO_THREAD)
            || !fast.ring().layout_matches(args[1], args[2], args[3], args[4])
        {
            return -(libc::EINVAL as i64);
        }
        if args[0] == OP_HELLO_THREAD {
            let usable = fast.armed_epoch().is_none()
                && args[5] == fast.epoch() as u64
                && fast.ring().is_on()
                && fast.leader() == Some(leader)
                && ring_process == Some(process);
            return match usable.then(|| fast.take_lane(task, false)).flatten() {
                Some(_) => 0, // replaced by each replica's own number
                None => -(libc::EBUSY as i64),
            };
        }
        if fast.armed_epoch().is_some() {
            if fast.lane_of(task) != Some(0) || !fast.enter_armed() || fast.leader() != Some(leader) {
                return -(libc::EBUSY as i64);
            }
            return 0; // replaced by each replica's own number
        }
        let mut untouched = untouched;
        if let Some((members, placement)) = relay.filter(|_| fast.task_of(0).is_none()) {
            // A replica was replaced before any shim attached: the first ring serves the
            // new set (without it, a threaded program's threads would run unordered).
            untouched = fast.relay_first(members, &placement);
        }
        if fast.task_of(0).is_some()
            || fast.epoch() != 0
            || !first_image
            || !untouched
            || !fast.ring().is_on()
            || fast.leader() != Some(leader)
            || fast.take_lane(task, true).is_none()
        {
            return -(libc::EBUSY as i64);
        }
        fast.reattach_word = Some(args[5]).filter(|&a| a != 0);
        0 // replaced by each replica's own number
    }

    /// A new ring's members, the leader first, then the other replicas of `live`, and each
    /// one's CPU when pinned.
    fn ring_members(&self, live: &[ReplicaId]) -> (Vec<ReplicaId>, Vec<Option<usize>>) {
        let leader = self.replicas.leader();
        let mut members = vec![leader];
        members.extend(live.iter().copied().filter(|&r| r != leader));
        let placement = members.iter().map(|&r| self.replicas.cpu(r)).collect();
        (members, placement)
    }

    /// The replica set is whole again after a change (a re-integration): the ring task's
    /// replicas, all stopped at the same call, are asked to attach the next epoch's ring
    /// when that call returns (the monitor writes the epoch where each shim reads it).
    pub(crate) fn arm_next_ring(&mut self, task: TaskId) {
        let live = self.live_slots(task);
        let leader = self.replicas.leader();
        let Some(fast) = &self.fast else {
            return;
        };
        let Some(word) = fast.reattach_word else {
            return;
        };
        if fast.lane_of(task) != Some(0) || fast.ring().is_on() || !live.contains(&leader) {
            return;
        }
        let (members, placement) = self.ring_members(&live);
        let tids: Vec<_> = members.iter().map(|&r| self.slot(task, r).tid()).collect();
        let Some(fast) = self.fast.as_mut() else {
            return;
        };
        if !fast.arm_next(members, &placement) {
            return;
        }
        let epoch = fast.armed_epoch().expect("just armed") as u32;
        for tid in tids {
            // A replica that cannot be told keeps the old ring (off) and fails the hello's
            // vote, like any replica that differs.
            self.be.steer().write(tid, word, &epoch.to_ne_bytes());
        }
        if self.debug {
            eprintln!("lockstep debug: the fast path's ring {epoch} is armed for task {task}");
        }
    }

    /// At a rendezvous of the ring's task: each follower must have consumed every record
    /// the leader published, no more and no less. Returns whether a replica failed.
    pub(crate) fn check_ring_consumption(&mut self, task: TaskId, live: &[ReplicaId]) -> Result<bool, Stopped> {
        let Some(fast) = &self.fast else {
            return Ok(false);
        };
        let Some(lane) = fast.active_lane(task) else {
            return Ok(false);
        };
        if self.processes[self.tasks[task].process()].exiting {
            // Killed by a fatal signal in every replica (`kill_process`): each died where
            // it was, not at a common call.
            return Ok(false);
        }
        let leader = self.replicas.leader();
        // A leader promoted in place that has not passed the former's cut in this lane
        // is where it took its records to.
        let published = fast.position_of(lane, leader).unwrap_or(0);
        let behind: Vec<(ReplicaId, u64)> = live
            .iter()
            .filter(|&&f| f != leader)
            .map(|&f| (f, fast.consumed(lane, f).unwrap_or(0)))
            .filter(|&(_, consumed)| consumed != published)
            .collect();
        if behind.is_empty() {
            return Ok(false);
        }
        // Every follower differs from the leader: with two or more of them, the leader is
        // the odd one out. A follower that fails leaves the ring on for the others in a
        // threaded program, a leader that fails is replaced in it (`vote_out`); otherwise
        // the ring goes off.
        let followers = live.len() - 1;
        let leader_fails = followers >= 2 && behind.len() == followers;
        if leader_fails && !self.ring_keeps_a_new_leader() {
            fast.switch_off();
        }
        let culprits: Vec<(ReplicaId, String)> = if leader_fails {
            vec![(
                leader,
                format!(
                    "replica {leader} (the leader) made {published} fast-path calls; its followers made {}",
                    behind[0].1
                ),
            )]
        } else {
            behind
                .iter()
                .map(|&(f, consumed)| {
                    (f, format!("replica {f} reached a call of the monitor after {consumed} fast-path calls; leader {leader} after {published}"))
                })
                .collect()
        };
        for (r, why) in culprits {
            if self.replicas.is_alive(r) {
                self.replica_failed(
                    task,
                    r,
                    "divergence",
                    format!("replica {r} diverged at task {task}: {why}"),
                )?;
            }
        }
        Ok(true)
    }

    /// Strict output checks: the leader stopped at an output from the fast gate. It runs
    /// only if every live follower voted, for the leader's next call, the digest of what
    /// the kernel is about to write (read from the leader's memory now). Anything else
    /// means the leader skipped or got wrong its own comparison, or reached the gate by a
    /// wild jump: it fails (voted out under TMR, a halt under DMR).
    pub(crate) fn check_gate_output(
        &mut self,
        task: TaskId,
        r: ReplicaId,
        nr: u64,
        args: &[u64; 6],
    ) -> Result<(), Stopped> {
        let tid = self.slot(task, r).tid();
        // No allocation unless a vote is wrong: this runs for every output in strict mode.
        let live = self.live_slots(task);
        let followers = live.iter().copied().filter(|&f| f != r);
        let verdict = match self.fast.as_mut() {
            None => Err("there is no fast path".to_string()),
            Some(fast) if fast.leader() != Some(r) || self.replicas.leader() != r => {
                Err(format!("replica {r} is not the ring's leader"))
            }
            Some(fast) => match fast.lane_of(task) {
                None => Err(format!("task {task} does not use the ring")),
                Some(lane) => {
                    let be = &self.be;
                    let mut read = |addr: u64, buf: &mut [u8]| be.read(tid, addr, buf);
                    let seq = fast.published(lane, r).unwrap_or(0) + 1;
                    let mut scratch = std::mem::take(&mut fast.scratch);
                    let digest = crate::fast_check::output_digest(nr, args, &mut scratch, &mut read);
                    fast.scratch = scratch;
                    digest.and_then(|digest| -> Result<(Lane, u64), String> {
                        let wrong: Vec<String> = followers
                            .filter_map(|f| {
                                let (vote_seq, vote) = fast.vote(lane, f).unwrap_or((0, 0));
                                (vote_seq != seq || vote != digest)
                                    .then(|| format!("replica {f} voted {vote:016x} for call #{vote_seq}"))
                            })
                            .collect();
                        if wrong.is_empty() {
                            Ok((lane, seq))
                        } else {
                            Err(format!(
                                "its digest is {digest:016x} for call #{seq}; {}",
                                wrong.join(", ")
                            ))
                        }
                    })
                }
            },
        };
        match verdict {
            Ok((lane, seq)) => {
                if let Some(fast) = self.fast.as_mut() {
                    fast.checked_outputs += 1;
                    fast.approved[lane] = seq;
                }
                // A failed resume is recorded by the backend and fails the replica.
                self.be.steer().resume(tid, Resume::Run);
                Ok(())
            }
            Err(why) => {
                self.fast_off();
                let msg = format!(
                    "replica {r} diverged at task {task}: its {} from the fast path failed the monitor's output check: {why}",
                    syscalls::name(nr)
                );
                self.replica_failed(task, r, "divergence", msg)
            }
        }
    }

    /// Leader `r` is leaving the ring (voted out or dead): its threads are settled, and
    /// then, under the order of every event, the follower that will lead takes its place
    /// in the ring (`FastPath::promote`): with the ring off a threaded program's
    /// survivors would run unordered. Otherwise the ring goes off, so that
    /// every follower gives up at the same call of each lane (the ring's followers wait
    /// for a call the leader had in flight until `leader_lost`). Ok(true): the ring stays
    /// on.
    ///
    /// A call it made from the fast path that may have run in the kernel, but whose
    /// record it never published, would run again in its successor: the data a read took
    /// would be lost, an output would go out twice. Such a call is the reason to stop the
    /// run instead, returned here. Calls that take nothing from the outside world may run
    /// again; an output that the monitor's strict check did not let run did not run; a
    /// call its thread is inside of in the kernel is interrupted before it completes.
    /// A thread that was on its way to publish a completed call is let run until it did
    /// (its other threads, running on as usual until they are stopped, are the common
    /// case: the fault was found in one thread of the leader, and the others were busy).
    pub(crate) fn lose_leader(&mut self, r: ReplicaId) -> Result<bool, String> {
        // What the committer wrote must not change while we decide what ran.
        if let Some(committer) = self.fast.as_ref().and_then(|f| f.committer()) {
            committer.pause();
        }
        let lost = self.lose_paused_leader(r);
        if let Some(committer) = self.fast.as_ref().and_then(|f| f.committer()) {
            committer.resume();
        }
        lost
    }

    fn lose_paused_leader(&mut self, r: ReplicaId) -> Result<bool, String> {
        let Some(fast) = &self.fast else {
            return Ok(false);
        };
        let lanes: Vec<(Lane, TaskId)> = fast.lanes_in_use().collect();
        // SIGKILL takes every thread of the process: none will run to its record (nor
        // stop for the monitor, which would wait a second for each).
        let ring_process = lanes.first().map(|&(_, task)| self.tasks[task].process());
        let killed = self.tasks.iter().any(|t| {
            Some(t.process()) == ring_process
                && t.slot(r).and_then(|s| s.arrival())
                    == Some(crate::task::Arrival::Died(crate::task::Death::Killed(libc::SIGKILL)))
        });
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
        let unsettled = lanes.into_iter().find_map(|(lane, task)| {
            let seq = self.settle_lane(lane, task, r, deadline, killed)?;
            let nr = self.fast.as_ref()?.in_flight(lane, r)?.1;
            Some(format!(
                "leader {r} failed after its fast-path call #{seq} ({}) of task {task} may have run and before it \
                 published the result; running it again could lose the input it took or repeat the output",
                syscalls::name(nr)
            ))
        });
        if unsettled.is_none() && self.promote_in_ring(r) {
            return Ok(true);
        }
        if let Some(fast) = &self.fast {
            fast.ring().mark_leader_lost();
        }
        self.fast_off();
        unsettled.map_or(Ok(false), Err)
    }

    /// Whether a failed leader can be replaced in the ring, which stays on: the ring is
    /// on, and its order is the order of every event (the object and serial orders'
    /// tickets and token are not carried over). With one thread a new ring after
    /// re-integration would serve too, but the program may start threads meanwhile.
    pub(crate) fn ring_keeps_a_new_leader(&self) -> bool {
        self.fast
            .as_ref()
            .is_some_and(|fast| fast.ring().is_on() && self.opts.sync_order == crate::SyncOrder::Global)
    }

    /// Replaces failed leader `r` in the ring by the replica that leads next (the first
    /// live one after it is removed, as `Replicas::remove` chooses).
    fn promote_in_ring(&mut self, r: ReplicaId) -> bool {
        if !self.ring_keeps_a_new_leader() {
            return false;
        }
        let Some(new) = self.live_replicas().into_iter().find(|&x| x != r) else {
            return false;
        };
        let promoted = self.fast.as_mut().is_some_and(|fast| fast.promote(r, new));
        if promoted && self.debug {
            eprintln!("lockstep debug: replica {new} leads the fast path's ring in place of {r}, which stays on");
        }
        promoted
    }

    /// Stops leader `r`'s thread of `task` (it is being removed, so its stops are never
    /// handed on) once its call in `lane` is settled; returns the call's number if it is
    /// not (see `lose_leader`) by `deadline`.
    fn settle_lane(
        &self,
        lane: Lane,
        task: TaskId,
        r: ReplicaId,
        deadline: std::time::Instant,
        killed: bool,
    ) -> Option<u64> {
        const REPEATABLE: [i64; 7] = [
            libc::SYS_poll,
            libc::SYS_epoll_wait,
            libc::SYS_epoll_pwait,
            libc::SYS_pread64,
            libc::SYS_preadv,
            libc::SYS_fstat,
            libc::SYS_getrandom,
        ];
        let fast = self.fast.as_ref()?;
        let strict = self.opts.output_check.is_strict();
        let slot = self.slot(task, r);
        let tid = slot.tid();
        // Only a thread that runs on its own is stopped here, and let run to its record;
        // one the monitor holds (at a rendezvous, a fault, or the very stop at hand: its
        // registers can be read only while it is stopped) is judged as it is.
        let mut may_run =
            !killed && matches!(slot.state(), SlotState::Running) && !slot.is_dead() && self.be.regs(tid).is_err();
        loop {
            if may_run && !self.stop_thread(tid, deadline) {
                may_run = false; // gone, or no stop in time: judged as it is
            }
            let (seq, nr) = fast.in_flight(lane, r)?;
            let settled = seq <= fast.published(lane, r)?
                || REPEATABLE.contains(&(nr as i64))
                || (crate::fast_check::is_fast_output(nr)
                    && strict
                    && fast.approved[lane] != seq
                    && !fast.commit_written(lane, seq))
                || self.be.regs(tid).is_ok_and(|regs| in_fast_gate_restart(&regs));
            if settled {
                return None;
            }
            if !may_run || std::time::Instant::now() >= deadline || self.be.resume(tid, Resume::Run).is_err() {
                return Some(seq);
            }
            while fast.published(lane, r)? < seq && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_micros(100));
            }
        }
    }

    /// Interrupts a running thread and waits (until `deadline`) for it to stop.
    fn stop_thread(&self, tid: lockstep_trace::Tid, deadline: std::time::Instant) -> bool {
        if self.be.interrupt(tid).is_err() {
            return false;
        }
        loop {
            match self.be.wait_tid_or_tick(tid) {
                Ok(Some(lockstep_trace::Stop::Exited(_) | lockstep_trace::Stop::Killed(_))) | Err(_) => return false,
                Ok(Some(_)) => return true,
                Ok(None) if std::time::Instant::now() < deadline => {}
                Ok(None) => return false,
            }
        }
    }

    /// A signal waits for the ring's task: the oldest pending one goes into the lane's
    /// mailbox, and the leader is interrupted in case it is blocked in a fast call. The
    /// leader takes it at its next replicated call (or at the interrupted one) as a SIGNAL
    /// record, which each replica raises on itself at the same call (`at_ring_raise`).
    /// A signal still pending when the task meets the monitor (the ring went off, or the
    /// thread runs without calls) is delivered there as with ptrace, and taken back from
    /// the mailbox (`withdraw_ring_signal`). Whether the task uses the ring.
    pub(crate) fn fast_kick(&mut self, task: TaskId) -> bool {
        let Some(sig) = self.tasks[task].signals.first_pending() else {
            return false;
        };
        let Some(fast) = &mut self.fast else {
            return false;
        };
        let Some(lane) = fast.lane_of(task) else {
            return false;
        };
        // With the ring off, only a leader blocked in a fast call it entered before needs
        // the ring: its followers still wait for that call's record. Any other call of the
        // task meets the monitor, which delivers the signal there.
        if !fast.ring().is_on() && !fast.leader_in_call(lane) {
            return false;
        }
        if !fast.post_signal(lane, sig) {
            return true; // the one posted earlier comes first; this one follows it
        }
        if self.debug {
            eprintln!("lockstep debug: signal {sig} posted to lane {lane} of task {task}");
        }
        let leader = self.replicas.leader();
        // Stopped here now (at its own copy's delivery stop), a fast call it was blocked
        // in ends at once, without an interrupt (`at_fast_interrupt` reads the registers,
        // which only a stopped thread has).
        if !self.at_fast_interrupt(task, leader) {
            self.interrupt_ring_leader(task, lane);
        }
        true
    }

    /// Interrupts `task`'s leader if it is blocked in a fast call (or about to enter the
    /// kernel for one) while a posted signal waits for it: the call then ends with EINTR
    /// (`at_fast_interrupt`) and the leader takes the signal.
    fn interrupt_ring_leader(&mut self, task: TaskId, lane: Lane) {
        let Some(fast) = &self.fast else {
            return;
        };
        if fast.posted_untaken(lane).is_none() || !fast.leader_in_call(lane) {
            return;
        }
        let slot = self.slot(task, self.replicas.leader());
        if matches!(slot.state(), SlotState::Running) {
            // Fails only for a thread that is gone, whose death is handled at its stop.
            self.be.steer().interrupt(slot.tid());
        }
    }

    /// Whether `task`'s pending signal is posted to a ring leader that moved in the ring
    /// since the last look (or, the ring off, is blocked in a fast call), so that it will
    /// take it without a catch-up.
    pub(crate) fn ring_takes_signals(&mut self, task: TaskId) -> bool {
        let Some(fast) = &mut self.fast else {
            return false;
        };
        let Some(lane) = fast.lane_of(task) else {
            return false;
        };
        if fast.posted_untaken(lane).is_none() {
            return false;
        }
        // A leader blocked in a fast call after the ring went off is interrupted again and
        // again by the watchdog until it takes the signal.
        match fast.ring().is_on() {
            true => fast.leader_moved(lane),
            false => fast.leader_in_call(lane),
        }
    }

    /// A pending signal of `task` was delivered through the monitor: it no longer waits
    /// in the ring's mailbox.
    pub(crate) fn withdraw_ring_signal(&mut self, task: TaskId, sig: i32) {
        if let Some(fast) = &mut self.fast {
            if let Some(lane) = fast.lane_of(task) {
                fast.withdraw_signal(lane, sig);
            }
        }
    }

    /// The ring's leader stopped by our interrupt: a fast call it was blocked in returns
    /// EINTR instead of restarting when a posted signal waits for it, and the shim learns
    /// the kernel's restart code, to end the call after the handler as natively. Without
    /// a posted signal (an interrupt of the fault injector's) the call just restarts.
    /// Whether it ended such a call.
    pub(crate) fn at_fast_interrupt(&mut self, task: TaskId, r: ReplicaId) -> bool {
        let Some(fast) = &self.fast else {
            return false;
        };
        let Some(lane) = fast.lane_of(task) else {
            return false;
        };
        let Some(sig) = fast.posted_untaken(lane).filter(|_| r == self.replicas.leader()) else {
            return false;
        };
        let tid = self.slot(task, r).tid();
        let Ok(mut regs) = self.be.regs(tid) else {
            return false;
        };
        // A signal the thread blocks now waits in the mailbox (the shim takes it once it
        // is unblocked): the call goes on.
        if !in_fast_gate_restart(&regs) || super::signals::signal_blocked(&self.be, tid, sig) {
            return false;
        }
        fast.ring().set_signal_code(lane, regs.rax as i64);
        regs.rax = -(libc::EINTR as i64) as u64;
        // A failed write is that replica's failure (`Checked`); the call would restart.
        self.be.set_regs(tid, &regs).is_ok()
    }

    /// A signal-delivery stop that is the shim raising a ring signal on its own thread
    /// (tgkill from the fast gate, after a SIGNAL record): let through with the leader's
    /// siginfo when the record is at the replica's place in the ring and the monitor
    /// posted that signal. None when the stop is not such a raise.
    pub(crate) fn at_ring_raise(
        &mut self,
        task: TaskId,
        r: ReplicaId,
        sig: i32,
        info: Option<&libc::siginfo_t>,
    ) -> Option<Result<(), Stopped>> {
        let lane = self.fast.as_ref()?.lane_of(task)?;
        let tid = self.slot(task, r).tid();
        // Known by the registers, not by the siginfo: a copy of the same signal that was
        // pending already (the replica's own timer's, say) absorbs the raise, and is what
        // this stop shows. Nothing else calls tgkill from the fast gate (the program's own
        // tgkill goes to the monitor), and a handler's return clears orig_rax.
        let regs = self.be.regs(tid).ok()?;
        if regs.rip != FAST_GATE + 2 || regs.orig_rax != libc::SYS_tgkill as u64 || regs.rdx != sig as u64 {
            return None;
        }
        let fast = self.fast.as_mut()?;
        let leader = fast.leader()?;
        let seq = fast.position_of(lane, r)?;
        if fast.signal_record(lane, seq) != Some(sig) {
            let msg = format!(
                "replica {r} raised signal {sig} at fast-path record #{seq} of task {task}, where the leader's ring \
                 delivers no such signal"
            );
            return Some(self.replica_failed(task, r, "divergence", msg));
        }
        if !fast.delivered_signal(lane, seq, sig) {
            if fast.posted_taken(lane) != Some(sig) {
                // A SIGNAL record the monitor never asked for: the leader's fault. The
                // raise is dropped; the followers drop theirs too. One a former leader
                // published was its last fault: it is gone already.
                let author = fast.record_author(lane, seq);
                if r != leader || author != Some(leader) {
                    // A failed resume is recorded by the backend and fails the replica.
                    self.be.steer().resume(tid, Resume::Run);
                    if author != Some(leader) || !self.live_slots(task).contains(&leader) {
                        return Some(Ok(())); // blamed already
                    }
                }
                let msg = format!(
                    "leader {leader} published signal {sig} at fast-path record #{seq} of task {task}, which was \
                     never sent to it"
                );
                return Some(self.replica_failed(task, leader, "divergence", msg));
            }
            fast.commit_signal(lane, seq, sig);
            // A catch-up started just before the leader took it: the ring delivered it.
            self.abandon_catch_up(task);
            if let Some(i) = self.tasks[task].signals.pending_index(sig) {
                self.take_pending(task, i);
            }
            self.stats.signals_delivered += 1;
            self.stats.signals_in_ring += 1;
            self.fast_kick(task); // the next pending signal, if any
        }
        if self.debug {
            eprintln!("lockstep debug: ring signal {sig} at record #{seq} of lane {lane} raised by replica {r}");
        }
        let delivered = self
            .leader_siginfo(task, sig)
            .unwrap_or_else(|| forwarded_siginfo(sig, info));
        self.be.steer().set_siginfo(tid, &delivered);
        // A failed resume is recorded by the backend and fails the replica.
        self.be.steer().resume(tid, Resume::Signal(sig));
        Some(Ok(()))
    }

    /// The watchdog, for every lane in use.
    pub(crate) fn check_ring_progress(&mut self) -> Result<(), Stopped> {
        if let Some(why) = self.commit_failure() {
            return Err(self.halt(why));
        }
        type Lanes = Vec<(Lane, TaskId)>;
        let (lanes, overdue): (Lanes, Lanes) = match &mut self.fast {
            Some(fast) => {
                let overdue = fast.overdue_signals(SIGNAL_PATIENCE);
                let tasks: Vec<(Lane, TaskId)> = fast.lanes_in_use().filter(|(l, _)| overdue.contains(l)).collect();
                // A look at the lanes can read /proc for each thread that stands still
                // (a program's idle threads do, for ever): at most once per LANE_LOOK,
                // not at every stop, or a busy multi-threaded program keeps the monitor's
                // CPU busy reading /proc (memcached: 100% of a CPU, mostly its maps).
                let now = std::time::Instant::now();
                let due = fast.lanes_checked.is_none_or(|at| now.duration_since(at) >= LANE_LOOK);
                if due {
                    fast.lanes_checked = Some(now);
                }
                (if due { fast.active_lanes().collect() } else { Vec::new() }, tasks)
            }
            None => return Ok(()),
        };
        // An interrupt that landed just before the leader entered the kernel (after its
        // last look at the mailbox) did not end the call: interrupt again.
        for (lane, task) in overdue {
            self.interrupt_ring_leader(task, lane);
        }
        for (lane, task) in lanes {
            self.check_lane_progress(lane, task)?;
        }
        Ok(())
    }

    /// A replica that, for the straggler timeout, runs (in user space) without moving in
    /// `task`'s lane while another replica waits there is a straggler, as one that does
    /// not reach a rendezvous is.
    fn check_lane_progress(&mut self, lane: Lane, task: TaskId) -> Result<(), Stopped> {
        let live: Vec<ReplicaId> = self.live_slots(task).to_vec();
        let now = std::time::Instant::now();
        // Ring reads first (memory); /proc only for a replica that has stood still while
        // another waits, so a busy ring costs the monitor no I/O at each stop.
        let Some(fast) = self.fast.as_ref() else {
            return Ok(());
        };
        // Waiting for another replica: asleep in one of the ring's waits that say so, or
        // (without moving since the last look) blocked in any futex wait on the ring's
        // memory, such as the order's, which does not.
        let waits: Vec<bool> = live
            .iter()
            .map(|&r| {
                let unmoved = fast
                    .region(r)
                    .zip(fast.position(lane, r))
                    .is_some_and(|(region, position)| fast.watch[lane][region as usize].0 == position);
                fast.sleeping(lane, r) || (unmoved && self.waits_on_ring(task, r))
            })
            .collect();
        let someone_waits = waits.iter().any(|&w| w);
        let moved = live.iter().any(|&r| {
            fast.position(lane, r)
                .zip(fast.region(r))
                .is_some_and(|(position, region)| fast.watch[lane][region as usize].0 != position)
        });
        // Which replicas run in user space: /proc reads, only when the ring stands still.
        let running: Vec<bool> = if !moved && someone_waits {
            live.iter()
                .zip(&waits)
                .map(|(&r, &w)| !w && self.running_in_user_space(task, r))
                .collect()
        } else {
            vec![false; live.len()]
        };
        let Some(fast) = self.fast.as_mut() else {
            return Ok(());
        };
        let mut standing = Vec::new();
        for (&r, &sleeping) in live.iter().zip(&waits) {
            let (Some(position), Some(region)) = (fast.position(lane, r), fast.region(r)) else {
                continue;
            };
            let entry = &mut fast.watch[lane][region as usize];
            if position != entry.0 || !someone_waits || sleeping {
                *entry = (position, None);
            } else {
                standing.push(r);
            }
        }
        // Nobody moves while someone waits in the ring, and no replica is in a call of the
        // program: each waits in the ring or runs in user space. If every one waits, it is
        // a cycle of waits that only a divergence explains (each is at a different call).
        // Those seen running meanwhile are what the others wait for, even when they also
        // slept on the ring's memory between looks (a replica that spins on a corrupted
        // word and sleeps on it in turn escaped both this rule and the straggler rule
        // below, which each want the same state at every look): a minority of them is
        // voted out.
        let stalled = !moved && someone_waits && waits.iter().zip(&running).all(|(&w, &run)| w || run);
        if stalled {
            for (&r, &run) in live.iter().zip(&running) {
                if run && r < 64 {
                    fast.stall_running[lane] |= 1 << r;
                }
            }
        } else {
            fast.deadlock_since[lane] = None;
            fast.stall_running[lane] = 0;
        }
        if stalled && now.duration_since(*fast.deadlock_since[lane].get_or_insert(now)) >= self.opts.timeout {
            let seen = fast.stall_running[lane];
            let spinning: Vec<ReplicaId> = live
                .iter()
                .copied()
                .filter(|&r| r < 64 && seen & (1 << r) != 0)
                .collect();
            if !spinning.is_empty() && spinning.len() * 2 < live.len() {
                fast.switch_off();
                let msg = format!(
                    "replica(s) {spinning:?} ran without moving in the fast path's ring of task {task} for {:.1} s \
                     while the others waited there",
                    self.opts.timeout.as_secs_f64()
                );
                return self.stragglers_timed_out(
                    task,
                    &spinning,
                    live.len(),
                    msg,
                    format!("no majority kept up in the fast path's ring of task {task}"),
                );
            }
            fast.switch_off();
            let msg = match spinning.is_empty() {
                true => format!(
                    "every replica of task {task} waited for another in the fast path's ring for {:.1} s",
                    self.opts.timeout.as_secs_f64()
                ),
                false => format!(
                    "replica(s) {spinning:?} ran without moving in the fast path's ring of task {task} for {:.1} s \
                     while the others waited there, and they are no minority",
                    self.opts.timeout.as_secs_f64()
                ),
            };
            self.detected(
                Event::new("run", "timeout", "halt")
                    .object(format!("task {task}"))
                    .message(msg.clone()),
            );
            return Err(self.halt(format!("{msg}: the replicas are at different calls")));
        }
        let mut stragglers = Vec::new();
        for r in standing {
            // A thread that can never wake is as stuck as one that spins.
            let running = self.running_in_user_space(task, r) || self.blocked_for_good(task, r);
            let Some(fast) = self.fast.as_mut() else {
                return Ok(());
            };
            let Some(region) = fast.region(r) else {
                continue;
            };
            let entry = &mut fast.watch[lane][region as usize];
            if !running {
                entry.1 = None;
                continue;
            }
            if now.duration_since(*entry.1.get_or_insert(now)) >= self.opts.timeout {
                stragglers.push(r);
            }
        }
        let Some(fast) = self.fast.as_ref() else {
            return Ok(());
        };
        if stragglers.is_empty() {
            return Ok(());
        }
        fast.switch_off();
        let msg = format!(
            "replica(s) {stragglers:?} ran for {:.1} s without moving in the fast path's ring of task {task} \
             while another replica waited",
            self.opts.timeout.as_secs_f64()
        );
        self.stragglers_timed_out(
            task,
            &stragglers,
            live.len(),
            msg,
            format!("no majority kept up in the fast path's ring of task {task}"),
        )
    }

    /// Whether every replica of `missing` sleeps in `task`'s ring, waiting for another one.
    /// A follower whose record the leader has published is not waiting for anyone: it has
    /// yet to wake and take it (a leader that brought an escalated call here published an
    /// ESCALATE record first, which sends its followers here too).
    pub(crate) fn waiting_in_ring(&self, task: TaskId, missing: &[ReplicaId]) -> bool {
        let leader = self.replicas.leader();
        self.fast.as_ref().is_some_and(|f| {
            f.active_lane(task).is_some_and(|lane| {
                let published = f.published(lane, leader).unwrap_or(0);
                missing.iter().all(|&r| {
                    let awaiting = f.awaiting(lane, r).unwrap_or(0);
                    f.sleeping(lane, r) && (r == leader || awaiting == 0 || awaiting > published)
                })
            })
        })
    }

    /// Replicas `came` reached the monitor while the others of `task` wait for them in the
    /// ring: they are the odd ones (voted out if a majority waits, else a halt).
    pub(crate) fn left_the_ring(
        &mut self,
        task: TaskId,
        came: &[ReplicaId],
        live: usize,
        waited: std::time::Duration,
    ) -> Result<(), Stopped> {
        self.fast_off();
        let msg = format!(
            "replica(s) {came:?} came to the monitor while the others waited for them in the fast path's ring of task {task} for {:.3} s",
            waited.as_secs_f64()
        );
        self.detected(
            Event::new("run", "timeout", "vote")
                .object(format!("task {task}"))
                .message(msg),
        );
        self.vote_out_or_halt(
            came,
            live,
            |r| format!("replica {r} left the ring's sequence of calls"),
            format!("no majority kept to the fast path's ring of task {task}"),
        )?;
        // The others come to the monitor now: their meeting starts with the first of them.
        self.tasks[task].stop_waiting();
        Ok(())
    }

    /// Whether replica `r`'s thread of `task` runs user code now (state R, not stopped by
    /// us and not asleep in the kernel).
    /// Whether replica `r`'s thread of `task` sleeps where nothing can wake it: in a
    /// private futex wait without a timeout, as the only thread of its process (a signal
    /// could, but none is coming: the program would be hung natively too). A healthy
    /// replica gets there only where the others do too, and then none of them waits in
    /// the ring for it; a fault gets one there alone (a lock word or a lock's owner
    /// corrupted, a lock taken twice), with the others waiting for its next record.
    fn blocked_for_good(&self, task: TaskId, r: ReplicaId) -> bool {
        let slot = self.slot(task, r);
        if slot.state() != SlotState::Running {
            return false;
        }
        let threads = self.be.proc_read(slot.tgid(), "status").unwrap_or_default();
        let only_thread = threads
            .lines()
            .find_map(|l| l.strip_prefix("Threads:"))
            .is_some_and(|n| n.trim() == "1");
        only_thread && endless_futex_wait(&self.be.proc_read(slot.tid(), "syscall").unwrap_or_default())
    }

    /// Whether replica `r`'s thread of `task` is blocked in a futex wait on the ring's
    /// memory: the shim waiting for another replica.
    fn waits_on_ring(&self, task: TaskId, r: ReplicaId) -> bool {
        let slot = self.slot(task, r);
        if slot.state() != SlotState::Running {
            return false;
        }
        let syscall = self.be.proc_read(slot.tid(), "syscall").unwrap_or_default();
        let Some(uaddr) = futex_wait_address(&syscall) else {
            return false;
        };
        let maps = self.be.proc_read(slot.tgid(), "maps").unwrap_or_default();
        in_ring_mapping(&maps, uaddr)
    }

    fn running_in_user_space(&self, task: TaskId, r: ReplicaId) -> bool {
        let slot = self.slot(task, r);
        if slot.state() != SlotState::Running {
            return false;
        }
        super::thread_state(&self.be, slot.tid()) == Some('R')
    }

    /// Follower `r` leaves while the ring is on and the program has threads in more than
    /// one lane: the ring stays on without it, so the survivors' threads keep the
    /// leader's order (switched off, they would run unordered through the monitor and
    /// their locks could deadlock across replicas). A single-threaded program's ring is
    /// switched off instead, as re-integration needs. Whether it stayed on.
    pub(crate) fn drop_follower_from_ring(&mut self, r: ReplicaId) -> bool {
        let Some(fast) = self.fast.as_mut() else {
            return false;
        };
        if fast.lanes_in_use().nth(1).is_none() {
            return false;
        }
        let dropped = fast.drop_follower(r);
        if dropped && self.debug {
            eprintln!("lockstep debug: replica {r} left the fast path's ring, which stays on");
        }
        dropped
    }

    /// The replica set changes: the ring's roles are fixed, so it is switched off (a
    /// later epoch's ring may take over once the set is whole again: `arm_next_ring`).
    pub(crate) fn fast_off(&mut self) {
        if let Some(fast) = &self.fast {
            fast.switch_off();
        }
    }

    /// Answers the hello in each replica with its number in the ring (its region).
    pub(crate) fn answer_fast_hello(&mut self, task: TaskId, result: i64) -> Result<(), Stopped> {
        let Some(fast) = &self.fast else {
            self.answer_each(task, |_| result);
            return Ok(());
        };
        let lane = fast.lane_of(task).unwrap_or(0);
        if self.debug && result == 0 {
            eprintln!(
                "lockstep debug: the fast path's ring {} gave lane {lane} to task {task}",
                fast.epoch()
            );
        }
        if result == 0 {
            // After the replicas started: the committer is a thread of the monitor.
            if let Err(e) = self.fast.as_mut().map_or(Ok(()), |f| f.start_committer()) {
                eprintln!("lockstep run: cannot start the output committer ({e}); outputs are checked at a stop");
            }
            let pids: Vec<Option<i32>> = (0..self.replicas.ids() as ReplicaId)
                .map(|r| self.tasks[task].slot(r).filter(|s| !s.is_dead()).map(|s| s.tgid()))
                .collect();
            if let Some(fast) = &self.fast {
                fast.commit_pids(|r| pids.get(r as usize).copied().flatten());
            }
        }
        let Some(fast) = &self.fast else {
            return Ok(());
        };
        let regions: Vec<Option<u32>> = (0..self.replicas.ids() as ReplicaId).map(|r| fast.region(r)).collect();
        // The answer: the replica's region, and the lane above it (`HELLO_LANE_SHIFT`).
        self.answer_each(task, |r| match regions.get(r as usize).copied().flatten() {
            Some(region) if result == 0 => region as i64 | ((lane as i64) << crate::fast::HELLO_LANE_SHIFT),
            _ if result == 0 => -(libc::EBUSY as i64),
            _ => result,
        });
        Ok(())
    }

    /// A call of the program's that the monitor is about to make: posted outputs that
    /// came before it go out first (`Committer::drain`), and a call that closes or
    /// replaces descriptors of the leader's process makes the committer drop its
    /// duplicates of them (`Committer::forget`). Err: the committer stopped writing for
    /// good (what it could not write was agreed on), and so must the run.
    pub(crate) fn commit_before(&self, task: TaskId, nr: u64, args: &[u64; 6]) -> Result<(), String> {
        let Some(committer) = self.fast.as_ref().and_then(|f| f.committer()) else {
            return Ok(());
        };
        let Some(slot) = self.tasks[task].slot(self.replicas.leader()) else {
            return Ok(());
        };
        // A call that writes to a descriptor waits for bytes kept for it.
        let writes_to = match nr as i64 {
            libc::SYS_write
            | libc::SYS_writev
            | libc::SYS_pwrite64
            | libc::SYS_pwritev
            | libc::SYS_pwritev2
            | libc::SYS_sendto
            | libc::SYS_sendmsg
            | libc::SYS_sendmmsg
            | libc::SYS_sendfile
            | libc::SYS_shutdown => i32::try_from(args[0]).ok(),
            _ => None,
        };
        committer.drain(slot.tgid(), writes_to);
        if let Some(why) = committer.failure() {
            return Err(why);
        }
        self.commit_forget(committer, slot.tgid(), nr, args);
        Ok(())
    }

    fn commit_forget(&self, committer: &crate::commit::Committer, pid: i32, nr: u64, args: &[u64; 6]) {
        let fd = match nr as i64 {
            libc::SYS_close => Some(args[0]),
            libc::SYS_dup2 | libc::SYS_dup3 => Some(args[1]),
            libc::SYS_close_range | libc::SYS_execve | libc::SYS_execveat | libc::SYS_exit_group => None,
            _ => return,
        };
        match fd.map(i32::try_from) {
            Some(Ok(fd)) => committer.forget(pid, Some(fd)),
            Some(Err(_)) => {} // not a descriptor: the call fails with EBADF
            None => committer.forget(pid, None),
        }
    }

    /// Whether the committer stopped writing for good (the run must stop too).
    pub(crate) fn commit_failure(&self) -> Option<String> {
        self.fast.as_ref().and_then(|f| f.committer()).and_then(|c| c.failure())
    }

    /// Calls the leaders completed on the fast path, for `--stats`.
    pub(crate) fn fast_calls(&self) -> Option<u64> {
        let fast = self.fast.as_ref()?;
        fast.task_of(0)?;
        Some(fast.fast_calls())
    }

    /// The leaders' orders of events, for `--stats`.
    pub(crate) fn order_counts(&self) -> Option<crate::fast::OrderCounts> {
        let fast = self.fast.as_ref()?;
        fast.task_of(0)?;
        Some(fast.order_counts())
    }
}

/// A signal lockstep forwards, as the monitor's own tgkill would show it: SI_TKILL from a
/// sender outside the replica's PID namespace (pid 0), with lockstep's uid.
/// A futex wait as `/proc/TID/syscall` shows it ("202 uaddr op val timeout ...", the
/// arguments in hex): (uaddr, op, timeout pointer), or None for anything else.
fn futex_wait(syscall: &str) -> Option<(u64, i32, u64)> {
    let mut fields = syscall.split_whitespace();
    let nr = fields.next()?.parse::<u64>().ok()?;
    let args: Vec<u64> = fields
        .take(4)
        .filter_map(|f| u64::from_str_radix(f.strip_prefix("0x")?, 16).ok())
        .collect();
    let &[uaddr, op, _, timeout] = &args[..] else {
        return None;
    };
    let cmd = op as i32 & libc::FUTEX_CMD_MASK;
    (nr == libc::SYS_futex as u64 && (cmd == libc::FUTEX_WAIT || cmd == libc::FUTEX_WAIT_BITSET))
        .then_some((uaddr, op as i32, timeout))
}

/// Whether `/proc/TID/syscall` shows a thread blocked in a private `FUTEX_WAIT` or
/// `FUTEX_WAIT_BITSET` without a timeout.
fn endless_futex_wait(syscall: &str) -> bool {
    futex_wait(syscall).is_some_and(|(_, op, timeout)| op & libc::FUTEX_PRIVATE_FLAG != 0 && timeout == 0)
}

/// The word a thread waits on in a futex wait, if it is in one.
fn futex_wait_address(syscall: &str) -> Option<u64> {
    futex_wait(syscall).map(|(uaddr, _, _)| uaddr)
}

/// Whether `addr` lies in a mapping of the ring's memfd, from `/proc/PID/maps`.
fn in_ring_mapping(maps: &str, addr: u64) -> bool {
    maps.lines().filter(|l| l.contains("/memfd:lockstep-ring")).any(|line| {
        line.split_whitespace()
            .next()
            .and_then(|range| range.split_once('-'))
            .and_then(|(a, b)| Some((u64::from_str_radix(a, 16).ok()?, u64::from_str_radix(b, 16).ok()?)))
            .is_some_and(|(start, end)| (start..end).contains(&addr))
    })
}

fn forwarded_siginfo(sig: i32, seen: Option<&libc::siginfo_t>) -> libc::siginfo_t {
    // SAFETY: an all-zero siginfo_t is valid; the fields written below are those of the
    // kill/tkill layout (signo, errno, code, a pad word, then pid and uid).
    unsafe {
        let mut info: libc::siginfo_t = seen.copied().unwrap_or_else(|| std::mem::zeroed());
        let words = (&raw mut info).cast::<i32>();
        words.write(sig);
        words.add(1).write(0);
        words.add(2).write(libc::SI_TKILL);
        words.add(4).write(0);
        words.add(5).write(libc::getuid() as i32);
        info
    }
}

/// How long a signal posted to a ring's leader waits untaken before the watchdog
/// interrupts the leader again.
const SIGNAL_PATIENCE: std::time::Duration = std::time::Duration::from_millis(20);
/// How often the monitor looks at the lanes' progress (stragglers and cycles of waits
/// are judged over the straggler timeout, seconds).
const LANE_LOOK: std::time::Duration = std::time::Duration::from_millis(10);

fn in_fast_gate_restart(regs: &Regs) -> bool {
    regs.rip == FAST_GATE + 2 && lockstep_trace::ptrace::is_restart(regs.rax as i64)
}

/// A record's call as a divergence names it: a synchronisation operation with its call
/// site (its digest is where the program called it, located through `maps`), or a syscall.
fn record_text(nr: u64, digest: u64, maps: &str) -> String {
    match crate::fast::is_sync(nr) {
        true => format!(
            "{} called from {}",
            crate::fast::call_name(nr),
            crate::fast::code_location(maps, digest)
        ),
        false => crate::fast::call_name(nr),
    }
}

/// What the votes on a posted output say about a follower's DIVERGED report.
enum PostedVerdict {
    /// Not a posted output, or no other vote decides: the reporter is the odd one.
    NotPosted,
    /// The record's author was removed already: the reporter goes on.
    AuthorGone,
    /// Another follower voted as the reporter did: the leader is the odd one.
    LeaderOdd,
}

#[cfg(test)]
mod tests {
    use super::endless_futex_wait;

    #[test]
    fn only_a_private_futex_wait_without_timeout_is_endless() {
        // glibc's lock wait (FUTEX_WAIT_BITSET | PRIVATE | CLOCK_REALTIME, no timeout), as a
        // hung replica showed it.
        assert!(endless_futex_wait(
            "202 0x7ffff6a7c5c8 0x189 0x2 0x0 0x0 0xffffffff 0x7ffff62307f8 0x610"
        ));
        assert!(endless_futex_wait("202 0x1000 0x80 0x0 0x0 0x0 0x0 0x7ff0 0x610"));
        // The shim's own timed wait on a shared word; another call; not in a call.
        assert!(!endless_futex_wait(
            "202 0x7fffedea0020 0x0 0xb5a 0x7ffff6230df0 0x0 0x0 0x7ffff6230dc8 0x610"
        ));
        assert!(!endless_futex_wait("202 0x1000 0x80 0x0 0x7ff000 0x0 0x0 0x7ff0 0x610"));
        assert!(!endless_futex_wait("0 0x3 0x7fff5c7a4478 0x4 0x8 0x0 0x0 0x7ff0 0x610"));
        assert!(!endless_futex_wait("running"));
        assert!(!endless_futex_wait(""));
    }

    #[test]
    fn a_wait_on_the_rings_memory_is_the_shims() {
        use super::{futex_wait_address, in_ring_mapping};
        let maps = "7fffedea0000-7ffff1ea0000 rw-s 00000000 00:01 77 /memfd:lockstep-ring (deleted)\n\
                    7ffff6a00000-7ffff6b00000 rw-p 00000000 00:00 0\n";
        let shim = "202 0x7fffedea0020 0x0 0xb5a 0x7ffff6230df0 0x0 0x0 0x7ffff6230dc8 0x610";
        let program = "202 0x7ffff6a7c5c8 0x189 0x2 0x0 0x0 0xffffffff 0x7ffff62307f8 0x610";
        assert!(in_ring_mapping(maps, futex_wait_address(shim).unwrap()));
        assert!(!in_ring_mapping(maps, futex_wait_address(program).unwrap()));
        assert_eq!(
            futex_wait_address("232 0x4 0x7ff 0x80 0xffffffff 0x0 0x0 0x7ff0 0x5fe"),
            None
        );
    }
}

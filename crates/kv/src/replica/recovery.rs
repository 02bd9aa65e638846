//! Recovery (CrossCheck Fig. 3): RECOVER entries, REPAIR messages, and the replacement of a
//! replica that keeps failing through a Raft membership change and a snapshot.

use super::*;

impl Replica {
    pub(super) fn apply_recover(&mut self, index: u64, u: &mut Unpacker<'_>) -> Result<(), UnpackError> {
        let time = u.u64()?;
        let target = u.u64()?;
        let n = u.u32()? as usize;
        if n > u.rest().len() / 8 {
            return Err(UnpackError("object count exceeds entry"));
        }
        let mut objects = Vec::with_capacity(n);
        for _ in 0..n {
            objects.push(ObjectId(u.u64()?));
        }
        self.recover_proposed.remove(&target);
        self.count_recovery(index, time, target);
        // This round covers what we were about to ask for on the target's behalf.
        if target != self.cfg.id {
            self.to_recover.remove(&target);
        }
        if target == self.cfg.id && self.unrepaired_failures == 0 {
            // We know of no request we failed: the entry is being replayed after a restart
            // (the replayed state is clean), or the others stepped in before our CHECKs
            // told us. Either way there is nothing to wait for; if we are wrong, the next
            // comparison says so and we ask again.
            self.events.emit(
                Event::new("kv", "recover-skip", "continue")
                    .replica(target as u32)
                    .message(format!(
                        "entry {index}: RECOVER for us, but we know of no failed request; not waiting for a repair"
                    )),
            );
            return Ok(());
        }
        if target == self.cfg.id {
            self.unrepaired_failures = 0;
            self.counters.recoveries += 1;
            self.events.emit(
                Event::new("kv", "recover", "wait-repair")
                    .replica(target as u32)
                    .message(format!(
                        "entry {index}: recovering {} object(s) from the healthy replicas",
                        objects.len()
                    )),
            );
            self.recovery = Some(Recovery {
                round: index,
                started: Instant::now(),
                objects,
                buffered: VecDeque::new(),
            });
            // A healthy replica may have applied the RECOVER, and sent its REPAIR, before
            // we got here.
            if let Some((from, frame)) = self.early_repairs.remove(&index) {
                let mut u = Unpacker::new(&frame);
                u.u8()?;
                self.on_repair(from, &mut u)?;
            }
            self.early_repairs.retain(|&round, _| round > index);
            return Ok(());
        }
        // Pack our copies (as of this entry, the same point of the log as the target's).
        let mut p = Packer::default();
        p.u8(MSG_REPAIR);
        p.u64(index);
        let real: Vec<ObjectId> = objects.into_iter().filter(|o| o.0 != 0).collect();
        if real.iter().any(|&id| !self.store.object_ok(id)) {
            self.events.emit(
                Event::new("kv", "repair-refused", "none")
                    .replica(self.cfg.id as u32)
                    .message(format!(
                        "entry {index}: our own copy of an object to repair fails its check; not sending it"
                    )),
            );
            return Ok(());
        }
        p.u32(real.len() as u32);
        for id in &real {
            p.u64(id.0);
            p.u8(self.store.object_exists(*id) as u8);
            p.u32(self.store.object_crc(*id));
            p.nested(|p| self.store.pack_object(*id, p));
        }
        let owed = self.validator.as_mut().map(|v| v.take_owed(target)).unwrap_or_default();
        p.u32(owed.len() as u32);
        for (req, reply) in &owed {
            p.u64(req.index);
            p.u32(req.pos);
            p.bytes(reply);
        }
        self.raft.as_mut().unwrap().peers.send(target, &p.buf);
        Ok(())
    }

    /// Too many recoveries of one replica within the window: the log decides, identically
    /// on every replica, that it is to be replaced.
    pub(super) fn count_recovery(&mut self, index: u64, time: u64, target: u64) {
        let window = self.cfg.recovery_window.as_millis() as u64;
        let times = self.recover_times.entry(target).or_default();
        times.push_back(time);
        while times.front().is_some_and(|&t| t + window < time) {
            times.pop_front();
        }
        if times.len() > self.cfg.max_recoveries && self.replace.insert(target) {
            times.clear();
            self.events.emit(Event::new("kv", "replace", "membership-change").replica(target as u32).message(format!(
                "entry {index}: replica {target} needed more than {} recoveries within {:?}; it will be removed and re-added from a snapshot",
                self.cfg.max_recoveries, self.cfg.recovery_window
            )));
        }
    }

    /// The leader carries out replacements: remove the replica, and re-add every configured
    /// replica that is not a voter (after a fresh snapshot, so that it is rebuilt from one).
    pub(super) fn manage_membership(&mut self) {
        let me = self.cfg.id;
        let r = self.raft.as_mut().unwrap();
        if r.node.raft.state != StateRole::Leader || r.node.raft.has_pending_conf() {
            return;
        }
        let voters = r.node.raft.prs().conf().to_conf_state().voters;
        if let Some(&x) = self.replace.iter().find(|x| voters.contains(x)) {
            if x == me {
                // A leader does not remove itself: hand leadership to a healthy voter.
                if let Some(&other) = voters.iter().find(|&&v| v != me && !self.replace.contains(&v)) {
                    r.node.transfer_leader(other);
                }
                return;
            }
            let mut cc = ConfChange::default();
            cc.set_change_type(ConfChangeType::RemoveNode);
            cc.node_id = x;
            // Refused while another change is pending; this check runs again on the next tick.
            let _ = r.node.propose_conf_change(b"replace".to_vec(), cc);
            return;
        }
        let configured = self.cfg.peers.len() as u64;
        if let Some(x) = (1..=configured).find(|x| !voters.contains(x) && !self.replace.contains(x)) {
            let mut cc = ConfChange::default();
            cc.set_change_type(ConfChangeType::AddNode);
            cc.node_id = x;
            if r.node.propose_conf_change(b"rejoin".to_vec(), cc).is_ok() {
                self.events.emit(
                    Event::new("kv", "rejoin", "membership-change")
                        .replica(x as u32)
                        .message(format!(
                            "proposed to add replica {x} back; it will be rebuilt from the last confirmed snapshot and the log"
                        )),
                );
            }
        }
    }

    /// This replica was removed to be replaced: drop every piece of state (the store, the
    /// log, pending validations) and wait, empty, to be added back and sent a snapshot.
    /// The Raft term and vote are kept, so that it can never vote twice in one term.
    pub(super) fn wipe_and_rejoin(&mut self, removed_at: u64) -> Result<(), i32> {
        self.counters.replacements += 1;
        self.events.emit(Event::new("kv", "replace", "wipe").replica(self.cfg.id as u32).message(
            "removed from the cluster for replacement: discarding all state; waiting to be re-added and sent a snapshot",
        ));
        let pending: Vec<(u64, u64)> = self.inflight.keys().copied().collect();
        for (conn, seq) in pending {
            self.send_reply(conn, seq, WITHDRAWN.to_vec());
        }
        self.withdraw_parked();
        self.batch.clear();
        let old = self.raft.take().expect("replicated");
        let hard = raft::Storage::initial_state(&old.storage)
            .map(|s| s.hard_state)
            .unwrap_or_default();
        // The configuration the log starts from, as at the cluster's start: with no
        // snapshot to install (the log was never compacted), the replica replays the log
        // from its first entry. (It cannot win an election meanwhile: pre-vote, and its
        // log is the shortest.)
        let voters: Vec<u64> = (1..=self.n as u64).collect();
        let storage = match &self.cfg.data_dir {
            Some(dir) => {
                for f in ["state", "log", "snapshot"] {
                    // A file that stayed would be read back as this replica's state.
                    match std::fs::remove_file(dir.join(f)) {
                        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                            return Err(self.fatal_io("reset the data directory", e));
                        }
                        _ => {}
                    }
                }
                LogStore::open(dir, voters, self.cfg.fsync).map_err(|e| self.fatal_io("reset the data directory", e))?
            }
            None => LogStore::new(voters),
        };
        let kept = raft::eraftpb::HardState {
            term: hard.term,
            vote: hard.vote,
            ..Default::default()
        };
        storage
            .set_hard_state(&kept)
            .map_err(|e| self.fatal_io("reset the hard state", e))?;
        let mut config = old.config.clone();
        config.applied = 0;
        let logger = slog::Logger::root(slog::Discard, slog::o!());
        let node = RawNode::new(&config, storage.clone(), &logger).map_err(|e| {
            self.halt(format!("cannot restart raft after replacement: {e}"));
            lockstep_core::exit::DETECTED
        })?;
        self.raft = Some(RaftPart {
            node,
            config,
            storage,
            peers: old.peers,
            last_tick: Instant::now(),
            snap_index: 0,
            pace: Default::default(),
            rejoining: true,
            removed_at: Some(removed_at),
            isolated_until: None,
            commit_news_until: 0,
            messages_sent: old.messages_sent,
            encode_scratch: Vec::new(),
            spare_snapshot: Vec::new(),
        });
        self.store = Store::new(self.cfg.limits.clone());
        self.applied_tags = Applied::default();
        self.validator = Some(Validator::new(self.n, self.cfg.id));
        self.recovery = None;
        self.to_recover.clear();
        self.recover_proposed.clear();
        self.recover_times.clear();
        self.replace.clear();
        self.early_repairs.clear();
        self.audits = audit::Audits::default();
        self.unrepaired_failures = 0;
        self.applied = 0;
        Ok(())
    }

    pub(super) fn on_repair(&mut self, from: u64, u: &mut Unpacker<'_>) -> Result<(), UnpackError> {
        let round = u.u64()?;
        let waiting = self.recovery.as_ref().map(|r| r.round);
        if waiting != Some(round) {
            // A repair for a RECOVER we have not applied yet: keep the first one until we
            // reach it (bounded: at most a few rounds can be ahead of us).
            if round > self.applied && waiting.is_none_or(|w| round > w) && self.early_repairs.len() < 16 {
                let mut frame = vec![MSG_REPAIR];
                frame.extend_from_slice(&round.to_le_bytes());
                frame.extend_from_slice(u.rest());
                self.early_repairs.entry(round).or_insert((from, frame));
            }
            return Ok(());
        }
        // Decode everything before touching the store: a malformed repair changes nothing.
        let n = u.u32()? as usize;
        let mut objects = Vec::new();
        for _ in 0..n {
            let id = ObjectId(u.u64()?);
            let present = u.u8()? != 0;
            let crc = u.u32()?;
            let bytes = u.bytes()?.to_vec();
            objects.push((id, present, crc, bytes));
        }
        let m = u.u32()? as usize;
        let mut replies = Vec::new();
        for _ in 0..m {
            let req = ReqId {
                index: u.u64()?,
                pos: u.u32()?,
            };
            replies.push((req, u.bytes()?.to_vec()));
        }
        let mut changed = 0;
        let mut bytes = 0;
        for (id, present, crc, data) in &objects {
            let same = self.store.object_crc(*id) == *crc && self.store.object_ok(*id);
            if same {
                continue;
            }
            self.store.replace_object(*id, present.then_some(&data[..]))?;
            if self.store.object_crc(*id) != *crc {
                return Err(UnpackError("repaired object does not have the advertised CRC"));
            }
            changed += 1;
            bytes += data.len() as u64;
        }
        let rec = self.recovery.take().unwrap();
        let us = rec.started.elapsed().as_micros() as u64;
        self.counters.repair_objects += changed;
        self.counters.repair_bytes += bytes;
        self.counters.last_recovery_us = us;
        self.counters.max_recovery_us = self.counters.max_recovery_us.max(us);
        let named = rec.objects.iter().filter(|o| o.0 != 0).count();
        if changed == 0 && named > 0 {
            self.counters.false_positives += 1;
        }
        let mut released = 0;
        for (req, reply) in replies {
            if let Some(to) = self.validator.as_mut().and_then(|v| v.take_held(req)) {
                self.send_reply(to.conn, to.seq, reply);
                released += 1;
            }
        }
        self.events.emit(
            Event::new("kv", "repair", "continue")
                .replica(self.cfg.id as u32)
                .object(rec.objects.iter().map(|o| o.to_string()).collect::<Vec<_>>().join(","))
                .duration_us(us)
                .message(format!(
                    "replaced {changed} of {named} named object(s) ({bytes} bytes) from replica {from}; {released} held repl{} released{}",
                    if released == 1 { "y" } else { "ies" },
                    if changed == 0 && named > 0 { "; nothing differed after synchronisation (false positive)" } else { "" }
                )),
        );
        // Apply what was committed in the meantime.
        for (index, data) in rec.buffered {
            if self.apply(index, &data).is_err() {
                return Err(UnpackError("buffered entry failed"));
            }
        }
        Ok(())
    }
}

//! Ordering: batching requests into log entries, proposing RECOVERs, and handling raft-rs's
//! `Ready` in the order it requires (send, install snapshot, apply, persist, send persisted
//! messages, advance).

use super::*;

impl Replica {
    pub(super) fn encode_batch(&self, batch: &[(u64, u64, Command)]) -> Vec<u8> {
        let mut p = Packer::default();
        // The header (kind, time, origin, incarnation, count: 29 bytes), then per request
        // its connection and number (16) and the command.
        p.buf.reserve(
            29 + batch
                .iter()
                .map(|(_, _, cmd)| 16 + cmd.encoded_len_hint())
                .sum::<usize>(),
        );
        p.u8(ENTRY_BATCH);
        p.u64(now_ms());
        p.u64(self.cfg.id);
        p.u64(self.incarnation);
        p.u32(batch.len() as u32);
        for (conn, seq, cmd) in batch {
            p.u64(*conn);
            p.u64(*seq);
            cmd.encode(&mut p);
        }
        p.buf
    }

    pub(super) fn propose_batch(&mut self) {
        if self.batch.is_empty() {
            return;
        }
        let data = self.encode_batch(&self.batch);
        let r = self.raft.as_mut().expect("replicated");
        // Without a known leader the proposal would be dropped: keep the batch for later.
        if r.node.raft.leader_id == raft::INVALID_ID {
            return;
        }
        if r.node.propose(vec![], data).is_ok() {
            let now = Instant::now();
            for (conn, seq, cmd) in self.batch.drain(..) {
                if let Some(f) = self.inflight.get_mut(&(conn, seq)) {
                    f.proposed = Some(now);
                    f.cmd = Some(cmd);
                }
            }
        }
    }

    pub(super) fn propose_recovers(&mut self) {
        if self.to_recover.is_empty() {
            return;
        }
        let now = Instant::now();
        let due: Vec<u64> = self
            .to_recover
            .iter()
            .filter(|(_, (_, at))| *at <= now)
            .map(|(t, _)| *t)
            .collect();
        for target in due {
            if self.recover_proposed.contains_key(&target) {
                continue;
            }
            let (ids, at) = self.to_recover.remove(&target).unwrap();
            let mut p = Packer::default();
            p.u8(ENTRY_RECOVER);
            p.u64(now_ms());
            p.u64(target);
            p.u32(ids.len() as u32);
            for id in &ids {
                p.u64(id.0);
            }
            let r = self.raft.as_mut().unwrap();
            if r.node.raft.leader_id != raft::INVALID_ID && r.node.propose(vec![], p.buf).is_ok() {
                self.recover_proposed.insert(target, Instant::now());
            } else {
                self.to_recover.insert(target, (ids, at));
            }
        }
    }

    pub(super) fn on_ready(&mut self) -> Result<(), i32> {
        let mut to_apply: Vec<Entry> = Vec::new();
        let mut snapshot = None;
        let early_ok = self.may_apply_early();
        let speculate = self.may_speculate();
        let mut early: Vec<Entry> = Vec::new();
        {
            let r = self.raft.as_mut().unwrap();
            if !r.node.has_ready() {
                return Ok(());
            }
            let mut rd = r.node.ready();
            // A leader's appends go out only after its own copy is stored, so that a
            // follower that stores one knows two copies exist (see `may_apply_early`).
            let messages = rd.take_messages();
            if !rd.snapshot().is_empty() {
                let s = rd.snapshot().clone();
                if let Err(e) = r.storage.apply_snapshot(s.clone()) {
                    return Err(self.fatal_io("install a snapshot", e));
                }
                snapshot = Some(s);
            }
            to_apply.extend(rd.take_committed_entries());
            // (Raft keeps its own account of what this Ready held: its entries are ours.)
            let entries = rd.take_entries();
            // What we applied was committed, so no leader may replace it: an entry at an
            // applied index means that reasoning failed, and serving on would diverge.
            if let Some(e) = entries.first().filter(|e| e.index <= self.applied) {
                let why = format!(
                    "the leader replaces entry {} (term {}), which this replica already applied (up to {})",
                    e.index, e.term, self.applied
                );
                self.halt(why);
                return Err(lockstep_core::exit::DETECTED);
            }
            let r = self.raft.as_mut().unwrap();
            if let Err(e) = r.storage.append(&entries) {
                return Err(self.fatal_io("append to the log", e));
            }
            broadcast_commits(r, &entries);
            // The entries of the current term, applied before the commit: a speculating
            // leader's own, or a follower's from its leader (never both).
            let term = r.node.raft.term;
            let ahead: Vec<Entry> = match speculate || early_ok {
                true => entries.into_iter().filter(|e| e.term == term).collect(),
                false => Vec::new(),
            };
            if speculate {
                // Our CHECKs for our new entries go ahead of the entries themselves.
                self.apply_early(ahead, false)?;
            } else {
                early = ahead;
            }
            let r = self.raft.as_mut().unwrap();
            send_all(r, messages);
            if let Some(hs) = rd.hs() {
                let r = self.raft.as_mut().unwrap();
                if let Err(e) = r.storage.set_hard_state(hs) {
                    return Err(self.fatal_io("save the hard state", e));
                }
            }
            let r = self.raft.as_mut().unwrap();
            send_all(r, rd.take_persisted_messages());
            let mut light = r.node.advance(rd);
            if let Some(c) = light.commit_index() {
                if let Err(e) = r.storage.set_commit(c) {
                    return Err(self.fatal_io("save the commit index", e));
                }
            }
            let r = self.raft.as_mut().unwrap();
            send_all(r, light.take_messages());
            to_apply.extend(light.take_committed_entries());
        }
        if let Some(s) = snapshot {
            let index = s.get_metadata().index;
            match restore_data(&self.cfg.limits, &s.data) {
                Ok((store, tags)) => {
                    self.withdraw_parked();
                    self.store = store;
                    self.applied_tags = tags;
                    self.applied = index;
                    let r = self.raft.as_mut().unwrap();
                    r.snap_index = index;
                    if r.rejoining && r.removed_at.is_none_or(|at| index >= at) {
                        self.rejoined(index); // else it replays the log up to its re-addition
                    }
                    // Our own summary of the installed state is compared at once.
                    self.audits.wanted = true;
                    self.events.emit(
                        Event::new("kv", "snapshot", "continue")
                            .replica(self.cfg.id as u32)
                            .message(format!(
                                "installed a snapshot at entry {index} ({} bytes)",
                                s.data.len()
                            )),
                    );
                }
                Err(e) => {
                    self.halt(format!("a snapshot from the leader does not restore: {e}"));
                    return Err(lockstep_core::exit::DETECTED);
                }
            }
        }
        for e in to_apply {
            if e.index <= self.applied {
                continue;
            }
            match e.get_entry_type() {
                EntryType::EntryNormal => {
                    if e.data.is_empty() {
                        self.applied = e.index;
                    } else {
                        self.apply(e.index, &e.data)?;
                    }
                }
                EntryType::EntryConfChange => {
                    let cc = ConfChange::decode(&e.data[..]).unwrap_or_default();
                    let cs = self.raft.as_mut().unwrap().node.apply_conf_change(&cc);
                    self.save_conf(cs, e.index)?;
                    let removed = cc.get_change_type() == ConfChangeType::RemoveNode;
                    self.events.emit(
                        Event::new("kv", "membership", "continue")
                            .replica(cc.node_id as u32)
                            .message(format!(
                                "entry {}: replica {} {}",
                                e.index,
                                cc.node_id,
                                if removed { "removed" } else { "added" }
                            )),
                    );
                    if removed {
                        self.replace.remove(&cc.node_id);
                    }
                    let r = self.raft.as_mut().unwrap();
                    match (removed, cc.node_id == self.cfg.id) {
                        // Replayed from a snapshot older than our removal: done already.
                        (true, true) if r.removed_at == Some(e.index) => {}
                        (true, true) => return self.wipe_and_rejoin(e.index),
                        (false, true) if r.rejoining => self.rejoined(e.index),
                        // The re-added replica is rebuilt from the last confirmed snapshot
                        // (the only kind Raft stores and sends) and the log since, which it
                        // replays itself: no state of ours, which may hold a latent flip
                        // while the two of us disagree, is sent to it. An audit soon
                        // brings its vote.
                        (false, false) if self.audited() => self.audits.wanted = true,
                        // Without audits a snapshot is not confirmed: make one that names
                        // the replica, so that it does not replay the log that removed it.
                        (false, false) if self.recovery.is_none() => self.take_snapshot()?,
                        _ => {}
                    }
                }
                EntryType::EntryConfChangeV2 => {
                    let cc = ConfChangeV2::decode(&e.data[..]).unwrap_or_default();
                    let cs = self.raft.as_mut().unwrap().node.apply_conf_change(&cc);
                    self.save_conf(cs, e.index)?;
                }
            }
        }
        self.apply_early(early, true)?;
        self.release_parked(None);
        // Raft's applied index only paces what it hands out; entries held back during a
        // recovery are this replica's to apply later.
        self.raft.as_mut().unwrap().node.advance_apply();
        Ok(())
    }

    /// A replica wiped for replacement holds the cluster's state up to entry `index`,
    /// its own re-addition included: a member like any other again.
    fn rejoined(&mut self, index: u64) {
        let r = self.raft.as_mut().unwrap();
        r.rejoining = false;
        r.removed_at = None;
        self.events.emit(
            Event::new("kv", "rejoined", "continue")
                .replica(self.cfg.id as u32)
                .message(format!("rebuilt up to entry {index}: a voter again")),
        );
    }

    /// Whether a follower may apply what it just stored from the leader without waiting
    /// to be told it is committed (see also `broadcast_commits`). In a cluster of at most
    /// 3 voters, an entry of the leader's current term that the leader stored (it sends
    /// only after storing) and that we stored is on a majority: it is committed (Raft,
    /// 5.4.2), so no leader can ever replace it. Applying it at once saves the round trip
    /// that brings the commit index, and lets our CHECK travel with our acknowledgement.
    fn may_apply_early(&self) -> bool {
        let Some(r) = self.raft.as_ref() else { return false };
        if r.node.raft.state != StateRole::Follower
            || r.node.raft.leader_id == raft::INVALID_ID
            || r.rejoining
            || self.recovery.is_some()
        {
            return false;
        }
        let voters = r.node.raft.prs().conf().voters();
        few_voters(&r.node.raft) && voters.contains(self.cfg.id)
    }

    /// Whether a cross-checking leader applies its new entries before they are committed.
    /// Its CHECKs then travel with the entries, so a follower that applies them early has
    /// a majority for its own client's request at once, without waiting for the leader to
    /// hear back. Replies wait for the commit all the same (`parked`). Should the entries
    /// never commit (this leader is deposed and its successor replaces them), the replica
    /// halts when the successor's entries arrive and restarts from its log.
    fn may_speculate(&self) -> bool {
        let Some(r) = self.raft.as_ref() else { return false };
        self.validator.is_some() && r.node.raft.state == StateRole::Leader && self.recovery.is_none() && !r.rejoining
    }

    /// Apply entries ahead of Raft's commit index (`may_apply_early`, `may_speculate`), in
    /// order: request batches only, from the next index on. Recovery, audit and
    /// configuration entries wait for the commit index, and so does everything after them.
    /// `committed`: the entries are known committed.
    fn apply_early(&mut self, early: Vec<Entry>, committed: bool) -> Result<(), i32> {
        for e in early {
            if e.index <= self.applied {
                continue;
            }
            if e.index != self.applied + 1 || e.get_entry_type() != EntryType::EntryNormal || self.recovery.is_some() {
                break;
            }
            match e.data.first() {
                None => self.applied = e.index,
                Some(&ENTRY_BATCH) => self.apply(e.index, &e.data)?,
                Some(_) => break,
            }
            if committed {
                self.committed_early = self.committed_early.max(e.index);
            }
        }
        Ok(())
    }

    /// Persist the configuration a conf-change entry produced; the entry is then applied.
    fn save_conf(&mut self, cs: raft::Result<raft::eraftpb::ConfState>, index: u64) -> Result<(), i32> {
        if let Ok(cs) = cs {
            if let Err(err) = self.raft.as_mut().unwrap().storage.set_conf_state(cs) {
                return Err(self.fatal_io("save the configuration", err));
            }
        }
        self.applied = index;
        Ok(())
    }
}

/// Frames Raft's messages into the links' queues, through one buffer reused for all.
pub(super) fn send_all(r: &mut RaftPart, msgs: Vec<Message>) {
    r.messages_sent += msgs.len() as u64;
    let buf = &mut r.encode_scratch;
    for m in msgs {
        buf.clear();
        buf.push(MSG_RAFT);
        m.encode(buf).expect("encoding into a Vec cannot fail");
        r.peers.send(m.to, buf);
    }
    // A snapshot passes through here too: its size is not kept for the next append.
    if buf.capacity() > SCRATCH_KEPT {
        *buf = Vec::new();
    }
}

/// The most send_all's buffer keeps between calls.
const SCRATCH_KEPT: usize = 1 << 20;

/// Whether the leader tells its followers of each commit at once (Raft's default: an
/// append with the new commit index to every follower, which each answers) or lets the
/// news travel with the next append or heartbeat. In a cluster of at most 3 voters the
/// followers apply request batches of the leader's term as soon as they store them
/// (`may_apply_early`): for those, the broadcast is two messages out and two back per
/// entry that nobody waits for. Every other entry of ours (the empty one of a new term,
/// RECOVER, AUDIT, configuration changes), and everything while a follower cannot apply
/// early (it is told no later than the next heartbeat), keeps the broadcast until it is
/// committed. `appended`: the entries this replica just stored.
fn broadcast_commits(r: &mut RaftPart, appended: &[Entry]) {
    let raft = &mut r.node.raft;
    if raft.state != StateRole::Leader {
        return;
    }
    let batch = |e: &Entry| e.get_entry_type() == EntryType::EntryNormal && e.data.first() == Some(&ENTRY_BATCH);
    if let Some(e) = appended.iter().rev().find(|e| !batch(e)) {
        r.commit_news_until = r.commit_news_until.max(e.index);
    }
    let small = few_voters(raft);
    raft.skip_bcast_commit(small && raft.raft_log.committed >= r.commit_news_until);
}

/// At most 3 voters: two stored copies are a majority, which is what lets followers apply
/// early (`may_apply_early`) and the leader keep its commit news (`broadcast_commits`).
fn few_voters(raft: &raft::Raft<LogStore>) -> bool {
    raft.prs().conf().voters().ids().len() <= 3
}

//! The state audit, and snapshots that only hold state a majority confirmed.
//!
//! A request cross-checks only the objects it touches, so a silent flip (one whose CRC
//! was recomputed) in an object no request touches stays latent. If such a state were
//! snapshotted and sent to a replica being rebuilt, two replicas would then agree on the
//! bad object and outvote the healthy one. The audit closes that hole:
//!
//! - An AUDIT log entry makes every replica summarise its whole state at the same index:
//!   one digest per group of object ids (`Store::audit_groups`), objects that fail their
//!   own check counted apart. The summaries go to the other replicas in AUDIT messages.
//! - A replica that differs in some groups from a majority that agrees proposes a
//!   RECOVER of every object of those groups, repaired by the usual REPAIR; the others
//!   step in for it if it does not.
//! - A snapshot is taken at an audit index and becomes the one Raft stores (and sends,
//!   and compacts the log to) only once a majority confirmed the summary it was taken
//!   with. An unconfirmed state is never installed elsewhere; the log since the last
//!   confirmed snapshot is kept, so a lagging replica replays it instead and brings its
//!   own, independently computed, vote.
//!
//! Audits are proposed by the leader when a snapshot is due (`SnapshotPace`) and every
//! `--audit-every`, and by any replica after it restarts or when Raft wants a snapshot
//! (a replica re-added after a replacement).

use super::*;
use std::collections::BTreeMap;

/// Groups of object ids per summary (8 bytes each in an AUDIT message).
pub(super) const AUDIT_GROUPS: usize = 512;
/// Audit rounds remembered, for summaries that arrive late (a replica catching up).
const ROUNDS_KEPT: usize = 16;
/// An AUDIT proposal not applied this long after it was made is made again.
const AUDIT_RETRY: Duration = Duration::from_secs(2);

#[derive(Clone)]
pub(super) struct Summary {
    /// Item slots in use: a repair names every id up to the largest count seen. (Not
    /// compared: a store restored from a snapshot has no trailing empty slots.)
    slots: u64,
    groups: Vec<u64>,
}

#[derive(Default)]
pub(super) struct Round {
    mine: Option<Summary>,
    peers: BTreeMap<u64, Summary>,
    /// The snapshot taken at this index, until a majority confirms it.
    snapshot: Option<(Vec<u8>, raft::eraftpb::ConfState)>,
    confirmed: bool,
    /// Groups already sent to repair in this round, per replica.
    acted: BTreeMap<u64, BTreeSet<usize>>,
}

#[derive(Default)]
pub(super) struct Audits {
    pub(super) rounds: BTreeMap<u64, Round>,
    /// An audit is wanted (restart, rejoin, a snapshot Raft asked for).
    pub(super) wanted: bool,
    /// A snapshot is wanted at the next audit, whatever the interval.
    pub(super) snapshot_wanted: bool,
    pub(super) last_applied_at: Option<Instant>,
    pub(super) last_index: u64,
    pub(super) proposed_at: Option<Instant>,
    pub(super) audits: u64,
    /// Time the last summary (and snapshot copy, when one was due) took, in µs.
    pub(super) last_us: u64,
    pub(super) max_us: u64,
    pub(super) divergent_groups: u64,
    pub(super) confirmed_snapshots: u64,
}

impl Audits {
    /// Round `index`, made room for by forgetting the oldest rounds (bounded memory).
    fn round(&mut self, index: u64) -> &mut Round {
        if !self.rounds.contains_key(&index) {
            while self.rounds.len() >= ROUNDS_KEPT {
                self.rounds.pop_first();
            }
        }
        self.rounds.entry(index).or_default()
    }
}

impl Replica {
    /// Whether this replica audits at all: only cross-checked state has CRCs to compare.
    pub(super) fn audited(&self) -> bool {
        self.validator.is_some()
    }

    /// The leader proposes an audit when one is due; any replica when it wants one.
    pub(super) fn propose_audit_if_due(&mut self) {
        if !self.audited() || self.recovery.is_some() {
            return;
        }
        let r = self.raft.as_mut().unwrap();
        if r.storage.take_snapshot_wanted() {
            self.audits.wanted = true;
            self.audits.snapshot_wanted = true;
        }
        let leader = r.node.raft.state == StateRole::Leader;
        let a = &self.audits;
        let by_entries = r
            .pace
            .due(self.applied.saturating_sub(a.last_index), self.cfg.snapshot_every);
        let by_time = a.last_applied_at.is_none_or(|t| t.elapsed() >= self.cfg.audit_every);
        let due = a.wanted || (leader && (by_entries || by_time));
        if !due || a.proposed_at.is_some_and(|t| t.elapsed() < AUDIT_RETRY) {
            return;
        }
        if r.node.raft.leader_id == raft::INVALID_ID {
            return;
        }
        let mut p = Packer::default();
        p.u8(ENTRY_AUDIT);
        if r.node.propose(vec![], p.buf).is_ok() {
            self.audits.proposed_at = Some(Instant::now());
        }
    }

    /// An AUDIT entry: summarise, snapshot if one is due, and tell the others.
    pub(super) fn apply_audit(&mut self, index: u64, u: &mut Unpacker<'_>) -> Result<(), UnpackError> {
        if !u.is_empty() {
            return Err(UnpackError("trailing bytes in audit"));
        }
        let audited = self.audited();
        let a = &mut self.audits;
        a.wanted = false;
        a.proposed_at = None;
        a.last_applied_at = Some(Instant::now());
        a.last_index = index;
        if !audited {
            return Ok(());
        }
        a.audits += 1;
        let began = Instant::now();
        let summary = Summary {
            slots: self.store.slot_count(),
            groups: self.store.audit_groups(AUDIT_GROUPS),
        };
        let r = self.raft.as_ref().unwrap();
        let snapshot_due =
            self.audits.snapshot_wanted || r.pace.due(index.saturating_sub(r.snap_index), self.cfg.snapshot_every);
        let conf = r.storage.conf_state();
        let snapshot = snapshot_due.then(|| (self.snapshot_data(), conf));
        if let Some((data, _)) = &snapshot {
            self.raft.as_mut().unwrap().pace.taken(data.len());
        }
        let us = began.elapsed().as_micros() as u64;
        self.audits.last_us = us;
        self.audits.max_us = self.audits.max_us.max(us);
        let mut p = Packer::default();
        p.u8(MSG_AUDIT);
        p.u64(index);
        p.u64(summary.slots);
        for g in &summary.groups {
            p.u64(*g);
        }
        self.raft.as_mut().unwrap().peers.broadcast(&p.buf);
        if snapshot.is_some() {
            self.audits.snapshot_wanted = false;
            // Only the newest unconfirmed snapshot is kept (memory: one copy of the state).
            for round in self.audits.rounds.values_mut() {
                round.snapshot = None;
            }
        }
        let round = self.audits.round(index);
        round.mine = Some(summary);
        round.snapshot = snapshot;
        self.settle_audit(index)
    }

    /// An AUDIT message: another replica's summary at `index`.
    pub(super) fn on_audit(&mut self, from: u64, u: &mut Unpacker<'_>) -> Result<(), UnpackError> {
        let index = u.u64()?;
        let slots = u.u64()?;
        if u.rest().len() != AUDIT_GROUPS * 8 {
            return Err(UnpackError("audit summary of the wrong size"));
        }
        let mut groups = Vec::with_capacity(AUDIT_GROUPS);
        for _ in 0..AUDIT_GROUPS {
            groups.push(u.u64()?);
        }
        if !self.audited() || from == self.cfg.id || from == 0 || from > self.n as u64 {
            return Ok(());
        }
        // Too old to matter: every round we still remember is newer.
        if self.audits.rounds.len() >= ROUNDS_KEPT && self.audits.rounds.keys().next().is_some_and(|&k| index < k) {
            return Ok(());
        }
        self.audits.round(index).peers.insert(from, Summary { slots, groups });
        self.settle_audit(index)
    }

    /// Compare what is known of round `index`: confirm our snapshot when a majority
    /// agrees with us, and send to repair every group in which a replica (us included)
    /// differs from a majority that agrees.
    fn settle_audit(&mut self, index: u64) -> Result<(), UnpackError> {
        debug_assert!(self.audited());
        let majority = self.n / 2 + 1;
        let me = self.cfg.id;
        let Some(round) = self.audits.rounds.get_mut(&index) else {
            return Ok(());
        };
        let Some(mine) = round.mine.clone() else { return Ok(()) };
        let mut all: Vec<(u64, &Summary)> = vec![(me, &mine)];
        all.extend(round.peers.iter().map(|(&id, s)| (id, s)));
        let slots = all.iter().map(|(_, s)| s.slots).max().unwrap_or(0);
        let agree = all.iter().filter(|(_, s)| s.groups == mine.groups).count();
        let mut confirmed_snapshot = None;
        if agree >= majority && !round.confirmed {
            round.confirmed = true;
            confirmed_snapshot = round.snapshot.take();
        }
        // Per replica, the groups where a majority agrees on another value than its own.
        let mut outvoted: BTreeMap<u64, BTreeSet<usize>> = BTreeMap::new();
        for g in 0..AUDIT_GROUPS {
            for &(_, s) in &all {
                let same = all.iter().filter(|(_, o)| o.groups[g] == s.groups[g]).count();
                if same >= majority {
                    for &(other, o) in &all {
                        if o.groups[g] != s.groups[g] {
                            outvoted.entry(other).or_default().insert(g);
                        }
                    }
                    break;
                }
            }
        }
        let mut repairs = Vec::new();
        for (id, groups) in outvoted {
            let acted = round.acted.entry(id).or_default();
            let new: BTreeSet<usize> = groups.difference(acted).copied().collect();
            if !new.is_empty() {
                acted.extend(new.iter().copied());
                repairs.push((id, new));
            }
        }
        if let Some((data, conf)) = confirmed_snapshot {
            self.audits.confirmed_snapshots += 1;
            let r = self.raft.as_mut().unwrap();
            if index > r.snap_index || r.storage.conf_state() != conf {
                match r.storage.compact_with_conf(index, data, conf) {
                    Ok(replaced) => r.keep_snapshot_buffer(replaced),
                    Err(e) => {
                        let code = self.fatal_io("write a snapshot", e);
                        std::process::exit(code);
                    }
                }
                r.snap_index = r.snap_index.max(index);
            }
        }
        for (id, groups) in repairs {
            self.audits.divergent_groups += groups.len() as u64;
            let ids = self.store.ids_in_groups(&groups, AUDIT_GROUPS, slots);
            self.counters.divergences += 1;
            self.events.emit(
                Event::new("kv", "divergence", "recover")
                    .replica(id as u32)
                    .message(format!(
                        "audit at entry {index}: replica {id} disagrees with the majority in {} group(s) of objects; repairing their {} object(s)",
                        groups.len(),
                        ids.len()
                    )),
            );
            let due = if id == me {
                self.unrepaired_failures += 1;
                Instant::now()
            } else {
                Instant::now() + STEP_IN_AFTER
            };
            let (set, _) = self.to_recover.entry(id).or_insert_with(|| (BTreeSet::new(), due));
            set.extend(ids);
        }
        Ok(())
    }
}

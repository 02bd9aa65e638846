//! CrossCheck's validation (Fig. 2): per request and replica, a status that starts
//! UNKNOWN and becomes VALID when the replica's state delta is in a majority of identical
//! deltas, or FAILED when a majority disagrees with it. The local reply is released once
//! the local replica is VALID; the other replicas' statuses are settled as their CHECKs
//! arrive (deferred validation), which is what recovery needs.
//!
//! Two levels. Replicas first exchange one digest per log entry: a CRC32C over the
//! entry's deltas, in request order (`digest`). When the digests agree, which is the
//! common case, every request of the entry is settled at once: no per-request state, no
//! per-object message. Only when a replica's digest differs from ours do the two trade
//! their full deltas for that entry, and the per-request vote above runs on them (a
//! replica whose digest equals ours is counted with our deltas: equal digests mean equal
//! deltas, up to the CRC's 2^-32 chance, the same strength as the object CRCs).

use crate::MAX_REPLICAS;
use lockstep_guard::{ObjectId, Packer, Pair, UnpackError, Unpacker};
use std::collections::BTreeMap;
use std::ops::Range;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ReqId {
    pub index: u64,
    pub pos: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Unknown,
    Suspect,
    Valid,
    Failed,
}

/// Where a locally received request's reply goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplyTo {
    pub conn: u64,
    pub seq: u64,
}

#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The local replica is VALID: send the reply (once `req` is committed).
    Release { req: ReqId, to: ReplyTo, reply: Vec<u8> },
    /// `replica` (1-based) disagrees with the majority on these objects.
    /// The first few differing objects are also in `values`, as "id: its CRC / the
    /// majority's CRC".
    Failed {
        replica: u64,
        req: ReqId,
        objects: Vec<ObjectId>,
        values: Vec<String>,
    },
    /// Every replica's delta is known and no majority agrees on some object: the request's
    /// result cannot be trusted (its client, if it is ours, is `to`: it gets an error).
    NoMajority { req: ReqId, to: Option<ReplyTo> },
    /// Digests of entry `index` differ: every peer needs our full deltas (`count`
    /// requests, encoded by `encode_delta`).
    Detail { index: u64, count: u32, detail: Vec<u8> },
}

/// An entry's deltas: per request, its position in the entry and its (object, CRC) pairs.
pub type Deltas = Vec<(u32, Vec<Pair>)>;

/// A request of an entry as this replica executed it.
#[derive(Debug)]
pub struct Executed {
    pub pos: u32,
    pub reply: KeptReply,
    /// The replica whose client sent the request.
    pub origin: u64,
    /// Our client, if it is ours.
    pub to: Option<ReplyTo>,
}

/// Where the reply of an executed request is kept until the entry is settled.
#[derive(Debug, PartialEq, Eq)]
pub enum KeptReply {
    /// Our client's: handed over whole when it is released.
    Own(Vec<u8>),
    /// Another replica's client's (kept for a repair of that replica): these bytes of
    /// the entry's `KeptEntry::replies`.
    Shared(Range<usize>),
}

/// What this replica keeps of an entry it applied until every replica's digest is in:
/// the requests' deltas, replies and clients. The buffers are handed back when the
/// entry is forgotten and serve a later one (`Validator::buffers`), so that an entry's
/// replies and deltas cost no allocation once the replica is warm.
#[derive(Debug, Default)]
pub struct KeptEntry {
    /// The requests' deltas, encoded by `encode_delta`.
    pub detail: Vec<u8>,
    pub executed: Vec<Executed>,
    /// The `KeptReply::Shared` replies, back to back.
    pub replies: Vec<u8>,
}

impl KeptReply {
    /// The reply as an owned buffer (`replies`: its entry's `KeptEntry::replies`).
    fn into_owned(self, replies: &[u8]) -> Vec<u8> {
        match self {
            KeptReply::Own(reply) => reply,
            KeptReply::Shared(at) => replies[at].to_vec(),
        }
    }
}

/// At most this many entries' buffers wait for reuse; buffers that grew past
/// `SPARE_BYTES_MAX` (an entry of large values) are freed instead. Both bound the memory
/// kept while a replica is idle: at most 32 × 2 × 256 KiB.
const SPARE_ENTRIES: usize = 32;
const SPARE_BYTES_MAX: usize = 256 << 10;

/// The digest of an entry's deltas, as encoded (`(pos, pairs)` per request).
pub fn digest(detail: &[u8]) -> u32 {
    lockstep_core::crc32c(detail)
}

/// One log entry at the digest level.
struct EntryCheck {
    /// Per replica, its digest of the entry (the first `n` are used).
    digests: [Option<u32>; MAX_REPLICAS],
    /// What we kept of the entry, once we applied it (its `executed` and `replies` are
    /// taken when the entry goes to the per-request vote).
    kept: Option<KeptEntry>,
    /// Requests in our `kept.detail`.
    count: u32,
    /// Our clients' replies went out (or moved to the per-request vote).
    released: bool,
    /// Digests differed: the entry's requests are voted one by one.
    voting: bool,
    /// Peers' full deltas, once sent (only when digests differ; empty until then).
    peer_details: Vec<Option<Deltas>>,
    /// Replicas whose deltas were handed to the per-request vote (bit per replica).
    fed: u64,
    created: Instant,
}

struct Pending {
    sets: Vec<Option<Vec<Pair>>>,
    status: Vec<Status>,
    /// The local reply, kept until every replica is settled (a FAILED replica's client
    /// gets it through a repair).
    reply: Option<Vec<u8>>,
    /// The replica whose client sent the request.
    origin: u64,
    to: Option<ReplyTo>,
    released: bool,
    owed_done: bool,
    no_majority: bool,
    created: Instant,
}

pub struct Validator {
    n: usize,
    me: usize,
    entries: BTreeMap<u64, EntryCheck>,
    pending: BTreeMap<ReqId, Pending>,
    /// Correct replies that a FAILED replica's clients are waiting for, by target replica.
    owed: BTreeMap<(u64, ReqId), Vec<u8>>,
    /// Local requests whose reply is held because this replica FAILED them.
    held: Held,
    /// Buffers of forgotten entries, for the next ones.
    spare: Vec<KeptEntry>,
}

type Held = BTreeMap<ReqId, (ReplyTo, Instant)>;

/// Requests are forgotten this long after they were applied, settled or not.
pub const WINDOW: Duration = Duration::from_secs(10);
/// A client of ours waits at most this long after its request was applied for a reply
/// that a majority confirmed; then it gets an error.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(3);

impl Validator {
    /// `n` replicas; `me` is this replica's 1-based id.
    pub fn new(n: usize, me: u64) -> Self {
        assert!((1..=MAX_REPLICAS).contains(&n) && me >= 1 && me as usize <= n);
        Validator {
            n,
            me: me as usize - 1,
            entries: BTreeMap::new(),
            pending: BTreeMap::new(),
            owed: BTreeMap::new(),
            held: BTreeMap::new(),
            spare: Vec::new(),
        }
    }

    /// Empty buffers for the next entry this replica applies (`local_entry`).
    pub fn buffers(&mut self) -> KeptEntry {
        self.spare.pop().unwrap_or_default()
    }

    fn recycle(&mut self, mut a: KeptEntry) {
        if self.spare.len() >= SPARE_ENTRIES
            || a.detail.capacity() > SPARE_BYTES_MAX
            || a.replies.capacity() > SPARE_BYTES_MAX
        {
            return;
        }
        a.detail.clear();
        a.executed.clear();
        a.replies.clear();
        self.spare.push(a);
    }

    fn entry(&mut self, id: ReqId) -> &mut Pending {
        let n = self.n;
        self.pending.entry(id).or_insert_with(|| Pending {
            sets: vec![None; n],
            status: vec![Status::Unknown; n],
            reply: None,
            origin: 0,
            to: None,
            released: false,
            owed_done: false,
            no_majority: false,
            created: Instant::now(),
        })
    }

    /// The 0-based index of peer `from` (1-based, not us).
    fn peer(&self, from: u64) -> usize {
        let i = from as usize - 1;
        assert!(i < self.n && i != self.me);
        i
    }

    fn entry_check(&mut self, index: u64) -> &mut EntryCheck {
        self.entries.entry(index).or_insert_with(|| EntryCheck {
            digests: [None; MAX_REPLICAS],
            kept: None,
            count: 0,
            released: false,
            voting: false,
            peer_details: Vec::new(),
            fed: 0,
            created: Instant::now(),
        })
    }

    /// This replica applied entry `index`: the checked requests' deltas are
    /// `kept.detail` (its `digest` went to the peers), their replies and clients
    /// `kept.executed`, in the same order.
    pub fn local_entry(&mut self, index: u64, digest: u32, kept: KeptEntry) -> Vec<Outcome> {
        debug_assert_eq!(digest, self::digest(&kept.detail));
        let me = self.me;
        let e = self.entry_check(index);
        e.digests[me] = Some(digest);
        e.count = kept.executed.len() as u32;
        e.kept = Some(kept);
        e.created = Instant::now();
        self.evaluate_entry(index)
    }

    /// Replica `from` (1-based) sent its digest of entry `index`.
    pub fn remote_digest(&mut self, from: u64, index: u64, d: u32) -> Vec<Outcome> {
        let i = self.peer(from);
        let e = self.entry_check(index);
        if e.digests[i].is_some() {
            return Vec::new();
        }
        e.digests[i] = Some(d);
        self.evaluate_entry(index)
    }

    /// Replica `from` sent its full deltas of entry `index` (digests differ somewhere):
    /// they join the per-request vote, now or once we applied the entry.
    pub fn remote_detail(&mut self, from: u64, index: u64, reqs: Deltas) -> Vec<Outcome> {
        let (i, n) = (self.peer(from), self.n);
        let e = self.entry_check(index);
        if e.peer_details.get(i).is_some_and(|d| d.is_some()) {
            return Vec::new();
        }
        e.peer_details.resize(n, None);
        // The digest goes first on the same link; this only covers a lost or stale one.
        e.digests[i] = Some(digest(&encode_deltas(&reqs)));
        e.peer_details[i] = Some(reqs);
        self.evaluate_entry(index)
    }

    fn evaluate_entry(&mut self, index: u64) -> Vec<Outcome> {
        let (n, me) = (self.n, self.me);
        let majority = n / 2 + 1;
        let e = self.entries.get_mut(&index).expect("evaluated entry exists");
        let Some(mine) = e.digests[me].filter(|_| e.kept.is_some()) else {
            return Vec::new();
        };
        let differs = e.digests[..n].iter().any(|d| d.is_some_and(|d| d != mine)) || !e.peer_details.is_empty();
        let mut out = if differs { self.start_voting(index) } else { Vec::new() };
        let e = self.entries.get_mut(&index).expect("evaluated entry exists");
        if e.voting {
            // Each replica not heard in the vote yet votes with the deltas of any replica
            // whose digest equals its own (ours, or a peer's detail, or its own detail).
            let ours = decode_detail(e.count, &e.kept.as_ref().expect("applied").detail);
            let mut votes = Vec::new();
            for r in 0..n {
                let (Some(d), false) = (e.digests[r], r == me || e.fed & (1 << r) != 0) else {
                    continue;
                };
                let source = if d == mine {
                    Some(&ours)
                } else {
                    let mut known = e.peer_details.iter().enumerate();
                    known.find_map(|(s, x)| x.as_ref().filter(|_| e.digests[s] == Some(d)))
                };
                if let Some(pairs) = source {
                    e.fed |= 1 << r;
                    votes.push((r as u64 + 1, pairs.clone()));
                }
            }
            for (from, reqs) in votes {
                for (pos, pairs) in reqs {
                    out.extend(self.remote(from, ReqId { index, pos }, pairs));
                }
            }
            return out;
        }
        let agree = e.digests[..n].iter().filter(|d| **d == Some(mine)).count();
        if agree >= majority && !e.released {
            e.released = true;
            for x in &mut e.kept.as_mut().expect("applied").executed {
                if let (Some(to), KeptReply::Own(reply)) = (x.to, &mut x.reply) {
                    out.push(Outcome::Release {
                        req: ReqId { index, pos: x.pos },
                        to,
                        reply: std::mem::take(reply),
                    });
                }
            }
        }
        if agree == n {
            if let Some(kept) = self.entries.remove(&index).and_then(|e| e.kept) {
                self.recycle(kept);
            }
        }
        out
    }

    /// Digests differ: tell every peer our full deltas, and hand the entry's requests to
    /// the per-request vote (once). Every replica that sees a difference does the same,
    /// at once, so a replica that turns out FAILED has had its deltas sent everywhere
    /// before it can ask for a repair, and the repair can carry its clients' replies.
    fn start_voting(&mut self, index: u64) -> Vec<Outcome> {
        let Some(e) = self.entries.get_mut(&index) else {
            return Vec::new();
        };
        if e.voting {
            return Vec::new();
        }
        e.voting = true;
        let released = std::mem::replace(&mut e.released, true);
        let count = e.count;
        let kept = e.kept.as_mut().expect("applied");
        let executed = std::mem::take(&mut kept.executed);
        let replies = std::mem::take(&mut kept.replies);
        let detail = kept.detail.clone();
        let ours = decode_detail(count, &detail);
        assert_eq!(ours.len(), executed.len(), "one delta per executed request");
        let mut out = vec![Outcome::Detail { index, count, detail }];
        for ((pos, pairs), x) in ours.into_iter().zip(executed) {
            assert_eq!(pos, x.pos);
            // A reply that already went out was confirmed by a majority of equal digests.
            let to = x.to.filter(|_| !released);
            let reply = x.reply.into_owned(&replies);
            out.extend(self.local(ReqId { index, pos }, pairs, reply, x.origin, to));
        }
        out
    }

    /// This replica executed `id`.
    fn local(&mut self, id: ReqId, pairs: Vec<Pair>, reply: Vec<u8>, origin: u64, to: Option<ReplyTo>) -> Vec<Outcome> {
        let me = self.me;
        let p = self.entry(id);
        p.sets[me] = Some(pairs);
        p.reply = Some(reply);
        p.origin = origin;
        p.to = to;
        p.created = Instant::now();
        self.evaluate(id)
    }

    /// Replica `from` (1-based) reported its delta for `id`.
    fn remote(&mut self, from: u64, id: ReqId, pairs: Vec<Pair>) -> Vec<Outcome> {
        let i = self.peer(from);
        let p = self.entry(id);
        if p.sets[i].is_some() {
            return Vec::new();
        }
        p.sets[i] = Some(pairs);
        self.evaluate(id)
    }

    fn evaluate(&mut self, id: ReqId) -> Vec<Outcome> {
        let n = self.n;
        let majority = n / 2 + 1;
        let p = self.pending.get_mut(&id).expect("evaluated request exists");
        let mut out = Vec::new();
        // Object by object: a replica is FAILED as soon as a majority agrees on a value of
        // an object that it does not have, and VALID once a majority agrees on every
        // object and it has each of those values. Two faulty replicas that differ on
        // different objects are both found, and the third stays VALID.
        let known = p.sets.iter().filter(|s| s.is_some()).count();
        let mut present = p.sets.iter().flatten();
        let first = present.next();
        if present.all(|s| Some(s) == first) {
            // Every delta known so far is the same (the usual case): each of those
            // replicas is VALID once they are a majority, no one is FAILED, and no object
            // lacks a majority. No vote needs counting.
            let now = if known >= majority {
                Status::Valid
            } else {
                Status::Suspect
            };
            for r in 0..n {
                if p.sets[r].is_some() && p.status[r] != Status::Failed {
                    p.status[r] = now;
                }
            }
        } else {
            Self::tally(p, &mut self.held, id, majority, &mut out);
        }
        self.settle(id, out)
    }

    /// The object-by-object vote, when the known deltas differ.
    fn tally(p: &mut Pending, held: &mut Held, id: ReqId, majority: usize, out: &mut Vec<Outcome>) {
        let n = p.sets.len();
        let votes = vote(&p.sets, majority);
        let known = p.sets.iter().filter(|s| s.is_some()).count();
        for r in 0..n {
            let Some(set) = &p.sets[r] else { continue };
            let wrong: Vec<ObjectId> = votes
                .iter()
                .filter(|v| v.winner.is_some_and(|w| value_of(set, v.id) != w))
                .map(|v| v.id)
                .collect();
            let now = if !wrong.is_empty() {
                Status::Failed
            } else if votes.iter().all(|v| v.winner.is_some()) {
                Status::Valid
            } else {
                Status::Suspect
            };
            if p.status[r] == now || p.status[r] == Status::Failed {
                continue;
            }
            p.status[r] = now;
            if now == Status::Failed {
                let values = wrong.iter().take(4).map(|&o| compared(o, set, &votes)).collect();
                out.push(Outcome::Failed {
                    replica: r as u64 + 1,
                    req: id,
                    objects: wrong,
                    values,
                });
            }
        }
        if known == n && !p.no_majority && votes.iter().any(|v| v.winner.is_none()) {
            p.no_majority = true;
            // Our client gets the error, whether its reply was still unsent or held for a
            // repair that cannot bring a right one.
            let to = p.to.filter(|_| !p.released || held.remove(&id).is_some());
            p.released |= to.is_some();
            out.push(Outcome::NoMajority { req: id, to });
        }
    }

    /// After the statuses of `id` changed: hand over what is due.
    fn settle(&mut self, id: ReqId, mut out: Vec<Outcome>) -> Vec<Outcome> {
        let me = self.me;
        let p = self.pending.get_mut(&id).expect("evaluated request exists");
        // A FAILED origin's client needs the right reply, which a VALID replica hands over
        // in its REPAIR.
        let origin = p.origin as usize;
        if !p.owed_done
            && origin >= 1
            && origin - 1 != me
            && p.status[me] == Status::Valid
            && p.status[origin - 1] == Status::Failed
        {
            if let Some(reply) = &p.reply {
                p.owed_done = true;
                self.owed.insert((p.origin, id), reply.clone());
            }
        }
        if !p.released {
            if let (Status::Valid, Some(to), true) = (p.status[me], p.to, p.reply.is_some()) {
                // Our own client's request: nobody else is owed this reply, so it moves.
                p.released = true;
                out.push(Outcome::Release {
                    req: id,
                    to,
                    reply: p.reply.take().expect("checked above"),
                });
            } else if let (Status::Failed, Some(to)) = (p.status[me], p.to) {
                p.released = true;
                self.held.insert(id, (to, Instant::now()));
            }
        }
        // The owed reply also covers the case where the origin failed before we applied.
        let settled = p.no_majority || p.status.iter().all(|s| matches!(s, Status::Valid | Status::Failed));
        if settled && (p.released || p.to.is_none()) {
            self.pending.remove(&id);
        }
        out
    }

    /// Replies owed to `target`'s clients (for a REPAIR); they are handed over once.
    pub fn take_owed(&mut self, target: u64) -> Vec<(ReqId, Vec<u8>)> {
        let keys: Vec<_> = self
            .owed
            .range((target, ReqId { index: 0, pos: 0 })..)
            .take_while(|(k, _)| k.0 == target)
            .map(|(k, _)| *k)
            .collect();
        keys.into_iter().map(|k| (k.1, self.owed.remove(&k).unwrap())).collect()
    }

    /// A repair brought the right reply for a held request: where to send it.
    pub fn take_held(&mut self, id: ReqId) -> Option<ReplyTo> {
        self.held.remove(&id).map(|h| h.0)
    }

    /// Give up on our clients' requests that got no trustworthy reply within
    /// `REPLY_TIMEOUT` (they get an error: bounded waiting), and forget requests older
    /// than the window. Returns the clients to answer with an error, and the number of
    /// requests forgotten unsettled.
    pub fn expire(&mut self, now: Instant) -> (Vec<ReplyTo>, usize) {
        let mut dropped = Vec::new();
        for e in self.entries.values_mut() {
            if !e.released && now.duration_since(e.created) > REPLY_TIMEOUT {
                e.released = true;
                dropped.extend(e.kept.iter().flat_map(|k| &k.executed).filter_map(|x| x.to));
            }
        }
        self.entries.retain(|_, e| now.duration_since(e.created) <= WINDOW);
        for p in self.pending.values_mut() {
            if let (false, Some(to)) = (p.released, p.to) {
                if now.duration_since(p.created) > REPLY_TIMEOUT {
                    p.released = true;
                    dropped.push(to);
                }
            }
        }
        let old: Vec<ReqId> = self
            .pending
            .iter()
            .filter(|(_, p)| now.duration_since(p.created) > WINDOW)
            .map(|(k, _)| *k)
            .collect();
        for id in &old {
            let p = self.pending.remove(id).unwrap();
            if let (false, Some(to)) = (p.released, p.to) {
                dropped.push(to);
            }
        }
        let late: Vec<ReqId> = self
            .held
            .iter()
            .filter(|(_, h)| now.duration_since(h.1) > REPLY_TIMEOUT)
            .map(|(k, _)| *k)
            .collect();
        for id in late {
            dropped.push(self.held.remove(&id).unwrap().0);
        }
        (dropped, old.len())
    }

    /// Entries and requests awaiting verdicts.
    pub fn pending(&self) -> usize {
        self.entries.len() + self.pending.len()
    }
}

/// One object's vote: the value a majority of replicas agrees on, if any (`Some(None)`:
/// a majority did not touch it).
struct Vote {
    id: ObjectId,
    winner: Option<Option<u32>>,
}

/// What `set` says of object `id`: its CRC, or None if the request did not touch it.
fn value_of(set: &[Pair], id: ObjectId) -> Option<u32> {
    set.binary_search_by_key(&id, |p| p.0).ok().map(|i| set[i].1)
}

/// The vote on every object any known delta touched.
fn vote(sets: &[Option<Vec<Pair>>], majority: usize) -> Vec<Vote> {
    let mut ids: Vec<ObjectId> = sets.iter().flatten().flat_map(|s| s.iter().map(|p| p.0)).collect();
    ids.sort_unstable();
    ids.dedup();
    ids.into_iter()
        .map(|id| {
            let values: Vec<Option<u32>> = sets.iter().flatten().map(|s| value_of(s, id)).collect();
            let winner = values
                .iter()
                .find(|v| values.iter().filter(|w| w == v).count() >= majority)
                .copied();
            Vote { id, winner }
        })
        .collect()
}

/// "id: its CRC / the majority's CRC" ("-" where the request did not touch it).
fn compared(id: ObjectId, set: &[Pair], votes: &[Vote]) -> String {
    let show = |v: Option<u32>| v.map_or("-".to_string(), |c| format!("{c:08x}"));
    let majority = votes.iter().find(|v| v.id == id).and_then(|v| v.winner).flatten();
    format!("{id}: {} / {}", show(value_of(set, id)), show(majority))
}

/// Encode one request's delta into an entry's detail (and so its digest).
pub fn encode_delta(p: &mut Packer, pos: u32, pairs: &[Pair]) {
    p.buf.reserve(8 + 12 * pairs.len());
    p.u32(pos);
    p.u32(pairs.len() as u32);
    for (id, crc) in pairs {
        p.u64(id.0);
        p.u32(*crc);
    }
}

/// Every request's delta of `reqs`, encoded one after another.
pub fn encode_deltas(reqs: &Deltas) -> Vec<u8> {
    let mut p = Packer::default();
    for (pos, pairs) in reqs {
        encode_delta(&mut p, *pos, pairs);
    }
    p.buf
}

/// `count` requests' deltas, as encoded by `encode_delta` (a peer's, or our own).
pub fn decode_deltas(u: &mut Unpacker<'_>, count: u32) -> Result<Deltas, UnpackError> {
    // Each request takes at least 8 bytes: the count is checked before allocating.
    if count as usize > u.rest().len() / 8 {
        return Err(UnpackError("request count exceeds message"));
    }
    let mut out = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let pos = u.u32()?;
        let n = u.u32()? as usize;
        if n > u.rest().len() / 12 {
            return Err(UnpackError("pair count exceeds message"));
        }
        let mut pairs = Vec::with_capacity(n);
        for _ in 0..n {
            pairs.push((ObjectId(u.u64()?), u.u32()?));
        }
        out.push((pos, pairs));
    }
    Ok(out)
}

/// Our own detail, which we encoded.
fn decode_detail(count: u32, detail: &[u8]) -> Deltas {
    decode_deltas(&mut Unpacker::new(detail), count).expect("our own detail decodes")
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockstep_guard::Delta;

    fn set(crc: u32) -> Vec<Pair> {
        vec![(ObjectId(1), crc), (Delta::REPLY, 7)]
    }
    const R: ReqId = ReqId { index: 5, pos: 0 };
    const TO: ReplyTo = ReplyTo { conn: 1, seq: 0 };

    #[test]
    fn reply_waits_for_a_matching_peer() {
        let mut v = Validator::new(3, 1);
        assert!(v.local(R, set(1), b"X".to_vec(), 1, Some(TO)).is_empty());
        let out = v.remote(2, R, set(1));
        assert_eq!(
            out,
            vec![Outcome::Release {
                req: R,
                to: TO,
                reply: b"X".to_vec()
            }]
        );
        // The third replica disagrees later: deferred validation marks it FAILED.
        let out = v.remote(3, R, set(2));
        assert_eq!(
            out,
            vec![Outcome::Failed {
                replica: 3,
                req: R,
                objects: vec![ObjectId(1)],
                values: vec!["0:1: 00000002 / 00000001".into()],
            }]
        );
        assert_eq!(v.pending(), 0);
    }

    #[test]
    fn suspect_then_failed_and_local_reply_held() {
        let mut v = Validator::new(3, 1);
        assert!(v.local(R, set(9), b"bad".to_vec(), 1, Some(TO)).is_empty());
        // First comparison fails: both SUSPECT, nothing released.
        assert!(v.remote(2, R, set(1)).is_empty());
        let out = v.remote(3, R, set(1));
        assert_eq!(
            out,
            vec![Outcome::Failed {
                replica: 1,
                req: R,
                objects: vec![ObjectId(1)],
                values: vec!["0:1: 00000009 / 00000001".into()],
            }]
        );
        assert_eq!(v.take_held(R), Some(TO));
    }

    #[test]
    fn healthy_replica_owes_the_failed_origin_its_reply() {
        let mut v = Validator::new(3, 2);
        v.local(R, set(1), b"good".to_vec(), 1, None);
        v.remote(3, R, set(1));
        let out = v.remote(1, R, set(4));
        assert!(matches!(out[..], [Outcome::Failed { replica: 1, .. }]));
        assert_eq!(v.take_owed(1), vec![(R, b"good".to_vec())]);
        assert!(v.take_owed(1).is_empty());
    }

    #[test]
    fn a_client_waits_a_bounded_time_for_a_confirmed_reply() {
        let mut v = Validator::new(3, 1);
        // Our request, and one peer that disagrees: no majority yet, nothing released.
        assert!(v.local(R, set(1), b"mine".to_vec(), 1, Some(TO)).is_empty());
        assert!(v.remote(2, R, set(2)).is_empty());
        let now = Instant::now();
        assert_eq!(v.expire(now).0, Vec::<ReplyTo>::new());
        // Past the bound the client is answered (with an error, by the replica), once.
        assert_eq!(v.expire(now + REPLY_TIMEOUT + Duration::from_millis(10)).0, vec![TO]);
        assert_eq!(
            v.expire(now + REPLY_TIMEOUT + Duration::from_millis(20)).0,
            Vec::<ReplyTo>::new()
        );
        // A held reply (we FAILED and wait for a repair) is bounded the same way.
        let r2 = ReqId { index: 6, pos: 0 };
        v.local(r2, set(9), b"bad".to_vec(), 1, Some(TO));
        v.remote(2, r2, set(1));
        v.remote(3, r2, set(1));
        assert_eq!(
            v.expire(Instant::now() + REPLY_TIMEOUT + Duration::from_millis(10)).0,
            vec![TO]
        );
        assert_eq!(v.take_held(r2), None);
    }

    #[test]
    fn three_different_deltas_have_no_majority() {
        let mut v = Validator::new(3, 1);
        v.local(R, set(1), vec![], 1, Some(TO));
        v.remote(2, R, set(2));
        assert_eq!(
            v.remote(3, R, set(3)),
            vec![Outcome::NoMajority { req: R, to: Some(TO) }]
        );
        assert_eq!(v.pending(), 0);
    }

    #[test]
    fn two_replicas_wrong_on_different_objects_are_both_failed_and_the_third_valid() {
        let pairs = |x: u32, y: u32, reply: u32| vec![(ObjectId(1), x), (ObjectId(2), y), (Delta::REPLY, reply)];
        let mut v = Validator::new(3, 3);
        assert!(v.local(R, pairs(1, 1, 7), b"right".to_vec(), 3, Some(TO)).is_empty());
        assert!(v.remote(1, R, pairs(9, 1, 8)).is_empty(), "1:1 on object 1: wait");
        let out = v.remote(2, R, pairs(1, 9, 6));
        // Object 1: replicas 2 and 3 agree; object 2: replicas 1 and 3; the reply: nobody.
        assert!(out.contains(&Outcome::Failed {
            replica: 1,
            req: R,
            objects: vec![ObjectId(1)],
            values: vec!["0:1: 00000009 / 00000001".into()],
        }));
        assert!(out
            .iter()
            .any(|o| matches!(o, Outcome::Failed { replica: 2, objects, .. } if objects == &vec![ObjectId(2)])));
        // No majority on the reply itself: our client gets an error, not a reply.
        assert!(out.contains(&Outcome::NoMajority { req: R, to: Some(TO) }));
    }

    fn entry(crcs: &[u32]) -> (u32, Vec<u8>, Deltas) {
        let reqs: Deltas = crcs.iter().enumerate().map(|(i, &c)| (i as u32, set(c))).collect();
        (reqs.len() as u32, encode_deltas(&reqs), reqs)
    }

    /// Our record of an entry of `count` requests with deltas `detail`, whose replies are
    /// "r<pos>": owned when the clients are `ours`, else in the shared buffer.
    fn applied(detail: Vec<u8>, count: u32, origin: u64, ours: bool) -> KeptEntry {
        let mut replies = Vec::new();
        let executed = (0..count)
            .map(|pos| {
                let reply = format!("r{pos}").into_bytes();
                Executed {
                    pos,
                    reply: match ours {
                        true => KeptReply::Own(reply),
                        false => {
                            replies.extend_from_slice(&reply);
                            KeptReply::Shared(replies.len() - reply.len()..replies.len())
                        }
                    },
                    origin,
                    to: ours.then_some(ReplyTo {
                        conn: 1,
                        seq: pos as u64,
                    }),
                }
            })
            .collect();
        KeptEntry {
            detail,
            executed,
            replies,
        }
    }

    #[test]
    fn equal_digests_release_a_whole_entry_without_a_per_request_vote() {
        let mut v = Validator::new(3, 1);
        let (count, detail, _) = entry(&[1, 2]);
        let d = digest(&detail);
        assert!(v
            .local_entry(9, digest(&detail), applied(detail, count, 1, true))
            .is_empty());
        let out = v.remote_digest(2, 9, d);
        let released: Vec<_> = out
            .iter()
            .map(|o| match o {
                Outcome::Release { req, reply, .. } => (req.pos, reply.clone()),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(released, vec![(0, b"r0".to_vec()), (1, b"r1".to_vec())]);
        assert_eq!(v.pending(), 1, "kept for the third replica's verdict");
        assert!(v.remote_digest(3, 9, d).is_empty());
        assert_eq!(v.pending(), 0, "all agree: nothing is kept");
        assert!(v.pending.is_empty(), "no per-request state was made");
        let reused = v.buffers();
        assert!(
            reused.detail.capacity() > 0,
            "the forgotten entry's buffers serve the next"
        );
        assert!(reused.detail.is_empty() && reused.executed.is_empty() && reused.replies.is_empty());
    }

    #[test]
    fn a_differing_digest_brings_the_full_deltas_and_the_per_request_vote() {
        // We are replica 2; replica 1 (the origin) executed request 1 wrongly.
        let mut v = Validator::new(3, 2);
        let (count, detail, _) = entry(&[1, 2]);
        let (_, bad, bad_reqs) = entry(&[1, 9]);
        // Replica 1's full deltas come before we applied the entry: they are kept.
        assert!(v.remote_digest(1, 4, digest(&bad)).is_empty());
        assert!(v.remote_detail(1, 4, bad_reqs).is_empty());
        let out = v.local_entry(4, digest(&detail), applied(detail.clone(), count, 1, false));
        assert!(
            matches!(&out[0], Outcome::Detail { index: 4, count: 2, detail: d } if *d == detail),
            "{out:?}"
        );
        // Replica 3 agrees with us: counted with our deltas; replica 1 is FAILED on the
        // request it got wrong, and is owed our reply for its client.
        let out = v.remote_digest(3, 4, digest(&detail));
        assert!(
            out.iter().any(|o| matches!(
                o,
                Outcome::Failed {
                    replica: 1,
                    req: ReqId { index: 4, pos: 1 },
                    ..
                }
            )),
            "{out:?}"
        );
        assert!(!out.iter().any(|o| matches!(
            o,
            Outcome::Failed {
                req: ReqId { pos: 0, .. },
                ..
            }
        )));
        assert_eq!(v.take_owed(1), vec![(ReqId { index: 4, pos: 1 }, b"r1".to_vec())]);
    }

    #[test]
    fn our_wrong_entry_holds_our_clients_replies_for_the_repair() {
        let mut v = Validator::new(3, 3);
        let (count, bad, _) = entry(&[5]);
        let (_, good, good_reqs) = entry(&[1]);
        let out = v.local_entry(7, digest(&bad), applied(bad, count, 3, true));
        assert!(out.is_empty());
        // Replica 1's digest differs: we send our deltas; replica 2's equals replica 1's,
        // so replica 1's full deltas count for both.
        let out = v.remote_digest(1, 7, digest(&good));
        assert!(matches!(out[..], [Outcome::Detail { index: 7, .. }]), "{out:?}");
        assert!(
            v.remote_digest(2, 7, digest(&good)).is_empty(),
            "1:1, no deltas for 1 yet"
        );
        let out = v.remote_detail(1, 7, good_reqs);
        assert!(
            out.iter().any(|o| matches!(o, Outcome::Failed { replica: 3, .. })),
            "{out:?}"
        );
        assert!(!out.iter().any(|o| matches!(o, Outcome::Release { .. })));
        assert_eq!(
            v.take_held(ReqId { index: 7, pos: 0 }),
            Some(ReplyTo { conn: 1, seq: 0 })
        );
    }

    #[test]
    fn an_entry_nobody_confirms_gets_its_clients_an_error_in_bounded_time() {
        let mut v = Validator::new(3, 1);
        let (count, detail, _) = entry(&[1, 2]);
        v.local_entry(3, digest(&detail), applied(detail, count, 1, true));
        let now = Instant::now();
        assert!(v.expire(now).0.is_empty());
        let late = now + REPLY_TIMEOUT + Duration::from_millis(10);
        assert_eq!(v.expire(late).0.len(), 2);
        assert!(v.expire(late).0.is_empty(), "once");
        v.expire(now + WINDOW + Duration::from_millis(10));
        assert_eq!(v.pending(), 0);
    }
}

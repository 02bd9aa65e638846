//! CrossCheck's validation (Fig. 2): per request and replica, a status that starts
//! UNKNOWN and becomes VALID when the replica's state delta is in a majority of identical
//! deltas, or FAILED when a majority disagrees with it. The local reply is released once
//! the local replica is VALID; the other replicas' statuses are settled as their CHECKs
//! arrive (deferred validation), which is what recovery needs.

use lockstep_guard::{Delta, ObjectId, Pair};
use std::collections::BTreeMap;
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
    /// The local replica is VALID: send the reply.
    Release { to: ReplyTo, reply: Vec<u8> },
    /// `replica` (1-based) disagrees with the majority on these objects.
    /// The first few differing objects are also in `values`, as "id: its CRC / the
    /// majority's CRC".
    Failed {
        replica: u64,
        req: ReqId,
        objects: Vec<ObjectId>,
        values: Vec<String>,
    },
    /// Every replica's delta is known and no majority agrees: nobody can be trusted.
    NoMajority { req: ReqId },
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
    created: Instant,
}

pub struct Validator {
    n: usize,
    me: usize,
    pending: BTreeMap<ReqId, Pending>,
    /// Correct replies that a FAILED replica's clients are waiting for, by target replica.
    owed: BTreeMap<(u64, ReqId), Vec<u8>>,
    /// Local requests whose reply is held because this replica FAILED them.
    held: BTreeMap<ReqId, (ReplyTo, Instant)>,
}

/// Requests are forgotten this long after they were applied, settled or not.
pub const WINDOW: Duration = Duration::from_secs(10);

impl Validator {
    /// `n` replicas; `me` is this replica's 1-based id.
    pub fn new(n: usize, me: u64) -> Self {
        assert!(n >= 1 && me >= 1 && me as usize <= n);
        Validator {
            n,
            me: me as usize - 1,
            pending: BTreeMap::new(),
            owed: BTreeMap::new(),
            held: BTreeMap::new(),
        }
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
            created: Instant::now(),
        })
    }

    /// This replica executed `id`.
    pub fn local(
        &mut self,
        id: ReqId,
        pairs: Vec<Pair>,
        reply: Vec<u8>,
        origin: u64,
        to: Option<ReplyTo>,
    ) -> Vec<Outcome> {
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
    pub fn remote(&mut self, from: u64, id: ReqId, pairs: Vec<Pair>) -> Vec<Outcome> {
        let i = from as usize - 1;
        assert!(i < self.n && i != self.me);
        let p = self.entry(id);
        if p.sets[i].is_some() {
            return Vec::new();
        }
        p.sets[i] = Some(pairs);
        self.evaluate(id)
    }

    fn evaluate(&mut self, id: ReqId) -> Vec<Outcome> {
        let (me, n) = (self.me, self.n);
        let majority = n / 2 + 1;
        let p = self.pending.get_mut(&id).expect("evaluated request exists");
        let mut out = Vec::new();
        // The largest group of replicas with identical deltas.
        let mut best: Option<(usize, usize)> = None; // (representative, size)
        for a in 0..n {
            let Some(sa) = &p.sets[a] else { continue };
            let size = (0..n).filter(|&b| p.sets[b].as_ref() == Some(sa)).count();
            if best.is_none_or(|(_, s)| size > s) {
                best = Some((a, size));
            }
        }
        let known = p.sets.iter().filter(|s| s.is_some()).count();
        match best {
            Some((rep, size)) if size >= majority => {
                let good = p.sets[rep].as_ref().expect("representative is known");
                for r in 0..n {
                    let Some(set) = &p.sets[r] else { continue };
                    let now = if set == good { Status::Valid } else { Status::Failed };
                    if p.status[r] != now {
                        p.status[r] = now;
                        if now == Status::Failed {
                            let objects = Delta::differing(set, good);
                            let values = objects.iter().take(4).map(|&o| compared(o, set, good)).collect();
                            out.push(Outcome::Failed {
                                replica: r as u64 + 1,
                                req: id,
                                objects,
                                values,
                            });
                        }
                    }
                }
            }
            _ => {
                for r in 0..n {
                    let Some(set) = &p.sets[r] else { continue };
                    if p.status[r] == Status::Unknown && p.sets.iter().flatten().any(|o| o != set) {
                        p.status[r] = Status::Suspect;
                    }
                }
                if known == n {
                    out.push(Outcome::NoMajority { req: id });
                }
            }
        }
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
                    to,
                    reply: p.reply.take().expect("checked above"),
                });
            } else if let (Status::Failed, Some(to)) = (p.status[me], p.to) {
                p.released = true;
                self.held.insert(id, (to, Instant::now()));
            }
        }
        // The owed reply also covers the case where the origin failed before we applied.
        if p.status.iter().all(|s| matches!(s, Status::Valid | Status::Failed)) && (p.released || p.to.is_none()) {
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

    /// Forget requests older than the window. Returns held replies that never got their
    /// correct version (their connections must be closed) and the number of requests that
    /// were dropped unsettled.
    pub fn expire(&mut self, now: Instant) -> (Vec<ReplyTo>, usize) {
        let old: Vec<ReqId> = self
            .pending
            .iter()
            .filter(|(_, p)| now.duration_since(p.created) > WINDOW)
            .map(|(k, _)| *k)
            .collect();
        let mut dropped = Vec::new();
        for id in &old {
            let p = self.pending.remove(id).unwrap();
            if let (false, Some(to)) = (p.released, p.to) {
                dropped.push(to);
            }
        }
        let late: Vec<ReqId> = self
            .held
            .iter()
            .filter(|(_, h)| now.duration_since(h.1) > WINDOW)
            .map(|(k, _)| *k)
            .collect();
        for id in late {
            dropped.push(self.held.remove(&id).unwrap().0);
        }
        (dropped, old.len())
    }

    pub fn pending(&self) -> usize {
        self.pending.len()
    }
}

/// "id: a / b" for one object of two deltas ("-" where a delta did not touch it).
fn compared(id: ObjectId, a: &[Pair], b: &[Pair]) -> String {
    let crc = |set: &[Pair]| match set.binary_search_by_key(&id, |p| p.0) {
        Ok(i) => format!("{:08x}", set[i].1),
        Err(_) => "-".to_string(),
    };
    format!("{id}: {} / {}", crc(a), crc(b))
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn three_different_deltas_have_no_majority() {
        let mut v = Validator::new(3, 1);
        v.local(R, set(1), vec![], 1, Some(TO));
        v.remote(2, R, set(2));
        assert_eq!(v.remote(3, R, set(3)), vec![Outcome::NoMajority { req: R }]);
    }
}

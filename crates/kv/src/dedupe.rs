//! Requests already applied, by the tag their proposer gave them. A request may be
//! proposed twice: the first proposal went to a leader that died before it appended it,
//! or it was only slow. The tag makes the second one a no-op, so that an `incr` or an
//! `append` never runs twice. The table is derived from the log, so every replica holds the
//! same one; it travels in snapshots.
//!
//! A connection numbers its requests 0, 1, 2, … and has at most `PIPELINE_MAX` of them
//! unanswered, so a request proposed again is never further than that below the highest
//! one applied from its connection. The table keeps, per connection, that highest number
//! and a bit per number in the `SEQ_WINDOW` below it: a few words per connection
//! instead of one hashed entry per request.

use crate::net::client::PIPELINE_MAX;
use fxhash::FxHashMap;
use lockstep_guard::{Packer, UnpackError, Unpacker};

/// (proposing replica, its incarnation, connection, request number on that connection).
pub type Tag = (u64, u64, u64, u64);

/// (proposing replica, its incarnation, connection).
type Conn = (u64, u64, u64);

/// Request numbers remembered below a connection's highest.
const SEQ_WINDOW: u64 = 512;
const WORDS: usize = (SEQ_WINDOW / 64) as usize;
const _: () = assert!(
    SEQ_WINDOW as usize >= 2 * PIPELINE_MAX,
    "a retry must fall inside the window"
);

/// A connection is forgotten once this many requests were applied since its last one (a
/// retry comes within seconds of the first proposal, so this is ample). It also bounds
/// the table: at most this many connections, about 100 bytes each.
pub const FORGET_AFTER: u64 = 1 << 18;
/// How often (in applied requests) connections are looked at for forgetting.
const SWEEP_EVERY: u64 = 1 << 14;

#[derive(Clone, Debug, PartialEq, Eq)]
struct Window {
    /// One above the highest request number applied.
    top: u64,
    /// Bit `i` of word `i / 64`: request `top - 1 - i` was applied.
    bits: [u64; WORDS],
    /// The table's count of applied requests when this connection last applied one.
    last: u64,
}

impl Window {
    fn mark(&mut self, back: u64) {
        self.bits[(back / 64) as usize] |= 1 << (back % 64);
    }

    fn marked(&self, back: u64) -> bool {
        self.bits[(back / 64) as usize] & (1 << (back % 64)) != 0
    }

    /// Move the top up by `by`: every remembered number moves `by` bits further back.
    fn advance(&mut self, by: u64) {
        if by >= SEQ_WINDOW {
            self.bits = [0; WORDS];
        } else {
            let (words, bits) = ((by / 64) as usize, by % 64);
            for i in (0..WORDS).rev() {
                let lo = i.checked_sub(words).map_or(0, |j| self.bits[j]);
                let carry = match (bits, i.checked_sub(words + 1)) {
                    (0, _) | (_, None) => 0,
                    (b, Some(j)) => self.bits[j] >> (64 - b),
                };
                self.bits[i] = (lo << bits) | carry;
            }
        }
        self.top += by;
    }
}

#[derive(Default)]
pub struct Applied {
    /// (Keys are ours, from the log, never a client's: no need for a keyed hash.)
    conns: FxHashMap<Conn, Window>,
    /// Requests applied so far (the clock for forgetting connections).
    count: u64,
}

impl Applied {
    /// Record `tag`; false if it was applied before.
    pub fn first_time(&mut self, tag: Tag) -> bool {
        let (origin, incarnation, conn, seq) = tag;
        let count = self.count + 1;
        let w = self.conns.entry((origin, incarnation, conn)).or_insert(Window {
            top: 0,
            bits: [0; WORDS],
            last: count,
        });
        if seq >= w.top {
            w.advance(seq + 1 - w.top);
        } else {
            let back = w.top - 1 - seq;
            // Below the window: older than any retry can be (see the module note).
            if back >= SEQ_WINDOW || w.marked(back) {
                return false;
            }
        }
        w.mark(w.top - 1 - seq);
        w.last = count;
        self.count = count;
        if count.is_multiple_of(SWEEP_EVERY) {
            self.conns.retain(|_, w| count - w.last <= FORGET_AFTER);
        }
        true
    }

    /// In a fixed order (by connection), so that equal tables encode equally.
    pub fn encode(&self, p: &mut Packer) {
        p.u64(self.count);
        let mut conns: Vec<_> = self.conns.iter().collect();
        conns.sort_unstable_by_key(|(k, _)| **k);
        p.u64(conns.len() as u64);
        for (&(origin, incarnation, conn), w) in conns {
            for v in [origin, incarnation, conn, w.top, w.last] {
                p.u64(v);
            }
            for b in w.bits {
                p.u64(b);
            }
        }
    }

    pub fn decode(u: &mut Unpacker<'_>) -> Result<Self, UnpackError> {
        let count = u.u64()?;
        let n = u.u64()? as usize;
        const ENCODED: usize = 8 * (5 + WORDS);
        if n > u.rest().len() / ENCODED {
            return Err(UnpackError("applied-request table too long"));
        }
        let mut t = Applied {
            conns: FxHashMap::default(),
            count,
        };
        for _ in 0..n {
            let key = (u.u64()?, u.u64()?, u.u64()?);
            let (top, last) = (u.u64()?, u.u64()?);
            let mut bits = [0; WORDS];
            for b in &mut bits {
                *b = u.u64()?;
            }
            if last > count {
                return Err(UnpackError("applied-request table from the future"));
            }
            t.conns.insert(key, Window { top, bits, last });
        }
        Ok(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tag_counts_once_and_survives_encoding() {
        let mut a = Applied::default();
        assert!(a.first_time((1, 2, 3, 4)));
        assert!(!a.first_time((1, 2, 3, 4)));
        assert!(a.first_time((1, 2, 3, 5)));
        let mut p = Packer::default();
        a.encode(&mut p);
        let mut b = Applied::decode(&mut Unpacker::new(&p.buf)).unwrap();
        assert!(!b.first_time((1, 2, 3, 5)));
        assert!(Applied::decode(&mut Unpacker::new(&p.buf[..9])).is_err());
    }

    /// Against a plain set: requests of a few connections, applied out of order within
    /// the pipeline bound, with retries, give the same answers.
    #[test]
    fn the_window_answers_as_a_set_of_every_tag_would() {
        let mut a = Applied::default();
        let mut set = std::collections::HashSet::new();
        let mut rng = lockstep_core::rng::Rng::new(0x9e37_79b9_7f4a_7c15);
        let mut next = [0u64; 3];
        for _ in 0..200_000 {
            let x = rng.next_u64();
            let conn = (x % 3) as usize;
            // A new request, or a retry of one up to PIPELINE_MAX back.
            let seq = if x.is_multiple_of(5) || next[conn] == 0 {
                next[conn] += 1 + (x >> 8) % 3;
                next[conn] - 1
            } else {
                next[conn] - 1 - (x >> 16) % (PIPELINE_MAX as u64).min(next[conn])
            };
            let tag = (1, 1, conn as u64, seq);
            assert_eq!(a.first_time(tag), set.insert(tag), "{tag:?}");
        }
    }

    #[test]
    fn idle_connections_are_forgotten() {
        let mut a = Applied::default();
        a.first_time((9, 9, 9, 0));
        for seq in 0..FORGET_AFTER + SWEEP_EVERY {
            a.first_time((1, 1, 1, seq));
        }
        assert_eq!(a.conns.len(), 1);
    }
}

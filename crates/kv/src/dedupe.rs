//! Requests already applied, by the tag their proposer gave them. A request may be
//! proposed twice: the first proposal went to a leader that died before it appended it,
//! or it was only slow. The tag makes the second one a no-op, so that an `incr` or an
//! `append` never runs twice. The table is derived from the log, so every replica holds the
//! same one; it travels in snapshots.

use fxhash::FxHashSet;
use lockstep_guard::{Packer, UnpackError, Unpacker};
use std::collections::VecDeque;

/// (proposing replica, its incarnation, connection, request number on that connection).
pub type Tag = (u64, u64, u64, u64);

/// How many tags are remembered. A retry comes within seconds of the first proposal, so a
/// window of this many requests is ample.
pub const WINDOW: usize = 1 << 18;

#[derive(Default)]
pub struct Applied {
    /// (Tags are ours, from the log, never a client's: no need for a keyed hash.)
    seen: FxHashSet<Tag>,
    order: VecDeque<Tag>,
}

impl Applied {
    /// Record `tag`; false if it was applied before.
    pub fn first_time(&mut self, tag: Tag) -> bool {
        if !self.seen.insert(tag) {
            return false;
        }
        self.order.push_back(tag);
        if self.order.len() > WINDOW {
            let old = self.order.pop_front().expect("non-empty");
            self.seen.remove(&old);
        }
        true
    }

    pub fn encode(&self, p: &mut Packer) {
        p.u64(self.order.len() as u64);
        for &(a, b, c, d) in &self.order {
            for v in [a, b, c, d] {
                p.u64(v);
            }
        }
    }

    pub fn decode(u: &mut Unpacker<'_>) -> Result<Self, UnpackError> {
        let n = u.u64()? as usize;
        if n > WINDOW || n > u.rest().len() / 32 {
            return Err(UnpackError("applied-request table too long"));
        }
        let mut t = Applied::default();
        for _ in 0..n {
            let tag = (u.u64()?, u.u64()?, u.u64()?, u.u64()?);
            t.first_time(tag);
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
}

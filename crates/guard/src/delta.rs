//! The state delta of one request: the latest CRC of every protected object it touched,
//! plus the reply's CRC, sorted by object id so that replicas compare them pairwise.

use crate::ObjectId;

/// (object id, crc). The reply is recorded under [`Delta::REPLY`].
pub type Pair = (ObjectId, u32);

/// Recorded instead of a CRC when an access found the object corrupt: a value no healthy
/// replica records for that object except by a 2^-32 chance, so the cross-check marks
/// this replica's pair as the odd one out and names the object for repair.
pub const CORRUPT_MARK: u32 = 0xDEAD_C0DE;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Delta {
    /// Off: accesses are neither checked nor recorded (the unprotected baseline).
    unchecked: bool,
    pairs: Vec<Pair>,
    /// Objects whose check failed during this request (locally known corrupt).
    corrupt: Vec<ObjectId>,
}

impl Delta {
    /// The id under which the reply's CRC is recorded (kind 0xFF is reserved for it).
    pub const REPLY: ObjectId = ObjectId(0xFF << 56);

    pub fn new() -> Self {
        Self::default()
    }

    /// A delta for the unprotected baseline: guards neither check nor checksum, so the
    /// cost of protection can be measured against it. Stored CRCs go stale in this mode.
    pub fn unchecked() -> Self {
        Delta {
            unchecked: true,
            ..Self::default()
        }
    }

    pub fn checking(&self) -> bool {
        !self.unchecked
    }

    /// Clear for the next request, keeping the allocation.
    pub fn clear(&mut self) {
        self.pairs.clear();
        self.corrupt.clear();
    }

    /// Record the latest CRC of `id`: a later access of the same object replaces it.
    pub fn record(&mut self, id: ObjectId, crc: u32) {
        // Requests touch a handful of objects: a linear scan beats a map here.
        match self.pairs.iter_mut().find(|p| p.0 == id) {
            Some(p) => p.1 = crc,
            None => self.pairs.push((id, crc)),
        }
    }

    /// This request already recorded `crc` for `id` (a check or a write it made), so an
    /// object still carrying that CRC needs no second check within the request.
    pub fn vouches(&self, id: ObjectId, crc: u32) -> bool {
        crc != CORRUPT_MARK && self.pairs.contains(&(id, crc))
    }

    /// An access found `id` corrupt.
    pub fn record_corrupt(&mut self, id: ObjectId) {
        self.record(id, CORRUPT_MARK);
        if !self.corrupt.contains(&id) {
            self.corrupt.push(id);
        }
    }

    pub fn record_reply(&mut self, reply: &[u8]) {
        if self.unchecked {
            return;
        }
        self.record(Self::REPLY, lockstep_core::crc32c(reply));
    }

    /// The sorted pairs, ready to compare or send.
    pub fn finish(&mut self) -> &[Pair] {
        self.pairs.sort_unstable_by_key(|p| p.0);
        &self.pairs
    }

    pub fn pairs(&self) -> &[Pair] {
        &self.pairs
    }

    pub fn corrupt(&self) -> &[ObjectId] {
        &self.corrupt
    }

    /// The objects whose pairs differ between two sorted deltas, including objects that
    /// only one of them touched (a faulty execution may take another path).
    pub fn differing(a: &[Pair], b: &[Pair]) -> Vec<ObjectId> {
        let (mut i, mut j) = (0, 0);
        let mut out = Vec::new();
        while i < a.len() || j < b.len() {
            match (a.get(i), b.get(j)) {
                (Some(x), Some(y)) if x.0 == y.0 => {
                    if x.1 != y.1 {
                        out.push(x.0);
                    }
                    i += 1;
                    j += 1;
                }
                (Some(x), Some(y)) if x.0 < y.0 => {
                    out.push(x.0);
                    i += 1;
                }
                (Some(_), Some(y)) => {
                    out.push(y.0);
                    j += 1;
                }
                (Some(x), None) => {
                    out.push(x.0);
                    i += 1;
                }
                (None, Some(y)) => {
                    out.push(y.0);
                    j += 1;
                }
                (None, None) => unreachable!(),
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latest_crc_wins_and_pairs_sort() {
        let mut d = Delta::new();
        d.record(ObjectId(5), 1);
        d.record(ObjectId(2), 7);
        d.record(ObjectId(5), 9);
        assert_eq!(d.finish(), &[(ObjectId(2), 7), (ObjectId(5), 9)]);
    }

    #[test]
    fn differing_names_changed_and_one_sided_objects() {
        let a = [(ObjectId(1), 1), (ObjectId(2), 2), (ObjectId(4), 4)];
        let b = [(ObjectId(1), 1), (ObjectId(2), 3), (ObjectId(3), 3)];
        assert_eq!(Delta::differing(&a, &b), vec![ObjectId(2), ObjectId(3), ObjectId(4)]);
        assert!(Delta::differing(&a, &a).is_empty());
    }

    #[test]
    fn corrupt_access_is_marked() {
        let mut d = Delta::new();
        d.record(ObjectId(1), 5);
        d.record_corrupt(ObjectId(1));
        assert_eq!(d.pairs(), &[(ObjectId(1), CORRUPT_MARK)]);
        assert_eq!(d.corrupt(), &[ObjectId(1)]);
    }
}

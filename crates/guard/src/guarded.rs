//! `Guarded<T>`: a value and the CRC of its protected fields, checked on every access.

use crate::{Delta, ObjectId, Protected};
use std::ops::{Deref, DerefMut};

/// An access found the object's bytes disagreeing with its CRC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Corrupt(pub ObjectId);

impl std::fmt::Display for Corrupt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "object {} failed its checksum", self.0)
    }
}
impl std::error::Error for Corrupt {}

pub struct Guarded<T: Protected> {
    id: ObjectId,
    crc: u32,
    value: T,
}

impl<T: Protected> Guarded<T> {
    /// A new object; its creation is part of the request's delta.
    pub fn new(id: ObjectId, value: T, delta: &mut Delta) -> Self {
        let crc = value.crc();
        delta.record(id, crc);
        Guarded { id, crc, value }
    }

    /// An object restored from a snapshot or a repair: not part of any request.
    pub fn restore(id: ObjectId, value: T) -> Self {
        let crc = value.crc();
        Guarded { id, crc, value }
    }

    /// An object restored with the CRC it had on the replica that packed it: a value that
    /// was already corrupt there stays detectably corrupt here instead of being laundered
    /// by a fresh CRC.
    pub fn restore_with_crc(id: ObjectId, value: T, crc: u32) -> Self {
        Guarded { id, crc, value }
    }

    pub fn id(&self) -> ObjectId {
        self.id
    }

    /// The CRC stored with the object (what it should be at rest).
    pub fn stored_crc(&self) -> u32 {
        self.crc
    }

    /// Verify and record. Corruption is recorded too, so that the cross-check names it.
    pub fn read(&self, delta: &mut Delta) -> Result<&T, Corrupt> {
        if self.checked_already(delta) {
            return Ok(&self.value);
        }
        self.check(delta)?;
        delta.record(self.id, self.crc);
        Ok(&self.value)
    }

    /// Verify, then hand out a mutable view that recomputes the CRC and records it when
    /// dropped (the paper's check()/update() pair around a method call).
    pub fn write<'a>(&'a mut self, delta: &'a mut Delta) -> Result<GuardMut<'a, T>, Corrupt> {
        if !self.checked_already(delta) {
            self.check(delta)?;
        }
        Ok(GuardMut { obj: self, delta })
    }

    /// No check is due: the baseline checks nothing, and an object this request already
    /// verified or wrote, whose stored CRC is still the one recorded then (and so already
    /// in the delta), is not hashed again. A flip since then is no worse than one during
    /// the access: it reaches the delta through a later write's CRC or through the reply,
    /// where the cross-check sees it, or the next request's first access finds it.
    fn checked_already(&self, delta: &Delta) -> bool {
        !delta.checking() || delta.vouches(self.id, self.crc)
    }

    fn check(&self, delta: &mut Delta) -> Result<(), Corrupt> {
        if self.value.crc() != self.crc {
            delta.record_corrupt(self.id);
            return Err(Corrupt(self.id));
        }
        Ok(())
    }

    /// Whether the value still matches its CRC, without recording anything (scrubbing,
    /// digests, repair).
    pub fn verify(&self) -> Result<(), Corrupt> {
        if self.value.crc() != self.crc {
            return Err(Corrupt(self.id));
        }
        Ok(())
    }

    /// The value without a check: for packing the healthy copy in a repair after
    /// `verify`, and for test-only corruption.
    pub fn peek(&self) -> &T {
        &self.value
    }

    /// The value, unchecked: for an object that is going away (its buffers may serve
    /// another).
    pub fn into_value(self) -> T {
        self.value
    }

    /// Overwrite the value with a repaired copy (the paper's `replace`).
    pub fn replace(&mut self, value: T) {
        self.crc = value.crc();
        self.value = value;
    }

    /// Test-only corruption: change the value behind the CRC's back, as a memory error
    /// in the object at rest would. `recompute` also updates the CRC, as a fault during an
    /// access (after check, before update) would; only the cross-check sees that one.
    pub fn corrupt_with(&mut self, recompute: bool, f: impl FnOnce(&mut T)) {
        f(&mut self.value);
        if recompute {
            self.crc = self.value.crc();
        }
    }
}

pub struct GuardMut<'a, T: Protected> {
    obj: &'a mut Guarded<T>,
    delta: &'a mut Delta,
}

impl<T: Protected> Deref for GuardMut<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.obj.value
    }
}

impl<T: Protected> DerefMut for GuardMut<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.obj.value
    }
}

impl<T: Protected> Drop for GuardMut<'_, T> {
    fn drop(&mut self) {
        if !self.delta.checking() {
            return;
        }
        self.obj.crc = self.obj.value.crc();
        self.delta.record(self.obj.id, self.obj.crc);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{FieldSink, Packer, UnpackError, Unpacker};

    #[derive(Debug, PartialEq)]
    struct Counter(u64);
    impl Protected for Counter {
        fn fields<S: FieldSink>(&self, out: &mut S) {
            out.u64(self.0)
        }
        fn unpack(inp: &mut Unpacker<'_>) -> Result<Self, UnpackError> {
            Ok(Counter(inp.u64()?))
        }
    }

    #[test]
    fn write_recomputes_and_records() {
        let mut d = Delta::new();
        let mut g = Guarded::new(ObjectId::new(1, 3), Counter(1), &mut d);
        d.clear();
        g.write(&mut d).unwrap().0 += 1;
        assert_eq!(d.pairs(), &[(ObjectId::new(1, 3), Counter(2).crc())]);
        assert_eq!(g.read(&mut d).unwrap(), &Counter(2));
    }

    #[test]
    fn flip_at_rest_is_caught_on_next_access() {
        let mut d = Delta::new();
        let mut g = Guarded::new(ObjectId::new(1, 0), Counter(8), &mut d);
        g.corrupt_with(false, |c| c.0 ^= 1 << 7);
        d.clear();
        assert_eq!(g.read(&mut d).unwrap_err(), Corrupt(ObjectId::new(1, 0)));
        assert_eq!(d.corrupt(), &[ObjectId::new(1, 0)]);
        assert!(g.write(&mut d).is_err());
    }

    #[test]
    fn a_request_checks_an_object_once_and_the_next_request_checks_it_again() {
        let mut d = Delta::new();
        let mut g = Guarded::new(ObjectId::new(1, 0), Counter(8), &mut d);
        d.clear();
        g.read(&mut d).unwrap();
        // A flip between two accesses of one request: the second one trusts the first
        // check (the flip is one during access, left to the cross-check)...
        g.corrupt_with(false, |c| c.0 ^= 1);
        assert!(g.read(&mut d).is_ok());
        // ...and the next request finds it.
        d.clear();
        assert!(g.read(&mut d).is_err());
        // A write vouches for what it wrote.
        let mut d = Delta::new();
        let mut g = Guarded::new(ObjectId::new(1, 0), Counter(8), &mut d);
        g.write(&mut d).unwrap().0 += 1;
        g.corrupt_with(false, |c| c.0 ^= 1);
        d.clear();
        assert!(g.write(&mut d).is_err());
    }

    #[test]
    fn flip_during_access_passes_the_check_but_changes_the_delta() {
        let mut d1 = Delta::new();
        let mut d2 = Delta::new();
        let a = Guarded::new(ObjectId::new(1, 0), Counter(8), &mut d1);
        let mut b = Guarded::new(ObjectId::new(1, 0), Counter(8), &mut d2);
        b.corrupt_with(true, |c| c.0 ^= 1);
        d1.clear();
        d2.clear();
        a.read(&mut d1).unwrap();
        b.read(&mut d2).unwrap();
        assert_eq!(Delta::differing(d1.finish(), d2.finish()), vec![ObjectId::new(1, 0)]);
    }

    #[test]
    fn pack_replace_round_trip() {
        let mut d = Delta::new();
        let good = Guarded::new(ObjectId::new(2, 0), Counter(42), &mut d);
        let mut bad = Guarded::new(ObjectId::new(2, 0), Counter(42), &mut d);
        bad.corrupt_with(false, |c| c.0 = 0);
        let mut p = Packer::default();
        good.peek().pack(&mut p);
        bad.replace(Counter::unpack(&mut Unpacker::new(&p.buf)).unwrap());
        assert!(bad.verify().is_ok());
        assert_eq!(bad.stored_crc(), good.stored_crc());
        assert!(Counter::unpack(&mut Unpacker::new(&p.buf[..3])).is_err());
    }
}

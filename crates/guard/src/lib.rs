//! Protected state for replicated services: checksummed objects whose accesses are
//! recorded into the current request's *state delta* (CrossCheck §IV-A, §V-B).
//!
//! - [`Guarded<T>`] holds a value and the CRC32C of its canonical bytes. Every access
//!   verifies the CRC first (the paper's `check()`); a mutable access recomputes it when
//!   the guard drops (`update()`), so the CRC always describes the value at rest.
//! - Each access records `(object id, crc)` into a [`Delta`]. Replicas that executed the
//!   same request on the same state produce identical deltas; comparing them is the
//!   cross-check.
//! - [`ObjectId`]s are derived from the object's kind and a deterministic index, so they
//!   are equal on every replica.
//! - [`Protected::pack`] / [`Protected::unpack`] serialise an object's protected parts for
//!   repair at object granularity.
//!
//! The fault model: a flip in a value at rest is caught by the next access's check; a flip
//! during an access (after check, before update) yields a CRC that differs from the other
//! replicas' and is caught by the cross-check. Neither needs more than the CRC per object.

mod delta;
mod guarded;
mod pack;

pub use delta::{Delta, Pair, CORRUPT_MARK};
pub use guarded::{Corrupt, GuardMut, Guarded};
pub use pack::{FieldSink, Hasher, Packer, Protected, UnpackError, Unpacker};

/// Identifies a protected object identically on every replica: the kind in the top byte,
/// a deterministic index (slot, bucket number) below it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjectId(pub u64);

impl ObjectId {
    /// Largest index an id can carry (56 bits).
    pub const MAX_INDEX: u64 = (1 << 56) - 1;

    pub fn new(kind: u8, index: u64) -> Self {
        assert!(index <= Self::MAX_INDEX, "object index {index} exceeds 56 bits");
        ObjectId(((kind as u64) << 56) | index)
    }
    pub fn kind(self) -> u8 {
        (self.0 >> 56) as u8
    }
    pub fn index(self) -> u64 {
        self.0 & Self::MAX_INDEX
    }
}

impl std::fmt::Display for ObjectId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.kind(), self.index())
    }
}

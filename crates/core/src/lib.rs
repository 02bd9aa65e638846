//! Contracts shared by every lockstep component.
//!
//! Nothing in here knows about processes, ptrace or sockets: it is the vocabulary
//! (checksums, signatures, votes, events, exit statuses, the CRC-checked frame and
//! the little-endian reader) that the components agree on.

pub mod alloc_count;
pub mod checksum;
pub mod events;
pub mod exit;
pub mod frame;
pub mod le;
pub mod rng;
pub mod signature;
pub mod vote;

pub use checksum::crc32c;
pub use events::{Event, EventSink};
pub use signature::Signature;
pub use vote::{vote, Verdict};

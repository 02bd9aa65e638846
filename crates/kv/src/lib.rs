//! `lockstep kv`: a replicated memcached-protocol store that cross-checks state deltas.

pub mod binary;
pub mod buffers;
pub mod check;
pub mod command;
pub mod dedupe;
pub mod fuzzing;
pub mod net;
pub mod objects;
pub mod protocol;
pub mod replica;
pub mod storage;
pub mod store;

/// The most replicas a cluster has (`--peers`, `cluster -n`): the validator keeps each
/// entry's digests in a fixed array of this size instead of allocating one per entry.
pub const MAX_REPLICAS: usize = 9;

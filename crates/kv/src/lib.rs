//! `lockstep kv`: a replicated memcached-protocol store that cross-checks state deltas.

pub mod binary;
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

//! `lockstep kv`: a replicated memcached-protocol store that cross-checks state deltas.

pub mod check;
pub mod command;
pub mod conn;
pub mod dedupe;
pub mod fuzzing;
pub mod objects;
pub mod peer;
pub mod protocol;
pub mod replica;
pub mod storage;
pub mod store;

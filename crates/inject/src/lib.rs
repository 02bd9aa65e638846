//! `lockstep inject`: fault-injection campaigns on real processes.
//!
//! * [`fault`]: fault models and applying one fault to a stopped thread (the engine).
//! * [`step`]: the dest and addr models, applied by single-stepping (iced-x86 decodes).
//! * [`target`]: running one process natively or up to an injection point.
//! * [`server`]: server mode (start, wait for the port, run the client, stop).
//! * [`tree`]: the traced process tree at time-based points (victim choice).
//! * [`classify`]: outcome classes against the golden runs.
//! * [`campaign`]: golden runs, parallel workers, resumable results.
//! * [`shard`]: `--shard K/N` slices of a campaign, their identity, and merging them.
//! * [`stats`]: Wilson intervals, zero-event bounds, Leveugle sample sizes.
//! * [`report`]: summary.json, summary.md and the SVG chart.

pub mod campaign;
pub mod classify;
pub mod fault;
pub mod fork_server;
pub mod hang;
pub mod report;
pub mod server;
pub mod shard;
pub mod stats;
pub mod step;
pub mod target;
pub mod tree;

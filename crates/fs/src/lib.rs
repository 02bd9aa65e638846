//! `lockstep fs`: a FUSE filesystem with a checksummed page cache (Loris).

pub mod cache;
pub mod crc;
pub mod fuse;
pub mod longpath;
pub mod mount;
pub mod naming;
pub mod recovery;
pub mod shared;
pub mod store;

//! Recovery of a crashed cache daemon (Loris §V-D), run by its successor before it serves
//! anything: every Dirty State Store record and every dirty page it names must pass its
//! CRC, or nothing is written and the daemon refuses (the caller exits with 86). When all
//! pass, the dirty pages are written back with the CRCs the DSS holds, and made durable.
//! The new daemon then starts with an empty cache.

use crate::naming::open_by_handle;
use crate::shared::Shared;
use crate::store::Store;
use lockstep_core::checksum::crc32c;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd};

/// Returns the number of dirty pages written back, or why recovery is refused.
pub fn recover(store: &mut Store, shared: &mut Shared) -> Result<usize, String> {
    let records = shared
        .dirty_records()
        .map_err(|slot| format!("the Dirty State Store record in slot {slot} fails its checksum"))?;
    // Verify everything before writing anything.
    for r in &records {
        if crc32c(&shared.page(r.slot)[..r.len]) != r.crc {
            return Err(format!(
                "the dirty page of inode {} block {} fails its checksum",
                r.ino, r.block
            ));
        }
    }
    let root = File::open(store.data_root()).map_err(|e| format!("cannot open the store: {e}"))?;
    let mut files: std::collections::HashMap<u64, File> = std::collections::HashMap::new();
    for r in &records {
        if let std::collections::hash_map::Entry::Vacant(v) = files.entry(r.ino) {
            let (_, htype, handle) = shared
                .handle(r.ino)
                .ok_or_else(|| format!("no file handle for inode {} with dirty pages", r.ino))?;
            let fd = open_by_handle(root.as_raw_fd(), htype, &handle, libc::O_RDWR | libc::O_CLOEXEC)
                .map_err(|e| format!("cannot reopen inode {}: errno {e}", r.ino))?;
            // SAFETY: the fd is ours; File takes ownership.
            v.insert(unsafe { File::from_raw_fd(fd.into_raw_fd()) });
        }
        let page = shared.page(r.slot)[..r.len].to_vec();
        store
            .write_block(r.ino, &files[&r.ino], r.block, &page, r.crc)
            .map_err(|e| format!("cannot write back inode {} block {}: {e}", r.ino, r.block))?;
    }
    for (ino, f) in &files {
        f.sync_data().map_err(|e| format!("fsync of inode {ino}: {e}"))?;
        store
            .sync(*ino)
            .map_err(|e| format!("fsync of the tables of inode {ino}: {e}"))?;
    }
    for r in &records {
        shared.clear(r.slot);
    }
    Ok(records.len())
}

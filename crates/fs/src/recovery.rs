//! Recovery of a crashed cache daemon (Loris §V-D), run by its successor before it serves
//! anything: every Dirty State Store record and every dirty page it names must pass its
//! CRC, or nothing is written and the daemon refuses (the caller exits with 86). When all
//! pass, the dirty pages are written back with the CRCs the DSS holds, and made durable.
//! The new daemon then starts with an empty cache.

use crate::naming::{open_by_handle, Handle};
use crate::shared::Shared;
use crate::store::{Place, Store};
use lockstep_core::checksum::crc32c;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd};

/// Returns the number of dirty pages written back, or why recovery is refused.
pub fn recover(store: &Store, shared: &mut Shared) -> Result<usize, String> {
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
    let root = File::open(store.root()).map_err(|e| format!("cannot open the store: {e}"))?;
    let mut files = std::collections::HashMap::new();
    for r in &records {
        if let std::collections::hash_map::Entry::Vacant(v) = files.entry(r.ino) {
            let (_, htype, bytes) = shared
                .handle(r.ino)
                .ok_or_else(|| format!("no file handle for inode {} with dirty pages", r.ino))?;
            let handle = Handle::new(htype, &bytes).ok_or_else(|| format!("bad handle for inode {}", r.ino))?;
            let fd = open_by_handle(root.as_raw_fd(), &handle, libc::O_RDWR | libc::O_CLOEXEC)
                .map_err(|e| format!("cannot reopen inode {}: errno {e}", r.ino))?;
            // SAFETY: the fd is ours; File takes ownership.
            let data = unsafe { File::from_raw_fd(fd.into_raw_fd()) };
            let tables = match path_of(store.root(), data.as_raw_fd()) {
                Some(rel) => store.tables(Place::Path(&rel)),
                None => store.tables(Place::Orphan(r.ino)),
            }
            .map_err(|e| format!("cannot open the tables of inode {}: {e}", r.ino))?;
            v.insert((data, tables));
        }
        let page = shared.page(r.slot)[..r.len].to_vec();
        let (data, tables) = &files[&r.ino];
        store
            .write_block(tables, data, r.block, &page, r.crc)
            .map_err(|e| format!("cannot write back inode {} block {}: {e}", r.ino, r.block))?;
    }
    for (ino, (data, tables)) in &files {
        data.sync_data().map_err(|e| format!("fsync of inode {ino}: {e}"))?;
        store
            .sync(tables)
            .map_err(|e| format!("fsync of the tables of inode {ino}: {e}"))?;
    }
    for r in &records {
        shared.clear(r.slot);
    }
    Ok(records.len())
}

/// The path of an open file relative to the store root: what the kernel says, checked
/// against the file itself, else a search of the tree. None for a file with no name left.
pub(crate) fn path_of(root: &std::path::Path, fd: std::os::fd::RawFd) -> Option<std::path::PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(format!("/proc/self/fd/{fd}")).ok()?;
    if m.nlink() == 0 {
        return None;
    }
    let same = |rel: &std::path::Path| {
        std::fs::symlink_metadata(root.join(rel)).is_ok_and(|x| x.ino() == m.ino() && x.dev() == m.dev())
    };
    if let Ok(link) = std::fs::read_link(format!("/proc/self/fd/{fd}")) {
        if let Ok(rel) = link.strip_prefix(root) {
            if same(rel) {
                return Some(rel.to_path_buf());
            }
        }
    }
    let mut hit = None;
    let _ = crate::store::offline::walk(root, &mut |rel, x| {
        if hit.is_none() && x.ino() == m.ino() && x.dev() == m.dev() {
            hit = Some(rel.to_path_buf());
        }
    });
    hit
}

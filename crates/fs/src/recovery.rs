//! Recovery of a crashed cache daemon (Loris §V-D), run by its successor before it serves
//! anything: every Dirty State Store record and every dirty page it names must pass its
//! CRC, or nothing is written and the daemon refuses (the caller exits with 86). When all
//! pass, pending truncations are applied and the dirty pages written back with the CRCs
//! the DSS holds, and made durable.
//! The new daemon then starts with an empty cache.

use crate::naming::{open_by_handle, Handle};
use crate::shared::Shared;
use crate::store::{Place, Store, Tables};
use lockstep_core::checksum::crc32c;
use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd};

/// What recovery carried to the store.
#[derive(Debug, Default)]
pub struct Recovered {
    pub pages: usize,
    pub truncations: usize,
    /// Files that had pending changes but are gone (unlinked and closed before the crash).
    pub gone: usize,
}

/// Carries the DSS to the store, or says why recovery is refused.
pub fn recover(store: &Store, shared: &mut Shared) -> Result<Recovered, String> {
    let records = shared
        .dirty_records()
        .map_err(|slot| format!("the Dirty State Store record in slot {slot} fails its checksum"))?;
    let sizes = shared
        .size_records()
        .map_err(|i| format!("the Dirty State Store size record {i} fails its checksum"))?;
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
    let mut files = HashMap::new();
    let mut gone = HashSet::new();
    for ino in sizes.iter().map(|s| s.ino).chain(records.iter().map(|r| r.ino)) {
        if files.contains_key(&ino) || gone.contains(&ino) {
            continue;
        }
        match reopen(store, &root, shared, ino)? {
            Some(f) => {
                files.insert(ino, f);
            }
            None => {
                gone.insert(ino);
            }
        }
    }
    let mut done = Recovered {
        gone: gone.len(),
        ..Recovered::default()
    };
    // Truncations first: the dirty pages were written after them.
    for s in &sizes {
        let Some((data, tables)) = files.get(&s.ino) else {
            continue;
        };
        if let Some(c) = s.cut {
            store
                .truncate(tables, data, c)
                .map_err(|e| format!("cannot truncate inode {}: {e}", s.ino))?;
        }
        store
            .truncate(tables, data, s.size)
            .map_err(|e| format!("cannot resize inode {}: {e}", s.ino))?;
        done.truncations += 1;
    }
    for r in &records {
        let Some((data, tables)) = files.get_mut(&r.ino) else {
            continue;
        };
        let page = shared.page(r.slot)[..r.len].to_vec();
        store
            .write_block(tables, data, r.block, &page, r.crc)
            .map_err(|e| format!("cannot write back inode {} block {}: {e}", r.ino, r.block))?;
        done.pages += 1;
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
    for s in &sizes {
        shared.clear_size(s.ino);
    }
    Ok(done)
}

/// The data file and tables of `ino`, reopened by its handle; None if the file no longer
/// exists (its last name was removed and nothing holds it).
fn reopen(store: &Store, root: &File, shared: &mut Shared, ino: u64) -> Result<Option<(File, Tables)>, String> {
    let (_, htype, bytes) = shared
        .handle(ino)
        .ok_or_else(|| format!("no file handle for inode {ino} with pending changes"))?;
    let handle = Handle::new(htype, &bytes).ok_or_else(|| format!("bad handle for inode {ino}"))?;
    let fd = match open_by_handle(root.as_raw_fd(), &handle, libc::O_RDWR | libc::O_CLOEXEC) {
        Ok(fd) => fd,
        Err(libc::ESTALE) | Err(libc::ENOENT) => return Ok(None),
        Err(e) => return Err(format!("cannot reopen inode {ino}: errno {e}")),
    };
    // SAFETY: the fd is ours; File takes ownership.
    let data = unsafe { File::from_raw_fd(fd.into_raw_fd()) };
    let tables = match path_of(store.root(), data.as_raw_fd()) {
        Some(rel) => store.tables(Place::Path(&rel)),
        None => store.tables(Place::Orphan(ino)),
    }
    .map_err(|e| format!("cannot open the tables of inode {ino}: {e}"))?;
    Ok(Some((data, tables)))
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
    // A walk that stops early leaves hit as found so far: the caller treats None as not found.
    let _ = crate::store::offline::walk(root, &mut |rel, x| {
        if hit.is_none() && x.ino() == m.ino() && x.dev() == m.dev() {
            hit = Some(rel.to_path_buf());
        }
    });
    hit
}

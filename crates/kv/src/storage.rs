//! Raft's log, hard state and snapshot: in memory for reads, and (with a data directory)
//! on disk so that a replica killed with -9 restarts with everything it acknowledged.
//!
//! Files in the data directory, each record `[u32 len][u32 crc32c][payload]`:
//! - `state`: the HardState and ConfState, rewritten atomically (tmp + rename).
//! - `log`: appended entries; an entry with an index at or below the last one truncates
//!   the tail first, as Raft's append does.
//! - `snapshot`: the latest snapshot (metadata and the store's packed objects).
//!
//! A record with a bad CRC at the end of `log` is a torn write from a crash and is cut off;
//! anywhere else, or in `state`/`snapshot`, it is corruption and the replica refuses to
//! start (exit 86).

use lockstep_core::frame;
use prost::Message as _;
use raft::eraftpb::{ConfState, Entry, HardState, Snapshot, SnapshotMetadata};
use raft::{GetEntriesContext, RaftState, StorageError};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

#[derive(Default)]
struct Core {
    hard: HardState,
    conf: ConfState,
    /// The latest snapshot: its metadata gives the index the log starts after.
    snap: Snapshot,
    /// Entries after `snap`'s index, contiguous.
    entries: Vec<Entry>,
    disk: Option<Disk>,
    /// A peer needs a snapshot newer than `snap`: the replica should make one.
    snapshot_wanted: bool,
}

struct Disk {
    dir: PathBuf,
    log: File,
    fsync: bool,
}

#[derive(Clone, Default)]
pub struct LogStore {
    core: Arc<Mutex<Core>>,
}

fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

fn record(payload: &[u8]) -> Vec<u8> {
    let mut r = Vec::new();
    frame::append(&mut r, payload);
    r
}

/// Split a file into records; returns the records and whether a torn tail was cut off
/// (a short or damaged record ends the valid prefix).
fn records(data: &[u8]) -> (Vec<&[u8]>, bool) {
    let mut out = Vec::new();
    let mut at = 0;
    while at < data.len() {
        match frame::decode(&data[at..], usize::MAX) {
            Ok(frame::Decoded::Frame { payload, len }) => {
                out.push(payload);
                at += len;
            }
            Ok(frame::Decoded::Incomplete) | Err(_) => return (out, true),
        }
    }
    (out, false)
}

fn write_atomic(path: &Path, payload: &[u8], fsync: bool) -> io::Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f = File::create(&tmp)?;
    f.write_all(&record(payload))?;
    if fsync {
        f.sync_data()?;
    }
    fs::rename(&tmp, path)?;
    if fsync {
        File::open(path.parent().unwrap_or(Path::new(".")))?.sync_all()?;
    }
    Ok(())
}

fn read_single(path: &Path) -> io::Result<Option<Vec<u8>>> {
    let mut data = Vec::new();
    match File::open(path) {
        Ok(mut f) => f.read_to_end(&mut data)?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let (recs, torn) = records(&data);
    if torn || recs.len() != 1 {
        return Err(bad(format!("{} is corrupt (checksum or length)", path.display())));
    }
    Ok(Some(recs[0].to_vec()))
}

impl LogStore {
    /// A fresh in-memory store for a cluster whose voters are `voters`.
    pub fn new(voters: Vec<u64>) -> Self {
        let s = LogStore::default();
        s.lock().conf = ConfState {
            voters,
            ..Default::default()
        };
        s
    }

    /// Open (or create) the on-disk state in `dir`. A new directory starts the cluster
    /// with `voters`; an existing one restores what was persisted.
    pub fn open(dir: &Path, voters: Vec<u64>, fsync: bool) -> io::Result<Self> {
        fs::create_dir_all(dir)?;
        let store = LogStore::new(voters);
        {
            let mut c = store.lock();
            if let Some(b) = read_single(&dir.join("snapshot"))? {
                c.snap = Snapshot::decode(&b[..]).map_err(|e| bad(format!("snapshot: {e}")))?;
                c.conf = c.snap.get_metadata().get_conf_state().clone();
            }
            if let Some(b) = read_single(&dir.join("state"))? {
                let mut u = lockstep_guard::Unpacker::new(&b);
                let hs = u.bytes().map_err(|e| bad(format!("state: {e}")))?;
                let cs = u.bytes().map_err(|e| bad(format!("state: {e}")))?;
                c.hard = HardState::decode(hs).map_err(|e| bad(format!("state: {e}")))?;
                c.conf = ConfState::decode(cs).map_err(|e| bad(format!("state: {e}")))?;
            }
            let log_path = dir.join("log");
            let mut data = Vec::new();
            if let Ok(mut f) = File::open(&log_path) {
                f.read_to_end(&mut data)?;
            }
            let (recs, torn) = records(&data);
            let snap_index = c.snap.get_metadata().index;
            for r in &recs {
                let e = Entry::decode(*r).map_err(|e| bad(format!("log entry: {e}")))?;
                if e.index <= snap_index {
                    continue;
                }
                let first = snap_index + 1;
                let keep = (e.index - first) as usize;
                if keep > c.entries.len() {
                    return Err(bad(format!("log has a gap before entry {}", e.index)));
                }
                c.entries.truncate(keep);
                c.entries.push(e);
            }
            // Rewrite the log when a torn tail was cut, so appends continue on clean records.
            if torn {
                let mut clean = Vec::new();
                for e in &c.entries {
                    clean.extend_from_slice(&record(&e.encode_to_vec()));
                }
                fs::write(log_path.with_extension("tmp"), &clean)?;
                fs::rename(log_path.with_extension("tmp"), &log_path)?;
            }
            let log = OpenOptions::new().create(true).append(true).open(&log_path)?;
            c.disk = Some(Disk {
                dir: dir.to_path_buf(),
                log,
                fsync,
            });
        }
        Ok(store)
    }

    fn lock(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether this store already holds state from an earlier run.
    pub fn is_restored(&self) -> bool {
        let c = self.lock();
        c.hard.term > 0 || !c.entries.is_empty() || c.snap.get_metadata().index > 0
    }

    /// The latest snapshot's data and index (for the replica to restore its store).
    pub fn snapshot_data(&self) -> (u64, Vec<u8>) {
        let c = self.lock();
        (c.snap.get_metadata().index, c.snap.data.to_vec())
    }

    pub fn append(&self, ents: &[Entry]) -> io::Result<()> {
        if ents.is_empty() {
            return Ok(());
        }
        let mut c = self.lock();
        let first = c.snap.get_metadata().index + 1;
        assert!(ents[0].index >= first, "append below the snapshot");
        let keep = (ents[0].index - first) as usize;
        assert!(keep <= c.entries.len(), "append leaves a gap");
        c.entries.truncate(keep);
        c.entries.extend_from_slice(ents);
        if let Some(d) = c.disk.as_mut() {
            let mut buf = Vec::new();
            for e in ents {
                buf.extend_from_slice(&record(&e.encode_to_vec()));
            }
            d.log.write_all(&buf)?;
            if d.fsync {
                d.log.sync_data()?;
            }
        }
        Ok(())
    }

    pub fn set_hard_state(&self, hs: &HardState) -> io::Result<()> {
        let mut c = self.lock();
        c.hard = hs.clone();
        Self::persist_state(&c)
    }

    pub fn set_commit(&self, commit: u64) -> io::Result<()> {
        let mut c = self.lock();
        c.hard.commit = commit;
        Self::persist_state(&c)
    }

    pub fn set_conf_state(&self, cs: ConfState) -> io::Result<()> {
        let mut c = self.lock();
        c.conf = cs;
        Self::persist_state(&c)
    }

    fn persist_state(c: &Core) -> io::Result<()> {
        let Some(d) = c.disk.as_ref() else { return Ok(()) };
        let mut p = lockstep_guard::Packer::default();
        p.bytes(&c.hard.encode_to_vec());
        p.bytes(&c.conf.encode_to_vec());
        write_atomic(&d.dir.join("state"), &p.buf, d.fsync)
    }

    /// Install a snapshot received from the leader.
    pub fn apply_snapshot(&self, snap: Snapshot) -> io::Result<()> {
        let mut c = self.lock();
        let meta = snap.get_metadata().clone();
        c.hard.term = c.hard.term.max(meta.term);
        c.hard.commit = c.hard.commit.max(meta.index);
        c.conf = meta.get_conf_state().clone();
        c.entries.retain(|e| e.index > meta.index);
        // Entries after the snapshot are only kept if they continue it.
        if c.entries.first().is_some_and(|e| e.index != meta.index + 1) {
            c.entries.clear();
        }
        c.snap = snap;
        Self::persist_snapshot(&mut c)?;
        Self::persist_state(&c)
    }

    /// The configuration now.
    pub fn conf_state(&self) -> ConfState {
        self.lock().conf.clone()
    }

    /// Make a snapshot of the store at `index` (already applied) and drop the log before it.
    /// Install `data` as the snapshot at `index` and drop the log up to it. Returns the
    /// buffer no longer needed (the replaced snapshot's, or `data` when nothing was
    /// replaced), for the next snapshot to be written into.
    pub fn compact(&self, index: u64, data: Vec<u8>) -> io::Result<Vec<u8>> {
        let conf = self.conf_state();
        self.compact_with_conf(index, data, conf)
    }

    /// `compact`, with the configuration as it was at `index` (a snapshot confirmed by an
    /// audit is installed some time after it was taken).
    pub fn compact_with_conf(&self, index: u64, data: Vec<u8>, conf: ConfState) -> io::Result<Vec<u8>> {
        let mut c = self.lock();
        let snap_index = c.snap.get_metadata().index;
        // The same index again only to refresh the configuration in the snapshot.
        if index < snap_index || (index == snap_index && c.snap.get_metadata().get_conf_state() == &conf) {
            return Ok(data);
        }
        let term = if index == snap_index {
            c.snap.get_metadata().term
        } else {
            c.entries[(index - snap_index - 1) as usize].term
        };
        let mut snap = Snapshot {
            data,
            ..Default::default()
        };
        snap.set_metadata(SnapshotMetadata {
            conf_state: Some(conf),
            index,
            term,
        });
        c.entries.drain(..(index - snap_index) as usize);
        let replaced = std::mem::replace(&mut c.snap, snap);
        c.snapshot_wanted = false;
        Self::persist_snapshot(&mut c)?;
        Ok(replaced.data)
    }

    fn persist_snapshot(c: &mut Core) -> io::Result<()> {
        let Some(d) = c.disk.as_ref() else { return Ok(()) };
        write_atomic(&d.dir.join("snapshot"), &c.snap.encode_to_vec(), d.fsync)?;
        // The log now only needs the entries after the snapshot.
        let path = d.dir.join("log");
        let mut clean = Vec::new();
        for e in &c.entries {
            clean.extend_from_slice(&record(&e.encode_to_vec()));
        }
        fs::write(path.with_extension("tmp"), &clean)?;
        fs::rename(path.with_extension("tmp"), &path)?;
        let fsync = d.fsync;
        let dir = d.dir.clone();
        c.disk = Some(Disk {
            log: OpenOptions::new().append(true).open(&path)?,
            dir,
            fsync,
        });
        Ok(())
    }

    pub fn take_snapshot_wanted(&self) -> bool {
        std::mem::take(&mut self.lock().snapshot_wanted)
    }
}

fn store_err(e: StorageError) -> raft::Error {
    raft::Error::Store(e)
}

impl raft::Storage for LogStore {
    fn initial_state(&self) -> raft::Result<RaftState> {
        let c = self.lock();
        Ok(RaftState::new(c.hard.clone(), c.conf.clone()))
    }

    fn entries(
        &self,
        low: u64,
        high: u64,
        max_size: impl Into<Option<u64>>,
        _ctx: GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        let c = self.lock();
        let first = c.snap.get_metadata().index + 1;
        if low < first {
            return Err(store_err(StorageError::Compacted));
        }
        let last = first + c.entries.len() as u64 - 1;
        assert!(high <= last + 1, "entries up to {high} asked, last is {last}");
        let max = max_size.into().unwrap_or(u64::MAX);
        let mut out = Vec::new();
        let mut size = 0u64;
        for e in &c.entries[(low - first) as usize..(high - first) as usize] {
            size += e.encoded_len() as u64;
            if !out.is_empty() && size > max {
                break;
            }
            out.push(e.clone());
        }
        Ok(out)
    }

    fn term(&self, idx: u64) -> raft::Result<u64> {
        let c = self.lock();
        let meta = c.snap.get_metadata();
        if idx == meta.index {
            return Ok(meta.term);
        }
        if idx < meta.index {
            return Err(store_err(StorageError::Compacted));
        }
        match c.entries.get((idx - meta.index - 1) as usize) {
            Some(e) => Ok(e.term),
            None => Err(store_err(StorageError::Unavailable)),
        }
    }

    fn first_index(&self) -> raft::Result<u64> {
        Ok(self.lock().snap.get_metadata().index + 1)
    }

    fn last_index(&self) -> raft::Result<u64> {
        let c = self.lock();
        Ok(c.snap.get_metadata().index + c.entries.len() as u64)
    }

    fn snapshot(&self, request_index: u64, to: u64) -> raft::Result<Snapshot> {
        let mut c = self.lock();
        let meta = c.snap.get_metadata();
        // raft-rs refuses a snapshot whose configuration does not contain the receiver (a
        // replica re-added after a replacement): make a newer one first.
        let stale_conf = !meta.get_conf_state().voters.contains(&to) && !meta.get_conf_state().learners.contains(&to);
        if meta.index < request_index || meta.index == 0 || stale_conf {
            c.snapshot_wanted = true;
            return Err(store_err(StorageError::SnapshotTemporarilyUnavailable));
        }
        Ok(c.snap.clone())
    }
}

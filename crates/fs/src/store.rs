//! The file store: file data in backing files, and a CRC32C for every 4 KiB block in a
//! checksummed side table, optionally mirrored for repair.
//!
//! Layout under `--store DIR`:
//! - `DIR/data/...`: the namespace and file data (the naming layer works on it directly).
//! - `DIR/.lockstep/crc/<backing inode>`: the block CRC table of that inode (shared by its
//!   hard links). It is a sequence of 4 KiB chunks, each holding 1023 block CRCs and the
//!   CRC of those 4092 bytes, so a damaged table is detected too.
//!
//! `--mirror DIR2` keeps a second copy of every block and table: `DIR2/<inode>.data` and
//! `DIR2/<inode>.crc`. A block that fails its check in the store is read from the mirror,
//! checked there, and written back over the bad copy.
//!
//! A block's CRC covers its used part (the file's bytes in it). A table slot of 0 stands
//! for "never written": the block must then be all zeros (a hole).

use crate::crc::PAGE;
use lockstep_core::checksum::crc32c;
use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

const SLOTS: u64 = 1023;

#[derive(Debug)]
pub enum StoreError {
    Io(io::Error),
    /// The block and its mirror copy (if any) both fail their checks.
    Corrupt {
        ino: u64,
        block: u64,
    },
}

impl From<io::Error> for StoreError {
    fn from(e: io::Error) -> Self {
        StoreError::Io(e)
    }
}

impl StoreError {
    pub fn errno(&self) -> i32 {
        match self {
            StoreError::Io(e) => e.raw_os_error().unwrap_or(libc::EIO),
            StoreError::Corrupt { .. } => libc::EIO,
        }
    }
}

/// What a read found.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ReadInfo {
    /// The block was bad in the store and repaired from the mirror.
    pub repaired: bool,
}

struct StoreCopy {
    crc_dir: PathBuf,
    /// Mirror copies keep the data beside the table; the primary's data is the caller's file.
    data_dir: Option<PathBuf>,
    tables: HashMap<u64, File>,
    datas: HashMap<u64, File>,
}

impl StoreCopy {
    fn table(&mut self, ino: u64) -> io::Result<&File> {
        let name = match self.data_dir {
            Some(_) => format!("{ino}.crc"),
            None => ino.to_string(),
        };
        open_cached(&mut self.tables, ino, &self.crc_dir.join(name))
    }

    fn mirror_data(&mut self, ino: u64) -> io::Result<&File> {
        let dir = self.data_dir.as_ref().expect("mirror");
        open_cached(&mut self.datas, ino, &dir.join(format!("{ino}.data")))
    }

    /// The stored CRC of a block; `Ok(None)` if its table chunk fails its own check.
    fn crc(&mut self, ino: u64, block: u64) -> io::Result<Option<u32>> {
        let chunk = read_chunk(self.table(ino)?, block / SLOTS)?;
        Ok(chunk.map(|c| slot(&c, block % SLOTS)))
    }

    fn set_crc(&mut self, ino: u64, block: u64, crc: u32) -> io::Result<()> {
        let t = self.table(ino)?;
        // A chunk that is damaged is rebuilt around this slot: its other blocks then fail
        // their checks and are repaired from the mirror or reported.
        let mut chunk = read_chunk(t, block / SLOTS)?.unwrap_or([0u8; PAGE]);
        let s = (block % SLOTS) as usize * 4;
        chunk[s..s + 4].copy_from_slice(&crc.to_le_bytes());
        let sum = crc32c(&chunk[..PAGE - 4]);
        chunk[PAGE - 4..].copy_from_slice(&sum.to_le_bytes());
        t.write_all_at(&chunk, block / SLOTS * PAGE as u64)
    }

    fn forget(&mut self, ino: u64) {
        self.tables.remove(&ino);
        self.datas.remove(&ino);
    }
}

fn open_cached<'a>(files: &'a mut HashMap<u64, File>, ino: u64, path: &Path) -> io::Result<&'a File> {
    match files.entry(ino) {
        std::collections::hash_map::Entry::Occupied(e) => Ok(e.into_mut()),
        std::collections::hash_map::Entry::Vacant(v) => {
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(path)?;
            Ok(v.insert(f))
        }
    }
}

fn slot(chunk: &[u8; PAGE], i: u64) -> u32 {
    let s = i as usize * 4;
    u32::from_le_bytes(chunk[s..s + 4].try_into().unwrap())
}

/// A table chunk, `None` if it fails its CRC; a chunk past the end reads as all holes.
fn read_chunk(t: &File, chunk: u64) -> io::Result<Option<[u8; PAGE]>> {
    let mut buf = [0u8; PAGE];
    let n = read_full(t, &mut buf, chunk * PAGE as u64)?;
    if n == 0 {
        return Ok(Some([0u8; PAGE]));
    }
    let sum = u32::from_le_bytes(buf[PAGE - 4..].try_into().unwrap());
    // A chunk of zeros is one that was never written (a hole in the table file).
    if n == PAGE && sum == 0 && buf.iter().all(|&b| b == 0) {
        return Ok(Some(buf));
    }
    if n < PAGE || crc32c(&buf[..PAGE - 4]) != sum {
        return Ok(None);
    }
    Ok(Some(buf))
}

fn read_full(f: &File, buf: &mut [u8], off: u64) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match f.read_at(&mut buf[done..], off + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// The CRC of `data` if it matches the stored `crc` (a 0 slot: the block was never
/// written and must be a hole of zeros). Computed once; the cache keeps it.
fn verified(data: &[u8], stored: u32) -> Option<u32> {
    let crc = crc32c(data);
    (crc == stored || (stored == 0 && data.iter().all(|&b| b == 0))).then_some(crc)
}

pub struct Store {
    root: PathBuf,
    primary: StoreCopy,
    mirror: Option<StoreCopy>,
}

impl Store {
    /// Open (creating if needed) the store in `dir` and the mirror in `mirror`.
    pub fn open(dir: &Path, mirror: Option<&Path>) -> io::Result<Store> {
        let crc_dir = dir.join(".lockstep").join("crc");
        fs::create_dir_all(dir.join("data"))?;
        fs::create_dir_all(&crc_dir)?;
        let mirror = match mirror {
            Some(m) => {
                fs::create_dir_all(m)?;
                Some(StoreCopy {
                    crc_dir: m.to_path_buf(),
                    data_dir: Some(m.to_path_buf()),
                    tables: HashMap::new(),
                    datas: HashMap::new(),
                })
            }
            None => None,
        };
        Ok(Store {
            root: dir.to_path_buf(),
            primary: StoreCopy {
                crc_dir,
                data_dir: None,
                tables: HashMap::new(),
                datas: HashMap::new(),
            },
            mirror,
        })
    }

    /// The directory that holds the namespace.
    pub fn data_root(&self) -> PathBuf {
        self.root.join("data")
    }

    /// Read block `block` of inode `ino` from `data` (the file's first `len` bytes of that
    /// block are in use) and verify it. Returns the bytes and their CRC, which the cache
    /// keeps: it never computes it again.
    pub fn read_block(
        &mut self,
        ino: u64,
        data: &File,
        block: u64,
        len: usize,
    ) -> Result<(Vec<u8>, u32, ReadInfo), StoreError> {
        assert!(len <= PAGE);
        let mut buf = vec![0u8; len];
        let n = read_full(data, &mut buf, block * PAGE as u64)?;
        buf[n..].fill(0);
        if let Some(stored) = self.primary.crc(ino, block)? {
            if let Some(crc) = verified(&buf, stored) {
                return Ok((buf, crc, ReadInfo::default()));
            }
        }
        // Bad data or a bad table chunk: the mirror's copy, if it checks out, repairs ours.
        let Some(m) = self.mirror.as_mut() else {
            return Err(StoreError::Corrupt { ino, block });
        };
        let mut good = vec![0u8; len];
        let n = read_full(m.mirror_data(ino)?, &mut good, block * PAGE as u64)?;
        good[n..].fill(0);
        match m.crc(ino, block)?.and_then(|stored| verified(&good, stored)) {
            Some(crc) => {
                data.write_all_at(&good, block * PAGE as u64)?;
                self.primary.set_crc(ino, block, crc)?;
                Ok((good, crc, ReadInfo { repaired: true }))
            }
            None => Err(StoreError::Corrupt { ino, block }),
        }
    }

    /// Write a block with the CRC the cache computed for it (the store does not recompute).
    pub fn write_block(&mut self, ino: u64, data: &File, block: u64, bytes: &[u8], crc: u32) -> io::Result<()> {
        assert!(bytes.len() <= PAGE);
        data.write_all_at(bytes, block * PAGE as u64)?;
        self.primary.set_crc(ino, block, crc)?;
        if let Some(m) = self.mirror.as_mut() {
            m.mirror_data(ino)?.write_all_at(bytes, block * PAGE as u64)?;
            m.set_crc(ino, block, crc)?;
        }
        Ok(())
    }

    /// Cut or extend a file to `size`. `fixups` are the new CRCs of blocks whose used part
    /// changed (the new last block when cut inside it, the old last block when extended).
    pub fn truncate(&mut self, ino: u64, data: &File, size: u64, fixups: &[(u64, u32)]) -> io::Result<()> {
        data.set_len(size)?;
        let blocks = size.div_ceil(PAGE as u64);
        let keep_chunks = blocks.div_ceil(SLOTS);
        for copy in std::iter::once(&mut self.primary).chain(self.mirror.as_mut()) {
            if copy.data_dir.is_some() {
                copy.mirror_data(ino)?.set_len(size)?;
            }
            // Slots past the end are cleared, so that a later extension reads as holes.
            let t = copy.table(ino)?;
            // Only ever shortened: chunks past the end would be holes anyway.
            if t.metadata()?.len() > keep_chunks * PAGE as u64 {
                t.set_len(keep_chunks * PAGE as u64)?;
            }
            if !blocks.is_multiple_of(SLOTS) && blocks > 0 {
                let last_chunk = (blocks - 1) / SLOTS;
                if let Some(mut chunk) = read_chunk(t, last_chunk)? {
                    let from = (blocks % SLOTS) as usize * 4;
                    chunk[from..PAGE - 4].fill(0);
                    let sum = crc32c(&chunk[..PAGE - 4]);
                    chunk[PAGE - 4..].copy_from_slice(&sum.to_le_bytes());
                    t.write_all_at(&chunk, last_chunk * PAGE as u64)?;
                }
            }
            for &(block, crc) in fixups {
                copy.set_crc(ino, block, crc)?;
            }
        }
        Ok(())
    }

    /// The inode is gone (its last link was removed): drop its table and mirror copy.
    pub fn remove(&mut self, ino: u64) {
        self.primary.forget(ino);
        let _ = fs::remove_file(self.primary.crc_dir.join(ino.to_string()));
        if let Some(m) = self.mirror.as_mut() {
            m.forget(ino);
            let _ = fs::remove_file(m.crc_dir.join(format!("{ino}.crc")));
            let _ = fs::remove_file(m.crc_dir.join(format!("{ino}.data")));
        }
    }

    /// Make the tables (and mirror) of `ino` durable; the caller syncs the data file.
    pub fn sync(&mut self, ino: u64) -> io::Result<()> {
        self.primary.table(ino)?.sync_data()?;
        if let Some(m) = self.mirror.as_mut() {
            m.table(ino)?.sync_data()?;
            m.mirror_data(ino)?.sync_data()?;
        }
        Ok(())
    }

    /// Close cached handles of an inode the kernel forgot.
    pub fn forget(&mut self, ino: u64) {
        self.primary.forget(ino);
        if let Some(m) = self.mirror.as_mut() {
            m.forget(ino);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fresh(path: impl AsRef<Path>) -> File {
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .unwrap()
    }

    fn tmp(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("lockstep-fs-store-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn blocks_round_trip_and_disk_flips_are_caught_and_mirrored_back() {
        let dir = tmp("rt");
        let mut s = Store::open(&dir.join("s"), Some(&dir.join("m"))).unwrap();
        let path = s.data_root().join("f");
        let f = fresh(&path);
        let block: Vec<u8> = (0..PAGE).map(|i| (i % 251) as u8).collect();
        s.write_block(7, &f, 0, &block, crc32c(&block)).unwrap();
        s.write_block(7, &f, 1, &block[..100], crc32c(&block[..100])).unwrap();
        let (got, crc, info) = s.read_block(7, &f, 1, 100).unwrap();
        assert_eq!(
            (&got[..], crc, info.repaired),
            (&block[..100], crc32c(&block[..100]), false)
        );
        // Flip a bit on disk: detected, repaired from the mirror, and the repair sticks.
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, 10).unwrap();
        f.write_all_at(&[b[0] ^ 0x10], 10).unwrap();
        let (got, _, info) = s.read_block(7, &f, 0, PAGE).unwrap();
        assert!(info.repaired);
        assert_eq!(got, block);
        assert!(!s.read_block(7, &f, 0, PAGE).unwrap().2.repaired);
        // Without a mirror the same flip is an error, never wrong data.
        let mut plain = Store::open(&dir.join("p"), None).unwrap();
        let g = fresh(plain.data_root().join("g"));
        plain.write_block(9, &g, 0, &block, crc32c(&block)).unwrap();
        g.write_all_at(&[0xff], 4000).unwrap();
        assert!(matches!(
            plain.read_block(9, &g, 0, PAGE),
            Err(StoreError::Corrupt { ino: 9, block: 0 })
        ));
        // A damaged CRC table is caught as well.
        let t = plain.primary.crc_dir.join("9");
        let tf = OpenOptions::new().write(true).open(&t).unwrap();
        tf.write_all_at(&[1, 2, 3], 100).unwrap();
        g.write_all_at(&block[4000..4001], 4000).unwrap();
        assert!(plain.read_block(9, &g, 0, PAGE).is_err());
    }

    #[test]
    fn a_table_with_holes_reads_as_unwritten_blocks() {
        let dir = tmp("sparse");
        let mut s = Store::open(&dir, None).unwrap();
        let f = fresh(s.data_root().join("s"));
        // Block 5000 lives in the table's fifth chunk: the first four are holes.
        let block = vec![3u8; PAGE];
        s.write_block(2, &f, 5000, &block, crc32c(&block)).unwrap();
        assert!(s.read_block(2, &f, 10, PAGE).is_ok());
        assert_eq!(s.read_block(2, &f, 5000, PAGE).unwrap().0, block);
    }

    #[test]
    fn holes_and_truncation() {
        let dir = tmp("holes");
        let mut s = Store::open(&dir, None).unwrap();
        let f = fresh(s.data_root().join("h"));
        let block = vec![5u8; PAGE];
        s.write_block(1, &f, 3, &block, crc32c(&block)).unwrap();
        // Blocks 0..3 were never written: holes read as zeros and pass.
        let (got, _, _) = s.read_block(1, &f, 1, PAGE).unwrap();
        assert!(got.iter().all(|&b| b == 0));
        s.truncate(1, &f, PAGE as u64 * 3 + 10, &[(3, crc32c(&block[..10]))])
            .unwrap();
        assert_eq!(s.read_block(1, &f, 3, 10).unwrap().0, block[..10]);
        // Extension: the old block 3 grows with zeros (its CRC extended), block 4 is a hole.
        let mut grown = block[..10].to_vec();
        grown.resize(PAGE, 0);
        s.truncate(1, &f, PAGE as u64 * 5, &[(3, crc32c(&grown))]).unwrap();
        assert_eq!(s.read_block(1, &f, 3, PAGE).unwrap().0, grown);
        assert!(s.read_block(1, &f, 4, PAGE).is_ok());
    }
}

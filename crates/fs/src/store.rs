//! The file store: file data in an ordinary directory tree, and a CRC32C for every 4 KiB
//! block in a checksummed side table, optionally mirrored for repair.
//!
//! Layout (store format 2) under `--store DIR`:
//! - `DIR/...`: the namespace and file data, exactly as the mount shows them.
//! - `DIR/.lockstep/format`: the format marker; `DIR/.lockstep/lock`: held (flock) by the
//!   mount that serves the store.
//! - `DIR/.lockstep/crc/<path>`: the block CRC table of the regular file `DIR/<path>`.
//!   Hard links of a file have hard-linked tables, and a rename moves the table with the
//!   file. Tables are keyed by path, not by inode number, because the path is what
//!   survives `cp -a`, `rsync -a`, tar and a restore from backup; inode numbers do not. (A
//!   per-file id in an extended attribute would be lost by rsync and tar without extra
//!   flags.) A copy without `-H` turns hard links into separate files, and their tables
//!   into separate, still matching, copies.
//! - `DIR/.lockstep/orphans/<inode>`: the table of a file whose last name was removed while
//!   it was still open.
//!
//! A table is a sequence of chunk pairs: chunk `k` covers blocks `1023k .. 1023k+1022` and
//! is stored twice, at offsets `2k` and `2k+1` pages. A chunk holds 1023 block CRCs and the
//! CRC of those 4092 bytes. A copy that fails its CRC is rewritten from the other one. If
//! both fail, a block is still accepted when its CRC equals the slot of either copy (a
//! damaged slot cannot match by chance, except with probability 2^-32), so only blocks
//! whose checksums are really lost become unreadable.
//!
//! `--mirror DIR2` is a second store with the same layout (`DIR2/<path>` and
//! `DIR2/.lockstep/crc/<path>`), kept in step by every write, truncate and namespace
//! change. A block that fails its check in the store is read from the mirror, checked
//! there, and written back over the bad copy.
//!
//! A block's CRC covers its used part (the file's bytes in it). A table slot of 0 stands
//! for "never written": the block must then be all zeros (a hole).

use crate::crc::PAGE;
use crate::longpath::{Base, Spot};
use lockstep_core::checksum::crc32c;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Block CRCs per table chunk.
pub const SLOTS: u64 = 1023;
/// The directory of lockstep's own files in a store; hidden from the mount.
pub const META: &str = ".lockstep";
const FORMAT: &str = "lockstep fs store, format 2\n";

#[derive(Debug)]
pub enum StoreError {
    Io(io::Error),
    /// The block and its mirror copy (if any) both fail their checks.
    Corrupt {
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
    /// One copy of its table chunk was damaged and rewritten from the other.
    pub table_repaired: bool,
}

/// Where a file's tables are: under its path, or among the orphans (no name left).
#[derive(Debug, Clone, Copy)]
pub enum Place<'a> {
    Path(&'a Path),
    Orphan(u64),
}

/// An owned `Place`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlaceBuf {
    Path(PathBuf),
    Orphan(u64),
}

impl PlaceBuf {
    pub fn as_place(&self) -> Place<'_> {
        match self {
            PlaceBuf::Path(p) => Place::Path(p),
            PlaceBuf::Orphan(i) => Place::Orphan(*i),
        }
    }
}

/// The tables of one file: its table in the store and, with a mirror, the mirror's copy
/// of its data and table. A file that has never had a block written has none yet (an
/// empty file costs one inode, not two): they are created on its first write-back, where
/// the file is then (`retarget` follows renames until that happens).
pub struct Tables {
    opened: Option<Opened>,
    place: PlaceBuf,
}

pub(crate) struct Opened {
    table: File,
    mirror: Option<(File, File)>,
}

impl Tables {
    /// Whether the tables exist on disk (they are made at the first write-back).
    pub fn exist(&self) -> bool {
        self.opened.is_some()
    }

    /// The tables of a new file: none yet, made at its first write-back at `place`.
    pub fn unwritten(place: PlaceBuf) -> Tables {
        Tables { opened: None, place }
    }

    /// The file moved (or lost its last name) before its tables were created.
    pub fn retarget(&mut self, place: PlaceBuf) {
        self.place = place;
    }

    /// `from` was renamed to `to` (or swapped with it): a place at or under one of them
    /// moves with it.
    pub fn retarget_moved(&mut self, from: &Path, to: &Path, exchange: bool) {
        let join = |base: &Path, rest: &Path| match rest.as_os_str().is_empty() {
            true => base.to_path_buf(),
            false => base.join(rest),
        };
        if let PlaceBuf::Path(p) = &self.place {
            if let Ok(rest) = p.strip_prefix(from) {
                self.place = PlaceBuf::Path(join(to, rest));
            } else if let (true, Ok(rest)) = (exchange, p.strip_prefix(to)) {
                self.place = PlaceBuf::Path(join(from, rest));
            }
        }
    }
}

/// One table chunk as read from its two copies.
enum Chunk {
    /// A copy passed its CRC (`repaired`: the other did not and was rewritten).
    Good { slots: Box<[u8; PAGE]>, repaired: bool },
    /// Both copies fail: each slot has two candidates.
    Damaged { a: Box<[u8; PAGE]>, b: Box<[u8; PAGE]> },
}

fn slot(chunk: &[u8; PAGE], i: u64) -> u32 {
    lockstep_core::le::u32_at(chunk, i as usize * 4)
}

fn seal(chunk: &mut [u8; PAGE]) {
    let sum = crc32c(&chunk[..PAGE - 4]);
    chunk[PAGE - 4..].copy_from_slice(&sum.to_le_bytes());
}

/// A copy passes if its CRC matches, or if it is all zeros (never written: a hole).
fn copy_ok(c: &[u8; PAGE]) -> bool {
    let sum = slot(c, SLOTS);
    crc32c(&c[..PAGE - 4]) == sum || (sum == 0 && c.iter().all(|&b| b == 0))
}

fn read_chunk(t: &File, k: u64) -> io::Result<Chunk> {
    // The two copies are adjacent: one read.
    let mut both = vec![0u8; 2 * PAGE];
    let n = read_full(t, &mut both, 2 * k * PAGE as u64)?;
    let (na, nb) = (n.min(PAGE), n.saturating_sub(PAGE));
    let page = |b: &[u8]| -> Box<[u8; PAGE]> { Box::new(b.try_into().expect("one page")) };
    let (a, b) = (page(&both[..PAGE]), page(&both[PAGE..]));
    // A short copy is a torn or cut table: not trusted unless it is absent altogether.
    let a_ok = (na == PAGE || na == 0) && copy_ok(&a);
    let b_ok = (nb == PAGE || nb == 0) && copy_ok(&b);
    match (a_ok, b_ok) {
        (true, true) if a == b => Ok(Chunk::Good {
            slots: a,
            repaired: false,
        }),
        // Both valid but different: a write was torn between the copies. The first copy is
        // always written first, so it is the newer one.
        (true, _) => {
            write_copy(t, k, 1, &a)?;
            Ok(Chunk::Good {
                slots: a,
                repaired: !b_ok,
            })
        }
        (false, true) => {
            write_copy(t, k, 0, &b)?;
            Ok(Chunk::Good {
                slots: b,
                repaired: true,
            })
        }
        (false, false) => Ok(Chunk::Damaged { a, b }),
    }
}

fn write_copy(t: &File, k: u64, copy: u64, c: &[u8; PAGE]) -> io::Result<()> {
    t.write_all_at(c, (2 * k + copy) * PAGE as u64)
}

/// Both copies of chunk `k`, in one write. A crash of the daemon cannot tear it (the
/// kernel finishes the call); a power cut can leave either copy old, and `read_chunk`
/// then takes the first valid one.
fn write_chunk(t: &File, k: u64, c: &[u8; PAGE]) -> io::Result<()> {
    let mut both = vec![0u8; 2 * PAGE];
    both[..PAGE].copy_from_slice(c);
    both[PAGE..].copy_from_slice(c);
    t.write_all_at(&both, 2 * k * PAGE as u64)
}

pub(crate) fn read_full(f: &File, buf: &mut [u8], off: u64) -> io::Result<usize> {
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

/// Whether `data` matches a stored slot value (0: never written, so it must be zeros).
fn matches(data: &[u8], crc: u32, stored: u32) -> bool {
    crc == stored || (stored == 0 && data.iter().all(|&b| b == 0))
}

/// Read block `block` (its first `len` bytes are in use) of `data` and verify it against
/// table `t`. Returns the bytes, their CRC and whether a table copy was repaired, or
/// `None` if the block does not verify.
fn read_verified(t: &File, data: &File, block: u64, len: usize) -> io::Result<Option<(Vec<u8>, u32, bool)>> {
    let mut buf = vec![0u8; len];
    let n = read_full(data, &mut buf, block * PAGE as u64)?;
    buf[n..].fill(0);
    let crc = crc32c(&buf);
    let i = block % SLOTS;
    let ok = match read_chunk(t, block / SLOTS)? {
        Chunk::Good { slots, repaired } => matches(&buf, crc, slot(&slots, i)).then_some(repaired),
        Chunk::Damaged { a, b } => {
            (matches(&buf, crc, slot(&a, i)) || matches(&buf, crc, slot(&b, i))).then_some(false)
        }
    };
    Ok(ok.map(|repaired| (buf, crc, repaired)))
}

/// Set slots of one chunk `k` of table `t` (`(slot index, crc)` pairs). If both copies of
/// the chunk are damaged, it is rebuilt from whichever candidate of each slot matches the
/// data in `data` (a slot that matches neither keeps the first copy's value and keeps
/// failing: its checksum is lost).
fn set_crcs(t: &File, data: &File, k: u64, slots: impl Iterator<Item = (u64, u32)>) -> io::Result<()> {
    let mut c = match read_chunk(t, k)? {
        Chunk::Good { slots, .. } => slots,
        Chunk::Damaged { a, b } => rebuild_chunk(data, k, &a, &b)?,
    };
    for (i, crc) in slots {
        assert!(i < SLOTS);
        let s = i as usize * 4;
        c[s..s + 4].copy_from_slice(&crc.to_le_bytes());
    }
    seal(&mut c);
    write_chunk(t, k, &c)
}

fn set_crc(t: &File, data: &File, block: u64, crc: u32) -> io::Result<()> {
    set_crcs(t, data, block / SLOTS, std::iter::once((block % SLOTS, crc)))
}

/// Write `blocks` (sorted, distinct) to `data`: runs of adjacent full blocks go out in one
/// `pwritev` each.
fn write_data(data: &File, blocks: &[WriteBlock]) -> io::Result<()> {
    let mut at = 0;
    while at < blocks.len() {
        let mut end = at + 1;
        while end < blocks.len()
            && end - at < IOV_MAX
            && blocks[end].block == blocks[end - 1].block + 1
            && blocks[end - 1].bytes.len() == PAGE
        {
            end += 1;
        }
        let run = &blocks[at..end];
        let iov: Vec<libc::iovec> = run
            .iter()
            .map(|b| libc::iovec {
                iov_base: b.bytes.as_ptr() as *mut libc::c_void,
                iov_len: b.bytes.len(),
            })
            .collect();
        let total: usize = run.iter().map(|b| b.bytes.len()).sum();
        let off = run[0].block * PAGE as u64;
        // SAFETY: the iovecs point into `blocks`, which outlives the call; the kernel only
        // reads them.
        let n = unsafe { libc::pwritev(data.as_raw_fd(), iov.as_ptr(), iov.len() as i32, off as libc::off_t) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
        if (n.max(0) as usize) < total {
            // Short or interrupted: the rest one block at a time.
            let mut done = n.max(0) as usize;
            for b in run {
                let len = b.bytes.len();
                if done >= len {
                    done -= len;
                    continue;
                }
                data.write_all_at(&b.bytes[done..], b.block * PAGE as u64 + done as u64)?;
                done = 0;
            }
        }
        at = end;
    }
    Ok(())
}

/// At most this many blocks go in one `pwritev`.
const IOV_MAX: usize = 1024;

/// Data and tables for `blocks`, then one update per table chunk touched.
fn write_with_table(t: &File, data: &File, blocks: &[WriteBlock]) -> io::Result<()> {
    write_data(data, blocks)?;
    let mut at = 0;
    while at < blocks.len() {
        let k = blocks[at].block / SLOTS;
        let end = at + blocks[at..].iter().take_while(|b| b.block / SLOTS == k).count();
        set_crcs(t, data, k, blocks[at..end].iter().map(|b| (b.block % SLOTS, b.crc)))?;
        at = end;
    }
    Ok(())
}

/// One block to write back: its number, its used bytes and their CRC (computed by the
/// cache; the store does not recompute it).
pub struct WriteBlock<'a> {
    pub block: u64,
    pub bytes: &'a [u8],
    pub crc: u32,
}

fn rebuild_chunk(data: &File, k: u64, a: &[u8; PAGE], b: &[u8; PAGE]) -> io::Result<Box<[u8; PAGE]>> {
    let size = data.metadata()?.len();
    let mut c = Box::new([0u8; PAGE]);
    let mut buf = vec![0u8; PAGE];
    for i in 0..SLOTS {
        let block = k * SLOTS + i;
        let start = block * PAGE as u64;
        let len = size.saturating_sub(start).min(PAGE as u64) as usize;
        if len == 0 {
            continue;
        }
        let n = read_full(data, &mut buf[..len], start)?;
        buf[n..len].fill(0);
        let crc = crc32c(&buf[..len]);
        let pick = if matches(&buf[..len], crc, slot(b, i)) && !matches(&buf[..len], crc, slot(a, i)) {
            slot(b, i)
        } else {
            slot(a, i)
        };
        let s = i as usize * 4;
        c[s..s + 4].copy_from_slice(&pick.to_le_bytes());
    }
    Ok(c)
}

/// Cut table `t` to cover `blocks` blocks: slots past the end are cleared, so that a later
/// extension reads as holes.
fn cut_table(t: &File, data: &File, blocks: u64) -> io::Result<()> {
    let keep = blocks.div_ceil(SLOTS);
    if t.metadata()?.len() > 2 * keep * PAGE as u64 {
        t.set_len(2 * keep * PAGE as u64)?;
    }
    if blocks > 0 && !blocks.is_multiple_of(SLOTS) {
        let k = (blocks - 1) / SLOTS;
        let mut c = match read_chunk(t, k)? {
            Chunk::Good { slots, .. } => slots,
            Chunk::Damaged { a, b } => rebuild_chunk(data, k, &a, &b)?,
        };
        c[(blocks % SLOTS) as usize * 4..PAGE - 4].fill(0);
        seal(&mut c);
        write_chunk(t, k, &c)?;
    }
    Ok(())
}

/// One copy of the store (the primary or the mirror): its root and what lives under it.
#[derive(Clone, Debug)]
struct Copy {
    root: PathBuf,
    /// The namespace (the mirror's copies of data live there too), `.lockstep/crc` and
    /// `.lockstep/orphans`, each opened once.
    tree: Arc<Base>,
    crc: Arc<Base>,
    orphans: Arc<Base>,
}

impl Copy {
    fn new(root: &Path) -> Copy {
        let meta = root.join(META);
        Copy {
            root: root.to_path_buf(),
            tree: Base::new(root),
            crc: Base::new(meta.join("crc")),
            orphans: Base::new(meta.join("orphans")),
        }
    }

    fn meta(&self) -> PathBuf {
        self.root.join(META)
    }

    fn table(&self, place: Place) -> Spot {
        match place {
            Place::Path(rel) => Spot::new(&self.crc, rel),
            Place::Orphan(ino) => Spot::new(&self.orphans, ino.to_string()),
        }
    }

    /// The mirror's copy of a file's data.
    fn data(&self, place: Place) -> Spot {
        match place {
            Place::Path(rel) => Spot::new(&self.tree, rel),
            Place::Orphan(ino) => Spot::new(&self.orphans, format!("{ino}.data")),
        }
    }

    /// What moves with a file in this copy: its table, and (mirror) its data.
    fn spots(&self, place: Place, with_data: bool) -> Vec<Spot> {
        let mut v = vec![self.table(place)];
        if with_data {
            v.push(self.data(place));
        }
        v
    }
}

/// What `Store::open` found in a directory.
#[derive(Debug, PartialEq, Eq)]
pub enum Layout {
    /// A format-2 store.
    Store,
    /// Empty or missing: a new store may be made there.
    Empty,
    /// Files, but no `.lockstep`: `lockstep fs adopt` makes it a store.
    PlainDirectory,
    /// A store of an older format (inode-keyed tables under `data/`).
    OldFormat,
}

pub fn layout(dir: &Path) -> io::Result<Layout> {
    match fs::read_to_string(dir.join(META).join("format")) {
        Ok(s) if s == FORMAT => return Ok(Layout::Store),
        Ok(s) => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("unknown store format {:?}", s.trim()),
            ))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    if dir.join(META).join("crc").is_dir() && dir.join("data").is_dir() {
        return Ok(Layout::OldFormat);
    }
    match fs::read_dir(dir) {
        Ok(mut d) => Ok(if d.next().is_none() {
            Layout::Empty
        } else {
            Layout::PlainDirectory
        }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Layout::Empty),
        Err(e) => Err(e),
    }
}

/// Make `dir` a store (it must be empty, or be adopted by the caller, which then fills in
/// the tables).
pub fn init(dir: &Path) -> io::Result<()> {
    let meta = dir.join(META);
    fs::create_dir_all(meta.join("crc"))?;
    fs::create_dir_all(meta.join("orphans"))?;
    let tmp = meta.join("format.tmp");
    fs::write(&tmp, FORMAT)?;
    fs::rename(tmp, meta.join("format"))
}

/// A clear refusal for a directory that is not a format-2 store.
pub fn require_store(dir: &Path, what: &str) -> Result<(), String> {
    match layout(dir) {
        Ok(Layout::Store) => Ok(()),
        Ok(Layout::Empty) => init(dir).map_err(|e| format!("cannot create the {what} {}: {e}", dir.display())),
        Ok(Layout::PlainDirectory) => Err(format!(
            "the {what} {} holds files but is not a lockstep store; run `lockstep fs adopt {}` to make it one",
            dir.display(),
            dir.display()
        )),
        Ok(Layout::OldFormat) => Err(format!(
            "the {what} {} was made by an older lockstep (format 1, tables keyed by inode); move its data/ \
             directory out and run `lockstep fs adopt` on it",
            dir.display()
        )),
        Err(e) => Err(format!("the {what} {} cannot be read: {e}", dir.display())),
    }
}

pub struct Store {
    primary: Copy,
    mirror: Option<Copy>,
}

impl Store {
    /// Open the store in `dir` and the mirror in `mirror`; both must be format-2 stores
    /// (`require_store` makes empty directories into stores).
    pub fn open(dir: &Path, mirror: Option<&Path>) -> io::Result<Store> {
        for d in std::iter::once(dir).chain(mirror) {
            if layout(d)? != Layout::Store {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{} is not a lockstep store", d.display()),
                ));
            }
        }
        Ok(Store {
            primary: Copy::new(dir),
            mirror: mirror.map(Copy::new),
        })
    }

    pub fn has_mirror(&self) -> bool {
        self.mirror.is_some()
    }

    /// The directory that holds the namespace.
    pub fn root(&self) -> &Path {
        &self.primary.root
    }

    fn copies(&self) -> impl Iterator<Item = (&Copy, bool)> {
        std::iter::once((&self.primary, false)).chain(self.mirror.iter().map(|m| (m, true)))
    }

    /// The tables of the file at `place`: opened if they exist, else to be created at
    /// its first write.
    pub fn tables(&self, place: Place) -> io::Result<Tables> {
        let opened = match self.primary.table(place).open_existing()? {
            Some(table) => Some(Opened {
                table,
                mirror: match &self.mirror {
                    Some(m) => Some((m.data(place).open_rw()?, m.table(place).open_rw()?)),
                    None => None,
                },
            }),
            None => None,
        };
        let place = match place {
            Place::Path(p) => PlaceBuf::Path(p.to_path_buf()),
            Place::Orphan(i) => PlaceBuf::Orphan(i),
        };
        Ok(Tables { opened, place })
    }

    /// The tables of `t`, created now if they do not exist. Whatever is at their place is
    /// stale (the file had no tables), so they start empty.
    pub(crate) fn ensure<'t>(&self, t: &'t mut Tables) -> io::Result<&'t Opened> {
        if t.opened.is_none() {
            let place = t.place.as_place();
            let table = self.primary.table(place).create_empty()?;
            let mirror = match &self.mirror {
                Some(m) => Some((m.data(place).create_empty()?, m.table(place).create_empty()?)),
                None => None,
            };
            t.opened = Some(Opened { table, mirror });
        }
        Ok(t.opened.as_ref().expect("just opened"))
    }

    /// Read block `block` of `data` (its first `len` bytes are in use) and verify it.
    /// Returns the bytes and their CRC, which the cache keeps: it never computes it again.
    pub fn read_block(
        &self,
        t: &Tables,
        data: &File,
        block: u64,
        len: usize,
    ) -> Result<(Vec<u8>, u32, ReadInfo), StoreError> {
        assert!(len <= PAGE);
        let Some(t) = &t.opened else {
            // No table: nothing was ever written, so the block must be a hole of zeros.
            let mut buf = vec![0u8; len];
            let n = read_full(data, &mut buf, block * PAGE as u64)?;
            buf[n..].fill(0);
            if buf.iter().any(|&b| b != 0) {
                return Err(StoreError::Corrupt { block });
            }
            return Ok((buf, crate::crc::zeros(len), ReadInfo::default()));
        };
        if let Some((buf, crc, table_repaired)) = read_verified(&t.table, data, block, len)? {
            return Ok((
                buf,
                crc,
                ReadInfo {
                    repaired: false,
                    table_repaired,
                },
            ));
        }
        // Bad data or a lost checksum: the mirror's copy, if it checks out, repairs ours.
        let Some((mdata, mtable)) = &t.mirror else {
            return Err(StoreError::Corrupt { block });
        };
        match read_verified(mtable, mdata, block, len)? {
            Some((good, crc, _)) => {
                data.write_all_at(&good, block * PAGE as u64)?;
                set_crc(&t.table, data, block, crc)?;
                Ok((
                    good,
                    crc,
                    ReadInfo {
                        repaired: true,
                        table_repaired: false,
                    },
                ))
            }
            None => Err(StoreError::Corrupt { block }),
        }
    }

    /// Write blocks (sorted by block number, distinct) with the CRCs the cache computed for
    /// them: the data first, then each table chunk they touch, once.
    pub fn write_blocks(&self, t: &mut Tables, data: &File, blocks: &[WriteBlock]) -> io::Result<()> {
        assert!(blocks.iter().all(|b| b.bytes.len() <= PAGE));
        assert!(
            blocks.windows(2).all(|w| w[0].block < w[1].block),
            "blocks sorted and distinct"
        );
        let t = self.ensure(t)?;
        write_with_table(&t.table, data, blocks)?;
        if let Some((mdata, mtable)) = &t.mirror {
            write_with_table(mtable, mdata, blocks)?;
        }
        Ok(())
    }

    /// Write one block (see `write_blocks`).
    pub fn write_block(&self, t: &mut Tables, data: &File, block: u64, bytes: &[u8], crc: u32) -> io::Result<()> {
        self.write_blocks(t, data, &[WriteBlock { block, bytes, crc }])
    }

    /// Cut or extend a file to `size`. The block whose used part changes (the new last one
    /// when cut inside it, the old last one when extended) is the caller's to write next:
    /// the cache keeps it as a dirty page.
    pub fn truncate(&self, t: &Tables, data: &File, size: u64) -> io::Result<()> {
        data.set_len(size)?;
        // Without tables every slot is a hole already, and stays one.
        let Some(t) = &t.opened else { return Ok(()) };
        let blocks = size.div_ceil(PAGE as u64);
        cut_table(&t.table, data, blocks)?;
        if let Some((mdata, mtable)) = &t.mirror {
            mdata.set_len(size)?;
            cut_table(mtable, mdata, blocks)?;
        }
        Ok(())
    }

    /// Make the tables (and mirror) durable; the caller syncs the data file.
    pub fn sync(&self, t: &Tables) -> io::Result<()> {
        let Some(t) = &t.opened else { return Ok(()) };
        t.table.sync_data()?;
        if let Some((mdata, mtable)) = &t.mirror {
            mtable.sync_data()?;
            mdata.sync_data()?;
        }
        Ok(())
    }

    /// A file was renamed: its tables (and mirror data) move with it. With `exchange`,
    /// the two swap.
    pub fn renamed(&self, from: &Path, to: &Path, exchange: bool) -> io::Result<()> {
        for (copy, with_data) in self.copies() {
            let froms = copy.spots(Place::Path(from), with_data);
            let tos = copy.spots(Place::Path(to), with_data);
            for (f, t) in froms.iter().zip(&tos) {
                let (fk, tk) = (f.is_dir(), t.is_dir());
                if exchange && fk.is_some() && tk.is_some() {
                    f.rename_to(t, libc::RENAME_EXCHANGE)?;
                } else if exchange && tk.is_some() {
                    t.rename_to(f, 0)?;
                } else if let Some(f_is_dir) = fk {
                    // A plain rename replaces what was at `to`, as it did in the namespace;
                    // a directory of tables in the way of a file's table goes first.
                    if tk == Some(true) && !f_is_dir {
                        t.remove()?;
                    }
                    if f.rename_to(t, 0).is_err() {
                        t.remove()?;
                        f.rename_to(t, 0)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// A new hard link `new` of the file at `existing`: its tables get the same link
    /// (made now if the file has none yet).
    pub fn linked(&self, existing: &Path, new: &Path) -> io::Result<()> {
        for (copy, with_data) in self.copies() {
            for (e, n) in copy
                .spots(Place::Path(existing), with_data)
                .iter()
                .zip(copy.spots(Place::Path(new), with_data))
            {
                // A file not written back yet has no tables: links must share them all the
                // same, so they are made (empty) now.
                if !e.exists() {
                    e.create_empty()?;
                }
                n.remove()?;
                e.link_to(&n)?;
            }
        }
        Ok(())
    }

    /// The name `rel` of a regular file was removed. `orphan`: it was the last name and the
    /// file is still open, so its tables move to the orphans (by inode) until it is closed.
    pub fn unlinked(&self, rel: &Path, orphan: Option<u64>) -> io::Result<()> {
        for (copy, with_data) in self.copies() {
            let names = copy.spots(Place::Path(rel), with_data);
            match orphan {
                Some(ino) => {
                    for (n, o) in names.iter().zip(copy.spots(Place::Orphan(ino), with_data)) {
                        match n.rename_to(&o, 0) {
                            // Nothing to move (orphans are right under their base: see
                            // `Spot::rename_to`).
                            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::ENOTDIR)) => {}
                            r => r?,
                        }
                    }
                }
                None => {
                    for n in names {
                        n.remove()?;
                    }
                }
            }
        }
        Ok(())
    }

    /// A directory was removed: whatever tables are left under it go too.
    pub fn dir_removed(&self, rel: &Path) -> io::Result<()> {
        for (copy, with_data) in self.copies() {
            for p in copy.spots(Place::Path(rel), with_data) {
                p.remove()?;
            }
        }
        Ok(())
    }

    /// An orphan file was closed for the last time: its tables go.
    pub fn orphan_gone(&self, ino: u64) {
        for (copy, with_data) in self.copies() {
            for p in copy.spots(Place::Orphan(ino), with_data) {
                // Best effort: an orphan's table left behind is removed at the next mount (below).
                let _ = p.remove();
            }
        }
    }

    /// At mount: orphans of an earlier mount belong to files that no longer exist.
    pub fn clear_orphans(&self) -> io::Result<()> {
        for (copy, _) in self.copies() {
            fs::create_dir_all(copy.meta().join("orphans"))?;
            Spot::clear(&copy.orphans)?;
        }
        Ok(())
    }
}

/// Offline verification and table building for whole trees (`lockstep fs check` and
/// `lockstep fs adopt`).
pub mod offline {
    use super::*;

    /// What `check` found in one file.
    #[derive(Debug, Default)]
    pub struct FileReport {
        pub path: PathBuf,
        /// Blocks that fail their check (data or lost checksum) with no good mirror copy.
        pub bad_blocks: Vec<u64>,
        pub repaired_blocks: u64,
        pub repaired_chunks: u64,
    }

    #[derive(Debug, Default)]
    pub struct Report {
        pub files: u64,
        pub blocks: u64,
        pub damaged: Vec<FileReport>,
        pub repaired_blocks: u64,
        pub repaired_chunks: u64,
        /// Tables whose file no longer exists (removed by `check`).
        pub stale_tables: u64,
    }

    /// Every entry under `root` (relative path and metadata, not following symlinks),
    /// skipping `.lockstep`, in name order.
    pub fn walk(root: &Path, each: &mut dyn FnMut(&Path, &fs::Metadata)) -> io::Result<()> {
        let mut stack = vec![PathBuf::new()];
        while let Some(rel) = stack.pop() {
            let mut names: Vec<_> = fs::read_dir(root.join(&rel))?.collect::<Result<_, _>>()?;
            names.sort_by_key(|e| e.file_name());
            for e in names.into_iter().rev() {
                if rel.as_os_str().is_empty() && e.file_name() == META {
                    continue;
                }
                let r = rel.join(e.file_name());
                let m = fs::symlink_metadata(root.join(&r))?;
                each(&r, &m);
                if m.is_dir() {
                    stack.push(r);
                }
            }
        }
        Ok(())
    }

    /// Every regular file under `root`, relative, skipping `.lockstep`.
    pub fn regular_files(root: &Path, mut each: impl FnMut(&Path) -> io::Result<()>) -> io::Result<()> {
        let mut files = Vec::new();
        walk(root, &mut |rel, m| {
            if m.is_file() {
                files.push(rel.to_path_buf());
            }
        })?;
        for f in files {
            each(&f)?;
        }
        Ok(())
    }

    /// Verify every block of every file (repairing damaged table copies and, with a mirror,
    /// bad blocks), and `progress` after each file.
    pub fn check(store: &Store, mut progress: impl FnMut(&Report)) -> io::Result<Report> {
        let mut report = Report::default();
        let root = store.root().to_path_buf();
        regular_files(&root, |rel| {
            let data = OpenOptions::new().read(true).write(true).open(root.join(rel))?;
            let t = store.tables(Place::Path(rel))?;
            let size = data.metadata()?.len();
            let mut fr = FileReport {
                path: rel.to_path_buf(),
                ..Default::default()
            };
            for block in 0..size.div_ceil(PAGE as u64) {
                let len = (size - block * PAGE as u64).min(PAGE as u64) as usize;
                match store.read_block(&t, &data, block, len) {
                    Ok((_, _, info)) => {
                        fr.repaired_blocks += info.repaired as u64;
                        fr.repaired_chunks += info.table_repaired as u64;
                    }
                    Err(StoreError::Corrupt { block }) => fr.bad_blocks.push(block),
                    Err(StoreError::Io(e)) => return Err(e),
                }
            }
            report.files += 1;
            report.blocks += size.div_ceil(PAGE as u64);
            report.repaired_blocks += fr.repaired_blocks;
            report.repaired_chunks += fr.repaired_chunks;
            if !fr.bad_blocks.is_empty() {
                report.damaged.push(fr);
            }
            progress(&report);
            Ok(())
        })?;
        // Tables left behind by a file that is gone (the daemon was killed between the two
        // steps of an unlink).
        let crc = root.join(META).join("crc");
        let mut stale = Vec::new();
        regular_files(&crc, |rel| {
            if fs::symlink_metadata(root.join(rel))
                .map(|m| !m.is_file())
                .unwrap_or(true)
            {
                stale.push(crc.join(rel));
            }
            Ok(())
        })?;
        for p in stale {
            fs::remove_file(p)?;
            report.stale_tables += 1;
        }
        Ok(report)
    }

    /// Make the existing tree at `dir` a store: write the format marker and a table for
    /// every regular file, computed from its current contents. Returns the number of files.
    pub fn adopt(dir: &Path, mut progress: impl FnMut(u64)) -> io::Result<u64> {
        match layout(dir)? {
            Layout::Store => {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!("{} is a lockstep store already", dir.display()),
                ))
            }
            Layout::OldFormat => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "{} is a format-1 store; adopt its data/ directory instead",
                        dir.display()
                    ),
                ))
            }
            Layout::Empty | Layout::PlainDirectory => {}
        }
        // The marker is written last, so that an interrupted adopt can simply be run again.
        let meta = dir.join(META);
        fs::create_dir_all(meta.join("crc"))?;
        let crc = Base::new(meta.join("crc"));
        let mut n = 0;
        let mut buf = vec![0u8; PAGE];
        regular_files(dir, |rel| {
            let data = File::open(dir.join(rel))?;
            let table = Spot::new(&crc, rel).create_empty()?;
            let size = data.metadata()?.len();
            let blocks = size.div_ceil(PAGE as u64);
            for k in 0..blocks.div_ceil(SLOTS) {
                let mut c = Box::new([0u8; PAGE]);
                for i in 0..SLOTS.min(blocks - k * SLOTS) {
                    let start = (k * SLOTS + i) * PAGE as u64;
                    let len = (size - start).min(PAGE as u64) as usize;
                    let got = read_full(&data, &mut buf[..len], start)?;
                    buf[got..len].fill(0);
                    let s = i as usize * 4;
                    c[s..s + 4].copy_from_slice(&crc32c(&buf[..len]).to_le_bytes());
                }
                seal(&mut c);
                write_chunk(&table, k, &c)?;
            }
            table.sync_data()?;
            n += 1;
            progress(n);
            Ok(())
        })?;
        init(dir)?;
        Ok(n)
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
        // (a leftover from an earlier run, if any)
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    fn store(dir: &Path, mirror: Option<&Path>) -> Store {
        for d in std::iter::once(dir).chain(mirror) {
            require_store(d, "store").unwrap();
        }
        Store::open(dir, mirror).unwrap()
    }

    #[test]
    fn blocks_round_trip_and_disk_flips_are_caught_and_mirrored_back() {
        let dir = tmp("rt");
        let s = store(&dir.join("s"), Some(&dir.join("m")));
        let f = fresh(s.root().join("f"));
        let mut t = s.tables(Place::Path(Path::new("f"))).unwrap();
        let block: Vec<u8> = (0..PAGE).map(|i| (i % 251) as u8).collect();
        s.write_block(&mut t, &f, 0, &block, crc32c(&block)).unwrap();
        s.write_block(&mut t, &f, 1, &block[..100], crc32c(&block[..100]))
            .unwrap();
        let (got, crc, info) = s.read_block(&t, &f, 1, 100).unwrap();
        assert_eq!(
            (&got[..], crc, info.repaired),
            (&block[..100], crc32c(&block[..100]), false)
        );
        // Flip a bit on disk: detected, repaired from the mirror, and the repair sticks.
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, 10).unwrap();
        f.write_all_at(&[b[0] ^ 0x10], 10).unwrap();
        let (got, _, info) = s.read_block(&t, &f, 0, PAGE).unwrap();
        assert!(info.repaired);
        assert_eq!(got, block);
        assert!(!s.read_block(&t, &f, 0, PAGE).unwrap().2.repaired);
        // The mirror is a store of its own, with the same layout.
        assert_eq!(
            fs::read(dir.join("m/f")).unwrap(),
            fs::read(s.root().join("f")).unwrap()
        );
        // Without a mirror the same flip is an error, never wrong data.
        let plain = store(&dir.join("p"), None);
        let g = fresh(plain.root().join("g"));
        let mut tg = plain.tables(Place::Path(Path::new("g"))).unwrap();
        plain.write_block(&mut tg, &g, 0, &block, crc32c(&block)).unwrap();
        g.write_all_at(&[0xff], 4000).unwrap();
        assert!(matches!(
            plain.read_block(&tg, &g, 0, PAGE),
            Err(StoreError::Corrupt { block: 0 })
        ));
    }

    #[test]
    fn a_batch_across_table_chunks_with_gaps_and_a_short_last_block_reads_back() {
        let dir = tmp("batch");
        let s = store(&dir, Some(&tmp("batch-mirror")));
        let f = fresh(s.root().join("f"));
        let mut t = s.tables(Place::Path(Path::new("f"))).unwrap();
        // Three chunks' worth, with gaps (separate pwritev runs), ending in a short block.
        let blocks: Vec<u64> = (0..3 * SLOTS).filter(|b| b % 7 != 3).collect();
        let last = *blocks.last().unwrap();
        let bytes: Vec<Vec<u8>> = blocks
            .iter()
            .map(|&b| vec![(b % 251) as u8 + 1; if b == last { 100 } else { PAGE }])
            .collect();
        let batch: Vec<WriteBlock> = blocks
            .iter()
            .zip(&bytes)
            .map(|(&block, b)| WriteBlock {
                block,
                bytes: b,
                crc: crc32c(b),
            })
            .collect();
        s.write_blocks(&mut t, &f, &batch).unwrap();
        for (&b, want) in blocks.iter().zip(&bytes) {
            let (got, crc, _) = s.read_block(&t, &f, b, want.len()).unwrap();
            assert_eq!((&got, crc), (want, crc32c(want)), "block {b}");
        }
        // The gaps are holes: zeros, and their slots say so.
        let (hole, _, _) = s.read_block(&t, &f, 3, PAGE).unwrap();
        assert!(hole.iter().all(|&x| x == 0));
        // A flipped data byte in the middle chunk is repaired from the mirror.
        f.write_all_at(&[0xee], (SLOTS + 1) * PAGE as u64 + 5).unwrap();
        let (got, _, info) = s.read_block(&t, &f, SLOTS + 1, PAGE).unwrap();
        assert!(info.repaired);
        assert_eq!(got, bytes[blocks.iter().position(|&b| b == SLOTS + 1).unwrap()]);
    }

    #[test]
    fn a_damaged_table_copy_is_repaired_and_a_doubly_damaged_chunk_loses_only_its_bad_slots() {
        let dir = tmp("chunk");
        let s = store(&dir, None);
        let f = fresh(s.root().join("f"));
        let mut t = s.tables(Place::Path(Path::new("f"))).unwrap();
        for b in 0..4u64 {
            let data = vec![b as u8 + 1; PAGE];
            s.write_block(&mut t, &f, b, &data, crc32c(&data)).unwrap();
        }
        let table = dir.join(META).join("crc").join("f");
        let tf = OpenOptions::new().write(true).open(&table).unwrap();
        // One copy damaged (slot 1): repaired from the other, every block reads.
        tf.write_all_at(&[0x55], 4 + 1).unwrap();
        let (_, _, info) = s.read_block(&t, &f, 1, PAGE).unwrap();
        assert!(info.table_repaired);
        assert!(!s.read_block(&t, &f, 1, PAGE).unwrap().2.table_repaired);
        // Both copies damaged, in slot 1 of one and slot 2 of the other: every block still
        // matches one candidate.
        tf.write_all_at(&[0x55], 4 + 1).unwrap();
        tf.write_all_at(&[0x55], PAGE as u64 + 8 + 1).unwrap();
        for b in 0..4 {
            assert!(s.read_block(&t, &f, b, PAGE).is_ok(), "block {b}");
        }
        // Both copies damaged in the same slot: only that block is lost.
        tf.write_all_at(&[0x66], PAGE as u64 + 4 + 1).unwrap();
        assert!(s.read_block(&t, &f, 1, PAGE).is_err());
        for b in [0, 2, 3] {
            assert!(s.read_block(&t, &f, b, PAGE).is_ok(), "block {b}");
        }
        // A write into the damaged chunk rebuilds it from the blocks that verify.
        let data = vec![9u8; PAGE];
        s.write_block(&mut t, &f, 3, &data, crc32c(&data)).unwrap();
        for b in 0..4 {
            assert_eq!(s.read_block(&t, &f, b, PAGE).is_ok(), b != 1, "block {b}");
        }
    }

    #[test]
    fn a_table_with_holes_reads_as_unwritten_blocks() {
        let dir = tmp("sparse");
        let s = store(&dir, None);
        let f = fresh(s.root().join("s"));
        let mut t = s.tables(Place::Path(Path::new("s"))).unwrap();
        // Block 5000 lives in the table's fifth chunk: the first four are holes.
        let block = vec![3u8; PAGE];
        s.write_block(&mut t, &f, 5000, &block, crc32c(&block)).unwrap();
        assert!(s.read_block(&t, &f, 10, PAGE).is_ok());
        assert_eq!(s.read_block(&t, &f, 5000, PAGE).unwrap().0, block);
    }

    #[test]
    fn holes_and_truncation() {
        let dir = tmp("holes");
        let s = store(&dir, None);
        let f = fresh(s.root().join("h"));
        let mut t = s.tables(Place::Path(Path::new("h"))).unwrap();
        let block = vec![5u8; PAGE];
        s.write_block(&mut t, &f, 3, &block, crc32c(&block)).unwrap();
        // Blocks 0..3 were never written: holes read as zeros and pass.
        let (got, _, _) = s.read_block(&t, &f, 1, PAGE).unwrap();
        assert!(got.iter().all(|&b| b == 0));
        s.truncate(&t, &f, PAGE as u64 * 3 + 10).unwrap();
        s.write_block(&mut t, &f, 3, &block[..10], crc32c(&block[..10]))
            .unwrap();
        assert_eq!(s.read_block(&t, &f, 3, 10).unwrap().0, block[..10]);
        // Extension: the old block 3 grows with zeros (its CRC extended), block 4 is a hole.
        let mut grown = block[..10].to_vec();
        grown.resize(PAGE, 0);
        s.truncate(&t, &f, PAGE as u64 * 5).unwrap();
        s.write_block(&mut t, &f, 3, &grown, crc32c(&grown)).unwrap();
        assert_eq!(s.read_block(&t, &f, 3, PAGE).unwrap().0, grown);
        assert!(s.read_block(&t, &f, 4, PAGE).is_ok());
    }

    #[test]
    fn tables_follow_renames_links_and_unlinks() {
        let dir = tmp("names");
        let s = store(&dir.join("s"), Some(&dir.join("m")));
        fs::create_dir_all(s.root().join("a")).unwrap();
        let f = fresh(s.root().join("a/f"));
        let mut t = s.tables(Place::Path(Path::new("a/f"))).unwrap();
        let block = vec![7u8; 100];
        s.write_block(&mut t, &f, 0, &block, crc32c(&block)).unwrap();
        drop(t);
        fs::rename(s.root().join("a"), s.root().join("b")).unwrap();
        s.renamed(Path::new("a"), Path::new("b"), false).unwrap();
        fs::hard_link(s.root().join("b/f"), s.root().join("g")).unwrap();
        s.linked(Path::new("b/f"), Path::new("g")).unwrap();
        for name in ["b/f", "g"] {
            let t = s.tables(Place::Path(Path::new(name))).unwrap();
            assert_eq!(s.read_block(&t, &f, 0, 100).unwrap().0, block, "{name}");
        }
        s.unlinked(Path::new("b/f"), None).unwrap();
        s.unlinked(Path::new("g"), Some(77)).unwrap();
        let t = s.tables(Place::Orphan(77)).unwrap();
        assert_eq!(s.read_block(&t, &f, 0, 100).unwrap().0, block);
        s.orphan_gone(77);
        assert!(!dir.join("s/.lockstep/orphans/77").exists());
        assert!(!dir.join("m/.lockstep/orphans/77.data").exists());
    }

    #[test]
    fn tables_are_made_at_the_first_write_where_the_file_is_then() {
        let dir = tmp("lazy");
        let s = store(&dir, None);
        fs::create_dir_all(s.root().join("a")).unwrap();
        let f = fresh(s.root().join("a/x"));
        let mut t = s.tables(Place::Path(Path::new("a/x"))).unwrap();
        // An empty file has no table, and reads as holes.
        assert!(!dir.join(".lockstep/crc/a/x").exists());
        assert!(s.read_block(&t, &f, 0, 10).is_ok());
        // Renamed before its first write-back (with a stale table at the new place).
        fs::rename(s.root().join("a"), s.root().join("b")).unwrap();
        fs::create_dir_all(dir.join(".lockstep/crc/b")).unwrap();
        fs::write(dir.join(".lockstep/crc/b/x"), vec![0xAAu8; 8192]).unwrap();
        t.retarget_moved(Path::new("a"), Path::new("b"), false);
        let block = vec![4u8; 300];
        s.write_block(&mut t, &f, 0, &block, crc32c(&block)).unwrap();
        assert!(!dir.join(".lockstep/crc/a/x").exists());
        let again = s.tables(Place::Path(Path::new("b/x"))).unwrap();
        assert_eq!(s.read_block(&again, &f, 0, 300).unwrap().0, block);
    }

    #[test]
    fn adopt_then_check_then_a_copy_checks_too() {
        let dir = tmp("adopt");
        let tree = dir.join("tree");
        fs::create_dir_all(tree.join("x/y")).unwrap();
        fs::write(tree.join("x/y/big"), vec![1u8; 3 * PAGE + 17]).unwrap();
        fs::write(tree.join("small"), b"hello").unwrap();
        fs::write(tree.join("empty"), b"").unwrap();
        assert_eq!(layout(&tree).unwrap(), Layout::PlainDirectory);
        assert_eq!(offline::adopt(&tree, |_| {}).unwrap(), 3);
        assert_eq!(layout(&tree).unwrap(), Layout::Store);
        let r = offline::check(&Store::open(&tree, None).unwrap(), |_| {}).unwrap();
        assert_eq!((r.files, r.blocks, r.damaged.len()), (3, 5, 0));
        // Damage a byte of data: check names the file and the block.
        let f = OpenOptions::new().write(true).open(tree.join("x/y/big")).unwrap();
        f.write_all_at(b"Z", PAGE as u64 * 2 + 5).unwrap();
        let r = offline::check(&Store::open(&tree, None).unwrap(), |_| {}).unwrap();
        assert_eq!(r.damaged.len(), 1);
        assert_eq!(r.damaged[0].path, Path::new("x/y/big"));
        assert_eq!(r.damaged[0].bad_blocks, vec![2]);
    }
}

//! The page cache: 4 KiB pages, each with the CRC32C of its used part.
//!
//! A page's CRC comes from the store on a miss (computed there once while verifying the
//! block) or is maintained incrementally by writes (`crc::extend`, `crc::patch`), and the
//! store persists that same CRC on write-back. Verification follows the configured
//! strategy, plus a background scrubber:
//! - a clean page that fails is dropped and read again from the store (counted);
//! - a dirty page that fails is poisoned: reads of it get EIO, it is never written back,
//!   and fsync of its file reports EIO.

use crate::crc::{self, PAGE};
use crate::shared::{DirtyRecord, Shared, SizeRecord};
use crate::store::{Store, StoreError, Tables, WriteBlock, SLOTS};
use lockstep_core::checksum::{crc32c, crc32c_append, crc32c_append_copy};
use lockstep_core::Event;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Files kept attached (data and table descriptors open) while no FUSE handle has them
/// open: the rest are written back and closed, and opened again on demand, so that the
/// number of descriptors does not grow with the number of files. The bound follows the
/// open-file limit: idle files hold at most a quarter of it (less a reserve), within these
/// limits. Keeping many is what lets short-lived files (created, written and removed within
/// the dirty age) never reach the store, as in a kernel page cache.
pub const IDLE_FILES_MIN: usize = 64;

pub const IDLE_FILES_MAX: usize = 4096;

fn idle_files_bound(fds_per_file: u64) -> usize {
    // SAFETY: rlimit is plain data; the kernel fills it in.
    let mut r: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: valid output struct.
    let limit = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0 {
        r.rlim_cur
    } else {
        1024
    };
    (limit.saturating_sub(256) / (4 * fds_per_file)).clamp(IDLE_FILES_MIN as u64, IDLE_FILES_MAX as u64) as usize
}

/// When a cached page is verified on read (§IV-C of the Loris paper). Only `EveryRead`
/// (the default) never returns a page that fails its CRC; the others leave a window, which
/// docs/fs.md states with measured numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verify {
    EveryRead,
    /// On read, if the last check is older than this.
    LastCheck(Duration),
    /// On read, if the last use is older than this, and in any case at least this often.
    LastUse(Duration),
    None,
}

struct Page {
    /// Where its bytes are in the shared slab.
    slot: usize,
    /// Bytes of the page that belong to the file.
    len: usize,
    /// CRC32C of `data[..len]`.
    crc: u32,
    /// When it became dirty.
    dirty: Option<Instant>,
    poisoned: bool,
    last_check: Instant,
    last_use: Instant,
    /// Used since the clock hand last passed (second chance).
    referenced: bool,
}

impl Page {
    fn empty(slot: usize, now: Instant) -> Page {
        Page {
            slot,
            len: 0,
            crc: 0,
            dirty: None,
            poisoned: false,
            last_check: now,
            last_use: now,
            referenced: true,
        }
    }

    fn intact(&self, shared: &Shared) -> bool {
        crc32c(&shared.page(self.slot)[..self.len]) == self.crc
    }
}

struct FileData {
    file: Arc<File>,
    tables: Tables,
    /// The file's size including dirty data and truncations not written back yet.
    size: u64,
    /// The backing file's size.
    disk_size: u64,
    /// A truncation not applied to the store yet: the lowest size the file was cut to.
    /// Bytes at or past it on disk are gone for readers.
    cut: Option<u64>,
    /// Since when the size has differed from the store's (a pending truncate).
    resized: Option<Instant>,
    /// Open FUSE file handles: an open file stays attached (an unlinked one could not be
    /// opened again).
    opens: u32,
    /// Blocks with dirty (or poisoned) pages.
    dirty: BTreeSet<u64>,
    /// Last attach or use, for closing idle files.
    seq: u64,
}

impl FileData {
    fn idle(&self) -> bool {
        self.opens == 0 && self.dirty.is_empty() && self.resized.is_none()
    }
}

#[derive(Default, Clone, Debug)]
pub struct Stats {
    pub reads: u64,
    pub writes: u64,
    pub hits: u64,
    pub misses: u64,
    pub checks: u64,
    /// Clean pages that failed their check and were read again from the store.
    pub clean_detected: u64,
    /// Dirty pages that failed their check (poisoned).
    pub dirty_detected: u64,
    /// Reads and fsyncs answered with EIO because of a poisoned page or a bad block.
    pub eio: u64,
    pub scrubbed: u64,
    /// Blocks that were bad on disk and repaired from the mirror.
    pub disk_repaired: u64,
    /// Blocks that were bad on disk with no good copy.
    pub disk_corrupt: u64,
    /// Checksum table chunks with one damaged copy, rewritten from the other.
    pub table_repaired: u64,
    pub written_back: u64,
    pub evicted: u64,
    /// Test-only flips injected into cached pages.
    pub injected: u64,
}

pub struct Cache {
    store: Store,
    /// By (inode, block): a file's pages are one range.
    pages: BTreeMap<(u64, u64), Page>,
    /// Eviction is CLOCK over the slots (an approximation of LRU that costs nothing per
    /// read): the page in each slot, and the hand.
    slot_keys: Vec<Option<(u64, u64)>>,
    hand: usize,
    seq: u64,
    /// Page data and the Dirty State Store, in memory that outlives this process.
    shared: Shared,
    /// Slots of `shared` holding no page.
    free: Vec<usize>,
    verify: Verify,
    files: HashMap<u64, FileData>,
    /// Attached files by last use (`FileData::seq`).
    file_lru: BTreeMap<u64, u64>,
    /// Idle files kept attached (`idle_files_bound`, from the open-file limit at start).
    idle_files_max: usize,
    scrub_cursor: (u64, u64),
    /// Pages that are dirty (poisoned ones included), for space accounting.
    dirty_count: usize,
    /// Detections and repairs not yet written to the event sink.
    events: Vec<Event>,
    /// The pages of the read being answered (kept to reuse its allocation).
    spans: Vec<(usize, usize, bool)>,
    pub stats: Stats,
}

type R<T> = Result<T, i32>;

impl Cache {
    /// A cache of about `limit_bytes` in a fresh shared region.
    pub fn with_memory(store: Store, limit_bytes: u64, verify: Verify) -> std::io::Result<Cache> {
        let slots = (limit_bytes / PAGE as u64).max(16) as usize;
        Ok(Cache::new(store, Shared::create(slots)?, verify))
    }

    /// A cache whose pages live in `shared` (any dirty pages there must have been written
    /// back by recovery first: the cache starts empty).
    pub fn new(store: Store, mut shared: Shared, verify: Verify) -> Cache {
        for slot in 0..shared.slots() {
            shared.clear(slot);
        }
        let free = (0..shared.slots()).rev().collect();
        let idle_files_max = idle_files_bound(if store.has_mirror() { 4 } else { 2 });
        Cache {
            store,
            pages: BTreeMap::new(),
            slot_keys: vec![None; shared.slots()],
            hand: 0,
            seq: 0,
            shared,
            free,
            verify,
            files: HashMap::new(),
            file_lru: BTreeMap::new(),
            idle_files_max,
            scrub_cursor: (0, 0),
            dirty_count: 0,
            events: Vec::new(),
            spans: Vec::new(),
            stats: Stats::default(),
        }
    }

    /// The shared region (handles of known inodes live there too).
    pub fn shared(&mut self) -> &mut Shared {
        &mut self.shared
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Give the cache the backing file of `ino` (opened read-write), its tables and its size
    /// on disk, unless it has them. `open` gets the store to open the tables with.
    pub fn attach(&mut self, ino: u64, open: impl FnOnce(&Store) -> std::io::Result<(File, Tables, u64)>) -> R<()> {
        self.seq += 1;
        let seq = self.seq;
        if let Some(f) = self.files.get_mut(&ino) {
            if f.opens == 0 {
                self.file_lru.remove(&f.seq);
                self.file_lru.insert(seq, ino);
            }
            f.seq = seq;
            return Ok(());
        }
        let (file, tables, size) = open(&self.store).map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
        self.files.insert(
            ino,
            FileData {
                file: Arc::new(file),
                tables,
                size,
                disk_size: size,
                cut: None,
                resized: None,
                opens: 0,
                dirty: BTreeSet::new(),
                seq,
            },
        );
        self.file_lru.insert(seq, ino);
        self.close_idle_files();
        Ok(())
    }

    /// Close the least recently used files that are not open (`file_lru` holds exactly
    /// those), beyond `idle_files_max`. Their dirty pages are written back first
    /// (write-back under descriptor pressure); a file with poisoned pages stays.
    fn close_idle_files(&mut self) {
        let excess = self.file_lru.len().saturating_sub(self.idle_files_max);
        if excess == 0 {
            return;
        }
        let (mut closed, mut kept) = (0, 0);
        while closed < excess {
            let Some(&ino) = self.file_lru.values().nth(kept) else {
                break;
            };
            if self.files[&ino].idle() || self.flush(Some(ino), Duration::ZERO).is_ok() {
                self.detach(ino);
                closed += 1;
            } else {
                kept += 1;
            }
        }
    }

    fn detach(&mut self, ino: u64) {
        if let Some(f) = self.files.remove(&ino) {
            self.file_lru.remove(&f.seq);
        }
    }

    pub fn is_attached(&self, ino: u64) -> bool {
        self.files.contains_key(&ino)
    }

    /// A FUSE open of `ino` (attached first): it stays attached until released.
    pub fn opened(&mut self, ino: u64) {
        if let Some(f) = self.files.get_mut(&ino) {
            if f.opens == 0 {
                self.file_lru.remove(&f.seq);
            }
            f.opens += 1;
        }
    }

    pub fn released(&mut self, ino: u64) {
        if let Some(f) = self.files.get_mut(&ino).filter(|f| f.opens > 0) {
            f.opens -= 1;
            if f.opens == 0 {
                self.seq += 1;
                f.seq = self.seq;
                self.file_lru.insert(f.seq, ino);
            }
        }
        self.close_idle_files();
    }

    /// The open data file of `ino`, if attached (an unlinked open file is reachable only
    /// through it).
    pub fn file_of(&self, ino: u64) -> Option<Arc<File>> {
        self.files.get(&ino).map(|f| f.file.clone())
    }

    /// Whether `ino` has tables on disk: known for an attached file (they are probed at
    /// attach and made at write-back), None otherwise.
    pub fn has_tables(&self, ino: u64) -> Option<bool> {
        self.files.get(&ino).map(|f| f.tables.exist())
    }

    /// Create the tables of `ino` now if it has none (it is getting a second name, and
    /// all its names must share one table).
    pub fn ensure_tables(&mut self, ino: u64) -> R<()> {
        if let Some(f) = self.files.get_mut(&ino) {
            self.store
                .ensure(&mut f.tables)
                .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
        }
        Ok(())
    }

    /// `ino` moved (or lost its last name): tables not created yet go to its new place.
    pub fn retarget(&mut self, ino: u64, place: crate::store::PlaceBuf) {
        if let Some(f) = self.files.get_mut(&ino) {
            f.tables.retarget(place);
        }
    }

    /// `from` was renamed to `to` (swapped with it, with `exchange`): attached files at
    /// or under them whose tables are not created yet follow.
    pub fn retarget_moved(&mut self, from: &std::path::Path, to: &std::path::Path, exchange: bool) {
        for f in self.files.values_mut() {
            f.tables.retarget_moved(from, to, exchange);
        }
    }

    /// Blocks of `ino` that hold dirty data not yet in the store.
    pub fn dirty_blocks(&self, ino: u64) -> Vec<u64> {
        self.files
            .get(&ino)
            .map(|f| f.dirty.iter().copied().collect())
            .unwrap_or_default()
    }

    /// Inodes with poisoned pages (dirty data that failed its check and will never be
    /// written), with the number of such pages.
    pub fn poisoned(&self) -> Vec<(u64, usize)> {
        let mut by_ino: BTreeMap<u64, usize> = BTreeMap::new();
        for ((ino, _), p) in &self.pages {
            if p.poisoned {
                *by_ino.entry(*ino).or_default() += 1;
            }
        }
        by_ino.into_iter().collect()
    }

    fn mark_dirty(&mut self, key: (u64, u64), now: Instant) {
        let p = self.pages.get_mut(&key).expect("page present");
        if p.dirty.is_none() {
            p.dirty = Some(now);
            self.dirty_count += 1;
            if let Some(f) = self.files.get_mut(&key.0) {
                f.dirty.insert(key.1);
            }
        }
    }

    fn mark_clean(&mut self, key: (u64, u64)) {
        let p = self.pages.get_mut(&key).expect("page present");
        if p.dirty.take().is_some() {
            self.dirty_count -= 1;
            if let Some(f) = self.files.get_mut(&key.0) {
                f.dirty.remove(&key.1);
            }
        }
    }

    /// The size of `ino` as the cache sees it (dirty data included), if attached.
    pub fn size(&self, ino: u64) -> Option<u64> {
        self.files.get(&ino).map(|f| f.size)
    }

    fn touch(&mut self, key: (u64, u64), now: Instant) {
        if let Some(p) = self.pages.get_mut(&key) {
            p.last_use = now;
            p.referenced = true;
        }
    }

    fn should_verify(verify: Verify, p: &Page, now: Instant) -> bool {
        match verify {
            Verify::EveryRead => true,
            Verify::LastCheck(d) => now.duration_since(p.last_check) >= d,
            // A page that is read continuously is never idle: without the second bound it
            // would never be checked again.
            Verify::LastUse(d) => now.duration_since(p.last_use) >= d || now.duration_since(p.last_check) >= d,
            Verify::None => false,
        }
    }

    fn drop_page(&mut self, key: (u64, u64)) {
        if self.pages.contains_key(&key) {
            self.mark_clean(key);
        }
        if let Some(p) = self.pages.remove(&key) {
            self.slot_keys[p.slot] = None;
            self.shared.clear(p.slot);
            self.free.push(p.slot);
        }
    }

    /// Keep the DSS record of a page in step with the page: a dirty page is recorded with
    /// its used length and CRC; a clean one has no record.
    fn record(&mut self, key: (u64, u64)) {
        let Some(p) = self.pages.get(&key) else { return };
        if p.dirty.is_some() && !p.poisoned {
            self.shared.set_dirty(DirtyRecord {
                slot: p.slot,
                ino: key.0,
                block: key.1,
                len: p.len,
                crc: p.crc,
            });
        } else {
            self.shared.clear(p.slot);
        }
    }

    /// A new, empty page for `key`, in a free slot (evicting the least recently used page
    /// if there is none).
    fn new_page(&mut self, key: (u64, u64), now: Instant) -> R<()> {
        if self.free.is_empty() {
            self.evict_one()?;
        }
        let slot = self.free.pop().ok_or(libc::ENOMEM)?;
        self.shared.page_mut(slot).fill(0);
        self.pages.insert(key, Page::empty(slot, now));
        self.slot_keys[slot] = Some(key);
        Ok(())
    }

    fn event(&mut self, kind: &'static str, action: &'static str, key: (u64, u64), message: String) {
        self.events.push(
            Event::new("fs", kind, action)
                .object(format!("inode {} block {}", key.0, key.1))
                .message(message),
        );
    }

    /// Events since the last call, for the daemon to write out.
    pub fn take_events(&mut self) -> Vec<Event> {
        std::mem::take(&mut self.events)
    }

    /// Bytes of dirty data not yet in the store.
    pub fn dirty_bytes(&self) -> u64 {
        (self.dirty_count * PAGE) as u64
    }

    /// Check a cached page now. A clean page that fails is dropped (the next access reads
    /// it from the store); a dirty one is poisoned. Returns whether it was intact.
    fn check(&mut self, key: (u64, u64), now: Instant) -> bool {
        let Some(p) = self.pages.get_mut(&key) else { return true };
        self.stats.checks += 1;
        p.last_check = now;
        if p.poisoned {
            return false;
        }
        if p.intact(&self.shared) {
            return true;
        }
        if p.dirty.is_some() {
            p.poisoned = true;
            // A poisoned page is not recovered after a crash either.
            self.shared.clear(p.slot);
            self.stats.dirty_detected += 1;
            self.event(
                "detect",
                "eio",
                key,
                "a dirty page failed its checksum: reads get EIO and it is not written back".into(),
            );
        } else {
            self.stats.clean_detected += 1;
            self.drop_page(key);
            self.event(
                "detect",
                "reread",
                key,
                "a clean page failed its checksum: dropped, the next read comes from the store".into(),
            );
        }
        false
    }

    /// The page for a read, as (slot, used length, whether the strategy wants it checked
    /// now): from the cache or, on a miss, from the store (verified there). The caller
    /// checks the page while copying it (`copy_checked`); the hit path looks it up once.
    fn page_for_read(&mut self, ino: u64, block: u64, now: Instant) -> R<(usize, usize, bool)> {
        let key = (ino, block);
        if let Some(p) = self.pages.get_mut(&key) {
            if p.poisoned {
                return Err(libc::EIO);
            }
            let due = Self::should_verify(self.verify, p, now);
            if due {
                self.stats.checks += 1;
                p.last_check = now;
            }
            self.stats.hits += 1;
            p.last_use = now;
            p.referenced = true;
            return Ok((p.slot, p.len, due));
        }
        self.load(ino, block, now)?;
        let p = &self.pages[&key];
        // Loaded pages are compared with their CRC while they are copied too: the check
        // then covers the copy, not only the store read.
        Ok((p.slot, p.len, true))
    }

    /// Append the bytes `used` of page `key` (in `slot`, `len` used bytes) to `out`, with
    /// zeros for what lies past its used bytes; when `due`, the whole page is checked
    /// against its CRC in the same pass, so the bytes appended are exactly the bytes
    /// checked. Returns whether the page was intact (if not, `out` is as it was).
    fn copy_checked(
        &self,
        key: (u64, u64),
        (slot, len, due): (usize, usize, bool),
        used: Range<usize>,
        out: &mut Vec<u8>,
    ) -> bool {
        let page = &self.shared.page(slot)[..len];
        let stop = used.end.min(len).max(used.start);
        let data = used.start..stop;
        let mark = out.len();
        let intact = !due || {
            let before = crc32c(&page[..data.start]);
            let copied = crc32c_append_copy(before, out, &page[data.clone()]);
            crc32c_append(copied, &page[data.end..]) == self.pages[&key].crc
        };
        if !due {
            out.extend_from_slice(&page[data]);
        }
        if !intact {
            out.truncate(mark);
            return false;
        }
        out.resize(out.len() + used.end - stop, 0);
        true
    }

    /// Append the part `used` of block `block` (zeros after its used bytes up to
    /// `used.end`) to `out`, checked per strategy. A page that fails is acted on (`check`:
    /// a clean page is dropped and read again from the store, a dirty one poisoned).
    fn append_block(&mut self, ino: u64, block: u64, used: Range<usize>, now: Instant, out: &mut Vec<u8>) -> R<()> {
        for attempt in 0..2 {
            let page = self.page_for_read(ino, block, now)?;
            if self.copy_checked((ino, block), page, used.clone(), out) {
                return Ok(());
            }
            self.check((ino, block), now);
            if attempt == 1 || self.pages.get(&(ino, block)).is_some_and(|p| p.poisoned) {
                break;
            }
        }
        Err(libc::EIO)
    }

    /// Count and report what the store repaired while reading a block.
    fn note_repairs(&mut self, info: crate::store::ReadInfo, key: (u64, u64)) {
        if info.table_repaired {
            self.stats.table_repaired += 1;
            let why = "one copy of a checksum table chunk was damaged; rewritten from the other";
            self.event("repair", "table-copy", key, why.into());
        }
        if info.repaired {
            self.stats.disk_repaired += 1;
            let why = "a block on disk failed its checksum; repaired from the mirror";
            self.event("repair", "mirror", key, why.into());
        }
    }

    /// Bring block `block` of `ino` into the cache from the store (verified there). What a
    /// pending truncation cut off reads as zeros.
    fn load(&mut self, ino: u64, block: u64, now: Instant) -> R<()> {
        let f = self.files.get(&ino).ok_or(libc::EBADF)?;
        let start = block * PAGE as u64;
        let len = f.size.saturating_sub(start).min(PAGE as u64) as usize;
        let on_disk = f.disk_size.saturating_sub(start).min(PAGE as u64) as usize;
        let valid = f
            .cut
            .map_or(on_disk, |c| on_disk.min(c.saturating_sub(start) as usize))
            .min(len);
        let mut fetched = None;
        if valid > 0 {
            let (bytes, crc, info) = match self.store.read_block(&f.tables, &f.file, block, on_disk) {
                Ok(r) => r,
                Err(StoreError::Corrupt { .. }) => {
                    self.stats.disk_corrupt += 1;
                    self.event(
                        "disk-corrupt",
                        "eio",
                        (ino, block),
                        "a block on disk fails its checksum and has no good copy: EIO".into(),
                    );
                    return Err(libc::EIO);
                }
                Err(e) => return Err(e.errno()),
            };
            self.note_repairs(info, (ino, block));
            fetched = Some((bytes, crc));
        }
        self.stats.misses += 1;
        self.new_page((ino, block), now)?;
        let p = self.pages.get_mut(&(ino, block)).expect("just added");
        let d = self.shared.page_mut(p.slot);
        p.len = len;
        p.crc = match fetched {
            // The whole block as the store verified it, then zeros up to the file's size.
            Some((bytes, crc)) if valid == on_disk => {
                d[..valid].copy_from_slice(&bytes);
                crc::extend(crc, &[0u8; PAGE][..len - valid])
            }
            // Part of it was cut off: computed afresh from bytes verified just now.
            Some((bytes, _)) => {
                d[..valid].copy_from_slice(&bytes[..valid]);
                crc32c(&d[..len])
            }
            None => crc::zeros(len),
        };
        Ok(())
    }

    /// Make room: write back (if dirty) and drop a page not used lately (the first the
    /// clock hand finds unreferenced), never a poisoned one.
    fn evict_one(&mut self) -> R<()> {
        let slots = self.slot_keys.len();
        let mut victim = None;
        // Two sweeps: the first may only clear reference bits.
        for _ in 0..2 * slots {
            self.hand = (self.hand + 1) % slots;
            let Some(key) = self.slot_keys[self.hand] else { continue };
            let Some(p) = self.pages.get_mut(&key) else { continue };
            if p.poisoned {
                continue;
            }
            if p.referenced {
                p.referenced = false;
                continue;
            }
            victim = Some(key);
            break;
        }
        let Some(key) = victim else { return Err(libc::ENOMEM) };
        if self.pages.get(&key).is_some_and(|p| p.dirty.is_some()) {
            // The file's other dirty pages under the same table chunk go along: one table
            // update instead of one per evicted page.
            let chunk = key.1 / SLOTS * SLOTS;
            let f = self.files.get(&key.0).ok_or(libc::EBADF)?;
            let blocks: Vec<u64> = f
                .dirty
                .range(chunk..chunk + SLOTS)
                .copied()
                .filter(|&b| self.pages.get(&(key.0, b)).is_some_and(|p| !p.poisoned))
                .collect();
            self.write_back(key.0, &blocks)?;
        }
        self.drop_page(key);
        self.stats.evicted += 1;
        Ok(())
    }

    pub fn read(&mut self, ino: u64, off: u64, size: usize) -> R<Vec<u8>> {
        let mut out = Vec::with_capacity(size);
        self.read_append(ino, off, size, &mut out)?;
        Ok(out)
    }

    /// Append `size` bytes at `off` (fewer at the end of the file) to `out`. Each page is
    /// checked per strategy in the same pass that copies it, so what is appended is what
    /// was checked. All pages are found first, so that the copy can prefetch the next one.
    pub fn read_append(&mut self, ino: u64, off: u64, size: usize, out: &mut Vec<u8>) -> R<()> {
        self.stats.reads += 1;
        let now = Instant::now();
        let fsize = self.files.get(&ino).ok_or(libc::EBADF)?.size;
        let end = (off + size as u64).min(fsize);
        if off >= end {
            return Ok(());
        }
        let blocks = || {
            let page = PAGE as u64;
            (off / page..end.div_ceil(page)).map(move |block| {
                let start = off.max(block * page) - block * page;
                let stop = end.min((block + 1) * page) - block * page;
                (block, start as usize..stop as usize)
            })
        };
        let mut spans = std::mem::take(&mut self.spans);
        spans.clear();
        let evicted = self.stats.evicted;
        let found = blocks().try_for_each(|(block, _)| {
            spans.push(self.page_for_read(ino, block, now)?);
            Ok(())
        });
        let result = found.and_then(|()| {
            out.reserve(end.saturating_sub(off) as usize);
            for (i, (block, used)) in blocks().enumerate() {
                if self.stats.evicted != evicted {
                    // Finding a page evicted one found earlier (a cache smaller than one
                    // request): from here on each page is found again just before its copy.
                    self.append_block(ino, block, used, now, out)?;
                    continue;
                }
                if let Some(&(next, _, _)) = spans.get(i + 1) {
                    self.shared.prefetch(next);
                }
                if !self.copy_checked((ino, block), spans[i], used.clone(), out) {
                    self.check((ino, block), now);
                    self.append_block(ino, block, used, now, out)?;
                }
            }
            Ok(())
        });
        self.spans = spans;
        if result == Err(libc::EIO) {
            self.stats.eio += 1;
        }
        result
    }

    // `load` inserts the page itself (after reading it from the store), so the entry API
    // does not fit here.
    #[allow(clippy::map_entry)]
    pub fn write(&mut self, ino: u64, off: u64, data: &[u8]) -> R<usize> {
        self.stats.writes += 1;
        let now = Instant::now();
        let fsize = self.files.get(&ino).ok_or(libc::EBADF)?.size;
        let end = off + data.len() as u64;
        if end > fsize {
            self.grow_last_block(ino, fsize, end, now)?;
        }
        let mut done = 0;
        while done < data.len() {
            let pos = off + done as u64;
            let block = pos / PAGE as u64;
            let start = (pos % PAGE as u64) as usize;
            let n = (PAGE - start).min(data.len() - done);
            let chunk = &data[done..done + n];
            let key = (ino, block);
            let whole = start == 0 && n == PAGE;
            if !self.pages.contains_key(&key) {
                if !whole && block * (PAGE as u64) < fsize {
                    self.load(ino, block, now).inspect_err(|&e| {
                        if e == libc::EIO {
                            self.stats.eio += 1;
                        }
                    })?;
                } else {
                    self.new_page(key, now)?;
                }
            }
            let p = self.pages.get_mut(&key).expect("page present");
            let d = self.shared.page_mut(p.slot);
            if whole || (start == 0 && n >= p.len) {
                // Everything in use is replaced: a fresh CRC, and a poisoned page heals.
                d[..n].copy_from_slice(chunk);
                d[n..].fill(0);
                p.len = n;
                p.crc = crc32c(&d[..n]);
                p.poisoned = false;
            } else {
                let overlap_end = (start + n).min(p.len);
                if start < overlap_end {
                    let m = overlap_end - start;
                    p.crc = crc::patch(p.crc, p.len, start, &d[start..overlap_end], &chunk[..m]);
                    d[start..overlap_end].copy_from_slice(&chunk[..m]);
                }
                if start > p.len {
                    let gap = start - p.len;
                    d[p.len..start].fill(0);
                    p.crc = crc::extend(p.crc, &[0u8; PAGE][..gap]);
                    p.len = start;
                }
                let from = overlap_end.max(start);
                if start + n > from {
                    let rest = &chunk[from - start..];
                    d[from..start + n].copy_from_slice(rest);
                    p.crc = crc::extend(p.crc, rest);
                    p.len = start + n;
                }
            }
            self.mark_dirty(key, now);
            self.record(key);
            self.touch(key, now);
            done += n;
        }
        let f = self.files.get_mut(&ino).expect("attached");
        f.size = f.size.max(off + data.len() as u64);
        Ok(data.len())
    }

    /// The file grows from `old` to `new` bytes: its old last block, if partly used, now
    /// has more bytes in use (zeros until written). Its CRC grows with them, in the cache,
    /// so that the CRC stored on write-back covers the block's new used part.
    fn grow_last_block(&mut self, ino: u64, old: u64, new: u64, now: Instant) -> R<()> {
        if old.is_multiple_of(PAGE as u64) {
            return Ok(());
        }
        let block = old / PAGE as u64;
        self.page_for_read(ino, block, now)?;
        let p = self.pages.get_mut(&(ino, block)).expect("loaded");
        let new_len = ((new - block * PAGE as u64).min(PAGE as u64)) as usize;
        if new_len > p.len {
            self.shared.page_mut(p.slot)[p.len..new_len].fill(0);
            p.crc = crc::extend(p.crc, &[0u8; PAGE][..new_len - p.len]);
            p.len = new_len;
            self.mark_dirty((ino, block), now);
            self.record((ino, block));
        }
        Ok(())
    }

    /// Write dirty pages of `ino` back (`blocks`, sorted), after checking each: a page that
    /// fails is poisoned and never written (EIO). The rest go to the store together, so
    /// that each table chunk is updated once.
    fn write_back(&mut self, ino: u64, blocks: &[u64]) -> R<()> {
        let now = Instant::now();
        let mut result = Ok(());
        let mut good = Vec::with_capacity(blocks.len());
        for &b in blocks {
            if self.check((ino, b), now) {
                good.push(b);
            } else {
                result = Err(libc::EIO);
            }
        }
        if good.is_empty() {
            return result;
        }
        self.apply_size(ino)?;
        let f = self.files.get_mut(&ino).ok_or(libc::EBADF)?;
        let (pages, shared) = (&self.pages, &self.shared);
        let writes: Vec<WriteBlock> = good
            .iter()
            .map(|&block| {
                let p = &pages[&(ino, block)];
                WriteBlock {
                    block,
                    bytes: &shared.page(p.slot)[..p.len],
                    crc: p.crc,
                }
            })
            .collect();
        self.store
            .write_blocks(&mut f.tables, &f.file, &writes)
            .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
        let end = writes
            .iter()
            .map(|w| w.block * PAGE as u64 + w.bytes.len() as u64)
            .max();
        f.disk_size = f.disk_size.max(end.unwrap_or(0));
        drop(writes);
        for block in good {
            let slot = self.pages[&(ino, block)].slot;
            self.shared.clear(slot);
            self.mark_clean((ino, block));
            self.stats.written_back += 1;
        }
        result
    }

    /// Write back dirty pages of `ino` (all inodes if None) that are at least `age` old.
    /// Returns EIO if any of them is poisoned.
    pub fn flush(&mut self, ino: Option<u64>, age: Duration) -> R<()> {
        let now = Instant::now();
        let inos: Vec<u64> = match ino {
            Some(i) => vec![i],
            None => self
                .files
                .iter()
                .filter(|(_, f)| !f.dirty.is_empty() || f.resized.is_some())
                .map(|(i, _)| *i)
                .collect(),
        };
        let mut result = Ok(());
        for &i in &inos {
            if self.size_due(i, now, age) {
                if let Err(e) = self.apply_size(i) {
                    result = Err(e);
                }
            }
        }
        for i in inos {
            let blocks = self.due_blocks(i, now, age, usize::MAX);
            if !blocks.is_empty() {
                if let Err(e) = self.write_back(i, &blocks) {
                    result = Err(e);
                }
            }
        }
        if let Some(i) = ino {
            let f = self.files.get(&i);
            if f.is_some_and(|f| {
                f.dirty
                    .iter()
                    .any(|&b| self.pages.get(&(i, b)).is_some_and(|p| p.poisoned))
            }) {
                self.stats.eio += 1;
                return Err(libc::EIO);
            }
        }
        result
    }

    /// Write back up to `max` dirty pages that are at least `age` old (after any truncations
    /// that are due); returns whether more are due. The flusher calls it in rounds and lets
    /// go of the cache in between, so that requests do not wait behind a large write-back.
    pub fn flush_some(&mut self, age: Duration, max: usize) -> bool {
        let now = Instant::now();
        let resized: Vec<u64> = self
            .files
            .keys()
            .copied()
            .filter(|&i| self.size_due(i, now, age))
            .collect();
        for i in resized {
            // A failed size change stays pending: retried next round, reported by fsync.
            let _ = self.apply_size(i);
        }
        let dirty: Vec<u64> = self
            .files
            .iter()
            .filter(|(_, f)| !f.dirty.is_empty())
            .map(|(i, _)| *i)
            .collect();
        let mut budget = max;
        for i in dirty {
            let blocks = self.due_blocks(i, now, age, budget);
            if blocks.is_empty() {
                continue;
            }
            budget -= blocks.len();
            // A failure stays dirty (or poisoned) and is retried or reported by fsync.
            let _ = self.write_back(i, &blocks);
            if budget == 0 {
                return true;
            }
        }
        false
    }

    /// Whether `ino` has a pending size change at least `age` old at `now`.
    fn size_due(&self, ino: u64, now: Instant, age: Duration) -> bool {
        self.files
            .get(&ino)
            .and_then(|f| f.resized)
            .is_some_and(|t| now.duration_since(t) >= age)
    }

    /// Up to `limit` dirty blocks of `ino` (in order), not poisoned, dirty for at least
    /// `age` at `now`.
    fn due_blocks(&self, ino: u64, now: Instant, age: Duration, limit: usize) -> Vec<u64> {
        let Some(f) = self.files.get(&ino) else {
            return Vec::new();
        };
        f.dirty
            .iter()
            .copied()
            .filter(|&b| {
                self.pages
                    .get(&(ino, b))
                    .is_some_and(|p| !p.poisoned && p.dirty.is_some_and(|d| now.duration_since(d) >= age))
            })
            .take(limit)
            .collect()
    }

    /// fsync: write back and make durable.
    pub fn fsync(&mut self, ino: u64) -> R<()> {
        self.flush(Some(ino), Duration::ZERO)?;
        let Some(f) = self.files.get(&ino) else { return Ok(()) };
        f.file.sync_data().map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
        self.store
            .sync(&f.tables)
            .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))
    }

    /// Cut or extend `ino` to `size`. Like a write, it happens in the cache and reaches the
    /// store later (recorded in the Dirty State Store meanwhile), so that a refused recovery
    /// leaves the file as it last was in the store: an O_TRUNC is undone with the rest.
    pub fn truncate(&mut self, ino: u64, size: u64) -> R<()> {
        let now = Instant::now();
        let old = self.files.get(&ino).ok_or(libc::EBADF)?.size;
        // The block whose used part changes: the new last one when cutting, the old last
        // one when extending.
        let edge = size.min(old);
        if edge % PAGE as u64 != 0 {
            let block = edge / PAGE as u64;
            let key = (ino, block);
            self.page_for_read(ino, block, now)?;
            // Checked whatever the strategy: the CRC is recomputed from these bytes.
            if !self.check(key, now) {
                self.page_for_read(ino, block, now)?;
            }
            let p = self.pages.get_mut(&key).expect("loaded");
            let new_len = ((size - block * PAGE as u64).min(PAGE as u64)) as usize;
            let d = self.shared.page_mut(p.slot);
            if new_len < p.len {
                d[new_len..].fill(0);
                p.crc = crc32c(&d[..new_len]);
            } else {
                p.crc = crc::extend(p.crc, &[0u8; PAGE][..new_len - p.len]);
            }
            p.len = new_len;
            self.mark_dirty(key, now);
            self.record(key);
        }
        self.drop_pages(ino, size.div_ceil(PAGE as u64));
        let f = self.files.get_mut(&ino).expect("attached");
        if size < old {
            f.cut = Some(f.cut.map_or(size, |c| c.min(size)));
        }
        f.size = size;
        f.resized.get_or_insert(now);
        let record = SizeRecord { ino, cut: f.cut, size };
        if !self.shared.set_size(record) {
            self.apply_size(ino)?;
        }
        Ok(())
    }

    /// Carry a pending truncation to the store: cut to the lowest size, then extend to the
    /// size now. The block at the cut, if partly kept, is a dirty page written right after.
    fn apply_size(&mut self, ino: u64) -> R<()> {
        let Some(f) = self.files.get_mut(&ino) else {
            return Ok(());
        };
        if f.resized.is_none() {
            return Ok(());
        }
        let io = |e: std::io::Error| e.raw_os_error().unwrap_or(libc::EIO);
        if let Some(c) = f.cut {
            self.store.truncate(&f.tables, &f.file, c).map_err(io)?;
            f.disk_size = c;
        }
        if f.size != f.disk_size {
            self.store.truncate(&f.tables, &f.file, f.size).map_err(io)?;
            f.disk_size = f.size;
        }
        f.cut = None;
        f.resized = None;
        self.shared.clear_size(ino);
        Ok(())
    }

    /// Drop the cached pages of `ino` from block `from` on, dirty or not.
    fn drop_pages(&mut self, ino: u64, from: u64) {
        let gone: Vec<_> = self
            .pages
            .range((ino, from)..=(ino, u64::MAX))
            .map(|(k, _)| *k)
            .collect();
        for k in gone {
            self.drop_page(k);
        }
    }

    /// The file is gone (its last link was removed and it is closed): drop its pages and
    /// close it. `orphan_tables`: its tables may be among the orphans, and go too.
    pub fn remove(&mut self, ino: u64, orphan_tables: bool) {
        let no_tables = self.has_tables(ino) == Some(false);
        self.drop_pages(ino, 0);
        self.shared.clear_size(ino);
        self.detach(ino);
        if orphan_tables && !no_tables {
            self.store.orphan_gone(ino);
        }
    }

    /// The kernel forgot the inode: write back its pages and close its file.
    pub fn release_inode(&mut self, ino: u64) {
        // Pages that fail stay dirty (or poisoned) and keep the file open below.
        let _ = self.flush(Some(ino), Duration::ZERO);
        if self.files.get(&ino).is_some_and(|f| f.idle()) {
            self.drop_pages(ino, 0);
            self.detach(ino);
        }
    }

    /// Check the next `n` pages in key order (the background scrubber).
    pub fn scrub(&mut self, n: usize) {
        let now = Instant::now();
        let mut keys: Vec<(u64, u64)> = self
            .pages
            .range((std::ops::Bound::Excluded(self.scrub_cursor), std::ops::Bound::Unbounded))
            .map(|(k, _)| *k)
            .take(n)
            .collect();
        if keys.len() < n {
            // Wrapped around: on from the start.
            keys.extend(self.pages.keys().take(n - keys.len()).copied());
        }
        for key in keys {
            self.stats.scrubbed += 1;
            self.check(key, now);
            self.scrub_cursor = key;
        }
    }

    /// Test-only: flip one bit in each of `n` cached pages chosen by `pick` among those
    /// with data (`dirty`: only dirty pages, Some(false): only clean ones). The CRC is not
    /// updated, as a memory error would not. Returns how many pages were hit.
    pub fn inject_flips(&mut self, n: usize, dirty: Option<bool>, mut rand: impl FnMut() -> u64) -> usize {
        let mut keys: Vec<(u64, u64)> = self
            .pages
            .iter()
            .filter(|(_, p)| p.len > 0 && !p.poisoned && dirty.is_none_or(|d| p.dirty.is_some() == d))
            .map(|(k, _)| *k)
            .collect();
        keys.sort_unstable();
        let mut hit = 0;
        for _ in 0..n {
            if keys.is_empty() {
                break;
            }
            let key = keys.swap_remove((rand() % keys.len() as u64) as usize);
            let p = self.pages.get_mut(&key).expect("listed");
            let bit = rand() % (p.len as u64 * 8);
            self.shared.page_mut(p.slot)[(bit / 8) as usize] ^= 1 << (bit % 8);
            hit += 1;
        }
        self.stats.injected += hit as u64;
        hit
    }

    pub fn dirty_pages(&self) -> usize {
        debug_assert_eq!(
            self.dirty_count,
            self.pages.values().filter(|p| p.dirty.is_some()).count()
        );
        self.dirty_count
    }

    pub fn cached_pages(&self) -> usize {
        self.pages.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::OpenOptions;

    /// A cache over a fresh store with one attached file `f` (inode 1).
    pub(super) fn cache_with(tag: &str, verify: Verify, bytes: u64) -> (Cache, std::path::PathBuf) {
        let d = std::env::temp_dir().join(format!("lockstep-fs-cache-{tag}-{}", std::process::id()));
        // (a leftover from an earlier run, if any)
        let _ = std::fs::remove_dir_all(&d);
        crate::store::require_store(&d, "store").unwrap();
        let store = Store::open(&d, None).unwrap();
        let path = store.root().join("f");
        let mut c = Cache::with_memory(store, bytes, verify).unwrap();
        let p2 = path.clone();
        c.attach(1, move |s| {
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&p2)?;
            let size = f.metadata()?.len();
            Ok((f, s.tables(crate::store::Place::Path(std::path::Path::new("f")))?, size))
        })
        .unwrap();
        (c, path)
    }

    fn cache(tag: &str, verify: Verify) -> (Cache, std::path::PathBuf) {
        cache_with(tag, verify, 1 << 20)
    }

    /// The seeded generator as the closure `inject_flips` takes, for picking pages and bits.
    fn rand_fn(seed: u64) -> impl FnMut() -> u64 {
        let mut rng = lockstep_core::rng::Rng::new(seed);
        move || rng.next_u64()
    }

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
    }

    #[test]
    fn reads_at_or_past_the_end_return_nothing_and_partial_pages_are_checked_whole() {
        let (mut c, _) = cache("eof", Verify::EveryRead);
        c.write(1, 0, &pattern(58_200, 4)).unwrap();
        for off in [58_200, 59_149, 1 << 40] {
            assert_eq!(c.read(1, off, 2435).unwrap(), Vec::<u8>::new(), "read at {off}");
        }
        assert_eq!(c.read(1, 57_000, 4096).unwrap(), pattern(58_200, 4)[57_000..]);
        // A flip outside the bytes asked for still fails the page's check.
        let slot = c.pages[&(1, 0)].slot;
        c.shared.page_mut(slot)[4000] ^= 1;
        assert_eq!(c.read(1, 10, 20), Err(libc::EIO));
        assert_eq!(c.stats.dirty_detected, 1);
    }

    #[test]
    fn writes_read_back_through_cache_and_store() {
        let (mut c, _) = cache("rw", Verify::EveryRead);
        let a = pattern(10_000, 1);
        c.write(1, 0, &a).unwrap();
        c.write(1, 5000, &pattern(100, 2)).unwrap(); // overwrite inside
        c.write(1, 12_000, &pattern(10, 3)).unwrap(); // past the end: a gap of zeros
        let mut want = a.clone();
        want[5000..5100].copy_from_slice(&pattern(100, 2));
        want.resize(12_000, 0);
        want.extend_from_slice(&pattern(10, 3));
        assert_eq!(c.read(1, 0, 20_000).unwrap(), want);
        c.flush(None, Duration::ZERO).unwrap();
        // Drop everything cached: the store's copy reads back the same.
        let keys: Vec<_> = c.pages.keys().copied().collect();
        for k in keys {
            c.drop_page(k);
        }
        assert_eq!(c.read(1, 0, 20_000).unwrap(), want);
        c.truncate(1, 7000).unwrap();
        assert_eq!(c.read(1, 0, 20_000).unwrap(), want[..7000]);
        c.truncate(1, 9000).unwrap();
        let mut grown = want[..7000].to_vec();
        grown.resize(9000, 0);
        assert_eq!(c.read(1, 0, 20_000).unwrap(), grown);
    }

    #[test]
    fn a_flip_in_a_clean_page_is_caught_and_reread() {
        let (mut c, _) = cache("clean", Verify::EveryRead);
        let a = pattern(8192, 4);
        c.write(1, 0, &a).unwrap();
        c.flush(None, Duration::ZERO).unwrap();
        assert_eq!(c.inject_flips(1, Some(false), rand_fn(7)), 1);
        assert_eq!(c.read(1, 0, 8192).unwrap(), a);
        assert_eq!(c.stats.clean_detected, 1);
    }

    #[test]
    fn a_flip_in_a_dirty_page_gives_eio_and_is_never_written_back() {
        let (mut c, path) = cache("dirty", Verify::EveryRead);
        let a = pattern(4096, 5);
        c.write(1, 0, &a).unwrap();
        c.flush(None, Duration::ZERO).unwrap();
        c.write(1, 0, &pattern(4096, 6)).unwrap();
        c.inject_flips(1, Some(true), rand_fn(3));
        assert_eq!(c.read(1, 0, 4096), Err(libc::EIO));
        assert_eq!(c.fsync(1), Err(libc::EIO));
        // The disk still has the last good version, not the corrupt one.
        assert_eq!(std::fs::read(path).unwrap(), a);
        // Overwriting the whole page heals it.
        c.write(1, 0, &pattern(4096, 7)).unwrap();
        assert_eq!(c.read(1, 0, 4096).unwrap(), pattern(4096, 7));
        assert!(c.fsync(1).is_ok());
    }

    #[test]
    fn the_scrubber_finds_flips_without_reads() {
        let (mut c, _) = cache("scrub", Verify::None);
        c.write(1, 0, &pattern(40_000, 8)).unwrap();
        c.flush(None, Duration::ZERO).unwrap();
        c.inject_flips(3, None, rand_fn(11));
        c.scrub(100);
        assert_eq!(c.stats.clean_detected, 3);
        assert_eq!(c.read(1, 0, 40_000).unwrap(), pattern(40_000, 8));
    }
}

#[cfg(test)]
mod model_tests {
    use super::*;

    /// Random writes, truncates, write-backs and evictions against a Vec model.
    #[test]
    fn random_operations_match_a_model() {
        // A small cache: pages are evicted and read back from the store.
        let (mut c, _) = super::tests::cache_with("model", Verify::EveryRead, 16 * PAGE as u64);
        let mut model: Vec<u8> = Vec::new();
        let mut rng = lockstep_core::rng::Rng::new(0x1234_5678_9abc_def1);
        let mut next = || rng.next_u64();
        for op in 0..4000 {
            match next() % 6 {
                0..=2 => {
                    let off = (next() % 200_000) as usize;
                    let n = 1 + (next() % 20_000) as usize;
                    let data: Vec<u8> = (0..n).map(|_| next() as u8).collect();
                    c.write(1, off as u64, &data)
                        .unwrap_or_else(|e| panic!("op {op}: write {off}+{n}: {e}"));
                    if model.len() < off + n {
                        model.resize(off + n, 0);
                    }
                    model[off..off + n].copy_from_slice(&data);
                }
                3 => {
                    let size = (next() % 220_000) as usize;
                    c.truncate(1, size as u64)
                        .unwrap_or_else(|e| panic!("op {op}: truncate {size}: {e}"));
                    model.resize(size, 0);
                }
                4 => c
                    .flush(None, Duration::ZERO)
                    .unwrap_or_else(|e| panic!("op {op}: flush: {e}")),
                _ => {
                    let got = c.read(1, 0, 300_000).unwrap_or_else(|e| panic!("op {op}: read: {e}"));
                    assert!(
                        got == model,
                        "op {op}: content differs ({} vs {} bytes)",
                        got.len(),
                        model.len()
                    );
                }
            }
        }
    }
}

//! Memory that outlives the cache daemon: a memfd that the supervisor holds, mapped by
//! each daemon it starts. It holds the page slab (every cached page's data) and the Dirty
//! State Store (Loris §V-B): one record per page slot, naming the dirty page in it (inode,
//! block, used length, CRC) and protected by its own CRC. After a crash, the next daemon
//! finds every dirty page through the records, checks each record and each page against
//! its CRC, and writes them back, or refuses.
//!
//! It also keeps the file handle (`name_to_handle_at`) of every inode the kernel holds,
//! so that a restarted daemon can reopen inodes by the numbers the kernel still uses.
//!
//! Truncations are delayed like dirty data (so that a refused recovery leaves a file as
//! its last good version, O_TRUNC included): a size record per file with a pending size
//! change holds the lowest size it was cut to and its size now.
//!
//! Layout: a 4 KiB header, then `slots` records of 32 bytes (rounded up to whole pages),
//! then `SIZES` size records of 32 bytes, then the handle table (`HANDLES` entries of 64
//! bytes), then `slots` pages of 4 KiB.

use crate::crc::PAGE;
use lockstep_core::checksum::crc32c;
use lockstep_core::le;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

const MAGIC: u64 = 0x4C53_4653_5353_0001; // "LSFSSS" v1
const RECORD: usize = 32;
const DIRTY: u32 = 2;
/// Entries in the handle table (open addressing with linear probing; 64 MiB of address
/// space, touched only where used). An inode whose entry finds no free place within
/// `PROBE_MAX` of its home still works, but cannot be reopened after a daemon crash.
const HANDLES: usize = 1 << 20;
/// The longest probe sequence: lookups, inserts and deletes cost at most this many entries
/// however full the table is.
const PROBE_MAX: usize = 64;
const HANDLE: usize = 64;
/// The longest file handle kept (ext4 and tmpfs handles are 8 to 12 bytes).
pub const HANDLE_MAX: usize = 40;
/// Size records: files with a pending truncation at once (more are applied at once).
const SIZES: usize = 4096;
const SIZE_STATE: u32 = 3;
const EMPTY: u64 = 0;

/// A pending size change as the DSS knows it: the file was cut to `cut` (if it was) and
/// is `size` bytes now; neither has reached the store yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SizeRecord {
    pub ino: u64,
    pub cut: Option<u64>,
    pub size: u64,
}

/// A dirty page as the DSS knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DirtyRecord {
    pub slot: usize,
    pub ino: u64,
    pub block: u64,
    pub len: usize,
    pub crc: u32,
}

pub struct Shared {
    fd: OwnedFd,
    base: *mut u8,
    size: usize,
    slots: usize,
}

// SAFETY: the mapping is only accessed through &self/&mut self of the one Cache that owns it.
unsafe impl Send for Shared {}

fn records_bytes(slots: usize) -> usize {
    (slots * RECORD).div_ceil(PAGE) * PAGE
}

fn sizes_at(slots: usize) -> usize {
    PAGE + records_bytes(slots)
}

fn handles_at(slots: usize) -> usize {
    sizes_at(slots) + SIZES * RECORD
}

fn pages_at(slots: usize) -> usize {
    handles_at(slots) + HANDLES * HANDLE
}

/// The most slots a region may have: far above any machine's memory, and low enough that
/// the layout arithmetic above cannot overflow.
const MAX_SLOTS: usize = isize::MAX as usize / (4 * PAGE);

/// Bytes of a region for `slots` pages, or None above MAX_SLOTS: a slot count read from a
/// corrupt header must not wrap around into a size that happens to match the file.
fn region_size(slots: usize) -> Option<usize> {
    (slots <= MAX_SLOTS).then(|| pages_at(slots) + slots * PAGE)
}

impl Shared {
    /// A new region for `slots` pages (the supervisor creates it once per mount).
    pub fn create(slots: usize) -> std::io::Result<Shared> {
        assert!(slots > 0);
        // SAFETY: plain syscall with a static name.
        let fd = unsafe { libc::memfd_create(c"lockstep-fs-cache".as_ptr(), 0) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: fd was just returned by memfd_create and nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let size = region_size(slots).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{slots} cache pages do not fit in memory"),
            )
        })?;
        // SAFETY: valid fd.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let mut s = Shared::map(fd, size, slots)?;
        s.header_mut()[..8].copy_from_slice(&MAGIC.to_le_bytes());
        s.header_mut()[8..16].copy_from_slice(&(slots as u64).to_le_bytes());
        Ok(s)
    }

    /// Map a region created earlier (by the supervisor, for a restarted daemon).
    pub fn open(fd: OwnedFd) -> std::io::Result<Shared> {
        // SAFETY: libc::stat is plain data, for which all-zero bytes are a valid value.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: valid fd and output struct.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let mut head = [0u8; 16];
        // SAFETY: reads 16 bytes into a local buffer.
        if unsafe { libc::pread(fd.as_raw_fd(), head.as_mut_ptr().cast(), 16, 0) } != 16 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "short shared region",
            ));
        }
        let magic = le::u64_at(&head, 0);
        let slots = le::u64_at(&head, 8) as usize;
        let size = st.st_size as usize;
        if magic != MAGIC || slots == 0 || region_size(slots) != Some(size) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "the shared region's header is corrupt",
            ));
        }
        Shared::map(fd, size, slots)
    }

    fn map(fd: OwnedFd, size: usize, slots: usize) -> std::io::Result<Shared> {
        // SAFETY: mapping a memfd of `size` bytes, shared.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Shared {
            fd,
            base: p.cast(),
            size,
            slots,
        })
    }

    pub fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    pub fn slots(&self) -> usize {
        self.slots
    }

    fn header_mut(&mut self) -> &mut [u8] {
        // SAFETY: the first page is the header, inside the mapping.
        unsafe { std::slice::from_raw_parts_mut(self.base, PAGE) }
    }

    fn record(&self, slot: usize) -> &[u8] {
        assert!(slot < self.slots);
        // SAFETY: inside the records area.
        unsafe { std::slice::from_raw_parts(self.base.add(PAGE + slot * RECORD), RECORD) }
    }

    fn record_mut(&mut self, slot: usize) -> &mut [u8] {
        assert!(slot < self.slots);
        // SAFETY: inside the records area; &mut self makes it exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.base.add(PAGE + slot * RECORD), RECORD) }
    }

    pub fn page(&self, slot: usize) -> &[u8; PAGE] {
        assert!(slot < self.slots);
        // SAFETY: inside the page area, page-aligned.
        unsafe { &*(self.base.add(pages_at(self.slots) + slot * PAGE) as *const [u8; PAGE]) }
    }

    /// Ask the CPU to start loading the page in `slot`: a read copies pages from scattered
    /// slots, and the hardware prefetcher does not follow a stream across 4 KiB.
    pub fn prefetch(&self, slot: usize) {
        #[cfg(target_arch = "x86_64")]
        for line in self.page(slot).chunks(64) {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            // SAFETY: a hint about a valid address; it changes nothing architecturally.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(line.as_ptr() as *const i8) };
        }
    }

    pub fn page_mut(&mut self, slot: usize) -> &mut [u8; PAGE] {
        assert!(slot < self.slots);
        // SAFETY: as above; &mut self makes it exclusive.
        unsafe { &mut *(self.base.add(pages_at(self.slots) + slot * PAGE) as *mut [u8; PAGE]) }
    }

    /// Record that `slot` holds a dirty page (or update its length and CRC).
    pub fn set_dirty(&mut self, r: DirtyRecord) {
        let rec = self.record_mut(r.slot);
        rec[0..4].copy_from_slice(&DIRTY.to_le_bytes());
        rec[4..8].copy_from_slice(&(r.len as u32).to_le_bytes());
        rec[8..16].copy_from_slice(&r.ino.to_le_bytes());
        rec[16..24].copy_from_slice(&r.block.to_le_bytes());
        rec[24..28].copy_from_slice(&r.crc.to_le_bytes());
        let sum = crc32c(&rec[..28]);
        rec[28..32].copy_from_slice(&sum.to_le_bytes());
    }

    /// The page in `slot` is clean (or gone): nothing to recover there.
    pub fn clear(&mut self, slot: usize) {
        self.record_mut(slot).fill(0);
    }

    /// Every dirty record, verified. `Err(slot)` names the first record that fails its
    /// CRC or says something impossible.
    pub fn dirty_records(&self) -> Result<Vec<DirtyRecord>, usize> {
        let mut out = Vec::new();
        for slot in 0..self.slots {
            let rec = self.record(slot);
            if rec.iter().all(|&b| b == 0) {
                continue;
            }
            let sum = le::u32_at(rec, 28);
            let state = le::u32_at(rec, 0);
            let len = le::u32_at(rec, 4) as usize;
            if crc32c(&rec[..28]) != sum || state != DIRTY || len > PAGE {
                return Err(slot);
            }
            out.push(DirtyRecord {
                slot,
                ino: le::u64_at(rec, 8),
                block: le::u64_at(rec, 16),
                len,
                crc: le::u32_at(rec, 24),
            });
        }
        Ok(out)
    }

    fn size_entry(&self, i: usize) -> &[u8] {
        assert!(i < SIZES);
        // SAFETY: inside the size records.
        unsafe { std::slice::from_raw_parts(self.base.add(sizes_at(self.slots) + i * RECORD), RECORD) }
    }

    fn size_entry_mut(&mut self, i: usize) -> &mut [u8] {
        assert!(i < SIZES);
        // SAFETY: inside the size records; &mut self makes it exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.base.add(sizes_at(self.slots) + i * RECORD), RECORD) }
    }

    fn find_size(&self, ino: u64) -> Option<usize> {
        (0..SIZES).find(|&i| le::u64_at(self.size_entry(i), 0) == ino)
    }

    /// Record a pending size change of `r.ino`. False if the table is full (the caller then
    /// applies the change to the store at once).
    pub fn set_size(&mut self, r: SizeRecord) -> bool {
        assert!(r.ino != EMPTY);
        let Some(i) = self.find_size(r.ino).or_else(|| self.find_size(EMPTY)) else {
            return false;
        };
        let e = self.size_entry_mut(i);
        e[..8].copy_from_slice(&r.ino.to_le_bytes());
        e[8..16].copy_from_slice(&r.cut.unwrap_or(u64::MAX).to_le_bytes());
        e[16..24].copy_from_slice(&r.size.to_le_bytes());
        e[24..28].copy_from_slice(&SIZE_STATE.to_le_bytes());
        let sum = crc32c(&e[..28]);
        e[28..32].copy_from_slice(&sum.to_le_bytes());
        true
    }

    /// The size change of `ino` reached the store.
    pub fn clear_size(&mut self, ino: u64) {
        if let Some(i) = self.find_size(ino) {
            self.size_entry_mut(i).fill(0);
        }
    }

    /// Every pending size change, verified; `Err(i)` names the first damaged record.
    pub fn size_records(&self) -> Result<Vec<SizeRecord>, usize> {
        let mut out = Vec::new();
        for i in 0..SIZES {
            let e = self.size_entry(i);
            if e.iter().all(|&b| b == 0) {
                continue;
            }
            let word = |a: usize| le::u64_at(e, a);
            let state = le::u32_at(e, 24);
            let sum = le::u32_at(e, 28);
            if crc32c(&e[..28]) != sum || state != SIZE_STATE || word(0) == EMPTY {
                return Err(i);
            }
            let cut = word(8);
            out.push(SizeRecord {
                ino: word(0),
                cut: (cut != u64::MAX).then_some(cut),
                size: word(16),
            });
        }
        Ok(out)
    }

    fn handle_entry(&mut self, i: usize) -> &mut [u8] {
        // SAFETY: inside the handle table; &mut self makes it exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.base.add(handles_at(self.slots) + i * HANDLE), HANDLE) }
    }

    /// Where `nodeid`'s probe sequence starts (the top bits of a multiplicative hash).
    fn home(nodeid: u64) -> usize {
        (nodeid.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - HANDLES.trailing_zeros())) as usize
    }

    fn entry_id(&mut self, i: usize) -> u64 {
        le::u64_at(self.handle_entry(i), 0)
    }

    /// Find the entry of `nodeid`, or (with `insert`) a free one for it, within
    /// `PROBE_MAX` of its home. Deletion shifts entries back (no tombstones), so an empty
    /// entry ends every search.
    fn find_handle(&mut self, nodeid: u64, insert: bool) -> Option<usize> {
        let mut i = Self::home(nodeid);
        for _ in 0..PROBE_MAX {
            let id = self.entry_id(i);
            if id == nodeid {
                return Some(i);
            }
            if id == EMPTY {
                return insert.then_some(i);
            }
            i = (i + 1) % HANDLES;
        }
        None
    }

    /// Empty entry `hole`, moving later entries of its cluster back into it where their
    /// probe sequences allow, so that no search stops early. Each move copies before it
    /// clears: a crash in between leaves a duplicate (found first, harmless), never a loss.
    fn delete_handle_at(&mut self, mut hole: usize) {
        let dist = |from: usize, to: usize| (to + HANDLES - from) % HANDLES;
        let mut j = hole;
        for _ in 0..HANDLES {
            j = (j + 1) % HANDLES;
            // Every entry lies within PROBE_MAX of its home: one this far past the hole
            // has its home after it, and so have all beyond.
            if dist(hole, j) >= PROBE_MAX {
                break;
            }
            let id = self.entry_id(j);
            if id == EMPTY {
                break;
            }
            if dist(Self::home(id), j) >= dist(hole, j) {
                let moved: [u8; HANDLE] = self.handle_entry(j).try_into().unwrap();
                self.handle_entry(hole).copy_from_slice(&moved);
                hole = j;
            }
        }
        self.handle_entry(hole).fill(0);
    }

    /// Remember how to reopen `nodeid` (a file handle of `htype`), with the kernel's lookup
    /// count. False if the handle is too long or the table is full.
    pub fn put_handle(&mut self, nodeid: u64, lookups: u64, htype: i32, handle: &[u8]) -> bool {
        assert!(nodeid != EMPTY);
        if handle.len() > HANDLE_MAX {
            return false;
        }
        let Some(i) = self.find_handle(nodeid, true) else {
            return false;
        };
        let e = self.handle_entry(i);
        e[..8].copy_from_slice(&nodeid.to_le_bytes());
        e[8..16].copy_from_slice(&lookups.to_le_bytes());
        e[16..20].copy_from_slice(&htype.to_le_bytes());
        e[20..22].copy_from_slice(&(handle.len() as u16).to_le_bytes());
        e[22..22 + handle.len()].copy_from_slice(handle);
        let sum = crc32c(&e[..HANDLE - 4]);
        e[HANDLE - 4..].copy_from_slice(&sum.to_le_bytes());
        true
    }

    pub fn set_lookups(&mut self, nodeid: u64, lookups: u64) {
        if let Some(i) = self.find_handle(nodeid, false) {
            let e = self.handle_entry(i);
            e[8..16].copy_from_slice(&lookups.to_le_bytes());
            let sum = crc32c(&e[..HANDLE - 4]);
            e[HANDLE - 4..].copy_from_slice(&sum.to_le_bytes());
        }
    }

    pub fn drop_handle(&mut self, nodeid: u64) {
        if let Some(i) = self.find_handle(nodeid, false) {
            self.delete_handle_at(i);
        }
    }

    /// (lookups, handle type, handle) of `nodeid`; None if unknown or its entry is damaged.
    pub fn handle(&mut self, nodeid: u64) -> Option<(u64, i32, Vec<u8>)> {
        let i = self.find_handle(nodeid, false)?;
        let e = self.handle_entry(i);
        let sum = le::u32_at(e, HANDLE - 4);
        let len = le::u16_at(e, 20) as usize;
        if crc32c(&e[..HANDLE - 4]) != sum || len > HANDLE_MAX {
            return None;
        }
        Some((le::u64_at(e, 8), le::i32_at(e, 16), e[22..22 + len].to_vec()))
    }

    /// Test-only: damage a record, as a wild write in the crashed daemon would.
    pub fn damage_record(&mut self, slot: usize) {
        self.record_mut(slot)[10] ^= 1;
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping.
        unsafe { libc::munmap(self.base.cast(), self.size) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The handle table against a map, with keys crowded into one small region (long
    /// clusters, probe limits, backward-shift deletion) and spread ones.
    #[test]
    fn handle_table_matches_a_map_under_churn() {
        let mut s = Shared::create(8).unwrap();
        let crowded: Vec<u64> = (1u64..).filter(|&n| Shared::home(n) < 40).take(150).collect();
        let spread: Vec<u64> = (1..5000u64).map(|n| n * 7919).collect();
        let keys: Vec<u64> = crowded.iter().chain(&spread).copied().collect();
        let mut model: std::collections::HashMap<u64, u64> = Default::default();
        let mut rng = lockstep_core::rng::Rng::new(0x2545_F491_4F6C_DD1D);
        for step in 0..60_000u64 {
            let x = rng.next_u64();
            let k = keys[(x % keys.len() as u64) as usize];
            if x.is_multiple_of(3) {
                s.drop_handle(k);
                model.remove(&k);
            } else if s.put_handle(k, step, 1, &k.to_le_bytes()) {
                model.insert(k, step);
            } else {
                // Only a crowded key may find no room within the probe limit.
                assert!(crowded.contains(&k) && s.handle(k).is_none());
                model.remove(&k);
            }
            if step % 997 == 0 {
                for &k in &keys {
                    assert_eq!(
                        s.handle(k).map(|h| h.0),
                        model.get(&k).copied(),
                        "key {k} at step {step}"
                    );
                }
            }
        }
        for &k in &keys {
            assert_eq!(s.handle(k), model.get(&k).map(|&l| (l, 1, k.to_le_bytes().to_vec())));
        }
    }

    /// A header whose slot count would wrap the size computation is refused, not mapped.
    #[test]
    fn a_corrupt_slot_count_is_refused() {
        assert_eq!(region_size(8), Some(pages_at(8) + 8 * PAGE));
        assert_eq!(region_size(usize::MAX / PAGE + 1), None);
        assert_eq!(region_size(usize::MAX / RECORD + 1), None);
        let s = Shared::create(8).unwrap();
        let fd = s.fd().try_clone().unwrap();
        for slots in [0u64, 9, u64::MAX, (usize::MAX / PAGE + 1) as u64] {
            // SAFETY: writes 8 bytes from a local into the region's header at offset 8.
            let n = unsafe { libc::pwrite(fd.as_raw_fd(), slots.to_le_bytes().as_ptr().cast(), 8, 8) };
            assert_eq!(n, 8);
            let err = Shared::open(fd.try_clone().unwrap())
                .err()
                .expect("a corrupt header is refused");
            assert_eq!(err.kind(), std::io::ErrorKind::InvalidData, "slots {slots}");
        }
    }

    #[test]
    fn records_survive_a_remap_and_damage_is_caught() {
        let mut s = Shared::create(8).unwrap();
        s.page_mut(3)[..5].copy_from_slice(b"hello");
        s.set_dirty(DirtyRecord {
            slot: 3,
            ino: 42,
            block: 7,
            len: 5,
            crc: crc32c(b"hello"),
        });
        let dup = s.fd().try_clone().unwrap();
        let mut t = Shared::open(dup).unwrap();
        let recs = t.dirty_records().unwrap();
        assert_eq!(
            recs,
            vec![DirtyRecord {
                slot: 3,
                ino: 42,
                block: 7,
                len: 5,
                crc: crc32c(b"hello")
            }]
        );
        assert_eq!(&t.page(3)[..5], b"hello");
        t.damage_record(3);
        assert_eq!(s.dirty_records(), Err(3));
        s.clear(3);
        assert!(t.dirty_records().unwrap().is_empty());
        assert!(s.put_handle(77, 2, 1, b"abcdefgh"));
        assert_eq!(t.handle(77), Some((2, 1, b"abcdefgh".to_vec())));
        t.set_lookups(77, 5);
        assert_eq!(s.handle(77).unwrap().0, 5);
        s.drop_handle(77);
        assert_eq!(t.handle(77), None);
        let r = SizeRecord {
            ino: 9,
            cut: Some(0),
            size: 5,
        };
        assert!(s.set_size(r));
        assert_eq!(t.size_records(), Ok(vec![r]));
        s.clear_size(9);
        assert_eq!(t.size_records(), Ok(vec![]));
    }
}

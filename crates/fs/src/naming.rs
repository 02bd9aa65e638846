//! The naming layer: FUSE operations on a backing directory tree (the store's root).
//! Names, directories, links, permissions and times live in the backing filesystem; file
//! data goes through the checksummed cache.
//!
//! Descriptors are not held per inode. Every inode the kernel remembers is kept as a file
//! handle (`name_to_handle_at`, at most `HANDLE_MAX` bytes, no allocation) plus one known
//! name, and is opened on demand through a small LRU of `O_PATH` descriptors. Open files
//! and files with dirty pages hold their data descriptor in the cache; everything else is
//! closed. So a tree of a million files needs no more descriptors than a tree of ten.
//!
//! The FUSE inode number is the backing inode number (the root is 1). Block CRC tables
//! are keyed by path (see `store.rs`), so this layer keeps the store's tables in step
//! with every rename, link and unlink.

use crate::cache::Cache;
use crate::fuse::consts::FOPEN_DIRECT_IO;
use crate::fuse::{
    FileAttr, FileType, Filesystem, Reply, Request, SetAttr, TimeOrNow, FUSE_ROOT_ID, FUSE_WRITE_KILL_SUIDGID,
};
use crate::shared::HANDLE_MAX;
use crate::store::{PlaceBuf, Store, Tables, META};
use lockstep_core::Event;
use std::collections::{BTreeMap, HashMap};
use std::ffi::{CString, OsStr, OsString};
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The kernel may cache names and attributes this long; data is never cached by the kernel
/// (every open is direct I/O), so that this cache is the one serving reads.
const TTL: Duration = Duration::from_secs(1);
/// `O_PATH` descriptors kept open for inodes that are not open files.
const PATH_FDS_MAX: usize = 128;
const MAX_DEPTH: usize = 4096;
/// Nodeids from here on are handed out to a file whose backing inode number is still the
/// nodeid of another file the kernel remembers (the number was freed by a delete and
/// reused): nodeids must be unique among the inodes the kernel holds.
const SYNTHETIC: u64 = 1 << 62;

/// A file handle of the backing filesystem, inline.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Handle {
    pub htype: i32,
    len: u8,
    bytes: [u8; HANDLE_MAX],
}

impl Handle {
    pub fn new(htype: i32, bytes: &[u8]) -> Option<Handle> {
        if bytes.len() > HANDLE_MAX {
            return None;
        }
        let mut h = Handle {
            htype,
            len: bytes.len() as u8,
            bytes: [0; HANDLE_MAX],
        };
        h.bytes[..bytes.len()].copy_from_slice(bytes);
        Some(h)
    }

    pub fn bytes(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }
}

struct Inode {
    handle: Handle,
    lookups: u64,
    /// One of its names (parent inode, name); None when unknown (after a restart) or gone.
    name: Option<(u64, OsString)>,
    /// Its last link is gone while the kernel still holds it: its tables are orphans.
    orphan: bool,
    /// Known to have no tables in the store: made here, and not written, extended or
    /// linked since (then unlinking it has nothing to do in the store).
    tableless: bool,
}

/// A descriptor for an inode: an `O_PATH` one, or the open data file of an attached file.
#[derive(Clone)]
enum Fd {
    Path(Arc<OwnedFd>),
    File(Arc<File>),
}

impl Fd {
    fn raw(&self) -> RawFd {
        match self {
            Fd::Path(f) => f.as_raw_fd(),
            Fd::File(f) => f.as_raw_fd(),
        }
    }
}

/// A small LRU of `O_PATH` descriptors.
#[derive(Default)]
struct PathFds {
    by_ino: HashMap<u64, (Arc<OwnedFd>, u64)>,
    order: BTreeMap<u64, u64>,
    seq: u64,
}

impl PathFds {
    fn get(&mut self, ino: u64) -> Option<Arc<OwnedFd>> {
        self.seq += 1;
        let (fd, seq) = self.by_ino.get_mut(&ino)?;
        self.order.remove(seq);
        *seq = self.seq;
        self.order.insert(self.seq, ino);
        Some(fd.clone())
    }

    fn put(&mut self, ino: u64, fd: Arc<OwnedFd>) {
        self.seq += 1;
        self.forget(ino);
        self.by_ino.insert(ino, (fd, self.seq));
        self.order.insert(self.seq, ino);
        while self.by_ino.len() > PATH_FDS_MAX {
            let (_, oldest) = self.order.pop_first().expect("non-empty");
            self.by_ino.remove(&oldest);
        }
    }

    fn forget(&mut self, ino: u64) {
        if let Some((_, seq)) = self.by_ino.remove(&ino) {
            self.order.remove(&seq);
        }
    }
}

pub struct Naming {
    /// The backing root opened for reading: the mount fd that open_by_handle_at needs
    /// (it refuses an O_PATH descriptor).
    root_dir: File,
    root_path: Arc<OwnedFd>,
    root: PathBuf,
    root_st_ino: u64,
    inodes: HashMap<u64, Inode>,
    /// Files whose nodeid is not their inode number (see `SYNTHETIC`).
    aliases: HashMap<Handle, u64>,
    next_synthetic: u64,
    fds: PathFds,
    pub cache: Arc<Mutex<Cache>>,
    /// Namespace events (table upkeep that failed) for the daemon to write out.
    events: Arc<Mutex<Vec<Event>>>,
    /// Filled at unmount: files whose acknowledged data was discarded (poisoned pages).
    lost: Arc<Mutex<Vec<String>>>,
    /// The store's free space when last asked, and when.
    space: Option<(std::time::Instant, u64)>,
    /// Files written since their mtime was last set: it is set when someone can see it
    /// (getattr, release, fsync), not on every write.
    mtime_due: std::collections::HashSet<u64>,
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)
}

fn io_errno(e: std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(libc::EIO)
}

fn cstr(name: &OsStr) -> Result<CString, i32> {
    CString::new(name.as_bytes()).map_err(|_| libc::EINVAL)
}

fn proc_path(fd: RawFd) -> CString {
    CString::new(format!("/proc/self/fd/{fd}")).expect("no NUL")
}

fn stat_fd(fd: RawFd) -> Result<libc::stat, i32> {
    // SAFETY: stat is plain data; the kernel fills it in.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a valid fd and an empty path with AT_EMPTY_PATH; st is written by the kernel.
    let r = unsafe {
        libc::fstatat(
            fd,
            c"".as_ptr(),
            &mut st,
            libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    if r < 0 {
        return Err(errno());
    }
    Ok(st)
}

fn stat_at(dir: RawFd, name: &CString) -> Result<libc::stat, i32> {
    // SAFETY: stat is plain data; the kernel fills it in.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid dir fd and NUL-terminated name.
    let r = unsafe { libc::fstatat(dir, name.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) };
    if r < 0 {
        return Err(errno());
    }
    Ok(st)
}

fn time(sec: i64, nsec: i64) -> SystemTime {
    if sec >= 0 {
        UNIX_EPOCH + Duration::new(sec as u64, nsec as u32)
    } else {
        UNIX_EPOCH
    }
}

fn kind(mode: u32) -> FileType {
    match mode & libc::S_IFMT {
        libc::S_IFDIR => FileType::Directory,
        libc::S_IFLNK => FileType::Symlink,
        libc::S_IFCHR => FileType::CharDevice,
        libc::S_IFBLK => FileType::BlockDevice,
        libc::S_IFIFO => FileType::NamedPipe,
        libc::S_IFSOCK => FileType::Socket,
        _ => FileType::RegularFile,
    }
}

fn dirent_kind(d_type: u8) -> FileType {
    match d_type {
        libc::DT_DIR => FileType::Directory,
        libc::DT_LNK => FileType::Symlink,
        libc::DT_CHR => FileType::CharDevice,
        libc::DT_BLK => FileType::BlockDevice,
        libc::DT_FIFO => FileType::NamedPipe,
        libc::DT_SOCK => FileType::Socket,
        _ => FileType::RegularFile,
    }
}

/// The kernel's file handle for `name` in `dir` (`name` empty: `dir` itself).
pub fn handle_of(dir: RawFd, name: &CString) -> Result<Handle, i32> {
    let mut fh = FileHandle {
        bytes: HANDLE_MAX as u32,
        htype: 0,
        data: [0; 128],
    };
    let mut mount_id: libc::c_int = 0;
    let flags = if name.as_bytes().is_empty() {
        libc::AT_EMPTY_PATH
    } else {
        0
    };
    // SAFETY: fh has room for HANDLE_MAX bytes as announced in `bytes`.
    let r = unsafe {
        libc::name_to_handle_at(
            dir,
            name.as_ptr(),
            (&mut fh as *mut FileHandle).cast(),
            &mut mount_id,
            flags,
        )
    };
    if r < 0 {
        return Err(errno());
    }
    Handle::new(fh.htype, &fh.data[..fh.bytes as usize]).ok_or(libc::EOVERFLOW)
}

pub(crate) fn open_by_handle(mount_fd: RawFd, h: &Handle, flags: i32) -> Result<OwnedFd, i32> {
    let mut fh = FileHandle {
        bytes: h.len as u32,
        htype: h.htype,
        data: [0; 128],
    };
    fh.data[..h.bytes().len()].copy_from_slice(h.bytes());
    // SAFETY: a well-formed handle buffer.
    let r = unsafe { libc::open_by_handle_at(mount_fd, (&mut fh as *mut FileHandle).cast(), flags) };
    if r < 0 {
        return Err(errno());
    }
    // SAFETY: a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(r) })
}

/// `struct file_handle` with room for its bytes.
#[repr(C)]
struct FileHandle {
    bytes: u32,
    htype: i32,
    data: [u8; 128],
}

fn open_at(dir: RawFd, name: &CString, flags: i32) -> Result<OwnedFd, i32> {
    // SAFETY: valid dir fd and name.
    let r = unsafe { libc::openat(dir, name.as_ptr(), flags | libc::O_CLOEXEC) };
    if r < 0 {
        return Err(errno());
    }
    // SAFETY: a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(r) })
}

/// Reopen an `O_PATH` (or any) descriptor with real access `flags`.
fn reopen(fd: RawFd, flags: i32) -> Result<File, i32> {
    let p = proc_path(fd);
    // SAFETY: NUL-terminated path.
    let r = unsafe { libc::open(p.as_ptr(), flags | libc::O_CLOEXEC) };
    if r < 0 {
        return Err(errno());
    }
    // SAFETY: a new descriptor that nothing else owns.
    Ok(unsafe { File::from_raw_fd(r) })
}

fn timespec(t: Option<TimeOrNow>) -> libc::timespec {
    match t {
        None => libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_OMIT,
        },
        Some(TimeOrNow::Now) => libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_NOW,
        },
        Some(TimeOrNow::SpecificTime(t)) => {
            let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
            libc::timespec {
                tv_sec: d.as_secs() as i64,
                tv_nsec: d.subsec_nanos() as i64,
            }
        }
    }
}

macro_rules! tryr {
    ($reply:expr, $e:expr) => {
        match $e {
            Ok(v) => v,
            Err(code) => {
                $reply.error(code);
                return;
            }
        }
    };
}

impl Naming {
    pub fn new(
        root: &Path,
        cache: Arc<Mutex<Cache>>,
        events: Arc<Mutex<Vec<Event>>>,
        lost: Arc<Mutex<Vec<String>>>,
    ) -> std::io::Result<Naming> {
        let root_dir = File::open(root)?;
        let st = stat_fd(root_dir.as_raw_fd()).map_err(std::io::Error::from_raw_os_error)?;
        let c = CString::new(root.as_os_str().as_bytes()).map_err(|_| std::io::ErrorKind::InvalidInput)?;
        let root_path =
            open_at(libc::AT_FDCWD, &c, libc::O_PATH | libc::O_DIRECTORY).map_err(std::io::Error::from_raw_os_error)?;
        Ok(Naming {
            root_dir,
            root_path: Arc::new(root_path),
            root: root.to_path_buf(),
            root_st_ino: st.st_ino,
            inodes: HashMap::new(),
            aliases: HashMap::new(),
            next_synthetic: SYNTHETIC,
            fds: PathFds::default(),
            cache,
            events,
            lost,
            space: None,
            mtime_due: std::collections::HashSet::new(),
        })
    }

    fn ino_of(&self, st_ino: u64) -> u64 {
        if st_ino == self.root_st_ino {
            FUSE_ROOT_ID
        } else {
            st_ino
        }
    }

    /// The nodeid of the file with inode number `st_ino` and handle `h`: its number, unless
    /// that number is the nodeid of another (deleted) file the kernel still holds. With
    /// `allocate`, such a file gets a new synthetic nodeid.
    fn nodeid_of(&mut self, st_ino: u64, h: Option<&Handle>, allocate: bool) -> u64 {
        let ino = self.ino_of(st_ino);
        if ino == FUSE_ROOT_ID {
            return ino;
        }
        let Some(h) = h else { return ino };
        if let Some(&id) = self.aliases.get(h) {
            return id;
        }
        match self.handle(ino) {
            Ok(existing) if existing != *h && allocate => {
                let id = self.next_synthetic;
                self.next_synthetic += 1;
                self.aliases.insert(*h, id);
                id
            }
            _ => ino,
        }
    }

    /// The handle of `dir`/`name`, needed to tell its nodeid only while some file has a
    /// synthetic one (`nodeid_of`); otherwise the inode number says it, and the call is
    /// saved.
    fn alias_handle(&self, dir: RawFd, name: &CString) -> Option<Handle> {
        if self.aliases.is_empty() {
            return None;
        }
        handle_of(dir, name).ok()
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, Cache> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn note(&self, what: &str, e: impl std::fmt::Display) {
        self.events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Event::new("fs", "table-upkeep", "continue").message(format!("{what}: {e}")));
    }

    /// The handle of `ino`: ours, or (after a restart) the one kept in shared memory.
    fn handle(&mut self, ino: u64) -> Result<Handle, i32> {
        if let Some(i) = self.inodes.get(&ino) {
            return Ok(i.handle);
        }
        let (lookups, htype, bytes) = self.cache().shared().handle(ino).ok_or(libc::ESTALE)?;
        let handle = Handle::new(htype, &bytes).ok_or(libc::ESTALE)?;
        self.inodes.insert(
            ino,
            Inode {
                handle,
                lookups,
                name: None,
                orphan: false,
                tableless: false,
            },
        );
        Ok(handle)
    }

    /// A descriptor of `ino`: the root's, an attached file's, or an `O_PATH` one opened
    /// from its handle (and kept in a small LRU).
    fn fd(&mut self, ino: u64) -> Result<Fd, i32> {
        if ino == FUSE_ROOT_ID {
            return Ok(Fd::Path(self.root_path.clone()));
        }
        if let Some(f) = self.cache().file_of(ino) {
            return Ok(Fd::File(f));
        }
        if let Some(f) = self.fds.get(ino) {
            return Ok(Fd::Path(f));
        }
        let h = self.handle(ino)?;
        let fd = open_by_handle(
            self.root_dir.as_raw_fd(),
            &h,
            libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
        .inspect_err(|e| eprintln!("lockstep fs: inode {ino} does not reopen from its handle: errno {e}"))?;
        let fd = Arc::new(fd);
        self.fds.put(ino, fd.clone());
        Ok(Fd::Path(fd))
    }

    /// The path of `ino` relative to the root: from its known names, else from the kernel
    /// (validated), else by searching the tree (only after a restart lost the names).
    fn rel_path(&mut self, ino: u64) -> Result<PathBuf, i32> {
        let mut parts = Vec::new();
        let mut at = ino;
        while at != FUSE_ROOT_ID {
            match self.inodes.get(&at).and_then(|i| i.name.clone()) {
                Some((parent, name)) if parts.len() < MAX_DEPTH => {
                    parts.push(name);
                    at = parent;
                }
                _ => {
                    let base = self.found_path(at)?;
                    return Ok(parts.iter().rev().fold(base, |p, n| p.join(n)));
                }
            }
        }
        Ok(parts.iter().rev().fold(PathBuf::new(), |p, n| p.join(n)))
    }

    fn found_path(&mut self, ino: u64) -> Result<PathBuf, i32> {
        let fd = self.fd(ino)?;
        crate::recovery::path_of(&self.root, fd.raw()).ok_or(libc::ESTALE)
    }

    /// Where the tables of the regular file `ino` are.
    fn place_of(&mut self, ino: u64) -> Result<PlaceBuf, i32> {
        if self.inodes.get(&ino).is_some_and(|i| i.orphan) {
            return Ok(PlaceBuf::Orphan(ino));
        }
        Ok(PlaceBuf::Path(self.rel_path(ino)?))
    }

    fn attr(&self, ino: u64, st: &libc::stat) -> FileAttr {
        let mut size = st.st_size as u64;
        let mut blocks = st.st_blocks as u64;
        if kind(st.st_mode) == FileType::RegularFile {
            let c = self.cache();
            if let Some(s) = c.size(ino) {
                size = s;
            }
            // Dirty pages past the end on disk will take room when written back.
            let on_disk = (st.st_size as u64).div_ceil(crate::crc::PAGE as u64);
            blocks += 8 * c.dirty_blocks(ino).iter().filter(|&&b| b >= on_disk).count() as u64;
        }
        FileAttr {
            ino,
            st_ino: st.st_ino,
            size,
            blocks,
            atime: time(st.st_atime, st.st_atime_nsec),
            mtime: time(st.st_mtime, st.st_mtime_nsec),
            ctime: time(st.st_ctime, st.st_ctime_nsec),
            kind: kind(st.st_mode),
            perm: (st.st_mode & 0o7777) as u16,
            nlink: st.st_nlink as u32,
            uid: st.st_uid,
            gid: st.st_gid,
            rdev: st.st_rdev as u32,
            blksize: 4096,
        }
    }

    /// `.lockstep` in the root is the store's own: invisible and untouchable.
    fn hidden(&self, parent: u64, name: &OsStr) -> bool {
        parent == FUSE_ROOT_ID && name.as_bytes() == META.as_bytes()
    }

    /// Look `name` up in `parent`, registering the inode (one more kernel reference).
    fn do_lookup(&mut self, parent: u64, name: &OsStr) -> Result<FileAttr, i32> {
        if self.hidden(parent, name) {
            return Err(libc::ENOENT);
        }
        let pfd = self.fd(parent)?;
        let c = cstr(name)?;
        let st = stat_at(pfd.raw(), &c)?;
        if self.ino_of(st.st_ino) == FUSE_ROOT_ID {
            return Ok(self.attr(FUSE_ROOT_ID, &st));
        }
        let handle = handle_of(pfd.raw(), &c)?;
        Ok(self.register(parent, name, &st, handle))
    }

    /// One more kernel reference to the node `st` (handle `handle`) found at
    /// `parent`/`name`; its attributes as the kernel is to see them.
    fn register(&mut self, parent: u64, name: &OsStr, st: &libc::stat, handle: Handle) -> FileAttr {
        let ino = self.nodeid_of(st.st_ino, Some(&handle), true);
        // An inode we lost in a restart but the kernel still holds is found again here.
        if !self.inodes.contains_key(&ino) && self.handle(ino).is_err() {
            self.inodes.insert(
                ino,
                Inode {
                    handle,
                    lookups: 0,
                    name: None,
                    orphan: false,
                    tableless: false,
                },
            );
        }
        let i = self.inodes.get_mut(&ino).expect("registered");
        i.lookups += 1;
        if i.name.is_none() {
            i.name = Some((parent, name.to_os_string()));
        }
        let (n, h) = (i.lookups, i.handle);
        {
            let mut c = self.cache();
            let shared = c.shared();
            if n == 1 || shared.handle(ino).is_none() {
                shared.put_handle(ino, n, h.htype, h.bytes());
            } else {
                shared.set_lookups(ino, n);
            }
        }
        self.attr(ino, st)
    }

    /// Open the data of a regular file read-write for the cache, with its tables.
    fn attach(&mut self, ino: u64) -> Result<(), i32> {
        self.attach_sized(ino, None)
    }

    /// `attach`, when the caller has just seen the backing file's size.
    fn attach_sized(&mut self, ino: u64, size: Option<u64>) -> Result<(), i32> {
        {
            // The common case, on every read and write: one lock, no opening.
            let mut c = self.cache();
            if c.is_attached(ino) {
                return c.attach(ino, |_| unreachable!("attached"));
            }
        }
        let place = self.place_of(ino)?;
        // From a descriptor we hold, else straight from the handle (one open, not two).
        let data = match self.fds.get(ino) {
            Some(fd) => reopen(fd.as_raw_fd(), libc::O_RDWR)?,
            None => {
                let h = self.handle(ino)?;
                File::from(open_by_handle(
                    self.root_dir.as_raw_fd(),
                    &h,
                    libc::O_RDWR | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                )?)
            }
        };
        self.cache().attach(ino, |store: &Store| {
            let size = match size {
                Some(s) => s,
                None => data.metadata()?.len(),
            };
            Ok((data, store.tables(place.as_place())?, size))
        })
    }

    /// Owner of a new node `st` at `dir`/`name`: the caller, and the directory's group if
    /// it is setgid (as the kernel does for local filesystems). The daemon made the node
    /// with its own ids and the kernel applied the setgid rule, so nothing is changed when
    /// they are already the caller's. A chown clears setuid/setgid; the bits the caller
    /// asked for are put back. `st` is updated.
    fn own(&self, dir: RawFd, name: &CString, req: &Request, st: &mut libc::stat) {
        if st.st_uid == req.uid() && st.st_gid == req.gid() {
            return;
        }
        let gid = match stat_fd(dir) {
            Ok(d) if d.st_mode & libc::S_ISGID != 0 => d.st_gid,
            _ => req.gid(),
        };
        if st.st_uid == req.uid() && st.st_gid == gid {
            return;
        }
        // Setgid is kept only for the caller's own group (the kernel clears it otherwise).
        let special = st.st_mode & libc::S_ISUID
            | if gid == req.gid() {
                st.st_mode & libc::S_ISGID
            } else {
                0
            };
        // SAFETY: valid fd and path. Failure leaves the daemon's ids, which only matters
        // when non-root users write here.
        if unsafe { libc::fchownat(dir, name.as_ptr(), req.uid(), gid, libc::AT_SYMLINK_NOFOLLOW) } < 0 {
            return;
        }
        if special != 0 && kind(st.st_mode) == FileType::RegularFile {
            // SAFETY: valid fd and path.
            unsafe { libc::fchmodat(dir, name.as_ptr(), st.st_mode & 0o777 | special, 0) };
        }
        if let Ok(now) = stat_at(dir, name) {
            *st = now;
        }
    }

    /// The node just made at `parent`/`name`: owned by the caller and registered.
    fn made(&mut self, parent: u64, dir: RawFd, name: &OsStr, req: &Request) -> Result<FileAttr, i32> {
        let c = cstr(name)?;
        let mut st = stat_at(dir, &c)?;
        self.own(dir, &c, req, &mut st);
        let handle = handle_of(dir, &c)?;
        Ok(self.register(parent, name, &st, handle))
    }

    /// The name `name` in `parent` (inode `st`, handle `h`) is gone: keep the tables in
    /// step, and forget it as the inode's known name.
    fn name_removed(&mut self, parent: u64, name: &OsStr, st: &libc::stat, h: Option<&Handle>) {
        let ino = self.nodeid_of(st.st_ino, h, false);
        if let Some(i) = self.inodes.get_mut(&ino) {
            if i.name.as_ref().is_some_and(|(p, n)| *p == parent && n == name) {
                i.name = None;
            }
        }
        match kind(st.st_mode) {
            FileType::RegularFile => {}
            FileType::Directory => {
                if let Ok(rel) = self.rel_path(parent).map(|p| p.join(name)) {
                    if let Err(e) = self.cache().store().dir_removed(&rel) {
                        self.note("cannot remove the tables of a removed directory", e);
                    }
                }
                return;
            }
            _ => return,
        }
        let Ok(rel) = self.rel_path(parent).map(|p| p.join(name)) else {
            return;
        };
        let last = st.st_nlink <= 1;
        let held = last && self.inodes.contains_key(&ino);
        if let Some(i) = self.inodes.get_mut(&ino).filter(|_| held) {
            i.orphan = true;
        }
        if held {
            self.cache().retarget(ino, PlaceBuf::Orphan(ino));
        }
        // A file attached without tables has none to move or drop (the common case for
        // short-lived files: they never reached the store).
        let tableless = self.inodes.get(&ino).is_some_and(|i| i.tableless);
        if !tableless && self.cache().has_tables(ino) != Some(false) {
            let r = self.cache().store().unlinked(&rel, held.then_some(ino));
            if let Err(e) = r {
                self.note(&format!("cannot drop the tables of {}", rel.display()), e);
            }
        }
        if last && !held {
            self.cache().remove(ino, false);
        }
    }

    /// Write-back must not find the disk full: a write is accepted only if the store has
    /// room for it and for everything dirty before it. Otherwise the writer gets ENOSPC
    /// now, while it can still act on it.
    fn room_for(&mut self, len: usize) -> Result<(), i32> {
        let root = self.root_dir.as_raw_fd();
        let avail = || -> Result<u64, i32> {
            // SAFETY: statvfs is plain data; the kernel fills it in.
            let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
            // SAFETY: valid fd and output struct.
            if unsafe { libc::fstatvfs(root, &mut s) } < 0 {
                return Err(errno());
            }
            Ok(s.f_bavail * s.f_frsize)
        };
        // Block tables and directory growth need a little room of their own.
        const MARGIN: u64 = 256 << 10;
        // A recent look at the free space is good enough while it is far from running out.
        const SLACK: u64 = 64 << 20;
        let need = |c: &Cache| c.dirty_bytes() + len as u64 + MARGIN;
        let now = std::time::Instant::now();
        if let Some((when, free)) = self.space {
            if now.duration_since(when) < Duration::from_millis(100) && free >= need(&self.cache()) + SLACK {
                return Ok(());
            }
        }
        let free = avail()?;
        self.space = Some((now, free));
        if free >= need(&self.cache()) {
            return Ok(());
        }
        // Writing back what is dirty turns reserved room into used room; then look again.
        let flushed = self.cache().flush(None, Duration::ZERO);
        if flushed == Err(libc::ENOSPC) || avail()? < need(&self.cache()) {
            return Err(libc::ENOSPC);
        }
        Ok(())
    }

    /// The errno of the call that just failed, unless it is `tolerated` and this request is
    /// one the kernel sent again after a restart (then its earlier run did the work: mkdir
    /// gives EEXIST, unlink ENOENT).
    fn failure(&self, req: &Request, tolerated: i32) -> Option<i32> {
        let e = errno();
        (e != tolerated || !req.resent()).then_some(e)
    }

    /// `ino` may get tables now (written, extended or linked).
    fn may_have_tables(&mut self, ino: u64) {
        if let Some(i) = self.inodes.get_mut(&ino) {
            i.tableless = false;
        }
    }

    /// Set the mtime of `ino` if it was written since it was last set.
    fn settle_mtime(&mut self, ino: u64) {
        if self.mtime_due.remove(&ino) {
            if let Ok(fd) = self.fd(ino) {
                self.touch_mtime(fd.raw());
            }
        }
    }

    fn touch_mtime(&self, fd: RawFd) {
        let times = [
            libc::timespec {
                tv_sec: 0,
                tv_nsec: libc::UTIME_OMIT,
            },
            libc::timespec {
                tv_sec: 0,
                tv_nsec: libc::UTIME_NOW,
            },
        ];
        // SAFETY: a two-element times array; an O_PATH descriptor gives EBADF.
        if unsafe { libc::futimens(fd, times.as_ptr()) } == 0 {
            return;
        }
        let p = proc_path(fd);
        // SAFETY: valid path and a two-element times array.
        unsafe { libc::utimensat(libc::AT_FDCWD, p.as_ptr(), times.as_ptr(), 0) };
    }

    /// Clear setuid, and setgid if group-executable, as a local filesystem does when a
    /// user without CAP_FSETID writes.
    fn kill_suidgid(&self, fd: RawFd) {
        let Ok(st) = stat_fd(fd) else { return };
        let mut mode = st.st_mode & 0o7777;
        if mode & libc::S_ISUID != 0 {
            mode &= !libc::S_ISUID;
        }
        if mode & (libc::S_ISGID | libc::S_IXGRP) == libc::S_ISGID | libc::S_IXGRP {
            mode &= !libc::S_ISGID;
        }
        if mode != st.st_mode & 0o7777 {
            let p = proc_path(fd);
            // SAFETY: valid path.
            unsafe { libc::chmod(p.as_ptr(), mode) };
        }
    }

    /// A new regular file at `parent`/`name`: tables left there by a file that had the name
    /// before (a crash between its unlink and the table's) must not apply to it.
    fn fresh_tables(&mut self, parent: u64, name: &OsStr) {
        if let Ok(rel) = self.rel_path(parent).map(|p| p.join(name)) {
            if let Err(e) = self.cache().store().unlinked(&rel, None) {
                self.note("cannot clear stale tables", e);
            }
        }
    }

    /// Backing-file SEEK_DATA/SEEK_HOLE, with dirty pages counted as data.
    fn seek_data_hole(&mut self, ino: u64, offset: u64, whence: i32) -> Result<u64, i32> {
        self.attach(ino)?;
        let (file, size, dirty) = {
            let c = self.cache();
            (
                c.file_of(ino).ok_or(libc::EBADF)?,
                c.size(ino).ok_or(libc::EBADF)?,
                c.dirty_blocks(ino),
            )
        };
        if offset >= size {
            return Err(libc::ENXIO);
        }
        let page = crate::crc::PAGE as u64;
        let disk = |pos: u64, how: i32| -> Result<Option<u64>, i32> {
            // SAFETY: lseek on our own descriptor.
            let r = unsafe { libc::lseek(file.as_raw_fd(), pos as i64, how) };
            if r < 0 {
                return match errno() {
                    libc::ENXIO => Ok(None),
                    e => Err(e),
                };
            }
            Ok(Some(r as u64))
        };
        let is_dirty = |pos: u64| dirty.binary_search(&(pos / page)).is_ok();
        if whence == libc::SEEK_DATA {
            let on_disk = disk(offset, libc::SEEK_DATA)?.filter(|&p| p < size);
            let in_cache = dirty
                .iter()
                .find(|&&b| (b + 1) * page > offset)
                .map(|&b| (b * page).max(offset))
                .filter(|&p| p < size);
            return match (on_disk, in_cache) {
                (Some(a), Some(b)) => Ok(a.min(b)),
                (Some(a), None) | (None, Some(a)) => Ok(a),
                (None, None) => Err(libc::ENXIO),
            };
        }
        let mut pos = offset;
        loop {
            if pos >= size {
                return Ok(size);
            }
            if is_dirty(pos) {
                pos = (pos / page + 1) * page;
                continue;
            }
            match disk(pos, libc::SEEK_HOLE)? {
                // Past the end on disk: a hole until dirty data that extends the file.
                None => return Ok(pos),
                Some(h) if h >= size => return Ok(size),
                Some(h) if !is_dirty(h) => return Ok(h),
                Some(h) => pos = h,
            }
        }
    }
}

impl Filesystem for Naming {
    fn destroy(&mut self) {
        // What fails stays poisoned, and is named just below as lost.
        let _ = self.cache().flush(None, Duration::ZERO);
        let poisoned = self.cache().poisoned();
        let mut lost = Vec::new();
        for (ino, pages) in poisoned {
            let name = match self.place_of(ino) {
                Ok(PlaceBuf::Path(p)) => p.display().to_string(),
                Ok(PlaceBuf::Orphan(_)) => format!("inode {ino} (already unlinked)"),
                Err(_) => format!("inode {ino}"),
            };
            lost.push(format!("{name} ({pages} page(s))"));
        }
        *self.lost.lock().unwrap_or_else(|p| p.into_inner()) = lost;
    }

    fn lookup(&mut self, _req: &Request, parent: u64, name: &OsStr, reply: Reply) {
        let attr = tryr!(reply, self.do_lookup(parent, name));
        reply.entry(&TTL, &attr, 0);
    }

    fn forget(&mut self, ino: u64, nlookup: u64) {
        self.settle_mtime(ino);
        if ino == FUSE_ROOT_ID || self.handle(ino).is_err() {
            return;
        }
        let Some(i) = self.inodes.get_mut(&ino) else { return };
        i.lookups = i.lookups.saturating_sub(nlookup);
        let left = i.lookups;
        if left > 0 {
            self.cache().shared().set_lookups(ino, left);
            return;
        }
        let (orphan, tableless) = (i.orphan, i.tableless);
        if ino >= SYNTHETIC {
            let h = i.handle;
            self.aliases.remove(&h);
        }
        self.inodes.remove(&ino);
        self.fds.forget(ino);
        let mut c = self.cache();
        c.shared().drop_handle(ino);
        if orphan {
            c.remove(ino, !tableless);
        } else {
            c.release_inode(ino);
        }
    }

    fn getattr(&mut self, _req: &Request, ino: u64, reply: Reply) {
        self.settle_mtime(ino);
        let fd = tryr!(reply, self.fd(ino));
        let st = tryr!(reply, stat_fd(fd.raw()));
        reply.attr(&TTL, &self.attr(ino, &st));
    }

    fn setattr(&mut self, _req: &Request, ino: u64, set: SetAttr, reply: Reply) {
        let SetAttr {
            mode,
            uid,
            gid,
            size,
            atime,
            mtime,
        } = set;
        self.settle_mtime(ino);
        let fd = tryr!(reply, self.fd(ino));
        let p = proc_path(fd.raw());
        if let Some(s) = size {
            self.may_have_tables(ino);
            tryr!(reply, self.attach(ino));
            tryr!(reply, self.cache().truncate(ino, s));
        }
        if uid.is_some() || gid.is_some() {
            let (u, g) = (uid.unwrap_or(u32::MAX), gid.unwrap_or(u32::MAX));
            // SAFETY: valid fd, empty path with AT_EMPTY_PATH.
            let r = unsafe {
                libc::fchownat(
                    fd.raw(),
                    c"".as_ptr(),
                    u,
                    g,
                    libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW,
                )
            };
            if r < 0 {
                return reply.error(errno());
            }
        }
        // After chown, which may have cleared setuid/setgid: the kernel sends the mode it
        // wants in the same request.
        if let Some(m) = mode {
            // SAFETY: valid path.
            if unsafe { libc::chmod(p.as_ptr(), m & 0o7777) } < 0 {
                return reply.error(errno());
            }
        }
        if atime.is_some() || mtime.is_some() {
            let times = [timespec(atime), timespec(mtime)];
            // SAFETY: valid path and times.
            if unsafe { libc::utimensat(libc::AT_FDCWD, p.as_ptr(), times.as_ptr(), 0) } < 0 {
                return reply.error(errno());
            }
        } else if size.is_some() {
            self.touch_mtime(fd.raw());
        }
        let st = tryr!(reply, stat_fd(fd.raw()));
        reply.attr(&TTL, &self.attr(ino, &st));
    }

    fn readlink(&mut self, _req: &Request, ino: u64, reply: Reply) {
        let fd = tryr!(reply, self.fd(ino));
        let mut buf = vec![0u8; libc::PATH_MAX as usize];
        // SAFETY: valid fd and buffer.
        let n = unsafe { libc::readlinkat(fd.raw(), c"".as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            return reply.error(errno());
        }
        reply.data(&buf[..n as usize]);
    }

    fn mknod(&mut self, req: &Request, parent: u64, name: &OsStr, mode: u32, umask: u32, rdev: u32, reply: Reply) {
        if self.hidden(parent, name) {
            return reply.error(libc::EPERM);
        }
        let pfd = tryr!(reply, self.fd(parent));
        let c = tryr!(reply, cstr(name));
        // SAFETY: valid dir fd and name.
        if unsafe { libc::mknodat(pfd.raw(), c.as_ptr(), mode & !umask, rdev as libc::dev_t) } < 0 {
            if let Some(e) = self.failure(req, libc::EEXIST) {
                return reply.error(e);
            }
        } else if mode & libc::S_IFMT == libc::S_IFREG || mode & libc::S_IFMT == 0 {
            self.fresh_tables(parent, name);
        }
        let attr = tryr!(reply, self.made(parent, pfd.raw(), name, req));
        reply.entry(&TTL, &attr, 0);
    }

    fn mkdir(&mut self, req: &Request, parent: u64, name: &OsStr, mode: u32, umask: u32, reply: Reply) {
        if self.hidden(parent, name) {
            return reply.error(libc::EPERM);
        }
        let pfd = tryr!(reply, self.fd(parent));
        let c = tryr!(reply, cstr(name));
        // SAFETY: valid dir fd and name.
        if unsafe { libc::mkdirat(pfd.raw(), c.as_ptr(), (mode & !umask) as libc::mode_t) } < 0 {
            if let Some(e) = self.failure(req, libc::EEXIST) {
                return reply.error(e);
            }
        }
        let attr = tryr!(reply, self.made(parent, pfd.raw(), name, req));
        reply.entry(&TTL, &attr, 0);
    }

    fn unlink(&mut self, req: &Request, parent: u64, name: &OsStr, reply: Reply) {
        if self.hidden(parent, name) {
            return reply.error(libc::ENOENT);
        }
        let pfd = tryr!(reply, self.fd(parent));
        let c = tryr!(reply, cstr(name));
        let st = match stat_at(pfd.raw(), &c) {
            Ok(st) => st,
            Err(libc::ENOENT) if req.resent() => return reply.ok(),
            Err(e) => return reply.error(e),
        };
        let h = self.alias_handle(pfd.raw(), &c);
        // SAFETY: valid dir fd and name.
        if unsafe { libc::unlinkat(pfd.raw(), c.as_ptr(), 0) } < 0 {
            return reply.error(errno());
        }
        self.name_removed(parent, name, &st, h.as_ref());
        reply.ok();
    }

    fn rmdir(&mut self, req: &Request, parent: u64, name: &OsStr, reply: Reply) {
        if self.hidden(parent, name) {
            return reply.error(libc::ENOENT);
        }
        let pfd = tryr!(reply, self.fd(parent));
        let c = tryr!(reply, cstr(name));
        let st = stat_at(pfd.raw(), &c);
        let h = self.alias_handle(pfd.raw(), &c);
        // SAFETY: valid dir fd and name.
        if unsafe { libc::unlinkat(pfd.raw(), c.as_ptr(), libc::AT_REMOVEDIR) } < 0 {
            if let Some(e) = self.failure(req, libc::ENOENT) {
                return reply.error(e);
            }
        }
        if let Ok(st) = st {
            self.name_removed(parent, name, &st, h.as_ref());
        }
        reply.ok();
    }

    fn symlink(&mut self, req: &Request, parent: u64, link_name: &OsStr, target: &Path, reply: Reply) {
        if self.hidden(parent, link_name) {
            return reply.error(libc::EPERM);
        }
        let pfd = tryr!(reply, self.fd(parent));
        let c = tryr!(reply, cstr(link_name));
        let t = tryr!(reply, cstr(target.as_os_str()));
        // SAFETY: valid strings and dir fd.
        if unsafe { libc::symlinkat(t.as_ptr(), pfd.raw(), c.as_ptr()) } < 0 {
            if let Some(e) = self.failure(req, libc::EEXIST) {
                return reply.error(e);
            }
        }
        let attr = tryr!(reply, self.made(parent, pfd.raw(), link_name, req));
        reply.entry(&TTL, &attr, 0);
    }

    fn rename(
        &mut self,
        req: &Request,
        parent: u64,
        name: &OsStr,
        newparent: u64,
        newname: &OsStr,
        flags: u32,
        reply: Reply,
    ) {
        if self.hidden(parent, name) || self.hidden(newparent, newname) {
            return reply.error(libc::EPERM);
        }
        let pfd = tryr!(reply, self.fd(parent));
        let nfd = tryr!(reply, self.fd(newparent));
        let c = tryr!(reply, cstr(name));
        let n = tryr!(reply, cstr(newname));
        let moved = stat_at(pfd.raw(), &c).ok();
        let moved_h = self.alias_handle(pfd.raw(), &c);
        let replaced = stat_at(nfd.raw(), &n).ok();
        let replaced_h = self.alias_handle(nfd.raw(), &n);
        // SAFETY: valid fds and names.
        let r = unsafe { libc::syscall(libc::SYS_renameat2, pfd.raw(), c.as_ptr(), nfd.raw(), n.as_ptr(), flags) };
        let replay = r < 0;
        if replay {
            if let Some(e) = self.failure(req, libc::ENOENT) {
                return reply.error(e);
            }
        }
        let exchange = flags & libc::RENAME_EXCHANGE != 0;
        // Two names of one file: the kernel did nothing, and neither do the tables.
        if let (Some(m), Some(t)) = (moved, replaced) {
            if !replay && m.st_ino == t.st_ino && m.st_dev == t.st_dev {
                return reply.ok();
            }
        }
        // The replaced file's tables go first, then the moved file's take their place.
        if let (Some(st), false, false) = (replaced, exchange, replay) {
            if moved.is_none_or(|m| m.st_ino != st.st_ino) {
                self.name_removed(newparent, newname, &st, replaced_h.as_ref());
            }
        }
        let from = self.rel_path(parent).map(|p| p.join(name));
        let to = self.rel_path(newparent).map(|p| p.join(newname));
        if let (Ok(from), Ok(to)) = (&from, &to) {
            if let Err(e) = self.cache().store().renamed(from, to, exchange) {
                self.note(&format!("cannot move the tables of {}", from.display()), e);
            }
        }
        if let Some(st) = moved {
            let ino = self.nodeid_of(st.st_ino, moved_h.as_ref(), false);
            if let Some(i) = self.inodes.get_mut(&ino) {
                i.name = Some((newparent, newname.to_os_string()));
            }
        }
        // Attached files whose tables do not exist yet follow the move (the file itself, or
        // everything under a directory); with an exchange, both ways.
        if let (Ok(from), Ok(to)) = (&from, &to) {
            self.cache().retarget_moved(from, to, exchange);
        }
        if let (Some(st), true) = (replaced, exchange) {
            let ino = self.nodeid_of(st.st_ino, replaced_h.as_ref(), false);
            if let Some(i) = self.inodes.get_mut(&ino) {
                i.name = Some((parent, name.to_os_string()));
            }
        }
        reply.ok();
    }

    fn link(&mut self, req: &Request, ino: u64, newparent: u64, newname: &OsStr, reply: Reply) {
        if self.hidden(newparent, newname) {
            return reply.error(libc::EPERM);
        }
        let fd = tryr!(reply, self.fd(ino));
        let nfd = tryr!(reply, self.fd(newparent));
        let n = tryr!(reply, cstr(newname));
        self.may_have_tables(ino);
        tryr!(reply, self.cache().ensure_tables(ino));
        // SAFETY: valid fds and name; AT_EMPTY_PATH links the inode the fd holds.
        if unsafe { libc::linkat(fd.raw(), c"".as_ptr(), nfd.raw(), n.as_ptr(), libc::AT_EMPTY_PATH) } < 0 {
            if let Some(e) = self.failure(req, libc::EEXIST) {
                return reply.error(e);
            }
        }
        if stat_fd(fd.raw()).is_ok_and(|st| kind(st.st_mode) == FileType::RegularFile) {
            let existing = self.rel_path(ino);
            let new = self.rel_path(newparent).map(|p| p.join(newname));
            if let (Ok(e), Ok(n)) = (existing, new) {
                if let Err(err) = self.cache().store().linked(&e, &n) {
                    self.note(&format!("cannot link the tables of {}", e.display()), err);
                }
            }
        }
        let attr = tryr!(reply, self.do_lookup(newparent, newname));
        reply.entry(&TTL, &attr, 0);
    }

    fn open(&mut self, _req: &Request, ino: u64, flags: i32, reply: Reply) {
        let fd = tryr!(reply, self.fd(ino));
        let st = tryr!(reply, stat_fd(fd.raw()));
        if kind(st.st_mode) == FileType::RegularFile {
            tryr!(reply, self.attach_sized(ino, Some(st.st_size as u64)));
            if flags & libc::O_TRUNC != 0 {
                tryr!(reply, self.cache().truncate(ino, 0));
            }
            self.cache().opened(ino);
        }
        reply.opened(0, FOPEN_DIRECT_IO);
    }

    fn release(&mut self, _req: &Request, ino: u64, reply: Reply) {
        self.settle_mtime(ino);
        self.cache().released(ino);
        reply.ok();
    }

    fn read(&mut self, _req: &Request, ino: u64, offset: u64, size: u32, reply: Reply) {
        tryr!(reply, self.attach(ino));
        reply.data_with(|out| self.cache().read_append(ino, offset, size as usize, out));
    }

    fn write(&mut self, _req: &Request, ino: u64, offset: u64, data: &[u8], write_flags: u32, reply: Reply) {
        tryr!(reply, self.attach(ino));
        tryr!(reply, self.room_for(data.len()));
        self.may_have_tables(ino);
        let n = tryr!(reply, self.cache().write(ino, offset, data));
        if write_flags & FUSE_WRITE_KILL_SUIDGID != 0 {
            if let Ok(fd) = self.fd(ino) {
                self.kill_suidgid(fd.raw());
            }
        }
        self.mtime_due.insert(ino);
        reply.written(n as u32);
    }

    fn fsync(&mut self, _req: &Request, ino: u64, reply: Reply) {
        self.settle_mtime(ino);
        if self.cache().is_attached(ino) {
            tryr!(reply, self.cache().fsync(ino));
        }
        reply.ok();
    }

    /// Entries come straight from the backing directory, with its own `d_off` cookies as
    /// offsets: they stay valid while entries are removed, and each call reads only what
    /// it returns.
    fn readdir(&mut self, _req: &Request, ino: u64, offset: i64, mut reply: Reply) {
        let fd = tryr!(reply, self.fd(ino));
        let dir = tryr!(reply, reopen(fd.raw(), libc::O_RDONLY | libc::O_DIRECTORY));
        // SAFETY: seeking our own directory descriptor to a cookie it gave out.
        if unsafe { libc::lseek(dir.as_raw_fd(), offset, libc::SEEK_SET) } < 0 {
            return reply.error(errno());
        }
        let mut buf = [0u8; 8192];
        loop {
            // SAFETY: getdents64 into our buffer.
            let n = unsafe { libc::syscall(libc::SYS_getdents64, dir.as_raw_fd(), buf.as_mut_ptr(), buf.len()) };
            if n < 0 {
                return reply.error(errno());
            }
            if n == 0 {
                break;
            }
            let mut at = 0usize;
            while at < n as usize {
                // struct linux_dirent64: u64 ino, i64 off, u16 reclen, u8 type, name.
                let d_ino = u64::from_ne_bytes(buf[at..at + 8].try_into().expect("8 bytes"));
                let d_off = i64::from_ne_bytes(buf[at + 8..at + 16].try_into().expect("8 bytes"));
                let reclen = u16::from_ne_bytes([buf[at + 16], buf[at + 17]]) as usize;
                let d_type = buf[at + 18];
                let name_bytes = &buf[at + 19..at + reclen];
                let name = OsStr::from_bytes(
                    &name_bytes[..name_bytes.iter().position(|&b| b == 0).unwrap_or(name_bytes.len())],
                );
                at += reclen;
                if self.hidden(ino, name) {
                    continue;
                }
                let eino = if ino == FUSE_ROOT_ID && name.as_bytes() == b".." {
                    FUSE_ROOT_ID
                } else {
                    self.ino_of(d_ino)
                };
                if reply.add(eino, d_off, dirent_kind(d_type), name) {
                    return reply.done();
                }
            }
        }
        reply.done();
    }

    fn fsyncdir(&mut self, _req: &Request, ino: u64, reply: Reply) {
        let fd = tryr!(reply, self.fd(ino));
        let dir = tryr!(reply, reopen(fd.raw(), libc::O_RDONLY | libc::O_DIRECTORY));
        tryr!(reply, dir.sync_all().map_err(io_errno));
        reply.ok();
    }

    fn statfs(&mut self, _req: &Request, reply: Reply) {
        // SAFETY: statvfs is plain data; the kernel fills it in.
        let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: valid fd and output struct.
        if unsafe { libc::fstatvfs(self.root_dir.as_raw_fd(), &mut s) } < 0 {
            return reply.error(errno());
        }
        reply.statfs(
            s.f_blocks,
            s.f_bfree,
            s.f_bavail,
            s.f_files,
            s.f_ffree,
            s.f_bsize as u32,
            s.f_namemax as u32,
            s.f_frsize as u32,
        );
    }

    fn create(&mut self, req: &Request, parent: u64, name: &OsStr, mode: u32, umask: u32, flags: i32, reply: Reply) {
        if self.hidden(parent, name) {
            return reply.error(libc::EPERM);
        }
        let pfd = tryr!(reply, self.fd(parent));
        let c = tryr!(reply, cstr(name));
        let excl = libc::O_CREAT | libc::O_EXCL | libc::O_RDWR | libc::O_CLOEXEC;
        // SAFETY: valid dir fd and name.
        let r = unsafe { libc::openat(pfd.raw(), c.as_ptr(), excl, mode & !umask) };
        if r < 0 {
            if errno() != libc::EEXIST || (flags & libc::O_EXCL != 0 && !req.resent()) {
                return reply.error(errno());
            }
            // It exists (or this is a replay of our own create): opened like any file.
            let attr = tryr!(reply, self.do_lookup(parent, name));
            if attr.kind != FileType::RegularFile {
                return reply.error(libc::EISDIR);
            }
            tryr!(reply, self.attach(attr.ino));
            if flags & libc::O_TRUNC != 0 {
                tryr!(reply, self.cache().truncate(attr.ino, 0));
            }
            self.cache().opened(attr.ino);
            let attr = match self.fd(attr.ino).and_then(|fd| stat_fd(fd.raw())) {
                Ok(st) => self.attr(attr.ino, &st),
                Err(_) => attr,
            };
            return reply.created(&TTL, &attr, 0, 0, FOPEN_DIRECT_IO);
        }
        // A new file: the descriptor just made is the cache's, and it has no tables yet
        // (stale ones at its path are removed).
        // SAFETY: our own new descriptor.
        let data = unsafe { File::from_raw_fd(r) };
        let mut st = tryr!(reply, stat_fd(r));
        self.own(pfd.raw(), &c, req, &mut st);
        let handle = tryr!(reply, handle_of(r, &CString::default()));
        let attr = self.register(parent, name, &st, handle);
        self.fresh_tables(parent, name);
        if let Some(i) = self.inodes.get_mut(&attr.ino) {
            i.tableless = i.lookups == 1;
        }
        let place = tryr!(reply, self.place_of(attr.ino));
        tryr!(
            reply,
            self.cache()
                .attach(attr.ino, |_| Ok((data, Tables::unwritten(place), st.st_size as u64)))
        );
        self.cache().opened(attr.ino);
        reply.created(&TTL, &attr, 0, 0, FOPEN_DIRECT_IO);
    }

    fn fallocate(&mut self, _req: &Request, ino: u64, offset: i64, length: i64, mode: i32, reply: Reply) {
        if offset < 0 || length <= 0 {
            return reply.error(libc::EINVAL);
        }
        let (off, len) = (offset as u64, length as u64);
        let end = tryr!(reply, off.checked_add(len).ok_or(libc::EFBIG));
        tryr!(reply, self.attach(ino));
        self.may_have_tables(ino);
        let size = self.cache().size(ino).unwrap_or(0);
        const ZEROING: i32 = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_ZERO_RANGE;
        match mode & !libc::FALLOC_FL_KEEP_SIZE {
            // Preallocation: the file reads the same, only its size may grow.
            0 => {
                if mode & libc::FALLOC_FL_KEEP_SIZE == 0 && end > size {
                    tryr!(reply, self.room_for(0));
                    tryr!(reply, self.cache().truncate(ino, end));
                }
            }
            // Punched or zeroed ranges read as zeros: written as zeros through the cache,
            // so that their checksums stay right (the space is not given back).
            m if m & !ZEROING == 0
                && (m & libc::FALLOC_FL_PUNCH_HOLE == 0 || mode & libc::FALLOC_FL_KEEP_SIZE != 0) =>
            {
                let stop = if mode & libc::FALLOC_FL_KEEP_SIZE != 0 {
                    end.min(size)
                } else {
                    end
                };
                let zeros = vec![0u8; 1 << 20];
                let mut at = off;
                while at < stop {
                    let n = (stop - at).min(zeros.len() as u64) as usize;
                    tryr!(reply, self.room_for(n));
                    tryr!(reply, self.cache().write(ino, at, &zeros[..n]));
                    at += n as u64;
                }
            }
            _ => return reply.error(libc::EOPNOTSUPP),
        }
        reply.ok();
    }

    fn lseek(&mut self, _req: &Request, ino: u64, offset: i64, whence: i32, reply: Reply) {
        if whence != libc::SEEK_DATA && whence != libc::SEEK_HOLE {
            return reply.error(libc::EINVAL);
        }
        if offset < 0 {
            return reply.error(libc::ENXIO);
        }
        let at = tryr!(reply, self.seek_data_hole(ino, offset as u64, whence));
        reply.offset(at as i64);
    }
}

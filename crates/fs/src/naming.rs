//! The naming layer: FUSE operations on a backing directory tree (`STORE/data`). Names,
//! directories, links, permissions and times live in the backing filesystem; file data
//! goes through the checksummed cache. Every inode we know is held by an `O_PATH` file
//! descriptor, so renames never invalidate anything, and the FUSE inode number is the
//! backing inode number (the root is 1), which also keys the block CRC tables.

use crate::cache::Cache;
use fuser::consts::FOPEN_DIRECT_IO;
use fuser::{
    FileAttr, FileType, Filesystem, KernelConfig, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty,
    ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request, TimeOrNow, FUSE_ROOT_ID,
};
use std::collections::{HashMap, HashSet};
use std::ffi::{CString, OsStr};
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The kernel may cache names and attributes this long; data is never cached by the kernel
/// (every open is direct I/O), so that this cache is the one serving reads.
const TTL: Duration = Duration::from_secs(1);

struct Inode {
    fd: OwnedFd,
    lookups: u64,
    /// Its last link is gone; the CRC table goes when the kernel forgets it.
    orphan: bool,
}

pub struct Naming {
    /// The backing root opened for reading: the mount fd that open_by_handle_at needs
    /// (it refuses an O_PATH descriptor).
    root_dir: File,
    /// Requests a crashed daemon may have carried out already: they are replayed, so a
    /// name that already exists (or is already gone) is their own earlier effect.
    replayed: HashSet<u64>,
    root_st_ino: u64,
    inodes: HashMap<u64, Inode>,
    pub cache: Arc<Mutex<Cache>>,
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)
}

fn cstr(name: &OsStr) -> Result<CString, i32> {
    CString::new(name.as_bytes()).map_err(|_| libc::EINVAL)
}

fn proc_path(fd: RawFd) -> CString {
    CString::new(format!("/proc/self/fd/{fd}")).expect("no NUL")
}

fn stat_fd(fd: RawFd) -> Result<libc::stat, i32> {
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

impl Naming {
    pub fn new(data_root: &Path, cache: Arc<Mutex<Cache>>, replayed: HashSet<u64>) -> std::io::Result<Naming> {
        let root = File::open(data_root)?;
        let st = stat_fd(root.as_raw_fd()).map_err(std::io::Error::from_raw_os_error)?;
        let fd = open_path(libc::AT_FDCWD, &CString::new(data_root.as_os_str().as_bytes()).unwrap())
            .map_err(std::io::Error::from_raw_os_error)?;
        let mut inodes = HashMap::new();
        inodes.insert(
            FUSE_ROOT_ID,
            Inode {
                fd,
                lookups: 1,
                orphan: false,
            },
        );
        Ok(Naming {
            root_dir: root,
            replayed,
            root_st_ino: st.st_ino,
            inodes,
            cache,
        })
    }

    fn ino_of(&self, st_ino: u64) -> u64 {
        if st_ino == self.root_st_ino {
            FUSE_ROOT_ID
        } else {
            st_ino
        }
    }

    /// The O_PATH descriptor of `ino`. An inode the kernel knows but this daemon does not
    /// (we were restarted) is reopened from the file handle kept in shared memory.
    fn fd(&mut self, ino: u64) -> Result<RawFd, i32> {
        if let Some(i) = self.inodes.get(&ino) {
            return Ok(i.fd.as_raw_fd());
        }
        let Some((lookups, htype, handle)) = self.cache().shared().handle(ino) else {
            return Err(libc::ESTALE);
        };
        let root = self.root_dir.as_raw_fd();
        let fd = open_by_handle(root, htype, &handle, libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC).inspect_err(
            |e| {
                eprintln!("lockstep fs: inode {ino} does not reopen from its handle: errno {e}");
            },
        )?;
        let raw = fd.as_raw_fd();
        self.inodes.insert(
            ino,
            Inode {
                fd,
                lookups,
                orphan: false,
            },
        );
        Ok(raw)
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, Cache> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn attr(&self, ino: u64, st: &libc::stat) -> FileAttr {
        let mut size = st.st_size as u64;
        if kind(st.st_mode) == FileType::RegularFile {
            if let Some(s) = self.cache().size(ino) {
                size = s;
            }
        }
        FileAttr {
            ino,
            size,
            blocks: size.div_ceil(512),
            atime: time(st.st_atime, st.st_atime_nsec),
            mtime: time(st.st_mtime, st.st_mtime_nsec),
            ctime: time(st.st_ctime, st.st_ctime_nsec),
            crtime: UNIX_EPOCH,
            kind: kind(st.st_mode),
            perm: (st.st_mode & 0o7777) as u16,
            nlink: st.st_nlink as u32,
            uid: st.st_uid,
            gid: st.st_gid,
            rdev: st.st_rdev as u32,
            blksize: 4096,
            flags: 0,
        }
    }

    /// Look `name` up in `parent`, registering the inode (one more kernel reference).
    fn do_lookup(&mut self, parent: u64, name: &OsStr) -> Result<FileAttr, i32> {
        let pfd = self.fd(parent)?;
        let c = cstr(name)?;
        let st = stat_at(pfd, &c)?;
        let ino = self.ino_of(st.st_ino);
        // An inode we lost in a restart but the kernel still holds is found again here.
        let known =
            self.inodes.contains_key(&ino) || (self.cache().shared().handle(ino).is_some() && self.fd(ino).is_ok());
        match self.inodes.get_mut(&ino) {
            Some(i) if known => {
                i.lookups += 1;
                let n = i.lookups;
                self.cache().shared().set_lookups(ino, n);
            }
            _ => {
                let fd = open_path(pfd, &c)?;
                if let Some((htype, handle)) = handle_of(pfd, &c) {
                    self.cache().shared().put_handle(ino, 1, htype, &handle);
                }
                self.inodes.insert(
                    ino,
                    Inode {
                        fd,
                        lookups: 1,
                        orphan: false,
                    },
                );
            }
        }
        Ok(self.attr(ino, &st))
    }

    /// Open the data of a regular file read-write for the cache.
    fn attach(&mut self, ino: u64) -> Result<(), i32> {
        let fd = self.fd(ino)?;
        self.cache().attach(ino, || {
            let p = proc_path(fd);
            // SAFETY: NUL-terminated path; the returned fd is owned by the File.
            let r = unsafe { libc::open(p.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
            if r < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(unsafe { File::from_raw_fd(r) })
        })
    }

    fn chown_to(&self, dir: RawFd, name: &CString, req: &Request<'_>) {
        // SAFETY: valid fd and path. Failure leaves root as owner, which only matters
        // when non-root users write here.
        unsafe { libc::fchownat(dir, name.as_ptr(), req.uid(), req.gid(), libc::AT_SYMLINK_NOFOLLOW) };
    }

    /// An inode whose last link is going away: remember it, or drop its tables at once if
    /// the kernel holds no reference to it.
    fn unlinking(&mut self, st: &libc::stat) {
        if kind(st.st_mode) != FileType::RegularFile || st.st_nlink > 1 {
            return;
        }
        let ino = self.ino_of(st.st_ino);
        match self.inodes.get_mut(&ino) {
            Some(i) => i.orphan = true,
            None => self.cache().remove(ino),
        }
    }

    /// Write-back must not find the disk full: a write is accepted only if the store has
    /// room for it and for everything dirty before it. Otherwise the writer gets ENOSPC
    /// now, while it can still act on it.
    fn room_for(&mut self, len: usize) -> Result<(), i32> {
        let root = self.fd(FUSE_ROOT_ID)?;
        let avail = || -> Result<u64, i32> {
            let fd = root;
            let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
            let p = proc_path(fd);
            // SAFETY: valid path and output struct.
            if unsafe { libc::statvfs(p.as_ptr(), &mut s) } < 0 {
                return Err(errno());
            }
            Ok(s.f_bavail * s.f_frsize)
        };
        // Block tables and directory growth need a little room of their own.
        const MARGIN: u64 = 256 << 10;
        let need = |c: &Cache| c.dirty_bytes() + len as u64 + MARGIN;
        if avail()? >= need(&self.cache()) {
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
    /// a replay (then its earlier run did the work: mkdir gives EEXIST, unlink ENOENT).
    fn failure(&self, req: &Request<'_>, tolerated: i32) -> Option<i32> {
        let e = errno();
        (e != tolerated || !self.replayed.contains(&req.unique())).then_some(e)
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
        let p = proc_path(fd);
        // SAFETY: valid path and a two-element times array.
        unsafe { libc::utimensat(libc::AT_FDCWD, p.as_ptr(), times.as_ptr(), 0) };
    }
}

/// The kernel's file handle for `name` in `dir` (for reopening after a restart).
fn handle_of(dir: RawFd, name: &CString) -> Option<(i32, Vec<u8>)> {
    let mut fh = FileHandle {
        bytes: crate::shared::HANDLE_MAX as u32,
        htype: 0,
        data: [0; 128],
    };
    let mut mount_id: libc::c_int = 0;
    // SAFETY: fh has room for HANDLE_MAX bytes as announced in `bytes`.
    let r = unsafe {
        libc::name_to_handle_at(
            dir,
            name.as_ptr(),
            (&mut fh as *mut FileHandle).cast(),
            &mut mount_id,
            0,
        )
    };
    (r == 0).then(|| (fh.htype, fh.data[..fh.bytes as usize].to_vec()))
}

pub(crate) fn open_by_handle(mount_fd: RawFd, htype: i32, handle: &[u8], flags: i32) -> Result<OwnedFd, i32> {
    let mut fh = FileHandle {
        bytes: handle.len() as u32,
        htype,
        data: [0; 128],
    };
    fh.data[..handle.len()].copy_from_slice(handle);
    // SAFETY: a well-formed handle buffer; the returned fd is owned.
    let r = unsafe { libc::open_by_handle_at(mount_fd, (&mut fh as *mut FileHandle).cast(), flags) };
    if r < 0 {
        return Err(errno());
    }
    Ok(unsafe { OwnedFd::from_raw_fd(r) })
}

/// `struct file_handle` with room for its bytes.
#[repr(C)]
struct FileHandle {
    bytes: u32,
    htype: i32,
    data: [u8; 128],
}

fn open_path(dir: RawFd, name: &CString) -> Result<OwnedFd, i32> {
    // SAFETY: valid dir fd and name; the new fd is owned.
    let r = unsafe { libc::openat(dir, name.as_ptr(), libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC) };
    if r < 0 {
        return Err(errno());
    }
    Ok(unsafe { OwnedFd::from_raw_fd(r) })
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

impl Filesystem for Naming {
    fn init(&mut self, _req: &Request<'_>, _config: &mut KernelConfig) -> Result<(), libc::c_int> {
        Ok(())
    }

    fn destroy(&mut self) {
        let _ = self.cache().flush(None, Duration::ZERO);
    }

    fn lookup(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEntry) {
        let attr = tryr!(reply, self.do_lookup(parent, name));
        reply.entry(&TTL, &attr, 0);
    }

    fn forget(&mut self, _req: &Request<'_>, ino: u64, nlookup: u64) {
        if ino == FUSE_ROOT_ID {
            return;
        }
        if self.fd(ino).is_err() {
            return;
        }
        let Some(i) = self.inodes.get_mut(&ino) else { return };
        i.lookups = i.lookups.saturating_sub(nlookup);
        let left = i.lookups;
        if left > 0 {
            self.cache().shared().set_lookups(ino, left);
        } else {
            let orphan = self.inodes[&ino].orphan;
            self.inodes.remove(&ino);
            let mut c = self.cache();
            c.shared().drop_handle(ino);
            if orphan {
                c.remove(ino);
            } else {
                c.release_inode(ino);
            }
        }
    }

    fn getattr(&mut self, _req: &Request<'_>, ino: u64, _fh: Option<u64>, reply: ReplyAttr) {
        let fd = tryr!(reply, self.fd(ino));
        let st = tryr!(reply, stat_fd(fd));
        reply.attr(&TTL, &self.attr(ino, &st));
    }

    fn setattr(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<u64>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<u32>,
        reply: ReplyAttr,
    ) {
        let fd = tryr!(reply, self.fd(ino));
        let p = proc_path(fd);
        if let Some(m) = mode {
            // SAFETY: valid path.
            if unsafe { libc::chmod(p.as_ptr(), m & 0o7777) } < 0 {
                return reply.error(errno());
            }
        }
        if uid.is_some() || gid.is_some() {
            let (u, g) = (uid.unwrap_or(u32::MAX), gid.unwrap_or(u32::MAX));
            // SAFETY: valid fd, empty path with AT_EMPTY_PATH.
            if unsafe { libc::fchownat(fd, c"".as_ptr(), u, g, libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW) } < 0 {
                return reply.error(errno());
            }
        }
        if let Some(s) = size {
            tryr!(reply, self.attach(ino));
            tryr!(reply, self.cache().truncate(ino, s));
        }
        if atime.is_some() || mtime.is_some() {
            let times = [timespec(atime), timespec(mtime)];
            // SAFETY: valid path and times.
            if unsafe { libc::utimensat(libc::AT_FDCWD, p.as_ptr(), times.as_ptr(), 0) } < 0 {
                return reply.error(errno());
            }
        } else if size.is_some() {
            self.touch_mtime(fd);
        }
        let st = tryr!(reply, stat_fd(fd));
        reply.attr(&TTL, &self.attr(ino, &st));
    }

    fn readlink(&mut self, _req: &Request<'_>, ino: u64, reply: ReplyData) {
        let fd = tryr!(reply, self.fd(ino));
        let mut buf = vec![0u8; libc::PATH_MAX as usize];
        // SAFETY: valid fd and buffer.
        let n = unsafe { libc::readlinkat(fd, c"".as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            return reply.error(errno());
        }
        reply.data(&buf[..n as usize]);
    }

    fn mknod(
        &mut self,
        req: &Request<'_>,
        parent: u64,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        let pfd = tryr!(reply, self.fd(parent));
        let c = tryr!(reply, cstr(name));
        // SAFETY: valid dir fd and name.
        if unsafe { libc::mknodat(pfd, c.as_ptr(), mode & !umask, rdev as libc::dev_t) } < 0 {
            if let Some(e) = self.failure(req, libc::EEXIST) {
                return reply.error(e);
            }
        }
        self.chown_to(pfd, &c, req);
        let attr = tryr!(reply, self.do_lookup(parent, name));
        reply.entry(&TTL, &attr, 0);
    }

    fn mkdir(&mut self, req: &Request<'_>, parent: u64, name: &OsStr, mode: u32, umask: u32, reply: ReplyEntry) {
        let pfd = tryr!(reply, self.fd(parent));
        let c = tryr!(reply, cstr(name));
        // SAFETY: valid dir fd and name.
        if unsafe { libc::mkdirat(pfd, c.as_ptr(), (mode & !umask) as libc::mode_t) } < 0 {
            if let Some(e) = self.failure(req, libc::EEXIST) {
                return reply.error(e);
            }
        }
        self.chown_to(pfd, &c, req);
        let attr = tryr!(reply, self.do_lookup(parent, name));
        reply.entry(&TTL, &attr, 0);
    }

    fn unlink(&mut self, req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEmpty) {
        let pfd = tryr!(reply, self.fd(parent));
        let c = tryr!(reply, cstr(name));
        let st = match stat_at(pfd, &c) {
            Ok(st) => st,
            Err(libc::ENOENT) if self.replayed.contains(&req.unique()) => return reply.ok(),
            Err(e) => return reply.error(e),
        };
        // SAFETY: valid dir fd and name.
        if unsafe { libc::unlinkat(pfd, c.as_ptr(), 0) } < 0 {
            return reply.error(errno());
        }
        self.unlinking(&st);
        reply.ok();
    }

    fn rmdir(&mut self, req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEmpty) {
        let pfd = tryr!(reply, self.fd(parent));
        let c = tryr!(reply, cstr(name));
        // SAFETY: valid dir fd and name.
        if unsafe { libc::unlinkat(pfd, c.as_ptr(), libc::AT_REMOVEDIR) } < 0 {
            if let Some(e) = self.failure(req, libc::ENOENT) {
                return reply.error(e);
            }
        }
        reply.ok();
    }

    fn symlink(&mut self, req: &Request<'_>, parent: u64, link_name: &OsStr, target: &Path, reply: ReplyEntry) {
        let pfd = tryr!(reply, self.fd(parent));
        let c = tryr!(reply, cstr(link_name));
        let t = tryr!(reply, cstr(target.as_os_str()));
        // SAFETY: valid strings and dir fd.
        if unsafe { libc::symlinkat(t.as_ptr(), pfd, c.as_ptr()) } < 0 {
            if let Some(e) = self.failure(req, libc::EEXIST) {
                return reply.error(e);
            }
        }
        self.chown_to(pfd, &c, req);
        let attr = tryr!(reply, self.do_lookup(parent, link_name));
        reply.entry(&TTL, &attr, 0);
    }

    fn rename(
        &mut self,
        req: &Request<'_>,
        parent: u64,
        name: &OsStr,
        newparent: u64,
        newname: &OsStr,
        flags: u32,
        reply: ReplyEmpty,
    ) {
        let pfd = tryr!(reply, self.fd(parent));
        let nfd = tryr!(reply, self.fd(newparent));
        let c = tryr!(reply, cstr(name));
        let n = tryr!(reply, cstr(newname));
        let replaced = stat_at(nfd, &n).ok();
        // SAFETY: valid fds and names.
        let r = unsafe { libc::syscall(libc::SYS_renameat2, pfd, c.as_ptr(), nfd, n.as_ptr(), flags) };
        if r < 0 {
            return match self.failure(req, libc::ENOENT) {
                Some(e) => reply.error(e),
                None => reply.ok(),
            };
        }
        if let Some(st) = replaced {
            if flags & libc::RENAME_EXCHANGE == 0 {
                self.unlinking(&st);
            }
        }
        reply.ok();
    }

    fn link(&mut self, req: &Request<'_>, ino: u64, newparent: u64, newname: &OsStr, reply: ReplyEntry) {
        let fd = tryr!(reply, self.fd(ino));
        let nfd = tryr!(reply, self.fd(newparent));
        let n = tryr!(reply, cstr(newname));
        // SAFETY: valid fds and name; AT_EMPTY_PATH links the inode the O_PATH fd holds.
        if unsafe { libc::linkat(fd, c"".as_ptr(), nfd, n.as_ptr(), libc::AT_EMPTY_PATH) } < 0 {
            if let Some(e) = self.failure(req, libc::EEXIST) {
                return reply.error(e);
            }
        }
        let attr = tryr!(reply, self.do_lookup(newparent, newname));
        reply.entry(&TTL, &attr, 0);
    }

    fn open(&mut self, _req: &Request<'_>, ino: u64, flags: i32, reply: ReplyOpen) {
        let fd = tryr!(reply, self.fd(ino));
        let st = tryr!(reply, stat_fd(fd));
        if kind(st.st_mode) == FileType::RegularFile {
            tryr!(reply, self.attach(ino));
            if flags & libc::O_TRUNC != 0 {
                tryr!(reply, self.cache().truncate(ino, 0));
            }
        }
        reply.opened(0, FOPEN_DIRECT_IO);
    }

    fn read(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        size: u32,
        _flags: i32,
        _lock_owner: Option<u64>,
        reply: ReplyData,
    ) {
        tryr!(reply, self.attach(ino));
        let data = tryr!(reply, self.cache().read(ino, offset.max(0) as u64, size as usize));
        reply.data(&data);
    }

    fn write(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        data: &[u8],
        _write_flags: u32,
        _flags: i32,
        _lock_owner: Option<u64>,
        reply: ReplyWrite,
    ) {
        tryr!(reply, self.attach(ino));
        tryr!(reply, self.room_for(data.len()));
        let n = tryr!(reply, self.cache().write(ino, offset.max(0) as u64, data));
        if let Ok(fd) = self.fd(ino) {
            self.touch_mtime(fd);
        }
        reply.written(n as u32);
    }

    fn flush(&mut self, _req: &Request<'_>, _ino: u64, _fh: u64, _lock_owner: u64, reply: ReplyEmpty) {
        reply.ok();
    }

    fn fsync(&mut self, _req: &Request<'_>, ino: u64, _fh: u64, _datasync: bool, reply: ReplyEmpty) {
        if self.cache().is_attached(ino) {
            tryr!(reply, self.cache().fsync(ino));
        }
        reply.ok();
    }

    fn opendir(&mut self, _req: &Request<'_>, _ino: u64, _flags: i32, reply: ReplyOpen) {
        reply.opened(0, 0);
    }

    fn readdir(&mut self, _req: &Request<'_>, ino: u64, _fh: u64, offset: i64, mut reply: ReplyDirectory) {
        let fd = tryr!(reply, self.fd(ino));
        let dir = match std::fs::read_dir(Path::new(&format!("/proc/self/fd/{fd}"))) {
            Ok(d) => d,
            Err(e) => return reply.error(e.raw_os_error().unwrap_or(libc::EIO)),
        };
        let mut entries: Vec<(u64, FileType, std::ffi::OsString)> = vec![
            (ino, FileType::Directory, ".".into()),
            (ino, FileType::Directory, "..".into()),
        ];
        for e in dir.flatten() {
            use std::os::unix::fs::DirEntryExt;
            let ft = match e.file_type() {
                Ok(t) if t.is_dir() => FileType::Directory,
                Ok(t) if t.is_symlink() => FileType::Symlink,
                _ => FileType::RegularFile,
            };
            entries.push((self.ino_of(e.ino()), ft, e.file_name()));
        }
        for (i, (eino, ft, name)) in entries.iter().enumerate().skip(offset.max(0) as usize) {
            if reply.add(*eino, i as i64 + 1, *ft, name) {
                break;
            }
        }
        reply.ok();
    }

    fn fsyncdir(&mut self, _req: &Request<'_>, _ino: u64, _fh: u64, _datasync: bool, reply: ReplyEmpty) {
        reply.ok();
    }

    fn statfs(&mut self, _req: &Request<'_>, _ino: u64, reply: ReplyStatfs) {
        let fd = tryr!(reply, self.fd(FUSE_ROOT_ID));
        let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
        let p = proc_path(fd);
        // SAFETY: valid path and output struct.
        if unsafe { libc::statvfs(p.as_ptr(), &mut s) } < 0 {
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

    fn access(&mut self, _req: &Request<'_>, _ino: u64, _mask: i32, reply: ReplyEmpty) {
        // The kernel checks permissions itself (default_permissions).
        reply.ok();
    }

    fn create(
        &mut self,
        req: &Request<'_>,
        parent: u64,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let pfd = tryr!(reply, self.fd(parent));
        let c = tryr!(reply, cstr(name));
        let oflags = libc::O_CREAT | libc::O_RDWR | libc::O_CLOEXEC | (flags & libc::O_EXCL);
        // SAFETY: valid dir fd and name; the fd is closed right away.
        let mut r = unsafe { libc::openat(pfd, c.as_ptr(), oflags, mode & !umask) };
        if r < 0 {
            if let Some(e) = self.failure(req, libc::EEXIST) {
                return reply.error(e);
            }
            // A replayed O_EXCL create whose first run created the file: open it.
            r = unsafe { libc::openat(pfd, c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
            if r < 0 {
                return reply.error(errno());
            }
        }
        unsafe { libc::close(r) };
        self.chown_to(pfd, &c, req);
        let attr = tryr!(reply, self.do_lookup(parent, name));
        tryr!(reply, self.attach(attr.ino));
        if flags & libc::O_TRUNC != 0 {
            tryr!(reply, self.cache().truncate(attr.ino, 0));
        }
        reply.created(&TTL, &attr, 0, 0, FOPEN_DIRECT_IO);
    }

    fn fallocate(
        &mut self,
        _req: &Request<'_>,
        _ino: u64,
        _fh: u64,
        _offset: i64,
        _length: i64,
        _mode: i32,
        reply: ReplyEmpty,
    ) {
        reply.error(libc::EOPNOTSUPP);
    }
}

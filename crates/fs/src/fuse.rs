//! The FUSE protocol, spoken directly on `/dev/fuse`: request decoding (every length
//! checked against the message before use), replies, and the session loop.
//!
//! We speak protocol 7.31 plus two extended-INIT flags (`FUSE_DIRECT_IO_ALLOW_MMAP`, so
//! that `MAP_SHARED` works on direct-I/O files) and use `FUSE_NOTIFY_RESEND` (Linux 6.9)
//! after a restart: the kernel then sends again every request the dead daemon had read
//! and not answered, with `FUSE_UNIQUE_RESEND` set in its id. There is no relay process
//! in the data path: the daemon reads requests and writes replies itself, into buffers
//! allocated once.
//!
//! The trait mirrors the subset of operations the naming layer implements; anything else
//! is answered with ENOSYS, which the kernel remembers and stops asking.

use lockstep_core::le;
use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub const FUSE_ROOT_ID: u64 = 1;
/// The kernel asks the server to clear setuid/setgid on this write.
pub const FUSE_WRITE_KILL_SUIDGID: u32 = 1 << 2;
/// Set in the id of a request the kernel sends again after `FUSE_NOTIFY_RESEND`.
pub const FUSE_UNIQUE_RESEND: u64 = 1 << 63;

pub mod consts {
    pub const FOPEN_DIRECT_IO: u32 = 1 << 0;
}

/// Largest write (and read) the kernel sends in one request.
pub const MAX_WRITE: usize = 1 << 20;
/// A request buffer: the largest write plus its headers.
pub const BUFFER: usize = MAX_WRITE + 4096;

const MINOR: u32 = 31;
const FUSE_ASYNC_READ: u32 = 1 << 0;
const FUSE_BIG_WRITES: u32 = 1 << 5;
const FUSE_MAX_PAGES: u32 = 1 << 22;
const FUSE_CACHE_SYMLINKS: u32 = 1 << 23;
const FUSE_INIT_EXT: u32 = 1 << 30;
const FUSE_DIRECT_IO_ALLOW_MMAP_HI: u32 = 1 << (36 - 32);
const FUSE_NOTIFY_RESEND: i32 = 7;

mod op {
    pub const LOOKUP: u32 = 1;
    pub const FORGET: u32 = 2;
    pub const GETATTR: u32 = 3;
    pub const SETATTR: u32 = 4;
    pub const READLINK: u32 = 5;
    pub const SYMLINK: u32 = 6;
    pub const MKNOD: u32 = 8;
    pub const MKDIR: u32 = 9;
    pub const UNLINK: u32 = 10;
    pub const RMDIR: u32 = 11;
    pub const RENAME: u32 = 12;
    pub const LINK: u32 = 13;
    pub const OPEN: u32 = 14;
    pub const READ: u32 = 15;
    pub const WRITE: u32 = 16;
    pub const STATFS: u32 = 17;
    pub const RELEASE: u32 = 18;
    pub const FSYNC: u32 = 20;
    pub const FLUSH: u32 = 25;
    pub const INIT: u32 = 26;
    pub const OPENDIR: u32 = 27;
    pub const READDIR: u32 = 28;
    pub const RELEASEDIR: u32 = 29;
    pub const FSYNCDIR: u32 = 30;
    pub const ACCESS: u32 = 34;
    pub const CREATE: u32 = 35;
    pub const INTERRUPT: u32 = 36;
    pub const DESTROY: u32 = 38;
    pub const NOTIFY_REPLY: u32 = 41;
    pub const BATCH_FORGET: u32 = 42;
    pub const FALLOCATE: u32 = 43;
    pub const RENAME2: u32 = 45;
    pub const LSEEK: u32 = 46;
}

// setattr `valid` bits.
const FATTR_MODE: u32 = 1 << 0;
const FATTR_UID: u32 = 1 << 1;
const FATTR_GID: u32 = 1 << 2;
const FATTR_SIZE: u32 = 1 << 3;
const FATTR_ATIME: u32 = 1 << 4;
const FATTR_MTIME: u32 = 1 << 5;
const FATTR_ATIME_NOW: u32 = 1 << 7;
const FATTR_MTIME_NOW: u32 = 1 << 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileType {
    NamedPipe,
    CharDevice,
    BlockDevice,
    Directory,
    RegularFile,
    Symlink,
    Socket,
}

impl FileType {
    fn mode_bits(self) -> u32 {
        match self {
            FileType::NamedPipe => libc::S_IFIFO,
            FileType::CharDevice => libc::S_IFCHR,
            FileType::BlockDevice => libc::S_IFBLK,
            FileType::Directory => libc::S_IFDIR,
            FileType::RegularFile => libc::S_IFREG,
            FileType::Symlink => libc::S_IFLNK,
            FileType::Socket => libc::S_IFSOCK,
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct FileAttr {
    /// The nodeid the kernel knows the file by.
    pub ino: u64,
    /// The inode number `stat` shows.
    pub st_ino: u64,
    pub size: u64,
    pub blocks: u64,
    pub atime: SystemTime,
    pub mtime: SystemTime,
    pub ctime: SystemTime,
    pub kind: FileType,
    pub perm: u16,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u32,
    pub blksize: u32,
}

#[derive(Clone, Copy, Debug)]
pub enum TimeOrNow {
    SpecificTime(SystemTime),
    Now,
}

/// Who sent a request.
pub struct Request {
    unique: u64,
    uid: u32,
    gid: u32,
}

impl Request {
    pub fn uid(&self) -> u32 {
        self.uid
    }

    pub fn gid(&self) -> u32 {
        self.gid
    }

    /// The kernel sent this request again after a daemon restart: its first run may have
    /// done its work already.
    pub fn resent(&self) -> bool {
        self.unique & FUSE_UNIQUE_RESEND != 0
    }
}

/// What setattr asks to change.
#[derive(Default)]
pub struct SetAttr {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime: Option<TimeOrNow>,
    pub mtime: Option<TimeOrNow>,
}

/// The operations the naming layer implements.
pub trait Filesystem {
    fn destroy(&mut self);
    fn lookup(&mut self, req: &Request, parent: u64, name: &OsStr, reply: Reply);
    fn forget(&mut self, ino: u64, nlookup: u64);
    fn getattr(&mut self, req: &Request, ino: u64, reply: Reply);
    fn setattr(&mut self, req: &Request, ino: u64, set: SetAttr, reply: Reply);
    fn readlink(&mut self, req: &Request, ino: u64, reply: Reply);
    #[allow(clippy::too_many_arguments)]
    fn mknod(&mut self, req: &Request, parent: u64, name: &OsStr, mode: u32, umask: u32, rdev: u32, reply: Reply);
    fn mkdir(&mut self, req: &Request, parent: u64, name: &OsStr, mode: u32, umask: u32, reply: Reply);
    fn unlink(&mut self, req: &Request, parent: u64, name: &OsStr, reply: Reply);
    fn rmdir(&mut self, req: &Request, parent: u64, name: &OsStr, reply: Reply);
    fn symlink(&mut self, req: &Request, parent: u64, name: &OsStr, target: &Path, reply: Reply);
    #[allow(clippy::too_many_arguments)]
    fn rename(
        &mut self,
        req: &Request,
        parent: u64,
        name: &OsStr,
        newparent: u64,
        newname: &OsStr,
        flags: u32,
        reply: Reply,
    );
    fn link(&mut self, req: &Request, ino: u64, newparent: u64, newname: &OsStr, reply: Reply);
    fn open(&mut self, req: &Request, ino: u64, flags: i32, reply: Reply);
    fn release(&mut self, req: &Request, ino: u64, reply: Reply);
    fn read(&mut self, req: &Request, ino: u64, offset: u64, size: u32, reply: Reply);
    fn write(&mut self, req: &Request, ino: u64, offset: u64, data: &[u8], write_flags: u32, reply: Reply);
    fn fsync(&mut self, req: &Request, ino: u64, reply: Reply);
    fn readdir(&mut self, req: &Request, ino: u64, offset: i64, reply: Reply);
    fn fsyncdir(&mut self, req: &Request, ino: u64, reply: Reply);
    fn statfs(&mut self, req: &Request, reply: Reply);
    #[allow(clippy::too_many_arguments)]
    fn create(&mut self, req: &Request, parent: u64, name: &OsStr, mode: u32, umask: u32, flags: i32, reply: Reply);
    fn fallocate(&mut self, req: &Request, ino: u64, offset: i64, length: i64, mode: i32, reply: Reply);
    fn lseek(&mut self, req: &Request, ino: u64, offset: i64, whence: i32, reply: Reply);
}

/// The one reply to one request. Dropped without an answer, it answers EIO, so that no
/// caller waits forever on a bug of ours.
pub struct Reply<'a> {
    fd: RawFd,
    unique: u64,
    buf: &'a mut Vec<u8>,
    /// For readdir: the most bytes of entries the kernel takes.
    limit: usize,
    sent: bool,
}

fn put_u32(b: &mut Vec<u8>, v: u32) {
    b.extend_from_slice(&v.to_le_bytes());
}

fn put_u64(b: &mut Vec<u8>, v: u64) {
    b.extend_from_slice(&v.to_le_bytes());
}

fn secs(t: SystemTime) -> (u64, u32) {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => (d.as_secs(), d.subsec_nanos()),
        Err(_) => (0, 0),
    }
}

fn put_attr(b: &mut Vec<u8>, a: &FileAttr) {
    let (at, atn) = secs(a.atime);
    let (mt, mtn) = secs(a.mtime);
    let (ct, ctn) = secs(a.ctime);
    for v in [a.st_ino, a.size, a.blocks, at, mt, ct] {
        put_u64(b, v);
    }
    for v in [
        atn,
        mtn,
        ctn,
        a.kind.mode_bits() | a.perm as u32,
        a.nlink,
        a.uid,
        a.gid,
        a.rdev,
        a.blksize,
        0,
    ] {
        put_u32(b, v);
    }
}

fn put_ttl(b: &mut Vec<u8>, ttl: &Duration) {
    put_u64(b, ttl.as_secs());
}

/// `fuse_entry_out`: the nodeid, its generation, how long the name and the attributes may
/// be cached, and the attributes.
fn put_entry(b: &mut Vec<u8>, ttl: &Duration, attr: &FileAttr, generation: u64) {
    put_u64(b, attr.ino);
    put_u64(b, generation);
    put_ttl(b, ttl);
    put_ttl(b, ttl);
    put_u32(b, ttl.subsec_nanos());
    put_u32(b, ttl.subsec_nanos());
    put_attr(b, attr);
}

impl Reply<'_> {
    fn begin(&mut self) {
        self.buf.clear();
        self.buf.resize(16, 0);
    }

    /// Send the header and what `begin` + the caller put in the buffer, then `extra`.
    fn finish(mut self, error: i32, extra: &[u8]) {
        let len = self.buf.len() + extra.len();
        self.buf[..4].copy_from_slice(&(len as u32).to_le_bytes());
        self.buf[4..8].copy_from_slice(&(-error).to_le_bytes());
        self.buf[8..16].copy_from_slice(&self.unique.to_le_bytes());
        let iov = [
            libc::iovec {
                iov_base: self.buf.as_ptr() as *mut libc::c_void,
                iov_len: self.buf.len(),
            },
            libc::iovec {
                iov_base: extra.as_ptr() as *mut libc::c_void,
                iov_len: extra.len(),
            },
        ];
        // SAFETY: two valid buffers; /dev/fuse takes one whole reply per write. A failure
        // (ENOENT: the request was interrupted and is gone) leaves nothing to do.
        unsafe { libc::writev(self.fd, iov.as_ptr(), if extra.is_empty() { 1 } else { 2 }) };
        self.sent = true;
    }

    pub fn error(mut self, errno: i32) {
        self.begin();
        self.finish(errno, &[]);
    }

    pub fn ok(mut self) {
        self.begin();
        self.finish(0, &[]);
    }

    pub fn entry(mut self, ttl: &Duration, attr: &FileAttr, generation: u64) {
        self.begin();
        put_entry(self.buf, ttl, attr, generation);
        self.finish(0, &[]);
    }

    pub fn attr(mut self, ttl: &Duration, attr: &FileAttr) {
        self.begin();
        let b = &mut *self.buf;
        put_ttl(b, ttl);
        put_u32(b, ttl.subsec_nanos());
        put_u32(b, 0);
        put_attr(b, attr);
        self.finish(0, &[]);
    }

    pub fn opened(mut self, fh: u64, flags: u32) {
        self.begin();
        put_u64(self.buf, fh);
        put_u32(self.buf, flags);
        put_u32(self.buf, 0);
        self.finish(0, &[]);
    }

    pub fn created(mut self, ttl: &Duration, attr: &FileAttr, generation: u64, fh: u64, flags: u32) {
        self.begin();
        let b = &mut *self.buf;
        put_entry(b, ttl, attr, generation);
        put_u64(b, fh);
        put_u32(b, flags);
        put_u32(b, 0);
        self.finish(0, &[]);
    }

    pub fn data(mut self, data: &[u8]) {
        self.begin();
        self.finish(0, data);
    }

    /// Reply with the bytes `fill` appends to the session's reused buffer, or with the
    /// error it returns.
    pub fn data_with(mut self, fill: impl FnOnce(&mut Vec<u8>) -> Result<(), i32>) {
        self.begin();
        match fill(self.buf) {
            Ok(()) => self.finish(0, &[]),
            Err(errno) => self.error(errno),
        }
    }

    pub fn written(mut self, size: u32) {
        self.begin();
        put_u32(self.buf, size);
        put_u32(self.buf, 0);
        self.finish(0, &[]);
    }

    #[allow(clippy::too_many_arguments)]
    pub fn statfs(
        mut self,
        blocks: u64,
        bfree: u64,
        bavail: u64,
        files: u64,
        ffree: u64,
        bsize: u32,
        namelen: u32,
        frsize: u32,
    ) {
        self.begin();
        let b = &mut *self.buf;
        for v in [blocks, bfree, bavail, files, ffree] {
            put_u64(b, v);
        }
        for v in [bsize, namelen, frsize, 0, 0, 0, 0, 0, 0, 0] {
            put_u32(b, v);
        }
        self.finish(0, &[]);
    }

    pub fn offset(mut self, offset: i64) {
        self.begin();
        put_u64(self.buf, offset as u64);
        self.finish(0, &[]);
    }
}

impl Drop for Reply<'_> {
    fn drop(&mut self) {
        if !self.sent {
            self.buf.clear();
            self.buf.resize(16, 0);
            let len = 16u32;
            self.buf[..4].copy_from_slice(&len.to_le_bytes());
            self.buf[4..8].copy_from_slice(&(-libc::EIO).to_le_bytes());
            self.buf[8..16].copy_from_slice(&self.unique.to_le_bytes());
            // SAFETY: writing our own buffer.
            unsafe { libc::write(self.fd, self.buf.as_ptr().cast(), 16) };
        }
    }
}

impl Reply<'_> {
    /// Add one entry; true when the reply is full (the entry was not added).
    pub fn add(&mut self, ino: u64, offset: i64, kind: FileType, name: &OsStr) -> bool {
        if self.buf.is_empty() {
            self.begin();
        }
        let name = name.as_bytes();
        let size = (24 + name.len()).next_multiple_of(8);
        if self.buf.len() - 16 + size > self.limit {
            return true;
        }
        let b = &mut *self.buf;
        put_u64(b, ino);
        put_u64(b, offset as u64);
        put_u32(b, name.len() as u32);
        put_u32(b, kind.mode_bits() >> 12);
        b.extend_from_slice(name);
        b.resize(b.len() + size - 24 - name.len(), 0);
        false
    }

    /// Send the entries added so far.
    pub fn done(mut self) {
        if self.buf.is_empty() {
            self.begin();
        }
        self.finish(0, &[]);
    }
}

/// Little-endian fields of a request body, every read bounds-checked.
struct Args<'a> {
    data: &'a [u8],
}

impl<'a> Args<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.data.len() < n {
            return None;
        }
        let (a, b) = self.data.split_at(n);
        self.data = b;
        Some(a)
    }

    fn u32(&mut self) -> Option<u32> {
        self.take(4).map(|b| le::u32_at(b, 0))
    }

    fn u64(&mut self) -> Option<u64> {
        self.take(8).map(|b| le::u64_at(b, 0))
    }

    /// A NUL-terminated name.
    fn name(&mut self) -> Option<&'a OsStr> {
        let end = self.data.iter().position(|&b| b == 0)?;
        let s = &self.data[..end];
        self.data = &self.data[end + 1..];
        Some(OsStr::from_bytes(s))
    }
}

fn time_of(set: bool, now: bool, secs: u64, nsecs: u32) -> Option<TimeOrNow> {
    if now {
        Some(TimeOrNow::Now)
    } else if set {
        Some(TimeOrNow::SpecificTime(
            UNIX_EPOCH + Duration::new(secs, nsecs.min(999_999_999)),
        ))
    } else {
        None
    }
}

/// How the session ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Ended {
    /// The filesystem was unmounted.
    Unmounted,
}

/// Fault in (and, where allowed, lock) every page of the request buffer before the first
/// read. The kernel copies a request into it; should that copy fault while this daemon is
/// being killed (a crash, or kill -9), the copy fails and the kernel ends the request
/// with EIO, which the application sees, instead of keeping it for the successor's
/// resend. A fresh `vec![0; n]` this large is untouched zero pages, so every restarted
/// daemon had that window on its first requests.
fn make_resident(buf: &mut [u8]) {
    const PAGE: usize = 4096;
    for i in (0..buf.len()).step_by(PAGE) {
        // SAFETY: a write within the buffer; volatile so that it is not elided.
        unsafe { std::ptr::write_volatile(buf.as_mut_ptr().add(i), 0) };
    }
    // Best effort: without CAP_IPC_LOCK or room under RLIMIT_MEMLOCK the touched pages
    // still stay resident unless the machine swaps.
    // SAFETY: locking our own buffer's pages.
    unsafe { libc::mlock(buf.as_ptr().cast(), buf.len()) };
}

/// Serves one FUSE connection from `fd`, in this thread.
pub struct Session<'f, FS: Filesystem> {
    fs: FS,
    fd: BorrowedFd<'f>,
    initialized: bool,
    destroyed: bool,
}

impl<'f, FS: Filesystem> Session<'f, FS> {
    /// `initialized`: the connection was set up by an earlier daemon (we are a restart).
    pub fn new(fs: FS, fd: BorrowedFd<'f>, initialized: bool) -> Self {
        Session {
            fs,
            fd,
            initialized,
            destroyed: false,
        }
    }

    /// Ask the kernel to send again every request a dead predecessor read but did not
    /// answer.
    pub fn request_resend(&self) -> io::Result<()> {
        let mut h = [0u8; 16];
        h[..4].copy_from_slice(&16u32.to_le_bytes());
        h[4..8].copy_from_slice(&FUSE_NOTIFY_RESEND.to_le_bytes());
        // SAFETY: one notification message from our buffer.
        if unsafe { libc::write(self.fd.as_raw_fd(), h.as_ptr().cast(), h.len()) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Serve until unmounted. `current` is told the id of the request being handled (0
    /// between requests), for the supervisor to know which request a crash happened in;
    /// `ready` is called once INIT has been answered.
    pub fn run(&mut self, mut current: impl FnMut(u64), mut ready: impl FnMut()) -> io::Result<Ended> {
        let mut req = vec![0u8; BUFFER];
        make_resident(&mut req);
        let mut out = Vec::with_capacity(BUFFER);
        loop {
            // SAFETY: reading one request into our buffer.
            let n = unsafe { libc::read(self.fd.as_raw_fd(), req.as_mut_ptr().cast(), req.len()) };
            if n < 0 {
                match io::Error::last_os_error().raw_os_error() {
                    Some(libc::ENODEV) => break,
                    // Interrupted, or a request withdrawn before we read it.
                    Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::ENOENT) => continue,
                    _ => return Err(io::Error::last_os_error()),
                }
            }
            let n = n as usize;
            if n < 40 {
                continue;
            }
            let len = le::u32_at(&req, 0) as usize;
            let opcode = le::u32_at(&req, 4);
            let unique = le::u64_at(&req, 8);
            let nodeid = le::u64_at(&req, 16);
            let r = Request {
                unique,
                uid: le::u32_at(&req, 24),
                gid: le::u32_at(&req, 28),
            };
            let body = &req[40..len.clamp(40, n)];
            current(unique);
            out.clear();
            let reply = Reply {
                fd: self.fd.as_raw_fd(),
                unique,
                buf: &mut out,
                limit: 0,
                sent: false,
            };
            let was = self.initialized;
            self.dispatch(opcode, nodeid, &r, body, reply);
            current(0);
            if !was && self.initialized {
                ready();
            }
            if self.destroyed {
                return Ok(Ended::Unmounted);
            }
        }
        if !self.destroyed {
            self.fs.destroy();
        }
        Ok(Ended::Unmounted)
    }

    fn dispatch(&mut self, opcode: u32, ino: u64, r: &Request, body: &[u8], reply: Reply) {
        let mut a = Args { data: body };
        if !self.initialized && opcode != op::INIT {
            return reply.error(libc::EIO);
        }
        // A request too short for its own arguments is answered EINVAL, never trusted.
        macro_rules! get {
            ($e:expr) => {
                match $e {
                    Some(v) => v,
                    None => return reply.error(libc::EINVAL),
                }
            };
        }
        let fs = &mut self.fs;
        match opcode {
            op::INIT => {
                let major = get!(a.u32());
                let minor = get!(a.u32());
                let max_readahead = get!(a.u32());
                let _kernel_flags = get!(a.u32());
                if major != 7 || minor < MINOR {
                    eprintln!("lockstep fs: the kernel speaks FUSE {major}.{minor}; 7.{MINOR} or later is needed");
                    return reply.error(libc::EPROTO);
                }
                let mut reply = reply;
                reply.begin();
                let b = &mut *reply.buf;
                put_u32(b, 7);
                put_u32(b, MINOR);
                put_u32(b, max_readahead);
                put_u32(
                    b,
                    // Not FUSE_ATOMIC_O_TRUNC: the kernel then truncates with a setattr,
                    // which also clears setuid/setgid when a non-owner truncates.
                    FUSE_ASYNC_READ | FUSE_BIG_WRITES | FUSE_MAX_PAGES | FUSE_CACHE_SYMLINKS | FUSE_INIT_EXT,
                );
                b.extend_from_slice(&16u16.to_le_bytes()); // max_background
                b.extend_from_slice(&12u16.to_le_bytes()); // congestion_threshold
                put_u32(b, MAX_WRITE as u32);
                put_u32(b, 1); // time_gran
                b.extend_from_slice(&((MAX_WRITE / 4096) as u16).to_le_bytes()); // max_pages
                b.extend_from_slice(&0u16.to_le_bytes()); // map_alignment
                put_u32(b, FUSE_DIRECT_IO_ALLOW_MMAP_HI); // flags2
                b.resize(16 + 64, 0);
                reply.finish(0, &[]);
                self.initialized = true;
            }
            op::DESTROY => {
                fs.destroy();
                self.destroyed = true;
                reply.ok();
            }
            op::LOOKUP => fs.lookup(r, ino, get!(a.name()), reply),
            op::FORGET => {
                no_reply(reply);
                fs.forget(ino, get_or(a.u64(), 0));
            }
            op::BATCH_FORGET => {
                no_reply(reply);
                let count = get_or(a.u32(), 0);
                // (a field this implementation does not use; a short body fails at the next read)
                let _ = a.u32();
                // The count is checked against the message, not trusted.
                for _ in 0..count {
                    let (Some(node), Some(n)) = (a.u64(), a.u64()) else {
                        break;
                    };
                    fs.forget(node, n);
                }
            }
            op::INTERRUPT | op::NOTIFY_REPLY => no_reply(reply),
            op::GETATTR => fs.getattr(r, ino, reply),
            op::SETATTR => {
                let valid = get!(a.u32());
                let _pad = get!(a.u32());
                let _fh = get!(a.u64());
                let size = get!(a.u64());
                let _lock_owner = get!(a.u64());
                let (atime, mtime, _ctime) = (get!(a.u64()), get!(a.u64()), get!(a.u64()));
                let (atimensec, mtimensec, _ctimensec) = (get!(a.u32()), get!(a.u32()), get!(a.u32()));
                let mode = get!(a.u32());
                let _unused = get!(a.u32());
                let (uid, gid) = (get!(a.u32()), get!(a.u32()));
                let has = |bit: u32| valid & bit != 0;
                let set = SetAttr {
                    mode: has(FATTR_MODE).then_some(mode),
                    uid: has(FATTR_UID).then_some(uid),
                    gid: has(FATTR_GID).then_some(gid),
                    size: has(FATTR_SIZE).then_some(size),
                    atime: time_of(has(FATTR_ATIME), has(FATTR_ATIME_NOW), atime, atimensec),
                    mtime: time_of(has(FATTR_MTIME), has(FATTR_MTIME_NOW), mtime, mtimensec),
                };
                fs.setattr(r, ino, set, reply)
            }
            op::READLINK => fs.readlink(r, ino, reply),
            op::SYMLINK => {
                let name = get!(a.name());
                let target = get!(a.name());
                fs.symlink(r, ino, name, Path::new(target), reply)
            }
            op::MKNOD => {
                let (mode, rdev, umask, _) = (get!(a.u32()), get!(a.u32()), get!(a.u32()), get!(a.u32()));
                fs.mknod(r, ino, get!(a.name()), mode, umask, rdev, reply)
            }
            op::MKDIR => {
                let (mode, umask) = (get!(a.u32()), get!(a.u32()));
                fs.mkdir(r, ino, get!(a.name()), mode, umask, reply)
            }
            op::UNLINK => fs.unlink(r, ino, get!(a.name()), reply),
            op::RMDIR => fs.rmdir(r, ino, get!(a.name()), reply),
            op::RENAME => {
                let newdir = get!(a.u64());
                let (name, newname) = (get!(a.name()), get!(a.name()));
                fs.rename(r, ino, name, newdir, newname, 0, reply)
            }
            op::RENAME2 => {
                let newdir = get!(a.u64());
                let (flags, _) = (get!(a.u32()), get!(a.u32()));
                let (name, newname) = (get!(a.name()), get!(a.name()));
                fs.rename(r, ino, name, newdir, newname, flags, reply)
            }
            op::LINK => {
                let old = get!(a.u64());
                fs.link(r, old, ino, get!(a.name()), reply)
            }
            op::OPEN => {
                let flags = get!(a.u32());
                fs.open(r, ino, flags as i32, reply)
            }
            op::OPENDIR => reply.opened(0, 0),
            op::READ => {
                let (_fh, offset, size) = (get!(a.u64()), get!(a.u64()), get!(a.u32()));
                fs.read(r, ino, offset, size.min(MAX_WRITE as u32), reply)
            }
            op::READDIR => {
                let (_fh, offset, size) = (get!(a.u64()), get!(a.u64()), get!(a.u32()));
                let mut reply = reply;
                reply.limit = (size as usize).min(MAX_WRITE);
                fs.readdir(r, ino, offset as i64, reply)
            }
            op::WRITE => {
                let (_fh, offset, size, write_flags) = (get!(a.u64()), get!(a.u64()), get!(a.u32()), get!(a.u32()));
                // (fields this implementation does not use; get! already answers a short body)
                let _ = (get!(a.u64()), get!(a.u32()), get!(a.u32()));
                let data = get!(a.take(size as usize));
                fs.write(r, ino, offset, data, write_flags, reply)
            }
            op::RELEASE => fs.release(r, ino, reply),
            op::RELEASEDIR | op::ACCESS => reply.ok(),
            // Nothing to do at close (data stays in the cache, locks are the kernel's):
            // ENOSYS makes the kernel stop sending it, one round trip less per close.
            op::FLUSH => reply.error(libc::ENOSYS),
            op::FSYNC => fs.fsync(r, ino, reply),
            op::FSYNCDIR => fs.fsyncdir(r, ino, reply),
            op::STATFS => fs.statfs(r, reply),
            op::CREATE => {
                let (flags, mode, umask, _) = (get!(a.u32()), get!(a.u32()), get!(a.u32()), get!(a.u32()));
                fs.create(r, ino, get!(a.name()), mode, umask, flags as i32, reply)
            }
            op::FALLOCATE => {
                let (_fh, offset, length, mode) = (get!(a.u64()), get!(a.u64()), get!(a.u64()), get!(a.u32()));
                fs.fallocate(r, ino, offset as i64, length as i64, mode as i32, reply)
            }
            op::LSEEK => {
                let (_fh, offset, whence) = (get!(a.u64()), get!(a.u64()), get!(a.u32()));
                fs.lseek(r, ino, offset as i64, whence as i32, reply)
            }
            _ => reply.error(libc::ENOSYS),
        }
    }
}

fn get_or<T>(v: Option<T>, d: T) -> T {
    v.unwrap_or(d)
}

/// Requests that take no reply (FORGET, INTERRUPT, ...).
fn no_reply(mut reply: Reply) {
    reply.sent = true;
}

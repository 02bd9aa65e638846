//! Mounting: open /dev/fuse, mount it (we run as root, so no fusermount is needed), and
//! serve the session, with the write-back and scrubber threads and a control socket.

use crate::cache::{Cache, Verify};
use crate::naming::Naming;
use crate::shared::Shared;
use crate::store::Store;
use lockstep_core::rng::Rng;
use lockstep_core::{Event, EventSink};
use std::ffi::CString;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct Options {
    pub store: PathBuf,
    pub mirror: Option<PathBuf>,
    pub mountpoint: PathBuf,
    pub verify: Verify,
    /// Pages checked per second by the background scrubber (0: off).
    pub scrub_rate: u64,
    pub cache_bytes: u64,
    /// Dirty pages older than this are written back.
    pub dirty_age: Duration,
    pub events: Option<PathBuf>,
    /// Accept `flip` on the control socket (measurements and tests only).
    pub test_flips: bool,
    /// Accept `crash` and `crash-damaged` on the control socket (tests and measurements).
    pub test_crash: bool,
}

/// The control socket of the mount whose store is `store`.
pub fn control_path(store: &Path) -> PathBuf {
    store.join(".lockstep").join("control.sock")
}

/// The mount source that names the store, so that `umount` can find the control socket.
fn source(store: &Path) -> String {
    format!("lockstep:{}", store.display())
}

/// The absolute path of a mountpoint, without touching the mount itself (a dead FUSE
/// mount cannot be stat'ed).
fn mount_path(path: &Path) -> Option<PathBuf> {
    let abs = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir().ok()?.join(path)
    };
    let parent = abs.parent()?.canonicalize().ok()?;
    Some(match abs.file_name() {
        Some(n) => parent.join(n),
        None => parent,
    })
}

/// Whether `path` is a mount point now (its entry in /proc/self/mountinfo).
pub fn is_mountpoint(path: &Path) -> bool {
    let Some(canon) = mount_path(path) else { return false };
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split(' ').nth(4).is_some_and(|m| Path::new(&unescape(m)) == canon))
}

/// The store of the lockstep mount at `path`, from /proc/self/mountinfo.
pub fn store_of(path: &Path) -> Option<PathBuf> {
    let canon = mount_path(path)?;
    for l in std::fs::read_to_string("/proc/self/mountinfo").ok()?.lines() {
        let fields: Vec<&str> = l.split(' ').collect();
        if fields.get(4).map(|m| PathBuf::from(unescape(m))) != Some(canon.clone()) {
            continue;
        }
        let after = fields.iter().position(|f| *f == "-")?;
        let src = unescape(fields.get(after + 2)?);
        return src.strip_prefix("lockstep:").map(PathBuf::from);
    }
    None
}

fn unescape(s: &str) -> String {
    s.replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
}

/// Whether the lockstep mount at `mountpoint` (per mountinfo) has lost its server: the
/// supervisor holds the store's lock for as long as it serves.
pub fn is_dead_mount(mountpoint: &Path) -> Option<PathBuf> {
    let store = store_of(mountpoint)?;
    match StoreLock::holder(&store) {
        Ok(None) => Some(store),
        _ => None,
    }
}

/// Check everything that can be checked before mounting; a clear message otherwise.
pub fn preflight(o: &Options) -> Result<(), String> {
    if let Some(store) = is_dead_mount(&o.mountpoint) {
        return Err(format!(
            "{} holds a dead lockstep mount (of {}): its server is gone and it answers every call with an \
             error. Run `lockstep fs umount {}` to clean it up, then mount again",
            o.mountpoint.display(),
            store.display(),
            o.mountpoint.display()
        ));
    }
    if is_mountpoint(&o.mountpoint) {
        return Err(format!(
            "mountpoint {} is busy: something is already mounted there",
            o.mountpoint.display()
        ));
    }
    if !o.mountpoint.is_dir() {
        return Err(format!("mountpoint {} is not a directory", o.mountpoint.display()));
    }
    for (what, dir) in std::iter::once(("store", &o.store)).chain(o.mirror.iter().map(|m| ("mirror", m))) {
        std::fs::create_dir_all(dir).map_err(|e| format!("cannot create the {what} {}: {e}", dir.display()))?;
        crate::store::require_store(dir, what)?;
        let probe = dir.join(crate::store::META).join("write-test");
        std::fs::write(&probe, b"x").map_err(|e| format!("the {what} {} is not writable: {e}", dir.display()))?;
        // (the probe proved the directory writable; a leftover probe file is harmless)
        let _ = std::fs::remove_file(probe);
        if let Ok(Some(holder)) = StoreLock::holder(dir) {
            return Err(format!("the {what} {} is in use: {holder}", dir.display()));
        }
    }
    if o.mirror
        .as_ref()
        .is_some_and(|m| m.canonicalize().ok() == o.store.canonicalize().ok())
    {
        return Err("--mirror must be another directory than --store".into());
    }
    // Inodes are kept as file handles: the store's filesystem must support them.
    let root = std::fs::File::open(&o.store).map_err(|e| format!("cannot open the store: {e}"))?;
    {
        use std::os::fd::AsRawFd;
        crate::naming::handle_of(root.as_raw_fd(), &CString::default()).map_err(|e| {
            format!(
                "the store {} is on a filesystem without file handles (name_to_handle_at: {}); use a \
                 local filesystem such as ext4, xfs, btrfs or tmpfs",
                o.store.display(),
                std::io::Error::from_raw_os_error(e)
            )
        })?;
    }
    Ok(())
}

/// The store's lock (`STORE/.lockstep/lock`, flock): held by the supervisor of the one
/// mount that serves the store, which also writes who it is into the file.
pub struct StoreLock {
    _file: std::fs::File,
}

impl StoreLock {
    fn path(store: &Path) -> PathBuf {
        store.join(crate::store::META).join("lock")
    }

    /// Take the lock, or say who holds it.
    pub fn take(store: &Path, mountpoint: &Path) -> Result<StoreLock, String> {
        use std::os::fd::AsRawFd;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(Self::path(store))
            .map_err(|e| format!("cannot open the lock of {}: {e}", store.display()))?;
        // SAFETY: flock on our own descriptor.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } < 0 {
            let who = std::fs::read_to_string(Self::path(store)).unwrap_or_default();
            return Err(format!("the store {} is in use: {}", store.display(), who.trim()));
        }
        f.set_len(0).map_err(|e| e.to_string())?;
        let who = format!(
            "mounted at {} by process {}\n",
            mountpoint.canonicalize().unwrap_or(mountpoint.to_path_buf()).display(),
            std::process::id()
        );
        std::os::unix::fs::FileExt::write_all_at(&f, who.as_bytes(), 0).map_err(|e| e.to_string())?;
        Ok(StoreLock { _file: f })
    }

    /// Who holds the lock of `store` (None: nobody).
    pub fn holder(store: &Path) -> std::io::Result<Option<String>> {
        use std::os::fd::AsRawFd;
        let f = match std::fs::File::open(Self::path(store)) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        // SAFETY: flock on our own descriptor; released when it closes.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) } == 0 {
            return Ok(None);
        }
        let who = std::fs::read_to_string(Self::path(store)).unwrap_or_default();
        Ok(Some(who.trim().to_string()))
    }

    /// Wait until nobody holds the lock of `store` (the supervisor has exited).
    pub fn wait_free(store: &Path, limit: Duration) -> bool {
        let deadline = std::time::Instant::now() + limit;
        while std::time::Instant::now() < deadline {
            if matches!(Self::holder(store), Ok(None)) {
                return true;
            }
            thread::sleep(Duration::from_millis(20));
        }
        false
    }
}

/// Raise the soft limit on open files to the hard limit: the daemon's descriptors are
/// bounded by design, but open files of the mount's users each hold one.
fn raise_nofile_limit() {
    // SAFETY: rlimit is plain data.
    let mut r: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: reading and setting our own limit.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            r.rlim_cur = r.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}

/// The unmount report a daemon leaves in the store: its exit status and what it says.
fn report_path(store: &Path) -> PathBuf {
    store.join(crate::store::META).join("last-unmount.json")
}

/// Mount and serve until unmounted. `ready` is called once the mount is in place (or with
/// the reason it failed).
///
/// This process is the supervisor: it mounts /dev/fuse, holds it and the shared memory,
/// and forks the cache daemon, which reads requests from /dev/fuse and answers them
/// itself. The supervisor's descriptor keeps the FUSE connection alive when the daemon
/// dies. It then starts a new one, which recovers the dirty pages and truncations from the
/// shared memory, writes them back, and asks the kernel to send again every request the
/// dead daemon had not answered (FUSE_NOTIFY_RESEND). The application sees a slow call,
/// not an error. If recovery finds the Dirty State Store damaged, the new daemon refuses
/// (86); the supervisor then drops the connection, so the mount returns errors instead of
/// serving or storing corrupt data.
pub fn run(o: Options, ready: impl FnOnce(Result<(), String>)) -> i32 {
    raise_nofile_limit();
    let lock = match StoreLock::take(&o.store, &o.mountpoint) {
        Ok(l) => l,
        Err(e) => {
            ready(Err(e));
            return 1;
        }
    };
    let mirror_lock = match o
        .mirror
        .as_deref()
        .map(|m| StoreLock::take(m, &o.mountpoint))
        .transpose()
    {
        Ok(l) => l,
        Err(e) => {
            ready(Err(e));
            return 1;
        }
    };
    match Store::open(&o.store, o.mirror.as_deref()) {
        Ok(s) => {
            if let Err(e) = s.clear_orphans() {
                ready(Err(format!("cannot clean the store {}: {e}", o.store.display())));
                return 1;
            }
        }
        Err(e) => {
            ready(Err(format!("cannot open the store {}: {e}", o.store.display())));
            return 1;
        }
    }
    // A report left by an earlier mount must never be read as this one's.
    match std::fs::remove_file(report_path(&o.store)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            ready(Err(format!("cannot remove the old unmount report: {e}")));
            return 1;
        }
        _ => {}
    }
    let slots = (o.cache_bytes / crate::crc::PAGE as u64).max(16) as usize;
    let shared = match Shared::create(slots) {
        Ok(s) => s,
        Err(e) => {
            ready(Err(format!("cannot create the cache's memory: {e}")));
            return 1;
        }
    };
    let fuse = match mount_fuse(&o) {
        Ok(fd) => fd,
        Err(e) => {
            ready(Err(e));
            return 1;
        }
    };
    // One events file for the supervisor and every daemon it starts: emptied once, then
    // appended to by all of them.
    if let Some(p) = &o.events {
        // Best effort: a file that cannot be created shows as the sink's own one-time error.
        let _ = std::fs::File::create(p);
    }
    let mut events = EventSink::append(o.events.as_deref(), true).unwrap_or_else(|_| EventSink::stderr_only());
    let status = supervise(&o, &fuse, &shared, &mut events, ready);
    drop((lock, mirror_lock));
    status
}

/// A request that has been sent again this often and still kills the daemon is not sent
/// again (Loris §V-D: a replay that crashes the cache again and again means recovery is
/// not possible).
const REPLAYS_MAX: u32 = 3;

/// A page shared by the supervisor and every daemon it forks (anonymous, MAP_SHARED): the
/// daemon says which request it is handling, and whether it ended with an unmount.
struct Beacon {
    base: *mut u8,
}

impl Beacon {
    fn new() -> std::io::Result<Beacon> {
        // SAFETY: a fresh anonymous shared mapping of one page.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Beacon { base: p.cast() })
    }

    fn word(&self, i: usize) -> &AtomicU64 {
        assert!(i < 4096 / 8);
        // SAFETY: inside the page, 8-byte aligned; only accessed atomically.
        unsafe { &*(self.base.add(i * 8) as *const AtomicU64) }
    }

    /// The id of the request the daemon is handling (0: none).
    fn current(&self) -> &AtomicU64 {
        self.word(0)
    }

    /// Set by a daemon whose session ended because the filesystem was unmounted.
    fn unmounted(&self) -> &AtomicU64 {
        self.word(1)
    }
}

impl Drop for Beacon {
    fn drop(&mut self) {
        // SAFETY: our own mapping.
        unsafe { libc::munmap(self.base.cast(), 4096) };
    }
}

fn supervise(
    o: &Options,
    fuse: &OwnedFd,
    shared: &Shared,
    events: &mut EventSink,
    ready: impl FnOnce(Result<(), String>),
) -> i32 {
    let beacon = match Beacon::new() {
        Ok(b) => b,
        Err(e) => {
            ready(Err(format!("cannot map the supervisor's page: {e}")));
            return 1;
        }
    };
    let mut ready = Some(ready);
    let mut replays: std::collections::HashMap<u64, u32> = std::collections::HashMap::new();
    let mut generation = 0u64;
    loop {
        let (child, started) = match spawn_daemon(o, fuse, shared, generation > 0, &beacon) {
            Ok(x) => x,
            Err(e) => {
                if let Some(r) = ready.take() {
                    r(Err(e));
                }
                return 1;
            }
        };
        // The first daemon says when it has answered INIT (or its pipe closes: it died).
        if ready.is_some() {
            let mut b = [0u8; 1];
            // SAFETY: reading one byte from our pipe.
            if unsafe { libc::read(started.as_raw_fd(), b.as_mut_ptr().cast(), 1) } == 1 {
                if let Some(r) = ready.take() {
                    r(Ok(()));
                }
            }
        }
        drop(started);
        let status = wait_child(child);
        if beacon.unmounted().load(Ordering::SeqCst) != 0 {
            // (the socket dies with the daemon; a stale one is replaced at the next mount)
            let _ = std::fs::remove_file(control_path(&o.store));
            return status;
        }
        if status == lockstep_core::exit::DETECTED {
            events.emit(Event::new("fs", "halt", "abort").message(
                "the cache daemon refused to continue (its dirty state failed verification); dropping the mount's connection so that nothing corrupt is served or stored".to_string(),
            ));
            if let Some(r) = ready.take() {
                r(Err("the cache daemon refused to start".into()));
            }
            return lockstep_core::exit::DETECTED;
        }
        let crashed_in = beacon.current().swap(0, Ordering::SeqCst) & !crate::fuse::FUSE_UNIQUE_RESEND;
        if crashed_in != 0 {
            *replays.entry(crashed_in).or_default() += 1;
        }
        let poison = replays.iter().find(|(_, n)| **n >= REPLAYS_MAX).map(|(u, _)| *u);
        if poison.is_some() || ready.is_some() {
            events.emit(Event::new("fs", "halt", "abort").message(match poison {
                Some(u) => format!("request {u} crashed the cache daemon {REPLAYS_MAX} times in a row; giving up"),
                None => format!("the cache daemon died before the mount was ready (status {status})"),
            }));
            if let Some(r) = ready.take() {
                r(Err(format!("the cache daemon died during start-up (status {status})")));
            }
            return lockstep_core::exit::DETECTED;
        }
        events.emit(Event::new("fs", "crash", "restart").message(format!(
            "the cache daemon died (status {status}){}; starting a new one",
            if crashed_in != 0 {
                format!(" while handling request {crashed_in}")
            } else {
                String::new()
            }
        )));
        generation += 1;
    }
}

fn wait_child(pid: libc::pid_t) -> i32 {
    let mut st = 0;
    loop {
        // SAFETY: waiting for our own child.
        let r = unsafe { libc::waitpid(pid, &mut st, 0) };
        if r == pid {
            break;
        }
        if r < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return 1;
        }
    }
    if libc::WIFEXITED(st) {
        libc::WEXITSTATUS(st)
    } else {
        lockstep_core::exit::SIGNAL_BASE + libc::WTERMSIG(st)
    }
}

/// Fork a cache daemon that serves `fuse`; returns its pid and a pipe on which it says
/// when it is serving.
fn spawn_daemon(
    o: &Options,
    fuse: &OwnedFd,
    shared: &Shared,
    recover: bool,
    beacon: &Beacon,
) -> Result<(libc::pid_t, OwnedFd), String> {
    let mut p = [0; 2];
    // SAFETY: plain syscall into a local array.
    if unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(format!("pipe: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: two new descriptors that nothing else owns.
    let (rd, wr) = unsafe { (OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])) };
    let shared_fd = shared.fd().try_clone().map_err(|e| format!("dup: {e}"))?;
    let supervisor = std::process::id() as libc::pid_t;
    // SAFETY: the supervisor is single-threaded, so the child may run Rust code freely.
    match unsafe { libc::fork() } {
        -1 => Err(format!("fork: {}", std::io::Error::last_os_error())),
        0 => {
            drop(rd);
            // A daemon must not outlive its supervisor: the store's lock goes with the
            // supervisor, and a mount without one is reported dead.
            // SAFETY: plain prctl and getppid.
            unsafe {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                if libc::getppid() != supervisor {
                    libc::_exit(1);
                }
            }
            // The daemon keeps only /dev/fuse, the shared memory, its pipe and stdio: an
            // inherited pipe (the mount command waiting for "mounted") must not stay open.
            close_fds_except(&[fuse.as_raw_fd(), shared_fd.as_raw_fd(), wr.as_raw_fd()]);
            let code = daemon(o.clone(), fuse.as_fd(), shared_fd, recover, beacon, wr);
            std::process::exit(code);
        }
        pid => Ok((pid, rd)),
    }
}

fn close_fds_except(keep: &[i32]) {
    let fds: Vec<i32> = std::fs::read_dir("/proc/self/fd")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    for fd in fds {
        if fd > 2 && !keep.contains(&fd) {
            // SAFETY: closing descriptors this fresh child does not use.
            unsafe { libc::close(fd) };
        }
    }
}

/// The cache daemon: recover (after a crash), then serve FUSE requests from /dev/fuse.
fn daemon(
    o: Options,
    fuse: std::os::fd::BorrowedFd<'_>,
    shared_fd: OwnedFd,
    recover: bool,
    beacon: &Beacon,
    started: OwnedFd,
) -> i32 {
    let events = Arc::new(Mutex::new(
        EventSink::append(o.events.as_deref(), true).unwrap_or_else(|_| EventSink::stderr_only()),
    ));
    let emit = |e: Event| events.lock().unwrap_or_else(|p| p.into_inner()).emit(e);
    // Modes come from the caller (FUSE passes its umask); ours must not be applied on top.
    // SAFETY: plain syscall.
    unsafe { libc::umask(0) };
    let store = match Store::open(&o.store, o.mirror.as_deref()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("lockstep fs: cannot open the store {}: {e}", o.store.display());
            return 1;
        }
    };
    let mut shared = match Shared::open(shared_fd) {
        Ok(s) => s,
        Err(e) => {
            emit(Event::new("fs", "halt", "exit 86").message(format!("the shared memory does not verify: {e}")));
            return lockstep_core::exit::DETECTED;
        }
    };
    if recover {
        let t = std::time::Instant::now();
        match crate::recovery::recover(&store, &mut shared) {
            Ok(r) => emit(
                Event::new("fs", "recover", "continue")
                    .duration_us(t.elapsed().as_micros() as u64)
                    .message(format!(
                        "restarted after a crash: {} dirty page(s) and {} truncation(s) verified and written back \
                         ({} file(s) gone); unanswered requests are sent again",
                        r.pages, r.truncations, r.gone
                    )),
            ),
            Err(why) => {
                emit(Event::new("fs", "halt", "exit 86").message(format!("recovery refused: {why}")));
                return lockstep_core::exit::DETECTED;
            }
        }
    }
    let root = store.root().to_path_buf();
    let cache = Arc::new(Mutex::new(Cache::new(store, shared, o.verify)));
    let naming_events = Arc::new(Mutex::new(Vec::new()));
    let lost = Arc::new(Mutex::new(Vec::new()));
    let naming = match Naming::new(&root, cache.clone(), naming_events.clone(), lost.clone()) {
        Ok(n) => n,
        Err(e) => {
            eprintln!("lockstep fs: cannot open {}: {e}", root.display());
            return 1;
        }
    };
    let stop = Arc::new(AtomicBool::new(false));
    start_writeback(
        cache.clone(),
        o.dirty_age,
        stop.clone(),
        events.clone(),
        naming_events.clone(),
    );
    if o.scrub_rate > 0 {
        start_scrubber(cache.clone(), o.scrub_rate, stop.clone());
    }
    if let Err(e) = start_control(&o, cache.clone()) {
        eprintln!("lockstep fs: {e}");
        return 1;
    }
    if !recover {
        emit(Event::new("fs", "mount", "continue").message(format!(
            "mounted {} on {} (verify {:?}, scrub {} pages/s, cache {} MiB{})",
            o.store.display(),
            o.mountpoint.display(),
            o.verify,
            o.scrub_rate,
            o.cache_bytes >> 20,
            if o.mirror.is_some() { ", mirrored" } else { "" }
        )));
    }
    let mut session = crate::fuse::Session::new(naming, fuse, recover);
    if recover {
        if let Err(e) = session.request_resend() {
            emit(Event::new("fs", "relay-error", "continue").message(format!(
                "cannot ask the kernel to resend unanswered requests (FUSE_NOTIFY_RESEND needs Linux 6.9): {e}"
            )));
        }
    }
    let result = session.run(
        |unique| beacon.current().store(unique, Ordering::Relaxed),
        // SAFETY: one byte to our pipe; the supervisor may have stopped listening.
        || unsafe {
            libc::write(started.as_raw_fd(), b"1".as_ptr().cast(), 1);
        },
    );
    if result.is_ok() {
        beacon.unmounted().store(1, Ordering::SeqCst);
    }
    stop.store(true, Ordering::SeqCst);
    // Unmounted: everything dirty went to the store in `destroy` (and again here, in case
    // the session ended without one). Poisoned pages are never written: say which files
    // lost acknowledged data.
    let pending = {
        let mut c = cache.lock().unwrap_or_else(|p| p.into_inner());
        // What fails stays poisoned, and the events below name it.
        let _ = c.flush(None, Duration::ZERO);
        c.take_events()
    };
    drop(session);
    let mut sink = events.lock().unwrap_or_else(|p| p.into_inner());
    for e in pending
        .into_iter()
        .chain(naming_events.lock().unwrap_or_else(|p| p.into_inner()).drain(..))
    {
        sink.emit(e);
    }
    let lost = lost.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let (status, message) = match (result, lost.is_empty()) {
        (Err(e), _) => (1, format!("the FUSE session ended with an error: {e}")),
        (Ok(_), true) => (0, "unmounted; all data written back".to_string()),
        (Ok(_), false) => (
            lockstep_core::exit::DETECTED,
            format!(
                "acknowledged data was discarded because it failed its checksum in memory (never \
                 written; the store keeps the previous version): {}",
                lost.join(", ")
            ),
        ),
    };
    if status != 0 {
        sink.emit(Event::new("fs", "unmount", "exit").message(message.clone()));
    }
    let report = serde_json::json!({"status": status, "message": message});
    // `lockstep fs umount` reads its status from this report; if it cannot be written,
    // the events say so (the daemon has no terminal).
    if let Err(e) = std::fs::write(report_path(&o.store), format!("{report}\n")) {
        sink.emit(Event::new("fs", "unmount", "report").message(format!("cannot write the unmount report: {e}")));
    }
    status
}

fn mount_fuse(o: &Options) -> Result<OwnedFd, String> {
    // SAFETY: plain open of a device node.
    let fd = unsafe { libc::open(c"/dev/fuse".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(format!("cannot open /dev/fuse: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: fd was just returned by open and nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    use std::os::fd::AsRawFd;
    let data = CString::new(format!(
        "fd={},rootmode=40000,user_id=0,group_id=0,allow_other,default_permissions",
        fd.as_raw_fd()
    ))
    .unwrap();
    let target = CString::new(o.mountpoint.as_os_str().as_bytes()).map_err(|_| "bad mountpoint".to_string())?;
    let src = CString::new(source(&o.store.canonicalize().unwrap_or(o.store.clone())).replace(' ', "_")).unwrap();
    // SAFETY: valid NUL-terminated strings.
    let r = unsafe {
        libc::mount(
            src.as_ptr(),
            target.as_ptr(),
            c"fuse.lockstep".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV,
            data.as_ptr().cast(),
        )
    };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            Some(libc::EPERM) => format!(
                "cannot mount {}: {e} (lockstep fs mounts as root)",
                o.mountpoint.display()
            ),
            _ => format!("cannot mount {}: {e}", o.mountpoint.display()),
        });
    }
    Ok(fd)
}

/// Writes back dirty pages once they are `age` old, and writes out the cache's events.
fn start_writeback(
    cache: Arc<Mutex<Cache>>,
    age: Duration,
    stop: Arc<AtomicBool>,
    events: Arc<Mutex<EventSink>>,
    naming_events: Arc<Mutex<Vec<Event>>>,
) {
    thread::Builder::new()
        .name("writeback".into())
        .spawn(move || {
            let tick = (age / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
            while !stop.load(Ordering::SeqCst) {
                thread::sleep(tick);
                // In rounds of a table chunk's worth of pages, each under the lock once;
                // bounded, so that pages that keep failing cannot keep it spinning.
                const ROUND: usize = crate::store::SLOTS as usize;
                let rounds = cache.lock().unwrap_or_else(|p| p.into_inner()).dirty_pages() / ROUND + 2;
                for _ in 0..rounds {
                    if !cache.lock().unwrap_or_else(|p| p.into_inner()).flush_some(age, ROUND) {
                        break;
                    }
                }
                let pending = cache.lock().unwrap_or_else(|p| p.into_inner()).take_events();
                let more: Vec<Event> = naming_events
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .drain(..)
                    .collect();
                let mut sink = events.lock().unwrap_or_else(|p| p.into_inner());
                for e in pending.into_iter().chain(more) {
                    sink.emit(e);
                }
            }
        })
        .expect("spawn writeback");
}

fn start_scrubber(cache: Arc<Mutex<Cache>>, rate: u64, stop: Arc<AtomicBool>) {
    thread::Builder::new()
        .name("scrubber".into())
        .spawn(move || {
            // Ten rounds a second, rate/10 pages each.
            let per_round = (rate / 10).max(1) as usize;
            while !stop.load(Ordering::SeqCst) {
                thread::sleep(Duration::from_millis(100));
                cache.lock().unwrap_or_else(|p| p.into_inner()).scrub(per_round);
            }
        })
        .expect("spawn scrubber");
}

/// Commands, one per line: `stats`, `flush`, and (with --test-flips) `flip N clean|dirty|any`.
/// Replies are one JSON line.
fn start_control(o: &Options, cache: Arc<Mutex<Cache>>) -> Result<(), String> {
    let path = control_path(&o.store);
    // (a stale socket from a crashed daemon; bind below reports any real problem)
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).map_err(|e| format!("cannot create {}: {e}", path.display()))?;
    let flips = o.test_flips;
    let crash = o.test_crash;
    let rate = Arc::new(FlipRate::default());
    if flips {
        start_flipper(cache.clone(), rate.clone());
    }
    thread::Builder::new()
        .name("control".into())
        .spawn(move || {
            let mut seed = Rng::new(std::process::id() as u64 ^ 0x9E37_79B9_7F4A_7C15);
            for conn in listener.incoming().flatten() {
                // A control connection that errs ends; the mount serves on.
                let _ = serve_control(conn, &cache, flips, crash, &rate, &mut seed);
            }
        })
        .expect("spawn control");
    Ok(())
}

/// Test-only background flips: `per_sec` pages a second, of the kind in `which`
/// (0 any, 1 clean, 2 dirty).
#[derive(Default)]
struct FlipRate {
    per_sec: std::sync::atomic::AtomicU64,
    which: std::sync::atomic::AtomicU64,
}

fn start_flipper(cache: Arc<Mutex<Cache>>, rate: Arc<FlipRate>) {
    thread::Builder::new()
        .name("flipper".into())
        .spawn(move || {
            let mut seed = Rng::new(0x2545_F491_4F6C_DD1D ^ std::process::id() as u64);
            let mut owed = 0.0f64;
            loop {
                thread::sleep(Duration::from_millis(10));
                let per_sec = rate.per_sec.load(Ordering::Relaxed);
                if per_sec == 0 {
                    continue;
                }
                owed += per_sec as f64 / 100.0;
                let n = owed as usize;
                owed -= n as f64;
                let dirty = match rate.which.load(Ordering::Relaxed) {
                    1 => Some(false),
                    2 => Some(true),
                    _ => None,
                };
                cache
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .inject_flips(n, dirty, || seed.next_u64());
            }
        })
        .expect("spawn flipper");
}

fn serve_control(
    conn: UnixStream,
    cache: &Mutex<Cache>,
    flips: bool,
    crash: bool,
    rate: &FlipRate,
    seed: &mut Rng,
) -> std::io::Result<()> {
    let mut w = conn.try_clone()?;
    for line in BufReader::new(conn).lines() {
        let line = line?;
        let words: Vec<&str> = line.split_whitespace().collect();
        let mut c = cache.lock().unwrap_or_else(|p| p.into_inner());
        let reply = match words[..] {
            ["stats"] => stats_json(&c),
            ["flush"] => match c.flush(None, Duration::ZERO) {
                Ok(()) => serde_json::json!({"ok": true}),
                Err(e) => serde_json::json!({"ok": false, "errno": e}),
            },
            ["flip", n, which] if flips => {
                let dirty = match which {
                    "clean" => Some(false),
                    "dirty" => Some(true),
                    _ => None,
                };
                let n: usize = n.parse().unwrap_or(0);
                let hit = c.inject_flips(n, dirty, || seed.next_u64());
                serde_json::json!({"ok": true, "flipped": hit})
            }
            ["flip-rate", n, which] if flips => match n.parse::<u64>() {
                Ok(per_sec) => {
                    let w = match which {
                        "clean" => 1,
                        "dirty" => 2,
                        _ => 0,
                    };
                    rate.which.store(w, Ordering::Relaxed);
                    rate.per_sec.store(per_sec, Ordering::Relaxed);
                    serde_json::json!({"ok": true, "flips_per_second": per_sec})
                }
                Err(_) => {
                    serde_json::json!({"ok": false, "error": "flip-rate N clean|dirty|any (N pages per second, 0 stops)"})
                }
            },
            ["flip" | "flip-rate", ..] => {
                serde_json::json!({"ok": false, "error": "test flips are off (mount with --test-flips)"})
            }
            // The daemon dies as a software bug would make it: no flush, no goodbye.
            ["crash"] if crash => std::process::abort(),
            // A real segmentation fault, as a wild pointer would cause.
            ["crash", "segv"] if crash => {
                // SAFETY: deliberately not safe: this write faults, which is the point.
                unsafe { std::ptr::write_volatile(std::ptr::dangling_mut::<u8>().wrapping_add(8), 1) };
                serde_json::json!({"ok": false, "error": "still alive after a wild write"})
            }
            // As above, after a wild write into the Dirty State Store: recovery must refuse.
            ["crash-damaged"] if crash => {
                let slot = c.shared().dirty_records().ok().and_then(|r| r.first().map(|d| d.slot));
                match slot {
                    Some(slot) => {
                        c.shared().damage_record(slot);
                        std::process::abort()
                    }
                    None => serde_json::json!({"ok": false, "error": "no dirty page to damage"}),
                }
            }
            ["crash" | "crash-damaged"] => {
                serde_json::json!({"ok": false, "error": "test crashes are off (mount with --test-crash)"})
            }
            _ => {
                serde_json::json!({"ok": false, "error": "commands: stats, flush, flip N clean|dirty|any, flip-rate N clean|dirty|any, crash [segv], crash-damaged"})
            }
        };
        drop(c);
        writeln!(w, "{reply}")?;
    }
    Ok(())
}

fn stats_json(c: &Cache) -> serde_json::Value {
    let s = &c.stats;
    serde_json::json!({
        "ok": true, "pid": std::process::id(),
        "cached_pages": c.cached_pages(), "dirty_pages": c.dirty_pages(),
        "reads": s.reads, "writes": s.writes, "hits": s.hits, "misses": s.misses, "checks": s.checks,
        "clean_detected": s.clean_detected, "dirty_detected": s.dirty_detected, "eio": s.eio,
        "scrubbed": s.scrubbed, "disk_repaired": s.disk_repaired, "disk_corrupt": s.disk_corrupt,
        "table_repaired": s.table_repaired,
        "written_back": s.written_back, "evicted": s.evicted, "injected": s.injected,
    })
}

/// Send one control command to the mount whose store is `store`.
pub fn control(store: &Path, command: &str) -> std::io::Result<serde_json::Value> {
    // A daemon that is starting (the first, or one restarted after a crash) has not bound
    // its socket yet: wait a little for it, as long as the store's server is there.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut s = loop {
        match UnixStream::connect(control_path(store)) {
            Ok(s) => break s,
            Err(e)
                if matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::ECONNREFUSED))
                    && std::time::Instant::now() < deadline
                    && matches!(StoreLock::holder(store), Ok(Some(_))) =>
            {
                thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(e),
        }
    };
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    writeln!(s, "{command}")?;
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line)?;
    serde_json::from_str(&line).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// What `umount` found.
pub struct Unmounted {
    /// The daemon's exit status: 0, or 86 when it discarded acknowledged data.
    pub status: i32,
    pub message: String,
}

/// How long `umount` retries a mount that is busy.
const UMOUNT_BUSY_GRACE: Duration = Duration::from_secs(3);

/// Flush the mount at `mountpoint`, unmount it, and wait for its server to finish: its
/// report says whether every acknowledged byte reached the store. A dead mount (its server
/// is gone) is detached, with a message that says so.
pub fn umount(mountpoint: &Path) -> Result<Unmounted, String> {
    if !is_mountpoint(mountpoint) {
        return Err(format!("{} is not mounted", mountpoint.display()));
    }
    let target = CString::new(mountpoint.as_os_str().as_bytes()).map_err(|_| "bad path".to_string())?;
    if let Some(store) = is_dead_mount(mountpoint) {
        // SAFETY: valid path.
        if unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) } < 0 {
            return Err(format!(
                "cannot detach the dead mount {}: {}",
                mountpoint.display(),
                std::io::Error::last_os_error()
            ));
        }
        return Ok(Unmounted {
            status: 1,
            message: format!(
                "{} was a dead mount: its server (of store {}) had exited, so data it had not written \
                 back is lost. Detached; `lockstep fs check {}` verifies what the store holds",
                mountpoint.display(),
                store.display(),
                store.display()
            ),
        });
    }
    let store = store_of(mountpoint);
    if let Some(store) = &store {
        match control(store, "flush") {
            Ok(v) if v["ok"] == true => {}
            Ok(v) => eprintln!(
                "lockstep fs: flush before unmount reported {v}; unmounting anyway (the daemon flushes again)"
            ),
            Err(e) => eprintln!("lockstep fs: cannot reach the daemon ({e}); unmounting"),
        }
    }
    // A mount can be busy for a moment without anyone using it: a file closed by another
    // thread's child between its fork and its exec, a release still in flight. Try again
    // for a little while before saying it is busy.
    let deadline = Instant::now() + UMOUNT_BUSY_GRACE;
    // SAFETY: valid path.
    while unsafe { libc::umount2(target.as_ptr(), 0) } < 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        }
        return Err(match e.raw_os_error() {
            Some(libc::EBUSY) => format!(
                "{} is busy (files are open or a process has its cwd there)",
                mountpoint.display()
            ),
            _ => format!("cannot unmount {}: {e}", mountpoint.display()),
        });
    }
    let Some(store) = store else {
        return Ok(Unmounted {
            status: 0,
            message: "unmounted".into(),
        });
    };
    if !StoreLock::wait_free(&store, Duration::from_secs(120)) {
        return Err(format!(
            "unmounted, but the server of {} is still running after 120 s",
            store.display()
        ));
    }
    let report: serde_json::Value = std::fs::read_to_string(report_path(&store))
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok())
        .unwrap_or(serde_json::json!({"status": 1, "message": "the server left no unmount report"}));
    Ok(Unmounted {
        status: report["status"].as_i64().unwrap_or(1) as i32,
        message: report["message"].as_str().unwrap_or("").to_string(),
    })
}

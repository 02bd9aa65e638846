//! Mounting: open /dev/fuse, mount it (we run as root, so no fusermount is needed), and
//! serve the session, with the write-back and scrubber threads and a control socket.

use crate::cache::{Cache, Verify};
use crate::naming::Naming;
use crate::store::Store;
use lockstep_core::{Event, EventSink};
use std::ffi::CString;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

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
}

/// The control socket of the mount whose store is `store`.
pub fn control_path(store: &Path) -> PathBuf {
    store.join(".lockstep").join("control.sock")
}

/// The mount source that names the store, so that `umount` can find the control socket.
fn source(store: &Path) -> String {
    format!("lockstep:{}", store.display())
}

/// Whether `path` is a mount point now (its entry in /proc/self/mountinfo).
pub fn is_mountpoint(path: &Path) -> bool {
    let Ok(canon) = path.canonicalize() else { return false };
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split(' ').nth(4).is_some_and(|m| Path::new(&unescape(m)) == canon))
}

/// The store of the lockstep mount at `path`, from /proc/self/mountinfo.
pub fn store_of(path: &Path) -> Option<PathBuf> {
    let canon = path.canonicalize().ok()?;
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

/// Check everything that can be checked before mounting; a clear message otherwise.
pub fn preflight(o: &Options) -> Result<(), String> {
    if !o.mountpoint.is_dir() {
        return Err(format!("mountpoint {} is not a directory", o.mountpoint.display()));
    }
    if is_mountpoint(&o.mountpoint) {
        return Err(format!(
            "mountpoint {} is busy: something is already mounted there",
            o.mountpoint.display()
        ));
    }
    for (what, dir) in std::iter::once(("store", &o.store)).chain(o.mirror.iter().map(|m| ("mirror", m))) {
        std::fs::create_dir_all(dir).map_err(|e| format!("cannot create the {what} {}: {e}", dir.display()))?;
        let probe = dir.join(".lockstep-write-test");
        std::fs::write(&probe, b"x").map_err(|e| format!("the {what} {} is not writable: {e}", dir.display()))?;
        let _ = std::fs::remove_file(probe);
    }
    if o.mirror
        .as_ref()
        .is_some_and(|m| m.canonicalize().ok() == o.store.canonicalize().ok())
    {
        return Err("--mirror must be another directory than --store".into());
    }
    Ok(())
}

/// Mount and serve until unmounted. `ready` is called once the mount is in place (or with
/// the reason it failed).
pub fn run(o: Options, ready: impl FnOnce(Result<(), String>)) -> i32 {
    let store = match Store::open(&o.store, o.mirror.as_deref()) {
        Ok(s) => s,
        Err(e) => {
            ready(Err(format!("cannot open the store {}: {e}", o.store.display())));
            return 1;
        }
    };
    let data_root = store.data_root();
    let cache = match Cache::with_memory(store, o.cache_bytes, o.verify) {
        Ok(c) => Arc::new(Mutex::new(c)),
        Err(e) => {
            ready(Err(format!("cannot create the cache's memory: {e}")));
            return 1;
        }
    };
    let naming = match Naming::new(&data_root, cache.clone()) {
        Ok(n) => n,
        Err(e) => {
            ready(Err(format!("cannot open {}: {e}", data_root.display())));
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
    let events = Arc::new(Mutex::new(
        EventSink::new(o.events.as_deref(), true).unwrap_or_else(|_| EventSink::stderr_only()),
    ));
    let stop = Arc::new(AtomicBool::new(false));
    start_writeback(cache.clone(), o.dirty_age, stop.clone(), events.clone());
    if o.scrub_rate > 0 {
        start_scrubber(cache.clone(), o.scrub_rate, stop.clone());
    }
    if let Err(e) = start_control(&o, cache.clone()) {
        ready(Err(e));
        return 1;
    }
    events
        .lock()
        .unwrap()
        .emit(Event::new("fs", "mount", "continue").message(format!(
            "mounted {} on {} (verify {:?}, scrub {} pages/s, cache {} MiB{})",
            o.store.display(),
            o.mountpoint.display(),
            o.verify,
            o.scrub_rate,
            o.cache_bytes >> 20,
            if o.mirror.is_some() { ", mirrored" } else { "" }
        )));
    ready(Ok(()));
    let mut session = fuser::Session::from_fd(naming, fuse, fuser::SessionACL::All);
    let result = session.run();
    stop.store(true, Ordering::SeqCst);
    // Unmounted: everything dirty goes to the store before we exit.
    let (flushed, pending) = {
        let mut c = cache.lock().unwrap_or_else(|p| p.into_inner());
        let flushed = c.flush(None, Duration::ZERO);
        (flushed, c.take_events())
    };
    let mut sink = events.lock().unwrap_or_else(|p| p.into_inner());
    for e in pending {
        sink.emit(e);
    }
    let _ = std::fs::remove_file(control_path(&o.store));
    match (result, flushed) {
        (Ok(()), Ok(())) => 0,
        (Err(e), _) => {
            eprintln!("lockstep fs: the FUSE session ended with an error: {e}");
            1
        }
        (_, Err(_)) => {
            eprintln!("lockstep fs: some dirty pages failed their checks and were not written back (EIO was reported)");
            lockstep_core::exit::DETECTED
        }
    }
}

fn mount_fuse(o: &Options) -> Result<OwnedFd, String> {
    // SAFETY: plain open of a device node.
    let fd = unsafe { libc::open(c"/dev/fuse".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(format!("cannot open /dev/fuse: {}", std::io::Error::last_os_error()));
    }
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
fn start_writeback(cache: Arc<Mutex<Cache>>, age: Duration, stop: Arc<AtomicBool>, events: Arc<Mutex<EventSink>>) {
    thread::Builder::new()
        .name("writeback".into())
        .spawn(move || {
            let tick = (age / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
            while !stop.load(Ordering::SeqCst) {
                thread::sleep(tick);
                let pending = {
                    let mut c = cache.lock().unwrap_or_else(|p| p.into_inner());
                    let _ = c.flush(None, age);
                    c.take_events()
                };
                let mut sink = events.lock().unwrap_or_else(|p| p.into_inner());
                for e in pending {
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
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).map_err(|e| format!("cannot create {}: {e}", path.display()))?;
    let flips = o.test_flips;
    thread::Builder::new()
        .name("control".into())
        .spawn(move || {
            let mut seed = std::process::id() as u64 ^ 0x9E37_79B9_7F4A_7C15;
            for conn in listener.incoming().flatten() {
                let _ = serve_control(conn, &cache, flips, &mut seed);
            }
        })
        .expect("spawn control");
    Ok(())
}

fn serve_control(conn: UnixStream, cache: &Mutex<Cache>, flips: bool, seed: &mut u64) -> std::io::Result<()> {
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
                let hit = c.inject_flips(n, dirty, || {
                    *seed ^= *seed << 13;
                    *seed ^= *seed >> 7;
                    *seed ^= *seed << 17;
                    *seed
                });
                serde_json::json!({"ok": true, "flipped": hit})
            }
            ["flip", ..] => serde_json::json!({"ok": false, "error": "test flips are off (mount with --test-flips)"}),
            _ => serde_json::json!({"ok": false, "error": "commands: stats, flush, flip N clean|dirty|any"}),
        };
        drop(c);
        writeln!(w, "{reply}")?;
    }
    Ok(())
}

fn stats_json(c: &Cache) -> serde_json::Value {
    let s = &c.stats;
    serde_json::json!({
        "ok": true,
        "cached_pages": c.cached_pages(), "dirty_pages": c.dirty_pages(),
        "reads": s.reads, "writes": s.writes, "hits": s.hits, "misses": s.misses, "checks": s.checks,
        "clean_detected": s.clean_detected, "dirty_detected": s.dirty_detected, "eio": s.eio,
        "scrubbed": s.scrubbed, "disk_repaired": s.disk_repaired, "disk_corrupt": s.disk_corrupt,
        "written_back": s.written_back, "evicted": s.evicted, "injected": s.injected,
    })
}

/// Send one control command to the mount whose store is `store`.
pub fn control(store: &Path, command: &str) -> std::io::Result<serde_json::Value> {
    let mut s = UnixStream::connect(control_path(store))?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    writeln!(s, "{command}")?;
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line)?;
    serde_json::from_str(&line).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// Flush the mount at `mountpoint` and unmount it.
pub fn umount(mountpoint: &Path) -> Result<(), String> {
    if !is_mountpoint(mountpoint) {
        return Err(format!("{} is not mounted", mountpoint.display()));
    }
    if let Some(store) = store_of(mountpoint) {
        match control(&store, "flush") {
            Ok(v) if v["ok"] == true => {}
            Ok(v) => eprintln!(
                "lockstep fs: flush before unmount reported {v}; unmounting anyway (the daemon flushes again)"
            ),
            Err(e) => eprintln!("lockstep fs: cannot reach the daemon ({e}); unmounting"),
        }
    }
    let target = CString::new(mountpoint.as_os_str().as_bytes()).map_err(|_| "bad path".to_string())?;
    // SAFETY: valid path.
    if unsafe { libc::umount2(target.as_ptr(), 0) } < 0 {
        let e = std::io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            Some(libc::EBUSY) => format!(
                "{} is busy (files are open or a process has its cwd there)",
                mountpoint.display()
            ),
            _ => format!("cannot unmount {}: {e}", mountpoint.display()),
        });
    }
    Ok(())
}

//! `lockstep fs` against POSIX, as the native filesystem implements it: real FUSE mounts
//! (as root), and wherever possible the same operation in a plain reference directory
//! (`scratch_dir`, on the normal filesystem), with equal results required. The tests
//! check "behaves like the native filesystem", not our reading of the standard.

mod common;
mod fsmount;

use common::*;
use fsmount::*;
use std::collections::{BTreeMap, VecDeque};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const MIB: u64 = 1 << 20;

/// A scratch directory with a plain reference directory `ref` and a mount of `store` on `mnt`.
fn setup(tag: &str, args: &[&str]) -> (PathBuf, PathBuf, Mount) {
    let dir = scratch_dir(tag);
    let reference = dir.join("ref");
    std::fs::create_dir_all(&reference).unwrap();
    let m = Mount::new(&dir, args);
    (dir, reference, m)
}

fn lmeta(p: &Path) -> std::fs::Metadata {
    std::fs::symlink_metadata(p).unwrap_or_else(|e| panic!("lstat {}: {e}", p.display()))
}

/// Permission bits with setuid, setgid and sticky.
fn mode(p: &Path) -> u32 {
    lmeta(p).mode() & 0o7777
}

/// `sh -c SCRIPT` in `dir` (optionally through setpriv as uid/gid 65533); its stdout.
fn sh_as(dir: &Path, script: &str, other_user: bool) -> String {
    let mut cmd = if other_user {
        let mut c = Command::new("setpriv");
        c.args(["--reuid=65533", "--regid=65533", "--clear-groups", "sh", "-c", script]);
        c
    } else {
        let mut c = Command::new("sh");
        c.args(["-c", script]);
        c
    };
    let out = cmd.current_dir(dir).output().unwrap();
    assert!(
        out.status.success(),
        "in {}: {script}: {}\n{}",
        dir.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn sh(dir: &Path, script: &str) -> String {
    sh_as(dir, script, false)
}

/// The caller's umask, and only it, masks the mode of a new file, directory or fifo. (The
/// daemon's own umask must not be applied on top.)
#[test]
fn the_callers_umask_is_applied_and_no_other() {
    let (_dir, reference, m) = setup("px-umask", &[]);
    let modes = |root: &Path| -> Vec<(&'static str, u32)> {
        sh(
            root,
            "umask 002; touch f; mkdir d; mkfifo p; umask 0; touch f0; mkdir d0; mkfifo p0; umask 077; touch f7; mkdir d7",
        );
        ["f", "d", "p", "f0", "d0", "p0", "f7", "d7"]
            .into_iter()
            .map(|n| (n, mode(&root.join(n))))
            .collect()
    };
    // touch: open(O_CREAT, 0666); mkdir: 0777; mkfifo: 0666.
    let want = vec![
        ("f", 0o664),
        ("d", 0o775),
        ("p", 0o664),
        ("f0", 0o666),
        ("d0", 0o777),
        ("p0", 0o666),
        ("f7", 0o600),
        ("d7", 0o700),
    ];
    assert_eq!(modes(&reference), want, "the native filesystem");
    assert_eq!(modes(&m.mnt), want, "the mount (left: got, right: native)");
}

/// In a directory with S_ISGID, new files and directories take the directory's group, and
/// new directories inherit S_ISGID, as on the native filesystem.
#[test]
fn a_setgid_directory_passes_its_group_on() {
    let (_dir, reference, m) = setup("px-sgid", &[]);
    let build = |root: &Path| -> Vec<(&'static str, u32, u32)> {
        let sg = root.join("sg");
        std::fs::create_dir(&sg).unwrap();
        std::os::unix::fs::chown(&sg, None, Some(65534)).unwrap();
        std::fs::set_permissions(&sg, std::fs::Permissions::from_mode(0o2775)).unwrap();
        std::fs::write(sg.join("f"), b"x").unwrap();
        std::fs::create_dir(sg.join("d")).unwrap();
        std::fs::create_dir(sg.join("d/e")).unwrap();
        std::fs::write(sg.join("d/g"), b"y").unwrap();
        std::os::unix::fs::symlink("f", sg.join("l")).unwrap();
        ["sg", "sg/f", "sg/d", "sg/d/e", "sg/d/g", "sg/l"]
            .into_iter()
            .map(|n| {
                let md = lmeta(&root.join(n));
                // A symlink's mode bits mean nothing; its group does.
                let bits = if md.file_type().is_symlink() {
                    0
                } else {
                    md.mode() & 0o7777
                };
                (n, bits, md.gid())
            })
            .collect()
    };
    let native = build(&reference);
    for (n, bits, gid) in &native {
        assert_eq!(*gid, 65534, "native: {n} {bits:o}");
        if ["sg/d", "sg/d/e"].contains(n) {
            assert_ne!(bits & libc::S_ISGID, 0, "native: {n} {bits:o}");
        }
    }
    assert_eq!(build(&m.mnt), native, "(name, mode, gid) on the mount, then native");
}

/// A write or truncate by a user other than the owner clears S_ISUID and S_ISGID (which the
/// kernel asks for only when the writer lacks CAP_FSETID).
#[test]
fn writing_as_another_user_clears_setuid_and_setgid() {
    let (_dir, reference, m) = setup("px-suid", &[]);
    let run = |root: &Path| -> Vec<(&'static str, u32, Vec<u8>)> {
        let cases: [(&str, &str); 4] = [
            ("w", "echo x >> w"),
            ("pw", "printf y | dd of=pw bs=1 seek=2 conv=notrunc status=none"),
            ("t", "truncate -s 2 t"),
            ("o", ": > o"),
        ];
        cases
            .iter()
            .map(|(name, script)| {
                let p = root.join(name);
                std::fs::write(&p, b"data\n").unwrap();
                std::os::unix::fs::chown(&p, Some(65534), Some(65534)).unwrap();
                std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o6777)).unwrap();
                assert_eq!(mode(&p), 0o6777, "{}", p.display());
                sh_as(root, script, true);
                (*name, mode(&p), std::fs::read(&p).unwrap())
            })
            .collect()
    };
    let native = run(&reference);
    for (name, bits, _) in &native {
        assert_eq!(bits & 0o6000, 0, "native: {name} keeps {bits:o}");
    }
    assert_eq!(run(&m.mnt), native, "(name, mode, content) on the mount, then native");
}

/// New files and directories keep the setuid, setgid and sticky bits they are made with,
/// whether root or another user makes them, as on the native filesystem (the daemon makes
/// every node itself and then gives it to the caller: a chown clears those bits).
#[test]
fn new_nodes_keep_their_special_bits() {
    let (_dir, reference, m) = setup("px-special", &[]);
    let make = "python3 -c \"import os; os.umask(0); \
                [os.close(os.open(n, os.O_CREAT | os.O_WRONLY, b)) for n, b in (('u', 0o4755), ('g', 0o2755), ('ug', 0o6711))]; \
                os.mkdir('d', 0o3777); os.mkdir('t', 0o1755)\"";
    let run = |root: &Path| -> Vec<(String, u32, u32)> {
        let mut got = Vec::new();
        for (sub, other) in [("root", false), ("user", true)] {
            let d = root.join(sub);
            std::fs::create_dir(&d).unwrap();
            std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o777)).unwrap();
            sh_as(&d, make, other);
            for n in ["u", "g", "ug", "d", "t"] {
                let md = lmeta(&d.join(n));
                got.push((format!("{sub}/{n}"), md.mode() & 0o7777, md.uid()));
            }
        }
        got
    };
    let native = run(&reference);
    assert!(
        native
            .iter()
            .any(|(n, bits, _)| n == "root/u" && bits & libc::S_ISUID != 0),
        "native: {native:?}"
    );
    assert_eq!(run(&m.mnt), native, "(name, mode, uid) on the mount, then native");
}

fn mknod(dir: &Path, args: &[&str]) {
    let out = Command::new(args[0])
        .args(&args[1..])
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// readdir gives each entry's type (d_type), which find and std::fs::DirEntry::file_type
/// use without a stat: regular file, directory, symlink, fifo, socket, char device.
#[test]
fn directory_entries_carry_their_file_type() {
    let (_dir, reference, m) = setup("px-dtype", &[]);
    let mut listeners = Vec::new();
    for root in [&reference, &m.mnt] {
        std::fs::write(root.join("reg"), b"x").unwrap();
        std::fs::create_dir(root.join("dir")).unwrap();
        std::os::unix::fs::symlink("reg", root.join("lnk")).unwrap();
        mknod(root, &["mkfifo", "fifo"]);
        listeners.push(std::os::unix::net::UnixListener::bind(root.join("sock")).unwrap());
        mknod(root, &["mknod", "chr", "c", "1", "3"]);
    }
    // What readdir says, as std sees it (DirEntry::file_type uses d_type when it is known).
    let dtypes = |root: &Path| -> Vec<(String, char)> {
        use std::os::unix::fs::FileTypeExt;
        let mut v: Vec<(String, char)> = std::fs::read_dir(root)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                let t = e.file_type().unwrap();
                let c = match () {
                    _ if t.is_file() => 'f',
                    _ if t.is_dir() => 'd',
                    _ if t.is_symlink() => 'l',
                    _ if t.is_fifo() => 'p',
                    _ if t.is_socket() => 's',
                    _ if t.is_char_device() => 'c',
                    _ if t.is_block_device() => 'b',
                    _ => '?',
                };
                (e.file_name().into_string().unwrap(), c)
            })
            .collect();
        v.sort();
        v
    };
    let find = |root: &Path, args: &str| -> Vec<String> {
        let mut v: Vec<String> = sh(root, &format!("find . -mindepth 1 {args}"))
            .lines()
            .map(String::from)
            .collect();
        v.sort();
        v
    };
    let native = dtypes(&reference);
    let want: Vec<(String, char)> = [
        ("chr", 'c'),
        ("dir", 'd'),
        ("fifo", 'p'),
        ("lnk", 'l'),
        ("reg", 'f'),
        ("sock", 's'),
    ]
    .into_iter()
    .map(|(n, c)| (n.to_string(), c))
    .collect();
    assert_eq!(native, want, "native d_type");
    assert_eq!(dtypes(&m.mnt), native, "d_type on the mount, then native");
    let native = find(&reference, "-printf '%y %f\\n'");
    assert_eq!(
        find(&m.mnt, "-printf '%y %f\\n'"),
        native,
        "find %y on the mount, then native"
    );
    assert_eq!(find(&reference, "-type f"), ["./reg"], "native find -type f");
    assert_eq!(find(&m.mnt, "-type f"), ["./reg"], "find -type f on the mount");
    drop(listeners);
}

/// One directory stream over 2000 files, each unlinked right after readdir returns it:
/// every file is seen exactly once and the directory ends empty.
#[test]
fn unlinking_each_entry_as_readdir_returns_it_sees_every_entry_once() {
    let (_dir, reference, m) = setup("px-rddel", &[]);
    for root in [&reference, &m.mnt] {
        let d = root.join("many");
        std::fs::create_dir(&d).unwrap();
        for i in 0..2000 {
            File::create(d.join(format!("file-{i:04}"))).unwrap();
        }
        let mut seen: BTreeMap<String, u32> = BTreeMap::new();
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            *seen.entry(e.file_name().into_string().unwrap()).or_default() += 1;
            std::fs::remove_file(e.path()).unwrap();
        }
        let twice: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).map(|(k, _)| k).collect();
        let missed: Vec<String> = (0..2000)
            .map(|i| format!("file-{i:04}"))
            .filter(|n| !seen.contains_key(n))
            .collect();
        assert!(
            twice.is_empty() && missed.is_empty() && seen.len() == 2000,
            "{}: {} names seen, {} more than once (e.g. {:?}), {} never (e.g. {:?})",
            root.display(),
            seen.len(),
            twice.len(),
            twice.iter().take(5).collect::<Vec<_>>(),
            missed.len(),
            missed.iter().take(5).collect::<Vec<_>>()
        );
        let left: Vec<_> = std::fs::read_dir(&d).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert!(left.is_empty(), "{}: left {} entries", root.display(), left.len());
        std::fs::remove_dir(&d).unwrap();
    }
}

/// A listing of 20000 names returns each exactly once.
#[test]
fn a_directory_of_20000_names_lists_each_once() {
    let (_dir, _reference, m) = setup("px-rdbig", &[]);
    let d = m.path("big");
    std::fs::create_dir(&d).unwrap();
    // Hard links to one file: 20000 names, but one inode (the daemon may hold a descriptor
    // per inode the kernel knows, and this test is about the listing).
    let py = "import os, sys\nd = sys.argv[1]\nfirst = os.path.join(d, 'n00000')\nos.mknod(first)\n\
              for i in range(1, 20000):\n    os.link(first, os.path.join(d, 'n%05d' % i))\n";
    let out = Command::new(python3()).args(["-c", py]).arg(&d).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for _ in 0..2 {
        let mut names: Vec<String> = std::fs::read_dir(&d)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        let total = names.len();
        names.sort();
        names.dedup();
        assert_eq!(total, names.len(), "duplicates in the listing");
        let want: Vec<String> = (0..20000).map(|i| format!("n{i:05}")).collect();
        assert!(names == want, "{} distinct names of 20000", names.len());
    }
}

fn blocks(p: &Path) -> u64 {
    lmeta(p).blocks()
}

/// st_blocks counts allocated space: a sparse file with one byte at 100 MiB has few blocks
/// (whether that byte is still in the cache or written back), a dense 1 MiB file has at
/// least 1 MiB of blocks; du agrees.
#[test]
fn st_blocks_counts_allocated_space_not_size() {
    let (_dir, reference, m) = setup("px-blocks", &["--dirty-age", "30s"]);
    for root in [&reference, &m.mnt] {
        let sparse = root.join("sparse");
        let f = File::create(&sparse).unwrap();
        f.write_all_at(b"x", 100 * MIB).unwrap();
        assert_eq!(lmeta(&sparse).len(), 100 * MIB + 1);
        let dirty = blocks(&sparse);
        f.sync_all().unwrap();
        drop(f);
        let clean = blocks(&sparse);
        assert!(
            dirty * 512 < MIB && clean * 512 < MIB,
            "{}: a 1-byte write at 100 MiB has st_blocks {dirty} before fsync, {clean} after",
            root.display()
        );
        let du = sh(root, "du -k sparse");
        let kib: u64 = du.split_whitespace().next().unwrap().parse().unwrap();
        assert!(kib < 1024, "{}: du -k sparse: {du}", root.display());

        let dense = root.join("dense");
        let f = File::create(&dense).unwrap();
        f.write_all_at(&fill(&mut Rng::new(3), MIB as usize), 0).unwrap();
        let dirty = blocks(&dense);
        f.sync_all().unwrap();
        drop(f);
        let clean = blocks(&dense);
        assert!(
            dirty * 512 >= MIB && clean * 512 >= MIB,
            "{}: 1 MiB of data has st_blocks {dirty} before fsync, {clean} after",
            root.display()
        );
    }
}

fn lseek(f: &File, off: i64, whence: i32) -> Result<i64, i32> {
    // SAFETY: a plain lseek on an open descriptor.
    let r = unsafe { libc::lseek(f.as_raw_fd(), off, whence) };
    if r < 0 {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap())
    } else {
        Ok(r)
    }
}

/// SEEK_DATA and SEEK_HOLE find the data in [0, 4 KiB) and [1 MiB, 1 MiB + 4 KiB) of a
/// 2 MiB file, while the data is only in the cache and after it is written back.
#[test]
fn seek_data_and_seek_hole_find_the_holes() {
    let (_dir, reference, m) = setup("px-seek", &["--dirty-age", "30s"]);
    let (data, hole) = (libc::SEEK_DATA, libc::SEEK_HOLE);
    let m1 = MIB as i64;
    let queries: Vec<(&str, i64, i32)> = vec![
        ("HOLE 0", 0, hole),
        ("HOLE 100", 100, hole),
        ("DATA 0", 0, data),
        ("DATA 4096", 4096, data),
        ("DATA 5000", 5000, data),
        ("HOLE 1M", m1, hole),
        ("DATA 1M+100", m1 + 100, data),
        ("HOLE 1M+4096", m1 + 4096, hole),
        ("DATA 1M+4096", m1 + 4096, data),
        ("DATA 2M-1", 2 * m1 - 1, data),
        ("HOLE 2M-1", 2 * m1 - 1, hole),
        ("DATA 2M", 2 * m1, data),
        ("HOLE 2M", 2 * m1, hole),
    ];
    let ask = |f: &File| -> Vec<(&str, Result<i64, i32>)> {
        queries.iter().map(|(q, off, wh)| (*q, lseek(f, *off, *wh))).collect()
    };
    let make = |root: &Path| -> File {
        let f = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(root.join("holes"))
            .unwrap();
        // The size first: a truncate may write the file back.
        f.set_len(2 * MIB).unwrap();
        f.write_all_at(&fill(&mut Rng::new(11), 4096), 0).unwrap();
        f.write_all_at(&fill(&mut Rng::new(12), 4096), MIB).unwrap();
        f
    };
    let fr = make(&reference);
    let native_dirty = ask(&fr);
    fr.sync_all().unwrap();
    let native = ask(&fr);
    assert_eq!(native_dirty, native, "native, before and after fsync");
    let get = |q: &str| native.iter().find(|(n, _)| *n == q).unwrap().1;
    assert_eq!(get("HOLE 0"), Ok(4096));
    assert_eq!(get("DATA 4096"), Ok(m1));
    assert_eq!(get("HOLE 1M"), Ok(m1 + 4096));
    assert_eq!(get("DATA 1M+4096"), Err(libc::ENXIO));

    let fm = make(&m.mnt);
    assert!(
        m.ctl("stats")["dirty_pages"].as_u64().unwrap_or(0) > 0,
        "the data should still be dirty in the cache"
    );
    assert_eq!(
        ask(&fm),
        native,
        "on the mount, data only in the cache (left), native (right)"
    );
    fm.sync_all().unwrap();
    assert_eq!(ask(&fm), native, "on the mount after fsync (left), native (right)");
    drop(fm);
    // And from a fresh open after the data has gone to the store.
    let fm = File::open(m.path("holes")).unwrap();
    assert_eq!(ask(&fm), native, "on the mount, reopened");
}

/// A MAP_SHARED mapping of `len` bytes of `f`, unmapped on drop.
struct Map {
    ptr: *mut u8,
    len: usize,
}

impl Map {
    fn new(f: &File, len: usize, writable: bool) -> std::io::Result<Map> {
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: a fresh shared mapping of an open file; checked for MAP_FAILED.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, f.as_raw_fd(), 0) };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Map { ptr: p.cast(), len })
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: the mapping is len bytes long and lives as long as self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    fn write(&mut self, off: usize, data: &[u8]) {
        assert!(off + data.len() <= self.len);
        // SAFETY: within a writable mapping.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(off), data.len()) };
    }

    fn sync(&self) -> std::io::Result<()> {
        // SAFETY: the whole mapping.
        if unsafe { libc::msync(self.ptr.cast(), self.len, libc::MS_SYNC) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
}

impl Drop for Map {
    fn drop(&mut self) {
        // SAFETY: our own mapping.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Shared mappings: a read-only one shows the file; writes through a writable one, after
/// msync and munmap, are seen by read() and are still there after a remount.
#[test]
fn map_shared_reads_and_writes_reach_the_file() {
    let (_dir, reference, m) = setup("px-mmap", &["--cache-size", "256K"]);
    let content = fill(&mut Rng::new(21), 50_000);
    let mut edits = Vec::new();
    let mut rng = Rng::new(22);
    for off in [0usize, 4090, 20_000, 49_990] {
        let len = (1 + rng.below(3000) as usize).min(content.len() - off);
        edits.push((off, fill(&mut rng, len)));
    }
    let mut expected = content.clone();
    for (off, d) in &edits {
        expected[*off..off + d.len()].copy_from_slice(d);
    }
    for root in [&reference, &m.mnt] {
        let p = root.join("mapped");
        std::fs::write(&p, &content).unwrap();
        let ro = File::open(&p).unwrap();
        let map = Map::new(&ro, content.len(), false)
            .unwrap_or_else(|e| panic!("{}: read-only MAP_SHARED mmap: {e}", root.display()));
        assert!(map.bytes() == &content[..], "{}: the mapping differs", root.display());
        drop(map);
        let rw = File::options().read(true).write(true).open(&p).unwrap();
        let mut map = Map::new(&rw, content.len(), true)
            .unwrap_or_else(|e| panic!("{}: writable MAP_SHARED mmap: {e}", root.display()));
        for (off, d) in &edits {
            map.write(*off, d);
        }
        map.sync().unwrap_or_else(|e| panic!("{}: msync: {e}", root.display()));
        drop(map);
        drop(rw);
        let mut got = vec![0u8; content.len() + 10];
        let n = ro.read_at(&mut got, 0).unwrap();
        assert_eq!(n, content.len(), "{}", root.display());
        assert!(
            got[..n] == expected[..],
            "{}: read() after msync and munmap misses the mapped writes",
            root.display()
        );
        assert!(
            std::fs::read(&p).unwrap() == expected,
            "{}: a fresh open",
            root.display()
        );
    }
    let m = m.remount();
    assert!(
        std::fs::read(m.path("mapped")).unwrap() == expected,
        "the mapped writes are lost after a remount"
    );
    assert_eq!(m.umount(), 0);
}

const SQLITE_PY: &str = r#"
import sqlite3, sys
path, phase = sys.argv[1], sys.argv[2]
c = sqlite3.connect(path, isolation_level=None)
print(c.execute("PRAGMA journal_mode=wal").fetchone()[0])
if phase == "write":
    c.execute("PRAGMA synchronous=NORMAL")
    c.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, v TEXT, n INTEGER)")
    for i in range(1000):
        c.execute("BEGIN")
        c.execute("INSERT INTO t(v, n) VALUES (?, ?)", ("row %d " % i + "x" * (i % 300), i))
        if i % 7 == 0:
            c.execute("UPDATE t SET n = n + 1000, v = v || 'u' WHERE id = ?", (i // 2 + 1,))
        c.execute("COMMIT")
        if i == 500:
            c.execute("PRAGMA wal_checkpoint(PASSIVE)")
print(c.execute("PRAGMA integrity_check").fetchone()[0])
print(*c.execute("SELECT count(*), sum(n), sum(length(v)) FROM t").fetchone())
c.close()
"#;

fn sqlite(db: &Path, phase: &str) -> Vec<String> {
    let out = Command::new(python3())
        .args(["-c", SQLITE_PY])
        .arg(db)
        .arg(phase)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "sqlite {phase} on {}: {}",
        db.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).lines().map(String::from).collect()
}

/// SQLite in WAL mode (which maps the -shm file MAP_SHARED): 1000 transactions, the
/// database intact and the same as on the native filesystem, also after a remount.
#[test]
fn sqlite_in_wal_mode_works() {
    let (_dir, reference, m) = setup("px-sqlite", &["--cache-size", "256K"]);
    let native = sqlite(&reference.join("db"), "write");
    assert_eq!(native[0], "wal");
    assert_eq!(native[1], "ok");
    assert!(native[2].starts_with("1000 "), "{native:?}");
    assert_eq!(
        sqlite(&m.path("db"), "write"),
        native,
        "on the mount (left), native (right)"
    );
    let m = m.remount();
    let native = sqlite(&reference.join("db"), "check");
    assert_eq!(
        sqlite(&m.path("db"), "check"),
        native,
        "after a remount (left), native (right)"
    );
    assert_eq!(m.umount(), 0);
}

/// One side of the fsx comparison: a directory and an open file per name.
struct Side {
    root: PathBuf,
    files: Vec<File>,
}

impl Side {
    fn open(root: &Path, name: &str) -> File {
        File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(root.join(name))
            .unwrap_or_else(|e| panic!("open {name} in {}: {e}", root.display()))
    }
}

const FSX_OPS: usize = 20_000;
const FSX_FILES: usize = 3;
const FSX_MAX: u64 = 3 * MIB;

/// fsx: 20000 seeded random operations on 3 files through a 256 KiB cache (pwrite, also far
/// past EOF; truncate up and down; read; read and write through MAP_SHARED mappings with
/// msync; fsync; close and reopen), each applied to the mount and to a reference directory.
/// Sizes are compared after every operation and data after every one that reads.
/// LOCKSTEP_FSX_SEED=N replays another sequence.
#[test]
fn fsx_with_mmap_matches_a_reference_directory() {
    let (_dir, reference, m) = setup("px-fsx", &["--cache-size", "256K", "--dirty-age", "200ms"]);
    let seed = std::env::var("LOCKSTEP_FSX_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x00f5_7a11_5eed_0042u64);
    let mut rng = Rng::new(seed | 1);
    let names: Vec<String> = (0..FSX_FILES).map(|i| format!("x{i}")).collect();
    let mut sides: Vec<Side> = [&m.mnt, &reference]
        .into_iter()
        .map(|root| Side {
            root: root.clone(),
            files: names.iter().map(|n| Side::open(root, n)).collect(),
        })
        .collect();
    let mut history: VecDeque<String> = VecDeque::new();
    let fail = |history: &VecDeque<String>, op: usize, msg: String| -> ! {
        let h: Vec<String> = history.iter().cloned().collect();
        panic!(
            "fsx seed {seed} (LOCKSTEP_FSX_SEED={seed}), op {op}: {msg}\nlast {} ops:\n  {}",
            h.len(),
            h.join("\n  ")
        )
    };
    for op in 0..FSX_OPS {
        let i = rng.below(FSX_FILES as u64) as usize;
        let name = &names[i];
        let size = sides[1].files[i].metadata().unwrap().len();
        let kind = rng.below(100);
        let desc;
        match kind {
            // pwrite, mostly near the data, sometimes far past EOF (a hole)
            0..=34 => {
                let off = if rng.below(8) == 0 {
                    size + rng.below(MIB)
                } else {
                    rng.below(size + 64 * 1024)
                }
                .min(FSX_MAX);
                let max = if rng.below(8) == 0 { 65536 } else { 5000 };
                let len = 1 + rng.below(max) as usize;
                let data = fill(&mut rng, len);
                desc = format!("pwrite {name} {off}+{len} (size {size})");
                history.push_back(desc.clone());
                for s in &sides {
                    if let Err(e) = s.files[i].write_all_at(&data, off) {
                        fail(&history, op, format!("{} in {}: {e}", desc, s.root.display()));
                    }
                }
            }
            // truncate, up or down
            35..=44 => {
                let to = if rng.below(2) == 0 {
                    rng.below(size + 1)
                } else {
                    (size + rng.below(MIB)).min(FSX_MAX)
                };
                desc = format!("truncate {name} {size} -> {to}");
                history.push_back(desc.clone());
                for s in &sides {
                    if let Err(e) = s.files[i].set_len(to) {
                        fail(&history, op, format!("{} in {}: {e}", desc, s.root.display()));
                    }
                }
            }
            // read()
            45..=64 => {
                let off = rng.below(size + 8192);
                let len = 1 + rng.below(40_000) as usize;
                desc = format!("read {name} {off}+{len} (size {size})");
                history.push_back(desc.clone());
                let got: Vec<Vec<u8>> = sides
                    .iter()
                    .map(|s| {
                        let mut buf = vec![0u8; len];
                        let mut n = 0;
                        while n < len {
                            match s.files[i].read_at(&mut buf[n..], off + n as u64) {
                                Ok(0) => break,
                                Ok(k) => n += k,
                                Err(e) => fail(&history, op, format!("{} in {}: {e}", desc, s.root.display())),
                            }
                        }
                        buf.truncate(n);
                        buf
                    })
                    .collect();
                if got[0] != got[1] {
                    let at = got[0].iter().zip(&got[1]).position(|(a, b)| a != b);
                    fail(
                        &history,
                        op,
                        format!(
                            "read differs: {} bytes on the mount, {} in the reference, first difference at +{at:?}",
                            got[0].len(),
                            got[1].len()
                        ),
                    );
                }
            }
            // read through a MAP_SHARED mapping
            65..=74 => {
                if size == 0 {
                    continue;
                }
                let off = rng.below(size) as usize;
                let len = (1 + rng.below(40_000) as usize).min(size as usize - off);
                desc = format!("mmap read {name} {off}+{len} (size {size})");
                history.push_back(desc.clone());
                let got: Vec<Vec<u8>> = sides
                    .iter()
                    .map(|s| match Map::new(&s.files[i], size as usize, false) {
                        Ok(map) => map.bytes()[off..off + len].to_vec(),
                        Err(e) => fail(&history, op, format!("{} in {}: mmap: {e}", desc, s.root.display())),
                    })
                    .collect();
                if got[0] != got[1] {
                    let at = got[0].iter().zip(&got[1]).position(|(a, b)| a != b);
                    fail(&history, op, format!("mapped bytes differ, first at +{at:?}"));
                }
            }
            // write through a MAP_SHARED mapping, then msync
            75..=84 => {
                if size == 0 {
                    continue;
                }
                let off = rng.below(size) as usize;
                let len = (1 + rng.below(20_000) as usize).min(size as usize - off);
                let data = fill(&mut rng, len);
                desc = format!("mmap write {name} {off}+{len} (size {size})");
                history.push_back(desc.clone());
                for (k, s) in sides.iter().enumerate() {
                    let mut map = match Map::new(&s.files[i], size as usize, true) {
                        Ok(map) => map,
                        Err(e) => fail(&history, op, format!("{} in {}: mmap: {e}", desc, s.root.display())),
                    };
                    map.write(off, &data);
                    // Natively, a shared mapping and read() see one page cache without msync
                    // (and msync costs a journal commit); the mount gets msync(MS_SYNC).
                    if k == 0 {
                        if let Err(e) = map.sync() {
                            fail(&history, op, format!("{} in {}: msync: {e}", desc, s.root.display()));
                        }
                    }
                }
            }
            // fsync (the mount only: the reference needs no durability)
            85..=89 => {
                desc = format!("fsync {name}");
                history.push_back(desc.clone());
                if let Err(e) = sides[0].files[i].sync_all() {
                    fail(&history, op, format!("{desc}: {e}"));
                }
            }
            // close and reopen
            _ => {
                desc = format!("reopen {name}");
                history.push_back(desc.clone());
                for s in &mut sides {
                    s.files[i] = Side::open(&s.root, name);
                }
            }
        }
        if history.len() > 20 {
            history.pop_front();
        }
        let sizes: Vec<u64> = sides.iter().map(|s| s.files[i].metadata().unwrap().len()).collect();
        if sizes[0] != sizes[1] {
            fail(
                &history,
                op,
                format!("size {} on the mount, {} in the reference", sizes[0], sizes[1]),
            );
        }
    }
    drop(sides);
    for n in &names {
        let (a, b) = (
            std::fs::read(m.path(n)).unwrap(),
            std::fs::read(reference.join(n)).unwrap(),
        );
        assert!(a == b, "fsx seed {seed}: {n} differs at the end");
    }
    let m = m.remount();
    for n in &names {
        let (a, b) = (
            std::fs::read(m.path(n)).unwrap(),
            std::fs::read(reference.join(n)).unwrap(),
        );
        assert!(a == b, "fsx seed {seed}: {n} differs after a remount");
    }
    assert_eq!(m.umount(), 0);
}

const CONCURRENT_PY: &str = r#"
import os, random, sys
mnt, ref, seed, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
r = random.Random(seed)
fds = [os.open(p, os.O_RDWR | os.O_CREAT, 0o644) for p in (mnt, ref)]
hist = []
def fail(msg):
    sys.stderr.write("seed %d, op %d: %s\nlast ops:\n  %s\n" % (seed, i, msg, "\n  ".join(hist[-20:])))
    sys.exit(1)
for i in range(n):
    k = r.randrange(10)
    if k < 5:
        off = r.randrange(0, 1 << 20)
        data = r.randbytes(r.randrange(1, 32768))
        hist.append("pwrite %d+%d" % (off, len(data)))
        for fd in fds:
            if os.pwrite(fd, data, off) != len(data):
                fail("short write")
    elif k < 7:
        size = r.randrange(0, 1 << 20)
        hist.append("truncate %d" % size)
        for fd in fds:
            os.ftruncate(fd, size)
    elif k < 9:
        off = r.randrange(0, 1 << 20)
        ln = r.randrange(1, 65536)
        hist.append("pread %d+%d" % (off, ln))
        a, b = (os.pread(fd, ln, off) for fd in fds)
        if a != b:
            fail("read differs: %d bytes on the mount, %d in the reference" % (len(a), len(b)))
    else:
        hist.append("fsync")
        os.fsync(fds[0])
    sizes = [os.fstat(fd).st_size for fd in fds]
    if sizes[0] != sizes[1]:
        fail("size %d on the mount, %d in the reference" % tuple(sizes))
"#;

/// 4 processes at once, each with ~2000 random writes, reads and truncates on its own file
/// in the mount (through a 256 KiB cache) and on a reference file; all files equal at the
/// end and after a remount.
#[test]
fn concurrent_processes_match_their_reference_files() {
    let (_dir, reference, m) = setup("px-conc", &["--cache-size", "256K", "--dirty-age", "200ms"]);
    let children: Vec<_> = (0..4)
        .map(|k| {
            Command::new(python3())
                .args(["-c", CONCURRENT_PY])
                .arg(m.path(&format!("c{k}")))
                .arg(reference.join(format!("c{k}")))
                .arg((1000 + k).to_string())
                .arg("2000")
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for (k, c) in children.into_iter().enumerate() {
        let out = c.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "process {k}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let compare = |m: &Mount, when: &str| {
        for k in 0..4 {
            let n = format!("c{k}");
            let (a, b) = (
                std::fs::read(m.path(&n)).unwrap(),
                std::fs::read(reference.join(&n)).unwrap(),
            );
            assert!(a == b, "{n} differs {when} ({} vs {} bytes)", a.len(), b.len());
        }
    };
    compare(&m, "at the end");
    let m = m.remount();
    compare(&m, "after a remount");
    assert_eq!(m.umount(), 0);
}

/// Unmounts a second mount, if there is one, whatever the test's outcome.
struct Unmount(PathBuf);
impl Drop for Unmount {
    fn drop(&mut self) {
        if mounted(&self.0) {
            let _ = lockstep().args(["fs", "umount"]).arg(&self.0).output();
            if mounted(&self.0) {
                let target = std::ffi::CString::new(self.0.to_str().unwrap()).unwrap();
                // SAFETY: target is a NUL-terminated path that outlives the call.
                unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
            }
        }
    }
}

/// A store that is mounted cannot be mounted a second time elsewhere: the second mount
/// fails with a clear message and the first one goes on undisturbed.
#[test]
fn a_store_in_use_cannot_be_mounted_twice() {
    let dir = scratch_dir("px-twice");
    let m = Mount::new(&dir, &["--dirty-age", "30s"]);
    std::fs::write(m.path("before"), b"written before").unwrap();
    let pid = m.ctl("stats")["pid"].clone();
    assert!(pid.is_number(), "stats has no pid: {pid}");
    let mnt2 = dir.join("mnt2");
    std::fs::create_dir_all(&mnt2).unwrap();
    let guard = Unmount(mnt2.clone());
    let out = lockstep()
        .args(["fs", "mount", "--store"])
        .arg(&m.store)
        .arg(&mnt2)
        .output()
        .unwrap();
    let second_mounted = mounted(&mnt2);
    drop(guard);
    let err = String::from_utf8_lossy(&out.stderr).to_lowercase();
    assert!(
        !out.status.success() && !second_mounted,
        "the second mount of the store succeeded ({}, mounted: {second_mounted}): {err}",
        out.status
    );
    assert!(
        err.contains("store") && (err.contains("in use") || err.contains("already mounted")),
        "the error does not say that the store is in use: {err}"
    );
    // The first mount is undisturbed: its data, its control socket, its daemon.
    assert_eq!(std::fs::read(m.path("before")).unwrap(), b"written before");
    assert_eq!(m.ctl("stats")["pid"], pid, "ctl reaches another daemon");
    std::fs::write(m.path("after"), b"written after").unwrap();
    let m = m.remount();
    assert_eq!(std::fs::read(m.path("before")).unwrap(), b"written before");
    assert_eq!(std::fs::read(m.path("after")).unwrap(), b"written after");
    assert_eq!(m.umount(), 0);
}

//! `lockstep fs`: real FUSE mounts (as root), real workloads (git, a C build, fio,
//! PostMark), random operations against a reference directory, on-disk and in-memory
//! corruption.

mod common;
mod fsmount;
use common::*;
use fsmount::*;
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// An fsx-style sequence: writes, truncates, renames, links, unlinks, fsyncs on 8 files,
/// applied to the mount and to a plain reference directory, compared all along and after
/// a remount.
#[test]
fn random_operations_match_a_reference_directory() {
    let dir = scratch_dir("fs-fsx");
    let reference = dir.join("ref");
    std::fs::create_dir_all(&reference).unwrap();
    // A small cache, so that pages are evicted and read back from the store too.
    let events = dir.join("events.jsonl");
    let m = Mount::new(
        &dir,
        &[
            "--cache-size",
            "256K",
            "--dirty-age",
            "200ms",
            "--verify",
            "every-read",
            "--events",
            events.to_str().unwrap(),
        ],
    );
    // LOCKSTEP_FSX_SEED=N replays another sequence.
    let seed = std::env::var("LOCKSTEP_FSX_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5eed_1234_abcd_0001u64);
    let mut rng = Rng::new(seed | 1);
    let names: Vec<String> = (0..8).map(|i| format!("f{i}")).collect();
    let open = |root: &Path, name: &str| {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(root.join(name))
            .unwrap()
    };
    for op in 0..3000 {
        let name = &names[rng.below(8) as usize];
        let kind = rng.below(10);
        if std::env::var_os("FSX_TRACE").is_some() {
            eprintln!("op {op}: {kind} {name}");
        }
        match kind {
            0..=4 => {
                let off = rng.below(200_000);
                let len = 1 + rng.below(20_000) as usize;
                let data = fill(&mut rng, len);
                for root in [&m.mnt, &reference] {
                    if let Err(e) = open(root, name).write_all_at(&data, off) {
                        std::thread::sleep(Duration::from_millis(1500));
                        panic!(
                            "op {op}: write {name} {off}+{len}: {e}; stats {}\n{}",
                            m.ctl("stats"),
                            std::fs::read_to_string(&events).unwrap_or_default()
                        );
                    }
                }
            }
            5 => {
                let size = rng.below(220_000);
                for root in [&m.mnt, &reference] {
                    if let Err(e) = open(root, name).set_len(size) {
                        std::thread::sleep(Duration::from_millis(1500));
                        panic!(
                            "op {op}: set_len {name} {size}: {e}; stats {}\n{}",
                            m.ctl("stats"),
                            std::fs::read_to_string(&events).unwrap_or_default()
                        );
                    }
                }
            }
            6 => {
                let to = &names[rng.below(8) as usize];
                for root in [&m.mnt, &reference] {
                    if root.join(name).exists() {
                        std::fs::rename(root.join(name), root.join(to)).unwrap();
                    }
                }
            }
            7 => {
                let to = format!("{name}.link");
                for root in [&m.mnt, &reference] {
                    if root.join(name).exists() && !root.join(&to).exists() {
                        std::fs::hard_link(root.join(name), root.join(&to)).unwrap();
                    }
                }
            }
            8 => {
                for root in [&m.mnt, &reference] {
                    let _ = std::fs::remove_file(root.join(name));
                }
            }
            _ => {
                if m.mnt.join(name).exists() {
                    open(&m.mnt, name).sync_all().unwrap();
                }
            }
        }
        if op % 50 == 0 || op == 2999 {
            compare_trees(&m.mnt, &reference, op);
        }
    }
    assert_eq!(m.umount(), 0);
    let m = Mount::new(&dir, &[]);
    compare_trees(&m.mnt, &reference, 3000);
    assert_eq!(m.umount(), 0);
}

fn compare_trees(a: &Path, b: &Path, op: usize) {
    let list = |p: &Path| {
        let mut v: Vec<String> = std::fs::read_dir(p)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    };
    assert_eq!(list(a), list(b), "after op {op}");
    for name in list(b) {
        let (x, y) = (
            std::fs::read(a.join(&name)).unwrap(),
            std::fs::read(b.join(&name)).unwrap(),
        );
        assert!(
            x == y,
            "{name} differs after op {op} ({} vs {} bytes)",
            x.len(),
            y.len()
        );
    }
}

fn sh(dir: &Path, script: &str) -> String {
    let out = Command::new("bash")
        .arg("-c")
        .arg(script)
        .current_dir(dir)
        .env("GIT_AUTHOR_DATE", "2026-01-01T00:00:00Z")
        .env("GIT_COMMITTER_DATE", "2026-01-01T00:00:00Z")
        .env("HOME", dir)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "script failed in {}:\n{script}\n{text}",
        dir.display()
    );
    text
}

/// git, a C build, fio with verification and PostMark, each on the mount and on a plain
/// directory; the outputs must be identical (PostMark's timing lines excepted).
#[test]
fn real_workloads_run_as_on_a_plain_directory() {
    let dir = scratch_dir("fs-work");
    let plain = dir.join("plain");
    std::fs::create_dir_all(&plain).unwrap();
    let m = Mount::new(&dir, &["--verify", "every-read", "--scrub", "1000"]);
    let git = "set -e
        git init -q -b main repo && cd repo
        git config user.email t@example.com && git config user.name tester
        for i in $(seq 1 30); do printf 'line %s\\n' $(seq 1 $i) > f$i.txt; done
        mkdir sub && echo nested > sub/n.txt && ln -s f1.txt link
        git add -A && git commit -q -m first
        git checkout -q -b side && echo more >> f3.txt && git rm -q f4.txt && git commit -q -am second
        git checkout -q main && git merge -q --no-edit side
        git gc -q && git fsck --strict 2>&1
        git log --format='%H %s' && git ls-files -s && cat f3.txt";
    let c_build = "set -e
        mkdir cproj && cd cproj
        printf '#include \"util.h\"\\nint twice(int x) { return 2 * x; }\\n' > util.c
        printf 'int twice(int x);\\n' > util.h
        printf '#include <stdio.h>\\n#include \"util.h\"\\nint main(void) { for (int i = 0; i < 5; i++) printf(\"%%d\\\\n\", twice(i)); return 0; }\\n' > main.c
        printf 'prog: main.o util.o\\n\\tgcc -o prog main.o util.o\\n%%.o: %%.c util.h\\n\\tgcc -O2 -Wall -c $<\\n' > Makefile
        make -s && ./prog && touch util.c && make -s && ./prog && cmp -s main.o main.o && echo built";
    for script in [git, c_build] {
        assert_eq!(sh(&m.mnt, script), sh(&plain, script), "{script}");
    }
    let fio = |d: &Path| {
        sh(
            d,
            "fio --name=v --rw=randwrite --bs=4k --size=4M --verify=crc32c --do_verify=1 --ioengine=psync \
               --fallocate=none --minimal --output-format=terse | cut -d';' -f5",
        )
    };
    assert_eq!(fio(&m.mnt).trim(), "0", "fio reported errors");
    assert_eq!(fio(&plain).trim(), "0");
    let postmark = |d: &Path| {
        let cfg = format!(
            "set location {}\nset number 300\nset transactions 1000\nset seed 42\nset size 500 20000\nrun\nquit\n",
            d.display()
        );
        let mut child = Command::new("postmark")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(cfg.as_bytes()).unwrap();
        let mut out = String::new();
        child.stdout.take().unwrap().read_to_string(&mut out).unwrap();
        let mut err = String::new();
        child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
        assert!(child.wait().unwrap().success());
        // PostMark reports failed opens on stderr and carries on.
        assert_eq!(err, "", "PostMark in {}", d.display());
        out.lines()
            .filter(|l| !l.contains("second"))
            .map(String::from)
            .collect::<Vec<_>>()
    };
    assert_eq!(postmark(&m.mnt), postmark(&plain));
    let stats = m.ctl("stats");
    assert_eq!(stats["clean_detected"], 0);
    assert_eq!(stats["eio"], 0);
    assert!(stats["checks"].as_u64().unwrap() > 1000, "{stats}");
    assert_eq!(m.umount(), 0);
}

#[test]
fn disk_corruption_is_caught_and_the_mirror_repairs_it() {
    let dir = scratch_dir("fs-disk");
    let mirror = dir.join("mirror");
    let data: Vec<u8> = fill(&mut Rng::new(77), 64 * 1024);
    let m = Mount::new(&dir, &["--mirror", mirror.to_str().unwrap()]);
    std::fs::write(m.path("victim"), &data).unwrap();
    std::fs::write(m.path("bystander"), b"unharmed").unwrap();
    assert_eq!(m.umount(), 0);
    let backing = dir.join("store/victim");
    let flip = |p: &Path, at: u64| {
        let f = std::fs::OpenOptions::new().read(true).write(true).open(p).unwrap();
        let mut b = [0u8];
        f.read_exact_at(&mut b, at).unwrap();
        f.write_all_at(&[b[0] ^ 0x20], at).unwrap();
    };
    flip(&backing, 5000);
    let m = Mount::new(&dir, &["--mirror", mirror.to_str().unwrap()]);
    assert_eq!(std::fs::read(m.path("victim")).unwrap(), data);
    assert_eq!(m.ctl("stats")["disk_repaired"], 1);
    assert_eq!(m.umount(), 0);
    // The repair was written back: the store's copy is good again.
    assert_eq!(std::fs::read(&backing).unwrap(), data);
    // Both copies bad: EIO for that file only, never its wrong data.
    flip(&backing, 9000);
    flip(&mirror.join("victim"), 9000);
    let m = Mount::new(&dir, &["--mirror", mirror.to_str().unwrap()]);
    let err = std::fs::read(m.path("victim")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    assert_eq!(std::fs::read(m.path("bystander")).unwrap(), b"unharmed");
    assert_eq!(m.ctl("stats")["disk_corrupt"], 1);
    assert_eq!(m.umount(), 0);
}

/// Flips in clean pages are caught and repaired under every strategy (given its time
/// condition), and by the scrubber alone.
#[test]
fn memory_flips_in_clean_pages_are_caught_by_each_strategy() {
    let data: Vec<u8> = fill(&mut Rng::new(99), 256 * 1024);
    for (verify, scrub, age_ms) in [
        ("every-read", "0", 0),
        ("last-check=100ms", "0", 300),
        ("last-use=100ms", "0", 300),
        ("none", "100000", 0),
    ] {
        let dir = scratch_dir("fs-flip");
        let m = Mount::new(&dir, &["--test-flips", "--verify", verify, "--scrub", scrub]);
        std::fs::write(m.path("f"), &data).unwrap();
        assert_eq!(m.ctl("flush")["ok"], true);
        assert_eq!(m.ctl("flip 10 clean")["flipped"], 10);
        // The time strategies check a page only once its last check (or use) is older
        // than their window: that age is the condition under test, not a stand-in for it.
        std::thread::sleep(Duration::from_millis(age_ms));
        if verify == "none" {
            // Only the scrubber can find them: wait until it has.
            let deadline = Instant::now() + Duration::from_secs(20);
            while m.ctl("stats")["clean_detected"] != 10 {
                assert!(Instant::now() < deadline, "the scrubber found {} of 10", m.ctl("stats"));
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        assert_eq!(std::fs::read(m.path("f")).unwrap(), data, "{verify}");
        let s = m.ctl("stats");
        assert_eq!(s["clean_detected"], 10, "{verify}: {s}");
        assert_eq!(m.umount(), 0);
    }
}

/// Flips at a high rate, while a reader re-reads the same clean file continuously with the
/// default strategy: not one wrong byte, and the flips are counted as detected.
#[test]
fn flips_at_a_rate_never_reach_a_reader_with_the_default_strategy() {
    let dir = scratch_dir("fs-rate");
    let m = Mount::new(&dir, &["--test-flips", "--scrub", "0"]);
    let data = fill(&mut Rng::new(1234), 2 << 20);
    std::fs::write(m.path("f"), &data).unwrap();
    assert_eq!(m.ctl("flush")["ok"], true);
    assert_eq!(m.ctl("flip-rate 2000 clean")["ok"], true);
    // Re-read until at least 500 flips went in and 100 were caught on the way (however
    // fast this machine is), every read checked byte for byte.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let got = std::fs::read(m.path("f")).unwrap();
        let wrong = got.iter().zip(&data).filter(|(a, b)| a != b).count();
        assert_eq!((got.len(), wrong), (data.len(), 0));
        let s = m.ctl("stats");
        if s["injected"].as_u64().unwrap() >= 500 && s["clean_detected"].as_u64().unwrap() >= 100 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "too few flips injected or caught in 60 s: {s}"
        );
    }
    assert_eq!(m.ctl("flip-rate 0 any")["ok"], true);
    assert_eq!(m.umount(), 0);
}

#[test]
fn a_flip_in_a_dirty_page_gives_eio_and_never_reaches_the_disk() {
    let dir = scratch_dir("fs-dirty");
    let m = Mount::new(
        &dir,
        &[
            "--test-flips",
            "--verify",
            "every-read",
            "--dirty-age",
            "30s",
            "--events",
            dir.join("ev.jsonl").to_str().unwrap(),
        ],
    );
    std::fs::write(m.path("old"), b"committed").unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(m.path("old")).unwrap();
    f.sync_all().unwrap();
    f.write_all_at(b"COMMITTED", 0).unwrap();
    assert_eq!(m.ctl("flip 1 dirty")["flipped"], 1);
    assert_eq!(
        std::fs::read(m.path("old")).unwrap_err().raw_os_error(),
        Some(libc::EIO)
    );
    assert_eq!(f.sync_all().unwrap_err().raw_os_error(), Some(libc::EIO));
    drop(f);
    // Unmounting writes back everything else; `fs umount` exits 86 and names the file whose
    // acknowledged data it had to discard.
    let (code, err) = m.umount_with_message();
    assert_eq!(code, 86, "{err}");
    assert!(err.contains("old (1 page(s))"), "{err}");
    assert_eq!(std::fs::read(dir.join("store/old")).unwrap(), b"committed");
    let events = std::fs::read_to_string(dir.join("ev.jsonl")).unwrap();
    assert!(events.contains("\"kind\":\"detect\""), "{events}");
}

#[test]
fn unmount_writes_back_dirty_data() {
    let dir = scratch_dir("fs-umount");
    let m = Mount::new(&dir, &["--dirty-age", "30s"]);
    let data = fill(&mut Rng::new(5), 100_000);
    std::fs::write(m.path("late"), &data).unwrap();
    assert!(m.ctl("stats")["dirty_pages"].as_u64().unwrap() > 0);
    assert_eq!(m.umount(), 0);
    assert_eq!(std::fs::read(dir.join("store/late")).unwrap(), data);
}

#[test]
fn a_full_disk_gives_enospc_to_the_writer_and_loses_nothing() {
    let dir = scratch_dir("fs-full");
    let store = dir.join("store");
    std::fs::create_dir_all(&store).unwrap();
    let ok = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=4m", "tmpfs"])
        .arg(&store)
        .status()
        .unwrap();
    assert!(ok.success());
    let mnt = dir.join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let m = Mount::at(&mnt, &store, &["--dirty-age", "30s"]);
    let small = fill(&mut Rng::new(6), 500_000);
    std::fs::write(m.path("small"), &small).unwrap();
    let mut f = std::fs::File::create(m.path("big")).unwrap();
    let chunk = vec![7u8; 64 * 1024];
    let mut written = 0usize;
    let err = loop {
        match f.write(&chunk) {
            Ok(n) => written += n,
            Err(e) => break e,
        }
        assert!(written < 64 << 20, "no ENOSPC after {written} bytes");
    };
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
    drop(f);
    // What was accepted is there, on the mount and after unmount.
    let big = std::fs::read(m.path("big")).unwrap();
    assert_eq!(big.len(), written);
    assert!(big.iter().all(|&b| b == 7));
    assert_eq!(std::fs::read(m.path("small")).unwrap(), small);
    assert_eq!(m.umount(), 0);
    assert_eq!(std::fs::read(store.join("small")).unwrap(), small);
    assert_eq!(std::fs::read(store.join("big")).unwrap().len(), written);
    let _ = Command::new("umount").arg(&store).status();
}

#[test]
fn bad_mounts_get_clear_errors() {
    let dir = scratch_dir("fs-bad");
    let mnt = dir.join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let run = |args: &[&str]| {
        let out = lockstep().args(["fs", "mount"]).args(args).arg(&mnt).output().unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    std::fs::write(dir.join("file"), b"x").unwrap();
    let (code, err) = run(&["--store", dir.join("file/store").to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("cannot create the store"), "{err}");
    let (code, err) = run(&["--verify", "sometimes"]);
    assert_eq!(code, 2);
    assert!(err.contains("--verify"), "{err}");
    let (code, err) = run(&["--dirty-age", "60s"]);
    assert_eq!(code, 2, "{err}");
    let m = Mount::new(&dir, &[]);
    let (code, err) = run(&["--store", dir.join("other").to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("busy"), "{err}");
    // The daemon mode returns once mounted; umount finds it through the mount table.
    drop(m);
    let mnt2 = dir.join("mnt2");
    std::fs::create_dir_all(&mnt2).unwrap();
    let out = lockstep()
        .args(["fs", "mount", "--store"])
        .arg(dir.join("s2"))
        .arg(&mnt2)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    std::fs::write(mnt2.join("x"), b"daemon").unwrap();
    let out = lockstep().args(["fs", "umount"]).arg(&mnt2).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::read(dir.join("s2/x")).unwrap(), b"daemon");
    let out = lockstep().args(["fs", "umount"]).arg(&mnt2).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("not mounted"));
    // A directory with files in it is not taken for a store: adopt makes it one.
    let plain = dir.join("plain");
    std::fs::create_dir_all(&plain).unwrap();
    std::fs::write(plain.join("mine"), b"precious").unwrap();
    let (code, err) = run(&["--store", plain.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("lockstep fs adopt"), "{err}");
    assert_eq!(std::fs::read(plain.join("mine")).unwrap(), b"precious");
}

/// A mount whose server was killed (supervisor and daemon) is recognised: mounting over
/// it says what happened and what to do, and `fs umount` cleans it up.
#[test]
fn a_dead_mount_is_recognised_and_cleaned_up() {
    let dir = scratch_dir("fs-dead");
    let mut m = Mount::new(&dir, &[]);
    std::fs::write(m.path("f"), b"x").unwrap();
    let daemon = m.ctl("stats")["pid"].as_i64().unwrap() as i32;
    let mut supervisor = m.child.take().unwrap();
    // SAFETY: kill takes any pid and signal.
    unsafe { libc::kill(supervisor.id() as i32, libc::SIGKILL) };
    // SAFETY: kill takes any pid and signal.
    unsafe { libc::kill(daemon, libc::SIGKILL) };
    supervisor.wait().unwrap();
    let out = lockstep()
        .args(["fs", "mount", "--store"])
        .arg(dir.join("store"))
        .arg(&m.mnt)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("dead lockstep mount") && err.contains("fs umount"),
        "{err}"
    );
    let out = lockstep().args(["fs", "umount"]).arg(&m.mnt).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("dead mount"), "{err}");
    assert!(!mounted(&m.mnt));
    // The store mounts again, with what had been written back.
    let m = Mount::at(&m.mnt.clone(), &dir.join("store"), &[]);
    assert!(m.path("f").exists());
    assert_eq!(m.umount(), 0);
}

/// The cache daemon dies (abort, SIGSEGV, SIGKILL) five times during a write-heavy
/// workload with 30 s of dirty data in memory. Each time the supervisor starts a new one,
/// which verifies the dirty state, writes it back and answers the replayed requests: the
/// workload sees no error and every byte it wrote is there.
#[test]
fn the_daemon_crashes_under_a_write_heavy_workload_and_nothing_is_lost() {
    let dir = scratch_dir("fs-crash");
    let events = dir.join("ev.jsonl");
    let m = Mount::new(
        &dir,
        &[
            "--test-crash",
            "--dirty-age",
            "30s",
            "--events",
            events.to_str().unwrap(),
        ],
    );
    let root = m.mnt.clone();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop2 = stop.clone();
    let writer = std::thread::spawn(move || {
        let mut rng = Rng::new(0xc0ffee);
        let mut written = Vec::new();
        let mut i = 0;
        while !stop2.load(std::sync::atomic::Ordering::SeqCst) || i < 100 {
            let len = 1 + rng.below(200_000) as usize;
            let data = fill(&mut rng, len);
            let name = format!("w{i}");
            let dirpath = root.join(format!("d{}", i % 7));
            std::fs::create_dir_all(&dirpath).expect("mkdir during crashes");
            std::fs::write(dirpath.join(&name), &data).expect("write during crashes");
            // Read back at once: what the cache serves right after a restart.
            assert_eq!(
                std::fs::read(dirpath.join(&name)).expect("read during crashes"),
                data,
                "{name}"
            );
            if i % 5 == 0 {
                std::fs::rename(dirpath.join(&name), dirpath.join(format!("{name}.r"))).expect("rename during crashes");
                written.push((dirpath.join(format!("{name}.r")), data));
            } else {
                written.push((dirpath.join(&name), data));
            }
            i += 1;
        }
        written
    });
    // Two aborts (a failed assertion), a SIGSEGV and two SIGKILLs.
    for how in ["abort", "segv", "kill", "abort", "kill"] {
        std::thread::sleep(Duration::from_millis(300));
        if how == "kill" {
            let pid = m.ctl("stats")["pid"].as_i64().unwrap() as i32;
            // SAFETY: kill takes any pid and signal.
            assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
        } else {
            let cmd: &[&str] = if how == "segv" { &["crash", "segv"] } else { &["crash"] };
            let out = lockstep().args(["fs", "ctl"]).arg(&m.mnt).args(cmd).output().unwrap();
            assert!(!out.status.success(), "the daemon answered instead of crashing");
        }
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let written = writer.join().expect("the workload saw an error");
    for (path, data) in &written {
        assert_eq!(&std::fs::read(path).unwrap(), data, "{}", path.display());
    }
    assert_eq!(m.umount(), 0);
    let ev = std::fs::read_to_string(&events).unwrap();
    assert_eq!(ev.matches("\"kind\":\"crash\"").count(), 5, "{ev}");
    for status in ["status 134", "status 139", "status 137"] {
        assert!(ev.contains(status), "no crash with {status}: {ev}");
    }
    assert_eq!(ev.matches("\"kind\":\"recover\"").count(), 5, "{ev}");
    // After unmount the store holds it all.
    for (path, data) in &written {
        let rel = path.strip_prefix(dir.join("mnt")).unwrap();
        assert_eq!(&std::fs::read(dir.join("store").join(rel)).unwrap(), data);
    }
}

/// A wild write into the Dirty State Store before the crash: the new daemon refuses, the
/// supervisor drops the connection (exit 86), and the disk keeps the last good data.
#[test]
fn a_damaged_dirty_state_store_makes_recovery_refuse() {
    let dir = scratch_dir("fs-dss");
    let m = Mount::new(&dir, &["--test-crash", "--dirty-age", "30s"]);
    std::fs::write(m.path("t"), vec![b'o'; 10_000]).unwrap();
    std::fs::write(m.path("u"), vec![b'u'; 10_000]).unwrap();
    assert_eq!(m.ctl("flush")["ok"], true);
    std::fs::write(m.path("f"), b"durable").unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(m.path("f")).unwrap();
    f.sync_all().unwrap();
    f.write_all_at(b"DIRTY!!", 0).unwrap();
    drop(f);
    // Truncated (O_TRUNC, and ftruncate) and rewritten: the truncations are undone with
    // the rest, and the store keeps the last good versions.
    std::fs::write(m.path("t"), b"new").unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(m.path("u"))
        .unwrap()
        .set_len(100)
        .unwrap();
    assert_eq!(std::fs::read(m.path("t")).unwrap(), b"new");
    assert_eq!(std::fs::read(m.path("u")).unwrap(), vec![b'u'; 100]);
    let _ = lockstep()
        .args(["fs", "ctl"])
        .arg(&m.mnt)
        .arg("crash-damaged")
        .output()
        .unwrap();
    let mut m = m;
    let code = m.child.take().unwrap().wait().unwrap().code();
    assert_eq!(code, Some(86));
    // The mount now fails instead of serving anything.
    assert!(std::fs::read(m.path("f")).is_err());
    let target = std::ffi::CString::new(m.mnt.to_str().unwrap()).unwrap();
    // SAFETY: target is a NUL-terminated path that outlives the call.
    unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
    assert_eq!(std::fs::read(dir.join("store/f")).unwrap(), b"durable");
    assert_eq!(std::fs::read(dir.join("store/t")).unwrap(), vec![b'o'; 10_000]);
    assert_eq!(std::fs::read(dir.join("store/u")).unwrap(), vec![b'u'; 10_000]);
    let log = std::fs::read_to_string(&m.log).unwrap();
    assert!(log.contains("recovery refused"), "{log}");
}

/// Metadata goes to the backing filesystem: modes, owners, times, links, statfs, and the
/// kernel's permission checks for a user other than root.
#[test]
fn metadata_and_permissions() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let dir = scratch_dir("fs-meta");
    let m = Mount::new(&dir, &[]);
    std::fs::write(m.path("f"), b"data").unwrap();
    std::fs::set_permissions(m.path("f"), std::fs::Permissions::from_mode(0o640)).unwrap();
    assert_eq!(std::fs::metadata(m.path("f")).unwrap().mode() & 0o7777, 0o640);
    std::os::unix::fs::chown(m.path("f"), Some(65534), Some(65534)).unwrap();
    assert_eq!(std::fs::metadata(m.path("f")).unwrap().uid(), 65534);
    let t = std::time::UNIX_EPOCH + Duration::from_secs(1_000_000_000);
    std::fs::File::options()
        .write(true)
        .open(m.path("f"))
        .unwrap()
        .set_modified(t)
        .unwrap();
    assert_eq!(std::fs::metadata(m.path("f")).unwrap().modified().unwrap(), t);
    std::os::unix::fs::symlink("f", m.path("s")).unwrap();
    assert_eq!(std::fs::read_link(m.path("s")).unwrap(), Path::new("f"));
    assert_eq!(std::fs::read(m.path("s")).unwrap(), b"data");
    std::fs::hard_link(m.path("f"), m.path("h")).unwrap();
    assert_eq!(std::fs::metadata(m.path("f")).unwrap().nlink(), 2);
    // SAFETY: libc::statvfs is plain data, for which all-zero bytes are a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    let c = std::ffi::CString::new(m.mnt.to_str().unwrap()).unwrap();
    // SAFETY: c is a NUL-terminated path and st a valid statvfs to fill.
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut st) }, 0);
    assert!(st.f_blocks > 0 && st.f_bsize > 0);
    // Another user may not read a 0600 file it does not own (checked by the kernel).
    std::fs::write(m.path("secret"), b"x").unwrap();
    std::fs::set_permissions(m.path("secret"), std::fs::Permissions::from_mode(0o600)).unwrap();
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "cat"])
        .arg(m.path("secret"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Permission denied"),
        "{out:?}"
    );
    assert_eq!(m.umount(), 0);
}

/// Runs `f` in a child with its open-file limit (soft and hard) at `limit`, as a user's
/// shell with the default limit would start things.
fn with_nofile(cmd: &mut Command, limit: u64) -> &mut Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            let r = libc::rlimit {
                rlim_cur: limit,
                rlim_max: limit,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &r) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })
    }
}

/// 20,000 files created, listed, read and removed, with the mount and the workload both
/// limited to 1024 open files (soft and hard): the daemon's descriptors do not grow with
/// the tree.
#[test]
fn a_tree_of_20000_files_with_1024_descriptors() {
    let dir = scratch_dir("fs-many");
    let mnt = dir.join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let log = dir.join("mount.log");
    let child = with_nofile(
        lockstep()
            .args(["fs", "mount", "--foreground", "--store"])
            .arg(dir.join("store"))
            .arg("--mirror")
            .arg(dir.join("mirror"))
            .arg(&mnt)
            .stderr(std::fs::File::create(&log).unwrap()),
        1024,
    )
    .spawn()
    .unwrap();
    let m = Mount {
        mnt: mnt.clone(),
        child: Some(child),
        log,
        store: dir.join("store"),
        args: vec![],
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while !mounted(&mnt) {
        assert!(Instant::now() < deadline, "not mounted");
        std::thread::sleep(Duration::from_millis(20));
    }
    let daemon = m.ctl("stats")["pid"].as_i64().unwrap();
    let script = r#"
import os, sys
r = sys.argv[1]
for d in range(4):
    os.mkdir(f"{r}/d{d}")
    for i in range(5000):
        with open(f"{r}/d{d}/f{i}", "w") as f:
            f.write(f"{d}:{i}")
listed = sorted(os.path.join(p, n) for p, _, ns in os.walk(r) for n in ns)
assert len(listed) == 20000, len(listed)
for d in range(4):
    for i in range(5000):
        with open(f"{r}/d{d}/f{i}") as f:
            assert f.read() == f"{d}:{i}", (d, i)
print("ok")
"#;
    let out = with_nofile(Command::new(python3()).args(["-c", script]).arg(&mnt), 1024)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let fds = std::fs::read_dir(format!("/proc/{daemon}/fd")).unwrap().count();
    // Bounded by design: 128 O_PATH descriptors, and idle files (4 descriptors each with a
    // mirror) holding at most a quarter of the limit (at least 64 files).
    assert!(fds < 512, "the daemon holds {fds} descriptors");
    let out = with_nofile(
        Command::new("rm")
            .arg("-rf")
            .args((0..4).map(|d| mnt.join(format!("d{d}")))),
        1024,
    )
    .output()
    .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::read_dir(&mnt).unwrap().count(), 0);
    assert_eq!(m.umount(), 0);
    // No table is left behind for a removed file.
    assert_eq!(std::fs::read_dir(dir.join("store/.lockstep/crc")).unwrap().count(), 0);
}

/// Tables exist only for files whose data reached the store, and go with them: a file
/// created and removed without a write leaves nothing, a written one takes its table along
/// when removed, one removed while open keeps an orphan table until closed, and a kept
/// one has exactly its own.
#[test]
fn tables_live_and_die_with_their_files() {
    let dir = scratch_dir("fs-table-life");
    let m = Mount::new(&dir, &[]);
    let crc = m.store.join(".lockstep/crc");
    let orphans = m.store.join(".lockstep/orphans");
    std::fs::create_dir(m.path("d")).unwrap();
    let written = |name: &str, data: &[u8]| {
        let mut f = std::fs::File::create(m.path(name)).unwrap();
        f.write_all(data).unwrap();
        f.sync_all().unwrap();
        f
    };
    // Never written: no table, before or after.
    std::fs::File::create(m.path("d/empty")).unwrap();
    assert!(!crc.join("d/empty").exists());
    std::fs::remove_file(m.path("d/empty")).unwrap();
    // Written back (fsync): a table; removed: gone.
    drop(written("d/w", &[7u8; 10_000]));
    assert!(crc.join("d/w").exists());
    std::fs::remove_file(m.path("d/w")).unwrap();
    assert!(!crc.join("d/w").exists());
    // Removed while open, and written again: its table is an orphan until it is closed.
    let mut open = written("d/open", &[1u8; 5000]);
    std::fs::remove_file(m.path("d/open")).unwrap();
    open.write_all(&[2u8; 5000]).unwrap();
    open.sync_all().unwrap();
    assert_eq!(std::fs::read_dir(&orphans).unwrap().count(), 1);
    drop(open);
    drop(written("d/keep", &[3u8; 9000]));
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::fs::read_dir(&orphans).unwrap().count() > 0 {
        assert!(Instant::now() < deadline, "the orphan table outlived its closed file");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(m.umount(), 0);
    let names: Vec<_> = std::fs::read_dir(crc.join("d"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["keep"]);
    let (code, out, err) = fs_cmd(&["check"], &dir.join("store"));
    assert_eq!(code, 0, "{out}{err}");
}

fn fs_cmd(args: &[&str], dir: &Path) -> (i32, String, String) {
    let out = lockstep().arg("fs").args(args).arg(dir).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

/// A store copied with `cp -a` (and with tar) mounts and checks like the original; a byte
/// flipped in one copy of a table chunk is repaired without a mirror; the same slot damaged
/// in both copies loses only that block; an existing tree becomes a store with `adopt`.
#[test]
fn copied_stores_check_and_damaged_tables_degrade_gracefully() {
    let dir = scratch_dir("fs-portable");
    let m = Mount::new(&dir, &[]);
    let big = fill(&mut Rng::new(9), 5 << 20);
    std::fs::create_dir_all(m.path("a/b")).unwrap();
    std::fs::write(m.path("a/b/big"), &big).unwrap();
    std::fs::write(m.path("small"), b"small file").unwrap();
    std::fs::hard_link(m.path("small"), m.path("a/link")).unwrap();
    std::fs::rename(m.path("a/b"), m.path("c")).unwrap();
    assert_eq!(m.umount(), 0);
    let copy = dir.join("copy");
    assert!(Command::new("cp")
        .arg("-a")
        .arg(dir.join("store"))
        .arg(&copy)
        .status()
        .unwrap()
        .success());
    let (code, out, err) = fs_cmd(&["check"], &copy);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("checked 3 files"), "{out}");
    let tarred = dir.join("tarred");
    std::fs::create_dir_all(&tarred).unwrap();
    let sh = format!(
        "tar -C {} -cf - . | tar -C {} -xf -",
        dir.join("store").display(),
        tarred.display()
    );
    assert!(Command::new("sh").args(["-c", &sh]).status().unwrap().success());
    assert_eq!(fs_cmd(&["check"], &tarred).0, 0);
    let m = Mount::at(&dir.join("mnt"), &copy, &[]);
    assert_eq!(std::fs::read(m.path("c/big")).unwrap(), big);
    assert_eq!(std::fs::read(m.path("a/link")).unwrap(), b"small file");
    assert_eq!(m.umount(), 0);
    // One copy of the first chunk of c/big's table damaged: repaired from its twin.
    let table = copy.join(".lockstep/crc/c/big");
    let poke = |at: u64, v: u8| {
        let f = std::fs::OpenOptions::new().write(true).open(&table).unwrap();
        f.write_all_at(&[v], at).unwrap();
    };
    poke(4 * 7 + 1, 0xA5);
    let (code, out, _) = fs_cmd(&["check"], &copy);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("1 table chunk copy"), "{out}");
    // The same slot damaged in both copies: block 7 alone is lost.
    poke(4 * 7 + 1, 0xA5);
    poke(4096 + 4 * 7 + 1, 0x5A);
    let (code, out, _) = fs_cmd(&["check"], &copy);
    assert_eq!(code, 86, "{out}");
    assert!(out.contains("BAD c/big blocks 7\n"), "{out}");
    let m = Mount::at(&dir.join("mnt"), &copy, &[]);
    let f = std::fs::File::open(m.path("c/big")).unwrap();
    let mut buf = vec![0u8; 4096];
    assert_eq!(
        f.read_exact_at(&mut buf, 7 * 4096).unwrap_err().raw_os_error(),
        Some(libc::EIO)
    );
    f.read_exact_at(&mut buf, 8 * 4096).unwrap();
    assert_eq!(buf, big[8 * 4096..9 * 4096]);
    drop(f);
    assert_eq!(m.umount(), 0);
    // An existing tree becomes a store.
    let tree = dir.join("tree");
    std::fs::create_dir_all(tree.join("x")).unwrap();
    std::fs::write(tree.join("x/y"), &big[..100_000]).unwrap();
    let (code, out, err) = fs_cmd(&["adopt"], &tree);
    assert_eq!(code, 0, "{out}{err}");
    let m = Mount::at(&dir.join("mnt"), &tree, &[]);
    assert_eq!(std::fs::read(m.path("x/y")).unwrap(), big[..100_000]);
    assert_eq!(m.umount(), 0);
    assert_eq!(fs_cmd(&["check"], &tree).0, 0);
}

/// Files deleted and created at a high rate, so that the backing filesystem reuses inode
/// numbers the kernel still holds as nodeids (as PostMark does): every create, open and
/// read succeeds and returns its own file's data.
#[test]
fn inode_numbers_reused_by_the_store_never_give_estale() {
    let dir = scratch_dir("fs-reuse");
    let m = Mount::new(&dir, &[]);
    let script = r#"
import os, random, sys
r = sys.argv[1]
rng = random.Random(7)
# Directories removed while open: the kernel keeps their nodeids, the store frees their
# inode numbers at once, and the next files created are likely to get those numbers.
held = []
for i in range(20):
    os.mkdir(f"{r}/gone{i}")
    held.append(os.open(f"{r}/gone{i}", os.O_RDONLY))
    os.rmdir(f"{r}/gone{i}")
live = {}
for step in range(6000):
    if live and rng.random() < 0.45:
        name = rng.choice(sorted(live))
        os.unlink(f"{r}/{name}")
        del live[name]
    else:
        name = f"f{step}"
        with open(f"{r}/{name}", "w") as f:
            f.write(name * rng.randint(1, 50))
        live[name] = name
    if live and step % 3 == 0:
        name = rng.choice(sorted(live))
        with open(f"{r}/{name}") as f:
            data = f.read()
        assert data and data == name * (len(data) // len(name)), (step, name, data[:40])
print(len(live))
"#;
    let out = Command::new(python3())
        .args(["-c", script])
        .arg(&m.mnt)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(m.umount(), 0);
}

/// Renames before anything is written back: a file, a directory of files, an exchange of
/// two files and of two directories, and a rename between two names of one file. After a
/// remount every file reads right and `fs check` finds every table where its file is.
#[test]
fn renames_before_write_back_keep_every_file_checkable() {
    let dir = scratch_dir("fs-renames");
    let m = Mount::new(&dir, &["--dirty-age", "30s"]);
    let w = |name: &str, data: &str| std::fs::write(m.path(name), data).unwrap();
    std::fs::create_dir_all(m.path("d1")).unwrap();
    std::fs::create_dir_all(m.path("d2")).unwrap();
    w("a", "file a");
    w("b", "file b");
    w("d1/x", "x in d1");
    w("d2/y", "y in d2");
    w("moved", "moved file");
    w("linked", "two names");
    std::fs::hard_link(m.path("linked"), m.path("alias")).unwrap();
    let exchange = |a: &str, b: &str| {
        let (a, b) = (
            std::ffi::CString::new(m.path(a).to_str().unwrap()).unwrap(),
            std::ffi::CString::new(m.path(b).to_str().unwrap()).unwrap(),
        );
        // SAFETY: both paths are NUL-terminated and outlive the call.
        let r = unsafe {
            libc::syscall(
                libc::SYS_renameat2,
                libc::AT_FDCWD,
                a.as_ptr(),
                libc::AT_FDCWD,
                b.as_ptr(),
                libc::RENAME_EXCHANGE,
            )
        };
        assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
    };
    exchange("a", "b");
    exchange("d1", "d2");
    std::fs::rename(m.path("moved"), m.path("d1/moved")).unwrap();
    std::fs::rename(m.path("d2"), m.path("d3")).unwrap();
    std::fs::rename(m.path("linked"), m.path("alias")).unwrap();
    let want = [
        ("a", "file b"),
        ("b", "file a"),
        ("d1/y", "y in d2"),
        ("d1/moved", "moved file"),
        ("d3/x", "x in d1"),
        ("linked", "two names"),
        ("alias", "two names"),
    ];
    for (name, data) in want {
        assert_eq!(std::fs::read_to_string(m.path(name)).unwrap(), data, "{name}");
    }
    assert_eq!(m.umount(), 0);
    let out = lockstep()
        .args(["fs", "check"])
        .arg(dir.join("store"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        text.contains("checked 7 files") && text.contains("removed 0 stale"),
        "{text}"
    );
    let m = Mount::new(&dir, &[]);
    for (name, data) in want {
        assert_eq!(std::fs::read_to_string(m.path(name)).unwrap(), data, "{name}");
    }
    assert_eq!(m.umount(), 0);
}

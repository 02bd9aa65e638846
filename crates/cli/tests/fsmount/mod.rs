//! The mount helper shared by the `lockstep fs` test files: a real FUSE mount (as root) in
//! the foreground, unmounted on drop, plus the small seeded generator the tests use.
//!
//! A test file uses it with `mod common; mod fsmount;`.

#![allow(dead_code)]

use crate::common::lockstep;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

/// Whether `mnt` is a mount point now (its entry in /proc/self/mountinfo).
pub fn mounted(mnt: &Path) -> bool {
    // Not the mountpoint itself: a dead mount cannot be stat'ed.
    let canon = mnt
        .parent()
        .unwrap()
        .canonicalize()
        .unwrap()
        .join(mnt.file_name().unwrap());
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(canon.to_str().unwrap()))
}

/// A mount in the foreground, unmounted (and its daemon reaped) on drop.
pub struct Mount {
    pub mnt: PathBuf,
    pub child: Option<Child>,
    /// The daemon's stderr.
    pub log: PathBuf,
    /// The store and the options it was mounted with, for `remount`.
    pub store: PathBuf,
    pub args: Vec<String>,
}

impl Mount {
    /// Mount `dir/store` on `dir/mnt`.
    pub fn new(dir: &Path, args: &[&str]) -> Mount {
        let mnt = dir.join("mnt");
        std::fs::create_dir_all(&mnt).unwrap();
        Mount::at(&mnt, &dir.join("store"), args)
    }

    /// Mount `store` on `mnt` with `args`; returns once the mount is in place.
    pub fn at(mnt: &Path, store: &Path, args: &[&str]) -> Mount {
        let log = mnt.with_extension(format!("log{}", std::process::id()));
        let child = lockstep()
            .args(["fs", "mount", "--foreground", "--store"])
            .arg(store)
            .args(args)
            .arg(mnt)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut m = Mount {
            mnt: mnt.to_path_buf(),
            child: Some(child),
            log,
            store: store.to_path_buf(),
            args: args.iter().map(|a| a.to_string()).collect(),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !mounted(&m.mnt) {
            if let Some(status) = m.child.as_mut().unwrap().try_wait().unwrap() {
                m.child = None;
                panic!(
                    "the mount exited with {status} before mounting: {}",
                    std::fs::read_to_string(&m.log).unwrap_or_default()
                );
            }
            assert!(
                Instant::now() < deadline,
                "not mounted: {}",
                std::fs::read_to_string(&m.log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        m
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.mnt.join(name)
    }

    /// `lockstep fs ctl MNT CMD...`, whose answer must be JSON.
    pub fn ctl(&self, cmd: &str) -> serde_json::Value {
        let out = lockstep()
            .args(["fs", "ctl"])
            .arg(&self.mnt)
            .args(cmd.split(' '))
            .output()
            .unwrap();
        serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|_| panic!("ctl {cmd}: {}", String::from_utf8_lossy(&out.stderr)))
    }

    /// Unmount with `lockstep fs umount`; returns its exit status, which is the daemon's.
    pub fn umount(self) -> i32 {
        self.umount_with_message().0
    }

    /// As `umount`, with what `fs umount` said on stderr.
    pub fn umount_with_message(mut self) -> (i32, String) {
        let out = lockstep().args(["fs", "umount"]).arg(&self.mnt).output().unwrap();
        let code = out.status.code().unwrap_or(-1);
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        // The server exits once the mount is gone; never wait forever on it.
        let mut child = self.child.take().unwrap();
        let deadline = Instant::now() + Duration::from_secs(150);
        let daemon = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status.code().unwrap_or(-1);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "the server did not exit after `fs umount` (exit {code}: {err}); mounted: {}; log: {}",
                    mounted(&self.mnt),
                    std::fs::read_to_string(&self.log).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_eq!(code, daemon, "umount: {err}");
        assert!(!mounted(&self.mnt));
        (code, err)
    }

    /// Unmount (the daemon must exit 0) and mount the same store on the same mountpoint
    /// with the same options again.
    pub fn remount(self) -> Mount {
        let (mnt, store, args) = (self.mnt.clone(), self.store.clone(), self.args.clone());
        let log = self.log.clone();
        let code = self.umount();
        assert_eq!(
            code,
            0,
            "the daemon exited with {code} at unmount: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Mount::at(&mnt, &store, &args)
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let target = std::ffi::CString::new(self.mnt.to_str().unwrap()).unwrap();
            // SAFETY: target is a NUL-terminated path that outlives the call.
            unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub use lockstep_core::rng::Rng;

/// `n` pseudo-random bytes.
pub fn fill(rng: &mut Rng, n: usize) -> Vec<u8> {
    let mut bytes = vec![0; n];
    rng.fill(&mut bytes);
    bytes
}

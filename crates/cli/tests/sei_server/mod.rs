//! What the tests of libsei's servers share (sei_examples.rs, sei_ledger.rs): building a
//! server natively or with `lockstep cc`, and running one on a port of its own.

// Each test file uses part of this module.
#![allow(dead_code)]

use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// How a server is compiled.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Build {
    /// `lockstep cc`: the handlers hardened.
    Hardened,
    /// gcc -DSEI_NATIVE: the same source with libsei's calls compiled away.
    Native,
}

/// Compiles `sources` into `out` with the flags the campaigns use; libsei is unpacked
/// under `work` for a hardened build. Fails the test with gcc's messages.
pub fn compile(sources: &[PathBuf], build: Build, work: &Path, out: &Path) {
    let mut cmd = match build {
        Build::Hardened => {
            let mut c = Command::new(env!("CARGO_BIN_EXE_lockstep"));
            c.arg("cc").env("LOCKSTEP_SEI_DIR", work.join("sei"));
            c
        }
        Build::Native => {
            let mut c = Command::new("gcc");
            c.arg("-DSEI_NATIVE")
                .arg("-I")
                .arg(repo().join("sei/include"))
                .arg("-pthread");
            c
        }
    };
    let result = cmd
        .args(["-O2", "-Wall", "-Wextra", "-Werror"])
        .args(sources)
        .arg("-o")
        .arg(out)
        .output()
        .unwrap();
    assert!(
        result.status.success(),
        "building {} ({build:?}): {}",
        out.display(),
        String::from_utf8_lossy(&result.stderr)
    );
}

/// A port the kernel just handed out (bound to 0, then released for the server).
pub fn free_port() -> u16 {
    TcpListener::bind(("127.0.0.1", 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A running server, killed on drop.
pub struct Server {
    pub child: Child,
    pub port: u16,
}

impl Server {
    /// Starts `cmd --port PORT` (stdout discarded, stderr kept) and waits until it listens.
    pub fn start(mut cmd: Command) -> Server {
        let port = free_port();
        let what = format!("{cmd:?}");
        let child = cmd
            .arg("--port")
            .arg(port.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "{what} did not open port {port}");
            std::thread::sleep(Duration::from_millis(10));
        }
        Server { child, port }
    }

    /// Stops the server and returns its stderr and exit status (None: killed by us).
    pub fn stop(mut self) -> (String, Option<i32>) {
        let status = match self.child.try_wait().unwrap() {
            Some(s) => s.code(),
            None => {
                // (already exited if the kill fails; the wait below reaps it either way)
                let _ = self.child.kill();
                let _ = self.child.wait();
                None
            }
        };
        let mut err = String::new();
        self.child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
        (err, status)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // (a server the test stopped is gone already)
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

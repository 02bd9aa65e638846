//! Shared helpers for the `lockstep run` integration tests.
//!
//! * fixtures (`tests/fixtures/*.c`) are compiled with gcc once per test process into
//!   `$TMPDIR/lockstep-tests-<pid>/bin`;
//! * every process is run with a hard timeout (it is killed, and the test fails,
//!   instead of hanging the suite);
//! * every `lockstep` invocation gets a unique marker in its environment
//!   (`LOCKSTEP_TEST_MARKER=<marker>`), which all replicas and their children inherit;
//!   after lockstep exits we check that no process carrying the marker is left
//!   (`no_orphans`), and that nobody holds lockstep's stdout/stderr pipes open.
//!
//! Only std, serde_json and libc (for kill(2)) are used.

#![allow(dead_code)]

use std::collections::HashMap;
use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;

/// Hard limit for one lockstep (or native) run. A run that takes longer is killed
/// and the test fails.
pub const RUN_TIMEOUT: Duration = Duration::from_secs(60);
/// How long we wait for stdout/stderr to reach EOF after lockstep exited. If a
/// leftover process still holds the pipes after this, that is an orphan: fail.
pub const PIPE_GRACE: Duration = Duration::from_secs(10);
/// How long `no_orphans` waits for marked processes to disappear.
pub const ORPHAN_GRACE: Duration = Duration::from_secs(5);
/// Environment variable carrying the per-invocation marker.
pub const MARKER_ENV: &str = "LOCKSTEP_TEST_MARKER";

/// Number of lines (= write syscalls) flip_target makes.
pub const FLIP_LINES: usize = 20;
/// The intercepted-syscall stop at which the fault-injection tests flip.
///
/// flip_target is freestanding and static (see tests/fixtures/flip_target.c): its
/// whole syscall sequence is `execve, write x 20, exit_group`, which the test
/// `flip_target_syscall_sequence_is_as_documented` checks with strace. Stop 8 is
/// therefore the 8th write if the monitor starts counting after execve, or the 7th
/// if it counts the execve stop too. Both are ordinary writes in the middle of the
/// run: lines before it exist to be checked as a prefix, and there are a dozen
/// writes after it (enough for a latent register fault to surface and for a
/// re-integrated replica to take part).
pub const FLIP_K: u32 = 8;
/// A second, later flip point used when two faults are injected one after the other.
pub const FLIP_K_LATE: u32 = 14;
/// An earlier flip point (for the first of two faults).
pub const FLIP_K_EARLY: u32 = 5;

/// The shell pipeline used by several tests (fork/exec, pipes, several programs).
pub const PIPELINE: &str = "seq 1 500 | sort -rn | head -20 | tr 0-9 a-j; echo done";

// ---------------------------------------------------------------------------------
// Paths, fixtures, inputs
// ---------------------------------------------------------------------------------

/// The workspace root (…/main).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("workspace root")
}

pub fn fixtures_dir() -> PathBuf {
    repo_root().join("tests/fixtures")
}

/// `$TMPDIR/lockstep-tests-<pid>`, created on first use. Directories left behind by
/// earlier test processes that no longer exist are removed at that point.
pub fn work_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let tmp = std::env::temp_dir();
        if let Ok(rd) = std::fs::read_dir(&tmp) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if let Some(pid) = name.strip_prefix("lockstep-tests-") {
                    if let Ok(pid) = pid.parse::<u32>() {
                        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
                            let _ = std::fs::remove_dir_all(e.path());
                        }
                    }
                }
            }
        }
        let dir = tmp.join(format!("lockstep-tests-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("bin")).expect("create work dir");
        dir
    })
}

/// A fresh, empty directory under the work dir.
pub fn scratch_dir(tag: &str) -> PathBuf {
    let d = work_dir().join(format!("scratch-{}-{}", tag, next_id()));
    std::fs::create_dir_all(&d).expect("create scratch dir");
    d
}

fn next_id() -> u64 {
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::SeqCst)
}

/// A marker string unique to this test process and call.
pub fn unique_marker(tag: &str) -> String {
    format!("lsmark-{}-{}-{}", std::process::id(), next_id(), tag)
}

/// gcc flags for each C fixture (on top of `-O1 -Wall -Wextra -Werror`).
/// A static program with no libc: its syscalls are exactly the ones its source makes.
const FREESTANDING: &[&str] = &[
    "-static",
    "-nostdlib",
    "-ffreestanding",
    "-fno-stack-protector",
    "-fno-pie",
    "-no-pie",
];

pub fn fixture_flags(name: &str) -> &'static [&'static str] {
    match name {
        // freestanding + static: the syscall sequence is exactly execve, 20 writes, exit_group
        "flip_target" => FREESTANDING,
        "threads" | "lanes" | "sync_order" | "thread_churn" => &["-pthread"],
        // Static: a short, fixed list of intercepted syscalls (msync is stop 9).
        "shared_counter" => &["-static"],
        // Static: the main thread's write of "main\n" is its 9th intercepted stop.
        "leader_dies_mid_call" => &["-static", "-pthread"],
        "trace_user" | "io_copy" | "outcome" | "step_target" => FREESTANDING,
        _ => &[],
    }
}

/// Other sources a fixture is linked with: `trace_native` uses the real liblockstep code.
fn extra_sources(name: &str) -> Vec<PathBuf> {
    match name {
        "trace_native" => vec![repo_root().join("clib/lockstep_trace.c")],
        _ => Vec::new(),
    }
}

/// Path of the compiled fixture `tests/fixtures/<name>.c` (compiled on first use).
pub fn fixture(name: &str) -> PathBuf {
    static BUILT: OnceLock<Mutex<HashMap<String, PathBuf>>> = OnceLock::new();
    let mut built = BUILT
        .get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(p) = built.get(name) {
        return p.clone();
    }
    let src = fixtures_dir().join(format!("{name}.c"));
    assert!(src.exists(), "fixture source {} missing", src.display());
    let out = work_dir().join("bin").join(name);
    let res = Command::new("gcc")
        .args(["-O1", "-Wall", "-Wextra", "-Werror"])
        .args(fixture_flags(name))
        .arg("-o")
        .arg(&out)
        .arg(&src)
        .args(extra_sources(name))
        .output()
        .expect("cannot run gcc");
    assert!(
        res.status.success(),
        "compiling {} failed:\n{}",
        src.display(),
        String::from_utf8_lossy(&res.stderr)
    );
    built.insert(name.to_string(), out.clone());
    out
}

/// Path of a non-C fixture file, e.g. `py_workload.py`.
pub fn fixture_file(name: &str) -> PathBuf {
    let p = fixtures_dir().join(name);
    assert!(p.exists(), "fixture {} missing", p.display());
    p
}

/// The real python3 executable (not a pyenv/asdf shim script), so that the replicas
/// run the interpreter directly.
pub fn python3() -> PathBuf {
    static PY: OnceLock<PathBuf> = OnceLock::new();
    PY.get_or_init(|| {
        let out = Command::new("python3")
            .args(["-c", "import sys; print(sys.executable)"])
            .output()
            .expect("python3 is required for these tests");
        assert!(out.status.success(), "python3 does not work");
        let p = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        assert!(p.is_absolute() && p.exists(), "odd sys.executable {p:?}");
        p
    })
    .clone()
}

/// A deterministic pseudo-random file of `size` bytes, cached per size.
pub fn random_file(size: usize) -> PathBuf {
    static FILES: OnceLock<Mutex<HashMap<usize, PathBuf>>> = OnceLock::new();
    let mut files = FILES
        .get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(p) = files.get(&size) {
        return p.clone();
    }
    let p = work_dir().join(format!("random-{size}.bin"));
    let mut data = vec![0u8; size];
    lockstep_core::rng::Rng::new(0x2545_f491_4f6c_dd1d ^ size as u64).fill(&mut data);
    std::fs::write(&p, &data).expect("write random file");
    files.insert(size, p.clone());
    p
}

// ---------------------------------------------------------------------------------
// Commands
// ---------------------------------------------------------------------------------

/// `Command` for the lockstep binary under test (no arguments yet).
pub fn lockstep() -> Command {
    Command::new(env!("CARGO_BIN_EXE_lockstep"))
}

/// `lockstep run OPTS... -- PROG...`
pub fn lockstep_run<S: AsRef<OsStr>>(opts: &[&str], prog: &[S]) -> Command {
    let mut c = lockstep();
    c.arg("run").args(opts).arg("--").args(prog);
    c
}

/// A plain command (for native reference runs).
pub fn native_cmd<S: AsRef<OsStr>>(prog: &[S]) -> Command {
    let mut c = Command::new(&prog[0]);
    c.args(&prog[1..]);
    c
}

// ---------------------------------------------------------------------------------
// Running with a hard timeout
// ---------------------------------------------------------------------------------

/// The result of a finished run.
pub struct Output {
    pub what: String,
    pub marker: String,
    pub status: ExitStatus,
    pub stdout: Vec<u8>,
    pub stderr: String,
    pub elapsed: Duration,
}

impl Output {
    /// Exit code, or 128+N if killed by signal N (what a shell would report).
    pub fn code(&self) -> i32 {
        match (self.status.code(), self.status.signal()) {
            (Some(c), _) => c,
            (None, Some(s)) => 128 + s,
            _ => -1,
        }
    }
    pub fn stdout_str(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
    /// A description for assertion messages.
    pub fn context(&self) -> String {
        format!(
            "command: {}\nstatus: {:?} (code {})\nelapsed: {:?}\n--- stdout ({} bytes) ---\n{}\n--- stderr ---\n{}",
            self.what,
            self.status,
            self.code(),
            self.elapsed,
            self.stdout.len(),
            clip(&self.stdout_str(), 4000),
            clip(&self.stderr, 6000)
        )
    }
    /// Asserts the exit status (the program's own, or 128+N for a signal).
    #[track_caller]
    pub fn assert_code(&self, code: i32) -> &Self {
        assert_eq!(self.code(), code, "unexpected exit status\n{}", self.context());
        self
    }
    #[track_caller]
    pub fn assert_stdout(&self, expected: &[u8]) -> &Self {
        if self.stdout != expected {
            panic!(
                "stdout differs from the expected (native) output\n--- expected ---\n{}\n{}",
                clip(&String::from_utf8_lossy(expected), 4000),
                self.context()
            );
        }
        self
    }
}

fn clip(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}\n…[{} more bytes]", &s[..end], s.len() - end)
}

fn spawn_reader<R: Read + Send + 'static>(mut r: R) -> Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = [0u8; 16384];
        loop {
            match r.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    if tx.send(buf[..n].to_vec()).is_err() {
                        break;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            }
        }
    });
    rx
}

/// A process started by the tests (lockstep or a native reference run).
pub struct Running {
    child: Child,
    pub pid: u32,
    pub marker: String,
    pub what: String,
    started: Instant,
    out_rx: Receiver<Vec<u8>>,
    err_rx: Receiver<Vec<u8>>,
    out_open: bool,
    err_open: bool,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    reaped: Option<ExitStatus>,
    /// Set once the run returned with survivors on purpose: dropping it leaves them.
    keep_survivors: bool,
}

/// Starts `cmd` in its own process group, stdin from /dev/null, stdout and stderr
/// captured, working directory = the work dir, with a fresh marker in its
/// environment.
pub fn spawn(mut cmd: Command) -> Running {
    let marker = unique_marker("run");
    let what = format!("{cmd:?}");
    cmd.env(MARKER_ENV, &marker)
        .current_dir(work_dir())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
    let out_rx = spawn_reader(child.stdout.take().unwrap());
    let err_rx = spawn_reader(child.stderr.take().unwrap());
    Running {
        pid: child.id(),
        child,
        marker,
        what,
        started: Instant::now(),
        out_rx,
        err_rx,
        out_open: true,
        err_open: true,
        stdout: Vec::new(),
        stderr: Vec::new(),
        reaped: None,
        keep_survivors: false,
    }
}

/// Appends to `buf` what `rx` holds now, without waiting; clears `open` once the sender is
/// gone. Returns whether anything arrived.
fn drain(rx: &Receiver<Vec<u8>>, open: &mut bool, buf: &mut Vec<u8>) -> bool {
    let mut got = false;
    while *open {
        match rx.try_recv() {
            Ok(b) => {
                buf.extend_from_slice(&b);
                got = true;
            }
            Err(mpsc::TryRecvError::Empty) => break,
            Err(mpsc::TryRecvError::Disconnected) => *open = false,
        }
    }
    got
}

impl Running {
    /// Moves whatever output arrived into `stdout`/`stderr`, waiting at most `wait`.
    fn pump(&mut self, wait: Duration) {
        let deadline = Instant::now() + wait;
        loop {
            let got_out = drain(&self.out_rx, &mut self.out_open, &mut self.stdout);
            let got_err = drain(&self.err_rx, &mut self.err_open, &mut self.stderr);
            if got_out || got_err || Instant::now() >= deadline || (!self.out_open && !self.err_open) {
                return;
            }
            // Block briefly on stdout (the interesting one).
            if self.out_open {
                match self.out_rx.recv_timeout(Duration::from_millis(10)) {
                    Ok(b) => self.stdout.extend_from_slice(&b),
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => self.out_open = false,
                }
            } else {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }

    pub fn stdout_str(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    fn partial_context(&self) -> String {
        format!(
            "command: {}\n--- stdout so far ---\n{}\n--- stderr so far ---\n{}",
            self.what,
            clip(&self.stdout_str(), 4000),
            clip(&String::from_utf8_lossy(&self.stderr), 6000)
        )
    }

    /// true while the process has not exited.
    pub fn is_running(&mut self) -> bool {
        if self.reaped.is_some() {
            return false;
        }
        match self.child.try_wait() {
            Ok(Some(st)) => {
                self.reaped = Some(st);
                false
            }
            Ok(None) => true,
            Err(e) => panic!("try_wait: {e}"),
        }
    }

    /// Waits until stdout contains `needle`; returns stdout so far. Fails the test
    /// (after killing everything) if it does not appear within `timeout` or the
    /// process exits first.
    #[track_caller]
    pub fn wait_for_stdout(&mut self, needle: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            self.pump(Duration::from_millis(20));
            let s = self.stdout_str();
            if s.contains(needle) {
                return s;
            }
            if !self.is_running() {
                self.pump(Duration::from_millis(200));
                let s = self.stdout_str();
                if s.contains(needle) {
                    return s;
                }
                let ctx = self.partial_context();
                self.kill_everything();
                panic!("process exited ({:?}) before printing {needle:?}\n{ctx}", self.reaped);
            }
            if Instant::now() >= deadline {
                let ctx = self.partial_context();
                self.kill_everything();
                panic!("{needle:?} did not appear on stdout within {timeout:?}\n{ctx}");
            }
        }
    }

    /// Sends signal `sig` to the process (not to its group).
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill takes any pid and signal; errors come back as -1.
        let r = unsafe { libc::kill(self.pid as libc::pid_t, sig) };
        assert_eq!(
            r,
            0,
            "kill({}, {sig}) failed: {}",
            self.pid,
            std::io::Error::last_os_error()
        );
    }

    /// Processes (other than this one itself) that carry this run's marker.
    pub fn marked_processes(&self) -> Vec<ProcInfo> {
        marked_processes(&self.marker)
            .into_iter()
            .filter(|p| p.pid != self.pid)
            .collect()
    }

    /// Waits until `pred` holds for the marked processes (other than lockstep
    /// itself); returns them. Fails the test on timeout.
    #[track_caller]
    pub fn wait_for_processes(
        &mut self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&[ProcInfo]) -> bool,
    ) -> Vec<ProcInfo> {
        let deadline = Instant::now() + timeout;
        loop {
            let procs = self.marked_processes();
            if pred(&procs) {
                return procs;
            }
            self.pump(Duration::from_millis(50));
            if !self.is_running() || Instant::now() >= deadline {
                let ctx = self.partial_context();
                let exited = self.reaped;
                self.kill_everything();
                panic!("never saw {what} (exited: {exited:?}); marked processes: {procs:#?}\n{ctx}");
            }
        }
    }

    /// Kills the process group, the process, and every process with our marker;
    /// reaps the child. Used on failure paths and on drop.
    pub fn kill_everything(&mut self) {
        // SAFETY: kill takes any pid and signal; a group already gone is fine.
        unsafe {
            libc::kill(-(self.pid as libc::pid_t), libc::SIGKILL);
        }
        if self.reaped.is_none() {
            let _ = self.child.kill();
            if let Ok(st) = self.child.wait() {
                self.reaped = Some(st);
            }
        }
        kill_marked(&self.marker);
    }

    /// Waits for the process to exit (at most `timeout`, else it is killed and the
    /// test fails), collects all its output, and checks that nothing it started is
    /// left behind.
    #[track_caller]
    pub fn finish(self, timeout: Duration) -> Output {
        self.finish_with_grace(timeout, PIPE_GRACE)
    }

    /// `finish` with a custom wait for the pipes to close after the process exited.
    #[track_caller]
    pub fn finish_with_grace(self, timeout: Duration, pipe_grace: Duration) -> Output {
        let out = self.finish_leaving_survivors(timeout, pipe_grace);
        if let Err(msg) = check_no_orphans(&out.marker, ORPHAN_GRACE) {
            panic!("{msg}\n{}", out.context());
        }
        out
    }

    /// Like `finish_with_grace`, for a run that leaves processes behind on purpose (a
    /// daemon that outlives the program's first process): the caller checks for them.
    pub fn finish_leaving_survivors(mut self, timeout: Duration, pipe_grace: Duration) -> Output {
        let deadline = self.started + timeout;
        while self.is_running() {
            if Instant::now() >= deadline {
                let ctx = self.partial_context();
                // What every thread was doing, for a hang seen once on a loaded machine.
                let state = lockstep_inject::hang::describe(self.pid as i32);
                self.kill_everything();
                panic!("timed out after {timeout:?}; killed it\n{ctx}\n--- threads at the deadline ---\n{state}");
            }
            self.pump(Duration::from_millis(20));
        }
        let status = self.reaped.unwrap();
        let elapsed = self.started.elapsed();
        let pipe_deadline = Instant::now() + pipe_grace;
        while self.out_open || self.err_open {
            if Instant::now() >= pipe_deadline {
                let procs = self.marked_processes();
                let ctx = self.partial_context();
                self.kill_everything();
                panic!(
                    "the process exited ({status:?}) but its stdout/stderr stayed open for {pipe_grace:?}: \
                     something it started is still alive. Marked processes: {procs:#?}\n{ctx}"
                );
            }
            self.pump(Duration::from_millis(50));
        }
        let out = Output {
            what: self.what.clone(),
            marker: self.marker.clone(),
            status,
            stdout: std::mem::take(&mut self.stdout),
            stderr: String::from_utf8_lossy(&self.stderr).into_owned(),
            elapsed,
        };
        self.reaped = Some(status);
        self.keep_survivors = true;
        out
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if self.reaped.is_none() || (!self.keep_survivors && !marked_processes(&self.marker).is_empty()) {
            self.kill_everything();
        }
    }
}

/// Runs `cmd` to completion with the default hard timeout.
#[track_caller]
pub fn run(cmd: Command) -> Output {
    spawn(cmd).finish(RUN_TIMEOUT)
}

/// Runs a native reference command, asserting exit 0; returns its stdout.
#[track_caller]
pub fn native_stdout<S: AsRef<OsStr>>(prog: &[S]) -> Vec<u8> {
    let out = run(native_cmd(prog));
    out.assert_code(0);
    assert!(!out.stdout.is_empty(), "native run printed nothing\n{}", out.context());
    out.stdout
}

// ---------------------------------------------------------------------------------
// Processes and orphans
// ---------------------------------------------------------------------------------

#[derive(Debug, Clone)]
pub struct ProcInfo {
    pub pid: u32,
    pub ppid: u32,
    pub state: char,
    pub cmdline: Vec<String>,
}

impl ProcInfo {
    /// Base name of argv[0].
    pub fn argv0(&self) -> String {
        self.cmdline
            .first()
            .map(|a| a.rsplit('/').next().unwrap_or(a).to_string())
            .unwrap_or_default()
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
}

/// All processes (except the test process itself) whose command line or
/// environment contains `marker`.
pub fn marked_processes(marker: &str) -> Vec<ProcInfo> {
    let me = std::process::id();
    let mut found = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return found;
    };
    for e in rd.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if pid == me {
            continue;
        }
        let dir = e.path();
        let cmdline = std::fs::read(dir.join("cmdline")).unwrap_or_default();
        let environ = std::fs::read(dir.join("environ")).unwrap_or_default();
        if !contains(&cmdline, marker.as_bytes()) && !contains(&environ, marker.as_bytes()) {
            continue;
        }
        let stat = std::fs::read_to_string(dir.join("stat")).unwrap_or_default();
        // "pid (comm) S ppid ..." - comm may contain spaces and parentheses.
        let after = stat.rfind(')').map(|i| &stat[i + 1..]).unwrap_or("");
        let mut f = after.split_whitespace();
        let state = f.next().and_then(|s| s.chars().next()).unwrap_or('?');
        let ppid = f.next().and_then(|s| s.parse().ok()).unwrap_or(0);
        if state == 'Z' || state == 'X' {
            continue; // exited, only waiting to be reaped
        }
        let cmdline = cmdline
            .split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        found.push(ProcInfo {
            pid,
            ppid,
            state,
            cmdline,
        });
    }
    found
}

fn kill_marked(marker: &str) {
    for p in marked_processes(marker) {
        // SAFETY: kill takes any pid and signal; a process already gone is fine.
        unsafe {
            libc::kill(p.pid as libc::pid_t, libc::SIGKILL);
        }
    }
}

fn check_no_orphans(marker: &str, grace: Duration) -> Result<(), String> {
    let deadline = Instant::now() + grace;
    loop {
        let procs = marked_processes(marker);
        if procs.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            kill_marked(marker); // clean up what we started, then fail
            return Err(format!(
                "processes left behind (marker {marker}) after {grace:?}: {procs:#?}"
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Asserts that, within 5 s, no process carries `marker` in its command line or
/// environment. Leftovers are killed (by pid) before the test fails.
#[track_caller]
pub fn no_orphans(marker: &str) {
    if let Err(msg) = check_no_orphans(marker, ORPHAN_GRACE) {
        panic!("{msg}");
    }
}

// ---------------------------------------------------------------------------------
// Events
// ---------------------------------------------------------------------------------

/// A fresh path for an events file.
pub fn events_path(tag: &str) -> PathBuf {
    work_dir().join(format!("events-{}-{}.jsonl", tag, next_id()))
}

/// Parses an events file: one JSON object per non-empty line. Fails the test if
/// the file is missing or any line is not a JSON object.
#[track_caller]
pub fn read_events(path: &Path) -> Vec<Value> {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read events file {}: {e}", path.display()));
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, l)| {
            let v: Value =
                serde_json::from_str(l).unwrap_or_else(|e| panic!("events line {} is not JSON ({e}): {l}", i + 1));
            assert!(v.is_object(), "events line {} is not a JSON object: {l}", i + 1);
            v
        })
        .collect()
}

/// `read_events`, but failures also show the run's output (exit status, stderr).
#[track_caller]
pub fn read_events_of(path: &Path, out: &Output) -> Vec<Value> {
    match std::panic::catch_unwind(|| read_events(path)) {
        Ok(v) => v,
        Err(e) => {
            let msg = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            panic!("{msg}\n{}", out.context())
        }
    }
}

/// Reads the events file if it exists and parses the complete lines (for polling
/// while lockstep is still running).
pub fn read_events_partial(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}

pub fn events_of<'a>(events: &'a [Value], kind: &str) -> Vec<&'a Value> {
    events.iter().filter(|e| e["kind"] == kind).collect()
}

pub fn has_event(events: &[Value], kind: &str, action: Option<&str>) -> bool {
    events.iter().any(|e| {
        e["kind"] == kind
            && match action {
                None => true,
                Some(a) => e["action"] == a,
            }
    })
}

/// One line per event, for assertion messages.
pub fn events_summary(events: &[Value]) -> String {
    events
        .iter()
        .map(|e| {
            format!(
                "  {} action={} replica={} object={} msg={}",
                e["kind"], e["action"], e["replica"], e["object"], e["message"]
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[track_caller]
pub fn assert_event(events: &[Value], kind: &str, action: Option<&str>, out: &Output) {
    assert!(
        has_event(events, kind, action),
        "expected an event kind={kind:?} action={action:?}; events:\n{}\n{}",
        events_summary(events),
        out.context()
    );
}

#[track_caller]
pub fn assert_no_event(events: &[Value], kind: &str, out: &Output) {
    assert!(
        !has_event(events, kind, None),
        "expected no {kind:?} event; events:\n{}\n{}",
        events_summary(events),
        out.context()
    );
}

/// Asserts that replicas agreed throughout: no divergence, vote-kill, halt or
/// timeout events.
#[track_caller]
pub fn assert_agreed(events: &[Value], out: &Output) {
    for kind in ["divergence", "halt", "timeout", "reintegrate"] {
        assert_no_event(events, kind, out);
    }
    assert!(
        !has_event(events, "vote", Some("kill")),
        "a replica was voted out although all should agree; events:\n{}\n{}",
        events_summary(events),
        out.context()
    );
}

/// Checks the documented event schema of one event.
#[track_caller]
pub fn check_event_schema(e: &Value) {
    let obj = e.as_object().expect("event is an object");
    let ts = obj
        .get("ts")
        .and_then(Value::as_f64)
        .unwrap_or_else(|| panic!("ts missing or not a number: {e}"));
    assert!(ts > 1.0e9, "ts {ts} is not seconds since the epoch: {e}");
    assert_eq!(
        obj.get("component").and_then(Value::as_str),
        Some("run"),
        "component: {e}"
    );
    for key in ["kind", "action", "message"] {
        let s = obj
            .get(key)
            .and_then(Value::as_str)
            .unwrap_or_else(|| panic!("{key} missing or not a string: {e}"));
        if key != "message" {
            assert!(!s.is_empty(), "{key} is empty: {e}");
        }
    }
    if let Some(r) = obj.get("replica") {
        assert!(r.as_u64().is_some(), "replica is not a non-negative integer: {e}");
    }
    if let Some(o) = obj.get("object") {
        assert!(o.is_string(), "object is not a string: {e}");
    }
    if let Some(v) = obj.get("values") {
        let arr = v.as_array().unwrap_or_else(|| panic!("values is not an array: {e}"));
        assert!(arr.iter().all(Value::is_string), "values are not all strings: {e}");
    }
    if let Some(d) = obj.get("duration_us") {
        assert!(d.as_u64().is_some(), "duration_us is not a non-negative integer: {e}");
    }
}

// ---------------------------------------------------------------------------------
// Output checks
// ---------------------------------------------------------------------------------

/// Asserts that `out.stdout` is a proper prefix of `native`, ending at a line
/// boundary (the divergent output and everything after it never appeared), and
/// that the number of complete lines is within `lines`.
#[track_caller]
pub fn assert_line_prefix(out: &Output, native: &[u8], lines: std::ops::RangeInclusive<usize>) {
    let got = &out.stdout;
    assert!(
        got.len() < native.len() && native.starts_with(got),
        "stdout is not a proper prefix of the native output\n--- native ---\n{}\n{}",
        String::from_utf8_lossy(native),
        out.context()
    );
    assert!(
        got.is_empty() || got.ends_with(b"\n"),
        "stdout ends in the middle of a line\n{}",
        out.context()
    );
    let n = got.iter().filter(|b| **b == b'\n').count();
    assert!(
        lines.contains(&n),
        "expected {lines:?} complete lines before the stop, got {n}\n{}",
        out.context()
    );
}

/// `line` with bit `bit` of its first byte flipped: what a `mem:rsi+0:<bit>` flip at
/// that line's write(2) turns it into.
pub fn flip_first_byte(line: &str, bit: u8) -> Vec<u8> {
    let mut b = line.as_bytes().to_vec();
    b[0] ^= 1 << bit;
    b
}

/// Asserts that no corrupted version (first byte, bit `bit` flipped) of any native
/// line appears anywhere in stdout.
#[track_caller]
pub fn assert_no_corrupted_line(out: &Output, native: &str, bit: u8) {
    for line in native.split_inclusive('\n') {
        let bad = flip_first_byte(line, bit);
        assert!(
            !contains(&out.stdout, &bad),
            "the corrupted line {:?} reached stdout\n{}",
            String::from_utf8_lossy(&bad),
            out.context()
        );
    }
}

/// Native output of flip_target (cached).
pub fn flip_target_native() -> Vec<u8> {
    static OUT: OnceLock<Vec<u8>> = OnceLock::new();
    OUT.get_or_init(|| {
        let out = native_stdout(&[fixture("flip_target")]);
        check_flip_target_output(&String::from_utf8_lossy(&out));
        out
    })
    .clone()
}

/// flip_target prints exactly FLIP_LINES lines "step <i> value <v>".
#[track_caller]
pub fn check_flip_target_output(s: &str) {
    let lines: Vec<&str> = s.lines().collect();
    assert_eq!(lines.len(), FLIP_LINES, "flip_target output:\n{s}");
    for (i, l) in lines.iter().enumerate() {
        let f: Vec<&str> = l.split(' ').collect();
        assert!(
            f.len() == 4
                && f[0] == "step"
                && f[1] == (i + 1).to_string()
                && f[2] == "value"
                && f[3].parse::<u64>().is_ok(),
            "bad flip_target line {l:?}"
        );
    }
}

/// Seconds since the epoch, as f64.
pub fn now_f64() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs_f64()
}

/// Validates rdtsc_clock output. `t0`/`t1`: the test's own clock (epoch seconds)
/// before and after the run; realtime values must lie within a few seconds of that.
#[track_caller]
pub fn check_rdtsc_output(s: &str, t0: f64, t1: f64) {
    const MIX_PRIME: u64 = 0x100000001b3;
    let mut mix: u64 = 0;
    let mut mix_in = |x: u64| mix = (mix ^ x).wrapping_mul(MIX_PRIME);
    let mut tscs: Vec<u64> = Vec::new();
    let mut first_tsc: Option<u64> = None;
    let mut realtimes: Vec<(u64, u64)> = Vec::new();
    let mut monos: Vec<(u64, u64)> = Vec::new();
    let (mut delta, mut mono_delta, mut printed_mix, mut done) = (None, None, None, false);
    let num = |x: &str| -> u64 { x.parse().unwrap_or_else(|_| panic!("not a number {x:?} in:\n{s}")) };
    for line in s.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        match f[0] {
            "tsc" => {
                assert_eq!(f.len(), 2, "bad line {line:?}");
                let t = num(f[1]);
                first_tsc.get_or_insert(t);
                mix_in(t);
                tscs.push(t);
            }
            "tscp" if f.get(1) == Some(&"unsupported") => {}
            "tscp" => {
                assert_eq!(f.len(), 3, "bad line {line:?}");
                let t = num(f[1]);
                num(f[2]);
                mix_in(t);
                tscs.push(t);
            }
            "realtime" | "monotonic" => {
                assert_eq!(f.len(), 3, "bad line {line:?}");
                let (sec, nsec) = (num(f[1]), num(f[2]));
                assert!(nsec < 1_000_000_000, "nsec out of range: {line:?}");
                mix_in(sec);
                mix_in(nsec);
                if f[0] == "realtime" {
                    realtimes.push((sec, nsec))
                } else {
                    monos.push((sec, nsec))
                }
            }
            "tsc-delta" => delta = Some(num(f[1])),
            "mono-delta-ns" => mono_delta = Some(num(f[1])),
            "mix" => printed_mix = Some(num(f[1])),
            "done" => done = true,
            _ => panic!("unexpected line {line:?} in rdtsc_clock output:\n{s}"),
        }
    }
    assert!(done, "rdtsc_clock output incomplete:\n{s}");
    assert!(
        tscs.len() >= 5 && realtimes.len() >= 5 && monos.len() >= 5,
        "too few readings:\n{s}"
    );
    assert!(tscs.windows(2).all(|w| w[0] <= w[1]), "TSC readings decrease:\n{s}");
    assert!(tscs[0] > 0, "TSC is zero:\n{s}");
    assert_eq!(
        delta,
        Some(tscs.last().unwrap() - first_tsc.unwrap()),
        "tsc-delta inconsistent:\n{s}"
    );
    let ns = |(a, b): (u64, u64)| a as u128 * 1_000_000_000 + b as u128;
    assert!(
        monos.windows(2).all(|w| ns(w[0]) <= ns(w[1])),
        "CLOCK_MONOTONIC decreases:\n{s}"
    );
    assert!(
        realtimes.windows(2).all(|w| ns(w[0]) <= ns(w[1])),
        "CLOCK_REALTIME decreases:\n{s}"
    );
    assert_eq!(
        mono_delta.map(|d| d as u128),
        Some(ns(*monos.last().unwrap()) - ns(monos[0])),
        "mono-delta-ns inconsistent:\n{s}"
    );
    for &(sec, nsec) in &realtimes {
        let t = sec as f64 + nsec as f64 * 1e-9;
        assert!(
            t >= t0 - 5.0 && t <= t1 + 5.0,
            "CLOCK_REALTIME {t} not within 5 s of [{t0}, {t1}]:\n{s}"
        );
    }
    assert_eq!(printed_mix, Some(mix), "mix does not match the printed values:\n{s}");
}

/// The first `words` words of each line: the shape of an output whose values vary
/// (1 for rdtsc_clock, 2 for py_workload's "det KEY" / "nondet KEY").
pub fn line_shapes(s: &str, words: usize) -> Vec<String> {
    s.lines()
        .map(|l| l.split(' ').take(words).collect::<Vec<_>>().join(" "))
        .collect()
}

/// The deterministic lines ("det ...") of py_workload output.
pub fn py_det_lines(s: &str) -> Vec<String> {
    s.lines()
        .filter(|l| l.starts_with("det "))
        .map(str::to_string)
        .collect()
}

/// Checks the nondeterministic lines of py_workload output for well-formedness.
#[track_caller]
pub fn check_py_nondet(s: &str, t0: f64, t1: f64) {
    let mut seen = Vec::new();
    for l in s.lines().filter(|l| l.starts_with("nondet ")) {
        let f: Vec<&str> = l.split(' ').collect();
        let fl = |x: &str| -> f64 { x.parse().unwrap_or_else(|_| panic!("not a float in {l:?}")) };
        match f[1] {
            "time" => {
                let t = fl(f[2]);
                assert!(t >= t0 - 5.0 && t <= t1 + 5.0, "time.time() {t} not near [{t0}, {t1}]");
            }
            "random" => {
                let r = fl(f[2]);
                assert!((0.0..1.0).contains(&r), "random() out of range: {l}");
            }
            "urandom" => assert!(
                f[2].len() == 32 && f[2].chars().all(|c| c.is_ascii_hexdigit()),
                "bad urandom line {l}"
            ),
            "monotonic" => {
                let (a, b) = (fl(f[2]), fl(f[3]));
                assert!(a > 0.0 && b >= a, "monotonic not monotonic: {l}");
            }
            "elapsed" => assert!(fl(f[2]) >= 0.0, "negative elapsed: {l}"),
            other => panic!("unexpected nondet line kind {other:?}: {l}"),
        }
        seen.push(f[1].to_string());
    }
    for k in ["time", "random", "urandom", "monotonic", "elapsed"] {
        assert!(seen.iter().any(|x| x == k), "no nondet {k} line in:\n{s}");
    }
}

/// Whether something accepts connections on 127.0.0.1:`port` within `within` (it is
/// tried every 50 ms).
pub fn port_listens_within(port: u16, within: Duration) -> bool {
    let deadline = std::time::Instant::now() + within;
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    true
}

/// Talks to echo_server on `port`: sends `lines` (some in a single write), checks
/// every echo, then closes. Returns the number of lines echoed.
#[track_caller]
pub fn echo_client(port: u16, lines: &[&str]) -> usize {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut stream = None;
    for _ in 0..100 {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(5)) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
    let stream = stream.unwrap_or_else(|| panic!("cannot connect to 127.0.0.1:{port}"));
    stream.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut w = stream.try_clone().unwrap();
    let mut r = BufReader::new(stream);
    // first line alone, round trip
    let mut reply = String::new();
    w.write_all(format!("{}\n", lines[0]).as_bytes()).unwrap();
    r.read_line(&mut reply).expect("reading the first echo");
    assert_eq!(reply, format!("echo: {}\n", lines[0]));
    // the rest in one go
    let rest: String = lines[1..].iter().map(|l| format!("{l}\n")).collect();
    w.write_all(rest.as_bytes()).unwrap();
    for l in &lines[1..] {
        reply.clear();
        r.read_line(&mut reply).expect("reading an echo");
        assert_eq!(reply, format!("echo: {l}\n"));
    }
    w.shutdown(std::net::Shutdown::Write).unwrap();
    reply.clear();
    let n = r.read_line(&mut reply).expect("waiting for the server to close");
    assert_eq!(n, 0, "unexpected data after the echoes: {reply:?}");
    lines.len()
}

/// Parses "PORT <n>" from echo_server's first line.
#[track_caller]
pub fn parse_port(stdout: &str) -> u16 {
    let line = stdout
        .lines()
        .find(|l| l.starts_with("PORT "))
        .unwrap_or_else(|| panic!("no PORT line in {stdout:?}"));
    line[5..]
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("bad PORT line {line:?}"))
}

/// `lockstep inject --out OUT EXTRA... -- PROG...`.
pub fn inject_cmd(out: &std::path::Path, extra: &[&str], prog: &[String]) -> std::process::Command {
    let mut c = lockstep();
    c.arg("inject").arg("--out").arg(out).args(extra).arg("--").args(prog);
    c
}

/// The records of the campaign in `out` (its results.jsonl), as JSON.
pub fn campaign_records(out: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(out.join("results.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// (class, count) pairs of a campaign's summary.json.
pub fn summary_counts(out: &std::path::Path) -> Vec<(String, u64)> {
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    s["classes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["class"].as_str().unwrap().to_string(), c["count"].as_u64().unwrap()))
        .collect()
}

/// The number after `key` in `--stats`.
pub fn stat(out: &Output, key: &str) -> Option<u64> {
    stat_in(&out.stderr, key)
}

pub fn stat_in(stderr: &str, key: &str) -> Option<u64> {
    stderr
        .lines()
        .find_map(|l| l.trim().strip_prefix(key))
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
        .or_else(|| {
            // A count inside a line: "..., N refused: ...".
            let line = stderr.lines().find(|l| l.contains(key))?;
            line[..line.find(key)?].split_whitespace().last()?.parse().ok()
        })
}

pub fn stat_or_panic(out: &Output, key: &str) -> u64 {
    stat(out, key).unwrap_or_else(|| panic!("no '{key}' in the stats\n{}", out.context()))
}

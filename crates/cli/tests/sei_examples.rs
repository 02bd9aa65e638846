//! The example key-value servers of sei/examples, hardened with `lockstep cc` and built
//! natively (-DSEI_NATIVE), served over real sockets to real clients: the CRC-checking
//! kv_client.py, pymemcache and the libmemcached tools (Debian packages, installed by
//! scripts/deps.sh).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn examples() -> PathBuf {
    repo().join("sei/examples")
}

fn work_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("lockstep-sei-examples-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    })
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Build {
    Hardened,
    Native,
}

/// Builds kv_single or kv_threads, once per variant and test process.
fn server_binary(name: &str, build: Build) -> PathBuf {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let out = work_dir().join(format!("{name}-{build:?}"));
    if out.exists() {
        return out;
    }
    let dir = examples();
    let sources = [
        dir.join(format!("{name}.c")),
        dir.join("kv_net.c"),
        dir.join("kv_store.c"),
    ];
    let mut cmd = match build {
        Build::Hardened => {
            let mut c = Command::new(env!("CARGO_BIN_EXE_lockstep"));
            c.arg("cc").env("LOCKSTEP_SEI_DIR", work_dir().join("sei"));
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
        .args(&sources)
        .arg("-o")
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        result.status.success(),
        "building {name} {build:?}: {}",
        String::from_utf8_lossy(&result.stderr)
    );
    out
}

fn free_port() -> u16 {
    TcpListener::bind(("127.0.0.1", 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A running server, killed on drop.
struct Server {
    child: Child,
    port: u16,
}

impl Server {
    fn start(name: &str, build: Build, args: &[&str], env: &[(&str, &str)]) -> Server {
        let port = free_port();
        let child = Command::new(server_binary(name, build))
            .arg("--port")
            .arg(port.to_string())
            .args(args)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "{name} did not open port {port}");
            std::thread::sleep(Duration::from_millis(10));
        }
        Server { child, port }
    }

    /// Stops the server and returns its stderr and exit status (None: killed by us).
    fn stop(mut self) -> (String, Option<i32>) {
        let status = match self.child.try_wait().unwrap() {
            Some(s) => s.code(),
            None => {
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
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs a command to completion (60 s at most), collecting its output as it comes.
fn run(cmd: &mut Command) -> Output {
    let child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(child.wait_with_output()));
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
            panic!("{cmd:?} did not finish in 60 s");
        }
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn kv_client(port: u16, args: &[&str]) -> Output {
    run(Command::new("python3")
        .arg(examples().join("kv_client.py"))
        .arg("--port")
        .arg(port.to_string())
        .args(args))
}

const VARIANTS: [(&str, Build, &[&str]); 5] = [
    ("kv_single", Build::Hardened, &[]),
    ("kv_single", Build::Native, &[]),
    ("kv_threads", Build::Hardened, &["--threads", "2"]),
    ("kv_threads", Build::Native, &["--threads", "2"]),
    ("kv_threads", Build::Hardened, &["--threads", "1"]),
];

#[test]
fn every_server_variant_passes_the_functional_check_with_and_without_crcs() {
    for (name, build, args) in VARIANTS {
        for mode in [None, Some("dup")] {
            if build == Build::Native && mode.is_some() {
                continue;
            }
            let env: Vec<(&str, &str)> = mode.map(|m| vec![("SEI_MODE", m)]).unwrap_or_default();
            let plain = Server::start(name, build, args, &env);
            let out = kv_client(plain.port, &["check"]);
            assert_eq!(
                out.status.code(),
                Some(0),
                "{name} {build:?} {mode:?}: {}",
                text(&out.stderr)
            );
            assert!(text(&out.stdout).starts_with("ok: 614 checks"));
            let crc_args: Vec<&str> = args.iter().copied().chain(["--crc"]).collect();
            let checked = Server::start(name, build, &crc_args, &env);
            let out = kv_client(checked.port, &["--crc", "check"]);
            assert_eq!(
                out.status.code(),
                Some(0),
                "{name} {build:?} {mode:?} --crc: {}",
                text(&out.stderr)
            );
            let (_, status) = plain.stop();
            assert_eq!(status, None, "{name} {build:?} {mode:?} exited on its own");
        }
    }
}

#[test]
fn hardened_and_native_servers_give_identical_replies_to_a_trace() {
    let trace = work_dir().join("trace.txt");
    let gen = kv_client(0, &["gen-trace", "400", "7"]);
    std::fs::write(&trace, &gen.stdout).unwrap();
    let mut replies = Vec::new();
    for (name, build, args) in VARIANTS {
        let crc_args: Vec<&str> = args.iter().copied().chain(["--crc"]).collect();
        let server = Server::start(name, build, &crc_args, &[]);
        let out = kv_client(server.port, &["--crc", "trace", trace.to_str().unwrap()]);
        assert_eq!(out.status.code(), Some(0), "{name} {build:?}: {}", text(&out.stderr));
        replies.push(out.stdout);
    }
    assert!(replies[0].len() > 10_000);
    assert!(
        replies.iter().all(|r| *r == replies[0]),
        "replies differ between variants"
    );
}

#[test]
fn pymemcache_works_against_the_hardened_servers() {
    let script = r#"
import sys
from pymemcache.client.base import Client
c = Client(("127.0.0.1", int(sys.argv[1])))
c.set("a", b"hello", noreply=False)
c.set("b", b"x" * 1000, noreply=False)
assert c.get("a") == b"hello" and len(c.get("b")) == 1000
assert sorted(c.get_many(["a", "b", "zz"]).keys()) == ["a", "b"]
assert c.delete("a", noreply=False) and not c.delete("a", noreply=False) and c.get("a") is None
for i in range(200):
    c.set("k%d" % i, str(i).encode() * 10, noreply=(i % 2 == 0))
assert all(c.get("k%d" % i) == str(i).encode() * 10 for i in range(200))
print("pymemcache ok")
"#;
    for (name, build, args) in VARIANTS {
        let server = Server::start(name, build, args, &[]);
        // Debian's pymemcache is installed for the system interpreter
        let out = run(Command::new("/usr/bin/python3")
            .arg("-c")
            .arg(script)
            .arg(server.port.to_string()));
        assert_eq!(out.status.code(), Some(0), "{name} {build:?}: {}", text(&out.stderr));
        assert!(text(&out.stdout).contains("pymemcache ok"));
    }
}

#[test]
fn libmemcached_tools_copy_read_and_remove_through_the_hardened_server() {
    let server = Server::start("kv_threads", Build::Hardened, &["--threads", "2"], &[]);
    let servers = format!("--servers=127.0.0.1:{}", server.port);
    let file = work_dir().join("payload.txt");
    std::fs::write(&file, "a value copied by memccp\n").unwrap();
    let cp = run(Command::new("memccp").arg(&servers).arg(&file));
    assert_eq!(cp.status.code(), Some(0), "{}", text(&cp.stderr));
    let cat = run(Command::new("memccat").arg(&servers).arg("payload.txt"));
    assert!(
        text(&cat.stdout).starts_with("a value copied by memccp\n"),
        "{}",
        text(&cat.stdout)
    );
    let rm = run(Command::new("memcrm").arg(&servers).arg("payload.txt"));
    assert_eq!(rm.status.code(), Some(0), "{}", text(&rm.stderr));
    let gone = run(Command::new("memccat").arg(&servers).arg("payload.txt"));
    assert_ne!(gone.status.code(), Some(0));
}

#[test]
fn a_reply_corrupted_after_validation_is_rejected_by_the_client() {
    let trace = work_dir().join("trace-corrupt.txt");
    std::fs::write(&trace, kv_client(0, &["gen-trace", "50", "3"]).stdout).unwrap();
    for build in [Build::Hardened, Build::Native] {
        let server = Server::start("kv_single", build, &["--crc"], &[("KV_TEST_CORRUPT_REPLY", "7")]);
        let out = kv_client(server.port, &["--crc", "trace", trace.to_str().unwrap()]);
        assert_eq!(out.status.code(), Some(86), "{build:?}: {}", text(&out.stderr));
        assert!(text(&out.stderr).contains("rejected a reply"), "{}", text(&out.stderr));
        assert!(text(&out.stdout).matches("\r\n").count() >= 6);
    }
}

#[test]
fn a_request_corrupted_on_arrival_is_discarded_and_sent_again() {
    let trace = work_dir().join("trace-resend.txt");
    std::fs::write(&trace, kv_client(0, &["gen-trace", "50", "5"]).stdout).unwrap();
    let golden = {
        let server = Server::start("kv_single", Build::Hardened, &["--crc"], &[]);
        kv_client(server.port, &["--crc", "trace", trace.to_str().unwrap()])
    };
    assert_eq!(golden.status.code(), Some(0), "{}", text(&golden.stderr));
    let server = Server::start(
        "kv_single",
        Build::Hardened,
        &["--crc"],
        &[("KV_TEST_CORRUPT_REQUEST", "9")],
    );
    let out = kv_client(server.port, &["--crc", "trace", trace.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(
        out.stdout, golden.stdout,
        "the resent request must give the same replies"
    );
}

/// Raw protocol exchanges: sends `request`, reads until `until` appears or EOF.
fn exchange(port: u16, request: &[u8], until: &str) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(request).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !text(&got).contains(until) {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    text(&got)
}

#[test]
fn corrupt_requests_are_discarded_and_bad_input_gets_clear_errors() {
    let server = Server::start("kv_single", Build::Hardened, &["--crc"], &[]);
    let crc = |b: &[u8]| lockstep_core::crc32c(b);
    let set = b"set k 0 0 2\r\nhi\r\n";
    // the request's CRC is off by one bit: discarded, the state is unchanged
    let bad = [set.as_slice(), format!("#crc {:08x}\r\n", crc(set) ^ 1).as_bytes()].concat();
    assert_eq!(exchange(server.port, &bad, "\r\n"), "CLIENT_ERROR crc mismatch\r\n");
    let get = b"get k\r\n";
    let get_req = [get.as_slice(), format!("#crc {:08x}\r\n", crc(get)).as_bytes()].concat();
    let reply = exchange(server.port, &get_req, "#crc");
    assert!(reply.starts_with("END\r\n#crc "), "{reply}");
    // a request without its CRC line closes the connection with an error
    let missing = exchange(server.port, b"get k\r\nget k\r\nget k\r\nget k\r\n", "\r\n");
    assert_eq!(missing, "CLIENT_ERROR expected a #crc line\r\n");
    let (stderr, status) = server.stop();
    assert_eq!(status, None, "the server died: {stderr}");

    let plain = Server::start("kv_single", Build::Hardened, &[], &[]);
    assert_eq!(exchange(plain.port, b"bogus\r\n", "\r\n"), "ERROR\r\n");
    let long = [vec![b'g'; 5000], b"\r\n".to_vec()].concat();
    assert_eq!(
        exchange(plain.port, &long, "\r\n"),
        "SERVER_ERROR request too large\r\n"
    );
    assert_eq!(
        exchange(plain.port, b"set k 0 0 999999\r\n", "\r\n"),
        "SERVER_ERROR request too large\r\n"
    );
    assert_eq!(exchange(plain.port, b"get k\r\n", "END\r\n"), "END\r\n");
    let (stderr, status) = plain.stop();
    assert_eq!(status, None, "the server died: {stderr}");
}

#[test]
fn a_bad_server_argument_is_a_usage_error() {
    for (name, args) in [
        ("kv_single", vec!["--port", "0"]),
        ("kv_threads", vec!["--threads", "x"]),
        ("kv_single", vec!["--bogus"]),
    ] {
        let out = run(Command::new(server_binary(name, Build::Hardened)).args(&args));
        assert_eq!(out.status.code(), Some(2), "{name} {args:?}");
        assert!(text(&out.stderr).contains("usage:"));
    }
}

/// Two workers under a concurrent load (memcaslap, 8 connections, sets and gets): a data
/// race in the example (an item counter shared across stripes) once made E1 and E2
/// disagree here, and dup mode's shadow once filled up. The server must survive both
/// memory modes and answer every request.
#[test]
fn the_threaded_server_survives_a_concurrent_load_in_both_modes() {
    for mode in ["ecc", "dup"] {
        for size in ["8", "1024"] {
            let server = Server::start(
                "kv_threads",
                Build::Hardened,
                &["--threads", "2"],
                &[("SEI_MODE", mode)],
            );
            let servers = format!("--servers=127.0.0.1:{}", server.port);
            let out =
                run(Command::new("memcaslap").args([servers.as_str(), "-T", "2", "-c", "8", "-t", "2s", "-X", size]));
            let report = text(&out.stdout);
            let total = report
                .lines()
                .rfind(|l| l.starts_with("Run time:"))
                .unwrap_or_default()
                .to_string();
            let ops: u64 = total
                .split("Ops:")
                .nth(1)
                .and_then(|t| t.split_whitespace().next())
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
            let (stderr, status) = server.stop();
            assert_eq!(status, None, "{mode} {size} B: the server exited: {stderr}");
            assert!(!stderr.contains("sei:"), "{mode} {size} B: {stderr}");
            assert!(ops > 1000, "{mode} {size} B: only {ops} operations: {report}");
        }
    }
}

//! The example key-value servers of sei/examples, hardened with `lockstep cc` and built
//! natively (-DSEI_NATIVE), served over real sockets to real clients: the CRC-checking
//! kv_client.py and sei/client's kv_cli, pymemcache and the libmemcached tools (Debian
//! packages, installed by scripts/deps.sh). The wire format the CRC tests pin down is
//! docs/sei.md's "Wire format and end-to-end CRCs".

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

mod sei_server;
use sei_server::{compile, repo, Build, Server};

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
        dir.join("wire.c"),
    ];
    compile(&sources, build, work_dir(), &out);
    out
}

/// Starts example server `name` with `args` and `env` on a port of its own.
fn start_server(name: &str, build: Build, args: &[&str], env: &[(&str, &str)]) -> Server {
    let mut cmd = Command::new(server_binary(name, build));
    cmd.args(args).envs(env.iter().copied());
    Server::start(cmd)
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

/// Builds sei/client's kv_cli with plain gcc (a client is not hardened), once.
fn kv_cli_binary() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let dir = repo().join("sei/client");
        let out = work_dir().join("kv_cli");
        let result = Command::new("gcc")
            .args(["-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror"])
            .arg(dir.join("sei_client.c"))
            .arg(dir.join("kv_cli.c"))
            .arg("-o")
            .arg(&out)
            .output()
            .unwrap();
        assert!(
            result.status.success(),
            "building kv_cli: {}",
            String::from_utf8_lossy(&result.stderr)
        );
        out
    })
    .clone()
}

fn kv_cli(port: u16, args: &[&str]) -> Output {
    run(Command::new(kv_cli_binary())
        .arg("--port")
        .arg(port.to_string())
        .args(args))
}

/// The two CRC-checking clients, which take the same arguments.
#[derive(Clone, Copy, Debug)]
enum Client {
    Python,
    C,
}

const CLIENTS: [Client; 2] = [Client::Python, Client::C];

fn client(which: Client, port: u16, args: &[&str]) -> Output {
    match which {
        Client::Python => kv_client(port, args),
        Client::C => kv_cli(port, args),
    }
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
            let plain = start_server(name, build, args, &env);
            let out = kv_client(plain.port, &["check"]);
            assert_eq!(
                out.status.code(),
                Some(0),
                "{name} {build:?} {mode:?}: {}",
                text(&out.stderr)
            );
            assert!(text(&out.stdout).starts_with("ok: 614 checks"));
            let crc_args: Vec<&str> = args.iter().copied().chain(["--crc"]).collect();
            let checked = start_server(name, build, &crc_args, &env);
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
        let server = start_server(name, build, &crc_args, &[]);
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
        let server = start_server(name, build, args, &[]);
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
    let server = start_server("kv_threads", Build::Hardened, &["--threads", "2"], &[]);
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
        let server = start_server("kv_single", build, &["--crc"], &[("KV_TEST_CORRUPT_REPLY", "7")]);
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
        let server = start_server("kv_single", Build::Hardened, &["--crc"], &[]);
        kv_client(server.port, &["--crc", "trace", trace.to_str().unwrap()])
    };
    assert_eq!(golden.status.code(), Some(0), "{}", text(&golden.stderr));
    let server = start_server(
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
    let server = start_server("kv_single", Build::Hardened, &["--crc"], &[]);
    let crc = |b: &[u8]| lockstep_core::crc32c(b);
    let set = b"set k 0 0 2\r\nhi\r\n";
    // the request's CRC is off by one bit: discarded, the state is unchanged
    let bad = [set.as_slice(), format!("#crc {:08x}\r\n", crc(set) ^ 1).as_bytes()].concat();
    assert_eq!(exchange(server.port, &bad, "\r\n"), "CLIENT_ERROR crc mismatch\r\n");
    let get = b"get k\r\n";
    let get_req = [get.as_slice(), format!("#crc {:08x}\r\n", crc(get)).as_bytes()].concat();
    let reply = exchange(server.port, &get_req, "#crc");
    // the reply's CRC covers the request it answers, then the reply
    let end = b"END\r\n";
    assert_eq!(
        reply,
        format!("END\r\n#crc {:08x}\r\n", crc(&[get.as_slice(), end].concat())),
        "{reply}"
    );
    // the pipeline rule: nothing after a discarded request runs on its connection, and
    // the server ends the connection after its notice
    let later = b"set later 0 0 2\r\nhi\r\n";
    let later_req = [later.as_slice(), format!("#crc {:08x}\r\n", crc(later)).as_bytes()].concat();
    let both = [bad.as_slice(), get_req.as_slice(), later_req.as_slice()].concat();
    assert_eq!(
        exchange(server.port, &both, "no such reply"),
        "CLIENT_ERROR crc mismatch\r\n"
    );
    let get_later = b"get later\r\n";
    let get_later_req = [
        get_later.as_slice(),
        format!("#crc {:08x}\r\n", crc(get_later)).as_bytes(),
    ]
    .concat();
    assert!(exchange(server.port, &get_later_req, "#crc").starts_with("END\r\n#crc "));
    // a request without its CRC line closes the connection with an error
    let missing = exchange(server.port, b"get k\r\nget k\r\nget k\r\nget k\r\n", "\r\n");
    assert_eq!(missing, "CLIENT_ERROR expected a #crc line\r\n");
    let (stderr, status) = server.stop();
    assert_eq!(status, None, "the server died: {stderr}");

    let plain = start_server("kv_single", Build::Hardened, &[], &[]);
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
            let server = start_server(
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

#[test]
fn the_crc32c_of_the_wire_format_has_the_documented_check_value() {
    assert_eq!(lockstep_core::crc32c(b"123456789"), 0xE306_9283);
    for which in CLIENTS {
        let out = client(which, 0, &["crc", "123456789"]);
        assert_eq!(text(&out.stdout), "e3069283\n", "{which:?}: {}", text(&out.stderr));
    }
}

#[test]
fn the_c_and_python_clients_pass_the_functional_check_against_the_hardened_servers() {
    for (name, args) in [("kv_single", &[][..]), ("kv_threads", &["--threads", "2"][..])] {
        let crc_args: Vec<&str> = args.iter().copied().chain(["--crc"]).collect();
        for which in CLIENTS {
            for pipeline in ["1", "32"] {
                let server = start_server(name, Build::Hardened, &crc_args, &[]);
                let out = client(which, server.port, &["--crc", "--pipeline", pipeline, "check"]);
                assert_eq!(
                    out.status.code(),
                    Some(0),
                    "{name} {which:?} --pipeline {pipeline}: {}",
                    text(&out.stderr)
                );
                assert_eq!(text(&out.stdout), "ok: 614 checks\n");
                let (stderr, status) = server.stop();
                assert_eq!(status, None, "{name}: {stderr}");
            }
        }
        // without --crc, the same clients speak plain memcached
        let server = start_server(name, Build::Hardened, args, &[]);
        let out = kv_cli(server.port, &["--pipeline", "16", "check"]);
        assert_eq!(out.status.code(), Some(0), "{name} plain: {}", text(&out.stderr));
    }
}

/// Both clients replay the same trace, pipelined or not, to the same replies.
#[test]
fn the_c_and_python_clients_give_the_same_replies_to_a_trace() {
    let trace = work_dir().join("trace-clients.txt");
    std::fs::write(&trace, kv_client(0, &["gen-trace", "300", "11"]).stdout).unwrap();
    let mut outputs = Vec::new();
    for which in CLIENTS {
        for pipeline in ["1", "25"] {
            let server = start_server("kv_threads", Build::Hardened, &["--threads", "2", "--crc"], &[]);
            let out = client(
                which,
                server.port,
                &["--crc", "--pipeline", pipeline, "trace", trace.to_str().unwrap()],
            );
            assert_eq!(
                out.status.code(),
                Some(0),
                "{which:?} {pipeline}: {}",
                text(&out.stderr)
            );
            outputs.push(out.stdout);
        }
    }
    assert!(outputs[0].len() > 10_000);
    assert!(outputs.iter().all(|o| *o == outputs[0]), "the clients' replies differ");
}

/// A fake server: answers the first request of each connection with `reply` (raw bytes,
/// its CRC line included), or closes at once after it if `close`; returns the port and
/// a counter of the connections it accepted.
fn fake_server(reply: Vec<u8>, close: bool) -> (u16, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    let listener = TcpListener::bind(("127.0.0.1", 0)).unwrap();
    let port = listener.local_addr().unwrap().port();
    let count = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = count.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let reply = reply.clone();
            std::thread::spawn(move || {
                conn.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                // one request with its CRC line: "#crc XXXXXXXX\r\n"
                while !text(&got).contains("#crc ") || !text(&got).ends_with("\r\n") {
                    match conn.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = conn.write_all(&reply);
                if close {
                    let _ = conn.shutdown(std::net::Shutdown::Write);
                }
                while matches!(conn.read(&mut buf), Ok(n) if n > 0) {}
            });
        }
    });
    (port, count)
}

/// A reply must carry the CRC of the request it answers followed by the reply: a
/// correct reply whose CRC covers another request, or only the reply, is what a server
/// that framed the wrong request would send, and the client rejects it (86).
#[test]
fn a_reply_whose_crc_covers_another_request_is_rejected() {
    let crc = |b: &[u8]| lockstep_core::crc32c(b);
    let trace = work_dir().join("trace-get-a.txt");
    std::fs::write(&trace, "get a\n").unwrap();
    let trace = trace.to_str().unwrap();
    let end = b"END\r\n".as_slice();
    for which in CLIENTS {
        for (covered, accepted) in [
            ([b"get a\r\n".as_slice(), end].concat(), true),
            ([b"get b\r\n".as_slice(), end].concat(), false),
            (end.to_vec(), false),
            ([b"get a\r\n#crc 00000000\r\n".as_slice(), end].concat(), false),
        ] {
            let reply = [end, format!("#crc {:08x}\r\n", crc(&covered)).as_bytes()].concat();
            let (port, _) = fake_server(reply, false);
            let out = client(which, port, &["--crc", "trace", trace]);
            let what = format!("{which:?}, a CRC over {:?}: {}", text(&covered), text(&out.stderr));
            if accepted {
                assert_eq!(out.status.code(), Some(0), "{what}");
                assert_eq!(text(&out.stdout), "END\r\n", "{what}");
            } else {
                assert_eq!(out.status.code(), Some(86), "{what}");
                assert!(text(&out.stderr).contains("does not cover the request"), "{what}");
                assert_eq!(text(&out.stdout), "", "{what}");
            }
        }
    }

    // The fault this guards against: framing in a hardened server steps over a request
    // (KV_TEST_SKIP_REQUEST), so each later reply answers the request after the one the
    // client waits on. Every reply is STORED with a CRC its server computed: only the
    // request inside the CRC shows the client that it answers another request.
    let sets = work_dir().join("trace-sets.txt");
    let lines: String = (0..30).map(|i| format!("set key{i} value{i}\n")).collect();
    std::fs::write(&sets, lines).unwrap();
    for (name, args) in [
        ("kv_single", &["--crc"][..]),
        ("kv_threads", &["--threads", "2", "--crc"][..]),
    ] {
        for which in CLIENTS {
            let server = start_server(name, Build::Hardened, args, &[("KV_TEST_SKIP_REQUEST", "15")]);
            let out = client(
                which,
                server.port,
                &["--crc", "--pipeline", "10", "trace", sets.to_str().unwrap()],
            );
            assert_eq!(out.status.code(), Some(86), "{name} {which:?}: {}", text(&out.stderr));
            assert!(
                text(&out.stderr).contains("does not cover the request"),
                "{name} {which:?}: {}",
                text(&out.stderr)
            );
            // the first pipeline came back whole; the second stopped at the skip
            assert_eq!(text(&out.stdout), "STORED\r\n".repeat(10), "{name} {which:?}");
            let (stderr, status) = server.stop();
            assert_eq!(status, None, "{name}: {stderr}");
        }
    }
}

/// Ten pipelined requests whose order matters: run out of order, the get of request 4
/// would see request 5's set, and request 7's delete would leave another value behind.
const ORDERED: &str = "set a 1\nget a\nset b 2\nget c\nset c 3\nget c\ndelete a\nget a b c\nset a 4\nget a\n";
const ORDERED_REPLIES: &str = "STORED\r\nVALUE a 0 1\r\n1\r\nEND\r\nSTORED\r\nEND\r\nSTORED\r\n\
VALUE c 0 1\r\n3\r\nEND\r\nDELETED\r\nVALUE b 0 1\r\n2\r\nVALUE c 0 1\r\n3\r\nEND\r\nSTORED\r\n\
VALUE a 0 1\r\n4\r\nEND\r\n";

/// Request 4 of a pipeline of 10 is discarded, by a wrong CRC from the client or by
/// corruption inside the server: the server runs nothing after it, the client sends
/// again from request 4, and the replies and the store are those of running the ten
/// in order.
#[test]
fn a_pipeline_cut_at_a_corrupt_request_runs_in_the_original_order_after_the_resend() {
    let trace = work_dir().join("trace-ordered.txt");
    std::fs::write(&trace, ORDERED).unwrap();
    let trace = trace.to_str().unwrap();
    let probe = work_dir().join("trace-probe.txt");
    std::fs::write(&probe, "get a b c\n").unwrap();
    let probe = probe.to_str().unwrap();
    for (name, args) in [
        ("kv_single", &["--crc"][..]),
        ("kv_threads", &["--threads", "2", "--crc"][..]),
    ] {
        for which in CLIENTS {
            for corrupt_at_server in [false, true] {
                let env: &[(&str, &str)] = if corrupt_at_server {
                    &[("KV_TEST_CORRUPT_REQUEST", "4")]
                } else {
                    &[]
                };
                let mut flags = vec!["--crc", "--pipeline", "10"];
                if !corrupt_at_server {
                    flags.extend(["--corrupt-crc", "4"]);
                }
                let server = start_server(name, Build::Hardened, args, env);
                let what = format!("{name} {which:?} corrupted in the server: {corrupt_at_server}");
                let out = client(which, server.port, &[flags.as_slice(), &["trace", trace]].concat());
                assert_eq!(out.status.code(), Some(0), "{what}: {}", text(&out.stderr));
                assert!(
                    text(&out.stderr).contains("discarded 1 pipelines"),
                    "{what}: no resend: {}",
                    text(&out.stderr)
                );
                assert_eq!(text(&out.stdout), ORDERED_REPLIES, "{what}");
                let store = client(which, server.port, &["--crc", "trace", probe]);
                assert_eq!(
                    text(&store.stdout),
                    "VALUE a 0 1\r\n4\r\nVALUE b 0 1\r\n2\r\nVALUE c 0 1\r\n3\r\nEND\r\n",
                    "{what}"
                );
                let (stderr, status) = server.stop();
                assert_eq!(status, None, "{what}: {stderr}");
            }
        }
    }
}

/// A noreply request gets no reply that could confirm it: when the server discards it,
/// its notice answers the next pipeline, which must send the noreply request again
/// before its own.
#[test]
fn a_discarded_noreply_request_is_sent_again_with_the_next_pipeline() {
    let trace = work_dir().join("trace-noreply.txt");
    std::fs::write(&trace, "set a 1\nset a 2 noreply\nget a\ndelete a noreply\nget a\n").unwrap();
    for which in CLIENTS {
        for nth in ["2", "4"] {
            let server = start_server(
                "kv_single",
                Build::Hardened,
                &["--crc"],
                &[("KV_TEST_CORRUPT_REQUEST", nth)],
            );
            let out = client(which, server.port, &["--crc", "trace", trace.to_str().unwrap()]);
            assert_eq!(out.status.code(), Some(0), "{which:?} {nth}: {}", text(&out.stderr));
            assert!(text(&out.stderr).contains("discarded 1 pipelines"), "{which:?} {nth}");
            assert_eq!(
                text(&out.stdout),
                "STORED\r\nVALUE a 0 1\r\n2\r\nEND\r\nEND\r\n",
                "{which:?} {nth}"
            );
        }
    }
}

/// A server that discards a request on every attempt: each client sends it three times,
/// then stops with the detection status rather than retrying forever.
#[test]
fn a_request_discarded_three_times_is_a_detection() {
    let trace = work_dir().join("trace-get-x.txt");
    std::fs::write(&trace, "get x\n").unwrap();
    for which in CLIENTS {
        let (port, connections) = fake_server(b"CLIENT_ERROR crc mismatch\r\n".to_vec(), true);
        let out = client(which, port, &["--crc", "trace", trace.to_str().unwrap()]);
        assert_eq!(out.status.code(), Some(86), "{which:?}: {}", text(&out.stderr));
        assert_eq!(connections.load(std::sync::atomic::Ordering::SeqCst), 3, "{which:?}");
    }
}

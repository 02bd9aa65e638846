//! The ledger server of the fault campaign bench/sei_ledger_eval.sh
//! (bench/sei_ledger_server.c, the handler of bench/sei_ledger.c behind a socket), built
//! natively (-DSEI_NATIVE) and with `lockstep cc`, served to its CRC-checking client
//! bench/sei_ledger_client.py: the builds must give the same replies and the same state
//! (which the client checks against its own model of the ledger), a request whose CRC
//! was corrupted must be discarded and sent again, and bad input must get its error.
//! The wire format is in the server's header comment.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

mod sei_server;
use sei_server::{compile, repo, Build, Server};

fn work_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lockstep-sei-ledger-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Builds the server natively or hardened, with the flags the campaign uses.
fn build(hardened: bool) -> PathBuf {
    let out = work_dir().join(if hardened { "ledger_sei" } else { "ledger_native" });
    let how = if hardened { Build::Hardened } else { Build::Native };
    let sources = [
        repo().join("bench/sei_ledger_server.c"),
        repo().join("sei/examples/wire.c"),
    ];
    compile(&sources, how, &work_dir(), &out);
    out
}

/// The ledger server `binary` in SEI_MODE `mode` on a port of its own.
fn start_server(binary: &Path, mode: Option<&str>) -> Server {
    let mut cmd = Command::new(binary);
    if let Some(mode) = mode {
        cmd.env("SEI_MODE", mode);
    }
    Server::start(cmd)
}

/// The client's run against port: 20 batches of seed 5, checked against its model.
fn client(port: u16, extra: &[&str]) -> Output {
    let out = Command::new("python3")
        .arg(repo().join("bench/sei_ledger_client.py"))
        .args([
            "--port",
            &port.to_string(),
            "--batches",
            "20",
            "--seed",
            "5",
            "--verify",
        ])
        .args(extra)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "client {extra:?}: {:?}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Sends raw bytes on a new connection and reads until the server ends it.
fn exchange(port: u16, bytes: &[u8]) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(bytes).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

#[test]
fn the_ledger_server_serves_alike_native_and_hardened_and_resends_a_discarded_request() {
    let native = build(false);
    let hardened = build(true);
    let mut outputs = Vec::new();
    for (binary, mode) in [(&native, None), (&hardened, Some("ecc")), (&hardened, Some("dup"))] {
        let server = start_server(binary, mode);
        let out = client(server.port, &[]);
        assert!(String::from_utf8_lossy(&out.stderr).contains(" 0 discarded"));
        outputs.push((mode, out.stdout));
    }
    let golden = String::from_utf8(outputs[0].1.clone()).unwrap();
    let lines: Vec<&str> = golden.lines().collect();
    assert_eq!(lines.len(), 21, "{golden}");
    assert!(
        lines[..20]
            .iter()
            .all(|l| l.starts_with("OK ") && l.contains(" moved, audit ")),
        "{golden}"
    );
    assert!(lines[20].starts_with("CHECKSUM "), "{golden}");
    for (mode, stdout) in &outputs {
        assert_eq!(
            String::from_utf8_lossy(stdout),
            golden,
            "the {mode:?} build's replies differ"
        );
    }

    // The 3rd frame's CRC is wrong: the hardened server discards it and runs nothing
    // after it on the connection; the client resends from there, and the replies and
    // the state are those of the run without the fault.
    let server = start_server(&hardened, Some("dup"));
    let out = client(server.port, &["--corrupt-crc", "3"]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(" 1 discarded"),
        "{:?}",
        out
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), golden);

    // Raw input: a bad CRC gets only the notice, then the end of the stream; an
    // unterminated request longer than the limit and a missing CRC line get their errors.
    assert_eq!(
        exchange(server.port, b"T 1 2 3\n\n#crc 00000000\r\nC\n\n#crc 00000000\r\n"),
        "CLIENT_ERROR crc mismatch\r\n"
    );
    assert_eq!(
        exchange(server.port, &[b'T'; 5000]),
        "CLIENT_ERROR request too large\r\n"
    );
    assert_eq!(
        exchange(server.port, b"C\n\nhello, world!!\r\n"),
        "CLIENT_ERROR expected a #crc line\r\n"
    );
    let _ = std::fs::remove_dir_all(work_dir());
}

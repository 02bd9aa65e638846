//! Every numeric or sized option of every subcommand, fed extreme values: each must end
//! in exit status 2 with exactly one line on stderr, never a panic (101), an overflow
//! that fails later, or a run that starts. Values a subcommand legitimately accepts (a
//! seed of 0, a scrub rate of 0) are not in the lists: those are tested where they act.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The extremes every numeric option is fed, plus each option's own out-of-range values.
const EXTREMES: &[&str] = &[
    "-1",
    "1e300",
    "18446744073709551616",
    "99999999999999999999999",
    "garbage",
    "",
];

/// Runs lockstep with `args`; kills it (and fails) if it is still running after 10 s,
/// which would mean a bad value was accepted and something started.
fn run(args: &[&str]) -> (Option<i32>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn lockstep");
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("lockstep {args:?} was still running after 10 s: the value was accepted");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut stderr)
        .expect("read stderr");
    (status.code(), stderr)
}

/// `lockstep PREFIX OPTION VALUE SUFFIX` for each value: exit 2 and one line on stderr.
fn refuses(prefix: &[&str], option: &str, own: &[&str], suffix: &[&str]) {
    for value in EXTREMES.iter().chain(own) {
        let with_equals = format!("{option}={value}");
        let mut args: Vec<&str> = prefix.to_vec();
        // `--opt=-1` so that a negative number reaches the option's parser.
        args.push(&with_equals);
        args.extend_from_slice(suffix);
        let (code, stderr) = run(&args);
        assert!(!stderr.contains("panicked"), "lockstep {args:?} panicked:\n{stderr}");
        assert_eq!(code, Some(2), "lockstep {args:?}: exit {code:?}, stderr:\n{stderr}");
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "lockstep {args:?}: not one line on stderr:\n{stderr}");
        assert!(lines[0].starts_with("lockstep"), "lockstep {args:?}: {stderr}");
    }
}

#[test]
fn run_refuses_extreme_values() {
    let cmd = ["--", "true"];
    refuses(&["run"], "--replicas", &["0", "1", "4", "4294967296"], &cmd);
    refuses(&["run"], "--spin", &["4294967296"], &cmd);
    refuses(
        &["run"],
        "--timeout",
        &["0", "nan", "inf", "-0.5", "100000000s", "1x"],
        &cmd,
    );
    refuses(&["run"], "--monitor-cpu", &["1024", "99999"], &cmd);
    refuses(
        &["run"],
        "--cpus",
        &["0-99999999999999", "5-2", "1024", ",", "0,,x"],
        &cmd,
    );
    refuses(&["run"], "--compare", &["all"], &cmd);
    refuses(&["run"], "--backend", &["seccomp"], &cmd);
}

#[test]
fn inject_refuses_extreme_values() {
    let cmd = ["--", "true"];
    refuses(&["inject"], "--runs", &["0", "1000000001"], &cmd);
    refuses(&["inject"], "--jobs", &["0", "1025", "99999999"], &cmd);
    refuses(&["inject"], "--seed", &[], &cmd);
    refuses(&["inject"], "--golden", &["0", "1001"], &cmd);
    refuses(&["inject"], "--timeout", &["0", "nan", "inf", "100000000s"], &cmd);
    refuses(
        &["inject", "--margin", "1"],
        "--confidence",
        &["0", "100", "nan", "inf"],
        &cmd,
    );
    refuses(
        &["inject", "--confidence", "95"],
        "--margin",
        &["0", "50", "nan", "1e-300"],
        &cmd,
    );
    refuses(
        &["inject", "--server", "--client", "true"],
        "--port",
        &["0", "65536"],
        &cmd,
    );
    refuses(
        &["inject", "--server", "--port", "9", "--client", "true"],
        "--client-detected",
        &["0", "256"],
        &cmd,
    );
    refuses(
        &["inject"],
        "--at",
        &["syscall:-1", "syscall:1e300", "ip:garbage"],
        &cmd,
    );
    refuses(
        &["inject"],
        "--shard",
        &["0/0", "5/4", "1e300/2", "1/18446744073709551616"],
        &cmd,
    );
    refuses(&["inject"], "--fault", &["cosmic-ray"], &cmd);
}

#[test]
fn kv_refuses_extreme_values() {
    for sub in ["serve", "cluster"] {
        refuses(&["kv", sub], "--memory-limit", &["0", "1048577"], &[]);
        refuses(&["kv", sub], "--item-max", &["0", "1073741825"], &[]);
        refuses(&["kv", sub], "--snapshot-every", &["0"], &[]);
        refuses(&["kv", sub], "--audit-every", &["0", "86401"], &[]);
        refuses(&["kv", sub], "--max-recoveries", &["1001"], &[]);
        refuses(&["kv", sub], "--max-conns", &["0", "1048577"], &[]);
        refuses(&["kv", sub], "--threads", &["65"], &[]);
        refuses(&["kv", sub], "--recovery-window", &["0"], &[]);
    }
    refuses(&["kv", "serve"], "--id", &["0", "65"], &[]);
    refuses(&["kv", "cluster"], "-n", &["0", "10"], &[]);
    // More replicas than a cluster has (lockstep_kv::MAX_REPLICAS, 9).
    let ten: Vec<String> = (1..=10).map(|i| format!("127.0.0.1:{}", 21210 + i)).collect();
    refuses(&["kv", "serve", "--id", "1"], "--peers", &[&ten.join(",")], &[]);
    refuses(&["kv", "cluster"], "--port", &["65536"], &[]);
    refuses(&["kv", "cluster"], "--peer-port", &["65536"], &[]);
}

#[test]
fn fs_refuses_extreme_values() {
    let mnt = ["/nonexistent/lockstep-args-test"];
    refuses(&["fs", "mount"], "--scrub", &[], &mnt);
    refuses(
        &["fs", "mount"],
        "--cache-size",
        &["0", "1K", "99999999999G", "1.5G", "12Q"],
        &mnt,
    );
    refuses(
        &["fs", "mount"],
        "--dirty-age",
        &["31s", "99999999999999999999999s", "nan", "1x"],
        &mnt,
    );
    refuses(
        &["fs", "mount"],
        "--verify",
        &["last-check=1e300", "last-check=-1", "last-use=2d", "sometimes"],
        &mnt,
    );
}

//! Process-level behaviour of `lockstep run`: exit statuses, usage errors, --stats,
//! signals, and never leaving processes behind.

mod common;
use common::*;
use std::time::Duration;

// --- exit statuses ------------------------------------------------------------------

#[test]
fn exit_status_passes_through_dmr() {
    run(lockstep_run(&["-r", "2"], &["sh", "-c", "echo before; exit 7"]))
        .assert_code(7)
        .assert_stdout(b"before\n");
}

#[test]
fn exit_status_passes_through_tmr() {
    run(lockstep_run(&["-r", "3"], &["sh", "-c", "echo before; exit 7"]))
        .assert_code(7)
        .assert_stdout(b"before\n");
}

#[test]
fn killed_by_signal_is_128_plus_n() {
    let out = run(lockstep_run(&["-r", "2"], &["sh", "-c", "kill -TERM $$"]));
    out.assert_code(143);
    assert!(
        out.status.code().is_some(),
        "lockstep itself should exit with 143, not die by the signal\n{}",
        out.context()
    );
}

/// (d) a crashing program: 128+SIGSEGV, and nothing left behind (checked by run()).
#[test]
fn program_crash_dmr() {
    let out = run(lockstep_run(&["-r", "2"], &["sh", "-c", "ulimit -c 0; kill -SEGV $$"]));
    out.assert_code(139);
    assert!(out.status.code().is_some(), "{}", out.context());
}

#[test]
fn program_crash_tmr() {
    let out = run(lockstep_run(&["-r", "3"], &["sh", "-c", "ulimit -c 0; kill -SEGV $$"]));
    out.assert_code(139);
    assert!(out.status.code().is_some(), "{}", out.context());
}

// --- bad input ----------------------------------------------------------------------

/// A usage error: exit 2, a message on stderr, and the command was not run.
#[track_caller]
fn usage_error(args: &[&str]) {
    let mut c = lockstep();
    c.args(args);
    let out = run(c);
    out.assert_code(2);
    assert!(
        !out.stderr.trim().is_empty(),
        "no message for a usage error\n{}",
        out.context()
    );
    assert!(
        !out.stdout_str().contains("RAN"),
        "the command ran despite the usage error\n{}",
        out.context()
    );
}

#[test]
fn usage_no_command() {
    usage_error(&["run"]);
    usage_error(&["run", "-r", "2"]);
    usage_error(&["run", "-r", "2", "--"]);
}

#[test]
fn usage_bad_replica_count() {
    for r in ["4", "1", "0", "x", "-3"] {
        usage_error(&["run", "-r", r, "--", "sh", "-c", "echo RAN"]);
    }
}

#[test]
fn usage_unknown_option() {
    usage_error(&["run", "--no-such-option", "--", "sh", "-c", "echo RAN"]);
}

#[test]
fn usage_bad_option_values() {
    usage_error(&["run", "-r", "2", "--compare", "sometimes", "--", "sh", "-c", "echo RAN"]);
    usage_error(&["run", "-r", "2", "--timeout", "soon", "--", "sh", "-c", "echo RAN"]);
    usage_error(&[
        "run",
        "-r",
        "2",
        "--test-flip",
        "not-a-spec",
        "--",
        "sh",
        "-c",
        "echo RAN",
    ]);
    usage_error(&[
        "run",
        "-r",
        "2",
        "--test-flip",
        "0:1:xmm0:1",
        "--",
        "sh",
        "-c",
        "echo RAN",
    ]);
}

#[test]
fn command_not_found() {
    let path = format!("/nonexistent/{}", unique_marker("prog"));
    for r in ["2", "3"] {
        let out = run(lockstep_run(&["-r", r], &[path.as_str()]));
        out.assert_code(127);
        assert!(
            out.stderr.contains(&path),
            "the message should name {path}\n{}",
            out.context()
        );
    }
}

#[test]
fn help_hides_test_flip() {
    let mut c = lockstep();
    c.args(["run", "--help"]);
    let out = run(c);
    out.assert_code(0);
    let text = out.stdout_str();
    for opt in ["--compare", "--timeout", "--events", "--stats", "--no-reintegrate"] {
        assert!(text.contains(opt), "--help does not mention {opt}\n{}", out.context());
    }
    assert!(
        !text.contains("test-flip") && !out.stderr.contains("test-flip"),
        "--test-flip must be hidden\n{}",
        out.context()
    );
}

// --- --stats ------------------------------------------------------------------------

#[test]
fn stats_summary() {
    let out = run(lockstep_run(&["-r", "2", "--stats"], &["sh", "-c", "echo hello"]));
    out.assert_code(0).assert_stdout(b"hello\n");
    assert!(
        out.stderr.lines().any(|l| l.contains("syscalls")),
        "--stats printed no 'syscalls' line\n{}",
        out.context()
    );
    // and without --stats, no summary
    let quiet = run(lockstep_run(&["-r", "2"], &["sh", "-c", "echo hello"]));
    quiet.assert_code(0).assert_stdout(b"hello\n");
    assert!(
        !quiet.stderr.contains("syscalls"),
        "summary printed without --stats\n{}",
        quiet.context()
    );
}

// --- no orphans ---------------------------------------------------------------------

/// `sh -c 'sleep 30; : MARKER'`: the marker is in sh's command line; all processes
/// (replicas and their sleep children) also carry the run's marker in their
/// environment.
fn sleeper(tag: &str) -> Vec<String> {
    vec!["sh".into(), "-c".into(), format!("sleep 30; : {}", unique_marker(tag))]
}

/// Waits until `n` replicas (sh processes, not lockstep itself) exist and at least
/// one of them has started its sleep; returns the replica processes.
fn wait_for_replicas(r: &mut Running, n: usize) -> Vec<ProcInfo> {
    // Settled: n replicas blocked (in wait4 for their sleep, or stopped by the monitor
    // until the leader's wait4 returns), none still running towards it.
    r.wait_for_processes(
        &format!("{n} replicas waiting for sleep"),
        Duration::from_secs(30),
        |ps| {
            let blocked = ps
                .iter()
                .filter(|p| p.argv0() == "sh" && matches!(p.state, 'S' | 't' | 'T'))
                .count();
            blocked >= n && ps.iter().any(|p| p.argv0() == "sleep")
        },
    );
    let mut shs: Vec<ProcInfo> = r.marked_processes().into_iter().filter(|p| p.argv0() == "sh").collect();
    shs.sort_by_key(|p| p.pid);
    assert!(shs.len() >= n, "replicas vanished: {shs:#?}");
    shs
}

fn sigkill(pid: u32) {
    // SAFETY: kill takes any pid and signal.
    let rc = unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
    assert_eq!(rc, 0, "kill -9 {pid}: {}", std::io::Error::last_os_error());
}

/// (a) TMR: a replica killed from outside is a crashed replica: lockstep notices,
/// carries on with the other two, and on SIGINT exits 130 leaving nothing behind.
#[test]
fn orphans_replica_killed_tmr() {
    let ev = events_path("orph-a3");
    let mut r = spawn(lockstep_run(
        &["-r", "3", "--events", ev.to_str().unwrap()],
        &sleeper("a3"),
    ));
    let replicas = wait_for_replicas(&mut r, 3);
    let victim = replicas.last().unwrap().clone();
    sigkill(victim.pid);
    // lockstep detects it ...
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while !has_event(&read_events_partial(&ev), "divergence", None) {
        assert!(
            r.is_running(),
            "lockstep exited after one of three replicas was killed\n{}",
            r.stdout_str()
        );
        assert!(
            std::time::Instant::now() < deadline,
            "no divergence event after killing replica {}",
            victim.pid
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // ... and keeps going: there is no event for "did not stop", so this is a window in
    // which a wrongly stopping run would have exited.
    std::thread::sleep(Duration::from_millis(1000));
    assert!(r.is_running(), "TMR lockstep stopped after losing one replica");
    r.signal(libc::SIGINT);
    let out = r.finish(RUN_TIMEOUT);
    out.assert_code(130);
}

/// (a) DMR: killing a replica stops the run with 86, leaving nothing behind.
#[test]
fn orphans_replica_killed_dmr() {
    let mut r = spawn(lockstep_run(&["-r", "2"], &sleeper("a2")));
    let replicas = wait_for_replicas(&mut r, 2);
    sigkill(replicas.last().unwrap().pid);
    let out = r.finish(RUN_TIMEOUT);
    out.assert_code(86);
    assert!(
        out.elapsed < Duration::from_secs(25),
        "DMR took too long to notice the dead replica\n{}",
        out.context()
    );
}

/// (b) SIGKILL to lockstep itself: the replicas must die with it.
#[test]
fn orphans_lockstep_sigkilled() {
    for n in [2usize, 3] {
        let mut r = spawn(lockstep_run(&["-r", &n.to_string()], &sleeper("b")));
        wait_for_replicas(&mut r, n);
        r.signal(libc::SIGKILL);
        // finish() waits for the pipes to close and for all marked processes to go.
        let out = r.finish(RUN_TIMEOUT);
        assert_eq!(out.status.code(), None, "{}", out.context());
        no_orphans(&out.marker);
    }
}

/// (c) SIGINT to lockstep: the program is interrupted, lockstep exits 130.
#[test]
fn orphans_lockstep_sigint() {
    for n in [2usize, 3] {
        let mut r = spawn(lockstep_run(&["-r", &n.to_string()], &sleeper("c")));
        wait_for_replicas(&mut r, n);
        r.signal(libc::SIGINT);
        let out = r.finish(RUN_TIMEOUT);
        out.assert_code(130);
        assert!(
            out.elapsed < Duration::from_secs(25),
            "SIGINT did not stop sleep 30 promptly\n{}",
            out.context()
        );
    }
}

// --- signal forwarding ----------------------------------------------------------------

/// SIGTERM to lockstep reaches the program, whose trap runs once (its output is
/// written once) and whose exit status comes back.
fn sigterm_forwarded(r: &str) {
    let script = "trap 'echo got-term; exit 3' TERM; echo ready; while :; do sleep 0.1; done";
    let mut run = spawn(lockstep_run(&["-r", r], &["sh", "-c", script]));
    run.wait_for_stdout("ready\n", Duration::from_secs(30));
    // Every replica is in its loop once each has a sleep child.
    let replicas: usize = r.parse().unwrap();
    run.wait_for_processes("each replica in its loop", Duration::from_secs(30), |ps| {
        ps.iter().filter(|p| p.argv0() == "sleep").count() >= replicas
    });
    run.signal(libc::SIGTERM);
    let out = run.finish(RUN_TIMEOUT);
    out.assert_code(3).assert_stdout(b"ready\ngot-term\n");
}

#[test]
fn sigterm_forwarded_dmr() {
    sigterm_forwarded("2");
}

#[test]
fn sigterm_forwarded_tmr() {
    sigterm_forwarded("3");
}

// --- process ids ------------------------------------------------------------------------

/// As root, the program's pid is lockstep's own (unique on the host while it runs, the same
/// in every replica), so two concurrent runs never share pid-named files.
#[test]
fn concurrent_runs_get_different_pids() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return; // without namespaces the pid is replica 0's real pid, unique anyway
    }
    let script = "echo $$; sleep 0.5";
    let a = spawn(lockstep_run(&["-r", "2"], &["sh", "-c", script]));
    let b = spawn(lockstep_run(&["-r", "3"], &["sh", "-c", script]));
    let (pid_a, pid_b) = (a.pid, b.pid);
    let (out_a, out_b) = (a.finish(RUN_TIMEOUT), b.finish(RUN_TIMEOUT));
    out_a.assert_code(0).assert_stdout(format!("{pid_a}\n").as_bytes());
    out_b.assert_code(0).assert_stdout(format!("{pid_b}\n").as_bytes());
}

/// git gc records its pid and host in .git/gc.pid and refuses to run while that process
/// lives. A run halted earlier left a lock naming pid 2 (the pid every replicated program
/// used to get): gc runs anyway, twice in a row.
#[test]
fn git_gc_twice_after_a_stale_lock() {
    let dir = scratch_dir("gitgc");
    let git = |args: &[&str]| {
        let out = std::process::Command::new("git")
            .args(["-c", "user.email=t@example.com", "-c", "user.name=t"])
            .args(args)
            .current_dir(&dir)
            .output()
            .expect("git");
        assert!(
            out.status.success(),
            "git {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    git(&["init", "-q"]);
    for i in 0..3 {
        std::fs::write(dir.join(format!("f{i}")), format!("{i}\n")).unwrap();
        git(&["add", "."]);
        git(&["commit", "-qm", "c"]);
    }
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    std::fs::write(dir.join(".git/gc.pid"), format!("2 {}", host.trim())).unwrap();
    let git_dir = dir.join(".git");
    for _ in 0..2 {
        let out = run(lockstep_run(
            &["-r", "2"],
            &["git", "-C", dir.to_str().unwrap(), "gc", "--quiet"],
        ));
        out.assert_code(0);
        assert!(git_dir.join("packed-refs").exists(), "{}", out.context());
    }
}

// --- processes that outlive the program's first process --------------------------------

/// Waits until no process carries `marker` (the detached monitor and the survivors).
fn wait_until_gone(marker: &str, limit: Duration) {
    let deadline = std::time::Instant::now() + limit;
    loop {
        let left = marked_processes(marker);
        if left.is_empty() {
            return;
        }
        if std::time::Instant::now() >= deadline {
            for p in &left {
                sigkill(p.pid);
            }
            panic!("still running after {limit:?}: {left:#?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A background job that writes after the main process exits: lockstep returns with the
/// main process's status, the job is still replicated and writes once, and the detached
/// monitor records both steps in the events file.
fn background_job_outlives_the_program(r: &str) {
    let dir = scratch_dir("bgjob");
    let file = dir.join("f");
    let ev = events_path("bgjob");
    let script = format!("(sleep 0.5; echo done >> {}) & exit 3", file.display());
    let run = spawn(lockstep_run(
        &["-r", r, "--events", ev.to_str().unwrap()],
        &["sh", "-c", script.as_str()],
    ));
    let out = run.finish_leaving_survivors(RUN_TIMEOUT, Duration::from_secs(10));
    out.assert_code(3);
    wait_until_gone(&out.marker, Duration::from_secs(30));
    assert_eq!(
        std::fs::read_to_string(&file).unwrap_or_default(),
        "done\n",
        "{}",
        out.context()
    );
    let kinds: Vec<String> = read_events(&ev)
        .iter()
        .map(|e| e["kind"].as_str().unwrap_or("").to_string())
        .collect();
    let detach = kinds.iter().position(|k| k == "detach").expect("a detach event");
    let exit = kinds.iter().position(|k| k == "exit").expect("an exit event");
    assert!(detach < exit, "{kinds:?}");
}

#[test]
fn background_job_outlives_the_program_dmr() {
    background_job_outlives_the_program("2");
}

#[test]
fn background_job_outlives_the_program_tmr() {
    background_job_outlives_the_program("3");
}

/// `--kill-orphans`: the background job is killed when the main process exits (it never
/// writes), and lockstep says so once.
#[test]
fn kill_orphans_kills_the_background_job() {
    let dir = scratch_dir("bgkill");
    let file = dir.join("f");
    let script = format!("(sleep 0.5; echo done >> {}) &", file.display());
    let out = run(lockstep_run(
        &["-r", "2", "--kill-orphans"],
        &["sh", "-c", script.as_str()],
    ));
    out.assert_code(0);
    assert_eq!(out.stderr.matches("outlived").count(), 1, "{}", out.context());
    // Once the job and its sleep are gone, nothing can write the file any more.
    no_orphans(&out.marker);
    assert!(!file.exists(), "the killed job wrote\n{}", out.context());
}

/// One RESP command to a redis server, its first reply line.
fn redis_command(port: u16, cmd: &str) -> String {
    use std::io::{BufRead, BufReader, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect to redis");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(format!("{cmd}\r\n").as_bytes()).unwrap();
    let mut line = String::new();
    let _ = BufReader::new(s).read_line(&mut line);
    line.trim_end().to_string()
}

/// `redis-server --daemonize yes`: lockstep returns 0 when the parent exits; the daemon
/// serves, replicated, and `SHUTDOWN` ends it and the detached monitor.
#[test]
fn redis_daemonizes_and_shuts_down() {
    let dir = scratch_dir("redisd");
    let port: u16 = 16391;
    let ev = events_path("redisd");
    let (d, p) = (dir.to_str().unwrap(), port.to_string());
    let log = format!("{d}/redis.log");
    let pidfile = format!("{d}/redis.pid");
    let run = spawn(lockstep_run(
        &["-r", "2", "--events", ev.to_str().unwrap()],
        &[
            "redis-server",
            "--port",
            &p,
            "--bind",
            "127.0.0.1",
            "--daemonize",
            "yes",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            d,
            "--logfile",
            &log,
            "--pidfile",
            &pidfile,
        ],
    ));
    let out = run.finish_leaving_survivors(RUN_TIMEOUT, Duration::from_secs(10));
    out.assert_code(0);
    assert!(
        port_listens_within(port, Duration::from_secs(30)),
        "redis never listened\n{}",
        out.context()
    );
    assert_eq!(redis_command(port, "PING"), "+PONG");
    assert_eq!(redis_command(port, "SET k replicated"), "+OK");
    assert_eq!(redis_command(port, "GET k"), "$10");
    redis_command(port, "SHUTDOWN NOSAVE");
    wait_until_gone(&out.marker, Duration::from_secs(30));
    let kinds: Vec<String> = read_events(&ev)
        .iter()
        .map(|e| e["kind"].as_str().unwrap_or("").to_string())
        .collect();
    assert!(
        kinds.contains(&"detach".to_string()) && kinds.contains(&"exit".to_string()),
        "{kinds:?}"
    );
    assert!(!kinds.contains(&"divergence".to_string()), "{kinds:?}");
}

//! `lockstep run --backend fast`: the in-process fast path (crates/run/shim/lockstep_fast.c
//! and crates/run/src/fast*.rs). The whole run suite also passes with LOCKSTEP_BACKEND=fast
//! (docs/run.md says how to run it); these tests cover what only the fast path has:
//! that calls really skip the monitor, that faults caught in process are voted and
//! masked as with ptrace, the watchdog, the ring's protection and CRC, and the seccomp
//! backstop under a broken Syscall User Dispatch.
//!
//! Faults use `--test-flip R:getppid:...` on `tests/fixtures/fast_target.c`, whose one
//! getppid call carries a pointer to its next output line: `mem:rdi+0` corrupts that line
//! in one replica, and the shim's vote on the write finds it.

mod common;
use common::*;
use serde_json::Value;
use std::time::Duration;

const FAST: &str = "--backend=fast";

/// "fast-path calls: N" and "syscalls intercepted: M" from `--stats`.
fn fast_and_intercepted(out: &Output) -> (u64, u64) {
    let number = |key: &str| -> u64 {
        out.stderr
            .lines()
            .find_map(|l| l.trim().strip_prefix(key))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no '{key}' in the stats\n{}", out.context()))
    };
    (number("fast-path calls:"), number("syscalls intercepted:"))
}

fn run_fast_target(replicas: &str, extra: &[&str]) -> (Output, Vec<Value>) {
    let ev = events_path("fast");
    let ev_arg = ev.to_string_lossy().into_owned();
    let mut opts = vec!["-r", replicas, FAST, "--events", &ev_arg];
    opts.extend_from_slice(extra);
    let out = run(lockstep_run(&opts, &[fixture("fast_target")]));
    let events = read_events_of(&ev, &out);
    (out, events)
}

fn fast_target_native() -> Vec<u8> {
    native_stdout(&[fixture("fast_target")])
}

#[test]
fn programs_give_native_output_and_their_hot_calls_skip_the_monitor() {
    let big = random_file(4 << 20);
    let py = python3();
    let job = "import hashlib, os, sys\n\
               h = hashlib.sha256()\n\
               for i in range(2000):\n    h.update(os.urandom(0) + str(i).encode())\n    sys.stdout.write(str(i % 10))\n\
               print()\n\
               pid = os.fork()\n\
               if pid == 0:\n    os._exit(3)\n\
               print(h.hexdigest(), os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n";
    let progs: Vec<Vec<std::ffi::OsString>> = vec![
        vec!["cat".into(), big.clone().into()],
        vec!["gzip".into(), "-c".into(), big.into()],
        vec!["sh".into(), "-c".into(), PIPELINE.into()],
        vec![py.into(), "-c".into(), job.into()],
    ];
    for prog in &progs {
        let native = native_stdout(prog);
        for r in ["2", "3"] {
            let out = run(lockstep_run(&["-r", r, FAST, "--stats"], prog));
            out.assert_code(0).assert_stdout(&native);
            assert!(!out.stderr.contains("[divergence]"), "{}", out.context());
            let (fast, _) = fast_and_intercepted(&out);
            assert!(fast > 0, "no call took the fast path\n{}", out.context());
        }
    }
}

#[test]
fn signal_masks_hold_under_the_shim() {
    for r in ["2", "3"] {
        let out = run(lockstep_run(&["-r", r, FAST], &[fixture("sigmask_first")]));
        out.assert_code(0).assert_stdout(b"blocked 1\n");
    }
}

#[test]
fn a_syscall_heavy_loop_runs_almost_entirely_on_the_fast_path() {
    let prog = ["dd", "if=/dev/zero", "of=/dev/null", "bs=512", "count=20000"];
    let out = run(lockstep_run(&["-r", "2", FAST, "--stats"], &prog));
    out.assert_code(0);
    let (fast, intercepted) = fast_and_intercepted(&out);
    assert!(fast >= 40_000, "{fast} fast-path calls\n{}", out.context());
    // dd's start-up and exit meet the monitor; its 40,000 reads and writes do not.
    assert!(
        intercepted * 100 < fast,
        "{intercepted} intercepted, {fast} fast\n{}",
        out.context()
    );
}

#[test]
fn socket_sends_and_receives_without_an_address_take_the_fast_path() {
    // recv() is recvfrom with a NULL address and a NULL address length, send() is sendto
    // with neither: both are a server's hot calls (nginx reads its requests with recv()).
    let job = "import socket\n\
               a, b = socket.socketpair()\n\
               total = 0\n\
               for i in range(3000):\n    a.send(b'%04d' % i)\n    total += int(b.recv(4))\n\
               print(total)\n";
    let prog: [std::ffi::OsString; 3] = [python3().into(), "-c".into(), job.into()];
    let out = run(lockstep_run(&["-r", "2", FAST, "--stats"], &prog));
    out.assert_code(0).assert_stdout(b"4498500\n");
    let (fast, _) = fast_and_intercepted(&out);
    assert!(fast >= 6000, "{fast} fast-path calls\n{}", out.context());
}

fn lanes(threads: u32, rounds: u32, start: &str) -> Vec<std::ffi::OsString> {
    vec![
        fixture("lanes").into_os_string(),
        threads.to_string().into(),
        rounds.to_string().into(),
        start.into(),
    ]
}

#[test]
fn each_thread_takes_a_lane_of_the_ring() {
    // Four workers at once, each with its own reads and writes: every call of theirs
    // skips the monitor, in DMR and TMR, with either output check.
    let prog = lanes(4, 300, "together");
    let native = native_stdout(&prog);
    for opts in [&["-r", "2"][..], &["-r", "3"], &["-r", "2", "--output-check", "fast"]] {
        let mut all = opts.to_vec();
        all.extend([FAST, "--stats"]);
        let out = run(lockstep_run(&all, &prog));
        out.assert_code(0).assert_stdout(&native);
        assert!(!out.stderr.contains("[divergence]"), "{}", out.context());
        let (fast, intercepted) = fast_and_intercepted(&out);
        assert!(
            fast >= 4 * 300 * 2,
            "{fast} fast-path calls, {intercepted} intercepted\n{}",
            out.context()
        );
        assert!(
            intercepted < 300,
            "{intercepted} calls met the monitor\n{}",
            out.context()
        );
    }
}

#[test]
fn threads_beyond_the_lanes_go_through_the_monitor_and_ended_threads_free_theirs() {
    let lanes_per_process = lockstep_run::fast::LANES as u64;
    // More threads at once than lanes: the first ones (the main thread has lane 0) take
    // the ring, the others meet the monitor at every call, and the output is native.
    let prog = lanes(20, 100, "together");
    let out = run(lockstep_run(&["-r", "2", FAST, "--stats"], &prog));
    out.assert_code(0).assert_stdout(&native_stdout(&prog));
    let (fast, intercepted) = fast_and_intercepted(&out);
    assert!(
        fast >= (lanes_per_process - 1) * 200,
        "{fast} fast-path calls\n{}",
        out.context()
    );
    assert!(intercepted >= 200, "{intercepted} intercepted\n{}", out.context());
    // More threads than lanes, one after another: each takes the lane the last one freed.
    let prog = lanes(40, 100, "one-by-one");
    let out = run(lockstep_run(&["-r", "2", FAST, "--stats"], &prog));
    out.assert_code(0).assert_stdout(&native_stdout(&prog));
    let (fast, _) = fast_and_intercepted(&out);
    assert!(fast >= 40 * 200, "{fast} fast-path calls\n{}", out.context());
}

#[test]
fn a_worker_threads_corrupted_output_is_caught_in_its_lane() {
    // Worker 1's 10th line is corrupted in one replica (its getppid carries the line).
    let prog = lanes(3, 50, "together");
    let native = native_stdout(&prog);
    for faulty in [1u32, 0] {
        let ev = events_path("lanes");
        let ev_arg = ev.to_string_lossy().into_owned();
        let flip = format!("{faulty}:getppid:mem:rdi+0:2");
        let out = run(lockstep_run(
            &["-r", "3", FAST, "--events", &ev_arg, "--test-flip", &flip],
            &prog,
        ));
        let events = read_events_of(&ev, &out);
        out.assert_code(0).assert_stdout(&native);
        assert_event(&events, "divergence", None, &out);
        assert_event(&events, "mask", None, &out);
        assert_no_event(&events, "halt", &out);
    }
    let out = run(lockstep_run(
        &["-r", "2", FAST, "--test-flip", "1:getppid:mem:rdi+0:2"],
        &prog,
    ));
    out.assert_code(86);
}

/// `tests/fixtures/ring_signals.c`: N fast-path writes under a 1 ms SIGALRM timer whose
/// handler makes calls too, then a pipe read the timer interrupts.
fn ring_signals(restart: &str) -> Vec<std::ffi::OsString> {
    vec![
        fixture("ring_signals").into_os_string(),
        "4000".into(),
        "1000".into(),
        restart.into(),
    ]
}

/// "in the ring: N" from `--stats`.
fn signals_in_ring(out: &Output) -> u64 {
    out.stderr
        .lines()
        .find_map(|l| l.trim().strip_prefix("in the ring:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

#[test]
fn signals_are_records_of_the_ring_taken_at_the_same_call_in_every_replica() {
    // Each replica prints the sum of the loop indices its handler interrupted: equal
    // outputs (no divergence) mean each replica took each signal at the same call. The
    // pipe read ends as natively: restarted under SA_RESTART, EINTR without it.
    for (replicas, restart, check) in [
        ("2", "restart", "strict"),
        ("3", "norestart", "strict"),
        ("3", "restart", "fast"),
        ("2", "norestart", "fast"),
    ] {
        let prog = ring_signals(restart);
        let native = String::from_utf8(native_stdout(&prog)).unwrap();
        let out = run(lockstep_run(
            &["-r", replicas, FAST, "--output-check", check, "--stats"],
            &prog,
        ));
        out.assert_code(0);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.starts_with("phase 1: 4000 writes, "), "{}", out.context());
        assert_eq!(stdout.lines().nth(1), native.lines().nth(1), "{}", out.context());
        assert!(signals_in_ring(&out) >= 3, "no signal took the ring\n{}", out.context());
        assert!(out.stderr.contains("divergences:          0"), "{}", out.context());
    }
}

#[test]
fn handlers_on_an_alternate_signal_stack_take_ring_signals_too() {
    // SA_ONSTACK: the handler, raised inside a ring call, runs on its own stack and makes
    // calls of its own; they must not take the ring stack from its top, where the
    // interrupted ring call's frames are (this stopped every run with 86 before).
    let mut prog = ring_signals("restart");
    prog.push("altstack".into());
    for replicas in ["2", "3"] {
        let out = run(lockstep_run(&["-r", replicas, FAST, "--stats"], &prog));
        out.assert_code(0);
        assert!(signals_in_ring(&out) >= 3, "no signal took the ring\n{}", out.context());
        assert!(out.stderr.contains("divergences:          0"), "{}", out.context());
    }
}

#[test]
fn a_signal_record_the_monitor_never_posted_is_the_leaders_fault() {
    // `signal:40`: the leader publishes a SIGUSR1 record at its 40th call, as a corrupted
    // look at its mailbox would. Under DMR the run stops; under TMR the leader is voted
    // out and the followers drop the signal, so the program never sees it.
    let prog = ring_signals("restart");
    let mut cmd = lockstep_run(&["-r", "2", FAST], &prog);
    cmd.env("LOCKSTEP_FAST_TEST", "signal:40");
    let out = run(cmd);
    out.assert_code(86);
    assert!(out.stderr.contains("which was never sent to it"), "{}", out.context());

    let ev = events_path("ring-signal");
    let ev_arg = ev.to_string_lossy().into_owned();
    let mut cmd = lockstep_run(&["-r", "3", FAST, "--events", &ev_arg], &prog);
    cmd.env("LOCKSTEP_FAST_TEST", "signal:40");
    let out = run(cmd);
    let events = read_events_of(&ev, &out);
    out.assert_code(0);
    assert_event(&events, "divergence", None, &out);
    assert_no_event(&events, "halt", &out);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains(", 0 usr1\n"), "{}", out.context());
}

#[test]
fn a_leader_blocked_in_a_fast_call_when_the_ring_goes_off_still_takes_its_signals_there() {
    // Phase 2 of ring_signals blocks in a pipe read that only the timer's handler ends
    // (ticks every 300 ms). A follower killed meanwhile switches the ring off; the leader,
    // still in the read it began on the ring, takes the first signal there as a record,
    // with the other follower, rather than "where each replica is" after 200 ms.
    let prog: Vec<std::ffi::OsString> = vec![
        fixture("ring_signals").into_os_string(),
        "500".into(),
        "300000".into(),
        "norestart".into(),
    ];
    let mut r = spawn(lockstep_run(&["-r", "3", FAST, "--no-reintegrate", "--stats"], &prog));
    r.wait_for_stdout("phase 1:", Duration::from_secs(30));
    let mut replicas: Vec<ProcInfo> = r
        .marked_processes()
        .into_iter()
        .filter(|p| p.argv0() == "ring_signals")
        .collect();
    replicas.sort_by_key(|p| p.pid);
    assert_eq!(replicas.len(), 3, "{replicas:#?}");
    // SAFETY: kill(2) of a replica of this test's own run.
    assert_eq!(unsafe { libc::kill(replicas[2].pid as libc::pid_t, libc::SIGKILL) }, 0);
    let out = r.finish(RUN_TIMEOUT);
    out.assert_code(0);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.ends_with("phase 2: read 'x', interrupted: yes\n"),
        "{}",
        out.context()
    );
    assert!(out.stderr.contains("[vote]"), "{}", out.context());
    assert!(!out.stderr.contains("[signal]"), "{}", out.context());
    // The first tick ends the read begun on the ring (a record); the reads after it meet
    // the monitor, which delivers the next ticks there.
    assert!(signals_in_ring(&out) >= 1, "{}", out.context());
}

#[test]
fn dmr_stops_a_corrupted_output_before_it_leaves() {
    let native = fast_target_native();
    for faulty in ["0", "1"] {
        let flip = format!("{faulty}:getppid:mem:rdi+0:2");
        let (out, events) = run_fast_target("2", &["--test-flip", &flip]);
        out.assert_code(86);
        assert_event(&events, "divergence", None, &out);
        assert_event(&events, "halt", None, &out);
        // Lines 0..9 went out; line 10 is the first one the faulty replica corrupted.
        assert_line_prefix(&out, &native, 10..=10);
    }
}

#[test]
fn tmr_masks_a_corrupted_follower_or_leader() {
    let native = fast_target_native();
    for faulty in [1u32, 0] {
        let flip = format!("{faulty}:getppid:mem:rdi+0:2");
        let (out, events) = run_fast_target("3", &["--test-flip", &flip]);
        out.assert_code(0).assert_stdout(&native);
        assert_event(&events, "divergence", None, &out);
        let killed: Vec<u64> = events
            .iter()
            .filter(|e| e["kind"] == "vote" && e["action"] == "kill")
            .filter_map(|e| e["replica"].as_u64())
            .collect();
        assert_eq!(
            killed,
            vec![faulty as u64],
            "{}\n{}",
            events_summary(&events),
            out.context()
        );
        assert_no_event(&events, "halt", &out);
    }
}

/// `lie:9`: the leader runs its 9th ring call (a write) with one byte fewer than it
/// compared, as a register flipped after its own check would make it.
fn run_lying_leader(replicas: &str, check: &str) -> (Output, Vec<Value>) {
    let ev = events_path("lie");
    let ev_arg = ev.to_string_lossy().into_owned();
    let opts = ["-r", replicas, FAST, "--output-check", check, "--events", &ev_arg];
    let mut cmd = lockstep_run(&opts, &[fixture("fast_target")]);
    cmd.env("LOCKSTEP_FAST_TEST", "lie:9");
    let out = run(cmd);
    let events = read_events_of(&ev, &out);
    (out, events)
}

#[test]
fn strict_checks_stop_a_leader_whose_output_differs_from_what_it_compared() {
    let native = fast_target_native();
    let (out, events) = run_lying_leader("2", "strict");
    out.assert_code(86);
    assert!(
        out.stderr.contains("failed the monitor's output check"),
        "{}",
        out.context()
    );
    assert_event(&events, "halt", None, &out);
    // The first 8 writes went out; the 9th never did.
    assert_line_prefix(&out, &native, 8..=8);
    let (out, events) = run_lying_leader("3", "strict");
    out.assert_code(0).assert_stdout(&native);
    assert_event(&events, "divergence", None, &out);
    assert_no_event(&events, "halt", &out);
    // Each new ring's leader lies again at its 9th call and is voted out, until the run
    // has used every ring it made (lockstep_run::fast::RINGS); then it goes on in ptrace.
    let elected = events.iter().filter(|e| e["kind"] == "leader").count();
    assert_eq!(elected, lockstep_run::fast::RINGS, "{}", events_summary(&events));
}

#[test]
fn with_in_process_checks_only_such_a_leader_goes_unnoticed() {
    // The reason strict checks exist: the same fault, checked by the leader alone.
    let native = fast_target_native();
    for r in ["2", "3"] {
        let (out, events) = run_lying_leader(r, "fast");
        assert_ne!(out.stdout, native, "{}", out.context());
        assert_no_event(&events, "divergence", &out);
    }
}

#[test]
fn strict_checks_agree_with_the_shim_on_every_fast_output() {
    let file = work_dir().join("fast_outputs.bin");
    let prog = [fixture("fast_outputs").into_os_string(), file.into_os_string()];
    let native = native_stdout(&prog);
    let count = |out: &Output, what: &str| {
        out.stderr
            .lines()
            .find_map(|l| l.trim().strip_prefix(what))
            .and_then(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
    };
    for r in ["2", "3"] {
        // 50 rounds of writev, pwrite64, pwritev, sendto, write, sendmsg and write, and
        // the last write. The committer writes the file's and the socket's (4 a round);
        // the pipe's (stdout) are checked at a stop.
        let out = run(lockstep_run(&["-r", r, FAST, "--stats"], &prog));
        out.assert_code(0).assert_stdout(&native);
        assert_eq!(count(&out, "outputs checked:"), Some(151), "{}", out.context());
        assert_eq!(count(&out, "outputs committed:"), Some(200), "{}", out.context());
        // The older strict path checks all of them at a stop.
        let out = run(lockstep_run(
            &["-r", r, FAST, "--output-check", "strict-stop", "--stats"],
            &prog,
        ));
        out.assert_code(0).assert_stdout(&native);
        assert_eq!(count(&out, "outputs checked:"), Some(351), "{}", out.context());
        assert_eq!(count(&out, "outputs committed:"), None, "{}", out.context());
    }
    let out = run(lockstep_run(
        &["-r", "2", FAST, "--output-check", "fast", "--stats"],
        &prog,
    ));
    out.assert_code(0).assert_stdout(&native);
    assert!(!out.stderr.contains("outputs checked"), "{}", out.context());
}

#[test]
fn a_killed_replica_is_voted_out_and_replaced_and_the_ring_goes_on() {
    let native = fast_target_native();
    for killed in ["2", "0"] {
        let flip = format!("{killed}:getppid:kill:0");
        let (out, events) = run_fast_target("3", &["--stats", "--test-flip", &flip]);
        out.assert_code(0).assert_stdout(&native);
        assert_event(&events, "vote", Some("kill"), &out);
        assert_event(&events, "reintegrate", Some("fork"), &out);
        // The kill comes before line 10; the new replica set takes a fresh ring, so all
        // 40 writes take the fast path (the first 10 in the first ring, 30 in the next).
        let (fast, _) = fast_and_intercepted(&out);
        assert_eq!(fast, 40, "{}", out.context());
    }
    let (out, events) = run_fast_target("2", &["--test-flip", "1:getppid:kill:0"]);
    out.assert_code(86);
    assert_event(&events, "halt", None, &out);
}

#[test]
fn the_watchdog_finds_a_replica_that_hangs_outside_the_monitor() {
    let native = fast_target_native();
    let (out, events) = run_fast_target("3", &["--timeout", "1", "--test-flip", "1:getppid:hang:0"]);
    out.assert_code(0).assert_stdout(&native);
    assert_event(&events, "timeout", None, &out);
    let (out, events) = run_fast_target("2", &["--timeout", "1", "--test-flip", "0:getppid:hang:0"]);
    out.assert_code(86);
    assert_event(&events, "timeout", None, &out);
    assert!(out.elapsed < RUN_TIMEOUT, "{}", out.context());
}

#[test]
fn a_corrupted_record_fails_its_crc_check() {
    let mut cmd = lockstep_run(&["-r", "2", FAST], &[fixture("fast_target")]);
    cmd.env("LOCKSTEP_FAST_TEST", "corrupt:5");
    let out = run(cmd);
    out.assert_code(86);
    assert!(out.stderr.contains("fails its CRC32C check"), "{}", out.context());
}

#[test]
fn a_result_changed_between_the_kernel_and_the_record_stops_the_run() {
    // `result:5`: the leader's 5th call (a write) returns, and a bit of its result flips
    // before the record is written, as a faulty register would make it. Every follower
    // would take that result and stay in step with the leader, so no vote could catch it;
    // the leader's check of its record against the result the gate stored does.
    // `wild-result:5`: the result register itself changes (bit 40) before any copy of it is
    // taken; the result is then out of range for the call (a write of 16 bytes).
    let native = fast_target_native();
    for (r, hook) in [("2", "result:5"), ("3", "result:5"), ("3", "wild-result:5")] {
        let mut cmd = lockstep_run(&["-r", r, FAST], &[fixture("fast_target")]);
        cmd.env("LOCKSTEP_FAST_TEST", hook);
        let out = run(cmd);
        out.assert_code(86);
        assert!(
            out.stderr.contains("does not match what the call returned"),
            "{}",
            out.context()
        );
        // The 5th write went out; nothing after it did.
        assert_line_prefix(&out, &native, 5..=5);
    }
}

#[test]
fn a_leader_lost_between_its_output_and_the_record_stops_the_run_instead_of_repeating_it() {
    // `crash:5`: the leader faults right after its 5th call (a write) returned, before its
    // record is out. Its successor would run that write again (found by a campaign: the
    // digest's one line printed twice). Judged at once, without waiting for the timeout:
    // the others ran the same code up to that call without the fault.
    let native = fast_target_native();
    for r in ["2", "3"] {
        // A straggler timeout longer than the test's own limit (RUN_TIMEOUT): waiting it
        // out fails the test.
        let mut cmd = lockstep_run(&["-r", r, FAST, "--timeout", "3600"], &[fixture("fast_target")]);
        cmd.env("LOCKSTEP_FAST_TEST", "crash:5");
        let out = run(cmd);
        out.assert_code(86);
        assert_line_prefix(&out, &native, 5..=5);
        if r == "3" {
            assert!(out.stderr.contains("may have run"), "{}", out.context());
        }
    }
}

/// A shim test hook (`LOCKSTEP_FAST_TEST`) that hurts one replica: under TMR it is voted
/// out and the output is whole, under DMR the run stops with 86; either way stderr says
/// `why`.
fn one_replica_hurt_is_masked_or_halts(hook: &str, timeout: &str, why: &str) {
    let native = fast_target_native();
    for r in ["2", "3"] {
        let mut cmd = lockstep_run(&["-r", r, FAST, "--timeout", timeout], &[fixture("fast_target")]);
        cmd.env("LOCKSTEP_FAST_TEST", hook);
        let out = run(cmd);
        if r == "3" {
            out.assert_code(0);
            assert_eq!(out.stdout, native, "{}", out.context());
        } else {
            out.assert_code(86);
        }
        assert!(out.stderr.contains(why), "{}", out.context());
    }
}

#[test]
fn a_leader_that_spins_and_sleeps_on_the_ring_in_turn_is_a_straggler() {
    // `flap:5`: before its 5th call the leader spins in user space, then sleeps on ring
    // memory, then spins again, for ever, as a campaign's replica did with a corrupted
    // pointer into the ring (docs/results.md §33). Each look saw it in another state,
    // which reset both the straggler rule's timer and the cycle-of-waits rule's.
    one_replica_hurt_is_masked_or_halts("flap:5", "1", "without moving");
}

#[test]
fn a_leader_that_can_never_wake_is_a_straggler() {
    // `hang:5`: before its 5th call the leader waits in a private futex wait without a
    // timeout, as the only thread of its process: nothing can wake it (a fault did this
    // to redis in a campaign, which then hung until it was killed). The followers wait
    // for its record; after the straggler timeout the leader is a straggler.
    one_replica_hurt_is_masked_or_halts("hang:5", "1", "without moving");
}

#[test]
fn a_follower_whose_wait_gives_an_impossible_answer_reports_itself() {
    // `bad-wait:5`: the last follower's wait for record 5 answers something no wait
    // answers (a fault in the shim's own return value did this in a campaign: the follower
    // skipped the record, and every later turn of its replica waited until the client
    // gave up). The follower reports its own state as corrupt, at once (the straggler
    // timeout is longer than the test's own limit).
    one_replica_hurt_is_masked_or_halts("bad-wait:5", "3600", "state is corrupt");
}

#[test]
fn a_follower_at_an_input_where_the_leader_outputs_is_caught_not_waited_for() {
    // The follower waits for the leader's record of an input, the leader for the
    // follower's vote on an output: each waited for the other until the run hung. Now the
    // leader sees the follower waiting for its record and takes the call to the monitor.
    let prog = fixture("fast_branch");
    let native = native_stdout(&[&prog]);
    let (out, events) = {
        let ev = events_path("branch");
        let ev_arg = ev.to_string_lossy().into_owned();
        let opts = [
            "-r",
            "3",
            FAST,
            "--timeout",
            "5",
            "--events",
            &ev_arg,
            "--test-flip",
            "2:getppid:mem:rdi+0:0",
        ];
        let out = run(lockstep_run(&opts, &[&prog]));
        let events = read_events_of(&ev, &out);
        (out, events)
    };
    out.assert_code(0).assert_stdout(&native);
    assert_event(&events, "divergence", None, &out);
    assert_no_event(&events, "timeout", &out);
    let out = run(lockstep_run(
        &[
            "-r",
            "2",
            FAST,
            "--timeout",
            "5",
            "--test-flip",
            "1:getppid:mem:rdi+0:0",
        ],
        &[&prog],
    ));
    out.assert_code(86);
    assert!(!out.stderr.contains("[timeout]"), "{}", out.context());
}

#[test]
fn a_replica_that_faults_while_the_others_wait_in_the_ring_is_the_one_voted_out() {
    // Bit 20 of rip flipped at getppid: that replica faults on its way back, reaches the
    // monitor, and the others wait for it in the ring. Counting the waiting ones as the
    // stragglers halted a run TMR should mask.
    let native = fast_target_native();
    for faulty in ["1", "0"] {
        let flip = format!("{faulty}:getppid:rip:20");
        let (out, events) = run_fast_target("3", &["--timeout", "1", "--test-flip", &flip]);
        out.assert_code(0).assert_stdout(&native);
        assert_event(&events, "timeout", Some("vote"), &out);
        assert_no_event(&events, "halt", &out);
    }
    let (out, _) = run_fast_target("2", &["--timeout", "1", "--test-flip", "1:getppid:rip:20"]);
    out.assert_code(86);
}

#[test]
fn with_dispatch_broken_the_seccomp_backstop_still_sees_every_call() {
    let native = fast_target_native();
    // The selector left open: nothing is rewritten, every call reaches seccomp directly.
    let mut cmd = lockstep_run(&["-r", "2", FAST, "--stats"], &[fixture("fast_target")]);
    cmd.env("LOCKSTEP_FAST_TEST", "selector-allow");
    let out = run(cmd);
    out.assert_code(0).assert_stdout(&native);
    let (fast, intercepted) = fast_and_intercepted(&out);
    assert_eq!(fast, 0, "{}", out.context());
    assert!(intercepted > 40, "{}", out.context());
    // And a fault is still caught, by the monitor.
    let mut cmd = lockstep_run(
        &["-r", "2", FAST, "--test-flip", "1:getppid:mem:rdi+0:2"],
        &[fixture("fast_target")],
    );
    cmd.env("LOCKSTEP_FAST_TEST", "selector-allow");
    let out = run(cmd);
    out.assert_code(86);
    assert!(out.stderr.contains("[divergence]"), "{}", out.context());
}

/// The ring's mappings in `pid`: (permissions, size, VmFlags) per mapping.
fn ring_mappings(pid: u32) -> Vec<(String, u64, String)> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap_or_default();
    let mut found = Vec::new();
    let mut current: Option<(String, u64)> = None;
    for line in smaps.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields
            .first()
            .is_some_and(|f| f.contains('-') && f.chars().next().is_some_and(|c| c.is_ascii_hexdigit()))
        {
            current = line.contains("lockstep-ring").then(|| {
                let (lo, hi) = fields[0].split_once('-').unwrap();
                let size = u64::from_str_radix(hi, 16).unwrap() - u64::from_str_radix(lo, 16).unwrap();
                (fields[1].to_string(), size)
            });
        } else if let Some(flags) = line.strip_prefix("VmFlags:") {
            if let Some((perms, size)) = current.take() {
                found.push((perms, size, flags.trim().to_string()));
            }
        }
    }
    found
}

#[test]
fn each_replica_may_write_only_its_own_region_and_the_mappings_are_sealed() {
    let running = spawn(lockstep_run(&["-r", "3", FAST], &["sleep", "30"]));
    // The replicas are the marked `sleep` processes that mapped the ring.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let replicas = loop {
        let with_ring: Vec<u32> = running
            .marked_processes()
            .into_iter()
            .filter(|p| p.cmdline.first().is_some_and(|c| c == "sleep"))
            .map(|p| p.pid)
            .filter(|&pid| !ring_mappings(pid).is_empty())
            .collect();
        if with_ring.len() == 3 || std::time::Instant::now() > deadline {
            break with_ring;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let maps: Vec<_> = replicas.iter().map(|&pid| ring_mappings(pid)).collect();
    running.signal(libc::SIGTERM);
    assert_eq!(replicas.len(), 3, "three replicas with the ring mapped");
    for maps in maps {
        // A replica's regions (one per lane, 4 MiB each) in one mapping; the clock areas
        // (a few MiB) are writable by all.
        let regions: Vec<&(String, u64, String)> = maps.iter().filter(|m| m.1 >= 32 << 20).collect();
        assert_eq!(regions.len(), 3, "{maps:?}");
        let writable = regions.iter().filter(|m| m.0.starts_with("rw")).count();
        assert_eq!(writable, 1, "exactly its own region is writable: {maps:?}");
        assert!(
            maps.iter().all(|m| m.2.split(' ').any(|f| f == "sl")),
            "every ring mapping is sealed: {maps:?}"
        );
        assert!(
            maps.iter().any(|m| m.0.starts_with("r--") && m.1 == 4096),
            "the header is read-only: {maps:?}"
        );
    }
}

#[test]
fn falls_back_to_ptrace_with_one_line_where_the_fast_path_cannot_work() {
    // flip_target is static: no shim can be preloaded.
    let out = run(lockstep_run(&["-r", "2", FAST], &[fixture("flip_target")]));
    out.assert_code(0).assert_stdout(&flip_target_native());
    let notes: Vec<&str> = out.stderr.lines().filter(|l| l.contains("--backend fast")).collect();
    assert_eq!(notes.len(), 1, "{}", out.context());
    assert!(notes[0].contains("statically linked"), "{}", out.context());
    let out = run(lockstep_run(&["-r", "2", "--backend", "nonsense"], &["true"]));
    out.assert_code(2);
}

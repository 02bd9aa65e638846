//! Fault injection with the hidden `--test-flip REPLICA:SYSCALL:TARGET:BIT` option on
//! the deterministic, freestanding `flip_target` fixture (20 lines, one write(2)
//! each; see tests/fixtures/flip_target.c and FLIP_K in common/mod.rs).
//!
//! * DMR (-r 2): any divergence stops everything with exit 86; the divergent bytes
//!   never reach stdout, so stdout is a proper, line-aligned prefix of the native
//!   output.
//! * TMR (-r 3): the faulty replica is voted out, output is exactly native, exit 0,
//!   and (unless --no-reintegrate) a replacement replica is forked.
//!
//! Targets used:
//!   mem:rsi+0 bit 2  - first byte of the write buffer: 's' (0x73) becomes 'w' (0x77);
//!   rdx bit 0        - the write length: one byte more or less is written;
//!   r12 bit 40       - flip_target keeps its accumulator in r12 across the write, so
//!                      this is a latent fault: the current line is fine, every later
//!                      line of that replica differs;
//!   rip bit 40       - the replica jumps to an unmapped address after the syscall
//!                      and crashes;
//!   kill / hang      - the replica is SIGKILLed / spins forever (straggler).

mod common;
use common::*;
use serde_json::Value;

const MEM_FLIP_BIT: u8 = 2;

fn flip(replica: u32, k: u32, target: &str, bit: u32) -> String {
    format!("{replica}:{k}:{target}:{bit}")
}

/// Runs flip_target under `lockstep run <opts> --events F --test-flip <spec>...`.
fn run_flip(opts: &[&str], flips: &[String]) -> (Output, Vec<Value>) {
    let ev = events_path("flip");
    let mut args: Vec<String> = opts.iter().map(|s| s.to_string()).collect();
    args.push("--events".into());
    args.push(ev.to_string_lossy().into_owned());
    for f in flips {
        args.push("--test-flip".into());
        args.push(f.clone());
    }
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = run(lockstep_run(&argv, &[fixture("flip_target")]));
    let events = read_events_of(&ev, &out);
    (out, events)
}

/// Checks that a TMR run masked a fault of replica `faulty`.
#[track_caller]
fn assert_masked(out: &Output, events: &[Value], faulty: u32, reintegrate: bool) {
    let native = flip_target_native();
    out.assert_code(0).assert_stdout(&native);
    assert_event(events, "divergence", None, out);
    assert_event(events, "vote", Some("kill"), out);
    let killed: Vec<u64> = events
        .iter()
        .filter(|e| e["kind"] == "vote" && e["action"] == "kill")
        .filter_map(|e| e["replica"].as_u64())
        .collect();
    assert!(
        killed.is_empty() || killed.contains(&(faulty as u64)),
        "replica {faulty} was faulty but the vote killed {killed:?}\n{}\n{}",
        events_summary(events),
        out.context()
    );
    if faulty == 0 {
        assert_event(events, "leader", None, out);
    }
    if reintegrate {
        // back to three replicas
        assert_event(events, "reintegrate", Some("fork"), out);
    } else {
        assert_no_event(events, "reintegrate", out);
    }
    assert_no_event(events, "halt", out);
}

/// Checks that a DMR (or no-majority) run stopped with 86 before the divergent
/// output, having printed between `lines` complete native lines.
#[track_caller]
fn assert_halted(out: &Output, events: &[Value], lines: std::ops::RangeInclusive<usize>) {
    let native = flip_target_native();
    out.assert_code(86);
    assert_line_prefix(out, &native, lines);
    assert_event(events, "halt", Some("halt"), out);
}

// --- DMR: detect and stop ------------------------------------------------------------

#[test]
fn dmr_follower_memory_flip_halts() {
    let (out, ev) = run_flip(&["-r", "2"], &[flip(1, FLIP_K, "mem:rsi+0", MEM_FLIP_BIT as u32)]);
    let k = FLIP_K as usize;
    assert_halted(&out, &ev, k - 3..=k - 1);
    assert_no_corrupted_line(&out, &String::from_utf8_lossy(&flip_target_native()), MEM_FLIP_BIT);
    assert_event(&ev, "divergence", None, &out);
}

#[test]
fn dmr_leader_memory_flip_halts() {
    let (out, ev) = run_flip(&["-r", "2"], &[flip(0, FLIP_K, "mem:rsi+0", MEM_FLIP_BIT as u32)]);
    let k = FLIP_K as usize;
    assert_halted(&out, &ev, k - 3..=k - 1);
    assert_no_corrupted_line(&out, &String::from_utf8_lossy(&flip_target_native()), MEM_FLIP_BIT);
}

#[test]
fn dmr_latent_register_flip_halts() {
    // r12 holds the accumulator: the line written at stop K is still right, the next
    // one differs.
    let (out, ev) = run_flip(&["-r", "2"], &[flip(1, FLIP_K, "r12", 40)]);
    let k = FLIP_K as usize;
    assert_halted(&out, &ev, k - 3..=k);
}

#[test]
fn dmr_length_register_flip_halts() {
    let (out, ev) = run_flip(&["-r", "2"], &[flip(1, FLIP_K, "rdx", 0)]);
    let k = FLIP_K as usize;
    assert_halted(&out, &ev, k - 3..=k - 1);
}

// --- TMR: mask, vote out, re-integrate -----------------------------------------------

#[test]
fn tmr_follower_memory_flip_masked() {
    let (out, ev) = run_flip(&["-r", "3"], &[flip(1, FLIP_K, "mem:rsi+0", MEM_FLIP_BIT as u32)]);
    assert_masked(&out, &ev, 1, true);
}

#[test]
fn tmr_leader_memory_flip_masked() {
    let (out, ev) = run_flip(&["-r", "3"], &[flip(0, FLIP_K, "mem:rsi+0", MEM_FLIP_BIT as u32)]);
    assert_masked(&out, &ev, 0, true);
}

#[test]
fn tmr_follower_register_flip_masked() {
    let (out, ev) = run_flip(&["-r", "3"], &[flip(1, FLIP_K, "rdx", 0)]);
    assert_masked(&out, &ev, 1, true);
}

#[test]
fn tmr_leader_register_flip_masked() {
    let (out, ev) = run_flip(&["-r", "3"], &[flip(0, FLIP_K, "rdx", 0)]);
    assert_masked(&out, &ev, 0, true);
}

#[test]
fn tmr_latent_register_flip_masked() {
    let (out, ev) = run_flip(&["-r", "3"], &[flip(2, FLIP_K, "r12", 40)]);
    assert_masked(&out, &ev, 2, true);
}

#[test]
fn tmr_no_reintegrate_still_masks() {
    let (out, ev) = run_flip(
        &["-r", "3", "--no-reintegrate"],
        &[flip(1, FLIP_K, "mem:rsi+0", MEM_FLIP_BIT as u32)],
    );
    assert_masked(&out, &ev, 1, false);
}

/// Two faults in different replicas, one after the other. Only if the first faulty
/// replica was replaced (re-integration back to 3) can the second one be outvoted.
#[test]
fn tmr_reintegration_masks_a_second_fault() {
    let flips = [
        flip(1, FLIP_K_EARLY, "mem:rsi+0", MEM_FLIP_BIT as u32),
        flip(2, FLIP_K_LATE, "mem:rsi+0", MEM_FLIP_BIT as u32),
    ];
    let (out, ev) = run_flip(&["-r", "3"], &flips);
    out.assert_code(0).assert_stdout(&flip_target_native());
    let kills = ev
        .iter()
        .filter(|e| e["kind"] == "vote" && e["action"] == "kill")
        .count();
    assert!(
        kills >= 2,
        "expected two replicas voted out; events:\n{}\n{}",
        events_summary(&ev),
        out.context()
    );
    assert_event(&ev, "reintegrate", Some("fork"), &out);
    assert_no_event(&ev, "halt", &out);
}

/// The same two faults without re-integration: after the first, only two replicas
/// are left, so the second fault cannot be outvoted and lockstep must stop.
#[test]
fn tmr_without_reintegration_second_fault_halts() {
    let flips = [
        flip(1, FLIP_K_EARLY, "mem:rsi+0", MEM_FLIP_BIT as u32),
        flip(2, FLIP_K_LATE, "mem:rsi+0", MEM_FLIP_BIT as u32),
    ];
    let (out, ev) = run_flip(&["-r", "3", "--no-reintegrate"], &flips);
    let k = FLIP_K_LATE as usize;
    assert_halted(&out, &ev, k - 3..=k - 1);
    assert_no_corrupted_line(&out, &String::from_utf8_lossy(&flip_target_native()), MEM_FLIP_BIT);
    assert_no_event(&ev, "reintegrate", &out);
}

// --- stragglers ------------------------------------------------------------------------

#[test]
fn tmr_straggler_is_timed_out() {
    let (out, ev) = run_flip(&["-r", "3", "--timeout", "1"], &[flip(2, FLIP_K, "hang", 0)]);
    out.assert_code(0).assert_stdout(&flip_target_native());
    assert_event(&ev, "timeout", None, &out);
    assert_no_event(&ev, "halt", &out);
}

#[test]
fn dmr_straggler_halts() {
    let (out, ev) = run_flip(&["-r", "2", "--timeout", "1"], &[flip(1, FLIP_K, "hang", 0)]);
    let k = FLIP_K as usize;
    assert_halted(&out, &ev, k - 3..=k);
    assert_event(&ev, "timeout", None, &out);
}

// --- crashed replicas --------------------------------------------------------------------

#[test]
fn tmr_killed_replica_masked() {
    let (out, ev) = run_flip(&["-r", "3"], &[flip(1, FLIP_K, "kill", 0)]);
    out.assert_code(0).assert_stdout(&flip_target_native());
    assert_event(&ev, "divergence", None, &out);
    assert_no_event(&ev, "halt", &out);
}

#[test]
fn tmr_crashed_replica_masked() {
    // rip bit 40: after the syscall the replica jumps into unmapped memory (SIGSEGV).
    let (out, ev) = run_flip(&["-r", "3"], &[flip(1, FLIP_K, "rip", 40)]);
    out.assert_code(0).assert_stdout(&flip_target_native());
    assert_event(&ev, "divergence", None, &out);
    assert_no_event(&ev, "halt", &out);
}

#[test]
fn dmr_killed_replica_halts() {
    let (out, ev) = run_flip(&["-r", "2"], &[flip(1, FLIP_K, "kill", 0)]);
    let k = FLIP_K as usize;
    assert_halted(&out, &ev, k - 3..=k);
    assert_event(&ev, "divergence", None, &out);
}

// --- the events file ------------------------------------------------------------------------

#[test]
fn events_file_schema() {
    let t0 = now_f64();
    let (out, ev) = run_flip(&["-r", "3"], &[flip(1, FLIP_K, "mem:rsi+0", MEM_FLIP_BIT as u32)]);
    let t1 = now_f64();
    out.assert_code(0);
    assert!(
        ev.len() >= 3,
        "expected at least divergence, vote and reintegrate events:\n{}",
        events_summary(&ev)
    );
    let mut last_ts = 0.0;
    for e in &ev {
        check_event_schema(e);
        let ts = e["ts"].as_f64().unwrap();
        assert!(
            ts >= t0 - 1.0 && ts <= t1 + 1.0,
            "event ts {ts} outside the run [{t0}, {t1}]: {e}"
        );
        assert!(ts >= last_ts, "event timestamps go backwards: {e}");
        last_ts = ts;
    }
    for kind in ["divergence", "vote", "reintegrate"] {
        assert_event(&ev, kind, None, &out);
    }
    // The vote that kills names the replica it killed.
    for e in ev.iter().filter(|e| e["kind"] == "vote" && e["action"] == "kill") {
        assert!(e["replica"].is_u64(), "a vote-kill event without the replica: {e}");
    }
    // Every event also has its human line on stderr.
    let mut kinds: Vec<&str> = ev.iter().map(|e| e["kind"].as_str().unwrap()).collect();
    kinds.sort();
    kinds.dedup();
    for kind in kinds {
        let in_file = events_of(&ev, kind).len();
        let prefix = format!("lockstep run: [{kind}]");
        let on_stderr = out.stderr.lines().filter(|l| l.starts_with(&prefix)).count();
        assert_eq!(
            in_file,
            on_stderr,
            "{kind}: {in_file} events in the file but {on_stderr} stderr lines\n{}",
            out.context()
        );
    }
}

/// TMR: while a second thread is blocked in a read that the leader runs for everyone, the
/// leader's output is corrupted and the leader is voted out. The blocked read runs again
/// with the new leader (before, its followers waited for the dead leader forever), and the
/// output is the native one.
#[test]
fn a_call_the_voted_out_leader_was_running_runs_again() {
    let prog = fixture("leader_dies_mid_call");
    for _ in 0..3 {
        let out = run(lockstep_run(
            &["-r", "3", "--test-flip", "0:10:mem:rsi+0:2"],
            &[prog.as_os_str()],
        ));
        out.assert_code(0).assert_stdout(b"main\nreader\n");
        assert!(out.stderr.contains("replica 0 voted out"), "{}", out.context());
    }
}

/// TMR: the leader dies inside a fork that every replica runs (killed once the monitor let
/// it run the call). The survivors' results must not come from the dead leader: its stale
/// result, 0, was every replica's, so each survivor's shell went on as the child, and the
/// rest of the script's output was lost with exit 0 (a wrong answer, not a detection).
#[test]
fn a_leader_killed_inside_a_fork_leaves_each_parent_its_child() {
    for backend in ["ptrace", "fast"] {
        let out = run(lockstep_run(
            &["-r", "3", "--backend", backend, "--test-flip", "0:clone:kill-in-call:0"],
            &["/bin/bash", "-c", "echo a; /bin/true; echo b"],
        ));
        out.assert_code(0).assert_stdout(b"a\nb\n");
        assert!(out.stderr.contains("replica 0 voted out"), "{}", out.context());
    }
}

/// TMR: the leader dies inside a `read` of a regular file (the loader's read of libc's ELF
/// header, the first read of any dynamically linked program). The read completes in
/// microseconds and moves the offset of the file the replicas share, so the new leader's
/// read again started past the header: "invalid ELF header", exit 127 (with a data file,
/// skipped data and a wrong answer). It cannot be told whether the read ran, so the run
/// stops with 86.
#[test]
fn a_leader_killed_inside_a_read_of_a_regular_file_stops_the_run() {
    for backend in ["ptrace", "fast"] {
        let out = run(lockstep_run(
            &["-r", "3", "--backend", backend, "--test-flip", "0:read:kill-in-call:0"],
            &["/bin/echo", "hi"],
        ));
        out.assert_code(86);
        assert!(
            out.stderr.contains("inside read() of a regular file"),
            "{}",
            out.context()
        );
    }
}

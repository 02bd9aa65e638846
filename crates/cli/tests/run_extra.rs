//! Refused syscalls, the lockstep_trace() API, CPU placement, and a real build with make.

mod common;
use common::*;
use lockstep_core::le;
use std::time::Duration;

#[test]
fn unsupported_syscall_is_named_and_stops_with_125() {
    let prog = fixture("unsupported");
    let out = run(lockstep_run(&["-r", "2"], &[prog.as_os_str()]));
    out.assert_code(125);
    let err = &out.stderr;
    assert!(
        err.contains("userfaultfd"),
        "stderr must name the syscall:\n{}",
        out.context()
    );
    // Everything before the refused call got out, nothing after it.
    assert_eq!(out.stdout_str(), "before\n", "{}", out.context());
    // Said once (its event line), not once more as lockstep's own error.
    assert_eq!(err.matches("userfaultfd").count(), 1, "{}", out.context());
    let quiet = run(lockstep_run(&["-q", "-r", "2"], &[prog.as_os_str()]));
    quiet.assert_code(125);
    assert_eq!(quiet.stderr.matches("userfaultfd").count(), 1, "{}", quiet.context());
}

/// Setting the clock is replicated (done once by the leader), not refused. (Syscalls outside
/// the table are named from the kernel's list: a unit test of `lockstep-trace`.)
#[test]
fn clock_settime_is_replicated() {
    let script = "import time\ntime.clock_settime(time.CLOCK_REALTIME, time.time())\nprint('set')\n";
    let py = python3();
    let out = run(lockstep_run(&["-r", "2"], &[py.to_str().unwrap(), "-c", script]));
    out.assert_code(0).assert_stdout(b"set\n");
}

// --- O_PATH ------------------------------------------------------------------------------

/// O_PATH descriptors (open, openat, openat2, fchmodat with AT_SYMLINK_NOFOLLOW): the same
/// output as natively under DMR and TMR.
#[test]
fn o_path_descriptors_work_as_natively() {
    let prog = fixture("o_path");
    let native_dir = scratch_dir("opath");
    let want = native_stdout(&[prog.to_str().unwrap(), native_dir.to_str().unwrap()]);
    for r in ["2", "3"] {
        for mode in ["args", "io"] {
            let dir = scratch_dir("opath");
            let out = run(lockstep_run(
                &["-r", r, "--compare", mode],
                &[prog.to_str().unwrap(), dir.to_str().unwrap()],
            ));
            out.assert_code(0).assert_stdout(&want);
        }
    }
}

/// An O_PATH descriptor passed over a socket cannot be installed into the followers:
/// lockstep stops with 125 and says which call, once, with an `internal` event.
#[test]
fn an_internal_failure_names_its_syscall() {
    let prog = fixture("o_path");
    let ev = events_path("internal");
    let out = run(lockstep_run(
        &["-r", "2", "--events", ev.to_str().unwrap()],
        &[prog.to_str().unwrap(), "--pass"],
    ));
    out.assert_code(125);
    assert_eq!(out.stderr.matches("recvmsg").count(), 1, "{}", out.context());
    let events = read_events_of(&ev, &out);
    let internal: Vec<&serde_json::Value> = events.iter().filter(|e| e["kind"] == "internal").collect();
    assert_eq!(internal.len(), 1, "{events:?}");
    assert_eq!(internal[0]["object"], "recvmsg");
}

/// LOCKSTEP_DUMP_AFTER describes a run that seems stuck: once it has lasted that long, the
/// monitor prints each task's phase and what each replica arrived with (here the sleep the
/// leader runs for everyone), and the run itself goes on undisturbed.
#[test]
fn a_state_dump_names_the_call_a_long_run_waits_in() {
    let mut cmd = lockstep_run(&["-r", "2"], &["sh", "-c", "sleep 2; echo done"]);
    cmd.env("LOCKSTEP_DUMP_AFTER", "1");
    let out = run(cmd);
    out.assert_code(0);
    assert_eq!(out.stdout_str(), "done\n", "{}", out.context());
    let dump = out
        .stderr
        .split("lockstep: state after")
        .nth(1)
        .unwrap_or_else(|| panic!("no dump: {}", out.context()));
    let nanosleep = format!("nr: {}", libc::SYS_clock_nanosleep);
    let sleeping = dump
        .lines()
        .take_while(|l| !l.is_empty())
        .any(|l| l.starts_with("task ") && l.contains("Leader") && l.contains(&nanosleep));
    assert!(sleeping, "the dump names the sleep: {}", out.context());
    for r in 0..2 {
        assert!(dump.contains(&format!("  replica {r}: tid ")), "{}", out.context());
    }
}

#[test]
fn lockstep_trace_is_a_noop_natively() {
    let prog = fixture("trace_native");
    let out = run(native_cmd(&[prog.as_os_str()]));
    out.assert_code(0);
    assert_eq!(out.stdout_str(), "ok\n");
}

/// Flips a bit of the traced buffer in replica 1 at its trace call (stop 2).
fn traced_flip(mode: &str) -> (Output, Vec<serde_json::Value>) {
    let prog = fixture("trace_user");
    let ev = events_path("trace");
    let evs = ev.to_string_lossy().into_owned();
    let opts = [
        "-r",
        "2",
        "--compare",
        mode,
        "--events",
        &evs,
        "--test-flip",
        "1:2:mem:rdi+0:3",
    ];
    let out = run(lockstep_run(&opts, &[prog.as_os_str()]));
    let events = read_events_of(&ev, &out);
    (out, events)
}

#[test]
fn lockstep_trace_without_fault_agrees() {
    let prog = fixture("trace_user");
    for mode in ["io", "args", "every"] {
        let out = run(lockstep_run(&["-r", "2", "--compare", mode], &[prog.as_os_str()]));
        out.assert_code(0);
    }
}

#[test]
fn lockstep_trace_catches_a_silent_fault_in_args_mode() {
    // The program prints nothing, so only the traced state can reveal the flip; args mode
    // votes the signature at exit.
    let (out, events) = traced_flip("args");
    out.assert_code(86);
    assert_event(&events, "halt", Some("halt"), &out);
}

#[test]
fn lockstep_trace_is_voted_at_the_call_in_every_mode() {
    let (out, events) = traced_flip("every");
    out.assert_code(86);
    let divergence = events_of(&events, "divergence");
    assert!(
        divergence
            .iter()
            .any(|e| e["values"].to_string().contains("lockstep_trace")),
        "the divergence must be found at the lockstep_trace call itself:\n{}",
        out.context()
    );
}

#[test]
fn lockstep_trace_is_not_compared_in_io_mode() {
    // io mode compares externally visible outputs only; this program has none.
    let (out, _) = traced_flip("io");
    out.assert_code(0);
}

fn allowed_cpus(pid: u32) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .map(|v| v.trim().to_string())
        .unwrap_or_default()
}

/// Starts `sleep 5` under lockstep with `opts` and returns (monitor CPUs, sorted replica CPUs).
fn placement(opts: &[&str]) -> (String, Vec<String>) {
    let mut running = spawn(lockstep_run(opts, &["sleep", "5"]));
    let procs = running.wait_for_processes("two sleep replicas", Duration::from_secs(10), |ps| {
        ps.iter().filter(|p| p.argv0() == "sleep").count() == 2
    });
    let mut cpus: Vec<String> = procs
        .iter()
        .filter(|p| p.argv0() == "sleep")
        .map(|p| allowed_cpus(p.pid))
        .collect();
    cpus.sort();
    // The monitor is the child of the process we started (the front; see front.rs).
    let monitor_pid = procs
        .iter()
        .find(|p| p.ppid == running.pid && p.argv0() == "lockstep")
        .map(|p| p.pid)
        .expect("the monitor process");
    let monitor = allowed_cpus(monitor_pid);
    running.kill_everything();
    (monitor, cpus)
}

#[test]
fn cpus_pin_each_replica() {
    let (monitor, replicas) = placement(&["-r", "2", "--cpus", "0,1"]);
    assert_eq!(replicas, ["0", "1"], "replica 0 on CPU 0 and replica 1 on CPU 1");
    assert_eq!(monitor, "0-1", "the monitor is not pinned unless asked");
}

#[test]
fn monitor_cpu_pins_the_monitor_only() {
    let (monitor, replicas) = placement(&["-r", "2", "--cpus", "0,0", "--monitor-cpu", "1"]);
    assert_eq!(replicas, ["0", "0"]);
    assert_eq!(monitor, "1");
}

#[test]
fn cpus_outside_the_allowed_set_are_a_usage_error() {
    let out = run(lockstep_run(&["-r", "2", "--cpus", "4095"], &["true"]));
    out.assert_code(2);
    let out = run(lockstep_run(&["-r", "2", "--cpus", "x-y"], &["true"]));
    out.assert_code(2);
    let out = run(lockstep_run(&["-r", "2", "--monitor-cpu", "4095"], &["true"]));
    out.assert_code(2);
}

#[test]
fn make_builds_a_c_program_with_every_child_replicated() {
    let make_tree = |tag: &str| {
        let dir = scratch_dir(tag);
        std::fs::write(
            dir.join("Makefile"),
            "all: hello\nhello: hello.o util.o\n\t$(CC) -o $@ $^\n%.o: %.c\n\t$(CC) -O1 -c $< -o $@\n",
        )
        .unwrap();
        std::fs::write(
            dir.join("hello.c"),
            "#include <stdio.h>\nint util(int);\nint main(void){printf(\"%d\\n\", util(20));return 0;}\n",
        )
        .unwrap();
        std::fs::write(dir.join("util.c"), "int util(int x){return x*2+2;}\n").unwrap();
        dir
    };
    let native_dir = make_tree("make-native");
    let native = run(native_cmd(&["make", "-s", "-C", native_dir.to_str().unwrap()]));
    native.assert_code(0);
    let dir = make_tree("make-lockstep");
    let ev = events_path("make");
    let evs = ev.to_string_lossy().into_owned();
    let out = run(lockstep_run(
        &["-r", "3", "--events", &evs],
        &["make", "-s", "-C", dir.to_str().unwrap()],
    ));
    out.assert_code(0);
    assert_agreed(&read_events_of(&ev, &out), &out);
    let built = run(native_cmd(&[dir.join("hello").as_os_str()]));
    built.assert_code(0);
    assert_eq!(built.stdout_str(), "42\n");
}

#[test]
fn replicas_start_identically() {
    let prog = fixture("start_state");
    let native = run(native_cmd(&[prog.as_os_str()]));
    native.assert_code(0);
    assert!(
        native.stdout_str().contains("vdso=mapped"),
        "natively the vDSO is there:\n{}",
        native.context()
    );
    for replicas in ["2", "3"] {
        let ev = events_path("start");
        let evs = ev.to_string_lossy().into_owned();
        // Every byte printed is an output the replicas vote on: any difference in
        // AT_RANDOM, stack or heap addresses would be a divergence.
        let out = run(lockstep_run(&["-r", replicas, "--events", &evs], &[prog.as_os_str()]));
        out.assert_code(0);
        assert_agreed(&read_events_of(&ev, &out), &out);
        let text = out.stdout_str();
        assert!(
            text.contains("vdso=hidden"),
            "the vDSO must be hidden:\n{}",
            out.context()
        );
        assert!(text.starts_with("at_random=") && text.lines().next().unwrap().len() == 10 + 32);
    }
}

#[test]
fn dev_urandom_and_getrandom_are_replicated() {
    let script = "head -c 32 /dev/urandom | od -An -tx1; python3 -c 'import os; print(os.urandom(16).hex())'";
    let ev = events_path("urandom");
    let evs = ev.to_string_lossy().into_owned();
    let out = run(lockstep_run(&["-r", "3", "--events", &evs], &["sh", "-c", script]));
    out.assert_code(0);
    assert_agreed(&read_events_of(&ev, &out), &out);
    assert_eq!(out.stdout_str().lines().count(), 3, "{}", out.context());
}

// --- --compare io: inputs run ahead in the leader, outputs are meeting points -------

/// 20 lines of 16 bytes: each write of io_copy emits exactly one line.
fn io_copy_input() -> (std::path::PathBuf, String) {
    let text: String = (1..=20).map(|i| format!("line {i:02} of text\n")).collect();
    assert!(text.lines().all(|l| l.len() + 1 == 16));
    let path = scratch_dir("io-copy").join("input.txt");
    std::fs::write(&path, &text).unwrap();
    (path, text)
}

/// Flips bit 2 of the first byte of write #3 (stop 8) in `replica`.
fn io_copy_flip(replicas: &str, replica: u32) -> (Output, Vec<serde_json::Value>, String) {
    let (input, text) = io_copy_input();
    let ev = events_path("io-copy");
    let evs = ev.to_string_lossy().into_owned();
    let flip = format!("{replica}:8:mem:rsi+0:2");
    let opts = [
        "-r",
        replicas,
        "--compare",
        "io",
        "--events",
        &evs,
        "--test-flip",
        &flip,
    ];
    let out = run(lockstep_run(
        &opts,
        &[fixture("io_copy").as_os_str(), input.as_os_str()],
    ));
    let events = read_events_of(&ev, &out);
    (out, events, text)
}

#[test]
fn io_mode_copies_input_exactly() {
    let (input, text) = io_copy_input();
    for replicas in ["2", "3"] {
        let ev = events_path("io-copy");
        let evs = ev.to_string_lossy().into_owned();
        let opts = ["-r", replicas, "--compare", "io", "--events", &evs];
        let out = run(lockstep_run(
            &opts,
            &[fixture("io_copy").as_os_str(), input.as_os_str()],
        ));
        out.assert_code(0);
        assert_eq!(out.stdout_str(), text, "{}", out.context());
        assert_agreed(&read_events_of(&ev, &out), &out);
    }
}

#[test]
fn io_mode_masks_a_follower_fault() {
    let (out, events, text) = io_copy_flip("3", 1);
    out.assert_code(0);
    let seen = events_of(&events, "divergence")
        .iter()
        .any(|e| e.to_string().contains("hine 03"));
    assert!(
        seen,
        "the divergence must be the corrupted third line:\n{}",
        out.context()
    );
    assert_eq!(out.stdout_str(), text, "{}", out.context());
    assert_event(&events, "divergence", None, &out);
    assert_event(&events, "vote", Some("kill"), &out);
}

#[test]
fn io_mode_masks_a_leader_fault() {
    let (out, events, text) = io_copy_flip("3", 0);
    out.assert_code(0);
    assert_eq!(out.stdout_str(), text, "{}", out.context());
    assert_event(&events, "leader", Some("elect"), &out);
}

#[test]
fn io_mode_dmr_halts_before_the_corrupted_line() {
    let (out, events, text) = io_copy_flip("2", 1);
    out.assert_code(86);
    assert_event(&events, "halt", Some("halt"), &out);
    let printed = out.stdout_str();
    assert!(
        text.starts_with(&printed),
        "only correct lines may leave:\n{}",
        out.context()
    );
    // 'l' (0x6c) with bit 2 flipped is 'h': the flip hit write #3, and it never left.
    let corrupted = "hine 03";
    let seen = events_of(&events, "divergence")
        .iter()
        .any(|e| e.to_string().contains(corrupted));
    assert!(
        seen,
        "the divergence must be the corrupted third line:\n{}",
        out.context()
    );
    assert!(
        !printed.contains(corrupted),
        "the corrupted line must not leave:\n{}",
        out.context()
    );
}

/// A real server: Python's http.server answers a request from outside the replica set,
/// then gets SIGINT while it sits in poll(). The interrupted poll is re-run by every
/// replica from identical memory (the kernel had already written `revents` into the
/// leader's copy), so the replicas must still agree, and Python exits 0 on
/// KeyboardInterrupt.
#[test]
fn python_http_server_serves_and_stops_on_sigint() {
    use std::io::{Read, Write};
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let dir = scratch_dir("http");
    std::fs::write(dir.join("page.txt"), "hello from lockstep\n").unwrap();
    let ev = events_path("http");
    let evs = ev.to_string_lossy().into_owned();
    let py = python3();
    let port_s = port.to_string();
    let dir_s = dir.to_string_lossy().into_owned();
    let cmd = lockstep_run(
        &["-r", "3", "--events", &evs],
        &[
            py.as_os_str(),
            "-m".as_ref(),
            "http.server".as_ref(),
            port_s.as_ref(),
            "--bind".as_ref(),
            "127.0.0.1".as_ref(),
            "--directory".as_ref(),
            dir_s.as_ref(),
        ],
    );
    let mut running = spawn(cmd);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let body = loop {
        if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            s.write_all(b"GET /page.txt HTTP/1.0\r\n\r\n").unwrap();
            let mut reply = String::new();
            s.read_to_string(&mut reply).unwrap();
            break reply;
        }
        assert!(std::time::Instant::now() < deadline, "server did not come up");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(body.contains("hello from lockstep"), "reply: {body}");
    // Interrupt it in the first poll() after the request (poll times out every 500 ms;
    // that first poll is the one whose `revents` the leader's kernel has just rewritten):
    // wait until a replica sleeps in poll, as the kernel reports it.
    running.wait_for_processes("a replica asleep in poll()", Duration::from_secs(20), |procs| {
        procs
            .iter()
            .any(|p| std::fs::read_to_string(format!("/proc/{}/wchan", p.pid)).is_ok_and(|w| w.contains("poll")))
    });
    running.signal(libc::SIGINT);
    let out = running.finish(Duration::from_secs(30));
    out.assert_code(0);
    assert_agreed(&read_events_of(&ev, &out), &out);
}

#[test]
fn a_leader_read_with_a_corrupted_pointer_is_not_handed_to_the_followers() {
    // Read #3 is stop 7. Bit 44 of the leader's buffer pointer makes the kernel answer
    // EFAULT; handing that to healthy followers would end the copy early with exit 0 (an
    // sdc: two of twenty lines). The followers' own buffers are valid, so the group stops.
    let (input, text) = io_copy_input();
    for replicas in ["2", "3"] {
        let ev = events_path("io-efault");
        let evs = ev.to_string_lossy().into_owned();
        let opts = ["-r", replicas, "--events", &evs, "--test-flip", "0:7:rsi:44"];
        let out = run(lockstep_run(
            &opts,
            &[fixture("io_copy").as_os_str(), input.as_os_str()],
        ));
        out.assert_code(86);
        let events = read_events_of(&ev, &out);
        assert!(
            events_of(&events, "divergence")
                .iter()
                .any(|e| e.to_string().contains("EFAULT")),
            "{}",
            out.context()
        );
        assert!(
            text.starts_with(&out.stdout_str()),
            "only correct lines may leave:\n{}",
            out.context()
        );
    }
}

/// A divergence message says where the data first differ: the lengths, the offset of the
/// first differing byte, and the bytes around it in each replica.
#[test]
fn divergence_message_shows_the_first_difference() {
    let prog = fixture("flip_target");
    let out = run(lockstep_run(
        &["-r", "2", "--test-flip", "1:7:mem:rsi+5:2"],
        &[prog.as_os_str()],
    ));
    out.assert_code(86);
    let line = out
        .stderr
        .lines()
        .find(|l| l.contains("[divergence]"))
        .unwrap_or_else(|| panic!("no divergence line\n{}", out.context()));
    assert!(line.contains("first difference at byte 5"), "{line}");
    assert!(
        line.contains("replica 0 passes ") && line.contains(" bytes, replica 1 "),
        "{line}"
    );
    // The preview shows the buffer only, not the call's other arguments.
    assert!(!line.contains("\\x00"), "{line}");
}

// --- shared file mappings ------------------------------------------------------------------

/// The intercepted syscall stop of `shared_counter`'s msync (execve, rseq, prlimit64,
/// readlink, getrandom, openat, ftruncate, mmap, msync).
const MSYNC_STOP: u32 = 9;

fn counter_in(file: &std::path::Path) -> u64 {
    let bytes = std::fs::read(file).unwrap();
    le::u64_at(&bytes, 0)
}

/// A read-modify-write through a writable MAP_SHARED mapping gives the native result
/// (the file is written once, by the leader), under DMR and TMR and each compare mode.
#[test]
fn shared_file_mapping_is_written_once() {
    let prog = fixture("shared_counter");
    for r in ["2", "3"] {
        for mode in ["args", "io", "every"] {
            let file = scratch_dir("shm").join("counter");
            let out = run(lockstep_run(
                &["-r", r, "--compare", mode],
                &[prog.to_str().unwrap(), file.to_str().unwrap()],
            ));
            out.assert_code(0).assert_stdout(b"counter=1000\n");
            assert_eq!(counter_in(&file), 1000, "{}", out.context());
        }
    }
}

/// A flipped bit in one replica's mapping is caught at msync: DMR stops with 86; TMR
/// masks it, also when the faulty replica is the leader whose mapping is the file (the
/// new leader's copy is written back).
#[test]
fn a_flip_in_a_shared_mapping_is_caught_at_msync() {
    let prog = fixture("shared_counter");
    let flip = |r: u32| format!("{r}:{MSYNC_STOP}:mem:rdi+0:0");
    let file = scratch_dir("shm").join("counter");
    let out = run(lockstep_run(
        &["-r", "2", "--test-flip", &flip(1)],
        &[prog.to_str().unwrap(), file.to_str().unwrap()],
    ));
    out.assert_code(86);
    assert!(out.stderr.contains("msync"), "{}", out.context());
    for faulty in [0, 1] {
        let file = scratch_dir("shm").join("counter");
        let out = run(lockstep_run(
            &["-r", "3", "--test-flip", &flip(faulty)],
            &[prog.to_str().unwrap(), file.to_str().unwrap()],
        ));
        out.assert_code(0).assert_stdout(b"counter=1000\n");
        assert!(out.stderr.contains("voted out"), "{}", out.context());
        assert_eq!(counter_in(&file), 1000, "{}", out.context());
    }
}

/// A clock the kernel refuses fails as natively (EINVAL), instead of being answered from
/// the monitor's (or the fast path's) clock sequences with a made-up value.
#[test]
fn clocks_the_kernel_refuses_fail_as_natively() {
    let prog = fixture("clock_ids");
    let want = native_stdout(&[&prog]);
    for r in ["2", "3"] {
        let out = run(lockstep_run(&["-r", r], &[&prog]));
        out.assert_code(0).assert_stdout(&want);
    }
}

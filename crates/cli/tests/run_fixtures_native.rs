//! Sanity checks of the test fixtures themselves, run natively (no lockstep).
//! They make sure that a failure in the lockstep tests is about lockstep, not about
//! a broken fixture or helper, and they pin down the facts the fault-injection tests
//! rely on (flip_target's exact syscall sequence).

mod common;
use common::*;
use std::process::Command;
use std::time::Duration;

#[test]
fn fixtures_compile_with_warnings_as_errors() {
    for name in ["flip_target", "rdtsc_clock", "mmap_file", "echo_server", "threads"] {
        let p = fixture(name);
        assert!(p.exists(), "{name} was not built");
    }
}

/// flip_target must make exactly: execve, FLIP_LINES writes to fd 1, exit_group.
/// The choice of FLIP_K (see common/mod.rs and tests/README.md) depends on it.
#[test]
fn flip_target_syscall_sequence_is_as_documented() {
    let bin = fixture("flip_target");
    let trace = work_dir().join(format!("flip_target-{}.strace", unique_marker("strace")));
    let res = Command::new("strace")
        .arg("-qq")
        .arg("-o")
        .arg(&trace)
        .arg(&bin)
        .output();
    // strace is in scripts/deps.sh: without it (or without ptrace) this check fails
    // instead of passing without having looked.
    let res = res.unwrap_or_else(|e| panic!("strace is needed for this check (scripts/deps.sh installs it): {e}"));
    assert!(
        res.status.success() || trace.exists(),
        "strace cannot trace here: {}",
        String::from_utf8_lossy(&res.stderr)
    );
    assert!(res.status.success(), "flip_target under strace failed: {res:?}");
    let text = std::fs::read_to_string(&trace).unwrap();
    let names: Vec<String> = text
        .lines()
        .map(|l| l.split('(').next().unwrap_or("").trim().to_string())
        .filter(|n| !n.is_empty() && !n.starts_with('+'))
        .collect();
    let mut expected = vec!["execve".to_string()];
    expected.extend((0..FLIP_LINES).map(|_| "write".to_string()));
    expected.push("exit_group".to_string());
    assert_eq!(
        names, expected,
        "flip_target syscalls changed; FLIP_K must be re-derived. strace:\n{text}"
    );
    for l in text.lines().filter(|l| l.starts_with("write(")) {
        assert!(l.starts_with("write(1, \"step "), "unexpected write {l}");
    }
    assert!((2..=FLIP_LINES as u32).contains(&FLIP_K) && (2..=FLIP_LINES as u32).contains(&FLIP_K_LATE));
}

#[test]
fn flip_target_native_output() {
    let out = flip_target_native();
    check_flip_target_output(&String::from_utf8_lossy(&out));
    // The corrupted line for the DMR test really differs from every real line.
    let text = String::from_utf8_lossy(&out);
    for l in text.split_inclusive('\n') {
        let bad = flip_first_byte(l, 2);
        assert_eq!(bad[0], b'w');
        assert!(!out.windows(bad.len()).any(|w| w == bad.as_slice()));
    }
}

#[test]
fn rdtsc_clock_native() {
    let t0 = now_f64();
    let out = native_stdout(&[fixture("rdtsc_clock")]);
    let t1 = now_f64();
    check_rdtsc_output(&String::from_utf8_lossy(&out), t0, t1);
}

#[test]
fn mmap_file_native_is_deterministic() {
    let input = random_file(300_000);
    let a = native_stdout(&[
        fixture("mmap_file").into_os_string(),
        input.clone().into(),
        scratch_dir("mm").join("o").into(),
    ]);
    let b = native_stdout(&[
        fixture("mmap_file").into_os_string(),
        input.into(),
        scratch_dir("mm").join("o").into(),
    ]);
    assert_eq!(a, b);
    let s = String::from_utf8_lossy(&a);
    assert!(
        s.contains("size 300000\n")
            && s.contains("private-equals-shared yes\n")
            && s.contains("mapped-back-matches yes\n"),
        "{s}"
    );
}

#[test]
fn threads_native() {
    let a = native_stdout(&[fixture("threads")]);
    let b = native_stdout(&[fixture("threads")]);
    assert_eq!(a, b);
    let s = String::from_utf8_lossy(&a);
    let lines: Vec<&str> = s.lines().collect();
    assert_eq!(lines.len(), 5, "{s}");
    for (i, l) in lines[..4].iter().enumerate() {
        assert!(l.starts_with(&format!("thread {i} result ")), "{s}");
    }
    assert!(lines[4].starts_with("threads done "), "{s}");
}

#[test]
fn echo_server_native() {
    let mut r = spawn(native_cmd(&[
        fixture("echo_server").into_os_string(),
        "0".into(),
        "2".into(),
    ]));
    let port = parse_port(&r.wait_for_stdout("\n", Duration::from_secs(20)));
    assert_eq!(echo_client(port, &["hello", "a b c", "", "last"]), 4);
    assert_eq!(echo_client(port, &["again"]), 1);
    let out = r.finish(RUN_TIMEOUT);
    out.assert_code(0)
        .assert_stdout(format!("PORT {port}\nserved 5 lines\n").as_bytes());
}

#[test]
fn py_workload_native() {
    let py = python3();
    let t0 = now_f64();
    let a = run(native_cmd(&[
        py.clone().into_os_string(),
        fixture_file("py_workload.py").into(),
        scratch_dir("py").into(),
    ]));
    let b = run(native_cmd(&[
        py.into_os_string(),
        fixture_file("py_workload.py").into(),
        scratch_dir("py").into(),
    ]));
    let t1 = now_f64();
    a.assert_code(0);
    b.assert_code(0);
    let (sa, sb) = (a.stdout_str(), b.stdout_str());
    assert_eq!(py_det_lines(&sa), py_det_lines(&sb));
    assert!(py_det_lines(&sa).len() >= 10 && sa.ends_with("det done\n"), "{sa}");
    check_py_nondet(&sa, t0, t1);
    assert_ne!(sa, sb, "the nondeterministic lines should differ between runs");
}

#[test]
fn sh_pipeline_native() {
    let out = native_stdout(&["sh", "-c", PIPELINE]);
    let s = String::from_utf8_lossy(&out);
    assert!(
        s.starts_with("faa\nejj\n") && s.ends_with("done\n") && s.lines().count() == 21,
        "{s}"
    );
}

#[test]
fn helpers_detect_orphans() {
    // A command that leaves a background process behind must be caught by the
    // pipe check in finish() (it keeps stdout open) - i.e. the orphan detection works.
    let r = spawn(native_cmd(&["sh", "-c", "sleep 20 & echo started"]));
    let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        r.finish_with_grace(Duration::from_secs(20), Duration::from_secs(1))
    }));
    assert!(res.is_err(), "a leftover background process was not detected");
}

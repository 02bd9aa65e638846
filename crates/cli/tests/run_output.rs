//! `lockstep run` must be transparent: for programs without faults, the output and
//! exit status are exactly those of a native run, and the replicas agree (no
//! divergence, vote-out, halt or timeout events).

mod common;
use common::*;
use std::ffi::OsString;
use std::time::Duration;

/// Runs `prog` natively and under `lockstep run <opts>`, and asserts identical
/// stdout, exit 0 and no disagreement events.
fn same_as_native(opts: &[&str], prog: &[OsString]) -> Output {
    let native = native_stdout(prog);
    let ev = events_path("same");
    let mut all: Vec<&str> = opts.to_vec();
    let evs = ev.to_string_lossy().into_owned();
    all.extend(["--events", &evs]);
    let out = run(lockstep_run(&all, prog));
    out.assert_code(0).assert_stdout(&native);
    assert_agreed(&read_events_of(&ev, &out), &out);
    out
}

fn os(v: &[&str]) -> Vec<OsString> {
    v.iter().map(OsString::from).collect()
}

// --- a fork/exec shell pipeline --------------------------------------------------

#[test]
fn sh_pipeline_dmr() {
    same_as_native(&["-r", "2"], &os(&["sh", "-c", PIPELINE]));
}

#[test]
fn sh_pipeline_tmr() {
    same_as_native(&["-r", "3"], &os(&["sh", "-c", PIPELINE]));
}

// --- reading a 4 MiB file --------------------------------------------------------

fn sha256sum_cmd() -> Vec<OsString> {
    vec!["sha256sum".into(), random_file(4 << 20).into()]
}

#[test]
fn sha256sum_dmr() {
    same_as_native(&["-r", "2"], &sha256sum_cmd());
}

#[test]
fn sha256sum_tmr() {
    same_as_native(&["-r", "3"], &sha256sum_cmd());
}

// --- compare modes ----------------------------------------------------------------

#[test]
fn compare_io() {
    same_as_native(&["-r", "2", "--compare", "io"], &os(&["sh", "-c", PIPELINE]));
}

#[test]
fn compare_args() {
    same_as_native(&["-r", "2", "--compare", "args"], &os(&["sh", "-c", PIPELINE]));
}

#[test]
fn compare_every() {
    same_as_native(&["-r", "2", "--compare", "every"], &os(&["sh", "-c", PIPELINE]));
}

#[test]
fn compare_every_tmr() {
    same_as_native(&["-r", "3", "--compare", "every"], &os(&["sh", "-c", PIPELINE]));
}

// --- Python: time, random, json, hashlib, threading, sqlite3 ----------------------

#[test]
fn python_workload_tmr() {
    let py = python3().into_os_string();
    let script: OsString = fixture_file("py_workload.py").into();
    let t0 = now_f64();
    let native = run(native_cmd(&[
        py.clone(),
        script.clone(),
        scratch_dir("py-native").into(),
    ]));
    native.assert_code(0);
    let ev = events_path("py");
    let out = run(lockstep_run(
        &["-r", "3", "--events", ev.to_str().unwrap()],
        &[py, script, scratch_dir("py-lockstep").into()],
    ));
    let t1 = now_f64();
    out.assert_code(0);
    let (n, l) = (native.stdout_str(), out.stdout_str());
    assert_eq!(
        py_det_lines(&l),
        py_det_lines(&n),
        "deterministic lines differ\n{}",
        out.context()
    );
    assert_eq!(
        line_shapes(&l, 2),
        line_shapes(&n, 2),
        "output structure differs\n{}",
        out.context()
    );
    check_py_nondet(&l, t0, t1);
    assert_agreed(&read_events_of(&ev, &out), &out);
}

// --- mmap of files -----------------------------------------------------------------

fn mmap_case(r: &str) {
    let input = random_file(300_000);
    let native = native_stdout(&[
        fixture("mmap_file").into_os_string(),
        input.clone().into(),
        scratch_dir("mm").join("out").into(),
    ]);
    let outdir = scratch_dir("mm");
    let ev = events_path("mmap");
    let out = run(lockstep_run(
        &["-r", r, "--events", ev.to_str().unwrap()],
        &[
            fixture("mmap_file").into_os_string(),
            input.into(),
            outdir.join("out").into(),
        ],
    ));
    out.assert_code(0).assert_stdout(&native);
    assert_agreed(&read_events_of(&ev, &out), &out);
    // The output file was written exactly once, completely.
    let written = std::fs::metadata(outdir.join("out")).expect("output file").len();
    assert_eq!(written, 256 * 1024 + 123);
}

#[test]
fn mmap_file_dmr() {
    mmap_case("2");
}

#[test]
fn mmap_file_tmr() {
    mmap_case("3");
}

// --- rdtsc, rdtscp, clock_gettime: all replicas see the same values ------------------

fn rdtsc_case(r: &str) {
    let native = String::from_utf8(native_stdout(&[fixture("rdtsc_clock")])).unwrap();
    let ev = events_path("rdtsc");
    let t0 = now_f64();
    let out = run(lockstep_run(
        &["-r", r, "--events", ev.to_str().unwrap()],
        &[fixture("rdtsc_clock")],
    ));
    let t1 = now_f64();
    out.assert_code(0);
    let s = out.stdout_str();
    check_rdtsc_output(&s, t0, t1);
    assert_eq!(
        line_shapes(&s, 1),
        line_shapes(&native, 1),
        "structure differs from native\n{}",
        out.context()
    );
    assert_agreed(&read_events_of(&ev, &out), &out);
}

#[test]
fn rdtsc_clock_dmr() {
    rdtsc_case("2");
}

#[test]
fn rdtsc_clock_tmr() {
    rdtsc_case("3");
}

// --- threads -------------------------------------------------------------------------

#[test]
fn threads_dmr() {
    same_as_native(&["-r", "2"], &[fixture("threads").into_os_string()]);
}

#[test]
fn threads_tmr() {
    same_as_native(&["-r", "3"], &[fixture("threads").into_os_string()]);
}

// --- a TCP server driven from outside the replica set ---------------------------------

#[test]
fn echo_server_tmr() {
    let ev = events_path("echo");
    let mut r = spawn(lockstep_run(
        &["-r", "3", "--events", ev.to_str().unwrap()],
        &[fixture("echo_server").into_os_string(), "0".into(), "2".into()],
    ));
    let port = parse_port(&r.wait_for_stdout("\n", Duration::from_secs(30)));
    assert_eq!(echo_client(port, &["hello", "lockstep", "", "x y z"]), 4);
    assert_eq!(echo_client(port, &["second connection", "bye"]), 2);
    let out = r.finish(RUN_TIMEOUT);
    out.assert_code(0)
        .assert_stdout(format!("PORT {port}\nserved 6 lines\n").as_bytes());
    assert_agreed(&read_events_of(&ev, &out), &out);
}

#[test]
fn echo_server_dmr() {
    let mut r = spawn(lockstep_run(
        &["-r", "2"],
        &[fixture("echo_server").into_os_string(), "0".into(), "1".into()],
    ));
    let port = parse_port(&r.wait_for_stdout("\n", Duration::from_secs(30)));
    assert_eq!(echo_client(port, &["one", "two"]), 2);
    let out = r.finish(RUN_TIMEOUT);
    out.assert_code(0)
        .assert_stdout(format!("PORT {port}\nserved 2 lines\n").as_bytes());
}

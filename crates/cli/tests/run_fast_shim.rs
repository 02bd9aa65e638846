//! The fast path's in-process shim (`crates/run/shim/lockstep_fast.c`): syscall sites
//! found by Syscall User Dispatch and rewritten into calls of the shim. So far the shim
//! passes every call on to the kernel; these tests check that programs cannot tell, on
//! their own and as replicas of `lockstep run` (whose monitor lets the shim's SIGSYS
//! through), and that the calls really go through rewritten sites.

mod common;
use common::*;
use std::ffi::OsString;
use std::process::Command;

const SHIM: &str = lockstep_run::fast::SHIM_PATH;

/// `prog` with the shim preloaded and switched on (`mode`: "1", or "count" for a report).
fn shimmed(mode: &str, prog: &[OsString]) -> Vec<OsString> {
    let mut v: Vec<OsString> = vec![
        "env".into(),
        format!("LOCKSTEP_FAST={mode}").into(),
        format!("LD_PRELOAD={SHIM}").into(),
    ];
    v.extend(prog.iter().cloned());
    v
}

fn os(v: &[&str]) -> Vec<OsString> {
    v.iter().map(OsString::from).collect()
}

/// A Python job that exercises what the shim treats specially: a fork (never rewritten),
/// signal handlers that make syscalls while the shim's own SIGSYS handler may be running,
/// and plenty of ordinary calls.
const PY_JOB: &str = r#"
import os, signal, hashlib
hits = []
signal.signal(signal.SIGALRM, lambda s, f: hits.append(os.getppid() > 0))
signal.setitimer(signal.ITIMER_REAL, 0.0005, 0.0005)
h = hashlib.sha256()
for i in range(300):
    with open('/etc/services', 'rb') as f:
        h.update(f.read(100 + i))
signal.setitimer(signal.ITIMER_REAL, 0, 0)
pid = os.fork()
if pid == 0:
    os._exit(7)
_, status = os.waitpid(pid, 0)
print(h.hexdigest(), os.WEXITSTATUS(status), all(hits))
"#;

fn py_job() -> Vec<OsString> {
    vec![python3().into(), "-c".into(), PY_JOB.into()]
}

#[test]
fn programs_behave_the_same_through_rewritten_sites() {
    let progs = [
        os(&["ls", "-la", "/usr/bin"]),
        os(&["sh", "-c", PIPELINE]),
        os(&["gzip", "-c", "/etc/services"]),
        py_job(),
    ];
    for prog in progs {
        let native = native_stdout(&prog);
        let out = run(native_cmd(&shimmed("1", &prog)));
        out.assert_code(0).assert_stdout(&native);
    }
}

#[test]
fn calls_go_through_rewritten_sites() {
    let out = run(native_cmd(&shimmed("count", &py_job())));
    out.assert_code(0);
    // "lockstep-fast: N calls through rewritten sites, S sites, W windows (U unrewritable)"
    let report = out
        .stderr
        .lines()
        .find_map(|l| l.strip_prefix("lockstep-fast: "))
        .unwrap_or_else(|| panic!("no report\n{}", out.context()));
    let number = |i: usize| -> u64 { report.split_whitespace().nth(i).and_then(|n| n.parse().ok()).unwrap() };
    let (calls, sites) = (number(0), number(5));
    assert!(calls > 1000, "{report}");
    assert!(
        sites > 10 && sites < calls / 10,
        "each site is found once, then called: {report}"
    );
}

#[test]
fn the_shim_is_inert_unless_switched_on() {
    let prog = py_job();
    let native = native_stdout(&prog);
    let mut cmd = Command::new("env");
    cmd.arg(format!("LD_PRELOAD={SHIM}")).args(&prog);
    let out = run(cmd);
    out.assert_code(0).assert_stdout(&native);
    assert!(!out.stderr.contains("lockstep-fast"), "{}", out.context());
}

#[test]
fn replicas_with_the_shim_agree_under_lockstep_run() {
    // Without the interval timer: `lockstep run` itself loses a follower whose own timer
    // interrupts a descriptor install (a known defect, see the issue note).
    let job = PY_JOB.replace("signal.setitimer", "0 and signal.setitimer");
    let prog = vec![python3().into(), "-c".into(), job.into()];
    let native = native_stdout(&prog);
    for replicas in ["2", "3"] {
        let prog = shimmed("1", &prog);
        let ev = events_path("fast-shim");
        let evs = ev.to_string_lossy().into_owned();
        let out = run(lockstep_run(&["-r", replicas, "--events", &evs], &prog));
        out.assert_code(0).assert_stdout(&native);
        assert_agreed(&read_events_of(&ev, &out), &out);
    }
}

#[test]
fn a_mask_set_at_a_sites_first_call_holds() {
    let prog = vec![fixture("sigmask_first").into_os_string()];
    let out = run(native_cmd(&shimmed("1", &prog)));
    out.assert_code(0).assert_stdout(b"blocked 1\n");
}

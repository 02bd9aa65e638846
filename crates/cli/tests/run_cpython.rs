//! CPython's own regression tests (Debian's libpython3.11-testsuite) under `lockstep run`:
//! a fast subset here, the whole fixed list in `make cpython-suite`
//! (scripts/cpython_suite.sh). Each module must end as it does natively: "Tests result:
//! SUCCESS" and exit 0, with no divergence.

mod common;
use common::*;

/// Debian's interpreter, whose test package the suite is (`/usr/lib/python3.11/test`).
const PYTHON: &str = "/usr/bin/python3";
/// How long one replicated module may take before the test calls it hung.
const MODULE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(180);

fn passes_under_lockstep(module: &str, exclude: &[&str]) {
    let mut argv = vec![PYTHON, "-m", "test", module];
    for pattern in exclude {
        argv.extend(["-i", pattern]);
    }
    let native = run(native_cmd(&argv));
    native.assert_code(0);
    assert!(
        native.stdout_str().contains("Tests result: SUCCESS"),
        "{}",
        native.context()
    );
    for r in ["2", "3"] {
        // Whole test modules: test_os alone takes 40-60 s under `-r 2` on a loaded 2-CPU
        // machine (thousands of descriptor installs), more than RUN_TIMEOUT leaves.
        let out = spawn(lockstep_run(&["-r", r], &argv)).finish(MODULE_TIMEOUT);
        out.assert_code(0);
        assert!(out.stdout_str().contains("Tests result: SUCCESS"), "{}", out.context());
        assert!(!out.stderr.contains("[divergence]"), "{}", out.context());
    }
}

#[test]
fn cpython_test_os() {
    passes_under_lockstep("test_os", &[]);
}

#[test]
fn cpython_test_tempfile() {
    passes_under_lockstep("test_tempfile", &[]);
}

#[test]
fn cpython_test_shutil() {
    passes_under_lockstep("test_shutil", &[]);
}

/// Without test_process_time and test_thread_time: they bound the CPU time used around a
/// 0.1 s sleep by 20 ms, and lockstep's stops of the replica cost CPU time in it (26 ms
/// was seen on a loaded CI machine).
#[test]
fn cpython_test_time() {
    passes_under_lockstep("test_time", &["test_process_time", "test_thread_time"]);
}

#[test]
fn cpython_test_uuid() {
    passes_under_lockstep("test_uuid", &[]);
}

#[test]
fn cpython_test_posixpath_and_fnmatch() {
    passes_under_lockstep("test_posixpath", &[]);
    passes_under_lockstep("test_fnmatch", &[]);
}

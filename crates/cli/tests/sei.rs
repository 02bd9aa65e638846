//! libsei through `lockstep cc`: sei/tests/unit.c is built at -O0, -O2 and -O3 (the
//! instrumentation differs at each level) and each case runs as a real process. A
//! detection is exit status 86 with a one-line reason on stderr.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const LEVELS: [&str; 3] = ["-O0", "-O2", "-O3"];
const DETECTED: i32 = 86;

fn lockstep() -> &'static str {
    env!("CARGO_BIN_EXE_lockstep")
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn work_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("lockstep-sei-tests-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    })
}

/// Compiles with `lockstep cc`, failing the test with the compiler's output.
fn cc(args: &[&str], out: &Path) {
    let result = Command::new(lockstep())
        .arg("cc")
        .args(["-Wall", "-Wextra", "-Werror"])
        .args(args)
        .arg("-o")
        .arg(out)
        .env("LOCKSTEP_SEI_DIR", work_dir().join("sei"))
        .output()
        .expect("run lockstep cc");
    assert!(
        result.status.success(),
        "lockstep cc {args:?} failed:\n{}",
        String::from_utf8_lossy(&result.stderr)
    );
}

/// The unit binary for one optimisation level, built once per test process.
fn unit(level: &str) -> PathBuf {
    static BUILT: OnceLock<Vec<PathBuf>> = OnceLock::new();
    let built = BUILT.get_or_init(|| {
        let src = repo().join("sei/tests/unit.c");
        LEVELS
            .iter()
            .map(|level| {
                let out = work_dir().join(format!("unit{level}"));
                cc(&[level, src.to_str().unwrap()], &out);
                out
            })
            .collect()
    });
    built[LEVELS.iter().position(|l| *l == level).unwrap()].clone()
}

/// Runs a binary with a hard limit of 30 s.
fn run(bin: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut child = Command::new(bin)
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("{} {args:?} did not finish in 30 s", bin.display());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    child.wait_with_output().unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The case passes at every level: exit 0 and the expected "ok" line.
fn passes(case: &str, expect: &str, env: &[(&str, &str)]) {
    for level in LEVELS {
        let out = run(&unit(level), &[case], env);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{case} at {level}: stdout {} stderr {}",
            text(&out.stdout),
            text(&out.stderr)
        );
        assert!(
            text(&out.stdout).contains(expect),
            "{case} at {level}: {}",
            text(&out.stdout)
        );
    }
}

/// The case is detected at every level: exit 86 and a reason containing `reason`.
fn detected(case: &str, reason: &str, env: &[(&str, &str)]) {
    for level in LEVELS {
        let out = run(&unit(level), &[case], env);
        let stderr = text(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(DETECTED),
            "{case} at {level}: stdout {} stderr {stderr}",
            text(&out.stdout)
        );
        assert!(!text(&out.stdout).contains("not detected"), "{case} at {level}");
        let line = stderr
            .lines()
            .find(|l| l.starts_with("sei: error detected: "))
            .unwrap_or_default();
        assert!(
            line.contains(reason),
            "{case} at {level}: expected `{reason}` in {stderr}"
        );
    }
}

#[test]
fn every_abi_barrier_changes_state_once_through_both_executions() {
    passes("abi", "ok barriers", &[]);
    passes("abi", "ok bulk", &[]);
}

#[test]
fn globals_heap_locals_and_the_enclosing_frame_start_e2_with_their_old_values() {
    passes("reset", "ok reset", &[]);
    passes("reset", "ok reset", &[("SEI_MODE", "dup")]);
}

#[test]
fn e2_gets_e1s_allocations_and_frees_wait_for_validation() {
    passes("alloc", "ok alloc", &[]);
    passes("alloc", "ok alloc", &[("SEI_MODE", "dup")]);
}

#[test]
fn deferred_send_write_and_close_happen_once_after_validation() {
    passes("send", "ok send", &[]);
}

#[test]
fn outputs_carry_e2s_crc_and_corrupt_input_is_discarded() {
    passes("output", "ok output", &[]);
    passes("pure-handler", "ok pure handler", &[]);
}

#[test]
fn a_cancel_in_both_executions_undoes_the_handler() {
    passes("cancel", "ok cancel", &[]);
}

#[test]
fn lock_releases_are_deferred_until_after_validation() {
    passes("locks", "ok locks", &[]);
}

#[test]
fn a_flip_in_either_execution_is_detected() {
    detected("flip-e1", "E1 and E2 disagree", &[]);
    detected("flip-e2", "E1 and E2 disagree", &[]);
}

#[test]
fn e2_writing_a_location_e1_did_not_is_detected() {
    detected("flip-branch", "E2 wrote", &[]);
}

#[test]
fn a_corrupted_output_or_send_buffer_never_leaves() {
    detected("flip-output", "disagree", &[]);
    detected("flip-send", "disagree", &[]);
}

#[test]
fn validated_locking_detects_a_foreign_release_and_a_different_lock() {
    detected("unlock-not-held", "does not hold", &[]);
    detected("other-lock", "E2 locked", &[]);
}

#[test]
fn control_flow_gates_reject_out_of_order_phases() {
    detected("end-without-handler", "control-flow gate", &[]);
    detected("begin-twice", "control-flow gate", &[]);
}

#[test]
fn dup_mode_detects_a_flip_between_handlers_and_ecc_mode_does_not() {
    detected("flip-between", "dup mode", &[("SEI_MODE", "dup")]);
    // ECC mode trusts the hardware: the software flip goes through (1000 ^ 16 + 1)
    passes("flip-between", "mode=ecc read=1017", &[]);
}

#[test]
fn dup_mode_chosen_at_build_time_and_overridden_at_run_time() {
    let out = work_dir().join("unit-dup-build");
    let src = repo().join("sei/tests/unit.c");
    cc(&["--sei-mode=dup", "-O2", src.to_str().unwrap()], &out);
    let dup = run(&out, &["flip-between"], &[]);
    assert_eq!(dup.status.code(), Some(DETECTED), "{}", text(&dup.stderr));
    let ecc = run(&out, &["flip-between"], &[("SEI_MODE", "ecc")]);
    assert_eq!(ecc.status.code(), Some(0), "{}", text(&ecc.stderr));
}

#[test]
fn dup_mode_raises_no_false_alarm_over_allocation_reuse() {
    passes("dup-quiet", "ok quiet mode=dup total=19834", &[("SEI_MODE", "dup")]);
    passes("dup-quiet", "ok quiet mode=ecc total=19834", &[]);
}

#[test]
fn the_checking_barrier_holds_output_while_another_handler_runs() {
    passes("barrier", "ok barrier blocked=1 open=1", &[]);
    passes("barrier", "ok barrier blocked=0 open=1", &[("SEI_BARRIER", "0")]);
}

#[test]
fn a_bad_memory_mode_is_refused_with_a_clear_error() {
    let out = run(&unit("-O2"), &["reset"], &[("SEI_MODE", "triple")]);
    assert_eq!(out.status.code(), Some(70));
    assert!(
        text(&out.stderr).contains("SEI_MODE=triple: expected ecc or dup"),
        "{}",
        text(&out.stderr)
    );
}

/// The build-time guard: no hardened binary may leave an `_ITM_` symbol for the
/// real libitm (the gcc driver links it after libsei).
#[test]
fn hardened_binaries_resolve_every_itm_symbol_in_libsei() {
    for level in LEVELS {
        let undefined = lockstep_sei_guard(&unit(level));
        assert!(undefined.is_empty(), "{level}: left for libitm: {undefined:?}");
    }
}

fn lockstep_sei_guard(bin: &Path) -> Vec<String> {
    let dynamic = Command::new("readelf")
        .arg("-d")
        .arg(bin)
        .output()
        .expect("run readelf");
    assert!(
        !text(&dynamic.stdout).contains("libitm"),
        "{} needs libitm.so",
        bin.display()
    );
    lockstep_sei::leaves_itm_undefined(bin).expect("run nm")
}

#[test]
fn the_guard_itself_sees_a_symbol_left_for_libitm() {
    // Plain gcc -fgnu-tm without libsei: every barrier is left to libitm.
    let src = work_dir().join("plain.c");
    std::fs::write(
        &src,
        "int g; int main(void) { __transaction_atomic { g++; } return g - 1; }\n",
    )
    .unwrap();
    let bin = work_dir().join("plain");
    let status = Command::new("gcc")
        .arg("-fgnu-tm")
        .arg(&src)
        .arg("-o")
        .arg(&bin)
        .status()
        .unwrap();
    assert!(status.success());
    let left = lockstep_sei::leaves_itm_undefined(&bin).unwrap();
    assert!(left.iter().any(|s| s == "_ITM_beginTransaction"), "{left:?}");
}

#[test]
fn lockstep_cc_refuses_a_compiler_that_is_not_gcc() {
    let fake = work_dir().join("fake-clang");
    std::fs::write(&fake, "#!/bin/sh\necho 'clang version 16.0.0' >&2\nexit 0\n").unwrap();
    Command::new("chmod").arg("+x").arg(&fake).status().unwrap();
    let out = Command::new(lockstep())
        .args(["cc", "x.c"])
        .env("LOCKSTEP_CC", &fake)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("is not GCC"), "{}", text(&out.stderr));
    let missing = Command::new(lockstep())
        .args(["cc", "x.c"])
        .env("LOCKSTEP_CC", "/nonexistent/gcc")
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(2));
    assert!(
        text(&missing.stderr).contains("cannot run the compiler"),
        "{}",
        text(&missing.stderr)
    );
    let bad_mode = Command::new(lockstep())
        .args(["cc", "--sei-mode=tmr", "x.c"])
        .output()
        .unwrap();
    assert_eq!(bad_mode.status.code(), Some(2));
    assert!(text(&bad_mode.stderr).contains("expected ecc or dup"));
}

#[test]
fn lockstep_cc_passes_compiler_errors_through() {
    let src = work_dir().join("broken.c");
    std::fs::write(&src, "int main(void) { return undeclared; }\n").unwrap();
    let out = Command::new(lockstep())
        .arg("cc")
        .arg(&src)
        .arg("-o")
        .arg(work_dir().join("broken"))
        .env("LOCKSTEP_SEI_DIR", work_dir().join("sei"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("undeclared"));
}

#[test]
fn lockstep_cxx_hardens_a_cxx_handler() {
    let src = work_dir().join("handler.cc");
    std::fs::write(
        &src,
        "#include \"sei.h\"\n#include <cstdio>\nstatic int counter;\n\
         int main() { for (int i = 0; i < 3; i++) { SEI_LOCAL_HANDLER() { counter += 2; } }\n\
         struct sei_stats s; sei_stats(&s); std::printf(\"%d %llu\\n\", counter, (unsigned long long)s.handlers);\n\
         return 0; }\n",
    )
    .unwrap();
    let bin = work_dir().join("handler-cxx");
    let out = Command::new(lockstep())
        .args(["c++", "-O2", "-Wall", "-Wextra", "-Werror"])
        .arg(&src)
        .arg("-o")
        .arg(&bin)
        .env("LOCKSTEP_SEI_DIR", work_dir().join("sei"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let run = run(&bin, &[], &[]);
    assert_eq!(text(&run.stdout), "6 3\n");
    assert!(lockstep_sei_guard(&bin).is_empty());
}

/// sei/tests/libc.c built with `lockstep cc` at each level, and natively (plain gcc,
/// -DSEI_NATIVE, strict C11: the native header must not need POSIX extensions).
fn libc_binaries() -> &'static [(String, PathBuf)] {
    static BUILT: OnceLock<Vec<(String, PathBuf)>> = OnceLock::new();
    BUILT.get_or_init(|| {
        let src = repo().join("sei/tests/libc.c");
        let mut built: Vec<(String, PathBuf)> = LEVELS
            .iter()
            .map(|level| {
                let out = work_dir().join(format!("libc{level}"));
                cc(&[level, src.to_str().unwrap()], &out);
                (level.to_string(), out)
            })
            .collect();
        let native = work_dir().join("libc-native");
        let result = Command::new("gcc")
            .args(["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror", "-DSEI_NATIVE", "-I"])
            .arg(repo().join("sei/include"))
            .arg(&src)
            .arg("-o")
            .arg(&native)
            .output()
            .expect("run gcc");
        assert!(result.status.success(), "native build: {}", text(&result.stderr));
        built.push(("native".into(), native));
        built
    })
}

#[test]
fn the_libc_subset_matches_libc_on_random_inputs_in_every_build() {
    for (build, bin) in libc_binaries() {
        let runs: &[(&str, &[(&str, &str)])] = if build == "native" {
            &[("native", &[])]
        } else {
            &[("handler", &[]), ("handler", &[("SEI_MODE", "dup")]), ("plain", &[])]
        };
        for (seed, (place, env)) in runs.iter().enumerate() {
            let seed = (seed + 1).to_string();
            let out = run(bin, &[place, "20000", &seed], env);
            assert_eq!(
                out.status.code(),
                Some(0),
                "{build} {place} {env:?}: {}{}",
                text(&out.stdout),
                text(&out.stderr)
            );
            assert_eq!(text(&out.stdout), "ok libc 20000\n");
        }
    }
}

#[test]
fn the_libc_subset_logs_what_it_writes_and_checks_what_it_reads() {
    for (build, bin) in libc_binaries().iter().filter(|(b, _)| b != "native") {
        // Two executions that format different numbers: V sees it, so the writes were logged.
        let out = run(bin, &["diverge"], &[]);
        assert_eq!(out.status.code(), Some(DETECTED), "{build}: {}", text(&out.stdout));
        assert!(
            text(&out.stderr).contains("E1 and E2 disagree"),
            "{build}: {}",
            text(&out.stderr)
        );
        // A string flipped between handlers: dup mode's check at sei_strlen's reads finds
        // it; ecc mode trusts the hardware and does not.
        let out = run(bin, &["flip"], &[("SEI_MODE", "dup")]);
        assert_eq!(out.status.code(), Some(DETECTED), "{build}: {}", text(&out.stdout));
        assert!(text(&out.stderr).contains("dup mode"), "{build}: {}", text(&out.stderr));
        let out = run(bin, &["flip"], &[("SEI_MODE", "ecc")]);
        assert_eq!(out.status.code(), Some(1), "{build}");
        assert_eq!(text(&out.stdout), "not detected: length 5\n");
    }
}

#[test]
fn an_unsupported_snprintf_conversion_stops_with_70_naming_it() {
    let src = work_dir().join("float.c");
    std::fs::write(
        &src,
        "#include \"sei.h\"\n#include <stdio.h>\nstatic char out[32];\n\
         int main(void) { volatile double x = 1.5; sei_snprintf(out, sizeof out, \"%f\", x); puts(out); return 0; }\n",
    )
    .unwrap();
    let bin = work_dir().join("float");
    cc(&["-O2", src.to_str().unwrap()], &bin);
    let out = run(&bin, &[], &[]);
    assert_eq!(out.status.code(), Some(70));
    assert!(
        text(&out.stderr).contains("conversion %f is not supported"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn a_pointer_call_without_a_clone_is_70_for_a_function_and_86_for_a_corrupted_pointer() {
    // A real function that is not SEI_SAFE: the program's mistake, named.
    for level in LEVELS {
        let out = run(&unit(level), &["no-clone"], &[]);
        assert_eq!(out.status.code(), Some(70), "{level}: {}", text(&out.stderr));
        assert!(
            text(&out.stderr).contains("called unsafe_callee"),
            "{level}: {}",
            text(&out.stderr)
        );
        assert!(!text(&out.stdout).contains("ran"), "{level}: the callee ran");
    }
    // Pointers that no program would make: into a function's middle, or to data.
    detected("wild-pointer", "which is no function of the program", &[]);
    detected("data-pointer", "which is no function of the program", &[]);
}

#[test]
fn a_large_reply_needs_no_ignore_and_a_full_log_names_the_buffer() {
    // 64 KiB written by one handler: eight times the write log's first size.
    passes("big-reply", "ok big reply 65536 bytes, 8192 words logged", &[]);
    passes("big-reply", "ok big reply 65536 bytes", &[("SEI_MODE", "dup")]);
    for level in LEVELS {
        let out = run(&unit(level), &["big-reply"], &[("SEI_MAX_WORDS", "1024")]);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(70), "{level}: {stderr}");
        assert!(stderr.contains("more than 1024 words"), "{level}: {stderr}");
        assert!(stderr.contains("in big_reply+8192"), "{level}: {stderr}");
    }
}

//! `lockstep cc` as a toolchain that guides: `--print-include-dir` / `--print-lib`, and
//! what it does when `gcc -fgnu-tm` fails in a known way (real gcc runs on the small C
//! fixtures in tests/sei_cc/). Each GCC-bug test first checks that plain `gcc -fgnu-tm`
//! still fails on its fixture; where it no longer does, only the build is checked.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

fn lockstep() -> &'static str {
    env!("CARGO_BIN_EXE_lockstep")
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/sei_cc").join(name)
}

fn work_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("lockstep-sei-cc-tests-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    })
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// `lockstep cc ARGS`, in the work directory, with its own unpacked libsei.
fn lockstep_cc(args: &[&str]) -> Output {
    Command::new(lockstep())
        .arg("cc")
        .args(args)
        .current_dir(work_dir())
        .env("LOCKSTEP_SEI_DIR", work_dir().join("sei"))
        .env_remove("LOCKSTEP_CC")
        .stdin(Stdio::null())
        .output()
        .expect("run lockstep cc")
}

/// The one line that `lockstep cc FLAG` prints.
fn printed_path(flag: &str) -> PathBuf {
    let out = lockstep_cc(&[flag]);
    assert_eq!(out.status.code(), Some(0), "{flag}: {}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert_eq!(stdout.lines().count(), 1, "{flag} printed {stdout:?}");
    PathBuf::from(stdout.trim_end_matches('\n'))
}

fn include_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| printed_path("--print-include-dir")).clone()
}

/// Plain gcc (no lockstep) with the include directory of sei.h.
fn gcc(args: &[&str]) -> Output {
    Command::new("gcc")
        .arg("-I")
        .arg(include_dir())
        .args(args)
        .current_dir(work_dir())
        .stdin(Stdio::null())
        .output()
        .expect("run gcc")
}

fn run(bin: &Path) -> String {
    let out = Command::new(bin).output().expect("run the fixture");
    assert_eq!(out.status.code(), Some(0), "{}: {}", bin.display(), text(&out.stderr));
    text(&out.stdout)
}

/// The fixture's output when built natively (`-DSEI_NATIVE`): what the hardened build must print.
fn native_output(source: &Path, name: &str) -> String {
    let bin = work_dir().join(format!("{name}.native"));
    let out = gcc(&[
        "-O2",
        "-DSEI_NATIVE",
        "-Wall",
        "-Wextra",
        "-Werror",
        source.to_str().unwrap(),
        "-o",
        bin.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "native build of {name}: {}", text(&out.stderr));
    run(&bin)
}

/// Builds `name` with `lockstep cc` at `level` and checks that it runs as the native build does.
fn builds_and_runs(name: &str, level: &str) -> String {
    let source = fixture(name);
    let bin = work_dir().join(format!("{name}{level}"));
    let out = lockstep_cc(&[
        level,
        "-Wall",
        "-Wextra",
        "-Werror",
        source.to_str().unwrap(),
        "-o",
        bin.to_str().unwrap(),
    ]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "lockstep cc {level} {name}:\n{stderr}");
    assert_eq!(run(&bin), native_output(&source, name), "{name} at {level}");
    stderr
}

/// True if plain `gcc -fgnu-tm` fails on the fixture with `error`: the GCC bug is present.
/// With GCC 12, where each bug was found, the fixture must reproduce it, so that a test
/// cannot pass by skipping its checks.
fn gcc_fails_with(name: &str, level: &str, error: &str) -> bool {
    let out = gcc(&[
        "-fgnu-tm",
        level,
        "-c",
        fixture(name).to_str().unwrap(),
        "-o",
        "/dev/null",
    ]);
    let fails = !out.status.success() && text(&out.stderr).contains(error);
    let version = gcc(&["-dumpversion"]);
    if text(&version.stdout).trim().split('.').next() == Some("12") {
        assert!(
            fails,
            "gcc 12 no longer fails on {name} with `{error}`:\n{}",
            text(&out.stderr)
        );
    }
    fails
}

#[test]
fn print_include_dir_and_print_lib_name_the_header_and_the_archive_to_build_by_hand() {
    let include = include_dir();
    assert!(include.join("sei.h").is_file(), "{}", include.display());
    assert!(include.join("sei_native.h").is_file(), "{}", include.display());
    let lib = printed_path("--print-lib");
    assert!(lib.is_file() && lib.ends_with("libsei.a"), "{}", lib.display());

    let help = text(&lockstep_cc(&["--help"]).stdout);
    for needed in [
        "--print-include-dir",
        "--print-lib",
        "-Wl,--whole-archive",
        "-Wl,--no-whole-archive -pthread",
    ] {
        assert!(help.contains(needed), "--help does not mention {needed}:\n{help}");
    }

    // The native build with the printed directory (what docs/sei.md tells users to run).
    let source = fixture("ice.c");
    let expected = native_output(&source, "by_hand");

    // A hardened build by hand, with the link flags that --help gives: at -O0, where
    // GCC 12 does not crash on this fixture.
    let object = work_dir().join("by_hand.o");
    let bin = work_dir().join("by_hand");
    let out = gcc(&[
        "-fgnu-tm",
        "-O0",
        "-c",
        source.to_str().unwrap(),
        "-o",
        object.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = Command::new("gcc")
        .arg(&object)
        .args(["-Wl,--whole-archive"])
        .arg(&lib)
        .args(["-Wl,--no-whole-archive", "-pthread", "-o"])
        .arg(&bin)
        .output()
        .unwrap();
    assert!(out.status.success(), "link by hand: {}", text(&out.stderr));
    assert_eq!(run(&bin), expected);
    let left = lockstep_sei::leaves_itm_undefined(&bin).expect("run nm");
    assert!(left.is_empty(), "the hand-linked binary leaves {left:?} to libitm");
}

#[test]
fn always_inline_helpers_found_const_are_retried_without_pure_const_discovery_and_stay_inlined() {
    let bug = gcc_fails_with("always_inline.c", "-O2", "inlining failed in call to");
    let stderr = builds_and_runs("always_inline.c", "-O2");
    if bug {
        let retry: Vec<&str> = stderr.lines().filter(|l| l.starts_with("lockstep cc:")).collect();
        assert_eq!(retry.len(), 1, "one line about the retry:\n{stderr}");
        assert!(
            retry[0].contains("retrying with -fno-ipa-pure-const") && retry[0].contains("'mix'"),
            "{stderr}"
        );
        assert!(
            !stderr.contains("error"),
            "GCC's error of the first attempt is not shown:\n{stderr}"
        );
    }
    // Outside the handler too, the helper is still inlined: no `mix` in the object.
    let object = work_dir().join("always_inline.o");
    let out = lockstep_cc(&[
        "-O2",
        "-c",
        fixture("always_inline.c").to_str().unwrap(),
        "-o",
        object.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let nm = Command::new("nm").arg(&object).output().expect("run nm");
    let symbols = text(&nm.stdout);
    assert!(symbols.contains(" T hash"), "{symbols}");
    assert!(
        !symbols.lines().any(|l| l.ends_with(" mix")),
        "mix was not inlined:\n{symbols}"
    );
}

#[test]
fn always_inline_helpers_declared_const_build_once_always_inline_is_dropped() {
    let bug = gcc_fails_with("always_inline_const.c", "-O2", "inlining failed in call to");
    let stderr = builds_and_runs("always_inline_const.c", "-O2");
    if bug {
        assert!(stderr.contains("retrying with -Dalways_inline=__unused__"), "{stderr}");
        assert!(stderr.contains("'fmix' is declared const"), "{stderr}");
    }
}

#[test]
fn unsafe_call_errors_are_traced_down_to_the_libc_calls_and_their_sei_replacements() {
    let source = fixture("unsafe_call.c");
    let object = work_dir().join("unsafe_call.o");
    let deps = work_dir().join("unsafe_call.d");
    let plain = gcc(&["-fgnu-tm", "-O2", "-c", source.to_str().unwrap(), "-o", "/dev/null"]);
    let out = lockstep_cc(&[
        "-O2",
        "-MD",
        "-MF",
        deps.to_str().unwrap(),
        "-c",
        source.to_str().unwrap(),
        "-o",
        object.to_str().unwrap(),
    ]);
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert_eq!(out.status.code(), plain.status.code(), "GCC's exit status is kept");
    assert!(
        stderr.contains("unsafe function call"),
        "GCC's own errors come first:\n{stderr}"
    );
    let ours: Vec<&str> = stderr.lines().filter(|l| l.starts_with("lockstep cc:")).collect();
    let strlen = "parse_key -> key_length -> strlen: strlen is not transaction-safe; use sei_strlen (sei.h)";
    let memcmp = "same_key -> memcmp: memcmp is not transaction-safe; use sei_memcmp (sei.h)";
    for wanted in [strlen, memcmp] {
        assert_eq!(
            ours.iter().filter(|l| l.contains(wanted)).count(),
            1,
            "want one `{wanted}`:\n{stderr}"
        );
    }
    assert_eq!(
        ours.iter().filter(|l| l.contains("strlen")).count(),
        1,
        "deduplicated:\n{stderr}"
    );
    assert!(
        ours.iter().all(|l| !l.contains("pure_length") && !l.contains("memcpy")),
        "{stderr}"
    );
    assert!(
        ours.last()
            .is_some_and(|l| l.contains("SEI_PURE") && l.contains("SEI_SAFE")),
        "{stderr}"
    );
    // The analysis re-runs left no trace in the dependency file or the output.
    let deps = std::fs::read_to_string(&deps).unwrap_or_default();
    assert!(
        !deps.contains("lockstep_probe") && !deps.contains("lockstep-cc-"),
        "{deps}"
    );
    assert!(!object.exists());
}

#[test]
fn a_gcc_crash_in_tm_instrumentation_is_explained_and_retried_with_no_ivopts() {
    let crashes = gcc_fails_with("ice.c", "-O2", "internal compiler error");
    for level in ["-O2", "-O3"] {
        let stderr = builds_and_runs("ice.c", level);
        if crashes {
            assert!(stderr.contains("retrying with -fno-ivopts"), "{level}:\n{stderr}");
            assert!(
                stderr.contains("a GCC bug, not an error in your code"),
                "{level}:\n{stderr}"
            );
            assert!(
                !stderr.contains("internal compiler error:"),
                "the crash itself is not shown:\n{stderr}"
            );
        }
    }
    if !crashes {
        return;
    }
    // A source on stdin cannot be compiled twice: the crash is explained, the status kept.
    let source = std::fs::File::open(fixture("ice.c")).unwrap();
    let out = Command::new(lockstep())
        .args(["cc", "-O2", "-x", "c", "-", "-c", "-o", "/dev/null"])
        .env("LOCKSTEP_SEI_DIR", work_dir().join("sei"))
        .stdin(source)
        .output()
        .unwrap();
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("GCC crashed in its transactional-memory instrumentation"),
        "{stderr}"
    );
    assert!(stderr.contains("-fno-ivopts avoids the known crash"), "{stderr}");
}

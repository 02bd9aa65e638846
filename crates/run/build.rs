//! Builds the fast path's in-process shim (shim/lockstep_fast.c) into
//! OUT_DIR/liblockstep_fast.so with the project's strict C flags. The crate embeds it
//! (`fast::SHIM`), so `lockstep run` works from the binary alone.
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("shim/lockstep_fast.c");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR")).join("liblockstep_fast.so");
    println!("cargo:rerun-if-changed={}", src.display());
    let status = Command::new("gcc")
        // general registers only: the trampoline saves no SSE state.
        .args([
            "-O2",
            "-g",
            "-std=gnu11",
            "-fPIC",
            "-shared",
            "-mgeneral-regs-only",
            "-fno-stack-protector",
            "-Wall",
            "-Wextra",
            "-Werror",
        ])
        .arg(&src)
        .arg("-o")
        .arg(&out)
        .status()
        .unwrap_or_else(|e| panic!("cannot run gcc: {e} (scripts/deps.sh installs it)"));
    assert!(status.success(), "compiling {} failed", src.display());
    println!("cargo:rustc-env=LOCKSTEP_FAST_SHIM={}", out.display());
}

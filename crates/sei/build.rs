//! Builds libsei (C11 + x86-64 assembly, in sei/) into OUT_DIR/libsei.a with the
//! project's strict C flags; the crate embeds the archive and the header, so that
//! `lockstep cc` works from the binary alone.
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../sei");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let cc = std::env::var("LOCKSTEP_SEI_BUILD_CC").unwrap_or_else(|_| "gcc".into());
    println!("cargo:rerun-if-changed={}", root.join("src").display());
    println!("cargo:rerun-if-changed={}", root.join("include").display());
    println!("cargo:rerun-if-env-changed=LOCKSTEP_SEI_BUILD_CC");
    let mut sources: Vec<PathBuf> = std::fs::read_dir(root.join("src"))
        .expect("sei/src")
        .map(|e| e.expect("sei/src entry").path())
        .filter(|p| matches!(p.extension().and_then(|e| e.to_str()), Some("c" | "S")))
        .collect();
    sources.sort();
    let mut objects = Vec::new();
    for src in &sources {
        println!("cargo:rerun-if-changed={}", src.display());
        let obj = out.join(src.file_name().unwrap()).with_extension("o");
        let status = Command::new(&cc)
            // initial-exec TLS: the handler context is one thread-local load away, not a
            // __tls_get_addr call per barrier (libsei is linked into executables)
            .args([
                "-O2",
                "-g",
                "-std=gnu11",
                "-fPIC",
                "-ftls-model=initial-exec",
                "-Wall",
                "-Wextra",
                "-Werror",
            ])
            .arg("-I")
            .arg(root.join("include"))
            .arg("-c")
            .arg(src)
            .arg("-o")
            .arg(&obj)
            .status()
            .unwrap_or_else(|e| panic!("cannot run {cc}: {e} (libsei needs GCC; scripts/deps.sh installs it)"));
        assert!(status.success(), "compiling {} failed", src.display());
        objects.push(obj);
    }
    let lib = out.join("libsei.a");
    // (an old archive, if any: ar appends to an existing one)
    let _ = std::fs::remove_file(&lib);
    let status = Command::new("ar")
        .arg("rcs")
        .arg(&lib)
        .args(&objects)
        .status()
        .expect("run ar");
    assert!(status.success(), "ar failed");
}

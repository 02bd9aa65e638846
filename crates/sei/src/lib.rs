//! libsei, embedded, and the compiler wrapper behind `lockstep cc`.
//!
//! build.rs compiles `sei/` (C11 and x86-64 assembly) into a static archive. This crate
//! carries that archive and `sei.h` inside the lockstep binary and unpacks them into a
//! cache directory on first use, so that `make CC="lockstep cc"` needs nothing else.
//! The wrapper adds `-fgnu-tm`, the include path and, when linking, the whole archive:
//! the gcc driver appends `-litm`, and every `_ITM_` symbol must bind to libsei first.

use std::ffi::{OsStr, OsString};
use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;

pub mod diagnose;

/// The public header, `sei/include/sei.h`.
pub const HEADER: &[u8] = include_bytes!("../../../sei/include/sei.h");
/// The no-op twin of the header, for the unhardened build (`-DSEI_NATIVE`).
pub const NATIVE_HEADER: &[u8] = include_bytes!("../../../sei/include/sei_native.h");
/// The runtime, built by build.rs.
pub const ARCHIVE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libsei.a"));

/// Where `include/sei.h` and `lib/libsei.a` were unpacked.
#[derive(Debug, Clone)]
pub struct Install {
    pub root: PathBuf,
}

impl Install {
    pub fn include_dir(&self) -> PathBuf {
        self.root.join("include")
    }
    pub fn archive(&self) -> PathBuf {
        self.root.join("lib/libsei.a")
    }
}

/// Unpacks the header and archive once per content version, under `LOCKSTEP_SEI_DIR`
/// if set, else `$XDG_CACHE_HOME/lockstep` or `~/.cache/lockstep`. Concurrent
/// compilers (make -j) race safely: each writes a private directory and renames it.
pub fn install() -> io::Result<Install> {
    let base = match std::env::var_os("LOCKSTEP_SEI_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => cache_home()?.join("lockstep"),
    };
    let version = lockstep_core::crc32c(HEADER)
        ^ lockstep_core::crc32c(NATIVE_HEADER).rotate_left(8)
        ^ lockstep_core::crc32c(ARCHIVE).rotate_left(16);
    let root = base.join(format!("sei-{version:08x}-{}", ARCHIVE.len()));
    let install = Install { root: root.clone() };
    if install.archive().is_file() {
        return Ok(install);
    }
    std::fs::create_dir_all(&base)?;
    let staging = base.join(format!(".sei-staging-{}", std::process::id()));
    // (a staging directory a killed run left behind, if any)
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(staging.join("include"))?;
    std::fs::create_dir_all(staging.join("lib"))?;
    std::fs::write(staging.join("include/sei.h"), HEADER)?;
    std::fs::write(staging.join("include/sei_native.h"), NATIVE_HEADER)?;
    std::fs::write(staging.join("lib/libsei.a"), ARCHIVE)?;
    match std::fs::rename(&staging, &root) {
        Ok(()) => Ok(install),
        Err(_) if install.archive().is_file() => {
            // (another process installed first; this staging copy is not needed)
            let _ = std::fs::remove_dir_all(&staging);
            Ok(install)
        }
        Err(e) => Err(e),
    }
}

fn cache_home() -> io::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(dir));
    }
    match std::env::var_os("HOME").filter(|d| !d.is_empty()) {
        Some(home) => Ok(PathBuf::from(home).join(".cache")),
        None => Err(io::Error::new(
            io::ErrorKind::NotFound,
            "neither XDG_CACHE_HOME nor HOME is set",
        )),
    }
}

/// The language of the wrapped compiler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lang {
    C,
    Cxx,
}

/// The memory mode compiled in as the default (`SEI_MODE` overrides it at run time).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Ecc,
    Dup,
}

/// Why a compiler invocation cannot be wrapped.
#[derive(Debug)]
pub enum WrapError {
    /// A `--sei-*` option is malformed.
    Usage(String),
    /// The compiler is missing or is not GCC.
    Compiler(String),
    /// The runtime could not be unpacked.
    Install(io::Error),
}

impl std::fmt::Display for WrapError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WrapError::Usage(m) | WrapError::Compiler(m) => f.write_str(m),
            WrapError::Install(e) => write!(f, "cannot unpack libsei: {e}"),
        }
    }
}

/// The compiler to wrap: `LOCKSTEP_CC` / `LOCKSTEP_CXX`, else gcc / g++.
pub fn compiler(lang: Lang) -> OsString {
    let (var, default) = match lang {
        Lang::C => ("LOCKSTEP_CC", "gcc"),
        Lang::Cxx => ("LOCKSTEP_CXX", "g++"),
    };
    std::env::var_os(var)
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| default.into())
}

/// Refuses a compiler that is not GCC: only GCC has the `-fgnu-tm` instrumentation.
pub fn check_gcc(compiler: &OsStr) -> Result<(), WrapError> {
    let name = compiler.to_string_lossy();
    let out = Command::new(compiler)
        .arg("-v")
        .output()
        .map_err(|e| WrapError::Compiler(format!("cannot run the compiler `{name}`: {e}")))?;
    let text = String::from_utf8_lossy(&out.stderr);
    let is_gcc = text.lines().any(|l| l.starts_with("gcc version")) && !text.contains("clang");
    if is_gcc {
        Ok(())
    } else {
        let first = text
            .lines()
            .find(|l| l.contains("version"))
            .unwrap_or("no version line")
            .trim();
        Err(WrapError::Compiler(format!(
            "`{name}` is not GCC ({first}); libsei needs GCC's -fgnu-tm instrumentation \
             (set LOCKSTEP_CC to a gcc)"
        )))
    }
}

/// Splits `--sei-mode=ecc|dup` (or `--sei-mode ecc|dup`) from the compiler's arguments.
pub fn take_options(args: &[OsString]) -> Result<(Mode, Vec<OsString>), WrapError> {
    let mut mode = Mode::Ecc;
    let mut rest = Vec::with_capacity(args.len());
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let text = arg.to_string_lossy();
        let value = if let Some(v) = text.strip_prefix("--sei-mode=") {
            v.to_string()
        } else if text == "--sei-mode" {
            it.next()
                .map(|v| v.to_string_lossy().into_owned())
                .ok_or_else(|| WrapError::Usage("--sei-mode needs a value: ecc or dup".into()))?
        } else if text.starts_with("--sei-") {
            return Err(WrapError::Usage(format!(
                "unknown option {text} (lockstep cc knows --sei-mode)"
            )));
        } else {
            rest.push(arg.clone());
            continue;
        };
        mode = match value.as_str() {
            "ecc" => Mode::Ecc,
            "dup" => Mode::Dup,
            other => return Err(WrapError::Usage(format!("--sei-mode {other}: expected ecc or dup"))),
        };
    }
    Ok((mode, rest))
}

/// Whether the invocation links (no -c, -S, -E or dependency-only output).
pub fn links(args: &[OsString]) -> bool {
    let stops = [
        "-c",
        "-S",
        "-E",
        "-M",
        "-MM",
        "-fsyntax-only",
        "--version",
        "-v",
        "-dumpversion",
        "-dumpmachine",
    ];
    !args.is_empty() && !args.iter().any(|a| stops.iter().any(|s| a == OsStr::new(s)))
}

/// The complete compiler command for one `lockstep cc` invocation.
pub fn command(lang: Lang, args: &[OsString], install: &Install) -> Result<Command, WrapError> {
    let (mode, args) = take_options(args)?;
    let cc = compiler(lang);
    check_gcc(&cc)?;
    let mut cmd = Command::new(&cc);
    // -Wno-clobbered: a handler's checkpoint is a returns-twice call, so GCC warns about
    // every register variable live across it; libsei restores them at the restart.
    cmd.arg("-fgnu-tm")
        .arg("-Wno-clobbered")
        .arg("-I")
        .arg(install.include_dir());
    if mode == Mode::Dup {
        cmd.arg("-DSEI_BUILD_DUP");
    }
    cmd.args(&args);
    if links(&args) {
        // The whole archive: crtbegin.o only references the clone-table functions
        // weakly, which would not pull their member in.
        cmd.arg("-Wl,--whole-archive")
            .arg(install.archive())
            .arg("-Wl,--no-whole-archive")
            .arg("-pthread");
    }
    Ok(cmd)
}

/// True when `path` is an ELF file that leaves an `_ITM_` symbol undefined (which the
/// dynamic linker would resolve from the real libitm). Uses `nm`.
pub fn leaves_itm_undefined(path: &Path) -> io::Result<Vec<String>> {
    let out = Command::new("nm").arg("-u").arg(path).output()?;
    if !out.status.success() {
        return Err(io::Error::other(String::from_utf8_lossy(&out.stderr).into_owned()));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().last())
        .filter(|s| s.starts_with("_ITM_"))
        .map(|s| s.split('@').next().unwrap_or(s).to_string())
        .collect())
}

//! Paths that may be longer than PATH_MAX: a base directory plus a relative path. A store's
//! tables mirror the tree's paths under `.lockstep/crc/`, so a file whose own path is just
//! under PATH_MAX has a table path just over it.
//!
//! The base is opened once and kept. A relative path that fits in PATH_MAX is handed to one
//! `*at` call (the common case: one syscall per table operation); a longer one, or one whose
//! directories are missing, is walked a component at a time. Intermediate components are
//! resolved by the kernel on the fast path: the store's `.lockstep` directory is written only
//! by lockstep (the mount hides it), so it holds no symlinks to follow.

use std::ffi::{CStr, CString};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, OnceLock};

/// A directory that relative paths start from, opened (`O_PATH`) at first use and kept.
#[derive(Debug)]
pub struct Base {
    path: PathBuf,
    fd: OnceLock<OwnedFd>,
}

impl Base {
    pub fn new(path: impl Into<PathBuf>) -> Arc<Base> {
        Arc::new(Base {
            path: path.into(),
            fd: OnceLock::new(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn fd(&self) -> io::Result<RawFd> {
        if let Some(fd) = self.fd.get() {
            return Ok(fd.as_raw_fd());
        }
        let fd = open_at(libc::AT_FDCWD, &cstr(self.path.as_os_str().as_bytes())?, DIR_FLAGS, 0)?;
        // Two threads racing here both opened it; the loser's copy is dropped.
        Ok(self.fd.get_or_init(|| fd).as_raw_fd())
    }
}

/// A place in the tree under `base`.
#[derive(Clone, Debug)]
pub struct Spot {
    pub base: Arc<Base>,
    pub rel: PathBuf,
}

fn last_error() -> io::Error {
    io::Error::last_os_error()
}

fn open_at(dir: RawFd, name: &CStr, flags: i32, mode: u32) -> io::Result<OwnedFd> {
    // SAFETY: a valid directory descriptor and NUL-terminated name.
    let r = unsafe { libc::openat(dir, name.as_ptr(), flags | libc::O_CLOEXEC, mode) };
    if r < 0 {
        return Err(last_error());
    }
    // SAFETY: a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(r) })
}

fn cstr(b: &[u8]) -> io::Result<CString> {
    CString::new(b).map_err(|_| io::ErrorKind::InvalidInput.into())
}

const DIR_FLAGS: i32 = libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW;

/// Relative paths up to this length go to the kernel whole (PATH_MAX counts the NUL).
const FAST_PATH_MAX: usize = libc::PATH_MAX as usize - 1;

fn missing(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::ENOTDIR))
}

impl Spot {
    pub fn new(base: &Arc<Base>, rel: impl Into<PathBuf>) -> Spot {
        Spot {
            base: base.clone(),
            rel: rel.into(),
        }
    }

    /// The base's descriptor and the whole relative path, when the kernel can take it in
    /// one call (only plain components, and short enough).
    fn whole(&self) -> io::Result<Option<(RawFd, CString)>> {
        let bytes = self.rel.as_os_str().as_bytes();
        let plain = self.rel.components().all(|c| matches!(c, Component::Normal(_)));
        if !plain || bytes.is_empty() || bytes.len() > FAST_PATH_MAX {
            return Ok(None);
        }
        Ok(Some((self.base.fd()?, cstr(bytes)?)))
    }

    /// The directory holding this spot and the spot's own name. With `create`, missing
    /// directories are made (and a file in the way of one, a stale table, is removed).
    fn parent(&self, create: bool) -> io::Result<(OwnedFd, CString)> {
        let mut dir = open_at(self.base.fd()?, c".", DIR_FLAGS, 0)?;
        let parts: Vec<&[u8]> = self
            .rel
            .components()
            .filter_map(|c| match c {
                Component::Normal(n) => Some(n.as_bytes()),
                _ => None,
            })
            .collect();
        let (last, dirs) = parts.split_last().ok_or(io::ErrorKind::InvalidInput)?;
        for d in dirs {
            let name = cstr(d)?;
            dir = match open_at(dir.as_raw_fd(), &name, DIR_FLAGS, 0) {
                Ok(fd) => fd,
                Err(e) if create && matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::ENOTDIR)) => {
                    if e.raw_os_error() == Some(libc::ENOTDIR) {
                        // SAFETY: valid descriptor and name.
                        unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), 0) };
                    }
                    // SAFETY: valid descriptor and name.
                    if unsafe { libc::mkdirat(dir.as_raw_fd(), name.as_ptr(), 0o755) } < 0
                        && last_error().raw_os_error() != Some(libc::EEXIST)
                    {
                        return Err(last_error());
                    }
                    open_at(dir.as_raw_fd(), &name, DIR_FLAGS, 0)?
                }
                Err(e) => return Err(e),
            };
        }
        Ok((dir, cstr(last)?))
    }

    /// Open read-write, creating the file and its directories.
    pub fn open_rw(&self) -> io::Result<File> {
        self.open_creating(0)
    }

    /// Create (or empty) the file, and its directories.
    pub fn create_empty(&self) -> io::Result<File> {
        self.open_creating(libc::O_TRUNC)
    }

    fn open_creating(&self, extra: i32) -> io::Result<File> {
        let flags = libc::O_RDWR | libc::O_CREAT | libc::O_NOFOLLOW | extra;
        if let Some((base, rel)) = self.whole()? {
            match open_at(base, &rel, flags, 0o644) {
                Ok(fd) => return Ok(File::from(fd)),
                // Missing directories, or a stale directory in the way: the slow path
                // makes or clears them.
                Err(e) if missing(&e) || e.raw_os_error() == Some(libc::EISDIR) => {}
                Err(e) => return Err(e),
            }
        }
        let (dir, name) = self.parent(true)?;
        let open = || open_at(dir.as_raw_fd(), &name, flags, 0o644);
        let fd = match open() {
            // A stale directory where a file now belongs (its directory was removed while
            // the daemon was down).
            Err(e) if e.raw_os_error() == Some(libc::EISDIR) => {
                remove_tree(dir.as_raw_fd(), &name)?;
                open()?
            }
            r => r?,
        };
        Ok(File::from(fd))
    }

    /// Open an existing file read-write; None if there is none.
    pub fn open_existing(&self) -> io::Result<Option<File>> {
        let flags = libc::O_RDWR | libc::O_NOFOLLOW;
        let opened = match self.whole()? {
            Some((base, rel)) => open_at(base, &rel, flags, 0),
            None => match self.parent(false) {
                Ok((dir, name)) => open_at(dir.as_raw_fd(), &name, flags, 0),
                Err(e) => Err(e),
            },
        };
        match opened {
            Ok(fd) => Ok(Some(File::from(fd))),
            Err(e) if missing(&e) || e.raw_os_error() == Some(libc::EISDIR) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// None if nothing is there; Some(true) for a directory.
    pub fn is_dir(&self) -> Option<bool> {
        // SAFETY: stat is plain data; the kernel fills it in.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        let stat = |dir: RawFd, name: &CString, st: &mut libc::stat| {
            // SAFETY: valid descriptor, name and output struct.
            unsafe { libc::fstatat(dir, name.as_ptr(), st, libc::AT_SYMLINK_NOFOLLOW) }
        };
        let r = match self.whole().ok()? {
            Some((base, rel)) => stat(base, &rel, &mut st),
            None => {
                let (dir, name) = self.parent(false).ok()?;
                stat(dir.as_raw_fd(), &name, &mut st)
            }
        };
        (r == 0).then_some(st.st_mode & libc::S_IFMT == libc::S_IFDIR)
    }

    pub fn exists(&self) -> bool {
        self.is_dir().is_some()
    }

    /// Remove a file or a whole directory tree; nothing there is fine.
    pub fn remove(&self) -> io::Result<()> {
        if let Some((base, rel)) = self.whole()? {
            // SAFETY: valid descriptor and name.
            if unsafe { libc::unlinkat(base, rel.as_ptr(), 0) } == 0 {
                return Ok(());
            }
            let e = last_error();
            if missing(&e) {
                return Ok(());
            }
            if !matches!(e.raw_os_error(), Some(libc::EISDIR) | Some(libc::EPERM)) {
                return Err(e);
            }
        }
        let (dir, name) = match self.parent(false) {
            Ok(x) => x,
            Err(e) if missing(&e) => return Ok(()),
            Err(e) => return Err(e),
        };
        remove_tree(dir.as_raw_fd(), &name)
    }

    /// Remove everything in this directory, keeping the directory (and its descriptor,
    /// when it is a base).
    pub fn clear(base: &Base) -> io::Result<()> {
        let names: Vec<CString> = std::fs::read_dir(base.path())?
            .filter_map(|e| e.ok())
            .filter_map(|e| CString::new(e.file_name().as_bytes()).ok())
            .collect();
        let dir = base.fd()?;
        for n in names {
            remove_tree(dir, &n)?;
        }
        Ok(())
    }

    /// `renameat2` to `to` (whose directories are made).
    pub fn rename_to(&self, to: &Spot, flags: u32) -> io::Result<()> {
        self.to_other(to, |fd, f, td, t| {
            // SAFETY: valid descriptors and names.
            unsafe { libc::syscall(libc::SYS_renameat2, fd, f.as_ptr(), td, t.as_ptr(), flags) as i32 }
        })
    }

    /// A hard link of this file at `to` (whose directories are made).
    pub fn link_to(&self, to: &Spot) -> io::Result<()> {
        self.to_other(to, |fd, f, td, t| {
            // SAFETY: valid descriptors and names.
            unsafe { libc::linkat(fd, f.as_ptr(), td, t.as_ptr(), 0) }
        })
    }

    /// A two-path call (`op` returns the syscall's result) from this spot to `to`: in one
    /// call when both paths fit, else (or when directories of `to` are missing) through
    /// their parents, making `to`'s.
    fn to_other(&self, to: &Spot, op: impl Fn(RawFd, &CString, RawFd, &CString) -> i32) -> io::Result<()> {
        let call = |fd: RawFd, f: &CString, td: RawFd, t: &CString| {
            if op(fd, f, td, t) < 0 {
                Err(last_error())
            } else {
                Ok(())
            }
        };
        if let (Some((fb, f)), Some((tb, t))) = (self.whole()?, to.whole()?) {
            match call(fb, &f, tb, &t) {
                // Nothing at this spot: said as the slow path would, without walking it.
                // (When `to` is right in its base, whose directory exists, ENOENT can only
                // mean that.)
                Err(e) if missing(&e) && (to.rel.components().count() == 1 || !self.exists()) => return Err(e),
                Err(e) if missing(&e) => {}
                r => return r,
            }
        }
        let (fd, fname) = self.parent(false)?;
        let (td, tname) = to.parent(true)?;
        call(fd.as_raw_fd(), &fname, td.as_raw_fd(), &tname)
    }
}

/// Remove `name` in `dir`, a file or a directory tree; missing is fine.
fn remove_tree(dir: RawFd, name: &CString) -> io::Result<()> {
    // SAFETY: valid descriptor and name.
    if unsafe { libc::unlinkat(dir, name.as_ptr(), 0) } == 0 {
        return Ok(());
    }
    match last_error().raw_os_error() {
        Some(libc::ENOENT) => return Ok(()),
        Some(libc::EISDIR) | Some(libc::EPERM) => {}
        _ => return Err(last_error()),
    }
    let sub = open_at(dir, name, libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW, 0)?;
    // The directory's own descriptor path has no length limit.
    let names: Vec<CString> = std::fs::read_dir(Path::new(&format!("/proc/self/fd/{}", sub.as_raw_fd())))?
        .filter_map(|e| e.ok())
        .filter_map(|e| CString::new(e.file_name().as_bytes()).ok())
        .collect();
    for n in names {
        remove_tree(sub.as_raw_fd(), &n)?;
    }
    // SAFETY: valid descriptor and name.
    if unsafe { libc::unlinkat(dir, name.as_ptr(), libc::AT_REMOVEDIR) } < 0
        && last_error().raw_os_error() != Some(libc::ENOENT)
    {
        return Err(last_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_past_path_max_are_created_renamed_linked_and_removed() {
        let base = std::env::temp_dir().join(format!("lockstep-longpath-{}", std::process::id()));
        // (a leftover from an earlier run, if any)
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        // 40 components of 200 bytes: 8 KiB, twice PATH_MAX.
        let deep: PathBuf = (0..40).map(|i| format!("{i:0>200}")).collect();
        let b = Base::new(&base);
        let f = Spot::new(&b, deep.join("f"));
        use std::io::Write;
        f.open_rw().unwrap().write_all(b"x").unwrap();
        assert_eq!(f.is_dir(), Some(false));
        let g = Spot::new(&b, deep.join("g"));
        f.link_to(&g).unwrap();
        let h = Spot::new(&b, "h");
        g.rename_to(&h, 0).unwrap();
        assert!(!g.exists());
        assert_eq!(std::fs::read(base.join("h")).unwrap(), b"x");
        let top = Spot::new(&b, deep.components().next().unwrap().as_os_str());
        top.remove().unwrap();
        assert!(!f.exists() && !top.exists());
        top.remove().unwrap();
    }
}

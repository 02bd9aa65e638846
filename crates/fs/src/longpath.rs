//! Paths that may be longer than PATH_MAX: a short base directory plus a relative path,
//! reached one component at a time with `*at` calls. A store's tables mirror the tree's
//! paths under `.lockstep/crc/`, so a file whose own path is just under PATH_MAX has a
//! table path just over it.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

/// A place in the tree under `base`.
#[derive(Clone, Debug)]
pub struct Spot {
    pub base: PathBuf,
    pub rel: PathBuf,
}

fn last_error() -> io::Error {
    io::Error::last_os_error()
}

fn open_at(dir: RawFd, name: &CString, flags: i32, mode: u32) -> io::Result<OwnedFd> {
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

impl Spot {
    pub fn new(base: impl Into<PathBuf>, rel: impl Into<PathBuf>) -> Spot {
        Spot {
            base: base.into(),
            rel: rel.into(),
        }
    }

    /// The directory holding this spot and the spot's own name. With `create`, missing
    /// directories are made (and a file in the way of one, a stale table, is removed).
    fn parent(&self, create: bool) -> io::Result<(OwnedFd, CString)> {
        let base = cstr(self.base.as_os_str().as_bytes())?;
        let mut dir = open_at(libc::AT_FDCWD, &base, DIR_FLAGS, 0)?;
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
        let (dir, name) = self.parent(true)?;
        let open = || {
            open_at(
                dir.as_raw_fd(),
                &name,
                libc::O_RDWR | libc::O_CREAT | libc::O_NOFOLLOW,
                0o644,
            )
        };
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
        let (dir, name) = match self.parent(false) {
            Ok(x) => x,
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::ENOTDIR)) => return Ok(None),
            Err(e) => return Err(e),
        };
        match open_at(dir.as_raw_fd(), &name, libc::O_RDWR | libc::O_NOFOLLOW, 0) {
            Ok(fd) => Ok(Some(File::from(fd))),
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::EISDIR)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Create (or empty) the file, and its directories.
    pub fn create_empty(&self) -> io::Result<File> {
        let f = self.open_rw()?;
        f.set_len(0)?;
        Ok(f)
    }

    /// None if nothing is there; Some(true) for a directory.
    pub fn is_dir(&self) -> Option<bool> {
        let (dir, name) = self.parent(false).ok()?;
        // SAFETY: stat is plain data; the kernel fills it in.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: valid descriptor, name and output struct.
        if unsafe { libc::fstatat(dir.as_raw_fd(), name.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) } < 0 {
            return None;
        }
        Some(st.st_mode & libc::S_IFMT == libc::S_IFDIR)
    }

    pub fn exists(&self) -> bool {
        self.is_dir().is_some()
    }

    /// Remove a file or a whole directory tree; nothing there is fine.
    pub fn remove(&self) -> io::Result<()> {
        let (dir, name) = match self.parent(false) {
            Ok(x) => x,
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::ENOTDIR)) => return Ok(()),
            Err(e) => return Err(e),
        };
        remove_tree(dir.as_raw_fd(), &name)
    }

    /// `renameat2` to `to` (whose directories are made).
    pub fn rename_to(&self, to: &Spot, flags: u32) -> io::Result<()> {
        let (fd, fname) = self.parent(false)?;
        let (td, tname) = to.parent(true)?;
        // SAFETY: valid descriptors and names.
        let r = unsafe {
            libc::syscall(
                libc::SYS_renameat2,
                fd.as_raw_fd(),
                fname.as_ptr(),
                td.as_raw_fd(),
                tname.as_ptr(),
                flags,
            )
        };
        if r < 0 {
            return Err(last_error());
        }
        Ok(())
    }

    /// A hard link of this file at `to` (whose directories are made).
    pub fn link_to(&self, to: &Spot) -> io::Result<()> {
        let (fd, fname) = self.parent(false)?;
        let (td, tname) = to.parent(true)?;
        // SAFETY: valid descriptors and names.
        if unsafe { libc::linkat(fd.as_raw_fd(), fname.as_ptr(), td.as_raw_fd(), tname.as_ptr(), 0) } < 0 {
            return Err(last_error());
        }
        Ok(())
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
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        // 40 components of 200 bytes: 8 KiB, twice PATH_MAX.
        let deep: PathBuf = (0..40).map(|i| format!("{i:0>200}")).collect();
        let f = Spot::new(&base, deep.join("f"));
        use std::io::Write;
        f.open_rw().unwrap().write_all(b"x").unwrap();
        assert_eq!(f.is_dir(), Some(false));
        let g = Spot::new(&base, deep.join("g"));
        f.link_to(&g).unwrap();
        let h = Spot::new(&base, "h");
        g.rename_to(&h, 0).unwrap();
        assert!(!g.exists());
        assert_eq!(std::fs::read(base.join("h")).unwrap(), b"x");
        let top = Spot::new(&base, deep.components().next().unwrap().as_os_str());
        top.remove().unwrap();
        assert!(!f.exists() && !top.exists());
        top.remove().unwrap();
    }
}

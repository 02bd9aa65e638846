//! The caller's side of a run whose processes may outlive the program's first process.
//!
//! `lockstep run` splits in two before it starts any replica. The *front* is the process the
//! caller started and waits for; the *monitor* (its child) does all the work. When the
//! program's first process exits and others live on (a background job, a double-forked
//! daemon), the monitor sends the exit status through a pipe and detaches; the front exits
//! with that status, as the native program's caller would see it, while the monitor goes on
//! replicating and voting the survivors until the last one exits. When nothing survives,
//! the monitor sends nothing: the front waits for it to finish and exits with its status,
//! so the caller never sees lockstep return before it has cleaned up.
//!
//! Signals that lockstep forwards to the program (SIGINT, SIGTERM, ...) and that reach the
//! front while the monitor runs are passed on to the monitor.

use crate::Error;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicI32, Ordering};

/// The monitor's end: where the program's status goes when the monitor detaches.
pub struct Front {
    status: Option<OwnedFd>,
    /// The pid of the process the caller started (the front's, or ours without a front):
    /// the program gets it as its own pid (see `spawn::Plan::pid`).
    caller_pid: libc::pid_t,
}

static MONITOR: AtomicI32 = AtomicI32::new(0);

extern "C" fn pass_on(sig: libc::c_int) {
    let pid = MONITOR.load(Ordering::SeqCst);
    if pid > 0 {
        // SAFETY: kill is async-signal-safe.
        unsafe { libc::kill(pid, sig) };
    }
}

/// Forks the monitor. Returns in the monitor only; the front waits and exits.
pub fn split() -> Result<Front, Error> {
    let mut fds = [0i32; 2];
    // SAFETY: fds is a writable array of two ints.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(Error::Io("pipe2", io::Error::last_os_error()));
    }
    // SAFETY: both were just returned by pipe2 and are owned by nobody else.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: getpid has no preconditions.
    let front_pid = unsafe { libc::getpid() };
    // SAFETY: lockstep is single-threaded here (before any replica or helper thread).
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(Error::Io("fork", io::Error::last_os_error()));
    }
    if pid == 0 {
        drop(read);
        // Until we detach, we live and die with the front: a SIGKILL to the process the
        // caller started must not leave the program running.
        // SAFETY: prctl on ourselves; getppid has no preconditions.
        unsafe {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
            if libc::getppid() != front_pid {
                libc::_exit(lockstep_core::exit::LOCKSTEP_FAILURE);
            }
        }
        return Ok(Front {
            status: Some(write),
            caller_pid: front_pid,
        });
    }
    drop(write);
    MONITOR.store(pid, Ordering::SeqCst);
    for sig in crate::session::FORWARDED {
        // SAFETY: the handler only reads an atomic and calls kill.
        unsafe { libc::signal(sig, pass_on as *const () as libc::sighandler_t) };
    }
    std::process::exit(wait_for_monitor(read, pid))
}

/// The front's life: the status the monitor sends, or the monitor's own exit status.
fn wait_for_monitor(read: OwnedFd, monitor: libc::pid_t) -> i32 {
    let mut buf = [0u8; 4];
    let mut got = 0;
    while got < buf.len() {
        // SAFETY: reading into the unfilled tail of a local buffer.
        let n = unsafe { libc::read(read.as_raw_fd(), buf[got..].as_mut_ptr().cast(), buf.len() - got) };
        if n > 0 {
            got += n as usize;
        } else if n == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            break;
        }
    }
    if got == buf.len() {
        return i32::from_le_bytes(buf);
    }
    loop {
        let mut status = 0;
        // SAFETY: waiting for our own child.
        let r = unsafe { libc::waitpid(monitor, &mut status, 0) };
        if r == monitor {
            return if libc::WIFEXITED(status) {
                libc::WEXITSTATUS(status)
            } else {
                lockstep_core::exit::SIGNAL_BASE + libc::WTERMSIG(status)
            };
        }
        if r < 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return lockstep_core::exit::LOCKSTEP_FAILURE;
        }
    }
}

impl Front {
    /// A front for a run that never detaches (`--kill-orphans`).
    pub fn none() -> Front {
        Front {
            status: None,
            // SAFETY: getpid has no preconditions.
            caller_pid: unsafe { libc::getpid() },
        }
    }

    pub fn caller_pid(&self) -> libc::pid_t {
        self.caller_pid
    }

    pub fn can_detach(&self) -> bool {
        self.status.is_some()
    }

    /// Hands the program's exit status to the caller and detaches from it: the front
    /// exits with `status`; our stdin, stdout and stderr become /dev/null (so the caller's
    /// pipes see EOF, as they do natively once the survivors have let go of them), and we
    /// leave the caller's session.
    pub fn detach(&mut self, status: i32) {
        let Some(fd) = self.status.take() else { return };
        // The front is about to exit: from now on we outlive it on purpose.
        // SAFETY: prctl on ourselves.
        unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, 0, 0, 0, 0) };
        // SAFETY: writing four bytes from a local; a short write cannot happen on a pipe
        // for fewer than PIPE_BUF bytes.
        unsafe { libc::write(fd.as_raw_fd(), status.to_le_bytes().as_ptr().cast(), 4) };
        drop(fd);
        // SAFETY: open/dup2/close/setsid on our own descriptors and process.
        unsafe {
            let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
            if null >= 0 {
                for fd in 0..3 {
                    libc::dup2(null, fd);
                }
                if null > 2 {
                    libc::close(null);
                }
            }
            libc::setsid();
        }
    }
}

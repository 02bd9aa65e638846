//! A thin, level-triggered epoll: the replica thread waits here for every socket it owns
//! (client connections, replica links, both listeners) and for its next tick.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

/// What a socket is watched for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Interest(u32);

impl Interest {
    pub const NONE: Interest = Interest(0);
    pub const READ: Interest = Interest(libc::EPOLLIN as u32 | libc::EPOLLRDHUP as u32);
    pub const WRITE: Interest = Interest(libc::EPOLLOUT as u32);
    pub const BOTH: Interest = Interest(Self::READ.0 | Self::WRITE.0);

    pub fn with_write(self, write: bool) -> Interest {
        if write {
            Interest(self.0 | Self::WRITE.0)
        } else {
            Interest(self.0 & !Self::WRITE.0)
        }
    }
}

/// One readiness report.
#[derive(Clone, Copy, Debug)]
pub struct Ready {
    pub token: u64,
    /// Readable, or the peer hung up or the socket failed (a read then says which).
    pub read: bool,
    pub write: bool,
}

pub struct Poller {
    epoll: OwnedFd,
}

/// Reports taken per wait, at most (the rest stay ready for the next one).
const EVENTS_MAX: usize = 256;

impl Poller {
    pub fn new() -> io::Result<Poller> {
        // SAFETY: epoll_create1 takes no pointers; a non-negative result is a new fd we own.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Poller {
            // SAFETY: fd was just returned by the kernel and nothing else owns it.
            epoll: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    fn ctl(&self, op: libc::c_int, fd: RawFd, token: u64, interest: Interest) -> io::Result<()> {
        let mut ev = libc::epoll_event {
            events: interest.0,
            u64: token,
        };
        // SAFETY: ev is a valid epoll_event for the duration of the call.
        let r = unsafe { libc::epoll_ctl(self.epoll.as_raw_fd(), op, fd, &mut ev) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    pub fn add(&self, fd: &impl AsRawFd, token: u64, interest: Interest) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_ADD, fd.as_raw_fd(), token, interest)
    }

    pub fn modify(&self, fd: &impl AsRawFd, token: u64, interest: Interest) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_MOD, fd.as_raw_fd(), token, interest)
    }

    /// Stop watching `fd` (closing it does that too; this is for a socket that stays open).
    pub fn remove(&self, fd: &impl AsRawFd) {
        // Not watched (any more) is the state asked for.
        let _ = self.ctl(libc::EPOLL_CTL_DEL, fd.as_raw_fd(), 0, Interest::NONE);
    }

    /// Wait up to `timeout` and append what is ready to `out` (cleared first).
    pub fn wait(&self, timeout: Duration, out: &mut Vec<Ready>) -> io::Result<()> {
        out.clear();
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; EVENTS_MAX];
        // Rounded up: a deadline 0.5 ms away must not become a busy poll.
        let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
        // SAFETY: events is a writable array of EVENTS_MAX entries.
        let n = unsafe { libc::epoll_wait(self.epoll.as_raw_fd(), events.as_mut_ptr(), EVENTS_MAX as i32, ms) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::Interrupted {
                Ok(())
            } else {
                Err(e)
            };
        }
        let hangup = (libc::EPOLLIN | libc::EPOLLRDHUP | libc::EPOLLHUP | libc::EPOLLERR) as u32;
        for ev in &events[..n as usize] {
            let bits = ev.events;
            out.push(Ready {
                token: ev.u64,
                read: bits & hangup != 0,
                write: bits & (libc::EPOLLOUT as u32 | libc::EPOLLERR as u32) != 0,
            });
        }
        Ok(())
    }
}

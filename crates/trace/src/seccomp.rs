//! The seccomp-bpf filter that decides which syscalls stop in the monitor, and the
//! user-notification listener that installs file descriptors into a stopped tracee.
//!
//! The filter is built from [`crate::syscalls`]: `Passthrough` syscalls are allowed
//! without a stop, [`crate::SYS_LOCKSTEP_INSTALL`] raises a user notification, and every
//! other syscall (including unknown numbers) stops with SECCOMP_RET_TRACE. With the fast
//! path, a call made from its gate ([`crate::FAST_GATE`]) is allowed first, or, for strict
//! output checks, every call there that changes the outside world stops ([`Gate`]).

use crate::syscalls::{self, Class};
use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

const SECCOMP_SET_MODE_FILTER: libc::c_ulong = 1;
const SECCOMP_FILTER_FLAG_NEW_LISTENER: libc::c_ulong = 1 << 3;
const SECCOMP_RET_ALLOW: u32 = 0x7fff_0000;
const SECCOMP_RET_TRACE: u32 = 0x7ff0_0000;
const SECCOMP_RET_USER_NOTIF: u32 = 0x7fc0_0000;
const SECCOMP_RET_KILL_PROCESS: u32 = 0x8000_0000;
const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
const X32_SYSCALL_BIT: u32 = 0x4000_0000;

const BPF_LD_W_ABS: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS
const BPF_JEQ_K: u16 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
const BPF_JGE_K: u16 = 0x35; // BPF_JMP | BPF_JGE | BPF_K
const BPF_JSET_K: u16 = 0x45; // BPF_JMP | BPF_JSET | BPF_K
const BPF_RET_K: u16 = 0x06; // BPF_RET | BPF_K

fn stmt(code: u16, k: u32) -> libc::sock_filter {
    libc::sock_filter { code, jt: 0, jf: 0, k }
}
fn jump(code: u16, k: u32, jt: u8, jf: u8) -> libc::sock_filter {
    libc::sock_filter { code, jt, jf, k }
}

/// What the filter does with calls made from the fast path's gate ([`crate::FAST_GATE`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gate {
    /// No fast path: the gate's address is nothing special.
    Absent,
    /// Every call from the gate is allowed: the shim's own, already replicated.
    AllowAll,
    /// Every call from the gate is allowed except those that change the outside world
    /// (class `Output`): they stop, so that the monitor checks an output before it leaves
    /// (strict output checks).
    StopOutputs,
}

/// The filter program. Built before fork so that the child only has to install it.
pub fn build_filter(gate: Gate) -> Vec<libc::sock_filter> {
    // mmap stops only for shared file mappings: MAP_SHARED (or MAP_SHARED_VALIDATE)
    // without MAP_ANONYMOUS. Everything else (the loader's and malloc's maps) never stops.
    const MAP_SHARED: u32 = libc::MAP_SHARED as u32;
    const MAP_ANONYMOUS: u32 = libc::MAP_ANONYMOUS as u32;
    const FLAGS_LOW: u32 = 16 + 3 * 8; // seccomp_data.args[3], low 32 bits
    let of_class = |class: Class| -> Vec<u32> {
        syscalls::table()
            .iter()
            .filter(|d| d.class == class)
            .map(|d| d.nr as u32)
            .collect()
    };
    let mut prog = vec![
        stmt(BPF_LD_W_ABS, 4), // seccomp_data.arch
        jump(BPF_JEQ_K, AUDIT_ARCH_X86_64, 1, 0),
        stmt(BPF_RET_K, SECCOMP_RET_KILL_PROCESS),
    ];
    if gate != Gate::Absent {
        // What happens to a call from the gate (the accumulator holds nothing useful yet).
        let mut at_gate = Vec::new();
        if gate == Gate::StopOutputs {
            at_gate.push(stmt(BPF_LD_W_ABS, 0)); // seccomp_data.nr
            for nr in of_class(Class::Output) {
                at_gate.push(jump(BPF_JEQ_K, nr, 0, 1));
                at_gate.push(stmt(BPF_RET_K, SECCOMP_RET_TRACE));
            }
        }
        at_gate.push(stmt(BPF_RET_K, SECCOMP_RET_ALLOW));
        let skip = u8::try_from(at_gate.len()).expect("the gate's block fits a BPF jump");
        // seccomp_data.instruction_pointer is the address after the `syscall` (2 bytes).
        let ip = crate::FAST_GATE + 2;
        prog.extend([
            stmt(BPF_LD_W_ABS, 8), // instruction_pointer, low half
            jump(BPF_JEQ_K, ip as u32, 0, skip + 2),
            stmt(BPF_LD_W_ABS, 12), // high half
            jump(BPF_JEQ_K, (ip >> 32) as u32, 0, skip),
        ]);
        prog.extend(at_gate);
    }
    prog.extend([
        stmt(BPF_LD_W_ABS, 0), // seccomp_data.nr
        // x32 syscalls are not supported: let them stop so the monitor can name them.
        jump(BPF_JGE_K, X32_SYSCALL_BIT, 0, 1),
        stmt(BPF_RET_K, SECCOMP_RET_TRACE),
        jump(BPF_JEQ_K, crate::SYS_LOCKSTEP_INSTALL as u32, 0, 1),
        stmt(BPF_RET_K, SECCOMP_RET_USER_NOTIF),
        // Not mmap: on to the allow list (the accumulator still holds the number).
        jump(BPF_JEQ_K, libc::SYS_mmap as u32, 0, 5),
        stmt(BPF_LD_W_ABS, FLAGS_LOW),
        jump(BPF_JSET_K, MAP_SHARED, 0, 2),
        jump(BPF_JSET_K, MAP_ANONYMOUS, 1, 0),
        stmt(BPF_RET_K, SECCOMP_RET_TRACE),
        stmt(BPF_RET_K, SECCOMP_RET_ALLOW),
    ]);
    for nr in of_class(Class::Passthrough) {
        prog.push(jump(BPF_JEQ_K, nr, 0, 1));
        prog.push(stmt(BPF_RET_K, SECCOMP_RET_ALLOW));
    }
    prog.push(stmt(BPF_RET_K, SECCOMP_RET_TRACE));
    assert!(prog.len() < 4096, "BPF programs are limited to 4096 instructions");
    prog
}

/// Installs `filter` in the calling thread and returns the user-notification listener.
/// Meant for a freshly forked child: it allocates nothing.
///
/// # Safety
/// Must be called in a single-threaded child after fork, with `filter` built beforehand.
pub unsafe fn install(filter: &[libc::sock_filter]) -> Result<RawFd, i32> {
    let prog = libc::sock_fprog {
        len: filter.len() as u16,
        filter: filter.as_ptr() as *mut libc::sock_filter,
    };
    let call = || {
        libc::syscall(
            libc::SYS_seccomp,
            SECCOMP_SET_MODE_FILTER,
            SECCOMP_FILTER_FLAG_NEW_LISTENER,
            &prog,
        )
    };
    let mut fd = call();
    if fd < 0 && *libc::__errno_location() == libc::EACCES {
        // Without CAP_SYS_ADMIN the kernel requires no_new_privs first.
        libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
        fd = call();
    }
    if fd < 0 {
        Err(*libc::__errno_location())
    } else {
        Ok(fd as RawFd)
    }
}

#[repr(C)]
#[derive(Default, Clone, Copy, Debug)]
pub struct NotifData {
    pub nr: i32,
    pub arch: u32,
    pub ip: u64,
    pub args: [u64; 6],
}

#[repr(C)]
#[derive(Default, Clone, Copy, Debug)]
pub struct Notif {
    pub id: u64,
    pub pid: u32,
    pub flags: u32,
    pub data: NotifData,
}

#[repr(C)]
#[derive(Default)]
struct NotifResp {
    id: u64,
    val: i64,
    error: i32,
    flags: u32,
}

#[repr(C)]
#[derive(Default)]
struct NotifAddfd {
    id: u64,
    flags: u32,
    srcfd: u32,
    newfd: u32,
    newfd_flags: u32,
}

const NOTIF_RECV: libc::c_ulong = 0xc050_2100;
const NOTIF_SEND: libc::c_ulong = 0xc018_2101;
const NOTIF_ADDFD: libc::c_ulong = 0x4018_2103;
const ADDFD_FLAG_SETFD: u32 = 1;

/// The monitor's end of one replica's seccomp user-notification channel.
pub struct Listener {
    fd: OwnedFd,
}

impl Listener {
    pub fn from_fd(fd: OwnedFd) -> Self {
        Listener { fd }
    }

    fn raw(&self) -> RawFd {
        use std::os::fd::AsRawFd;
        self.fd.as_raw_fd()
    }

    /// Waits up to `timeout` for the next notification. The wait also ends, with
    /// `ErrorKind::Interrupted`, when one of our children changes state (SIGCHLD, which the
    /// caller keeps blocked otherwise: see [`block_sigchld`]), so that a tracer can wait
    /// for a notification and for its tracee's stops at once.
    pub fn recv(&self, timeout: std::time::Duration) -> io::Result<Notif> {
        let wait = libc::timespec {
            tv_sec: timeout.as_secs().min(i32::MAX as u64) as libc::time_t,
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        let mut pfd = libc::pollfd {
            fd: self.raw(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: plain signal-set calls on a local set.
        let mask = unsafe {
            let mut mask: libc::sigset_t = std::mem::zeroed();
            libc::pthread_sigmask(libc::SIG_BLOCK, std::ptr::null(), &mut mask);
            libc::sigdelset(&mut mask, libc::SIGCHLD);
            mask
        };
        // SAFETY: one valid pollfd, a valid timespec and signal set.
        let n = unsafe { libc::ppoll(&mut pfd, 1, &wait, &mask) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "no seccomp notification arrived",
            ));
        }
        let mut notif = Notif::default();
        // SAFETY: the kernel fills a struct seccomp_notif of exactly this layout.
        if retry(|| unsafe { libc::ioctl(self.raw(), NOTIF_RECV, &mut notif) }) < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(notif)
    }

    /// Installs our `srcfd` into the notifying task at exactly `newfd`.
    pub fn add_fd(&self, id: u64, srcfd: RawFd, newfd: i32, cloexec: bool) -> io::Result<()> {
        let req = NotifAddfd {
            id,
            flags: ADDFD_FLAG_SETFD,
            srcfd: srcfd as u32,
            newfd: newfd as u32,
            newfd_flags: if cloexec { libc::O_CLOEXEC as u32 } else { 0 },
        };
        // SAFETY: struct seccomp_notif_addfd of exactly this layout.
        let r = retry(|| unsafe { libc::ioctl(self.raw(), NOTIF_ADDFD, &req) });
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Lets the notifying task return `val` from its syscall.
    pub fn respond(&self, id: u64, val: i64) -> io::Result<()> {
        let mut resp = NotifResp {
            id,
            val,
            error: 0,
            flags: 0,
        };
        // SAFETY: struct seccomp_notif_resp of exactly this layout.
        if retry(|| unsafe { libc::ioctl(self.raw(), NOTIF_SEND, &mut resp) }) < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

extern "C" fn on_sigchld(_: libc::c_int) {}

/// Gives SIGCHLD a handler (one that does nothing) and blocks it in the calling thread:
/// it then interrupts only the waits that unblock it on purpose ([`Listener::recv`]),
/// never a `waitpid` or anything else. Children must reset their signal mask.
pub fn block_sigchld() {
    // SAFETY: the handler does nothing; plain signal-set calls.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigchld as *const () as usize;
        // Restarted where it can be; ppoll never is, whatever the flag.
        sa.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(libc::SIGCHLD, &sa, std::ptr::null_mut());
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGCHLD);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

fn interrupted() -> bool {
    io::Error::last_os_error().raw_os_error() == Some(libc::EINTR)
}

/// Repeats a call that the monitor's own timer signal interrupted.
fn retry(mut call: impl FnMut() -> libc::c_int) -> libc::c_int {
    loop {
        let r = call();
        if r >= 0 || !interrupted() {
            return r;
        }
    }
}

/// A pidfd for process `pid`.
pub fn pidfd_open(pid: libc::pid_t) -> io::Result<OwnedFd> {
    // SAFETY: plain syscall; on success we own the returned descriptor.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fresh descriptor returned by the kernel.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// A duplicate, in our process, of descriptor `fd` of the process behind `pidfd`.
pub fn pidfd_getfd(pidfd: &OwnedFd, fd: i32) -> io::Result<OwnedFd> {
    use std::os::fd::AsRawFd;
    // SAFETY: plain syscall; on success we own the returned descriptor.
    let r = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fresh descriptor returned by the kernel.
    Ok(unsafe { OwnedFd::from_raw_fd(r as RawFd) })
}

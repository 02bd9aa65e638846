//! Counting one thread's syscalls without stopping it: a perf counter on the kernel's
//! `raw_syscalls:sys_enter` tracepoint, attached to the thread. A ptrace syscall stop per
//! entry and exit costs a wake-up of the tracer each, which made a traced server start ten
//! times slower; the counter costs the thread almost nothing.
//!
//! A tracepoint is named to `perf_event_open` by its id, which only tracefs tells. Where
//! tracefs is not mounted, a short-lived child mounts it in a mount namespace of its own
//! and reads the id there, so the machine's mounts are left as they were. Without the
//! privilege for either (root or CAP_PERFMON with CAP_SYS_ADMIN), [`SyscallCounter::open`]
//! fails and callers count with ptrace stops instead.

use crate::Tid;
use std::io;
use std::sync::OnceLock;

/// `perf_event_attr` as of PERF_ATTR_SIZE_VER0 (64 bytes), the part this counter needs;
/// the kernel accepts the short form and treats the rest as zero.
#[repr(C)]
struct PerfEventAttr {
    kind: u32,
    size: u32,
    config: u64,
    sample_period: u64,
    sample_type: u64,
    read_format: u64,
    /// Bit flags (disabled, inherit, exclude_kernel, …): all clear, so the counter runs
    /// from its creation, counts kernel-side events and only for this thread.
    flags: u64,
    wakeup_events: u32,
    bp_type: u32,
    config1: u64,
}

const PERF_TYPE_TRACEPOINT: u32 = 2;
const PERF_FLAG_FD_CLOEXEC: libc::c_ulong = 8;
const ID_FILE: &str = "events/raw_syscalls/sys_enter/id";
const TRACEFS_DIRS: [&str; 2] = ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"];

/// Syscall entries of one thread since the counter was opened.
pub struct SyscallCounter {
    fd: std::os::fd::OwnedFd,
}

impl SyscallCounter {
    /// Starts counting the syscalls `tid` enters from now on (the one it is stopped in, if
    /// any, is not counted).
    pub fn open(tid: Tid) -> io::Result<SyscallCounter> {
        let id = sys_enter_id().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::Unsupported,
                "the raw_syscalls:sys_enter tracepoint is not available",
            )
        })?;
        let attr = PerfEventAttr {
            kind: PERF_TYPE_TRACEPOINT,
            size: std::mem::size_of::<PerfEventAttr>() as u32,
            config: id,
            sample_period: 0,
            sample_type: 0,
            read_format: 0,
            flags: 0,
            wakeup_events: 0,
            bp_type: 0,
            config1: 0,
        };
        // SAFETY: perf_event_open reads one attribute struct of the declared size.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_perf_event_open,
                &attr as *const PerfEventAttr,
                tid,
                -1 as libc::c_int,
                -1 as libc::c_int,
                PERF_FLAG_FD_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: perf_event_open returned a new descriptor that nothing else owns.
        let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) };
        Ok(SyscallCounter { fd })
    }

    /// The syscalls entered since [`SyscallCounter::open`].
    pub fn read(&self) -> io::Result<u64> {
        let mut count = [0u8; 8];
        // SAFETY: read of 8 bytes into an 8-byte buffer.
        let n = unsafe { libc::read(std::os::fd::AsRawFd::as_raw_fd(&self.fd), count.as_mut_ptr().cast(), 8) };
        if n != 8 {
            return Err(if n < 0 {
                io::Error::last_os_error()
            } else {
                io::Error::new(io::ErrorKind::UnexpectedEof, "short read of a perf counter")
            });
        }
        Ok(u64::from_ne_bytes(count))
    }

    /// Whether counters can be opened here (looked up once per process). The counter
    /// opened to find out stays open for the life of the process: while one counter on the
    /// tracepoint exists, opening and closing others is cheap, but closing the last one
    /// unregisters the tracepoint and waits for an RCU grace period (about 10 ms here),
    /// which inject would pay at every injection with the server stopped.
    pub fn available() -> bool {
        static KEEPS_THE_TRACEPOINT: OnceLock<Option<SyscallCounter>> = OnceLock::new();
        KEEPS_THE_TRACEPOINT
            .get_or_init(|| {
                // SAFETY: gettid has no preconditions.
                let me = unsafe { libc::gettid() };
                SyscallCounter::open(me).ok()
            })
            .is_some()
    }
}

/// The tracepoint's id, from a mounted tracefs or a private mount of one.
fn sys_enter_id() -> Option<u64> {
    static ID: OnceLock<Option<u64>> = OnceLock::new();
    *ID.get_or_init(|| {
        TRACEFS_DIRS
            .iter()
            .find_map(|dir| parse_id(&std::fs::read(format!("{dir}/{ID_FILE}")).ok()?))
            .or_else(id_from_private_tracefs)
    })
}

fn parse_id(text: &[u8]) -> Option<u64> {
    std::str::from_utf8(text).ok()?.trim().parse().ok()
}

/// Forks a child that mounts tracefs in a new mount namespace (invisible to the rest of
/// the machine) and sends back the id file's contents.
fn id_from_private_tracefs() -> Option<u64> {
    let c = |s: &str| std::ffi::CString::new(s).expect("no NUL in constant paths");
    // Built before the fork: the child of a multi-threaded process must not allocate.
    let (root, mount_point, fstype) = (c("/"), c(TRACEFS_DIRS[0]), c("tracefs"));
    let id_path = c(&format!("{}/{ID_FILE}", TRACEFS_DIRS[0]));
    let mut pipe = [0; 2];
    // SAFETY: pipe2 writes two descriptors.
    if unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return None;
    }
    // SAFETY: the child makes raw syscalls only and ends with _exit.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: raw syscalls on buffers built before the fork.
        unsafe {
            let mut buf = [0u8; 32];
            let ok = libc::unshare(libc::CLONE_NEWNS) == 0
                && libc::mount(
                    std::ptr::null(),
                    root.as_ptr(),
                    std::ptr::null(),
                    libc::MS_REC | libc::MS_PRIVATE,
                    std::ptr::null(),
                ) == 0
                && libc::mount(
                    fstype.as_ptr(),
                    mount_point.as_ptr(),
                    fstype.as_ptr(),
                    0,
                    std::ptr::null(),
                ) == 0;
            if ok {
                let fd = libc::open(id_path.as_ptr(), libc::O_RDONLY);
                if fd >= 0 {
                    let n = libc::read(fd, buf.as_mut_ptr().cast(), buf.len());
                    if n > 0 {
                        libc::write(pipe[1], buf.as_ptr().cast(), n as usize);
                    }
                }
            }
            libc::_exit(0);
        }
    }
    // SAFETY: closing our copy of the write end; the child holds its own.
    unsafe { libc::close(pipe[1]) };
    let mut text = Vec::new();
    if pid > 0 {
        let mut buf = [0u8; 32];
        loop {
            // SAFETY: read into a local buffer.
            let n = unsafe { libc::read(pipe[0], buf.as_mut_ptr().cast(), buf.len()) };
            if n <= 0 || text.len() > 64 {
                break;
            }
            text.extend_from_slice(&buf[..n as usize]);
        }
        // SAFETY: reaping our own child.
        unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) };
    }
    // SAFETY: closing the read end we own.
    unsafe { libc::close(pipe[0]) };
    parse_id(&text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_the_syscalls_of_a_thread() {
        if !SyscallCounter::available() {
            eprintln!("skipped: perf tracepoint counters need root here");
            // SAFETY: geteuid has no preconditions.
            assert_ne!(unsafe { libc::geteuid() }, 0, "root must be able to count syscalls");
            return;
        }
        // SAFETY: gettid has no preconditions.
        let me = unsafe { libc::gettid() };
        let counter = SyscallCounter::open(me).expect("open");
        let before = counter.read().expect("read");
        for _ in 0..100 {
            // SAFETY: getppid has no preconditions.
            unsafe { libc::syscall(libc::SYS_getppid) };
        }
        let after = counter.read().expect("read");
        // Each read is a syscall too: exactly the 100 calls and the first read.
        assert_eq!(after - before, 101);
    }

    /// The counter opened at a traced program's exec stop agrees, syscall by syscall, with
    /// ptrace's entry stops counted from the same exec (what `--at syscall:K` counts).
    #[test]
    fn agrees_with_ptrace_syscall_stops_from_an_exec() {
        if !SyscallCounter::available() {
            // SAFETY: geteuid has no preconditions.
            assert_ne!(unsafe { libc::geteuid() }, 0, "root must be able to count syscalls");
            return;
        }
        use crate::ptrace::{self, Stop};
        let (prog, arg) = (c"/bin/ls", c"/");
        // SAFETY: the child makes raw syscalls only before its exec.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: async-signal-safe calls in the forked child.
            unsafe {
                let devnull = libc::open(c"/dev/null".as_ptr(), libc::O_WRONLY);
                libc::dup2(devnull, 1);
                libc::ptrace(libc::PTRACE_TRACEME, 0, 0, 0);
                libc::raise(libc::SIGSTOP);
                let argv = [prog.as_ptr(), arg.as_ptr(), std::ptr::null()];
                libc::execv(prog.as_ptr(), argv.as_ptr());
                libc::_exit(127);
            }
        }
        let wait = || {
            let mut status = 0;
            // SAFETY: waitpid on our child.
            assert_eq!(unsafe { libc::waitpid(pid, &mut status, libc::__WALL) }, pid);
            ptrace::decode(status)
        };
        assert!(matches!(wait(), Stop::Signal(libc::SIGSTOP)));
        let options = libc::PTRACE_O_TRACESYSGOOD | libc::PTRACE_O_TRACEEXEC | libc::PTRACE_O_EXITKILL;
        // SAFETY: plain ptrace on our stopped child.
        unsafe { libc::ptrace(libc::PTRACE_SETOPTIONS, pid, 0, options) };
        ptrace::cont(pid, 0).unwrap();
        // The exec's own syscall-exit is not a stop here: PTRACE_CONT up to the event.
        assert!(matches!(wait(), Stop::Event(libc::PTRACE_EVENT_EXEC)));
        let counter = SyscallCounter::open(pid).expect("open on a stopped tracee");
        let (mut entered, mut in_syscall, mut checked) = (0u64, true, 0);
        ptrace::cont_syscall(pid, 0).unwrap();
        loop {
            match wait() {
                Stop::SyscallExit => {
                    in_syscall = !in_syscall;
                    if in_syscall {
                        entered += 1;
                        // The tracepoint fires after the entry stop.
                        assert_eq!(counter.read().unwrap(), entered - 1, "at entry {entered}");
                    } else {
                        assert_eq!(counter.read().unwrap(), entered, "after syscall {entered}");
                        checked += 1;
                    }
                    ptrace::cont_syscall(pid, 0).unwrap();
                }
                Stop::Exited(code) => {
                    assert_eq!(code, 0);
                    break;
                }
                other => panic!("unexpected stop {other:?}"),
            }
        }
        assert!(checked > 20, "ls made only {checked} syscalls");
    }
}

//! The fork server: a campaign worker runs the program once, traced, and keeps stopped
//! copies of it (snapshots) at a few points along its CPU time. A run whose time point
//! lies past a snapshot starts as a fork of that snapshot instead of a fresh exec, so it
//! skips the part of the program before the snapshot, which is the same in every run of a
//! deterministic program. That part is on average half of a run, which is what lets a
//! campaign run faster per core than the program itself.
//!
//! Safe only where the copy cannot tell that it is a copy. The snapshot run therefore
//! stops taking snapshots at the first syscall outside [`harmless`] (anything that
//! writes a file, creates a thread or process, arms a timer, maps shared memory, talks to
//! the network, …), and a snapshot is only taken while the process has no descriptor
//! other than 0, 1 and 2, one thread, no pending signal, and is not inside a syscall. A
//! copy differs from a fresh run only in its pid and its CPU clocks, which start at zero
//! at the fork (docs/inject.md says so). Its stdout and stderr are fresh files that hold
//! what the program had written by the snapshot.

use crate::target::Child;
use crate::tree::idle;
use lockstep_trace::remote::Remote;
use lockstep_trace::{ptrace, Stop, Tid};
use std::io;
use std::path::Path;
use std::time::{Duration, Instant};

/// Snapshots per worker: runs start on average `1/(2 * SNAPSHOTS)` of the program's CPU
/// time before their point.
pub const SNAPSHOTS: u32 = 8;

/// How often the snapshot run may be stopped in all (a stop inside a syscall is tried
/// again): a program that sleeps through its snapshot points gets none.
const STOP_TRIES_MAX: u32 = 4 * SNAPSHOTS;

/// A stopped copy of the program.
struct Snapshot {
    pid: Tid,
    /// The program's CPU time since its exec when the copy was made.
    cpu: Duration,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
}

/// One worker's snapshots of the program (possibly none: the program was not safe to copy
/// early enough).
#[derive(Default)]
pub struct ForkServer {
    snapshots: Vec<Snapshot>,
}

impl Drop for ForkServer {
    fn drop(&mut self) {
        for s in &self.snapshots {
            ptrace::kill(s.pid, libc::SIGKILL);
            // SAFETY: reaping our own child.
            unsafe { libc::waitpid(s.pid, std::ptr::null_mut(), libc::__WALL) };
        }
        crate::target::forget_running(self.snapshots.iter().map(|s| s.pid));
    }
}

/// Where the snapshot run stands.
enum Chain {
    Running,
    /// Stopped where a copy cannot start (inside a syscall): try again a little later.
    NotHere,
    /// The program did something a copy could not repeat (or ended): no more snapshots.
    Done,
}

impl ForkServer {
    /// Runs the program once, traced, taking up to [`SNAPSHOTS`] - 1 snapshots spread
    /// evenly over `points_cpu` (the range time points are drawn from), until the first
    /// syscall that is not [`harmless`]. The run itself is killed at the last snapshot.
    pub fn build(
        argv: &[String],
        env: &[(String, String)],
        scratch: &Path,
        points_cpu: Duration,
        deadline: Instant,
    ) -> io::Result<ForkServer> {
        let child = Child::spawn(argv, true, scratch, "snapshot-", env)?;
        let mut server = ForkServer { snapshots: Vec::new() };
        let result = server.take_snapshots(&child, points_cpu, deadline);
        ptrace::kill(child.pid, libc::SIGKILL);
        // SAFETY: reaping our own child (its snapshots are children of ours, not of it).
        unsafe { libc::waitpid(child.pid, std::ptr::null_mut(), libc::__WALL) };
        child.forget();
        result.map(|()| server)
    }

    fn take_snapshots(&mut self, child: &Child, points_cpu: Duration, deadline: Instant) -> io::Result<()> {
        let pid = child.pid;
        if !matches!(ptrace::wait_tid(pid)?, Stop::Signal(libc::SIGSTOP)) {
            return Ok(()); // it ended before its exec
        }
        let options = libc::PTRACE_O_TRACESYSGOOD
            | libc::PTRACE_O_TRACEEXEC
            | libc::PTRACE_O_EXITKILL
            | libc::PTRACE_O_TRACECLONE
            | libc::PTRACE_O_TRACEFORK
            | libc::PTRACE_O_TRACEVFORK;
        // SAFETY: plain ptrace on our stopped child.
        unsafe { libc::ptrace(libc::PTRACE_SETOPTIONS, pid, 0, options) };
        ptrace::cont(pid, 0)?;
        if !matches!(ptrace::wait_tid(pid)?, Stop::Event(libc::PTRACE_EVENT_EXEC)) {
            return Ok(());
        }
        let exec_cpu = lockstep_trace::cpu::process_cpu(pid).unwrap_or_default();
        let cpu = || {
            lockstep_trace::cpu::process_cpu(pid)
                .unwrap_or_default()
                .saturating_sub(exec_cpu)
        };
        let step = points_cpu / SNAPSHOTS;
        if step.is_zero() {
            return Ok(());
        }
        // The exec's own exit stop comes first; then entries and exits alternate.
        let mut in_syscall = true;
        ptrace::cont_syscall(pid, 0)?;
        let (mut stopping, mut tries) = (false, 0u32);
        // After a stop that could not be a snapshot, the next try waits for some progress:
        // a SIGSTOP sent at once would be taken at the same place.
        let mut retry_at = Duration::ZERO;
        while self.snapshots.len() < SNAPSHOTS as usize - 1 {
            let next = step * (self.snapshots.len() as u32 + 1);
            let stop = match next_stop(pid, deadline, || !stopping && cpu() >= next.max(retry_at))? {
                Some(stop) => stop,
                None if Instant::now() >= deadline => return Ok(()),
                None => {
                    // SAFETY: tkill of our own tracee.
                    unsafe { libc::syscall(libc::SYS_tkill, pid, libc::SIGSTOP) };
                    stopping = true;
                    continue;
                }
            };
            match stop {
                Stop::SyscallExit => {
                    in_syscall = !in_syscall;
                    if in_syscall && !harmless(&ptrace::get_regs(pid)?) {
                        return Ok(());
                    }
                }
                Stop::Signal(libc::SIGSTOP) if stopping => {
                    stopping = false;
                    tries += 1;
                    if tries > STOP_TRIES_MAX {
                        return Ok(());
                    }
                    match self.snapshot_here(child, cpu())? {
                        Chain::Done => return Ok(()),
                        Chain::NotHere => retry_at = cpu() + step / 16,
                        Chain::Running => {}
                    }
                }
                // Any other signal, event or end: the program does more than a copy may.
                _ => return Ok(()),
            }
            ptrace::cont_syscall(pid, 0)?;
        }
        Ok(())
    }

    /// At the program's SIGSTOP: forks a stopped copy of it if it is in a state a copy
    /// can start from (else tries again at the next stop, or gives up).
    fn snapshot_here(&mut self, child: &Child, cpu: Duration) -> io::Result<Chain> {
        let pid = child.pid;
        if ptrace::get_regs(pid)?.orig_rax != u64::MAX {
            return Ok(Chain::NotHere); // interrupted in a syscall
        }
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        if !alone_with_standard_fds(pid, &status) || !copies_fit_in_memory(&status) {
            return Ok(Chain::Done);
        }
        let copy = fork_stopped(pid)?;
        crate::target::register_running(copy);
        let (stdout, stderr) = child.outputs();
        self.snapshots.push(Snapshot {
            pid: copy,
            cpu,
            stdout,
            stderr,
        });
        Ok(Chain::Running)
    }

    /// Starts a run as a fork of the last snapshot before `at` (CPU time since exec), its
    /// output in `scratch`: the child, stopped and traced, and the CPU time it has
    /// already done. None when no snapshot comes before `at`.
    pub(crate) fn start(&mut self, at: Duration, scratch: &Path) -> io::Result<Option<(Child, Duration)>> {
        let Some(snapshot) = self.snapshots.iter().rev().find(|s| s.cpu <= at) else {
            return Ok(None);
        };
        let out_path = scratch.join("stdout");
        let err_path = scratch.join("stderr");
        std::fs::write(&out_path, &snapshot.stdout)?;
        std::fs::write(&err_path, &snapshot.stderr)?;
        let started = Instant::now();
        let copy = fork_stopped(snapshot.pid)?;
        crate::target::register_running(copy);
        let child = Child {
            pid: copy,
            started,
            out_path,
            err_path,
        };
        if let Err(e) = become_run(&child) {
            // It may not have its own process group yet.
            ptrace::kill(copy, libc::SIGKILL);
            // SAFETY: reaping our own child.
            unsafe { libc::waitpid(copy, std::ptr::null_mut(), libc::__WALL) };
            child.forget();
            return Err(e);
        }
        Ok(Some((child, snapshot.cpu)))
    }

    pub fn is_empty(&self) -> bool {
        self.snapshots.is_empty()
    }
}

/// Waits for the tracee's next stop; None when `due()` says it is time to stop it (or
/// the deadline passed) with no stop pending.
fn next_stop(pid: Tid, deadline: Instant, due: impl Fn() -> bool) -> io::Result<Option<Stop>> {
    loop {
        if let Some(stop) = crate::target::try_stop(pid)? {
            return Ok(Some(stop));
        }
        if due() || Instant::now() >= deadline {
            return Ok(None);
        }
        idle();
    }
}

/// Makes the stopped process `pid` fork a copy of itself that is a child of this worker
/// (CLONE_PARENT), traced and stopped at its first stop with `pid`'s registers; `pid`
/// stays stopped, as it was.
fn fork_stopped(pid: Tid) -> io::Result<Tid> {
    let remote = Remote::enter(pid)?;
    let forked = remote.call(
        libc::SYS_clone,
        &[(libc::CLONE_PARENT | libc::SIGCHLD) as u64, 0, 0, 0, 0],
    );
    // The copy has the patch too (its memory is a copy of `pid`'s with the patch in).
    let copy = forked.as_ref().ok().and_then(|r| r.child).map(|c| (c, remote.adopt(c)));
    remote.leave()?;
    let (copy, copy_remote) = match (forked?, copy) {
        (_, Some(copy)) => copy,
        (r, None) => return Err(io::Error::other(format!("the fork failed ({})", r.value))),
    };
    match ptrace::wait_tid(copy)? {
        Stop::Signal(libc::SIGSTOP) | Stop::EventStop(_) => {}
        other => return Err(io::Error::other(format!("the fork's first stop was {other:?}"))),
    }
    copy_remote.leave()?;
    Ok(copy)
}

/// Gives a fresh copy its own process group and its own stdout and stderr (files already
/// holding what the program had written by the snapshot, written on at their end).
fn become_run(child: &Child) -> io::Result<()> {
    let remote = Remote::enter(child.pid)?;
    let result = (|| {
        remote.call_ok(libc::SYS_setpgid, &[0, 0])?;
        for (fd, path) in [(1u64, &child.out_path), (2, &child.err_path)] {
            let mut name = path.as_os_str().as_encoded_bytes().to_vec();
            name.push(0);
            let at = remote.scratch(&name)?;
            let opened = remote.call_ok(libc::SYS_openat, &[libc::AT_FDCWD as u64, at, libc::O_WRONLY as u64])?;
            remote.call_ok(libc::SYS_lseek, &[opened, 0, libc::SEEK_END as u64])?;
            remote.call_ok(libc::SYS_dup2, &[opened, fd])?;
            remote.call_ok(libc::SYS_close, &[opened])?;
        }
        Ok(())
    })();
    remote.leave()?;
    result
}

/// Whether [`SNAPSHOTS`] copies of the resident memory in `status` (/proc/PID/status) fit
/// in a quarter of the memory the machine has available: each copy keeps the pages the
/// program later writes.
fn copies_fit_in_memory(status: &str) -> bool {
    let field = |text: &str, key: &str| -> Option<u64> {
        text.lines()
            .find_map(|l| l.strip_prefix(key))?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    };
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    match (field(status, "VmRSS:"), field(&meminfo, "MemAvailable:")) {
        (Some(rss_kib), Some(available_kib)) => rss_kib.saturating_mul(SNAPSHOTS as u64) <= available_kib / 4,
        _ => false,
    }
}

/// One thread, no descriptor but 0, 1 and 2, no pending signal (`status`: its
/// /proc/PID/status).
fn alone_with_standard_fds(pid: Tid, status: &str) -> bool {
    let count = |dir: String| std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(usize::MAX);
    let no_pending = ["SigPnd:", "ShdPnd:"].iter().all(|field| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .is_some_and(|v| v.trim().trim_start_matches('0').is_empty())
    });
    count(format!("/proc/{pid}/task")) == 1 && count(format!("/proc/{pid}/fd")) == 3 && no_pending
}

/// The mapping-type bits of mmap's flags (the kernel's MAP_TYPE).
const MAP_TYPE: i32 = 0x0f;

/// Whether the syscall a traced program is entering leaves nothing outside its own
/// memory and registers that a fork would not copy: reads, private mappings, queries,
/// writes to stdout and stderr. Anything else ends the taking of snapshots.
pub fn harmless(regs: &lockstep_trace::Regs) -> bool {
    use libc as c;
    /// Calls that touch only the process itself, read, or ask.
    const PRIVATE: &[i64] = &[
        c::SYS_read,
        c::SYS_pread64,
        c::SYS_readv,
        c::SYS_preadv,
        c::SYS_close,
        c::SYS_fstat,
        c::SYS_stat,
        c::SYS_lstat,
        c::SYS_newfstatat,
        c::SYS_statx,
        c::SYS_lseek,
        c::SYS_access,
        c::SYS_faccessat,
        c::SYS_faccessat2,
        c::SYS_readlink,
        c::SYS_readlinkat,
        c::SYS_getcwd,
        c::SYS_getdents64,
        c::SYS_mprotect,
        c::SYS_munmap,
        c::SYS_brk,
        c::SYS_mremap,
        c::SYS_madvise,
        c::SYS_rt_sigaction,
        c::SYS_rt_sigprocmask,
        c::SYS_sigaltstack,
        c::SYS_getpid,
        c::SYS_getppid,
        c::SYS_gettid,
        c::SYS_getuid,
        c::SYS_geteuid,
        c::SYS_getgid,
        c::SYS_getegid,
        c::SYS_getpgrp,
        c::SYS_getrlimit,
        c::SYS_uname,
        c::SYS_sysinfo,
        c::SYS_arch_prctl,
        c::SYS_set_tid_address,
        c::SYS_set_robust_list,
        c::SYS_rseq,
        c::SYS_getrandom,
        c::SYS_clock_gettime,
        c::SYS_clock_getres,
        c::SYS_gettimeofday,
        c::SYS_time,
        c::SYS_nanosleep,
        c::SYS_clock_nanosleep,
        c::SYS_sched_getaffinity,
        c::SYS_sched_yield,
        c::SYS_futex,
        c::SYS_dup,
        c::SYS_dup2,
        c::SYS_dup3,
    ];
    const WRITES: &[i64] = &[c::SYS_write, c::SYS_writev, c::SYS_pwrite64, c::SYS_pwritev];
    let nr = regs.orig_rax as i64;
    let [a0, a1, a2, a3, ..] = ptrace::syscall_args(regs);
    let read_only = |flags: u64| {
        flags as i32 & (c::O_WRONLY | c::O_RDWR | c::O_CREAT | c::O_TRUNC | c::O_APPEND | c::O_TMPFILE) == 0
    };
    if PRIVATE.contains(&nr) {
        true
    } else if WRITES.contains(&nr) {
        a0 == 1 || a0 == 2
    } else if nr == c::SYS_open {
        read_only(a1)
    } else if nr == c::SYS_openat {
        read_only(a2)
    } else if nr == c::SYS_mmap {
        // A shared mapping would be shared with every copy.
        a3 as i32 & MAP_TYPE == c::MAP_PRIVATE
    } else if nr == c::SYS_ioctl {
        a1 == c::TCGETS || a1 == c::TIOCGWINSZ
    } else if nr == c::SYS_fcntl {
        [c::F_GETFD, c::F_GETFL, c::F_SETFD].contains(&(a1 as i32))
    } else if nr == c::SYS_prlimit64 {
        a2 == 0
    } else {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::harmless;

    fn call(nr: i64, args: [u64; 4]) -> lockstep_trace::Regs {
        // SAFETY: all-zero is a valid user_regs_struct.
        let mut regs: lockstep_trace::Regs = unsafe { std::mem::zeroed() };
        regs.orig_rax = nr as u64;
        (regs.rdi, regs.rsi, regs.rdx, regs.r10) = (args[0], args[1], args[2], args[3]);
        regs
    }

    #[test]
    fn only_calls_a_copy_can_repeat_are_harmless() {
        use libc as c;
        let private = (c::MAP_PRIVATE | c::MAP_ANONYMOUS) as u64;
        let shared = (c::MAP_SHARED | c::MAP_ANONYMOUS) as u64;
        assert!(harmless(&call(c::SYS_mmap, [0, 4096, 3, private])));
        assert!(!harmless(&call(c::SYS_mmap, [0, 4096, 3, shared])));
        assert!(!harmless(&call(
            c::SYS_mmap,
            [0, 4096, 3, c::MAP_SHARED_VALIDATE as u64]
        )));
        assert!(harmless(&call(c::SYS_openat, [0, 0, c::O_RDONLY as u64, 0])));
        assert!(!harmless(&call(
            c::SYS_openat,
            [0, 0, (c::O_WRONLY | c::O_CREAT) as u64, 0]
        )));
        assert!(harmless(&call(c::SYS_write, [1, 0, 5, 0])));
        assert!(!harmless(&call(c::SYS_write, [3, 0, 5, 0])));
        assert!(harmless(&call(c::SYS_ioctl, [1, c::TCGETS, 0, 0])));
        assert!(!harmless(&call(c::SYS_ioctl, [1, c::TIOCSWINSZ, 0, 0])));
        assert!(!harmless(&call(c::SYS_fcntl, [1, c::F_SETFL as u64, 0, 0])));
        assert!(!harmless(&call(c::SYS_prlimit64, [0, 7, 0x1000, 0])));
        for nr in [
            c::SYS_clone,
            c::SYS_clone3,
            c::SYS_fork,
            c::SYS_socket,
            c::SYS_setitimer,
            c::SYS_alarm,
            c::SYS_unlink,
        ] {
            assert!(!harmless(&call(nr, [0; 4])), "syscall {nr}");
        }
    }
}

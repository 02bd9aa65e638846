//! Starting one replica with an identical start: a fresh PID namespace (so process ids
//! match across replicas), ASLR off, RDTSC trapping, a CPU pin, and the seccomp filter.
//!
//! Process shape of one replica (namespaces available, i.e. running as root):
//!
//! ```text
//! lockstep ── stub (pid 1 in the replica's PID namespace: reaps orphans)
//!                └── program (pid = lockstep's own pid, chosen with clone3 set_tid; traced;
//!                             seccomp filter installed just before exec)
//! ```
//!
//! The monitor seizes the stub before it forks, so the program is auto-attached and the
//! fork event tells us its global pid. The stub is then detached. Without namespaces the
//! monitor forks the program directly.

use crate::Error;
use lockstep_trace::{ptrace, seccomp, Stop, Tid};
use std::ffi::CString;
use std::io;
use std::os::fd::OwnedFd;

pub struct Spawned {
    /// The namespace's init (0 when there is no namespace).
    pub stub: Tid,
    /// The program's main thread, stopped at its first seccomp stop (execve).
    pub main: Tid,
    pub listener: seccomp::Listener,
}

pub struct Plan<'a> {
    pub path: &'a CString,
    /// NULL-terminated pointer arrays, built once so every replica's execve gets the
    /// same argument addresses.
    pub argv: &'a [*const libc::c_char],
    pub envp: &'a [*const libc::c_char],
    pub cpu: Option<usize>,
    pub namespaces: bool,
    /// The pid the program asks for inside its namespace: lockstep's own, which no other
    /// process on the host has while lockstep runs, so pid-named files (lock files, temp
    /// directories) never collide between runs. 0: the kernel's choice.
    pub pid: libc::pid_t,
    pub filter: &'a [libc::sock_filter],
    /// lockstep's own descriptors that the stub keeps but the program must not get (the
    /// fast path's ring and shim, reached through /proc/1/fd).
    pub close_fds: &'a [i32],
}

fn errno() -> i32 {
    io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// Runs in the program's process between fork and exec. Only async-signal-safe calls.
///
/// # Safety
/// Only in the child of a fork of a process that may have had other threads: nothing here
/// may allocate or take a lock. `argv` and `envp` are NULL-terminated arrays of pointers to
/// NUL-terminated strings that the parent built before the fork.
unsafe fn become_program(plan: &Plan, argv: &[*const libc::c_char], envp: &[*const libc::c_char]) -> ! {
    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
    // Signal dispositions set to "ignore" survive exec; the program must start clean.
    for sig in 1..32 {
        if sig != libc::SIGKILL && sig != libc::SIGSTOP {
            libc::signal(sig, libc::SIG_DFL);
        }
    }
    let mut empty: libc::sigset_t = std::mem::zeroed();
    libc::sigemptyset(&mut empty);
    libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
    libc::personality(libc::ADDR_NO_RANDOMIZE as libc::c_ulong);
    const PR_SET_TSC: i32 = 26;
    const PR_TSC_SIGSEGV: libc::c_ulong = 2;
    libc::prctl(PR_SET_TSC, PR_TSC_SIGSEGV, 0, 0, 0);
    // Best effort: make CPUID fault too, so that it is answered once for all replicas (its
    // APIC ids differ between cores). Needs CPU support ("cpuid_fault"); without it the
    // call fails and CPUID runs natively.
    const ARCH_SET_CPUID: libc::c_long = 0x1012;
    libc::syscall(libc::SYS_arch_prctl, ARCH_SET_CPUID, 0);
    if let Some(cpu) = plan.cpu {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
    for &fd in plan.close_fds {
        libc::close(fd);
    }
    if seccomp::install(plan.filter).is_err() {
        libc::_exit(crate::EXIT_SETUP_FAILED);
    }
    libc::execve(plan.path.as_ptr(), argv.as_ptr(), envp.as_ptr());
    libc::_exit(lockstep_core::exit::CANNOT_EXECUTE);
}

/// `struct clone_args` of clone3(2), up to `set_tid_size` (CLONE_ARGS_SIZE_VER1).
#[repr(C)]
#[derive(Default)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
}

/// fork(2), with the child's pid in the caller's (new) PID namespace set to `pid` when it
/// is above 1 (clone3 with `set_tid`, which needs CAP_SYS_ADMIN there); a plain fork when
/// the kernel refuses. Async-signal-safe.
///
/// # Safety
/// As for fork(2): in a process with other threads, the child may only make
/// async-signal-safe calls until it execs or exits.
unsafe fn fork_with_pid(pid: libc::pid_t) -> libc::pid_t {
    if pid > 1 {
        let tids = [pid];
        let args = CloneArgs {
            exit_signal: libc::SIGCHLD as u64,
            set_tid: tids.as_ptr() as u64,
            set_tid_size: 1,
            ..CloneArgs::default()
        };
        // SAFETY: args and tids outlive the call; no shared VM, so this is a fork.
        let r = unsafe {
            libc::syscall(
                libc::SYS_clone3,
                &args as *const CloneArgs,
                std::mem::size_of::<CloneArgs>(),
            )
        };
        if r >= 0 {
            return r as libc::pid_t;
        }
    }
    // SAFETY: as above.
    unsafe { libc::fork() }
}

pub fn ptrs(v: &[CString]) -> Vec<*const libc::c_char> {
    v.iter()
        .map(|s| s.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect()
}

/// Starts one replica and returns it stopped at the seccomp stop of its first execve.
pub fn spawn(plan: &Plan) -> Result<Spawned, Error> {
    let (argv, envp) = (plan.argv, plan.envp);
    let mut go = [0i32; 2];
    // SAFETY: plain pipe2 into a local array.
    if unsafe { libc::pipe2(go.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(Error::Io("pipe2", io::Error::last_os_error()));
    }
    let flags = if plan.namespaces {
        libc::CLONE_NEWPID | libc::CLONE_NEWNS
    } else {
        0
    };
    // SAFETY: a fork-like clone (no shared VM); the child only runs async-signal-safe code.
    let first = unsafe { libc::syscall(libc::SYS_clone, (flags | libc::SIGCHLD) as libc::c_ulong, 0, 0, 0, 0) };
    if first < 0 {
        return Err(Error::Io("clone", io::Error::last_os_error()));
    }
    if first == 0 {
        // SAFETY: child side of the fork; never returns.
        unsafe {
            libc::close(go[1]);
            let mut byte = 0u8;
            // Wait until the monitor has seized us, so that our fork is traced.
            libc::read(go[0], (&mut byte as *mut u8).cast(), 1);
            libc::close(go[0]);
            if !plan.namespaces {
                // Own process group, as with the stub: terminal signals reach lockstep only.
                libc::setpgid(0, 0);
                become_program(plan, argv, envp);
            }
            // The stub: its own process group, so the terminal's and `kill 0`'s signals
            // reach lockstep and not the replicas directly; a private /proc for our pids.
            libc::setpgid(0, 0);
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
            let none = c"none";
            let root = c"/";
            let proc_ = c"proc";
            let procdir = c"/proc";
            libc::mount(
                none.as_ptr(),
                root.as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            );
            libc::mount(
                proc_.as_ptr(),
                procdir.as_ptr(),
                proc_.as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                std::ptr::null(),
            );
            let child = fork_with_pid(plan.pid);
            if child == 0 {
                become_program(plan, argv, envp);
            }
            // The stub only reaps: it must not keep the caller's terminal or pipes open
            // after the program has let go of them (a daemon, a detached run).
            let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
            if null >= 0 {
                for fd in 0..3 {
                    libc::dup2(null, fd);
                }
            }
            // Reap everything until the namespace is empty.
            loop {
                let r = libc::wait(std::ptr::null_mut());
                if r < 0 && errno() != libc::EINTR {
                    libc::_exit(0);
                }
            }
        }
    }
    let first = first as Tid;
    // SAFETY: closing our copy of the read end.
    unsafe { libc::close(go[0]) };
    let release = |fd: i32| {
        // SAFETY: one byte from a local; then close our end.
        unsafe {
            libc::write(fd, b"g".as_ptr().cast(), 1);
            libc::close(fd);
        }
    };
    if let Err(e) = ptrace::seize(first) {
        release(go[1]);
        ptrace::kill(first, libc::SIGKILL);
        return Err(Error::Io("ptrace(PTRACE_SEIZE)", e));
    }
    release(go[1]);
    let (stub, main) = if plan.namespaces {
        // The stub forks the program: take its pid from the fork event, then let go of the stub.
        let main = loop {
            match ptrace::wait_tid(first).map_err(|e| Error::Io("waitpid", e))? {
                Stop::Event(libc::PTRACE_EVENT_FORK) => {
                    let pid = ptrace::event_msg(first).map_err(|e| Error::Io("PTRACE_GETEVENTMSG", e))? as Tid;
                    ptrace::detach(first).map_err(|e| Error::Io("PTRACE_DETACH", e))?;
                    break pid;
                }
                Stop::Exited(_) | Stop::Killed(_) => {
                    return Err(Error::Setup("the replica's namespace stub died".into()))
                }
                Stop::Signal(sig) => ptrace::cont(first, sig).map_err(|e| Error::Io("PTRACE_CONT", e))?,
                _ => ptrace::cont(first, 0).map_err(|e| Error::Io("PTRACE_CONT", e))?,
            }
        };
        (first, main)
    } else {
        (0, first)
    };
    // Run the program's set-up until its execve stops in seccomp.
    loop {
        match ptrace::wait_tid(main).map_err(|e| Error::Io("waitpid", e))? {
            Stop::Seccomp => break,
            Stop::Exited(code) if code == crate::EXIT_SETUP_FAILED => {
                return Err(Error::Setup(
                    "installing the seccomp filter failed in the replica".into(),
                ))
            }
            Stop::Exited(code) => return Err(Error::Setup(format!("the replica exited with {code} before exec"))),
            Stop::Killed(sig) => {
                return Err(Error::Setup(format!(
                    "the replica was killed by signal {sig} before exec"
                )))
            }
            Stop::Signal(sig) => ptrace::cont(main, sig).map_err(|e| Error::Io("PTRACE_CONT", e))?,
            _ => ptrace::cont(main, 0).map_err(|e| Error::Io("PTRACE_CONT", e))?,
        }
    }
    let listener = grab_listener(main)?;
    Ok(Spawned { stub, main, listener })
}

/// Copies the program's seccomp listener (still open, close-on-exec) into the monitor.
fn grab_listener(main: Tid) -> Result<seccomp::Listener, Error> {
    let dir = format!("/proc/{main}/fd");
    let entries = std::fs::read_dir(&dir).map_err(|e| Error::Io("reading /proc/PID/fd", e))?;
    for entry in entries.flatten() {
        let Ok(target) = std::fs::read_link(entry.path()) else {
            continue;
        };
        if target.to_string_lossy().contains("seccomp notify") {
            let fd: i32 = entry.file_name().to_string_lossy().parse().unwrap_or(-1);
            let pidfd = seccomp::pidfd_open(main).map_err(|e| Error::Io("pidfd_open", e))?;
            let ours: OwnedFd = seccomp::pidfd_getfd(&pidfd, fd).map_err(|e| Error::Io("pidfd_getfd", e))?;
            return Ok(seccomp::Listener::from_fd(ours));
        }
    }
    Err(Error::Setup("the replica's seccomp listener was not found".into()))
}

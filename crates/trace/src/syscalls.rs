//! The one table that classifies every x86-64 syscall lockstep knows.
//!
//! The class says who executes a syscall and what the followers get; the argument kinds
//! say which arguments are values, which are pointers to data to compare (inputs), and
//! which are buffers the kernel fills (outputs, copied from the leader to the followers).
//! A few syscalls depend on their arguments (fcntl, ioctl, prctl, clone); [`classify`]
//! refines those. A number that is not in the table is `Unsupported`.

use std::sync::OnceLock;

/// Who executes a syscall, and what the other replicas get.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Class {
    /// Purely local (memory management, futexes, signal masks): allowed by the filter
    /// without a stop, executed by every replica on its own.
    Passthrough,
    /// Reads the outside world. The leader executes it; the result and the output
    /// buffers are copied into the followers, whose call is skipped.
    Input,
    /// Changes the outside world. Input buffers are compared across replicas first; the
    /// leader executes it once; the followers get its result.
    Output,
    /// Creates file descriptors. The leader executes it; the new open file descriptions
    /// are installed into every follower at the same numbers.
    FdCreate,
    /// Per-process effect that must wait for the leader (wait4): the leader executes it
    /// first, then every follower executes it for real. Results are compared.
    AllAfterLeader,
    /// Per-process effect (fork, exec, close, dup, chdir, exit...): every replica
    /// executes it at the same time. Results are compared.
    All,
    /// Answered by the monitor itself (getpid, lockstep_trace, PR_SET_TSC).
    Emulated,
    /// Cannot be replicated safely: lockstep names it and stops.
    Unsupported,
}

/// Length of a pointed-to buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Len {
    Fixed(usize),
    /// The value of argument N.
    OfArg(u8),
    /// The syscall's (non-negative) return value.
    Ret,
    /// Return value times an element size.
    RetTimes(usize),
    /// Argument N times an element size.
    ArgTimes(u8, usize),
    /// `*(socklen_t *)argN`, read after the call.
    SockLen(u8),
    /// An fd_set for `nfds` in argument N.
    FdSet(u8),
}

/// How one argument is treated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arg {
    /// A plain value: folded as is. Never a pointer: pointer values depend on allocation
    /// timing (thread stacks, heap arenas), so pointers are `In`, `Out` or `Ignore`.
    Val,
    /// A file descriptor.
    Fd,
    /// A NUL-terminated string (a path): folded and compared by content.
    Path,
    /// A buffer the kernel reads.
    In(Len),
    /// A buffer the kernel writes.
    Out(Len),
    /// A buffer the kernel reads and writes.
    InOut(Len),
    /// An iovec array (count in argument N) the kernel reads.
    IovIn(u8),
    /// An iovec array (count in argument N) the kernel fills, up to the return value.
    IovOut(u8),
    /// A struct msghdr the kernel reads (sendmsg).
    MsgIn,
    /// A struct msghdr the kernel fills (recvmsg).
    MsgOut,
    /// Not part of the syscall's behaviour for our purposes.
    Ignore,
}

/// Which new descriptors a `FdCreate` syscall produces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NewFds {
    None,
    /// The return value is the new descriptor.
    Ret,
    /// Two descriptors are written as `int[2]` at argument N.
    PairAt(u8),
}

/// One row of the table.
#[derive(Clone, Copy, Debug)]
pub struct Desc {
    pub nr: u64,
    pub name: &'static str,
    pub class: Class,
    pub args: &'static [Arg],
    pub new_fds: NewFds,
    /// May block for a long time (reads, waits, sleeps): a pending signal interrupts it.
    pub blocking: bool,
}

use Arg::*;
use Class::*;
use Len::*;

const STAT: usize = 144;
const TIMESPEC: usize = 16;
const RUSAGE: usize = 144;
const SIGINFO: usize = 128;
const STATFS: usize = 120;
const STATX: usize = 256;
const EPOLL_EVENT: usize = 12;
const POLLFD: usize = 8;
const FLOCK: usize = 32;
const ITIMERVAL: usize = 32;
/// The kernel's `struct sigaction` on x86-64: handler, flags, restorer, 8-byte mask.
const KERNEL_SIGACTION: usize = 32;
const ITIMERSPEC: usize = 32;
const SOCKADDR_MAX: usize = 128;

macro_rules! row {
    ($nr:ident, $class:expr, [$($a:expr),*]) => {
        row!($nr, $class, [$($a),*], NewFds::None, false)
    };
    ($nr:ident, $class:expr, [$($a:expr),*], blocking) => {
        row!($nr, $class, [$($a),*], NewFds::None, true)
    };
    ($nr:ident, $class:expr, [$($a:expr),*], $fds:expr, $blocking:expr) => {
        Desc {
            nr: libc::$nr as u64,
            name: {
                let s = stringify!($nr);
                // Strip the "SYS_" prefix at compile time.
                let b = s.as_bytes();
                match std::str::from_utf8(b.split_at(4).1) { Ok(n) => n, Err(_) => s }
            },
            class: $class,
            args: &[$($a),*],
            new_fds: $fds,
            blocking: $blocking,
        }
    };
}

static ROWS: &[Desc] = &[
    // --- purely local: never stop ---
    // mmap stops only for shared file mappings (the filter looks at its flags; see
    // seccomp.rs): those are written once, by the leader. munmap stops so that such a
    // mapping's contents are compared before it goes; others are let go at once.
    row!(SYS_mmap, All, [Val, Val, Val, Val, Fd, Val]),
    row!(SYS_munmap, All, [Val, Val]),
    row!(SYS_mprotect, Passthrough, []),
    row!(SYS_brk, Passthrough, []),
    row!(SYS_mremap, Passthrough, []),
    row!(SYS_madvise, Passthrough, []),
    row!(SYS_msync, Output, [Val, Val, Val]),
    row!(SYS_mincore, Passthrough, []),
    row!(SYS_mlock, Passthrough, []),
    row!(SYS_munlock, Passthrough, []),
    row!(SYS_mlockall, Passthrough, []),
    row!(SYS_munlockall, Passthrough, []),
    row!(SYS_mlock2, Passthrough, []),
    row!(SYS_mbind, Passthrough, []),
    row!(SYS_set_mempolicy, Passthrough, []),
    row!(SYS_get_mempolicy, Passthrough, []),
    row!(SYS_membarrier, Passthrough, []),
    row!(SYS_futex, Passthrough, []),
    row!(SYS_futex_waitv, Passthrough, []),
    row!(SYS_set_robust_list, Passthrough, []),
    row!(SYS_get_robust_list, Passthrough, []),
    row!(SYS_set_tid_address, Passthrough, []),
    row!(SYS_sched_yield, Passthrough, []),
    // Stops, though every replica runs it itself: a signal that arrived under the old
    // disposition must be delivered before the disposition changes (signals.rs).
    row!(SYS_rt_sigaction, All, [Val, In(Fixed(KERNEL_SIGACTION)), Ignore, Val]),
    row!(SYS_rt_sigprocmask, Passthrough, []),
    row!(SYS_rt_sigreturn, Passthrough, []),
    row!(SYS_sigaltstack, Passthrough, []),
    row!(SYS_arch_prctl, Passthrough, []),
    row!(SYS_restart_syscall, Passthrough, []),
    row!(SYS_exit, Passthrough, []),
    row!(SYS_uname, Passthrough, []),
    row!(SYS_getuid, Passthrough, []),
    row!(SYS_geteuid, Passthrough, []),
    row!(SYS_getgid, Passthrough, []),
    row!(SYS_getegid, Passthrough, []),
    row!(SYS_getresuid, Passthrough, []),
    row!(SYS_getresgid, Passthrough, []),
    row!(SYS_getgroups, Passthrough, []),
    row!(SYS_getrlimit, Passthrough, []),
    row!(SYS_capget, Passthrough, []),
    row!(SYS_sched_getparam, Passthrough, []),
    row!(SYS_sched_getscheduler, Passthrough, []),
    row!(SYS_sched_get_priority_max, Passthrough, []),
    row!(SYS_sched_get_priority_min, Passthrough, []),
    row!(SYS_personality, Passthrough, []),
    // --- monitor-answered ---
    row!(SYS_getpid, Emulated, []),
    row!(SYS_gettid, Emulated, []),
    row!(SYS_getppid, Emulated, []),
    row!(SYS_sched_setaffinity, Emulated, [Val, Val, In(OfArg(1))]),
    // The kernel writes each thread's current CPU into its rseq area, and replicas run on
    // different CPUs: registration fails with ENOSYS, which glibc handles.
    row!(SYS_rseq, Emulated, [Val, Val, Val, Val]),
    // --- inputs: the leader executes, followers get a copy ---
    row!(SYS_read, Input, [Fd, Out(Ret), Val], blocking),
    row!(SYS_pread64, Input, [Fd, Out(Ret), Val, Val]),
    row!(SYS_readv, Input, [Fd, IovOut(2), Val], blocking),
    row!(SYS_preadv, Input, [Fd, IovOut(2), Val, Val, Val]),
    row!(SYS_preadv2, Input, [Fd, IovOut(2), Val, Val, Val, Val]),
    row!(
        SYS_recvfrom,
        Input,
        [Fd, Out(Ret), Val, Val, Out(SockLen(5)), InOut(Fixed(4))],
        blocking
    ),
    row!(SYS_recvmsg, Input, [Fd, MsgOut, Val], blocking),
    // Readiness waits: the timeout is not compared, for the reason given at nanosleep
    // below (programs compute it from clock readings). Where the kernel writes the time
    // left back (ppoll, select, pselect6), the leader's value is copied.
    row!(SYS_poll, Input, [InOut(ArgTimes(1, POLLFD)), Val, Ignore], blocking),
    row!(
        SYS_ppoll,
        Input,
        [InOut(ArgTimes(1, POLLFD)), Val, Out(Fixed(TIMESPEC)), In(OfArg(4)), Val],
        blocking
    ),
    row!(
        SYS_select,
        Input,
        [
            Val,
            InOut(FdSet(0)),
            InOut(FdSet(0)),
            InOut(FdSet(0)),
            Out(Fixed(TIMESPEC))
        ],
        blocking
    ),
    row!(
        SYS_pselect6,
        Input,
        [
            Val,
            InOut(FdSet(0)),
            InOut(FdSet(0)),
            InOut(FdSet(0)),
            Out(Fixed(TIMESPEC)),
            Ignore
        ],
        blocking
    ),
    row!(
        SYS_epoll_wait,
        Input,
        [Fd, Out(RetTimes(EPOLL_EVENT)), Val, Ignore],
        blocking
    ),
    row!(
        SYS_epoll_pwait,
        Input,
        [Fd, Out(RetTimes(EPOLL_EVENT)), Val, Ignore, Ignore, Val],
        blocking
    ),
    row!(
        SYS_epoll_pwait2,
        Input,
        [Fd, Out(RetTimes(EPOLL_EVENT)), Val, Ignore, Ignore, Val],
        blocking
    ),
    // Waits and sleeps: the leader waits (in its own time), the followers get its result.
    // A signal that ends the leader's wait ends each follower's at the same call.
    row!(SYS_rt_sigsuspend, Input, [In(Fixed(8)), Val], blocking),
    row!(SYS_pause, Input, [], blocking),
    row!(
        SYS_rt_sigtimedwait,
        Input,
        [In(Fixed(8)), Out(Fixed(SIGINFO)), Ignore, Val],
        blocking
    ),
    // The time left (second pointer) is written only when the sleep is interrupted; it is
    // copied then (`signals.rs`). The requested time is not compared: programs compute it
    // from clock readings, and with several threads the readings each replica's thread
    // gets can differ (docs/run.md, Clocks); it only decides when the leader wakes up.
    row!(SYS_nanosleep, Input, [Ignore, Ignore], blocking),
    row!(SYS_clock_nanosleep, Input, [Val, Val, Ignore, Ignore], blocking),
    row!(SYS_clock_gettime, Input, [Val, Out(Fixed(TIMESPEC))]),
    row!(SYS_clock_getres, Input, [Val, Out(Fixed(TIMESPEC))]),
    row!(SYS_gettimeofday, Input, [Out(Fixed(16)), Out(Fixed(8))]),
    row!(SYS_time, Input, [Out(Fixed(8))]),
    row!(SYS_getrandom, Input, [Out(Ret), Val, Val], blocking),
    row!(SYS_fstat, Input, [Fd, Out(Fixed(STAT))]),
    row!(SYS_stat, Input, [Path, Out(Fixed(STAT))]),
    row!(SYS_lstat, Input, [Path, Out(Fixed(STAT))]),
    row!(SYS_newfstatat, Input, [Fd, Path, Out(Fixed(STAT)), Val]),
    row!(SYS_statx, Input, [Fd, Path, Val, Val, Out(Fixed(STATX))]),
    row!(SYS_statfs, Input, [Path, Out(Fixed(STATFS))]),
    row!(SYS_fstatfs, Input, [Fd, Out(Fixed(STATFS))]),
    row!(SYS_getdents64, Input, [Fd, Out(Ret), Val]),
    row!(SYS_getdents, Input, [Fd, Out(Ret), Val]),
    row!(SYS_readlink, Input, [Path, Out(Ret), Val]),
    row!(SYS_readlinkat, Input, [Fd, Path, Out(Ret), Val]),
    row!(SYS_access, Input, [Path, Val]),
    row!(SYS_faccessat, Input, [Fd, Path, Val]),
    row!(SYS_faccessat2, Input, [Fd, Path, Val, Val]),
    row!(SYS_getcwd, Input, [Out(Ret), Val]),
    row!(SYS_lseek, Input, [Fd, Val, Val]),
    row!(SYS_sysinfo, Input, [Out(Fixed(112))]),
    row!(SYS_times, Input, [Out(Fixed(32))]),
    row!(SYS_getrusage, Input, [Val, Out(Fixed(RUSAGE))]),
    row!(SYS_sched_getaffinity, Input, [Val, Val, Out(Ret)]),
    row!(SYS_getcpu, Input, [Out(Fixed(4)), Out(Fixed(4)), Val]),
    row!(SYS_getsockopt, Input, [Fd, Val, Val, Out(SockLen(4)), InOut(Fixed(4))]),
    row!(SYS_getsockname, Input, [Fd, Out(SockLen(2)), InOut(Fixed(4))]),
    row!(SYS_getpeername, Input, [Fd, Out(SockLen(2)), InOut(Fixed(4))]),
    row!(SYS_getxattr, Input, [Path, Path, Out(Ret), Val]),
    row!(SYS_lgetxattr, Input, [Path, Path, Out(Ret), Val]),
    row!(SYS_fgetxattr, Input, [Fd, Path, Out(Ret), Val]),
    row!(SYS_listxattr, Input, [Path, Out(Ret), Val]),
    row!(SYS_llistxattr, Input, [Path, Out(Ret), Val]),
    row!(SYS_flistxattr, Input, [Fd, Out(Ret), Val]),
    row!(SYS_timerfd_gettime, Input, [Fd, Out(Fixed(ITIMERSPEC))]),
    row!(SYS_getitimer, Input, [Val, Out(Fixed(ITIMERVAL))]),
    row!(SYS_ioctl, Input, [Fd, Val, Ignore]),
    row!(SYS_fcntl, Input, [Fd, Val, Val]),
    row!(SYS_sysfs, Input, [Val, Ignore, Ignore]),
    // --- outputs: compared, then executed once by the leader ---
    row!(SYS_write, Output, [Fd, In(OfArg(2)), Val], blocking),
    row!(SYS_pwrite64, Output, [Fd, In(OfArg(2)), Val, Val]),
    row!(SYS_writev, Output, [Fd, IovIn(2), Val], blocking),
    row!(SYS_pwritev, Output, [Fd, IovIn(2), Val, Val, Val]),
    row!(SYS_pwritev2, Output, [Fd, IovIn(2), Val, Val, Val, Val]),
    row!(
        SYS_sendto,
        Output,
        [Fd, In(OfArg(2)), Val, Val, In(OfArg(5)), Val],
        blocking
    ),
    row!(SYS_sendmsg, Output, [Fd, MsgIn, Val], blocking),
    row!(SYS_sendfile, Output, [Fd, Fd, InOut(Fixed(8)), Val], blocking),
    row!(
        SYS_splice,
        Output,
        [Fd, InOut(Fixed(8)), Fd, InOut(Fixed(8)), Val, Val],
        blocking
    ),
    row!(SYS_tee, Output, [Fd, Fd, Val, Val], blocking),
    row!(
        SYS_copy_file_range,
        Output,
        [Fd, InOut(Fixed(8)), Fd, InOut(Fixed(8)), Val, Val]
    ),
    row!(SYS_connect, Output, [Fd, In(OfArg(2)), Val], blocking),
    row!(SYS_bind, Output, [Fd, In(OfArg(2)), Val]),
    row!(SYS_listen, Output, [Fd, Val]),
    row!(SYS_shutdown, Output, [Fd, Val]),
    row!(SYS_setsockopt, Output, [Fd, Val, Val, In(OfArg(4)), Val]),
    row!(SYS_epoll_ctl, Output, [Fd, Val, Fd, In(Fixed(EPOLL_EVENT))]),
    row!(
        SYS_timerfd_settime,
        Output,
        [Fd, Val, In(Fixed(ITIMERSPEC)), Out(Fixed(ITIMERSPEC))]
    ),
    row!(SYS_inotify_add_watch, Output, [Fd, Path, Val]),
    row!(SYS_inotify_rm_watch, Output, [Fd, Val]),
    row!(SYS_unlink, Output, [Path]),
    row!(SYS_unlinkat, Output, [Fd, Path, Val]),
    row!(SYS_rename, Output, [Path, Path]),
    row!(SYS_renameat, Output, [Fd, Path, Fd, Path]),
    row!(SYS_renameat2, Output, [Fd, Path, Fd, Path, Val]),
    row!(SYS_mkdir, Output, [Path, Val]),
    row!(SYS_mkdirat, Output, [Fd, Path, Val]),
    row!(SYS_rmdir, Output, [Path]),
    row!(SYS_link, Output, [Path, Path]),
    row!(SYS_linkat, Output, [Fd, Path, Fd, Path, Val]),
    row!(SYS_symlink, Output, [Path, Path]),
    row!(SYS_symlinkat, Output, [Path, Fd, Path]),
    row!(SYS_mknod, Output, [Path, Val, Val]),
    row!(SYS_mknodat, Output, [Fd, Path, Val, Val]),
    row!(SYS_chmod, Output, [Path, Val]),
    row!(SYS_fchmod, Output, [Fd, Val]),
    row!(SYS_fchmodat, Output, [Fd, Path, Val]),
    row!(SYS_chown, Output, [Path, Val, Val]),
    row!(SYS_fchown, Output, [Fd, Val, Val]),
    row!(SYS_lchown, Output, [Path, Val, Val]),
    row!(SYS_fchownat, Output, [Fd, Path, Val, Val, Val]),
    row!(SYS_truncate, Output, [Path, Val]),
    row!(SYS_ftruncate, Output, [Fd, Val]),
    row!(SYS_fallocate, Output, [Fd, Val, Val, Val]),
    row!(SYS_fsync, Output, [Fd], blocking),
    row!(SYS_fdatasync, Output, [Fd], blocking),
    row!(SYS_sync, Output, []),
    row!(SYS_syncfs, Output, [Fd]),
    row!(SYS_sync_file_range, Output, [Fd, Val, Val, Val]),
    row!(SYS_fadvise64, Output, [Fd, Val, Val, Val]),
    row!(SYS_readahead, Output, [Fd, Val, Val]),
    row!(SYS_flock, Output, [Fd, Val], blocking),
    row!(SYS_utime, Output, [Path, In(Fixed(16))]),
    row!(SYS_utimes, Output, [Path, In(Fixed(32))]),
    row!(SYS_utimensat, Output, [Fd, Path, In(Fixed(32)), Val]),
    row!(SYS_futimesat, Output, [Fd, Path, In(Fixed(32))]),
    row!(SYS_setxattr, Output, [Path, Path, In(OfArg(3)), Val, Val]),
    row!(SYS_lsetxattr, Output, [Path, Path, In(OfArg(3)), Val, Val]),
    row!(SYS_fsetxattr, Output, [Fd, Path, In(OfArg(3)), Val, Val]),
    row!(SYS_removexattr, Output, [Path, Path]),
    row!(SYS_lremovexattr, Output, [Path, Path]),
    row!(SYS_fremovexattr, Output, [Fd, Path]),
    row!(SYS_syslog, Output, [Val, Ignore, Val]),
    // --- descriptor creation: the leader opens, followers share the description ---
    row!(SYS_open, FdCreate, [Path, Val, Val], NewFds::Ret, true),
    row!(SYS_openat, FdCreate, [Fd, Path, Val, Val], NewFds::Ret, true),
    row!(SYS_openat2, FdCreate, [Fd, Path, In(OfArg(3)), Val], NewFds::Ret, true),
    row!(SYS_creat, FdCreate, [Path, Val], NewFds::Ret, false),
    row!(SYS_socket, FdCreate, [Val, Val, Val], NewFds::Ret, false),
    row!(
        SYS_accept,
        FdCreate,
        [Fd, Out(SockLen(2)), InOut(Fixed(4))],
        NewFds::Ret,
        true
    ),
    row!(
        SYS_accept4,
        FdCreate,
        [Fd, Out(SockLen(2)), InOut(Fixed(4)), Val],
        NewFds::Ret,
        true
    ),
    row!(
        SYS_socketpair,
        FdCreate,
        [Val, Val, Val, Out(Fixed(8))],
        NewFds::PairAt(3),
        false
    ),
    row!(SYS_pipe, FdCreate, [Out(Fixed(8))], NewFds::PairAt(0), false),
    row!(SYS_pipe2, FdCreate, [Out(Fixed(8)), Val], NewFds::PairAt(0), false),
    row!(SYS_eventfd, FdCreate, [Val], NewFds::Ret, false),
    row!(SYS_eventfd2, FdCreate, [Val, Val], NewFds::Ret, false),
    row!(SYS_epoll_create, FdCreate, [Val], NewFds::Ret, false),
    row!(SYS_epoll_create1, FdCreate, [Val], NewFds::Ret, false),
    row!(SYS_timerfd_create, FdCreate, [Val, Val], NewFds::Ret, false),
    row!(SYS_signalfd, FdCreate, [Fd, In(Fixed(8)), Val], NewFds::Ret, false),
    row!(
        SYS_signalfd4,
        FdCreate,
        [Fd, In(Fixed(8)), Val, Val],
        NewFds::Ret,
        false
    ),
    row!(SYS_inotify_init, FdCreate, [], NewFds::Ret, false),
    row!(SYS_inotify_init1, FdCreate, [Val], NewFds::Ret, false),
    // --- per-process effects: every replica executes them ---
    row!(
        SYS_wait4,
        AllAfterLeader,
        [Val, Out(Fixed(4)), Val, Out(Fixed(RUSAGE))],
        blocking
    ),
    row!(
        SYS_waitid,
        AllAfterLeader,
        [Val, Val, Out(Fixed(SIGINFO)), Val, Out(Fixed(RUSAGE))],
        blocking
    ),
    // Stack, tid and TLS pointers depend on allocation timing (thread-stack reuse): only
    // the flags are compared.
    row!(SYS_clone, All, [Val, Ignore, Ignore, Ignore, Ignore]),
    // The first field of struct clone_args is the flags; the rest are pointers and sizes.
    row!(SYS_clone3, All, [In(Fixed(8)), Val]),
    row!(SYS_fork, All, []),
    row!(SYS_vfork, All, []),
    row!(SYS_execve, All, [Path, Ignore, Ignore]),
    row!(SYS_execveat, All, [Fd, Path, Ignore, Ignore, Val]),
    row!(SYS_exit_group, All, [Val]),
    row!(SYS_close, All, [Fd]),
    row!(SYS_close_range, All, [Val, Val, Val]),
    row!(SYS_dup, All, [Fd]),
    row!(SYS_dup2, All, [Fd, Val]),
    row!(SYS_dup3, All, [Fd, Val, Val]),
    row!(SYS_chdir, All, [Path]),
    row!(SYS_fchdir, All, [Fd]),
    row!(SYS_chroot, All, [Path]),
    row!(SYS_umask, All, [Val]),
    row!(SYS_setpgid, All, [Val, Val]),
    row!(SYS_getpgid, All, [Val]),
    row!(SYS_getpgrp, All, []),
    row!(SYS_setsid, All, []),
    row!(SYS_getsid, All, [Val]),
    row!(SYS_setuid, All, [Val]),
    row!(SYS_setgid, All, [Val]),
    row!(SYS_setreuid, All, [Val, Val]),
    row!(SYS_setregid, All, [Val, Val]),
    row!(SYS_setresuid, All, [Val, Val, Val]),
    row!(SYS_setresgid, All, [Val, Val, Val]),
    row!(SYS_setgroups, All, [Val, In(ArgTimes(0, 4))]),
    row!(SYS_setfsuid, All, [Val]),
    row!(SYS_setfsgid, All, [Val]),
    row!(SYS_capset, All, [Ignore, Ignore]),
    row!(SYS_setrlimit, All, [Val, In(Fixed(16))]),
    row!(SYS_prlimit64, All, [Val, Val, In(Fixed(16)), Out(Fixed(16))]),
    row!(SYS_setpriority, All, [Val, Val, Val]),
    row!(SYS_getpriority, All, [Val, Val]),
    row!(SYS_sched_setscheduler, All, [Val, Val, In(Fixed(4))]),
    row!(SYS_sched_setparam, All, [Val, In(Fixed(4))]),
    row!(SYS_prctl, All, [Val, Val, Ignore, Ignore, Ignore]),
    row!(SYS_seccomp, All, [Val, Val, Ignore]),
    row!(SYS_kill, All, [Val, Val]),
    row!(SYS_tkill, All, [Val, Val]),
    row!(SYS_tgkill, All, [Val, Val, Val]),
    row!(SYS_rt_sigqueueinfo, All, [Val, Val, Ignore]),
    row!(SYS_rt_tgsigqueueinfo, All, [Val, Val, Val, Ignore]),
    row!(SYS_rt_sigpending, All, [Out(Fixed(8)), Val]),
    // Setting the clock changes the world: compared, then done once by the leader.
    row!(SYS_clock_settime, Output, [Val, In(Fixed(TIMESPEC))]),
    row!(SYS_settimeofday, Output, [In(Fixed(16)), In(Fixed(8))]),
    row!(SYS_alarm, All, [Val]),
    row!(SYS_setitimer, All, [Val, In(Fixed(ITIMERVAL)), Ignore]),
    row!(SYS_timer_create, All, [Val, Ignore, Out(Fixed(4))]),
    row!(SYS_timer_settime, All, [Val, Val, In(Fixed(ITIMERSPEC)), Ignore]),
    row!(SYS_timer_gettime, All, [Val, Ignore]),
    row!(SYS_timer_getoverrun, All, [Val]),
    row!(SYS_timer_delete, All, [Val]),
    row!(SYS_memfd_create, All, [Path, Val]),
    row!(SYS_pidfd_open, All, [Val, Val]),
    row!(SYS_pidfd_send_signal, All, [Fd, Val, Ignore, Val]),
    // --- refused: they would let a replica escape the monitor or share state ---
    row!(SYS_ptrace, Unsupported, []),
    row!(SYS_process_vm_readv, Unsupported, []),
    row!(SYS_process_vm_writev, Unsupported, []),
    row!(SYS_pidfd_getfd, Unsupported, []),
    row!(SYS_io_uring_setup, Unsupported, []),
    row!(SYS_io_uring_enter, Unsupported, []),
    row!(SYS_io_uring_register, Unsupported, []),
    row!(SYS_io_setup, Unsupported, []),
    row!(SYS_io_submit, Unsupported, []),
    row!(SYS_userfaultfd, Unsupported, []),
    row!(SYS_perf_event_open, Unsupported, []),
    row!(SYS_bpf, Unsupported, []),
    row!(SYS_unshare, Unsupported, []),
    row!(SYS_setns, Unsupported, []),
    row!(SYS_mount, Unsupported, []),
    row!(SYS_umount2, Unsupported, []),
    row!(SYS_pivot_root, Unsupported, []),
    row!(SYS_shmget, Unsupported, []),
    row!(SYS_shmat, Unsupported, []),
    row!(SYS_semget, Unsupported, []),
    row!(SYS_msgget, Unsupported, []),
    row!(SYS_vmsplice, Unsupported, []),
    row!(SYS_recvmmsg, Unsupported, []),
    row!(SYS_sendmmsg, Unsupported, []),
    row!(SYS_fanotify_init, Unsupported, []),
    row!(SYS_name_to_handle_at, Unsupported, []),
    row!(SYS_open_by_handle_at, Unsupported, []),
    row!(SYS_kexec_load, Unsupported, []),
    row!(SYS_reboot, Unsupported, []),
    row!(SYS_init_module, Unsupported, []),
    row!(SYS_finit_module, Unsupported, []),
    row!(SYS_delete_module, Unsupported, []),
    row!(SYS_swapon, Unsupported, []),
    row!(SYS_swapoff, Unsupported, []),
];

const TABLE_SIZE: usize = 512;

/// The row for `nr`, if lockstep knows it.
pub fn describe(nr: u64) -> Option<&'static Desc> {
    if nr == crate::SYS_LOCKSTEP_TRACE {
        return Some(&TRACE_ROW);
    }
    if nr == crate::SYS_LOCKSTEP_FAST {
        return Some(&FAST_ROW);
    }
    static INDEX: OnceLock<Vec<Option<&'static Desc>>> = OnceLock::new();
    let index = INDEX.get_or_init(|| {
        let mut v = vec![None; TABLE_SIZE];
        for d in ROWS {
            assert!(v[d.nr as usize].is_none(), "syscall {} listed twice", d.name);
            v[d.nr as usize] = Some(d);
        }
        v
    });
    index.get(nr as usize).copied().flatten()
}

static TRACE_ROW: Desc = Desc {
    nr: crate::SYS_LOCKSTEP_TRACE,
    name: "lockstep_trace",
    class: Emulated,
    args: &[In(OfArg(1)), Val],
    new_fds: NewFds::None,
    blocking: false,
};

static FAST_ROW: Desc = Desc {
    nr: crate::SYS_LOCKSTEP_FAST,
    name: "lockstep_fast",
    class: Emulated,
    args: &[Val, Val, Val, Val, Val, Val],
    new_fds: NewFds::None,
    blocking: false,
};

/// Every row.
pub fn table() -> &'static [Desc] {
    ROWS
}

/// Name of syscall `nr` for messages: from the table, else from the kernel's list of
/// names ("syscall 999" only for a number the kernel does not define).
pub fn name(nr: u64) -> String {
    if let Some(d) = describe(nr) {
        return d.name.to_string();
    }
    match crate::syscall_names::NAMES.get(nr as usize) {
        Some(n) if !n.is_empty() => n.to_string(),
        _ => format!("syscall {nr}"),
    }
}

const FIONCLEX: u64 = 0x5450;
const FIOCLEX: u64 = 0x5451;
/// `ioctl(master, TIOCGPTPEER, flags)`: opens a pseudo-terminal's peer; returns its fd.
pub const TIOCGPTPEER: u64 = 0x5441;

pub const PR_SET_TSC: u64 = 26;
pub const PR_GET_TSC: u64 = 25;

/// The class of one concrete call: the table's class, refined by arguments where the
/// syscall number alone does not decide.
pub fn classify(desc: &Desc, args: &[u64; 6]) -> Class {
    match desc.nr as i64 {
        libc::SYS_fcntl => match args[1] as i32 {
            libc::F_DUPFD | libc::F_DUPFD_CLOEXEC | libc::F_GETFD | libc::F_SETFD => All,
            libc::F_ADD_SEALS | libc::F_GET_SEALS => All,
            libc::F_GETFL | libc::F_GETLK | libc::F_OFD_GETLK | libc::F_GETPIPE_SZ | libc::F_GETOWN => Input,
            _ => Output,
        },
        // The TSC must keep trapping, so the program may not change that setting.
        libc::SYS_prctl if args[0] == PR_SET_TSC || args[0] == PR_GET_TSC => Emulated,
        // The close-on-exec flag belongs to each process's descriptor table (CPython's
        // os.set_inheritable uses these).
        libc::SYS_ioctl if matches!(args[1], FIONCLEX | FIOCLEX) => All,
        // Opens the terminal's peer and returns the new descriptor (glibc's openpty).
        libc::SYS_ioctl if args[1] == TIOCGPTPEER => FdCreate,
        libc::SYS_open => open_class(args[1]),
        libc::SYS_openat => open_class(args[2]),
        _ => desc.class,
    }
}

/// The class of an open with these flags (for `openat2`, the `flags` of its `open_how`).
/// An `O_PATH` descriptor cannot be installed into another process through seccomp (the
/// kernel refuses to pass it), so every replica opens it itself: paths and mount
/// namespaces are identical, and the results are compared.
pub fn open_class(flags: u64) -> Class {
    if flags & libc::O_PATH as u64 != 0 {
        All
    } else {
        FdCreate
    }
}

/// Extra output buffer of an ioctl, decoded from well-known requests and from the
/// size/direction bits of newer ones. `None`: nothing to copy.
pub fn ioctl_out_len(request: u64) -> Option<usize> {
    match request as u32 {
        0x5401 => Some(36),                  // TCGETS: struct termios (kernel layout)
        0x5413 => Some(8),                   // TIOCGWINSZ
        0x541B | 0x540F | 0x5429 => Some(4), // FIONREAD, TIOCGPGRP, TIOCGSID
        // The SIOCGIF* requests (network interfaces, ifconfig) fill a struct ifreq.
        0x8910 | 0x8913 | 0x8915 | 0x8917 | 0x8919 | 0x891b | 0x891d | 0x891f | 0x8921 | 0x8925 | 0x8927 | 0x8929
        | 0x8933 | 0x8935 | 0x8938 | 0x8942 | 0x8970 => Some(IFREQ),
        r => {
            let dir = r >> 30;
            let size = ((r >> 16) & 0x3fff) as usize;
            // _IOC_READ: the kernel writes `size` bytes at the argument.
            (dir & 2 != 0 && size > 0).then_some(size)
        }
    }
}

/// `ioctl(fd, SIOCGIFCONF, struct ifconf *)`: the kernel writes `ifc_len` and that many
/// bytes at `ifc_buf` (a pointer inside the struct).
pub const SIOCGIFCONF: u64 = 0x8912;
const IFREQ: usize = 40;

/// Maximum socket address we copy for `SockLen` buffers.
pub const SOCKADDR_LIMIT: usize = SOCKADDR_MAX;
/// Size of one fcntl `struct flock`.
pub const FLOCK_SIZE: usize = FLOCK;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_consistent() {
        for d in table() {
            assert!(d.args.len() <= 6, "{}", d.name);
            assert!((d.nr as usize) < TABLE_SIZE, "{}", d.name);
            assert_eq!(describe(d.nr).unwrap().name, d.name);
            if d.new_fds != NewFds::None {
                assert_eq!(d.class, FdCreate, "{}", d.name);
            }
        }
        assert_eq!(describe(libc::SYS_write as u64).unwrap().name, "write");
        assert_eq!(describe(libc::SYS_write as u64).unwrap().class, Output);
        assert!(describe(9999).is_none());
    }

    #[test]
    fn every_kernel_syscall_has_its_name() {
        assert_eq!(name(227), "clock_settime");
        assert_eq!(name(425), "io_uring_setup");
        assert_eq!(name(9999), "syscall 9999");
        for d in table() {
            if (d.nr as usize) < crate::syscall_names::NAMES.len() {
                assert_eq!(crate::syscall_names::NAMES[d.nr as usize], d.name);
            }
        }
        // The generated list matches the installed kernel header, where there is one.
        let Ok(header) = std::fs::read_to_string("/usr/include/x86_64-linux-gnu/asm/unistd_64.h") else {
            return;
        };
        for line in header.lines() {
            let mut words = line.split_whitespace();
            if let (Some("#define"), Some(sym), Some(nr)) = (words.next(), words.next(), words.next()) {
                let (Some(n), Ok(nr)) = (sym.strip_prefix("__NR_"), nr.parse::<usize>()) else {
                    continue;
                };
                assert_eq!(crate::syscall_names::NAMES.get(nr).copied(), Some(n), "syscall {nr}");
            }
        }
    }

    #[test]
    fn o_path_opens_run_in_every_replica() {
        let open = describe(libc::SYS_openat as u64).unwrap();
        let path = (libc::O_PATH | libc::O_NOFOLLOW) as u64;
        assert_eq!(classify(open, &[0, 0, path, 0, 0, 0]), All);
        assert_eq!(classify(open, &[0, 0, libc::O_RDONLY as u64, 0, 0, 0]), FdCreate);
        assert_eq!(open_class(libc::O_PATH as u64), All);
    }

    #[test]
    fn fcntl_is_refined() {
        let d = describe(libc::SYS_fcntl as u64).unwrap();
        assert_eq!(classify(d, &[3, libc::F_DUPFD_CLOEXEC as u64, 0, 0, 0, 0]), All);
        assert_eq!(classify(d, &[3, libc::F_GETFL as u64, 0, 0, 0, 0]), Input);
        assert_eq!(classify(d, &[3, libc::F_SETFL as u64, 0, 0, 0, 0]), Output);
        let ioctl = describe(libc::SYS_ioctl as u64).unwrap();
        assert_eq!(classify(ioctl, &[3, FIOCLEX, 0, 0, 0, 0]), All);
        assert_eq!(classify(ioctl, &[3, 0x5401, 0, 0, 0, 0]), Input);
    }
}

//! Which syscalls the fast path replicates in process, and how the shim reads their
//! arguments. One source for both sides: `build.rs` includes this file to generate the
//! shim's C table (`lockstep_fast_table.h`), and the monitor uses it to digest a leader's
//! output exactly as the shim does (`fast_check.rs`, strict output checks).
//!
//! Only `lockstep_trace` and `libc` may be used here: build.rs compiles it too.

use lockstep_trace::syscalls::{Arg, Len};

/// Inputs: the leader runs them, followers copy the result.
pub const FAST_INPUTS: &[i64] = &[
    libc::SYS_read,
    libc::SYS_pread64,
    libc::SYS_readv,
    libc::SYS_preadv,
    libc::SYS_recvfrom,
    libc::SYS_poll,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_getrandom,
    libc::SYS_fstat,
];

/// Outputs: followers vote a digest, the leader runs them once.
pub const FAST_OUTPUTS: &[i64] = &[
    libc::SYS_write,
    libc::SYS_pwrite64,
    libc::SYS_writev,
    libc::SYS_pwritev,
    libc::SYS_sendto,
    libc::SYS_sendmsg,
];

/// Clock reads, answered from the ring's clock area.
pub const FAST_CLOCKS: &[i64] = &[libc::SYS_clock_gettime, libc::SYS_gettimeofday, libc::SYS_time];

/// How the shim treats one argument (`A_*` in the C table).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArgKind {
    /// Folded into the digest as a value.
    Val,
    Ignore,
    /// Must be NULL, or the call goes to the monitor.
    NullOnly,
    In,
    Out,
    InOut,
    IovIn,
    IovOut,
    /// A `struct msghdr` to send: its iovecs, as `IovIn`; without an address or control
    /// data (anything else is the monitor's).
    MsgIn,
}

/// How a buffer's length is found (`L_*` in the C table).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LenKind {
    /// `size` bytes.
    Fixed,
    /// Argument `len_arg` times `size`.
    Arg,
    /// The result times `size`, bounded before the call by argument `len_arg`.
    Ret,
}

/// One argument as the shim reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FastArg {
    pub kind: ArgKind,
    pub len: LenKind,
    pub len_arg: usize,
    pub size: u64,
}

impl FastArg {
    const fn plain(kind: ArgKind) -> FastArg {
        FastArg {
            kind,
            len: LenKind::Fixed,
            len_arg: 0,
            size: 0,
        }
    }

    /// Bytes of the buffer before the call (its bound, for a length known only after).
    pub fn bound(&self, args: &[u64; 6]) -> u64 {
        match self.len {
            LenKind::Fixed => self.size,
            LenKind::Arg | LenKind::Ret => args[self.len_arg].wrapping_mul(self.size),
        }
    }

    /// The C table's spelling: `{A_IN, L_ARG, 2, 1}`.
    pub fn c_row(&self) -> String {
        let kind = match self.kind {
            ArgKind::Val => "A_VAL",
            ArgKind::Ignore => "A_IGNORE",
            ArgKind::NullOnly => "A_NULL_ONLY",
            ArgKind::In => "A_IN",
            ArgKind::Out => "A_OUT",
            ArgKind::InOut => "A_INOUT",
            ArgKind::IovIn => "A_IOV_IN",
            ArgKind::IovOut => "A_IOV_OUT",
            ArgKind::MsgIn => "A_MSG_IN",
        };
        let len = match self.len {
            LenKind::Fixed => "L_FIXED",
            LenKind::Arg => "L_ARG",
            LenKind::Ret => "L_RET",
        };
        format!("{{{kind}, {len}, {}, {}}}", self.len_arg, self.size)
    }
}

/// Argument `i` of fast call `nr` as the shim reads it. Panics on a kind the fast path
/// does not handle (a table change that must be looked at).
pub fn fast_arg(nr: i64, i: usize, arg: &Arg) -> FastArg {
    let buffer = |kind: ArgKind, l: &Len| -> FastArg {
        let (len, len_arg, size) = match *l {
            Len::Fixed(n) => (LenKind::Fixed, 0, n as u64),
            Len::OfArg(a) => (LenKind::Arg, a as usize, 1),
            Len::ArgTimes(a, s) => (LenKind::Arg, a as usize, s as u64),
            // Bounded before the call by the count that follows the buffer.
            Len::Ret => (LenKind::Ret, i + 1, 1),
            Len::RetTimes(s) => (LenKind::Ret, i + 1, s as u64),
            other => panic!("syscall {nr} argument {i}: length {other:?} is not on the fast path"),
        };
        FastArg {
            kind,
            len,
            len_arg,
            size,
        }
    };
    // epoll_pwait's signal mask changes how signals reach the call: the monitor's job.
    if nr == libc::SYS_epoll_pwait && i == 4 {
        return FastArg::plain(ArgKind::NullOnly);
    }
    // recv(): recvfrom without an address passes a NULL address length too, which the
    // kernel then never reads; with an address, the call is the monitor's (see above).
    if nr == libc::SYS_recvfrom && i == 5 {
        return FastArg::plain(ArgKind::NullOnly);
    }
    match arg {
        Arg::Val | Arg::Fd => FastArg::plain(ArgKind::Val),
        Arg::Ignore => FastArg::plain(ArgKind::Ignore),
        Arg::In(l) => buffer(ArgKind::In, l),
        Arg::Out(Len::SockLen(_)) => FastArg::plain(ArgKind::NullOnly),
        Arg::Out(l) => buffer(ArgKind::Out, l),
        Arg::InOut(l) => buffer(ArgKind::InOut, l),
        Arg::IovIn(a) => FastArg {
            kind: ArgKind::IovIn,
            len: LenKind::Arg,
            len_arg: *a as usize,
            size: 1,
        },
        Arg::MsgIn => FastArg::plain(ArgKind::MsgIn),
        Arg::IovOut(a) => FastArg {
            kind: ArgKind::IovOut,
            len: LenKind::Arg,
            len_arg: *a as usize,
            size: 1,
        },
        other => panic!("syscall {nr} argument {i}: {other:?} is not on the fast path"),
    }
}

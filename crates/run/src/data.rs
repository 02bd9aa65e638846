//! Syscall data: digests of what a replica passes to the kernel, and the buffers the
//! kernel fills, copied from the leader into the followers.

use crate::backend::Backend;
use lockstep_core::le::{u32_at, u64_at};
use lockstep_trace::syscalls::{Arg, Desc, Len, SOCKADDR_LIMIT};
use lockstep_trace::Tid;

/// Largest single buffer we read from a replica. Larger calls are still executed, but
/// their data beyond this limit is neither compared nor copied (documented in run.md).
pub const MAX_BUFFER: usize = 64 << 20;
/// Longest path we read.
const MAX_PATH: usize = 4096;
/// Bytes of a `struct iovec` and of a `struct msghdr` (x86-64).
pub(crate) const IOVEC: usize = 16;
pub(crate) const MSGHDR: usize = 56;
/// Most iovec entries read from one array (the kernel's UIO_MAXIOV).
const MAX_IOVECS: usize = 1024;
/// Most bytes of ancillary data (a message's control buffer) compared or copied.
const MAX_CONTROL: usize = 4096;

/// What one replica passed to one syscall, reduced for comparison.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CallDigest {
    pub crc: u32,
    /// Bytes that went into the digest (values and pointed-to data).
    pub bytes: u64,
    /// The first pointed-to buffer, as (address, length) in the replica, for divergence
    /// messages (see [`first_difference`]).
    pub first_buffer: Option<(u64, usize)>,
    /// Its first bytes, for previews in messages.
    pub preview: [u8; PREVIEW],
    pub preview_len: u8,
}

impl Default for CallDigest {
    fn default() -> Self {
        CallDigest {
            crc: 0,
            bytes: 0,
            first_buffer: None,
            preview: [0; PREVIEW],
            preview_len: 0,
        }
    }
}

impl CallDigest {
    pub fn preview(&self) -> &[u8] {
        &self.preview[..self.preview_len as usize]
    }
}

/// Bytes of an output buffer kept for messages.
pub const PREVIEW: usize = 48;

/// Replica memory is read and folded into a digest this many bytes at a time, so the
/// monitor's memory does not grow with the sizes a replica passes.
pub const CHUNK: usize = 64 << 10;

/// Folds what a replica passes to a call into a CRC32C as it is read, chunk by chunk,
/// within the call's budget of [`MAX_BUFFER`] bytes of pointed-to data.
struct Folder<'a> {
    be: &'a dyn Backend,
    tid: Tid,
    chunk: &'a mut Vec<u8>,
    digest: CallDigest,
    budget: usize,
}

impl Folder<'_> {
    fn value(&mut self, bytes: &[u8]) {
        self.digest.crc = lockstep_core::checksum::crc32c_append(self.digest.crc, bytes);
        self.digest.bytes += bytes.len() as u64;
    }

    /// `len` bytes at `addr`; an unreadable range is itself an observable difference.
    fn memory(&mut self, addr: u64, len: usize) {
        if addr == 0 || len == 0 {
            self.value(&[0xff; 4]);
            return;
        }
        let len = len.min(self.budget);
        self.budget -= len;
        let first = self.digest.first_buffer.is_none();
        if first {
            self.digest.first_buffer = Some((addr, len));
        }
        let mut done = 0;
        while done < len {
            let n = (len - done).min(CHUNK);
            self.chunk.resize(n, 0);
            if self
                .be
                .read(self.tid, addr + done as u64, &mut self.chunk[..n])
                .is_err()
            {
                self.value(b"<EFAULT>");
                return;
            }
            if first && done == 0 {
                let kept = n.min(PREVIEW);
                self.digest.preview[..kept].copy_from_slice(&self.chunk[..kept]);
                self.digest.preview_len = kept as u8;
            }
            self.digest.crc = lockstep_core::checksum::crc32c_append(self.digest.crc, &self.chunk[..n]);
            self.digest.bytes += n as u64;
            done += n;
        }
    }
}

/// Length of a buffer described by `len`, before (`ret` = None) or after the call.
fn length(be: &dyn Backend, tid: Tid, len: Len, args: &[u64; 6], ret: Option<i64>) -> Option<usize> {
    let n = match len {
        Len::Fixed(n) => n,
        Len::OfArg(i) => args[i as usize] as usize,
        Len::ArgTimes(i, k) => (args[i as usize] as usize).saturating_mul(k),
        Len::Ret => ret.filter(|r| *r >= 0)? as usize,
        Len::RetTimes(k) => (ret.filter(|r| *r >= 0)? as usize).saturating_mul(k),
        Len::SockLen(i) => {
            let mut b = [0u8; 4];
            be.read(tid, args[i as usize], &mut b).ok()?;
            (u32::from_le_bytes(b) as usize).min(SOCKADDR_LIMIT)
        }
        Len::FdSet(i) => (args[i as usize] as usize).div_ceil(64) * 8,
    };
    Some(n.min(MAX_BUFFER))
}

/// Reads an iovec array: (base, len) pairs.
fn iovecs(be: &dyn Backend, tid: Tid, addr: u64, count: u64) -> Vec<(u64, usize)> {
    let count = (count as usize).min(MAX_IOVECS);
    let Ok(raw) = be.read_vec(tid, addr, count * IOVEC) else {
        return Vec::new();
    };
    (0..count)
        .map(|i| (u64_at(&raw, i * IOVEC), u64_at(&raw, i * IOVEC + 8) as usize))
        .collect()
}

/// Folds the input data of a call (values, and the content behind pointers).
fn fold_inputs(f: &mut Folder<'_>, desc: &Desc, args: &[u64; 6]) {
    let (be, tid) = (f.be, f.tid);
    for (i, arg) in desc.args.iter().enumerate() {
        let a = args[i];
        match *arg {
            Arg::Val | Arg::Fd => f.value(&a.to_le_bytes()),
            Arg::Path => match be.read_cstr(tid, a, MAX_PATH) {
                Ok(mut s) if a != 0 => {
                    s.push(0);
                    f.value(&s);
                }
                _ => f.value(b"<EFAULT>"),
            },
            Arg::In(len) | Arg::InOut(len) => {
                let n = length(be, tid, len, args, None).unwrap_or(0);
                f.memory(a, n);
            }
            Arg::IovIn(c) => {
                for (base, len) in iovecs(be, tid, a, args[c as usize]) {
                    f.memory(base, len);
                }
            }
            Arg::MsgIn => {
                let Ok(h) = be.read_vec(tid, a, MSGHDR) else {
                    f.value(b"<EFAULT>");
                    continue;
                };
                f.memory(u64_at(&h, 0), (u32_at(&h, 8) as usize).min(SOCKADDR_LIMIT));
                for (base, len) in iovecs(be, tid, u64_at(&h, 16), u64_at(&h, 24)) {
                    f.memory(base, len);
                }
                f.memory(u64_at(&h, 32), (u64_at(&h, 40) as usize).min(MAX_CONTROL));
            }
            Arg::Out(_) | Arg::IovOut(_) | Arg::MsgOut | Arg::Ignore => {}
        }
    }
}

/// Digest of everything a replica passes to syscall `nr`: the number, the values, and the
/// content behind pointer arguments (at most [`MAX_BUFFER`] bytes of it in all). `chunk`
/// is reused between calls and never grows beyond [`CHUNK`].
pub fn digest_call(
    be: &dyn Backend,
    tid: Tid,
    nr: u64,
    desc: Option<&Desc>,
    args: &[u64; 6],
    chunk: &mut Vec<u8>,
) -> CallDigest {
    let mut f = Folder {
        be,
        tid,
        chunk,
        digest: CallDigest::default(),
        budget: MAX_BUFFER,
    };
    f.value(&nr.to_le_bytes());
    match desc {
        Some(d) => fold_inputs(&mut f, d, args),
        None => args.iter().for_each(|a| f.value(&a.to_le_bytes())),
    }
    f.digest
}

/// Where two replicas' buffers first differ: (offset, length of each), reading both in
/// [`CHUNK`]-sized pieces. None when they are identical (as far as both are readable).
pub fn first_difference(be: &dyn Backend, a: (Tid, u64, usize), b: (Tid, u64, usize)) -> Option<usize> {
    let common = a.2.min(b.2);
    // Sized to what is compared: most outputs are far smaller than a chunk, and this runs
    // while the healthy replicas wait for the vote-out.
    let size = common.min(CHUNK);
    let (mut ca, mut cb) = (vec![0u8; size], vec![0u8; size]);
    let mut done = 0;
    while done < common {
        let n = (common - done).min(CHUNK);
        let ra = be.read(a.0, a.1 + done as u64, &mut ca[..n]);
        let rb = be.read(b.0, b.1 + done as u64, &mut cb[..n]);
        if ra.is_err() || rb.is_err() {
            return (ra.is_err() != rb.is_err()).then_some(done);
        }
        if let Some(at) = ca[..n].iter().zip(&cb[..n]).position(|(x, y)| x != y) {
            return Some(done + at);
        }
        done += n;
    }
    (a.2 != b.2).then_some(common)
}

/// A printable, quoted form of the first bytes of an output buffer (for event messages).
pub fn escape_preview(bytes: &[u8]) -> String {
    let shown: String = bytes
        .iter()
        .flat_map(|b| std::ascii::escape_default(*b))
        .map(char::from)
        .collect();
    format!("\"{shown}\"")
}

/// The buffers the kernel filled in the leader's call, in a fixed order (see
/// `locations`), plus any file descriptors passed in SCM_RIGHTS control messages
/// (which must be installed too).
pub struct Outputs {
    pub pieces: Vec<(u64, Vec<u8>)>,
    pub passed_fds: Vec<i32>,
}

impl Outputs {
    pub fn bytes(&self) -> u64 {
        self.pieces.iter().map(|(_, b)| b.len() as u64).sum()
    }

    /// The piece the leader's kernel wrote at `addr` (in the leader's address space).
    pub fn at(&self, addr: u64) -> Option<&[u8]> {
        self.pieces.iter().find(|(a, _)| *a == addr).map(|(_, b)| b.as_slice())
    }
}

/// Where a call's outputs are, in one replica: (address, length) per piece, in a fixed
/// order. Each replica's own pointers are used, because addresses may legitimately differ
/// between replicas (thread stacks, heap arenas). For the leader (`lens` = None) lengths
/// come from the completed call; for a follower they are the leader's piece lengths.
fn locations(
    be: &dyn Backend,
    tid: Tid,
    desc: &Desc,
    args: &[u64; 6],
    ret: i64,
    lens: Option<&[usize]>,
) -> Vec<(u64, usize)> {
    let mut locs: Vec<(u64, usize)> = Vec::new();
    let piece = |locs: &mut Vec<(u64, usize)>, addr: u64, computed: usize| {
        let len = match lens {
            Some(l) => l.get(locs.len()).copied().unwrap_or(0),
            None => computed,
        };
        locs.push((addr, if addr == 0 { 0 } else { len.min(MAX_BUFFER) }));
    };
    if ret < 0 {
        return locs;
    }
    for (i, arg) in desc.args.iter().enumerate() {
        let a = args[i];
        match *arg {
            Arg::Out(len) | Arg::InOut(len) => {
                let n = if lens.is_none() {
                    length(be, tid, len, args, Some(ret)).unwrap_or(0)
                } else {
                    0
                };
                piece(&mut locs, a, n);
            }
            Arg::IovOut(c) => {
                let mut left = ret as usize;
                for (base, len) in iovecs(be, tid, a, args[c as usize]) {
                    let n = len.min(left);
                    piece(&mut locs, base, n);
                    left -= n;
                }
            }
            Arg::MsgOut => {
                let Ok(h) = be.read_vec(tid, a, MSGHDR) else { continue };
                // Lengths and flags the kernel updates in the header; never its pointers.
                piece(&mut locs, a + 8, 4); // msg_namelen
                piece(&mut locs, a + 40, 8); // msg_controllen
                piece(&mut locs, a + 48, 4); // msg_flags
                let after = |off: usize| u64_at(&h, off);
                let name_len = if lens.is_none() {
                    (u32_at(&h, 8) as usize).min(SOCKADDR_LIMIT)
                } else {
                    0
                };
                piece(&mut locs, after(0), name_len);
                let control_len = if lens.is_none() {
                    (after(40) as usize).min(MAX_CONTROL)
                } else {
                    0
                };
                piece(&mut locs, after(32), control_len);
                let mut left = ret as usize;
                for (base, len) in iovecs(be, tid, after(16), after(24)) {
                    let n = len.min(left);
                    piece(&mut locs, base, n);
                    left -= n;
                }
            }
            _ => {}
        }
    }
    if desc.nr == libc::SYS_ioctl as u64 {
        if let Some(n) = lockstep_trace::syscalls::ioctl_out_len(args[1]) {
            piece(&mut locs, args[2], n);
        }
        if args[1] == lockstep_trace::syscalls::SIOCGIFCONF && args[2] != 0 {
            // struct ifconf { int ifc_len; (pad) char *ifc_buf; }: the length, then the
            // interfaces at this replica's own ifc_buf.
            if let Ok(head) = be.read_vec(tid, args[2], 16) {
                let filled = if lens.is_none() {
                    (u32_at(&head, 0) as usize).min(MAX_BUFFER)
                } else {
                    0
                };
                piece(&mut locs, args[2], 4);
                piece(&mut locs, u64_at(&head, 8), filled);
            }
        }
    }
    if desc.nr == libc::SYS_fcntl as u64 && matches!(args[1] as i32, libc::F_GETLK | libc::F_OFD_GETLK) {
        piece(&mut locs, args[2], lockstep_trace::syscalls::FLOCK_SIZE);
    }
    locs
}

/// Collects the outputs of the leader's completed call `desc(args) = ret`.
pub fn collect_outputs(be: &dyn Backend, leader: Tid, desc: &Desc, args: &[u64; 6], ret: i64) -> Outputs {
    let mut out = Outputs {
        pieces: Vec::new(),
        passed_fds: Vec::new(),
    };
    // One budget for all pieces: an iovec array of a faulty leader cannot multiply it.
    let mut budget = MAX_BUFFER;
    for (addr, len) in locations(be, leader, desc, args, ret, None) {
        let len = len.min(budget);
        budget -= len;
        let bytes = if len == 0 {
            Vec::new()
        } else {
            be.read_vec(leader, addr, len).unwrap_or_default()
        };
        out.pieces.push((addr, bytes));
    }
    if desc.args.contains(&Arg::MsgOut) {
        // The control buffer is the fifth piece of a message header (see `locations`).
        if let Some((_, control)) = out.pieces.get(4) {
            out.passed_fds = scm_rights(control);
        }
    }
    out
}

/// Whether every buffer argument of a call is readable in `tid` (NULL is allowed: many
/// buffers are optional). Used when the leader's call failed with EFAULT: if a follower's
/// own buffers are fine, the leader's pointer was corrupted, and its EFAULT must not be
/// handed to healthy replicas as if it were the kernel's answer.
pub fn buffers_readable(be: &dyn Backend, tid: Tid, desc: &Desc, args: &[u64; 6]) -> bool {
    desc.args.iter().zip(args).all(|(kind, &ptr)| match kind {
        Arg::In(_) | Arg::Out(_) | Arg::InOut(_) | Arg::IovIn(_) | Arg::IovOut(_) | Arg::MsgIn | Arg::MsgOut => {
            ptr == 0 || be.read(tid, ptr, &mut [0u8]).is_ok()
        }
        _ => true,
    })
}

/// Writes the leader's outputs into a follower, at the follower's own addresses.
/// Returns how many pieces could not be written: the follower's pointers are bad, which
/// the next vote will catch.
pub fn apply_outputs(
    be: &dyn Backend,
    follower: Tid,
    desc: &Desc,
    args: &[u64; 6],
    ret: i64,
    outputs: &Outputs,
) -> usize {
    let lens: Vec<usize> = outputs.pieces.iter().map(|(_, b)| b.len()).collect();
    let locs = locations(be, follower, desc, args, ret, Some(&lens));
    let mut failed = 0;
    for ((addr, _), (_, bytes)) in locs.iter().zip(&outputs.pieces) {
        if !bytes.is_empty() && be.write(follower, *addr, bytes).is_err() {
            failed += 1;
        }
    }
    failed + outputs.pieces.len().saturating_sub(locs.len())
}

/// Copies the leader's in/out buffers of `desc` into a follower (each at its own address).
/// Used when the leader's call was interrupted and will run again: the kernel may already
/// have written into them (`poll` writes `revents` even when interrupted), and the
/// replicas must run the call again from identical memory.
pub fn sync_inout(
    be: &dyn Backend,
    leader: Tid,
    follower: Tid,
    desc: &Desc,
    leader_args: &[u64; 6],
    follower_args: &[u64; 6],
) {
    for (i, arg) in desc.args.iter().enumerate() {
        if let Arg::InOut(len) = *arg {
            let n = length(be, leader, len, leader_args, None).unwrap_or(0);
            if leader_args[i] == 0 || follower_args[i] == 0 || n == 0 {
                continue;
            }
            if let Ok(bytes) = be.read_vec(leader, leader_args[i], n) {
                // A follower whose pointer a fault corrupted refuses the write; what it
                // does next differs from the leader, and the vote judges that.
                let _judged_by_the_vote = be.write(follower, follower_args[i], &bytes);
            }
        }
    }
}

/// File descriptors carried by SCM_RIGHTS messages in a control buffer.
fn scm_rights(control: &[u8]) -> Vec<i32> {
    let mut fds = Vec::new();
    let mut off = 0;
    while off + 16 <= control.len() {
        let len = u64_at(control, off) as usize;
        let level = u32_at(control, off + 8) as i32;
        let kind = u32_at(control, off + 12) as i32;
        if len < 16 || off + len > control.len() {
            break;
        }
        if level == libc::SOL_SOCKET && kind == libc::SCM_RIGHTS {
            let mut p = off + 16;
            while p + 4 <= off + len {
                fds.push(u32_at(control, p) as i32);
                p += 4;
            }
        }
        off += len.div_ceil(8) * 8;
    }
    fds
}

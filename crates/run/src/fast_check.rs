//! Strict output checks (`--output-check strict`, the fast backend): the go-ahead for a
//! leader's output comes from the monitor, not from the leader itself.
//!
//! In process, the leader compares its followers' digests with its own before it writes.
//! A fault in the leader can skip that comparison, or change the buffer or its pointer
//! after it. In strict mode the seccomp filter stops every output call made from the
//! fast gate (`lockstep_trace::seccomp::Gate::StopOutputs`), and the monitor digests the
//! leader's arguments from its memory, as the kernel is about to use them, with the shim's
//! own algorithm, and lets the call run only if every live follower voted that digest.
//!
//! The digest is the shim's (`digest_bytes`, `inspect`): the 8-byte words go round four
//! lanes, each a CRC32C (no final inversion) and a multiplicative hash; the CRC lanes fold
//! into the high half, the hash lanes into the low half.

use crate::fast::layout;
use crate::fast_calls::{fast_arg, ArgKind, FAST_OUTPUTS};
use lockstep_core::le;
use std::io;

/// Bytes read from the leader per step (a multiple of 8: the hash folds 8-byte words).
pub const CHUNK: usize = 64 * 1024;

/// Lanes of the digest: word `i` of a buffer goes to lane `i % LANES`, single values to
/// lane 0 (the shim's `DIGEST_LANES`).
const LANES: usize = 4;
const MIX_SEED: u64 = 0xcbf29ce484222325;
const MIX_PRIME: u64 = 0x100000001b3;

struct Digest {
    crc: [u32; LANES],
    mix: [u64; LANES],
    /// The CPU has SSE4.2's `crc32` (asked once per digest, not per word).
    sse42: bool,
}

/// One step of a lane's CRC32C (raw state, no inversion: the shim's `crc32q`).
fn crc_word(sse42: bool, crc: u32, v: u64) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if sse42 {
        // SAFETY: the CPU has SSE4.2 (`Digest::new` asked).
        return unsafe { crc_word_sse42(crc, v) };
    }
    !lockstep_core::checksum::crc32c_append(!crc, &v.to_le_bytes())
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
fn crc_word_sse42(crc: u32, v: u64) -> u32 {
    std::arch::x86_64::_mm_crc32_u64(crc as u64, v) as u32
}

impl Digest {
    fn new() -> Digest {
        Digest {
            crc: [!0; LANES],
            mix: [MIX_SEED; LANES],
            #[cfg(target_arch = "x86_64")]
            sse42: std::arch::is_x86_feature_detected!("sse4.2"),
            #[cfg(not(target_arch = "x86_64"))]
            sse42: false,
        }
    }

    fn lane(&mut self, lane: usize, v: u64) {
        self.crc[lane] = crc_word(self.sse42, self.crc[lane], v);
        self.mix[lane] = (self.mix[lane] ^ v).wrapping_mul(MIX_PRIME);
    }

    fn word(&mut self, v: u64) {
        self.lane(0, v);
    }

    /// `n` bytes at `addr` of the leader, read a chunk at a time into `scratch`.
    fn bytes(&mut self, addr: u64, n: u64, scratch: &mut [u8], read: &mut Reader<'_>) -> io::Result<()> {
        let mut done = 0u64;
        let mut words = 0usize;
        let (mut tail, mut tail_len) = (0u64, 0u64);
        while done < n {
            let take = (n - done).min(scratch.len() as u64) as usize;
            let chunk = &mut scratch[..take];
            read(addr.wrapping_add(done), chunk)?;
            let mut whole = chunk.chunks_exact(8);
            for w in &mut whole {
                self.lane(words % LANES, u64::from_le_bytes(w.try_into().expect("8 bytes")));
                words += 1;
            }
            // Only the last chunk can end in a partial word (chunks are multiples of 8).
            for (i, &b) in whole.remainder().iter().enumerate() {
                self.crc[0] = !lockstep_core::checksum::crc32c_append(!self.crc[0], &[b]);
                tail |= (b as u64) << (8 * i);
            }
            tail_len = whole.remainder().len() as u64;
            done += take as u64;
        }
        self.mix[0] = (self.mix[0] ^ tail ^ (tail_len << 56)).wrapping_mul(MIX_PRIME);
        Ok(())
    }

    fn value(&self) -> u64 {
        let [c0, c1, c2, c3] = self.crc;
        let [m0, m1, m2, m3] = self.mix;
        let crc = c0 ^ c1.rotate_left(8) ^ c2.rotate_left(16) ^ c3.rotate_left(24);
        let mix = m0 ^ m1.rotate_left(13) ^ m2.rotate_left(29) ^ m3.rotate_left(47);
        ((crc as u64) << 32) ^ (mix >> 32) ^ (mix & 0xffff_ffff)
    }
}

/// Reads the leader's memory.
pub type Reader<'a> = dyn FnMut(u64, &mut [u8]) -> io::Result<()> + 'a;

/// Whether `nr` is an output the shim makes from the fast gate.
pub fn is_fast_output(nr: u64) -> bool {
    FAST_OUTPUTS.iter().any(|&o| o as u64 == nr)
}

/// The digest the shim computes for output call `nr` with `args`, read through `read`.
/// Err: a call that the shim would not have made on the fast path (so a correct leader
/// cannot be at the gate with it), or memory that cannot be read.
pub fn output_digest(nr: u64, args: &[u64; 6], scratch: &mut [u8], read: &mut Reader<'_>) -> Result<u64, String> {
    assert!(
        scratch.len() >= 8 && scratch.len().is_multiple_of(8),
        "chunks keep 8-byte words whole"
    );
    if !is_fast_output(nr) {
        return Err(format!(
            "{} is not a fast-path output",
            lockstep_trace::syscalls::name(nr)
        ));
    }
    let desc = lockstep_trace::syscalls::describe(nr).expect("fast outputs are in the table");
    let unreadable = |e: io::Error| format!("its buffer cannot be read ({e})");
    let mut d = Digest::new();
    d.word(nr);
    for (i, arg) in desc.args.iter().enumerate() {
        let g = fast_arg(nr as i64, i, arg);
        let p = args[i];
        match g.kind {
            ArgKind::Val => d.word(p),
            ArgKind::Ignore => {}
            ArgKind::NullOnly if p != 0 => return Err(format!("argument {i} is not NULL")),
            ArgKind::NullOnly => {}
            ArgKind::In | ArgKind::InOut => {
                let n = g.bound(args);
                if (n > 0 && p == 0) || n > layout::PAYLOAD_MAX {
                    return Err(format!("argument {i} ({n} bytes) is not a fast-path buffer"));
                }
                d.word(n);
                if p != 0 {
                    d.bytes(p, n, scratch, read).map_err(unreadable)?;
                }
            }
            ArgKind::Out => d.word((p != 0) as u64),
            ArgKind::IovIn | ArgKind::IovOut | ArgKind::MsgIn => {
                let (p, count) = if g.kind == ArgKind::MsgIn {
                    sendable_iovecs(p, read).map_err(|e| format!("argument {i}: {e}"))?
                } else {
                    (p, args[g.len_arg])
                };
                if count > layout::MAX_IOVECS || (count > 0 && p == 0) {
                    return Err(format!("argument {i} has {count} iovecs"));
                }
                for k in 0..count {
                    let mut iov = [0u8; 16];
                    read(p.wrapping_add(16 * k), &mut iov).map_err(unreadable)?;
                    let base = le::u64_at(&iov, 0);
                    let len = le::u64_at(&iov, 8);
                    d.word(len);
                    if g.kind != ArgKind::IovOut {
                        if len > layout::PAYLOAD_MAX || (len > 0 && base == 0) {
                            return Err(format!("iovec {k} ({len} bytes) is not a fast-path buffer"));
                        }
                        d.bytes(base, len, scratch, read).map_err(unreadable)?;
                    }
                }
            }
        }
    }
    Ok(d.value())
}

/// A `struct msghdr`'s iovecs (address, count), if the shim would send it on the fast path:
/// no address (`msg_name`) and no control data.
fn sendable_iovecs(msghdr: u64, read: &mut Reader<'_>) -> Result<(u64, u64), String> {
    let mut m = [0u8; 56];
    if msghdr == 0 {
        return Err("no msghdr".into());
    }
    read(msghdr, &mut m).map_err(|e| format!("its msghdr cannot be read ({e})"))?;
    let field = |at: usize| le::u64_at(&m, at);
    let (name, iov, iovlen, controllen) = (field(0), field(16), field(24), field(40));
    if name != 0 || controllen != 0 {
        return Err("its msghdr has an address or control data".into());
    }
    Ok((iov, iovlen))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest_of_write(data: &[u8], chunk: usize) -> u64 {
        let base = data.as_ptr() as u64;
        let mut scratch = vec![0u8; chunk];
        let mut read = |addr: u64, buf: &mut [u8]| -> io::Result<()> {
            let at = (addr - base) as usize;
            buf.copy_from_slice(&data[at..at + buf.len()]);
            Ok(())
        };
        let args = [1, base, data.len() as u64, 0, 0, 0];
        output_digest(libc::SYS_write as u64, &args, &mut scratch, &mut read).unwrap()
    }

    #[test]
    fn the_digest_does_not_depend_on_how_the_buffer_is_read() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 + 3) as u8).collect();
        for len in [0, 1, 7, 8, 9, 63, 64, 65, 999] {
            let whole = digest_of_write(&data[..len], CHUNK);
            assert_eq!(whole, digest_of_write(&data[..len], 8), "len {len}");
            assert_eq!(whole, digest_of_write(&data[..len], 24), "len {len}");
        }
        // One changed byte changes both halves.
        let mut other = data.clone();
        other[500] ^= 1;
        let (a, b) = (digest_of_write(&data, CHUNK), digest_of_write(&other, CHUNK));
        assert_ne!(a >> 32, b >> 32);
        assert_ne!(a & 0xffff_ffff, b & 0xffff_ffff);
    }

    #[test]
    fn calls_the_shim_would_not_make_fast_are_refused() {
        let mut scratch = vec![0u8; 64];
        let mut read = |_: u64, _: &mut [u8]| -> io::Result<()> { Err(io::Error::from_raw_os_error(libc::EFAULT)) };
        let read_call = [0, 0x1000, 10, 0, 0, 0];
        assert!(output_digest(libc::SYS_read as u64, &read_call, &mut scratch, &mut read).is_err());
        let too_big = [1, 0x1000, layout::PAYLOAD_MAX + 1, 0, 0, 0];
        assert!(output_digest(libc::SYS_write as u64, &too_big, &mut scratch, &mut read).is_err());
        let unreadable = [1, 0x1000, 10, 0, 0, 0];
        assert!(output_digest(libc::SYS_write as u64, &unreadable, &mut scratch, &mut read).is_err());
        let too_many = [1, 0x1000, layout::MAX_IOVECS + 1, 0, 0, 0];
        assert!(output_digest(libc::SYS_writev as u64, &too_many, &mut scratch, &mut read).is_err());
    }
}

//! CRC32C (Castagnoli), the one checksum every lockstep component uses.
//!
//! The `crc32c` crate dispatches to the SSE4.2 `crc32` instruction when the CPU has it,
//! which every x86-64 machine we target does. `crc32c_append_copy` adds a copy that reads
//! each byte once, folding 256 bytes per step with AVX-512 carry-less multiplies where the
//! CPU has them (`fold`).

/// CRC32C of `data`.
#[inline]
pub fn crc32c(data: &[u8]) -> u32 {
    crc32c::crc32c(data)
}

/// Continues a CRC32C over more data: `crc32c_append(crc32c(a), b) == crc32c(a ++ b)`.
#[inline]
pub fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
    crc32c::crc32c_append(crc, data)
}

/// The CRC32C of `a ++ b` from `crc32c(a)`, `crc32c(b)` and `b.len()`, in O(log len).
#[inline]
pub fn crc32c_combine(crc_a: u32, crc_b: u32, len_b: usize) -> u32 {
    crc32c::crc32c_combine(crc_a, crc_b, len_b)
}

/// Appends `src` to `out` and continues `crc` over it: `crc32c_append(crc, src)`, with the
/// copy and the checksum made from one read of each byte. What lands in `out` is exactly
/// what the CRC covered, so checking the result against a stored CRC leaves no window in
/// which the source could change between the check and the copy; and on a CPU with
/// AVX-512 VPCLMULQDQ the checksum hides behind the memory traffic of the copy.
pub fn crc32c_append_copy(crc: u32, out: &mut Vec<u8>, src: &[u8]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if src.len() >= fold::BLOCK && fold::available() {
        out.reserve(src.len());
        let at = out.len();
        // SAFETY: the CPU has the instructions (checked above); `reserve` made room for
        // `src.len()` bytes after `at`, all of which `append_copy` writes before `set_len`.
        unsafe {
            let crc = fold::append_copy(crc, out.as_mut_ptr().add(at), src);
            out.set_len(at + src.len());
            return crc;
        }
    }
    let at = out.len();
    out.extend_from_slice(src);
    crc32c_append(crc, &out[at..])
}

/// CRC32C by folding: four 512-bit accumulators take 256 bytes per step with
/// VPCLMULQDQ, and the last 16 bytes left after folding go through the `crc32`
/// instruction. Constants are derived here from the polynomial, not tabulated.
#[cfg(target_arch = "x86_64")]
mod fold {
    use std::arch::x86_64::*;

    /// Bytes folded per step; shorter inputs take the scalar path.
    pub const BLOCK: usize = 256;

    pub fn available() -> bool {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("vpclmulqdq")
            && is_x86_feature_detected!("pclmulqdq")
            && is_x86_feature_detected!("sse4.2")
    }

    /// `x^n mod P` (P the CRC32C polynomial) as an operand of a reflected carry-less
    /// multiply: the coefficient of `x^d` in bit `63 - d`.
    const fn x_pow_mod(n: u32) -> u64 {
        let mut r: u32 = 1;
        let mut i = 0;
        while i < n {
            let carry = r & 0x8000_0000 != 0;
            r <<= 1;
            if carry {
                r ^= 0x1EDC_6F41;
            }
            i += 1;
        }
        (r.reverse_bits() as u64) << 32
    }

    /// Multipliers that move a 128-bit lane `bytes` further along the message. A lane is
    /// `L·x^64 + H` (L its first 8 bytes); its value `bytes` on is `L·x^(64+D) + H·x^D`
    /// with `D = 8·bytes`, and the reflected multiply contributes one factor of x itself.
    const fn shift(bytes: u32) -> (u64, u64) {
        (x_pow_mod(8 * bytes + 63), x_pow_mod(8 * bytes - 1))
    }

    const BY_256: (u64, u64) = shift(256);
    const BY_192: (u64, u64) = shift(192);
    const BY_128: (u64, u64) = shift(128);
    const BY_64: (u64, u64) = shift(64);
    const BY_16: (u64, u64) = shift(16);

    /// # Safety
    /// The CPU has AVX-512F and VPCLMULQDQ (the caller checked at run time).
    #[target_feature(enable = "avx512f,vpclmulqdq")]
    unsafe fn lanes(k: (u64, u64)) -> __m512i {
        _mm512_broadcast_i32x4(_mm_set_epi64x(k.1 as i64, k.0 as i64))
    }

    /// `acc` moved along by the multipliers `k`, plus `next`.
    ///
    /// # Safety
    /// The CPU has AVX-512F and VPCLMULQDQ.
    #[target_feature(enable = "avx512f,vpclmulqdq")]
    unsafe fn fold(acc: __m512i, k: __m512i, next: __m512i) -> __m512i {
        let first = _mm512_clmulepi64_epi128(acc, k, 0x00);
        let second = _mm512_clmulepi64_epi128(acc, k, 0x11);
        _mm512_ternarylogic_epi64(first, second, next, 0x96)
    }

    /// # Safety
    /// The CPU has PCLMULQDQ and SSE4.2.
    #[target_feature(enable = "pclmulqdq,sse4.2")]
    unsafe fn fold_lane(acc: __m128i, k: (u64, u64), next: __m128i) -> __m128i {
        let k = _mm_set_epi64x(k.1 as i64, k.0 as i64);
        let first = _mm_clmulepi64_si128(acc, k, 0x00);
        let second = _mm_clmulepi64_si128(acc, k, 0x11);
        _mm_xor_si128(_mm_xor_si128(first, second), next)
    }

    /// Loads 64 bytes at `src + at` and stores them at `dst + at`.
    ///
    /// # Safety
    /// The CPU has AVX-512F; `src + at` is readable and `dst + at` writable for 64 bytes.
    #[target_feature(enable = "avx512f")]
    unsafe fn move64(src: *const u8, dst: *mut u8, at: usize) -> __m512i {
        let v = _mm512_loadu_si512(src.add(at) as *const __m512i);
        _mm512_storeu_si512(dst.add(at) as *mut __m512i, v);
        v
    }

    /// `crc32c_append(crc, src)`, copying `src` to `dst` on the way.
    ///
    /// # Safety
    /// The CPU has AVX-512F, VPCLMULQDQ, PCLMULQDQ and SSE4.2; `src.len() >= BLOCK`;
    /// `dst` is valid for `src.len()` bytes of writes and does not overlap `src`.
    #[target_feature(enable = "avx512f,vpclmulqdq,pclmulqdq,sse4.2")]
    pub unsafe fn append_copy(crc: u32, dst: *mut u8, src: &[u8]) -> u32 {
        debug_assert!(src.len() >= BLOCK);
        let s = src.as_ptr();
        let folded = src.len() / BLOCK * BLOCK;
        // A CRC register of c over the message equals a zero register over the message
        // with !c xored into its first four bytes (and the final inversion below).
        let init = _mm512_zextsi128_si512(_mm_cvtsi32_si128(!crc as i32));
        let mut x0 = _mm512_xor_si512(move64(s, dst, 0), init);
        let mut x1 = move64(s, dst, 64);
        let mut x2 = move64(s, dst, 128);
        let mut x3 = move64(s, dst, 192);
        let by_256 = lanes(BY_256);
        let mut at = BLOCK;
        while at < folded {
            x0 = fold(x0, by_256, move64(s, dst, at));
            x1 = fold(x1, by_256, move64(s, dst, at + 64));
            x2 = fold(x2, by_256, move64(s, dst, at + 128));
            x3 = fold(x3, by_256, move64(s, dst, at + 192));
            at += BLOCK;
        }
        let mut x = fold(x2, lanes(BY_64), x3);
        x = fold(x1, lanes(BY_128), x);
        x = fold(x0, lanes(BY_192), x);
        let mut lane = _mm512_extracti32x4_epi32::<0>(x);
        lane = fold_lane(lane, BY_16, _mm512_extracti32x4_epi32::<1>(x));
        lane = fold_lane(lane, BY_16, _mm512_extracti32x4_epi32::<2>(x));
        lane = fold_lane(lane, BY_16, _mm512_extracti32x4_epi32::<3>(x));
        let first = _mm_cvtsi128_si64(lane) as u64;
        let second = _mm_extract_epi64::<1>(lane) as u64;
        let crc = !(_mm_crc32_u64(_mm_crc32_u64(0, first), second) as u32);
        let tail = &src[folded..];
        std::ptr::copy_nonoverlapping(tail.as_ptr(), dst.add(folded), tail.len());
        super::crc32c_append(crc, tail)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn append_copy_equals_append_at_every_length_and_start() {
        let data: Vec<u8> = (0..5000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for len in (0..300).chain([511, 512, 513, 1000, 4095, 4096, 4097, 4999]) {
            for (start, prev) in [(0, 0u32), (1, 0x1234_5678), (3, !0)] {
                let src = &data[start..start + len.min(data.len() - start)];
                let mut out = b"head".to_vec();
                let crc = crc32c_append_copy(prev, &mut out, src);
                assert_eq!(crc, crc32c_append(prev, src), "len {} start {start}", src.len());
                assert_eq!(&out[..4], b"head");
                assert_eq!(&out[4..], src);
            }
        }
    }

    #[test]
    fn the_folding_path_runs_where_the_cpu_has_it() {
        // The tests above go through `fold` only on a CPU with AVX-512 VPCLMULQDQ; say so
        // when it is not exercised rather than pass silently.
        #[cfg(target_arch = "x86_64")]
        if fold::available() {
            let src: Vec<u8> = (0..4096u32).map(|i| (i * 13) as u8).collect();
            let mut dst = vec![0u8; 4096];
            // SAFETY: features checked; 4096 >= BLOCK; `dst` is a separate 4096-byte buffer.
            let crc = unsafe { fold::append_copy(7, dst.as_mut_ptr(), &src) };
            assert_eq!(crc, crc32c_append(7, &src));
            assert_eq!(dst, src);
        } else {
            eprintln!("this CPU has no AVX-512 VPCLMULQDQ: only the scalar path was tested");
        }
    }

    #[test]
    fn append_copy_sees_every_single_bit_flip() {
        let page: Vec<u8> = (0..4096u32).map(|i| (i * 31 + 7) as u8).collect();
        let good = crc32c(&page);
        for bit in (0..4096 * 8).step_by(97) {
            let mut bad = page.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            let mut out = Vec::new();
            assert_ne!(crc32c_append_copy(0, &mut out, &bad), good, "bit {bit}");
            assert_eq!(out, bad);
        }
    }

    #[test]
    fn known_vector() {
        // RFC 3720 B.4: 32 bytes of zeros.
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    }

    #[test]
    fn combine_equals_whole() {
        assert_eq!(
            crc32c_combine(crc32c(b"hello, "), crc32c(b"world"), 5),
            crc32c(b"hello, world")
        );
    }

    #[test]
    fn append_equals_whole() {
        let whole = crc32c(b"hello, world");
        assert_eq!(crc32c_append(crc32c(b"hello, "), b"world"), whole);
    }
}

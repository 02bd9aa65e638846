//! Page checksums that are computed once and then maintained, never recomputed from the
//! whole page while it is dirty: an append extends the CRC of the used part, and a small
//! overwrite patches it from the old and new bytes alone. A flip that hit an untouched part
//! of the page before the write therefore stays detectable, which a full recompute would
//! have absorbed.
//!
//! CRC32C is affine over equal-length messages: `crc(a ^ b) = crc(a) ^ crc(b) ^ crc(0^L)`.
//! With `D` the message that is zero except `old ^ new` at the written range,
//! `crc(page') = crc(page) ^ crc(D) ^ crc(0^L)`, and `crc(D)` is combined from the CRC of
//! the changed bytes and precomputed CRCs of zero runs.

use lockstep_core::checksum::{crc32c, crc32c_append, crc32c_combine};
use std::sync::OnceLock;

pub const PAGE: usize = 4096;

/// `ZERO_CRCS[k]` = CRC32C of k zero bytes, k = 0..=PAGE.
fn zero_crcs() -> &'static [u32; PAGE + 1] {
    static T: OnceLock<Box<[u32; PAGE + 1]>> = OnceLock::new();
    T.get_or_init(|| {
        let mut t = Box::new([0u32; PAGE + 1]);
        for k in 1..=PAGE {
            t[k] = crc32c_append(t[k - 1], &[0]);
        }
        t
    })
}

/// The CRC of a page of `len` used bytes after `old` at `off` was overwritten with `new`
/// (same length, inside the used part).
pub fn patch(crc: u32, len: usize, off: usize, old: &[u8], new: &[u8]) -> u32 {
    assert_eq!(old.len(), new.len());
    assert!(off + new.len() <= len && len <= PAGE);
    let n = new.len();
    let z = zero_crcs();
    let mut delta = [0u8; PAGE];
    for i in 0..n {
        delta[i] = old[i] ^ new[i];
    }
    let tail = len - off - n;
    let d = crc32c_combine(crc32c_combine(z[off], crc32c(&delta[..n]), n), z[tail], tail);
    crc ^ d ^ z[len]
}

/// The CRC32C of `len` zero bytes (`len` ≤ PAGE), from a table.
pub fn zeros(len: usize) -> u32 {
    zero_crcs()[len]
}

/// The CRC after appending `more` to a page whose used part had CRC `crc`.
pub fn extend(crc: u32, more: &[u8]) -> u32 {
    crc32c_append(crc, more)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patch_and_extend_match_a_full_recompute() {
        let mut page: Vec<u8> = (0..3000u32).map(|i| (i * 7 + 3) as u8).collect();
        let mut crc = crc32c(&page);
        for (off, n, seed) in [(0, 1, 1u8), (17, 100, 2), (2999, 1, 3), (512, 2000, 4), (0, 3000, 5)] {
            let new: Vec<u8> = (0..n)
                .map(|i| (i as u8).wrapping_mul(seed).wrapping_add(seed))
                .collect();
            crc = patch(crc, page.len(), off, &page[off..off + n], &new);
            page[off..off + n].copy_from_slice(&new);
            assert_eq!(crc, crc32c(&page), "patch at {off}+{n}");
        }
        let more = vec![9u8; PAGE - page.len()];
        crc = extend(crc, &more);
        page.extend_from_slice(&more);
        assert_eq!(crc, crc32c(&page));
    }

    #[test]
    fn an_earlier_flip_outside_the_write_stays_detectable() {
        let mut page = vec![1u8; PAGE];
        let crc = crc32c(&page);
        page[10] ^= 4; // a memory error in a part the next write does not touch
        let new = [7u8; 16];
        let patched = patch(crc, PAGE, 100, &page[100..116], &new);
        page[100..116].copy_from_slice(&new);
        assert_ne!(patched, crc32c(&page));
    }
}

//! CRC32C (Castagnoli), the one checksum every lockstep component uses.
//!
//! The `crc32c` crate dispatches to the SSE4.2 `crc32` instruction when the CPU has it,
//! which every x86-64 machine we target does.

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

#[cfg(test)]
mod tests {
    use super::*;

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

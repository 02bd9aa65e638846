//! Running signatures over a replica's observable behaviour.
//!
//! Like RCoE, a signature is an event count plus a Fletcher checksum. Fletcher is
//! order-sensitive (`fold(a); fold(b)` differs from `fold(b); fold(a)`), so a replica that
//! made the same calls in another order, or with other arguments, ends up with another
//! signature. We use Fletcher-64 over 32-bit words; long buffers are first reduced to their
//! CRC32C so that folding cost stays proportional to the number of items, not bytes.

/// Fletcher-64 modulus.
const MOD: u64 = 0xFFFF_FFFF;

/// A running signature: three words, compared by equality.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Signature {
    /// Number of events folded in so far.
    pub events: u64,
    sum1: u64,
    sum2: u64,
}

impl Signature {
    pub const fn new() -> Self {
        Signature {
            events: 0,
            sum1: 0,
            sum2: 0,
        }
    }

    /// Marks the start of a new event (a syscall, a trace record, a signal).
    #[inline]
    pub fn begin_event(&mut self) {
        self.events += 1;
        self.fold_u64(self.events);
    }

    #[inline]
    pub fn fold_u32(&mut self, word: u32) {
        self.sum1 = (self.sum1 + word as u64) % MOD;
        self.sum2 = (self.sum2 + self.sum1) % MOD;
    }

    #[inline]
    pub fn fold_u64(&mut self, value: u64) {
        self.fold_u32(value as u32);
        self.fold_u32((value >> 32) as u32);
    }

    /// Folds a byte buffer by its length and CRC32C.
    #[inline]
    pub fn fold_bytes(&mut self, bytes: &[u8]) {
        self.fold_u64(bytes.len() as u64);
        self.fold_u32(crate::crc32c(bytes));
    }

    /// The two checksum words packed, for events and logs.
    pub fn digest(&self) -> u64 {
        (self.sum2 << 32) | self.sum1
    }
}

impl std::fmt::Display for Signature {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{:016x}", self.events, self.digest())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_matters() {
        let mut a = Signature::new();
        a.fold_u64(1);
        a.fold_u64(2);
        let mut b = Signature::new();
        b.fold_u64(2);
        b.fold_u64(1);
        assert_ne!(a, b);
    }

    #[test]
    fn single_bit_flip_changes_signature() {
        let mut data = vec![0x5au8; 4096];
        let mut a = Signature::new();
        a.fold_bytes(&data);
        for bit in [0usize, 7, 8 * 100 + 3, 8 * 4095 + 7] {
            data[bit / 8] ^= 1 << (bit % 8);
            let mut b = Signature::new();
            b.fold_bytes(&data);
            assert_ne!(a, b, "bit {bit}");
            data[bit / 8] ^= 1 << (bit % 8);
        }
    }

    #[test]
    fn event_count_distinguishes_empty_events() {
        let mut a = Signature::new();
        a.begin_event();
        let mut b = Signature::new();
        b.begin_event();
        b.begin_event();
        assert_ne!(a, b);
    }
}

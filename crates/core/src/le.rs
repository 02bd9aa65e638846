//! Little-endian integers in byte slices: the one reader that wire formats, shared memory
//! and tracee memory go through.
//!
//! The `*_at` functions are for offsets the caller has already checked against the
//! slice's length (a fixed header, a fixed-size read); they panic otherwise, since
//! reaching one out of bounds is a bug. [`Reader`] is for data of unknown length (a
//! peer's bytes, a file): each read returns `None` instead.

macro_rules! at_fns {
    ($($name:ident: $t:ty),*) => {$(
        #[doc = concat!("The `", stringify!($t), "` at byte offset `at` of `b`. Panics if `b` is too short.")]
        #[inline]
        pub fn $name(b: &[u8], at: usize) -> $t {
            const N: usize = std::mem::size_of::<$t>();
            match b.get(at..at + N) {
                Some(bytes) => <$t>::from_le_bytes(bytes.try_into().expect("N bytes")),
                None => panic!("{}: offset {at} of a {}-byte slice", stringify!($name), b.len()),
            }
        }
    )*};
}
at_fns!(u16_at: u16, u32_at: u32, u64_at: u64, i32_at: i32);

/// A cursor over bytes of unknown length: every read is checked.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Reader<'a> {
        Reader { buf, at: 0 }
    }

    /// The next `n` bytes, or `None` (and no progress) if fewer are left.
    pub fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.at.checked_add(n)?;
        let bytes = self.buf.get(self.at..end)?;
        self.at = end;
        Some(bytes)
    }

    pub fn u32(&mut self) -> Option<u32> {
        self.take(4).map(|b| u32_at(b, 0))
    }

    pub fn u64(&mut self) -> Option<u64> {
        self.take(8).map(|b| u64_at(b, 0))
    }

    /// Bytes not read yet.
    pub fn rest(&self) -> &'a [u8] {
        &self.buf[self.at..]
    }

    pub fn position(&self) -> usize {
        self.at
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_at_offsets_and_refuses_past_the_end() {
        let b = [1u8, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 2, 0, 0, 0, 0, 0, 0, 0x80];
        assert_eq!(u32_at(&b, 0), 1);
        assert_eq!(i32_at(&b, 4), -1);
        assert_eq!(u64_at(&b, 8), 0x8000_0000_0000_0002);
        assert_eq!(u16_at(&b, 14), 0x8000);
        assert!(std::panic::catch_unwind(|| u64_at(&b, 9)).is_err());
        assert!(std::panic::catch_unwind(|| u32_at(&b, usize::MAX)).is_err());
        let mut r = Reader::new(&b);
        assert_eq!(r.u32(), Some(1));
        assert_eq!(r.take(4), Some(&b[4..8]));
        assert_eq!(r.u64(), Some(0x8000_0000_0000_0002));
        assert_eq!(r.u32(), None);
        assert_eq!(r.take(usize::MAX), None);
        assert_eq!(r.position(), 16);
        assert!(r.rest().is_empty());
    }
}

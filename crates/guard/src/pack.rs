//! Canonical bytes of protected objects: one order of fields for the checksum, and a
//! self-delimiting encoding for repair messages and snapshots.

use lockstep_core::checksum::crc32c_append;

/// Feeds an object's protected fields into a CRC32C, without building a buffer.
///
/// Fixed-size fields gather in a small buffer that is checksummed a block at a time:
/// one call per field into the CRC routine costs more than the field, and a block lets
/// the CPU run its three CRC lanes in parallel. The result is the CRC of the packed bytes.
pub struct Hasher {
    crc: u32,
    pending: [u8; HASHER_BLOCK],
    len: usize,
}

/// Bytes a [`Hasher`] gathers before it folds them into the CRC.
const HASHER_BLOCK: usize = 128;

impl Default for Hasher {
    fn default() -> Self {
        Hasher {
            crc: 0,
            pending: [0; HASHER_BLOCK],
            len: 0,
        }
    }
}

impl Hasher {
    #[inline]
    fn push(&mut self, b: &[u8]) {
        if self.len + b.len() > HASHER_BLOCK {
            self.fold();
        }
        self.pending[self.len..self.len + b.len()].copy_from_slice(b);
        self.len += b.len();
    }
    #[inline]
    fn fold(&mut self) {
        self.crc = crc32c_append(self.crc, &self.pending[..self.len]);
        self.len = 0;
    }
    #[inline]
    pub fn bytes(&mut self, b: &[u8]) {
        // The length first, so that ("ab","c") and ("a","bc") differ.
        self.u32(b.len() as u32);
        if b.len() <= HASHER_BLOCK / 4 {
            self.push(b);
        } else {
            self.fold();
            self.crc = crc32c_append(self.crc, b);
        }
    }
    #[inline]
    pub fn u64(&mut self, v: u64) {
        self.push(&v.to_le_bytes());
    }
    #[inline]
    pub fn u32(&mut self, v: u32) {
        self.push(&v.to_le_bytes());
    }
    #[inline]
    pub fn finish(&self) -> u32 {
        crc32c_append(self.crc, &self.pending[..self.len])
    }
}

/// Where an object's protected fields go: the CRC ([`Hasher`]) or the wire ([`Packer`]).
/// Both take the fields in the same order and encoding, so one description of an
/// object's fields serves both, and the CRC is the CRC of the packed bytes.
pub trait FieldSink {
    fn u8(&mut self, v: u8);
    fn u32(&mut self, v: u32);
    fn u64(&mut self, v: u64);
    /// Length-prefixed bytes.
    fn bytes(&mut self, b: &[u8]);
}

impl FieldSink for Hasher {
    #[inline]
    fn u8(&mut self, v: u8) {
        self.push(&[v]);
    }
    #[inline]
    fn u32(&mut self, v: u32) {
        Hasher::u32(self, v)
    }
    #[inline]
    fn u64(&mut self, v: u64) {
        Hasher::u64(self, v)
    }
    #[inline]
    fn bytes(&mut self, b: &[u8]) {
        Hasher::bytes(self, b)
    }
}

impl FieldSink for Packer {
    #[inline]
    fn u8(&mut self, v: u8) {
        Packer::u8(self, v)
    }
    #[inline]
    fn u32(&mut self, v: u32) {
        Packer::u32(self, v)
    }
    #[inline]
    fn u64(&mut self, v: u64) {
        Packer::u64(self, v)
    }
    #[inline]
    fn bytes(&mut self, b: &[u8]) {
        Packer::bytes(self, b)
    }
}

/// A protected object: the state a replica must agree on and be able to repair.
pub trait Protected: Sized {
    /// Emit every protected field, in a fixed order. Fields that are not protected
    /// (caches, pointers, statistics) are left out.
    fn fields<S: FieldSink>(&self, out: &mut S);
    /// Rebuild an object from the packed fields.
    fn unpack(inp: &mut Unpacker<'_>) -> Result<Self, UnpackError>;

    fn checksum(&self, h: &mut Hasher) {
        self.fields(h)
    }
    fn pack(&self, out: &mut Packer) {
        self.fields(out)
    }
    fn crc(&self) -> u32 {
        let mut h = Hasher::default();
        self.checksum(&mut h);
        h.finish()
    }
}

/// Little-endian, length-prefixed encoding.
#[derive(Default)]
pub struct Packer {
    pub buf: Vec<u8>,
}

impl Packer {
    #[inline]
    pub fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
    #[inline]
    pub fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    #[inline]
    pub fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    #[inline]
    pub fn bytes(&mut self, b: &[u8]) {
        self.u32(b.len() as u32);
        self.buf.extend_from_slice(b);
    }
    /// What `fill` packs, length-prefixed as by [`Packer::bytes`], written in place (no
    /// intermediate buffer: a snapshot is the size of the whole state).
    pub fn nested<R>(&mut self, fill: impl FnOnce(&mut Packer) -> R) -> R {
        let at = self.buf.len();
        self.u32(0);
        let r = fill(self);
        let len = u32::try_from(self.buf.len() - at - 4).expect("nested field under 4 GiB");
        self.buf[at..at + 4].copy_from_slice(&len.to_le_bytes());
        r
    }
}

#[derive(Debug, PartialEq, Eq)]
pub struct UnpackError(pub &'static str);

impl std::fmt::Display for UnpackError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "malformed packed object: {}", self.0)
    }
}
impl std::error::Error for UnpackError {}

/// Reads what a [`Packer`] wrote; every read is bounds-checked, so arbitrary bytes from the
/// network give an error, never a panic.
pub struct Unpacker<'a> {
    buf: &'a [u8],
}

impl<'a> Unpacker<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Unpacker { buf }
    }
    #[inline]
    fn take(&mut self, n: usize) -> Result<&'a [u8], UnpackError> {
        if self.buf.len() < n {
            return Err(UnpackError("truncated"));
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }
    #[inline]
    pub fn u8(&mut self) -> Result<u8, UnpackError> {
        Ok(self.take(1)?[0])
    }
    #[inline]
    pub fn u32(&mut self) -> Result<u32, UnpackError> {
        Ok(lockstep_core::le::u32_at(self.take(4)?, 0))
    }
    #[inline]
    pub fn u64(&mut self) -> Result<u64, UnpackError> {
        Ok(lockstep_core::le::u64_at(self.take(8)?, 0))
    }
    #[inline]
    pub fn bytes(&mut self) -> Result<&'a [u8], UnpackError> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
    #[inline]
    pub fn rest(&self) -> &'a [u8] {
        self.buf
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every mix of field sizes, including byte strings on both sides of the block size,
    /// hashes to the CRC of the packed bytes.
    #[test]
    fn hasher_is_the_crc_of_the_packed_bytes() {
        let mut rng = lockstep_core::rng::Rng::new(0x9e37_79b9_7f4a_7c15);
        let mut h = Hasher::default();
        let mut p = Packer::default();
        for i in 0..2000usize {
            let x = rng.next_u64();
            match x % 4 {
                0 => {
                    FieldSink::u8(&mut h, x as u8);
                    FieldSink::u8(&mut p, x as u8);
                }
                1 => {
                    h.u32(x as u32);
                    p.u32(x as u32);
                }
                2 => {
                    h.u64(x);
                    p.u64(x);
                }
                _ => {
                    let b: Vec<u8> = (0..(x >> 32) as usize % 300).map(|j| (i + j) as u8).collect();
                    h.bytes(&b);
                    p.bytes(&b);
                }
            }
            assert_eq!(h.finish(), lockstep_core::crc32c(&p.buf), "after field {i}");
        }
    }
}

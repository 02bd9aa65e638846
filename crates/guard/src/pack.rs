//! Canonical bytes of protected objects: one order of fields for the checksum, and a
//! self-delimiting encoding for repair messages and snapshots.

use lockstep_core::checksum::{crc32c_append, crc32c_append_u32, crc32c_append_u64, crc32c_append_u8};

/// Feeds an object's protected fields into a CRC32C, without building a buffer.
#[derive(Default)]
pub struct Hasher {
    crc: u32,
}

impl Hasher {
    pub fn bytes(&mut self, b: &[u8]) {
        // The length first, so that ("ab","c") and ("a","bc") differ.
        self.crc = crc32c_append_u32(self.crc, b.len() as u32);
        self.crc = crc32c_append(self.crc, b);
    }
    pub fn u64(&mut self, v: u64) {
        self.crc = crc32c_append_u64(self.crc, v);
    }
    pub fn u32(&mut self, v: u32) {
        self.crc = crc32c_append_u32(self.crc, v);
    }
    pub fn finish(&self) -> u32 {
        self.crc
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
    fn u8(&mut self, v: u8) {
        self.crc = crc32c_append_u8(self.crc, v);
    }
    fn u32(&mut self, v: u32) {
        Hasher::u32(self, v)
    }
    fn u64(&mut self, v: u64) {
        Hasher::u64(self, v)
    }
    fn bytes(&mut self, b: &[u8]) {
        Hasher::bytes(self, b)
    }
}

impl FieldSink for Packer {
    fn u8(&mut self, v: u8) {
        Packer::u8(self, v)
    }
    fn u32(&mut self, v: u32) {
        Packer::u32(self, v)
    }
    fn u64(&mut self, v: u64) {
        Packer::u64(self, v)
    }
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
    pub fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
    pub fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
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
    fn take(&mut self, n: usize) -> Result<&'a [u8], UnpackError> {
        if self.buf.len() < n {
            return Err(UnpackError("truncated"));
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }
    pub fn u8(&mut self) -> Result<u8, UnpackError> {
        Ok(self.take(1)?[0])
    }
    pub fn u32(&mut self) -> Result<u32, UnpackError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    pub fn u64(&mut self) -> Result<u64, UnpackError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    pub fn bytes(&mut self) -> Result<&'a [u8], UnpackError> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
    pub fn rest(&self) -> &'a [u8] {
        self.buf
    }
}

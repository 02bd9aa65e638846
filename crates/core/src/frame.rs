//! The `[u32 len][u32 crc32c(payload)][payload]` record (little-endian) that kv's peer
//! links and its data files both use: one encoder, one checked decoder.

use crate::checksum::crc32c;
use crate::le::u32_at;

/// Bytes before the payload.
pub const HEADER: usize = 8;

/// What [`decode`] found at the front of a buffer.
#[derive(Debug, PartialEq, Eq)]
pub enum Decoded<'a> {
    /// A whole frame whose CRC matches: its payload and its length with the header.
    Frame { payload: &'a [u8], len: usize },
    /// Fewer bytes than the frame needs (a stream not read yet, or a torn file tail).
    Incomplete,
}

#[derive(Debug, PartialEq, Eq)]
pub enum FrameError {
    /// The header announces more than the caller's limit (checked before any wait for it).
    TooLong { len: usize, max: usize },
    /// The payload does not match its CRC.
    Crc,
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::TooLong { len, max } => write!(f, "frame of {len} bytes (at most {max})"),
            FrameError::Crc => f.write_str("frame CRC mismatch"),
        }
    }
}

impl std::error::Error for FrameError {}

/// Appends `payload` as one frame. Panics above `u32::MAX` bytes: callers bound their
/// payloads far below that.
pub fn append(out: &mut Vec<u8>, payload: &[u8]) {
    let len = u32::try_from(payload.len()).expect("a frame's payload fits in u32");
    out.reserve(HEADER + payload.len());
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&crc32c(payload).to_le_bytes());
    out.extend_from_slice(payload);
}

/// The frame at the front of `buf`, refusing announced lengths above `max`.
pub fn decode(buf: &[u8], max: usize) -> Result<Decoded<'_>, FrameError> {
    if buf.len() < HEADER {
        return Ok(Decoded::Incomplete);
    }
    let len = u32_at(buf, 0) as usize;
    if len > max {
        return Err(FrameError::TooLong { len, max });
    }
    let Some(payload) = buf.get(HEADER..HEADER + len) else {
        return Ok(Decoded::Incomplete);
    };
    if crc32c(payload) != u32_at(buf, 4) {
        return Err(FrameError::Crc);
    }
    Ok(Decoded::Frame {
        payload,
        len: HEADER + len,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects_damage() {
        let mut buf = Vec::new();
        append(&mut buf, b"hello");
        append(&mut buf, b"");
        assert_eq!(
            decode(&buf, 16),
            Ok(Decoded::Frame {
                payload: b"hello",
                len: 13
            })
        );
        assert_eq!(decode(&buf[13..], 16), Ok(Decoded::Frame { payload: b"", len: 8 }));
        for cut in 0..13 {
            assert_eq!(decode(&buf[..cut], 16), Ok(Decoded::Incomplete), "cut at {cut}");
        }
        assert_eq!(decode(&buf, 4), Err(FrameError::TooLong { len: 5, max: 4 }));
        let mut bad = buf.clone();
        bad[9] ^= 1;
        assert_eq!(decode(&bad, 16), Err(FrameError::Crc));
        let huge = [0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0];
        assert_eq!(decode(&huge, usize::MAX), Ok(Decoded::Incomplete));
    }
}

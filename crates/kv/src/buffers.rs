//! Byte buffers that are done with, kept for the next ones: the keys and values of
//! requests whose replies went out (for the parser), of items that were evicted or deleted
//! (for new items). A request or an item then costs no allocation in the steady state.
//!
//! Only capacity is reused, never content, so nothing any replica computes depends on it.
//! Bounded: at most `KEPT` buffers per size class (up to `SMALL_MAX` bytes, up to
//! `LARGE_MAX`) and `KEY_LISTS_KEPT` key lists of at most `KEY_LIST_MAX` keys; anything
//! else is freed. About 1 MiB at most.

use crate::command::Command;

/// Buffers kept per size class.
pub const KEPT: usize = 64;
/// The small class (keys, short values), by capacity.
const SMALL_MAX: usize = 256;
/// Larger buffers are freed, not kept.
const LARGE_MAX: usize = 16 << 10;
/// Get key lists kept.
const KEY_LISTS_KEPT: usize = 16;
/// A key list with more keys is not kept whole.
const KEY_LIST_MAX: usize = 24;

#[derive(Default)]
pub struct Buffers {
    small: Vec<Vec<u8>>,
    large: Vec<Vec<u8>>,
    key_lists: Vec<Vec<Vec<u8>>>,
}

/// Whether a buffer of `capacity` may hold `len` bytes: room enough, and not so much that
/// an item holds memory far beyond the size it is accounted at.
pub fn fits(capacity: usize, len: usize) -> bool {
    capacity >= len && capacity <= 2 * len + 64
}

/// `bytes` into `buf`: in place when it fits them (see `fits`), else a new buffer.
pub fn refill(buf: &mut Vec<u8>, bytes: &[u8]) {
    if fits(buf.capacity(), bytes.len()) {
        buf.clear();
        buf.extend_from_slice(bytes);
    } else {
        *buf = bytes.to_vec();
    }
}

impl Buffers {
    fn class(&mut self, len: usize) -> &mut Vec<Vec<u8>> {
        if len <= SMALL_MAX {
            &mut self.small
        } else {
            &mut self.large
        }
    }

    pub fn keep(&mut self, buf: Vec<u8>) {
        let capacity = buf.capacity();
        if capacity == 0 || capacity > LARGE_MAX {
            return;
        }
        let list = self.class(capacity);
        if list.len() < KEPT {
            list.push(buf);
        }
    }

    /// A buffer holding `bytes`: the last one kept of their class if it fits them, else a
    /// new one (a kept one that does not fit is freed: sizes have moved on).
    pub fn copy(&mut self, bytes: &[u8]) -> Vec<u8> {
        match self.class(bytes.len()).pop() {
            Some(mut buf) => {
                refill(&mut buf, bytes);
                buf
            }
            None => bytes.to_vec(),
        }
    }

    /// A get's key list holding `keys`.
    pub fn key_list(&mut self, keys: &[&[u8]]) -> Vec<Vec<u8>> {
        let mut list = self.key_lists.pop().unwrap_or_default();
        for spare in list.drain(keys.len().min(list.len())..) {
            self.keep(spare);
        }
        for (i, key) in keys.iter().enumerate() {
            match list.get_mut(i) {
                Some(buf) => refill(buf, key),
                None => {
                    let buf = self.copy(key);
                    list.push(buf);
                }
            }
        }
        list
    }

    /// What a command that is done with leaves: its key, value and key list.
    pub fn keep_command(&mut self, cmd: Command) {
        match cmd {
            Command::Get { mut keys, .. } => {
                if keys.len() > KEY_LIST_MAX {
                    for key in keys.drain(KEY_LIST_MAX..) {
                        self.keep(key);
                    }
                }
                if self.key_lists.len() < KEY_LISTS_KEPT {
                    self.key_lists.push(keys);
                }
            }
            Command::Store { key, data, .. } | Command::Meta { key, data, .. } => {
                self.keep(key);
                self.keep(data);
            }
            Command::Delete { key }
            | Command::Arith { key, .. }
            | Command::Touch { key, .. }
            | Command::TooLarge { key } => self.keep(key),
            Command::OnHeldItem(inner) => self.keep_command(*inner),
            Command::FlushAll { .. } | Command::MemLimit { .. } => {}
        }
    }

    /// Moves `other`'s buffers here, as many as the bounds allow (the rest are freed).
    pub fn take_from(&mut self, other: &mut Buffers) {
        for buf in other.small.drain(..).chain(other.large.drain(..)) {
            self.keep(buf);
        }
        let room = KEY_LISTS_KEPT.saturating_sub(self.key_lists.len());
        self.key_lists.extend(other.key_lists.drain(..).take(room));
    }

    /// Buffers kept, over every class (key lists count their keys).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.small.len() + self.large.len() + self.key_lists.iter().map(Vec::len).sum::<usize>()
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The buffer `copy` would try next for `len` bytes (for tests of reuse).
    #[cfg(test)]
    pub(crate) fn next_for(&mut self, len: usize) -> Option<*const u8> {
        self.class(len).last().map(|b| b.as_ptr())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused_within_their_bounds() {
        let mut b = Buffers::default();
        b.keep(vec![1; 400]);
        let kept = b.next_for(400).unwrap();
        let got = b.copy(&[7; 350]);
        assert_eq!(got.as_ptr(), kept, "a fitting buffer is reused");
        assert_eq!(got, vec![7; 350]);
        // Too small or far too large for what is asked: a new buffer.
        b.keep(vec![1; 300]);
        assert_eq!(b.copy(&[2; 1000]), vec![2; 1000]);
        assert!(b.is_empty(), "the misfit was freed");
        b.keep(vec![1; 4000]);
        let small = b.copy(&[3; 10]);
        assert!(small.capacity() < 100);
        // Bounds: per class, and nothing over LARGE_MAX.
        for _ in 0..3 * KEPT {
            b.keep(vec![0; 64]);
            b.keep(vec![0; 1000]);
        }
        b.keep(vec![0; LARGE_MAX + 1]);
        assert_eq!(b.len(), 2 * KEPT);
        // A key list comes back with its keys' buffers; a long one is not kept whole.
        let mut b = Buffers::default();
        let list = b.key_list(&[b"aa", b"bb"]);
        let first = list[0].as_ptr();
        b.keep_command(Command::Get {
            keys: list,
            with_cas: false,
            touch: None,
        });
        let again = b.key_list(&[b"cc"]);
        assert_eq!(again, vec![b"cc".to_vec()]);
        assert_eq!(again[0].as_ptr(), first);
        let many: Vec<Vec<u8>> = (0..100).map(|i| vec![i as u8; 8]).collect();
        b.keep_command(Command::Get {
            keys: many,
            with_cas: false,
            touch: None,
        });
        assert!(b.len() <= KEY_LIST_MAX + KEPT + 1);
        let mut other = Buffers::default();
        other.take_from(&mut b);
        assert!(b.is_empty() && !other.is_empty());
    }
}

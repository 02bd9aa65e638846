//! The store's protected objects. Each is one `Guarded<T>` with a deterministic id:
//! items and their LRU links by slot, hash buckets by number, the free-slot stack in
//! chunks by number, and two singletons (the slab allocator and the global counters/LRU
//! ends). Every object's size is bounded by a constant or by items per bucket, so that
//! checking it on each access costs the same whatever the store holds.

use lockstep_guard::{FieldSink, ObjectId, Protected, UnpackError, Unpacker};

pub const KIND_ITEM: u8 = 1;
pub const KIND_LINKS: u8 = 2;
pub const KIND_BUCKET: u8 = 3;
pub const KIND_SLAB: u8 = 4;
pub const KIND_GLOBALS: u8 = 5;
pub const KIND_FREE: u8 = 6;

/// No slot (end of an LRU list).
pub const NIL: u32 = u32::MAX;

pub fn item_id(slot: u32) -> ObjectId {
    ObjectId::new(KIND_ITEM, slot as u64)
}
pub fn links_id(slot: u32) -> ObjectId {
    ObjectId::new(KIND_LINKS, slot as u64)
}
pub fn bucket_id(b: u32) -> ObjectId {
    ObjectId::new(KIND_BUCKET, b as u64)
}
pub fn free_chunk_id(chunk: u32) -> ObjectId {
    ObjectId::new(KIND_FREE, chunk as u64)
}
pub const SLAB_ID: ObjectId = ObjectId((KIND_SLAB as u64) << 56);
pub const GLOBALS_ID: ObjectId = ObjectId((KIND_GLOBALS as u64) << 56);

/// A key-value pair with its memcached metadata.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Item {
    pub key: Vec<u8>,
    pub value: Vec<u8>,
    pub flags: u32,
    /// Absolute expiry in milliseconds of log time; 0 = never.
    pub exptime_ms: u64,
    pub cas: u64,
    /// Log time of the last store, for flush_all.
    pub stored_ms: u64,
    /// Stored by a meta command with a base64 key (`b`): memcached's ITEM_KEY_BINARY,
    /// which makes `mg k` and `me` show the key base64-encoded.
    pub key_binary: bool,
    /// Marked stale by `md … I` or a stale `ms … I` (memcached's ITEM_STALE): `mg` shows
    /// `X`, and hands the next reader the recache token.
    pub stale: bool,
    /// A reader was handed the recache token (`W`; memcached's ITEM_TOKEN_SENT): later
    /// readers see `Z` until the item is replaced.
    pub token_sent: bool,
}

/// Bits of the trailing marks byte of an [`Item`], written only when one is set so that
/// plain items keep their CRCs and format (a byte of 1 is the older key flag).
const MARK_KEY_BINARY: u8 = 1;
const MARK_STALE: u8 = 2;
const MARK_TOKEN_SENT: u8 = 4;

impl Item {
    /// Bytes charged against the memory limit.
    pub fn size(&self) -> u64 {
        (self.key.len() + self.value.len() + 48) as u64
    }
}

impl Protected for Item {
    fn fields<S: FieldSink>(&self, p: &mut S) {
        p.bytes(&self.key);
        p.bytes(&self.value);
        p.u32(self.flags);
        p.u64(self.exptime_ms);
        p.u64(self.cas);
        p.u64(self.stored_ms);
        let marks = (self.key_binary as u8 * MARK_KEY_BINARY)
            | (self.stale as u8 * MARK_STALE)
            | (self.token_sent as u8 * MARK_TOKEN_SENT);
        if marks != 0 {
            p.u8(marks);
        }
    }
    fn unpack(u: &mut Unpacker<'_>) -> Result<Self, UnpackError> {
        let (key, value) = (u.bytes()?.to_vec(), u.bytes()?.to_vec());
        let (flags, exptime_ms, cas, stored_ms) = (u.u32()?, u.u64()?, u.u64()?, u.u64()?);
        let marks = match u.is_empty() {
            true => 0,
            false => u.u8()?,
        };
        if marks & !(MARK_KEY_BINARY | MARK_STALE | MARK_TOKEN_SENT) != 0 {
            return Err(UnpackError("bad item marks"));
        }
        Ok(Item {
            key,
            value,
            flags,
            exptime_ms,
            cas,
            stored_ms,
            key_binary: marks & MARK_KEY_BINARY != 0,
            stale: marks & MARK_STALE != 0,
            token_sent: marks & MARK_TOKEN_SENT != 0,
        })
    }
}

/// An item's place in the LRU list and its last access (log time), with what taking the
/// item out of the index and the accounting needs: an eviction reads these small links,
/// not the whole item (whose check would read every byte of a cold value).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Links {
    pub prev: u32,
    pub next: u32,
    pub accessed_ms: u64,
    /// Read since it was stored (memcached's ITEM_FETCHED: `mg h`, metadump's `fetch`).
    pub fetched: bool,
    /// The item's key hash (its bucket and its entry there).
    pub key_hash: u32,
    /// The item's size as accounted (`Item::size`).
    pub size: u64,
}

impl Protected for Links {
    fn fields<S: FieldSink>(&self, p: &mut S) {
        p.u32(self.prev);
        p.u32(self.next);
        p.u64(self.accessed_ms);
        p.u8(self.fetched as u8);
        p.u32(self.key_hash);
        p.u64(self.size);
    }
    fn unpack(u: &mut Unpacker<'_>) -> Result<Self, UnpackError> {
        Ok(Links {
            prev: u.u32()?,
            next: u.u32()?,
            accessed_ms: u.u64()?,
            fetched: u.u8()? == 1,
            key_hash: u.u32()?,
            size: u.u64()?,
        })
    }
}

/// One hash bucket: (hash of key, slot) for each item whose key hashes here.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Bucket {
    pub entries: Vec<(u32, u32)>,
}

impl Protected for Bucket {
    fn fields<S: FieldSink>(&self, p: &mut S) {
        p.u32(self.entries.len() as u32);
        for &(k, s) in &self.entries {
            p.u32(k);
            p.u32(s);
        }
    }
    fn unpack(u: &mut Unpacker<'_>) -> Result<Self, UnpackError> {
        let n = u.u32()? as usize;
        if n > u.rest().len() / 8 {
            return Err(UnpackError("bucket length exceeds message"));
        }
        let mut entries = Vec::with_capacity(n);
        for _ in 0..n {
            entries.push((u.u32()?, u.u32()?));
        }
        Ok(Bucket { entries })
    }
}

/// The slot allocator: freed slots are reused last-freed-first, the same on every replica.
/// The stack of freed slots lives in `FreeChunk`s of `FREE_CHUNK` slots (chunk `i` holds
/// stack positions `i * FREE_CHUNK ..`), so that a free or an allocation checks and
/// rewrites one small chunk, not a stack that a mass delete made as long as the store.
/// The chunk an allocation empties stays (one empty chunk at most, just above the
/// stack's top), so that a store that frees and takes a slot per set does not allocate.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Slab {
    /// Freed slots on the stack.
    pub free_len: u32,
    /// Slots ever allocated; the next new slot.
    pub high: u32,
}

/// Slots per free-stack chunk.
pub const FREE_CHUNK: u32 = 64;

impl Protected for Slab {
    fn fields<S: FieldSink>(&self, p: &mut S) {
        p.u32(self.high);
        p.u32(self.free_len);
    }
    fn unpack(u: &mut Unpacker<'_>) -> Result<Self, UnpackError> {
        let high = u.u32()?;
        let free_len = u.u32()?;
        if free_len > high {
            return Err(UnpackError("more free slots than slots"));
        }
        Ok(Slab { free_len, high })
    }
}

/// One chunk of the free-slot stack (see `Slab`): at most `FREE_CHUNK` slots.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FreeChunk {
    pub slots: Vec<u32>,
}

impl Protected for FreeChunk {
    fn fields<S: FieldSink>(&self, p: &mut S) {
        p.u32(self.slots.len() as u32);
        for &s in &self.slots {
            p.u32(s);
        }
    }
    fn unpack(u: &mut Unpacker<'_>) -> Result<Self, UnpackError> {
        let n = u.u32()?;
        if n > FREE_CHUNK {
            return Err(UnpackError("free chunk over its size"));
        }
        let slots = (0..n).map(|_| u.u32()).collect::<Result<_, _>>()?;
        Ok(FreeChunk { slots })
    }
}

/// Store-wide state: the CAS counter, the LRU ends, the item count and bytes, flush time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Globals {
    pub cas: u64,
    pub lru_head: u32,
    pub lru_tail: u32,
    pub items: u64,
    pub bytes: u64,
    /// Items stored at or before this log time are invalid once it has passed (a delayed
    /// flush_all).
    pub oldest_live_ms: u64,
    /// Items whose CAS is below this are invalid (an immediate flush_all: exact in log
    /// order, however many requests share a millisecond).
    pub oldest_cas: u64,
    /// The log's clock: never goes backwards.
    pub now_ms: u64,
    pub evictions: u64,
    /// The memory limit `cache_memlimit` set, in bytes (0: the configured one).
    pub memlimit: u64,
}

impl Default for Globals {
    fn default() -> Self {
        Globals {
            cas: 0,
            lru_head: NIL,
            lru_tail: NIL,
            items: 0,
            bytes: 0,
            oldest_live_ms: 0,
            oldest_cas: 0,
            now_ms: 0,
            evictions: 0,
            memlimit: 0,
        }
    }
}

impl Protected for Globals {
    fn fields<S: FieldSink>(&self, p: &mut S) {
        for v in [
            self.cas,
            self.items,
            self.bytes,
            self.oldest_live_ms,
            self.oldest_cas,
            self.now_ms,
            self.evictions,
        ] {
            p.u64(v);
        }
        p.u32(self.lru_head);
        p.u32(self.lru_tail);
        // Only once set, so that stores that never changed it keep their CRCs and format.
        if self.memlimit != 0 {
            p.u64(self.memlimit);
        }
    }
    fn unpack(u: &mut Unpacker<'_>) -> Result<Self, UnpackError> {
        Ok(Globals {
            cas: u.u64()?,
            items: u.u64()?,
            bytes: u.u64()?,
            oldest_live_ms: u.u64()?,
            oldest_cas: u.u64()?,
            now_ms: u.u64()?,
            evictions: u.u64()?,
            lru_head: u.u32()?,
            lru_tail: u.u32()?,
            memlimit: if u.is_empty() { 0 } else { u.u64()? },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockstep_guard::Packer;

    fn item(key_binary: bool, stale: bool, token_sent: bool) -> Item {
        Item {
            key: b"k".to_vec(),
            value: b"v".to_vec(),
            flags: 1,
            exptime_ms: 2,
            cas: 3,
            stored_ms: 4,
            key_binary,
            stale,
            token_sent,
        }
    }

    #[test]
    fn item_marks_round_trip_and_a_plain_item_packs_without_them() {
        let mut plain = Packer::default();
        item(false, false, false).pack(&mut plain);
        for marks in 0..8u8 {
            let it = item(marks & 1 != 0, marks & 2 != 0, marks & 4 != 0);
            let mut p = Packer::default();
            it.pack(&mut p);
            assert_eq!(p.buf.len(), plain.buf.len() + usize::from(marks != 0));
            assert_eq!(Item::unpack(&mut Unpacker::new(&p.buf)).unwrap(), it);
        }
        let mut bad = plain.buf.clone();
        bad.push(8);
        assert!(Item::unpack(&mut Unpacker::new(&bad)).is_err());
    }
}

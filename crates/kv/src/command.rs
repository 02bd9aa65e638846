//! A parsed client request in the form that goes into the replicated log. Only what every
//! replica needs to execute it is here; connection matters (noreply, which socket) stay
//! with the replica that received it.

use crate::buffers::refill;
use lockstep_guard::{Packer, UnpackError, Unpacker};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreOp {
    Set,
    Add,
    Replace,
    Append,
    Prepend,
    Cas,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// get/gets (touch: None) and gat/gats (touch: Some(exptime)).
    Get {
        keys: Vec<Vec<u8>>,
        with_cas: bool,
        touch: Option<i64>,
    },
    Store {
        op: StoreOp,
        key: Vec<u8>,
        flags: u32,
        exptime: i64,
        data: Vec<u8>,
        cas: u64,
    },
    Delete {
        key: Vec<u8>,
    },
    Arith {
        key: Vec<u8>,
        incr: bool,
        delta: u64,
    },
    Touch {
        key: Vec<u8>,
        exptime: i64,
    },
    FlushAll {
        delay: i64,
    },
    /// A `set` whose value does not fit: memcached answers "object too large" and removes
    /// the key's old value, so that no stale value outlives a failed set.
    TooLarge {
        key: Vec<u8>,
    },
    /// `cache_memlimit`: the memory limit, in MiB, from now on (at least 8, as memcached).
    MemLimit {
        mb: u32,
    },
    /// A meta command: `kind` is b'g', b's', b'd', b'a' or b'e' (mg, ms, md, ma, me);
    /// `flags` are its flag tokens as sent, already checked by the parser.
    Meta {
        kind: u8,
        key: Vec<u8>,
        flags: Vec<Vec<u8>>,
        data: Vec<u8>,
    },
    /// An incr, decr or ma (`Arith` or `Meta` b'a') of a key whose item memcached would
    /// still hold for an unwritten reply on the same connection (see [`HeldKeys`]): the
    /// new value goes into a new item, not in place.
    OnHeldItem(Box<Command>),
}

/// A get's tag in the log's encoding of commands.
const GET_TAG: u8 = 1;
/// A store's (set, add, replace, append, prepend, cas).
const STORE_TAG: u8 = 2;

fn decode_store_op(u: &mut Unpacker<'_>) -> Result<StoreOp, UnpackError> {
    Ok(match u.u8()? {
        0 => StoreOp::Set,
        1 => StoreOp::Add,
        2 => StoreOp::Replace,
        3 => StoreOp::Append,
        4 => StoreOp::Prepend,
        5 => StoreOp::Cas,
        _ => return Err(UnpackError("unknown store op")),
    })
}

/// A get's fields after its tag: `with_cas`, `touch`, and its keys into `keys` (whose
/// buffers are reused where there are some).
fn decode_get(u: &mut Unpacker<'_>, keys: &mut Vec<Vec<u8>>) -> Result<(bool, Option<i64>), UnpackError> {
    let with_cas = u.u8()? != 0;
    let touch = match u.u8()? {
        0 => None,
        _ => Some(u.u64()? as i64),
    };
    let n = u.u32()? as usize;
    if n > u.rest().len() / 4 {
        return Err(UnpackError("key count exceeds entry"));
    }
    keys.truncate(n);
    for i in 0..n {
        let key = u.bytes()?;
        match keys.get_mut(i) {
            Some(k) => refill(k, key),
            None => keys.push(key.to_vec()),
        }
    }
    Ok((with_cas, touch))
}

impl Command {
    /// The key of an arithmetic command (incr, decr, ma), which [`Command::OnHeldItem`]
    /// may wrap.
    pub fn arith_key(&self) -> Option<&[u8]> {
        match self {
            Command::Arith { key, .. } => Some(key),
            Command::Meta { kind: b'a', key, .. } => Some(key),
            _ => None,
        }
    }
}

/// Decodes a log entry's commands one after another into two reused slots, one for gets
/// and one for everything else, so that a mix of gets and sets reuses the buffers of the
/// last one of each kind (see [`Command::decode_into`]).
pub struct Decoder {
    get: Command,
    other: Command,
}

impl Default for Decoder {
    fn default() -> Self {
        Decoder {
            get: Command::empty(),
            other: Command::empty(),
        }
    }
}

impl Decoder {
    /// The next command of `u`, valid until the next call.
    pub fn next(&mut self, u: &mut Unpacker<'_>) -> Result<&Command, UnpackError> {
        let slot = match u.rest().first() {
            Some(&GET_TAG) => &mut self.get,
            _ => &mut self.other,
        };
        slot.decode_into(u)?;
        Ok(slot)
    }
}

/// What memcached 1.6 does with an item read by an `mg` (or a binary get) whose reply is
/// queued, not yet written: it keeps the item referenced, and an incr, decr or ma of it
/// then makes a new item (unpadded, unfetched) instead of rewriting the value in place
/// (`do_add_delta`). Queued replies are written, and the items let go, at a text get, an
/// `mn`, a binary noop or error, when what one read brought is used up, and when an event
/// has handled its share of requests (memcached's `-R`, 20: the first event after a read
/// handles 21, as its first request does not count). One per connection; it notes the
/// keys of every such read (a miss too: the parser cannot know, so an `mg` miss followed
/// by an `add` and an incr counts as held where memcached pads in place, and a binary
/// get's miss, an error reply that writes the queue in memcached, does not end a hold).
pub struct HeldKeys {
    keys: Vec<Vec<u8>>,
    /// Requests handled in this event, and how many it may handle.
    requests: usize,
    limit: usize,
}

/// memcached's default `-R` (`reqs_per_event`). It also bounds `HeldKeys`.
pub const REQUESTS_PER_EVENT: usize = 20;

impl Default for HeldKeys {
    fn default() -> HeldKeys {
        HeldKeys {
            keys: Vec::new(),
            requests: 0,
            limit: REQUESTS_PER_EVENT + 1,
        }
    }
}

impl HeldKeys {
    /// A request (of any kind) is handled next.
    pub fn next_request(&mut self) {
        if self.requests == self.limit {
            // memcached writes what is queued and yields; its next event begins.
            self.written();
            self.requests = 0;
            self.limit = REQUESTS_PER_EVENT;
        }
        self.requests += 1;
    }

    /// Every queued reply is written.
    pub fn written(&mut self) {
        self.keys.clear();
    }

    /// What the last read brought is used up: memcached writes its queue and waits.
    pub fn read_used_up(&mut self) {
        *self = HeldKeys::default();
    }

    /// Notes `cmd` (handled now): a queued read holds its key, a text get writes every
    /// queued reply. Returns the command to log: an arithmetic one on a held key wrapped.
    pub fn note(&mut self, cmd: Command) -> Command {
        match &cmd {
            Command::Meta { kind: b'g', key, .. }
                if !self.keys.contains(key) && self.keys.len() <= REQUESTS_PER_EVENT =>
            {
                self.keys.push(key.clone());
            }
            // (Only the text protocol makes a Get: a binary get is an mg.)
            Command::Get { .. } => self.written(),
            _ => {}
        }
        match cmd.arith_key() {
            Some(key) if self.keys.iter().any(|k| k == key) => Command::OnHeldItem(Box::new(cmd)),
            _ => cmd,
        }
    }
}

impl Command {
    /// About the bytes [`Command::encode`] writes (at least that many for every command but
    /// a meta command with many flags): a log entry's buffer is reserved once from it
    /// instead of growing a reallocation at a time.
    pub fn encoded_len_hint(&self) -> usize {
        // Tags, numbers and length prefixes of any one command.
        const FIXED: usize = 32;
        FIXED
            + match self {
                Command::Get { keys, .. } => keys.iter().map(|k| k.len() + 4).sum(),
                Command::Store { key, data, .. } => key.len() + data.len(),
                Command::Delete { key }
                | Command::Arith { key, .. }
                | Command::Touch { key, .. }
                | Command::TooLarge { key } => key.len(),
                Command::FlushAll { .. } | Command::MemLimit { .. } => 0,
                Command::Meta { key, flags, data, .. } => {
                    key.len() + data.len() + flags.iter().map(|f| f.len() + 4).sum::<usize>()
                }
                Command::OnHeldItem(inner) => inner.encoded_len_hint(),
            }
    }

    pub fn encode(&self, p: &mut Packer) {
        match self {
            Command::Get { keys, with_cas, touch } => {
                p.u8(GET_TAG);
                p.u8(*with_cas as u8);
                match touch {
                    Some(t) => {
                        p.u8(1);
                        p.u64(*t as u64);
                    }
                    None => p.u8(0),
                }
                p.u32(keys.len() as u32);
                for k in keys {
                    p.bytes(k);
                }
            }
            Command::Store {
                op,
                key,
                flags,
                exptime,
                data,
                cas,
            } => {
                p.u8(STORE_TAG);
                p.u8(*op as u8);
                p.bytes(key);
                p.u32(*flags);
                p.u64(*exptime as u64);
                p.bytes(data);
                p.u64(*cas);
            }
            Command::Delete { key } => {
                p.u8(3);
                p.bytes(key);
            }
            Command::Arith { key, incr, delta } => {
                p.u8(4);
                p.bytes(key);
                p.u8(*incr as u8);
                p.u64(*delta);
            }
            Command::Touch { key, exptime } => {
                p.u8(5);
                p.bytes(key);
                p.u64(*exptime as u64);
            }
            Command::FlushAll { delay } => {
                p.u8(6);
                p.u64(*delay as u64);
            }
            Command::TooLarge { key } => {
                p.u8(7);
                p.bytes(key);
            }
            Command::MemLimit { mb } => {
                p.u8(9);
                p.u32(*mb);
            }
            Command::OnHeldItem(inner) => {
                p.u8(10);
                inner.encode(p);
            }
            Command::Meta { kind, key, flags, data } => {
                p.u8(8);
                p.u8(*kind);
                p.bytes(key);
                p.u32(flags.len() as u32);
                for f in flags {
                    p.bytes(f);
                }
                p.bytes(data);
            }
        }
    }

    /// An empty get: a slot for [`Command::decode_into`].
    pub fn empty() -> Self {
        Command::Get {
            keys: Vec::new(),
            with_cas: false,
            touch: None,
        }
    }

    /// Decodes into `self`. A get decoded over a get reuses its key buffers, a store over a
    /// store its key and value buffers: every replica decodes every request at apply, and
    /// each of those buffers was an allocation each time.
    pub fn decode_into(&mut self, u: &mut Unpacker<'_>) -> Result<(), UnpackError> {
        match (u.rest().first(), &mut *self) {
            (Some(&GET_TAG), Command::Get { keys, with_cas, touch }) => {
                u.u8()?;
                (*with_cas, *touch) = decode_get(u, keys)?;
            }
            (
                Some(&STORE_TAG),
                Command::Store {
                    op,
                    key,
                    flags,
                    exptime,
                    data,
                    cas,
                },
            ) => {
                u.u8()?;
                *op = decode_store_op(u)?;
                refill(key, u.bytes()?);
                *flags = u.u32()?;
                *exptime = u.u64()? as i64;
                refill(data, u.bytes()?);
                *cas = u.u64()?;
            }
            _ => *self = Command::decode(u)?,
        }
        Ok(())
    }

    pub fn decode(u: &mut Unpacker<'_>) -> Result<Self, UnpackError> {
        Ok(match u.u8()? {
            GET_TAG => {
                let mut keys = Vec::new();
                let (with_cas, touch) = decode_get(u, &mut keys)?;
                Command::Get { keys, with_cas, touch }
            }
            STORE_TAG => {
                let op = decode_store_op(u)?;
                Command::Store {
                    op,
                    key: u.bytes()?.to_vec(),
                    flags: u.u32()?,
                    exptime: u.u64()? as i64,
                    data: u.bytes()?.to_vec(),
                    cas: u.u64()?,
                }
            }
            3 => Command::Delete {
                key: u.bytes()?.to_vec(),
            },
            4 => Command::Arith {
                key: u.bytes()?.to_vec(),
                incr: u.u8()? != 0,
                delta: u.u64()?,
            },
            5 => Command::Touch {
                key: u.bytes()?.to_vec(),
                exptime: u.u64()? as i64,
            },
            6 => Command::FlushAll { delay: u.u64()? as i64 },
            7 => Command::TooLarge {
                key: u.bytes()?.to_vec(),
            },
            8 => {
                let kind = u.u8()?;
                let key = u.bytes()?.to_vec();
                let n = u.u32()? as usize;
                if n > u.rest().len() / 4 {
                    return Err(UnpackError("flag count exceeds entry"));
                }
                let mut flags = Vec::with_capacity(n);
                for _ in 0..n {
                    flags.push(u.bytes()?.to_vec());
                }
                Command::Meta {
                    kind,
                    key,
                    flags,
                    data: u.bytes()?.to_vec(),
                }
            }
            9 => Command::MemLimit { mb: u.u32()? },
            10 => {
                // An arithmetic command only (tags 4 and 8), so never nested.
                if !matches!(u.rest().first(), Some(4 | 8)) {
                    return Err(UnpackError("a held-item command that is not arithmetic"));
                }
                let cmd = Command::decode(u)?;
                if cmd.arith_key().is_none() {
                    return Err(UnpackError("a held-item command that is not arithmetic"));
                }
                Command::OnHeldItem(Box::new(cmd))
            }
            _ => return Err(UnpackError("unknown command tag")),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_command_round_trips() {
        let cmds = [
            Command::Get {
                keys: vec![b"a".to_vec(), b"bc".to_vec()],
                with_cas: true,
                touch: Some(-1),
            },
            Command::Store {
                op: StoreOp::Cas,
                key: b"k".to_vec(),
                flags: 7,
                exptime: 3,
                data: b"v\r\n".to_vec(),
                cas: 9,
            },
            Command::Store {
                op: StoreOp::Append,
                key: b"a longer key".to_vec(),
                flags: 0,
                exptime: -1,
                data: Vec::new(),
                cas: 0,
            },
            Command::Delete { key: b"k".to_vec() },
            Command::Arith {
                key: b"n".to_vec(),
                incr: false,
                delta: u64::MAX,
            },
            Command::Touch {
                key: b"k".to_vec(),
                exptime: 100,
            },
            Command::FlushAll { delay: 0 },
            Command::MemLimit { mb: 64 },
            Command::OnHeldItem(Box::new(Command::Arith {
                key: b"n".to_vec(),
                incr: true,
                delta: 2,
            })),
            Command::OnHeldItem(Box::new(Command::Meta {
                kind: b'a',
                key: b"n".to_vec(),
                flags: vec![b"v".to_vec()],
                data: Vec::new(),
            })),
        ];
        // One after another through a decoder, each into the buffers of the one before
        // of its kind, then in reverse order.
        let mut decoder = Decoder::default();
        for c in cmds.iter().chain(cmds.iter().rev()) {
            let mut p = Packer::default();
            c.encode(&mut p);
            let mut u = Unpacker::new(&p.buf);
            assert_eq!(decoder.next(&mut u).unwrap(), c);
            assert!(u.is_empty());
        }
        for c in cmds {
            let mut p = Packer::default();
            c.encode(&mut p);
            let mut u = Unpacker::new(&p.buf);
            assert_eq!(Command::decode(&mut u).unwrap(), c);
            assert!(u.is_empty());
            for cut in 0..p.buf.len() {
                // (any result will do: the test is that it never panics)
                let _ = Command::decode(&mut Unpacker::new(&p.buf[..cut]));
            }
        }
    }
}

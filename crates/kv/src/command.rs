//! A parsed client request in the form that goes into the replicated log. Only what every
//! replica needs to execute it is here; connection matters (noreply, which socket) stay
//! with the replica that received it.

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
}

impl Command {
    pub fn encode(&self, p: &mut Packer) {
        match self {
            Command::Get { keys, with_cas, touch } => {
                p.u8(1);
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
                p.u8(2);
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

    pub fn decode(u: &mut Unpacker<'_>) -> Result<Self, UnpackError> {
        Ok(match u.u8()? {
            1 => {
                let with_cas = u.u8()? != 0;
                let touch = match u.u8()? {
                    0 => None,
                    _ => Some(u.u64()? as i64),
                };
                let n = u.u32()? as usize;
                if n > u.rest().len() / 4 {
                    return Err(UnpackError("key count exceeds entry"));
                }
                let mut keys = Vec::with_capacity(n);
                for _ in 0..n {
                    keys.push(u.bytes()?.to_vec());
                }
                Command::Get { keys, with_cas, touch }
            }
            2 => {
                let op = match u.u8()? {
                    0 => StoreOp::Set,
                    1 => StoreOp::Add,
                    2 => StoreOp::Replace,
                    3 => StoreOp::Append,
                    4 => StoreOp::Prepend,
                    5 => StoreOp::Cas,
                    _ => return Err(UnpackError("unknown store op")),
                };
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
        ];
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

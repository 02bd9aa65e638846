//! The memcached binary protocol, as memcached 1.6.18 speaks it (`proto_bin.c`). A
//! connection whose first byte is 0x80 speaks it for its whole life.
//!
//! A request is mapped onto the meta command with the same semantics (`mg`, `ms`, `md`,
//! `ma`), asking for the CAS and the client flags that a binary response carries; the
//! replica orders, applies and cross-checks it like any text request, and the
//! connection turns the meta reply into the binary response ([`respond`]). Nothing here
//! touches the store, so both protocols share one definition of every operation.
//!
//! Limits: a frame is not buffered before its header is checked; the key and extras are
//! at most 250 and 255 bytes; a value is buffered only if the item would fit
//! (`item_max`), otherwise it is discarded as it arrives.
//!
//! Where we differ from memcached, on purpose:
//! - An unknown opcode's body is discarded exactly. memcached discards `bodylen` bytes
//!   after the key and extras it already read, which eats the start of the next request.
//! - Bytes past the key of a `stat`, `touch` or `gat` request are discarded, not read
//!   as the next request.
//! - An expiration above 2^31 - 1 (an absolute time after January 2038) is taken as
//!   2^31 - 1: meta commands hold times in 32 signed bits, as memcached's do.

use crate::command::Command;
use crate::protocol::{item_size, Request, KEY_MAX};

pub const REQUEST_MAGIC: u8 = 0x80;
const RESPONSE_MAGIC: u8 = 0x81;
const HEADER: usize = 24;

pub(crate) mod op {
    pub const GET: u8 = 0x00;
    pub const SET: u8 = 0x01;
    pub const ADD: u8 = 0x02;
    pub const REPLACE: u8 = 0x03;
    pub const DELETE: u8 = 0x04;
    pub const INCREMENT: u8 = 0x05;
    pub const DECREMENT: u8 = 0x06;
    pub const QUIT: u8 = 0x07;
    pub const FLUSH: u8 = 0x08;
    pub const GETQ: u8 = 0x09;
    pub const NOOP: u8 = 0x0a;
    pub const VERSION: u8 = 0x0b;
    pub const GETK: u8 = 0x0c;
    pub const GETKQ: u8 = 0x0d;
    pub const APPEND: u8 = 0x0e;
    pub const PREPEND: u8 = 0x0f;
    pub const STAT: u8 = 0x10;
    pub const SETQ: u8 = 0x11;
    pub const ADDQ: u8 = 0x12;
    pub const REPLACEQ: u8 = 0x13;
    pub const DELETEQ: u8 = 0x14;
    pub const INCREMENTQ: u8 = 0x15;
    pub const DECREMENTQ: u8 = 0x16;
    pub const QUITQ: u8 = 0x17;
    pub const FLUSHQ: u8 = 0x18;
    pub const APPENDQ: u8 = 0x19;
    pub const PREPENDQ: u8 = 0x1a;
    pub const TOUCH: u8 = 0x1c;
    pub const GAT: u8 = 0x1d;
    pub const GATQ: u8 = 0x1e;
    pub const GATK: u8 = 0x23;
    pub const GATKQ: u8 = 0x24;
}

/// Response status codes.
mod status {
    pub const OK: u16 = 0x0000;
    pub const KEY_ENOENT: u16 = 0x0001;
    pub const KEY_EEXISTS: u16 = 0x0002;
    pub const E2BIG: u16 = 0x0003;
    pub const EINVAL: u16 = 0x0004;
    pub const NOT_STORED: u16 = 0x0005;
    pub const DELTA_BADVAL: u16 = 0x0006;
    pub const UNKNOWN_COMMAND: u16 = 0x0081;
    pub const ENOMEM: u16 = 0x0082;
    /// Not produced by memcached: a replica that cannot vouch for a result (no majority,
    /// outcome unknown) says so with the protocol's "internal error".
    pub const INTERNAL: u16 = 0x0084;
}

/// The opcodes memcached 1.6.18 serves, quiet forms aside.
const SERVED: [u8; 18] = [
    op::GET,
    op::SET,
    op::ADD,
    op::REPLACE,
    op::DELETE,
    op::INCREMENT,
    op::DECREMENT,
    op::QUIT,
    op::FLUSH,
    op::NOOP,
    op::VERSION,
    op::GETK,
    op::APPEND,
    op::PREPEND,
    op::STAT,
    op::TOUCH,
    op::GAT,
    op::GATK,
];

/// The opcode without its quiet bit, and whether it was quiet (memcached's mapping in
/// `dispatch_bin_command`).
fn unquiet(opcode: u8) -> (u8, bool) {
    let loud = match opcode {
        op::SETQ => op::SET,
        op::ADDQ => op::ADD,
        op::REPLACEQ => op::REPLACE,
        op::DELETEQ => op::DELETE,
        op::INCREMENTQ => op::INCREMENT,
        op::DECREMENTQ => op::DECREMENT,
        op::QUITQ => op::QUIT,
        op::FLUSHQ => op::FLUSH,
        op::APPENDQ => op::APPEND,
        op::PREPENDQ => op::PREPEND,
        op::GETQ => op::GET,
        op::GETKQ => op::GETK,
        op::GATQ => op::GAT,
        op::GATKQ => op::GATK,
        other => return (other, false),
    };
    (loud, true)
}

/// What a response is made of, besides the reply: kept by the connection while the
/// request is ordered and applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pending {
    /// As the client sent it (quiet variants included): the response echoes it.
    opcode: u8,
    opaque: [u8; 4],
    quiet: bool,
    shape: Shape,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Shape {
    /// get, getk, gat, gatk, touch: `key` is returned (getk, gatk) or None.
    Get {
        key: Option<Vec<u8>>,
        value: bool,
    },
    /// set, add, replace, append, prepend; `loud` is the opcode without the quiet bit,
    /// and `cas` whether the request carried one (then it is a compare-and-swap).
    Store {
        loud: u8,
        cas: bool,
    },
    Delete,
    Arith,
    Flush,
    Stat,
}

#[derive(Debug, PartialEq, Eq)]
pub enum Frame {
    /// More bytes are needed.
    Incomplete,
    /// A request for the replica, `consumed` bytes long, then `swallow` bytes to discard
    /// as they arrive; its reply becomes a response through [`respond`].
    Request {
        req: Request,
        pending: Pending,
        consumed: usize,
        swallow: usize,
    },
    /// Answered by the connection: send `reply` (nothing if empty), drop `consumed`
    /// bytes and `swallow` more; `close` ends the connection after the reply.
    Answer {
        reply: Vec<u8>,
        consumed: usize,
        swallow: usize,
        close: bool,
    },
}

struct Header {
    opcode: u8,
    keylen: usize,
    extlen: usize,
    bodylen: usize,
    opaque: [u8; 4],
    cas: u64,
}

impl Header {
    fn read(b: &[u8]) -> Header {
        Header {
            opcode: b[1],
            keylen: u16::from_be_bytes([b[2], b[3]]) as usize,
            extlen: b[4] as usize,
            bodylen: u32::from_be_bytes([b[8], b[9], b[10], b[11]]) as usize,
            opaque: [b[12], b[13], b[14], b[15]],
            cas: u64::from_be_bytes(b[16..24].try_into().unwrap()),
        }
    }
}

/// One response frame.
fn frame(opcode: u8, status: u16, opaque: [u8; 4], cas: u64, extras: &[u8], key: &[u8], value: &[u8]) -> Vec<u8> {
    let body = extras.len() + key.len() + value.len();
    let mut r = Vec::with_capacity(HEADER + body);
    r.extend_from_slice(&[RESPONSE_MAGIC, opcode]);
    r.extend_from_slice(&(key.len() as u16).to_be_bytes());
    r.extend_from_slice(&[extras.len() as u8, 0]);
    r.extend_from_slice(&status.to_be_bytes());
    r.extend_from_slice(&(body as u32).to_be_bytes());
    r.extend_from_slice(&opaque);
    r.extend_from_slice(&cas.to_be_bytes());
    r.extend_from_slice(extras);
    r.extend_from_slice(key);
    r.extend_from_slice(value);
    r
}

/// An error response, with memcached's text for the status unless `message` says more.
fn error(opcode: u8, opaque: [u8; 4], code: u16, message: Option<&[u8]>) -> Vec<u8> {
    let text: &[u8] = match (message, code) {
        (Some(m), _) => m,
        (None, status::KEY_ENOENT) => b"Not found",
        (None, status::KEY_EEXISTS) => b"Data exists for key.",
        (None, status::E2BIG) => b"Too large.",
        (None, status::EINVAL) => b"Invalid arguments",
        (None, status::NOT_STORED) => b"Not stored.",
        (None, status::DELTA_BADVAL) => b"Non-numeric server-side value for incr or decr",
        (None, status::UNKNOWN_COMMAND) => b"Unknown command",
        (None, status::ENOMEM) => b"Out of memory",
        (None, _) => b"Internal error",
    };
    frame(opcode, code, opaque, 0, &[], &[], text)
}

fn answer(reply: Vec<u8>, consumed: usize, swallow: usize, close: bool) -> Frame {
    Frame::Answer {
        reply,
        consumed,
        swallow,
        close,
    }
}

fn be_u32(b: &[u8]) -> u32 {
    u32::from_be_bytes(b[..4].try_into().unwrap())
}

fn be_u64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().unwrap())
}

/// An expiration as a meta `T`/`N` token (see the module notes on times past 2038).
fn ttl_token(letter: u8, exptime: u32) -> Vec<u8> {
    let mut t = vec![letter];
    t.extend_from_slice(exptime.min(i32::MAX as u32).to_string().as_bytes());
    t
}

fn token(letter: u8, value: impl std::fmt::Display) -> Vec<u8> {
    let mut t = vec![letter];
    t.extend_from_slice(value.to_string().as_bytes());
    t
}

/// Parse one binary request at the front of `buf`.
pub fn parse(buf: &[u8], item_max: usize, version: &str) -> Frame {
    if buf.len() < HEADER {
        return Frame::Incomplete;
    }
    if buf[0] != REQUEST_MAGIC {
        // memcached closes without a word.
        return answer(Vec::new(), buf.len(), 0, true);
    }
    let h = Header::read(buf);
    let fail = |code: u16| answer(error(h.opcode, h.opaque, code, None), HEADER, 0, true);
    if h.keylen > h.bodylen || h.keylen + h.extlen > h.bodylen {
        return fail(status::UNKNOWN_COMMAND);
    }
    if h.keylen > KEY_MAX {
        return fail(status::EINVAL);
    }
    let head = HEADER + h.extlen + h.keylen;
    if buf.len() < head {
        return Frame::Incomplete;
    }
    let extras = &buf[HEADER..HEADER + h.extlen];
    let key = &buf[HEADER + h.extlen..head];
    let vlen = h.bodylen - h.extlen - h.keylen;
    let (loud, quiet) = unquiet(h.opcode);
    let pending = |shape: Shape| Pending {
        opcode: h.opcode,
        opaque: h.opaque,
        quiet,
        shape,
    };
    let request = |cmd: Command, shape: Shape, consumed: usize, swallow: usize| Frame::Request {
        req: Request::Data { cmd, noreply: false },
        pending: pending(shape),
        consumed,
        swallow,
    };
    let meta = |kind: u8, flags: Vec<Vec<u8>>, data: Vec<u8>| Command::Meta {
        kind,
        key: key.to_vec(),
        flags,
        data,
    };
    let (e, k, b) = (h.extlen, h.keylen, h.bodylen);
    match loud {
        op::VERSION | op::NOOP | op::QUIT if e == 0 && k == 0 && b == 0 => {
            let value = match loud {
                op::VERSION => version.as_bytes(),
                _ => &[][..],
            };
            let reply = match (loud, quiet) {
                (op::QUIT, true) => Vec::new(),
                _ => frame(h.opcode, status::OK, h.opaque, 0, &[], &[], value),
            };
            answer(reply, head, 0, loud == op::QUIT)
        }
        op::FLUSH if k == 0 && b == e && (e == 0 || e == 4) => {
            let delay = if e == 4 { be_u32(extras) as i64 } else { 0 };
            request(Command::FlushAll { delay }, Shape::Flush, head, 0)
        }
        op::SET | op::ADD | op::REPLACE if e == 8 && k != 0 && b >= k + 8 => {
            let flags = be_u32(extras);
            let exptime = be_u32(&extras[4..]);
            if item_size(k, flags, vlen) > item_max {
                // As memcached: a set that does not fit removes the old value.
                return match loud {
                    op::SET => request(
                        Command::TooLarge { key: key.to_vec() },
                        Shape::Store { loud, cas: false },
                        head,
                        vlen,
                    ),
                    _ => answer(error(h.opcode, h.opaque, status::E2BIG, None), head, vlen, false),
                };
            }
            if buf.len() < head + vlen {
                return Frame::Incomplete;
            }
            // Any CAS makes it a compare-and-swap, whatever the opcode (memcached's
            // NREAD_CAS).
            let mode: &[u8] = match (loud, h.cas) {
                (_, 1..) | (op::SET, 0) => b"MS",
                (op::ADD, _) => b"ME",
                _ => b"MR",
            };
            let mut f = vec![
                token(b'F', flags),
                ttl_token(b'T', exptime),
                b"c".to_vec(),
                mode.to_vec(),
            ];
            if h.cas != 0 {
                f.push(token(b'C', h.cas));
            }
            let cmd = meta(b's', f, buf[head..head + vlen].to_vec());
            request(cmd, Shape::Store { loud, cas: h.cas != 0 }, head + vlen, 0)
        }
        op::APPEND | op::PREPEND if k > 0 && e == 0 => {
            if item_size(k, 0, vlen) > item_max {
                return answer(error(h.opcode, h.opaque, status::E2BIG, None), head, vlen, false);
            }
            if buf.len() < head + vlen {
                return Frame::Incomplete;
            }
            let mode: &[u8] = if loud == op::APPEND { b"MA" } else { b"MP" };
            let mut f = vec![b"c".to_vec(), mode.to_vec()];
            if h.cas != 0 {
                f.push(token(b'C', h.cas));
            }
            let cmd = meta(b's', f, buf[head..head + vlen].to_vec());
            request(cmd, Shape::Store { loud, cas: h.cas != 0 }, head + vlen, 0)
        }
        op::GET | op::GETK if e == 0 && b == k && k > 0 => {
            let shape = Shape::Get {
                key: (loud == op::GETK).then(|| key.to_vec()),
                value: true,
            };
            let flags = [&b"v"[..], b"f", b"c"].map(|f| f.to_vec()).to_vec();
            request(meta(b'g', flags, Vec::new()), shape, head, 0)
        }
        op::TOUCH | op::GAT | op::GATK if e == 4 && k != 0 => {
            let value = loud != op::TOUCH;
            let shape = Shape::Get {
                key: (loud == op::GATK).then(|| key.to_vec()),
                value,
            };
            let mut flags = vec![ttl_token(b'T', be_u32(extras)), b"f".to_vec(), b"c".to_vec()];
            if value {
                flags.push(b"v".to_vec());
            }
            request(meta(b'g', flags, Vec::new()), shape, head, vlen)
        }
        op::DELETE if k > 0 && e == 0 && b == k => {
            let flags = if h.cas != 0 {
                vec![token(b'C', h.cas)]
            } else {
                Vec::new()
            };
            request(meta(b'd', flags, Vec::new()), Shape::Delete, head, 0)
        }
        op::INCREMENT | op::DECREMENT if k > 0 && e == 20 && b == k + e => {
            let (delta, initial, exptime) = (be_u64(extras), be_u64(&extras[8..]), be_u32(&extras[16..]));
            let mode: &[u8] = if loud == op::INCREMENT { b"MI" } else { b"MD" };
            let mut flags = vec![token(b'D', delta), mode.to_vec(), b"v".to_vec(), b"c".to_vec()];
            // 0xffffffff: fail on a missing key; anything else creates it.
            if exptime != u32::MAX {
                flags.push(ttl_token(b'N', exptime));
                flags.push(token(b'J', initial));
            }
            if h.cas != 0 {
                flags.push(token(b'C', h.cas));
            }
            request(meta(b'a', flags, Vec::new()), Shape::Arith, head, 0)
        }
        op::STAT if e == 0 => {
            let args = String::from_utf8_lossy(key)
                .split_whitespace()
                .map(str::to_owned)
                .collect();
            Frame::Request {
                req: Request::Stats { args },
                pending: pending(Shape::Stat),
                consumed: head,
                swallow: vlen,
            }
        }
        // A command memcached serves, with lengths it refuses.
        _ if SERVED.contains(&loud) => fail(status::EINVAL),
        _ => answer(
            error(h.opcode, h.opaque, status::UNKNOWN_COMMAND, None),
            head,
            vlen,
            false,
        ),
    }
}

/// The first line of a meta reply and what follows it.
fn split_line(reply: &[u8]) -> (&[u8], &[u8]) {
    match reply.windows(2).position(|w| w == b"\r\n") {
        Some(i) => (&reply[..i], &reply[i + 2..]),
        None => (reply, &[]),
    }
}

/// The value of a returned meta flag (`c123` → 123).
fn returned(line: &[u8], letter: u8) -> u64 {
    line.split(|&b| b == b' ')
        .skip(1)
        .find(|t| t.first() == Some(&letter))
        .and_then(|t| std::str::from_utf8(&t[1..]).ok()?.parse().ok())
        .unwrap_or(0)
}

/// The value block of a `VA <len> ...` reply.
fn value_of<'a>(line: &[u8], rest: &'a [u8]) -> &'a [u8] {
    let len = line
        .split(|&b| b == b' ')
        .nth(1)
        .and_then(|t| std::str::from_utf8(t).ok()?.parse::<usize>().ok())
        .unwrap_or(0);
    &rest[..len.min(rest.len())]
}

/// The binary response to a request, from the replica's reply to the meta command it
/// became (or the text `stats` reply). Empty: a quiet request that has nothing to say.
pub fn respond(p: &Pending, reply: &[u8]) -> Vec<u8> {
    let (line, rest) = split_line(reply);
    let code = line.split(|&b| b == b' ').next().unwrap_or(b"");
    let err = |status: u16| error(p.opcode, p.opaque, status, None);
    // A reply this request cannot have: passed on as an internal error.
    let unexpected = || error(p.opcode, p.opaque, status::INTERNAL, Some(line));
    // What the replica may answer to any request: it cannot vouch for the result.
    if let Some(m) = line.strip_prefix(b"SERVER_ERROR ") {
        return match m {
            b"object too large for cache" => err(status::E2BIG),
            _ if m.starts_with(b"out of memory") => err(status::ENOMEM),
            _ => error(p.opcode, p.opaque, status::INTERNAL, Some(m)),
        };
    }
    let ok = |cas: u64, extras: &[u8], key: &[u8], value: &[u8]| match p.quiet {
        true => Vec::new(),
        false => frame(p.opcode, status::OK, p.opaque, cas, extras, key, value),
    };
    match &p.shape {
        Shape::Get { key, value } => match code {
            b"VA" | b"HD" => {
                let flags = (returned(line, b'f') as u32).to_be_bytes();
                let data = if *value { value_of(line, rest) } else { &[][..] };
                // A hit is answered even when quiet.
                let key = key.as_deref().unwrap_or(&[]);
                frame(p.opcode, status::OK, p.opaque, returned(line, b'c'), &flags, key, data)
            }
            b"EN" if p.quiet => Vec::new(),
            // getk and gatk return the key with a miss, and no message.
            b"EN" => match key {
                Some(k) => frame(p.opcode, status::KEY_ENOENT, p.opaque, 0, &[], k, &[]),
                None => err(status::KEY_ENOENT),
            },
            _ => unexpected(),
        },
        Shape::Store { loud, cas } => match code {
            b"HD" => ok(returned(line, b'c'), &[], &[], &[]),
            b"EX" => err(status::KEY_EEXISTS),
            b"NF" => err(status::KEY_ENOENT),
            // (A compare-and-swap of a missing key is NF; an append's is NS.)
            b"NS" => err(match (*loud, *cas) {
                (op::ADD, false) => status::KEY_EEXISTS,
                (op::REPLACE, false) => status::KEY_ENOENT,
                _ => status::NOT_STORED,
            }),
            _ => unexpected(),
        },
        Shape::Delete => match code {
            b"HD" => ok(0, &[], &[], &[]),
            b"NF" => err(status::KEY_ENOENT),
            b"EX" => err(status::KEY_EEXISTS),
            _ => unexpected(),
        },
        Shape::Arith => match code {
            b"VA" => {
                let n = std::str::from_utf8(value_of(line, rest))
                    .ok()
                    .and_then(|s| s.parse::<u64>().ok())
                    .unwrap_or(0);
                ok(returned(line, b'c'), &[], &[], &n.to_be_bytes())
            }
            b"NF" => err(status::KEY_ENOENT),
            b"EX" => err(status::KEY_EEXISTS),
            b"NS" => err(status::NOT_STORED),
            b"CLIENT_ERROR" => err(status::DELTA_BADVAL),
            _ => unexpected(),
        },
        Shape::Flush => match code {
            b"OK" => ok(0, &[], &[], &[]),
            _ => unexpected(),
        },
        Shape::Stat => stat_frames(p, reply),
    }
}

/// `STAT name value` lines become one response each, then an empty one ends the list.
fn stat_frames(p: &Pending, reply: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut rest = reply;
    while !rest.is_empty() {
        let (line, next) = split_line(rest);
        rest = next;
        if let Some(stat) = line.strip_prefix(b"STAT ") {
            let cut = stat.iter().position(|&b| b == b' ').unwrap_or(stat.len());
            let value = stat.get(cut + 1..).unwrap_or(&[]);
            out.extend(frame(p.opcode, status::OK, p.opaque, 0, &[], &stat[..cut], value));
        } else if line == b"END" || line == b"RESET" {
            break;
        } else {
            // An unknown group.
            return error(p.opcode, p.opaque, status::KEY_ENOENT, None);
        }
    }
    out.extend(frame(p.opcode, status::OK, p.opaque, 0, &[], &[], &[]));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(opcode: u8, key: &[u8], extras: &[u8], value: &[u8], cas: u64) -> Vec<u8> {
        let mut r = vec![REQUEST_MAGIC, opcode];
        r.extend_from_slice(&(key.len() as u16).to_be_bytes());
        r.extend_from_slice(&[extras.len() as u8, 0, 0, 0]);
        r.extend_from_slice(&((extras.len() + key.len() + value.len()) as u32).to_be_bytes());
        r.extend_from_slice(&[1, 2, 3, 4]);
        r.extend_from_slice(&cas.to_be_bytes());
        r.extend_from_slice(extras);
        r.extend_from_slice(key);
        r.extend_from_slice(value);
        r
    }

    fn status_of(r: &[u8]) -> u16 {
        u16::from_be_bytes([r[6], r[7]])
    }

    #[test]
    fn a_set_becomes_an_ms_that_returns_the_cas() {
        let mut extras = 7u32.to_be_bytes().to_vec();
        extras.extend_from_slice(&100u32.to_be_bytes());
        let r = req(op::SETQ, b"k", &extras, b"hello", 0);
        let Frame::Request {
            req, pending, consumed, ..
        } = parse(&r, 1 << 20, "v")
        else {
            panic!()
        };
        assert_eq!(consumed, r.len());
        let Request::Data {
            cmd: Command::Meta { kind, key, flags, data },
            ..
        } = req
        else {
            panic!()
        };
        assert_eq!((kind, &key[..], &data[..]), (b's', &b"k"[..], &b"hello"[..]));
        assert_eq!(
            flags,
            vec![b"F7".to_vec(), b"T100".to_vec(), b"c".to_vec(), b"MS".to_vec()]
        );
        // Quiet: success says nothing, a failure is still answered.
        assert!(respond(&pending, b"HD c9\r\n").is_empty());
        assert_eq!(status_of(&respond(&pending, b"NS c0\r\n")), status::NOT_STORED);
    }

    #[test]
    fn every_prefix_of_a_request_is_incomplete() {
        let r = req(op::SET, b"key", &[0; 8], b"value", 0);
        for n in 0..r.len() {
            assert_eq!(parse(&r[..n], 1 << 20, "v"), Frame::Incomplete, "{n}");
        }
    }

    #[test]
    fn bad_frames_get_memcacheds_errors() {
        // A key longer than 250 bytes: invalid arguments, then close.
        let r = req(op::GET, &[b'k'; 251], &[], &[], 0);
        let Frame::Answer { reply, close, .. } = parse(&r, 1 << 20, "v") else {
            panic!()
        };
        assert!(close);
        assert_eq!(status_of(&reply), status::EINVAL);
        // Lengths that do not add up: unknown command, then close.
        let mut r = req(op::GET, b"k", &[], &[], 0);
        r[11] = 0;
        let Frame::Answer { reply, close, .. } = parse(&r, 1 << 20, "v") else {
            panic!()
        };
        assert!(close);
        assert_eq!(status_of(&reply), status::UNKNOWN_COMMAND);
        // An unknown opcode: its body is discarded and the connection stays.
        let r = req(0x1b, &[], &[0; 4], &[], 0);
        let Frame::Answer {
            reply,
            close,
            consumed,
            swallow,
        } = parse(&r, 1 << 20, "v")
        else {
            panic!()
        };
        assert!(!close);
        assert_eq!(consumed + swallow, r.len());
        assert_eq!(status_of(&reply), status::UNKNOWN_COMMAND);
        // A value too large is never buffered.
        let mut r = req(op::ADD, b"k", &[0; 8], &[], 0);
        r[8..12].copy_from_slice(&(9 + (2u32 << 20)).to_be_bytes());
        let Frame::Answer { reply, swallow, .. } = parse(&r, 1 << 20, "v") else {
            panic!()
        };
        assert_eq!(swallow, 2 << 20);
        assert_eq!(status_of(&reply), status::E2BIG);
    }

    /// Random frames (random opcodes, lengths and bytes, cut anywhere): the parser never
    /// panics, never consumes more than it was given unless it swallows, and a response
    /// to any reply never panics either.
    #[test]
    fn random_frames_never_panic() {
        let mut rng = lockstep_core::rng::Rng::new(0x9E37_79B9_7F4A_7C15);
        let mut next = || rng.next_u64();
        for _ in 0..20_000 {
            let key = vec![b'k'; (next() % 300) as usize];
            let extras = vec![0xAB; (next() % 24) as usize];
            let value = vec![b'v'; (next() % 64) as usize];
            let mut r = req((next() % 0x40) as u8, &key, &extras, &value, next() % 3);
            if next() % 4 == 0 {
                let at = 4 + (next() % 8) as usize;
                r[at] = next() as u8;
            }
            r.truncate((next() as usize) % (r.len() + 1));
            match parse(&r, 1024, "v") {
                Frame::Incomplete => {}
                Frame::Answer { consumed, .. } => assert!(consumed <= r.len()),
                Frame::Request { pending, consumed, .. } => {
                    assert!(consumed <= r.len());
                    for reply in [
                        &b"VA 3 f1 c2\r\nabc\r\n"[..],
                        b"EN\r\n",
                        b"VA 9\r\n",
                        b"STAT a\r\n",
                        b"",
                        b"HD c",
                    ] {
                        // (any result will do: the test is that it never panics)
                        let _ = respond(&pending, reply);
                    }
                }
            }
        }
    }

    #[test]
    fn replies_map_onto_statuses() {
        let get = Pending {
            opcode: op::GETK,
            opaque: [0; 4],
            quiet: false,
            shape: Shape::Get {
                key: Some(b"k".to_vec()),
                value: true,
            },
        };
        let hit = respond(&get, b"VA 2 f5 c7\r\nhi\r\n");
        assert_eq!(status_of(&hit), status::OK);
        assert_eq!(&hit[16..24], &7u64.to_be_bytes());
        assert_eq!(&hit[24..], &[0, 0, 0, 5, b'k', b'h', b'i']);
        let miss = respond(&get, b"EN\r\n");
        assert_eq!((status_of(&miss), &miss[24..]), (status::KEY_ENOENT, &b"k"[..]));
        let arith = Pending {
            opcode: op::INCREMENT,
            opaque: [0; 4],
            quiet: false,
            shape: Shape::Arith,
        };
        let r = respond(&arith, b"VA 2 c3\r\n15\r\n");
        assert_eq!(&r[24..], &15u64.to_be_bytes());
        let r = respond(
            &arith,
            b"CLIENT_ERROR cannot increment or decrement non-numeric value\r\n",
        );
        assert_eq!(status_of(&r), status::DELTA_BADVAL);
        let r = respond(&arith, b"SERVER_ERROR the replicas did not confirm the outcome\r\n");
        assert_eq!(status_of(&r), status::INTERNAL);
    }
}

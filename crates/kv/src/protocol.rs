//! The memcached text protocol: parsing client bytes into requests. The parser never
//! panics and never trusts a length: every malformed line gets memcached's error reply,
//! and an over-long line or an absurd value length closes the connection.

use crate::buffers::Buffers;
use crate::command::{Command, StoreOp};

/// memcached's key limit.
pub const KEY_MAX: usize = 250;
/// The longest command line accepted (a multi-get of many keys).
pub const LINE_MAX: usize = 64 * 1024;
/// The longest line of any other command, as in memcached.
const SHORT_LINE_MAX: usize = 2048;

/// What a connection does with one parsed request.
#[derive(Debug, PartialEq, Eq)]
pub enum Request {
    /// Goes through the replicated log.
    Data {
        cmd: Command,
        noreply: bool,
    },
    Version,
    Verbosity {
        noreply: bool,
    },
    Stats {
        args: Vec<String>,
    },
    /// `mn`: answered "MN" in order with the replies before it.
    MetaNoop,
    /// lockstep's own commands (`lockstep_digest`, `lockstep_corrupt ...`) and memcached's
    /// `lru_crawler`, answered by the replica that received them and never ordered.
    Local {
        line: String,
    },
    Quit,
}

#[derive(Debug, PartialEq, Eq)]
pub enum Parsed {
    /// More bytes are needed.
    Incomplete,
    /// A request, `consumed` bytes long; the `swallow` bytes after it are to be discarded
    /// as they arrive (the data block of a value too large to keep).
    Request {
        req: Request,
        consumed: usize,
        swallow: usize,
    },
    /// Reply `reply` (nothing if empty) and drop `consumed` bytes, then `swallow` more as
    /// they arrive; `close` ends the connection.
    Error {
        reply: String,
        consumed: usize,
        swallow: usize,
        close: bool,
    },
}

fn err(reply: &str, consumed: usize) -> Parsed {
    Parsed::Error {
        reply: format!("{reply}\r\n"),
        consumed,
        swallow: 0,
        close: false,
    }
}

const BAD_FORMAT: &str = "CLIENT_ERROR bad command line format";
const BAD_TOKEN: &str = "CLIENT_ERROR bad token in command line format";
const TOO_LARGE: &str = "SERVER_ERROR object too large for cache";

/// What memcached adds to a value to make an item (64-bit build, CAS on): the item header
/// (48 bytes), the CAS (8), the key's terminating NUL, the value's "\r\n", and 4 bytes of
/// flags when they are not zero. An item larger than `item_max` (memcached's `-I`) is
/// refused, so with the default 1 MiB the largest value under a 1-byte key is 1,048,516.
pub fn item_size(key_len: usize, flags: u32, value_len: usize) -> usize {
    48 + 8 + key_len + 1 + if flags == 0 { 0 } else { 4 } + value_len + 2
}

/// Tokens of a request line kept on the stack; a line with more (a multi-get of many
/// keys) spills into a vector. memcached's own limit for a non-get command is 24.
const TOKENS_INLINE: usize = 24;

/// Parse one request from the front of `buf`. `item_max` is the largest item accepted.
pub fn parse(buf: &[u8], item_max: usize) -> Parsed {
    parse_with(buf, item_max, &mut Buffers::default())
}

/// [`parse`], a get's or a store's key and value written into `buffers`' spare buffers
/// (the event loop's, which requests that are done with give back).
pub fn parse_with(buf: &[u8], item_max: usize, buffers: &mut Buffers) -> Parsed {
    let nl = buf.iter().position(|&b| b == b'\n');
    // memcached: more than 2 KiB of a line can only be a long multi-get; anything else
    // closes the connection, without a reply. (Checked whether or not the newline has
    // arrived yet, so that how the bytes were cut into reads changes nothing.)
    let line_so_far = nl.unwrap_or(buf.len());
    if line_so_far > SHORT_LINE_MAX {
        let spaces = buf.iter().take_while(|&&b| b == b' ').count();
        let rest = &buf[spaces..];
        if spaces > 100 || !(rest.starts_with(b"get ") || rest.starts_with(b"gets ")) {
            return Parsed::Error {
                reply: String::new(),
                consumed: buf.len(),
                swallow: 0,
                close: true,
            };
        }
    }
    let Some(nl) = nl else {
        if buf.len() > LINE_MAX {
            return Parsed::Error {
                reply: "CLIENT_ERROR line too long\r\n".into(),
                consumed: buf.len(),
                swallow: 0,
                close: true,
            };
        }
        return Parsed::Incomplete;
    };
    let line_len = nl + 1;
    let line = &buf[..nl];
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    // memcached reads the line as a C string: a NUL byte ends it.
    let line = &line[..line.iter().position(|&b| b == 0).unwrap_or(line.len())];
    // The tokens: on the stack for every command but a long multi-get (a parse is on
    // every request's path).
    let mut inline: [&[u8]; TOKENS_INLINE] = [&[]; TOKENS_INLINE];
    let mut spilled: Vec<&[u8]> = Vec::new();
    let mut count = 0;
    for t in line.split(|&b| b == b' ').filter(|t| !t.is_empty()) {
        if count < TOKENS_INLINE {
            inline[count] = t;
        } else {
            if spilled.is_empty() {
                spilled.extend_from_slice(&inline);
            }
            spilled.push(t);
        }
        count += 1;
    }
    let tokens: &[&[u8]] = match count <= TOKENS_INLINE {
        true => &inline[..count],
        false => &spilled,
    };
    let Some(&name) = tokens.first() else {
        return err("ERROR", line_len);
    };
    let args = &tokens[1..];
    let noreply = args.last() == Some(&&b"noreply"[..]);
    // Commands that honour noreply also stay silent about their errors (memcached's
    // set_noreply_maybe comes before its checks); unknown commands do not.
    let fail = |reply: &str, consumed: usize| {
        if noreply {
            Parsed::Error {
                reply: String::new(),
                consumed,
                swallow: 0,
                close: false,
            }
        } else {
            err(reply, consumed)
        }
    };
    match name {
        b"get" | b"gets" | b"gat" | b"gats" => {
            let touch = name.starts_with(b"gat");
            let (exptime, keys) = if touch {
                match args.split_first() {
                    Some((e, k)) => match c_long(e) {
                        Some(e) => (Some(e as i32 as i64), k),
                        None => return err("CLIENT_ERROR invalid exptime argument", line_len),
                    },
                    None => return err("ERROR", line_len),
                }
            } else {
                (None, args)
            };
            if keys.is_empty() {
                return err("ERROR", line_len);
            }
            if keys.iter().any(|k| k.len() > KEY_MAX) {
                return err(BAD_FORMAT, line_len);
            }
            let cmd = Command::Get {
                keys: buffers.key_list(keys),
                with_cas: name.ends_with(b"s"),
                touch: exptime,
            };
            data(cmd, false, line_len)
        }
        b"set" | b"add" | b"replace" | b"append" | b"prepend" | b"cas" => {
            let op = match name {
                b"set" => StoreOp::Set,
                b"add" => StoreOp::Add,
                b"replace" => StoreOp::Replace,
                b"append" => StoreOp::Append,
                b"prepend" => StoreOp::Prepend,
                _ => StoreOp::Cas,
            };
            let want = if op == StoreOp::Cas { 5 } else { 4 };
            if args.len() != want && !(args.len() == want + 1 && noreply) {
                return err("ERROR", line_len);
            }
            let key = args[0];
            if key.len() > KEY_MAX {
                return fail(BAD_FORMAT, line_len);
            }
            // memcached's safe_strtoul/strtol, then a cut to 32 bits: flags 2^32 are 0, a
            // length of 2^32 is 0.
            let (Some(flags), Some(exptime), Some(len)) = (c_ulong(args[1]), c_long(args[2]), c_long(args[3])) else {
                return fail(BAD_FORMAT, line_len);
            };
            let (flags, exptime, len) = (flags as u32, exptime as i32 as i64, len as i32);
            let cas = if op == StoreOp::Cas {
                match c_ulong(args[4]) {
                    Some(c) => c,
                    None => return fail(BAD_FORMAT, line_len),
                }
            } else {
                0
            };
            if !(0..=i32::MAX - 2).contains(&len) {
                return fail(BAD_FORMAT, line_len);
            }
            let len = len as usize;
            let total = line_len + len + 2;
            if item_size(key.len(), flags, len) > item_max {
                // The data block is swallowed as it arrives, never buffered. A failed set
                // also removes the key's old value (through the log, like any change).
                if op == StoreOp::Set {
                    return Parsed::Request {
                        req: Request::Data {
                            cmd: Command::TooLarge { key: key.to_vec() },
                            noreply,
                        },
                        consumed: line_len,
                        swallow: len + 2,
                    };
                }
                return match fail(TOO_LARGE, line_len) {
                    Parsed::Error { reply, consumed, .. } => Parsed::Error {
                        reply,
                        consumed,
                        swallow: len + 2,
                        close: false,
                    },
                    other => other,
                };
            }
            let value = match data_block(buf, line_len, len) {
                Block::Here(value) => value,
                Block::Incomplete => return Parsed::Incomplete,
                Block::Bad => return fail("CLIENT_ERROR bad data chunk", total),
            };
            let cmd = Command::Store {
                op,
                key: buffers.copy(key),
                flags,
                exptime,
                data: buffers.copy(value),
                cas,
            };
            data(cmd, noreply, total)
        }
        b"delete" => {
            // "delete <key> [0] [noreply]": memcached still accepts a zero hold time.
            let rest = if noreply { &args[..args.len() - 1] } else { args };
            match rest {
                [key] | [key, b"0"] if key.len() <= KEY_MAX => {
                    data(Command::Delete { key: key.to_vec() }, noreply, line_len)
                }
                [_, _] => fail(
                    "CLIENT_ERROR bad command line format.  Usage: delete <key> [noreply]",
                    line_len,
                ),
                _ => err("ERROR", line_len),
            }
        }
        b"incr" | b"decr" => {
            let rest = if noreply { &args[..args.len() - 1] } else { args };
            match rest {
                [key, delta] if key.len() <= KEY_MAX => match c_ulong(delta) {
                    Some(delta) => data(
                        Command::Arith {
                            key: key.to_vec(),
                            incr: name == b"incr",
                            delta,
                        },
                        noreply,
                        line_len,
                    ),
                    None => fail("CLIENT_ERROR invalid numeric delta argument", line_len),
                },
                [key, _] if key.len() > KEY_MAX => fail(BAD_FORMAT, line_len),
                _ => err("ERROR", line_len),
            }
        }
        b"touch" => {
            let rest = if noreply { &args[..args.len() - 1] } else { args };
            match rest {
                [key, exptime] if key.len() <= KEY_MAX => match c_long(exptime) {
                    Some(exptime) => data(
                        Command::Touch {
                            key: key.to_vec(),
                            exptime: exptime as i32 as i64,
                        },
                        noreply,
                        line_len,
                    ),
                    None => fail("CLIENT_ERROR invalid exptime argument", line_len),
                },
                [key, _] if key.len() > KEY_MAX => fail(BAD_FORMAT, line_len),
                _ => err("ERROR", line_len),
            }
        }
        b"flush_all" => {
            let rest = if noreply { &args[..args.len() - 1] } else { args };
            match rest {
                [] => data(Command::FlushAll { delay: 0 }, noreply, line_len),
                [d] => match c_long(d) {
                    Some(delay) => data(
                        Command::FlushAll {
                            delay: delay as i32 as i64,
                        },
                        noreply,
                        line_len,
                    ),
                    None => fail(BAD_FORMAT, line_len),
                },
                _ => err("ERROR", line_len),
            }
        }
        // memcached: 1 or 2 arguments (the second is "noreply" or ignored); the limit is in
        // MiB, parsed as its 32-bit strtoul does (no sign, truncated to 32 bits).
        b"cache_memlimit" => match args {
            [mb] | [mb, _] => match std::str::from_utf8(mb).ok().and_then(|s| s.parse::<u64>().ok()) {
                None => fail("ERROR", line_len),
                Some(mb) => match mb as u32 {
                    mb if mb < 8 => fail("MEMLIMIT_TOO_SMALL cannot set maxbytes to less than 8m", line_len),
                    mb if mb > 1_000_000_000 => {
                        fail("MEMLIMIT_ADJUST_FAILED input value is megabytes not bytes", line_len)
                    }
                    mb => data(Command::MemLimit { mb }, noreply, line_len),
                },
            },
            _ => err("ERROR", line_len),
        },
        b"version" => req(Request::Version, line_len),
        // memcached: "verbosity noreply" sets nothing and says nothing.
        b"verbosity" => match args {
            [_] | [_, _] => req(Request::Verbosity { noreply }, line_len),
            _ => err("ERROR", line_len),
        },
        b"stats" => req(
            Request::Stats {
                args: args.iter().map(|a| String::from_utf8_lossy(a).into_owned()).collect(),
            },
            line_len,
        ),
        b"shutdown" => err("ERROR: shutdown not enabled", line_len),
        b"mn" => req(Request::MetaNoop, line_len),
        b"me" => meta_debug(args, line_len),
        b"mg" | b"ms" | b"md" | b"ma" => meta(name[1], args, buf, line_len, item_max),
        b"quit" => req(Request::Quit, line_len),
        b"lockstep_digest" | b"lockstep_corrupt" | b"lockstep_isolate" | b"lru_crawler" => req(
            Request::Local {
                line: String::from_utf8_lossy(line).into_owned(),
            },
            line_len,
        ),
        _ => err("ERROR", line_len),
    }
}

fn data(cmd: Command, noreply: bool, consumed: usize) -> Parsed {
    req(Request::Data { cmd, noreply }, consumed)
}

fn req(req: Request, consumed: usize) -> Parsed {
    Parsed::Request {
        req,
        consumed,
        swallow: 0,
    }
}

/// The flags memcached 1.6.18 takes on every meta command (each command ignores those
/// that mean nothing to it); `E`, `S` and `x` are not among them.
fn meta_flag_known(c: u8) -> bool {
    b"bcfhklOqstuvCDFIJLMNPRT".contains(&c)
}

/// `me`: memcached reads only the key and, if the next token is exactly `b`, decodes the
/// key as base64 (a key that does not decode is a bad command line); every other token
/// is ignored.
fn meta_debug(args: &[&[u8]], line_len: usize) -> Parsed {
    let Some(&token) = args.first() else {
        return err("ERROR", line_len);
    };
    if token.len() > KEY_MAX {
        return err(BAD_FORMAT, line_len);
    }
    let binary = args.get(1) == Some(&&b"b"[..]);
    let key = match binary {
        true => match base64_decode(token) {
            Some(k) => k,
            None => return err(BAD_FORMAT, line_len),
        },
        false => token.to_vec(),
    };
    let flags = if binary { vec![b"b".to_vec()] } else { Vec::new() };
    let cmd = Command::Meta {
        kind: b'e',
        key,
        flags,
        data: Vec::new(),
    };
    data(cmd, false, line_len)
}

/// Parse `mg`, `ms`, `md` or `ma`: check every flag as memcached does, so that only
/// well-formed commands reach the log.
fn meta(kind: u8, args: &[&[u8]], buf: &[u8], line_len: usize, item_max: usize) -> Parsed {
    let Some((&key, rest)) = args.split_first() else {
        return err("ERROR", line_len);
    };
    if key.len() > KEY_MAX {
        return err(BAD_FORMAT, line_len);
    }
    let (len, flags) = if kind == b's' {
        match rest.split_first() {
            Some((l, f)) => match c_long(l).map(|l| l as i32) {
                Some(l) if (0..=i32::MAX - 2).contains(&l) => (Some(l as usize), f),
                _ => return err(BAD_FORMAT, line_len),
            },
            None => return err(BAD_FORMAT, line_len),
        }
    } else {
        (None, rest)
    };
    // Once the length of an ms data block is known, an error swallows the block too.
    let err = |reply: &str, consumed: usize| Parsed::Error {
        reply: format!("{reply}\r\n"),
        consumed,
        swallow: len.map_or(0, |l| l + 2),
        close: false,
    };
    // memcached's flag pre-parse, token by token: a repeated or unknown letter stops it
    // at once; a bad number, M token or base64 key marks an error and goes on, and the
    // last such message wins (`F` leaves the message as it was). md and ma answer every
    // pre-parse failure with one message.
    let preparse_failed = |message: Option<&str>| {
        let reply = match kind {
            b'a' | b'd' => "CLIENT_ERROR invalid or duplicate flag",
            _ => message.unwrap_or(BAD_FORMAT),
        };
        err(reply, line_len)
    };
    let mut seen = [false; 128];
    let mut failed = false;
    let mut message = None;
    let mut decoded = None;
    for f in flags {
        let (c, arg) = (f[0], &f[1..]);
        if c >= 127 || seen[c as usize] {
            return preparse_failed(Some("CLIENT_ERROR duplicate flag"));
        }
        seen[c as usize] = true;
        let problem = match c {
            _ if !meta_flag_known(c) => return preparse_failed(Some("CLIENT_ERROR invalid flag")),
            // `b`: the key token is base64 (memcached's lenient decoder); the store sees
            // the decoded key, and replies show it encoded again, as memcached's do.
            b'b' => match base64_decode(key) {
                Some(k) => {
                    decoded = Some(k);
                    None
                }
                None => Some(Some("CLIENT_ERROR error decoding key")),
            },
            b'T' | b'N' | b'R' if c_long(arg).is_none() => Some(Some(BAD_TOKEN)),
            b'C' if c_ulong(arg).is_none() => Some(Some(BAD_TOKEN)),
            b'F' if c_ulong(arg).is_none() => Some(None),
            b'M' if arg.len() != 1 => Some(Some("CLIENT_ERROR incorrect length for M token")),
            b'J' if c_ulong(arg).is_none() => Some(Some("CLIENT_ERROR invalid numeric initial value")),
            b'D' if c_ulong(arg).is_none() => Some(Some("CLIENT_ERROR invalid numeric delta value")),
            _ => None,
        };
        if let Some(m) = problem {
            failed = true;
            message = m.or(message);
        }
    }
    if failed {
        return preparse_failed(message);
    }
    let mode = flags.iter().find(|f| f[0] == b'M').map(|f| f[1]);
    // Then the mode of ms and ma, and an opaque over 32 bytes.
    let opaque_too_long = flags.iter().any(|f| f[0] == b'O' && f.len() > 33);
    match (kind, mode) {
        (b's', Some(m)) if !b"EeAaPpRrSs".contains(&m) => {
            return err("CLIENT_ERROR invalid mode for ms M token", line_len)
        }
        (b'a', Some(m)) if !b"Ii+Dd-".contains(&m) => return err("CLIENT_ERROR invalid mode for ma M token", line_len),
        _ if opaque_too_long => return err("CLIENT_ERROR opaque token too long", line_len),
        _ => {}
    }
    let key = decoded.as_deref().unwrap_or(key);
    let flags: Vec<Vec<u8>> = flags.iter().map(|f| f.to_vec()).collect();
    let noreply = false; // meta commands answer through their flags (q), at apply time
    let Some(len) = len else {
        let cmd = Command::Meta {
            kind,
            key: key.to_vec(),
            flags,
            data: Vec::new(),
        };
        return data(cmd, noreply, line_len);
    };
    let total = line_len + len + 2;
    if item_size(key.len(), 0, len) > item_max {
        return Parsed::Error {
            reply: format!("{TOO_LARGE}\r\n"),
            consumed: line_len,
            swallow: len + 2,
            close: false,
        };
    }
    let value = match data_block(buf, line_len, len) {
        Block::Here(value) => value,
        Block::Incomplete => return Parsed::Incomplete,
        Block::Bad => return err("CLIENT_ERROR bad data chunk", total),
    };
    let cmd = Command::Meta {
        kind,
        key: key.to_vec(),
        flags,
        data: value.to_vec(),
    };
    data(cmd, noreply, total)
}

const BASE64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding, as memcached prints binary keys.
pub fn base64_encode(data: &[u8]) -> String {
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(BASE64[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Base64 decoding with memcached's rules: characters outside the alphabet (and '=') are
/// skipped; the rest must be a non-zero multiple of 4; '=' counts as a zero digit and ends
/// the decoding at the end of its group, dropping one byte per '=' (three are invalid).
/// None where memcached answers "error decoding key" (including an empty result).
pub fn base64_decode(token: &[u8]) -> Option<Vec<u8>> {
    let digit = |c: u8| match c {
        b'=' => Some(0),
        _ => BASE64.iter().position(|&x| x == c).map(|v| v as u8),
    };
    let count = token.iter().filter(|&&c| digit(c).is_some()).count();
    if count == 0 || count % 4 != 0 {
        return None;
    }
    let mut out = Vec::with_capacity(count / 4 * 3);
    let (mut group, mut filled, mut pad) = ([0u8; 4], 0, 0);
    for &c in token {
        let Some(v) = digit(c) else { continue };
        pad += usize::from(c == b'=');
        group[filled] = v;
        filled += 1;
        if filled == 4 {
            out.push((group[0] << 2) | (group[1] >> 4));
            out.push((group[1] << 4) | (group[2] >> 2));
            out.push((group[2] << 6) | group[3]);
            filled = 0;
            if pad > 0 {
                if pad > 2 {
                    return None;
                }
                out.truncate(out.len() - pad);
                break;
            }
        }
    }
    (!out.is_empty()).then_some(out)
}

/// A value's data block after its command line.
enum Block<'a> {
    Here(&'a [u8]),
    Incomplete,
    /// Not followed by "\r\n".
    Bad,
}

/// The `len` bytes after a command line of `line_len` bytes, and their "\r\n".
fn data_block(buf: &[u8], line_len: usize, len: usize) -> Block<'_> {
    let total = line_len + len + 2;
    if buf.len() < total {
        Block::Incomplete
    } else if &buf[line_len + len..total] != b"\r\n" {
        Block::Bad
    } else {
        Block::Here(&buf[line_len..line_len + len])
    }
}

/// C's `strtol` as memcached's safe_strtol uses it: an optional sign and decimal digits
/// filling the token, within 64 bits.
fn c_long(t: &[u8]) -> Option<i64> {
    let (negative, digits) = split_sign(t);
    let n = decimal(digits)?;
    if negative {
        0i64.checked_sub_unsigned(n)
    } else {
        i64::try_from(n).ok()
    }
}

/// C's `strtoul` as memcached's safe_strtoul uses it: like `c_long` but unsigned; a minus
/// sign is refused unless the number is zero.
fn c_ulong(t: &[u8]) -> Option<u64> {
    let (negative, digits) = split_sign(t);
    let n = decimal(digits)?;
    (!negative || n == 0).then_some(n)
}

fn split_sign(t: &[u8]) -> (bool, &[u8]) {
    match t.first() {
        Some(b'-') => (true, &t[1..]),
        Some(b'+') => (false, &t[1..]),
        _ => (false, t),
    }
}

fn decimal(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(digits).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: usize = 1 << 20;

    /// A set's key and value, and a get's key list, are parsed into the buffers of
    /// requests that are done with (what the event loop gets back from the replica).
    #[test]
    fn a_request_is_parsed_into_the_buffers_of_one_that_is_done() {
        let mut buffers = Buffers::default();
        let set = |key: &str| [format!("set {key} 0 0 400\r\n").as_bytes(), &[b'v'; 400], b"\r\n"].concat();
        let cmd = |p: Parsed| match p {
            Parsed::Request {
                req: Request::Data { cmd, .. },
                ..
            } => cmd,
            other => panic!("{other:?}"),
        };
        let first = cmd(parse_with(&set("key-1"), MAX, &mut buffers));
        let Command::Store { key, data, .. } = &first else {
            panic!()
        };
        let (key_at, data_at) = (key.as_ptr(), data.as_ptr());
        buffers.keep_command(first);
        let second = cmd(parse_with(&set("key-2"), MAX, &mut buffers));
        let Command::Store { key, data, .. } = &second else {
            panic!()
        };
        assert_eq!((key.as_slice(), data.len()), (&b"key-2"[..], 400));
        assert_eq!((key.as_ptr(), data.as_ptr()), (key_at, data_at));
        let get = cmd(parse_with(b"get a b\r\n", MAX, &mut buffers));
        let Command::Get { keys, .. } = &get else { panic!() };
        let list_at = keys.as_ptr();
        buffers.keep_command(get);
        let again = cmd(parse_with(b"get c\r\n", MAX, &mut buffers));
        let Command::Get { keys, .. } = &again else { panic!() };
        assert_eq!((keys.as_slice(), keys.as_ptr()), (&[b"c".to_vec()][..], list_at));
    }

    #[test]
    fn set_waits_for_its_data_block() {
        let full = b"set k 5 0 3\r\nabc\r\nget k\r\n";
        for cut in 0..18 {
            assert_eq!(parse(&full[..cut], MAX), Parsed::Incomplete, "cut {cut}");
        }
        match parse(full, MAX) {
            Parsed::Request {
                req:
                    Request::Data {
                        cmd: Command::Store { data, flags, .. },
                        noreply,
                    },
                consumed,
                swallow: 0,
            } => {
                assert_eq!((data.as_slice(), flags, noreply, consumed), (&b"abc"[..], 5, false, 18));
            }
            p => panic!("{p:?}"),
        }
    }

    #[test]
    fn a_get_of_more_keys_than_fit_on_the_stack_keeps_them_all_in_order() {
        for n in [TOKENS_INLINE - 1, TOKENS_INLINE, TOKENS_INLINE + 1, 3 * TOKENS_INLINE] {
            let names: Vec<String> = (0..n).map(|i| format!("key{i}")).collect();
            let line = format!("get  {} \r\n", names.join("  "));
            match parse(line.as_bytes(), MAX) {
                Parsed::Request {
                    req:
                        Request::Data {
                            cmd: Command::Get { keys, .. },
                            ..
                        },
                    consumed,
                    ..
                } => {
                    assert_eq!(consumed, line.len());
                    let got: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
                    let want: Vec<&[u8]> = names.iter().map(|k| k.as_bytes()).collect();
                    assert_eq!(got, want, "{n} keys");
                }
                other => panic!("{n} keys: {other:?}"),
            }
        }
    }

    #[test]
    fn malformed_lines_get_memcached_errors() {
        let cases: &[(&[u8], &str)] = &[
            (b"bogus\r\n", "ERROR\r\n"),
            (b"\r\n", "ERROR\r\n"),
            (b"set k x 0 1\r\na\r\n", "CLIENT_ERROR bad command line format\r\n"),
            (b"set k 0 0 -1\r\n", "CLIENT_ERROR bad command line format\r\n"),
            (b"set k 0 0 1\r\nab\r\n", "CLIENT_ERROR bad data chunk\r\n"),
            (b"incr k abc\r\n", "CLIENT_ERROR invalid numeric delta argument\r\n"),
            (b"get\r\n", "ERROR\r\n"),
        ];
        for (input, want) in cases {
            match parse(input, MAX) {
                Parsed::Error { reply, .. } => assert_eq!(&reply, want, "{:?}", String::from_utf8_lossy(input)),
                p => panic!("{:?}: {p:?}", String::from_utf8_lossy(input)),
            }
        }
        let long_key = format!("get {}\r\n", "k".repeat(251));
        assert!(matches!(parse(long_key.as_bytes(), MAX), Parsed::Error { .. }));
    }

    #[test]
    fn oversize_values_are_swallowed_as_they_arrive() {
        // A set that does not fit: its data block (declared 2,000,000 bytes) is to be
        // discarded as it arrives, whether or not it is here yet, and the old value goes.
        for tail in [&b""[..], b"xxxx"] {
            let mut big = b"set k 0 0 2000000\r\n".to_vec();
            big.extend_from_slice(tail);
            match parse(&big, MAX) {
                Parsed::Request {
                    req:
                        Request::Data {
                            cmd: Command::TooLarge { key },
                            noreply: false,
                        },
                    consumed: 19,
                    swallow: 2_000_002,
                } => assert_eq!(key, b"k"),
                p => panic!("{p:?}"),
            }
        }
        match parse(b"add k 0 0 2000000 noreply\r\n", MAX) {
            Parsed::Error {
                reply,
                swallow: 2_000_002,
                close: false,
                ..
            } => assert_eq!(reply, "", "noreply silences the error"),
            p => panic!("{p:?}"),
        }
        // memcached's limit counts the item header: 1,048,516 bytes fit under a 1-byte key.
        assert!(matches!(
            parse(b"set k 0 0 1048517\r\n", MAX),
            Parsed::Request { swallow: 1_048_519, .. }
        ));
        let mut fits = b"set k 0 0 1048516\r\n".to_vec();
        fits.extend(vec![b'x'; 1_048_516]);
        fits.extend_from_slice(b"\r\n");
        assert!(matches!(parse(&fits, MAX), Parsed::Request { swallow: 0, .. }));
        assert!(matches!(
            parse(&vec![b'a'; LINE_MAX + 1], MAX),
            Parsed::Error { close: true, .. }
        ));
    }

    #[test]
    fn numbers_are_read_as_memcached_reads_them() {
        // Flags and lengths are cut to 32 bits; a minus sign is refused where memcached
        // refuses it; a NUL ends the line.
        match parse(b"set k 4294967301 0 1\r\na\r\n", MAX) {
            Parsed::Request {
                req:
                    Request::Data {
                        cmd: Command::Store { flags, .. },
                        ..
                    },
                ..
            } => assert_eq!(flags, 5),
            p => panic!("{p:?}"),
        }
        assert!(matches!(
            parse(b"set k 0 0 4294967296\r\n\r\n", MAX),
            Parsed::Request { consumed: 24, .. }
        ));
        assert_eq!(parse(b"set k -1 0 1\r\na\r\n", MAX), err(BAD_FORMAT, 14));
        assert_eq!(parse(b"set k 0 0 2147483648\r\n", MAX), err(BAD_FORMAT, 22));
        assert_eq!(parse(b"set a\0b 0 0 1\r\na\r\n", MAX), err("ERROR", 15));
        assert_eq!(
            parse(b"incr k -1\r\n", MAX),
            err("CLIENT_ERROR invalid numeric delta argument", 11)
        );
        assert!(matches!(parse(b"set k 0 0 z noreply\r\n", MAX), Parsed::Error { ref reply, .. } if reply.is_empty()));
        assert_eq!(parse(b"bogus noreply\r\n", MAX), err("ERROR", 15));
    }

    #[test]
    fn binary_garbage_never_panics() {
        let mut rng = lockstep_core::rng::Rng::new(0x9E37_79B9_7F4A_7C15);
        for _ in 0..2000 {
            let mut buf = Vec::new();
            for _ in 0..rng.below(64) {
                let x = rng.next_u64();
                buf.push(if x.is_multiple_of(5) { b'\n' } else { (x >> 8) as u8 });
            }
            // (any result will do: the test is that it never panics)
            let _ = parse(&buf, MAX);
        }
    }

    #[test]
    fn base64_keys_decode_as_memcached_decodes_them() {
        assert_eq!(base64_decode(b"YWJj").as_deref(), Some(&b"abc"[..]));
        assert_eq!(base64_decode(b"YQ==").as_deref(), Some(&b"a"[..]));
        // Outside the alphabet is skipped; '=' ends the group it closes.
        assert_eq!(base64_decode(b"Y!W!J!j").as_deref(), Some(&b"abc"[..]));
        assert_eq!(base64_decode(b"YQ==YWJj").as_deref(), Some(&b"a"[..]));
        for bad in [&b""[..], b"YQ", b"!!!!", b"YWJjZA===", b"Y==="] {
            assert_eq!(base64_decode(bad), None, "{bad:?}");
        }
        for key in [&b"a"[..], b"ab", b"abc", b"\0\x01\x02", b" b "] {
            assert_eq!(base64_decode(base64_encode(key).as_bytes()).as_deref(), Some(key));
        }
        assert_eq!(base64_encode(b"bin\0key"), "YmluAGtleQ==");
    }
}

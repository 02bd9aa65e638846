//! The memcached text protocol: parsing client bytes into requests. The parser never
//! panics and never trusts a length: every malformed line gets memcached's error reply,
//! and an over-long line or an absurd value length closes the connection.

use crate::command::{Command, StoreOp};

/// memcached's key limit.
pub const KEY_MAX: usize = 250;
/// The longest command line accepted (a multi-get of many keys).
pub const LINE_MAX: usize = 64 * 1024;

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
    /// lockstep's own commands (`lockstep_digest`, `lockstep_corrupt ...`), answered by the
    /// replica that received them and never ordered.
    Local {
        line: String,
    },
    Quit,
}

#[derive(Debug, PartialEq, Eq)]
pub enum Parsed {
    /// More bytes are needed.
    Incomplete,
    Request {
        req: Request,
        consumed: usize,
    },
    /// Reply `reply` and drop `consumed` bytes; `close` ends the connection.
    Error {
        reply: String,
        consumed: usize,
        close: bool,
    },
}

fn err(reply: &str, consumed: usize) -> Parsed {
    Parsed::Error {
        reply: format!("{reply}\r\n"),
        consumed,
        close: false,
    }
}

const BAD_FORMAT: &str = "CLIENT_ERROR bad command line format";

/// Parse one request from the front of `buf`. `item_max` is the largest value accepted.
pub fn parse(buf: &[u8], item_max: usize) -> Parsed {
    let Some(nl) = buf.iter().position(|&b| b == b'\n') else {
        if buf.len() > LINE_MAX {
            return Parsed::Error {
                reply: "CLIENT_ERROR line too long\r\n".into(),
                consumed: buf.len(),
                close: true,
            };
        }
        return Parsed::Incomplete;
    };
    let line_len = nl + 1;
    let line = &buf[..nl];
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let tokens: Vec<&[u8]> = line.split(|&b| b == b' ').filter(|t| !t.is_empty()).collect();
    let Some(&name) = tokens.first() else {
        return err("ERROR", line_len);
    };
    let args = &tokens[1..];
    let noreply = args.last() == Some(&&b"noreply"[..]);
    match name {
        b"get" | b"gets" | b"gat" | b"gats" => {
            let touch = name.starts_with(b"gat");
            let (exptime, keys) = if touch {
                match args.split_first() {
                    Some((e, k)) => match num::<i64>(e) {
                        Some(e) => (Some(e), k),
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
                keys: keys.iter().map(|k| k.to_vec()).collect(),
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
            let (Some(flags), Some(exptime), Some(len)) =
                (num::<u32>(args[1]), num::<i64>(args[2]), num::<i64>(args[3]))
            else {
                return err(BAD_FORMAT, line_len);
            };
            let cas = if op == StoreOp::Cas {
                match num::<u64>(args[4]) {
                    Some(c) => c,
                    None => return err(BAD_FORMAT, line_len),
                }
            } else {
                0
            };
            if key.len() > KEY_MAX || len < 0 {
                return err(BAD_FORMAT, line_len);
            }
            let len = len as usize;
            if len > item_max {
                // memcached swallows the data block; when it is absurdly large, there is no
                // point reading it: close instead.
                if len > 64 * item_max {
                    return Parsed::Error {
                        reply: "SERVER_ERROR object too large for cache\r\n".into(),
                        consumed: buf.len(),
                        close: true,
                    };
                }
                let total = line_len + len + 2;
                if buf.len() < total {
                    return Parsed::Incomplete;
                }
                return err("SERVER_ERROR object too large for cache", total);
            }
            let total = line_len + len + 2;
            if buf.len() < total {
                return Parsed::Incomplete;
            }
            if &buf[line_len + len..total] != b"\r\n" {
                return err("CLIENT_ERROR bad data chunk", total);
            }
            let cmd = Command::Store {
                op,
                key: key.to_vec(),
                flags,
                exptime,
                data: buf[line_len..line_len + len].to_vec(),
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
                [_, _] => err(
                    "CLIENT_ERROR bad command line format.  Usage: delete <key> [noreply]",
                    line_len,
                ),
                _ => err("ERROR", line_len),
            }
        }
        b"incr" | b"decr" => {
            let rest = if noreply { &args[..args.len() - 1] } else { args };
            match rest {
                [key, delta] if key.len() <= KEY_MAX => match num::<u64>(delta) {
                    Some(delta) => data(
                        Command::Arith {
                            key: key.to_vec(),
                            incr: name == b"incr",
                            delta,
                        },
                        noreply,
                        line_len,
                    ),
                    None => err("CLIENT_ERROR invalid numeric delta argument", line_len),
                },
                _ => err("ERROR", line_len),
            }
        }
        b"touch" => {
            let rest = if noreply { &args[..args.len() - 1] } else { args };
            match rest {
                [key, exptime] if key.len() <= KEY_MAX => match num::<i64>(exptime) {
                    Some(exptime) => data(
                        Command::Touch {
                            key: key.to_vec(),
                            exptime,
                        },
                        noreply,
                        line_len,
                    ),
                    None => err("CLIENT_ERROR invalid exptime argument", line_len),
                },
                _ => err("ERROR", line_len),
            }
        }
        b"flush_all" => {
            let rest = if noreply { &args[..args.len() - 1] } else { args };
            match rest {
                [] => data(Command::FlushAll { delay: 0 }, noreply, line_len),
                [d] => match num::<i64>(d) {
                    Some(delay) => data(Command::FlushAll { delay }, noreply, line_len),
                    None => err(BAD_FORMAT, line_len),
                },
                _ => err("ERROR", line_len),
            }
        }
        b"version" if args.is_empty() => req(Request::Version, line_len),
        // memcached: "verbosity noreply" sets nothing and says nothing.
        b"verbosity" => match args {
            _ if noreply && args.len() <= 2 => req(Request::Verbosity { noreply }, line_len),
            [n] if num::<u32>(n).is_some() => req(Request::Verbosity { noreply }, line_len),
            _ => err("ERROR", line_len),
        },
        b"stats" => match args {
            [] | [b"kv"] => req(
                Request::Stats {
                    args: args.iter().map(|a| String::from_utf8_lossy(a).into_owned()).collect(),
                },
                line_len,
            ),
            _ => err("ERROR", line_len),
        },
        b"quit" if args.is_empty() => req(Request::Quit, line_len),
        b"lockstep_digest" | b"lockstep_corrupt" => req(
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
    Parsed::Request { req, consumed }
}

fn num<T: std::str::FromStr>(t: &[u8]) -> Option<T> {
    std::str::from_utf8(t).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: usize = 1 << 20;

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
            } => {
                assert_eq!((data.as_slice(), flags, noreply, consumed), (&b"abc"[..], 5, false, 18));
            }
            p => panic!("{p:?}"),
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
    fn oversize_values_are_swallowed_or_closed() {
        let mut big = b"set k 0 0 2000000\r\n".to_vec();
        big.extend(vec![b'x'; 2_000_000]);
        big.extend_from_slice(b"\r\n");
        match parse(&big, MAX) {
            Parsed::Error { reply, consumed, close } => {
                assert_eq!(
                    (reply.as_str(), consumed, close),
                    ("SERVER_ERROR object too large for cache\r\n", big.len(), false)
                )
            }
            p => panic!("{p:?}"),
        }
        assert!(matches!(
            parse(b"set k 0 0 99999999999\r\n", MAX),
            Parsed::Error { close: true, .. }
        ));
        assert!(matches!(
            parse(&vec![b'a'; LINE_MAX + 1], MAX),
            Parsed::Error { close: true, .. }
        ));
    }

    #[test]
    fn binary_garbage_never_panics() {
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        for _ in 0..2000 {
            let mut buf = Vec::new();
            for _ in 0..(x % 64) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                buf.push(if x.is_multiple_of(5) { b'\n' } else { (x >> 8) as u8 });
            }
            let _ = parse(&buf, MAX);
        }
    }
}

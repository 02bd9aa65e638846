//! One client connection: parse requests, hand data commands to the replica thread, write
//! replies in request order. Replies may be released out of order (validation finishes at
//! different times), so they are stashed until their turn.

use crate::protocol::{parse, Parsed, Request, LINE_MAX};
use crate::replica::{Inbound, Route};
use std::collections::{BTreeMap, VecDeque};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::mpsc::{channel, RecvTimeoutError};
use std::time::Duration;

/// A reply that does not arrive in this time closes the connection (the replica itself
/// answers "SERVER_ERROR" well before this when it cannot order a request).
const REPLY_TIMEOUT: Duration = Duration::from_secs(60);

enum Slot {
    Ready(Vec<u8>),
    Await { seq: u64, noreply: bool },
    Quit,
}

/// The first byte of a binary-protocol request.
const BINARY_MAGIC: u8 = 0x80;

/// A binary-protocol response to the request at the front of `buf`: status 0x0083 ("not
/// supported"), the request's opcode and opaque echoed, and a message saying why.
fn binary_not_supported(buf: &[u8]) -> Vec<u8> {
    let msg = b"lockstep kv speaks the memcached text protocol only";
    let opcode = buf.get(1).copied().unwrap_or(0);
    let opaque = buf.get(12..16).unwrap_or(&[0; 4]);
    let mut r = vec![0x81, opcode, 0, 0, 0, 0, 0x00, 0x83];
    r.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    r.extend_from_slice(opaque);
    r.extend_from_slice(&[0; 8]);
    r.extend_from_slice(msg);
    r
}

/// The memcached release whose behaviour kv reproduces comes first: clients (memccapable,
/// libmemcached) read the version to decide what the server supports.
pub const VERSION: &str = concat!("VERSION 1.6.18-lockstep-", env!("CARGO_PKG_VERSION"), "\r\n");

pub fn serve(mut stream: TcpStream, conn: u64, to_node: Route, item_max: usize) {
    let _ = stream.set_nodelay(true);
    let (tx, rx) = channel::<(u64, Vec<u8>)>();
    if !to_node.deliver(Inbound::Open { conn, tx }) {
        return;
    }
    let mut buf: Vec<u8> = Vec::with_capacity(16 << 10);
    let mut chunk = vec![0u8; 64 << 10];
    let mut next_seq = 0u64;
    let mut stash: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
    // Bytes of an oversized value still to be discarded as they arrive.
    let mut swallowing = 0usize;
    // Bytes a well-formed request can need before it parses: its line plus its value.
    let buffer_max = LINE_MAX + item_max + 2;
    'conn: loop {
        let n = match stream.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let skip = swallowing.min(n);
        swallowing -= skip;
        buf.extend_from_slice(&chunk[skip..n]);
        if next_seq == 0 && buf.first() == Some(&BINARY_MAGIC) {
            // The binary protocol: say so in its own framing, then close.
            let _ = stream.write_all(&binary_not_supported(&buf));
            break;
        }
        let mut slots = VecDeque::new();
        let mut close = false;
        let mut at = 0;
        while at < buf.len() && !close {
            let (step, swallow) = match parse(&buf[at..], item_max) {
                Parsed::Incomplete => {
                    if buf.len() - at > buffer_max {
                        slots.push_back(Slot::Ready(b"CLIENT_ERROR request too large\r\n".to_vec()));
                        close = true;
                    }
                    break;
                }
                Parsed::Error {
                    reply,
                    consumed,
                    swallow,
                    close: c,
                } => {
                    if !reply.is_empty() {
                        slots.push_back(Slot::Ready(reply.into_bytes()));
                    }
                    close = c;
                    (consumed, swallow)
                }
                Parsed::Request { req, consumed, swallow } => {
                    // Requests the replica thread answers: (message, whether to discard the reply).
                    let to_replica = |seq| match req {
                        Request::Data { cmd, noreply } => Ok((Inbound::Request { conn, seq, cmd }, noreply)),
                        Request::Local { line } => Ok((Inbound::Local { conn, seq, line }, false)),
                        Request::Stats { args } => Ok((Inbound::Stats { conn, seq, args }, false)),
                        other => Err(other),
                    };
                    match to_replica(next_seq) {
                        Ok((msg, noreply)) => {
                            if !to_node.deliver(msg) {
                                break 'conn;
                            }
                            slots.push_back(Slot::Await { seq: next_seq, noreply });
                            next_seq += 1;
                        }
                        Err(Request::Version) => slots.push_back(Slot::Ready(VERSION.as_bytes().to_vec())),
                        Err(Request::MetaNoop) => slots.push_back(Slot::Ready(b"MN\r\n".to_vec())),
                        Err(Request::Verbosity { noreply }) => {
                            if !noreply {
                                slots.push_back(Slot::Ready(b"OK\r\n".to_vec()))
                            }
                        }
                        Err(Request::Quit) => {
                            slots.push_back(Slot::Quit);
                            close = true;
                        }
                        Err(_) => unreachable!("every request kind is handled above"),
                    }
                    (consumed, swallow)
                }
            };
            at += step;
            // What is already here of a swallowed block goes now, the rest as it comes.
            let here = swallow.min(buf.len() - at);
            at += here;
            swallowing = swallow - here;
            if swallowing > 0 {
                break;
            }
        }
        buf.drain(..at.min(buf.len()));
        let mut out = Vec::new();
        for slot in slots {
            match slot {
                Slot::Ready(r) => out.extend_from_slice(&r),
                Slot::Quit => break,
                Slot::Await { seq, noreply } => {
                    let reply = loop {
                        if let Some(r) = stash.remove(&seq) {
                            break r;
                        }
                        match rx.recv_timeout(REPLY_TIMEOUT) {
                            Ok((s, r)) if s == seq => break r,
                            Ok((s, r)) => {
                                stash.insert(s, r);
                            }
                            Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => break 'conn,
                        }
                    };
                    // An empty reply is a quiet one (a meta command's q flag).
                    if !noreply {
                        out.extend_from_slice(&reply);
                    }
                }
            }
        }
        if stream.write_all(&out).is_err() || close {
            break;
        }
    }
    to_node.deliver(Inbound::Closed { conn });
}

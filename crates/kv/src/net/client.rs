//! One client connection, driven by the replica thread's event loop: bytes in are parsed
//! into requests for the replica; replies (which may be released out of order, as
//! validation finishes at different times) go out in request order.
//!
//! Limits: at most `PIPELINE_MAX` requests of one connection wait for their replies and
//! at most `OUT_MAX` reply bytes wait for the client to read them; past either the
//! connection is not read until it drains, so a client that pipelines without reading
//! slows down instead of growing our buffers. Unparsed input is at most one request.

use super::poll::{Interest, Poller};
use super::{SPENT_BYTES_MAX, SPENT_MAX};
use crate::binary::{self, Frame, Pending};
use crate::buffers::Buffers;
use crate::command::HeldKeys;
use crate::protocol::{parse_with, Parsed, Request, LINE_MAX};
use crate::replica::Inbound;
use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::TcpStream;

/// Requests of one connection handed to the replica and not answered yet, at most.
pub const PIPELINE_MAX: usize = 256;
/// Reply bytes waiting for the client to read them before we stop reading its requests.
const OUT_MAX: usize = 4 << 20;

/// The memcached release whose behaviour kv reproduces comes first: clients (memccapable,
/// libmemcached) read the version to decide what the server supports.
pub const VERSION: &str = concat!("VERSION 1.6.18-lockstep-", env!("CARGO_PKG_VERSION"), "\r\n");

enum Slot {
    Ready(Vec<u8>),
    Await {
        seq: u64,
        noreply: bool,
        /// A binary-protocol request: what its response is made of besides the reply.
        binary: Option<Pending>,
        reply: Option<Vec<u8>>,
    },
}

/// What a connection speaks, decided by its first byte (as memcached does).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Protocol {
    Undecided,
    Text,
    Binary,
}

pub struct Client {
    pub stream: TcpStream,
    pub id: u64,
    /// Received and not parsed yet (at most one incomplete request).
    input: Vec<u8>,
    /// Bytes of an oversized value still to be discarded as they arrive.
    swallowing: usize,
    next_seq: u64,
    /// Replies in request order, some still awaited.
    slots: VecDeque<Slot>,
    awaiting: usize,
    out: Vec<u8>,
    out_at: usize,
    /// Stop reading and parsing; close once `out` is written (quit, a fatal protocol
    /// error).
    closing: bool,
    /// The client sent its last byte: what it sent is still parsed and answered.
    eof: bool,
    /// The peer closed its side or the socket failed: close now.
    pub dead: bool,
    interest: Interest,
    item_max: usize,
    protocol: Protocol,
    /// Keys whose items memcached would still hold for a queued reply.
    held: HeldKeys,
}

impl Client {
    pub fn new(stream: TcpStream, id: u64, item_max: usize) -> Client {
        Client {
            stream,
            id,
            input: Vec::new(),
            swallowing: 0,
            next_seq: 0,
            slots: VecDeque::new(),
            awaiting: 0,
            out: Vec::new(),
            out_at: 0,
            closing: false,
            eof: false,
            dead: false,
            interest: Interest::READ,
            item_max,
            protocol: Protocol::Undecided,
            held: HeldKeys::default(),
        }
    }

    fn unsent(&self) -> usize {
        self.out.len() - self.out_at
    }

    /// Whether more requests may be parsed now.
    fn may_parse(&self) -> bool {
        !self.closing && !self.dead && self.awaiting < PIPELINE_MAX && self.unsent() < OUT_MAX
    }

    /// Whether more input may be read now.
    fn wants_input(&self) -> bool {
        self.may_parse() && !self.eof
    }

    /// Everything this connection will ever answer is written.
    fn finished(&self) -> bool {
        let drained = self.unsent() == 0 && self.slots.is_empty();
        // After the end of input, what is left unparsed is an incomplete request.
        drained && (self.closing || (self.eof && (self.input.is_empty() || self.may_parse())))
    }

    /// Read what the socket has (a bounded amount per call, for fairness) and parse it.
    /// Requests for the replica go to `to_replica`, their keys and values into `buffers`'
    /// spare buffers.
    pub fn on_readable(&mut self, scratch: &mut [u8], to_replica: &mut Vec<Inbound>, buffers: &mut Buffers) {
        if self.interest.with_write(false) == Interest::NONE {
            // Not watched for input: only a hang-up or an error is reported.
            self.dead = true;
            return;
        }
        for _ in 0..4 {
            if !self.wants_input() {
                break;
            }
            let n = match self.stream.read(scratch) {
                Ok(0) => {
                    // The client is done sending: what it sent is still answered (as
                    // memcached answers what it parsed before it reads the end).
                    self.eof = true;
                    break;
                }
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => {
                    self.dead = true;
                    break;
                }
            };
            let skip = self.swallowing.min(n);
            self.swallowing -= skip;
            self.input.extend_from_slice(&scratch[skip..n]);
            self.parse_input(to_replica, buffers);
            if n < scratch.len() {
                break;
            }
        }
    }

    /// Parse buffered input while the pipeline has room (what stays is parsed when replies
    /// drain it).
    pub fn parse_input(&mut self, to_replica: &mut Vec<Inbound>, buffers: &mut Buffers) {
        if self.protocol == Protocol::Undecided {
            self.protocol = match self.input.first() {
                None => return,
                Some(&binary::REQUEST_MAGIC) => Protocol::Binary,
                Some(_) => Protocol::Text,
            };
        }
        let mut at = 0;
        while at < self.input.len() && self.may_parse() {
            let next = match self.protocol {
                Protocol::Binary => self.next_binary(at, to_replica),
                _ => self.next_text(at, to_replica, buffers),
            };
            let Some((step, swallow)) = next else { break };
            at += step;
            // What is already here of a swallowed block goes now, the rest as it comes.
            let here = swallow.min(self.input.len() - at);
            at += here;
            self.swallowing = swallow - here;
            if self.swallowing > 0 {
                break;
            }
        }
        self.input.drain(..at.min(self.input.len()));
        if self.closing {
            self.input.clear();
        }
        self.held.read_used_up();
        self.release(None);
    }

    /// Parse one text request at `at`: the bytes it took and the bytes to discard after
    /// it, or None when more input is needed.
    fn next_text(&mut self, at: usize, to_replica: &mut Vec<Inbound>, buffers: &mut Buffers) -> Option<(usize, usize)> {
        match parse_with(&self.input[at..], self.item_max, buffers) {
            Parsed::Incomplete => {
                if self.input.len() - at > LINE_MAX + self.item_max + 2 {
                    self.answer(b"CLIENT_ERROR request too large\r\n".to_vec(), true);
                }
                None
            }
            Parsed::Error {
                reply,
                consumed,
                swallow,
                close,
            } => {
                self.answer(reply.into_bytes(), close);
                Some((consumed, swallow))
            }
            Parsed::Request { req, consumed, swallow } => {
                self.request(req, None, to_replica);
                Some((consumed, swallow))
            }
        }
    }

    /// [`Client::next_text`] for a binary-protocol frame.
    fn next_binary(&mut self, at: usize, to_replica: &mut Vec<Inbound>) -> Option<(usize, usize)> {
        match binary::parse(&self.input[at..], self.item_max, binary_version()) {
            Frame::Incomplete => None,
            Frame::Answer {
                reply,
                consumed,
                swallow,
                close,
            } => {
                // A noop, or an error, makes memcached write its queued replies; a version
                // answer does not.
                let writes_queued = reply.get(1) != Some(&binary::op::VERSION);
                self.answer(reply, close);
                if writes_queued {
                    self.held.written();
                }
                Some((consumed, swallow))
            }
            Frame::Request {
                req,
                pending,
                consumed,
                swallow,
            } => {
                self.request(req, Some(pending), to_replica);
                Some((consumed, swallow))
            }
        }
    }

    /// A reply the connection gives itself (nothing if empty), in request order; `close`
    /// ends the connection once it is written.
    fn answer(&mut self, reply: Vec<u8>, close: bool) {
        self.held.next_request();
        if !reply.is_empty() {
            self.slots.push_back(Slot::Ready(reply));
        }
        self.closing |= close;
    }

    fn request(&mut self, req: Request, binary: Option<Pending>, to_replica: &mut Vec<Inbound>) {
        let (conn, seq) = (self.id, self.next_seq);
        self.held.next_request();
        let (msg, noreply) = match req {
            Request::Data { cmd, noreply } => {
                let cmd = self.held.note(cmd);
                (Inbound::Request { conn, seq, cmd }, noreply)
            }
            Request::Local { line } => {
                // Whether replies are queued ahead of it (memcached streams a metadump
                // straight to the socket, so it refuses one queued behind others).
                let queued_behind = !self.slots.is_empty();
                (
                    Inbound::Local {
                        conn,
                        seq,
                        line,
                        queued_behind,
                    },
                    false,
                )
            }
            Request::Stats { args } => (Inbound::Stats { conn, seq, args }, false),
            Request::Version => return self.slots.push_back(Slot::Ready(VERSION.as_bytes().to_vec())),
            Request::MetaNoop => {
                self.held.written(); // mn makes memcached write its queued replies
                return self.slots.push_back(Slot::Ready(b"MN\r\n".to_vec()));
            }
            Request::Verbosity { noreply } => {
                if !noreply {
                    self.slots.push_back(Slot::Ready(b"OK\r\n".to_vec()));
                }
                return;
            }
            Request::Quit => {
                self.closing = true;
                return;
            }
        };
        to_replica.push(msg);
        self.slots.push_back(Slot::Await {
            seq,
            noreply,
            binary,
            reply: None,
        });
        self.awaiting += 1;
        self.next_seq += 1;
    }

    /// The replica's reply to request `seq`.
    pub fn reply(&mut self, seq: u64, reply: Vec<u8>) {
        for slot in self.slots.iter_mut() {
            if let Slot::Await {
                seq: s,
                reply: r @ None,
                ..
            } = slot
            {
                if *s == seq {
                    *r = Some(reply);
                    return;
                }
            }
        }
    }

    /// Move the replies that are due, in order, to the output buffer; their buffers go to
    /// `spent` (up to `SPENT_MAX`, those up to `SPENT_BYTES_MAX`) to be written into again.
    pub fn release(&mut self, mut spent: Option<&mut Vec<Vec<u8>>>) {
        while let Some(front) = self.slots.front_mut() {
            let r = match front {
                Slot::Ready(r) => {
                    self.out.extend_from_slice(r);
                    r
                }
                Slot::Await { reply: None, .. } => break,
                Slot::Await {
                    reply: Some(r),
                    noreply,
                    binary,
                    ..
                } => {
                    // An empty reply is a quiet one (a meta command's q flag).
                    match binary {
                        Some(pending) => self.out.extend_from_slice(&binary::respond(pending, r)),
                        None if !*noreply => self.out.extend_from_slice(r),
                        None => {}
                    }
                    self.awaiting -= 1;
                    r
                }
            };
            if let Some(spent) = spent.as_deref_mut() {
                if spent.len() < SPENT_MAX && (1..=SPENT_BYTES_MAX).contains(&r.capacity()) {
                    spent.push(std::mem::take(r));
                }
            }
            self.slots.pop_front();
        }
    }

    /// Write what is due; then watch the socket for what this connection needs next.
    /// Returns false when the connection is to be closed.
    pub fn flush(&mut self, poll: &Poller, token: u64, to_replica: &mut Vec<Inbound>, buffers: &mut Buffers) -> bool {
        // Input held back by the pipeline limit is parsed as replies make room.
        if !self.input.is_empty() && self.may_parse() && self.swallowing == 0 {
            self.parse_input(to_replica, buffers);
        }
        while self.unsent() > 0 && !self.dead {
            match self.stream.write(&self.out[self.out_at..]) {
                Ok(0) => self.dead = true,
                Ok(n) => self.out_at += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => self.dead = true,
            }
        }
        if self.unsent() == 0 {
            self.out.clear();
            self.out_at = 0;
        } else if self.out_at > OUT_MAX {
            self.out.drain(..self.out_at);
            self.out_at = 0;
        }
        if self.dead || self.finished() {
            return false;
        }
        let read = if self.wants_input() {
            Interest::READ
        } else {
            Interest::NONE
        };
        let want = read.with_write(self.unsent() > 0);
        if want != self.interest {
            self.interest = want;
            // A connection the poller no longer watches would stall: close it instead.
            if poll.modify(&self.stream, token, want).is_err() {
                return false;
            }
        }
        true
    }
}

/// The version a binary client reads: the text reply's, without "VERSION " and the
/// line end.
fn binary_version() -> &'static str {
    VERSION.trim_start_matches("VERSION ").trim_end()
}

//! Replica-to-replica transport, driven by the replica thread's event loop: one TCP
//! connection per direction and peer, carrying frames `[u32 len][u32 crc32c(payload)]
//! [payload]`. The first frame on a connection is a hello naming the sender. A frame that
//! is too long, fails its CRC or does not parse closes the connection; the replica keeps
//! running and Raft retransmits.
//!
//! Nothing a peer sends makes us spend before it is checked: a frame's length is checked
//! against the limit first and its payload is buffered only as it arrives (a header
//! claiming 256 MiB costs nothing until 256 MiB come); the hello is at most 16 bytes and
//! must come within a few seconds. At most `STRANGERS_MAX` connections wait for their
//! hello at once: a newcomer past that closes the one that has waited longest, so a flood
//! of silent strangers never keeps a real replica that reconnects from getting in; and at
//! most `PEERS_MAX` connections that said hello are served.

use super::poll::{Interest, Poller};
use lockstep_core::{frame, le};
use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::FromRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Larger frames are refused (a snapshot of a full 64 MiB store fits).
pub const FRAME_MAX: usize = 256 << 20;
/// Frame bytes queued for one peer before new frames are dropped (the peer is slow or
/// down; Raft resends what matters). One frame is always taken into an empty queue.
const QUEUE_MAX: usize = 64 << 20;
const HELLO: &[u8; 8] = b"LSKVPEER";
/// The hello's payload: the magic and the sender's id.
const HELLO_LEN: usize = 16;
/// An unauthenticated connection must say hello within this time.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// Incoming connections waiting for their hello at once.
pub const STRANGERS_MAX: usize = 16;
/// Incoming connections that said hello, served at once (a replica keeps one, and a few
/// more while it reconnects after a failure).
pub const PEERS_MAX: usize = 32;
/// A link that failed is tried again after this long.
const RECONNECT_AFTER: Duration = Duration::from_millis(100);
/// Bytes read from one incoming link per readiness report, at most (fairness).
const READ_BURST: usize = 1 << 20;

/// Tokens of outgoing links: this tag plus the peer's id.
pub const TOKEN_OUT: u64 = 3 << 56;

fn append_frame(out: &mut Vec<u8>, payload: &[u8]) {
    assert!(payload.len() <= FRAME_MAX);
    frame::append(out, payload);
}

enum LinkState {
    /// Not connected; try again at this time.
    Down(Instant),
    /// A non-blocking connect is under way.
    Connecting(TcpStream),
    Up(TcpStream),
}

/// Our outgoing connection to one peer.
struct Link {
    id: u64,
    addr: SocketAddr,
    state: LinkState,
    out: Vec<u8>,
    out_at: usize,
    watching_write: bool,
    /// Something queued must go out in this round.
    urgent: bool,
    /// When the oldest frame that may wait (see [`Peers::send_lazy`]) was queued.
    lazy_since: Option<Instant>,
}

/// A frame sent with [`Peers::send_lazy`] waits at most this long for company.
pub const LAZY_FLUSH: Duration = Duration::from_millis(2);
/// ... or until this much is queued.
const LAZY_BYTES: usize = 64 << 10;

/// Outgoing links, one per peer id. Frames are queued during a round of the replica loop
/// and written by [`Peers::flush`] without blocking; what the socket does not take now
/// goes when it becomes writable.
pub struct Peers {
    /// Nothing is queued while set (a test-only partition).
    pub muted: bool,
    me: u64,
    links: Vec<Option<Link>>,
    hello: Vec<u8>,
    poll: Arc<Poller>,
}

impl Peers {
    /// Links to every other replica (`addrs[i]` is replica `i + 1`), connected on demand.
    pub fn start(me: u64, addrs: &[SocketAddr], poll: Arc<Poller>) -> Peers {
        let now = Instant::now();
        let links = addrs
            .iter()
            .enumerate()
            .map(|(i, &addr)| {
                let id = i as u64 + 1;
                (id != me).then(|| Link {
                    id,
                    addr,
                    state: LinkState::Down(now),
                    out: Vec::new(),
                    out_at: 0,
                    watching_write: false,
                    urgent: false,
                    lazy_since: None,
                })
            })
            .collect();
        let mut hello = HELLO.to_vec();
        hello.extend_from_slice(&me.to_le_bytes());
        let mut framed = Vec::new();
        append_frame(&mut framed, &hello);
        let mut p = Peers {
            muted: false,
            me,
            links,
            hello: framed,
            poll,
        };
        p.reconnect_due();
        p
    }

    /// Queue a payload for `to` (written at the next flush). Dropped while the link is
    /// down or its queue is full.
    pub fn send(&mut self, to: u64, payload: &[u8]) {
        debug_assert!(to != self.me);
        if self.muted {
            return;
        }
        let i = (to as usize).wrapping_sub(1);
        if let Some(Some(link)) = self.links.get_mut(i) {
            link.queue(payload, false);
        }
    }

    /// Queue a frame that nobody waits on: it goes with the next urgent frame to the same
    /// peer, or after `LAZY_FLUSH`. A write and the peer's wake-up are the dearest part
    /// of a small message, so frames that only feed deferred work share them.
    pub fn send_lazy(&mut self, to: u64, payload: &[u8]) {
        debug_assert!(to != self.me);
        if self.muted {
            return;
        }
        if let Some(Some(link)) = self.links.get_mut((to as usize).wrapping_sub(1)) {
            link.queue(payload, true);
        }
    }

    pub fn broadcast(&mut self, payload: &[u8]) {
        if self.muted {
            return;
        }
        for link in self.links.iter_mut().flatten() {
            link.queue(payload, false);
        }
    }

    /// Write what is queued and due, as far as the sockets take it now.
    pub fn flush(&mut self) {
        let now = Instant::now();
        for link in self.links.iter_mut().flatten() {
            let lazy_due = link.lazy_since.is_some_and(|t| now >= t + LAZY_FLUSH);
            if link.urgent || lazy_due || link.out.len() - link.out_at >= LAZY_BYTES {
                link.write_some(&self.poll);
            }
        }
    }

    /// When the oldest lazy frame falls due, if one waits.
    pub fn lazy_deadline(&self) -> Option<Instant> {
        self.links
            .iter()
            .flatten()
            .filter_map(|l| l.lazy_since)
            .min()
            .map(|t| t + LAZY_FLUSH)
    }

    /// The socket of link `id` is ready (connected, writable, or failed).
    pub fn on_ready(&mut self, id: u64, read: bool) {
        let poll = self.poll.clone();
        let hello = self.hello.clone();
        let Some(Some(link)) = self.links.get_mut((id as usize).wrapping_sub(1)) else {
            return;
        };
        match &link.state {
            LinkState::Connecting(s) => match s.take_error() {
                Ok(None) if s.peer_addr().is_ok() => {
                    let LinkState::Connecting(s) = std::mem::replace(&mut link.state, LinkState::Down(Instant::now()))
                    else {
                        unreachable!()
                    };
                    link.state = LinkState::Up(s);
                    // The hello goes first, ahead of what was queued while connecting.
                    link.out.splice(link.out_at..link.out_at, hello);
                }
                _ => link.fail(&poll),
            },
            LinkState::Up(s) => {
                if read {
                    // Peers never write on our outgoing link: input means it closed.
                    let mut b = [0u8; 64];
                    match (&*s).read(&mut b) {
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                        _ => return link.fail(&poll),
                    }
                }
            }
            LinkState::Down(_) => {}
        }
        link.write_some(&poll);
    }

    /// Start connecting the links whose retry time has come.
    pub fn reconnect_due(&mut self) {
        let now = Instant::now();
        for link in self.links.iter_mut().flatten() {
            if let LinkState::Down(at) = link.state {
                if at <= now {
                    link.connect(&self.poll);
                }
            }
        }
    }
}

impl Link {
    fn queue(&mut self, payload: &[u8], lazy: bool) {
        let queued = self.out.len() - self.out_at;
        if matches!(self.state, LinkState::Down(_)) || (queued > 0 && queued + payload.len() > QUEUE_MAX) {
            return;
        }
        append_frame(&mut self.out, payload);
        if lazy {
            self.lazy_since.get_or_insert_with(Instant::now);
        } else {
            self.urgent = true;
        }
    }

    fn connect(&mut self, poll: &Poller) {
        self.discard_queue();
        match connect_nonblocking(self.addr) {
            Ok(s) => {
                let token = TOKEN_OUT | self.id;
                if poll.add(&s, token, Interest::BOTH).is_ok() {
                    self.watching_write = true;
                    self.state = LinkState::Connecting(s);
                    return;
                }
                self.state = LinkState::Down(Instant::now() + RECONNECT_AFTER);
            }
            Err(_) => self.state = LinkState::Down(Instant::now() + RECONNECT_AFTER),
        }
    }

    /// Drop the connection and what was queued on it; try again a little later.
    fn fail(&mut self, poll: &Poller) {
        if let LinkState::Up(s) | LinkState::Connecting(s) = &self.state {
            poll.remove(s);
        }
        self.state = LinkState::Down(Instant::now() + RECONNECT_AFTER);
        self.discard_queue();
        self.watching_write = false;
    }

    fn discard_queue(&mut self) {
        self.out.clear();
        self.out_at = 0;
        self.urgent = false;
        self.lazy_since = None;
    }

    fn write_some(&mut self, poll: &Poller) {
        let LinkState::Up(s) = &self.state else { return };
        let mut s: &TcpStream = s;
        while self.out_at < self.out.len() {
            match s.write(&self.out[self.out_at..]) {
                Ok(0) => return self.fail(poll),
                Ok(n) => self.out_at += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return self.fail(poll),
            }
        }
        if self.out_at == self.out.len() {
            // (Field by field: `s` still borrows the state.)
            self.out.clear();
            self.out_at = 0;
            self.urgent = false;
            self.lazy_since = None;
        } else if self.out_at >= QUEUE_MAX {
            self.out.drain(..self.out_at);
            self.out_at = 0;
        }
        let want_write = self.out_at < self.out.len();
        if want_write != self.watching_write {
            self.watching_write = want_write;
            // A link the poller no longer watches would stall: drop it and reconnect.
            if poll
                .modify(s, TOKEN_OUT | self.id, Interest::READ.with_write(want_write))
                .is_err()
            {
                self.fail(poll);
            }
        }
    }
}

/// Start a TCP connection without waiting for it: the socket reports writable (or an
/// error) when it is established.
fn connect_nonblocking(addr: SocketAddr) -> io::Result<TcpStream> {
    // SAFETY: sockaddr_storage is plain data; we fill in the family-specific prefix.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            // SAFETY: sockaddr_storage is large enough and aligned for sockaddr_in.
            let sin = unsafe { &mut *(&mut storage as *mut _ as *mut libc::sockaddr_in) };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_port = a.port().to_be();
            sin.sin_addr.s_addr = u32::from(*a.ip()).to_be();
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            // SAFETY: sockaddr_storage is large enough and aligned for sockaddr_in6.
            let sin6 = unsafe { &mut *(&mut storage as *mut _ as *mut libc::sockaddr_in6) };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_port = a.port().to_be();
            sin6.sin6_addr.s6_addr = a.ip().octets();
            sin6.sin6_scope_id = a.scope_id();
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    let family = storage.ss_family as libc::c_int;
    // SAFETY: socket takes no pointers; a non-negative result is a new fd we own.
    let fd = unsafe { libc::socket(family, libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a socket we just created and own from here on.
    let stream = unsafe { TcpStream::from_raw_fd(fd) };
    // SAFETY: storage holds a valid address of `len` bytes.
    let r = unsafe {
        libc::connect(
            fd,
            &storage as *const _ as *const libc::sockaddr,
            len as libc::socklen_t,
        )
    };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINPROGRESS) {
            return Err(e);
        }
    }
    // (latency only: a socket without it still works)
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

/// What an incoming link delivered or how it ended.
pub enum Incoming<'a> {
    Frame(u64, &'a [u8]),
    /// A peer said hello: the id it gave.
    Hello(u64),
}

/// An incoming connection: a stranger until its hello names a replica.
pub struct InLink {
    pub stream: TcpStream,
    /// The replica that said hello (None: a stranger).
    pub from: Option<u64>,
    pub accepted: Instant,
    buf: Vec<u8>,
    start: usize,
}

impl InLink {
    pub fn new(stream: TcpStream) -> InLink {
        // (latency only: a socket without it still works)
        let _ = stream.set_nodelay(true);
        InLink {
            stream,
            from: None,
            accepted: Instant::now(),
            buf: Vec::new(),
            start: 0,
        }
    }

    /// Whether the hello is overdue.
    pub fn hello_overdue(&self, now: Instant) -> bool {
        self.from.is_none() && now.duration_since(self.accepted) > HELLO_TIMEOUT
    }

    /// Read what arrived and hand each complete frame to `deliver`. `Err` (with why) means
    /// the connection is to be closed: end of stream, a bad frame, or a refused hello.
    pub fn on_readable(
        &mut self,
        scratch: &mut [u8],
        n_peers: u64,
        mut deliver: impl FnMut(Incoming<'_>) -> Result<(), String>,
    ) -> Result<(), String> {
        let mut taken = 0;
        while taken < READ_BURST {
            let n = match self.stream.read(scratch) {
                Ok(0) => return Err(String::new()),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e.to_string()),
            };
            taken += n;
            self.buf.extend_from_slice(&scratch[..n]);
            self.frames(n_peers, &mut deliver)?;
            if n < scratch.len() {
                break;
            }
        }
        Ok(())
    }

    fn frames(
        &mut self,
        n_peers: u64,
        deliver: &mut impl FnMut(Incoming<'_>) -> Result<(), String>,
    ) -> Result<(), String> {
        loop {
            let max = if self.from.is_some() { FRAME_MAX } else { HELLO_LEN };
            let (payload, len) = match frame::decode(&self.buf[self.start..], max) {
                Ok(frame::Decoded::Frame { payload, len }) => (payload, len),
                Ok(frame::Decoded::Incomplete) => break,
                Err(e) => return Err(e.to_string()),
            };
            match self.from {
                Some(from) => deliver(Incoming::Frame(from, payload))?,
                None => {
                    if payload.len() != HELLO_LEN || &payload[..8] != HELLO {
                        return Err("not a lockstep kv peer".into());
                    }
                    let from = le::u64_at(payload, 8);
                    if from == 0 || from > n_peers {
                        return Err(format!("unknown replica id {from}"));
                    }
                    deliver(Incoming::Hello(from))?;
                    self.from = Some(from);
                }
            }
            self.start += len;
        }
        if self.start == self.buf.len() {
            self.buf.clear();
            self.start = 0;
        } else if self.start > (1 << 20) {
            self.buf.drain(..self.start);
            self.start = 0;
        }
        Ok(())
    }
}

/// Incoming links by token, strangers in accept order (the oldest is evicted first).
#[derive(Default)]
pub struct InLinks {
    pub links: std::collections::HashMap<u64, InLink>,
    pub strangers: VecDeque<u64>,
}

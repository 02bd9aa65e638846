//! The I/O layer: one thread per replica runs an epoll loop over every socket it owns
//! (client connections, incoming and outgoing replica links, both listeners) and drives
//! the replica between waits. No request crosses a thread: a request is read, ordered,
//! applied and answered by the thread that owns the store, and the only wake-ups are the
//! kernel's (a socket became ready, or the next tick is due).
//!
//! Boundaries: this module knows sockets, framing and limits; what requests mean is the
//! replica's (behind [`Service`]). It never blocks except in `epoll_wait`.

pub mod client;
pub mod peer;
pub mod poll;

use crate::buffers::Buffers;
use crate::replica::Inbound;
use client::Client;
use peer::{InLink, InLinks, Incoming, Peers, PEERS_MAX, STRANGERS_MAX, TOKEN_OUT};
use poll::{Interest, Poller, Ready};
use std::collections::HashMap;
use std::io::{self, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A reply released by the replica: (connection, request sequence, bytes).
pub type Reply = (u64, u64, Vec<u8>);

/// Reply buffers a loop hands back per turn, and the largest it keeps: enough for a
/// turn's replies to every connection of a busy loop, at most 2 MiB held.
pub const SPENT_MAX: usize = 128;
pub const SPENT_BYTES_MAX: usize = 16 << 10;

/// Buffers going round between the event loop and the service, so that a request and
/// its reply cost no allocation in the steady state.
#[derive(Default)]
pub struct Recycle {
    /// Reply buffers the loop has copied out to their connections since the last turn
    /// (at most `SPENT_MAX`), for the service to write replies into (loop → service).
    pub replies: Vec<Vec<u8>>,
    /// Buffers of requests the service is done with (their replies are out), for the
    /// parser's next requests (service → loop; bounded by `Buffers`).
    pub requests: Buffers,
}

/// What the event loop drives.
pub trait Service {
    /// One round after a burst of input: take the messages from client connections,
    /// order, apply, settle, queue messages to peers, and hand over the replies released
    /// for this loop's connections, with buffers to reuse both ways (`Recycle`).
    fn turn(&mut self, msgs: &mut Vec<Inbound>, replies: &mut Vec<Reply>, recycle: &mut Recycle) -> Result<(), i32>;
    /// A frame from replica `from`.
    fn peer_frame(&mut self, from: u64, frame: &[u8]) -> Result<(), i32>;
    /// The outgoing replica links (None for a single replica).
    fn peers(&mut self) -> Option<&mut Peers>;
    /// The longest the loop may sleep.
    fn tick(&self) -> Duration;
}

const TOKEN_CLIENT_LISTENER: u64 = 0;
const TOKEN_PEER_LISTENER: u64 = 1;
const TOKEN_CLIENT: u64 = 1 << 56;
const TOKEN_IN: u64 = 2 << 56;
const TOKEN_KIND: u64 = 0xff << 56;
/// Connections accepted per readiness report of a listener, at most (fairness).
const ACCEPT_BURST: usize = 64;
/// Out of descriptors: the listener rests this long (the backlog keeps the connections).
const ACCEPT_PAUSE: Duration = Duration::from_millis(10);
/// Timers (hello deadlines, reconnects, a resting listener) are looked at this often.
const TIMER_EVERY: Duration = Duration::from_millis(10);

pub struct Listeners {
    pub clients: TcpListener,
    /// The replica port and the number of replicas (None for a single replica).
    pub peers: Option<(TcpListener, u64)>,
    pub max_conns: usize,
    pub item_max: usize,
    /// Client connections open now, over all loops sharing the client listener.
    pub live: Arc<AtomicUsize>,
    /// This loop's index among `loops` sharing the listener: connection ids are
    /// `k * loops + index`, unique over all of them.
    pub index: u64,
    pub loops: u64,
}

struct Loop<'a, S: Service> {
    svc: &'a mut S,
    poll: Arc<Poller>,
    listeners: Listeners,
    clients: HashMap<u64, Client>,
    next_client: u64,
    inlinks: InLinks,
    next_inlink: u64,
    scratch: Vec<u8>,
    /// Client messages for the replica, handed over after the burst of events.
    to_replica: Vec<Inbound>,
    replies: Vec<Reply>,
    /// Reply buffers copied out, for the service; request buffers, for the parser.
    recycle: Recycle,
    /// Clients with replies or output to deal with this round.
    touched: Vec<u64>,
    accept_paused_until: Option<Instant>,
}

/// Serve until the replica stops; returns its exit status.
pub fn serve<S: Service>(svc: &mut S, poll: Arc<Poller>, listeners: Listeners) -> i32 {
    let setup = || -> io::Result<()> {
        listeners.clients.set_nonblocking(true)?;
        poll.add(&listeners.clients, TOKEN_CLIENT_LISTENER, Interest::READ)?;
        if let Some((l, _)) = &listeners.peers {
            l.set_nonblocking(true)?;
            poll.add(l, TOKEN_PEER_LISTENER, Interest::READ)?;
        }
        Ok(())
    };
    if let Err(e) = setup() {
        eprintln!("lockstep kv: cannot watch the listening sockets: {e}");
        return 1;
    }
    let mut l = Loop {
        svc,
        poll,
        listeners,
        clients: HashMap::new(),
        next_client: 0,
        inlinks: InLinks::default(),
        next_inlink: 0,
        scratch: vec![0; 64 << 10],
        to_replica: Vec::new(),
        replies: Vec::new(),
        recycle: Recycle::default(),
        touched: Vec::new(),
        accept_paused_until: None,
    };
    match l.run() {
        Ok(()) => 0,
        Err(code) => code,
    }
}

impl<S: Service> Loop<'_, S> {
    fn run(&mut self) -> Result<(), i32> {
        let mut ready: Vec<Ready> = Vec::new();
        let mut next_timers = Instant::now();
        let mut next_round = Instant::now();
        loop {
            // Input parsed but not handed over yet (a pipeline that was waiting for room)
            // means there is work now.
            let timeout = if self.to_replica.is_empty() {
                next_round.min(next_timers).saturating_duration_since(Instant::now())
            } else {
                Duration::ZERO
            };
            if let Err(e) = self.poll.wait(timeout, &mut ready) {
                eprintln!("lockstep kv: epoll_wait: {e}");
                return Err(1);
            }
            for r in &ready {
                self.on_event(*r)?;
            }
            self.svc
                .turn(&mut self.to_replica, &mut self.replies, &mut self.recycle)?;
            next_round = Instant::now() + self.svc.tick();
            self.answer_clients()?;
            let now = Instant::now();
            if now >= next_timers {
                self.timers(now);
                next_timers = now + TIMER_EVERY;
            }
        }
    }

    fn on_event(&mut self, r: Ready) -> Result<(), i32> {
        match r.token & TOKEN_KIND {
            _ if r.token == TOKEN_CLIENT_LISTENER => self.accept_clients(),
            _ if r.token == TOKEN_PEER_LISTENER => self.accept_peers(),
            TOKEN_CLIENT => {
                let id = r.token & !TOKEN_KIND;
                if let Some(c) = self.clients.get_mut(&id) {
                    if r.read {
                        c.on_readable(&mut self.scratch, &mut self.to_replica, &mut self.recycle.requests);
                    }
                    self.touched.push(id);
                }
            }
            TOKEN_IN => return self.on_inlink(r.token),
            TOKEN_OUT => {
                if let Some(p) = self.svc.peers() {
                    p.on_ready(r.token & !TOKEN_KIND, r.read);
                }
            }
            _ => {}
        }
        Ok(())
    }

    fn accept_clients(&mut self) {
        for _ in 0..ACCEPT_BURST {
            let stream = match self.listeners.clients.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EMFILE) | Some(libc::ENFILE) | Some(libc::ENOMEM)
                    ) =>
                {
                    // Out of descriptors: rest instead of spinning on the ready listener.
                    self.poll
                        .modify(&self.listeners.clients, TOKEN_CLIENT_LISTENER, Interest::NONE)
                        .ok();
                    self.accept_paused_until = Some(Instant::now() + ACCEPT_PAUSE);
                    return;
                }
                // A connection reset before we took it.
                Err(_) => continue,
            };
            if self.listeners.live.load(Ordering::Relaxed) >= self.listeners.max_conns {
                // memcached's behaviour past its -c: say so and close.
                let _ = (&stream).write(b"ERROR Too many open connections\r\n");
                continue;
            }
            let id = self.next_client * self.listeners.loops + self.listeners.index;
            self.next_client += 1;
            let token = TOKEN_CLIENT | id;
            if stream.set_nonblocking(true).is_err() || self.poll.add(&stream, token, Interest::READ).is_err() {
                continue;
            }
            // (latency only: a socket without it still works)
            let _ = stream.set_nodelay(true);
            self.listeners.live.fetch_add(1, Ordering::Relaxed);
            self.clients
                .insert(id, Client::new(stream, id, self.listeners.item_max));
            self.to_replica.push(Inbound::Open { conn: id });
        }
    }

    fn accept_peers(&mut self) {
        let Some((listener, _)) = &self.listeners.peers else {
            return;
        };
        for _ in 0..ACCEPT_BURST {
            let stream = match listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(_) => return,
            };
            if self.inlinks.strangers.len() >= STRANGERS_MAX {
                // The stranger that has waited longest makes room.
                if let Some(oldest) = self.inlinks.strangers.pop_front() {
                    self.inlinks.links.remove(&oldest);
                }
            }
            let token = TOKEN_IN | self.next_inlink;
            self.next_inlink += 1;
            if stream.set_nonblocking(true).is_err() || self.poll.add(&stream, token, Interest::READ).is_err() {
                continue;
            }
            self.inlinks.links.insert(token, InLink::new(stream));
            self.inlinks.strangers.push_back(token);
        }
    }

    fn on_inlink(&mut self, token: u64) -> Result<(), i32> {
        let n_peers = self.listeners.peers.as_ref().map_or(0, |(_, n)| *n);
        let authenticated = self.inlinks.links.len() - self.inlinks.strangers.len();
        let Some(link) = self.inlinks.links.get_mut(&token) else {
            return Ok(());
        };
        let svc = &mut *self.svc;
        let mut fatal = None;
        let result = link.on_readable(&mut self.scratch, n_peers, |got| match got {
            Incoming::Hello(from) if authenticated >= PEERS_MAX => Err(format!(
                "replica {from}: more than {PEERS_MAX} connections from replicas"
            )),
            Incoming::Hello(_) => Ok(()),
            Incoming::Frame(from, frame) => svc.peer_frame(from, frame).map_err(|code| {
                fatal = Some(code);
                String::new()
            }),
        });
        if let Some(code) = fatal {
            return Err(code);
        }
        let said_hello = link.from.is_some();
        let peer = result.is_err().then(|| link.stream.peer_addr().ok()).flatten();
        if said_hello {
            self.inlinks.strangers.retain(|t| *t != token);
        }
        if let Err(why) = result {
            self.inlinks.links.remove(&token);
            self.inlinks.strangers.retain(|t| *t != token);
            if !why.is_empty() {
                let who = peer.map_or("a replica link".to_string(), |p| p.to_string());
                self.to_replica
                    .push(Inbound::PeerError(format!("{who}: {why}; connection closed")));
            }
        }
        Ok(())
    }

    /// Hand released replies to their connections and write what is due.
    fn answer_clients(&mut self) -> Result<(), i32> {
        for (conn, seq, reply) in self.replies.drain(..) {
            if let Some(c) = self.clients.get_mut(&conn) {
                c.reply(seq, reply);
                self.touched.push(conn);
            }
        }
        // The list is taken out and put back, emptied, so that its memory serves every turn.
        let mut touched = std::mem::take(&mut self.touched);
        touched.sort_unstable();
        touched.dedup();
        for &id in &touched {
            let Some(c) = self.clients.get_mut(&id) else { continue };
            c.release(Some(&mut self.recycle.replies));
            if !c.flush(
                &self.poll,
                TOKEN_CLIENT | id,
                &mut self.to_replica,
                &mut self.recycle.requests,
            ) {
                self.clients.remove(&id);
                self.listeners.live.fetch_sub(1, Ordering::Relaxed);
                self.to_replica.push(Inbound::Closed { conn: id });
            }
        }
        touched.clear();
        self.touched = touched;
        Ok(())
    }

    fn timers(&mut self, now: Instant) {
        let overdue: Vec<u64> = self
            .inlinks
            .strangers
            .iter()
            .copied()
            .filter(|t| self.inlinks.links.get(t).is_some_and(|l| l.hello_overdue(now)))
            .collect();
        for t in overdue {
            self.inlinks.links.remove(&t);
            self.inlinks.strangers.retain(|s| *s != t);
        }
        if let Some(p) = self.svc.peers() {
            p.reconnect_due();
        }
        if self.accept_paused_until.is_some_and(|at| at <= now) {
            self.accept_paused_until = None;
            self.poll
                .modify(&self.listeners.clients, TOKEN_CLIENT_LISTENER, Interest::READ)
                .ok();
        }
    }
}

//! Replica-to-replica transport: one TCP connection per direction and peer, carrying
//! frames `[u32 len][u32 crc32c(payload)][payload]`. The first frame on a connection is a
//! hello naming the sender. A frame that is too long, fails its CRC or does not parse
//! closes the connection; the replica keeps running and Raft retransmits.
//!
//! Nothing a peer sends makes us spend before it is checked: a frame's length is checked
//! against the limit first and its payload is read as it arrives (a header claiming
//! 256 MiB costs nothing until 256 MiB come); the hello is at most 16 bytes and must come
//! within a few seconds. At most `STRANGERS_MAX` connections wait for their hello at once:
//! a newcomer past that closes the one that has waited longest, so a flood of silent
//! strangers never keeps a real replica that reconnects from getting in; and at most
//! `PEERS_MAX` connections that said hello are served.

use crate::replica::{Inbound, Inbox};
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

/// Larger frames are refused (a snapshot of a full 64 MiB store fits).
pub const FRAME_MAX: usize = 256 << 20;
/// Frames queued for one peer before new ones are dropped (the peer is slow or down).
const QUEUE: usize = 8192;
const HELLO: &[u8; 8] = b"LSKVPEER";
/// The hello's payload: the magic and the sender's id.
const HELLO_LEN: usize = 16;
/// An unauthenticated connection must say hello within this time.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// Incoming connections waiting for their hello at once.
const STRANGERS_MAX: usize = 16;
/// Incoming connections that said hello, served at once (a replica keeps one, and a few
/// more while it reconnects after a failure).
const PEERS_MAX: usize = 32;

pub fn encode_frame(payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(payload.len() + 8);
    append_frame(&mut f, payload);
    f
}

fn append_frame(out: &mut Vec<u8>, payload: &[u8]) {
    assert!(payload.len() <= FRAME_MAX);
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&lockstep_core::crc32c(payload).to_le_bytes());
    out.extend_from_slice(payload);
}

/// Read one frame of at most `max` bytes; `Err` on EOF, a bad CRC or an oversize length.
/// The payload buffer grows as bytes arrive, never ahead of them.
pub fn read_frame(r: &mut impl Read, max: usize) -> std::io::Result<Vec<u8>> {
    let mut head = [0u8; 8];
    r.read_exact(&mut head)?;
    let len = u32::from_le_bytes(head[..4].try_into().unwrap()) as usize;
    let crc = u32::from_le_bytes(head[4..].try_into().unwrap());
    if len > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("frame of {len} bytes (at most {max})"),
        ));
    }
    let mut payload = Vec::with_capacity(len.min(64 << 10));
    r.take(len as u64).read_to_end(&mut payload)?;
    if payload.len() != len {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    if lockstep_core::crc32c(&payload) != crc {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "frame CRC mismatch",
        ));
    }
    Ok(payload)
}

/// Outgoing queues, one per peer id. Frames are collected during one round of the
/// replica loop and handed to each peer's sender thread in one piece by [`Peers::flush`]:
/// one wake-up per peer and round instead of one per message.
pub struct Peers {
    me: u64,
    queues: Vec<Option<SyncSender<Vec<u8>>>>,
    pending: Vec<Vec<u8>>,
}

impl Peers {
    /// Start a sender thread per peer (`addrs[i]` is replica `i + 1`).
    pub fn start(me: u64, addrs: &[SocketAddr]) -> Peers {
        let queues: Vec<_> = addrs
            .iter()
            .enumerate()
            .map(|(i, &addr)| {
                let id = i as u64 + 1;
                if id == me {
                    return None;
                }
                let (tx, rx) = sync_channel(QUEUE);
                thread::Builder::new()
                    .name(format!("peer-out-{id}"))
                    .spawn(move || sender(me, addr, rx))
                    .expect("spawn peer sender");
                Some(tx)
            })
            .collect();
        let pending = vec![Vec::new(); queues.len()];
        Peers { me, queues, pending }
    }

    /// Queue a payload for `to` (sent at the next flush).
    pub fn send(&mut self, to: u64, payload: &[u8]) {
        debug_assert!(to != self.me);
        let i = (to as usize).wrapping_sub(1);
        if self.queues.get(i).is_some_and(|q| q.is_some()) {
            append_frame(&mut self.pending[i], payload);
        }
    }

    pub fn broadcast(&mut self, payload: &[u8]) {
        for i in 0..self.queues.len() {
            if self.queues[i].is_some() {
                append_frame(&mut self.pending[i], payload);
            }
        }
    }

    /// Hand what was queued to the sender threads; dropped for a peer whose queue is full
    /// (it is slow or down; Raft resends what matters).
    pub fn flush(&mut self) {
        for (q, buf) in self.queues.iter().zip(self.pending.iter_mut()) {
            if let (Some(q), false) = (q, buf.is_empty()) {
                match q.try_send(std::mem::take(buf)) {
                    Ok(()) | Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {}
                }
            }
        }
    }
}

fn sender(me: u64, addr: SocketAddr, rx: Receiver<Vec<u8>>) {
    let mut hello = HELLO.to_vec();
    hello.extend_from_slice(&me.to_le_bytes());
    let hello = encode_frame(&hello);
    'connect: loop {
        let stream = match TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
            Ok(s) => s,
            Err(_) => {
                // Drop what piled up while the peer is away; Raft resends what matters.
                while rx.try_recv().is_ok() {}
                thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let mut w = BufWriter::with_capacity(64 << 10, stream);
        if w.write_all(&hello).and_then(|_| w.flush()).is_err() {
            continue;
        }
        loop {
            let Ok(frame) = rx.recv() else { return };
            if w.write_all(&frame).is_err() {
                continue 'connect;
            }
            // Batch whatever else is queued into the same write.
            while let Ok(more) = rx.try_recv() {
                if w.write_all(&more).is_err() {
                    continue 'connect;
                }
            }
            if w.flush().is_err() {
                continue 'connect;
            }
        }
    }
}

/// Accept peer connections and forward their frames to the replica.
pub fn listen(listener: TcpListener, n_peers: u64, to_node: Inbox) {
    let strangers: Strangers = Default::default();
    let peers = Arc::new(AtomicUsize::new(0));
    thread::Builder::new()
        .name("peer-accept".into())
        .spawn(move || {
            for (token, stream) in listener.incoming().flatten().enumerate() {
                let Ok(handle) = stream.try_clone() else { continue };
                {
                    let mut waiting = strangers.lock().unwrap_or_else(|p| p.into_inner());
                    if waiting.len() >= STRANGERS_MAX {
                        // The one that has waited longest makes room (its thread then
                        // fails its read and ends).
                        if let Some((_, oldest)) = waiting.pop_front() {
                            let _ = oldest.shutdown(std::net::Shutdown::Both);
                        }
                    }
                    waiting.push_back((token, handle));
                }
                let (to_node, strangers, peers) = (to_node.clone(), strangers.clone(), peers.clone());
                let _ = thread::Builder::new().name("peer-in".into()).spawn(move || {
                    receive(stream, token, n_peers, to_node, &strangers, &peers);
                });
            }
        })
        .expect("spawn peer listener");
}

/// Connections still waiting for their hello, oldest first, by accept order.
type Strangers = Arc<std::sync::Mutex<std::collections::VecDeque<(usize, TcpStream)>>>;

fn receive(stream: TcpStream, token: usize, n_peers: u64, to_node: Inbox, strangers: &Strangers, peers: &AtomicUsize) {
    let peer = stream.peer_addr().ok();
    let _ = stream.set_nodelay(true);
    let _ = stream.set_read_timeout(Some(HELLO_TIMEOUT));
    let mut r = BufReader::with_capacity(64 << 10, stream);
    let hello = read_frame(&mut r, HELLO_LEN);
    strangers
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .retain(|(t, _)| *t != token);
    let from = match hello {
        Ok(h) if h.len() == HELLO_LEN && &h[..8] == HELLO => u64::from_le_bytes(h[8..].try_into().unwrap()),
        _ => {
            let _ = to_node.send(Inbound::PeerError(format!(
                "{peer:?}: not a lockstep kv peer; connection closed"
            )));
            return;
        }
    };
    if from == 0 || from > n_peers {
        let _ = to_node.send(Inbound::PeerError(format!(
            "{peer:?}: unknown replica id {from}; connection closed"
        )));
        return;
    }
    if peers.fetch_add(1, Ordering::Relaxed) >= PEERS_MAX {
        peers.fetch_sub(1, Ordering::Relaxed);
        let _ = to_node.send(Inbound::PeerError(format!(
            "replica {from}: more than {PEERS_MAX} connections from replicas; closed"
        )));
        return;
    }
    let _ = r.get_ref().set_read_timeout(None);
    serve_peer(&mut r, from, &to_node);
    peers.fetch_sub(1, Ordering::Relaxed);
}

/// Forward a replica's frames until its connection ends.
fn serve_peer(r: &mut BufReader<TcpStream>, from: u64, to_node: &Inbox) {
    loop {
        match read_frame(r, FRAME_MAX) {
            Ok(frame) => {
                if to_node.send(Inbound::Peer { from, frame }).is_err() {
                    return;
                }
            }
            Err(e) => {
                if e.kind() != std::io::ErrorKind::UnexpectedEof {
                    let _ = to_node.send(Inbound::PeerError(format!("replica {from}: {e}; connection closed")));
                }
                return;
            }
        }
    }
}

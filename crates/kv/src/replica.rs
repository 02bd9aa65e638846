//! One replica: the thread that owns the store, orders requests (directly, or through
//! Raft), applies them, cross-checks their state deltas with the other replicas and
//! repairs its objects when it is the odd one out.
//!
//! Data flow: client connection → `Inbound::Request` → batch → Raft entry → committed →
//! `apply` (store + delta) → CHECK to peers → `Validator` → reply released to the
//! connection. A replica that FAILED a request proposes RECOVER; when RECOVER is applied
//! the healthy replicas send REPAIR with the packed objects, and the failed one replaces
//! them before it applies anything else.

use crate::check::{Outcome, ReplyTo, ReqId, Validator};
use crate::command::Command;
use crate::conn;
use crate::peer::{self, Peers};
use crate::storage::LogStore;
use crate::store::{Limits, Store, Target};
use lockstep_core::{Event, EventSink};
use lockstep_guard::{Delta, ObjectId, Packer, Pair, UnpackError, Unpacker};
use prost::Message as _;
use raft::eraftpb::{ConfChange, ConfChangeV2, Entry, EntryType, Message};
use raft::{RawNode, StateRole};
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The configurations of CrossCheck's Table IV.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// One process, no replication, no object protection ("----").
    Single,
    /// Raft-replicated, deterministic apply, no protection ("RD--").
    Smr,
    /// Plus checksummed objects checked on every access ("RDG-").
    Gop,
    /// Plus cross-checked state deltas and repair ("RDGX").
    CrossCheck,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Single => "single",
            Mode::Smr => "smr",
            Mode::Gop => "gop",
            Mode::CrossCheck => "crosscheck",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Config {
    /// 1-based replica id.
    pub id: u64,
    /// Replica-to-replica addresses, `peers[i]` is replica `i + 1` (empty for single).
    pub peers: Vec<SocketAddr>,
    pub client: SocketAddr,
    pub mode: Mode,
    pub data_dir: Option<PathBuf>,
    pub fsync: bool,
    pub limits: Limits,
    pub test_corruption: bool,
    pub events: Option<PathBuf>,
    /// Applied entries between snapshots (and log compactions).
    pub snapshot_every: u64,
    /// Raft tick.
    pub tick: Duration,
}

/// What the replica thread is told.
pub enum Inbound {
    Open { conn: u64, tx: Sender<(u64, Vec<u8>)> },
    Closed { conn: u64 },
    Request { conn: u64, seq: u64, cmd: Command },
    Stats { conn: u64, seq: u64, args: Vec<String> },
    Local { conn: u64, seq: u64, line: String },
    Peer { from: u64, frame: Vec<u8> },
    PeerError(String),
}

const ENTRY_BATCH: u8 = 1;
const ENTRY_RECOVER: u8 = 2;
const MSG_RAFT: u8 = 1;
const MSG_CHECK: u8 = 2;
const MSG_REPAIR: u8 = 3;

/// Requests per log entry, at most.
const BATCH_MAX: usize = 256;
/// A request that is not applied this long after it arrived is answered with an error.
const ORDER_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the healthy replicas give a failed one to propose its own recovery.
const STEP_IN_AFTER: Duration = Duration::from_secs(1);
/// A replica in recovery that gets no REPAIR this long after RECOVER stops (exit 86).
const REPAIR_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Default)]
struct Counters {
    requests: u64,
    cmd_get: u64,
    cmd_set: u64,
    get_hits: u64,
    get_misses: u64,
    curr_connections: u64,
    total_connections: u64,
    /// Objects found corrupt by their own check on this replica.
    self_detections: u64,
    /// Requests where this replica saw another replica (or itself) disagree.
    divergences: u64,
    recoveries: u64,
    false_positives: u64,
    repair_bytes: u64,
    repair_objects: u64,
    last_recovery_us: u64,
    max_recovery_us: u64,
    held_dropped: u64,
    order_timeouts: u64,
}

struct Recovery {
    round: u64,
    started: Instant,
    objects: Vec<ObjectId>,
    /// Committed entries that arrived while waiting for the repair.
    buffered: VecDeque<(u64, Vec<u8>)>,
}

struct RaftPart {
    node: RawNode<LogStore>,
    storage: LogStore,
    peers: Peers,
    last_tick: Instant,
    snap_index: u64,
}

pub struct Replica {
    cfg: Config,
    n: usize,
    store: Store,
    delta: Delta,
    events: EventSink,
    conns: HashMap<u64, Sender<(u64, Vec<u8>)>>,
    batch: Vec<(u64, u64, Command)>,
    /// (conn, seq) → when it arrived, for requests not applied yet.
    inflight: HashMap<(u64, u64), Instant>,
    raft: Option<RaftPart>,
    validator: Option<Validator>,
    recovery: Option<Recovery>,
    /// Objects to name in the next RECOVER, per target replica, and when to propose it.
    /// A failed replica proposes its own recovery at once; the others wait a moment and
    /// only step in if it does not (one RECOVER per fault instead of one per replica).
    to_recover: HashMap<u64, (BTreeSet<ObjectId>, Instant)>,
    /// A RECOVER for this target is in the log but not applied yet.
    recover_proposed: HashMap<u64, Instant>,
    applied: u64,
    incarnation: u64,
    started: Instant,
    counters: Counters,
}

/// Start a replica and serve until a fatal error. Returns the exit status.
pub fn run(cfg: Config) -> i32 {
    let client = match TcpListener::bind(cfg.client) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("lockstep kv: cannot listen for clients on {}: {e}", cfg.client);
            return 1;
        }
    };
    let (tx, rx) = channel();
    let replicated = cfg.mode != Mode::Single;
    if replicated {
        let me = cfg.peers[cfg.id as usize - 1];
        let listener = match TcpListener::bind(me) {
            Ok(l) => l,
            Err(e) => {
                eprintln!("lockstep kv: cannot listen for replicas on {me}: {e}");
                return 1;
            }
        };
        peer::listen(listener, cfg.peers.len() as u64, tx.clone());
    }
    let mut replica = match Replica::new(cfg) {
        Ok(r) => r,
        Err((code, msg)) => {
            eprintln!("lockstep kv: {msg}");
            return code;
        }
    };
    let item_max = replica.store.limits().item_max;
    let accept_tx = tx.clone();
    thread::Builder::new()
        .name("client-accept".into())
        .spawn(move || {
            for (conn, stream) in client.incoming().flatten().enumerate() {
                let tx = accept_tx.clone();
                let _ = thread::Builder::new()
                    .name("client".into())
                    .spawn(move || conn::serve(stream, conn as u64, tx, item_max));
            }
        })
        .expect("spawn client acceptor");
    drop(tx);
    replica.serve(rx)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl Replica {
    fn new(cfg: Config) -> Result<Self, (i32, String)> {
        let n = cfg.peers.len().max(1);
        let mut events = EventSink::new(cfg.events.as_deref(), true)
            .map_err(|e| (1, format!("cannot open the events file: {e}")))?;
        let mut store = Store::new(cfg.limits.clone());
        let mut raft = None;
        let mut applied = 0;
        if cfg.mode != Mode::Single {
            assert!(cfg.id >= 1 && cfg.id as usize <= n, "replica id out of range");
            let voters: Vec<u64> = (1..=n as u64).collect();
            let storage = match &cfg.data_dir {
                Some(dir) => LogStore::open(dir, voters, cfg.fsync).map_err(|e| {
                    let code = if e.kind() == std::io::ErrorKind::InvalidData {
                        lockstep_core::exit::DETECTED
                    } else {
                        1
                    };
                    (code, format!("cannot open the data directory {}: {e}", dir.display()))
                })?,
                None => LogStore::new(voters),
            };
            let (snap_index, data) = storage.snapshot_data();
            if snap_index > 0 {
                store = Store::restore(cfg.limits.clone(), &data).map_err(|e| {
                    (
                        lockstep_core::exit::DETECTED,
                        format!("the stored snapshot does not restore: {e}"),
                    )
                })?;
                applied = snap_index;
            }
            if storage.is_restored() {
                events.emit(
                    Event::new("kv", "restart", "continue")
                        .replica(cfg.id as u32)
                        .message(format!(
                            "replica {} restarts from its data directory at entry {snap_index}",
                            cfg.id
                        )),
                );
            }
            let rc = raft::Config {
                id: cfg.id,
                election_tick: 10,
                heartbeat_tick: 2,
                applied,
                max_size_per_msg: 1 << 20,
                max_inflight_msgs: 256,
                check_quorum: true,
                pre_vote: true,
                ..Default::default()
            };
            rc.validate().map_err(|e| (2, format!("raft configuration: {e}")))?;
            let logger = slog::Logger::root(slog::Discard, slog::o!());
            let node = RawNode::new(&rc, storage.clone(), &logger).map_err(|e| (1, format!("raft: {e}")))?;
            let peers = Peers::start(cfg.id, &cfg.peers);
            raft = Some(RaftPart {
                node,
                storage,
                peers,
                last_tick: Instant::now(),
                snap_index,
            });
        }
        let validator = (cfg.mode == Mode::CrossCheck).then(|| Validator::new(n, cfg.id));
        let delta = if matches!(cfg.mode, Mode::Single | Mode::Smr) {
            Delta::unchecked()
        } else {
            Delta::new()
        };
        Ok(Replica {
            n,
            store,
            delta,
            events,
            conns: HashMap::new(),
            batch: Vec::new(),
            inflight: HashMap::new(),
            raft,
            validator,
            recovery: None,
            to_recover: HashMap::new(),
            recover_proposed: HashMap::new(),
            applied,
            incarnation: now_ms() ^ (std::process::id() as u64) << 40,
            started: Instant::now(),
            counters: Counters::default(),
            cfg,
        })
    }

    fn serve(&mut self, rx: Receiver<Inbound>) -> i32 {
        self.events.emit(
            Event::new("kv", "start", "continue")
                .replica(self.cfg.id as u32)
                .message(format!(
                    "replica {} of {} serving memcached on {} ({} mode)",
                    self.cfg.id,
                    self.n,
                    self.cfg.client,
                    self.cfg.mode.name()
                )),
        );
        loop {
            match rx.recv_timeout(self.cfg.tick) {
                Ok(m) => {
                    if let Err(code) = self.handle(m) {
                        return code;
                    }
                    // Everything already queued joins the same batch and Ready.
                    while let Ok(m) = rx.try_recv() {
                        if let Err(code) = self.handle(m) {
                            return code;
                        }
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return 0,
            }
            if let Err(code) = self.step() {
                return code;
            }
        }
    }

    /// One round after a burst of input: propose, tick, process Raft's Ready, settle.
    fn step(&mut self) -> Result<(), i32> {
        if self.raft.is_none() {
            let batch = std::mem::take(&mut self.batch);
            if !batch.is_empty() {
                let data = self.encode_batch(&batch);
                self.apply(self.applied + 1, &data)?;
            }
            return Ok(());
        }
        self.propose_batch();
        self.propose_recovers();
        let tick = {
            let r = self.raft.as_mut().unwrap();
            if r.last_tick.elapsed() >= self.cfg.tick {
                r.last_tick = Instant::now();
                r.node.tick();
                true
            } else {
                false
            }
        };
        self.on_ready()?;
        if tick {
            self.housekeeping()?;
        }
        Ok(())
    }

    fn handle(&mut self, m: Inbound) -> Result<(), i32> {
        match m {
            Inbound::Open { conn, tx } => {
                self.counters.curr_connections += 1;
                self.counters.total_connections += 1;
                self.conns.insert(conn, tx);
            }
            Inbound::Closed { conn } => {
                self.counters.curr_connections -= 1;
                self.conns.remove(&conn);
            }
            Inbound::Request { conn, seq, cmd } => {
                self.inflight.insert((conn, seq), Instant::now());
                self.batch.push((conn, seq, cmd));
                if self.batch.len() >= BATCH_MAX {
                    self.propose_batch();
                }
            }
            Inbound::Stats { conn, seq, args } => {
                let reply = self.stats(&args);
                self.send_reply(conn, seq, reply);
            }
            Inbound::Local { conn, seq, line } => {
                let reply = self.local_command(&line);
                self.send_reply(conn, seq, reply.into_bytes());
            }
            Inbound::Peer { from, frame } => self.on_peer(from, &frame)?,
            Inbound::PeerError(msg) => {
                self.events.emit(Event::new("kv", "peer-error", "close").message(msg));
            }
        }
        Ok(())
    }

    fn send_reply(&mut self, conn: u64, seq: u64, reply: Vec<u8>) {
        self.inflight.remove(&(conn, seq));
        if let Some(tx) = self.conns.get(&conn) {
            let _ = tx.send((seq, reply));
        }
    }

    // ---- ordering -------------------------------------------------------------------

    fn encode_batch(&self, batch: &[(u64, u64, Command)]) -> Vec<u8> {
        let mut p = Packer::default();
        p.u8(ENTRY_BATCH);
        p.u64(now_ms());
        p.u64(self.cfg.id);
        p.u64(self.incarnation);
        p.u32(batch.len() as u32);
        for (conn, seq, cmd) in batch {
            p.u64(*conn);
            p.u64(*seq);
            cmd.encode(&mut p);
        }
        p.buf
    }

    fn propose_batch(&mut self) {
        if self.batch.is_empty() {
            return;
        }
        let data = self.encode_batch(&self.batch);
        let r = self.raft.as_mut().expect("replicated");
        // Without a known leader the proposal would be dropped: keep the batch for later.
        if r.node.raft.leader_id == raft::INVALID_ID {
            return;
        }
        if r.node.propose(vec![], data).is_ok() {
            self.batch.clear();
        }
    }

    fn propose_recovers(&mut self) {
        if self.to_recover.is_empty() {
            return;
        }
        let now = Instant::now();
        let due: Vec<u64> = self
            .to_recover
            .iter()
            .filter(|(_, (_, at))| *at <= now)
            .map(|(t, _)| *t)
            .collect();
        for target in due {
            if self.recover_proposed.contains_key(&target) {
                continue;
            }
            let (ids, at) = self.to_recover.remove(&target).unwrap();
            let mut p = Packer::default();
            p.u8(ENTRY_RECOVER);
            p.u64(target);
            p.u32(ids.len() as u32);
            for id in &ids {
                p.u64(id.0);
            }
            let r = self.raft.as_mut().unwrap();
            if r.node.raft.leader_id != raft::INVALID_ID && r.node.propose(vec![], p.buf).is_ok() {
                self.recover_proposed.insert(target, Instant::now());
            } else {
                self.to_recover.insert(target, (ids, at));
            }
        }
    }

    fn on_ready(&mut self) -> Result<(), i32> {
        let mut to_apply: Vec<Entry> = Vec::new();
        let mut snapshot = None;
        {
            let r = self.raft.as_mut().unwrap();
            if !r.node.has_ready() {
                return Ok(());
            }
            let mut rd = r.node.ready();
            send_all(&r.peers, rd.take_messages());
            if !rd.snapshot().is_empty() {
                let s = rd.snapshot().clone();
                if let Err(e) = r.storage.apply_snapshot(s.clone()) {
                    return Err(self.fatal_io("install a snapshot", e));
                }
                snapshot = Some(s);
            }
            to_apply.extend(rd.take_committed_entries());
            if let Err(e) = r.storage.append(rd.entries()) {
                return Err(self.fatal_io("append to the log", e));
            }
            if let Some(hs) = rd.hs() {
                let r = self.raft.as_mut().unwrap();
                if let Err(e) = r.storage.set_hard_state(hs) {
                    return Err(self.fatal_io("save the hard state", e));
                }
            }
            let r = self.raft.as_mut().unwrap();
            send_all(&r.peers, rd.take_persisted_messages());
            let mut light = r.node.advance(rd);
            if let Some(c) = light.commit_index() {
                if let Err(e) = r.storage.set_commit(c) {
                    return Err(self.fatal_io("save the commit index", e));
                }
            }
            let r = self.raft.as_mut().unwrap();
            send_all(&r.peers, light.take_messages());
            to_apply.extend(light.take_committed_entries());
        }
        if let Some(s) = snapshot {
            let index = s.get_metadata().index;
            match Store::restore(self.cfg.limits.clone(), &s.data) {
                Ok(store) => {
                    self.store = store;
                    self.applied = index;
                    self.raft.as_mut().unwrap().snap_index = index;
                    self.events.emit(
                        Event::new("kv", "snapshot", "continue")
                            .replica(self.cfg.id as u32)
                            .message(format!(
                                "installed a snapshot at entry {index} ({} bytes)",
                                s.data.len()
                            )),
                    );
                }
                Err(e) => {
                    self.halt(format!("a snapshot from the leader does not restore: {e}"));
                    return Err(lockstep_core::exit::DETECTED);
                }
            }
        }
        for e in to_apply {
            if e.index <= self.applied {
                continue;
            }
            match e.get_entry_type() {
                EntryType::EntryNormal => {
                    if e.data.is_empty() {
                        self.applied = e.index;
                    } else {
                        self.apply(e.index, &e.data)?;
                    }
                }
                EntryType::EntryConfChange | EntryType::EntryConfChangeV2 => {
                    let r = self.raft.as_mut().unwrap();
                    let cs = if e.get_entry_type() == EntryType::EntryConfChange {
                        let cc = ConfChange::decode(&e.data[..]).unwrap_or_default();
                        r.node.apply_conf_change(&cc)
                    } else {
                        let cc = ConfChangeV2::decode(&e.data[..]).unwrap_or_default();
                        r.node.apply_conf_change(&cc)
                    };
                    if let Ok(cs) = cs {
                        let _ = r.storage.set_conf_state(cs);
                    }
                    self.applied = e.index;
                }
            }
        }
        // Raft's applied index only paces what it hands out; entries held back during a
        // recovery are this replica's to apply later.
        self.raft.as_mut().unwrap().node.advance_apply();
        Ok(())
    }

    fn fatal_io(&mut self, what: &str, e: std::io::Error) -> i32 {
        self.events.emit(
            Event::new("kv", "halt", "exit")
                .replica(self.cfg.id as u32)
                .message(format!(
                    "cannot {what}: {e}; stopping rather than acknowledging what is not stored"
                )),
        );
        1
    }

    fn halt(&mut self, why: String) {
        self.events.emit(
            Event::new("kv", "halt", "exit 86")
                .replica(self.cfg.id as u32)
                .message(why),
        );
    }

    // ---- apply ----------------------------------------------------------------------

    fn apply(&mut self, index: u64, data: &[u8]) -> Result<(), i32> {
        if let Some(rec) = self.recovery.as_mut() {
            rec.buffered.push_back((index, data.to_vec()));
            return Ok(());
        }
        let mut u = Unpacker::new(data);
        let result = match u.u8() {
            Ok(ENTRY_BATCH) => self.apply_batch(index, &mut u),
            Ok(ENTRY_RECOVER) => self.apply_recover(index, &mut u),
            _ => Err(UnpackError("unknown entry kind")),
        };
        match result {
            Ok(()) => {
                self.applied = index;
                Ok(())
            }
            Err(e) => {
                // Every replica decodes the same bytes; an entry we cannot decode was
                // corrupted here after it was checksummed, or the log is damaged.
                self.halt(format!("entry {index} does not decode: {e}"));
                Err(lockstep_core::exit::DETECTED)
            }
        }
    }

    fn apply_batch(&mut self, index: u64, u: &mut Unpacker<'_>) -> Result<(), UnpackError> {
        let time = u.u64()?;
        let origin = u.u64()?;
        let incarnation = u.u64()?;
        let n = u.u32()?;
        let mine = origin == self.cfg.id && incarnation == self.incarnation;
        let mut check = Packer::default();
        check.u8(MSG_CHECK);
        check.u64(index);
        check.u32(n);
        let mut outcomes = Vec::new();
        for pos in 0..n {
            let conn = u.u64()?;
            let seq = u.u64()?;
            let cmd = Command::decode(u)?;
            self.delta.clear();
            let reply = self.store.apply(&cmd, time, &mut self.delta);
            self.count(&cmd, &reply);
            if !self.delta.corrupt().is_empty() {
                self.counters.self_detections += 1;
                let ids: Vec<String> = self.delta.corrupt().iter().map(|i| i.to_string()).collect();
                self.events.emit(
                    Event::new("kv", "detect", "cross-check")
                        .replica(self.cfg.id as u32)
                        .object(ids.join(","))
                        .message(format!(
                            "entry {index}.{pos}: object {} failed its checksum on access",
                            ids.join(",")
                        )),
                );
            }
            let to = (mine && self.inflight.remove(&(conn, seq)).is_some()).then_some(ReplyTo { conn, seq });
            match self.validator.as_mut() {
                None => {
                    if let Some(to) = to {
                        self.send_reply(to.conn, to.seq, reply);
                    }
                }
                Some(v) => {
                    let pairs = self.delta.finish().to_vec();
                    check.u32(pos);
                    encode_pairs(&mut check, &pairs);
                    outcomes.extend(v.local(ReqId { index, pos }, pairs, reply, origin, to));
                }
            }
        }
        if !u.is_empty() {
            return Err(UnpackError("trailing bytes in batch"));
        }
        if self.validator.is_some() {
            self.raft.as_ref().unwrap().peers.broadcast(&check.buf);
        }
        self.settle(outcomes);
        Ok(())
    }

    fn count(&mut self, cmd: &Command, reply: &[u8]) {
        self.counters.requests += 1;
        match cmd {
            Command::Get { keys, .. } => {
                self.counters.cmd_get += keys.len() as u64;
                let hits = reply.windows(6).filter(|w| w == b"VALUE ").count() as u64;
                self.counters.get_hits += hits;
                self.counters.get_misses += keys.len() as u64 - hits.min(keys.len() as u64);
            }
            Command::Store { .. } => self.counters.cmd_set += 1,
            _ => {}
        }
    }

    fn settle(&mut self, outcomes: Vec<Outcome>) {
        for o in outcomes {
            match o {
                Outcome::Release { to, reply } => self.send_reply(to.conn, to.seq, reply),
                Outcome::Failed { replica, req, objects } => {
                    self.counters.divergences += 1;
                    let names: Vec<String> = objects.iter().map(|i| i.to_string()).collect();
                    self.events.emit(
                        Event::new("kv", "divergence", "recover")
                            .replica(replica as u32)
                            .object(names.join(","))
                            .message(format!(
                                "entry {}.{}: replica {replica} disagrees with the majority on {} object(s) ({})",
                                req.index,
                                req.pos,
                                objects.len(),
                                names.join(",")
                            )),
                    );
                    // The reply pseudo-object is not repaired; the right reply travels in
                    // the REPAIR itself.
                    let due = if replica == self.cfg.id {
                        Instant::now()
                    } else {
                        Instant::now() + STEP_IN_AFTER
                    };
                    let (set, _) = self.to_recover.entry(replica).or_insert_with(|| (BTreeSet::new(), due));
                    set.extend(objects.into_iter().filter(|o| *o != Delta::REPLY));
                    if set.is_empty() {
                        // Only the reply differed: the state is fine, but the client still
                        // needs the right reply, which a (possibly empty) repair carries.
                        set.insert(ObjectId(0));
                    }
                }
                Outcome::NoMajority { req } => {
                    self.halt(format!(
                        "entry {}.{}: no majority of replicas agrees on the state delta; no reply can be trusted",
                        req.index, req.pos
                    ));
                    std::process::exit(lockstep_core::exit::DETECTED);
                }
            }
        }
    }

    // ---- recovery -------------------------------------------------------------------

    fn apply_recover(&mut self, index: u64, u: &mut Unpacker<'_>) -> Result<(), UnpackError> {
        let target = u.u64()?;
        let n = u.u32()? as usize;
        if n > u.rest().len() / 8 {
            return Err(UnpackError("object count exceeds entry"));
        }
        let mut objects = Vec::with_capacity(n);
        for _ in 0..n {
            objects.push(ObjectId(u.u64()?));
        }
        self.recover_proposed.remove(&target);
        // This round covers what we were about to ask for on the target's behalf.
        if target != self.cfg.id {
            self.to_recover.remove(&target);
        }
        if target == self.cfg.id {
            self.counters.recoveries += 1;
            self.events.emit(
                Event::new("kv", "recover", "wait-repair")
                    .replica(target as u32)
                    .message(format!(
                        "entry {index}: recovering {} object(s) from the healthy replicas",
                        objects.len()
                    )),
            );
            self.recovery = Some(Recovery {
                round: index,
                started: Instant::now(),
                objects,
                buffered: VecDeque::new(),
            });
            return Ok(());
        }
        // Pack our copies (as of this entry, the same point of the log as the target's).
        let mut p = Packer::default();
        p.u8(MSG_REPAIR);
        p.u64(index);
        let real: Vec<ObjectId> = objects.into_iter().filter(|o| o.0 != 0).collect();
        if real.iter().any(|&id| !self.store.object_ok(id)) {
            self.events.emit(
                Event::new("kv", "repair-refused", "none")
                    .replica(self.cfg.id as u32)
                    .message(format!(
                        "entry {index}: our own copy of an object to repair fails its check; not sending it"
                    )),
            );
            return Ok(());
        }
        p.u32(real.len() as u32);
        for id in &real {
            p.u64(id.0);
            let mut obj = Packer::default();
            let present = self.store.pack_object(*id, &mut obj);
            p.u8(present as u8);
            p.u32(self.store.object_crc(*id));
            p.bytes(&obj.buf);
        }
        let owed = self.validator.as_mut().map(|v| v.take_owed(target)).unwrap_or_default();
        p.u32(owed.len() as u32);
        for (req, reply) in &owed {
            p.u64(req.index);
            p.u32(req.pos);
            p.bytes(reply);
        }
        self.raft.as_ref().unwrap().peers.send(target, &p.buf);
        Ok(())
    }

    fn on_repair(&mut self, from: u64, u: &mut Unpacker<'_>) -> Result<(), UnpackError> {
        let round = u.u64()?;
        let Some(rec) = self.recovery.as_ref() else {
            return Ok(());
        };
        if rec.round != round {
            return Ok(());
        }
        // Decode everything before touching the store: a malformed repair changes nothing.
        let n = u.u32()? as usize;
        let mut objects = Vec::new();
        for _ in 0..n {
            let id = ObjectId(u.u64()?);
            let present = u.u8()? != 0;
            let crc = u.u32()?;
            let bytes = u.bytes()?.to_vec();
            objects.push((id, present, crc, bytes));
        }
        let m = u.u32()? as usize;
        let mut replies = Vec::new();
        for _ in 0..m {
            let req = ReqId {
                index: u.u64()?,
                pos: u.u32()?,
            };
            replies.push((req, u.bytes()?.to_vec()));
        }
        let mut changed = 0;
        let mut bytes = 0;
        for (id, present, crc, data) in &objects {
            let same = self.store.object_crc(*id) == *crc && self.store.object_ok(*id);
            if same {
                continue;
            }
            self.store.replace_object(*id, present.then_some(&data[..]))?;
            if self.store.object_crc(*id) != *crc {
                return Err(UnpackError("repaired object does not have the advertised CRC"));
            }
            changed += 1;
            bytes += data.len() as u64;
        }
        let rec = self.recovery.take().unwrap();
        let us = rec.started.elapsed().as_micros() as u64;
        self.counters.repair_objects += changed;
        self.counters.repair_bytes += bytes;
        self.counters.last_recovery_us = us;
        self.counters.max_recovery_us = self.counters.max_recovery_us.max(us);
        let named = rec.objects.iter().filter(|o| o.0 != 0).count();
        if changed == 0 && named > 0 {
            self.counters.false_positives += 1;
        }
        let mut released = 0;
        for (req, reply) in replies {
            if let Some(to) = self.validator.as_mut().and_then(|v| v.take_held(req)) {
                self.send_reply(to.conn, to.seq, reply);
                released += 1;
            }
        }
        self.events.emit(
            Event::new("kv", "repair", "continue")
                .replica(self.cfg.id as u32)
                .object(rec.objects.iter().map(|o| o.to_string()).collect::<Vec<_>>().join(","))
                .duration_us(us)
                .message(format!(
                    "replaced {changed} of {named} named object(s) ({bytes} bytes) from replica {from}; {released} held repl{} released{}",
                    if released == 1 { "y" } else { "ies" },
                    if changed == 0 && named > 0 { "; nothing differed after synchronisation (false positive)" } else { "" }
                )),
        );
        // Apply what was committed in the meantime.
        for (index, data) in rec.buffered {
            if self.apply(index, &data).is_err() {
                return Err(UnpackError("buffered entry failed"));
            }
        }
        Ok(())
    }

    // ---- peers ----------------------------------------------------------------------

    fn on_peer(&mut self, from: u64, frame: &[u8]) -> Result<(), i32> {
        let mut u = Unpacker::new(frame);
        let result = match u.u8() {
            Ok(MSG_RAFT) => match Message::decode(u.rest()) {
                Ok(m) => {
                    let r = self.raft.as_mut().unwrap();
                    let _ = r.node.step(m);
                    Ok(())
                }
                Err(_) => Err(UnpackError("raft message does not decode")),
            },
            Ok(MSG_CHECK) => self.on_check(from, &mut u),
            Ok(MSG_REPAIR) => self.on_repair(from, &mut u),
            _ => Err(UnpackError("unknown message type")),
        };
        if let Err(e) = result {
            self.events.emit(
                Event::new("kv", "peer-error", "drop")
                    .replica(from as u32)
                    .message(format!("message from replica {from} dropped: {e}")),
            );
        }
        Ok(())
    }

    fn on_check(&mut self, from: u64, u: &mut Unpacker<'_>) -> Result<(), UnpackError> {
        let index = u.u64()?;
        let n = u.u32()?;
        let mut reqs = Vec::new();
        for _ in 0..n {
            let pos = u.u32()?;
            reqs.push((ReqId { index, pos }, decode_pairs(u)?));
        }
        let Some(v) = self.validator.as_mut() else {
            return Ok(());
        };
        let mut outcomes = Vec::new();
        for (id, pairs) in reqs {
            outcomes.extend(v.remote(from, id, pairs));
        }
        self.settle(outcomes);
        Ok(())
    }

    // ---- periodic -------------------------------------------------------------------

    fn housekeeping(&mut self) -> Result<(), i32> {
        let now = Instant::now();
        // Requests that could not be ordered in time get an error, not silence.
        let late: Vec<(u64, u64)> = self
            .inflight
            .iter()
            .filter(|(_, t)| now.duration_since(**t) > ORDER_TIMEOUT)
            .map(|(k, _)| *k)
            .collect();
        if !late.is_empty() {
            self.batch.retain(|(c, s, _)| !late.contains(&(*c, *s)));
            for (conn, seq) in late {
                self.counters.order_timeouts += 1;
                self.send_reply(
                    conn,
                    seq,
                    b"SERVER_ERROR request not ordered in time (no quorum?)\r\n".to_vec(),
                );
            }
        }
        self.recover_proposed
            .retain(|_, t| now.duration_since(*t) < ORDER_TIMEOUT);
        if let Some(v) = self.validator.as_mut() {
            let (dropped, _) = v.expire(now);
            for to in dropped {
                self.counters.held_dropped += 1;
                // An empty reply closes the client's connection: no unvalidated reply leaves.
                self.send_reply(to.conn, to.seq, Vec::new());
            }
        }
        if let Some(rec) = &self.recovery {
            if rec.started.elapsed() > REPAIR_TIMEOUT {
                self.halt(format!(
                    "no healthy replica repaired entry {}'s objects within {:?}; refusing to serve corrupt state",
                    rec.round, REPAIR_TIMEOUT
                ));
                return Err(lockstep_core::exit::DETECTED);
            }
        }
        // Snapshot and compact the log now and then, or when a peer needs one.
        let r = self.raft.as_mut().unwrap();
        let wanted = r.storage.take_snapshot_wanted();
        if self.recovery.is_none()
            && self.applied > r.snap_index
            && (wanted || self.applied - r.snap_index >= self.cfg.snapshot_every)
        {
            let data = self.store.snapshot();
            let applied = self.applied;
            if let Err(e) = r.storage.compact(applied, data) {
                return Err(self.fatal_io("write a snapshot", e));
            }
            self.raft.as_mut().unwrap().snap_index = applied;
        }
        Ok(())
    }

    // ---- local commands -------------------------------------------------------------

    fn local_command(&mut self, line: &str) -> String {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words[..] {
            ["lockstep_digest"] => {
                let (digest, bad) = self.store.digest();
                format!("DIGEST {digest:016x} {} {bad}\r\n", self.applied)
            }
            ["lockstep_corrupt", key, what, ref rest @ ..] if self.cfg.test_corruption => {
                let target = match what {
                    "item" => Target::Item,
                    "bucket" => Target::Bucket,
                    "links" => Target::Links,
                    _ => {
                        return "CLIENT_ERROR usage: lockstep_corrupt <key> item|bucket|links [recompute] [bit]\r\n"
                            .into()
                    }
                };
                let recompute = rest.contains(&"recompute");
                let bit = rest.iter().find_map(|w| w.parse::<u64>().ok()).unwrap_or(3);
                match self.store.corrupt(key.as_bytes(), target, bit, recompute) {
                    Some(id) => {
                        self.events.emit(
                            Event::new("kv", "inject", "flip")
                                .replica(self.cfg.id as u32)
                                .object(id.to_string())
                                .message(format!(
                                    "test corruption: flipped a bit of object {id} ({what} of {key:?}{})",
                                    if recompute { ", CRC recomputed" } else { "" }
                                )),
                        );
                        format!("CORRUPTED {id}\r\n")
                    }
                    None => "NOT_FOUND\r\n".into(),
                }
            }
            ["lockstep_corrupt", ..] => {
                "CLIENT_ERROR test corruption is off (start the replica with --test-corruption)\r\n".into()
            }
            _ => "ERROR\r\n".into(),
        }
    }

    fn stats(&self, args: &[String]) -> Vec<u8> {
        let mut out = String::new();
        let mut stat = |k: &str, v: String| out.push_str(&format!("STAT {k} {v}\r\n"));
        let g = self.store.stats();
        let c = &self.counters;
        if args.is_empty() || args[0] == "kv" {
            if args.is_empty() {
                stat("pid", std::process::id().to_string());
                stat("uptime", self.started.elapsed().as_secs().to_string());
                stat("time", (now_ms() / 1000).to_string());
                stat("version", env!("CARGO_PKG_VERSION").to_string());
                stat("curr_connections", c.curr_connections.to_string());
                stat("total_connections", c.total_connections.to_string());
                stat("cmd_get", c.cmd_get.to_string());
                stat("cmd_set", c.cmd_set.to_string());
                stat("get_hits", c.get_hits.to_string());
                stat("get_misses", c.get_misses.to_string());
                stat("curr_items", g.items.to_string());
                stat("bytes", g.bytes.to_string());
                stat("limit_maxbytes", self.store.limits().memory_bytes.to_string());
                stat("evictions", g.evictions.to_string());
            }
            let role = match &self.raft {
                None => "single".to_string(),
                Some(r) => match r.node.raft.state {
                    StateRole::Leader => "leader".into(),
                    StateRole::Follower => "follower".into(),
                    _ => "candidate".into(),
                },
            };
            stat("kv_mode", self.cfg.mode.name().into());
            stat("kv_replica", self.cfg.id.to_string());
            stat("kv_role", role);
            stat("kv_applied", self.applied.to_string());
            stat("kv_requests", c.requests.to_string());
            stat("kv_detections", c.self_detections.to_string());
            stat("kv_divergences", c.divergences.to_string());
            stat("kv_recoveries", c.recoveries.to_string());
            stat("kv_false_positives", c.false_positives.to_string());
            stat("kv_repair_objects", c.repair_objects.to_string());
            stat("kv_repair_bytes", c.repair_bytes.to_string());
            stat("kv_last_recovery_us", c.last_recovery_us.to_string());
            stat("kv_max_recovery_us", c.max_recovery_us.to_string());
            stat("kv_held_dropped", c.held_dropped.to_string());
            stat("kv_order_timeouts", c.order_timeouts.to_string());
            stat(
                "kv_pending_validation",
                self.validator.as_ref().map_or(0, |v| v.pending()).to_string(),
            );
        }
        out.push_str("END\r\n");
        out.into_bytes()
    }
}

fn send_all(peers: &Peers, msgs: Vec<Message>) {
    for m in msgs {
        let mut buf = Vec::with_capacity(m.encoded_len() + 1);
        buf.push(MSG_RAFT);
        m.encode(&mut buf).expect("encoding into a Vec cannot fail");
        peers.send(m.to, &buf);
    }
}

fn encode_pairs(p: &mut Packer, pairs: &[Pair]) {
    p.u32(pairs.len() as u32);
    for (id, crc) in pairs {
        p.u64(id.0);
        p.u32(*crc);
    }
}

fn decode_pairs(u: &mut Unpacker<'_>) -> Result<Vec<Pair>, UnpackError> {
    let n = u.u32()? as usize;
    if n > u.rest().len() / 12 {
        return Err(UnpackError("pair count exceeds message"));
    }
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        v.push((ObjectId(u.u64()?), u.u32()?));
    }
    Ok(v)
}

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
use raft::eraftpb::{ConfChange, ConfChangeType, ConfChangeV2, Entry, EntryType, Message, MessageType};
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
    /// A replica recovered more than this many times within `recovery_window` is removed
    /// from the cluster and re-added empty, to be rebuilt from a snapshot.
    pub max_recoveries: usize,
    pub recovery_window: Duration,
    /// The replica thread making no progress for this long stops the process (exit 86).
    pub watchdog: Duration,
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
    replacements: u64,
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
    config: raft::Config,
    storage: LogStore,
    peers: Peers,
    last_tick: Instant,
    snap_index: u64,
    /// Wiped for replacement and not yet rebuilt from a snapshot.
    rejoining: bool,
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
    /// Log times of the RECOVER entries applied per target (the replacement policy; every
    /// replica computes the same from the log).
    recover_times: HashMap<u64, VecDeque<u64>>,
    /// Requests this replica FAILED since its last recovery round.
    unrepaired_failures: u64,
    /// REPAIR messages that arrived before we applied their RECOVER, by round.
    early_repairs: std::collections::BTreeMap<u64, (u64, Vec<u8>)>,
    /// Replicas the log has decided to replace (removed, then re-added empty).
    replace: BTreeSet<u64>,
    /// Beats of the replica thread, for the watchdog.
    heartbeat: std::sync::Arc<std::sync::atomic::AtomicU64>,
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
                config: rc,
                storage,
                peers,
                last_tick: Instant::now(),
                snap_index,
                rejoining: false,
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
            recover_times: HashMap::new(),
            replace: BTreeSet::new(),
            early_repairs: Default::default(),
            unrepaired_failures: 0,
            heartbeat: Default::default(),
            incarnation: now_ms() ^ (std::process::id() as u64) << 40,
            started: Instant::now(),
            counters: Counters::default(),
            cfg,
        })
    }

    fn serve(&mut self, rx: Receiver<Inbound>) -> i32 {
        self.start_watchdog();
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
            self.heartbeat.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// A thread that stops the process when the replica thread stops making progress (a
    /// corrupted loop condition, a deadlock): exit 86, never a silent hang. The replica
    /// thread beats at least once per tick.
    fn start_watchdog(&self) {
        let beats = self.heartbeat.clone();
        let limit = self.cfg.watchdog;
        let mut events = EventSink::stderr_only();
        let id = self.cfg.id as u32;
        thread::Builder::new()
            .name("watchdog".into())
            .spawn(move || {
                let mut last = beats.load(std::sync::atomic::Ordering::Relaxed);
                let mut since = Instant::now();
                loop {
                    thread::sleep(limit / 4);
                    let now = beats.load(std::sync::atomic::Ordering::Relaxed);
                    if now != last {
                        last = now;
                        since = Instant::now();
                    } else if since.elapsed() >= limit {
                        events.emit(Event::new("kv", "halt", "exit 86").replica(id).message(format!(
                            "watchdog: the replica thread made no progress for {limit:?}; stopping"
                        )));
                        std::process::exit(lockstep_core::exit::DETECTED);
                    }
                }
            })
            .expect("spawn watchdog");
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
        self.raft.as_mut().unwrap().peers.flush();
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
            p.u64(now_ms());
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
            send_all(&mut r.peers, rd.take_messages());
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
            send_all(&mut r.peers, rd.take_persisted_messages());
            let mut light = r.node.advance(rd);
            if let Some(c) = light.commit_index() {
                if let Err(e) = r.storage.set_commit(c) {
                    return Err(self.fatal_io("save the commit index", e));
                }
            }
            let r = self.raft.as_mut().unwrap();
            send_all(&mut r.peers, light.take_messages());
            to_apply.extend(light.take_committed_entries());
        }
        if let Some(s) = snapshot {
            let index = s.get_metadata().index;
            match Store::restore(self.cfg.limits.clone(), &s.data) {
                Ok(store) => {
                    self.store = store;
                    self.applied = index;
                    let r = self.raft.as_mut().unwrap();
                    r.snap_index = index;
                    r.rejoining = false;
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
                EntryType::EntryConfChange => {
                    let cc = ConfChange::decode(&e.data[..]).unwrap_or_default();
                    let r = self.raft.as_mut().unwrap();
                    if let Ok(cs) = r.node.apply_conf_change(&cc) {
                        if let Err(err) = r.storage.set_conf_state(cs) {
                            return Err(self.fatal_io("save the configuration", err));
                        }
                    }
                    self.applied = e.index;
                    let removed = cc.get_change_type() == ConfChangeType::RemoveNode;
                    self.events.emit(
                        Event::new("kv", "membership", "continue")
                            .replica(cc.node_id as u32)
                            .message(format!(
                                "entry {}: replica {} {}",
                                e.index,
                                cc.node_id,
                                if removed { "removed" } else { "added" }
                            )),
                    );
                    if removed {
                        self.replace.remove(&cc.node_id);
                        if cc.node_id == self.cfg.id {
                            return self.wipe_and_rejoin();
                        }
                    } else if cc.node_id != self.cfg.id && self.recovery.is_none() {
                        // The re-added replica must be rebuilt from a snapshot that names it
                        // in its configuration, not by replaying the log that removed it.
                        let r = self.raft.as_mut().unwrap();
                        if let Err(err) = r.storage.compact(self.applied, self.store.snapshot()) {
                            return Err(self.fatal_io("write a snapshot", err));
                        }
                        r.snap_index = self.applied;
                    }
                }
                EntryType::EntryConfChangeV2 => {
                    let cc = ConfChangeV2::decode(&e.data[..]).unwrap_or_default();
                    let r = self.raft.as_mut().unwrap();
                    if let Ok(cs) = r.node.apply_conf_change(&cc) {
                        if let Err(err) = r.storage.set_conf_state(cs) {
                            return Err(self.fatal_io("save the configuration", err));
                        }
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
            self.raft.as_mut().unwrap().peers.broadcast(&check.buf);
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
                    if replica == self.cfg.id {
                        self.unrepaired_failures += 1;
                    }
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
        let time = u.u64()?;
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
        self.count_recovery(index, time, target);
        // This round covers what we were about to ask for on the target's behalf.
        if target != self.cfg.id {
            self.to_recover.remove(&target);
        }
        if target == self.cfg.id && self.unrepaired_failures == 0 {
            // We know of no request we failed: the entry is being replayed after a restart
            // (the replayed state is clean), or the others stepped in before our CHECKs
            // told us. Either way there is nothing to wait for; if we are wrong, the next
            // comparison says so and we ask again.
            self.events.emit(
                Event::new("kv", "recover-skip", "continue")
                    .replica(target as u32)
                    .message(format!(
                        "entry {index}: RECOVER for us, but we know of no failed request; not waiting for a repair"
                    )),
            );
            return Ok(());
        }
        if target == self.cfg.id {
            self.unrepaired_failures = 0;
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
            // A healthy replica may have applied the RECOVER, and sent its REPAIR, before
            // we got here.
            if let Some((from, frame)) = self.early_repairs.remove(&index) {
                let mut u = Unpacker::new(&frame);
                u.u8()?;
                self.on_repair(from, &mut u)?;
            }
            self.early_repairs.retain(|&round, _| round > index);
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
        self.raft.as_mut().unwrap().peers.send(target, &p.buf);
        Ok(())
    }

    /// Too many recoveries of one replica within the window: the log decides, identically
    /// on every replica, that it is to be replaced.
    fn count_recovery(&mut self, index: u64, time: u64, target: u64) {
        let window = self.cfg.recovery_window.as_millis() as u64;
        let times = self.recover_times.entry(target).or_default();
        times.push_back(time);
        while times.front().is_some_and(|&t| t + window < time) {
            times.pop_front();
        }
        if times.len() > self.cfg.max_recoveries && self.replace.insert(target) {
            times.clear();
            self.events.emit(Event::new("kv", "replace", "membership-change").replica(target as u32).message(format!(
                "entry {index}: replica {target} needed more than {} recoveries within {:?}; it will be removed and re-added from a snapshot",
                self.cfg.max_recoveries, self.cfg.recovery_window
            )));
        }
    }

    /// The leader carries out replacements: remove the replica, and re-add every configured
    /// replica that is not a voter (after a fresh snapshot, so that it is rebuilt from one).
    fn manage_membership(&mut self) {
        let me = self.cfg.id;
        let r = self.raft.as_mut().unwrap();
        if r.node.raft.state != StateRole::Leader || r.node.raft.has_pending_conf() {
            return;
        }
        let voters = r.node.raft.prs().conf().to_conf_state().voters;
        if let Some(&x) = self.replace.iter().find(|x| voters.contains(x)) {
            if x == me {
                // A leader does not remove itself: hand leadership to a healthy voter.
                if let Some(&other) = voters.iter().find(|&&v| v != me && !self.replace.contains(&v)) {
                    r.node.transfer_leader(other);
                }
                return;
            }
            let mut cc = ConfChange::default();
            cc.set_change_type(ConfChangeType::RemoveNode);
            cc.node_id = x;
            let _ = r.node.propose_conf_change(b"replace".to_vec(), cc);
            return;
        }
        let configured = self.cfg.peers.len() as u64;
        if let Some(x) = (1..=configured).find(|x| !voters.contains(x) && !self.replace.contains(x)) {
            let mut cc = ConfChange::default();
            cc.set_change_type(ConfChangeType::AddNode);
            cc.node_id = x;
            if r.node.propose_conf_change(b"rejoin".to_vec(), cc).is_ok() {
                self.events.emit(
                    Event::new("kv", "rejoin", "membership-change")
                        .replica(x as u32)
                        .message(format!(
                            "proposed to add replica {x} back; it will be rebuilt from a snapshot"
                        )),
                );
            }
        }
    }

    /// This replica was removed to be replaced: drop every piece of state (the store, the
    /// log, pending validations) and wait, empty, to be added back and sent a snapshot.
    /// The Raft term and vote are kept, so that it can never vote twice in one term.
    fn wipe_and_rejoin(&mut self) -> Result<(), i32> {
        self.counters.replacements += 1;
        self.events.emit(Event::new("kv", "replace", "wipe").replica(self.cfg.id as u32).message(
            "removed from the cluster for replacement: discarding all state; waiting to be re-added and sent a snapshot",
        ));
        let pending: Vec<(u64, u64)> = self.inflight.keys().copied().collect();
        for (conn, seq) in pending {
            self.send_reply(conn, seq, Vec::new());
        }
        self.batch.clear();
        let old = self.raft.take().expect("replicated");
        let hard = raft::Storage::initial_state(&old.storage)
            .map(|s| s.hard_state)
            .unwrap_or_default();
        let storage = match &self.cfg.data_dir {
            Some(dir) => {
                for f in ["state", "log", "snapshot"] {
                    let _ = std::fs::remove_file(dir.join(f));
                }
                LogStore::open(dir, vec![], self.cfg.fsync).map_err(|e| self.fatal_io("reset the data directory", e))?
            }
            None => LogStore::new(vec![]),
        };
        let kept = raft::eraftpb::HardState {
            term: hard.term,
            vote: hard.vote,
            ..Default::default()
        };
        storage
            .set_hard_state(&kept)
            .map_err(|e| self.fatal_io("reset the hard state", e))?;
        let mut config = old.config.clone();
        config.applied = 0;
        let logger = slog::Logger::root(slog::Discard, slog::o!());
        let node = RawNode::new(&config, storage.clone(), &logger).map_err(|e| {
            self.halt(format!("cannot restart raft after replacement: {e}"));
            lockstep_core::exit::DETECTED
        })?;
        self.raft = Some(RaftPart {
            node,
            config,
            storage,
            peers: old.peers,
            last_tick: Instant::now(),
            snap_index: 0,
            rejoining: true,
        });
        self.store = Store::new(self.cfg.limits.clone());
        self.validator = Some(Validator::new(self.n, self.cfg.id));
        self.recovery = None;
        self.to_recover.clear();
        self.recover_proposed.clear();
        self.recover_times.clear();
        self.replace.clear();
        self.early_repairs.clear();
        self.unrepaired_failures = 0;
        self.applied = 0;
        Ok(())
    }

    fn on_repair(&mut self, from: u64, u: &mut Unpacker<'_>) -> Result<(), UnpackError> {
        let round = u.u64()?;
        let waiting = self.recovery.as_ref().map(|r| r.round);
        if waiting != Some(round) {
            // A repair for a RECOVER we have not applied yet: keep the first one until we
            // reach it (bounded: at most a few rounds can be ahead of us).
            if round > self.applied && waiting.is_none_or(|w| round > w) && self.early_repairs.len() < 16 {
                let mut frame = vec![MSG_REPAIR];
                frame.extend_from_slice(&round.to_le_bytes());
                frame.extend_from_slice(u.rest());
                self.early_repairs.entry(round).or_insert((from, frame));
            }
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
                Ok(mut m) => {
                    let r = self.raft.as_mut().unwrap();
                    // A wiped replica may still get heartbeats sent before the leader applied
                    // its removal, committing entries it no longer has; it only commits what
                    // it holds until its snapshot arrives.
                    if r.rejoining && m.get_msg_type() == MessageType::MsgHeartbeat {
                        m.commit = m.commit.min(r.node.raft.raft_log.last_index());
                    }
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
        self.manage_membership();
        // Snapshot and compact the log now and then, or when a peer needs one.
        let r = self.raft.as_mut().unwrap();
        let wanted = r.storage.take_snapshot_wanted();
        // A wanted snapshot may repeat the last index: it refreshes the configuration in it.
        if self.recovery.is_none()
            && self.applied > 0
            && (wanted || self.applied.saturating_sub(r.snap_index) >= self.cfg.snapshot_every)
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
            stat("kv_replacements", c.replacements.to_string());
            stat(
                "kv_pending_validation",
                self.validator.as_ref().map_or(0, |v| v.pending()).to_string(),
            );
        }
        out.push_str("END\r\n");
        out.into_bytes()
    }
}

fn send_all(peers: &mut Peers, msgs: Vec<Message>) {
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

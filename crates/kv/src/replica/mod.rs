//! One replica: the thread that owns the store, orders requests (directly, or through
//! Raft), applies them, cross-checks their state deltas with the other replicas and
//! repairs its objects when it is the odd one out.
//!
//! Data flow: client connection → `Inbound::Request` → batch → Raft entry → committed →
//! `apply` (store + delta) → CHECK to peers → `Validator` → reply released to the
//! connection. A replica that FAILED a request proposes RECOVER; when RECOVER is applied
//! the healthy replicas send REPAIR with the packed objects, and the failed one replaces
//! them before it applies anything else.

use crate::buffers::Buffers;
use crate::check::{self, Executed, KeptReply, Outcome, ReplyTo, ReqId, Validator};
use crate::command::{Command, Decoder};
use crate::dedupe::Applied;
use crate::net::peer::Peers;
use crate::net::poll::Poller;
use crate::net::{self, Listeners, Recycle, Reply, Service, SPENT_MAX};
use crate::storage::LogStore;
use crate::store::{Limits, Store, Target};
use lockstep_core::{Event, EventSink};
use lockstep_guard::{Delta, ObjectId, Packer, UnpackError, Unpacker};
use prost::Message as _;
use raft::eraftpb::{ConfChange, ConfChangeType, ConfChangeV2, Entry, EntryType, Message, MessageType};
use raft::{RawNode, StateRole};
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

mod admin;
mod audit;
mod raft_io;
mod recovery;

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
    /// Applied entries between audits (each with a snapshot and a log compaction).
    pub snapshot_every: u64,
    /// Time between state audits (proposed by the leader).
    pub audit_every: Duration,
    /// Raft tick.
    pub tick: Duration,
    /// A replica recovered more than this many times within `recovery_window` is removed
    /// from the cluster and re-added empty, to be rebuilt from a snapshot.
    pub max_recoveries: usize,
    pub recovery_window: Duration,
    /// The replica thread making no progress for this long stops the process (exit 86).
    pub watchdog: Duration,
    /// Client connections served at once (memcached's `-c`).
    pub max_conns: usize,
    /// Event loops in single mode (0: one per CPU, at most 4).
    pub threads: u64,
}

/// Pending client connections the kernel holds for us (memcached's default).
const LISTEN_BACKLOG: i32 = 1024;
/// Bytes reserved per request for an entry's encoded deltas (the detail behind its
/// digest), so that the buffer is allocated once per entry, not grown request by request.
const DELTA_BYTES_HINT: usize = 192;
/// The most a replica keeps of its spare reply buffer (a multi-get's reply can be large).
const SPARE_REPLY_MAX: usize = 1 << 20;

/// What the replica is told by its client connections and links.
pub enum Inbound {
    Open {
        conn: u64,
    },
    Closed {
        conn: u64,
    },
    Request {
        conn: u64,
        seq: u64,
        cmd: Command,
    },
    Stats {
        conn: u64,
        seq: u64,
        args: Vec<String>,
    },
    Local {
        conn: u64,
        seq: u64,
        line: String,
        queued_behind: bool,
    },
    PeerError(String),
}

const ENTRY_BATCH: u8 = 1;
const ENTRY_RECOVER: u8 = 2;
const ENTRY_AUDIT: u8 = 3;
const MSG_RAFT: u8 = 1;
const MSG_CHECK: u8 = 2;
const MSG_DIGEST: u8 = 5;
const MSG_REPAIR: u8 = 3;
const MSG_AUDIT: u8 = 4;

const NOT_VALIDATED: &[u8] = b"SERVER_ERROR the replicas did not confirm the result in time\r\n";
const WITHDRAWN: &[u8] = b"SERVER_ERROR this replica is being rebuilt; the request was not acknowledged\r\n";
/// A reply parked for a speculatively applied entry, when that state is thrown away before
/// the entry committed: it may have committed elsewhere, or been replaced.
const UNCONFIRMED: &[u8] =
    b"SERVER_ERROR outcome unknown: this replica's state was replaced before the request committed\r\n";
const NO_MAJORITY: &[u8] = b"SERVER_ERROR no majority of replicas agrees on the result; try again later\r\n";

/// A request of ours not applied this long after its proposal is proposed again (its
/// leader may have died with it); the applied-tag table makes the repeat a no-op.
const REPROPOSE_AFTER: Duration = Duration::from_secs(1);
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
    /// Requests whose result no majority agreed on (answered SERVER_ERROR).
    no_majority: u64,
    /// Items stored since start (memcached's `total_items`).
    total_items: u64,
}

struct Inflight {
    arrived: Instant,
    /// When it was last put into a proposal (None: waiting in the batch).
    proposed: Option<Instant>,
    /// Kept to propose again once proposed (a cluster only). A command is in the batch
    /// or here, never both: it moves, it is not copied (a request's value is on it).
    cmd: Option<Command>,
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
    pace: SnapshotPace,
    /// Wiped for replacement and not yet rebuilt (from a snapshot, or by replaying the log
    /// up to the entry that added it back).
    rejoining: bool,
    /// While rejoining: the entry that removed this replica. Rebuilt from a snapshot older
    /// than it, the replica replays that entry too; it is not a new removal.
    removed_at: Option<u64>,
    /// Test-only partition (`lockstep_isolate`): until then, nothing is sent to or taken
    /// from the other replicas.
    isolated_until: Option<Instant>,
    /// As the leader: the last entry of ours that followers do not apply early (see
    /// `broadcast_commits`); until it is committed, every commit is broadcast at once.
    commit_news_until: u64,
    /// Raft messages sent (the `kv_raft_messages` stat).
    messages_sent: u64,
    encode_scratch: Vec<u8>,
    /// The buffer of the last snapshot replaced, for the next one (`snapshot_data`).
    spare_snapshot: Vec<u8>,
}

/// When the next snapshot is due. A snapshot copies the whole state, so for a large state
/// it waits until the log since the last one holds as many bytes as that snapshot did:
/// snapshotting then costs at most as much again as logging (Redis rewrites its AOF on
/// the same rule), and the log stays within one state's size (bounded by the memory
/// limit). Small states are snapshotted every `--snapshot-every` entries.
#[derive(Default)]
struct SnapshotPace {
    /// Entry bytes applied since the last snapshot was taken.
    log_bytes: u64,
    /// Size of the last snapshot taken.
    last_len: u64,
}

/// States up to this size are cheap to copy: they are snapshotted by entry count alone.
const SMALL_SNAPSHOT: u64 = 1 << 20;
/// Bytes counted per entry besides its data (index, term, framing).
const ENTRY_OVERHEAD: u64 = 32;

impl SnapshotPace {
    fn due(&self, entries_since: u64, every: u64) -> bool {
        entries_since >= every && (self.last_len <= SMALL_SNAPSHOT || self.log_bytes >= self.last_len)
    }

    fn taken(&mut self, len: usize) {
        self.log_bytes = 0;
        self.last_len = len as u64;
    }
}

impl RaftPart {
    /// Keep a snapshot's buffer for the next snapshot; only one, and only while it is
    /// about the size of the last snapshot (a state that shrank lets it go).
    fn keep_snapshot_buffer(&mut self, buf: Vec<u8>) {
        if (buf.capacity() as u64) <= 2 * self.pace.last_len.max(SMALL_SNAPSHOT) {
            self.spare_snapshot = buf;
        }
    }

    fn isolated(&mut self) -> bool {
        match self.isolated_until {
            Some(t) if Instant::now() < t => true,
            Some(_) => {
                self.isolated_until = None;
                false
            }
            None => false,
        }
    }
}

pub struct Replica {
    cfg: Config,
    n: usize,
    store: Store,
    delta: Delta,
    events: EventSink,
    /// Replies released and not yet handed to their connections.
    replies: Vec<Reply>,
    batch: Vec<(u64, u64, Command)>,
    /// Requests from our clients that are not applied yet.
    inflight: fxhash::FxHashMap<(u64, u64), Inflight>,
    /// Tags of applied requests, so that a re-proposed request runs once.
    applied_tags: Applied,
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
    /// State audits and the snapshots they confirm.
    audits: audit::Audits,
    incarnation: u64,
    started: Instant,
    counters: Counters,
    /// The last get and the last other command applied, kept so that the next ones reuse
    /// their buffers.
    decoder: Decoder,
    /// Where replies nobody is sent are written (kept up to SPARE_REPLY_MAX bytes).
    spare_reply: Vec<u8>,
    /// Buffers of replies the event loop has written out, for our clients' next replies.
    reply_buffers: Vec<Vec<u8>>,
    /// Buffers of our clients' requests whose replies went out, for the event loop's
    /// parser (handed over at the end of each turn).
    request_buffers: Buffers,
    /// Event loops serving this replica (the `threads` stat).
    threads: usize,
    /// memcached's `lru_crawler enable`/`disable` state (this replica's, like memcached's).
    crawler_enabled: bool,
    /// The highest entry this replica knows to be committed without Raft having said so
    /// (a follower's early apply).
    committed_early: u64,
    /// Validated replies of entries applied speculatively (a cross-checking leader), sent
    /// once their entry is committed: (entry, client, reply, when validated).
    parked: Vec<(u64, ReplyTo, Vec<u8>, Instant)>,
}

/// Start a replica and serve until a fatal error. Returns the exit status.
pub fn run(cfg: Config) -> i32 {
    let clients = match TcpListener::bind(cfg.client) {
        Ok(l) => {
            // memcached's backlog (its -b, default 1024) instead of std's 128: a burst of
            // connections otherwise overflows it, and every overflowing client waits a
            // second for its SYN to be resent.
            use std::os::fd::AsRawFd;
            // SAFETY: listen on a socket we own; it only changes the backlog.
            unsafe { libc::listen(l.as_raw_fd(), LISTEN_BACKLOG) };
            l
        }
        Err(e) => {
            eprintln!("lockstep kv: cannot listen for clients on {}: {e}", cfg.client);
            return 1;
        }
    };
    raise_nofile_limit();
    let peers = if cfg.mode != Mode::Single {
        let me = cfg.peers[cfg.id as usize - 1];
        match TcpListener::bind(me) {
            Ok(l) => Some((l, cfg.peers.len() as u64)),
            Err(e) => {
                eprintln!("lockstep kv: cannot listen for replicas on {me}: {e}");
                return 1;
            }
        }
    } else {
        None
    };
    let poll = match Poller::new() {
        Ok(p) => Arc::new(p),
        Err(e) => {
            eprintln!("lockstep kv: epoll: {e}");
            return 1;
        }
    };
    let mut replica = match Replica::new(cfg, poll.clone()) {
        Ok(r) => r,
        Err((code, msg)) => {
            eprintln!("lockstep kv: {msg}");
            return code;
        }
    };
    let (max_conns, item_max) = (replica.cfg.max_conns, replica.store.limits().item_max);
    let live = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    replica.start_watchdog();
    replica.announce();
    if peers.is_some() {
        let listeners = Listeners {
            clients,
            peers,
            max_conns,
            item_max,
            live,
            index: 0,
            loops: 1,
        };
        return net::serve(&mut replica, poll, listeners);
    }
    drop(poll);
    // Single mode has nothing to order: like memcached's worker threads, one loop per CPU
    // (at most 4) serves its own connections and applies their requests under the store's
    // lock, a whole turn at a time.
    let loops = single_loops(replica.cfg.threads);
    replica.threads = loops as usize;
    let tick = replica.cfg.tick;
    let shared = Arc::new(std::sync::Mutex::new(replica));
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    for index in 0..loops {
        let listeners = match clients.try_clone() {
            Ok(clients) => Listeners {
                clients,
                peers: None,
                max_conns,
                item_max,
                live: live.clone(),
                index,
                loops,
            },
            Err(e) => {
                eprintln!("lockstep kv: cannot share the client listener: {e}");
                return 1;
            }
        };
        let mut svc = SharedReplica {
            shared: shared.clone(),
            index,
            loops,
            tick,
        };
        let done = done_tx.clone();
        let spawned = thread::Builder::new().name(format!("loop-{index}")).spawn(move || {
            let code = match Poller::new() {
                Ok(p) => net::serve(&mut svc, Arc::new(p), listeners),
                Err(e) => {
                    eprintln!("lockstep kv: epoll: {e}");
                    1
                }
            };
            // (the waiter may have given up; the code is then not needed)
            let _ = done.send(code);
        });
        if let Err(e) = spawned {
            eprintln!("lockstep kv: cannot start an event loop: {e}");
            return 1;
        }
    }
    // The first loop to stop decides the exit status.
    done_rx.recv().unwrap_or(1)
}

/// Event loops in single mode: as asked, or one per CPU, at most 4 (memcached's default).
fn single_loops(asked: u64) -> u64 {
    if asked > 0 {
        return asked;
    }
    thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, 4) as u64
}

impl Replica {
    /// One loop's turn: its clients' messages, one step, and the replies released for the
    /// connections that `mine` says are the loop's.
    fn turn_for(
        &mut self,
        msgs: &mut Vec<Inbound>,
        replies: &mut Vec<Reply>,
        recycle: &mut Recycle,
        mine: impl Fn(u64) -> bool,
    ) -> Result<(), i32> {
        let room = SPENT_MAX.saturating_sub(self.reply_buffers.len());
        // (What does not fit is dropped with the drain.)
        self.reply_buffers.extend(recycle.replies.drain(..).take(room));
        for m in msgs.drain(..) {
            self.handle(m)?;
        }
        self.step()?;
        recycle.requests.take_from(&mut self.request_buffers);
        self.heartbeat.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if self.replies.iter().all(|r| mine(r.0)) {
            replies.append(&mut self.replies);
        } else {
            // Another loop's replies stay for it.
            let (ours, theirs): (Vec<Reply>, Vec<Reply>) =
                std::mem::take(&mut self.replies).into_iter().partition(|r| mine(r.0));
            replies.extend(ours);
            self.replies = theirs;
        }
        Ok(())
    }
}

/// The replica of single mode, shared by its event loops.
struct SharedReplica {
    shared: Arc<std::sync::Mutex<Replica>>,
    index: u64,
    loops: u64,
    tick: Duration,
}

impl Service for SharedReplica {
    fn turn(&mut self, msgs: &mut Vec<Inbound>, replies: &mut Vec<Reply>, recycle: &mut Recycle) -> Result<(), i32> {
        // A loop that panicked while holding the replica may have left the store
        // half-changed: stop (exit 86) rather than serve from it.
        let mut r = self.shared.lock().map_err(|_| {
            eprintln!("lockstep kv: a request failed while changing the store; stopping rather than serving from it");
            lockstep_core::exit::DETECTED
        })?;
        let (index, loops) = (self.index, self.loops);
        r.turn_for(msgs, replies, recycle, |conn| conn % loops == index)
    }

    fn peer_frame(&mut self, _: u64, _: &[u8]) -> Result<(), i32> {
        Ok(())
    }

    fn peers(&mut self) -> Option<&mut Peers> {
        None
    }

    fn tick(&self) -> Duration {
        self.tick
    }
}

impl Service for Replica {
    fn turn(&mut self, msgs: &mut Vec<Inbound>, replies: &mut Vec<Reply>, recycle: &mut Recycle) -> Result<(), i32> {
        self.turn_for(msgs, replies, recycle, |_| true)
    }

    fn peer_frame(&mut self, from: u64, frame: &[u8]) -> Result<(), i32> {
        self.on_peer(from, frame)
    }

    fn peers(&mut self) -> Option<&mut Peers> {
        self.raft.as_mut().map(|r| &mut r.peers)
    }

    fn tick(&self) -> Duration {
        let lazy = self.raft.as_ref().and_then(|r| r.peers.lazy_deadline());
        match lazy {
            Some(t) => self.cfg.tick.min(t.saturating_duration_since(Instant::now())),
            None => self.cfg.tick,
        }
    }
}

/// Raise the soft limit on open files to the hard limit, as memcached does for its
/// connection limit: the caller's usual 1024 would stop us short of `--max-conns`.
fn raise_nofile_limit() {
    // SAFETY: rlimit is plain data, and these calls only read and set our own limit.
    unsafe {
        let mut r: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            r.rlim_cur = r.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl Replica {
    fn new(cfg: Config, poll: Arc<Poller>) -> Result<Self, (i32, String)> {
        let n = cfg.peers.len().max(1);
        let mut events = EventSink::new(cfg.events.as_deref(), true)
            .map_err(|e| (1, format!("cannot open the events file: {e}")))?;
        let mut store = Store::new(cfg.limits.clone());
        let mut applied_tags = Applied::default();
        let mut raft = None;
        let mut applied = 0;
        let mut restarted = false;
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
                (store, applied_tags) = restore_data(&cfg.limits, &data).map_err(|e| {
                    (
                        lockstep_core::exit::DETECTED,
                        format!("the stored snapshot does not restore: {e}"),
                    )
                })?;
                applied = snap_index;
            }
            if storage.is_restored() {
                restarted = true;
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
            let peers = Peers::start(cfg.id, &cfg.peers, poll);
            raft = Some(RaftPart {
                node,
                config: rc,
                storage,
                peers,
                last_tick: Instant::now(),
                snap_index,
                pace: SnapshotPace::default(),
                rejoining: false,
                removed_at: None,
                isolated_until: None,
                commit_news_until: 0,
                messages_sent: 0,
                encode_scratch: Vec::new(),
                spare_snapshot: Vec::new(),
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
            replies: Vec::new(),
            batch: Vec::new(),
            inflight: Default::default(),
            applied_tags,
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
            audits: audit::Audits {
                // A restarted replica's state is compared with the others' at once.
                wanted: restarted,
                ..Default::default()
            },
            incarnation: now_ms() ^ (std::process::id() as u64) << 40,
            started: Instant::now(),
            counters: Counters::default(),
            decoder: Decoder::default(),
            spare_reply: Vec::new(),
            reply_buffers: Vec::new(),
            request_buffers: Buffers::default(),
            threads: 1,
            committed_early: 0,
            crawler_enabled: true,
            parked: Vec::new(),
            cfg,
        })
    }

    fn announce(&mut self) {
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
            return self.order_batch();
        }
        let r = self.raft.as_mut().unwrap();
        r.peers.muted = r.isolated();
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
        // Applying may have found a failed replica: propose its RECOVER now rather than at
        // the next wake-up, which can be a whole tick away on an idle cluster.
        if !self.to_recover.is_empty() {
            self.propose_recovers();
            self.on_ready()?;
        }
        if tick {
            self.housekeeping()?;
        }
        self.raft.as_mut().unwrap().peers.flush();
        Ok(())
    }

    /// Put the batched requests in order: a single replica applies them at once (it has
    /// no Raft), a replicated one proposes them.
    fn order_batch(&mut self) -> Result<(), i32> {
        if self.raft.is_some() {
            self.propose_batch();
            return Ok(());
        }
        if !self.batch.is_empty() {
            let data = self.encode_batch(&self.batch);
            for (_, _, cmd) in self.batch.drain(..) {
                self.request_buffers.keep_command(cmd);
            }
            self.apply(self.applied + 1, &data)?;
        }
        Ok(())
    }

    fn handle(&mut self, m: Inbound) -> Result<(), i32> {
        match m {
            Inbound::Open { .. } => {
                self.counters.curr_connections += 1;
                self.counters.total_connections += 1;
            }
            Inbound::Closed { .. } => {
                self.counters.curr_connections -= 1;
            }
            Inbound::Request { conn, seq, cmd } => {
                self.inflight.insert(
                    (conn, seq),
                    Inflight {
                        arrived: Instant::now(),
                        proposed: None,
                        cmd: None,
                    },
                );
                self.batch.push((conn, seq, cmd));
                if self.batch.len() >= BATCH_MAX {
                    self.order_batch()?;
                }
            }
            Inbound::Stats { conn, seq, args } => {
                let reply = self.stats(&args);
                self.send_reply(conn, seq, reply);
            }
            Inbound::Local {
                conn,
                seq,
                line,
                queued_behind,
            } => {
                let reply = self.local_command(&line, queued_behind);
                self.send_reply(conn, seq, reply.into_bytes());
            }
            Inbound::PeerError(msg) => {
                self.events.emit(Event::new("kv", "peer-error", "close").message(msg));
            }
        }
        Ok(())
    }

    fn send_reply(&mut self, conn: u64, seq: u64, reply: Vec<u8>) {
        self.forget_request(conn, seq);
        self.replies.push((conn, seq, reply));
    }

    /// Done with our client's request (its reply is decided): whether it was in flight.
    /// Its command's buffers go to the parser's next requests.
    fn forget_request(&mut self, conn: u64, seq: u64) -> bool {
        let Some(f) = self.inflight.remove(&(conn, seq)) else {
            return false;
        };
        if let Some(cmd) = f.cmd {
            self.request_buffers.keep_command(cmd);
        }
        true
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
        if let Some(r) = self.raft.as_mut() {
            r.pace.log_bytes += data.len() as u64 + ENTRY_OVERHEAD;
        }
        let mut u = Unpacker::new(data);
        let result = match u.u8() {
            Ok(ENTRY_BATCH) => self.apply_batch(index, &mut u),
            Ok(ENTRY_RECOVER) => self.apply_recover(index, &mut u),
            Ok(ENTRY_AUDIT) => self.apply_audit(index, &mut u),
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
        // What a cross-check keeps of the entry: the deltas, request by request (the
        // detail behind its digest), and every reply (in reused buffers).
        let mut kept = self.validator.as_mut().map(|v| v.buffers());
        if let Some(k) = kept.as_mut() {
            // (The count comes from the log: it sizes nothing beyond what we batch.)
            let expected = (n as usize).min(BATCH_MAX);
            // (A get's delta takes about 70 bytes, a set's up to about 150.)
            k.detail.reserve(DELTA_BYTES_HINT * expected);
            k.executed.reserve(expected);
        }
        // (Taken out for the loop, as the store and the counters borrow the replica; put
        // back after it. An entry that does not decode leaves an empty one: the replica
        // halts then.)
        let mut decoder = std::mem::take(&mut self.decoder);
        for pos in 0..n {
            let conn = u.u64()?;
            let seq = u.u64()?;
            let cmd = decoder.next(u)?;
            // (A single replica proposes nothing twice: no table to keep.)
            if self.raft.is_some() && !self.applied_tags.first_time((origin, incarnation, conn, seq)) {
                continue;
            }
            let to = (mine && self.forget_request(conn, seq)).then_some(ReplyTo { conn, seq });
            self.delta.clear();
            // Our client's reply gets a buffer of its own (it leaves with the client, and
            // comes back once written out); another replica's client's goes into the
            // entry's shared buffer when a cross-check keeps it, else into the spare buffer.
            let mut reply = match (to, &kept) {
                (Some(_), _) => self.reply_buffers.pop().unwrap_or_default(),
                (None, None) => std::mem::take(&mut self.spare_reply),
                (None, Some(_)) => Vec::new(), // (stays empty: not written into)
            };
            let (out, at) = match (to, kept.as_mut()) {
                (None, Some(k)) => {
                    let at = self.store.apply_append(cmd, time, &mut self.delta, &mut k.replies);
                    (&k.replies, at)
                }
                _ => {
                    self.store.apply_into(cmd, time, &mut self.delta, &mut reply);
                    (&reply, 0..reply.len())
                }
            };
            count_request(&mut self.counters, cmd, &out[at.clone()]);
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
            if let Some(k) = kept.as_mut() {
                let mut detail = Packer {
                    buf: std::mem::take(&mut k.detail),
                };
                check::encode_delta(&mut detail, pos, self.delta.finish());
                k.detail = detail.buf;
                let reply = match to {
                    Some(_) => KeptReply::Own(reply),
                    None => KeptReply::Shared(at),
                };
                k.executed.push(Executed { pos, reply, origin, to });
            } else if let Some(to) = to {
                self.send_reply(to.conn, to.seq, reply);
            } else if reply.capacity() <= SPARE_REPLY_MAX {
                self.spare_reply = reply;
            }
        }
        self.decoder = decoder;
        if !u.is_empty() {
            return Err(UnpackError("trailing bytes in batch"));
        }
        let Some(kept) = kept.filter(|k| !k.executed.is_empty()) else {
            return Ok(());
        };
        let digest = check::digest(&kept.detail);
        // (kind, index, digest) packed as `on_digest` reads them; on the stack, as one
        // goes out per entry.
        let mut msg = [0u8; 13];
        msg[0] = MSG_DIGEST;
        msg[1..9].copy_from_slice(&index.to_le_bytes());
        msg[9..].copy_from_slice(&digest.to_le_bytes());
        self.send_check(&msg);
        let v = self.validator.as_mut().expect("checking");
        let outcomes = v.local_entry(index, digest, kept);
        self.settle(outcomes);
        Ok(())
    }

    /// A digest is urgent for the leader's peers (their own clients' replies wait on the
    /// leader's delta) and for the leader (its clients' wait on a follower's); between
    /// followers it only serves deferred validation and goes with other traffic.
    fn send_check(&mut self, check: &[u8]) {
        let n = self.n as u64;
        let me = self.cfg.id;
        let r = self.raft.as_mut().unwrap();
        let leading = r.node.raft.state == StateRole::Leader;
        let leader = r.node.raft.leader_id;
        for peer in (1..=n).filter(|&p| p != me) {
            if leading || peer == leader {
                r.peers.send(peer, check);
            } else {
                r.peers.send_lazy(peer, check);
            }
        }
    }

    fn settle(&mut self, outcomes: Vec<Outcome>) {
        for o in outcomes {
            match o {
                Outcome::Release { req, to, reply } => {
                    if req.index > self.committed() {
                        // Validated against a speculative apply: acknowledged only once
                        // the entry is committed.
                        self.parked.push((req.index, to, reply, Instant::now()));
                    } else {
                        self.send_reply(to.conn, to.seq, reply)
                    }
                }
                Outcome::Failed {
                    replica,
                    req,
                    objects,
                    values,
                } => {
                    self.counters.divergences += 1;
                    if replica == self.cfg.id {
                        self.unrepaired_failures += 1;
                    }
                    let names: Vec<String> = objects.iter().map(|i| i.to_string()).collect();
                    self.events.emit(
                        Event::new("kv", "divergence", "recover")
                            .replica(replica as u32)
                            .object(names.join(","))
                            .values(values)
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
                Outcome::Detail { index, count, detail } => {
                    let mut p = Packer::default();
                    p.u8(MSG_CHECK);
                    p.u64(index);
                    p.u32(count);
                    p.buf.extend_from_slice(&detail);
                    self.raft.as_mut().unwrap().peers.broadcast(&p.buf);
                }
                Outcome::NoMajority { req, to } => {
                    // Unavailable rather than wrong: the objects nobody agrees on answer
                    // errors until a majority agrees again (an audit or a repair); the
                    // rest of the store keeps serving.
                    self.counters.no_majority += 1;
                    self.events.emit(
                        Event::new("kv", "no-majority", "server-error")
                            .replica(self.cfg.id as u32)
                            .message(format!(
                                "entry {}.{}: no majority of replicas agrees on the request's result; its client gets SERVER_ERROR",
                                req.index, req.pos
                            )),
                    );
                    if let Some(to) = to {
                        self.send_reply(to.conn, to.seq, NO_MAJORITY.to_vec());
                    }
                }
            }
        }
    }

    // ---- peers ----------------------------------------------------------------------

    fn on_peer(&mut self, from: u64, frame: &[u8]) -> Result<(), i32> {
        if self.raft.as_mut().is_some_and(|r| r.isolated()) {
            return Ok(());
        }
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
                    // raft refuses messages it must ignore (a stale term, an unknown peer): nothing to do.
                    let _ = r.node.step(m);
                    Ok(())
                }
                Err(_) => Err(UnpackError("raft message does not decode")),
            },
            Ok(MSG_CHECK) => self.on_check(from, &mut u),
            Ok(MSG_DIGEST) => self.on_digest(from, &mut u),
            Ok(MSG_REPAIR) => self.on_repair(from, &mut u),
            Ok(MSG_AUDIT) => self.on_audit(from, &mut u),
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

    /// A peer's full deltas for an entry whose digests differ.
    fn on_check(&mut self, from: u64, u: &mut Unpacker<'_>) -> Result<(), UnpackError> {
        let index = u.u64()?;
        let count = u.u32()?;
        let reqs = check::decode_deltas(u, count)?;
        if !u.is_empty() {
            return Err(UnpackError("trailing bytes in check"));
        }
        if let Some(v) = self.validator.as_mut() {
            let outcomes = v.remote_detail(from, index, reqs);
            self.settle(outcomes);
        }
        Ok(())
    }

    fn on_digest(&mut self, from: u64, u: &mut Unpacker<'_>) -> Result<(), UnpackError> {
        let index = u.u64()?;
        let digest = u.u32()?;
        if let Some(v) = self.validator.as_mut() {
            let outcomes = v.remote_digest(from, index, digest);
            self.settle(outcomes);
        }
        Ok(())
    }

    /// The highest entry known to be committed.
    fn committed(&self) -> u64 {
        match &self.raft {
            Some(r) => r.node.raft.raft_log.committed.max(self.committed_early),
            None => u64::MAX,
        }
    }

    /// Send the parked replies whose entries are now committed; those waiting longer than
    /// a client may wait get an error instead (their entry may never commit).
    fn release_parked(&mut self, now: Option<Instant>) {
        if self.parked.is_empty() {
            return;
        }
        let committed = self.committed();
        for (index, to, reply, at) in std::mem::take(&mut self.parked) {
            if index <= committed {
                self.send_reply(to.conn, to.seq, reply);
            } else if now.is_some_and(|now| now.duration_since(at) > crate::check::REPLY_TIMEOUT) {
                self.counters.held_dropped += 1;
                self.send_reply(to.conn, to.seq, NOT_VALIDATED.to_vec());
            } else {
                self.parked.push((index, to, reply, at));
            }
        }
    }

    /// The speculative state behind the parked replies is gone (a snapshot replaced it, or
    /// the replica was wiped): a later commit index says nothing about those entries any
    /// more, so their clients learn that the outcome is unknown rather than a false STORED.
    pub(super) fn withdraw_parked(&mut self) {
        for (_, to, _, _) in std::mem::take(&mut self.parked) {
            self.counters.held_dropped += 1;
            self.send_reply(to.conn, to.seq, UNCONFIRMED.to_vec());
        }
    }

    // ---- periodic -------------------------------------------------------------------

    fn housekeeping(&mut self) -> Result<(), i32> {
        let now = Instant::now();
        // Requests that could not be ordered in time get an error, not silence.
        let late: Vec<(u64, u64)> = self
            .inflight
            .iter()
            .filter(|(_, f)| now.duration_since(f.arrived) > ORDER_TIMEOUT)
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
        // Proposals that went nowhere (to a leader that died) go out again.
        for (&(conn, seq), f) in self.inflight.iter_mut() {
            if f.proposed.is_some_and(|p| now.duration_since(p) > REPROPOSE_AFTER) {
                f.proposed = None;
                let cmd = f.cmd.take().expect("a proposed request keeps its command");
                self.batch.push((conn, seq, cmd));
            }
        }
        self.recover_proposed
            .retain(|_, t| now.duration_since(*t) < ORDER_TIMEOUT);
        self.release_parked(Some(now));
        if let Some(v) = self.validator.as_mut() {
            let (dropped, _) = v.expire(now);
            for to in dropped {
                self.counters.held_dropped += 1;
                // No unvalidated reply leaves; the client is not left waiting either.
                self.send_reply(to.conn, to.seq, NOT_VALIDATED.to_vec());
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
        if self.audited() {
            // Snapshots come from audits, once a majority confirmed them.
            self.propose_audit_if_due();
            return Ok(());
        }
        // Snapshot and compact the log now and then, or when a peer needs one.
        let r = self.raft.as_mut().unwrap();
        let wanted = r.storage.take_snapshot_wanted();
        // A wanted snapshot may repeat the last index: it refreshes the configuration in it.
        // Not ahead of Raft's commit index (entries applied early are): Raft must still be
        // able to hand out what it considers unapplied.
        if self.recovery.is_none()
            && self.applied > 0
            && self.applied <= r.node.raft.raft_log.committed
            && (wanted
                || r.pace
                    .due(self.applied.saturating_sub(r.snap_index), self.cfg.snapshot_every))
        {
            self.take_snapshot()?;
        }
        Ok(())
    }
}

/// A Raft snapshot's data: the store's objects and the applied-request table.
/// The layout of a snapshot's data (the store, then the applied-request table). Raised
/// whenever either changes, so that a data directory or a peer from another layout is
/// refused with a clear message instead of misread. 3: the applied-request window. 4: an
/// item's links hold its key hash and size; the bucket count follows the memory limit.
const SNAPSHOT_FORMAT: u32 = 4;

/// What `restore_data` reads, written into `buf` (emptied first).
fn snapshot_bytes(store: &Store, tags: &Applied, mut buf: Vec<u8>) -> Vec<u8> {
    buf.clear();
    let mut p = Packer { buf };
    p.u32(SNAPSHOT_FORMAT);
    p.nested(|p| store.snapshot_into(p));
    tags.encode(&mut p);
    p.buf
}

fn restore_data(limits: &Limits, data: &[u8]) -> Result<(Store, Applied), UnpackError> {
    let mut u = Unpacker::new(data);
    if u.u32()? != SNAPSHOT_FORMAT {
        return Err(UnpackError(
            "snapshot written in another format (by another lockstep version): start from an empty data directory",
        ));
    }
    let store = Store::restore(limits.clone(), u.bytes()?)?;
    let tags = Applied::decode(&mut u)?;
    if !u.is_empty() {
        return Err(UnpackError("trailing bytes after the snapshot"));
    }
    Ok((store, tags))
}

impl Replica {
    /// Snapshot the store at the applied index and compact the log up to it.
    fn take_snapshot(&mut self) -> Result<(), i32> {
        let data = self.snapshot_data();
        let applied = self.applied;
        let r = self.raft.as_mut().expect("replicated");
        r.pace.taken(data.len());
        match r.storage.compact(applied, data) {
            Ok(replaced) => r.keep_snapshot_buffer(replaced),
            Err(e) => return Err(self.fatal_io("write a snapshot", e)),
        }
        self.raft.as_mut().expect("replicated").snap_index = applied;
        Ok(())
    }

    /// The store's snapshot, written into the buffer a replaced snapshot left (its pages
    /// are mapped already: a fresh state-sized buffer costs a page fault per 4 KiB).
    fn snapshot_data(&mut self) -> Vec<u8> {
        let buf = self
            .raft
            .as_mut()
            .map(|r| std::mem::take(&mut r.spare_snapshot))
            .unwrap_or_default();
        snapshot_bytes(&self.store, &self.applied_tags, buf)
    }
}

/// A request applied here, in the statistics.
fn count_request(counters: &mut Counters, cmd: &Command, reply: &[u8]) {
    counters.requests += 1;
    match cmd {
        Command::Get { keys, .. } => {
            counters.cmd_get += keys.len() as u64;
            let hits = reply.windows(6).filter(|w| w == b"VALUE ").count() as u64;
            counters.get_hits += hits;
            counters.get_misses += keys.len() as u64 - hits.min(keys.len() as u64);
        }
        Command::Store { .. } => {
            counters.cmd_set += 1;
            if reply == b"STORED\r\n" {
                counters.total_items += 1;
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_in_another_format_is_refused_by_name() {
        let limits = Limits::default();
        let mut data = snapshot_bytes(&Store::new(limits.clone()), &Applied::default(), vec![1, 2, 3]);
        assert!(restore_data(&limits, &data).is_ok());
        data[0] ^= 1;
        let e = restore_data(&limits, &data).err().expect("refused");
        assert!(e.0.contains("another format"), "{e}");
    }
}

//! The output commit (`--output-check strict`, the fast backend): a thread of the monitor,
//! the *committer*, makes the ring leader's outputs.
//!
//! The promise of strict checks is that no output byte leaves unless a party outside the
//! replica that may be faulty has seen every replica's digest of it agree. Before this
//! module, that party was the monitor behind a ptrace stop of the leader at every output
//! (`fast_check.rs`, still the path for descriptors the committer does not write). Now:
//!
//! 1. The leader's shim posts the call (number and arguments) in its region of the ring
//!    (`commit_seq`, `commit_nr`, `commit_args`) and waits; it does not enter the kernel.
//! 2. Each follower votes its own digest of the call, as before.
//! 3. Whoever completes the request last (the leader posting after every vote, or the last
//!    follower voting after the post) rings the doorbell, a futex word in the ring.
//! 4. The committer copies the output's buffers out of the leader's memory
//!    (`process_vm_readv`, into its own memory: nothing the leader does afterwards can change
//!    what is written), digests the copy with the shim's algorithm (`fast_check`), and
//!    writes the copy through its own duplicate of the leader's descriptor
//!    (`pidfd_getfd`, checked with `kcmp` at every use) only if every live follower voted
//!    that digest for that call. Its answer (the kernel's result, or "escalate", or "own")
//!    goes into the header page, which only the monitor writes.
//!
//! So an output costs no ptrace stop and no rendezvous; with the replicas and the monitor
//! on one CPU it costs the context switches to the committer and back, and a committer
//! that is awake serves every lane's request without sleeping in between.
//!
//! What it does not write (the leader then makes the call from the fast gate, where the
//! seccomp filter stops it for the monitor's check, as before): descriptors other than
//! sockets and regular files (pipes, ttys, devices: a write there may block, and blocking
//! the committer would block every lane), and positioned writes to sockets. Sockets are
//! written with `MSG_DONTWAIT | MSG_NOSIGNAL`: a full send buffer or a closed peer gives
//! an error, nothing is written, and the leader makes the call through the monitor
//! instead (where it blocks, or gets its SIGPIPE, as natively). A blocking socket whose
//! send buffer fills midway returns a short count, where natively the call would block
//! until everything is sent.

use crate::data::{IOVEC as IOVEC_SIZE, MSGHDR as MSGHDR_SIZE};
use crate::fast::{layout, Posted, Ring, COMMIT_DONE, COMMIT_ESCALATE, COMMIT_OWN, LANES};
use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// The longest the committer sleeps before it looks at every lane again without a
/// doorbell (a backstop: a replica whose doorbell write a fault lost costs this much).
const PATIENCE_NS: i64 = 10_000_000;
/// Descriptors the committer keeps duplicates of (each checked with `kcmp` at every use);
/// past this it forgets them all and starts over.
const MAX_DUPS: usize = 1024;
/// Processes it keeps pidfds of (the replicas of every ring).
const MAX_PIDFDS: usize = 16;
/// Descriptors named for posted outputs at once (`Named`); past this no new one is named
/// (their outputs commit one by one) until closed ones are let go.
const MAX_HANDLES: usize = 65536;
/// Bytes of posted outputs the committer keeps, in all, for sockets that did not take
/// them at once; past this a socket's connection is shut down (see `Desk::keep`).
const BACKLOG_MAX: usize = 64 << 20;
/// How often the committer offers kept bytes again.
const BACKLOG_RETRY_NS: i64 = 1_000_000;
/// How long the committer, at the end of a run, and the monitor, before a call it makes
/// on a socket with kept bytes, wait for the socket to take them.
const DRAIN_PATIENCE: std::time::Duration = std::time::Duration::from_secs(10);
const KCMP_FILE: i32 = 0;

/// What the committer has done, for `--stats` and the counter tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CommitCounts {
    /// Outputs the committer wrote.
    pub written: u64,
    /// Requests answered "escalate" (the monitor votes on the call).
    pub escalated: u64,
    /// Requests answered "own" (the leader makes the call, checked at its stop).
    pub own: u64,
    /// Times the committer woke up with work to look at (not its patience running out).
    pub wakeups: u64,
    /// Descriptors it duplicated from a leader (`pidfd_getfd`).
    pub duplicated: u64,
    /// Posted outputs it wrote (or kept, for a socket that took them later).
    pub posted: u64,
    /// Posted outputs a socket did not take whole at once (the rest was kept).
    pub kept: u64,
    /// Posted outputs a follower did not vote for (the monitor judged the call).
    pub refused: u64,
}

#[derive(Default)]
struct Counters {
    written: AtomicU64,
    escalated: AtomicU64,
    own: AtomicU64,
    wakeups: AtomicU64,
    duplicated: AtomicU64,
    posted: AtomicU64,
    kept: AtomicU64,
    refused: AtomicU64,
}

/// The run's rings, owned by `FastPath`, which stops the committer before it drops them.
struct Rings {
    first: *const Ring,
    count: usize,
}

// SAFETY: the rings are shared memory accessed through atomics (`Ring`'s accessors); the
// pointer stays valid until `Committer::drop` joined the thread (FastPath drops it first).
unsafe impl Send for Rings {}
// SAFETY: as above.
unsafe impl Sync for Rings {}

struct Shared {
    rings: Rings,
    current: AtomicUsize,
    stop: AtomicBool,
    /// Set by the monitor while it decides about a lost leader (`Committer::pause`).
    paused: AtomicBool,
    desk: Mutex<Desk>,
    counters: Counters,
    /// Why the committer stopped writing for good (a posted output it cannot make as the
    /// replicas agreed on it): the monitor stops the run.
    failure: Mutex<Option<String>>,
    failed: AtomicBool,
}

impl Shared {
    fn fail(&self, why: String) {
        let mut failure = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        failure.get_or_insert(why);
        self.failed.store(true, Ordering::SeqCst);
    }
}

impl Shared {
    fn rings(&self) -> &[Ring] {
        // SAFETY: see `Rings`.
        unsafe { std::slice::from_raw_parts(self.rings.first, self.rings.count) }
    }
}

/// The committer of a run: its thread, and what the monitor's thread tells it.
pub struct Committer {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// What the committer holds while it judges and writes one output (the monitor's thread
/// takes it to wait for the end of one: `Committer::pause`).
struct Desk {
    /// Per ring, per region: the replica's process.
    pids: Vec<[i32; layout::MAX_REPLICAS as usize]>,
    pidfds: Vec<(i32, OwnedFd)>,
    dups: Vec<Dup>,
    copy: Copy,
    scratch: Vec<u8>,
    kcmp_works: bool,
    /// Duplicates made since the counters last heard of them.
    duplicated: u64,
    /// The process the duplicates were taken from.
    leader_pid: i32,
    /// Per ring, per lane: the next record to look at for a posted output (every earlier
    /// one is taken).
    cursors: Vec<[u64; LANES]>,
    /// Per ring: regions whose replica was removed (bit r), whose votes nobody waits for.
    gone: Vec<u32>,
    /// The descriptors named for posted outputs, by handle.
    names: HashMap<u32, Named>,
    next_handle: u32,
    /// Bytes kept for sockets, in all (`Dup::backlog`).
    kept_bytes: usize,
    /// A posted output waited for a vote at the last look.
    posted_pending: bool,
}

/// The next posted output of a lane, as `Desk::head` found it.
enum Head {
    Empty,
    Pending,
    Ready { seq: u64, author: u32, order: u64 },
}

/// A duplicate of a leader's descriptor.
struct Dup {
    pid: i32,
    fd: i32,
    local: OwnedFd,
    kind: Kind,
    /// The handle posted outputs name it by (0: none given).
    handle: u32,
    /// Bytes of posted outputs the socket did not take yet, in order.
    backlog: Vec<u8>,
    /// A write failed (the peer is gone): later posted outputs are dropped, as the bytes
    /// of a connection that broke are; the next output on it goes to the monitor.
    broken: bool,
    /// The program closed it; kept until its backlog is out.
    retired: bool,
}

/// What a handle names: descriptor `fd` of process `pid`, the open file with inode `ino`.
#[derive(Clone, Copy)]
struct Named {
    pid: i32,
    fd: i32,
    ino: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Socket { seqpacket: bool, stream: bool },
    File,
    Other,
}

#[derive(Clone, Copy, Debug)]
enum How {
    /// `sendmsg` with these flags (sockets).
    Send(i32),
    /// `writev` at the file position (regular files).
    Writev,
    /// `pwritev` at the call's position (regular files).
    Pwritev,
}

/// A leader's commit request, as the committer read it once.
struct Request {
    epoch: usize,
    lane: usize,
    leader: u32,
    seq: u64,
    nr: u64,
    args: [u64; 6],
}

enum Verdict {
    /// Some follower has not reached the call yet.
    Pending,
    Answer(u32, i64),
}

impl Committer {
    /// Starts the committer for `rings`, which must outlive it (see `Rings`).
    pub fn start(rings: &[Ring]) -> io::Result<Committer> {
        let shared = Arc::new(Shared {
            rings: Rings {
                first: rings.as_ptr(),
                count: rings.len(),
            },
            current: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            paused: AtomicBool::new(false),
            desk: Mutex::new(Desk {
                pids: vec![[0; layout::MAX_REPLICAS as usize]; rings.len()],
                pidfds: Vec::with_capacity(MAX_PIDFDS),
                dups: Vec::with_capacity(MAX_DUPS),
                copy: Copy::new(),
                scratch: vec![0; crate::fast_check::CHUNK],
                kcmp_works: true,
                duplicated: 0,
                leader_pid: 0,
                cursors: vec![[1; LANES]; rings.len()],
                gone: vec![0; rings.len()],
                names: HashMap::new(),
                next_handle: 1,
                kept_bytes: 0,
                posted_pending: false,
            }),
            counters: Counters::default(),
            failure: Mutex::new(None),
            failed: AtomicBool::new(false),
        });
        let serving = Arc::clone(&shared);
        // The thread must take none of the monitor's signals (SIGCHLD, SIGINT, ...): they
        // are blocked while it is created, so it starts with them blocked.
        let old = block_all_signals();
        let thread = std::thread::Builder::new()
            .name("lockstep-commit".into())
            .spawn(move || serve(&serving));
        restore_signals(&old);
        Ok(Committer {
            shared,
            thread: Some(thread?),
        })
    }

    /// The ring in use from now on (`FastPath`'s epoch).
    pub fn set_current(&self, epoch: usize) {
        self.shared.current.store(epoch, Ordering::SeqCst);
        self.kick();
    }

    /// Replica process `pid` holds region `region` of ring `epoch`.
    pub fn set_pid(&self, epoch: usize, region: u32, pid: i32) {
        let mut desk = self.hold();
        if let Some(slot) = desk.pids.get_mut(epoch).and_then(|p| p.get_mut(region as usize)) {
            *slot = pid;
        }
    }

    /// Process `pid` closes or replaces its descriptor `fd` (None: all of them: an exec,
    /// an exit, `close_range`): our duplicates go first, so that the file closes when the
    /// program closes it (a peer waiting for the end of a connection sees it).
    /// A descriptor number names the same file in every replica of the ring's process, so
    /// a close forgets the duplicates of that number taken from any of them.
    ///
    /// A duplicate with bytes still kept for its socket, or named by a handle that a
    /// posted output not yet taken may carry, is only retired: it goes once that is done,
    /// as the kernel sends what a closed socket's buffer holds.
    pub fn forget(&self, pid: i32, fd: Option<i32>) {
        let mut desk = self.hold();
        let closed = |d: &Dup| match fd {
            Some(fd) => d.fd == fd,
            None => d.pid == pid,
        };
        for dup in desk.dups.iter_mut().filter(|d| closed(d)) {
            dup.retired = true;
        }
        desk.names.retain(|_, n| match fd {
            Some(fd) => n.fd != fd,
            None => n.pid != pid,
        });
        if fd.is_none() {
            desk.pidfds.retain(|(p, _)| *p != pid);
        }
        desk.let_go();
    }

    /// Replica region `region` of ring `epoch` was removed: nobody waits for its votes.
    pub fn region_gone(&self, epoch: usize, region: u32) {
        let mut desk = self.hold();
        if let Some(gone) = desk.gone.get_mut(epoch) {
            *gone |= 1 << region;
        }
        drop(desk);
        self.kick();
    }

    /// Writes every posted output the replicas agreed on (the monitor is about to make a
    /// call of the program's, which comes after them), and waits up to DRAIN_PATIENCE for
    /// bytes kept for descriptor `fd` of `pid` to go out (the call may write there too).
    pub fn drain(&self, pid: i32, fd: Option<i32>) {
        let shared = &*self.shared;
        let mut desk = self.hold();
        if shared.paused.load(Ordering::SeqCst) {
            return;
        }
        for (epoch, ring) in shared.rings().iter().enumerate() {
            if ring.commits() {
                desk.serve_posted(shared, epoch, ring);
            }
        }
        if let Some(fd) = fd {
            desk.flush_waiting(|d| d.pid == pid && d.fd == fd, DRAIN_PATIENCE);
        }
    }

    /// Why the committer stopped writing, if it did: the run must stop.
    pub fn failure(&self) -> Option<String> {
        if !self.shared.failed.load(Ordering::SeqCst) {
            return None;
        }
        self.shared.failure.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Wakes the committer to look at every request again (the ring changed: off, a
    /// region dropped, a new leader).
    pub fn kick(&self) {
        let rings = self.shared.rings();
        let current = self.shared.current.load(Ordering::SeqCst).min(rings.len() - 1);
        let bell = rings[current].doorbell();
        bell.fetch_add(1, Ordering::SeqCst);
        futex(bell, libc::FUTEX_WAKE, i32::MAX as u32, None);
    }

    fn hold(&self) -> MutexGuard<'_, Desk> {
        lock(&self.shared.desk)
    }

    /// Stops the committer from judging or writing anything until [`Committer::resume`];
    /// returns once an output it was writing is written and answered. What was written
    /// is then known for sure ([`was_written`]): the monitor decides whether a lost
    /// leader's output ran.
    pub fn pause(&self) {
        self.shared.paused.store(true, Ordering::SeqCst);
        drop(self.hold());
    }

    pub fn resume(&self) {
        self.shared.paused.store(false, Ordering::SeqCst);
        self.kick();
    }

    /// What the committer did so far.
    pub fn counts(&self) -> CommitCounts {
        let c = &self.shared.counters;
        CommitCounts {
            written: c.written.load(Ordering::Relaxed),
            escalated: c.escalated.load(Ordering::Relaxed),
            own: c.own.load(Ordering::Relaxed),
            wakeups: c.wakeups.load(Ordering::Relaxed),
            duplicated: c.duplicated.load(Ordering::Relaxed),
            posted: c.posted.load(Ordering::Relaxed),
            kept: c.kept.load(Ordering::Relaxed),
            refused: c.refused.load(Ordering::Relaxed),
        }
    }
}

impl Drop for Committer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.kick();
        if let Some(thread) = self.thread.take() {
            // A committer that panicked has nothing left to clean up.
            let _ = thread.join();
        }
        // The run is over: what the replicas agreed on goes out, and what sockets did
        // not take yet gets its chance.
        let shared = &*self.shared;
        let mut desk = self.hold();
        if !shared.failed.load(Ordering::SeqCst) {
            for (epoch, ring) in shared.rings().iter().enumerate() {
                if ring.commits() {
                    desk.serve_posted(shared, epoch, ring);
                }
            }
        }
        desk.flush_waiting(|_| true, DRAIN_PATIENCE);
    }
}

/// Whether request `seq` of `lane` in `ring` was written (the committer answered it
/// "done"). Sure only while the committer is paused: otherwise the answer may be on its way.
pub fn was_written(ring: &Ring, lane: usize, seq: u64) -> bool {
    ring.answered(lane) == (seq, COMMIT_DONE)
}

fn lock(desk: &Mutex<Desk>) -> MutexGuard<'_, Desk> {
    // A panic in the committer poisons the lock; what it guards stays consistent (each
    // field is replaced whole), so the monitor goes on.
    desk.lock().unwrap_or_else(|e| e.into_inner())
}

fn serve(shared: &Shared) {
    let rings = shared.rings();
    let mut last_posted = 0;
    while !shared.stop.load(Ordering::SeqCst) {
        let current = shared.current.load(Ordering::SeqCst).min(rings.len() - 1);
        let bell = rings[current].doorbell();
        let rung = bell.load(Ordering::SeqCst);
        let mut pending = false;
        for (epoch, ring) in rings[..=current].iter().enumerate() {
            if ring.commits() && !shared.failed.load(Ordering::SeqCst) {
                pending |= serve_ring(shared, epoch, ring);
            }
        }
        let keeping = lock(&shared.desk).flush(shared);
        // While posted outputs flow, look again soon without a doorbell: a follower that
        // caught up with a leader still at work leaves the ring to the leader's next wait.
        let posted = shared.counters.posted.load(Ordering::Relaxed);
        let flowing = posted != last_posted;
        last_posted = posted;
        // A replica rings after it changed what we look at, and wakes us only if it sees
        // us asleep: we say so before we look at the bell a last time.
        rings[current].set_committer_sleeping(true);
        if bell.load(Ordering::SeqCst) == rung && !shared.stop.load(Ordering::SeqCst) {
            let patience = if keeping || flowing {
                BACKLOG_RETRY_NS
            } else {
                PATIENCE_NS
            };
            let woken = futex(bell, libc::FUTEX_WAIT, rung, Some(patience)) == 0;
            if woken || pending {
                shared.counters.wakeups.fetch_add(1, Ordering::Relaxed);
            }
        }
        rings[current].set_committer_sleeping(false);
    }
}

/// Answers every complete request of `ring`; whether one still waits for a follower.
fn serve_ring(shared: &Shared, epoch: usize, ring: &Ring) -> bool {
    let mut pending = false;
    {
        let mut desk = lock(&shared.desk);
        if !shared.paused.load(Ordering::SeqCst) {
            pending |= desk.serve_posted(shared, epoch, ring);
        }
    }
    for lane in 0..LANES {
        let leader = ring.leader();
        if leader >= ring.replicas() {
            continue;
        }
        let (seq, nr, args) = ring.commit_request(lane, leader);
        if seq == 0 || ring.answered(lane).0 >= seq {
            continue;
        }
        let mut desk = lock(&shared.desk);
        // The monitor may have paused us, or replaced the leader, meanwhile.
        if shared.paused.load(Ordering::SeqCst) || ring.leader() != leader || shared.failed.load(Ordering::SeqCst) {
            continue;
        }
        let request = Request {
            epoch,
            lane,
            leader,
            seq,
            nr,
            args,
        };
        let counter = match desk.judge(ring, &request) {
            Verdict::Pending => {
                pending = true;
                continue;
            }
            Verdict::Answer(verdict, ret) => {
                let handle = match verdict {
                    COMMIT_DONE => desk.handle_for(&request, ret),
                    _ => 0,
                };
                ring.set_answer_handle(lane, handle);
                ring.answer_commit(lane, leader, seq, verdict, ret);
                match verdict {
                    COMMIT_DONE => &shared.counters.written,
                    COMMIT_OWN => &shared.counters.own,
                    _ => &shared.counters.escalated,
                }
            }
        };
        counter.fetch_add(1, Ordering::Relaxed);
        if desk.duplicated > 0 {
            shared.counters.duplicated.fetch_add(desk.duplicated, Ordering::Relaxed);
            desk.duplicated = 0;
        }
    }
    pending
}

impl Desk {
    /// The verdict on a request: written, or why not.
    fn judge(&mut self, ring: &Ring, request: &Request) -> Verdict {
        let Request {
            epoch,
            lane,
            leader,
            seq,
            nr,
            ref args,
        } = *request;
        let escalate = Verdict::Answer(COMMIT_ESCALATE, 0);
        if !ring.is_on() {
            return escalate;
        }
        let leader_slow_calls = ring.follower_at(lane, leader).slow_calls;
        let mut votes = [None; layout::MAX_REPLICAS as usize];
        for f in (0..ring.replicas()).filter(|&f| f != leader && !ring.is_lost(f)) {
            let at = ring.follower_at(lane, f);
            match at.vote_seq.cmp(&seq) {
                std::cmp::Ordering::Equal => votes[f as usize] = Some(at.vote_digest),
                // A vote past the call cannot be: the follower waits for its record.
                std::cmp::Ordering::Greater => return escalate,
                // It waits for this call's record without a vote (it is at another call
                // than an output), or it went to the monitor: the monitor compares them.
                std::cmp::Ordering::Less if at.awaiting >= seq => return escalate,
                std::cmp::Ordering::Less if at.slow_seq != 0 && at.slow_calls > leader_slow_calls => return escalate,
                std::cmp::Ordering::Less => return Verdict::Pending,
            }
        }
        let pid = self.pids.get(epoch).map_or(0, |p| p[leader as usize]);
        let Ok(fd) = i32::try_from(args[0]) else {
            return escalate;
        };
        if pid <= 0 {
            return escalate;
        }
        if self.cursors.get(epoch).is_none_or(|c| c[lane] < seq) {
            return Verdict::Pending; // a posted output of the lane before this one waits
        }
        if pid != self.leader_pid {
            // A new leader: the old one's duplicates would keep its files open.
            for dup in &mut self.dups {
                dup.retired = true;
            }
            self.let_go();
            self.leader_pid = pid;
        }
        let (at, kind) = match self.descriptor(pid, fd) {
            Ok(found) => found,
            Err(_) => return escalate, // not open in the leader: its own call says so
        };
        let Some(how) = how_to_write(kind, nr, args) else {
            return Verdict::Answer(COMMIT_OWN, 0);
        };
        if self.dups[at].broken {
            return escalate; // the monitor's call meets the error
        }
        if !self.dups[at].backlog.is_empty() {
            self.offer(at);
        }
        if !self.dups[at].backlog.is_empty() {
            // Bytes of earlier outputs wait for the socket: this one comes after them.
            return match nonblocking(self.dups[at].local.as_raw_fd()) {
                true => Verdict::Answer(COMMIT_DONE, -(libc::EAGAIN as i64)),
                false => Verdict::Pending,
            };
        }
        let local = self.dups[at].local.as_raw_fd();
        if self.copy.take(pid, nr, args).is_err() {
            return escalate;
        }
        let copy = &self.copy;
        let mut read = |addr: u64, buf: &mut [u8]| copy.read(addr, buf);
        let Ok(digest) = crate::fast_check::output_digest(nr, args, &mut self.scratch, &mut read) else {
            return escalate;
        };
        if votes.iter().flatten().any(|&vote| vote != digest) {
            return escalate;
        }
        match self.copy.write(local, how, args) {
            ret if ret >= 0 => Verdict::Answer(COMMIT_DONE, ret),
            _ => escalate, // nothing was written; the leader's own call meets it again
        }
    }

    /// Our duplicate of `fd` of process `pid` (its index in `dups`), and what it is.
    fn descriptor(&mut self, pid: i32, fd: i32) -> io::Result<(usize, Kind)> {
        if let Some(i) = self.dups.iter().position(|d| !d.retired && d.pid == pid && d.fd == fd) {
            let dup = &self.dups[i];
            if self.kcmp_works && same_file(pid, fd, dup.local.as_raw_fd(), &mut self.kcmp_works) {
                return Ok((i, dup.kind));
            }
            self.dups[i].retired = true;
            self.let_go();
        }
        let local = self.duplicate(pid, fd)?;
        let kind = kind_of(&local)?;
        Ok((self.keep_dup(pid, fd, local, kind, 0), kind))
    }

    /// Adds a duplicate to the cache (making room first); its index.
    fn keep_dup(&mut self, pid: i32, fd: i32, local: OwnedFd, kind: Kind, handle: u32) -> usize {
        if self.dups.len() >= MAX_DUPS {
            // Room first: duplicates that hold nothing back are taken again when needed.
            self.dups.retain(|d| !d.backlog.is_empty());
        }
        self.dups.push(Dup {
            pid,
            fd,
            local,
            kind,
            handle,
            backlog: Vec::new(),
            broken: false,
            retired: false,
        });
        self.dups.len() - 1
    }

    /// A new duplicate of `fd` of process `pid`.
    fn duplicate(&mut self, pid: i32, fd: i32) -> io::Result<OwnedFd> {
        let local = match self.pidfd(pid).and_then(|pidfd| get_fd(pidfd, fd)) {
            // A pidfd of a process that died: its pid may be another process's now.
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {
                self.pidfds.retain(|(p, _)| *p != pid);
                get_fd(self.pidfd(pid)?, fd)?
            }
            got => got?,
        };
        self.duplicated += 1;
        Ok(local)
    }

    /// The handle to give with a "done" answer to `request` (0: none): a whole output on
    /// a non-blocking stream socket, whose later outputs may then be posted.
    fn handle_for(&mut self, request: &Request, ret: i64) -> u32 {
        let pid = self.pids.get(request.epoch).map_or(0, |p| p[request.leader as usize]);
        let Ok(fd) = i32::try_from(request.args[0]) else {
            return 0;
        };
        let whole = self.copy.data.iter().map(|d| d.iov_len as i64).sum::<i64>();
        let Some(at) = self.dups.iter().position(|d| !d.retired && d.pid == pid && d.fd == fd) else {
            return 0;
        };
        let dup = &self.dups[at];
        let postable = matches!(dup.kind, Kind::Socket { stream: true, .. })
            && ret == whole
            && dup.backlog.is_empty()
            && !dup.broken
            && nonblocking(dup.local.as_raw_fd());
        if !postable {
            return 0;
        }
        if dup.handle != 0 && self.names.contains_key(&dup.handle) {
            return dup.handle;
        }
        let Ok(ino) = inode_of(dup.local.as_raw_fd()) else {
            return 0;
        };
        if self.names.len() >= MAX_HANDLES {
            return 0;
        }
        let handle = self.next_handle;
        self.next_handle = self.next_handle.checked_add(1).unwrap_or(1);
        self.names.insert(handle, Named { pid, fd, ino });
        self.dups[at].handle = handle;
        handle
    }

    /// Takes every posted output of `ring` whose votes are in, across lanes in the
    /// leader's order of events; whether one still waits for a vote.
    fn serve_posted(&mut self, shared: &Shared, epoch: usize, ring: &Ring) -> bool {
        if epoch >= self.cursors.len() {
            return false;
        }
        let mut pending = false;
        while !shared.failed.load(Ordering::SeqCst) {
            let mut first: Option<(u64, usize, u64, u32)> = None;
            for lane in 0..LANES {
                match self.head(shared, epoch, ring, lane) {
                    Head::Empty => {}
                    Head::Pending => pending = true,
                    Head::Ready { seq, author, order } => {
                        if first.is_none_or(|(o, ..)| order < o) {
                            first = Some((order, lane, seq, author));
                        }
                    }
                }
            }
            let Some((_, lane, seq, author)) = first else {
                break;
            };
            if let Err(why) = self.take_posted(shared, epoch, ring, lane, seq, author) {
                shared.fail(why);
                break;
            }
            self.cursors[epoch][lane] = seq + 1;
            ring.set_taken(lane, seq);
        }
        self.posted_pending = pending;
        pending
    }

    /// The next posted output of `lane` and whether its votes are in; steps over records
    /// that are not posted outputs, and refuses (never writes) posted ones whose author
    /// was removed after a follower voted against it, or that a follower went past
    /// without a vote (the ring went off while it waited for its vote slot).
    fn head(&mut self, shared: &Shared, epoch: usize, ring: &Ring, lane: usize) -> Head {
        loop {
            let seq = self.cursors[epoch][lane];
            let author = ring.author_of(lane, seq);
            if ring.published(lane, author) < seq {
                return Head::Empty;
            }
            let Some(posted) = ring.posted(lane, author, seq) else {
                self.cursors[epoch][lane] = seq + 1;
                continue;
            };
            let gone = self.gone[epoch];
            let (mut missing, mut refused) = (false, false);
            let voters = (0..ring.replicas()).filter(|&v| v != author && !ring.is_lost(v) && gone & (1 << v) == 0);
            for v in voters {
                match ring.post_vote(lane, seq, v) {
                    Some(vote) if vote == posted.digest => {}
                    // A follower found its own call different: the monitor weighs the
                    // votes and removes the odd one. A removed author's output is not
                    // made (its successor makes the call); otherwise it waits.
                    Some(_) if ring.is_lost(author) || gone & (1 << author) != 0 => refused = true,
                    Some(_) => missing = true,
                    // Past the record without a vote: it never votes (the ring went off
                    // while its vote slot was still taken). No vote, no write.
                    None if ring.passed(lane, v) >= seq && ring.post_vote(lane, seq, v).is_none() => refused = true,
                    None => missing = true,
                }
            }
            if refused {
                shared.counters.refused.fetch_add(1, Ordering::Relaxed);
                self.cursors[epoch][lane] = seq + 1;
                ring.set_taken(lane, seq);
                continue;
            }
            return match missing {
                true => Head::Pending,
                false => Head::Ready {
                    seq,
                    author,
                    order: posted.order,
                },
            };
        }
    }

    /// Writes posted output `seq` of `lane` (every vote is in): copies it out of the
    /// record, digests the copy, and writes it, or keeps what the socket does not take.
    fn take_posted(
        &mut self,
        shared: &Shared,
        epoch: usize,
        ring: &Ring,
        lane: usize,
        seq: u64,
        author: u32,
    ) -> Result<(), String> {
        let what = || format!("posted output #{seq} of lane {lane}");
        let posted = ring
            .posted(lane, author, seq)
            .ok_or_else(|| format!("{} changed before it was written", what()))?;
        let at = self.posted_dup(epoch, ring, posted.handle).map_err(|e| {
            format!(
                "{}: its descriptor (handle {}) cannot be found again: {e}",
                what(),
                posted.handle
            )
        })?;
        let args = posted_args(&posted, self.dups[at].fd);
        self.copy
            .take_local(&posted, &args)
            .map_err(|e| format!("{}: its copy is not well formed: {e}", what()))?;
        let copy = &self.copy;
        let mut read = |addr: u64, buf: &mut [u8]| copy.read(addr, buf);
        let digest = crate::fast_check::output_digest(posted.nr, &args, &mut self.scratch, &mut read)
            .map_err(|e| format!("{}: {e}", what()))?;
        if digest != posted.digest {
            return Err(format!(
                "{}: the copy in the ring has digest {digest:#x}, the replicas voted {:#x} (the copy changed after \
                 the leader digested it); nothing of it was written",
                what(),
                posted.digest
            ));
        }
        let flags = posted.flags as u32 as i32;
        shared.counters.posted.fetch_add(1, Ordering::Relaxed);
        if self.put(at, flags, ring) {
            shared.counters.kept.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// The duplicate that posted outputs under `handle` go to: the one that got the
    /// handle, or (let go from the cache since) a new one of the same open file from any
    /// replica of the ring (they all hold it under the same number).
    fn posted_dup(&mut self, epoch: usize, ring: &Ring, handle: u32) -> io::Result<usize> {
        if let Some(at) = self.dups.iter().position(|d| d.handle == handle) {
            return Ok(at);
        }
        let named = *self
            .names
            .get(&handle)
            .ok_or_else(|| io::Error::other("closed since"))?;
        let gone = self.gone.get(epoch).copied().unwrap_or(0);
        let pids: Vec<i32> = self.pids.get(epoch).map_or(Vec::new(), |p| {
            (0..ring.replicas())
                .filter(|&r| !ring.is_lost(r) && gone & (1 << r) == 0)
                .map(|r| p[r as usize])
                .filter(|&pid| pid > 0)
                .collect()
        });
        let mut last = io::Error::other("no replica holds it");
        for pid in pids {
            match self.duplicate(pid, named.fd) {
                Ok(local) if inode_of(local.as_raw_fd()).is_ok_and(|ino| ino == named.ino) => {
                    let kind = kind_of(&local)?;
                    return Ok(self.keep_dup(named.pid, named.fd, local, kind, handle));
                }
                Ok(_) => last = io::Error::other("the descriptor names another file now"),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// Writes the copy to duplicate `at` behind what it keeps already; whether bytes were
    /// kept (the socket did not take them all). After a failed write the connection is
    /// broken: its bytes go nowhere, as a broken connection's do.
    fn put(&mut self, at: usize, flags: i32, ring: &Ring) -> bool {
        if self.dups[at].broken {
            return false;
        }
        let whole: usize = self.copy.data.iter().map(|d| d.iov_len).sum();
        let sent = match self.dups[at].backlog.is_empty() {
            true => self.copy.write(
                self.dups[at].local.as_raw_fd(),
                How::Send(libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL | flags),
                &[0; 6],
            ),
            false => 0,
        };
        let sent = match sent {
            n if n >= 0 => n as usize,
            n if n == -(libc::EAGAIN as i64) => 0,
            _ => {
                self.break_connection(at, ring);
                return false;
            }
        };
        if sent >= whole {
            return false;
        }
        if self.kept_bytes + (whole - sent) > BACKLOG_MAX {
            // The peer has not read for long: the connection is shut down, which the
            // program and the peer both see, rather than bytes dropped silently.
            // SAFETY: shutdown of our own duplicate.
            unsafe { libc::shutdown(self.dups[at].local.as_raw_fd(), libc::SHUT_RDWR) };
            self.break_connection(at, ring);
            return false;
        }
        let mut skip = sent;
        let copy = &self.copy;
        let dup = &mut self.dups[at];
        for piece in &copy.data {
            let len = piece.iov_len;
            if skip >= len {
                skip -= len;
                continue;
            }
            // SAFETY: the copy's iovecs point into its own `bytes` (see `Copy`).
            let bytes = unsafe { std::slice::from_raw_parts(piece.iov_base.cast::<u8>(), len) };
            dup.backlog.extend_from_slice(&bytes[skip..]);
            skip = 0;
        }
        self.kept_bytes += whole - sent;
        // Its next output goes the synchronous way (after the kept bytes).
        ring.bump_post_epoch();
        true
    }

    fn break_connection(&mut self, at: usize, ring: &Ring) {
        let dup = &mut self.dups[at];
        dup.broken = true;
        self.kept_bytes -= dup.backlog.len();
        dup.backlog = Vec::new();
        ring.bump_post_epoch();
    }

    /// Offers duplicate `at`'s kept bytes to its socket once more.
    fn offer(&mut self, at: usize) {
        let dup = &mut self.dups[at];
        if dup.backlog.is_empty() {
            return;
        }
        // SAFETY: a send from our own buffer on our own duplicate.
        let sent = unsafe {
            libc::send(
                dup.local.as_raw_fd(),
                dup.backlog.as_ptr().cast(),
                dup.backlog.len(),
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        if sent > 0 {
            dup.backlog.drain(..sent as usize);
            self.kept_bytes -= sent as usize;
            if dup.backlog.is_empty() {
                dup.backlog = Vec::new();
            }
        } else if sent < 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EAGAIN) {
            self.kept_bytes -= dup.backlog.len();
            dup.backlog = Vec::new();
            dup.broken = true;
        }
    }

    /// Offers every socket its kept bytes; whether any are still kept.
    fn flush(&mut self, _shared: &Shared) -> bool {
        if self.kept_bytes == 0 {
            return false;
        }
        for at in 0..self.dups.len() {
            self.offer(at);
        }
        self.let_go();
        self.kept_bytes > 0
    }

    /// Offers the kept bytes of the duplicates `which` selects until they are out or
    /// `patience` ran out.
    fn flush_waiting(&mut self, which: impl Fn(&Dup) -> bool, patience: std::time::Duration) {
        let deadline = std::time::Instant::now() + patience;
        loop {
            for at in 0..self.dups.len() {
                if which(&self.dups[at]) {
                    self.offer(at);
                }
            }
            let mut waiting: Vec<libc::pollfd> = self
                .dups
                .iter()
                .filter(|d| which(d) && !d.backlog.is_empty())
                .map(|d| libc::pollfd {
                    fd: d.local.as_raw_fd(),
                    events: libc::POLLOUT,
                    revents: 0,
                })
                .collect();
            let now = std::time::Instant::now();
            if waiting.is_empty() || now >= deadline {
                break;
            }
            let ms = (deadline - now).as_millis().min(100) as i32;
            // SAFETY: poll on our own array of our own descriptors.
            unsafe { libc::poll(waiting.as_mut_ptr(), waiting.len() as libc::nfds_t, ms) };
        }
        self.let_go();
    }

    /// Closes retired duplicates that nothing needs any more (no kept bytes, and no
    /// posted output not yet taken can name them).
    fn let_go(&mut self) {
        let pending = self.posted_pending;
        self.dups
            .retain(|d| !d.retired || !d.backlog.is_empty() || (pending && d.handle != 0));
    }

    fn pidfd(&mut self, pid: i32) -> io::Result<RawFd> {
        if let Some((_, fd)) = self.pidfds.iter().find(|(p, _)| *p == pid) {
            return Ok(fd.as_raw_fd());
        }
        // SAFETY: pidfd_open returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        if self.pidfds.len() >= MAX_PIDFDS {
            self.pidfds.clear();
        }
        // SAFETY: just created, ours.
        self.pidfds.push((pid, unsafe { OwnedFd::from_raw_fd(fd as RawFd) }));
        Ok(fd as RawFd)
    }
}

/// The call a posted output makes, over its copy: the pointers are the leader's
/// addresses of the record's payload (`Posted::base`), which `Copy::take_local` maps.
fn posted_args(posted: &Posted<'_>, fd: i32) -> [u64; 6] {
    let (fd, base, flags) = (fd as u64, posted.base, posted.flags & 0xffff_ffff);
    match posted.nr as i64 {
        libc::SYS_writev => [fd, base, posted.flags >> 32, 0, 0, 0],
        libc::SYS_sendto => [fd, base, posted.len as u64, flags, 0, 0],
        libc::SYS_sendmsg => [fd, base, flags, 0, 0, 0],
        _ => [fd, base, posted.len as u64, 0, 0, 0],
    }
}

fn nonblocking(fd: RawFd) -> bool {
    // SAFETY: F_GETFL reads the open file's status flags.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    flags >= 0 && flags & libc::O_NONBLOCK != 0
}

fn inode_of(fd: RawFd) -> io::Result<u64> {
    // SAFETY: fstat into a zeroed stat of our own.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st.st_ino)
}

/// A duplicate of descriptor `fd` of the process behind `pidfd`.
fn get_fd(pidfd: RawFd, fd: i32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_getfd returns a new descriptor or -1; it is owned from here on.
    unsafe {
        let got = libc::syscall(libc::SYS_pidfd_getfd, pidfd, fd, 0);
        if got < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(OwnedFd::from_raw_fd(got as RawFd))
    }
}

/// Whether our `local` and `fd` of `pid` are the same open file. A kernel without kcmp
/// turns the cache off (every commit then duplicates the descriptor afresh).
fn same_file(pid: i32, fd: i32, local: RawFd, works: &mut bool) -> bool {
    // SAFETY: kcmp only compares; no memory is passed.
    let r = unsafe { libc::syscall(libc::SYS_kcmp, std::process::id() as i32, pid, KCMP_FILE, local, fd) };
    if r < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS) {
        *works = false;
    }
    r == 0
}

fn kind_of(fd: &OwnedFd) -> io::Result<Kind> {
    // SAFETY: fstat into a zeroed stat of our own.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(match st.st_mode & libc::S_IFMT {
        libc::S_IFSOCK => {
            let mut ty: libc::c_int = 0;
            let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
            // SAFETY: SO_TYPE into an int of ours.
            let r = unsafe {
                libc::getsockopt(
                    fd.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_TYPE,
                    (&mut ty as *mut libc::c_int).cast(),
                    &mut len,
                )
            };
            Kind::Socket {
                seqpacket: r == 0 && ty == libc::SOCK_SEQPACKET,
                stream: r == 0 && ty == libc::SOCK_STREAM,
            }
        }
        libc::S_IFREG => Kind::File,
        _ => Kind::Other,
    })
}

/// How the committer makes output `nr` on a descriptor of `kind`, if it does.
fn how_to_write(kind: Kind, nr: u64, args: &[u64; 6]) -> Option<How> {
    let nr = nr as i64;
    let never_wait = libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL;
    match kind {
        // write(2) on a SEQPACKET socket ends a record (sock_write_iter adds MSG_EOR).
        Kind::Socket { seqpacket, .. } if nr == libc::SYS_write || nr == libc::SYS_writev => {
            Some(How::Send(never_wait | if seqpacket { libc::MSG_EOR } else { 0 }))
        }
        Kind::Socket { .. } if nr == libc::SYS_sendto => Some(How::Send(never_wait | args[3] as i32)),
        Kind::Socket { .. } if nr == libc::SYS_sendmsg => Some(How::Send(never_wait | args[2] as i32)),
        Kind::File if nr == libc::SYS_write || nr == libc::SYS_writev => Some(How::Writev),
        Kind::File if nr == libc::SYS_pwrite64 || nr == libc::SYS_pwritev => Some(How::Pwritev),
        _ => None,
    }
}

/// The committer's copy of one output: the leader's buffers (and the iovec arrays and
/// msghdr that describe them), as one read of its memory found them. Its buffers are
/// allocated once, at their bounds (`layout::PAYLOAD_MAX` bytes, `layout::MAX_IOVECS`).
struct Copy {
    bytes: Vec<u8>,
    /// Where each piece of the leader's memory lies in `bytes`.
    pieces: Vec<Piece>,
    /// The output's bytes, in order: what the committer writes.
    data: Vec<libc::iovec>,
    /// The leader's iovecs, read out of `bytes`.
    wanted: Vec<(u64, u64)>,
    remote: Vec<libc::iovec>,
}

// SAFETY: the raw pointers in `data` point into the copy's own `bytes` (or, in `remote`,
// name another process's addresses and are never dereferenced here): moving the copy to
// the committer's thread moves what they point to with it (a Vec's heap buffer).
unsafe impl Send for Copy {}

/// Where a copy's bytes come from: a leader's memory, or a posted output's copy in the
/// ring (whose pointers are addresses from `base` on).
#[derive(Clone, Copy)]
enum Source<'a> {
    Remote(i32),
    Local { bytes: &'a [u8], base: u64 },
}

#[derive(Clone, Copy)]
struct Piece {
    addr: u64,
    len: usize,
    at: usize,
}

impl Copy {
    fn new() -> Copy {
        let iovecs = layout::MAX_IOVECS as usize;
        Copy {
            bytes: vec![0; layout::PAYLOAD_MAX as usize + IOVEC_SIZE * iovecs + MSGHDR_SIZE],
            pieces: Vec::with_capacity(iovecs + 2),
            data: Vec::with_capacity(iovecs),
            wanted: Vec::with_capacity(iovecs),
            remote: Vec::with_capacity(iovecs),
        }
    }

    fn used(&self) -> usize {
        self.pieces.last().map_or(0, |p| p.at + p.len)
    }

    /// Copies output `nr`'s buffers out of process `pid`.
    fn take(&mut self, pid: i32, nr: u64, args: &[u64; 6]) -> Result<(), String> {
        self.take_from(Source::Remote(pid), nr, args)
    }

    /// Copies posted output `posted` (its call `args`) out of its record's payload.
    fn take_local(&mut self, posted: &Posted<'_>, args: &[u64; 6]) -> Result<(), String> {
        let source = Source::Local {
            bytes: &posted.payload[..posted.len],
            base: posted.base,
        };
        self.take_from(source, posted.nr, args)
    }

    fn take_from(&mut self, source: Source<'_>, nr: u64, args: &[u64; 6]) -> Result<(), String> {
        let pid = source;
        self.pieces.clear();
        self.data.clear();
        self.wanted.clear();
        match nr as i64 {
            libc::SYS_write | libc::SYS_pwrite64 | libc::SYS_sendto => self.wanted.push((args[1], args[2])),
            libc::SYS_writev | libc::SYS_pwritev => self.iovecs(pid, args[1], args[2])?,
            libc::SYS_sendmsg => {
                let at = self.fetch(pid, args[1], MSGHDR_SIZE)?;
                let field = |i: usize| lockstep_core::le::u64_at(&self.bytes[at..at + MSGHDR_SIZE], 8 * i);
                let (name, iov, iovlen, controllen) = (field(0), field(2), field(3), field(5));
                if name != 0 || controllen != 0 {
                    return Err("an address or control data".into());
                }
                self.iovecs(pid, iov, iovlen)?;
            }
            _ => return Err("not a fast-path output".into()),
        }
        self.fetch_data(pid)
    }

    /// Reads the iovec array at `addr` into `wanted`.
    fn iovecs(&mut self, pid: Source<'_>, addr: u64, count: u64) -> Result<(), String> {
        if count > layout::MAX_IOVECS {
            return Err(format!("{count} iovecs"));
        }
        let len = IOVEC_SIZE * count as usize;
        let at = self.fetch(pid, addr, len)?;
        for k in 0..count as usize {
            let iov = &self.bytes[at + IOVEC_SIZE * k..at + IOVEC_SIZE * (k + 1)];
            self.wanted
                .push((lockstep_core::le::u64_at(iov, 0), lockstep_core::le::u64_at(iov, 8)));
        }
        Ok(())
    }

    /// Reads `len` bytes at `addr` of `pid` as one more piece; where they start in `bytes`.
    fn fetch(&mut self, pid: Source<'_>, addr: u64, len: usize) -> Result<usize, String> {
        let at = self.used();
        if at + len > self.bytes.len() {
            return Err("too large".into());
        }
        self.remote.clear();
        self.remote.push(libc::iovec {
            iov_base: addr as *mut libc::c_void,
            iov_len: len,
        });
        self.read_remote(pid, at, len)?;
        self.pieces.push(Piece { addr, len, at });
        Ok(at)
    }

    /// Reads every buffer of `wanted` with one `process_vm_readv`.
    fn fetch_data(&mut self, pid: Source<'_>) -> Result<(), String> {
        let total = self.wanted.iter().try_fold(0u64, |sum, &(_, len)| sum.checked_add(len));
        let total = match total {
            Some(t) if t <= layout::PAYLOAD_MAX => t as usize,
            _ => return Err("more than a record's payload".into()),
        };
        let start = self.used();
        if start + total > self.bytes.len() {
            return Err("too large".into());
        }
        self.remote.clear();
        let mut at = start;
        for &(base, len) in &self.wanted {
            let len = len as usize;
            if len > 0 && base == 0 {
                return Err("a NULL buffer".into());
            }
            if len > 0 {
                self.remote.push(libc::iovec {
                    iov_base: base as *mut libc::c_void,
                    iov_len: len,
                });
            }
            self.pieces.push(Piece { addr: base, len, at });
            // SAFETY: a pointer into `bytes`, inside it (checked above); written by the
            // kernel through our own process_vm_readv, read by our write.
            let local = unsafe { self.bytes.as_mut_ptr().add(at) };
            self.data.push(libc::iovec {
                iov_base: local.cast(),
                iov_len: len,
            });
            at += len;
        }
        self.read_remote(pid, start, total)
    }

    /// `process_vm_readv` of `self.remote` into `bytes[at..at + len]`, all of it (or the
    /// same from a posted output's copy).
    fn read_remote(&mut self, source: Source<'_>, at: usize, len: usize) -> Result<(), String> {
        if len == 0 {
            return Ok(());
        }
        let pid = match source {
            Source::Remote(pid) => pid,
            Source::Local { bytes, base } => {
                let mut to = at;
                for iov in &self.remote {
                    let from = (iov.iov_base as u64)
                        .checked_sub(base)
                        .map(|f| f as usize)
                        .filter(|&f| f.checked_add(iov.iov_len).is_some_and(|end| end <= bytes.len()))
                        .ok_or("a pointer outside the copy")?;
                    self.bytes[to..to + iov.iov_len].copy_from_slice(&bytes[from..from + iov.iov_len]);
                    to += iov.iov_len;
                }
                return Ok(());
            }
        };
        let local = libc::iovec {
            // SAFETY: inside `bytes` (callers check the bound).
            iov_base: unsafe { self.bytes.as_mut_ptr().add(at) }.cast(),
            iov_len: len,
        };
        // SAFETY: the local iovec points into our own buffer of at least `len` bytes.
        let got = unsafe {
            libc::process_vm_readv(
                pid,
                &local,
                1,
                self.remote.as_ptr(),
                self.remote.len() as libc::c_ulong,
                0,
            )
        };
        if got != len as isize {
            return Err(format!("read {got} of {len} bytes ({})", io::Error::last_os_error()));
        }
        Ok(())
    }

    /// The leader's memory at `addr`, as copied (the reader of `fast_check::output_digest`).
    fn read(&self, addr: u64, buf: &mut [u8]) -> io::Result<()> {
        let piece = self.pieces.iter().find(|p| {
            addr >= p.addr
                && addr
                    .checked_add(buf.len() as u64)
                    .is_some_and(|end| end <= p.addr + p.len as u64)
        });
        let Some(p) = piece else {
            return Err(io::Error::from_raw_os_error(libc::EFAULT));
        };
        let from = p.at + (addr - p.addr) as usize;
        buf.copy_from_slice(&self.bytes[from..from + buf.len()]);
        Ok(())
    }

    /// Writes the copy to our duplicate `fd`; the kernel's result (-errno on failure).
    fn write(&self, fd: RawFd, how: How, args: &[u64; 6]) -> i64 {
        let (iov, count) = (self.data.as_ptr(), self.data.len());
        // SAFETY: the iovecs point into `bytes`, which outlives the call.
        let ret = unsafe {
            match how {
                How::Send(flags) => {
                    let mut msg: libc::msghdr = std::mem::zeroed();
                    msg.msg_iov = iov.cast_mut();
                    msg.msg_iovlen = count;
                    libc::sendmsg(fd, &msg, flags) as i64
                }
                How::Writev => libc::writev(fd, iov, count as i32) as i64,
                // pwrite64's offset and pwritev's low half are both the fourth argument.
                How::Pwritev => libc::syscall(libc::SYS_pwritev, fd, iov, count, args[3], args[4]),
            }
        };
        if ret < 0 {
            -(io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO) as i64)
        } else {
            ret
        }
    }
}

fn futex(word: &std::sync::atomic::AtomicU32, op: i32, value: u32, timeout_ns: Option<i64>) -> i64 {
    let ts = timeout_ns.map(|ns| libc::timespec {
        tv_sec: ns / 1_000_000_000,
        tv_nsec: ns % 1_000_000_000,
    });
    let ts_ptr = ts.as_ref().map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: a futex call on a word of a shared mapping (not private: replicas ring it).
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), op, value, ts_ptr, 0, 0) }
}

fn block_all_signals() -> libc::sigset_t {
    // SAFETY: plain signal-mask calls on sets of our own.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old);
        old
    }
}

fn restore_signals(old: &libc::sigset_t) {
    // SAFETY: restores the mask saved by block_all_signals.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, old, std::ptr::null_mut()) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_reads_back_only_what_it_took() {
        let data: Vec<u8> = (0..100u8).collect();
        let mut copy = Copy::new();
        let pid = std::process::id() as i32;
        let args = [1, data.as_ptr() as u64, data.len() as u64, 0, 0, 0];
        copy.take(pid, libc::SYS_write as u64, &args).unwrap();
        let mut buf = [0u8; 10];
        copy.read(data.as_ptr() as u64 + 5, &mut buf).unwrap();
        assert_eq!(&buf, &data[5..15]);
        // Past the buffer's end: not in the copy.
        assert!(copy.read(data.as_ptr() as u64 + 95, &mut buf).is_err());
        assert_eq!(copy.data.len(), 1);
        assert_eq!(copy.data[0].iov_len, 100);
    }

    #[test]
    fn a_copy_refuses_what_the_fast_path_would_not_carry() {
        let mut copy = Copy::new();
        let pid = std::process::id() as i32;
        let big = [1, 0x1000, layout::PAYLOAD_MAX + 1, 0, 0, 0];
        assert!(copy.take(pid, libc::SYS_write as u64, &big).is_err());
        let many = [1, 0x1000, layout::MAX_IOVECS + 1, 0, 0, 0];
        assert!(copy.take(pid, libc::SYS_writev as u64, &many).is_err());
        let null = [1, 0, 10, 0, 0, 0];
        assert!(copy.take(pid, libc::SYS_write as u64, &null).is_err());
        assert!(copy.take(pid, libc::SYS_read as u64, &null).is_err());
    }

    #[test]
    fn the_copys_digest_is_the_one_the_shim_computes_over_the_same_iovecs() {
        let a: Vec<u8> = b"hello ".to_vec();
        let b: Vec<u8> = b"world, and more".to_vec();
        let iov = [
            libc::iovec {
                iov_base: a.as_ptr() as *mut _,
                iov_len: a.len(),
            },
            libc::iovec {
                iov_base: b.as_ptr() as *mut _,
                iov_len: b.len(),
            },
        ];
        let args = [1, iov.as_ptr() as u64, 2, 0, 0, 0];
        let mut copy = Copy::new();
        copy.take(std::process::id() as i32, libc::SYS_writev as u64, &args)
            .unwrap();
        let mut scratch = vec![0; 64];
        let mut from_copy = |addr: u64, buf: &mut [u8]| copy.read(addr, buf);
        let digest = crate::fast_check::output_digest(libc::SYS_writev as u64, &args, &mut scratch, &mut from_copy);
        let mut direct = |addr: u64, buf: &mut [u8]| -> io::Result<()> {
            // SAFETY: test memory of our own, alive for the call.
            unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, buf.as_mut_ptr(), buf.len()) };
            Ok(())
        };
        let expected = crate::fast_check::output_digest(libc::SYS_writev as u64, &args, &mut scratch, &mut direct);
        assert_eq!(digest.unwrap(), expected.unwrap());
        assert_eq!(copy.data.iter().map(|d| d.iov_len).sum::<usize>(), a.len() + b.len());
    }
}

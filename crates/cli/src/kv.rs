//! `lockstep kv`: serve one replica, or start a local cluster.

use clap::{Args, Subcommand, ValueEnum};
use lockstep_core::exit;
use lockstep_kv::replica::{self, Config, Mode};
use lockstep_kv::store::Limits;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::Duration;

const AFTER_HELP: &str = "\
How it works:
  Every replica executes every request in Raft's order, deterministically (expiry uses the
  time stored in the log entry). Each request's state delta, the CRC32C of every protected
  object it touched plus its reply, is sent to the other replicas in a CHECK message. A
  reply leaves only when a majority of replicas agree with the local delta. A replica that
  disagrees with the majority is repaired: a RECOVER entry goes through the log, the
  healthy replicas send the objects that differed, it replaces them and carries on.

Modes (--mode, CrossCheck's Table IV):
  single       one process, no replication, no object checks          ----
  smr          Raft replication and deterministic apply               RD--
  gop          plus checksummed objects, checked on every access      RDG-
  crosscheck   plus cross-checked state deltas and repair (default)   RDGX

Examples:
  lockstep kv cluster -n 3                      # replicas on 11211, 11212, 11213
  lockstep kv serve --listen 127.0.0.1:11211    # one unreplicated server
  lockstep kv serve --id 2 --listen 127.0.0.1:11212 \\
      --peers 127.0.0.1:21211,127.0.0.1:21212,127.0.0.1:21213 --data-dir /var/lib/kv2

Test-only commands on the client port (with --test-corruption):
  lockstep_corrupt <key> item|bucket|links [recompute] [BIT]   flip a bit on this replica
  lockstep_digest                  DIGEST <state digest> <applied entry> <objects failing>";

/// A memcached-protocol store on Raft that cross-checks state deltas and repairs objects.
#[derive(Args)]
pub struct KvArgs {
    #[command(subcommand)]
    command: KvCommand,
}

#[derive(Subcommand)]
enum KvCommand {
    Serve(ServeArgs),
    Cluster(ClusterArgs),
}

#[derive(Clone, Copy, ValueEnum)]
enum ModeArg {
    Single,
    Smr,
    Gop,
    Crosscheck,
}

impl From<ModeArg> for Mode {
    fn from(m: ModeArg) -> Mode {
        match m {
            ModeArg::Single => Mode::Single,
            ModeArg::Smr => Mode::Smr,
            ModeArg::Gop => Mode::Gop,
            ModeArg::Crosscheck => Mode::CrossCheck,
        }
    }
}

/// Options shared by `serve` and `cluster`.
#[derive(Args, Clone)]
struct StoreOpts {
    /// single, smr, gop or crosscheck (default: crosscheck with --peers, else single).
    #[arg(long, value_enum)]
    mode: Option<ModeArg>,
    /// Memory for items before LRU eviction, in MiB.
    #[arg(long, default_value_t = 64, value_name = "MIB", value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    memory_limit: u64,
    /// Largest item accepted, in bytes, counted as memcached's -I counts it: the value
    /// plus its key and about 60 bytes of header (so 1 MiB holds a value of 1,048,516
    /// bytes under a 1-byte key).
    #[arg(long, default_value_t = 1 << 20, value_name = "BYTES", value_parser = crate::args::usize_in(1, 1 << 30))]
    item_max: usize,
    /// Do not fsync the Raft log (faster; a machine crash may then lose acknowledged writes).
    #[arg(long)]
    no_fsync: bool,
    /// Accept lockstep_corrupt on the client port (tests and measurements only).
    #[arg(long)]
    test_corruption: bool,
    /// Applied log entries between snapshots (at least; a state over 1 MiB also waits
    /// until the log since the last snapshot is as large as it was). In crosscheck mode
    /// each snapshot is taken at a state audit and becomes the one sent to lagging
    /// replicas once a majority confirmed it.
    #[arg(long, default_value_t = 10_000, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1 << 40))]
    snapshot_every: u64,
    /// Seconds between state audits, whatever the load: the replicas compare digests of
    /// their whole state, so that a corrupt object no request touches is found and
    /// repaired by majority.
    #[arg(long, default_value_t = 10, value_name = "SECS", value_parser = clap::value_parser!(u64).range(1..=86_400))]
    audit_every: u64,
    /// A replica that needs more than N recoveries within --recovery-window is removed
    /// from the cluster and re-added empty, to be rebuilt from a snapshot.
    #[arg(long, default_value_t = 5, value_name = "N", value_parser = crate::args::usize_in(0, 1000))]
    max_recoveries: usize,
    /// Client connections served at once; past it a new connection gets "ERROR Too many
    /// open connections" and is closed, as with memcached's -c.
    #[arg(long, default_value_t = 1024, value_name = "N", value_parser = crate::args::usize_in(1, 1 << 20))]
    max_conns: usize,
    /// Event loops of a single replica (no --peers), each serving its own connections, as
    /// memcached's -t: 0 means one per CPU, at most 4. A cluster replica always has one
    /// loop, which owns the store.
    #[arg(long, default_value_t = 0, value_name = "N", value_parser = clap::value_parser!(u64).range(0..=64))]
    threads: u64,
    /// The window for --max-recoveries, in seconds.
    #[arg(long, default_value_t = 60, value_name = "SECS", value_parser = clap::value_parser!(u64).range(1..=7 * 86_400))]
    recovery_window: u64,
}

/// Run one replica.
#[derive(Args)]
#[command(after_help = AFTER_HELP)]
struct ServeArgs {
    /// This replica's id: 1 for the first address in --peers, 2 for the second, ...
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
    id: u64,
    /// Client (memcached) address.
    #[arg(long, default_value = "127.0.0.1:11211", value_name = "ADDR")]
    listen: String,
    /// Replica-to-replica addresses of all replicas, in id order, comma-separated.
    #[arg(long, value_delimiter = ',', value_name = "ADDR,...")]
    peers: Vec<String>,
    /// Where this replica keeps its Raft log and snapshots (default: memory only).
    #[arg(long, value_name = "DIR")]
    data_dir: Option<PathBuf>,
    /// Write every event as a JSON line to FILE.
    #[arg(long, value_name = "FILE")]
    events: Option<PathBuf>,
    #[command(flatten)]
    opts: StoreOpts,
}

/// Start a local cluster of replicas on loopback (the quick start; tests use it too).
#[derive(Args)]
#[command(after_help = AFTER_HELP)]
struct ClusterArgs {
    /// Number of replicas.
    #[arg(short, long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=9))]
    n: u64,
    /// Client port of replica 1; replica i listens on PORT + i - 1.
    #[arg(long, default_value_t = 11211)]
    port: u16,
    /// Replica-to-replica port of replica 1 (default: PORT + 10000).
    #[arg(long)]
    peer_port: Option<u16>,
    /// Keep each replica's Raft state in DIR/replica-<i> (default: memory only). With it, a
    /// replica that exits (a crash, the watchdog) is restarted, up to 5 times.
    #[arg(long, value_name = "DIR")]
    data_dir: Option<PathBuf>,
    /// Write each replica's events to DIR/replica-<i>.jsonl.
    #[arg(long, value_name = "DIR")]
    events: Option<PathBuf>,
    #[command(flatten)]
    opts: StoreOpts,
}

fn resolve(what: &str, s: &str) -> Result<SocketAddr, String> {
    s.to_socket_addrs()
        .map_err(|e| format!("{what} {s:?}: {e}"))?
        .next()
        .ok_or_else(|| format!("{what} {s:?} does not resolve"))
}

pub fn main(args: KvArgs) -> i32 {
    match args.command {
        KvCommand::Serve(a) => serve(a),
        KvCommand::Cluster(a) => cluster(a),
    }
}

fn usage(msg: String) -> i32 {
    crate::args::usage("kv", &msg)
}

fn serve(a: ServeArgs) -> i32 {
    let client = match resolve("--listen", &a.listen) {
        Ok(c) => c,
        Err(e) => return usage(e),
    };
    let mut peers = Vec::new();
    for p in &a.peers {
        match resolve("--peers", p) {
            Ok(addr) => peers.push(addr),
            Err(e) => return usage(e),
        }
    }
    let mode: Mode = a.opts.mode.map(Mode::from).unwrap_or(if peers.is_empty() {
        Mode::Single
    } else {
        Mode::CrossCheck
    });
    if mode == Mode::Single && !peers.is_empty() {
        return usage("--mode single takes no --peers".into());
    }
    if mode != Mode::Single {
        if peers.is_empty() {
            return usage(format!(
                "--mode {} needs --peers (the replica addresses, in id order)",
                mode.name()
            ));
        }
        if a.id == 0 || a.id as usize > peers.len() {
            return usage(format!(
                "--id {} is not between 1 and the {} addresses in --peers",
                a.id,
                peers.len()
            ));
        }
        if peers.len() > lockstep_kv::MAX_REPLICAS {
            return usage(format!(
                "--peers names {} replicas; a cluster has at most {}",
                peers.len(),
                lockstep_kv::MAX_REPLICAS
            ));
        }
        if mode == Mode::CrossCheck && peers.len() < 3 {
            return usage("crosscheck needs at least 3 replicas: with 2, a disagreement has no majority".into());
        }
    }
    if a.opts.item_max == 0 || a.opts.memory_limit == 0 {
        return usage("--item-max and --memory-limit must be positive".into());
    }
    let cfg = Config {
        id: if mode == Mode::Single { 1 } else { a.id },
        peers,
        client,
        mode,
        data_dir: a.data_dir,
        fsync: !a.opts.no_fsync,
        limits: Limits::new(a.opts.memory_limit << 20, a.opts.item_max),
        test_corruption: a.opts.test_corruption,
        events: a.events,
        snapshot_every: a.opts.snapshot_every.max(1),
        audit_every: Duration::from_secs(a.opts.audit_every.max(1)),
        tick: Duration::from_millis(100),
        max_recoveries: a.opts.max_recoveries,
        recovery_window: Duration::from_secs(a.opts.recovery_window.max(1)),
        watchdog: Duration::from_secs(10),
        max_conns: a.opts.max_conns.max(1),
        threads: a.opts.threads,
    };
    replica::run(cfg)
}

fn cluster(a: ClusterArgs) -> i32 {
    if a.n == 0 || a.n > lockstep_kv::MAX_REPLICAS as u64 {
        return usage(format!(
            "-n {}: a local cluster has 1 to {} replicas",
            a.n,
            lockstep_kv::MAX_REPLICAS
        ));
    }
    let peer_port = a.peer_port.unwrap_or(a.port.wrapping_add(10000));
    if (a.port as u32 + a.n as u32 > 65536) || (peer_port as u32 + a.n as u32 > 65536) {
        return usage("ports out of range".into());
    }
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("lockstep kv: cannot find my own executable: {e}");
            return 1;
        }
    };
    let peers: Vec<String> = (0..a.n)
        .map(|i| format!("127.0.0.1:{}", peer_port as u64 + i))
        .collect();
    let mode = a
        .opts
        .mode
        .unwrap_or(if a.n >= 3 { ModeArg::Crosscheck } else { ModeArg::Smr });
    if let Some(dir) = &a.events {
        if let Err(e) = std::fs::create_dir_all(dir) {
            eprintln!("lockstep kv: cannot create {}: {e}", dir.display());
            return 1;
        }
    }
    let spawn = |id: u64| -> std::io::Result<Child> {
        let mut cmd = Command::new(&exe);
        cmd.args(["kv", "serve", "--id", &id.to_string()]);
        cmd.args(["--listen", &format!("127.0.0.1:{}", a.port as u64 + id - 1)]);
        if a.n > 1 {
            cmd.args(["--peers", &peers.join(",")]);
        }
        cmd.args(["--mode", mode.to_possible_value().unwrap().get_name()]);
        cmd.args(["--memory-limit", &a.opts.memory_limit.to_string()]);
        cmd.args(["--item-max", &a.opts.item_max.to_string()]);
        cmd.args(["--snapshot-every", &a.opts.snapshot_every.to_string()]);
        cmd.args(["--audit-every", &a.opts.audit_every.to_string()]);
        cmd.args(["--max-recoveries", &a.opts.max_recoveries.to_string()]);
        cmd.args(["--recovery-window", &a.opts.recovery_window.to_string()]);
        cmd.args(["--max-conns", &a.opts.max_conns.to_string()]);
        cmd.args(["--threads", &a.opts.threads.to_string()]);
        if a.opts.no_fsync {
            cmd.arg("--no-fsync");
        }
        if a.opts.test_corruption {
            cmd.arg("--test-corruption");
        }
        if let Some(dir) = &a.data_dir {
            cmd.arg("--data-dir").arg(dir.join(format!("replica-{id}")));
        }
        if let Some(dir) = &a.events {
            cmd.arg("--events").arg(dir.join(format!("replica-{id}.jsonl")));
        }
        cmd.spawn()
    };
    let mut children: Vec<(u64, Child, u32)> = Vec::new();
    for id in 1..=a.n {
        match spawn(id) {
            Ok(c) => children.push((id, c, 0)),
            Err(e) => {
                eprintln!("lockstep kv: cannot start replica {id}: {e}");
                for (_, c, _) in &mut children {
                    // (a replica that already exited needs no kill)
                    let _ = c.kill();
                }
                return 1;
            }
        }
    }
    eprintln!(
        "lockstep kv: {} replica(s), memcached on 127.0.0.1:{}..{} (Ctrl-C stops them)",
        a.n,
        a.port,
        a.port as u64 + a.n - 1
    );
    stop_on_signal();
    let mut status = 0;
    while !children.is_empty() {
        std::thread::sleep(Duration::from_millis(100));
        if STOP.load(std::sync::atomic::Ordering::SeqCst) {
            for (_, c, _) in &mut children {
                // (a replica that already exited needs no kill)
                let _ = c.kill();
                // (reaped so that none is left a zombie; its status no longer matters)
                let _ = c.wait();
            }
            return status;
        }
        let mut i = 0;
        while i < children.len() {
            let (id, c, restarts) = &mut children[i];
            let Ok(Some(st)) = c.try_wait() else {
                i += 1;
                continue;
            };
            eprintln!("lockstep kv: replica {id} exited ({st})");
            if st.code() == Some(exit::DETECTED) {
                status = exit::DETECTED;
            }
            // Only a replica with a data directory may come back: one without would rejoin
            // with no memory of what it acknowledged, which Raft does not allow.
            if a.data_dir.is_some() && *restarts < CLUSTER_RESTARTS {
                *restarts += 1;
                match spawn(*id) {
                    Ok(new) => {
                        eprintln!("lockstep kv: restarted replica {id} from its data directory ({restarts} of {CLUSTER_RESTARTS})");
                        *c = new;
                        i += 1;
                        continue;
                    }
                    Err(e) => eprintln!("lockstep kv: cannot restart replica {id}: {e}"),
                }
            }
            children.remove(i);
        }
    }
    status
}

/// Restarts per replica that `kv cluster --data-dir` performs before giving up on it.
const CLUSTER_RESTARTS: u32 = 5;

static STOP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn stop_on_signal() {
    extern "C" fn on_signal(_: libc::c_int) {
        STOP.store(true, std::sync::atomic::Ordering::SeqCst);
    }
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
}

//! `lockstep run`.

use clap::Args;
use lockstep_core::exit;
use lockstep_run::{CompareMode, FlipSpec, Options};
use std::path::PathBuf;
use std::time::Duration;

const AFTER_HELP: &str = "\
How it works:
  Every replica runs the unmodified program on its own core, with ASLR off, identical
  AT_RANDOM bytes, the vDSO hidden (so time is a syscall) and RDTSC trapped. Each syscall
  that is not purely local stops all replicas at the same point. Inputs (read, recv,
  clock_gettime, getrandom, ...) run once in the leader and are copied to the followers;
  outputs (write, send, unlink, ...) are compared first and then run once.

  -r 2 (DMR): any divergence stops everything with exit status 86 before the divergent
              output leaves.
  -r 3 (TMR): the faulty replica is voted out, the others go on, and a fresh third
              replica is forked from a healthy one (single-threaded, single-process
              programs; see docs/run.md).

Exit status:
  the program's own status; 128+N if it was killed by signal N; 86 corruption detected
  and stopped; 2 usage error; 125 lockstep failure (e.g. an unsupported syscall, named on
  stderr); 126 command not executable; 127 command not found.

Examples:
  lockstep run -r 3 -- sha256sum big.iso
  lockstep run -r 2 --compare every --events ev.jsonl -- python3 job.py
  lockstep run -r 3 --stats -- redis-server --port 7000
  lockstep run -r 2 --backend ptrace --stats -- redis-server --port 7000";

/// Run a program as 2 (DMR) or 3 (TMR) replicas that vote on every output.
#[derive(Args)]
#[command(after_help = AFTER_HELP)]
pub struct RunArgs {
    /// Number of replicas: 2 detects (DMR), 3 detects and masks (TMR).
    #[arg(short = 'r', long = "replicas", default_value_t = 2, value_name = "N")]
    replicas: u32,

    /// What is compared: `io` compares only outputs; `args` folds every syscall into a
    /// per-replica signature voted at outputs; `every` votes at every syscall.
    #[arg(long, default_value = "args", value_name = "MODE", value_parser = one_of::<CompareMode>(&["io", "args", "every"]))]
    compare: CompareMode,

    /// How replicas' syscalls reach the monitor. `fast` (the default): a shim preloaded
    /// into each replica replicates the hot inputs, outputs and clock reads in process
    /// through shared memory and leaves the rest to ptrace; it needs a dynamically linked
    /// program and root (page 0 is mapped), and falls back to ptrace with a one-line
    /// message otherwise. `ptrace`: every intercepted call stops every replica (slower,
    /// the same checks). docs/run.md, "The fast backend".
    #[arg(
        long,
        env = "LOCKSTEP_BACKEND",
        default_value = "fast",
        value_name = "BACKEND",
        value_parser = one_of::<lockstep_run::BackendKind>(&["fast", "ptrace"])
    )]
    backend: lockstep_run::BackendKind,

    /// Fast backend: who lets the leader's outputs leave. `strict`: the monitor; its
    /// committer thread copies each output out of the leader, digests the copy and writes
    /// it only if every follower voted that digest (a faulty leader cannot skip the check;
    /// no stop, outputs to pipes and ttys are checked at a stop). `strict-stop`: the
    /// monitor checks each output at a ptrace stop of the leader (the older strict path).
    /// `fast`: the leader checks in process, twice (no monitor; a fault in the leader at
    /// the wrong moment can let a wrong output out). docs/run.md has the measurements.
    #[arg(
        long,
        env = "LOCKSTEP_OUTPUT_CHECK",
        default_value = "strict",
        value_name = "MODE",
        value_parser = one_of::<lockstep_run::OutputCheck>(&["strict", "strict-stop", "fast"])
    )]
    output_check: lockstep_run::OutputCheck,

    /// Fast backend: how the followers' threads keep the leader's order of the program's
    /// pthread and semaphore operations. `global`: one order of every operation and call
    /// of every thread. `object`: an order per object (mutex, semaphore, ...), so threads
    /// on different objects never wait for each other; only for programs that share data
    /// under locks alone (memcached's races make it diverge). `serial`: one order, and each
    /// replica runs one thread at a time, switching only at calls and operations, so that
    /// racy reads are replayed too; slower, and a thread that spins on memory without a call
    /// never lets another run.
    #[arg(
        long,
        env = "LOCKSTEP_SYNC_ORDER",
        default_value = "global",
        value_name = "ORDER",
        value_parser = one_of::<lockstep_run::SyncOrder>(&["global", "object", "serial"])
    )]
    sync_order: lockstep_run::SyncOrder,

    /// Fast backend: pause iterations a waiting replica spins at most before it sleeps (0:
    /// never; a follower waiting for its leader's next record spins 256 at most).
    #[arg(long, default_value_t = lockstep_run::fast::DEFAULT_SPIN, value_name = "N")]
    spin: u32,

    /// How long the replicas that reached a rendezvous wait for a straggler before it is
    /// declared faulty (TMR) or the run halts (DMR): seconds, or with a unit (500ms, 1m);
    /// from 1ms to 1 day.
    #[arg(long, default_value = "10", value_name = "SECS",
          value_parser = crate::args::timeout())]
    timeout: Duration,

    /// Write one JSON object per event (divergence, vote, re-integration, ...) to FILE.
    #[arg(long, value_name = "FILE")]
    events: Option<PathBuf>,

    /// Print syscall, vote and timing counters on stderr at exit.
    #[arg(long)]
    stats: bool,

    /// Pin replica i to the i-th CPU of LIST (e.g. 0,1 or 0-2). Default: spread replicas
    /// round-robin over the CPUs lockstep may use.
    #[arg(long, value_name = "LIST")]
    cpus: Option<String>,

    /// Pin lockstep's monitor to this CPU. Every intercepted syscall wakes the monitor and
    /// the replicas in turn, so for syscall-heavy programs putting the monitor and the
    /// replicas on one CPU (e.g. --cpus 0,0 --monitor-cpu 0) avoids cross-CPU wake-ups and
    /// can be much faster; CPU-bound programs want the replicas spread (docs/results.md).
    #[arg(long, value_name = "CPU", value_parser = crate::args::usize_in(0, CPU_MAX as u64))]
    monitor_cpu: Option<usize>,

    /// After voting out a replica, stay with the remaining ones instead of forking a new one.
    #[arg(long)]
    no_reintegrate: bool,

    /// Do not print event lines on stderr.
    #[arg(short, long)]
    quiet: bool,

    /// When the program's first process exits, kill its processes that outlive it
    /// (background jobs, daemons). Default: lockstep returns with the first process's
    /// status, as the program's caller would see it natively, and a detached monitor keeps
    /// replicating the survivors until the last one exits.
    #[arg(long)]
    kill_orphans: bool,

    /// Test only: REPLICA:SYSCALL:TARGET:BIT flips BIT of TARGET (a register, or
    /// mem:REG+OFF) in REPLICA at its SYSCALL-th intercepted syscall; TARGET `kill` or
    /// `hang` kills the replica or makes it spin there.
    #[arg(long = "test-flip", value_name = "SPEC", hide = true)]
    test_flip: Vec<String>,

    /// The program and its arguments.
    #[arg(last = true, value_name = "CMD")]
    command: Vec<String>,
}

/// CPU numbers above this are refused before a range is expanded (the kernel's
/// CPU_SETSIZE; `0-99999999999` must not allocate).
const CPU_MAX: usize = 1023;

fn parse_cpus(list: &str) -> Result<Vec<usize>, String> {
    let mut cpus = Vec::new();
    for part in list.split(',').filter(|p| !p.is_empty()) {
        let bad = || format!("bad CPU list '{list}' (expected e.g. 0,1 or 0-3)");
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
                if a > b || b > CPU_MAX {
                    return Err(bad());
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(part.parse().ok().filter(|&c| c <= CPU_MAX).ok_or_else(bad)?),
        }
    }
    if cpus.is_empty() {
        return Err(format!("empty CPU list '{list}'"));
    }
    Ok(cpus)
}

fn usage(msg: &str) -> i32 {
    crate::args::usage("run", msg)
}

/// One of `names` (listed in --help and in the error), parsed into the library's type.
fn one_of<T>(names: &'static [&'static str]) -> impl clap::builder::TypedValueParser<Value = T>
where
    T: std::str::FromStr<Err = String> + Clone + Send + Sync + 'static,
{
    use clap::builder::TypedValueParser as _;
    clap::builder::PossibleValuesParser::new(names).try_map(|s| s.parse::<T>())
}

pub fn main(a: RunArgs) -> i32 {
    let cpus = match a.cpus.as_deref().map(parse_cpus).transpose() {
        Ok(c) => c.unwrap_or_default(),
        Err(e) => return usage(&e),
    };
    let mut flips = Vec::new();
    for f in &a.test_flip {
        match f.parse::<FlipSpec>() {
            Ok(spec) if spec.replica < a.replicas => flips.push(spec),
            Ok(spec) => {
                return usage(&format!(
                    "--test-flip names replica {} but there are {}",
                    spec.replica, a.replicas
                ))
            }
            Err(e) => return usage(&e),
        }
    }
    let options = Options {
        replicas: a.replicas,
        compare: a.compare,
        backend: a.backend,
        spin: a.spin,
        output_check: a.output_check,
        sync_order: a.sync_order,
        timeout: a.timeout,
        events: a.events,
        stats: a.stats,
        cpus,
        monitor_cpu: a.monitor_cpu,
        reintegrate: !a.no_reintegrate,
        flips,
        quiet: a.quiet,
        kill_orphans: a.kill_orphans,
        command: a.command,
    };
    let quiet = options.quiet;
    match lockstep_run::run(options) {
        Ok(status) => status,
        Err(e) => {
            let code = e.exit_status();
            if code == exit::USAGE {
                return usage(&e.to_string());
            }
            if e.reported_as_event() && !quiet {
                return code; // its event line is on stderr already: say it once
            }
            let msg = e.to_string();
            if msg.starts_with("lockstep run:") {
                eprintln!("{msg}");
            } else {
                eprintln!("lockstep run: {msg}");
            }
            code
        }
    }
}

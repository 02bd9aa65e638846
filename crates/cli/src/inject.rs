//! `lockstep inject`.

use clap::Args;
use lockstep_core::exit;
use lockstep_inject::campaign::{self, Config};
use lockstep_inject::classify::{classify, Compare};
use lockstep_inject::fault::{Model, Region, Scope, Width};
use lockstep_inject::shard::{self, CampaignFile, Shard};
use lockstep_inject::target::{Plan, Point};
use lockstep_inject::{report, stats};
use std::io::IsTerminal;
use std::path::PathBuf;

const AFTER_HELP: &str = "\
How it works:
  K golden runs (J at a time) fix the expected output, the runtime and the CPU time. Each
  injection then starts the program under ptrace, runs it to the injection point, applies
  one fault, lets it go, and classifies the result:
  masked, detected (exit 86), crash, hang, program-error, sdc, not-activated.

Fault models (--fault):
  reg    flip a bit of a general-purpose register (not rsp, rip)           RREG
  dest   single-step to the next instruction that writes a register or
         memory, let it execute, flip a bit of what it wrote               WREG/WVAL
  addr   single-step to the next memory access with a base/index register,
         flip a bit of that register for this one instruction only        WADDR/RADDR
  mem    flip a bit of a random byte of writable memory in RAM (--region)  RVAL
  ip     flip a bit of the instruction pointer                             CF
  text   flip a bit of the program's code (--libs: and its libraries)
  mixed  each run draws one of reg, dest, addr, mem, ip
  none   change nothing: checks the harness itself (every run must be masked)

Injection points:
  default           uniform over the least CPU time a golden run used, counted from the
                    target's exec (a replica's own CPU time with --replica); time-based:
                    no hardware counters here
  --at syscall:K    after the K-th syscall of the program returns (exact, replayable)
  --at syscall:K+steps:D   ... then D single-steps further

Fork server (time-based points, default): each worker keeps stopped copies of the program
  at a few points of its CPU time and starts a run from the last copy before its point, so
  runs skip what every run does alike. Copies are only taken while the program has done
  nothing a copy cannot repeat (no file written, no thread, child, timer or socket, only
  fds 0-2 open); otherwise runs start fresh. --no-fork-server: always start fresh.

Outputs in --out DIR: results.jsonl (one line per run, appended as runs finish; run the
same command again to resume), summary.json, summary.md, summary.svg, and campaign.json
(the campaign's id, which `merge` checks when it joins the shards of a campaign).

Examples:
  lockstep inject --fault reg --runs 1000 -- ./md5job input.bin
  lockstep inject --fault mem --region heap --confidence 95 --margin 1 -- python3 job.py
  lockstep inject --fault reg --replica any -- lockstep run -r 3 -- ./md5job input.bin
  lockstep inject --fault mem -j 2 --server --port 7000 \\
      --client 'redis-cli -p {port} get k' -- redis-server --port {port} --save ''
  lockstep inject --compare file:{dir}/out.txt -- ./job -o {dir}/out.txt
  lockstep inject --replay out/results.jsonl:17 -- ./md5job input.bin
  parallel lockstep inject --shard {}/4 -j 1 --out camp/s{} -- ./md5job input.bin ::: 0 1 2 3
  lockstep inject merge --out camp/all camp/s0 camp/s1 camp/s2 camp/s3";

/// Inject faults into a program and classify every outcome, with confidence intervals.
#[derive(Args)]
#[command(after_help = AFTER_HELP, args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct InjectArgs {
    #[command(subcommand)]
    action: Option<InjectAction>,
    /// Fault model: reg, dest, addr, mem, ip, text, mixed or none (see below).
    #[arg(long, default_value = "reg", value_name = "MODEL")]
    fault: String,
    /// Number of injections (default 100 unless --confidence/--margin is given).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=MAX_RUNS))]
    runs: Option<u64>,
    /// With --margin: choose the number of runs for this confidence level (percent).
    #[arg(long, value_name = "PCT")]
    confidence: Option<f64>,
    /// With --confidence: the margin of error in percentage points.
    #[arg(long, value_name = "PCT")]
    margin: Option<f64>,
    /// Parallel workers (default: the number of CPUs).
    #[arg(long, short = 'j', value_name = "J", value_parser = crate::args::usize_in(1, 1024))]
    jobs: Option<usize>,
    /// Seed of the campaign; each run's choices depend only on it and the run's number.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Hang timeout: `auto` (10x the golden runtime, at least 2 s) or seconds.
    #[arg(long, default_value = "auto", value_name = "auto|SECS")]
    timeout: String,
    /// Number of golden (fault-free) runs.
    #[arg(long, default_value_t = 3, value_name = "K", value_parser = clap::value_parser!(u32).range(1..=1000))]
    golden: u32,
    /// Channels compared with the golden run: stdout, stderr, exit, file:PATH (a file the
    /// target writes; `{dir}` in PATH and in the command is each run's own directory).
    #[arg(long, default_value = "stdout,exit", value_name = "LIST")]
    compare: String,
    /// A command that decides whether differing outputs are equivalent: it is run as
    /// `sh -c 'CMD "$@"' sh GOLDEN RUN` and exits 0 when they are (for example
    /// `diff -q -I '^took'` to ignore timing lines). Also used for the golden runs.
    #[arg(long, value_name = "CMD")]
    diff_cmd: Option<String>,
    /// Server mode: the target is a server. Wait until it accepts connections on --port,
    /// run --client, compare the client's output, then stop the server with SIGTERM.
    #[arg(long, requires_all = ["port", "client"])]
    server: bool,
    /// Server mode: the TCP port on 127.0.0.1; worker w uses PORT+w, written `{port}` in
    /// the command and the client.
    #[arg(long, value_name = "PORT", requires = "server", value_parser = clap::value_parser!(u16).range(1..))]
    port: Option<u16>,
    /// Server mode: the client workload (run with sh -c; `{port}` and `{dir}` expand).
    #[arg(long, value_name = "CMD", requires = "server")]
    client: Option<String>,
    /// Server mode: the client's exit status that means its own check rejected a wrong
    /// reply (a CRC, a checksum): such a run counts as detected, not sdc.
    #[arg(long, value_name = "CODE", requires = "server", default_value_t = lockstep_core::exit::DETECTED)]
    client_detected: i32,
    /// Exact injection point: syscall:K or syscall:K+steps:D.
    #[arg(long, value_name = "POINT")]
    at: Option<String>,
    /// Bits changed: 1, 2 (adjacent) or word (a random value).
    #[arg(long, default_value = "1", value_name = "1|2|word")]
    bits: String,
    /// Memory region for --fault mem: heap, stack, data, anon or all.
    #[arg(long, default_value = "all", value_name = "REGION")]
    region: String,
    /// For --fault text: include shared libraries' code.
    #[arg(long)]
    libs: bool,
    /// Time-based points: only threads of processes named NAME (their comm, as in
    /// `ps -o comm`) are victims. Default: every thread and child of the target.
    #[arg(long, value_name = "NAME")]
    pid_filter: Option<String>,
    /// Output directory.
    #[arg(long, default_value = "inject-out", value_name = "DIR")]
    out: PathBuf,
    /// Fault one replica of a `lockstep run` target (leader, follower or any) instead of
    /// the target process: the run monitor applies the fault. With --at syscall:K, K counts
    /// the replica's intercepted syscalls (its first is the execve).
    #[arg(long, value_name = "WHICH")]
    replica: Option<String>,
    /// Re-run one recorded injection: RESULTS.jsonl:RUN.
    #[arg(long, value_name = "FILE:RUN")]
    replay: Option<String>,
    /// Run only the K-th of N disjoint slices of the campaign (runs r with r mod N = K),
    /// with the seeds and points of the whole campaign; join the slices' --out
    /// directories with `lockstep inject merge` (see docs/inject.md for GNU parallel and
    /// Slurm).
    #[arg(long, value_name = "K/N")]
    shard: Option<String>,
    /// Start every run with a fresh exec. By default a worker keeps stopped copies of the
    /// program at a few points of its CPU time (taken only while the program has done
    /// nothing a copy could not repeat: see docs/inject.md) and starts a time-based run
    /// from the last copy before its point.
    #[arg(long)]
    no_fork_server: bool,
    /// The program and its arguments.
    #[arg(last = true, value_name = "CMD", required = true)]
    command: Vec<String>,
}

#[derive(clap::Subcommand)]
enum InjectAction {
    /// Join the --out directories of a campaign's shards (--shard K/N) into one: its
    /// results.jsonl, summary.json, summary.md and summary.svg. Refuses directories of
    /// different campaigns (their campaign.json ids differ) and the same shard twice.
    Merge(MergeArgs),
}

#[derive(Args)]
struct MergeArgs {
    /// Where the merged campaign goes (created; must not hold another campaign).
    #[arg(long, default_value = "inject-merged", value_name = "DIR")]
    out: PathBuf,
    /// Merge even if some shards are missing (the summary then covers fewer runs).
    #[arg(long)]
    partial: bool,
    /// The shards' --out directories.
    #[arg(value_name = "SHARD_DIR", required = true)]
    shards: Vec<PathBuf>,
}

fn usage(msg: &str) -> i32 {
    crate::args::usage("inject", msg)
}

/// The most runs one campaign (or one shard of it) may ask for.
const MAX_RUNS: u64 = 1_000_000_000;

fn fail(msg: &str) -> i32 {
    eprintln!("lockstep inject: {msg}");
    exit::LOCKSTEP_FAILURE
}

pub fn main(a: InjectArgs) -> i32 {
    if let Some(InjectAction::Merge(m)) = &a.action {
        return merge(m);
    }
    let model: Model = match a.fault.parse() {
        Ok(m) => m,
        Err(e) => return usage(&e),
    };
    let (width, region, mut compare): (Width, Region, Compare) =
        match (a.bits.parse(), a.region.parse(), a.compare.parse()) {
            (Ok(w), Ok(r), Ok(c)) => (w, r, c),
            (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => return usage(&e),
        };
    let at = match a.at.as_deref().map(str::parse::<Point>).transpose() {
        Ok(p) => p,
        Err(e) => return usage(&e),
    };
    let timeout = match a.timeout.as_str() {
        "auto" => None,
        s => match crate::args::timeout()(s) {
            Ok(d) => Some(d),
            Err(e) => {
                return usage(&format!(
                    "--timeout {e} (expected auto or a duration from 1ms to 1 day)"
                ))
            }
        },
    };
    if a.region != "all" && model != Model::Mem {
        return usage("--region only applies to --fault mem");
    }
    if a.pid_filter.is_some() && at.is_some() {
        return usage("--pid-filter applies to time-based points; --at syscall:K always faults the main thread");
    }
    if a.libs && model != Model::Text {
        return usage("--libs only applies to --fault text");
    }
    compare.diff_cmd = a.diff_cmd.clone();
    let confidence = a.confidence.unwrap_or(95.0);
    let runs = match (a.runs, a.confidence, a.margin) {
        (Some(_), Some(_), Some(_)) => return usage("give either --runs or --confidence with --margin, not both"),
        (_, Some(c), Some(m)) => {
            if !((50.0..100.0).contains(&c) && m > 0.0 && m < 50.0) {
                return usage("--confidence must be in [50, 100) and --margin in (0, 50) percent");
            }
            let n = stats::sample_size(c, m / 100.0, None);
            if n > MAX_RUNS {
                return usage(&format!(
                    "--margin {m:?} at {c:?}% needs {n} runs, more than {MAX_RUNS}"
                ));
            }
            eprintln!("lockstep inject: {n} runs for ±{m}% at {c}% confidence (Leveugle et al.)");
            n
        }
        (_, Some(_), None) | (_, None, Some(_)) => return usage("--confidence and --margin go together"),
        (Some(n), None, None) => n,
        (None, None, None) => 100,
    };
    if runs == 0 {
        return usage("--runs must be at least 1");
    }
    let shard = match a.shard.as_deref().map(str::parse::<Shard>).transpose() {
        Ok(s) => s,
        Err(e) => return usage(&e),
    };
    if shard.is_some() && a.replay.is_some() {
        return usage("--replay re-runs one recorded run; it takes no --shard");
    }
    let replica = match a
        .replica
        .as_deref()
        .map(str::parse::<lockstep_inject::fault::ReplicaChoice>)
        .transpose()
    {
        Ok(r) => r,
        Err(e) => return usage(&e),
    };
    let is_lockstep_run = a.command.len() >= 2 && a.command[0].ends_with("lockstep") && a.command[1] == "run";
    if replica.is_some() && !is_lockstep_run {
        return usage("--replica needs a `lockstep run ...` command as the target");
    }
    if is_lockstep_run && replica.is_none() && at.is_none() {
        return usage("a `lockstep run` target needs --replica leader|follower|any: its replicas are traced by the run monitor, and a process has only one tracer");
    }
    let jobs = a
        .jobs
        .unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1))
        .max(1);
    let uses = |token: &str| a.command.iter().any(|c| c.contains(token));
    if jobs > 1 && compare.files.iter().any(|f| !f.contains("{dir}")) {
        return usage(
            "parallel runs would share a compared file: write {dir} in file:PATH (and in the command), or use -j 1",
        );
    }
    let server = match (a.server, a.port, a.client.clone()) {
        (true, Some(port), Some(client)) => {
            if !(1..=255).contains(&a.client_detected) {
                return usage("--client-detected must be an exit status from 1 to 255");
            }
            compare.client_detected = Some(a.client_detected);
            if jobs > 1 && !(uses("{port}") && client.contains("{port}")) {
                return usage("with -j 2 or more each worker's server needs its own port: write {port} in the server command and in --client, or use -j 1");
            }
            if let Some((low, high)) = ephemeral_ports() {
                let last = port as u32 + jobs as u32 - 1;
                if (port as u32) <= high && last >= low {
                    eprintln!(
                        "lockstep inject: warning: ports {port}-{last} overlap the kernel's ephemeral range {low}-{high}: an outgoing connection (even the client's) can take one and the server then fails to bind; pick ports below {low}"
                    );
                }
            }
            Some(lockstep_inject::server::Server { port, client })
        }
        _ => None,
    };
    // Resolve the program once (templates like {dir} are left for each run).
    let mut argv = a.command.clone();
    if !argv[0].contains('{') {
        match campaign::resolve_program(&argv[0]) {
            Some(p) => argv[0] = p.to_string_lossy().into_owned(),
            None => return fail(&format!("command not found or not executable: {}", argv[0])),
        }
    }
    let cfg = Config {
        argv,
        model,
        width,
        scope: Scope {
            region,
            libs: a.libs,
            pid_filter: a.pid_filter.clone(),
        },
        at,
        runs,
        jobs,
        seed: a.seed,
        timeout,
        golden_runs: a.golden,
        compare,
        out: a.out.clone(),
        confidence,
        live_progress: std::io::stderr().is_terminal(),
        replica,
        server,
        shard,
        fork_server: !a.no_fork_server,
    };
    if let Some(spec) = a.replay.as_deref() {
        return replay(&cfg, spec);
    }
    let reference = match campaign::golden_runs(&cfg) {
        Ok(r) => r,
        Err(e) => return fail(&e),
    };
    let campaign_file = CampaignFile {
        id: shard::campaign_id(&cfg, &a.fault, &reference.golden),
        command: cfg.argv.clone(),
        fault: a.fault.clone(),
        runs,
        seed: cfg.seed,
        confidence,
        shard,
    };
    if let Err(e) = claim_out_dir(&cfg.out, &campaign_file) {
        return e;
    }
    let slice = match shard {
        Some(s) => format!(
            "shard {s} of campaign {}: {} of {runs} runs",
            campaign_file.id,
            s.runs_of(runs)
        ),
        None => format!("{runs} runs"),
    };
    eprintln!(
        "lockstep inject: golden runtime {:.1} ms ({:.1} ms CPU), hang timeout {:.1} s, {slice} on {} workers",
        reference.runtime.as_secs_f64() * 1e3,
        reference.cpu.as_secs_f64() * 1e3,
        reference.timeout.as_secs_f64(),
        cfg.jobs
    );
    let (records, throughput) = match campaign::run(&cfg, &reference) {
        Ok(r) => r,
        Err(e) => return fail(&e),
    };
    let mut summary = report::summarise(&cfg.argv, &a.fault, &records, confidence);
    summary.throughput = report::Rate::new(
        throughput.new_runs,
        throughput.elapsed.as_secs_f64(),
        cfg.jobs,
        reference.whole.as_secs_f64(),
    );
    if let Err(e) = report::write_all(&cfg.out, &summary) {
        return fail(&format!("cannot write the reports: {e}"));
    }
    print!("{}", report::markdown(&summary));
    0
}

/// Records which campaign `out` holds, refusing a directory that holds results of another
/// one (resuming appends to results.jsonl, which must not mix campaigns or shards).
fn claim_out_dir(out: &std::path::Path, campaign: &CampaignFile) -> Result<(), i32> {
    if let Err(e) = std::fs::create_dir_all(out) {
        return Err(fail(&format!("cannot create {}: {e}", out.display())));
    }
    let has_results = out.join("results.jsonl").exists();
    match CampaignFile::read(out) {
        Ok(old) if old.id != campaign.id || old.shard != campaign.shard => {
            return Err(usage(&format!(
                "{} holds results of another campaign or shard (campaign {}{}); give another --out",
                out.display(),
                old.id,
                old.shard.map(|s| format!(", shard {s}")).unwrap_or_default()
            )))
        }
        Ok(_) => {}
        Err(_) if has_results && campaign.shard.is_some() => {
            return Err(usage(&format!(
                "{} holds results of a campaign without a campaign.json; a shard needs its own --out",
                out.display()
            )))
        }
        Err(_) => {}
    }
    campaign
        .write(out)
        .map_err(|e| fail(&format!("cannot write {}: {e}", out.join(CampaignFile::NAME).display())))
}

/// `lockstep inject merge`.
fn merge(m: &MergeArgs) -> i32 {
    let merged = match shard::merge(&m.shards) {
        Ok(merged) => merged,
        Err(e) => return usage(&e),
    };
    if !merged.missing_shards.is_empty() && !m.partial {
        return usage(&format!(
            "shard(s) {:?} are missing: merge them too, or give --partial to summarise the runs present",
            merged.missing_shards
        ));
    }
    if m.shards.iter().any(|d| same_dir(d, &m.out)) {
        return usage("--out must not be one of the shard directories");
    }
    if let Err(e) = claim_out_dir(&m.out, &merged.campaign) {
        return e;
    }
    let results = m.out.join("results.jsonl");
    if let Err(e) = campaign::save_results(&results, &merged.records) {
        return fail(&format!("cannot write {}: {e}", results.display()));
    }
    let c = &merged.campaign;
    let summary = report::summarise(&c.command, &c.fault, &merged.records, c.confidence);
    if let Err(e) = report::write_all(&m.out, &summary) {
        return fail(&format!("cannot write the reports: {e}"));
    }
    eprintln!(
        "lockstep inject: merged {} shard director{} of campaign {}: {} of {} runs{}",
        m.shards.len(),
        if m.shards.len() == 1 { "y" } else { "ies" },
        c.id,
        merged.records.len(),
        c.runs,
        if merged.missing_shards.is_empty() {
            String::new()
        } else {
            format!(" (missing shards {:?})", merged.missing_shards)
        }
    );
    print!("{}", report::markdown(&summary));
    0
}

fn same_dir(a: &std::path::Path, b: &std::path::Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

/// The kernel's range of ports for outgoing connections.
fn ephemeral_ports() -> Option<(u32, u32)> {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    let mut it = text.split_whitespace().map(|v| v.parse().ok());
    Some((it.next()??, it.next()??))
}

fn replay(cfg: &Config, spec: &str) -> i32 {
    let Some((file, run)) = spec.rsplit_once(':') else {
        return usage("--replay wants RESULTS.jsonl:RUN");
    };
    let Ok(run) = run.parse::<u64>() else {
        return usage("--replay wants RESULTS.jsonl:RUN");
    };
    let records = campaign::load_results(std::path::Path::new(file));
    let Some(rec) = records.iter().find(|r| r.run == run) else {
        return fail(&format!("run {run} is not in {file}"));
    };
    let Some(applied) = rec.applied.clone() else {
        return fail(&format!("run {run} was not activated: nothing to replay"));
    };
    let reference = match campaign::golden_runs(&Config {
        golden_runs: 1,
        ..cfg.clone()
    }) {
        Ok(r) => r,
        Err(e) => return fail(&e),
    };
    let ws = campaign::Workspace::of(cfg, "replay", 0);
    // A time-based point in a server's main thread is replayed after the syscall it
    // followed: the same place relative to the requests served, which a CPU time is not.
    let at_syscall = match (rec.point, applied.syscalls, &cfg.server, cfg.replica) {
        (Point::Time { .. }, Some(k), Some(_), None) => Some(k),
        _ => None,
    };
    let point = at_syscall.map_or(rec.point, |k| Point::Syscall { k, steps: 0 });
    let result = match cfg.replica {
        // The monitor re-applies the record to the same replica (drawn from the same seed).
        Some(choice) => {
            let fault = campaign::replica_fault(cfg, choice, applied.model, rec.point, rec.seed, Some(applied));
            campaign::run_replica_fault(cfg, &reference, &ws, fault)
        }
        None => {
            let plan = Plan::Replay { point, applied };
            campaign::run_target(cfg, &ws, &plan, reference.limits(), &[])
        }
    };
    let outcome = match result {
        Ok(o) => o,
        Err(e) => return fail(&format!("replay failed: {e}")),
    };
    let class = classify(&reference.golden, &outcome, &cfg.compare);
    println!("run {run}: recorded {}, replayed {}", rec.class.name(), class.name());
    // What the fault found there: the same old value means the same point in the program
    // (unless the value itself varies from run to run, as addresses do with ASLR).
    if let (Some(now), Some(then)) = (&outcome.applied, &rec.applied) {
        let place = |a: &lockstep_inject::fault::Applied| match (&a.register, a.address) {
            (Some(r), _) => r.clone(),
            (None, Some(addr)) => format!("{addr:#x}"),
            (None, None) => "?".into(),
        };
        println!(
            "applied: {} {:#x} ^ {:#x}, recorded: {} {:#x} ^ {:#x}",
            place(now),
            now.old,
            now.mask,
            place(then),
            then.old,
            then.mask
        );
    }
    match at_syscall {
        Some(k) => println!(
            "note: the point was time-based, in the server's main thread after it had entered {k} syscalls; the replay faults it as syscall {k} returns (--at syscall:{k}), so the instruction may differ"
        ),
        None if matches!(rec.point, Point::Time { .. }) => {
            println!("note: the point is time-based, so the replay hits a nearby instruction, not the same one")
        }
        None => {}
    }
    0
}

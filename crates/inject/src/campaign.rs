//! A campaign: golden runs, then N injections by J parallel workers, each appended to
//! `results.jsonl` as it finishes so an interrupted campaign resumes where it stopped.

use crate::classify::{classify, Class, Compare, Golden};
use crate::fault::{Applied, Model, Rng, Scope, Width};
use crate::target::{self, Ending, Plan, Point};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashSet};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant};

/// Everything a campaign needs.
#[derive(Clone, Debug)]
pub struct Config {
    pub argv: Vec<String>,
    pub model: Model,
    pub width: Width,
    pub scope: Scope,
    /// A fixed, deterministic point for every run; None: uniform over the golden runtime.
    pub at: Option<Point>,
    pub runs: u64,
    pub jobs: usize,
    pub seed: u64,
    /// None: derived from the golden runtime.
    pub timeout: Option<Duration>,
    pub golden_runs: u32,
    pub compare: Compare,
    pub out: PathBuf,
    pub confidence: f64,
    /// Live progress line (a terminal) or plain lines.
    pub live_progress: bool,
    /// Fault one replica of a `lockstep run` target instead of the target process.
    pub replica: Option<crate::fault::ReplicaChoice>,
    /// Server mode: the base port (worker w uses base + w, as `{port}`) and the client.
    pub server: Option<crate::server::Server>,
    /// Run only this slice of the campaign (`--shard K/N`).
    pub shard: Option<crate::shard::Shard>,
    /// Start time-based runs of a plain target from fork-server snapshots where that is
    /// safe (see [`crate::fork_server`]); `--no-fork-server` turns it off.
    pub fork_server: bool,
}

/// Resolves a command name through PATH once, so that runs do not search it again.
/// None: not found (or not executable).
pub fn resolve_program(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let executable =
        |p: &std::path::Path| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
    if name.contains('/') {
        let p = PathBuf::from(name);
        return executable(&p).then_some(p);
    }
    std::env::var_os("PATH")?
        .to_string_lossy()
        .split(':')
        .map(|dir| std::path::Path::new(if dir.is_empty() { "." } else { dir }).join(name))
        .find(|p| executable(p))
}

/// Where one worker's runs happen: `{dir}` and `{port}` in the command, the client and
/// compared file paths are replaced by these, so parallel runs do not collide.
#[derive(Clone, Debug)]
pub struct Workspace {
    pub dir: PathBuf,
    pub port: u16,
}

impl Workspace {
    pub fn of(cfg: &Config, name: &str, worker: usize) -> Workspace {
        Workspace {
            dir: cfg.out.join("work").join(name),
            port: cfg.server.as_ref().map_or(0, |s| s.port.saturating_add(worker as u16)),
        }
    }

    pub fn expand(&self, s: &str) -> String {
        s.replace("{dir}", &self.dir.to_string_lossy())
            .replace("{port}", &self.port.to_string())
    }
}

/// Runs the target once in workspace `ws` (natively or in server mode) and reads the
/// compared files.
pub fn run_target(
    cfg: &Config,
    ws: &Workspace,
    plan: &Plan,
    limits: target::Limits,
    env: &[(String, String)],
) -> std::io::Result<target::Outcome> {
    std::fs::create_dir_all(&ws.dir)?;
    let argv: Vec<String> = cfg.argv.iter().map(|a| ws.expand(a)).collect();
    let files: Vec<PathBuf> = cfg.compare.files.iter().map(|f| PathBuf::from(ws.expand(f))).collect();
    for f in &files {
        remove_stale(f)?;
    }
    let mut o = match &cfg.server {
        Some(server) => {
            let server = crate::server::Server {
                port: ws.port,
                client: ws.expand(&server.client),
            };
            crate::server::run(&argv, &server, plan, limits.wall, &ws.dir, env)?
        }
        None => target::run_with_env(&argv, plan, limits, &ws.dir, env)?,
    };
    o.files = files.iter().map(|f| std::fs::read(f).ok()).collect();
    Ok(o)
}

/// One injection, as stored in results.jsonl. Fields added later are optional, so that
/// older results files still load (resume, merge, replay).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Record {
    pub run: u64,
    pub seed: u64,
    pub point: Point,
    pub model: Model,
    pub applied: Option<Applied>,
    pub class: Class,
    pub ending: Ending,
    pub wall_ms: f64,
    /// The compared output (the client's in server mode) against the golden one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdout: Option<OutputDigest>,
    /// Server mode: how the client ended (its exit status, 128+N for signal N, or
    /// timedout); `ending` puts the server's own fate first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client: Option<Ending>,
    /// The worker that ran it, and its port in server mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// The run started as a fork-server copy of the program taken at this CPU time
    /// (microseconds since its exec); absent: a fresh exec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_us: Option<u64>,
}

/// A run's output told apart from the golden one without storing it: its length, its
/// CRC32C, and where it first differs, with a few bytes of each side from there.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputDigest {
    pub len: usize,
    pub crc32c: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_diff: Option<usize>,
    /// Up to [`DIFF_BYTES`] bytes of the golden output from `first_diff`, escaped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub golden: Option<String>,
    /// The same bytes of this run's output.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub got: Option<String>,
}

/// How many bytes of each side an [`OutputDigest`] shows.
pub const DIFF_BYTES: usize = 24;

impl OutputDigest {
    pub fn of(golden: &[u8], run: &[u8]) -> OutputDigest {
        let first_diff = (golden != run).then(|| {
            golden
                .iter()
                .zip(run)
                .position(|(a, b)| a != b)
                .unwrap_or(golden.len().min(run.len()))
        });
        let window = |bytes: &[u8], at: usize| {
            let end = (at + DIFF_BYTES).min(bytes.len());
            bytes[at.min(end)..end].escape_ascii().to_string()
        };
        OutputDigest {
            len: run.len(),
            crc32c: format!("{:08x}", lockstep_core::crc32c(run)),
            first_diff,
            golden: first_diff.map(|at| window(golden, at)),
            got: first_diff.map(|at| window(run, at)),
        }
    }
}

/// What the golden runs established.
pub struct Reference {
    pub golden: Golden,
    /// Mean runtime (server mode: of the client workload).
    pub runtime: Duration,
    /// Mean CPU time of the target (of one replica in `--replica` mode).
    pub cpu: Duration,
    /// The least CPU time a golden run used: time-based injection points are uniform over
    /// it, so that a point falls inside a run that uses a little less CPU than the mean
    /// (short runs and servers vary by tens of percent from run to run).
    pub points_cpu: Duration,
    /// Server mode: mean time until the port opened (replica faults count from the start).
    pub startup: Duration,
    /// Mean wall time of a whole golden run (server mode: start to stop), the native
    /// baseline of the throughput ratio.
    pub whole: Duration,
    pub timeout: Duration,
    /// With `--timeout auto` (plain targets): the CPU time after which a run counts as
    /// hung, [`CPU_LIMIT_FACTOR`] times the most CPU time of a golden run and at least
    /// [`MIN_CPU_LIMIT`].
    pub cpu_limit: Option<Duration>,
}

/// With `--timeout auto`, a plain target that uses this many times the most CPU time of a
/// golden run has hung: a deterministic program's CPU time varies by a few percent from
/// run to run, and every hung run costs this many runs' worth of the campaign's time.
pub const CPU_LIMIT_FACTOR: u32 = 3;

/// The least CPU time a run may use before it counts as hung (`--timeout auto`).
pub const MIN_CPU_LIMIT: Duration = Duration::from_millis(50);

impl Reference {
    /// The hang limits of an injection run.
    pub fn limits(&self) -> target::Limits {
        target::Limits {
            wall: self.timeout,
            cpu: self.cpu_limit,
        }
    }
}

/// Set by SIGINT: stop handing out runs, kill running targets, keep what is done.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// One golden run's outcome and the CPU time it counts (a replica's in `--replica` mode).
struct GoldenRun {
    outcome: target::Outcome,
    cpu: Duration,
    whole: Duration,
}

/// Runs the program once without faults in worker `worker`'s golden workspace.
fn golden_run(cfg: &Config, worker: usize, i: u32, limit: Duration) -> Result<GoldenRun, String> {
    let name = if worker == 0 {
        "golden".to_string()
    } else {
        format!("golden-{worker}")
    };
    let ws = Workspace::of(cfg, &name, worker);
    // In --replica mode the run monitor reports its replicas' CPU time.
    let report = ws.dir.join("replica-cpu.json");
    let env = match cfg.replica {
        Some(_) => vec![(
            crate::fault::CPU_REPORT_ENV.to_string(),
            report.to_string_lossy().into_owned(),
        )],
        None => Vec::new(),
    };
    let t0 = Instant::now();
    remove_stale(&report).map_err(|e| format!("cannot remove {}: {e}", report.display()))?;
    let outcome =
        run_target(cfg, &ws, &Plan::None, limit.into(), &env).map_err(|e| format!("cannot run the target: {e}"))?;
    let whole = t0.elapsed();
    let cpu = match cfg.replica {
        Some(_) => replica_cpu(&report).ok_or_else(|| {
            format!(
                "the run monitor did not report its replicas' CPU time in golden run {} (is the target `lockstep run`?)",
                i + 1
            )
        })?,
        None => outcome.cpu,
    };
    Ok(GoldenRun { outcome, cpu, whole })
}

/// Runs the program `k` times without faults and checks that its behaviour is stable.
///
/// The golden runs run `--jobs` at a time, as the injected runs do: a program's CPU time
/// depends on the load it runs under (on a 2-vCPU VM a server that waits for its client
/// uses twice the CPU time alone as beside another run, since idle CPUs' wake-ups are
/// charged to it), and time-based injection points must fall inside the injected runs.
pub fn golden_runs(cfg: &Config) -> Result<Reference, String> {
    let mut first: Option<Golden> = None;
    let (mut total, mut startup, mut whole, mut cpu) = (Duration::ZERO, Duration::ZERO, Duration::ZERO, Duration::ZERO);
    let (mut least_cpu, mut most_cpu) = (Duration::MAX, Duration::ZERO);
    let limit = cfg.timeout.unwrap_or(Duration::from_secs(300));
    let k = cfg.golden_runs.max(1);
    let workers = cfg.jobs.clamp(1, k as usize);
    let mut runs: Vec<Option<Result<GoldenRun, String>>> = (0..k).map(|_| None).collect();
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|w| {
                scope.spawn(move || {
                    (w..k as usize)
                        .step_by(workers)
                        .map(|i| (i, golden_run(cfg, w, i as u32, limit)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for h in handles {
            for (i, r) in h.join().expect("a golden-run worker panicked") {
                runs[i] = Some(r);
            }
        }
    });
    for (i, run) in runs.into_iter().enumerate() {
        let GoldenRun {
            outcome: o,
            cpu: run_cpu,
            whole: run_whole,
        } = run.expect("every golden run ran")?;
        whole += run_whole;
        cpu += run_cpu;
        least_cpu = least_cpu.min(run_cpu);
        most_cpu = most_cpu.max(run_cpu);
        match o.ending {
            Ending::TimedOut => {
                return Err(format!(
                    "the target did not finish within {:.0} s in golden run {} ({})",
                    limit.as_secs_f64(),
                    i + 1,
                    if cfg.server.is_some() {
                        "the server never opened its port, or the client hung"
                    } else {
                        "give --timeout SECS for longer programs"
                    }
                ))
            }
            Ending::Exited(127) if o.stdout.is_empty() && cfg.server.is_none() => {
                return Err(format!("command not found or not executable: {}", cfg.argv[0]))
            }
            Ending::ServerExited(c) => {
                return Err(format!(
                    "the server exited (status {c}) before the client finished in golden run {}: {}",
                    i + 1,
                    String::from_utf8_lossy(&o.stderr).trim()
                ))
            }
            Ending::Signaled(s) if cfg.server.is_some() => {
                return Err(format!("the server was killed by signal {s} in golden run {}", i + 1))
            }
            _ => {}
        }
        if let (Some(code), Some(Ending::Exited(c))) = (cfg.compare.client_detected, o.client_ending) {
            if c == code {
                return Err(format!(
                    "the client exited {c} in golden run {}, the status that --client-detected says means a detection (the golden run must pass its own checks)",
                    i + 1
                ));
            }
        }
        total += o.wall;
        startup += o.startup.unwrap_or_default();
        let g = Golden::of(&o);
        match &first {
            None => first = Some(g),
            Some(f) => {
                if let Some(channel) = cfg.compare.difference(f, &g) {
                    return Err(format!(
                        "the target's {channel} differs between golden runs 1 and {}: results could not be classified (make the output deterministic, give --diff-cmd to normalise it, or compare fewer channels)",
                        i + 1
                    ));
                }
            }
        }
    }
    let runtime = total / k;
    let startup = startup / k;
    // Hang timeout: generous against noise, bounded below for very short programs.
    let timeout = cfg
        .timeout
        .unwrap_or_else(|| ((runtime + startup) * 10).max(Duration::from_secs(2)));
    Ok(Reference {
        golden: first.expect("at least one golden run"),
        runtime,
        cpu: cpu / k,
        points_cpu: least_cpu,
        startup,
        whole: whole / k,
        timeout,
        // A monitor's or a server's own CPU time says nothing about a hang in the program.
        cpu_limit: (cfg.timeout.is_none() && cfg.replica.is_none() && cfg.server.is_none())
            .then(|| (most_cpu * CPU_LIMIT_FACTOR).max(MIN_CPU_LIMIT)),
    })
}

fn replica_cpu(report: &std::path::Path) -> Option<Duration> {
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(report).ok()?).ok()?;
    Some(Duration::from_micros(v["cpu_us"].as_f64()? as u64))
}

/// Per-run seed: depends only on the campaign seed and the run number, so results do not
/// depend on how runs are spread over workers.
pub fn run_seed(seed: u64, run: u64) -> u64 {
    seed ^ run.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// Run numbers already in results.jsonl (resume), and their records.
pub fn load_results(path: &std::path::Path) -> Vec<Record> {
    let Ok(f) = std::fs::File::open(path) else {
        return Vec::new();
    };
    std::io::BufReader::new(f)
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| serde_json::from_str(&l).ok())
        .collect()
}

/// Writes `records` as a whole results.jsonl (a merge's output).
pub fn save_results(path: &std::path::Path, records: &[Record]) -> std::io::Result<()> {
    let mut text = String::new();
    for rec in records {
        text.push_str(&serde_json::to_string(rec).expect("records serialise"));
        text.push('\n');
    }
    std::fs::write(path, text)
}

/// Runs one injection.
/// What a worker keeps from run to run: its fork server, built at its second run that can
/// use one (so that a campaign of one run per worker does not pay for it).
#[derive(Default)]
pub struct WorkerState {
    fork_server: Option<crate::fork_server::ForkServer>,
    eligible_runs: u32,
}

impl WorkerState {
    /// The fork server for a fresh time-based run of a plain target, if it has (or now
    /// gets) snapshots.
    fn fork_server(
        &mut self,
        cfg: &Config,
        reference: &Reference,
        ws: &Workspace,
        argv: &[String],
    ) -> Option<&mut crate::fork_server::ForkServer> {
        let usable = cfg.fork_server
            && cfg.at.is_none()
            && cfg.server.is_none()
            && cfg.replica.is_none()
            && cfg.compare.files.is_empty();
        if !usable {
            return None;
        }
        self.eligible_runs += 1;
        if self.fork_server.is_none() && self.eligible_runs == 2 {
            let deadline = Instant::now() + reference.timeout;
            // A fork server that cannot be built leaves the runs fresh, as without one.
            let built = crate::fork_server::ForkServer::build(argv, &[], &ws.dir, reference.points_cpu, deadline)
                .unwrap_or_default();
            self.fork_server = Some(built);
        }
        self.fork_server.as_mut().filter(|f| !f.is_empty())
    }

    /// After a fork-server run failed (a copy that died, a fork refused): its copies are
    /// killed and the worker's runs start fresh from now on.
    fn give_up_fork_server(&mut self) {
        self.fork_server = Some(crate::fork_server::ForkServer::default());
    }
}

pub fn inject_once(
    cfg: &Config,
    reference: &Reference,
    run: u64,
    worker: usize,
    state: &mut WorkerState,
) -> std::io::Result<Record> {
    let seed = run_seed(cfg.seed, run);
    let mut rng = Rng::new(seed);
    let point = cfg.at.unwrap_or_else(|| Point::Time {
        at_us: rng.below((reference.points_cpu.as_micros() as u64).max(1)),
    });
    let model = cfg.model.resolve(&mut rng);
    let ws = Workspace::of(cfg, &format!("worker-{worker}"), worker);
    let o = match cfg.replica {
        None => {
            let plan = Plan::Fresh {
                model,
                width: cfg.width,
                scope: cfg.scope.clone(),
                point,
                rng,
            };
            std::fs::create_dir_all(&ws.dir)?;
            let argv: Vec<String> = cfg.argv.iter().map(|a| ws.expand(a)).collect();
            let from_copy = state
                .fork_server(cfg, reference, &ws, &argv)
                .map(|server| target::run_from_fork_server(server, &argv, &plan, reference.limits(), &ws.dir));
            match from_copy {
                Some(Ok(o)) => o,
                Some(Err(_)) => {
                    state.give_up_fork_server();
                    run_target(cfg, &ws, &plan, reference.limits(), &[])?
                }
                None => run_target(cfg, &ws, &plan, reference.limits(), &[])?,
            }
        }
        Some(choice) => {
            let fault = replica_fault(cfg, choice, model, point, seed, None);
            run_replica_fault(cfg, reference, &ws, fault)?
        }
    };
    let class = classify(&reference.golden, &o, &cfg.compare);
    if matches!(class, Class::Hang | Class::Crash | Class::ProgramError | Class::Sdc) {
        keep_workspace(cfg, &ws, run);
    }
    Ok(Record {
        run,
        seed,
        point,
        model,
        class,
        ending: o.ending,
        wall_ms: o.wall.as_secs_f64() * 1e3,
        stdout: Some(OutputDigest::of(&reference.golden.stdout, &o.stdout)),
        client: o.client_ending,
        worker: Some(worker),
        port: cfg.server.is_some().then_some(ws.port),
        snapshot_us: o.from_snapshot.map(|d| d.as_micros() as u64),
        applied: o.applied,
    })
}

/// Runs whose workspace (their output, the server's stderr, what was applied) is kept.
const KEPT_RUNS_MAX: usize = 50;

/// Copies the workspace of a run that ended badly to `work/kept/run-N` (at most
/// `KEPT_RUNS_MAX` of them), so that it survives the worker's next run for diagnosis.
fn keep_workspace(cfg: &Config, ws: &Workspace, run: u64) {
    let kept = cfg.out.join("work").join("kept");
    let count = std::fs::read_dir(&kept).map(|d| d.count()).unwrap_or(0);
    if count >= KEPT_RUNS_MAX {
        return;
    }
    let dest = kept.join(format!("run-{run}"));
    if std::fs::create_dir_all(&dest).is_err() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(&ws.dir) else {
        return;
    };
    for e in entries.flatten() {
        if e.file_type().is_ok_and(|t| t.is_file()) {
            // Best effort: a copy of a failed run's files for the user to look at.
            let _ = std::fs::copy(e.path(), dest.join(e.file_name()));
        }
    }
}

/// The fault the run monitor applies to one replica (`--replica`), fresh or (`replay`) as
/// recorded.
pub fn replica_fault(
    cfg: &Config,
    choice: crate::fault::ReplicaChoice,
    model: Model,
    point: Point,
    seed: u64,
    replay: Option<Applied>,
) -> crate::fault::ReplicaFault {
    let (at_stop, after_us, steps) = match point {
        Point::Syscall { k, steps } => (Some(k), None, steps),
        Point::Time { at_us } => (None, Some(at_us), 0),
    };
    crate::fault::ReplicaFault {
        model,
        width: cfg.width,
        region: cfg.scope.region,
        libs: cfg.scope.libs,
        replica: choice,
        at_stop,
        after_us,
        seed,
        record: PathBuf::new(),
        steps,
        replay,
        interrupted: false,
    }
}

/// Runs the `lockstep run` target with `fault` for its monitor and reads back what the
/// monitor applied.
pub fn run_replica_fault(
    cfg: &Config,
    reference: &Reference,
    ws: &Workspace,
    mut fault: crate::fault::ReplicaFault,
) -> std::io::Result<target::Outcome> {
    std::fs::create_dir_all(&ws.dir)?;
    let record = ws.dir.join("applied.json");
    let detections = crate::fault::detections_path(&record);
    remove_stale(&record)?;
    remove_stale(&detections)?;
    fault.record = record.clone();
    let env = [(
        crate::fault::REPLICA_FAULT_ENV.to_string(),
        serde_json::to_string(&fault).expect("serialise"),
    )];
    let mut o = run_target(cfg, ws, &Plan::None, reference.timeout.into(), &env)?;
    o.applied = std::fs::read_to_string(&record)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok());
    o.lockstep_detections = std::fs::read_to_string(&detections)
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(0);
    Ok(o)
}

/// Counts per class.
pub fn tally(records: &[Record]) -> BTreeMap<Class, u64> {
    let mut t = BTreeMap::new();
    for r in records {
        *t.entry(r.class).or_insert(0) += 1;
    }
    t
}

/// How fast this invocation injected (resumed runs excluded).
#[derive(Clone, Copy, Debug)]
pub struct Throughput {
    pub new_runs: u64,
    pub elapsed: Duration,
}

/// Runs the campaign and returns every record (old ones included when resuming).
pub fn run(cfg: &Config, reference: &Reference) -> Result<(Vec<Record>, Throughput), String> {
    std::fs::create_dir_all(&cfg.out).map_err(|e| format!("cannot create {}: {e}", cfg.out.display()))?;
    let path = cfg.out.join("results.jsonl");
    let mut records = load_results(&path);
    let done: HashSet<u64> = records.iter().map(|r| r.run).collect();
    let todo: Vec<u64> = (0..cfg.runs)
        .filter(|r| !done.contains(r) && cfg.shard.is_none_or(|s| s.owns(*r)))
        .collect();
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_sigint as *const () as libc::sighandler_t);
    }
    let next = AtomicU64::new(0);
    let started = Instant::now();
    let (tx, rx) = mpsc::channel::<Result<Record, String>>();
    let failure: Mutex<Option<String>> = Mutex::new(None);
    std::thread::scope(|s| {
        for worker in 0..cfg.jobs.max(1) {
            let tx = tx.clone();
            let (todo, next) = (&todo, &next);
            s.spawn(move || {
                target::prefer_worker_thread();
                worker_loop(cfg, reference, todo, next, worker, &tx);
            });
        }
        drop(tx);
        let total = todo.len();
        let mut finished = 0usize;
        loop {
            let r = match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(r) => r,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if INTERRUPTED.load(Ordering::SeqCst) {
                        // Ctrl-C: stop every running target now; their runs are dropped.
                        crate::target::kill_running_targets();
                    }
                    continue;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            };
            match r {
                Ok(rec) => {
                    let line = serde_json::to_string(&rec).expect("records serialise");
                    if writeln!(file, "{line}").is_err() {
                        *failure.lock().expect("lock") = Some(format!("cannot append to {}", path.display()));
                        INTERRUPTED.store(true, Ordering::SeqCst);
                    }
                    records.push(rec);
                    finished += 1;
                    progress(cfg, finished, total, started);
                }
                Err(e) => {
                    *failure.lock().expect("lock") = Some(e);
                    INTERRUPTED.store(true, Ordering::SeqCst);
                }
            }
        }
    });
    if cfg.live_progress {
        eprintln!();
    }
    if let Some(e) = failure.into_inner().expect("lock") {
        return Err(e);
    }
    if INTERRUPTED.load(Ordering::SeqCst) {
        eprintln!(
            "lockstep inject: interrupted; {} results kept in {} (run again to resume)",
            records.len(),
            path.display()
        );
    }
    let new_runs = (records.len() - done.len()) as u64;
    records.sort_by_key(|r| r.run);
    Ok((
        records,
        Throughput {
            new_runs,
            elapsed: started.elapsed(),
        },
    ))
}

/// One worker: takes the next run until none is left or Ctrl-C, and sends its record.
fn worker_loop(
    cfg: &Config,
    reference: &Reference,
    todo: &[u64],
    next: &AtomicU64,
    worker: usize,
    tx: &mpsc::Sender<Result<Record, String>>,
) {
    let mut state = WorkerState::default();
    loop {
        if INTERRUPTED.load(Ordering::SeqCst) {
            break;
        }
        let i = next.fetch_add(1, Ordering::SeqCst) as usize;
        let Some(&run) = todo.get(i) else { break };
        let r = inject_once(cfg, reference, run, worker, &mut state).map_err(|e| format!("run {run}: {e}"));
        if INTERRUPTED.load(Ordering::SeqCst) {
            break; // a run cut short by Ctrl-C is not a result
        }
        if tx.send(r).is_err() {
            break;
        }
    }
}

fn progress(cfg: &Config, done: usize, total: usize, started: Instant) {
    let rate = done as f64 / started.elapsed().as_secs_f64().max(1e-9);
    let eta = (total - done) as f64 / rate.max(1e-9);
    if cfg.live_progress {
        let width = 30;
        let filled = done * width / total.max(1);
        eprint!(
            "\r[{}{}] {done}/{total}  {rate:.1} runs/s  ETA {eta:.0} s ",
            "#".repeat(filled),
            ".".repeat(width - filled)
        );
    } else if done.is_multiple_of(100) || done == total {
        eprintln!("lockstep inject: {done}/{total} runs, {rate:.1} runs/s, ETA {eta:.0} s");
    }
}

/// Removes a file a run is about to produce, so that one left by an earlier run is never
/// read as this run's: a missing file is fine, any other failure stops the run.
fn remove_stale(path: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

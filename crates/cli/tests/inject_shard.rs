//! `lockstep inject --shard K/N` and `lockstep inject merge`: shards run by GNU parallel and
//! by a real single-node Slurm job array merge into exactly the campaign that one machine
//! runs, and merges of mismatched shards are refused.
//!
//! Every campaign here runs with ASLR off (`setarch -R`, inherited by the targets), so that
//! each run's outcome depends only on its seed and the two sides can be compared run by run.

mod common;
use common::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

const RUNS: &str = "36";
/// The campaign: register faults after flip_target's 8th syscall, seed 7.
const CAMPAIGN: [&str; 10] = [
    "--fault",
    "reg",
    "--at",
    "syscall:8",
    "--seed",
    "7",
    "--golden",
    "1",
    "--runs",
    RUNS,
];

fn program() -> Vec<String> {
    vec![fixture("flip_target").to_string_lossy().into_owned()]
}

fn lockstep_bin() -> &'static str {
    env!("CARGO_BIN_EXE_lockstep")
}

/// `setarch x86_64 -R PROG ARGS...`: ASLR off for PROG and everything it starts.
fn no_aslr(prog: &str, args: &[String]) -> Command {
    let mut c = Command::new("setarch");
    c.args(["x86_64", "-R", prog]).args(args);
    c
}

/// `lockstep inject --out OUT EXTRA... CAMPAIGN... -- flip_target`, as strings.
fn inject_args(out: &str, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = vec!["inject".into(), "--out".into(), out.into()];
    a.extend(extra.iter().map(|s| s.to_string()));
    a.extend(CAMPAIGN.iter().map(|s| s.to_string()));
    a.push("--".into());
    a.extend(program());
    a
}

/// The unsharded campaign, run on this machine with two workers.
fn whole_campaign(tag: &str) -> PathBuf {
    let whole = scratch_dir(tag);
    run(no_aslr(
        lockstep_bin(),
        &inject_args(whole.to_str().unwrap(), &["-j", "2"]),
    ))
    .assert_code(0);
    whole
}

/// A campaign's records in run order, without their wall times, workers, the length of a
/// hung run's output and the registers' old and new values: with ASLR off, stack addresses still move with the size of the environment,
/// which differs between a shard and the unsharded campaign.
fn records(dir: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(dir.join("results.jsonl")).unwrap();
    let mut v: Vec<Value> = text
        .lines()
        .map(|l| {
            let mut r: Value = serde_json::from_str(l).unwrap();
            r.as_object_mut().unwrap().remove("wall_ms");
            r.as_object_mut().unwrap().remove("worker");
            if let Some(applied) = r["applied"].as_object_mut() {
                applied.remove("old");
                applied.remove("new");
            }
            // A hung run prints until it is stopped: how much is a matter of timing.
            if r["class"] == "hang" {
                let out = r["stdout"].as_object_mut().unwrap();
                out.remove("len");
                out.remove("crc32c");
            }
            r
        })
        .collect();
    v.sort_by_key(|r| r["run"].as_u64().unwrap());
    v
}

fn merge(out: &Path, shards: &[PathBuf], extra: &[&str]) -> Output {
    let mut c = lockstep();
    c.args(["inject", "merge", "--out"]).arg(out).args(extra).args(shards);
    run(c)
}

/// The merged campaign equals the unsharded one: every run, and the summary.
fn assert_same_campaign(merged: &Path, whole: &Path) {
    let (m, w) = (records(merged), records(whole));
    assert_eq!(m.len(), RUNS.parse::<usize>().unwrap());
    assert_eq!(m, w, "merged shards and the unsharded campaign differ");
    assert_eq!(summary_counts(merged), summary_counts(whole));
    let id = |d: &Path| {
        let c: Value = serde_json::from_str(&std::fs::read_to_string(d.join("campaign.json")).unwrap()).unwrap();
        c["id"].as_str().unwrap().to_string()
    };
    assert_eq!(id(merged), id(whole), "one campaign, one id");
}

#[test]
fn shards_run_by_gnu_parallel_merge_into_the_unsharded_campaign() {
    let whole = whole_campaign("shard-whole-parallel");
    let base = scratch_dir("shards-parallel");
    let out = format!("{}/shard-{{}}", base.display());
    let mut args = vec![
        "--will-cite".to_string(),
        "-j".into(),
        "3".into(),
        "--halt".into(),
        "now,fail=1".into(),
        lockstep_bin().into(),
    ];
    args.extend(inject_args(&out, &["--shard", "{}/3", "-j", "1"]));
    args.extend([":::", "0", "1", "2"].map(String::from));
    run(no_aslr("parallel", &args)).assert_code(0);
    let shards: Vec<PathBuf> = (0..3).map(|k| base.join(format!("shard-{k}"))).collect();
    for (k, s) in shards.iter().enumerate() {
        let recs = records(s);
        assert_eq!(recs.len(), 12, "shard {k}");
        assert!(
            recs.iter().all(|r| r["run"].as_u64().unwrap() % 3 == k as u64),
            "shard {k}: {recs:?}"
        );
    }
    let merged = base.join("merged");
    merge(&merged, &shards, &[]).assert_code(0);
    assert_same_campaign(&merged, &whole);
}

#[test]
fn merge_refuses_shards_that_do_not_belong_together() {
    let base = scratch_dir("shards-refused");
    let shard = |name: &str, spec: &str, seed: &str| -> PathBuf {
        let dir = base.join(name);
        let mut a = inject_args(dir.to_str().unwrap(), &["--shard", spec, "-j", "1"]);
        let at = a.iter().position(|s| s == "--seed").unwrap();
        a[at + 1] = seed.into();
        let mut c = lockstep();
        c.args(&a);
        run(c).assert_code(0);
        dir
    };
    let s0 = shard("s0", "0/2", "7");
    let s1 = shard("s1", "1/2", "7");
    let other = shard("other", "1/2", "8");
    let third = shard("third", "1/3", "7");
    let refused = |shards: &[PathBuf], extra: &[&str], why: &str| {
        let o = merge(&base.join("merged-refused"), shards, extra);
        o.assert_code(2);
        assert!(o.stderr.contains(why), "expected '{why}'\n{}", o.context());
    };
    refused(&[s0.clone(), other], &[], "different campaigns");
    refused(&[s0.clone(), s1.clone(), s1.clone()], &[], "are both shard 1/2");
    refused(&[s0.clone(), third], &[], "split into 2");
    refused(std::slice::from_ref(&s0), &[], "missing");
    // --partial summarises the shards present.
    let partial = base.join("partial");
    merge(&partial, std::slice::from_ref(&s0), &["--partial"]).assert_code(0);
    assert_eq!(records(&partial).len(), 18);
    // A shard's directory is not reused for another shard or campaign.
    let mut c = lockstep();
    c.args(inject_args(s0.to_str().unwrap(), &["--shard", "1/2", "-j", "1"]));
    let o = run(c);
    o.assert_code(2);
    assert!(o.stderr.contains("another campaign or shard"), "{}", o.context());
    // Bad --shard values are usage errors.
    for bad in ["2/2", "1", "0/0", "x/3"] {
        let mut c = lockstep();
        c.args(inject_args(base.join("bad").to_str().unwrap(), &["--shard", bad]));
        let o = run(c);
        o.assert_code(2);
        assert!(o.stderr.contains("bad --shard"), "{}", o.context());
    }
}

/// A single-node Slurm (munged, slurmctld and slurmd on this machine, with their own
/// key, socket, ports and state directory), torn down when dropped.
struct Slurm {
    dir: PathBuf,
    daemons: Vec<std::process::Child>,
}

impl Slurm {
    fn start(dir: &Path) -> Slurm {
        let mut s = Slurm {
            dir: dir.to_path_buf(),
            daemons: Vec::new(),
        };
        for sub in ["state", "spool", "log"] {
            std::fs::create_dir_all(dir.join(sub)).unwrap();
        }
        let key = dir.join("munge.key");
        sh(Command::new("mungekey").arg("--create").arg("--keyfile").arg(&key));
        let socket = dir.join("munge.sock");
        let munged = Command::new("munged")
            .args(["--foreground", "--force"])
            .arg(format!("--socket={}", socket.display()))
            .arg(format!("--key-file={}", key.display()))
            .arg(format!("--pid-file={}", dir.join("munged.pid").display()))
            .arg(format!("--log-file={}", dir.join("log/munged.log").display()))
            .arg(format!("--seed-file={}", dir.join("munged.seed").display()))
            .spawn()
            .expect("munged (scripts/deps.sh installs munge)");
        s.daemons.push(munged);
        wait_for(|| socket.exists(), "munged's socket");
        let host = String::from_utf8(Command::new("hostname").arg("-s").output().unwrap().stdout).unwrap();
        let (ctl_port, node_port) = (free_port(), free_port());
        let d = dir.display();
        let conf = format!(
            "ClusterName=lockstep-test\nSlurmctldHost={host}\nSlurmctldPort={ctl_port}\nSlurmdPort={node_port}\n\
             AuthType=auth/munge\nAuthInfo=socket={socket}\nCredType=cred/munge\n\
             StateSaveLocation={d}/state\nSlurmdSpoolDir={d}/spool\n\
             SlurmctldPidFile={d}/slurmctld.pid\nSlurmdPidFile={d}/slurmd.pid\n\
             SlurmctldLogFile={d}/log/slurmctld.log\nSlurmdLogFile={d}/log/slurmd.log\n\
             ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nSchedulerType=sched/builtin\n\
             SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\nReturnToService=2\n\
             SlurmUser=root\nSlurmdUser=root\nJobAcctGatherType=jobacct_gather/none\n\
             AccountingStorageType=accounting_storage/none\nMpiDefault=none\n\
             NodeName={host} CPUs=2 State=UNKNOWN\nPartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP\n",
            host = host.trim(),
            socket = socket.display(),
        );
        std::fs::write(s.conf(), conf).unwrap();
        for daemon in ["slurmctld", "slurmd"] {
            let child = Command::new(daemon)
                .arg("-D")
                .env("SLURM_CONF", s.conf())
                .stdout(std::process::Stdio::null())
                .stderr(std::fs::File::create(dir.join(format!("log/{daemon}.stderr"))).unwrap())
                .spawn()
                .unwrap_or_else(|e| panic!("{daemon}: {e} (scripts/deps.sh installs slurmctld and slurmd)"));
            s.daemons.push(child);
        }
        let ready = || {
            Command::new("sinfo")
                .args(["-h", "-o", "%T"])
                .env("SLURM_CONF", s.conf())
                .output()
                .is_ok_and(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).trim() == "idle")
        };
        wait_for(ready, "an idle Slurm node");
        s
    }

    fn conf(&self) -> PathBuf {
        self.dir.join("slurm.conf")
    }
}

impl Drop for Slurm {
    fn drop(&mut self) {
        // An orderly shutdown first, so that slurmctld reaps its own helper (slurmscriptd).
        let _ = Command::new("scontrol")
            .arg("shutdown")
            .env("SLURM_CONF", self.conf())
            .output();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        for d in &mut self.daemons[1..] {
            while std::time::Instant::now() < deadline && matches!(d.try_wait(), Ok(None)) {
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
        }
        for d in self.daemons.iter_mut().rev() {
            let _ = d.kill();
            let _ = d.wait();
        }
    }
}

fn sh(cmd: &mut Command) {
    let o = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(o.status.success(), "{cmd:?}: {}", String::from_utf8_lossy(&o.stderr));
}

fn wait_for(mut ready: impl FnMut() -> bool, what: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !ready() {
        assert!(
            std::time::Instant::now() < deadline,
            "{what} did not come up within 30 s"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn shards_run_as_a_slurm_job_array_merge_into_the_unsharded_campaign() {
    let whole = whole_campaign("shard-whole-slurm");
    let base = scratch_dir("shards-slurm");
    let slurm = Slurm::start(&base.join("slurm"));
    let script = repo_root().join("examples/inject/slurm-array.sh");
    // The job runs the documented array script, ASLR off like the unsharded campaign.
    let mut args = vec![
        "--wait".to_string(),
        "--array=0-2".into(),
        format!("--output={}/task-%a.log", base.display()),
        format!("--export=ALL,OUT={},LOCKSTEP={}", base.display(), lockstep_bin()),
        "--wrap".into(),
    ];
    let mut wrapped = format!("exec setarch x86_64 -R {}", script.display());
    for a in CAMPAIGN.iter().chain(["--"].iter()) {
        wrapped.push(' ');
        wrapped.push_str(a);
    }
    for p in program() {
        wrapped.push(' ');
        wrapped.push_str(&p);
    }
    args.push(wrapped);
    let mut sbatch = Command::new("sbatch");
    sbatch.args(&args).env("SLURM_CONF", slurm.conf());
    let o = run(sbatch);
    let logs: String = (0..3)
        .map(|k| std::fs::read_to_string(base.join(format!("task-{k}.log"))).unwrap_or_default())
        .collect();
    assert_eq!(
        o.code(),
        0,
        "sbatch --wait failed\n{}\n--- task logs ---\n{logs}",
        o.context()
    );
    let shards: Vec<PathBuf> = (0..3).map(|k| base.join(format!("shard-{k}"))).collect();
    let merged = base.join("merged");
    merge(&merged, &shards, &[]).assert_code(0);
    assert_same_campaign(&merged, &whole);
    drop(slurm);
}

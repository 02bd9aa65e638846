//! `lockstep inject`'s fork server: time-based runs of a plain program start as copies of
//! it taken part-way through, and must end exactly as fresh runs do; programs that do
//! something a copy cannot repeat are never copied.

mod common;
use common::*;

fn progress_job(extra: &[&str]) -> Vec<String> {
    std::iter::once(fixture("progress_job").to_string_lossy().into_owned())
        .chain(extra.iter().map(|s| s.to_string()))
        .collect()
}

/// Runs a campaign of `progress_job` (with `job_args`) into a fresh directory; its
/// directory and records.
fn campaign(tag: &str, args: &[&str], job_args: &[&str]) -> (std::path::PathBuf, Vec<serde_json::Value>) {
    let out = scratch_dir(tag);
    run(inject_cmd(&out, args, &progress_job(job_args))).assert_code(0);
    let records = campaign_records(&out);
    (out, records)
}

fn snapshot_of(record: &serde_json::Value) -> Option<u64> {
    record.get("snapshot_us").and_then(|v| v.as_u64())
}

/// With nothing injected (`--fault none`), a copy that printed part of its output before
/// its snapshot and prints the rest by itself is indistinguishable from a fresh run: the
/// same stdout (compared byte for byte) and the same exit status (3), so every activated
/// run is masked. Most runs start from a snapshot, always one taken before their point.
#[test]
fn copies_of_a_program_end_exactly_as_fresh_runs_do() {
    let (out, records) = campaign(
        "fork-server-none",
        &[
            "--fault", "none", "--runs", "60", "-j", "2", "--golden", "2", "--seed", "4",
        ],
        &[],
    );
    assert_eq!(records.len(), 60);
    for r in &records {
        let class = r["class"].as_str().unwrap();
        assert!(class == "masked" || class == "not-activated", "{r}");
        if let Some(at) = snapshot_of(r) {
            assert!(
                at <= r["point"]["time"]["at_us"].as_u64().unwrap(),
                "a snapshot after the point: {r}"
            );
        }
    }
    let copied = records.iter().filter(|r| snapshot_of(r).is_some()).count();
    // Points are uniform and snapshots are taken at 1/8, 2/8, ... of the CPU time: about
    // 7 in 8 runs start from one.
    assert!(copied >= 30, "only {copied} of 60 runs started from a snapshot");
    let masked = summary_counts(&out).into_iter().find(|(c, _)| c == "masked").unwrap().1;
    assert!(masked >= 50, "{masked} of 60 masked");
}

/// A program that writes a file before its work (a copy would not write it again) is
/// never copied; `--no-fork-server` turns copies off for any program.
#[test]
fn a_program_that_writes_a_file_is_never_copied() {
    let (_, records) = campaign(
        "fork-server-file",
        &["--fault", "none", "--runs", "16", "-j", "2", "--golden", "1"],
        &["{dir}/started"],
    );
    assert!(records.iter().all(|r| snapshot_of(r).is_none()), "copied: {records:?}");
    assert!(records.iter().any(|r| r["class"] == "masked"));

    let (_, records) = campaign(
        "fork-server-off",
        &[
            "--fault",
            "reg",
            "--runs",
            "16",
            "-j",
            "2",
            "--golden",
            "1",
            "--no-fork-server",
        ],
        &[],
    );
    assert!(records.iter().all(|r| snapshot_of(r).is_none()), "copied: {records:?}");
}

/// Faults in copies are classified like faults in fresh runs: of the register faults of a
/// campaign, some are masked and some change the output (sdc) or crash, and a copy's
/// record names the program as the faulted process.
#[test]
fn faults_in_copies_are_classified() {
    let (_, records) = campaign(
        "fork-server-reg",
        &[
            "--fault", "reg", "--runs", "80", "-j", "2", "--golden", "2", "--seed", "9",
        ],
        &[],
    );
    let copied: Vec<&serde_json::Value> = records.iter().filter(|r| snapshot_of(r).is_some()).collect();
    assert!(
        copied.len() >= 40,
        "only {} of 80 runs started from a snapshot",
        copied.len()
    );
    let classes: std::collections::HashSet<&str> = copied.iter().map(|r| r["class"].as_str().unwrap()).collect();
    assert!(classes.contains("masked"), "{classes:?}");
    assert!(
        classes.contains("sdc") || classes.contains("crash"),
        "no fault in a copy had an effect: {classes:?}"
    );
    for r in copied {
        if r["applied"].is_object() {
            assert_eq!(r["applied"]["process"], "progress_job", "{r}");
        }
    }
}

//! What a hung run was doing when its deadline passed, kept for whoever explains it.
//!
//! A hang is the one outcome that leaves no trace of its own: the target is killed at the
//! deadline, and a replay often runs differently (the fault lands at another moment).
//! So, before the kill, every thread of the target's process group is described from
//! `/proc` into `hang-state.txt` in the run's workspace (kept with the run, see
//! `campaign::keep_workspace`): its state, the kernel function it sleeps in, the syscall
//! it is blocked in with its arguments and user-space stack and instruction pointers, and
//! its kernel stack where the kernel shows it (root only).

use lockstep_trace::Tid;
use std::fmt::Write as _;
use std::path::Path;

/// The file a hung run's description is written to, in its workspace.
pub const STATE_FILE: &str = "hang-state.txt";

/// At most this many processes and threads are described: a fork bomb's hang is not a
/// reason to write megabytes.
const THREADS_MAX: usize = 256;

/// Writes the description of the target `group` (its process group and descendants) into `dir`; best effort (a run's
/// classification never depends on it).
pub fn record(group: Tid, dir: &Path) {
    // Best effort: the description helps a human; classification never reads it.
    let _ = std::fs::write(dir.join(STATE_FILE), describe(group));
}

/// The threads of every process of the target `group`, one paragraph each.
pub fn describe(group: Tid) -> String {
    let mut out = format!("process group {group}, at the hang deadline\n");
    let mut threads = 0;
    for pid in processes_of(group) {
        let task_dir = format!("/proc/{pid}/task");
        let Ok(tasks) = std::fs::read_dir(&task_dir) else {
            continue;
        };
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline"))
            .map(|b| String::from_utf8_lossy(&b).replace('\0', " ").trim_end().to_string())
            .unwrap_or_default();
        // (writing into a String cannot fail)
        let _ = writeln!(out, "\nprocess {pid}: {cmdline}");
        let mut tids: Vec<Tid> = tasks
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse().ok())
            .collect();
        tids.sort_unstable();
        for tid in tids {
            threads += 1;
            if threads > THREADS_MAX {
                // (writing into a String cannot fail)
                let _ = writeln!(out, "(more threads not described: limit {THREADS_MAX})");
                return out;
            }
            describe_thread(&mut out, pid, tid);
        }
    }
    out
}

fn describe_thread(out: &mut String, pid: Tid, tid: Tid) {
    let read = |file: &str| std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/{file}")).unwrap_or_default();
    let status = read("status");
    let field = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .map(|v| v.trim().to_string())
            .unwrap_or_default()
    };
    // (writing into a String cannot fail)
    let _ = writeln!(
        out,
        "  thread {tid} ({}): state {}, wchan {}, syscall {}, tracer {}, sigpnd {} shdpnd {} blocked {}",
        field("Name:"),
        field("State:"),
        read("wchan").trim(),
        read("syscall").trim(),
        field("TracerPid:"),
        field("SigPnd:"),
        field("ShdPnd:"),
        field("SigBlk:"),
    );
    for line in read("stack").lines() {
        // (writing into a String cannot fail)
        let _ = writeln!(out, "    {line}");
    }
}

/// Processes (thread group leaders) in process group `root`, or descended from `root`
/// (a child that made a group of its own is still the target's), in pid order.
fn processes_of(root: Tid) -> Vec<Tid> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    // (pid, parent, group) of every process.
    let all: Vec<(Tid, Tid, Tid)> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<Tid>().ok())
        .filter_map(|pid| {
            let (parent, group) = parent_and_group(pid)?;
            Some((pid, parent, group))
        })
        .collect();
    let mut ours: Vec<Tid> = all.iter().filter(|p| p.0 == root || p.2 == root).map(|p| p.0).collect();
    // Descendants, to a fixed point (bounded: each round adds at least one process).
    loop {
        let more: Vec<Tid> = all
            .iter()
            .filter(|p| ours.contains(&p.1) && !ours.contains(&p.0))
            .map(|p| p.0)
            .collect();
        if more.is_empty() || ours.len() > THREADS_MAX {
            break;
        }
        ours.extend(more);
    }
    ours.sort_unstable();
    ours
}

/// Fields 4 and 5 of `/proc/PID/stat` (after the parenthesised command, which may hold
/// spaces).
fn parent_and_group(pid: Tid) -> Option<(Tid, Tid)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let mut fields = stat[stat.rfind(')')? + 1..].split_whitespace().skip(1);
    Some((fields.next()?.parse().ok()?, fields.next()?.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;

    #[test]
    fn a_sleeping_child_is_described_with_its_syscall() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .process_group(0)
            .spawn()
            .expect("spawn sleep");
        let pid = child.id() as Tid;
        // The child is in its own group as soon as spawn returns; wait until it sleeps.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut text = describe(pid);
        while !text.contains("state S") && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
            text = describe(pid);
        }
        child.kill().expect("kill");
        child.wait().expect("wait");
        assert!(text.contains(&format!("process {pid}: sleep 30")), "{text}");
        assert!(text.contains(&format!("thread {pid} (sleep): state S")), "{text}");
        // clock_nanosleep (230) with its arguments, then sp and pc.
        assert!(text.contains("syscall 230 "), "{text}");
    }

    #[test]
    fn a_group_with_no_process_describes_nothing() {
        let text = describe(i32::MAX - 1);
        assert_eq!(text.lines().count(), 1, "{text}");
    }
}

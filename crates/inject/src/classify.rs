//! Outcome classes, shared with the brief: masked, detected, crash, hang, program-error,
//! sdc, not-activated.

use crate::target::{Ending, Outcome};
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Class {
    /// The program behaved exactly as in the golden runs.
    Masked,
    /// Exit status 86 (lockstep or libsei detected corruption and stopped), or a correct
    /// output after lockstep reported a detection (a divergence it masked).
    Detected,
    /// Killed by a signal.
    Crash,
    /// Did not finish within the timeout.
    Hang,
    /// A non-zero exit status other than the golden one: the program noticed a problem.
    ProgramError,
    /// Silent data corruption: a normal exit with wrong output.
    Sdc,
    /// The process ended before the fault could be injected.
    NotActivated,
}

impl Class {
    pub const ALL: [Class; 7] = [
        Class::Masked,
        Class::Detected,
        Class::Crash,
        Class::Hang,
        Class::ProgramError,
        Class::Sdc,
        Class::NotActivated,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Class::Masked => "masked",
            Class::Detected => "detected",
            Class::Crash => "crash",
            Class::Hang => "hang",
            Class::ProgramError => "program-error",
            Class::Sdc => "sdc",
            Class::NotActivated => "not-activated",
        }
    }
}

/// Which channels are compared with the golden run, and how.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Compare {
    pub stdout: bool,
    pub stderr: bool,
    pub exit: bool,
    /// Files the target writes (`{dir}` is the run's own directory), read after each run.
    pub files: Vec<String>,
    /// A shell command that decides whether two differing outputs are equivalent: it gets
    /// the golden and the run's copy as its last two arguments and exits 0 when they are.
    pub diff_cmd: Option<String>,
    /// Server mode: the client's exit status that means "the client's own check caught a
    /// wrong reply" (`--client-detected`): such a run is detected, not sdc.
    pub client_detected: Option<i32>,
}

impl std::str::FromStr for Compare {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let mut c = Compare::default();
        for part in s.split(',').filter(|p| !p.is_empty()) {
            match part {
                "stdout" => c.stdout = true,
                "stderr" => c.stderr = true,
                "exit" => c.exit = true,
                p if p.starts_with("file:") && p.len() > 5 => c.files.push(p[5..].to_string()),
                p => {
                    return Err(format!(
                        "unknown --compare channel '{p}' (expected stdout, stderr, exit or file:PATH)"
                    ))
                }
            }
        }
        if !(c.stdout || c.stderr || c.exit || !c.files.is_empty()) {
            return Err("--compare needs at least one channel".into());
        }
        Ok(c)
    }
}

/// What a run produced, in the compared channels.
#[derive(Clone, Debug)]
pub struct Golden {
    pub ending: Ending,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// The contents of `Compare::files` (None: the file did not exist).
    pub files: Vec<Option<Vec<u8>>>,
}

impl Golden {
    pub fn of(run: &Outcome) -> Golden {
        Golden {
            ending: run.ending,
            stdout: run.stdout.clone(),
            stderr: run.stderr.clone(),
            files: run.files.clone(),
        }
    }
}

impl Compare {
    /// The first channel in which `run` differs from `golden`, if any.
    pub fn difference(&self, golden: &Golden, run: &Golden) -> Option<String> {
        if self.exit && golden.ending != run.ending {
            return Some("exit status".into());
        }
        if self.stdout && !self.equivalent(&golden.stdout, &run.stdout) {
            return Some("stdout".into());
        }
        if self.stderr && !self.equivalent(&golden.stderr, &run.stderr) {
            return Some("stderr".into());
        }
        for (i, path) in self.files.iter().enumerate() {
            let same = match (golden.files.get(i), run.files.get(i)) {
                (Some(Some(a)), Some(Some(b))) => self.equivalent(a, b),
                (Some(None), Some(None)) => true,
                _ => false,
            };
            if !same {
                return Some(format!("file {path}"));
            }
        }
        None
    }

    fn equivalent(&self, golden: &[u8], run: &[u8]) -> bool {
        golden == run
            || self
                .diff_cmd
                .as_deref()
                .is_some_and(|cmd| diff_says_same(cmd, golden, run))
    }
}

/// Runs the user's diff command on two temporary files; exit 0 means equivalent.
fn diff_says_same(cmd: &str, golden: &[u8], run: &[u8]) -> bool {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::temp_dir().join(format!(
        "lockstep-diff-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    if std::fs::create_dir_all(&dir).is_err() {
        return false;
    }
    let (a, b) = (dir.join("golden"), dir.join("run"));
    let same = std::fs::write(&a, golden).is_ok()
        && std::fs::write(&b, run).is_ok()
        && std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("{cmd} \"$@\""))
            .arg("sh")
            .arg(&a)
            .arg(&b)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
    // (a temporary directory; the system cleans what is left)
    let _ = std::fs::remove_dir_all(&dir);
    same
}

/// Classifies one injected run against the golden behaviour.
pub fn classify(golden: &Golden, run: &Outcome, compare: &Compare) -> Class {
    if run.applied.is_none() {
        return Class::NotActivated;
    }
    let golden_code = match golden.ending {
        Ending::Exited(c) => c,
        _ => 0,
    };
    match run.ending {
        Ending::TimedOut => Class::Hang,
        Ending::Signaled(_) => Class::Crash,
        Ending::Exited(lockstep_core::exit::DETECTED) | Ending::ServerExited(lockstep_core::exit::DETECTED) => {
            Class::Detected
        }
        Ending::Exited(c) if compare.client_detected == Some(c) && run.client_ending == Some(Ending::Exited(c)) => {
            Class::Detected
        }
        Ending::ServerExited(_) => Class::ProgramError,
        Ending::Exited(c) if c != golden_code && c != 0 => Class::ProgramError,
        Ending::Exited(_) => {
            if compare.difference(golden, &Golden::of(run)).is_some() {
                Class::Sdc
            } else if run.lockstep_detections > 0 {
                // The output is right because lockstep caught the fault and outvoted it.
                Class::Detected
            } else {
                Class::Masked
            }
        }
    }
}

//! Outcome classes, shared with the brief: masked, detected, crash, hang, program-error,
//! sdc, not-activated.

use crate::target::{Ending, Outcome};
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Class {
    /// The program behaved exactly as in the golden runs.
    Masked,
    /// Exit status 86: lockstep (or libsei) detected corruption and stopped.
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

/// Which channels are compared with the golden run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Compare {
    pub stdout: bool,
    pub stderr: bool,
    pub exit: bool,
}

impl std::str::FromStr for Compare {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let mut c = Compare {
            stdout: false,
            stderr: false,
            exit: false,
        };
        for part in s.split(',').filter(|p| !p.is_empty()) {
            match part {
                "stdout" => c.stdout = true,
                "stderr" => c.stderr = true,
                "exit" => c.exit = true,
                p if p.starts_with("file:") => return Err("--compare file:PATH is not implemented yet".into()),
                p => {
                    return Err(format!(
                        "unknown --compare channel '{p}' (expected stdout, stderr, exit)"
                    ))
                }
            }
        }
        if !(c.stdout || c.stderr || c.exit) {
            return Err("--compare needs at least one channel".into());
        }
        Ok(c)
    }
}

/// The reference behaviour from the golden runs.
#[derive(Clone, Debug)]
pub struct Golden {
    pub ending: Ending,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

/// Classifies one injected run against the golden behaviour.
pub fn classify(golden: &Golden, run: &Outcome, compare: Compare) -> Class {
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
        Ending::Exited(lockstep_core::exit::DETECTED) => Class::Detected,
        Ending::Exited(c) if c != golden_code && c != 0 => Class::ProgramError,
        Ending::Exited(c) => {
            let same = (!compare.stdout || run.stdout == golden.stdout)
                && (!compare.stderr || run.stderr == golden.stderr)
                && (!compare.exit || c == golden_code);
            if same {
                Class::Masked
            } else {
                Class::Sdc
            }
        }
    }
}

//! What the user asked `lockstep run` to do.

use std::path::PathBuf;
use std::time::Duration;

/// What is compared at a rendezvous (RCoE's N/A/S modes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompareMode {
    /// Only externally visible outputs: their arguments and buffers.
    Io,
    /// Every intercepted syscall is folded into a running per-replica signature, which is
    /// voted at outputs.
    Args,
    /// Like `Args`, but the signature is voted at every intercepted syscall.
    Every,
}

impl std::str::FromStr for CompareMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "io" => Ok(CompareMode::Io),
            "args" => Ok(CompareMode::Args),
            "every" => Ok(CompareMode::Every),
            _ => Err(format!("unknown compare mode '{s}' (expected io, args or every)")),
        }
    }
}

/// How replicas' syscalls reach the monitor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// Every intercepted call stops every replica under ptrace.
    Ptrace,
    /// Hot inputs, outputs and clock reads are replicated in process through a shared
    /// ring (`fast.rs`); everything else stops under ptrace as before.
    Fast,
}

impl std::str::FromStr for BackendKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "ptrace" => Ok(BackendKind::Ptrace),
            "fast" => Ok(BackendKind::Fast),
            _ => Err(format!("unknown backend '{s}' (expected fast or ptrace)")),
        }
    }
}

/// Who lets a leader's output leave, with the fast backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputCheck {
    /// The monitor: its committer thread copies each output out of the leader's memory,
    /// digests the copy, and writes it through its own duplicate of the leader's
    /// descriptor only if every follower voted that digest (`commit.rs`). Outputs to
    /// descriptors it does not write (pipes, ttys) take `StrictStop`'s path. A faulty
    /// leader cannot skip it.
    Strict,
    /// The monitor, at a stop: every output the leader makes from the fast path stops in
    /// seccomp, and the monitor compares the leader's arguments, read from its memory,
    /// with every follower's vote before the call runs (`fast_check.rs`). The path of
    /// strict checks before the committer: a ptrace stop per output.
    StrictStop,
    /// The leader itself compares its followers' votes with its own digest, twice (the
    /// second time over the buffers again, just before the call). No stop; a fault in
    /// the leader at the wrong moment can let a wrong output out.
    Fast,
}

impl std::str::FromStr for OutputCheck {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "strict" => Ok(OutputCheck::Strict),
            "strict-stop" => Ok(OutputCheck::StrictStop),
            "fast" => Ok(OutputCheck::Fast),
            _ => Err(format!(
                "unknown output check '{s}' (expected strict, strict-stop or fast)"
            )),
        }
    }
}

impl OutputCheck {
    /// Whether the monitor gives the go-ahead for every output (not the leader itself).
    pub fn is_strict(self) -> bool {
        self != OutputCheck::Fast
    }
}

/// How the followers' threads keep the leader's order of the program's synchronisation
/// operations, with the fast backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncOrder {
    /// Each object (mutex, semaphore, read-write lock, barrier, once control) has an order
    /// of its own: a follower's thread waits only for earlier operations on the same object.
    Object,
    /// One order of every event: a follower's thread waits for every earlier operation of
    /// every thread, on any object.
    Global,
    /// One order of every event, and each replica runs one thread at a time, switching only
    /// at events: what a thread reads between events (even racily) is what the leader's read.
    Serial,
}

impl SyncOrder {
    /// The ring header's `sync_order` (`SYNC_ORDER_*` in the shim).
    pub fn header_value(self) -> u32 {
        match self {
            SyncOrder::Global => 0,
            SyncOrder::Object => 1,
            SyncOrder::Serial => 2,
        }
    }
}

impl std::str::FromStr for SyncOrder {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "object" => Ok(SyncOrder::Object),
            "global" => Ok(SyncOrder::Global),
            "serial" => Ok(SyncOrder::Serial),
            _ => Err(format!("unknown sync order '{s}' (expected global, object or serial)")),
        }
    }
}

/// Where a test-only fault goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FlipTarget {
    Register(String),
    /// The byte at (register + offset).
    Memory {
        base: String,
        offset: i64,
    },
    /// SIGKILL the replica.
    Kill,
    /// SIGKILL the replica once the call it stopped at is decided and it is let run: it
    /// dies in the call (or as it enters it) while the other replicas run theirs.
    KillInCall,
    /// Make the replica spin forever (a straggler).
    Hang,
}

/// Where a test-only fault strikes: the K-th intercepted syscall of a replica's main
/// thread, or the first intercepted call of one syscall by any of its threads (which
/// stays put when the number of calls before it changes, as with the fast backend).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlipAt {
    Stop(u64),
    FirstCall(u64),
}

/// A deterministic, test-only fault: at `at` in `replica`, flip `bit` of
/// `target`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlipSpec {
    pub replica: u32,
    pub at: FlipAt,
    pub target: FlipTarget,
    pub bit: u32,
}

impl std::str::FromStr for FlipSpec {
    type Err = String;
    /// `REPLICA:SYSCALL:TARGET:BIT`, SYSCALL = a count from 1 or a syscall name, TARGET =
    /// register | mem:REG+OFF | kill | kill-in-call | hang.
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || {
            format!("bad flip '{s}': expected REPLICA:SYSCALL:TARGET:BIT, TARGET = a register, mem:REG+OFFSET, kill, kill-in-call or hang")
        };
        let parts: Vec<&str> = s.split(':').collect();
        let (replica, syscall, target, bit) = match parts.as_slice() {
            [r, k, t, b] => (r, k, t.to_string(), b),
            [r, k, "mem", m, b] => (r, k, format!("mem:{m}"), b),
            _ => return Err(bad()),
        };
        let replica = replica.parse().map_err(|_| bad())?;
        let at = match syscall.parse::<u64>() {
            Ok(0) => return Err(format!("bad flip '{s}': syscalls are counted from 1")),
            Ok(k) => FlipAt::Stop(k),
            Err(_) => FlipAt::FirstCall(lockstep_trace::syscall_names::number(syscall).ok_or_else(bad)?),
        };
        let bit: u32 = bit.parse().map_err(|_| bad())?;
        let target = match target.as_str() {
            "kill" => FlipTarget::Kill,
            "kill-in-call" => FlipTarget::KillInCall,
            "hang" => FlipTarget::Hang,
            t if t.starts_with("mem:") => {
                let spec = &t[4..];
                let (base, offset) = match spec.find(['+', '-']) {
                    Some(i) => (
                        &spec[..i],
                        spec[i..].trim_start_matches('+').parse::<i64>().map_err(|_| bad())?,
                    ),
                    None => (spec, 0),
                };
                if !lockstep_trace::regs::NAMES.contains(&base) {
                    return Err(bad());
                }
                if bit > 7 {
                    return Err(format!("bad flip '{s}': a memory byte has bits 0..7"));
                }
                FlipTarget::Memory {
                    base: base.to_string(),
                    offset,
                }
            }
            r if lockstep_trace::regs::NAMES.contains(&r) => {
                if bit > 63 {
                    return Err(format!("bad flip '{s}': a register has bits 0..63"));
                }
                FlipTarget::Register(r.to_string())
            }
            _ => return Err(bad()),
        };
        Ok(FlipSpec {
            replica,
            at,
            target,
            bit,
        })
    }
}

/// Everything `lockstep run` needs.
#[derive(Clone, Debug)]
pub struct Options {
    pub replicas: u32,
    pub compare: CompareMode,
    pub backend: BackendKind,
    /// Pause iterations before a replica waiting on the ring sleeps (fast backend).
    pub spin: u32,
    /// Who lets the leader's outputs leave (fast backend).
    pub output_check: OutputCheck,
    /// How followers' threads keep the order of synchronisation operations (fast backend).
    pub sync_order: SyncOrder,
    /// How long the first replica to reach a rendezvous waits for the others.
    pub timeout: Duration,
    pub events: Option<PathBuf>,
    pub stats: bool,
    /// CPUs to pin replicas to, in order; empty = spread over the CPUs we may use.
    pub cpus: Vec<usize>,
    /// CPU to pin the monitor to once the replicas are started; None = not pinned.
    pub monitor_cpu: Option<usize>,
    pub reintegrate: bool,
    pub flips: Vec<FlipSpec>,
    /// Print one line per event on stderr.
    pub quiet: bool,
    /// Kill the program's processes that outlive its first process when that one exits
    /// (instead of detaching and replicating them until they exit).
    pub kill_orphans: bool,
    pub command: Vec<String>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            replicas: 2,
            compare: CompareMode::Args,
            backend: BackendKind::Ptrace,
            spin: crate::fast::DEFAULT_SPIN,
            output_check: OutputCheck::Strict,
            sync_order: SyncOrder::Global,
            timeout: Duration::from_secs(10),
            events: None,
            stats: false,
            cpus: Vec::new(),
            monitor_cpu: None,
            reintegrate: true,
            flips: Vec::new(),
            quiet: false,
            kill_orphans: false,
            command: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_flips() {
        let f: FlipSpec = "1:12:mem:rsi+3:2".parse().unwrap();
        assert_eq!(
            f.target,
            FlipTarget::Memory {
                base: "rsi".into(),
                offset: 3
            }
        );
        let f: FlipSpec = "0:5:rbx:63".parse().unwrap();
        assert_eq!(f.target, FlipTarget::Register("rbx".into()));
        assert_eq!("2:7:kill:0".parse::<FlipSpec>().unwrap().target, FlipTarget::Kill);
        assert_eq!(
            "0:23:kill-in-call:0".parse::<FlipSpec>().unwrap().target,
            FlipTarget::KillInCall
        );
        assert!("2:0:kill:0".parse::<FlipSpec>().is_err());
        let at = "1:getppid:mem:rdi+0:2".parse::<FlipSpec>().unwrap().at;
        assert_eq!(at, FlipAt::FirstCall(libc::SYS_getppid as u64));
        assert!("1:nosuchcall:kill:0".parse::<FlipSpec>().is_err());
        assert!("x".parse::<FlipSpec>().is_err());
        assert!("0:1:rbx:64".parse::<FlipSpec>().is_err());
        assert!("0:1:mem:rsi:8".parse::<FlipSpec>().is_err());
    }
}

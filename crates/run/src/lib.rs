//! `lockstep run`: redundant co-execution of an unmodified Linux program.
//!
//! N replicas (2 = DMR, 3 = TMR) run the same program. Every syscall that is not purely
//! local stops in the monitor, where the replicas' calls to it meet ("rendezvous"), are
//! compared, and are executed according to the syscall's class (see
//! `lockstep_trace::syscalls`). DMR halts on a divergence; TMR votes the faulty replica
//! out, continues, and forks a fresh replica from a healthy one.
//!
//! Map of this crate:
//! * [`options`]: what the user asked for.
//! * [`spawn`]: identical starts of replicas.
//! * [`backend`]: the seam between policy and mechanism (ptrace; every steering failure
//!   is a replica failure).
//! * [`scripted`]: a backend that plays hand-written syscall streams, for policy tests
//!   without processes (`tests/policy.rs`).
//! * [`fast`]: the fast path (`--backend fast`): the ring shared with the in-process
//!   shim, and the shim itself.
//! * [`fast_calls`]: which calls the shim replicates and how it reads their arguments
//!   (shared with `build.rs`, which generates the shim's table from it).
//! * [`fast_check`]: strict output checks: the monitor digests a leader's output as the
//!   shim does and lets it run only if every follower voted that digest.
//! * [`commit`]: the output commit of strict checks: a thread of the monitor copies each
//!   output out of the leader, digests the copy, and writes it through its own duplicate
//!   of the leader's descriptor once every follower voted that digest.
//! * [`front`]: the process the caller waits for, split from the monitor so that processes
//!   outliving the program's first one stay replicated after lockstep returns.
//! * [`replica`]: the replica set: liveness, leadership, pid translation.
//! * [`report`]: events, queued during a stop and written after it.
//! * [`session`]: the policy, one module tree with private state: the event loop, logical
//!   processes, and in submodules the rendezvous (`session::rendezvous`), asynchronous
//!   signals (`session::signals`, `session::catch_up`), shared file mappings
//!   (`session::shared_map`) and what the monitor does for the fast path (hello, reports,
//!   the consumption check at rendezvous, signals, switching the ring off).
//! * [`task`]: a logical thread and its per-replica slots, with the transitions that
//!   change their state.
//! * [`injection`]: `lockstep inject --replica` and `--test-flip`, reaching the monitor
//!   through one hook.
//! * [`data`]: reading syscall arguments and copying results between replicas.
//! * [`clock`]: clock reads, answered from per-task value sequences without a rendezvous.
//! * [`stats`]: counters printed by `--stats`.

pub mod backend;
pub mod clock;
pub mod commit;
pub mod data;
pub mod fast;
pub mod fast_calls;
pub mod fast_check;
pub mod front;
pub mod injection;
pub mod options;
pub mod replica;
pub mod report;
pub mod scripted;
pub mod session;
pub mod spawn;
pub mod stats;
pub mod task;

pub use options::{BackendKind, CompareMode, FlipAt, FlipSpec, FlipTarget, Options, OutputCheck, SyncOrder};

/// Exit status a replica uses when it cannot install the seccomp filter before exec.
pub(crate) const EXIT_SETUP_FAILED: i32 = 121;

/// Why `lockstep run` could not do its job (as opposed to a divergence, which is an outcome).
#[derive(Debug)]
pub enum Error {
    Usage(String),
    NotFound(String),
    Setup(String),
    Io(&'static str, std::io::Error),
    Unsupported(String),
    /// The monitor failed while it replicated this syscall.
    Internal {
        syscall: String,
        cause: Box<Error>,
    },
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Usage(m) => write!(f, "{m}"),
            Error::NotFound(m) => write!(f, "{m}"),
            Error::Setup(m) => write!(f, "cannot start the replicas: {m}"),
            Error::Io(what, e) => write!(f, "{what} failed: {e}"),
            Error::Unsupported(m) => write!(f, "{m}"),
            Error::Internal { syscall, cause } => write!(f, "internal error while replicating {syscall}: {cause}"),
        }
    }
}

impl Error {
    /// Whether the monitor already reported this error as an event (whose human line goes
    /// to stderr unless `--quiet`): the caller need not print it again.
    pub fn reported_as_event(&self) -> bool {
        matches!(self, Error::Unsupported(_) | Error::Internal { .. })
    }

    /// The documented exit status for this error.
    pub fn exit_status(&self) -> i32 {
        use lockstep_core::exit;
        match self {
            Error::Usage(_) => exit::USAGE,
            Error::NotFound(_) => exit::NOT_FOUND,
            Error::Setup(_) | Error::Io(..) | Error::Unsupported(_) | Error::Internal { .. } => exit::LOCKSTEP_FAILURE,
        }
    }
}

/// Runs the program under the given options and returns lockstep's exit status.
pub fn run(options: Options) -> Result<i32, Error> {
    let front = if options.kill_orphans {
        front::Front::none()
    } else {
        front::split()?
    };
    session::Session::start(options, front)?.run()
}

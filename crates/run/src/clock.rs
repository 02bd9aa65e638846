//! Time without rendezvous.
//!
//! Some programs read a clock a timing-dependent number of times (CPython's GIL polls
//! CLOCK_MONOTONIC while it waits), so replicas that behave the same can still make a
//! different number of clock calls. Clock calls are therefore not matched across
//! replicas. Instead each task keeps, per clock, one sequence of values: the i-th read of
//! that clock in any replica returns the i-th value, taken from the real clock by
//! whichever replica got there first. Replicas that read the clock the same number of
//! times see exactly the same values; extra reads only see later values. Sequences are
//! restarted at every rendezvous of the task (all replicas pass it together), so extra
//! reads only shift values up to the task's next synchronised syscall.

use crate::session::ReplicaId;
use lockstep_trace::Tid;
use std::collections::{HashMap, VecDeque};

/// Clocks answered this way: the standard ids 0..=11 (CLOCK_REALTIME .. CLOCK_TAI).
/// `gettimeofday` and `time` use CLOCK_REALTIME's sequence.
pub fn clock_of(nr: u64, args: &[u64; 6]) -> Option<i32> {
    match nr as i64 {
        libc::SYS_clock_gettime if args[0] <= 11 && kernel_reads(args[0] as usize) => Some(args[0] as i32),
        libc::SYS_gettimeofday | libc::SYS_time => Some(libc::CLOCK_REALTIME),
        _ => None,
    }
}

/// Whether this kernel reads clock `id` (0..=11). Clocks it refuses (CLOCK_SGI_CYCLE,
/// alarm clocks without an RTC) are not answered here: the call runs in the leader and its
/// EINVAL reaches every replica, as natively.
fn kernel_reads(id: usize) -> bool {
    static READABLE: std::sync::OnceLock<[bool; 12]> = std::sync::OnceLock::new();
    READABLE.get_or_init(|| {
        std::array::from_fn(|c| {
            let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
            // SAFETY: clock_gettime writes one timespec into `ts`.
            unsafe { libc::clock_gettime(c as libc::clockid_t, &mut ts) == 0 }
        })
    })[id]
}

/// One clock's values for one task.
#[derive(Default, Clone)]
pub struct Sequence {
    /// Index of `values[0]`.
    base: u64,
    values: VecDeque<libc::timespec>,
    /// Next index per replica.
    next: HashMap<ReplicaId, u64>,
}

/// Upper bound on values kept for a lagging replica; beyond it the oldest are dropped
/// (a replica that far behind on clock reads is diverging anyway).
const MAX_KEPT: usize = 1 << 16;

impl Sequence {
    /// The value replica `r` reads next; `now` reads the real clock if it is new.
    pub fn next(&mut self, r: ReplicaId, live: &[ReplicaId], now: impl FnOnce() -> libc::timespec) -> libc::timespec {
        let idx = *self.next.get(&r).unwrap_or(&self.base);
        let idx = idx.max(self.base);
        let end = self.base + self.values.len() as u64;
        let value = if idx < end {
            self.values[(idx - self.base) as usize]
        } else {
            let v = now();
            self.values.push_back(v);
            v
        };
        self.next.insert(r, idx + 1);
        // Forget values every live replica has read.
        let min = live
            .iter()
            .map(|l| *self.next.get(l).unwrap_or(&self.base))
            .min()
            .unwrap_or(self.base);
        while self.base < min || self.values.len() > MAX_KEPT {
            self.values.pop_front();
            self.base += 1;
        }
        value
    }

    /// A new replica forked from `source` continues where `source` is.
    pub fn fork(&mut self, source: ReplicaId, new: ReplicaId) {
        let at = *self.next.get(&source).unwrap_or(&self.base);
        self.next.insert(new, at);
    }
}

/// Reads `clock` now, as seen by thread `tid` (CPU-time clocks are per process/thread).
pub fn read(clock: i32, tgid: Tid, tid: Tid) -> libc::timespec {
    let id = match clock {
        libc::CLOCK_PROCESS_CPUTIME_ID => (!tgid << 3) | 2,
        libc::CLOCK_THREAD_CPUTIME_ID => (!tid << 3) | 6,
        c => c,
    };
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime into a local.
    unsafe { libc::clock_gettime(id, &mut ts) };
    ts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ts(s: i64) -> libc::timespec {
        libc::timespec { tv_sec: s, tv_nsec: 0 }
    }

    #[test]
    fn replicas_read_the_same_values_in_order() {
        let mut seq = Sequence::default();
        let live = [0, 1];
        assert_eq!(seq.next(0, &live, || ts(10)).tv_sec, 10);
        assert_eq!(seq.next(0, &live, || ts(11)).tv_sec, 11);
        assert_eq!(seq.next(1, &live, || ts(99)).tv_sec, 10);
        // Replica 1 reads more often: it gets new values, which replica 0 then sees too.
        assert_eq!(seq.next(1, &live, || ts(99)).tv_sec, 11);
        assert_eq!(seq.next(1, &live, || ts(12)).tv_sec, 12);
        assert_eq!(seq.next(0, &live, || ts(98)).tv_sec, 12);
    }

    #[test]
    fn consumed_values_are_dropped_and_forks_continue() {
        let mut seq = Sequence::default();
        let live = [0, 1];
        for i in 0..5 {
            seq.next(0, &live, || ts(i));
            seq.next(1, &live, || ts(100));
        }
        assert!(seq.values.is_empty());
        seq.next(0, &live, || ts(7));
        seq.fork(1, 2);
        assert_eq!(seq.next(2, &[0, 1, 2], || ts(55)).tv_sec, 7);
    }
}

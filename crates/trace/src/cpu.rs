//! CPU time of another process: what time-based fault injection counts, so that a point
//! means the same amount of the program's own execution whether it runs natively or as a
//! (slower, often parked) replica.

use crate::Tid;
use std::time::Duration;

/// CPUCLOCK_SCHED: the scheduler's precise runtime (user + system).
const CPUCLOCK_SCHED: libc::clockid_t = 2;
/// CPUCLOCK_PERTHREAD_MASK: the clock of one thread, not of its whole process.
const CPUCLOCK_PERTHREAD: libc::clockid_t = 4;

/// The CPU time (all threads, user + system) process `pid` has used so far; None once it
/// is gone. The kernel lets any process read another process's CPU clock.
pub fn process_cpu(pid: Tid) -> Option<Duration> {
    // MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED) from the kernel's posix-timers.h.
    read_clock(((!pid) << 3) | CPUCLOCK_SCHED)
}

/// The CPU time thread `tid` alone has used so far; None once it is gone.
pub fn thread_cpu(tid: Tid) -> Option<Duration> {
    // MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED).
    read_clock(((!tid) << 3) | CPUCLOCK_SCHED | CPUCLOCK_PERTHREAD)
}

fn read_clock(clock: libc::clockid_t) -> Option<Duration> {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec.
    if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
        return None;
    }
    Some(Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_cpu_time_of_a_process() {
        let me = std::process::id() as Tid;
        let before = process_cpu(me).expect("own clock");
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = x.wrapping_add(i ^ (x >> 3));
        }
        std::hint::black_box(x);
        assert!(process_cpu(me).unwrap() > before);
        assert_eq!(process_cpu(4_194_000), None, "no such process");
        // SAFETY: gettid has no preconditions.
        let own = thread_cpu(unsafe { libc::gettid() }).expect("own thread clock");
        assert!(own > Duration::ZERO && own <= process_cpu(me).unwrap());
    }
}

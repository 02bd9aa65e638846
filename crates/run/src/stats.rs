//! Counters for `--stats`.

use lockstep_trace::syscalls::Class;
use std::time::Duration;

#[derive(Default, Debug)]
pub struct Stats {
    pub by_class: [u64; 8],
    pub votes: u64,
    pub bytes_compared: u64,
    pub bytes_copied: u64,
    pub rdtsc: u64,
    pub clock_reads: u64,
    pub signals_delivered: u64,
    /// Of those, delivered while the task made no system call (see `catch_up.rs`): at a
    /// state every replica met, or where each replica was.
    pub signals_met: u64,
    pub signals_loose: u64,
    /// Of those, delivered as records of the fast path's ring (no rendezvous).
    pub signals_in_ring: u64,
    pub divergences: u64,
    /// Calls the leader completed on the fast path, when it was attached.
    pub fast_calls: Option<u64>,
    /// Of those, outputs the monitor checked before they ran (strict output checks).
    pub checked_outputs: Option<u64>,
    /// The leader's order of events across threads (fast backend).
    pub order: Option<crate::fast::OrderCounts>,
    /// What the output committer did (strict output checks on the fast backend).
    pub commits: Option<crate::commit::CommitCounts>,
    /// The monitor's own stops and /proc reads.
    pub monitor: crate::backend::MonitorCounts,
    pub reintegrations: u64,
    pub monitor_time: Duration,
}

pub fn class_index(c: Class) -> usize {
    match c {
        Class::Passthrough => 0,
        Class::Input => 1,
        Class::Output => 2,
        Class::FdCreate => 3,
        Class::AllAfterLeader => 4,
        Class::All => 5,
        Class::Emulated => 6,
        Class::Unsupported => 7,
    }
}

const NAMES: [&str; 8] = [
    "passthrough",
    "input",
    "output",
    "fd-create",
    "after-leader",
    "all",
    "emulated",
    "unsupported",
];

impl Stats {
    pub fn count(&mut self, c: Class) {
        self.by_class[class_index(c)] += 1;
    }

    pub fn render(&self, wall: Duration) -> String {
        let total: u64 = self.by_class.iter().sum();
        let mut s = format!("lockstep run: stats\n  syscalls intercepted: {total} (rendezvous)\n");
        for (i, n) in self.by_class.iter().enumerate() {
            if *n > 0 {
                s.push_str(&format!("    {:<13} {n}\n", NAMES[i]));
            }
        }
        if let Some(n) = self.fast_calls {
            s.push_str(&format!(
                "  fast-path calls:      {n} (replicated in process, no stop)\n"
            ));
        }
        if let Some(n) = self.checked_outputs {
            s.push_str(&format!(
                "    outputs checked:    {n} (by the monitor before they ran: --output-check strict)\n"
            ));
        }
        if let Some(c) = self.commits {
            s.push_str(&format!(
                "    outputs committed:  {} (written by the monitor's committer; {} escalated, {} left to the leader)\n",
                c.written, c.escalated, c.own
            ));
            s.push_str(&format!(
                "    outputs posted:     {} (the leader went on at once; {} kept for a full socket, {} refused: voted against or never voted)\n",
                c.posted, c.kept, c.refused
            ));
            s.push_str(&format!(
                "    committer wake-ups: {} ({} descriptors duplicated)\n",
                c.wakeups, c.duplicated
            ));
        }
        if let Some(order) = self.order {
            s.push_str(&format!(
                "  ordered events:       {} ({} taken out of turn, {} late wake-ups)\n",
                order.events, order.skipped, order.late_wakes
            ));
            s.push_str(&format!(
                "  owned mutex takes:    {} (taken again by the thread that took it last: no record)\n",
                order.owned_takes
            ));
            s.push_str(&format!(
                "  ring wake-ups:        {} (futex wakes between replicas' threads)\n",
                order.wakes
            ));
        }
        s.push_str(&format!("  rdtsc emulated:       {}\n", self.rdtsc));
        s.push_str(&format!(
            "  clock reads:          {} (answered without rendezvous)\n",
            self.clock_reads
        ));
        s.push_str(&format!("  votes:                {}\n", self.votes));
        s.push_str(&format!("  bytes compared:       {}\n", self.bytes_compared));
        s.push_str(&format!("  bytes copied:         {}\n", self.bytes_copied));
        s.push_str(&format!("  signals delivered:    {}\n", self.signals_delivered));
        if self.signals_in_ring > 0 {
            s.push_str(&format!(
                "    in the ring:        {} (records of the fast path, no rendezvous)\n",
                self.signals_in_ring
            ));
        }
        if self.signals_met + self.signals_loose > 0 {
            s.push_str(&format!(
                "    outside syscalls:   {} at a met state, {} where each replica was\n",
                self.signals_met, self.signals_loose
            ));
        }
        s.push_str(&format!("  divergences:          {}\n", self.divergences));
        s.push_str(&format!(
            "  monitor stops:        {} (ptrace stops of replica threads)\n",
            self.monitor.stops
        ));
        s.push_str(&format!("  monitor /proc reads:  {}\n", self.monitor.proc_reads));
        s.push_str(&format!("  re-integrations:      {}\n", self.reintegrations));
        let per = (self.monitor_time.as_nanos() as u64).checked_div(total).unwrap_or(0);
        // SAFETY: getrusage into a zeroed struct.
        let cpu = unsafe {
            let mut u: libc::rusage = std::mem::zeroed();
            libc::getrusage(libc::RUSAGE_SELF, &mut u);
            u.ru_utime.tv_sec as f64
                + u.ru_utime.tv_usec as f64 / 1e6
                + u.ru_stime.tv_sec as f64
                + u.ru_stime.tv_usec as f64 / 1e6
        };
        s.push_str(&format!("  monitor CPU time:     {cpu:.3} s\n"));
        s.push_str(&format!(
            "  time in monitor:      {:.3} s of {:.3} s wall ({} ns per intercepted syscall)\n",
            self.monitor_time.as_secs_f64(),
            wall.as_secs_f64(),
            per
        ));
        s
    }
}

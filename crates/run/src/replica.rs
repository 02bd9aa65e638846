//! The replica set: which copies of the program are alive, which one leads, how each one's
//! pids map to the program's, and whether the set is short of replicas.
//!
//! State is private: a replica becomes dead and a new leader is elected only through
//! [`Replicas::remove`], and a replica is added only through [`Replicas::add_fork`].

use crate::session::{Members, ReplicaId, Started};
use lockstep_trace::seccomp::Listener;
use lockstep_trace::Tid;
use std::collections::HashMap;
use std::rc::Rc;

/// One copy of the whole program.
struct Replica {
    alive: bool,
    cpu: Option<usize>,
    /// Where its descriptor installs are answered (ptrace replicas only).
    listener: Option<Rc<Listener>>,
    /// Its PID namespace's init, or 0.
    stub: Tid,
    /// Logical pid -> this replica's own pid, where they differ.
    to_local: HashMap<i32, i32>,
    to_logical: HashMap<i32, i32>,
}

/// What removing a replica did to the leadership.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Removal {
    /// A follower left; the leader is unchanged.
    Follower,
    /// The leader left and this replica leads now.
    NewLeader(ReplicaId),
    /// The leader left and no replica is alive.
    NoneLeft,
}

pub struct Replicas {
    members: Vec<Replica>,
    leader: ReplicaId,
    /// How many replicas the user asked for (re-integration restores this many).
    want: usize,
}

impl Replicas {
    /// The replicas as their mechanism started them; replica 0 leads. A replica whose own
    /// pid differs from `logical_pid` is translated.
    pub fn new(started: Vec<Started>, logical_pid: i32) -> Replicas {
        let want = started.len();
        let members = started
            .into_iter()
            .map(|s| {
                let mut r = Replica {
                    alive: true,
                    cpu: s.cpu,
                    listener: s.listener,
                    stub: s.stub,
                    to_local: HashMap::new(),
                    to_logical: HashMap::new(),
                };
                if s.own_pid != logical_pid {
                    r.to_local.insert(logical_pid, s.own_pid);
                    r.to_logical.insert(s.own_pid, logical_pid);
                }
                r
            })
            .collect();
        Replicas {
            members,
            leader: 0,
            want,
        }
    }

    pub fn leader(&self) -> ReplicaId {
        self.leader
    }

    /// Replica ids ever given (dead ones included): the width of every task's slot table.
    pub fn ids(&self) -> usize {
        self.members.len()
    }

    pub fn is_alive(&self, r: ReplicaId) -> bool {
        self.members.get(r as usize).is_some_and(|m| m.alive)
    }

    pub fn live(&self) -> Members {
        (0..self.members.len() as ReplicaId)
            .filter(|&r| self.is_alive(r))
            .collect()
    }

    /// Fewer replicas are alive than the user asked for.
    pub fn short(&self) -> bool {
        self.live().len() < self.want
    }

    /// Removes replica `r` from the live set and, if it led, elects the live replica with
    /// the lowest id.
    pub fn remove(&mut self, r: ReplicaId) -> Removal {
        assert!(self.is_alive(r), "replica {r} is removed once");
        self.members[r as usize].alive = false;
        if r != self.leader {
            return Removal::Follower;
        }
        match self.live().first() {
            Some(&new) => {
                self.leader = new;
                Removal::NewLeader(new)
            }
            None => Removal::NoneLeft,
        }
    }

    /// Adds a replica forked from `source` (re-integration): it shares the source's
    /// listener and namespace, and its own pid `local_pid` stands for `logical_pid`.
    pub fn add_fork(&mut self, source: ReplicaId, cpu: Option<usize>, local_pid: i32, logical_pid: i32) -> ReplicaId {
        let from = &self.members[source as usize];
        let mut r = Replica {
            alive: true,
            cpu,
            listener: from.listener.clone(),
            stub: from.stub,
            to_local: from.to_local.clone(),
            to_logical: from.to_logical.clone(),
        };
        if local_pid != logical_pid {
            r.to_local.insert(logical_pid, local_pid);
            r.to_logical.insert(local_pid, logical_pid);
        }
        self.members.push(r);
        assert!(
            self.live().len() <= crate::session::MAX_LIVE,
            "at most {} live replicas",
            crate::session::MAX_LIVE
        );
        (self.members.len() - 1) as ReplicaId
    }

    /// The CPU replica `r` is pinned to, if it is.
    pub fn cpu(&self, r: ReplicaId) -> Option<usize> {
        self.members.get(r as usize).and_then(|m| m.cpu)
    }

    /// The CPU a dead replica ran on (a new replica takes its place there).
    pub fn free_cpu(&self) -> Option<usize> {
        self.members.iter().find(|m| !m.alive).and_then(|m| m.cpu)
    }

    pub fn listener(&self, r: ReplicaId) -> Option<Rc<Listener>> {
        self.members[r as usize].listener.clone()
    }

    pub fn stub(&self, r: ReplicaId) -> Tid {
        self.members[r as usize].stub
    }

    /// Every replica's namespace init (to kill at the end).
    pub fn stubs(&self) -> impl Iterator<Item = Tid> + '_ {
        self.members.iter().map(|m| m.stub).filter(|&s| s > 0)
    }

    /// Replica `r` knows its copy of logical pid `logical` as `local`.
    pub fn learn_pid(&mut self, r: ReplicaId, logical: i32, local: i32) {
        let m = &mut self.members[r as usize];
        m.to_local.insert(logical, local);
        m.to_logical.insert(local, logical);
    }

    /// Whether replica `r` numbers any process differently from the program.
    pub fn translates(&self, r: ReplicaId) -> bool {
        !self.members[r as usize].to_local.is_empty()
    }

    /// Logical pid -> replica-local pid (a negative pid names a process group).
    pub fn to_local(&self, r: ReplicaId, pid: i32) -> i32 {
        let map = &self.members[r as usize].to_local;
        if map.is_empty() {
            return pid;
        }
        if pid < -1 {
            return -map.get(&-pid).copied().unwrap_or(-pid);
        }
        map.get(&pid).copied().unwrap_or(pid)
    }

    /// Replica-local pid -> logical pid.
    pub fn to_logical(&self, r: ReplicaId, pid: i32) -> i32 {
        self.members[r as usize].to_logical.get(&pid).copied().unwrap_or(pid)
    }
}

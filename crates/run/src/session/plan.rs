//! The policy's decisions at a rendezvous, as data.
//!
//! What the replicas of a task arrived with goes in; a list of [`Command`]s comes out, and
//! `Session::carry_out` (rendezvous.rs) applies them in order through the backend, adding
//! what only the session knows how to do (events, statistics, the description of a
//! divergence). The functions here read no replica and change nothing, so each decision
//! (who is voted out, when the run halts, who runs a call and who waits, how a trapped
//! instruction is answered) is tested on its own below, without ptrace or any process.

use crate::backend::Resume;
use crate::task::{Phase, ReplicaId, SlotState};
use lockstep_core::{vote, Verdict};
use lockstep_trace::syscalls::Class;
use lockstep_trace::Regs;

/// One step of a decision.
#[derive(Clone, Debug, PartialEq)]
pub enum Command {
    /// The majority agrees that this replica is faulty: vote it out (kill it, and replace
    /// the leader if it was the leader).
    VoteOut(ReplicaId),
    /// No majority agrees on a faulty replica: stop every replica (exit 86).
    Halt,
    /// The remaining replicas agree; `masked` when replicas were voted out first.
    Agree { masked: bool },
    /// The monitor answers the call itself, the same answer for every replica.
    Emulate { nr: u64, args: [u64; 6] },
    /// The call cannot be replicated safely: stop the run (exit 125).
    Refuse { nr: u64 },
    /// The task's next phase.
    Begin(Phase),
    /// The task's process is going down (`exit_group`, or a fault every replica took).
    Exiting,
    /// Before every replica runs a call of its own: forget the process it last spawned
    /// and note a signal the program sends to itself.
    PrepareForAll { nr: u64, args: [u64; 6] },
    /// Translate the replica's pid arguments (logical to its own) before it runs the call.
    TranslatePids {
        replica: ReplicaId,
        nr: u64,
        args: [u64; 6],
    },
    /// Set the replica's registers: the monitor's answer in place of an instruction.
    SetRegs(ReplicaId, Registers),
    /// Let the replica's thread go on, and the state its slot is in meanwhile.
    Resume(ReplicaId, Resume, SlotState),
    /// Write what the leader's call returned in memory (the buffers it filled) into the
    /// replica's own buffers for the same call.
    CopyResults(ReplicaId),
    /// Install the descriptors the leader's call created (or received) in the replica at
    /// the same numbers, and make its call return `ret`.
    InstallFds { replica: ReplicaId, ret: i64 },
    /// Raise in the replica the signals the leader took at this call.
    RaiseMirrored(ReplicaId),
    /// The call is over: the task collects arrivals again.
    Recollect,
    /// Fold a call's result into the replica's output signature.
    FoldResult(ReplicaId, i64),
}

/// A whole register set in a command, compared field by field.
#[derive(Clone, Copy, Debug)]
pub struct Registers(pub Regs);

impl PartialEq for Registers {
    fn eq(&self, other: &Self) -> bool {
        super::catch_up::regs_bytes(&self.0) == super::catch_up::regs_bytes(&other.0)
    }
}

/// Votes on the keys the replicas (`members`, in the same order) arrived with: the
/// replicas voted out one by one while a majority agrees on a single suspect, then either
/// agreement or a halt.
pub fn vote_plan<K: PartialEq + Clone>(members: &[ReplicaId], keys: &[K]) -> Vec<Command> {
    assert_eq!(members.len(), keys.len(), "one key per member");
    let (mut members, mut keys) = (members.to_vec(), keys.to_vec());
    let mut plan = Vec::new();
    loop {
        match vote(&keys) {
            Verdict::Unanimous => {
                plan.push(Command::Agree {
                    masked: !plan.is_empty(),
                });
                return plan;
            }
            Verdict::Faulty(i) => {
                plan.push(Command::VoteOut(members.remove(i)));
                keys.remove(i);
            }
            Verdict::NoConsensus => {
                plan.push(Command::Halt);
                return plan;
            }
        }
    }
}

/// Who runs an agreed-on call of class `class`, and how: the leader alone while the
/// followers wait (an input, an output, a new descriptor, a shared file mapping), the
/// leader first and then the followers (`wait4` and its kin), every replica at once (a
/// per-process effect), or nobody (the monitor answers, or refuses).
pub fn execution_plan(class: Class, nr: u64, args: [u64; 6], leader: ReplicaId, live: &[ReplicaId]) -> Vec<Command> {
    let leader_alone = |phase: Phase| {
        vec![
            Command::Begin(phase),
            Command::Resume(leader, Resume::ToExit, SlotState::Executing),
        ]
    };
    match class {
        Class::Passthrough | Class::Emulated => vec![Command::Emulate { nr, args }],
        Class::Unsupported => vec![Command::Refuse { nr }],
        Class::Input | Class::Output | Class::FdCreate => leader_alone(Phase::Leader { nr, args, class }),
        // A shared file mapping (the only mmap that stops): the leader maps the file, then
        // the followers get private copies (shared_map.rs).
        Class::All if nr == libc::SYS_mmap as u64 => leader_alone(Phase::Leader { nr, args, class }),
        Class::AllAfterLeader => vec![
            Command::Begin(Phase::LeaderFirst { nr, args }),
            Command::TranslatePids {
                replica: leader,
                nr,
                args,
            },
            Command::Resume(leader, Resume::ToExit, SlotState::Executing),
        ],
        Class::All if nr == libc::SYS_exit_group as u64 => std::iter::once(Command::Exiting)
            .chain(
                live.iter()
                    .map(|&r| Command::Resume(r, Resume::Run, SlotState::Running)),
            )
            .collect(),
        Class::All => {
            let mut plan = vec![
                Command::Begin(Phase::All { nr, args }),
                Command::PrepareForAll { nr, args },
            ];
            for &replica in live {
                plan.push(Command::TranslatePids { replica, nr, args });
                plan.push(Command::Resume(replica, Resume::ToExit, SlotState::Executing));
            }
            plan
        }
    }
}

/// A trapped instruction that every replica reached, and the monitor's answer to it.
#[derive(Clone, Copy, Debug)]
pub enum Answer {
    /// RDTSC (`len` 2) or RDTSCP (`len` 3), with the time-stamp counter's value.
    Tsc { len: u8, tsc: u64 },
    /// CPUID, with what the monitor's CPU answered (eax, ebx, ecx, edx).
    Cpuid([u32; 4]),
}

/// Every live replica (with the registers it stopped with) gets the same answer to a
/// trapped instruction, past which it goes on.
pub fn answer_plan(stopped: &[(ReplicaId, Regs)], answer: Answer) -> Vec<Command> {
    let mut plan = Vec::with_capacity(stopped.len() * 2);
    for (r, regs) in stopped {
        let mut regs = *regs;
        match answer {
            Answer::Tsc { len, tsc } => {
                regs.rax = tsc & 0xffff_ffff;
                regs.rdx = tsc >> 32;
                if len == 3 {
                    regs.rcx = 0; // RDTSCP's processor id
                }
                regs.rip += len as u64;
            }
            Answer::Cpuid([a, b, c, d]) => {
                (regs.rax, regs.rbx, regs.rcx, regs.rdx) = (a as u64, b as u64, c as u64, d as u64);
                regs.rip += 2;
            }
        }
        plan.push(Command::SetRegs(*r, Registers(regs)));
        plan.push(Command::Resume(*r, Resume::Run, SlotState::Running));
    }
    plan
}

/// The leader has run a call for everyone (an input, an output, a new descriptor) and it
/// returned `ret`. Each follower waiting at the call (`waiting`, with the registers it
/// stopped with) gets the leader's results in its memory and then either the leader's new
/// descriptors (`new_fds`, which also end its call) or the leader's result in place of
/// running the call; then the leader goes on. A follower never runs the call itself.
pub fn completion_plan(leader: ReplicaId, waiting: &[(ReplicaId, Regs)], ret: i64, new_fds: bool) -> Vec<Command> {
    let mut plan = Vec::with_capacity(waiting.len() * 4 + 2);
    for (f, regs) in waiting {
        assert_ne!(*f, leader, "the leader is not waiting for its own call");
        plan.push(Command::CopyResults(*f));
        if new_fds {
            plan.push(Command::InstallFds { replica: *f, ret });
            continue;
        }
        let mut regs = *regs;
        lockstep_trace::ptrace::skip_with_result(&mut regs, ret);
        plan.push(Command::SetRegs(*f, Registers(regs)));
        plan.push(Command::RaiseMirrored(*f));
        plan.push(Command::Resume(*f, Resume::Run, SlotState::Running));
    }
    plan.push(Command::Recollect);
    plan.push(Command::Resume(leader, Resume::Run, SlotState::Running));
    plan
}

/// A call that every replica ran for itself (a per-process effect, or a `wait4` the
/// followers repeated after the leader) has returned in each. `ended` holds each live
/// replica with the registers it stopped with at the call's exit and the result the
/// program must see (its own, with pids made logical). When `copy_leaders_results`, the
/// followers first get the leader's buffers (what legitimately differs, such as rusage or
/// siginfo times, is the leader's, as for an input). Each replica's result register is
/// set to the logical result and, when `fold`, folded into its signature; then the results
/// are voted on. The replicas the vote keeps take the mirrored signals (the followers) and
/// go on; a halt ends the plan.
pub fn all_done_plan(
    leader: ReplicaId,
    ended: &[(ReplicaId, Regs, i64)],
    copy_leaders_results: bool,
    fold: bool,
) -> Vec<Command> {
    let mut plan = Vec::with_capacity(ended.len() * 5 + 2);
    for &(r, regs, result) in ended {
        if copy_leaders_results && r != leader {
            plan.push(Command::CopyResults(r));
        }
        if regs.rax as i64 != result {
            let mut regs = regs;
            regs.rax = result as u64;
            plan.push(Command::SetRegs(r, Registers(regs)));
        }
        if fold {
            plan.push(Command::FoldResult(r, result));
        }
    }
    let members: Vec<ReplicaId> = ended.iter().map(|e| e.0).collect();
    let results: Vec<i64> = ended.iter().map(|e| e.2).collect();
    let vote = vote_plan(&members, &results);
    if vote.last() == Some(&Command::Halt) {
        plan.extend(vote);
        return plan;
    }
    let survivors: Vec<ReplicaId> = members
        .into_iter()
        .filter(|r| !vote.contains(&Command::VoteOut(*r)))
        .collect();
    plan.extend(vote);
    for &r in &survivors {
        if r != leader {
            plan.push(Command::RaiseMirrored(r));
        }
        plan.push(Command::Resume(r, Resume::Run, SlotState::Running));
    }
    plan
}

/// Every replica took the same synchronous fault: the program's own behaviour. Its process
/// goes down as natively, with the signal delivered in every replica.
pub fn fault_plan(live: &[ReplicaId], sig: i32) -> Vec<Command> {
    std::iter::once(Command::Exiting)
        .chain(
            live.iter()
                .map(|&r| Command::Resume(r, Resume::Signal(sig), SlotState::Running)),
        )
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use Command::*;

    const WRITE: u64 = libc::SYS_write as u64;

    #[test]
    fn agreeing_replicas_go_on_without_a_vote_out() {
        assert_eq!(vote_plan(&[0, 1, 2], &[5, 5, 5]), vec![Agree { masked: false }]);
        assert_eq!(vote_plan(&[0], &[5]), vec![Agree { masked: false }]);
    }

    #[test]
    fn tmr_votes_out_the_one_that_differs_and_masks_the_fault() {
        assert_eq!(
            vote_plan(&[0, 1, 2], &[5, 9, 5]),
            vec![VoteOut(1), Agree { masked: true }]
        );
        // The leader (0) too: the member ids are kept, not the positions.
        assert_eq!(
            vote_plan(&[0, 3, 4], &[9, 5, 5]),
            vec![VoteOut(0), Agree { masked: true }]
        );
    }

    #[test]
    fn dmr_and_a_three_way_split_halt() {
        assert_eq!(vote_plan(&[0, 1], &[5, 9]), vec![Halt]);
        assert_eq!(vote_plan(&[0, 1, 2], &[5, 9, 7]), vec![Halt]);
    }

    #[test]
    fn five_replicas_vote_out_a_single_suspect_and_halt_on_two() {
        // Two replicas that differ from the rest and from each other tie as suspects.
        let plan = vote_plan(&[0, 1, 2, 3, 4], &[5, 5, 5, 8, 9]);
        assert_eq!(plan, vec![Halt], "two distinct suspects tie: no single one to vote out");
        let plan = vote_plan(&[0, 1, 2, 3, 4], &[5, 5, 5, 5, 9]);
        assert_eq!(plan, vec![VoteOut(4), Agree { masked: true }]);
    }

    #[test]
    fn an_output_runs_in_the_leader_alone_while_the_followers_wait() {
        let args = [1, 0x1000, 5, 0, 0, 0];
        let plan = execution_plan(Class::Output, WRITE, args, 2, &[0, 1, 2]);
        assert_eq!(
            plan,
            vec![
                Begin(Phase::Leader {
                    nr: WRITE,
                    args,
                    class: Class::Output
                }),
                Resume(2, crate::backend::Resume::ToExit, SlotState::Executing),
            ]
        );
        // Nothing resumes a follower: it never executes an output.
        assert!(plan.iter().all(|c| !matches!(c, Resume(r, ..) if *r != 2)));
    }

    #[test]
    fn a_per_process_call_runs_everywhere_and_exit_group_lets_every_replica_go() {
        let nr = libc::SYS_close as u64;
        let plan = execution_plan(Class::All, nr, [3, 0, 0, 0, 0, 0], 0, &[0, 1]);
        let resumed: Vec<ReplicaId> = plan
            .iter()
            .filter_map(|c| match c {
                Resume(r, crate::backend::Resume::ToExit, SlotState::Executing) => Some(*r),
                _ => None,
            })
            .collect();
        assert_eq!(resumed, vec![0, 1]);
        assert!(plan.contains(&TranslatePids {
            replica: 1,
            nr,
            args: [3, 0, 0, 0, 0, 0]
        }));
        let exit = execution_plan(Class::All, libc::SYS_exit_group as u64, [0; 6], 0, &[0, 1]);
        assert_eq!(exit[0], Exiting);
        assert_eq!(exit.len(), 3);
        assert!(!exit.iter().any(|c| matches!(c, Begin(_))));
    }

    #[test]
    fn the_monitor_answers_or_refuses_without_resuming_anyone() {
        assert_eq!(
            execution_plan(Class::Emulated, libc::SYS_getpid as u64, [0; 6], 0, &[0, 1]),
            vec![Emulate {
                nr: libc::SYS_getpid as u64,
                args: [0; 6]
            }]
        );
        assert_eq!(
            execution_plan(Class::Unsupported, 999, [0; 6], 0, &[0, 1]),
            vec![Refuse { nr: 999 }]
        );
    }

    #[test]
    fn every_replica_gets_the_same_time_stamp_and_steps_over_the_instruction() {
        let regs = |rip| {
            // SAFETY: user_regs_struct is plain integers; all zero is a valid value.
            let mut r: Regs = unsafe { std::mem::zeroed() };
            (r.rip, r.rcx) = (rip, 7);
            r
        };
        let plan = answer_plan(
            &[(0, regs(0x100)), (1, regs(0x100))],
            Answer::Tsc {
                len: 3,
                tsc: 0x1234_5678_9abc_def0,
            },
        );
        assert_eq!(plan.len(), 4);
        for c in &plan {
            if let SetRegs(_, Registers(r)) = c {
                assert_eq!((r.rax, r.rdx, r.rcx, r.rip), (0x9abc_def0, 0x1234_5678, 0, 0x103));
            }
        }
        let plan = answer_plan(&[(1, regs(0x200))], Answer::Cpuid([1, 2, 3, 4]));
        match &plan[0] {
            SetRegs(1, Registers(r)) => assert_eq!((r.rax, r.rbx, r.rcx, r.rdx, r.rip), (1, 2, 3, 4, 0x202)),
            other => panic!("{other:?}"),
        }
        assert_eq!(plan[1], Resume(1, crate::backend::Resume::Run, SlotState::Running));
    }

    fn stopped_at(rip: u64) -> Regs {
        // SAFETY: user_regs_struct is plain integers; all zero is a valid value.
        let mut r: Regs = unsafe { std::mem::zeroed() };
        (r.rip, r.orig_rax, r.rax) = (rip, 0, (-libc::ENOSYS) as u64);
        r
    }

    #[test]
    fn followers_get_the_leaders_results_and_result_and_never_run_the_call() {
        let plan = completion_plan(0, &[(1, stopped_at(0x10)), (2, stopped_at(0x10))], 42, false);
        for f in [1, 2] {
            let at = plan.iter().position(|c| *c == CopyResults(f)).expect("results copied");
            match &plan[at + 1] {
                SetRegs(r, Registers(regs)) => {
                    assert_eq!(*r, f);
                    assert_eq!(
                        (regs.rax, regs.orig_rax, regs.rip),
                        (42, u64::MAX, 0x10),
                        "skipped, with the result"
                    );
                }
                other => panic!("{other:?}"),
            }
            assert_eq!(plan[at + 2], RaiseMirrored(f));
            assert_eq!(plan[at + 3], Resume(f, crate::backend::Resume::Run, SlotState::Running));
        }
        // Nothing lets a follower execute the call: no resume to the call's exit.
        assert!(!plan
            .iter()
            .any(|c| matches!(c, Resume(_, crate::backend::Resume::ToExit, _))));
        assert_eq!(
            plan[plan.len() - 2..],
            [Recollect, Resume(0, crate::backend::Resume::Run, SlotState::Running)]
        );
    }

    #[test]
    fn new_descriptors_are_installed_in_each_follower_with_the_leaders_result() {
        let plan = completion_plan(1, &[(0, stopped_at(0x10))], 5, true);
        assert_eq!(
            plan,
            vec![
                CopyResults(0),
                InstallFds { replica: 0, ret: 5 },
                Recollect,
                Resume(1, crate::backend::Resume::Run, SlotState::Running),
            ]
        );
        // A follower that was not waiting at the call (already gone, or at another input
        // under `--compare io`) gets nothing.
        assert_eq!(
            completion_plan(1, &[], -11, false),
            vec![Recollect, Resume(1, crate::backend::Resume::Run, SlotState::Running)]
        );
    }

    fn returned(rax: i64) -> Regs {
        let mut r = stopped_at(0x20);
        r.rax = rax as u64;
        r
    }

    #[test]
    fn a_call_every_replica_ran_ends_with_the_logical_result_and_a_vote() {
        // A fork: each replica's kernel returned its own child pid; the program sees the
        // leader's. wait4's buffers come from the leader.
        let plan = all_done_plan(
            0,
            &[
                (0, returned(700), 700),
                (1, returned(812), 700),
                (2, returned(913), 700),
            ],
            true,
            true,
        );
        let set = |r, v| SetRegs(r, Registers(returned(v)));
        assert_eq!(
            plan,
            vec![
                FoldResult(0, 700),
                CopyResults(1),
                set(1, 700),
                FoldResult(1, 700),
                CopyResults(2),
                set(2, 700),
                FoldResult(2, 700),
                Agree { masked: false },
                Resume(0, crate::backend::Resume::Run, SlotState::Running),
                RaiseMirrored(1),
                Resume(1, crate::backend::Resume::Run, SlotState::Running),
                RaiseMirrored(2),
                Resume(2, crate::backend::Resume::Run, SlotState::Running),
            ]
        );
    }

    #[test]
    fn a_different_result_of_a_call_everyone_ran_is_voted_out_or_halts() {
        // umask in TMR: replica 1 got another result; it is voted out and never resumed.
        let plan = all_done_plan(
            0,
            &[(0, returned(18), 18), (1, returned(63), 63), (2, returned(18), 18)],
            false,
            false,
        );
        assert_eq!(
            plan,
            vec![
                VoteOut(1),
                Agree { masked: true },
                Resume(0, crate::backend::Resume::Run, SlotState::Running),
                RaiseMirrored(2),
                Resume(2, crate::backend::Resume::Run, SlotState::Running),
            ]
        );
        // In DMR the same difference halts, and nobody goes on.
        let plan = all_done_plan(0, &[(0, returned(18), 18), (1, returned(63), 63)], false, false);
        assert_eq!(plan, vec![Halt]);
    }

    #[test]
    fn a_fault_every_replica_took_is_delivered_in_each() {
        assert_eq!(
            fault_plan(&[0, 2], libc::SIGSEGV),
            vec![
                Exiting,
                Resume(0, crate::backend::Resume::Signal(libc::SIGSEGV), SlotState::Running),
                Resume(2, crate::backend::Resume::Signal(libc::SIGSEGV), SlotState::Running),
            ]
        );
    }
}

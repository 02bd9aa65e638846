//! The monitor's policy driven by hand-written syscall streams (`lockstep_run::scripted`):
//! votes, leader failover, straggler timeouts, TMR→DMR downgrade, re-integration and the
//! monitor's own limits, without ptrace or any process.

use lockstep_core::EventSink;
use lockstep_run::front::Front;
use lockstep_run::scripted::{Call, Scripted, Step};
use lockstep_run::session::{Session, Started};
use lockstep_run::Options;
use std::time::Duration;

/// Main thread ids of replicas 0, 1, 2.
const TIDS: [i32; 3] = [100, 200, 300];
const BUF: u64 = 0x7000_0000;

struct Outcome {
    status: i32,
    events: Vec<serde_json::Value>,
    machine: Scripted,
}

impl Outcome {
    fn kinds(&self) -> Vec<String> {
        self.events
            .iter()
            .map(|e| {
                format!(
                    "{}/{}",
                    e["kind"].as_str().unwrap_or(""),
                    e["action"].as_str().unwrap_or("")
                )
            })
            .collect()
    }

    fn has(&self, kind_action: &str) -> bool {
        self.kinds().iter().any(|k| k == kind_action)
    }

    fn messages(&self) -> String {
        self.events
            .iter()
            .filter_map(|e| e["message"].as_str())
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The threads that ran syscall `nr` in their kernel.
    fn ran(&self, nr: libc::c_long) -> Vec<i32> {
        self.machine
            .executed()
            .into_iter()
            .filter(|&(_, n, _)| n == nr as u64)
            .map(|(t, _, _)| t)
            .collect()
    }
}

fn run_scripts(scripts: Vec<Vec<Step>>, tune: impl FnOnce(&mut Options, &Scripted)) -> Outcome {
    let dir = std::env::temp_dir().join(format!(
        "lockstep-policy-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let events_path = dir.join("events.jsonl");
    let machine = Scripted::default();
    let mut opts = Options {
        replicas: scripts.len() as u32,
        quiet: true,
        timeout: Duration::from_secs(5),
        events: Some(events_path.clone()),
        command: vec!["scripted".into()],
        ..Options::default()
    };
    let started = scripts
        .into_iter()
        .zip(TIDS)
        .map(|(script, tid)| {
            // Every replica starts where a real one is handed to the monitor: at its execve.
            let exec = Step::Call(Call::new(libc::SYS_execve, [0; 6], 0));
            machine.add_thread(tid, std::iter::once(exec).chain(script).collect());
            Started {
                main: tid,
                own_pid: 42,
                cpu: None,
                listener: None,
                stub: 0,
            }
        })
        .collect();
    tune(&mut opts, &machine);
    let events = EventSink::new(opts.events.as_deref(), false).unwrap();
    let session = Session::assemble(opts, Front::none(), Box::new(machine.clone()), started, events)
        .expect("the monitor takes the scripted replicas");
    let status = session.run().expect("the monitor runs to an outcome");
    let events = std::fs::read_to_string(&events_path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON event per line"))
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    Outcome {
        status,
        events,
        machine,
    }
}

/// A program that says something and exits 0; `say` is what this replica's copy says.
fn hello(say: &[u8]) -> Vec<Step> {
    vec![Call::write(1, BUF, say), Call::exit_group(0)]
}

#[test]
fn agreeing_replicas_run_each_output_once_in_the_leader() {
    for n in [2, 3] {
        let o = run_scripts((0..n).map(|_| hello(b"hello\n")).collect(), |_, _| {});
        assert_eq!(o.status, 0, "{:?}", o.kinds());
        assert_eq!(o.ran(libc::SYS_write), vec![TIDS[0]], "only the leader writes");
        assert!(
            !o.has("divergence/vote") && !o.has("divergence/halt"),
            "{:?}",
            o.kinds()
        );
    }
}

#[test]
fn dmr_halts_on_a_divergent_output_before_it_runs() {
    let o = run_scripts(vec![hello(b"hello\n"), hello(b"hellO\n")], |_, _| {});
    assert_eq!(o.status, lockstep_core::exit::DETECTED);
    assert!(o.ran(libc::SYS_write).is_empty(), "no copy of the output ran");
    assert!(o.has("divergence/halt") && o.has("halt/halt"), "{:?}", o.kinds());
    let m = o.messages();
    assert!(m.contains("first difference at byte 4"), "{m}");
}

#[test]
fn tmr_votes_out_a_divergent_follower_and_masks_the_fault() {
    let o = run_scripts(vec![hello(b"hello\n"), hello(b"hello\n"), hello(b"jello\n")], |o, _| {
        o.reintegrate = false
    });
    assert_eq!(o.status, 0, "{}", o.messages());
    assert_eq!(o.ran(libc::SYS_write), vec![TIDS[0]]);
    assert!(
        o.has("divergence/vote") && o.has("vote/kill") && o.has("mask/continue"),
        "{:?}",
        o.kinds()
    );
    assert!(o.machine.gone(TIDS[2]));
    assert!(o.messages().contains("replica 2 diverged"), "{}", o.messages());
    // The divergence is described after the healthy replicas went on, from what each
    // replica arrived with and the victim's memory, and still comes first in the report.
    assert!(o.messages().contains("first difference at byte 0"), "{}", o.messages());
    let kinds = o.kinds();
    let place = |k: &str| kinds.iter().position(|x| x == k);
    assert!(
        place("divergence/vote") < place("vote/kill") && place("vote/kill") < place("mask/continue"),
        "{kinds:?}"
    );
    // Masking latency: the healthy leader goes on before the faulty replica is killed
    // (killing wakes the victim, which could take the monitor's CPU first).
    let actions = o.machine.actions();
    let last = |wanted: &str| actions.iter().rposition(|a| a == wanted);
    let kill = last(&format!("kill {}", TIDS[2])).expect("the faulty replica is killed");
    // The leader's last call that it runs to its exit is the write.
    let write = last(&format!("resume {} ToExit", TIDS[0])).expect("the leader runs its output");
    assert!(write < kill, "{actions:?}");
}

#[test]
fn a_faulty_leader_is_replaced_and_the_new_leader_runs_the_output() {
    let o = run_scripts(vec![hello(b"HELLO\n"), hello(b"hello\n"), hello(b"hello\n")], |o, _| {
        o.reintegrate = false
    });
    assert_eq!(o.status, 0, "{}", o.messages());
    assert_eq!(o.ran(libc::SYS_write), vec![TIDS[1]], "the new leader wrote, once");
    assert!(o.has("leader/elect"), "{:?}", o.kinds());
    assert!(o.messages().contains("replica 1 is the new leader"));
}

#[test]
fn an_input_runs_once_in_the_leader_and_the_followers_get_its_bytes() {
    // Each replica's kernel would give it different bytes; only the leader's reaches them.
    let script = |got: &[u8]| {
        let mut write = Call::new(libc::SYS_write, [1, BUF, 5, 0, 0, 0], 5);
        write.memory.clear();
        vec![Call::read(0, BUF, got), Step::Call(write), Call::exit_group(0)]
    };
    let o = run_scripts(vec![script(b"abcde"), script(b"zzzzz")], |_, _| {});
    assert_eq!(o.status, 0, "{}", o.messages());
    assert_eq!(o.ran(libc::SYS_read), vec![TIDS[0]]);
    assert_eq!(
        o.ran(libc::SYS_write),
        vec![TIDS[0]],
        "the copied bytes agree, so the write ran"
    );
}

#[test]
fn a_straggler_is_voted_out_after_the_timeout() {
    let o = run_scripts(vec![hello(b"hi\n"), hello(b"hi\n"), vec![Step::Hang]], |o, _| {
        o.timeout = Duration::from_millis(150);
        o.reintegrate = false;
    });
    assert_eq!(o.status, 0, "{}", o.messages());
    assert!(o.has("timeout/vote"), "{:?}", o.kinds());
    assert!(o.messages().contains("replica 2 is a straggler"), "{}", o.messages());
    assert_eq!(o.ran(libc::SYS_write), vec![TIDS[0]]);
}

#[test]
fn dmr_halts_when_its_only_follower_straggles() {
    let o = run_scripts(vec![hello(b"hi\n"), vec![Step::Hang]], |o, _| {
        o.timeout = Duration::from_millis(150);
    });
    assert_eq!(o.status, lockstep_core::exit::DETECTED);
    assert!(o.has("timeout/vote") && o.has("halt/halt"), "{:?}", o.kinds());
    assert!(o.ran(libc::SYS_write).is_empty());
}

#[test]
fn tmr_downgrades_to_dmr_and_then_halts_on_a_second_fault() {
    let script = |first: &[u8], second: &[u8]| {
        vec![
            Call::write(1, BUF, first),
            Call::write(1, BUF, second),
            Call::exit_group(0),
        ]
    };
    let o = run_scripts(
        vec![
            script(b"one\n", b"two\n"),
            script(b"one\n", b"twO\n"),
            script(b"onE\n", b"two\n"),
        ],
        |o, _| o.reintegrate = false,
    );
    assert_eq!(o.status, lockstep_core::exit::DETECTED, "{}", o.messages());
    assert_eq!(
        o.ran(libc::SYS_write),
        vec![TIDS[0]],
        "the first output ran, the second did not"
    );
    assert!(o.has("vote/kill") && o.has("divergence/halt"), "{:?}", o.kinds());
}

#[test]
fn a_voted_out_replica_is_replaced_by_a_fork_of_a_healthy_one() {
    let script = |first: &[u8]| {
        vec![
            Call::write(1, BUF, first),
            Call::write(1, BUF, b"two\n"),
            Call::write(1, BUF, b"three\n"),
            Call::exit_group(0),
        ]
    };
    let o = run_scripts(vec![script(b"one\n"), script(b"one\n"), script(b"onE\n")], |_, _| {});
    assert_eq!(o.status, 0, "{}", o.messages());
    assert!(o.has("reintegrate/fork"), "{:?}", o.kinds());
    let forked = o.machine.forked();
    assert_eq!(forked.len(), 1, "one new replica");
    assert_eq!(
        o.ran(libc::SYS_write),
        vec![TIDS[0]; 3],
        "every output ran once, in the leader"
    );
    // The new replica took part to the end: it ran its own exit_group.
    assert!(
        o.ran(libc::SYS_exit_group).contains(&forked[0]),
        "{:?}",
        o.machine.executed()
    );
}

#[test]
fn a_replica_whose_registers_cannot_be_set_fails_and_never_runs_the_output() {
    let o = run_scripts(vec![hello(b"hi\n"), hello(b"hi\n"), hello(b"hi\n")], |o, m| {
        o.reintegrate = false;
        m.break_registers(TIDS[2]);
    });
    assert_eq!(o.status, 0, "{}", o.messages());
    assert_eq!(
        o.ran(libc::SYS_write),
        vec![TIDS[0]],
        "the broken follower did not write"
    );
    assert!(o.messages().contains("could not steer replica 2"), "{}", o.messages());
}

#[test]
fn a_dmr_replica_whose_registers_cannot_be_set_halts_the_run() {
    let o = run_scripts(vec![hello(b"hi\n"), hello(b"hi\n")], |_, m| m.break_registers(TIDS[1]));
    assert_eq!(o.status, lockstep_core::exit::DETECTED, "{}", o.messages());
    assert_eq!(o.ran(libc::SYS_write), vec![TIDS[0]]);
    assert!(o.has("halt/halt"), "{:?}", o.kinds());
}

#[test]
fn a_replica_cannot_make_the_monitor_read_or_hold_more_than_its_limits() {
    use lockstep_run::data::{digest_call, CHUNK, MAX_BUFFER};
    const IOV: u64 = 0x1000;
    // writev(1, iov, 1024) with every iovec claiming 1 GiB: 1 TiB in all.
    let iovecs: Vec<u8> = (0..1024u64)
        .flat_map(|i| [(0x10_0000_0000 + (i << 30)).to_le_bytes(), (1u64 << 30).to_le_bytes()].concat())
        .collect();
    let mut writev = Call::new(libc::SYS_writev, [1, IOV, 1024, 0, 0, 0], 0);
    writev.memory.push((IOV, iovecs));
    // sendmsg(3, msg, 0) whose header claims a 4 GiB name and a 16 EiB control buffer.
    let mut header = vec![0u8; 56];
    header[..8].copy_from_slice(&0x20_0000_0000u64.to_le_bytes());
    header[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
    header[32..40].copy_from_slice(&0x30_0000_0000u64.to_le_bytes());
    header[40..48].copy_from_slice(&u64::MAX.to_le_bytes());
    let mut sendmsg = Call::new(libc::SYS_sendmsg, [3, IOV, 0, 0, 0, 0], 0);
    sendmsg.memory.push((IOV, header));
    for (call, most) in [(writev, MAX_BUFFER + 1024 * 16), (sendmsg, 56 + 4096 + 128)] {
        let machine = Scripted::default();
        let (nr, args) = (call.nr, call.args);
        machine.add_thread(TIDS[0], vec![Step::Call(call)]);
        machine.readable_everywhere(TIDS[0]);
        let mut chunk = Vec::new();
        let desc = lockstep_trace::syscalls::describe(nr);
        let digest = digest_call(&machine, TIDS[0], nr, desc, &args, &mut chunk);
        let read = machine.bytes_read() as usize;
        assert!(
            read <= most,
            "{} read {read} bytes (limit {most})",
            lockstep_trace::syscalls::name(nr)
        );
        assert!(digest.bytes as usize <= most + 64);
        assert!(
            chunk.capacity() <= 2 * CHUNK,
            "the chunk stays small: {}",
            chunk.capacity()
        );
    }
}

#[test]
fn an_output_is_run_by_the_leader_then_skipped_in_the_follower_with_its_result() {
    let o = run_scripts(vec![hello(b"hello\n"), hello(b"hello\n")], |_, _| {});
    assert_eq!(o.status, 0);
    let actions = o.machine.actions();
    let at = |wanted: &str| {
        actions
            .iter()
            .position(|a| a == wanted)
            .unwrap_or_else(|| panic!("no `{wanted}` in {actions:#?}"))
    };
    // The execve every replica runs, then the write: the leader runs it to its exit, and
    // only then is the follower's copy cancelled with the leader's result.
    let leader_runs = at("resume 100 ToExit");
    let leader_write = leader_runs
        + 1
        + actions[leader_runs + 1..]
            .iter()
            .position(|a| a == "resume 100 ToExit")
            .unwrap();
    let follower_skipped = at("skip 200 = 6");
    assert!(leader_write < follower_skipped, "{actions:#?}");
    assert!(actions[follower_skipped..].iter().any(|a| a == "resume 200 Run"));
    assert!(
        !actions[leader_write..follower_skipped]
            .iter()
            .any(|a| a == "resume 200 ToExit" || a == "resume 200 Run"),
        "the follower waits, parked at its write: {actions:#?}"
    );
}

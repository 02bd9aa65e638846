//! A backend that plays hand-written syscall streams, so that the monitor's policy (vote,
//! leader failover, straggler timeout, TMR→DMR downgrade, re-integration) is tested
//! without ptrace and without any process.
//!
//! Each replica's main thread follows a script of [`Step`]s: the calls it makes in order,
//! with the memory its user code prepared for each, what the kernel returns when the call
//! runs in that thread, and what the kernel writes into its memory. The monitor steers
//! these threads as it steers real ones: it lets a call run (`Resume::Run`/`ToExit` at an
//! entry), skips it with a result of its choice (`orig_rax = -1`), rewinds it, kills the
//! thread, or injects a fork (re-integration). Which thread ran which call is recorded in
//! [`Scripted::executed`]: the calls that reached the "kernel", i.e. the outside world.
//!
//! The model is deliberately small: one thread per replica, no signals, no descriptor
//! installs (the policy reports those as unsupported here), and memory as a list of
//! regions the script declared.

use crate::backend::{Action, Backend, Resume};
use lockstep_trace::{Regs, Stop, Tid};
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io;
use std::rc::Rc;

/// One step of a thread's script.
#[derive(Clone, Debug)]
pub enum Step {
    Call(Call),
    /// The thread stops making progress (a straggler): it never stops again by itself.
    Hang,
    /// The thread's user code takes a synchronous fault with this signal.
    Fault(i32),
}

/// A syscall as one replica's thread makes it.
#[derive(Clone, Debug)]
pub struct Call {
    pub nr: u64,
    pub args: [u64; 6],
    /// What the thread's user code wrote before the call (the buffers it passes).
    pub memory: Vec<(u64, Vec<u8>)>,
    /// What the call returns when it runs in this thread.
    pub ret: i64,
    /// What the kernel writes into the thread's memory when the call runs here.
    pub fills: Vec<(u64, Vec<u8>)>,
}

impl Call {
    pub fn new(nr: libc::c_long, args: [u64; 6], ret: i64) -> Self {
        Call {
            nr: nr as u64,
            args,
            memory: Vec::new(),
            ret,
            fills: Vec::new(),
        }
    }

    /// `write(fd, addr, data)`, with `data` prepared at `addr`.
    pub fn write(fd: i32, addr: u64, data: &[u8]) -> Step {
        let mut c = Call::new(
            libc::SYS_write,
            [fd as u64, addr, data.len() as u64, 0, 0, 0],
            data.len() as i64,
        );
        c.memory.push((addr, data.to_vec()));
        Step::Call(c)
    }

    /// `read(fd, addr, data.len())` that, where it runs, receives `data`.
    pub fn read(fd: i32, addr: u64, data: &[u8]) -> Step {
        let len = data.len();
        let mut c = Call::new(libc::SYS_read, [fd as u64, addr, len as u64, 0, 0, 0], len as i64);
        c.memory.push((addr, vec![0; len]));
        c.fills.push((addr, data.to_vec()));
        Step::Call(c)
    }

    pub fn exit_group(code: i32) -> Step {
        Step::Call(Call::new(libc::SYS_exit_group, [code as u64, 0, 0, 0, 0, 0], 0))
    }
}

/// Where a scripted thread is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    /// Stopped at the entry of its current call.
    Entry,
    /// Stopped at the exit of its current call.
    Exit,
    /// Stopped at the fork event of a fork the monitor injected.
    Forked,
    /// Stopped to take a synchronous fault.
    Faulting(i32),
    /// Running and never stopping (a straggler, or past the end of its script).
    Hung,
    Gone,
}

struct Thread {
    regs: Regs,
    /// (address, bytes) regions; an access outside them is EFAULT.
    memory: Vec<(u64, Vec<u8>)>,
    script: Rc<Vec<Step>>,
    at: usize,
    place: Place,
}

/// The address just after the `syscall` instruction of step `i` (where a seccomp stop
/// reports `rip`).
fn rip_of(i: usize) -> u64 {
    0x40_0000 + 16 * i as u64 + 2
}

#[derive(Default)]
struct Machine {
    threads: BTreeMap<Tid, Thread>,
    ready: VecDeque<(Tid, Stop)>,
    event_msgs: HashMap<Tid, u64>,
    next_tid: Tid,
    executed: Vec<(Tid, u64, i64)>,
    bytes_read: u64,
    /// Threads whose reads succeed anywhere (zeros outside their regions).
    readable_everywhere: Vec<Tid>,
    /// Threads whose register writes fail with EIO.
    broken_regs: Vec<Tid>,
    /// Every command the monitor gave, in order (see [`describe`]).
    actions: Vec<String>,
}

/// A command in a short form tests can match: `resume 200 ToExit`, `skip 200 = 6`
/// (registers set to skip the call with that result), `regs 200`, `write 200 0x7000 6`,
/// `kill 300`, ...
fn describe(action: &Action<'_>) -> String {
    match *action {
        Action::SetRegs(t, r) if r.orig_rax == u64::MAX => format!("skip {t} = {}", r.rax as i64),
        Action::SetRegs(t, _) => format!("regs {t}"),
        Action::Write(t, addr, data) => format!("write {t} {addr:#x} {}", data.len()),
        Action::Resume(t, how) => format!("resume {t} {how:?}"),
        Action::Interrupt(t) => format!("interrupt {t}"),
        Action::SetSiginfo(t, _) => format!("siginfo {t}"),
        Action::Signal(_, t, sig) => format!("signal {t} {sig}"),
        Action::Kill(t) => format!("kill {t}"),
        Action::Breakpoint(t, at) => format!("breakpoint {t} {at:?}"),
        Action::SingleStep(t) => format!("single-step {t:?}"),
    }
}

/// The scripted backend. Clones share one machine, so a test keeps a handle to inspect it
/// after the monitor has run.
#[derive(Clone, Default)]
pub struct Scripted {
    machine: Rc<RefCell<Machine>>,
}

fn no_thread() -> io::Error {
    io::Error::from_raw_os_error(libc::ESRCH)
}

fn fault() -> io::Error {
    io::Error::from_raw_os_error(libc::EFAULT)
}

impl Scripted {
    /// Adds a main thread `tid` that follows `script`, stopped at the entry of its first
    /// call (where a real replica is when the monitor takes over).
    pub fn add_thread(&self, tid: Tid, script: Vec<Step>) {
        let mut m = self.machine.borrow_mut();
        m.next_tid = m.next_tid.max(tid + 1000);
        let thread = Thread {
            // SAFETY: all-zero is a valid user_regs_struct.
            regs: unsafe { std::mem::zeroed() },
            memory: Vec::new(),
            script: Rc::new(script),
            at: 0,
            place: Place::Hung,
        };
        m.threads.insert(tid, thread);
        m.arrive(tid, 0);
        // The monitor records the first arrival itself (Session::assemble).
        m.ready.retain(|&(t, _)| t != tid);
    }

    /// The calls that ran in a thread (reached the kernel): (thread, number, result).
    pub fn executed(&self) -> Vec<(Tid, u64, i64)> {
        self.machine.borrow().executed.clone()
    }

    /// Every command the monitor gave, in order.
    pub fn actions(&self) -> Vec<String> {
        self.machine.borrow().actions.clone()
    }

    /// Bytes the monitor has read from the threads' memory so far.
    pub fn bytes_read(&self) -> u64 {
        self.machine.borrow().bytes_read
    }

    /// Reads from `tid` succeed at any address (zeros outside its regions).
    pub fn readable_everywhere(&self, tid: Tid) {
        self.machine.borrow_mut().readable_everywhere.push(tid);
    }

    /// Register writes to `tid` fail (as a broken mechanism would).
    pub fn break_registers(&self, tid: Tid) {
        self.machine.borrow_mut().broken_regs.push(tid);
    }

    /// Whether `tid` is gone (exited or killed).
    pub fn gone(&self, tid: Tid) -> bool {
        self.machine
            .borrow()
            .threads
            .get(&tid)
            .is_none_or(|t| t.place == Place::Gone)
    }

    /// Threads the machine created for injected forks.
    pub fn forked(&self) -> Vec<Tid> {
        let m = self.machine.borrow();
        m.threads.keys().copied().filter(|&t| t >= 10_000).collect()
    }
}

impl Machine {
    fn thread(&mut self, tid: Tid) -> io::Result<&mut Thread> {
        self.threads
            .get_mut(&tid)
            .filter(|t| t.place != Place::Gone)
            .ok_or_else(no_thread)
    }

    /// Thread `tid` reaches step `i`.
    fn arrive(&mut self, tid: Tid, i: usize) {
        let t = self.threads.get_mut(&tid).expect("scripted thread");
        t.at = i;
        match t.script.get(i).cloned() {
            Some(Step::Call(call)) => {
                for (addr, bytes) in &call.memory {
                    store(&mut t.memory, *addr, bytes);
                }
                let r = &mut t.regs;
                r.orig_rax = call.nr;
                r.rax = (-libc::ENOSYS) as u64;
                [r.rdi, r.rsi, r.rdx, r.r10, r.r8, r.r9] = call.args;
                r.rip = rip_of(i);
                t.place = Place::Entry;
                self.ready.push_back((tid, Stop::Seccomp));
            }
            Some(Step::Fault(sig)) => {
                t.regs.rip = rip_of(i);
                t.place = Place::Faulting(sig);
                self.ready.push_back((tid, Stop::Signal(sig)));
            }
            Some(Step::Hang) | None => t.place = Place::Hung,
        }
    }

    fn die(&mut self, tid: Tid, stop: Stop) {
        if let Some(t) = self.threads.get_mut(&tid) {
            t.place = Place::Gone;
        }
        self.ready.retain(|&(t, _)| t != tid);
        self.ready.push_back((tid, stop));
    }

    /// Runs the call `tid` is stopped at in its "kernel".
    fn execute(&mut self, tid: Tid) -> Option<Stop> {
        let t = self.threads.get_mut(&tid).expect("scripted thread");
        let Some(Step::Call(call)) = t.script.get(t.at).cloned() else {
            unreachable!("a thread at an entry is at a call");
        };
        if t.regs.orig_rax == libc::SYS_exit_group as u64 || t.regs.orig_rax == libc::SYS_exit as u64 {
            let code = t.regs.rdi as i32;
            self.executed.push((tid, t.regs.orig_rax, 0));
            return Some(Stop::Exited(code));
        }
        assert_eq!(
            t.regs.orig_rax, call.nr,
            "the monitor ran a call the script does not make"
        );
        for (addr, bytes) in &call.fills {
            store(&mut t.memory, *addr, bytes);
        }
        t.regs.rax = call.ret as u64;
        self.executed.push((tid, call.nr, call.ret));
        None
    }

    /// An injected `clone(CLONE_PARENT | SIGCHLD)`: a copy of the thread, stopped as a
    /// new child is, at the same step.
    fn fork(&mut self, tid: Tid) -> Tid {
        let child = self.next_tid.max(10_000);
        self.next_tid = child + 1;
        let parent = &self.threads[&tid];
        let mut regs = parent.regs;
        regs.rax = 0;
        let copy = Thread {
            regs,
            memory: parent.memory.clone(),
            script: parent.script.clone(),
            at: parent.at,
            place: Place::Exit,
        };
        self.threads.insert(child, copy);
        self.event_msgs.insert(tid, child as u64);
        self.ready.push_back((child, Stop::EventStop(libc::SIGSTOP)));
        child
    }

    fn resume(&mut self, tid: Tid, how: Resume) -> io::Result<()> {
        let t = self.thread(tid)?;
        let (place, at, regs) = (t.place, t.at, t.regs);
        let rewound = regs.rip == rip_of(at) - 2;
        if let Resume::Signal(sig) = how {
            if sig != 0 && !matches!(place, Place::Hung) {
                self.die(tid, Stop::Killed(sig));
                return Ok(());
            }
        }
        match place {
            Place::Hung => return Err(no_thread()), // running: not in a stop
            Place::Gone => unreachable!(),
            Place::Faulting(sig) => self.ready.push_back((tid, Stop::Signal(sig))),
            Place::Forked => {
                let child = self.event_msgs[&tid] as i64;
                let t = self.thread(tid)?;
                t.regs.rax = child as u64;
                t.place = Place::Exit;
                self.ready.push_back((tid, Stop::SyscallExit));
            }
            Place::Exit if rewound => self.arrive(tid, at),
            Place::Exit => self.arrive(tid, at + 1),
            Place::Entry if regs.orig_rax == libc::SYS_clone as u64 => {
                self.fork(tid);
                self.thread(tid)?.place = Place::Forked;
                self.ready.push_back((tid, Stop::Event(libc::PTRACE_EVENT_FORK)));
            }
            Place::Entry => {
                let skipped = regs.orig_rax == u64::MAX;
                if !skipped {
                    if let Some(death) = self.execute(tid) {
                        self.die(tid, death);
                        return Ok(());
                    }
                }
                match how {
                    Resume::ToExit => {
                        self.thread(tid)?.place = Place::Exit;
                        self.ready.push_back((tid, Stop::SyscallExit));
                    }
                    _ if skipped && rewound => self.arrive(tid, at),
                    _ => self.arrive(tid, at + 1),
                }
            }
        }
        Ok(())
    }
}

/// Writes `bytes` at `addr` into the region that holds them, or as a new region.
fn store(memory: &mut Vec<(u64, Vec<u8>)>, addr: u64, bytes: &[u8]) {
    if write_into(memory, addr, bytes).is_err() {
        memory.push((addr, bytes.to_vec()));
    }
}

fn region_of(memory: &[(u64, Vec<u8>)], addr: u64, len: usize) -> Option<(usize, usize)> {
    memory.iter().enumerate().find_map(|(i, (start, bytes))| {
        let off = addr.checked_sub(*start)? as usize;
        (off.checked_add(len)? <= bytes.len()).then_some((i, off))
    })
}

fn write_into(memory: &mut [(u64, Vec<u8>)], addr: u64, bytes: &[u8]) -> io::Result<()> {
    let (i, off) = region_of(memory, addr, bytes.len()).ok_or_else(fault)?;
    memory[i].1[off..off + bytes.len()].copy_from_slice(bytes);
    Ok(())
}

impl Backend for Scripted {
    fn apply(&self, action: Action<'_>) -> io::Result<()> {
        let mut m = self.machine.borrow_mut();
        m.actions.push(describe(&action));
        match action {
            Action::SetRegs(tid, regs) => {
                if m.broken_regs.contains(&tid) {
                    return Err(io::Error::from_raw_os_error(libc::EIO));
                }
                m.thread(tid)?.regs = *regs;
                Ok(())
            }
            Action::Write(tid, addr, data) => write_into(&mut m.thread(tid)?.memory, addr, data),
            Action::Resume(tid, how) => m.resume(tid, how),
            Action::Kill(pid) => {
                if m.thread(pid).is_ok() {
                    m.die(pid, Stop::Killed(libc::SIGKILL));
                }
                Ok(())
            }
            // No signals or breakpoints in this model: the thread only has to exist.
            Action::Interrupt(tid)
            | Action::SetSiginfo(tid, _)
            | Action::Signal(_, tid, _)
            | Action::Breakpoint(tid, _) => m.thread(tid).map(drop),
            Action::SingleStep(_) => Ok(()),
        }
    }
    fn regs(&self, tid: Tid) -> io::Result<Regs> {
        Ok(self.machine.borrow_mut().thread(tid)?.regs)
    }
    fn read(&self, tid: Tid, addr: u64, buf: &mut [u8]) -> io::Result<()> {
        let mut m = self.machine.borrow_mut();
        let everywhere = m.readable_everywhere.contains(&tid);
        let t = m.thread(tid)?;
        match region_of(&t.memory, addr, buf.len()) {
            Some((i, off)) => buf.copy_from_slice(&t.memory[i].1[off..off + buf.len()]),
            None if everywhere => buf.fill(0),
            None => return Err(fault()),
        }
        m.bytes_read += buf.len() as u64;
        Ok(())
    }
    fn wait_any(&self) -> io::Result<Option<(Tid, Stop)>> {
        let next = self.machine.borrow_mut().ready.pop_front();
        if next.is_none() {
            // What the real monitor's tick does: let timeouts be checked.
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        Ok(next)
    }
    fn wait_tid(&self, tid: Tid) -> io::Result<Stop> {
        self.try_wait_tid(tid)?
            .ok_or_else(|| io::Error::new(io::ErrorKind::WouldBlock, format!("scripted thread {tid} has no stop")))
    }
    fn try_wait_tid(&self, tid: Tid) -> io::Result<Option<Stop>> {
        let mut m = self.machine.borrow_mut();
        let pos = m.ready.iter().position(|&(t, _)| t == tid);
        Ok(pos.and_then(|p| m.ready.remove(p)).map(|(_, stop)| stop))
    }
    fn event_msg(&self, tid: Tid) -> io::Result<u64> {
        self.machine
            .borrow()
            .event_msgs
            .get(&tid)
            .copied()
            .ok_or_else(no_thread)
    }
    fn siginfo(&self, _tid: Tid) -> io::Result<libc::siginfo_t> {
        // SAFETY: all-zero is a valid siginfo_t.
        Ok(unsafe { std::mem::zeroed() })
    }
    fn read_cstr(&self, tid: Tid, addr: u64, limit: usize) -> io::Result<Vec<u8>> {
        let mut m = self.machine.borrow_mut();
        let t = m.thread(tid)?;
        let (i, off) = region_of(&t.memory, addr, 1).ok_or_else(fault)?;
        let rest = &t.memory[i].1[off..];
        let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len()).min(limit);
        Ok(rest[..end].to_vec())
    }
    fn proc_read(&self, pid: Tid, file: &str) -> io::Result<String> {
        self.machine.borrow_mut().thread(pid)?;
        let none = "0000000000000000";
        match file {
            "status" => Ok(format!(
                "State:\tt (tracing stop)\nSigPnd:\t{none}\nShdPnd:\t{none}\nSigBlk:\t{none}\nSigIgn:\t{none}\nSigCgt:\t{none}\n"
            )),
            "stat" => Ok(format!("{pid} (scripted) t 1 {pid} {pid}")),
            "statm" => Ok("100 25 0 0 0 0 0".into()),
            _ => Err(io::Error::from_raw_os_error(libc::ENOENT)),
        }
    }
    fn proc_link(&self, _pid: Tid, _file: &str) -> io::Result<std::path::PathBuf> {
        Err(io::Error::from_raw_os_error(libc::ENOENT))
    }
    fn fd_file_len(&self, _pid: Tid, _fd: i32) -> Option<u64> {
        None
    }
    fn has_children(&self, _pid: Tid) -> bool {
        false
    }
    fn process_cpu(&self, pid: Tid) -> Option<std::time::Duration> {
        let m = self.machine.borrow();
        let t = m.threads.get(&pid)?;
        Some(std::time::Duration::from_micros(t.at as u64))
    }
    fn pin(&self, _tid: Tid, _cpu: usize) {}
    fn reap_all(&self) {}
}

//! Making a stopped tracee run syscalls of our choosing: the tracee's next instruction is
//! temporarily a `syscall`, its registers name the call, and two syscall stops later the
//! result is in `rax`. Used by inject's fork server to fork a stopped program and to give
//! the fork its own process group and output files.
//!
//! The thread must be in a ptrace stop outside any syscall (a signal-delivery-stop or a
//! new child's first stop after [`Remote::enter`]), traced with PTRACE_O_TRACESYSGOOD.

use crate::ptrace::{self, Regs, Stop};
use crate::{mem, Tid};
use std::io;

/// `syscall` (0f 05).
const SYSCALL_INSN: [u8; 2] = [0x0f, 0x05];

/// A stopped thread whose instruction at `rip` is a `syscall` until [`Remote::leave`].
pub struct Remote {
    tid: Tid,
    /// The registers to return to, and the address of the patched instruction.
    regs: Regs,
    /// The two bytes the patch replaced.
    saved: [u8; 2],
}

/// What a remote syscall returned, and the child a fork-like call made (its pid from the
/// fork event; the child's own first stop is left for the caller to wait for).
pub struct Returned {
    pub value: i64,
    pub child: Option<Tid>,
}

impl Remote {
    /// Patches a `syscall` instruction in at the stopped thread's `rip`.
    pub fn enter(tid: Tid) -> io::Result<Remote> {
        let mut regs = ptrace::get_regs(tid)?;
        // Not inside a syscall: no restart of an interrupted call on resume.
        regs.orig_rax = u64::MAX;
        let mut saved = [0u8; 2];
        mem::read(tid, regs.rip, &mut saved)?;
        mem::write(tid, regs.rip, &SYSCALL_INSN)?;
        Ok(Remote { tid, regs, saved })
    }

    /// Takes over the copy of the patch in `child`, a fork of this thread's process made
    /// while the patch was in place, stopped: the child returns to the same registers.
    pub fn adopt(&self, child: Tid) -> Remote {
        Remote {
            tid: child,
            regs: self.regs,
            saved: self.saved,
        }
    }

    /// Runs syscall `nr` with `args` and returns its result.
    pub fn call(&self, nr: i64, args: &[u64]) -> io::Result<Returned> {
        let mut regs = self.regs;
        regs.rax = nr as u64;
        let slots = [
            &mut regs.rdi,
            &mut regs.rsi,
            &mut regs.rdx,
            &mut regs.r10,
            &mut regs.r8,
            &mut regs.r9,
        ];
        for (slot, &arg) in slots.into_iter().zip(args) {
            *slot = arg;
        }
        ptrace::set_regs(self.tid, &regs)?;
        ptrace::cont_syscall(self.tid, 0)?;
        self.expect(|stop| matches!(stop, Stop::SyscallExit), "syscall entry")?;
        ptrace::cont_syscall(self.tid, 0)?;
        let mut child = None;
        loop {
            match ptrace::wait_tid(self.tid)? {
                Stop::SyscallExit => break,
                Stop::Event(e)
                    if e == libc::PTRACE_EVENT_FORK
                        || e == libc::PTRACE_EVENT_VFORK
                        || e == libc::PTRACE_EVENT_CLONE =>
                {
                    child = Some(ptrace::event_msg(self.tid)? as Tid);
                    ptrace::cont_syscall(self.tid, 0)?;
                }
                other => return Err(unexpected(other, "syscall exit")),
            }
        }
        let value = ptrace::get_regs(self.tid)?.rax as i64;
        Ok(Returned { value, child })
    }

    /// Like [`Remote::call`], as an io::Result of a non-negative value.
    pub fn call_ok(&self, nr: i64, args: &[u64]) -> io::Result<u64> {
        let r = self.call(nr, args)?.value;
        if r < 0 {
            return Err(io::Error::from_raw_os_error(-r as i32));
        }
        Ok(r as u64)
    }

    /// Writes `data` into the thread's stack well below its red zone, for a call that
    /// takes a pointer; returns the address. Nothing of the program's lives there.
    pub fn scratch(&self, data: &[u8]) -> io::Result<u64> {
        const BELOW_STACK: u64 = 4096;
        let at = (self.regs.rsp - BELOW_STACK - data.len() as u64) & !15;
        mem::write(self.tid, at, data)?;
        Ok(at)
    }

    /// Restores the instruction and the registers; the thread stays stopped.
    pub fn leave(self) -> io::Result<()> {
        mem::write(self.tid, self.regs.rip, &self.saved)?;
        ptrace::set_regs(self.tid, &self.regs)
    }

    fn expect(&self, ok: impl Fn(Stop) -> bool, what: &str) -> io::Result<()> {
        let stop = ptrace::wait_tid(self.tid)?;
        if ok(stop) {
            Ok(())
        } else {
            Err(unexpected(stop, what))
        }
    }
}

fn unexpected(stop: Stop, what: &str) -> io::Error {
    io::Error::other(format!("remote syscall: expected the {what}, got {stop:?}"))
}

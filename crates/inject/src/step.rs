//! Faults that need the target to execute instructions under single-stepping:
//!
//! * `dest` (SEI's WREG/WVAL): let one instruction execute, then flip a bit in what it
//!   wrote, a general-purpose register or a memory location.
//! * `addr` (SEI's WADDR/RADDR): flip a bit in the base or index register of one memory
//!   access for exactly that instruction, then restore the register.
//!
//! Instructions are decoded with iced-x86. The driver (the standalone injector or the run
//! monitor) single-steps the thread and calls [`StepFault::on_stop`] at every stop between
//! two instructions until it reports [`Progress::Done`]. The engine never waits itself, so
//! the run monitor can keep serving the other replicas while one of them is stepped.

use crate::fault::{mask_for, xor_memory, Applied, Model, Rng, Width};
use iced_x86::{
    Decoder, DecoderOptions, Formatter, Instruction, InstructionInfoFactory, IntelFormatter, Mnemonic, OpAccess,
    OpKind, Register,
};
use lockstep_trace::{mem, ptrace, regs, Regs, Tid};
use std::io;

/// How many instructions are stepped looking for one the model can use (one with a
/// destination, or with a memory operand) before the fault is given up.
pub const MAX_SEARCH: u64 = 10_000;

/// Longest x86-64 instruction.
const MAX_INSTRUCTION_LEN: usize = 15;

/// What the driver does next.
#[derive(Debug)]
pub enum Progress {
    /// Single-step the thread once more and call `on_stop` again.
    Step,
    /// The fault is in place; let the thread run freely.
    Done(Applied),
    /// No suitable instruction was found within [`MAX_SEARCH`] steps: no fault.
    GaveUp,
}

enum Choice {
    Fresh { model: Model, width: Width, rng: Rng },
    Replay(Applied),
}

/// The second half of an armed fault, done after the chosen instruction executed.
enum Pending {
    /// Flip these bits of a register the instruction wrote.
    DestRegister { name: &'static str, mask: u64 },
    /// Flip these bits at an address the instruction wrote.
    DestMemory { addr: u64, len: usize, mask: u64 },
    /// Undo the flip of an address register.
    RestoreRegister { name: &'static str, mask: u64 },
}

/// A `dest` or `addr` fault in progress on one thread.
pub struct StepFault {
    choice: Choice,
    /// Stops seen so far (the chosen instruction is the one at stop `steps`).
    steps: u64,
    armed: Option<(Pending, Applied)>,
    decoder_info: InstructionInfoFactory,
}

impl StepFault {
    pub fn fresh(model: Model, width: Width, rng: Rng) -> Self {
        assert!(model.needs_steps(), "{model:?} is applied at a stop, not by stepping");
        Self::new(Choice::Fresh { model, width, rng })
    }

    /// Re-applies a recorded fault: same number of steps, same target, same bits.
    pub fn replay(applied: Applied) -> Self {
        assert!(applied.model.needs_steps() && applied.steps.is_some());
        Self::new(Choice::Replay(applied))
    }

    fn new(choice: Choice) -> Self {
        StepFault {
            choice,
            steps: 0,
            armed: None,
            decoder_info: InstructionInfoFactory::new(),
        }
    }

    /// Called whenever `tid` is stopped between two instructions (the first call at the
    /// injection point, then after every single-step).
    pub fn on_stop(&mut self, tid: Tid) -> io::Result<Progress> {
        let mut r = ptrace::get_regs(tid)?;
        if let Some((pending, mut applied)) = self.armed.take() {
            finish(tid, &mut r, pending, &mut applied)?;
            return Ok(Progress::Done(applied));
        }
        let step = self.steps;
        self.steps += 1;
        if let Choice::Replay(applied) = &self.choice {
            if Some(step) != applied.steps {
                return Ok(Progress::Step);
            }
        } else if step >= MAX_SEARCH {
            return Ok(Progress::GaveUp);
        }
        let Some(instr) = decode_at(tid, r.rip) else {
            return Ok(Progress::Step);
        };
        if matches!(
            instr.mnemonic(),
            Mnemonic::Syscall | Mnemonic::Int | Mnemonic::Int3 | Mnemonic::Int1 | Mnemonic::Into
        ) {
            // Stepping over a syscall hands control to the kernel (and the run monitor);
            // the fault goes on a later instruction.
            return Ok(Progress::Step);
        }
        let armed = match &mut self.choice {
            Choice::Fresh { model, width, rng } => {
                let info = self.decoder_info.info(&instr);
                match model {
                    Model::Dest => arm_dest(tid, info, &r, *width, rng)?,
                    Model::Addr => arm_addr(&instr, info, &r, *width, rng),
                    _ => unreachable!("checked in fresh()"),
                }
            }
            Choice::Replay(applied) => Some(rearm(applied)?),
        };
        let Some((pending, mut applied)) = armed else {
            return Ok(Progress::Step);
        };
        applied.ip = Some(r.rip);
        applied.steps = Some(step);
        applied.instruction = Some(disassemble(&instr));
        if let Pending::RestoreRegister { name, mask } = pending {
            let reg = regs::by_name(&mut r, name).expect("general-purpose register");
            applied.old = *reg;
            *reg ^= mask;
            applied.new = *reg;
            ptrace::set_regs(tid, &r)?;
        }
        self.armed = Some((pending, applied));
        Ok(Progress::Step)
    }
}

impl StepFault {
    /// Called instead of [`StepFault::on_stop`] when the step stopped at a signal rather
    /// than after the instruction: an armed instruction faulted, typically because its
    /// address was corrupted. The fault counts as applied; an address register is restored
    /// so that a handler that retries the instruction sees a transient fault.
    pub fn on_signal(&mut self, tid: Tid) -> io::Result<Option<Applied>> {
        let Some((pending, applied)) = self.armed.take() else {
            return Ok(None);
        };
        if let Pending::RestoreRegister { name, mask } = pending {
            let mut r = ptrace::get_regs(tid)?;
            *regs::by_name(&mut r, name).expect("general-purpose register") ^= mask;
            ptrace::set_regs(tid, &r)?;
        }
        Ok(Some(applied))
    }
}

impl Model {
    /// True for the models applied by single-stepping (see [`StepFault`]).
    pub fn needs_steps(self) -> bool {
        matches!(self, Model::Dest | Model::Addr)
    }
}

fn decode_at(tid: Tid, rip: u64) -> Option<Instruction> {
    let mut bytes = [0u8; MAX_INSTRUCTION_LEN];
    // The instruction may end just before an unmapped page: try shorter reads.
    let len = (1..=MAX_INSTRUCTION_LEN)
        .rev()
        .find(|&n| mem::read(tid, rip, &mut bytes[..n]).is_ok())?;
    let mut decoder = Decoder::with_ip(64, &bytes[..len], rip, DecoderOptions::NONE);
    let instr = decoder.decode();
    (!instr.is_invalid()).then_some(instr)
}

fn disassemble(instr: &Instruction) -> String {
    let mut text = String::new();
    IntelFormatter::new().format(instr, &mut text);
    text
}

fn writes(access: OpAccess) -> bool {
    matches!(
        access,
        OpAccess::Write | OpAccess::CondWrite | OpAccess::ReadWrite | OpAccess::ReadCondWrite
    )
}

/// The lockstep name of a 64-bit general-purpose register, and the bit offset of `reg`
/// inside it (8 for AH..DH).
fn gpr(reg: Register) -> Option<(&'static str, u32)> {
    if !reg.is_gpr() {
        return None;
    }
    let offset = if matches!(reg, Register::AH | Register::BH | Register::CH | Register::DH) {
        8
    } else {
        0
    };
    let name = match reg.full_register() {
        Register::RAX => "rax",
        Register::RBX => "rbx",
        Register::RCX => "rcx",
        Register::RDX => "rdx",
        Register::RSI => "rsi",
        Register::RDI => "rdi",
        Register::RBP => "rbp",
        Register::RSP => "rsp",
        Register::R8 => "r8",
        Register::R9 => "r9",
        Register::R10 => "r10",
        Register::R11 => "r11",
        Register::R12 => "r12",
        Register::R13 => "r13",
        Register::R14 => "r14",
        Register::R15 => "r15",
        _ => return None,
    };
    Some((name, offset))
}

fn register_value(r: &Regs, reg: Register) -> Option<u64> {
    match reg {
        Register::FS => Some(r.fs_base),
        Register::GS => Some(r.gs_base),
        Register::ES | Register::CS | Register::SS | Register::DS => Some(0),
        Register::RIP => Some(r.rip),
        _ => {
            let (name, offset) = gpr(reg)?;
            let mut copy = *r;
            let full = *regs::by_name(&mut copy, name)?;
            let bits = reg.size() as u32 * 8;
            let value = full >> offset;
            Some(if bits >= 64 {
                value
            } else {
                value & ((1u64 << bits) - 1)
            })
        }
    }
}

/// Chooses a destination of `instr` (a written general-purpose register or written
/// memory) and the bits to flip in it once it has executed. None: nothing to corrupt.
fn arm_dest(
    tid: Tid,
    info: &iced_x86::InstructionInfo,
    r: &Regs,
    width: Width,
    rng: &mut Rng,
) -> io::Result<Option<(Pending, Applied)>> {
    enum Dest {
        Reg(Register),
        Mem { addr: u64, size: usize },
    }
    let mut dests: Vec<Dest> = info
        .used_registers()
        .iter()
        .filter(|u| writes(u.access()) && gpr(u.register()).is_some())
        .map(|u| Dest::Reg(u.register()))
        .collect();
    for m in info.used_memory() {
        if writes(m.access()) {
            if let Some(addr) = m.virtual_address(0, |reg, _, _| register_value(r, reg)) {
                dests.push(Dest::Mem {
                    addr,
                    size: m.memory_size().size(),
                });
            }
        }
    }
    if dests.is_empty() {
        return Ok(None);
    }
    let mut applied = Applied::new(Model::Dest);
    let pending = match dests.swap_remove(rng.below(dests.len() as u64) as usize) {
        Dest::Reg(reg) => {
            let (name, offset) = gpr(reg).expect("filtered");
            let bits = (reg.size() as u32 * 8).min(64);
            let old = register_value(r, reg).unwrap_or(0);
            let mask = mask_for(width, bits, rng, old) << offset;
            applied.register = Some(name.to_string());
            applied.mask = mask;
            Pending::DestRegister { name, mask }
        }
        Dest::Mem { addr, size } => {
            // At most one word of a wider store is corrupted.
            let size = size.clamp(1, 8);
            let mut bytes = [0u8; 8];
            mem::read(tid, addr, &mut bytes[..size])?;
            let mask = mask_for(width, size as u32 * 8, rng, u64::from_le_bytes(bytes));
            applied.address = Some(addr);
            applied.mask = mask;
            Pending::DestMemory { addr, len: size, mask }
        }
    };
    Ok(Some((pending, applied)))
}

/// Chooses an address register (base or index) of one memory access of `instr` that the
/// instruction does not otherwise read or write, so that flipping it for this one
/// instruction corrupts only the address. None: no such access.
fn arm_addr(
    instr: &Instruction,
    info: &iced_x86::InstructionInfo,
    r: &Regs,
    width: Width,
    rng: &mut Rng,
) -> Option<(Pending, Applied)> {
    let used_otherwise = |reg: Register| {
        let full = reg.full_register();
        info.used_registers()
            .iter()
            .any(|u| u.register().full_register() == full && writes(u.access()))
            || (0..instr.op_count())
                .any(|i| instr.op_kind(i) == OpKind::Register && instr.op_register(i).full_register() == full)
    };
    let mut candidates: Vec<(Register, u64)> = Vec::new();
    for m in info.used_memory() {
        if matches!(m.access(), OpAccess::NoMemAccess | OpAccess::None) {
            continue;
        }
        let Some(ea) = m.virtual_address(0, |reg, _, _| register_value(r, reg)) else {
            continue;
        };
        for reg in [m.base(), m.index()] {
            if reg.is_gpr64() && gpr(reg).is_some() && !used_otherwise(reg) {
                candidates.push((reg, ea));
            }
        }
    }
    if candidates.is_empty() {
        return None;
    }
    let (reg, ea) = candidates[rng.below(candidates.len() as u64) as usize];
    let (name, _) = gpr(reg).expect("filtered");
    let mask = mask_for(width, 64, rng, register_value(r, reg).unwrap_or(0));
    let mut applied = Applied::new(Model::Addr);
    applied.register = Some(name.to_string());
    applied.address = Some(ea);
    applied.mask = mask;
    Some((Pending::RestoreRegister { name, mask }, applied))
}

/// The pending half of a recorded fault.
fn rearm(recorded: &Applied) -> io::Result<(Pending, Applied)> {
    let bad = || {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "record does not describe a dest/addr fault",
        )
    };
    let name = |n: &str| {
        regs::NAMES
            .iter()
            .copied()
            .find(|&k| k == n && k != "rip")
            .ok_or_else(bad)
    };
    let pending = match (recorded.model, &recorded.register, recorded.address) {
        (Model::Dest, Some(reg), _) => Pending::DestRegister {
            name: name(reg)?,
            mask: recorded.mask,
        },
        (Model::Dest, None, Some(addr)) => Pending::DestMemory {
            addr,
            len: 0,
            mask: recorded.mask,
        },
        (Model::Addr, Some(reg), _) => Pending::RestoreRegister {
            name: name(reg)?,
            mask: recorded.mask,
        },
        _ => return Err(bad()),
    };
    let mut applied = recorded.clone();
    (applied.old, applied.new) = (0, 0);
    Ok((pending, applied))
}

/// Completes an armed fault after its instruction executed.
fn finish(tid: Tid, r: &mut Regs, pending: Pending, applied: &mut Applied) -> io::Result<()> {
    match pending {
        Pending::DestRegister { name, mask } | Pending::RestoreRegister { name, mask } => {
            let reg = regs::by_name(r, name).expect("general-purpose register");
            if matches!(pending, Pending::DestRegister { .. }) {
                applied.old = *reg;
                *reg ^= mask;
                applied.new = *reg;
            } else {
                *reg ^= mask;
            }
            ptrace::set_regs(tid, r)
        }
        Pending::DestMemory { addr, len, mask } => {
            (applied.old, applied.new) = xor_memory(tid, addr, len, mask)?;
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(bytes: &[u8]) -> Instruction {
        Decoder::with_ip(64, bytes, 0x1000, DecoderOptions::NONE).decode()
    }

    fn regs_with(rsi: u64) -> Regs {
        // SAFETY: user_regs_struct is plain integers.
        let mut r: Regs = unsafe { std::mem::zeroed() };
        r.rsi = rsi;
        r
    }

    #[test]
    fn addr_picks_an_address_register_the_instruction_does_not_otherwise_use() {
        let mut factory = InstructionInfoFactory::new();
        let r = regs_with(0x5000);
        // mov r8, [rsi+8]: rsi is only an address register.
        let load = decode(&[0x4c, 0x8b, 0x46, 0x08]);
        let (pending, applied) = arm_addr(&load, factory.info(&load), &r, Width::One, &mut Rng::new(1)).expect("rsi");
        assert!(matches!(pending, Pending::RestoreRegister { name: "rsi", .. }));
        assert_eq!(applied.address, Some(0x5008));
        // mov rsi, [rsi+8] writes its own base: no candidate.
        let own = decode(&[0x48, 0x8b, 0x76, 0x08]);
        assert!(arm_addr(&own, factory.info(&own), &r, Width::One, &mut Rng::new(1)).is_none());
        // mov rdx, [rip+0x10]: no general-purpose address register.
        let riprel = decode(&[0x48, 0x8b, 0x15, 0x10, 0, 0, 0]);
        assert!(arm_addr(&riprel, factory.info(&riprel), &r, Width::One, &mut Rng::new(1)).is_none());
    }
}

//! Named access to general-purpose registers.

use crate::Regs;

pub const NAMES: [&str; 17] = [
    "rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "rsp", "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15", "rip",
];

/// A mutable reference to the register called `name`, if there is one.
pub fn by_name<'a>(regs: &'a mut Regs, name: &str) -> Option<&'a mut u64> {
    Some(match name {
        "rax" => &mut regs.rax,
        "rbx" => &mut regs.rbx,
        "rcx" => &mut regs.rcx,
        "rdx" => &mut regs.rdx,
        "rsi" => &mut regs.rsi,
        "rdi" => &mut regs.rdi,
        "rbp" => &mut regs.rbp,
        "rsp" => &mut regs.rsp,
        "r8" => &mut regs.r8,
        "r9" => &mut regs.r9,
        "r10" => &mut regs.r10,
        "r11" => &mut regs.r11,
        "r12" => &mut regs.r12,
        "r13" => &mut regs.r13,
        "r14" => &mut regs.r14,
        "r15" => &mut regs.r15,
        "rip" => &mut regs.rip,
        _ => return None,
    })
}

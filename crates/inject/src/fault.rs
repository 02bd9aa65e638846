//! Fault models and how one fault is applied to a stopped thread. This is the engine both
//! the standalone injector and (later) the run monitor drive; it only needs a stopped,
//! traced thread.

use lockstep_trace::{mem, ptrace, regs, Tid};
use serde::{Deserialize, Serialize};
use std::io;

/// Where a fault goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Model {
    /// A general-purpose register (RREG).
    Reg,
    /// A byte of writable memory the process has in RAM (RVAL): each resident page weighs
    /// the same, pages it never touched weigh nothing (by size when none is resident).
    Mem,
    /// The instruction pointer (CF).
    Ip,
    /// A byte of a code page of the program (or of its libraries with `libs`).
    Text,
    /// What one instruction wrote, a register or memory (WREG/WVAL); see [`crate::step`].
    Dest,
    /// The effective address of one memory access (WADDR/RADDR); see [`crate::step`].
    Addr,
    /// Each run draws one of reg, dest, addr, mem and ip.
    Mixed,
    /// Nothing changes: the victim is stopped at the point and let go. A campaign of these
    /// measures the harness itself (every run must be masked).
    None,
}

impl Model {
    /// The models `mixed` draws from.
    pub const MIXED: [Model; 5] = [Model::Reg, Model::Dest, Model::Addr, Model::Mem, Model::Ip];

    /// The concrete model of one run: `mixed` draws one with `rng`.
    pub fn resolve(self, rng: &mut Rng) -> Model {
        match self {
            Model::Mixed => Self::MIXED[rng.below(Self::MIXED.len() as u64) as usize],
            m => m,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Model::Reg => "reg",
            Model::Mem => "mem",
            Model::Ip => "ip",
            Model::Text => "text",
            Model::Dest => "dest",
            Model::Addr => "addr",
            Model::Mixed => "mixed",
            Model::None => "none",
        }
    }
}

impl std::str::FromStr for Model {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "reg" => Ok(Model::Reg),
            "mem" => Ok(Model::Mem),
            "ip" => Ok(Model::Ip),
            "text" => Ok(Model::Text),
            "dest" => Ok(Model::Dest),
            "addr" => Ok(Model::Addr),
            "mixed" => Ok(Model::Mixed),
            "none" => Ok(Model::None),
            _ => Err(format!(
                "unknown fault model '{s}' (expected reg, dest, addr, mem, ip, text, mixed or none)"
            )),
        }
    }
}

/// How many bits change.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Width {
    /// One bit.
    One,
    /// Two adjacent bits.
    Two,
    /// A random word replaces the value.
    Word,
}

impl std::str::FromStr for Width {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "1" => Ok(Width::One),
            "2" => Ok(Width::Two),
            "word" => Ok(Width::Word),
            _ => Err(format!("bad --bits '{s}' (expected 1, 2 or word)")),
        }
    }
}

/// Memory regions for `mem` faults.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Region {
    Heap,
    Stack,
    Data,
    Anon,
    All,
}

impl std::str::FromStr for Region {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "heap" => Ok(Region::Heap),
            "stack" => Ok(Region::Stack),
            "data" => Ok(Region::Data),
            "anon" => Ok(Region::Anon),
            "all" => Ok(Region::All),
            _ => Err(format!("bad --region '{s}' (expected heap, stack, data, anon or all)")),
        }
    }
}

/// One generator per injection run (SplitMix64), so that a run's choices depend only on
/// the campaign seed and the run's number.
pub use lockstep_core::rng::Rng;

/// What was changed, recorded so that the injection can be replayed and reported.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Applied {
    pub model: Model,
    /// Register name for reg/ip faults.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub register: Option<String>,
    /// Address for mem/text/dest faults (the first byte the mask covers), or the
    /// uncorrupted effective address for addr faults.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub address: Option<u64>,
    /// Bits that changed (XOR mask; little-endian over the bytes at `address`).
    pub mask: u64,
    pub old: u64,
    pub new: u64,
    /// dest/addr: where the chosen instruction is...
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub ip: Option<u64>,
    /// ...how many single-steps after the injection point it was reached...
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub steps: Option<u64>,
    /// ...and what it is.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub instruction: Option<String>,
    /// The name of the victim's process (time-based points choose among the tree).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub process: Option<String>,
    /// Server mode, a time-based point in the server's main thread: how many syscalls it
    /// had entered since its exec. `--replay` faults it after that syscall returns
    /// (`--at syscall:K`), the same place relative to the requests it served.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub syscalls: Option<u64>,
}

impl Applied {
    /// A flip of `mask` in a named register or in the byte(s) at `address`, for
    /// [`reapply`]: how deterministic test faults (`lockstep run --test-flip`) go in
    /// through the same engine as recorded ones.
    pub fn flip(model: Model, register: Option<String>, address: Option<u64>, mask: u64) -> Applied {
        Applied {
            register,
            address,
            mask,
            ..Applied::new(model)
        }
    }

    /// A record of `model` that has changed nothing yet.
    pub fn new(model: Model) -> Self {
        Applied {
            model,
            register: None,
            address: None,
            mask: 0,
            old: 0,
            new: 0,
            ip: None,
            steps: None,
            instruction: None,
            process: None,
            syscalls: None,
        }
    }
}

/// XORs `mask` into the `len` bytes at `addr` (at least as many as the mask covers,
/// little-endian, at most 8) and returns their old and new values.
pub fn xor_memory(tid: Tid, addr: u64, len: usize, mask: u64) -> io::Result<(u64, u64)> {
    let len = len.max((64 - mask.leading_zeros()).div_ceil(8) as usize).clamp(1, 8);
    let mut bytes = [0u8; 8];
    mem::read(tid, addr, &mut bytes[..len])?;
    let old = u64::from_le_bytes(bytes);
    let new = old ^ mask;
    mem::write(tid, addr, &new.to_le_bytes()[..len])?;
    Ok((old, new))
}

pub(crate) fn mask_for(width: Width, bits: u32, rng: &mut Rng, old: u64) -> u64 {
    match width {
        Width::One => 1u64 << rng.below(bits as u64),
        Width::Two => 3u64 << rng.below(bits as u64 - 1),
        Width::Word => {
            let all = if bits == 64 { u64::MAX } else { (1u64 << bits) - 1 };
            // A random value that differs from the old one.
            let new = rng.next_u64() & all;
            let m = (new ^ old) & all;
            if m == 0 {
                1
            } else {
                m
            }
        }
    }
}

/// A writable or executable mapping of the target.
#[derive(Clone, Debug)]
struct Mapping {
    start: u64,
    end: u64,
}

fn mappings(pid: Tid, want: impl Fn(&str, &str) -> bool) -> io::Result<Vec<Mapping>> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
    let mut out = Vec::new();
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (Some(range), Some(perms)) = (f.next(), f.next()) else {
            continue;
        };
        let path = f.nth(3).unwrap_or("").to_string();
        let Some((a, b)) = range.split_once('-') else { continue };
        let (Ok(start), Ok(end)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) else {
            continue;
        };
        if want(perms, &path) && path != "[vvar]" && path != "[vdso]" && path != "[vsyscall]" {
            out.push(Mapping { start, end });
        }
    }
    Ok(out)
}

fn pick_byte(maps: &[Mapping], rng: &mut Rng) -> Option<u64> {
    let total: u64 = maps.iter().map(|m| m.end - m.start).sum();
    if total == 0 {
        return None;
    }
    let mut at = rng.below(total);
    for m in maps {
        let len = m.end - m.start;
        if at < len {
            return Some(m.start + at);
        }
        at -= len;
    }
    None
}

/// The page size of every target (x86-64).
const PAGE: u64 = 4096;
/// Pagemap entries read at once.
const PAGEMAP_CHUNK: usize = 512;

/// Calls `visit` with the address of each page of `m` that is in RAM (pagemap's present
/// bit), in order.
fn each_resident_page(pagemap: &std::fs::File, m: &Mapping, visit: &mut dyn FnMut(u64)) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    const PRESENT: u64 = 1 << 63;
    let mut entries = [0u8; PAGEMAP_CHUNK * 8];
    let mut page = m.start / PAGE;
    let end = m.end.div_ceil(PAGE);
    while page < end {
        let n = ((end - page) as usize).min(PAGEMAP_CHUNK);
        let got = pagemap.read_at(&mut entries[..n * 8], page * 8)? / 8;
        if got == 0 {
            return Ok(()); // the mapping went away meanwhile
        }
        for (i, entry) in entries[..got * 8].chunks_exact(8).enumerate() {
            let word = u64::from_le_bytes(entry.try_into().expect("8 bytes"));
            if word & PRESENT != 0 {
                visit((page + i as u64) * PAGE);
            }
        }
        page += got as u64;
    }
    Ok(())
}

/// A byte of a resident page of `maps`, every resident page equally likely (one pass over
/// pagemap, reservoir sampling). A memory fault hits memory the process holds in RAM, not
/// address space it reserved and never touched: weighted by mapping size, a large sparse
/// mapping (`lockstep run`'s ring, a reserved heap arena) took most faults, which then
/// landed in bytes nothing reads. None when no page is resident.
fn pick_resident_byte(pid: Tid, maps: &[Mapping], rng: &mut Rng) -> io::Result<Option<u64>> {
    let pagemap = std::fs::File::open(format!("/proc/{pid}/pagemap"))?;
    let (mut seen, mut chosen) = (0u64, None);
    for m in maps {
        each_resident_page(&pagemap, m, &mut |page| {
            seen += 1;
            if rng.below(seen) == 0 {
                chosen = Some(page);
            }
        })?;
    }
    Ok(chosen.map(|page| page + rng.below(PAGE)))
}

/// Options that shape where a fault goes.
#[derive(Clone, Debug)]
pub struct Scope {
    pub region: Region,
    pub libs: bool,
    /// Time-based points: only threads of processes with this name (comm) are victims.
    pub pid_filter: Option<String>,
}

/// Applies one fault of `model` to the stopped thread `tid` of process `pid`. The models
/// that need single-stepping (dest, addr) go through [`crate::step::StepFault`] instead.
pub fn apply(pid: Tid, tid: Tid, model: Model, width: Width, scope: &Scope, rng: &mut Rng) -> io::Result<Applied> {
    assert!(
        !model.needs_steps() && model != Model::Mixed,
        "{model:?} is not applied at a stop"
    );
    let mut applied = Applied::new(model);
    match model {
        Model::None => Ok(applied),
        Model::Reg | Model::Ip => {
            let mut r = ptrace::get_regs(tid)?;
            // rsp is left out of RREG: flipping it almost always crashes at once, which
            // says little about the program (as in SEI's register model).
            const CANDIDATES: [&str; 15] = [
                "rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15",
            ];
            let name = if model == Model::Ip {
                "rip"
            } else {
                CANDIDATES[rng.below(CANDIDATES.len() as u64) as usize]
            };
            let reg = regs::by_name(&mut r, name).expect("known register");
            let old = *reg;
            let mask = mask_for(width, 64, rng, old);
            *reg ^= mask;
            let new = *reg;
            ptrace::set_regs(tid, &r)?;
            applied.register = Some(name.to_string());
            (applied.mask, applied.old, applied.new) = (mask, old, new);
            Ok(applied)
        }
        Model::Mem | Model::Text => {
            let exe = std::fs::read_link(format!("/proc/{pid}/exe"))
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_default();
            let maps = if model == Model::Text {
                mappings(pid, |perms, path| {
                    perms.starts_with("r-x") && (path == exe || (scope.libs && path.starts_with('/')))
                })?
            } else {
                mappings(pid, |perms, path| {
                    perms.starts_with("rw")
                        && match scope.region {
                            Region::Heap => path == "[heap]",
                            Region::Stack => path == "[stack]",
                            Region::Data => path.starts_with('/'),
                            Region::Anon => path.is_empty(),
                            Region::All => true,
                        }
                })?
            };
            // A region with no page in RAM yet (a program at its first call, before it
            // touched its data) is chosen in by size: its pages come from the file.
            let addr = match model {
                Model::Mem => pick_resident_byte(pid, &maps, rng)?.or_else(|| pick_byte(&maps, rng)),
                _ => pick_byte(&maps, rng),
            }
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no memory of the requested kind"))?;
            let mut b = [0u8];
            mem::read(tid, addr, &mut b)?;
            applied.mask = mask_for(width, 8, rng, b[0] as u64);
            applied.address = Some(addr);
            (applied.old, applied.new) = xor_memory(tid, addr, 1, applied.mask)?;
            Ok(applied)
        }
        Model::Dest | Model::Addr | Model::Mixed => unreachable!("asserted above"),
    }
}

/// Re-applies a recorded fault exactly (for `--replay`).
pub fn reapply(tid: Tid, applied: &Applied) -> io::Result<()> {
    if applied.model == Model::None {
        return Ok(());
    }
    match (&applied.register, applied.address) {
        (Some(name), _) => {
            let mut r = ptrace::get_regs(tid)?;
            let reg = regs::by_name(&mut r, name)
                .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "unknown register"))?;
            *reg ^= applied.mask;
            ptrace::set_regs(tid, &r)
        }
        (None, Some(addr)) => xor_memory(tid, addr, 1, applied.mask).map(drop),
        (None, None) => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "record names no register or address",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_faults_land_in_resident_pages_only() {
        const LEN: usize = 64 << 20;
        // SAFETY: a fresh private anonymous mapping, unmapped below; nothing else uses it.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        let touched = [3usize, 9_000];
        for page in touched {
            // SAFETY: inside the mapping made above.
            unsafe { *(base as *mut u8).add(page * PAGE as usize) = 1 };
        }
        let start = base as u64;
        let maps = [Mapping {
            start,
            end: start + LEN as u64,
        }];
        let mut rng = Rng::new(11);
        let mut hits = [0u32; 2];
        for _ in 0..200 {
            let addr = pick_resident_byte(std::process::id() as Tid, &maps, &mut rng)
                .expect("pagemap")
                .expect("two resident pages");
            let page = ((addr - start) / PAGE) as usize;
            let which = touched.iter().position(|&t| t == page);
            assert!(which.is_some(), "page {page} was never touched");
            hits[which.unwrap()] += 1;
        }
        // By size, 200 picks of 16,384 pages would almost never hit the two touched ones.
        assert!(hits.iter().all(|&h| h > 50), "{hits:?}");
        // SAFETY: the mapping made above, no longer used.
        unsafe { libc::munmap(base, LEN) };
    }

    #[test]
    fn masks_have_the_requested_width() {
        let mut rng = Rng::new(7);
        for _ in 0..1000 {
            assert_eq!(mask_for(Width::One, 64, &mut rng, 0).count_ones(), 1);
            let two = mask_for(Width::Two, 8, &mut rng, 0);
            assert_eq!(two.count_ones(), 2);
            assert!(two < 256 && (two & (two >> 1)) != 0, "adjacent bits: {two:b}");
            assert_ne!(mask_for(Width::Word, 8, &mut rng, 0x5a), 0);
        }
    }

    #[test]
    fn generator_is_deterministic() {
        let a: Vec<u64> = (0..5)
            .map({
                let mut r = Rng::new(42);
                move |_| r.next_u64()
            })
            .collect();
        let mut r = Rng::new(42);
        assert_eq!(a, (0..5).map(|_| r.next_u64()).collect::<Vec<_>>());
    }
}

/// A fault for one replica of a `lockstep run` group, handed to the run monitor in the
/// `LOCKSTEP_INJECT` environment variable (JSON). The monitor applies it with [`apply`]
/// and writes the resulting [`Applied`] as JSON to `record`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ReplicaFault {
    pub model: Model,
    pub width: Width,
    pub region: Region,
    pub libs: bool,
    pub replica: ReplicaChoice,
    /// Inject at this intercepted syscall stop of the replica's main thread (1-based)...
    pub at_stop: Option<u64>,
    /// ...or once the replica has used this much CPU time (microseconds): at its next
    /// syscall stop or where the monitor interrupts it, whichever comes first.
    pub after_us: Option<u64>,
    pub seed: u64,
    pub record: std::path::PathBuf,
    /// With `at_stop`: single-steps after that syscall returns before the fault goes in
    /// (`--at syscall:K+steps:D`).
    #[serde(default)]
    pub steps: u64,
    /// Re-apply this record exactly instead of drawing a fresh fault (`--replay`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay: Option<Applied>,
    /// Monitor-side state: the replica was interrupted for this fault.
    #[serde(skip)]
    pub interrupted: bool,
}

/// Which replica of a group is faulted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReplicaChoice {
    Leader,
    Follower,
    Any,
}

impl std::str::FromStr for ReplicaChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "leader" => Ok(ReplicaChoice::Leader),
            "follower" => Ok(ReplicaChoice::Follower),
            "any" => Ok(ReplicaChoice::Any),
            _ => Err(format!("bad --replica '{s}' (expected leader, follower or any)")),
        }
    }
}

/// Name of the environment variable naming the file where the run monitor writes its
/// replicas' mean CPU time (`{"cpu_us": N}`), the range of time-based replica faults.
pub const CPU_REPORT_ENV: &str = "LOCKSTEP_CPU_REPORT";

/// Where the run monitor writes how many detection events (divergence, timeout, halt) it
/// emitted during a run with a replica fault recorded at `record`.
pub fn detections_path(record: &std::path::Path) -> std::path::PathBuf {
    record.with_extension("detections")
}

/// Name of the environment variable that carries a [`ReplicaFault`].
pub const REPLICA_FAULT_ENV: &str = "LOCKSTEP_INJECT";

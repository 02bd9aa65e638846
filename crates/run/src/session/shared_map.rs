//! Shared file mappings (`mmap` with `MAP_SHARED` of a file).
//!
//! Stores into such a mapping are not syscalls: if every replica mapped the file shared,
//! every replica would write it, and a read-modify-write would happen once per replica.
//! So the leader maps the file as asked, and each follower gets an anonymous private
//! mapping at the same address holding a copy of what the leader's mapping held at that
//! moment. From then on the file sees the leader's writes only; the followers' writes stay
//! in their copies. The copies are compared with the leader's mapping (a CRC32C of each
//! region, folded into the call's comparison key) at `msync`, `munmap`, `fsync`,
//! `fdatasync` and `exit_group`, so a replica whose stores differ is caught there.
//!
//! If the leader is voted out, the file may hold its faulty stores: the new leader's copy
//! is written back into the file at once, and from then on (its mapping being a private
//! copy too) after every comparison at which the replicas agree. Between two such points
//! other processes then see the file as of the last one.
//!
//! Limits: a region larger than `MAX_REGION` is refused (named, exit 125). Another process
//! writing the file outside the program changes the leader's view only, which the next
//! comparison reports as a divergence. `mremap` of such a region is not followed.

use crate::backend::{Backend, Resume};
use crate::session::signals::StandIn;
use crate::session::{ReplicaId, Session, SlotState, Stopped, TaskId};
use crate::Error;
use std::rc::Rc;

/// The largest shared file mapping lockstep copies into the followers.
pub const MAX_REGION: u64 = 256 << 20;

/// One shared file mapping of a logical process.
#[derive(Clone, Debug)]
pub struct SharedMap {
    pub addr: u64,
    pub len: u64,
    /// The mapped file (the leader's open file description) and where the mapping starts.
    file: Rc<std::os::fd::OwnedFd>,
    offset: u64,
    /// Bytes of the mapping backed by the file when it was mapped.
    backed: u64,
    /// The leader's mapping is a private copy (the original leader was voted out): the
    /// monitor writes it back into the file at every agreed comparison.
    leader_private: bool,
}

impl SharedMap {
    fn overlaps(&self, addr: u64, len: u64) -> bool {
        addr < self.addr.saturating_add(self.len) && self.addr < addr.saturating_add(len)
    }
}

/// What a follower does at the exit of its stand-in `mmap`: the address it must have got,
/// and the leader's contents to copy there.
pub struct MapCopy {
    pub addr: u64,
    pub bytes: Rc<Vec<u8>>,
}

fn page_up(n: u64) -> u64 {
    n.div_ceil(4096) * 4096
}

impl Session {
    /// Whether `munmap(args[0], args[1])` in `task`'s process removes a shared file mapping.
    pub(crate) fn unmaps_shared(&self, task: TaskId, args: &[u64; 6]) -> bool {
        let p = self.tasks[task].process();
        self.processes[p]
            .shared_maps
            .iter()
            .any(|m| m.overlaps(args[0], args[1]))
    }

    /// CRC32C of replica `r`'s contents of the shared mappings of `task`'s process that the
    /// call `nr(args)` concerns (those in the range of `msync`/`munmap`; all of them at
    /// `fsync`, `fdatasync` and `exit_group`); `None` when it concerns none.
    pub(crate) fn shared_maps_crc(&self, task: TaskId, r: ReplicaId, nr: u64, args: &[u64; 6]) -> Option<u32> {
        let p = self.tasks[task].process();
        let maps = &self.processes[p].shared_maps;
        if maps.is_empty() {
            return None;
        }
        let ranged = nr == libc::SYS_msync as u64 || nr == libc::SYS_munmap as u64;
        let everything = [libc::SYS_fsync, libc::SYS_fdatasync, libc::SYS_exit_group]
            .iter()
            .any(|&s| nr == s as u64);
        if !ranged && !everything {
            return None;
        }
        let tid = self.slot(task, r).tid();
        let mut crc = 0u32;
        let mut any = false;
        for m in maps.iter().filter(|m| everything || m.overlaps(args[0], args[1])) {
            let bytes = self
                .be
                .read_vec(tid, m.addr, m.len as usize)
                .unwrap_or_else(|_| b"<EFAULT>".to_vec());
            crc = lockstep_core::checksum::crc32c_append(crc, &bytes);
            any = true;
        }
        any.then_some(crc)
    }

    /// The leader's `mmap(args)` of a shared file mapping returned `ret`: record the
    /// region, and give each parked follower a private anonymous mapping at the same
    /// address with the leader's current contents.
    pub(crate) fn finish_shared_map(&mut self, task: TaskId, args: [u64; 6], ret: i64) -> Result<(), Stopped> {
        let leader = self.replicas.leader();
        let (ltid, ltgid) = (self.slot(task, leader).tid(), self.slot(task, leader).tgid());
        let len = page_up(args[1]);
        let mut copy = None;
        if ret >= 0 {
            if len > MAX_REGION {
                let msg = format!(
                    "a shared file mapping of {len} bytes is larger than lockstep copies into the followers ({MAX_REGION} bytes)"
                );
                self.emit(
                    lockstep_core::Event::new("run", "unsupported", "stop")
                        .object("mmap")
                        .message(msg.clone()),
                );
                self.kill_everything();
                return Err(Stopped::Failure(Error::Unsupported(format!("lockstep run: {msg}"))));
            }
            let addr = ret as u64;
            // Only the part backed by the file can be read; the rest stays zero.
            let backed = self
                .be
                .fd_file_len(ltgid, args[4] as i32)
                .map(|size| size.saturating_sub(args[5]).min(len))
                .unwrap_or(0);
            let mut bytes = self.be.read_vec(ltid, addr, backed as usize).unwrap_or_default();
            bytes.resize(backed as usize, 0);
            let pidfd = lockstep_trace::seccomp::pidfd_open(ltgid).map_err(|e| Error::Io("pidfd_open", e))?;
            let file = lockstep_trace::seccomp::pidfd_getfd(&pidfd, args[4] as i32)
                .map_err(|e| Error::Io("pidfd_getfd", e))?;
            let p = self.tasks[task].process();
            self.processes[p].shared_maps.push(SharedMap {
                addr,
                len,
                file: Rc::new(file),
                offset: args[5],
                backed,
                leader_private: false,
            });
            copy = Some(Rc::new(bytes));
        }
        for f in self.live_slots(task) {
            if f == leader || self.slot(task, f).state() != SlotState::Arrived {
                continue;
            }
            let ftid = self.slot(task, f).tid();
            let mut regs = self.slot(task, f).regs();
            let Some(bytes) = copy.clone() else {
                lockstep_trace::ptrace::skip_with_result(&mut regs, ret);
                self.be.steer().set_regs(ftid, &regs);
                self.raise_mirrored(task, f);
                self.resume(task, f, Resume::Run, SlotState::Running);
                continue;
            };
            // Same address, same length and protection; private and anonymous.
            regs.rdi = ret as u64;
            regs.r10 = (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE) as u64;
            regs.r8 = u64::MAX;
            regs.r9 = 0;
            self.be.steer().set_regs(ftid, &regs);
            let signals = self.tasks[task].signals.mirror();
            self.slot_mut(task, f).signals.stand_in(StandIn {
                restore: None,
                ret,
                signals,
                copy: Some(MapCopy {
                    addr: ret as u64,
                    bytes,
                }),
            });
            self.resume(task, f, Resume::ToExit, SlotState::Executing);
        }
        self.tasks[task].recollect();
        self.tasks[task].signals.take_mirror();
        self.resume(task, leader, Resume::Run, SlotState::Running);
        Ok(())
    }

    /// A follower's stand-in `mmap` returned `got`: it must be the leader's address; then
    /// the leader's contents go in.
    pub(crate) fn fill_map_copy(
        &mut self,
        task: TaskId,
        f: ReplicaId,
        got: i64,
        copy: &MapCopy,
    ) -> Result<(), Stopped> {
        if got != copy.addr as i64 {
            let msg = format!(
                "replica {f} could not place its copy of a shared file mapping at {:#x} (got {got:#x})",
                copy.addr
            );
            return self.replica_failed(task, f, "divergence", msg);
        }
        let tid = self.slot(task, f).tid();
        if !copy.bytes.is_empty() && self.be.write(tid, copy.addr, &copy.bytes).is_err() {
            let msg = format!("could not copy the leader's shared mapping into replica {f}");
            return self.replica_failed(task, f, "divergence", msg);
        }
        Ok(())
    }

    /// The leader was voted out: the file may hold its stores. Every shared mapping gets the
    /// new leader's copy written back, now and at every later agreed comparison.
    pub(crate) fn leader_replaced_for_maps(&mut self) {
        for p in 0..self.processes.len() {
            for m in self.processes[p].shared_maps.iter_mut() {
                m.leader_private = true;
            }
            self.write_back(p, None);
        }
    }

    /// The replicas agreed at `nr(args)` of `task`: write the leader's copies that this call
    /// concerns back into their files (only where the leader's mapping is a private copy).
    pub(crate) fn agreed_on_maps(&mut self, task: TaskId, nr: u64, args: &[u64; 6]) {
        let p = self.tasks[task].process();
        if self.processes[p].shared_maps.iter().any(|m| m.leader_private)
            && self.shared_maps_crc(task, self.replicas.leader(), nr, args).is_some()
        {
            let ranged = nr == libc::SYS_msync as u64 || nr == libc::SYS_munmap as u64;
            self.write_back(p, ranged.then_some((args[0], args[1])));
        }
    }

    /// Writes the leader's copy of process `p`'s private-leader mappings (those in `range`,
    /// or all) into their files.
    fn write_back(&mut self, p: usize, range: Option<(u64, u64)>) {
        use std::os::fd::AsRawFd;
        let leader = self.replicas.leader();
        let Some(tid) = self.processes[p].tasks.iter().find_map(|&t| {
            let task = &self.tasks[t];
            (!task.is_finished())
                .then(|| task.slot(leader).map(|s| s.tid()))
                .flatten()
        }) else {
            return;
        };
        for m in &self.processes[p].shared_maps {
            if !m.leader_private || range.is_some_and(|(a, l)| !m.overlaps(a, l)) {
                continue;
            }
            let Ok(bytes) = self.be.read_vec(tid, m.addr, m.backed as usize) else {
                continue;
            };
            // SAFETY: writing a local buffer to a descriptor we own.
            unsafe { libc::pwrite(m.file.as_raw_fd(), bytes.as_ptr().cast(), bytes.len(), m.offset as i64) };
        }
    }

    /// After a `munmap` every replica ran: the shared mappings in its range are gone.
    pub(crate) fn forget_unmapped(&mut self, task: TaskId, args: &[u64; 6]) {
        let p = self.tasks[task].process();
        self.processes[p].shared_maps.retain(|m| !m.overlaps(args[0], args[1]));
    }
}

//! Reading and writing a tracee's memory with process_vm_readv/writev, falling back to
//! /proc/PID/mem for pages that are not writable from outside (for example read-only
//! mappings we need to patch).

use crate::Tid;
use std::io;
use std::os::unix::fs::FileExt;

/// Reads exactly `buf.len()` bytes at `addr`.
pub fn read(tid: Tid, addr: u64, buf: &mut [u8]) -> io::Result<()> {
    if buf.is_empty() {
        return Ok(());
    }
    let local = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let remote = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: buf.len(),
    };
    // SAFETY: `local` points at our own buffer of the stated length.
    let n = unsafe { libc::process_vm_readv(tid, &local, 1, &remote, 1, 0) };
    if n == buf.len() as isize {
        return Ok(());
    }
    // Partial or failed (e.g. a range crossing into an unreadable page): fall back.
    let f = std::fs::File::open(format!("/proc/{tid}/mem"))?;
    f.read_exact_at(buf, addr)
}

pub fn read_vec(tid: Tid, addr: u64, len: usize) -> io::Result<Vec<u8>> {
    let mut v = vec![0u8; len];
    read(tid, addr, &mut v)?;
    Ok(v)
}

/// Writes all of `data` at `addr`.
pub fn write(tid: Tid, addr: u64, data: &[u8]) -> io::Result<()> {
    if data.is_empty() {
        return Ok(());
    }
    let local = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    let remote = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: data.len(),
    };
    // SAFETY: `local` points at our own buffer of the stated length.
    let n = unsafe { libc::process_vm_writev(tid, &local, 1, &remote, 1, 0) };
    if n == data.len() as isize {
        return Ok(());
    }
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(format!("/proc/{tid}/mem"))?;
    f.write_all_at(data, addr)
}

/// Reads a NUL-terminated string of at most `limit` bytes (without the NUL).
pub fn read_cstr(tid: Tid, addr: u64, limit: usize) -> io::Result<Vec<u8>> {
    let mut out = Vec::new();
    let mut chunk = [0u8; 256];
    let mut at = addr;
    while out.len() < limit {
        // Read up to the end of the current page so we never cross into an unmapped one.
        let page_left = 4096 - (at as usize % 4096);
        let n = page_left.min(chunk.len());
        read(tid, at, &mut chunk[..n])?;
        if let Some(pos) = chunk[..n].iter().position(|&b| b == 0) {
            out.extend_from_slice(&chunk[..pos]);
            return Ok(out);
        }
        out.extend_from_slice(&chunk[..n]);
        at += n as u64;
    }
    out.truncate(limit);
    Ok(out)
}

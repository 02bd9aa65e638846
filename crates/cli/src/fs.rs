//! `lockstep fs`: mount, unmount and talk to the checksummed FUSE filesystem.

use clap::{Args, Subcommand};
use lockstep_core::exit;
use lockstep_fs::cache::Verify;
use lockstep_fs::mount::{self, Options};
use std::io::{Read, Write};
use std::os::fd::FromRawFd;
use std::path::PathBuf;
use std::time::Duration;

const AFTER_HELP: &str = "\
How it works:
  File data is served from lockstep's own page cache (the kernel's is bypassed with direct
  I/O). Every 4 KiB page carries the CRC32C of its contents, the same checksum the store
  keeps for that block on disk: computed once when the page is modified, kept up to date
  incrementally, and handed up by the store on a miss. A page that fails its check is
  read again from the store if it is clean, and gives EIO (never wrong data, and it is
  never written back) if it is dirty. Blocks that fail on disk are repaired from --mirror.

Verification strategies (--verify):
  every-read        check a page on every read, in the same pass that copies it into
                    the reply (the default: no read ever returns a byte that was not
                    checked; cost: none measurable on 4 KiB reads, about 5% on 1 MiB
                    reads from the cache; docs/results.md)
  last-check=DUR    on read, if the page was last checked DUR ago or more
  last-use=DUR      on read, if the page was idle for DUR, and at least every DUR
  none              only the scrubber checks
  plus --scrub RATE: a background scrubber checks RATE pages per second.
  All but every-read leave a window in which a flipped page can be returned.

The store is an ordinary directory tree (what the mount shows) plus STORE/.lockstep,
which holds the block checksums keyed by path, so a copy made with cp -a, rsync -a or
tar mounts and checks like the original. A mount holds the store's lock.

Examples:
  lockstep fs mount --store /var/lib/fs-store /mnt/data
  lockstep fs mount --store s --mirror m --verify last-check=1s --scrub 1000 /mnt/x
  lockstep fs ctl /mnt/data stats
  lockstep fs umount /mnt/data      # exit 86 if acknowledged data had to be discarded
  lockstep fs check /var/lib/fs-store
  lockstep fs adopt ~/photos        # an existing tree becomes a store";

/// A FUSE filesystem whose checksummed page cache catches memory errors.
#[derive(Args)]
pub struct FsArgs {
    #[command(subcommand)]
    command: FsCommand,
}

#[derive(Subcommand)]
enum FsCommand {
    Mount(MountArgs),
    Umount(UmountArgs),
    Ctl(CtlArgs),
    Check(CheckArgs),
    Adopt(AdoptArgs),
}

/// Mount the filesystem (as root). Returns once it is mounted, unless --foreground.
#[derive(Args)]
#[command(after_help = AFTER_HELP)]
struct MountArgs {
    /// Where files and block checksums are kept (default: MOUNTPOINT.store).
    #[arg(long, value_name = "DIR")]
    store: Option<PathBuf>,
    /// A second copy of every block and checksum, for repairing bad blocks.
    #[arg(long, value_name = "DIR")]
    mirror: Option<PathBuf>,
    /// every-read, last-check=DUR, last-use=DUR or none.
    #[arg(long, default_value = "every-read", value_name = "STRATEGY")]
    verify: String,
    /// Pages per second checked in the background (0: no scrubber).
    #[arg(long, default_value_t = 64, value_name = "RATE")]
    scrub: u64,
    /// Memory for cached pages, e.g. 64M or 1G (at least 64K, at most the machine's memory).
    #[arg(long, default_value = "64M", value_name = "SIZE", value_parser = crate::args::size_in(64 << 10, 1 << 50))]
    cache_size: u64,
    /// Dirty pages are written back once they are this old (at most 30s: Loris bounds the
    /// age of dirty data).
    #[arg(long, default_value = "5s", value_name = "DUR",
          value_parser = crate::args::duration_in(Duration::ZERO, Duration::from_secs(30)))]
    dirty_age: Duration,
    /// Write every event as a JSON line to FILE.
    #[arg(long, value_name = "FILE")]
    events: Option<PathBuf>,
    /// Accept `flip` on the control socket (tests and measurements only).
    #[arg(long)]
    test_flips: bool,
    /// Accept `crash` and `crash-damaged` on the control socket (tests and measurements).
    #[arg(long)]
    test_crash: bool,
    /// Stay in the foreground instead of returning once mounted.
    #[arg(short, long)]
    foreground: bool,
    mountpoint: PathBuf,
}

/// Write back everything dirty and unmount. Exits 86 if the mount had to discard
/// acknowledged data (dirty pages that failed their checksum), naming the files.
#[derive(Args)]
struct UmountArgs {
    mountpoint: PathBuf,
}

/// Verify every block of every file in a store (not mounted). Damaged copies of checksum
/// tables are rewritten from their twin, and bad blocks from --mirror. Exits 86 if any
/// block stays bad, and names each one.
#[derive(Args)]
struct CheckArgs {
    store: PathBuf,
    /// The store's mirror, to repair bad blocks from.
    #[arg(long, value_name = "DIR")]
    mirror: Option<PathBuf>,
}

/// Make an existing directory tree a store: compute a checksum table for every regular
/// file from its current contents. The files stay where they are.
#[derive(Args)]
struct AdoptArgs {
    dir: PathBuf,
}

/// Send a control command to a mount: stats, flush, or (with --test-flips) flip N clean|dirty|any.
#[derive(Args)]
struct CtlArgs {
    mountpoint: PathBuf,
    #[arg(trailing_var_arg = true, required = true)]
    command: Vec<String>,
}

pub fn main(a: FsArgs) -> i32 {
    match a.command {
        FsCommand::Mount(m) => mount_cmd(m),
        FsCommand::Umount(u) => match mount::umount(&u.mountpoint) {
            Ok(r) => {
                if r.status != 0 {
                    eprintln!("lockstep fs: {}", r.message);
                }
                r.status
            }
            Err(e) => {
                eprintln!("lockstep fs: {e}");
                1
            }
        },
        FsCommand::Check(c) => check_cmd(c),
        FsCommand::Adopt(a) => adopt_cmd(a),
        FsCommand::Ctl(c) => {
            let Some(store) = mount::store_of(&c.mountpoint) else {
                eprintln!("lockstep fs: {} is not a lockstep fs mount", c.mountpoint.display());
                return 1;
            };
            match mount::control(&store, &c.command.join(" ")) {
                Ok(v) => {
                    println!("{v}");
                    if v["ok"] == true {
                        0
                    } else {
                        1
                    }
                }
                Err(e) => {
                    eprintln!(
                        "lockstep fs: cannot reach the daemon of {}: {e}",
                        c.mountpoint.display()
                    );
                    1
                }
            }
        }
    }
}

fn check_cmd(c: CheckArgs) -> i32 {
    use lockstep_fs::store::{self, offline, Layout};
    for d in std::iter::once(&c.store).chain(c.mirror.as_ref()) {
        match store::layout(d) {
            Ok(Layout::Store) => {}
            Ok(_) => {
                eprintln!("lockstep fs: {} is not a lockstep store", d.display());
                return 1;
            }
            Err(e) => {
                eprintln!("lockstep fs: cannot read {}: {e}", d.display());
                return 1;
            }
        }
        if let Ok(Some(holder)) = mount::StoreLock::holder(d) {
            eprintln!("lockstep fs: {} is mounted ({holder}); unmount it first", d.display());
            return 1;
        }
    }
    let s = match store::Store::open(&c.store, c.mirror.as_deref()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("lockstep fs: {e}");
            return 1;
        }
    };
    let mut last = std::time::Instant::now();
    let report = offline::check(&s, |r| {
        if last.elapsed() >= Duration::from_secs(2) {
            eprintln!("lockstep fs: checked {} files, {} blocks", r.files, r.blocks);
            last = std::time::Instant::now();
        }
    });
    let r = match report {
        Ok(r) => r,
        Err(e) => {
            eprintln!("lockstep fs: check failed: {e}");
            return 1;
        }
    };
    for f in &r.damaged {
        let blocks: Vec<String> = f.bad_blocks.iter().map(|b| b.to_string()).collect();
        println!("BAD {} blocks {}", f.path.display(), blocks.join(","));
    }
    println!(
        "checked {} files, {} blocks: {} bad block(s) in {} file(s); repaired {} block(s) from the mirror and {} table chunk copy(ies); removed {} stale table(s)",
        r.files,
        r.blocks,
        r.damaged.iter().map(|f| f.bad_blocks.len()).sum::<usize>(),
        r.damaged.len(),
        r.repaired_blocks,
        r.repaired_chunks,
        r.stale_tables
    );
    if r.damaged.is_empty() {
        0
    } else {
        exit::DETECTED
    }
}

fn adopt_cmd(a: AdoptArgs) -> i32 {
    if !a.dir.is_dir() {
        eprintln!("lockstep fs: {} is not a directory", a.dir.display());
        return 1;
    }
    let mut last = std::time::Instant::now();
    match lockstep_fs::store::offline::adopt(&a.dir, |n| {
        if last.elapsed() >= Duration::from_secs(2) {
            eprintln!("lockstep fs: {n} files so far");
            last = std::time::Instant::now();
        }
    }) {
        Ok(n) => {
            println!("{} is a lockstep store now: checksums for {n} files", a.dir.display());
            0
        }
        Err(e) => {
            eprintln!("lockstep fs: cannot adopt {}: {e}", a.dir.display());
            1
        }
    }
}

fn usage(msg: String) -> i32 {
    crate::args::usage("fs", &msg)
}

/// The longest `last-check`/`last-use` window of --verify.
const VERIFY_WINDOW_MAX: Duration = Duration::from_secs(86_400);

fn parse_verify(s: &str) -> Result<Verify, String> {
    let window = crate::args::duration_in(Duration::ZERO, VERIFY_WINDOW_MAX);
    match s {
        "every-read" => Ok(Verify::EveryRead),
        "none" => Ok(Verify::None),
        _ => match s.split_once('=') {
            Some(("last-check", d)) => Ok(Verify::LastCheck(window(d)?)),
            Some(("last-use", d)) => Ok(Verify::LastUse(window(d)?)),
            _ => Err(format!(
                "--verify {s:?}: use every-read, last-check=DUR, last-use=DUR or none"
            )),
        },
    }
}

fn mount_cmd(m: MountArgs) -> i32 {
    let verify = match parse_verify(&m.verify) {
        Ok(v) => v,
        Err(e) => return usage(e),
    };
    let cache_bytes = m.cache_size;
    // SAFETY: sysconf has no preconditions.
    if cache_bytes / 4096 > unsafe { libc::sysconf(libc::_SC_PHYS_PAGES) }.max(0) as u64 {
        return usage(format!(
            "--cache-size {cache_bytes} bytes is more than this machine's memory"
        ));
    }
    let dirty_age = m.dirty_age;
    let mut store = m.store.unwrap_or_else(|| {
        let mut s = m.mountpoint.clone().into_os_string();
        s.push(".store");
        PathBuf::from(s)
    });
    if store.is_relative() {
        store = std::env::current_dir().map(|d| d.join(&store)).unwrap_or(store);
    }
    let mirror = m.mirror.map(|p| {
        if p.is_relative() {
            std::env::current_dir().map(|d| d.join(&p)).unwrap_or(p)
        } else {
            p
        }
    });
    let o = Options {
        store,
        mirror,
        mountpoint: m.mountpoint,
        verify,
        scrub_rate: m.scrub,
        cache_bytes,
        dirty_age,
        events: m.events,
        test_flips: m.test_flips,
        test_crash: m.test_crash,
    };
    if let Err(e) = mount::preflight(&o) {
        eprintln!("lockstep fs: {e}");
        return 1;
    }
    if m.foreground {
        return mount::run(o, |r| {
            if let Err(e) = r {
                eprintln!("lockstep fs: {e}");
            }
        });
    }
    // Daemon: the parent returns once the child has mounted (or says why it could not).
    let mut fds = [0; 2];
    // SAFETY: plain pipe/fork before any thread exists.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        eprintln!("lockstep fs: pipe: {}", std::io::Error::last_os_error());
        return 1;
    }
    // SAFETY: pipe2 just returned these two fds, and nothing else owns them.
    let (mut rd, mut wr) = unsafe { (std::fs::File::from_raw_fd(fds[0]), std::fs::File::from_raw_fd(fds[1])) };
    // SAFETY: no thread exists yet (the mount's threads start in the child), so the child may run any code after fork.
    match unsafe { libc::fork() } {
        -1 => {
            eprintln!("lockstep fs: fork: {}", std::io::Error::last_os_error());
            1
        }
        0 => {
            drop(rd);
            // SAFETY: setsid has no preconditions; in a fresh child it cannot fail.
            unsafe { libc::setsid() };
            // Detached from the terminal's output: errors before the mount go back through
            // the pipe, and events go to --events.
            if let Ok(null) = std::fs::OpenOptions::new().read(true).write(true).open("/dev/null") {
                use std::os::fd::AsRawFd;
                // SAFETY: dup2 onto 0-2 from an open fd; the old stdio descriptors are ours to replace.
                unsafe {
                    libc::dup2(null.as_raw_fd(), 0);
                    libc::dup2(null.as_raw_fd(), 1);
                    libc::dup2(null.as_raw_fd(), 2);
                }
            }
            let code = mount::run(o, move |r| {
                let msg = match r {
                    Ok(()) => "OK".to_string(),
                    Err(e) => e,
                };
                // (the parent may be gone; the message only spares it a wait)
                let _ = wr.write_all(msg.as_bytes());
            });
            std::process::exit(code);
        }
        _ => {
            drop(wr);
            let mut msg = String::new();
            // (an empty message below means the child died before it could say why)
            let _ = rd.read_to_string(&mut msg);
            if msg == "OK" {
                0
            } else {
                eprintln!(
                    "lockstep fs: {}",
                    if msg.is_empty() {
                        "the daemon died before mounting"
                    } else {
                        &msg
                    }
                );
                1
            }
        }
    }
}

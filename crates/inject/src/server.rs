//! Server mode: start the target (a server), wait until its TCP port accepts connections,
//! run the client workload against it, then stop the server. What is compared with the
//! golden run is the client's output; the server's own fate decides the rest:
//!
//! * the server exits 86 (lockstep or libsei detected corruption), even while stopping:
//!   detected;
//! * it is killed by a signal: crash; it exits by itself otherwise: program-error;
//! * the client does not finish in time: hang;
//! * otherwise the client's output and exit status decide between masked and sdc.
//!
//! A time-based injection point counts the server's CPU time from its exec; the golden
//! runs measure it from the exec to the end of the client workload. An exact point
//! (`--at syscall:K`) counts the server's main thread's syscalls from its exec; the client
//! starts as soon as the port is open, wherever the point is.

use crate::target::{detach_after_exec, drive_to_injection, ending_of, Child, Driven, Ending, Outcome, Plan};
use crate::tree::{idle, Tree};
use lockstep_trace::{ptrace, Tid};
use std::io;
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

/// How long a port in use is given to become free before a run starts.
const PORT_FREE_WAIT: Duration = Duration::from_secs(3);

/// How long a server gets to exit after SIGTERM before it is killed.
pub const STOP_GRACE: Duration = Duration::from_secs(5);

/// How the workload reaches the server.
#[derive(Clone, Debug)]
pub struct Server {
    /// The port the server listens on (127.0.0.1).
    pub port: u16,
    /// The client workload, run with `sh -c`.
    pub client: String,
}

fn port_open(port: u16) -> bool {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    TcpStream::connect_timeout(&addr, Duration::from_millis(100)).is_ok()
}

/// The server's end if it has ended (untraced server; reaps it).
fn try_reap(pid: Tid) -> Option<Ending> {
    let mut status = 0;
    // SAFETY: non-blocking waitpid on our child.
    let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG | libc::__WALL) };
    (r == pid).then(|| ending_of(ptrace::decode(status))).flatten()
}

/// Where the server is, for the code that waits on it: traced (its stops passed on by the
/// tree) or plain.
enum Watch<'a> {
    Traced(&'a mut Tree),
    Plain(Tid),
}

impl Watch<'_> {
    /// Passes on pending stops; the server's end once it has ended.
    fn server_end(&mut self) -> io::Result<Option<Ending>> {
        match self {
            Watch::Traced(t) => {
                while let Some((tid, stop)) = crate::tree::poll()? {
                    t.handle(tid, stop)?;
                }
                Ok(t.root_end)
            }
            Watch::Plain(pid) => Ok(try_reap(*pid)),
        }
    }

    /// Waits for the untraced child `pid` (the client) until the deadline.
    fn wait_child(&mut self, pid: Tid, deadline: Instant) -> io::Result<Option<Ending>> {
        match self {
            Watch::Traced(t) => t.wait_foreign(pid, deadline),
            Watch::Plain(_) => loop {
                if let Some(e) = try_reap(pid) {
                    return Ok(Some(e));
                }
                if Instant::now() >= deadline {
                    return Ok(None);
                }
                idle();
            },
        }
    }
}

/// Waits until `port` accepts connections; Err(ending) if the server ended first.
fn wait_for_port(watch: &mut Watch, port: u16, deadline: Instant) -> io::Result<Result<(), Ending>> {
    loop {
        if let Some(end) = watch.server_end()? {
            return Ok(Err(end));
        }
        if port_open(port) {
            return Ok(Ok(()));
        }
        if Instant::now() >= deadline {
            return Ok(Err(Ending::TimedOut));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Runs the server `argv` with the client workload, injecting per `plan`.
pub fn run(
    argv: &[String],
    server: &Server,
    plan: &Plan,
    timeout: Duration,
    scratch: &Path,
    env: &[(String, String)],
) -> io::Result<Outcome> {
    // The previous run's server may still be dying (a killed run monitor's replicas close
    // their sockets asynchronously): give the port a moment before calling it taken.
    let free_by = Instant::now() + PORT_FREE_WAIT;
    while port_open(server.port) {
        if Instant::now() >= free_by {
            return Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                format!("port {} is already in use before the server started", server.port),
            ));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let traced = !matches!(plan, Plan::None);
    // A golden run's server is followed to its exec too, where its CPU time starts to
    // count (as an injection point's does), and then runs untraced.
    let srv = Child::spawn(argv, true, scratch, "server-", env)?;
    let result = serve(&srv, server, plan, timeout, scratch, traced);
    if result.as_ref().is_ok_and(|o| o.ending == Ending::TimedOut) {
        crate::hang::record(srv.pid, scratch);
    }
    // Whatever happened, nothing of this run may outlive it.
    crate::tree::kill_and_reap_all(srv.pid);
    srv.forget();
    result
}

fn serve(
    srv: &Child,
    server: &Server,
    plan: &Plan,
    timeout: Duration,
    scratch: &Path,
    traced: bool,
) -> io::Result<Outcome> {
    let deadline = srv.started + timeout;
    let mut tree = Tree::new(srv.pid);
    tree.count_root_syscalls();
    let client_argv = ["sh".to_string(), "-c".to_string(), server.client.clone()];
    let mut client: Option<(Child, Instant)> = None;
    let mut startup = None;
    let mut start_client = |client: &mut Option<(Child, Instant)>| -> io::Result<()> {
        startup = Some(srv.started.elapsed());
        *client = Some((
            Child::spawn(&client_argv, false, scratch, "client-", &[])?,
            Instant::now(),
        ));
        Ok(())
    };
    let mut applied = None;
    let mut early_end = None;
    let mut exec_cpu = Duration::ZERO;
    if !traced {
        match detach_after_exec(srv.pid)? {
            Ok(at_exec) => exec_cpu = at_exec,
            Err(ending) => early_end = Some(ending),
        }
    }
    if traced {
        // The point counts the server's CPU time from its exec: the client starts as soon
        // as the port is open, whether or not the fault is in by then.
        // Once the client is done, the point will not come: the fault is not applied (and
        // the run does not wait for the deadline).
        let driven = drive_to_injection(srv.pid, plan, deadline, &mut tree, &mut || {
            if client.is_none() && port_open(server.port) {
                start_client(&mut client)?;
            }
            Ok(client.as_ref().is_none_or(|(c, _)| !has_exited(c.pid)))
        })?;
        match driven {
            Driven::Injected(a) => applied = Some(a),
            Driven::NotApplied => {}
            Driven::Ended(e) => early_end = Some(e),
        }
    }
    let mut watch = if traced {
        Watch::Traced(&mut tree)
    } else {
        Watch::Plain(srv.pid)
    };
    if client.is_none() && early_end.is_none() {
        match wait_for_port(&mut watch, server.port, deadline)? {
            Ok(()) => start_client(&mut client)?,
            Err(end) => early_end = Some(end),
        }
    }
    let Some((client, client_started)) = client else {
        // The server ended (or never opened its port) before the client could start.
        let ending = server_ending(early_end.unwrap_or(Ending::TimedOut));
        let (stdout, stderr) = srv.outputs();
        return Ok(Outcome {
            ending,
            stdout,
            stderr,
            wall: srv.started.elapsed(),
            applied,
            startup,
            files: Vec::new(),
            cpu: Duration::ZERO,
            lockstep_detections: 0,
            client_ending: None,
            from_snapshot: None,
        });
    };
    let client_end = watch.wait_child(client.pid, deadline)?;
    let client_wall = client_started.elapsed();
    let cpu = lockstep_trace::cpu::process_cpu(srv.pid)
        .unwrap_or_default()
        .saturating_sub(exec_cpu);
    if client_end.is_none() {
        // SAFETY: the client overran the deadline: kill its process group and reap it.
        unsafe {
            libc::kill(-client.pid, libc::SIGKILL);
            libc::waitpid(client.pid, std::ptr::null_mut(), 0);
        }
    }
    client.forget();
    let before_stop = match early_end {
        Some(e) => Some(e),
        None => watch.server_end()?,
    };
    // The client's end as its exit status (128+N for signal N, as a shell reports it).
    let client_status = client_end.map(|e| match e {
        Ending::Signaled(s) => Ending::Exited(128 + s),
        e => e,
    });
    let ending = match (before_stop, client_status) {
        (Some(end), _) => server_ending(end),
        // The client hung: the run is a hang whatever the server does now, so it is not
        // given the SIGTERM grace (a spinning server would use all of it); `run` kills it.
        (None, None) => Ending::TimedOut,
        (None, Some(client_status)) => match stop_server(&mut watch, srv.pid)? {
            Some(Ending::Exited(lockstep_core::exit::DETECTED)) => Ending::Exited(lockstep_core::exit::DETECTED),
            _ => client_status,
        },
    };
    let (stdout, stderr) = client.outputs();
    Ok(Outcome {
        ending,
        stdout,
        stderr,
        wall: client_wall,
        applied,
        startup,
        files: Vec::new(),
        cpu,
        lockstep_detections: 0,
        client_ending: Some(client_status.unwrap_or(Ending::TimedOut)),
        from_snapshot: None,
    })
}

/// Whether our untraced child `pid` has exited, without reaping it (its status is read
/// later by the wait for the client). A child that is gone altogether has exited too: the
/// traced tree's poll (`waitpid(-1)`) reaps every child of the worker, the client
/// included, and keeps its end in `Tree::foreign`.
fn has_exited(pid: Tid) -> bool {
    // SAFETY: all-zero is a valid siginfo_t; waitid writes at most one.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: waitid on our own child with WNOWAIT leaves it to be reaped.
    let r = unsafe {
        libc::waitid(
            libc::P_PID,
            pid as libc::id_t,
            &mut info,
            libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
        )
    };
    if r < 0 {
        return io::Error::last_os_error().raw_os_error() == Some(libc::ECHILD);
    }
    // SAFETY: si_pid is set by waitid when a child was found.
    let found = unsafe { info.si_pid() };
    found == pid
}

/// The run's ending when the server ended by itself.
fn server_ending(end: Ending) -> Ending {
    match end {
        Ending::Exited(c) => Ending::ServerExited(c),
        e => e,
    }
}

/// SIGTERM, then SIGKILL after [`STOP_GRACE`]. Returns how the server ended if it did so
/// within the grace period.
fn stop_server(watch: &mut Watch, pid: Tid) -> io::Result<Option<Ending>> {
    // SAFETY: signal our own child.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let until = Instant::now() + STOP_GRACE;
    loop {
        if let Some(end) = watch.server_end()? {
            return Ok(Some(end));
        }
        if Instant::now() >= until {
            return Ok(None);
        }
        idle();
    }
}

#[cfg(test)]
mod tests {
    use super::has_exited;

    fn fork_exiting_child() -> libc::pid_t {
        // SAFETY: the child only calls _exit.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: async-signal-safe exit of the forked child.
            unsafe { libc::_exit(0) };
        }
        assert!(pid > 0, "fork failed");
        pid
    }

    #[test]
    fn an_exited_child_counts_as_exited_before_and_after_it_is_reaped() {
        let pid = fork_exiting_child();
        while !has_exited(pid) {
            std::thread::yield_now();
        }
        // A traced tree's `waitpid(-1)` may reap the client before the run looks at it.
        // SAFETY: waitpid on our own child.
        assert_eq!(unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) }, pid);
        assert!(has_exited(pid), "a reaped client must not look alive");
    }
}

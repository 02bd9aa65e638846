//! Handled signals that arrive while the program is blocked in the kernel: the call ends
//! (or restarts) and the handler runs exactly as natively, in every replica, for DMR and
//! TMR. One fixture (`signal_wait.c`) per pattern, compared byte for byte with a native
//! run; then real programs built on these patterns (`make -j2`, nginx's master).

mod common;
use common::*;
use std::path::Path;
use std::time::Duration;

/// Runs `signal_wait PATTERN` natively and under `-r 2` and `-r 3` with each compare mode
/// given; every run must print what the native run printed and exit 0.
fn same_as_native(pattern: &str, modes: &[&str]) {
    let prog = fixture("signal_wait");
    let argv = [prog.to_str().unwrap(), pattern];
    let want = native_stdout(&argv);
    for r in ["2", "3"] {
        for mode in modes {
            let out = run(lockstep_run(&["-r", r, "--compare", mode], &argv));
            out.assert_code(0).assert_stdout(&want);
        }
    }
}

const ALL_MODES: &[&str] = &["args", "io", "every"];

#[test]
fn pselect_with_sigchld_blocked_outside_the_call() {
    same_as_native("pselect", ALL_MODES);
}

#[test]
fn ppoll_with_sigchld_blocked_outside_the_call() {
    same_as_native("ppoll", ALL_MODES);
}

#[test]
fn epoll_pwait_with_sigchld_blocked_outside_the_call() {
    same_as_native("epoll_pwait", ALL_MODES);
}

#[test]
fn sigsuspend_with_sigchld_blocked_outside_the_call() {
    same_as_native("sigsuspend", ALL_MODES);
}

#[test]
fn alarm_then_pause() {
    same_as_native("pause", ALL_MODES);
}

#[test]
fn timer_during_sleep_with_and_without_sa_restart() {
    same_as_native("sleep-restart", &["args"]);
    same_as_native("sleep-norestart", &["args"]);
}

#[test]
fn a_timer_faster_than_its_handler_still_lets_every_call_through() {
    // Each rendezvous at the re-arming call finds a new SIGALRM pending: delivered before
    // the call every time, the handler would rewind it for ever.
    same_as_native("slow-handler", &["args"]);
}

#[test]
fn timer_during_a_pipe_read_with_and_without_sa_restart() {
    same_as_native("read-restart", ALL_MODES);
    same_as_native("read-norestart", ALL_MODES);
}

#[test]
fn interval_timer_and_a_pause_loop() {
    same_as_native("itimer", &["args", "io"]);
}

#[test]
fn timer_during_waitpid() {
    same_as_native("wait", ALL_MODES);
}

/// The handler's siginfo is the leader's in every replica: a POSIX timer's value (the
/// followers used to see 0, a false divergence under -r 2 and a healthy leader voted out
/// under -r 3).
#[test]
fn posix_timer_signals_carry_their_value() {
    same_as_native("posix-timer", ALL_MODES);
}

/// SIGCHLD's pid, code and status as an SA_SIGINFO handler sees them (under -r 3 the
/// followers' empty siginfo used to win the vote and reach the output).
#[test]
fn sigchld_handler_sees_the_childs_pid_and_status() {
    same_as_native("sigchld-info", ALL_MODES);
}

/// The loop after the timer makes no system call, so only a catch-up can deliver the
/// signal: `--stats` must count it, and the run must say so once.
#[test]
fn timer_during_a_computation_without_system_calls() {
    same_as_native("busy", &["args"]);
    let prog = fixture("signal_wait");
    let out = run(lockstep_run(&["-r", "2", "--stats"], &[prog.to_str().unwrap(), "busy"]));
    out.assert_code(0);
    assert!(out.stderr.contains("outside syscalls:"), "{}", out.context());
    let said = out
        .stderr
        .lines()
        .filter(|l| l.starts_with("lockstep run: [signal]"))
        .count();
    assert_eq!(said, 1, "{}", out.context());
}

#[test]
fn a_signal_that_arrived_under_the_old_handler_runs_it_before_the_disposition_changes() {
    same_as_native("handler-swap", &["args"]);
}

#[test]
fn python_alarm_ends_a_busy_loop() {
    let script = "import signal, sys\n\
def on_alarm(*_):\n    print('handler ran'); sys.exit(3)\n\
signal.signal(signal.SIGALRM, on_alarm)\nsignal.setitimer(signal.ITIMER_REAL, 0.1)\n\
while True:\n    pass\n";
    for r in ["2", "3"] {
        let out = run(lockstep_run(&["-r", r], &["python3", "-c", script]));
        out.assert_code(3).assert_stdout(b"handler ran\n");
    }
}

#[test]
fn timerfd_reads() {
    same_as_native("timerfd", &["args", "io"]);
}

/// SIGUSR1 sent to lockstep while the program waits in pause(): forwarded, the handler
/// runs, pause returns EINTR and the program exits.
fn outside_signal_during_pause(r: &str) {
    let prog = fixture("signal_wait");
    let mut run = spawn(lockstep_run(&["-r", r], &[prog.to_str().unwrap(), "outside"]));
    run.wait_for_stdout("ready\n", Duration::from_secs(30));
    // The program is in pause() or about to be: either way the signal must end it.
    std::thread::sleep(Duration::from_millis(300));
    run.signal(libc::SIGUSR1);
    let out = run.finish(RUN_TIMEOUT);
    out.assert_code(0)
        .assert_stdout(b"ready\npause: ret=-1 errno=EINTR handled=1\n");
}

#[test]
fn outside_signal_during_pause_dmr() {
    outside_signal_during_pause("2");
}

#[test]
fn outside_signal_during_pause_tmr() {
    outside_signal_during_pause("3");
}

/// A small C project: 13 sources and a main, built with `make -j2`, whose job loop waits
/// for SIGCHLD in pselect with SIGCHLD blocked outside it.
fn small_project(dir: &Path) {
    for i in 1..=13 {
        let src = format!("int f{i}(int x) {{ int s = 0; for (int i = 0; i < x; i++) s += i * {i}; return s; }}\n");
        std::fs::write(dir.join(format!("f{i}.c")), src).unwrap();
    }
    let mut main = String::from("#include <stdio.h>\n");
    for i in 1..=13 {
        main.push_str(&format!("int f{i}(int);\n"));
    }
    main.push_str("int main(void) { long t = 0;\n");
    for i in 1..=13 {
        main.push_str(&format!("    t += f{i}(100);\n"));
    }
    main.push_str("    printf(\"%ld\\n\", t);\n    return 0;\n}\n");
    std::fs::write(dir.join("main.c"), main).unwrap();
    let makefile = "OBJS = $(patsubst %.c,%.o,$(sort $(wildcard *.c)))\n\
                    prog: $(OBJS)\n\t$(CC) -o $@ $(OBJS)\n\
                    %.o: %.c\n\t$(CC) -O1 -c -o $@ $<\n";
    std::fs::write(dir.join("Makefile"), makefile).unwrap();
}

fn make_j2(r: &str) {
    let dir = scratch_dir("make");
    small_project(&dir);
    let out = run(lockstep_run(
        &["-r", r],
        &["make", "-s", "-j2", "-C", dir.to_str().unwrap()],
    ));
    out.assert_code(0);
    let built = std::process::Command::new(dir.join("prog"))
        .output()
        .expect("run the built program");
    assert_eq!(String::from_utf8_lossy(&built.stdout), "450450\n", "{}", out.context());
}

#[test]
fn make_j2_builds_a_small_project_dmr() {
    make_j2("2");
}

#[test]
fn make_j2_builds_a_small_project_tmr() {
    make_j2("3");
}

/// nginx (Debian's nginx-light) as a foreground master with one worker: it serves a
/// request, and `stop` (SIGTERM, fast) or `quit` (SIGQUIT, graceful) sent to lockstep ends
/// it with status 0. The master waits for its worker in sigsuspend with SIGCHLD and the
/// stop signals blocked outside it.
fn nginx_stops_on(r: &str, sig: i32, port: u16) {
    let dir = scratch_dir("nginx");
    let d = dir.display();
    let conf = format!(
        "daemon off;\nmaster_process on;\nworker_processes 1;\npid {d}/nginx.pid;\n\
         error_log {d}/error.log warn;\nevents {{ worker_connections 64; }}\n\
         http {{\n  access_log off;\n  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n\
         fastcgi_temp_path {d}/fcgi;\n  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n\
         server {{ listen 127.0.0.1:{port}; location / {{ return 200 \"replicated\\n\"; }} }}\n}}\n"
    );
    std::fs::write(dir.join("nginx.conf"), conf).unwrap();
    let conf_path = dir.join("nginx.conf");
    let run = spawn(lockstep_run(
        &["-r", r],
        &["nginx", "-c", conf_path.to_str().unwrap(), "-p", dir.to_str().unwrap()],
    ));
    let body = http_get_with_retry(port, Duration::from_secs(30));
    assert_eq!(body, "replicated\n");
    run.signal(sig);
    let out = run.finish(RUN_TIMEOUT);
    out.assert_code(0);
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "nginx still listens after lockstep returned\n{}",
        out.context()
    );
}

/// The body of `GET /` on 127.0.0.1:`port`, retried until the server answers.
fn http_get_with_retry(port: u16, limit: Duration) -> String {
    use std::io::{Read, Write};
    let deadline = std::time::Instant::now() + limit;
    loop {
        if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            s.write_all(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n").unwrap();
            let mut reply = String::new();
            s.read_to_string(&mut reply).expect("read the reply");
            return reply.split("\r\n\r\n").nth(1).unwrap_or_default().to_string();
        }
        assert!(std::time::Instant::now() < deadline, "nginx did not listen on {port}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn nginx_stops_on_sigterm_dmr() {
    nginx_stops_on("2", libc::SIGTERM, 18181);
}

#[test]
fn nginx_stops_on_sigquit_tmr() {
    nginx_stops_on("3", libc::SIGQUIT, 18182);
}

#[test]
fn nginx_stops_on_sigterm_tmr() {
    nginx_stops_on("3", libc::SIGTERM, 18183);
}

// --- killing one's own children -----------------------------------------------------------

/// A shell kills its background job and waits for it: the child's death by the program's
/// own signal is not a divergence, and its status reaches the parent in every replica.
/// Repeated, because the child dies at a different point in each replica every time.
fn shell_kills_its_child(sig: &str, status: &str) {
    let script = format!("sleep 10 & kill -{sig} $!; wait $!; echo st=$?");
    for r in ["2", "3"] {
        for _ in 0..5 {
            let out = run(lockstep_run(&["-r", r], &["sh", "-c", script.as_str()]));
            out.assert_code(0).assert_stdout(format!("st={status}\n").as_bytes());
        }
    }
}

#[test]
fn shell_kills_its_child_with_sigkill() {
    shell_kills_its_child("9", "137");
}

#[test]
fn shell_kills_its_child_with_sigterm() {
    shell_kills_its_child("TERM", "143");
}

/// Python's subprocess timeouts, terminate(), kill(), a forked child killed by a signal,
/// and pidfd_send_signal: the same output as natively.
#[test]
fn python_kills_its_children() {
    let script = fixture_file("kill_children.py");
    let argv = [
        python3().to_str().unwrap().to_string(),
        script.to_str().unwrap().to_string(),
    ];
    let want = native_stdout(&argv);
    for r in ["2", "3"] {
        let out = run(lockstep_run(&["-r", r], &argv));
        out.assert_code(0).assert_stdout(&want);
    }
}

/// A follower's own timer interrupts its descriptor install again and again (and can cancel
/// a reply in flight): the install is retried, never taken for a fault. Before the fix this
/// halted with exit 86 (a follower killed as a straggler, then a re-integration fork that
/// the timer interrupted left its source with a wrong result).
#[test]
fn a_busy_interval_timer_during_descriptor_installs() {
    let prog = fixture("timer_opens");
    let want = native_stdout(&[&prog]);
    for r in ["2", "3"] {
        let ev = events_path("timer_opens");
        let ev_arg = ev.to_string_lossy().into_owned();
        let out = run(lockstep_run(&["-r", r, "--events", &ev_arg], &[&prog]));
        out.assert_code(0).assert_stdout(&want);
        let events = read_events_of(&ev, &out);
        assert_no_event(&events, "divergence", &out);
    }
}

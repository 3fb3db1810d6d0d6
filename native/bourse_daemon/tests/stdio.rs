//! `--stdio` mode: 4-byte length-prefixed frames, as an Erlang `{:packet, 4}` port.

mod common;

use std::time::{Duration, Instant};

use serde_json::json;

use common::{StdioDaemon, Transport};

#[test]
fn every_op() {
    let mut daemon = StdioDaemon::start(&[]);
    common::exercise_every_op(&mut daemon);
    daemon.close_stdin();
    assert!(common::wait_exit(&mut daemon.child).success());
}

#[test]
fn bad_requests_are_answered_and_the_port_goes_on() {
    let mut daemon = StdioDaemon::start(&[]);
    common::exercise_bad_requests(&mut daemon);
    // An empty frame is not JSON.
    assert_eq!(daemon.call_raw(b"")["error"]["type"], "invalid_parameters");
}

#[test]
fn a_thousand_pipelined_requests_answer_in_order() {
    let mut daemon = StdioDaemon::start(&[]);
    let mut batch = Vec::new();
    for i in 0..1000 {
        let request = json!({"op": "check", "key": {"exchange": "e", "credential": null},
                             "limit": {"capacity": 500, "refill_per_sec": 0.001}, "id": i});
        let payload = serde_json::to_vec(&request).unwrap();
        batch.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        batch.extend_from_slice(&payload);
    }
    let mut stdin = daemon.stdin.take().unwrap();
    let writer = std::thread::spawn(move || {
        use std::io::Write;
        stdin.write_all(&batch).unwrap();
        stdin
    });
    let mut admitted = 0;
    for i in 0..1000 {
        let answer = daemon.recv_frame().expect("answer");
        assert_eq!(answer["id"], i);
        admitted += usize::from(answer["result"] == "admitted");
    }
    assert_eq!(admitted, 500);
    daemon.stdin = Some(writer.join().unwrap());
}

#[test]
fn closing_stdin_exits_cleanly_even_mid_frame() {
    let mut daemon = StdioDaemon::start(&[]);
    assert_eq!(daemon.call(json!({"op": "hello"}))["ok"], true);
    daemon.close_stdin();
    assert!(daemon.recv_frame().is_none());
    assert!(common::wait_exit(&mut daemon.child).success());

    // A frame cut off is answered, with the id that leads it, and not executed.
    let mut daemon = StdioDaemon::start(&[]);
    daemon.send_raw(&100u32.to_be_bytes());
    daemon.send_raw(br#"{"id":8,"op":"record","key":{"exchange":"p","credential":null}"#);
    daemon.close_stdin();
    let answer = daemon.recv_frame().expect("the cut frame is answered");
    assert_eq!(answer["id"], 8);
    assert_eq!(answer["error"]["type"], "invalid_parameters");
    let message = answer["error"]["message"].as_str().unwrap();
    assert!(message.contains("middle of a frame"), "{message}");
    assert!(daemon.recv_frame().is_none());
    assert!(common::wait_exit(&mut daemon.child).success());

    // So is a header cut off.
    let mut daemon = StdioDaemon::start(&[]);
    daemon.send_raw(&[0, 0]);
    daemon.close_stdin();
    let answer = daemon.recv_frame().expect("the cut header is answered");
    assert_eq!(answer["error"]["type"], "invalid_parameters");
    assert!(common::wait_exit(&mut daemon.child).success());
}

#[test]
fn an_oversized_frame_is_refused_then_the_port_closes() {
    let mut daemon = StdioDaemon::start(&["--max-frame-bytes", "1024"]);
    assert_eq!(daemon.call(json!({"op": "hello"}))["ok"], true);
    daemon.send_raw(&2000u32.to_be_bytes());
    let answer = daemon.recv_frame().expect("an error frame");
    assert_eq!(answer["ok"], false);
    assert_eq!(answer["error"]["type"], "frame_too_large");
    assert!(daemon.recv_frame().is_none());
    assert_eq!(common::wait_exit(&mut daemon.child).code(), Some(1));
}

#[test]
fn sigterm_exits_zero_and_sigint_is_ignored() {
    let mut daemon = StdioDaemon::start(&[]);
    assert_eq!(daemon.call(json!({"op": "hello"}))["ok"], true);
    common::signal(&daemon.child, "INT");
    // Still serving: the answer shows the signal was swallowed, however late it landed.
    std::thread::sleep(std::time::Duration::from_millis(100));
    assert_eq!(daemon.call(json!({"op": "hello"}))["ok"], true);
    assert!(daemon.child.try_wait().unwrap().is_none());
    common::signal(&daemon.child, "TERM");
    assert!(common::wait_exit(&mut daemon.child).success());
}

/// SIGTERM stops a port whose stdout nobody reads (before, it waited for that stdout for
/// good).
#[test]
fn sigterm_exits_while_nobody_reads_stdout() {
    assert!(common::sigterm_with_stdout_unread(&[]).success());
}

/// Where a daemon's `--stdio-socket` connects: a listener on a fresh temporary path, whose
/// file is removed when it is dropped.
struct StdioSocket {
    path: std::path::PathBuf,
    listener: std::os::unix::net::UnixListener,
}

impl StdioSocket {
    fn bind(name: &str) -> Self {
        let path = common::temp_path(name);
        let _ = std::fs::remove_file(&path);
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        Self { path, listener }
    }

    /// The daemon's end, once it connected.
    fn accept(&self) -> std::os::unix::net::UnixStream {
        self.listener.accept().unwrap().0
    }
}

impl Drop for StdioSocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The same through `--stdio-socket`, where the socket replaces stdin and stdout.
#[test]
fn sigterm_exits_while_nobody_reads_the_stdio_socket() {
    use std::process::{Command, Stdio};

    let listener = StdioSocket::bind("unread-stdio-socket");
    let mut child = Command::new(common::daemon_binary())
        .args(["--stdio", "--stdio-socket"])
        .arg(&listener.path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn bourse_daemon --stdio --stdio-socket");
    let socket = listener.accept();
    let kept = socket.try_clone().unwrap();
    let status = common::sigterm_with_answers_unread(&mut child, socket);
    drop(kept);
    assert!(status.success(), "{status:?}");
}

#[test]
fn an_idle_port_uses_no_cpu() {
    let mut daemon = StdioDaemon::start(&[]);
    let pid = daemon.child.id();
    let ticks = common::idle_cpu_ticks(&mut daemon, pid);
    // Generous: the sweeper's wake-ups and a loaded machine's noise are far below this.
    assert!(ticks <= 10, "{ticks} ticks of CPU in an idle second");
}

/// A port has no stderr of its own: a daemon that refuses its configuration answers the
/// port's first frame with why, in the codec its `hello` asked for, then exits 2. It says
/// why on stderr too, unless its client is on `--stdio-socket` (the Elixir backend, which
/// reports the answer itself).
#[test]
fn a_refused_configuration_answers_the_hello_with_why() {
    for (args, hello) in [
        (
            &["--stdio", "--redis-timeout-ms", "abc"][..],
            r#"{"id":0,"op":"hello"}"#,
        ),
        (
            &["--stdio", "--redis", "redis://127.0.0.1:1/notanumber"][..],
            r#"{"id":7,"op":"hello"}"#,
        ),
    ] {
        for on_socket in [false, true] {
            let (answer, stderr) = refused_port(args, hello, on_socket);
            let hello: serde_json::Value = serde_json::from_str(hello).unwrap();
            assert_eq!(answer["ok"], false, "{answer}");
            assert_eq!(answer["id"], hello["id"], "{answer}");
            assert_eq!(answer["error"]["type"], "invalid_parameters", "{answer}");
            let message = answer["error"]["message"].as_str().unwrap();
            assert!(
                message.contains("--redis-timeout-ms") || message.contains("database number"),
                "{message}"
            );
            if on_socket {
                assert_eq!(stderr, "", "{args:?}");
            } else {
                assert!(stderr.contains(message), "{args:?}: {stderr}");
            }
        }
    }
}

/// `--stdio-socket` without `--stdio` is no port: the refusal goes to stderr alone.
#[test]
fn a_stdio_socket_without_stdio_is_refused_on_stderr() {
    use std::process::{Command, Stdio};

    let listener = StdioSocket::bind("stray-stdio-socket");
    let output = Command::new(common::daemon_binary())
        .args(["--socket", "/nonexistent/x.sock", "--stdio-socket"])
        .arg(&listener.path)
        .stdin(Stdio::null())
        .output()
        .expect("run");
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--stdio-socket goes with --stdio"),
        "{stderr}"
    );
}

/// Runs a port that refuses `args`, its client on stdin and stdout or on `--stdio-socket`;
/// sends it the frame `hello`; returns the answer and what the daemon wrote on stderr once
/// it exited 2.
fn refused_port(args: &[&str], hello: &str, on_socket: bool) -> (serde_json::Value, String) {
    use std::io::{Read, Write};
    use std::process::{Command, Stdio};

    let mut command = Command::new(common::daemon_binary());
    command.args(args).stderr(Stdio::piped());
    let listener = on_socket.then(|| {
        let listener = StdioSocket::bind("refused-stdio-socket");
        command.arg("--stdio-socket").arg(&listener.path);
        command.stdin(Stdio::null()).stdout(Stdio::null());
        listener
    });
    if !on_socket {
        command.stdin(Stdio::piped()).stdout(Stdio::piped());
    }
    let mut child = command.spawn().expect("spawn");
    let (mut input, mut output): (Box<dyn Write>, Box<dyn Read>) = match &listener {
        Some(listener) => {
            let socket = listener.accept();
            (Box::new(socket.try_clone().unwrap()), Box::new(socket))
        }
        None => (
            Box::new(child.stdin.take().unwrap()),
            Box::new(child.stdout.take().unwrap()),
        ),
    };
    input.write_all(&common::frame(hello.as_bytes())).unwrap();
    let mut out = Vec::new();
    output.read_to_end(&mut out).unwrap();
    drop(input);
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert_eq!(child.wait().unwrap().code(), Some(2), "{args:?}");
    let size = u32::from_be_bytes(out[..4].try_into().unwrap()) as usize;
    assert_eq!(out.len(), 4 + size, "{args:?}");
    (serde_json::from_slice(&out[4..]).unwrap(), stderr)
}

/// A refused daemon whose port sends nothing and closes its input exits 2 at once.
#[test]
fn a_refused_configuration_without_a_hello_exits() {
    use std::process::{Command, Stdio};
    let status = Command::new(common::daemon_binary())
        .args(["--stdio", "--redis-timeout-ms", "abc"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("run");
    assert_eq!(status.code(), Some(2));
}

/// A port stopped while it runs pipelined checks: the checks paid are exactly those
/// answered `admitted`. An answer it could send only past its check's last moment to run
/// is `unavailable`, what the check paid given back; one settled in time and then held by
/// the stop (while its write waited for this reader) is read late, and stays paid. Before
/// answers were settled, 781 answers of 20 rounds of 2,000 checks were read late, admitted.
#[test]
fn the_checks_paid_are_those_answered_admitted_while_the_port_is_stopped() {
    let mut daemon = StdioDaemon::start(&[]);
    let k = json!({"exchange": "e", "credential": "stopped"});
    let limit = json!({"capacity": 1e9, "refill_per_sec": 1e-9});
    let (mut in_time, mut late) = (0u32, 0u32);
    for round in 0..20u64 {
        let now_us = daemon.call(json!({"op": "hello"}))["clock_us"]
            .as_u64()
            .unwrap();
        // Its caller waits 400 ms: the checks may run for 300 ms, and their answers have
        // 100 ms to be read.
        let deadline = Instant::now() + Duration::from_millis(400);
        let mut batch = Vec::new();
        for id in 0..1_000 {
            let request = json!({"id": id, "op": "check", "key": k, "limit": limit,
                                 "deadline_us": now_us + 400_000, "timeout_ms": 400});
            batch.extend(common::frame(&serde_json::to_vec(&request).unwrap()));
        }
        daemon.send_raw(&batch);
        // Stopped at some point of the batch, for longer than its callers wait.
        std::thread::sleep(Duration::from_micros(round * 150));
        common::signal(&daemon.child, "STOP");
        std::thread::sleep(Duration::from_millis(500));
        common::signal(&daemon.child, "CONT");
        for _ in 0..1_000 {
            let (read_at, answer) = daemon.recv_read().expect("an answer");
            let answer: serde_json::Value = serde_json::from_slice(&answer).unwrap();
            match (answer["result"] == "admitted", read_at <= deadline) {
                (true, true) => in_time += 1,
                (true, false) => late += 1,
                (false, _) => assert_eq!(answer["error"]["type"], "unavailable", "{answer}"),
            }
        }
    }
    let paid = common::borrowed(&mut daemon, &k);
    println!("{in_time} admitted in time, {late} admitted late, {paid} paid");
    assert!(
        (paid - f64::from(in_time + late)).abs() < 1e-3,
        "{paid} paid"
    );
}

/// A request's answer is sent before the port waits for the rest of the next frame.
#[test]
fn an_answer_does_not_wait_for_the_next_frame_to_arrive_whole() {
    let mut daemon = StdioDaemon::start(&[]);
    let k = json!({"exchange": "e", "credential": "partial"});
    let limit = json!({"capacity": 10, "refill_per_sec": 1});
    let (first, second) = (
        common::check_frame(1, &k, &limit),
        common::check_frame(2, &k, &limit),
    );
    let mut bytes = first;
    bytes.extend_from_slice(&second[..6]);
    daemon.send_raw(&bytes);
    assert_eq!(daemon.recv_frame().unwrap()["id"], 1);
    daemon.send_raw(&second[6..]);
    assert_eq!(daemon.recv_frame().unwrap()["id"], 2);
}

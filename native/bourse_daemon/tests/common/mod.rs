//! Helpers for the tests that run the built `bourse_daemon` binary.

#![allow(dead_code)] // Each test file uses its own subset.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::ops::Deref;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

pub mod load;
pub mod proxy;

pub const DAEMON: &str = env!("CARGO_BIN_EXE_bourse_daemon");

/// The binary under test: `BOURSE_DAEMON_UNDER_TEST` (to run these tests against another
/// build), else this build's.
pub fn daemon_binary() -> String {
    std::env::var("BOURSE_DAEMON_UNDER_TEST").unwrap_or_else(|_| DAEMON.to_string())
}
/// The shared secret of the daemons these tests start (given in their environment).
pub const SECRET: &str = "test-secret-0123456789";
/// Generous: the machine is shared with other builds.
pub const PATIENCE: Duration = Duration::from_secs(30);

/// A unique path in the temporary directory.
pub fn temp_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("bourse-test-{}-{name}", std::process::id()))
}

/// A new, empty directory at [`temp_path`], removed with what it holds when dropped.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(name: &str) -> TempDir {
        let path = temp_path(name);
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir(&path).unwrap();
        TempDir(path)
    }
}

impl Deref for TempDir {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for TempDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Sends `signal` (`TERM`, `INT`) with the system's `kill` command.
pub fn signal(child: &Child, signal: &str) {
    let status = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(child.id().to_string())
        .status()
        .expect("run kill");
    assert!(status.success());
}

/// Waits for `child` to exit, killing it after [`PATIENCE`].
pub fn wait_exit(child: &mut Child) -> ExitStatus {
    let deadline = Instant::now() + PATIENCE;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the daemon did not exit within {PATIENCE:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `bourse_daemon --stdio` with `extra`, its stdin and stdout piped, its stderr dropped.
fn spawn_port(extra: &[&str]) -> Child {
    Command::new(daemon_binary())
        .arg("--stdio")
        .args(extra)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn bourse_daemon --stdio")
}

/// Starts a port (`--stdio` and `extra`) whose stdout nobody reads, keeps sending it checks
/// until its answers fill stdout, then sends SIGTERM; returns how the daemon exited.
pub fn sigterm_with_stdout_unread(extra: &[&str]) -> ExitStatus {
    let mut child = spawn_port(extra);
    let stdin = child.stdin.take().expect("stdin");
    let status = sigterm_with_answers_unread(&mut child, stdin);
    drop(child.stdout.take());
    status
}

/// Keeps writing checks to `input`, the stdin of the port `child`, and reads none of its
/// answers, until they fill its output; then sends SIGTERM and returns how it exited.
pub fn sigterm_with_answers_unread<W: Write + Send + 'static>(
    child: &mut Child,
    mut input: W,
) -> ExitStatus {
    let request = json!({"op": "check", "key": {"exchange": "unread", "credential": null},
                         "limit": {"capacity": 1, "refill_per_sec": 0.001}});
    let frame = frame(&serde_json::to_vec(&request).unwrap());
    // Ends with a failed write once the daemon is gone.
    std::thread::spawn(move || while input.write_all(&frame).is_ok() {});
    // Far more answers than the output's buffers and the daemon's take, even through Redis.
    std::thread::sleep(Duration::from_millis(500));
    signal(child, "TERM");
    wait_exit(child)
}

/// Requests whose answers far outnumber what the sockets' buffers hold (loopback TCP takes
/// several MB), written to `stream` from a thread of its own that never reads an answer;
/// it ends once its write fails (the connection was shut down or closed) or after 30 MB.
pub fn flood_unread<S: Write + Send + 'static>(mut stream: S) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let lines = b"{\"op\":\"hello\"}\n".repeat(1000);
        for _ in 0..2000 {
            if stream.write_all(&lines).is_err() {
                break;
            }
        }
    })
}

/// A frame that never ends: its start, then one more byte every 50 ms (a slowloris), from
/// a thread of its own; it ends once a write fails (the connection was closed) or after
/// 10 s. Answers whether the daemon closed the connection.
pub fn never_ending_frame<S: Write + Send + 'static>(
    mut stream: S,
) -> std::thread::JoinHandle<bool> {
    std::thread::spawn(move || {
        if stream.write_all(b"{\"op\":\"hello\"").is_err() {
            return true;
        }
        for _ in 0..200 {
            std::thread::sleep(Duration::from_millis(50));
            if stream.write_all(b" ").is_err() {
                return true;
            }
        }
        false
    })
}

/// Whether a new client of the Unix socket `socket` is served (not refused) within `within`.
pub fn served_within(socket: &std::path::Path, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        let mut client = LineClient::new(UnixStream::connect(socket).unwrap());
        if client.call(serde_json::json!({"op": "hello"}))["ok"] == true {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// Sends 2000 `hello`s to the daemon at `socket` while reading the answers 4 KiB every
/// 50 ms; fails unless every answer arrives and every request could be sent. Each read takes
/// 4 KiB, far less than the socket must be rid of before it takes more: with an idle
/// timeout of 1 s, what the client reads in one is ten of the daemon's 8 KiB parts, and the
/// whole exchange takes about 5 s. (With 300 ms, a loaded machine that held the reading
/// thread that long had the connection closed.)
pub fn read_slowly(socket: &std::path::Path) {
    let stream = UnixStream::connect(socket).unwrap();
    let mut writer = stream.try_clone().unwrap();
    let requests = 2000;
    let sending = std::thread::spawn(move || {
        for id in 0..requests {
            let line = format!("{{\"op\":\"hello\",\"id\":{id}}}\n");
            if writer.write_all(line.as_bytes()).is_err() {
                return false;
            }
        }
        true
    });
    let mut reader = stream;
    reader
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let (mut answers, mut chunk) = (0, [0u8; 4096]);
    while answers < requests {
        std::thread::sleep(Duration::from_millis(50));
        match reader.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(read) => answers += chunk[..read].iter().filter(|&&b| b == b'\n').count(),
        }
    }
    assert_eq!(answers, requests, "closed before the last answer");
    assert!(
        sending.join().unwrap(),
        "closed while the client was sending"
    );
}

/// Polls `probe` until it holds, failing after [`PATIENCE`].
pub fn eventually(what: &str, mut probe: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !probe() {
        assert!(Instant::now() < deadline, "never happened: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The CPU time (user and system) process `pid` used so far, in clock ticks (Linux `/proc`).
pub fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    // The fields after the command name, which is in parentheses.
    let fields: Vec<&str> = stat
        .rsplit_once(") ")
        .expect("a stat line")
        .1
        .split(' ')
        .collect();
    fields[11].parse::<u64>().expect("utime") + fields[12].parse::<u64>().expect("stime")
}

/// After a conversation of one request at a time on `t` (what makes a daemon poll for
/// the next request), the CPU ticks process `pid` uses in one idle second: a daemon that
/// keeps polling an idle connection uses about 100 (a tick is 10 ms).
pub fn idle_cpu_ticks(t: &mut impl Transport, pid: u32) -> u64 {
    let limit = json!({"capacity": 1.0e9, "refill_per_sec": 1.0e9});
    for _ in 0..2000 {
        assert_eq!(
            t.call(check(&key("idle", None), limit.clone(), 1.0))["ok"],
            true
        );
    }
    let before = cpu_ticks(pid);
    std::thread::sleep(Duration::from_secs(1));
    cpu_ticks(pid) - before
}

/// Anything that answers one request at a time.
pub trait Transport {
    /// Sends one frame holding `payload` as is and reads its answer.
    fn call_raw(&mut self, payload: &[u8]) -> Value;

    fn call(&mut self, request: Value) -> Value {
        self.call_raw(&serde_json::to_vec(&request).expect("encode"))
    }
}

/// A daemon in server mode; killed when dropped if still running, and its Unix socket
/// files removed (a killed daemon leaves them).
pub struct Server {
    pub child: Child,
    /// The `listening ...` lines it printed, one per listener.
    pub listening: Vec<String>,
    sockets: Vec<PathBuf>,
}

impl Server {
    pub fn start(args: &[&str]) -> Self {
        let listeners = args
            .iter()
            .filter(|arg| matches!(**arg, "--listen" | "--socket"))
            .count();
        let mut child = Command::new(daemon_binary())
            .args(args)
            .env("BOURSE_DAEMON_SECRET", SECRET)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn bourse_daemon");
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut listening = Vec::new();
        for _ in 0..listeners {
            let mut line = String::new();
            stdout.read_line(&mut line).expect("read listening line");
            assert!(
                line.starts_with("listening "),
                "unexpected first output {line:?}"
            );
            listening.push(line.trim_end().to_string());
        }
        let sockets = args
            .windows(2)
            .filter(|pair| pair[0] == "--socket")
            .map(|pair| PathBuf::from(pair[1]))
            .collect();
        Self {
            child,
            listening,
            sockets,
        }
    }

    /// A daemon on a free loopback TCP port.
    pub fn tcp(extra: &[&str]) -> Self {
        let mut args = vec!["--listen", "127.0.0.1:0"];
        args.extend_from_slice(extra);
        Self::start(&args)
    }

    pub fn tcp_addr(&self) -> String {
        self.listening
            .iter()
            .find_map(|line| line.strip_prefix("listening tcp "))
            .expect("a TCP listener")
            .to_string()
    }

    /// A TCP client that proved the secret.
    pub fn connect(&self) -> LineClient<TcpStream> {
        let mut client = self.connect_unproved();
        authenticate(&mut client, SECRET.as_bytes());
        client
    }

    /// A TCP client that did not prove anything yet.
    pub fn connect_unproved(&self) -> LineClient<TcpStream> {
        let stream = TcpStream::connect(self.tcp_addr()).expect("connect");
        stream.set_nodelay(true).expect("nodelay");
        LineClient::new(stream)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        for socket in &self.sockets {
            let _ = std::fs::remove_file(socket);
        }
    }
}

/// The proof of `secret` over `nonce`: hex HMAC-SHA256, as docs/PROTOCOL.md says.
pub fn proof(secret: &[u8], nonce: &str) -> String {
    use hmac::{Hmac, Mac};
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(secret).expect("hmac key");
    mac.update(nonce.as_bytes());
    mac.finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// `hello`, then `auth` with the proof of `secret`; returns the auth answer.
pub fn authenticate<S: Stream>(client: &mut LineClient<S>, secret: &[u8]) -> Value {
    let hello = client.call(json!({"op": "hello"}));
    let nonce = hello["auth"]["nonce"].as_str().expect("a nonce to prove");
    let answer = client.call(json!({"op": "auth", "proof": proof(secret, nonce)}));
    if secret == SECRET.as_bytes() {
        assert_eq!(answer, json!({"ok": true}));
    }
    answer
}

/// Streams both TCP and Unix sockets can be.
pub trait Stream: Read + Write + Sized {
    fn try_clone_stream(&self) -> Self;
    fn set_timeout(&self, timeout: Duration);
    fn close_write(&self);
}

/// The impl for sockets, whose inherent methods of these names are alike.
macro_rules! socket_stream {
    ($($socket:ty),*) => {$(
        impl Stream for $socket {
            fn try_clone_stream(&self) -> Self {
                self.try_clone().expect("clone")
            }
            fn set_timeout(&self, timeout: Duration) {
                self.set_read_timeout(Some(timeout)).expect("timeout");
            }
            fn close_write(&self) {
                self.shutdown(std::net::Shutdown::Write).expect("shutdown");
            }
        }
    )*};
}

socket_stream!(TcpStream, UnixStream);

/// A newline-delimited JSON client.
pub struct LineClient<S: Stream> {
    pub stream: S,
    reader: BufReader<S>,
}

impl<S: Stream> LineClient<S> {
    pub fn new(stream: S) -> Self {
        stream.set_timeout(PATIENCE);
        let reader = BufReader::new(stream.try_clone_stream());
        Self { stream, reader }
    }

    pub fn send_raw(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).expect("write");
    }

    pub fn send(&mut self, request: &Value) {
        let mut line = serde_json::to_vec(request).expect("encode");
        line.push(b'\n');
        self.send_raw(&line);
    }

    /// The next answer line, or `None` at the end of the stream.
    pub fn recv_line(&mut self) -> Option<String> {
        let mut line = String::new();
        match self.reader.read_line(&mut line).expect("read answer") {
            0 => None,
            _ => {
                assert!(line.ends_with('\n'), "answer without newline: {line:?}");
                Some(line)
            }
        }
    }

    pub fn recv(&mut self) -> Value {
        let line = self
            .recv_line()
            .expect("an answer before the end of the stream");
        serde_json::from_str(&line).expect("answers are JSON")
    }
}

impl<S: Stream> Transport for LineClient<S> {
    fn call_raw(&mut self, payload: &[u8]) -> Value {
        let mut line = payload.to_vec();
        line.push(b'\n');
        self.send_raw(&line);
        self.recv()
    }
}

/// A daemon in `--stdio` mode, spoken to with 4-byte length-prefixed frames.
pub struct StdioDaemon {
    pub child: Child,
    pub stdin: Option<ChildStdin>,
    /// Each answer, with when it was read.
    frames: mpsc::Receiver<(Instant, Vec<u8>)>,
}

impl StdioDaemon {
    pub fn start(extra: &[&str]) -> Self {
        let mut child = spawn_port(extra);
        let stdin = child.stdin.take();
        let mut stdout = child.stdout.take().expect("stdout");
        let (sender, frames) = mpsc::channel();
        std::thread::spawn(move || loop {
            let mut header = [0u8; 4];
            if stdout.read_exact(&mut header).is_err() {
                return;
            }
            let mut frame = vec![0; u32::from_be_bytes(header) as usize];
            if stdout.read_exact(&mut frame).is_err()
                || sender.send((Instant::now(), frame)).is_err()
            {
                return;
            }
        });
        Self {
            child,
            stdin,
            frames,
        }
    }

    pub fn send_raw(&mut self, bytes: &[u8]) {
        self.stdin
            .as_mut()
            .expect("stdin open")
            .write_all(bytes)
            .expect("write stdin");
    }

    pub fn send_frame(&mut self, payload: &[u8]) {
        self.send_raw(&frame(payload));
    }

    /// The next answer frame, or `None` once stdout closed.
    pub fn recv_frame(&mut self) -> Option<Value> {
        self.recv_bytes()
            .map(|frame| serde_json::from_slice(&frame).expect("answers are JSON"))
    }

    /// The next answer frame's bytes, or `None` once stdout closed.
    pub fn recv_bytes(&mut self) -> Option<Vec<u8>> {
        self.recv_read().map(|(_, frame)| frame)
    }

    /// The next answer frame's bytes and when it was read, or `None` once stdout closed.
    pub fn recv_read(&mut self) -> Option<(Instant, Vec<u8>)> {
        match self.frames.recv_timeout(PATIENCE) {
            Ok(read) => Some(read),
            Err(mpsc::RecvTimeoutError::Disconnected) => None,
            Err(mpsc::RecvTimeoutError::Timeout) => panic!("no answer within {PATIENCE:?}"),
        }
    }

    pub fn close_stdin(&mut self) {
        self.stdin = None;
    }
}

impl Transport for StdioDaemon {
    fn call_raw(&mut self, payload: &[u8]) -> Value {
        self.send_frame(payload);
        self.recv_frame().expect("an answer")
    }
}

impl Drop for StdioDaemon {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

pub fn key(exchange: &str, credential: Option<&str>) -> Value {
    json!({"exchange": exchange, "credential": credential})
}

/// `payload` as one `--stdio` frame: its length (4 bytes, big-endian), then itself.
pub fn frame(payload: &[u8]) -> Vec<u8> {
    let mut frame = (payload.len() as u32).to_be_bytes().to_vec();
    frame.extend_from_slice(payload);
    frame
}

/// The `--stdio` frame of a check of cost 1 with `id`.
pub fn check_frame(id: u64, k: &Value, limit: &Value) -> Vec<u8> {
    let request = json!({"id": id, "op": "check", "key": k, "limit": limit, "cost": 1});
    frame(&serde_json::to_vec(&request).unwrap())
}

pub fn check(k: &Value, limit: Value, cost: f64) -> Value {
    json!({"op": "check", "key": k, "limit": limit, "cost": cost})
}

/// What `get_cost` answers for `k`.
pub fn borrowed(t: &mut impl Transport, k: &Value) -> f64 {
    t.call(json!({"op": "get_cost", "key": k}))["borrowed"]
        .as_f64()
        .unwrap()
}

/// Runs every op once with answers that do not depend on timing: limits are slow enough
/// (refill 0.001/s) that nothing refills during a test.
pub fn exercise_every_op(t: &mut impl Transport) {
    let k = key("binance", Some("k1"));
    let slow = json!({"capacity": 2, "refill_per_sec": 0.001});
    let admitted = |t: &mut dyn Transport| {
        t.call(json!({"op": "stats"}))["stats"]["admitted"]
            .as_u64()
            .unwrap()
    };
    let admitted_before = admitted(t);
    let mut hello = t.call(json!({"op": "hello", "id": 1}));
    // Servers close idle connections; a port has none. The in-memory table is named.
    if let Some(fields) = hello.as_object_mut() {
        fields.remove("idle_timeout_ms");
        fields.remove("table");
        assert!(fields
            .remove("clock_us")
            .is_some_and(|clock| clock.is_u64()));
    }
    assert_eq!(
        hello,
        json!({"ok": true, "protocol": 1, "server": concat!("bourse_daemon ", env!("CARGO_PKG_VERSION")),
               "assume_busy_at_start": false, "max_frame_bytes": 4_194_304, "id": 1})
    );
    let check = json!({"op": "check", "key": k, "limit": slow, "id": "c"});
    assert_eq!(
        t.call(check.clone()),
        json!({"ok": true, "result": "admitted", "id": "c"})
    );
    assert_eq!(t.call(check.clone())["result"], "admitted");
    let refused = t.call(check.clone());
    assert_eq!(refused["result"], "delay");
    assert!(refused["ms"].as_u64().unwrap() > 900_000);
    let mut waiter = check.clone();
    waiter["max_wait_ms"] = json!(5000);
    assert_eq!(t.call(waiter)["result"], "over_budget");
    let mut booker = check.clone();
    booker["max_wait_ms"] = json!(4_294_967_295u64);
    booker["owner"] = json!("me");
    assert_eq!(t.call(booker)["result"], "booked");
    assert_eq!(
        t.call(json!({"op": "check", "key": k, "limit": null, "cost": 5}))["result"],
        "admitted"
    );
    let info = t.call(json!({"op": "inspect", "key": k}));
    assert_eq!(info["info"]["bookings"], 1);
    assert_eq!(
        info["info"]["limit"],
        json!({"capacity": 2.0, "refill_per_sec": 0.001})
    );
    assert_eq!(
        t.call(json!({"op": "inspect", "key": key("none", None)})),
        json!({"ok": true, "info": null})
    );

    let ip = json!({"exchange": "binance", "credential": null, "axis": "ip"});
    let many = json!({"op": "check_many", "checks": [
        {"key": ip, "limit": {"requests": 3, "period": 3_000_000}, "cost": 2},
        {"key": ip, "limit": {"capacity": 3, "refill_per_sec": 0.001}},
        {"key": key("okx", None), "limit": null},
    ]});
    assert_eq!(t.call(many.clone())["result"], "admitted");
    assert_eq!(t.call(many)["result"], "delay");
    let borrowed = t.call(json!({"op": "get_cost", "key": ip}))["borrowed"]
        .as_f64()
        .unwrap();
    assert!((2.99..=3.0).contains(&borrowed), "{borrowed}");

    assert_eq!(
        t.call(json!({"op": "record", "key": key("okx", None), "cost": 4})),
        json!({"ok": true})
    );
    assert_eq!(
        t.call(json!({"op": "get_cost", "key": key("okx", None), "period": 1000})),
        json!({"ok": true, "borrowed": 4.0})
    );
    let busiest = t.call(json!({"op": "busiest", "count": 2}));
    assert_eq!(
        busiest["keys"][0]["key"],
        json!({"exchange": "okx", "credential": null, "axis": "request"})
    );

    assert_eq!(
        t.call(json!({"op": "pause", "target": {"exchange": "okx"}, "ms": 60_000})),
        json!({"ok": true})
    );
    let fresh = json!({"op": "check", "key": key("okx", Some("k9")), "limit": {"requests": 10}});
    assert_eq!(t.call(fresh.clone())["result"], "delay");
    assert_eq!(
        t.call(json!({"op": "reset_exchange", "exchange": "okx"})),
        json!({"ok": true})
    );
    assert_eq!(t.call(fresh)["result"], "admitted");
    assert_eq!(
        t.call(json!({"op": "reset", "key": k})),
        json!({"ok": true})
    );
    assert_eq!(t.call(check.clone())["result"], "admitted");

    let stats = t.call(json!({"op": "stats"}));
    assert_eq!(stats["stats"]["bookings"], 0);
    assert_eq!(stats["stats"]["admitted"], admitted_before + 5);
    assert_eq!(t.call(json!({"op": "sweep"}))["ok"], true);
    assert_eq!(t.call(json!({"op": "reset_all"})), json!({"ok": true}));
    assert_eq!(t.call(json!({"op": "stats"}))["stats"]["buckets"], 0);

    exercise_unbook(t);
    exercise_sync_beside_bookings(t);
    assert_eq!(t.call(json!({"op": "reset_all"})), json!({"ok": true}));
}

/// `sync` leaves room in the allowance for the bookings due before the window ends (paid,
/// but not yet counted by the exchange), none for those due after it, and holds those the
/// allowance cannot cover until the window ends.
fn exercise_sync_beside_bookings(t: &mut impl Transport) {
    let slow = json!({"capacity": 10, "refill_per_sec": 0.001});
    let check = |k: &Value, cost: f64| {
        json!({"op": "check", "key": k, "limit": slow, "cost": cost, "owner": 2,
               "max_wait_ms": 4_294_967_295u64})
    };
    let sync = |t: &mut dyn Transport, k: &Value, allowance: f64, window_left_ms: u64| {
        let request = json!({"op": "sync", "key": k, "allowance": allowance,
                             "window_left_ms": window_left_ms});
        t.call(request)["taken"].as_f64().unwrap()
    };
    let k = key("sync", Some("booked"));
    // 2 left, then 3 booked for 1,000 s from now: -1.
    assert_eq!(t.call(check(&k, 8.0))["result"], "admitted");
    assert_eq!(t.call(check(&k, 3.0))["result"], "booked");
    // Due after a window of 500 s: the allowance (0) less its refill (0.5) only.
    let taken = sync(t, &k, 0.0, 500_000);
    assert!(taken < 1e-3, "{taken}");
    // Due within 2,000 s: 2 of the allowance of 3 refill, 3 are booked: -2.
    let taken = sync(t, &k, 3.0, 2_000_000);
    assert!((taken - 1.0).abs() < 1e-3, "{taken}");

    // An allowance of 0 for 3,000 s: the booking goes out once the window ends.
    let k = key("sync", Some("held"));
    assert_eq!(t.call(check(&k, 8.0))["result"], "admitted");
    assert_eq!(t.call(check(&k, 3.0))["result"], "booked");
    let taken = sync(t, &k, 0.0, 3_000_000);
    assert!((taken - 2.0).abs() < 1e-3, "{taken}");
    let early = t.call(check(&k, 3.0));
    assert_eq!(early["result"], "delay", "{early}");
    let ms = early["ms"].as_u64().unwrap();
    assert!((2_999_000..=3_000_000).contains(&ms), "{early}");

    // Held, and paid again as of the window's end, where the cap took part of the refill:
    // the tokens that leaves are lowered no further, and never raised (Redis raised them to
    // the allowance, and admitted past P1 at the window's end).
    let k = key("sync", Some("capped"));
    let small = json!({"capacity": 4, "refill_per_sec": 0.002});
    let check = |cost: f64| {
        json!({"op": "check", "key": k, "limit": small, "cost": cost, "owner": 2,
               "max_wait_ms": 4_294_967_295u64})
    };
    assert_eq!(t.call(check(4.0))["result"], "admitted");
    assert_eq!(t.call(check(3.0))["result"], "booked");
    let taken = sync(t, &k, 2.0, 3_000_000);
    assert!((taken - 2.0).abs() < 1e-3, "{taken}");
}

/// `unbook` gives back a waiter's booking when no booking made after it holds its bucket
/// (else it stays paid), leaving the others' ready times; and a waiter whose booking one
/// of its buckets lost to a reset gets it back on the others when it checks again, paying
/// once (refill 0.001/s: delays are in thousands of seconds, and nothing refills during a
/// test).
fn exercise_unbook(t: &mut impl Transport) {
    let slow = json!({"capacity": 10, "refill_per_sec": 0.001});
    let waiter = |k: &Value, owner: u64, cost: f64| {
        json!({"op": "check", "key": k, "limit": slow, "cost": cost, "owner": owner,
               "max_wait_ms": 4_294_967_295u64})
    };
    let unbook = |k: &Value, owner: u64, cost: f64| {
        json!({"op": "unbook", "checks": [{"key": k, "limit": slow, "cost": cost}],
               "owner": owner, "id": 9})
    };
    // Booked for `ms` from the moment of the first of the calls that set it, read a few ms
    // later on a loaded machine.
    let assert_booked = |answer: Value, ms: u64| {
        assert_eq!(answer["result"], "booked", "{answer}");
        let told = answer["ms"].as_u64().unwrap();
        assert!((ms - 1_000..=ms).contains(&told), "{answer}");
    };

    // 2 left: 3 booked for 1,000 s from now, 1 more behind it for 2,000 s.
    let k = key("unbook", Some("latest"));
    assert_eq!(t.call(waiter(&k, 1, 8.0))["result"], "admitted");
    assert_booked(t.call(waiter(&k, 2, 3.0)), 1_000_000);
    assert_booked(t.call(waiter(&k, 3, 1.0)), 2_000_000);
    let before = borrowed(t, &k);
    assert_eq!(
        t.call(unbook(&k, 2, 3.0)),
        json!({"ok": true, "given_back": false, "id": 9})
    );
    assert!((before - borrowed(t, &k)).abs() < 1e-3, "{before}");
    assert_eq!(t.call(unbook(&k, 3, 2.0))["given_back"], false);
    assert_eq!(t.call(unbook(&k, 3, 1.0))["given_back"], true);
    assert!((before - borrowed(t, &k) - 1.0).abs() < 1e-3, "{before}");
    assert_eq!(t.call(unbook(&k, 3, 1.0))["given_back"], false);
    let early = t.call(waiter(&k, 2, 3.0));
    assert_eq!(early["result"], "delay");
    assert!(
        (999_000..=1_000_000).contains(&early["ms"].as_u64().unwrap()),
        "{early}"
    );
    assert_eq!(t.call(unbook(&k, 2, 3.0))["given_back"], true);
    assert!((before - borrowed(t, &k) - 4.0).abs() < 1e-3, "{before}");

    // 3 left: 4 booked for 1,000 s; 12, over the capacity, for 13,000 s takes everything
    // the bucket can hold then, the first's 4 with it.
    let k = key("unbook", Some("forfeited"));
    assert_eq!(t.call(waiter(&k, 1, 7.0))["result"], "admitted");
    assert_booked(t.call(waiter(&k, 2, 4.0)), 1_000_000);
    assert_booked(t.call(waiter(&k, 3, 12.0)), 13_000_000);
    let before = borrowed(t, &k);
    assert_eq!(t.call(unbook(&k, 2, 4.0))["given_back"], false);
    assert!((before - borrowed(t, &k)).abs() < 1e-3, "{before}");

    // Booked on two buckets, one reset since: checked again, it pays the other once.
    let (reset, kept) = (key("unbook", Some("reset")), key("unbook", Some("kept")));
    assert_eq!(t.call(waiter(&reset, 1, 10.0))["result"], "admitted");
    assert_eq!(t.call(waiter(&kept, 1, 5.0))["result"], "admitted");
    let both = json!({"op": "check_many", "owner": 5, "max_wait_ms": 4_294_967_295u64,
                      "checks": [{"key": reset, "limit": slow}, {"key": kept, "limit": slow}]});
    assert_booked(t.call(both.clone()), 1_000_000);
    assert_eq!(t.call(json!({"op": "reset", "key": reset}))["ok"], true);
    assert_eq!(t.call(both)["result"], "admitted");
    assert!((borrowed(t, &kept) - 6.0).abs() < 1e-3);

    let bad = t.call(json!({"op": "unbook", "checks": "all", "id": 10}));
    assert_eq!(
        (bad["error"]["type"].as_str(), bad["id"].as_u64()),
        (Some("invalid_parameters"), Some(10))
    );
}

/// A lapsed booking is given back (`unbook`) while nothing wrote its bucket since it
/// lapsed, and not once a debit did. The daemon must run with `--booking-slack-ms 1`.
pub fn assert_lapsed_bookings_unbooked_while_untouched(t: &mut impl Transport) {
    let limit = json!({"capacity": 10, "refill_per_sec": 1});
    let waiter = |k: &Value| {
        json!({"op": "check", "key": k, "limit": limit, "cost": 1, "owner": 5,
               "max_wait_ms": 60_000})
    };
    let unbook = |k: &Value| json!({"op": "unbook", "checks": [{"key": k, "limit": limit, "cost": 1}], "owner": 5});
    let untouched = key("lapsed", Some("untouched"));
    let debited = key("lapsed", Some("debited"));
    for k in [&untouched, &debited] {
        let drain = json!({"op": "check", "key": k, "limit": limit, "cost": 10});
        assert_eq!(t.call(drain)["result"], "admitted");
        assert_eq!(t.call(waiter(k))["result"], "booked");
    }
    // Both due in a second, lapsed a millisecond later.
    std::thread::sleep(Duration::from_millis(1_300));
    assert_eq!(
        t.call(json!({"op": "record", "key": debited, "cost": 0.5}))["ok"],
        true
    );
    let before = borrowed(t, &untouched);
    assert_eq!(t.call(unbook(&untouched))["given_back"], true);
    let given = before - borrowed(t, &untouched);
    // And what refilled between the two readings.
    assert!((0.95..=1.1).contains(&given), "{given} given back");
    let before = borrowed(t, &debited);
    assert_eq!(t.call(unbook(&debited))["given_back"], false);
    assert!(borrowed(t, &debited) <= before, "given back past a debit");
}

/// Bad requests get errors naming the problem, echo their id, and the stream goes on.
pub fn exercise_bad_requests(t: &mut impl Transport) {
    let cases: [(&[u8], &str); 8] = [
        (b"{not json", "malformed JSON"),
        (b"\"hello\"", "must be a JSON object"),
        (br#"{"op":"launch","id":3}"#, "unknown op"),
        (br#"{"op":"check","key":{"exchange":"b","credential":null},"limit":{"requests":"5"},"id":4}"#, "requests must be a finite number > 0"),
        (br#"{"op":"check","key":{"exchange":"b","credential":null},"limit":{"requests":5},"cost":-1}"#, "cost"),
        (br#"{"op":"check","key":{"exchange":"b","credential":null},"limit":{"capacity":1,"refill_per_sec":0}}"#, "refill_per_sec"),
        (br#"{"op":"check","key":{"exchange":"b","credential":null},"limit":null,"max_wait_ms":0}"#, "max_wait_ms"),
        (br#"{"op":"pause","target":{"exchange":"b"},"ms":"soon"}"#, "pause (in milliseconds) must be an integer"),
    ];
    let before = t.call(json!({"op": "stats"}))["stats"]["invalid"]
        .as_u64()
        .unwrap();
    for (request, expected) in cases {
        let answer = t.call_raw(request);
        assert_eq!(answer["ok"], false, "{answer}");
        assert_eq!(answer["error"]["type"], "invalid_parameters", "{answer}");
        let message = answer["error"]["message"].as_str().unwrap();
        assert!(message.contains(expected), "{message:?} lacks {expected:?}");
    }
    let answer = t.call_raw(br#"{"op":"launch","id":[3]}"#);
    assert_eq!(answer["id"], json!([3]));
    let stats = t.call(json!({"op": "stats"}))["stats"].clone();
    assert_eq!(
        stats["invalid"].as_u64().unwrap(),
        before + cases.len() as u64 + 1
    );
    assert_eq!(stats["buckets"], 0);
    assert_eq!(t.call(json!({"op": "hello"}))["ok"], true);
}

/// A connection whose hello carries `busy_since_us_ago` sees the buckets new to the store as
/// if empty that long before the hello; buckets the store held, and other connections, are
/// left alone. Keys of `exchange` only.
pub fn assert_busy_start_of_a_connection(
    busy: &mut dyn Transport,
    plain: &mut dyn Transport,
    exchange: &str,
) {
    let limit = json!({"capacity": 10, "refill_per_sec": 1});
    let check_of = |t: &mut dyn Transport, credential: &str, cost: f64| {
        t.call(check(&key(exchange, Some(credential)), limit.clone(), cost))
    };
    let delay = |answer: Value| {
        assert_eq!(answer["result"], "delay", "{answer}");
        answer["ms"].as_u64().unwrap()
    };
    assert_eq!(check_of(plain, "held", 1.0)["result"], "admitted");
    for bad in [
        json!(-1),
        json!(1.5),
        json!("1"),
        json!(9_223_372_036_854_775_808u64),
    ] {
        let answer = busy.call(json!({"op": "hello", "busy_since_us_ago": bad, "id": 2}));
        assert_eq!(answer["error"]["type"], "invalid_parameters", "{answer}");
        assert_eq!(answer["id"], 2, "{answer}");
    }
    let hello = busy.call(json!({"op": "hello", "busy_since_us_ago": 4_000_000}));
    assert_eq!(hello["ok"], true, "{hello}");
    // Started 4 s ago: 4 tokens of 10 accrued since.
    assert_eq!(check_of(busy, "new", 4.0)["result"], "admitted");
    let ms = delay(check_of(busy, "new", 1.0));
    assert!((600..=1_000).contains(&ms), "{ms} ms");
    // Held by the store before: as it was (9 tokens).
    assert_eq!(check_of(busy, "held", 9.0)["result"], "admitted");
    // Another connection sees new buckets full.
    assert_eq!(check_of(plain, "other", 10.0)["result"], "admitted");
    // A hello without the field keeps the start; one with 0 starts it now.
    assert_eq!(busy.call(json!({"op": "hello"}))["ok"], true);
    assert_eq!(check_of(busy, "kept", 4.0)["result"], "admitted");
    assert_eq!(
        busy.call(json!({"op": "hello", "busy_since_us_ago": 0}))["ok"],
        true
    );
    assert!(delay(check_of(busy, "now", 1.0)) > 600);
}

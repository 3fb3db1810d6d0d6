//! Hostile input against the built daemon, over stdio, TCP and a Unix socket (whose
//! connections are served on threads of their own): random bytes, invalid UTF-8,
//! wrong shapes, numbers beyond a double, 100k-deep nesting, oversized lines, half frames
//! and slow clients. The daemon never crashes, answers every frame it could read (with
//! the id when it could read one), and still serves a valid request afterwards.

mod common;

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use serde_json::{json, Value};

use common::{key, temp_path, LineClient, Server, StdioDaemon, Transport};

/// xorshift64*: reproducible input without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }

    /// A JSON value of a random shape, `depth` levels at most.
    fn value(&mut self, depth: u32) -> String {
        let scalars = [
            "null",
            "true",
            "0",
            "-1",
            "1.5",
            "1e400",
            "-1e400",
            "1e-400",
            "9007199254740993",
            "18446744073709551616",
            "\"\"",
            "\"binance\"",
            "\"\\u0000\"",
            "\"\\ud800\"",
            "\"ip\"",
            "1e12",
            "4294967296",
        ];
        match self.below(if depth == 0 { 2 } else { 5 }) {
            0 => self.pick(&scalars).to_string(),
            1 => format!("\"{}\"", "x".repeat(self.below(1100) as usize)),
            2 => {
                let items: Vec<String> =
                    (0..self.below(4)).map(|_| self.value(depth - 1)).collect();
                format!("[{}]", items.join(","))
            }
            _ => {
                let names = [
                    "op",
                    "key",
                    "limit",
                    "cost",
                    "exchange",
                    "credential",
                    "axis",
                    "capacity",
                    "refill_per_sec",
                    "requests",
                    "period",
                    "checks",
                    "owner",
                    "max_wait_ms",
                    "target",
                    "ms",
                    "count",
                    "allowance",
                    "window_left_ms",
                    "proof",
                    "zzz",
                ];
                let fields: Vec<String> = (0..self.below(5))
                    .map(|_| format!("\"{}\":{}", self.pick(&names), self.value(depth - 1)))
                    .collect();
                format!("{{{}}}", fields.join(","))
            }
        }
    }

    /// A request-like object: a real op and fields of random shapes (never another `id`).
    fn request(&mut self, id: u64) -> String {
        let ops = [
            "check",
            "check_many",
            "record",
            "get_cost",
            "sync",
            "reset",
            "reset_exchange",
            "pause",
            "inspect",
            "busiest",
            "stats",
            "hello",
            "auth",
            "nope",
        ];
        let mut fields = vec![format!("\"op\":\"{}\"", self.pick(&ops))];
        for _ in 0..self.below(4) {
            let body = self.value(3);
            if let Some(inner) = body.strip_prefix('{').and_then(|b| b.strip_suffix('}')) {
                if !inner.is_empty() {
                    fields.push(inner.to_string());
                }
            }
        }
        format!("{{\"id\":{id},{}}}", fields.join(","))
    }

    /// Bytes with no newline and not all blank.
    fn bytes(&mut self) -> Vec<u8> {
        let mut bytes: Vec<u8> = (0..1 + self.below(300))
            .map(|_| self.next() as u8)
            .map(|b| if b == b'\n' || b == b'\r' { b'?' } else { b })
            .collect();
        bytes[0] = b'#';
        bytes
    }
}

/// The frames of one run: each with the id its answer must carry, if any.
fn frames(seed: u64) -> Vec<(Vec<u8>, Option<u64>)> {
    let mut rng = Rng(seed);
    let mut frames = Vec::new();
    for id in 0..400 {
        match id % 4 {
            0 => frames.push((rng.bytes(), None)),
            1 => {
                // Invalid UTF-8 after a readable id.
                let mut frame = format!("{{\"id\":{id},\"op\":\"").into_bytes();
                frame.extend_from_slice(&[0xff, 0xfe, 0xc3]);
                frame.extend_from_slice(b"\"}");
                frames.push((frame, Some(id)));
            }
            _ => frames.push((rng.request(id).into_bytes(), Some(id))),
        }
    }
    let k = json!({"exchange": "f", "credential": "k"});
    let big = "9".repeat(400);
    for (id, frame) in [
        (
            1000,
            format!(
                r#"{{"id":1000,"op":"check","key":{k},"limit":{{"capacity":{big},"refill_per_sec":1}}}}"#
            ),
        ),
        (
            1001,
            format!(
                r#"{{"id":1001,"op":"check","key":{k},"limit":{{"capacity":1,"refill_per_sec":1e400}}}}"#
            ),
        ),
        (
            1002,
            format!(
                r#"{{"id":1002,"op":"check","key":{k},"limit":{{"requests":1}},"cost":-1e400}}"#
            ),
        ),
        (
            1003,
            format!(
                r#"{{"id":1003,"op":"check","key":{k},"limit":{}}}"#,
                "[".repeat(100_000)
            ),
        ),
        (
            1004,
            format!(
                r#"{{"id":1004,"op":"check_many","checks":[{}]}}"#,
                vec!["{}"; 2000].join(",")
            ),
        ),
    ] {
        frames.push((frame.into_bytes(), Some(id)));
    }
    frames
}

/// Checks the answers of `frames` (`answers` in any order) and that a valid request works.
fn judge(frames: &[(Vec<u8>, Option<u64>)], answers: Vec<Value>, t: &mut impl Transport) {
    assert_eq!(answers.len(), frames.len(), "one answer per frame");
    let mut ids: Vec<u64> = answers.iter().filter_map(|a| a["id"].as_u64()).collect();
    ids.sort_unstable();
    let mut expected: Vec<u64> = frames.iter().filter_map(|(_, id)| *id).collect();
    expected.sort_unstable();
    assert_eq!(ids, expected, "every readable id answered");
    for answer in &answers {
        assert!(answer["ok"].is_boolean(), "{answer}");
        if answer["ok"] == false {
            let kind = answer["error"]["type"].as_str().unwrap_or_default();
            assert!(
                ["invalid_parameters", "unauthorized"].contains(&kind),
                "{answer}"
            );
            assert!(
                answer["id"].is_u64() || answer["frame"].is_u64(),
                "unattributed: {answer}"
            );
            let message = answer["error"]["message"].as_str().unwrap();
            assert!(message.len() < 400, "{message}");
        }
    }
    let answer = t.call(
        json!({"op": "check", "key": key("after", None), "limit": {"requests": 5}, "id": "z"}),
    );
    assert_eq!(answer, json!({"ok": true, "result": "admitted", "id": "z"}));
}

#[test]
fn stdio_answers_every_hostile_frame_and_goes_on() {
    for seed in [1, 2] {
        let frames = frames(0x9e37_79b9_7f4a_7c15 ^ seed);
        let mut daemon = StdioDaemon::start(&["--max-frame-bytes", "1048576"]);
        for (frame, _) in &frames {
            daemon.send_frame(frame);
        }
        let answers = (0..frames.len())
            .map(|_| daemon.recv_frame().expect("an answer"))
            .collect();
        judge(&frames, answers, &mut daemon);
        // A half frame at the end of the stream is answered and not executed; the daemon
        // exits 0.
        daemon.send_raw(&[0, 0, 0, 50, b'{']);
        daemon.close_stdin();
        let cut = daemon.recv_frame().expect("the cut frame is answered");
        assert_eq!(cut["error"]["type"], "invalid_parameters", "{cut}");
        assert_eq!(daemon.recv_frame(), None);
        assert_eq!(common::wait_exit(&mut daemon.child).code(), Some(0));
    }
}

#[test]
fn tcp_answers_every_hostile_line_and_goes_on() {
    let server = Server::tcp(&["--max-frame-bytes", "1048576"]);
    let frames = frames(7);
    let mut client = server.connect();
    // Written by another thread: the daemon answers while it reads.
    let mut writer = client.stream.try_clone().unwrap();
    let lines: Vec<u8> = frames
        .iter()
        .flat_map(|(frame, _)| frame.iter().copied().chain([b'\n']))
        .collect();
    let sending = std::thread::spawn(move || writer.write_all(&lines).unwrap());
    let answers = (0..frames.len()).map(|_| client.recv()).collect();
    sending.join().unwrap();
    judge(&frames, answers, &mut client);

    // A slow client, one byte at a time.
    let mut slow = server.connect();
    let request =
        br#"{"id":5,"op":"check","key":{"exchange":"s","credential":null},"limit":{"requests":2}}"#;
    for byte in request.iter().chain(b"\n") {
        slow.send_raw(&[*byte]);
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(slow.recv()["result"], "admitted");

    // An oversized line: an error, then the connection closes; others go on.
    let mut big = server.connect();
    big.send_raw(&vec![b'x'; 2 * 1048576]);
    assert_eq!(big.recv()["error"]["type"], "frame_too_large");
    // A half frame, then the client goes away.
    let mut half = server.connect();
    half.send_raw(br#"{"id":6,"op":"ch"#);
    half.stream.shutdown(std::net::Shutdown::Write).unwrap();
    let answer = half.recv();
    assert_eq!(answer["error"]["type"], "invalid_parameters", "{answer}");
    // Unproved clients sending garbage are answered too.
    let mut stranger = server.connect_unproved();
    let answer = stranger.call_raw(b"\xff\xfe garbage");
    assert_eq!(answer["error"]["type"], "invalid_parameters", "{answer}");
    let answer = stranger.call(json!({"id": 9, "op": "reset_all"}));
    assert_eq!(
        (answer["error"]["type"].as_str(), answer["id"].as_u64()),
        (Some("unauthorized"), Some(9))
    );

    let mut fresh = server.connect();
    assert_eq!(fresh.call(json!({"op": "hello"}))["ok"], true);
}

#[test]
fn unix_answers_every_hostile_line_and_goes_on() {
    let path = temp_path("fuzz.sock");
    let socket = path.to_str().unwrap();
    let mut server = Server::start(&["--socket", socket, "--max-frame-bytes", "1048576"]);
    let connect = || LineClient::new(UnixStream::connect(&path).expect("connect"));
    for seed in [11, 12] {
        let frames = frames(seed);
        let mut client = connect();
        // Written by another thread: the daemon answers while it reads.
        let mut writer = client.stream.try_clone().unwrap();
        let lines: Vec<u8> = frames
            .iter()
            .flat_map(|(frame, _)| frame.iter().copied().chain([b'\n']))
            .collect();
        let sending = std::thread::spawn(move || writer.write_all(&lines).unwrap());
        let answers = (0..frames.len()).map(|_| client.recv()).collect();
        sending.join().unwrap();
        judge(&frames, answers, &mut client);
    }

    // A slow client, one byte at a time, beside a busy one.
    let mut busy = connect();
    let mut slow = connect();
    let request =
        br#"{"id":5,"op":"check","key":{"exchange":"s","credential":null},"limit":{"requests":2}}"#;
    for byte in request.iter().chain(b"\n") {
        slow.send_raw(&[*byte]);
        assert_eq!(busy.call(json!({"op": "hello", "id": 1}))["id"], 1);
    }
    assert_eq!(slow.recv()["result"], "admitted");

    // An oversized line: an error, then the connection closes; others go on.
    let mut big = connect();
    big.send_raw(&vec![b'x'; 2 * 1048576]);
    assert_eq!(big.recv()["error"]["type"], "frame_too_large");
    // A half frame, then the client goes away.
    let mut half = connect();
    half.send_raw(br#"{"id":6,"op":"ch"#);
    half.stream.shutdown(std::net::Shutdown::Write).unwrap();
    let answer = half.recv();
    assert_eq!(answer["error"]["type"], "invalid_parameters", "{answer}");
    assert_eq!(busy.call(json!({"op": "hello", "id": 2}))["id"], 2);

    // SIGTERM: the requests already read are answered, then the daemon exits 0.
    let mut last = connect();
    let check = json!({"op": "check", "key": key("t", None), "limit": {"requests": 1000}});
    for id in 0..200 {
        let mut request = check.clone();
        request["id"] = json!(id);
        last.send_raw(format!("{request}\n").as_bytes());
    }
    assert_eq!(last.recv()["id"], 0);
    common::signal(&server.child, "TERM");
    assert_eq!(common::wait_exit(&mut server.child).code(), Some(0));
    let mut answered = 1;
    while let Some(line) = last.recv_line() {
        let answer: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(answer["id"], answered, "{answer}");
        answered += 1;
    }
    assert!(answered <= 200);
    assert!(!path.exists(), "the socket file outlived the daemon");
}

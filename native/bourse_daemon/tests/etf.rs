//! The external term format against the built daemon, over stdio, a Unix socket and TCP:
//! chosen by the first `hello`, then hostile terms (random bytes, 100k-deep nesting, counts
//! and lengths beyond the frame, compressed terms, non-UTF-8 binaries, empty frames, JSON).
//! The daemon never crashes, answers every frame with a term (with the id when it could read
//! one), stays within bounded memory, and still serves a valid request afterwards.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;

use common::{proof, temp_path, Server, StdioDaemon, PATIENCE, SECRET};

const HELLO: &[u8] = br#"{"op":"hello","codec":"etf","id":0}"#;

/// `:erlang.term_to_binary(%{id: 5, op: "check", key: %{exchange: "binance",
/// credential: nil, axis: "ip"}, limit: %{capacity: 10, refill_per_sec: 1.5}, cost: 1,
/// owner: "<0.1.0>", max_wait_ms: 70000})` (OTP 25).
const CHECK: &[u8] = include_bytes!("terms/check.etf");

fn binary(bytes: &[u8]) -> Vec<u8> {
    let mut term = vec![b'm'];
    term.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
    term.extend_from_slice(bytes);
    term
}

/// A map term of binary keys and the given (encoded) values.
fn map(entries: &[(&str, Vec<u8>)]) -> Vec<u8> {
    let mut term = vec![131, b't'];
    term.extend_from_slice(&(entries.len() as u32).to_be_bytes());
    for (name, value) in entries {
        term.extend(binary(name.as_bytes()));
        term.extend_from_slice(value);
    }
    term
}

/// The id bytes every answer to a request with `id` (a small integer) starts with.
fn answer_to(id: u8) -> Vec<u8> {
    let mut prefix = vec![131, b't'];
    prefix.extend_from_slice(&[0, 0, 0]);
    prefix.push(0); // The arity's last byte is not compared.
    prefix.extend(binary(b"id"));
    prefix.extend_from_slice(&[b'a', id]);
    prefix
}

fn has_id(answer: &[u8], id: u8) -> bool {
    let prefix = answer_to(id);
    answer.len() > prefix.len()
        && answer[..5] == prefix[..5]
        && answer[6..prefix.len()] == prefix[6..]
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack
        .windows(needle.len())
        .any(|window| window == needle)
}

/// xorshift64*: reproducible input without a dependency.
fn random_bytes(seed: &mut u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|_| {
            *seed ^= *seed >> 12;
            *seed ^= *seed << 25;
            *seed ^= *seed >> 27;
            (seed.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8
        })
        .collect()
}

/// Hostile frames, each with the id its answer must carry, if any.
fn hostile() -> Vec<(Vec<u8>, Option<u8>)> {
    let mut seed = 0x9e37_79b9_7f4a_7c15;
    let mut frames: Vec<(Vec<u8>, Option<u8>)> = Vec::new();
    for _ in 0..200 {
        let mut frame = vec![131];
        let len = 1 + (random_bytes(&mut seed, 1)[0] as usize);
        frame.extend(random_bytes(&mut seed, len));
        frames.push((frame, None));
    }
    let mut deep = vec![131];
    for _ in 0..100_000 {
        deep.extend_from_slice(&[b'h', 1]);
    }
    deep.push(b'j');
    frames.push((deep, None));
    frames.push((vec![131, b'l', 255, 255, 255, 255, b'j'], None));
    frames.push((vec![131, b'm', 255, 255, 255, 255], None));
    frames.push((vec![131, b't', 255, 255, 255, 255], None));
    frames.push((vec![131, b'P', 0, 0x10, 0, 0, 120, 156, 1, 2, 3], None));
    frames.push((Vec::new(), None));
    frames.push((br#"{"op":"hello"}"#.to_vec(), None));
    // A map of 100k keys: read as its shape, never held.
    let mut wide = vec![131, b't'];
    wide.extend_from_slice(&100_000u32.to_be_bytes());
    for _ in 0..100_000 {
        wide.extend_from_slice(&[b'a', 1, b'a', 1]);
    }
    frames.push((wide, None));
    // The id read before the fault: a binary that is not UTF-8, then bytes cut short.
    frames.push((
        map(&[("id", vec![b'a', 7]), ("op", vec![b'm', 0, 0, 0, 1, 0xff])]),
        Some(7),
    ));
    let mut cut = map(&[("id", vec![b'a', 8]), ("op", binary(b"check"))]);
    cut[5] = 3;
    frames.push((cut, Some(8)));
    // Readable terms that are no request.
    frames.push((
        map(&[("id", vec![b'a', 9]), ("op", vec![b'h', 0])]),
        Some(9),
    ));
    frames.push((vec![131, b'h', 2, b'a', 1, b'a', 2], None));
    frames
}

/// Checks one answer per hostile frame (in order), then that a valid request works.
fn judge(frames: &[(Vec<u8>, Option<u8>)], answers: &[Vec<u8>]) {
    assert_eq!(answers.len(), frames.len(), "one answer per frame");
    for ((frame, id), answer) in frames.iter().zip(answers) {
        let shown = &frame[..frame.len().min(16)];
        assert_eq!(answer.first(), Some(&131), "{shown:?}: {answer:?}");
        assert!(
            contains(answer, b"invalid_parameters"),
            "{shown:?}: {answer:?}"
        );
        assert!(answer.len() < 600, "{shown:?}: {} bytes", answer.len());
        match id {
            Some(id) => assert!(has_id(answer, *id), "{shown:?}: {answer:?}"),
            None => assert!(
                contains(&answer[..20], b"frame"),
                "{shown:?}: unattributed {answer:?}"
            ),
        }
    }
}

fn admitted(answer: &[u8]) {
    assert!(has_id(answer, 5), "{answer:?}");
    assert!(contains(answer, b"admitted"), "{answer:?}");
}

/// The daemon's peak resident memory, in kB.
fn peak_kb(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|kb| kb.trim().trim_end_matches(" kB").parse().ok())
        .expect("VmHWM")
}

#[test]
fn stdio_reads_terms_after_the_first_hello_and_survives_hostile_ones() {
    let mut daemon = StdioDaemon::start(&["--max-frame-bytes", "1048576"]);
    daemon.send_frame(HELLO);
    let hello = daemon.recv_bytes().expect("a hello");
    assert!(has_id(&hello, 0), "{hello:?}");
    assert!(contains(&hello, b"protocol"));
    let frames = hostile();
    for (frame, _) in &frames {
        daemon.send_frame(frame);
    }
    let answers: Vec<Vec<u8>> = (0..frames.len())
        .map(|_| daemon.recv_bytes().expect("an answer"))
        .collect();
    judge(&frames, &answers);
    daemon.send_frame(CHECK);
    admitted(&daemon.recv_bytes().expect("an answer"));
    assert!(peak_kb(daemon.child.id()) < 256 * 1024);
    // A half frame at the end of the stream is answered, as a term, and not executed; the
    // daemon exits 0.
    daemon.send_raw(&[0, 0, 0, 50, 131]);
    daemon.close_stdin();
    let cut = daemon.recv_bytes().expect("the cut frame is answered");
    assert!(contains(&cut, b"the stream ended in the middle of a frame"));
    assert_eq!(daemon.recv_bytes(), None);
    assert_eq!(common::wait_exit(&mut daemon.child).code(), Some(0));
}

/// A socket client after its JSON hello: length-prefixed terms both ways.
struct TermClient<S: Read + Write> {
    stream: S,
}

impl<S: Read + Write> TermClient<S> {
    /// Asks for the external term format; its hello answer.
    fn open(mut stream: S) -> (Self, Vec<u8>) {
        stream.write_all(HELLO).unwrap();
        stream.write_all(b"\n").unwrap();
        let mut client = Self { stream };
        let hello = client.recv().expect("a hello");
        assert!(has_id(&hello, 0), "{hello:?}");
        (client, hello)
    }

    fn send(&mut self, frame: &[u8]) {
        self.stream
            .write_all(&(frame.len() as u32).to_be_bytes())
            .unwrap();
        self.stream.write_all(frame).unwrap();
    }

    /// The next frame, or `None` at the end of the stream.
    fn recv(&mut self) -> Option<Vec<u8>> {
        let mut header = [0u8; 4];
        self.stream.read_exact(&mut header).ok()?;
        let mut frame = vec![0; u32::from_be_bytes(header) as usize];
        self.stream.read_exact(&mut frame).ok()?;
        Some(frame)
    }

    fn call(&mut self, frame: &[u8]) -> Vec<u8> {
        self.send(frame);
        self.recv().expect("an answer")
    }
}

#[test]
fn a_unix_socket_reads_terms_after_the_first_hello_and_survives_hostile_ones() {
    let path = temp_path("etf.sock");
    let server = Server::start(&[
        "--socket",
        path.to_str().unwrap(),
        "--max-frame-bytes",
        "1048576",
    ]);
    let stream = UnixStream::connect(&path).unwrap();
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    let (mut client, _) = TermClient::open(stream.try_clone().unwrap());
    let frames = hostile();
    // Written by another thread: the daemon answers while it reads.
    let mut writer = TermClient {
        stream: stream.try_clone().unwrap(),
    };
    let sent = frames.clone();
    let sending = std::thread::spawn(move || {
        for (frame, _) in &sent {
            writer.send(frame);
        }
    });
    let answers: Vec<Vec<u8>> = (0..frames.len())
        .map(|_| client.recv().expect("an answer"))
        .collect();
    sending.join().unwrap();
    judge(&frames, &answers);
    admitted(&client.call(CHECK));
    assert!(peak_kb(server.child.id()) < 256 * 1024);

    // A frame announced longer than the limit: an error, then the connection closes.
    let (mut big, _) = TermClient::open(UnixStream::connect(&path).unwrap());
    big.stream.write_all(&[0, 0x20, 0, 0, 131]).unwrap();
    let answer = big.recv().expect("an answer");
    assert!(contains(&answer, b"frame_too_large"), "{answer:?}");
    assert_eq!(big.recv(), None);
    // A half frame, then the client goes away: answered, not executed.
    let (mut half, _) = TermClient::open(UnixStream::connect(&path).unwrap());
    half.stream.write_all(&[0, 0, 0, 50, 131, b't']).unwrap();
    half.stream.shutdown(std::net::Shutdown::Write).unwrap();
    let answer = half.recv().expect("an answer");
    assert!(contains(&answer, b"the stream ended"), "{answer:?}");
}

#[test]
fn tcp_proves_the_secret_in_terms() {
    let server = Server::tcp(&[]);
    let stream = TcpStream::connect(server.tcp_addr()).unwrap();
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    let (mut client, hello) = TermClient::open(stream);
    let at = hello
        .windows(5)
        .position(|window| window == b"nonce")
        .expect("a nonce to prove");
    // "nonce", then the binary tag, its 4-byte length and 64 hex digits.
    let nonce = std::str::from_utf8(&hello[at + 10..at + 74]).unwrap();
    let answer = client.call(CHECK);
    assert!(
        contains(&answer, b"unauthorized") && has_id(&answer, 5),
        "{answer:?}"
    );
    let auth = map(&[
        ("op", binary(b"auth")),
        ("proof", binary(proof(SECRET.as_bytes(), nonce).as_bytes())),
    ]);
    let answer = client.call(&auth);
    assert!(
        contains(&answer, b"ok") && !contains(&answer, b"error"),
        "{answer:?}"
    );
    admitted(&client.call(CHECK));
}

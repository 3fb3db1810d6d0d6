//! Server mode: loopback TCP and Unix sockets, newline-delimited JSON, many clients.

mod common;

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::thread;
use std::time::Duration;

use serde_json::{json, Value};

use common::{eventually, key, LineClient, Server, Stream, Transport};

#[test]
fn every_op_over_tcp_and_unix() {
    let path = common::temp_path("ops.sock");
    let server = Server::start(&[
        "--listen",
        "127.0.0.1:0",
        "--socket",
        path.to_str().unwrap(),
    ]);
    assert_eq!(server.listening.len(), 2);
    let port: u16 = server
        .tcp_addr()
        .rsplit(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert_ne!(port, 0, "the real port is printed");
    common::exercise_every_op(&mut server.connect());
    let mut unix = LineClient::new(UnixStream::connect(&path).unwrap());
    common::exercise_every_op(&mut unix);
}

#[test]
fn a_lapsed_booking_is_unbooked_only_while_nothing_wrote_its_bucket() {
    let server = Server::tcp(&["--booking-slack-ms", "1"]);
    common::assert_lapsed_bookings_unbooked_while_untouched(&mut server.connect());
}

#[test]
fn a_connection_assumes_buckets_busy_from_the_start_its_hello_names() {
    let server = Server::tcp(&[]);
    common::assert_busy_start_of_a_connection(
        &mut server.connect(),
        &mut server.connect(),
        "binance",
    );
}

#[test]
fn bad_requests_are_answered_and_the_connection_goes_on() {
    let server = Server::tcp(&[]);
    let mut client = server.connect();
    common::exercise_bad_requests(&mut client);
    // Blank lines are skipped and `\r\n` endings accepted, as netcat sends them.
    client.send_raw(b"\n  \r\n{\"op\":\"hello\",\"id\":9}\r\n");
    assert_eq!(client.recv()["id"], 9);
}

#[test]
fn a_thousand_pipelined_requests_answer_in_order() {
    let server = Server::tcp(&[]);
    let mut client = server.connect();
    let mut batch = Vec::new();
    for i in 0..1000 {
        let request = json!({"op": "check", "key": key("e", None),
                             "limit": {"capacity": 500, "refill_per_sec": 0.001}, "id": i});
        batch.extend_from_slice(&serde_json::to_vec(&request).unwrap());
        batch.push(b'\n');
    }
    let mut stream = client.stream.try_clone_stream();
    let writer = thread::spawn(move || stream.write_all(&batch).unwrap());
    let mut admitted = 0;
    for i in 0..1000 {
        let answer = client.recv();
        assert_eq!(answer["id"], i);
        admitted += usize::from(answer["result"] == "admitted");
    }
    writer.join().unwrap();
    assert_eq!(admitted, 500);
}

#[test]
fn clients_share_one_bucket() {
    let server = Server::tcp(&[]);
    let addr = server.tcp_addr();
    let workers: Vec<_> = (0..8)
        .map(|_| {
            let addr = addr.clone();
            thread::spawn(move || {
                let mut client = LineClient::new(std::net::TcpStream::connect(addr).unwrap());
                common::authenticate(&mut client, common::SECRET.as_bytes());
                (0..20)
                    .filter(|_| {
                        let answer = client.call(json!({"op": "check", "key": key("shared", Some("k")),
                                                         "limit": {"capacity": 50, "refill_per_sec": 0.001}}));
                        answer["result"] == "admitted"
                    })
                    .count()
            })
        })
        .collect();
    let admitted: usize = workers.into_iter().map(|w| w.join().unwrap()).sum();
    assert_eq!(admitted, 50);
}

#[test]
fn each_start_names_its_own_table_and_every_connection_sees_it() {
    let table = |server: &Server| server.connect().call(json!({"op": "hello"}))["table"].clone();
    let first = Server::tcp(&[]);
    let second = Server::tcp(&[]);
    assert!(table(&first).is_string());
    assert_eq!(table(&first), table(&first));
    assert_ne!(table(&first), table(&second));
}

#[test]
fn oversized_frames_get_an_error_then_the_connection_closes() {
    let server = Server::tcp(&["--max-frame-bytes", "1024"]);
    // A long line that arrives whole...
    let mut client = server.connect();
    let padding = "x".repeat(2000);
    client.send_raw(format!("{{\"op\":\"hello\",\"pad\":\"{padding}\"}}\n").as_bytes());
    let answer = client.recv();
    assert_eq!(answer["error"]["type"], "frame_too_large");
    assert!(client.recv_line().is_none());
    // ...answered with the id that leads it, whole or not ended...
    for end in ["\n", ""] {
        let mut client = server.connect();
        let frame = format!("{{\"id\":7,\"op\":\"hello\",\"pad\":\"{padding}\"}}{end}");
        client.send_raw(frame.as_bytes());
        let answer = client.recv();
        assert_eq!(answer["error"]["type"], "frame_too_large", "{answer}");
        assert_eq!(answer["id"], 7, "{answer}");
        assert!(client.recv_line().is_none());
    }
    // ...and one that never ends.
    let mut client = server.connect();
    assert_eq!(client.call(json!({"op": "hello"}))["ok"], true);
    client.send_raw(&[b' '; 4096]);
    assert_eq!(client.recv()["error"]["type"], "frame_too_large");
    assert!(client.recv_line().is_none());
    // ...and a client that keeps streaming still reads the error before the close.
    let mut client = server.connect();
    let mut stream = client.stream.try_clone_stream();
    let writer = thread::spawn(move || {
        let chunk = [b'x'; 8192];
        for _ in 0..64 {
            if stream.write_all(&chunk).is_err() {
                break;
            }
        }
    });
    assert_eq!(client.recv()["error"]["type"], "frame_too_large");
    assert!(client.recv_line().is_none());
    writer.join().unwrap();
    // A line just under the limit is fine.
    let mut client = server.connect();
    let padding = "x".repeat(900);
    let answer = client.call_raw(format!("{{\"op\":\"hello\",\"id\":\"{padding}\"}}").as_bytes());
    assert_eq!(answer["ok"], true);
}

#[test]
fn partial_frames_then_disconnect() {
    let server = Server::tcp(&[]);
    // Half-closed after a partial line: told, not executed.
    let mut client = server.connect();
    client.send_raw(br#"{"op":"record","key":{"exchange":"p","credential":null}"#);
    client.stream.close_write();
    let answer = client.recv();
    assert_eq!(answer["error"]["type"], "invalid_parameters");
    assert!(answer["error"]["message"]
        .as_str()
        .unwrap()
        .contains("middle of a frame"));
    assert!(client.recv_line().is_none());
    // Gone entirely in the middle of a line: nothing breaks.
    let mut client = server.connect();
    client.send_raw(br#"{"op":"record","key":{"exch"#);
    drop(client);
    let mut client = server.connect();
    let borrowed = client.call(json!({"op": "get_cost", "key": key("p", None)}));
    assert_eq!(borrowed["borrowed"], 0.0);
    assert_eq!(client.call(json!({"op": "hello"}))["ok"], true);
}

#[test]
fn a_client_vanishing_with_a_booking_leaks_nothing() {
    let server = Server::tcp(&["--booking-slack-ms", "100", "--sweep-interval-ms", "50"]);
    // One token per second: a booking made now is ready in about a second.
    let check = json!({"op": "check", "key": key("gone", Some("k")),
                       "limit": {"capacity": 1, "refill_per_sec": 1}});
    let mut waiter = server.connect();
    assert_eq!(waiter.call(check.clone())["result"], "admitted");
    let mut book = check.clone();
    book["max_wait_ms"] = json!(60_000);
    assert_eq!(waiter.call(book.clone())["result"], "booked");
    drop(waiter);

    let mut other = server.connect();
    // The booked cost stays paid: the bucket is still in debt.
    let refused = other.call(check.clone());
    assert_eq!(refused["result"], "delay", "{refused}");
    // The booking lapses after its slack and is swept; the daemon serves on.
    let mut stats = Value::Null;
    eventually("the booking lapsed", || {
        stats = other.call(json!({"op": "stats"}))["stats"].clone();
        stats["bookings"] == 0 && stats["lapsed"].as_u64() >= Some(1)
    });
    // A new waiter books and claims as usual (if the machine is so slow that its booking
    // lapses before the claim, it books again).
    eventually("a new waiter is admitted", || {
        let answer = other.call(book.clone());
        match answer["result"].as_str() {
            Some("booked" | "delay") => {
                let ms = answer["ms"].as_u64().unwrap();
                std::thread::sleep(std::time::Duration::from_millis(ms));
                false
            }
            Some("claimed" | "admitted") => true,
            _ => panic!("unexpected answer {answer}"),
        }
    });
}

#[test]
fn sigterm_answers_what_was_received_then_exits_zero() {
    let path = common::temp_path("term.sock");
    let mut server = Server::start(&["--socket", path.to_str().unwrap()]);
    let mut client = LineClient::new(UnixStream::connect(&path).unwrap());
    let mut idle = LineClient::new(UnixStream::connect(&path).unwrap());
    assert_eq!(idle.call(json!({"op": "hello"}))["ok"], true);
    let mut batch = Vec::new();
    for i in 0..20 {
        batch.extend_from_slice(format!("{{\"op\":\"hello\",\"id\":{i}}}\n").as_bytes());
    }
    client.send_raw(&batch);
    assert_eq!(client.recv()["id"], 0);
    common::signal(&server.child, "TERM");
    // Whatever was received is answered, in order, each line whole; then the end.
    let mut next = 1;
    while let Some(line) = client.recv_line() {
        let answer: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(answer["id"], next);
        next += 1;
    }
    assert!(idle.recv_line().is_none(), "idle connections are closed");
    assert!(common::wait_exit(&mut server.child).success());
    assert!(!path.exists(), "socket file removed");
    assert!(UnixStream::connect(&path).is_err());
}

/// A socket path replaced while the daemon serves (by a file, or a symlink to one: whoever
/// can write the directory may) is left as it is on exit: the daemon removes only the
/// socket file it bound.
#[test]
fn a_socket_path_replaced_while_serving_is_left_on_exit() {
    let path = common::temp_path("replaced.sock");
    let other = common::temp_path("replaced-other");
    let swapped = common::temp_path("replaced-swapped");
    for symlink in [false, true] {
        let mut server = Server::start(&["--socket", path.to_str().unwrap()]);
        std::fs::write(&other, "not the daemon's").unwrap();
        match symlink {
            false => std::fs::copy(&other, &swapped).map(drop).unwrap(),
            true => std::os::unix::fs::symlink(&other, &swapped).unwrap(),
        }
        std::fs::rename(&swapped, &path).unwrap();
        common::signal(&server.child, "TERM");
        assert!(common::wait_exit(&mut server.child).success());
        let left = std::fs::symlink_metadata(&path).expect("the replacement left");
        assert_eq!(left.file_type().is_symlink(), symlink);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "not the daemon's");
        let _ = std::fs::remove_file(&path);
    }
    let _ = std::fs::remove_file(&other);
}

#[test]
fn sigint_stops_a_server_too() {
    let mut server = Server::tcp(&[]);
    assert_eq!(server.connect().call(json!({"op": "hello"}))["ok"], true);
    common::signal(&server.child, "INT");
    assert!(common::wait_exit(&mut server.child).success());
}

#[test]
fn an_idle_connection_uses_no_cpu() {
    let path = common::temp_path("idle.sock");
    let server = Server::start(&["--socket", path.to_str().unwrap()]);
    let mut client = LineClient::new(UnixStream::connect(&path).unwrap());
    let ticks = common::idle_cpu_ticks(&mut client, server.child.id());
    // Generous: the sweeper's wake-ups and a loaded machine's noise are far below this.
    assert!(ticks <= 10, "{ticks} ticks of CPU in an idle second");
}

/// A Unix connection (served on a thread of its own) is closed after its idle timeout, and
/// after the error answering an oversized frame.
#[test]
fn a_unix_connection_is_closed_when_idle_or_sent_an_oversized_frame() {
    let path = common::temp_path("unix-limits.sock");
    let args = ["--idle-timeout-ms", "300", "--max-frame-bytes", "1024"];
    let _server = Server::start(&[&["--socket", path.to_str().unwrap()][..], &args].concat());
    let mut idle = LineClient::new(UnixStream::connect(&path).unwrap());
    assert_eq!(idle.call(json!({"op": "hello"}))["idle_timeout_ms"], 300);
    thread::sleep(Duration::from_millis(800));
    assert_eq!(idle.recv_line(), None, "still open after its idle timeout");
    let mut client = LineClient::new(UnixStream::connect(&path).unwrap());
    client.send_raw(format!("{{\"op\":\"hello\",\"pad\":\"{}\"}}\n", "x".repeat(2000)).as_bytes());
    assert_eq!(client.recv()["error"]["type"], "frame_too_large");
    assert!(client.recv_line().is_none());
}

/// A Unix client that stops reading its answers holds up only its own connection (its
/// thread waits to write): another client is still answered, and once both close, the
/// threads that served them end.
#[test]
fn a_unix_client_that_stops_reading_holds_up_no_other() {
    let path = common::temp_path("stopped.sock");
    let server = Server::start(&["--socket", path.to_str().unwrap()]);
    let threads = || {
        std::fs::read_dir(format!("/proc/{}/task", server.child.id()))
            .unwrap()
            .count()
    };
    let before = threads();
    let stopped = UnixStream::connect(&path).unwrap();
    let flood = common::flood_unread(stopped.try_clone().unwrap());
    thread::sleep(Duration::from_millis(300));
    let mut other = LineClient::new(UnixStream::connect(&path).unwrap());
    for id in 0..100 {
        assert_eq!(other.call(json!({"op": "hello", "id": id}))["id"], id);
    }
    drop(other);
    assert!(
        !flood.is_finished(),
        "the daemon read the whole flood: it never waited"
    );
    stopped.shutdown(std::net::Shutdown::Both).unwrap();
    flood.join().unwrap();
    drop(stopped);
    eventually("the connections' threads end", || threads() <= before);
}

/// A Unix client's request wakes the daemon once: reading the answer, which frees room in
/// the daemon's socket, does not wake it again (a runtime's reactor watching the socket for
/// room to write would be, once per answer).
#[test]
fn a_unix_client_wakes_the_daemon_once_per_request() {
    let path = common::temp_path("wakes.sock");
    let server = Server::start(&["--socket", path.to_str().unwrap()]);
    let mut client = LineClient::new(UnixStream::connect(&path).unwrap());
    assert_eq!(client.call(json!({"op": "hello"}))["ok"], true);
    let per_request = sleeps_per_spaced_request(&mut client, server.child.id());
    assert!(
        per_request < 1.5,
        "{per_request:.2} times asleep per request"
    );
}

/// A TCP connection, once it proved the secret, is served on a thread of its own, as a
/// Unix one: requests sent in the same write as the proof are answered in order, a later
/// request wakes the daemon once, and the thread ends with the connection.
#[test]
fn a_tcp_connection_is_served_on_a_thread_once_it_proved_the_secret() {
    let server = Server::tcp(&[]);
    let threads = || connection_threads(server.child.id());
    assert_eq!(threads(), 0);
    let mut client = server.connect_unproved();
    let hello = client.call(json!({"op": "hello"}));
    let nonce = hello["auth"]["nonce"].as_str().expect("a nonce to prove");
    let mut frames =
        json!({"op": "auth", "proof": common::proof(common::SECRET.as_bytes(), nonce)}).to_string();
    for id in 0..50 {
        frames.push_str(&format!("\n{}", json!({"op": "hello", "id": id})));
    }
    client.send_raw(format!("{frames}\n").as_bytes());
    assert_eq!(client.recv(), json!({"ok": true}));
    for id in 0..50 {
        assert_eq!(client.recv()["id"], id);
    }
    assert_eq!(threads(), 1, "no thread of its own");
    let per_request = sleeps_per_spaced_request(&mut client, server.child.id());
    assert!(
        per_request < 1.5,
        "{per_request:.2} times asleep per request"
    );
    drop(client);
    eventually("the connection's thread ends", || threads() == 0);
}

/// The threads of process `pid` serving one connection each (named so).
fn connection_threads(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .filter(|name| name.trim_end() == "connection")
        .count()
}

/// How many times the daemon `pid` went to sleep per request of `client`, its requests
/// spaced so that the daemon sleeps, not polls, after it answered and between requests.
fn sleeps_per_spaced_request<S: Stream>(client: &mut LineClient<S>, pid: u32) -> f64 {
    thread::sleep(Duration::from_millis(100));
    let requests = 200;
    let before = sleeps(pid);
    for id in 0..requests {
        client.send(&json!({"op": "hello", "id": id}));
        thread::sleep(Duration::from_millis(1));
        assert_eq!(client.recv()["id"], id);
        thread::sleep(Duration::from_millis(1));
    }
    (sleeps(pid) - before) as f64 / requests as f64
}

/// How many times the threads of process `pid` went to sleep so far (voluntary context
/// switches).
fn sleeps(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("status")).ok())
        .flat_map(|status| {
            status
                .lines()
                .filter_map(|line| line.strip_prefix("voluntary_ctxt_switches:"))
                .map(|count| count.trim().parse::<u64>().unwrap())
                .collect::<Vec<_>>()
        })
        .sum()
}

/// A lone connection in conversation (so that it polls its socket before it sleeps) gets
/// requests one byte at a time, then one cut short by its half-close: each whole request is
/// answered once, the cut one is told it ended mid-frame, and the connection then ends;
/// the daemon still stops at SIGTERM.
#[test]
fn a_polled_connection_reads_requests_byte_by_byte_and_its_end_mid_frame() {
    let path = common::temp_path("bytes.sock");
    let mut server = Server::start(&["--socket", path.to_str().unwrap()]);
    let mut client = LineClient::new(UnixStream::connect(&path).unwrap());
    for id in 0..200 {
        assert_eq!(client.call(json!({"op": "hello", "id": id}))["id"], id);
    }
    for id in 200..203 {
        for byte in format!("{{\"op\":\"hello\",\"id\":{id}}}\n").bytes() {
            client.send_raw(&[byte]);
            thread::sleep(std::time::Duration::from_micros(30));
        }
        assert_eq!(client.recv()["id"], id);
    }
    for byte in br#"{"op":"record","key":{"exchange":"p","credential":null}"# {
        client.send_raw(&[*byte]);
    }
    client.stream.close_write();
    let answer = client.recv();
    assert!(answer["error"]["message"]
        .as_str()
        .unwrap()
        .contains("middle of a frame"));
    assert!(client.recv_line().is_none());
    let mut other = LineClient::new(UnixStream::connect(&path).unwrap());
    let borrowed = other.call(json!({"op": "get_cost", "key": key("p", None)}));
    assert_eq!(borrowed["borrowed"], 0.0);
    common::signal(&server.child, "TERM");
    assert!(common::wait_exit(&mut server.child).success());
}

/// The same requests, hostile ones included, get the same bytes from a Unix connection
/// (served on a thread of its own), a TCP connection (a task of the runtime until it
/// proved the secret, then a thread of its own) and a port:
/// each transport has a daemon of its own, asked the same frames in the same order. A
/// wait's milliseconds may differ by how far apart in time the three were asked.
#[test]
fn a_unix_thread_a_tcp_task_and_a_port_answer_the_same_bytes() {
    let path = common::temp_path("same-bytes.sock");
    let _unix_server = Server::start(&["--socket", path.to_str().unwrap()]);
    let tcp_server = Server::tcp(&[]);
    let mut unix = LineClient::new(UnixStream::connect(&path).unwrap());
    let mut tcp = tcp_server.connect();
    let mut port = common::StdioDaemon::start(&[]);
    // Two frames each, as the TCP client's hello and auth: frame numbers then agree.
    for _ in 0..2 {
        unix.call(json!({"op": "hello"}));
        port.call(json!({"op": "hello"}));
    }
    let slow = r#""limit":{"capacity":2,"refill_per_sec":1e-9}"#;
    let k = r#""key":{"exchange":"binance","credential":"k"}"#;
    let requests: Vec<String> = vec![
        format!(r#"{{"op":"check","id":1,{k},{slow},"cost":1}}"#),
        format!(r#"{{"op":"check","id":[2],{k},{slow},"cost":1.5}}"#),
        format!(r#"{{"op":"check","id":{{"a":null}},{k},{slow},"cost":1}}"#),
        format!(r#"{{"op":"check","id":4,{k},{slow},"cost":1,"max_wait_ms":10}}"#),
        format!(r#"{{"op":"check","id":5,{k},{slow},"cost":1e999}}"#),
        format!(r#"{{"op":"check","id":6,{k},{slow},"cost":18446744073709551616}}"#),
        format!(r#"{{"op":"check","id":7,{k},{slow},"cost":-0.0}}"#),
        format!(r#"{{"op":"check","id":8,{k},{slow},"cost":1,"max_wait_ms":1.5}}"#),
        format!(r#"{{"op":"check","id":9,{k},"limit":{{"capacity":2}},"cost":1}}"#),
        format!(r#"{{"op":"check","id":10,{k},{slow},"cost":1,"cost":2}}"#),
        format!(
            r#"{{"op":"check_many","id":11,"checks":[{{{k},{slow},"cost":1}},{{{k},"limit":{{"capacity":3,"refill_per_sec":1}},"cost":1}}]}}"#
        ),
        r#"{"op":"check","key":{"exchange":"e","credential":"\ud800"},"cost":1}"#.into(),
        format!(
            r#"{{"op":"check","key":{{"exchange":"e","credential":"{}"}},{slow},"cost":1}}"#,
            "k".repeat(1025)
        ),
        r#"{"op":"record","id":12,"key":{"exchange":"p","credential":null},"cost":3}"#.into(),
        r#"{"op":"get_cost","id":13,"key":{"exchange":"p","credential":null}}"#.into(),
        r#"{"op":"reset","id":14,"key":{"exchange":"p","credential":null}}"#.into(),
        r#"{"op":"stats","id":15}"#.into(),
        r#"{"op":"nope","id":16}"#.into(),
        r#"{"op":"hello","codec":"etf","id":17}"#.into(),
        "[1,2]".into(),
        "\"x\"".into(),
        "{".into(),
        format!("[{}]", "[".repeat(200)),
        "{\"op\":\"stats\",\"id\":\"\u{1F600}\"}".into(),
    ];
    let mut frames: Vec<Vec<u8>> = requests.into_iter().map(String::into_bytes).collect();
    frames.push([b"{\"op\":\"stats\",\"id\":\"".as_slice(), &[0xFF], b"\"}"].concat());
    frames.push(b"{\"op\":\"stats\",\"id\":\"\xED\xA0\x80\"}".to_vec());
    for request in &frames {
        let mut line = request.clone();
        line.push(b'\n');
        unix.send_raw(&line);
        tcp.send_raw(&line);
        port.send_frame(request);
        let from_unix = unix.recv_line().expect("a Unix answer");
        let from_tcp = tcp.recv_line().expect("a TCP answer");
        let mut from_port = port.recv_bytes().expect("a port answer");
        from_port.push(b'\n');
        let request = String::from_utf8_lossy(request);
        let (unix_bytes, unix_ms) = without_wait(from_unix.as_bytes());
        let (tcp_bytes, tcp_ms) = without_wait(from_tcp.as_bytes());
        let (port_bytes, port_ms) = without_wait(&from_port);
        assert_eq!(
            unix_bytes, tcp_bytes,
            "Unix and TCP answers to {request:.200}"
        );
        assert_eq!(
            unix_bytes, port_bytes,
            "Unix and port answers to {request:.200}"
        );
        // A wait counts down in real time between the three servers' answers.
        for other in [tcp_ms, port_ms] {
            assert!(
                unix_ms.abs_diff(other) <= 1_000,
                "waits {unix_ms} and {other} ms"
            );
        }
    }
}

/// An answer with the digits of its `"ms":` wait taken out, and that wait (0 without one).
fn without_wait(answer: &[u8]) -> (Vec<u8>, u64) {
    let field = b"\"ms\":";
    let Some(at) = answer.windows(field.len()).position(|w| w == field) else {
        return (answer.to_vec(), 0);
    };
    let start = at + field.len();
    let digits = answer[start..]
        .iter()
        .take_while(|b| b.is_ascii_digit())
        .count();
    let ms = std::str::from_utf8(&answer[start..start + digits])
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(0);
    ([&answer[..start], &answer[start + digits..]].concat(), ms)
}

/// Connections opened and closed as fast as a client can, some after a request, some mid
/// frame, some after choosing external terms, leave no thread and no descriptor behind.
#[test]
fn unix_connections_opened_and_closed_fast_leak_no_thread_nor_descriptor() {
    let path = common::temp_path("churn.sock");
    let server = Server::start(&["--socket", path.to_str().unwrap(), "--max-connections", "8"]);
    let pid = server.child.id();
    let count = |what: &str| {
        std::fs::read_dir(format!("/proc/{pid}/{what}"))
            .unwrap()
            .count()
    };
    // A first round starts what the runtime starts lazily.
    let churn = |rounds: usize| {
        for i in 0..rounds {
            let mut stream = UnixStream::connect(&path).unwrap();
            let sent: &[u8] = match i % 4 {
                0 => b"",
                1 => b"{\"op\":\"hello\"}\n",
                2 => b"{\"op\":\"hel",
                _ => b"{\"op\":\"hello\",\"codec\":\"etf\"}\n\x00\x00",
            };
            let _ = stream.write_all(sent);
        }
    };
    churn(100);
    // Served once the closed connections gave their slots back.
    eventually("a new connection is served", || {
        let mut probe = LineClient::new(UnixStream::connect(&path).unwrap());
        probe.call(json!({"op": "hello"}))["ok"] == true
    });
    eventually("the first connections end", || count("task") <= 4);
    let (threads, descriptors) = (count("task"), count("fd"));
    churn(2000);
    // Served once the closed connections gave their slots back.
    eventually("a new connection is served", || {
        let mut probe = LineClient::new(UnixStream::connect(&path).unwrap());
        probe.call(json!({"op": "hello"}))["ok"] == true
    });
    eventually(
        "the connections' threads and descriptors are released",
        || count("task") <= threads && count("fd") <= descriptors,
    );
}

/// SIGTERM while a connection's thread is blocked writing to a client that stopped reading
/// (as a stopped process does): the other connections are answered and closed, and the
/// daemon exits 0 once its drain timeout passed, its socket file removed.
#[test]
fn sigterm_with_a_thread_blocked_writing_exits_zero_after_the_drain() {
    let path = common::temp_path("term-blocked.sock");
    let mut server = Server::start(&["--socket", path.to_str().unwrap()]);
    let stopped = UnixStream::connect(&path).unwrap();
    let flood = common::flood_unread(stopped.try_clone().unwrap());
    let mut other = LineClient::new(UnixStream::connect(&path).unwrap());
    assert_eq!(other.call(json!({"op": "hello"}))["ok"], true);
    thread::sleep(Duration::from_millis(300));
    assert!(!flood.is_finished(), "the daemon read the whole flood");
    other.send_raw(b"{\"op\":\"hello\",\"id\":1}\n{\"op\":\"hel");
    assert_eq!(other.recv()["id"], 1);
    common::signal(&server.child, "TERM");
    assert!(
        other.recv_line().is_none(),
        "the other connection is closed"
    );
    assert!(common::wait_exit(&mut server.child).success());
    assert!(!path.exists(), "socket file removed");
    stopped.shutdown(std::net::Shutdown::Both).unwrap();
    flood.join().unwrap();
}

/// Without room for more threads (here an address-space limit a little above what the
/// daemon holds once started: each thread reserves its stack), further Unix connections
/// are served as tasks: every one is answered, the listener goes on accepting, and SIGTERM
/// still stops the daemon. A TCP connection that proves the secret stays a task too, and
/// the requests it sent in the same write as the proof are answered.
#[test]
fn connections_past_the_threads_the_system_allows_are_served_as_tasks() {
    let path = common::temp_path("no-threads.sock");
    // No sweep during the test, which allocates at the edge of the address space.
    let args = ["--max-connections", "500", "--sweep-interval-ms", "3600000"];
    let listeners = [
        "--socket",
        path.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
    ];
    let mut server = Server::start(&[&listeners[..], &args].concat());
    let pid = server.child.id();
    let held = || -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        status
            .lines()
            .find_map(|line| line.strip_prefix("VmSize:"))
            .and_then(|size| size.trim().strip_suffix(" kB")?.parse().ok())
            .expect("VmSize in /proc/PID/status")
    };
    // Once every thread of the runtime has started (and mapped its signal stack).
    let mut last = 0;
    eventually("the daemon's address space stops growing", || {
        thread::sleep(Duration::from_millis(200));
        let now = held();
        std::mem::replace(&mut last, now) == now
    });
    // The address space the daemon may hold: `rlim_max` stays unlimited, so that the limit
    // can be raised again without privilege.
    let limit_to = |kib: u64| {
        let limit = libc::rlimit {
            rlim_cur: kib << 10,
            rlim_max: libc::RLIM_INFINITY,
        };
        // SAFETY: prlimit only reads `limit`.
        let set = unsafe {
            libc::prlimit(
                pid as libc::pid_t,
                libc::RLIMIT_AS,
                &limit,
                std::ptr::null_mut(),
            )
        };
        assert_eq!(set, 0, "prlimit: {}", std::io::Error::last_os_error());
    };
    limit_to(held() + (64 << 10));
    let threads = || {
        std::fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap()
            .count()
    };
    let mut clients = Vec::new();
    let mut raised = false;
    for id in 0..150 {
        let stream = UnixStream::connect(&path)
            .unwrap_or_else(|error| panic!("connection {id} ({} threads): {error}", threads()));
        let mut client = LineClient::new(stream);
        assert_eq!(client.call(json!({"op": "hello", "id": id}))["id"], id);
        clients.push(client);
        // The first connection the system gave no thread: the stacks took nearly all of the
        // 64 MiB, and glibc, which could map no arena for a connection's thread, maps each
        // of its allocations on its own: the little left (100 to 300 KiB, by the timing of
        // its reads) ran out in a `stats`, and the daemon aborted ("memory allocation of 16
        // bytes failed"). Room for 1 MiB more, less than a thread's 2 MiB stack and guard.
        if !raised && connection_threads(pid) < clients.len() {
            limit_to(held() + 1024);
            raised = true;
        }
    }
    assert!(raised, "every connection got a thread");
    assert!(threads() < 150, "{} threads: none was refused", threads());
    let threads_before_tcp = connection_threads(pid);
    for (id, client) in clients.iter_mut().enumerate() {
        assert_eq!(client.call(json!({"op": "stats", "id": id}))["id"], id);
    }
    let mut tcp = server.connect_unproved();
    let nonce = tcp.call(json!({"op": "hello"}))["auth"]["nonce"].clone();
    let proof = common::proof(common::SECRET.as_bytes(), nonce.as_str().unwrap());
    let auth = json!({"op": "auth", "proof": proof});
    let behind = [1, 2].map(|id| json!({"op": "stats", "id": id}));
    tcp.send_raw(format!("{auth}\n{}\n{}\n", behind[0], behind[1]).as_bytes());
    assert_eq!(tcp.recv(), json!({"ok": true}));
    assert_eq!([tcp.recv()["id"].clone(), tcp.recv()["id"].clone()], [1, 2]);
    assert_eq!(connection_threads(pid), threads_before_tcp);
    drop(clients);
    common::signal(&server.child, "TERM");
    assert!(common::wait_exit(&mut server.child).success());
}

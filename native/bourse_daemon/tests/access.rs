//! Who may use a daemon: the Unix socket is owner-only whatever the umask, TCP clients must
//! prove the shared secret, answers hold no credential, and idle or unproved connections
//! cannot keep a real client out.

mod common;

use std::ffi::CString;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use common::{authenticate, daemon_binary, key, LineClient, TempDir, Transport, SECRET};

/// A daemon started by `sh` with a shell prelude (`umask 000`, `ulimit -n 256`); killed when
/// dropped.
struct Shell {
    child: Child,
    listening: Vec<String>,
}

impl Shell {
    fn start(prelude: &str, args: &[&str]) -> Self {
        let mut script = format!("{prelude}; exec \"$0\"");
        for i in 1..=args.len() {
            script.push_str(&format!(" \"${i}\""));
        }
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(script)
            .arg(daemon_binary())
            .args(args)
            .env("BOURSE_DAEMON_SECRET", SECRET)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn sh");
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let listeners = args
            .iter()
            .filter(|a| matches!(**a, "--listen" | "--socket"))
            .count();
        let listening = (0..listeners)
            .map(|_| {
                let mut line = String::new();
                stdout.read_line(&mut line).expect("listening line");
                line.trim_end().to_string()
            })
            .collect();
        Self { child, listening }
    }

    fn tcp(&self) -> String {
        self.listening
            .iter()
            .find_map(|line| line.strip_prefix("listening tcp "))
            .expect("a TCP listener")
            .to_string()
    }
}

impl Drop for Shell {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Another user's daemon started on the path of a live socket it may not connect to, in a
/// directory it may write to, does not take that socket over.
#[test]
fn a_live_socket_another_user_cannot_reach_is_not_replaced() {
    if !can_run_as_nobody() {
        eprintln!("SKIPPED: needs root and setpriv to run a daemon as nobody");
        return;
    }
    let dir = open_dir("shared-path");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let path = dir.join("d.sock");
    let path_text = path.to_str().unwrap();
    let _owner = Shell::start("umask 077", &["--socket", path_text]);
    let inode = std::fs::metadata(&path).unwrap().ino();
    // A copy that nobody may run, wherever the build is.
    let binary = dir.join("bourse_daemon");
    std::fs::copy(daemon_binary(), &binary).unwrap();
    std::fs::set_permissions(&binary, std::fs::Permissions::from_mode(0o755)).unwrap();
    let output = Command::new("timeout")
        .arg("10")
        .args(AS_NOBODY)
        .args([binary.to_str().unwrap(), "--socket", path_text])
        .env_remove("BOURSE_DAEMON_SECRET")
        .output()
        .map(|output| {
            (
                output.status.code(),
                String::from_utf8_lossy(&output.stderr).to_string(),
            )
        })
        .unwrap();
    assert_eq!(output.0, Some(1), "{}", output.1);
    assert!(output.1.contains("not replacing it"), "{}", output.1);
    assert_eq!(std::fs::metadata(&path).unwrap().ino(), inode);
}

/// A directory every user may enter, for a socket another user tries to reach.
fn open_dir(name: &str) -> TempDir {
    let dir = TempDir::new(name);
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

/// The socket's mode, set through the umask at `bind`, is kept under a default ACL of the
/// directory that lets everyone in (which overrides the umask for other files).
#[test]
fn the_socket_is_owner_only_whatever_the_umask_or_shared_with_a_group() {
    let dir = open_dir("umask");
    for acl in [false, true] {
        if acl && !grant_all_by_default(&dir) {
            eprintln!("SKIPPED under a default ACL: the file system takes none");
            break;
        }
        for (flags, mode) in [(&[][..], 0o600), (&["--socket-mode", "660"][..], 0o660)] {
            let path = dir.join("d.sock");
            let path_text = path.to_str().unwrap();
            let mut args = vec!["--socket", path_text];
            args.extend_from_slice(flags);
            let _daemon = Shell::start("umask 000", &args);
            let found = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
            assert_eq!(
                found, mode,
                "socket mode {found:o} under umask 000 (ACL: {acl})"
            );
            // The owner is served.
            let mut client = LineClient::new(UnixStream::connect(&path).unwrap());
            assert_eq!(client.call(json!({"op": "stats"}))["ok"], true);
        }
    }
}

/// Gives `dir` a default ACL letting everyone read, write and search what is created in
/// it; false where its file system takes no ACL.
fn grant_all_by_default(dir: &Path) -> bool {
    // An ACL as its extended attribute holds it: version 2, then tag, permissions (rwx)
    // and an unused id for the owner, the group and others.
    let mut acl = 2u32.to_le_bytes().to_vec();
    for tag in [0x01u16, 0x04, 0x20] {
        acl.extend(tag.to_le_bytes());
        acl.extend(7u16.to_le_bytes());
        acl.extend(u32::MAX.to_le_bytes());
    }
    let dir = CString::new(dir.as_os_str().as_bytes()).unwrap();
    let name = c"system.posix_acl_default";
    // SAFETY: both strings end in NUL, and `acl` holds the length given.
    let set = unsafe {
        libc::setxattr(
            dir.as_ptr(),
            name.as_ptr(),
            acl.as_ptr().cast(),
            acl.len(),
            0,
        )
    };
    set == 0
}

/// What another local user (`nobody`) manages against a daemon started under umask 000:
/// one line per attempt, printed by a Python script run as that user.
const INTRUDER: &str = r#"
import json, socket, sys
path, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
try:
    s = socket.socket(socket.AF_UNIX); s.connect(path); print("unix: connected")
except OSError as e:
    print("unix: refused", e.errno)
s = socket.create_connection((host, port)); f = s.makefile("rb")
def call(request):
    s.sendall(json.dumps(request).encode() + b"\n"); return json.loads(f.readline())
print("hello:", json.dumps(sorted(call({"op": "hello"}))))
for request in [{"op": "busiest"}, {"op": "reset_all"},
                {"op": "pause", "target": {"exchange": "binance"}, "ms": 86400000},
                {"op": "auth", "proof": "00" * 32}, {"op": "busiest"}]:
    answer = call(request)
    print(request["op"] + ":", answer.get("error", {}).get("type", "served"), json.dumps(answer))
"#;

/// Whether this test runs as root with `setpriv`, to run a program as `nobody`.
fn can_run_as_nobody() -> bool {
    let root = Command::new("id")
        .arg("-u")
        .output()
        .map(|o| o.stdout == b"0\n");
    root.ok() == Some(true) && Command::new("setpriv").arg("--version").output().is_ok()
}

/// What `setpriv` takes to run a program as `nobody`.
const AS_NOBODY: [&str; 4] = [
    "setpriv",
    "--reuid=nobody",
    "--regid=nogroup",
    "--clear-groups",
];

#[test]
fn another_user_cannot_reach_the_socket_nor_use_tcp_without_the_secret() {
    // The system's Python: another user cannot run one under /root.
    let python = "/usr/bin/python3";
    if !can_run_as_nobody() || !std::path::Path::new(python).exists() {
        eprintln!("SKIPPED: needs root, setpriv and {python} to run a client as nobody");
        return;
    }
    let dir = open_dir("intruder");
    let path = dir.join("d.sock");
    let daemon = Shell::start(
        "umask 000",
        &[
            "--socket",
            path.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
        ],
    );
    // The owner puts a credential in the table.
    let mut owner = LineClient::new(UnixStream::connect(&path).unwrap());
    let limit = json!({"capacity": 5, "refill_per_sec": 0.001});
    let k = key("binance", Some("SECRET-API-KEY-42"));
    assert_eq!(
        owner.call(json!({"op": "check", "key": k, "limit": limit, "cost": 3}))["result"],
        "admitted"
    );
    let tcp = daemon.tcp();
    let (host, port) = tcp.rsplit_once(':').unwrap();
    let output = Command::new(AS_NOBODY[0])
        .args(&AS_NOBODY[1..])
        .args([python, "-c", INTRUDER])
        .args([path.to_str().unwrap(), host, port])
        .env_remove("BOURSE_DAEMON_SECRET")
        .output()
        .expect("run python3 as nobody");
    let seen = String::from_utf8_lossy(&output.stdout).to_string();
    eprintln!(
        "as nobody:\n{seen}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success());
    assert!(seen.contains("unix: refused 13"), "{seen}");
    assert!(seen.contains(r#""auth""#), "hello offers the proof: {seen}");
    for op in ["busiest", "reset_all", "pause", "auth"] {
        assert!(
            seen.contains(&format!("{op}: unauthorized")),
            "{op}: {seen}"
        );
    }
    assert!(
        !seen.contains("served") && !seen.contains("SECRET"),
        "{seen}"
    );
    // Nothing was reset or paused.
    let info = owner.call(json!({"op": "inspect", "key": k}))["info"].clone();
    assert_eq!(
        (
            info["borrowed"].as_f64().map(f64::round),
            info["pause_ms"].clone()
        ),
        (Some(3.0), Value::Null)
    );
    // The owner's `busiest` shows a fingerprint, never the key.
    let busiest = owner.call(json!({"op": "busiest"}));
    assert!(!busiest.to_string().contains("SECRET"), "{busiest}");
    assert!(busiest["keys"][0]["key"]["credential"]
        .as_str()
        .unwrap()
        .starts_with("key:"));
}

/// Up to `count` connections to `addr` that each sent a `hello` (and read nothing).
fn said_hello(addr: &str, count: usize) -> Vec<TcpStream> {
    let hello = format!("{}\n", json!({"op": "hello"}));
    (0..count)
        .filter_map(|_| {
            let mut stream = TcpStream::connect(addr).ok()?;
            stream.write_all(hello.as_bytes()).ok()?;
            Some(stream)
        })
        .collect()
}

/// A client with the secret that connects to `addr` proves it, answered within `wait`.
fn proved_client(addr: &str, wait: Duration) -> LineClient<TcpStream> {
    let mut client = LineClient::new(TcpStream::connect(addr).unwrap());
    client.stream.set_read_timeout(Some(wait)).unwrap();
    assert_eq!(
        authenticate(&mut client, SECRET.as_bytes()),
        json!({"ok": true})
    );
    client
}

#[test]
fn idle_and_unproved_connections_cannot_lock_out_a_real_client() {
    // Few descriptors, as on a host with `ulimit -n 256`.
    let daemon = Shell::start("ulimit -n 256", &["--listen", "127.0.0.1:0"]);
    let addr = daemon.tcp();
    let idle: Vec<TcpStream> = (0..300)
        .filter_map(|_| TcpStream::connect(&addr).ok())
        .collect();
    assert!(idle.len() >= 250, "{} connections", idle.len());
    let mut client = proved_client(&addr, Duration::from_secs(10));
    let answer =
        client.call(json!({"op": "check", "key": key("x", None), "limit": {"requests": 5}}));
    assert_eq!(answer["result"], "admitted");
    drop(idle);
}

#[test]
fn greeted_connections_cannot_take_every_descriptor_of_a_low_limit() {
    // Fewer descriptors than the unproved queues hold at full size.
    let daemon = Shell::start("ulimit -n 200", &["--listen", "127.0.0.1:0"]);
    let addr = daemon.tcp();
    let greeted = said_hello(&addr, 300);
    assert!(greeted.len() >= 250, "{} connections", greeted.len());
    // Each hello read and answered, or its connection closed.
    std::thread::sleep(Duration::from_millis(500));
    // Well before the unproved connections' own deadline (10 s) frees their descriptors.
    proved_client(&addr, Duration::from_secs(4));
    drop(greeted);
}

/// Four floods at once of connections that each send a `hello` and are held (as many as a
/// low descriptor limit allows, then the oldest closed) never run the daemon out of
/// descriptors: it accepts a connection only when one of its places for connections that
/// have not proved the secret is free, after the one it evicted has closed. Clients with
/// the secret all prove it meanwhile.
#[test]
fn concurrent_floods_never_run_a_low_limit_out_of_descriptors() {
    let log = std::env::temp_dir().join(format!("bourse-floods-{}.log", std::process::id()));
    let prelude = format!("ulimit -n 150; exec 2>'{}'", log.display());
    let daemon = Shell::start(&prelude, &["--listen", "127.0.0.1:0"]);
    let addr = daemon.tcp();
    let stop = Arc::new(AtomicBool::new(false));
    let opened = Arc::new(AtomicUsize::new(0));
    let floods: Vec<_> = (0..4)
        .map(|_| {
            let (addr, stop, opened) = (addr.clone(), Arc::clone(&stop), Arc::clone(&opened));
            std::thread::spawn(move || {
                let hello = format!("{}\n", json!({"op": "hello"}));
                let mut held = std::collections::VecDeque::new();
                while !stop.load(Ordering::Relaxed) {
                    if let Ok(mut stream) = TcpStream::connect(&addr) {
                        let _ = stream.write_all(hello.as_bytes());
                        held.push_back(stream);
                        opened.fetch_add(1, Ordering::Relaxed);
                    }
                    if held.len() > 100 {
                        held.pop_front();
                    }
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    // A connection sent its nonce may be evicted by the floods' own before it proves the
    // secret (they too are sent theirs): the client then connects again.
    for client in 0..10 {
        let started = std::time::Instant::now();
        let proved = (0..100).any(|_| {
            greeted(&addr).is_some_and(|(stream, nonce)| {
                let proof = common::proof(SECRET.as_bytes(), &nonce);
                call(&stream, &json!({"op": "auth", "proof": proof})) == Some(json!({"ok": true}))
            })
        });
        assert!(proved, "client {client} never proved the secret");
        let took = started.elapsed();
        assert!(
            took < Duration::from_secs(5),
            "client {client} took {took:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    stop.store(true, Ordering::Relaxed);
    for flood in floods {
        flood.join().unwrap();
    }
    let opened = opened.load(Ordering::Relaxed);
    // Far more than the descriptors: the daemon closed most of them.
    assert!(opened >= 200, "the floods opened only {opened} connections");
    drop(daemon);
    let logged = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_file(&log);
    assert!(!logged.contains("accept:"), "{logged}");
}

/// A listener waiting for its next connection holds no place of another's: with two
/// listeners, connections taking every place of those that have not proved the secret on
/// one (greeted ones, then silent ones, none closing) do not stall it, and a client with
/// the secret proves it there at once.
#[test]
fn a_second_listener_does_not_stall_the_first() {
    let daemon = Shell::start(":", &["--listen", "127.0.0.1:0", "--listen", "127.0.0.1:0"]);
    let addr = daemon.tcp();
    let hellos = said_hello(&addr, 256);
    std::thread::sleep(Duration::from_millis(300));
    let said_nothing: Vec<TcpStream> = (0..64)
        .filter_map(|_| TcpStream::connect(&addr).ok())
        .collect();
    assert_eq!((hellos.len(), said_nothing.len()), (256, 64));
    std::thread::sleep(Duration::from_millis(300));
    let started = std::time::Instant::now();
    let proved = (0..10).any(|_| {
        greeted(&addr).is_some_and(|(stream, nonce)| {
            let proof = common::proof(SECRET.as_bytes(), &nonce);
            call(&stream, &json!({"op": "auth", "proof": proof})) == Some(json!({"ok": true}))
        })
    });
    let took = started.elapsed();
    assert!(
        proved && took < Duration::from_secs(3),
        "proved: {proved}, took {took:?}"
    );
    drop((hellos, said_nothing));
}

/// Connections opened as fast as one thread can and held without a word (another local
/// user's, say) do not close a client's connection while it proves the secret: 20
/// clients, each with at least 20 ms and 256 such connections between the answer to its
/// `hello` and its `auth`, all prove it.
#[test]
fn silent_connections_cannot_close_a_client_proving_the_secret() {
    let daemon = common::Server::tcp(&[]);
    let addr = daemon.tcp_addr();
    let opened = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let attacker = {
        let (addr, opened, stop) = (addr.clone(), Arc::clone(&opened), Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut held = std::collections::VecDeque::new();
            while !stop.load(Ordering::Relaxed) {
                if let Ok(stream) = TcpStream::connect(&addr) {
                    held.push_back(stream);
                    opened.fetch_add(1, Ordering::Relaxed);
                }
                if held.len() > 256 {
                    held.pop_front();
                }
            }
        })
    };
    let proved = (0..20)
        .filter(|_| {
            // A connection closed before its hello is answered was not proving anything
            // yet: the client opens another.
            let (stream, nonce) = (0..100)
                .find_map(|_| greeted(&addr))
                .expect("a hello answered");
            let before = opened.load(Ordering::Relaxed);
            std::thread::sleep(Duration::from_millis(20));
            common::eventually("256 silent connections are opened", || {
                opened.load(Ordering::Relaxed) >= before + 256
            });
            let proof = common::proof(SECRET.as_bytes(), &nonce);
            call(&stream, &json!({"op": "auth", "proof": proof})) == Some(json!({"ok": true}))
        })
        .count();
    stop.store(true, Ordering::Relaxed);
    attacker.join().unwrap();
    assert_eq!(proved, 20, "clients that proved the secret");
}

/// A connection that has not proved the secret and sends a frame too large for it is
/// closed at once: its descriptor is not held past the bounds of the unproved queues.
/// Before, each lingered a second, so 500 of them held 500 descriptors.
#[test]
fn unproved_connections_sending_oversized_frames_hold_no_descriptors() {
    let daemon = common::Server::tcp(&[]);
    let addr = daemon.tcp_addr();
    let fds = || {
        std::fs::read_dir(format!("/proc/{}/fd", daemon.child.id()))
            .map(|entries| entries.count())
            .unwrap_or(0)
    };
    let oversized = vec![b'x'; 1100];
    let held: Vec<TcpStream> = (0..500)
        .filter_map(|_| {
            let mut stream = TcpStream::connect(&addr).ok()?;
            stream.write_all(&oversized).ok()?;
            Some(stream)
        })
        .collect();
    assert!(held.len() >= 400, "{} connections opened", held.len());
    // Well within the second each lingered before.
    std::thread::sleep(Duration::from_millis(200));
    let open = fds();
    assert!(open < 150, "the daemon holds {open} descriptors");
}

/// A TCP connection to `addr` and the nonce the answer to its `hello` carried.
fn greeted(addr: &str) -> Option<(TcpStream, String)> {
    let stream = TcpStream::connect(addr).ok()?;
    stream.set_read_timeout(Some(common::PATIENCE)).ok()?;
    let hello = call(&stream, &json!({"op": "hello"}))?;
    let nonce = hello["auth"]["nonce"].as_str()?.to_string();
    Some((stream, nonce))
}

/// The answer to `request` on `stream`; `None` once the connection is closed (its write
/// or its read may fail: reset).
fn call(mut stream: &TcpStream, request: &Value) -> Option<Value> {
    stream.write_all(format!("{request}\n").as_bytes()).ok()?;
    let mut answer = String::new();
    BufReader::new(stream).read_line(&mut answer).ok()?;
    serde_json::from_str(&answer).ok()
}

#[test]
fn idle_connections_are_closed() {
    let daemon = Shell::start(
        "true",
        &["--listen", "127.0.0.1:0", "--idle-timeout-ms", "300"],
    );
    let stream = TcpStream::connect(daemon.tcp()).unwrap();
    let mut client = LineClient::new(stream);
    authenticate(&mut client, SECRET.as_bytes());
    assert_eq!(client.call(json!({"op": "hello"}))["idle_timeout_ms"], 300);
    std::thread::sleep(Duration::from_millis(800));
    assert_eq!(
        client.recv_line(),
        None,
        "still open after its idle timeout"
    );
}

#[test]
fn a_refused_client_reads_the_refusal_even_when_its_hello_comes_late() {
    let socket = common::temp_path("refused.sock");
    let socket_arg = socket.to_str().unwrap();
    let _daemon = common::Server::start(&["--socket", socket_arg, "--max-connections", "1"]);
    let _first = UnixStream::connect(&socket).unwrap();
    let mut late = LineClient::new(UnixStream::connect(&socket).unwrap());
    // The refusal is written at once; the hello only after it.
    std::thread::sleep(Duration::from_millis(300));
    late.send(&json!({"op": "hello", "id": 0}));
    let refusal: Value = serde_json::from_str(&late.recv_line().expect("a refusal")).unwrap();
    assert_eq!(refusal["error"]["type"], "unavailable");
    assert_eq!(
        refusal["error"]["message"],
        "the daemon serves at most 1 connections (--max-connections)"
    );
}

/// Connections refused past `--max-connections` and held open by their client (another
/// local user's, say) do not each keep a descriptor of the daemon for the second a refused
/// connection may take to send its hello: past a few, they are closed once told, so that
/// the descriptors kept spare for the listeners, Redis and unproved clients stay free.
#[test]
fn refused_connections_held_open_keep_few_descriptors() {
    let socket = common::temp_path("refused-many.sock");
    let socket_arg = socket.to_str().unwrap();
    let daemon = common::Server::start(&["--socket", socket_arg, "--max-connections", "1"]);
    let descriptors = || {
        std::fs::read_dir(format!("/proc/{}/fd", daemon.child.id()))
            .unwrap()
            .count()
    };
    let _first = UnixStream::connect(&socket).unwrap();
    let mut first = LineClient::new(UnixStream::connect(&socket).unwrap());
    assert_eq!(first.recv()["error"]["type"], "unavailable");
    drop(first);
    let before = descriptors();
    let mut refused: Vec<LineClient<UnixStream>> = (0..200)
        .map(|_| LineClient::new(UnixStream::connect(&socket).unwrap()))
        .collect();
    let mut most = 0;
    for client in &mut refused {
        assert_eq!(client.recv()["error"]["type"], "unavailable");
        most = most.max(descriptors());
    }
    assert!(
        most < before + 32,
        "{most} descriptors held, {before} before 200 refused connections"
    );
}

/// A client that has not proved the secret, sending requests and never reading the
/// answers (the daemon's write of them waits), is closed at its deadline all the same: it
/// cannot hold a descriptor by not reading. Its deadline here is the idle timeout.
#[test]
fn an_unproved_client_that_never_reads_is_closed_at_its_deadline() {
    let daemon = common::Server::tcp(&["--idle-timeout-ms", "500"]);
    let flood = common::flood_unread(TcpStream::connect(daemon.tcp_addr()).unwrap());
    std::thread::sleep(Duration::from_millis(200));
    assert!(!flood.is_finished(), "the daemon read the whole flood");
    // Its writes fail once the daemon closed the connection.
    common::eventually("the unproved connection is closed", || flood.is_finished());
}

/// A daemon on `socket` and TCP serving two connections, idle after 500 ms.
fn two_slots_idle_after_500_ms(socket: &std::path::Path) -> common::Server {
    common::Server::start(&[
        "--socket",
        socket.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--idle-timeout-ms",
        "500",
        "--max-connections",
        "2",
    ])
}

/// Clients that stop reading (a paused process, say), on a Unix socket or over TCP once
/// proved, hold their connection slots only until they have read none of their answers
/// for the idle timeout: then a new client is served, not refused.
#[test]
fn clients_that_stop_reading_give_their_slots_back_after_the_idle_timeout() {
    let socket = common::temp_path("stop-reading.sock");
    let daemon = two_slots_idle_after_500_ms(&socket);
    let unix = common::flood_unread(UnixStream::connect(&socket).unwrap());
    let proved = daemon.connect();
    let tcp = common::flood_unread(proved.stream.try_clone().unwrap());
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        !unix.is_finished() && !tcp.is_finished(),
        "a flood was read whole"
    );
    common::eventually("a new client is served", || {
        let mut client = LineClient::new(UnixStream::connect(&socket).unwrap());
        client.call(json!({"op": "hello"}))["ok"] == true
    });
    unix.join().unwrap();
    tcp.join().unwrap();
}

/// A client that adds a byte now and then to a frame it never ends sends no request: it
/// is idle, and gives its slot back after the idle timeout, on a Unix socket as over TCP
/// once proved. (Were any byte activity, such clients would hold every slot for ever.)
#[test]
fn a_frame_that_never_ends_gives_its_slot_back_after_the_idle_timeout() {
    let socket = common::temp_path("never-ending-frame.sock");
    let daemon = two_slots_idle_after_500_ms(&socket);
    let unix = common::never_ending_frame(UnixStream::connect(&socket).unwrap());
    let proved = daemon.connect();
    let tcp = common::never_ending_frame(proved.stream.try_clone().unwrap());
    std::thread::sleep(Duration::from_millis(200));
    let mut refused = LineClient::new(UnixStream::connect(&socket).unwrap());
    assert_eq!(
        refused.call(json!({"op": "hello"}))["error"]["type"],
        "unavailable"
    );
    // Well before the never-ending frames give up (10 s).
    assert!(
        common::served_within(&socket, Duration::from_secs(5)),
        "no new client served while the never-ending frames go on"
    );
    let (unix_closed, tcp_closed) = (unix.join().unwrap(), tcp.join().unwrap());
    assert!(
        unix_closed && tcp_closed,
        "still open: unix {} tcp {}",
        !unix_closed,
        !tcp_closed
    );
}

/// Before it proves the secret a client is told `unauthorized` for any request but `hello`
/// and `auth`, a request already past its deadline included, and what it sends is not
/// counted in the daemon's counters: anyone may connect, only clients count.
#[test]
fn an_unproved_client_is_answered_unauthorized_and_counts_nothing() {
    let daemon = common::Server::tcp(&[]);
    let mut unproved = daemon.connect_unproved();
    unproved.send_raw(b"not json\n");
    assert_eq!(unproved.recv()["error"]["type"], "invalid_parameters");
    let late = json!({"op": "check", "key": key("x", None), "limit": {"requests": 5},
                      "deadline_us": 1, "timeout_ms": 1000, "id": 7});
    let answer = unproved.call(late);
    assert_eq!(
        (answer["id"].clone(), answer["error"]["type"].clone()),
        (json!(7), json!("unauthorized"))
    );
    let mut client = daemon.connect();
    assert_eq!(client.call(json!({"op": "stats"}))["stats"]["invalid"], 0);
}

/// Until it proves the secret a connection's frames are short (a `hello` or an `auth`
/// takes about 100 bytes), so an unknown client cannot make the daemon read large ones;
/// once proved, its frames may be as long as `--max-frame-bytes`.
#[test]
fn frames_are_short_until_the_secret_is_proved() {
    let daemon = common::Server::tcp(&[]);
    let padded = |id: u64| {
        format!(
            "{{\"op\":\"hello\",\"id\":{id},\"pad\":\"{}\"}}\n",
            "x".repeat(2000)
        )
    };
    let mut proved = daemon.connect();
    proved.send_raw(padded(1).as_bytes());
    let answer = proved.recv();
    assert_eq!(answer["ok"], false, "the pad is an unknown field");
    assert_eq!(answer["id"], 1);
    let mut unproved = daemon.connect_unproved();
    unproved.send_raw(padded(2).as_bytes());
    let refused = unproved.recv();
    assert_eq!(refused["error"]["type"], "frame_too_large");
    assert_eq!(
        refused["error"]["message"],
        "frame longer than 1024 bytes before the secret is proved; closing"
    );
    assert_eq!(unproved.recv_line(), None);
}

/// A client that reads its answers slowly but steadily while it still sends requests is
/// neither idle nor stopped: the time the daemon waits to write to it, or has requests it
/// could not read yet, is not idleness. Every answer arrives, with an idle timeout far
/// shorter than the whole exchange.
#[test]
fn a_slow_but_steady_reader_is_served_to_the_end() {
    let socket = common::temp_path("slow-reader.sock");
    let _daemon = common::Server::start(&[
        "--socket",
        socket.to_str().unwrap(),
        "--idle-timeout-ms",
        "1000",
    ]);
    common::read_slowly(&socket);
}

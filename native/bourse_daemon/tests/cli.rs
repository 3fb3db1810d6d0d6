//! Command-line behaviour of the built binary.

mod common;

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::net::UnixListener;
use std::process::{Command, Output};

use common::{Server, TempDir, DAEMON};

fn run(args: &[&str]) -> Output {
    Command::new(DAEMON)
        .args(args)
        .output()
        .expect("run bourse_daemon")
}

#[test]
fn help_and_version_exit_zero() {
    let help = run(&["--help"]);
    assert!(help.status.success());
    let text = String::from_utf8_lossy(&help.stdout);
    for needle in [
        "--stdio",
        "--listen",
        "--socket",
        "--max-frame-bytes",
        "--allow-remote",
    ] {
        assert!(text.contains(needle), "usage lacks {needle}");
    }
    let version = run(&["--version"]);
    assert!(version.status.success());
    assert!(String::from_utf8_lossy(&version.stdout).starts_with("bourse_daemon "));
}

#[test]
fn bad_flags_exit_two_with_a_reason_and_the_usage() {
    for (args, reason) in [
        (&["--frobnicate"][..], "unknown argument"),
        (&[], "choose a mode"),
        (
            &["--stdio", "--listen", "127.0.0.1:0"],
            "cannot be combined",
        ),
        (&["--listen"], "needs a value"),
        (&["--listen", "localhost:1"], "no host names"),
        (
            &["--stdio", "--sweep-interval-ms", "soon"],
            "--sweep-interval-ms needs an integer",
        ),
        (
            &["--stdio", "--max-frame-bytes", "1"],
            "--max-frame-bytes needs an integer",
        ),
        (&["--listen", "0.0.0.0:0"], "not a loopback address"),
        (&["--listen", "[::]:0"], "--allow-remote"),
    ] {
        let output = run(args);
        assert_eq!(output.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(reason), "{args:?}: {stderr}");
        assert!(stderr.contains("Usage:"), "{args:?}: {stderr}");
        assert!(output.stdout.is_empty());
    }
}

#[test]
fn an_argument_that_is_not_utf8_is_refused_by_its_place() {
    let url = std::ffi::OsStr::from_bytes(b"redis://127.0.0.1:1/\xff");
    for (mode, place) in [("--listen", 4), ("--stdio", 3)] {
        let mut command = Command::new(DAEMON);
        if mode == "--listen" {
            command.args(["--listen", "127.0.0.1:0"]);
        } else {
            command.arg("--stdio");
        }
        let output = command
            .arg("--redis")
            .arg(url)
            .stdin(std::process::Stdio::null())
            .output()
            .expect("run bourse_daemon");
        assert_eq!(output.status.code(), Some(2), "{mode}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        let reason = format!("argument {place} is not UTF-8");
        assert!(stderr.contains(&reason), "{mode}: {stderr}");
        assert!(!stderr.contains("panicked"), "{mode}: {stderr}");
        assert!(!stderr.contains("redis://"), "{mode}: {stderr}");
    }
}

/// The port's socket may be at a path that is not UTF-8: the daemon connects there (not
/// to its lossy text) and serves it.
#[test]
fn a_stdio_socket_path_that_is_not_utf8_is_served() {
    let dir = TempDir::new("raw-dir");
    let mut raw = dir.as_os_str().to_owned().into_vec();
    raw.extend_from_slice(b"/s\xff.sock");
    let path = std::path::PathBuf::from(std::ffi::OsString::from_vec(raw));
    let listener = UnixListener::bind(&path).unwrap();
    let mut daemon = Command::new(DAEMON)
        .arg("--stdio")
        .arg("--stdio-socket")
        .arg(&path)
        .spawn()
        .expect("run bourse_daemon");
    let (mut stream, _) = listener.accept().unwrap();
    let hello = br#"{"id":1,"op":"hello"}"#;
    stream
        .write_all(&(hello.len() as u32).to_be_bytes())
        .unwrap();
    stream.write_all(hello).unwrap();
    let mut header = [0u8; 4];
    stream.read_exact(&mut header).unwrap();
    let mut answer = vec![0u8; u32::from_be_bytes(header) as usize];
    stream.read_exact(&mut answer).unwrap();
    let answer: serde_json::Value = serde_json::from_slice(&answer).unwrap();
    assert_eq!(answer["ok"], true, "{answer}");
    drop(stream);
    assert!(daemon.wait().unwrap().success());
}

/// A secret in the environment is bytes, as in a file: one that is not UTF-8 (random
/// bytes) is used, not taken for unset; a Redis password that is not UTF-8 is refused.
#[test]
fn secrets_in_the_environment_need_not_be_utf8() {
    let random = std::ffi::OsStr::from_bytes(b"\xff\xfe-0123456789abcdef-\x80");
    let mut served = Command::new(DAEMON)
        .args(["--listen", "127.0.0.1:0"])
        .env("BOURSE_DAEMON_SECRET", random)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run bourse_daemon");
    let mut line = String::new();
    let stdout = served.stdout.take().unwrap();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line).unwrap();
    let _ = served.kill();
    let _ = served.wait();
    assert!(line.starts_with("listening tcp "), "{line:?}");

    let output = Command::new(DAEMON)
        .args(["--stdio", "--redis", "redis://127.0.0.1:1"])
        .env("BOURSE_REDIS_PASSWORD", random)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run bourse_daemon");
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("the Redis password must be UTF-8"),
        "{stderr}"
    );
}

#[test]
fn unix_socket_files_are_replaced_only_when_stale() {
    let path = common::temp_path("stale.sock");
    let _ = std::fs::remove_file(&path);
    let path_text = path.to_str().unwrap();

    // A socket nobody listens on any more is replaced.
    drop(UnixListener::bind(&path).unwrap());
    assert!(path.exists());
    let mut server = Server::start(&["--socket", path_text]);
    assert_eq!(
        server.listening,
        vec![format!("listening unix {path_text}")]
    );
    common::signal(&server.child, "TERM");
    assert!(common::wait_exit(&mut server.child).success());
    assert!(!path.exists(), "socket file left behind");

    // A live socket is not taken over.
    let live = UnixListener::bind(&path).unwrap();
    let output = run(&["--socket", path_text]);
    assert_eq!(output.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&output.stderr).contains("another process is listening"));
    drop(live);

    // Nor one whose listener accepts nothing, its backlog full (a blocking connect would
    // wait for ever): the daemon gives up on it within a second or so.
    let full = full_listener(&path);
    let started = std::time::Instant::now();
    let output = Command::new("timeout")
        .args(["10", DAEMON, "--socket", path_text])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&output.stderr).contains("accepts nothing"));
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    drop(full);

    // Nor is a file that is not a socket.
    std::fs::remove_file(&path).unwrap();
    std::fs::write(&path, "data").unwrap();
    let output = run(&["--socket", path_text]);
    assert_eq!(output.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&output.stderr).contains("not a socket"));
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "data");
    std::fs::remove_file(&path).unwrap();
}

/// A listener at `path` with a backlog of none, filled by connections it never accepts: a
/// blocking connect to it waits. Dropped, it closes them all.
fn full_listener(path: &std::path::Path) -> (UnixListener, Vec<OwnedFd>) {
    let _ = std::fs::remove_file(path);
    let listener = UnixListener::bind(path).unwrap();
    // SAFETY: listen(2) on a socket this function owns.
    assert_eq!(unsafe { libc::listen(listener.as_raw_fd(), 0) }, 0);
    // SAFETY: a zeroed sockaddr_un is valid; the path fits (temp paths are short).
    let mut address: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    address.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (slot, byte) in address.sun_path.iter_mut().zip(path.as_os_str().as_bytes()) {
        *slot = *byte as libc::c_char;
    }
    let mut waiting = Vec::new();
    loop {
        // SAFETY: a new socket, owned at once; connect(2) reads `address` only.
        let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_NONBLOCK, 0) };
        assert!(fd >= 0);
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let size = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
        let done =
            unsafe { libc::connect(fd.as_raw_fd(), std::ptr::addr_of!(address).cast(), size) };
        if done != 0 {
            return (listener, waiting);
        }
        waiting.push(fd);
    }
}

//! Command-line behaviour of the built binary.

mod common;

use std::os::unix::net::UnixListener;
use std::process::{Command, Output};

use common::{Server, DAEMON};

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

    // Nor is a file that is not a socket.
    std::fs::remove_file(&path).unwrap();
    std::fs::write(&path, "data").unwrap();
    let output = run(&["--socket", path_text]);
    assert_eq!(output.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&output.stderr).contains("not a socket"));
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "data");
    std::fs::remove_file(&path).unwrap();
}

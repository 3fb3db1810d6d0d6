//! `--stdio --stdio-socket PATH`: the port's client listens on a Unix socket, which becomes
//! this process's stdin and stdout before anything is read or written, so `--stdio` serves
//! it unchanged (and a refused configuration is answered there). A socket lets the client
//! read answers as soon as they are written, without a port in between.

use std::ffi::{OsStr, OsString};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;

const FLAG: &str = "--stdio-socket";

/// Connects stdin and stdout to the socket named by `--stdio-socket` in `args`, if any (a
/// path is bytes: it need not be UTF-8).
pub fn redirect<I: IntoIterator<Item = OsString>>(args: I) -> Result<(), String> {
    let Some(path) = socket_path(args) else {
        return Ok(());
    };
    let stream =
        UnixStream::connect(&path).map_err(|e| format!("{FLAG} {path:?}: cannot connect: {e}"))?;
    for target in [libc::STDIN_FILENO, libc::STDOUT_FILENO] {
        // SAFETY: both descriptors are open; dup2 replaces `target` atomically.
        if unsafe { libc::dup2(stream.as_raw_fd(), target) } < 0 {
            let error = std::io::Error::last_os_error();
            return Err(format!("{FLAG}: cannot use the socket as stdio: {error}"));
        }
    }
    Ok(())
}

/// Whether `args` name a socket.
pub fn named<I: IntoIterator<Item = OsString>>(args: I) -> bool {
    socket_path(args).is_some()
}

/// Whether `arg`, after the argument `previous`, is the socket's path.
pub fn names_path(previous: Option<&str>, arg: &OsStr) -> bool {
    previous == Some(FLAG) || inline_path(arg).is_some()
}

/// The value of the flag (`--stdio-socket PATH` or `--stdio-socket=PATH`).
fn socket_path<I: IntoIterator<Item = OsString>>(args: I) -> Option<OsString> {
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        if arg == FLAG {
            return args.next();
        }
        if let Some(path) = inline_path(&arg) {
            return Some(path.to_owned());
        }
    }
    None
}

/// The path of `--stdio-socket=PATH`.
fn inline_path(arg: &OsStr) -> Option<&OsStr> {
    let rest = arg.as_bytes().strip_prefix(FLAG.as_bytes())?;
    rest.strip_prefix(b"=").map(OsStr::from_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<OsString> {
        list.iter().map(OsString::from).collect()
    }

    #[test]
    fn the_path_is_read_in_either_form() {
        assert_eq!(socket_path(args(&["--stdio"])), None);
        let spaced = args(&["--stdio", "--stdio-socket", "/tmp/d/s"]);
        assert_eq!(socket_path(spaced), Some("/tmp/d/s".into()));
        let inline = args(&["--stdio-socket=/tmp/d/s", "--stdio"]);
        assert_eq!(socket_path(inline), Some("/tmp/d/s".into()));
        // Bytes that are not UTF-8, as given.
        let raw = OsStr::from_bytes(b"--stdio-socket=/tmp/d/\xff").to_owned();
        let path = OsStr::from_bytes(b"/tmp/d/\xff").to_owned();
        assert_eq!(socket_path([raw]), Some(path));
    }

    #[test]
    fn a_socket_no_one_listens_on_is_an_error() {
        let error = redirect(args(&["--stdio", "--stdio-socket", "/nonexistent/s"])).unwrap_err();
        assert!(error.contains("cannot connect"), "{error}");
    }
}

//! Secrets (the TCP clients' shared secret, the Redis password and key secret): read from a
//! file named on the command line or from the environment, never taken from the arguments.

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::unix::ffi::OsStringExt;
use std::os::unix::fs::OpenOptionsExt;

use bourse_core::rules::{MAX_SECRET_BYTES, MAX_SECRET_FILE_BYTES};

/// Where secrets may come from: a file named on the command line, or the environment.
pub trait Environment {
    /// The variable's bytes (a secret need not be UTF-8), `None` when unset or empty.
    fn var(&self, name: &str) -> Option<Vec<u8>>;
    fn read(&self, path: &str) -> Result<Vec<u8>, String>;
}

/// The process's own environment and files.
pub struct Process;

impl Environment for Process {
    fn var(&self, name: &str) -> Option<Vec<u8>> {
        let value = std::env::var_os(name)?.into_vec();
        (!value.is_empty()).then_some(value)
    }

    /// A regular file's bytes. Opened without blocking, so that a FIFO nobody writes to
    /// (or another special file) is refused rather than waited on.
    fn read(&self, path: &str) -> Result<Vec<u8>, String> {
        let cannot = |error: std::io::Error| format!("cannot read {path}: {error}");
        let file: File = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(path)
            .map_err(cannot)?;
        if !file.metadata().map_err(cannot)?.is_file() {
            return Err(format!("cannot read {path}: not a regular file"));
        }
        let mut bytes = Vec::new();
        file.take(MAX_SECRET_FILE_BYTES as u64 + 1)
            .read_to_end(&mut bytes)
            .map_err(cannot)?;
        if bytes.len() > MAX_SECRET_FILE_BYTES {
            return Err(format!(
                "cannot read {path}: larger than {MAX_SECRET_FILE_BYTES} bytes, no secret's file"
            ));
        }
        Ok(bytes)
    }
}

/// A secret from `file` (read through `env`) or else the variable `var`, and where it came
/// from (`--flag PATH` or the variable's name), for messages; a trailing newline is not
/// part of it.
pub fn read_secret(
    env: &impl Environment,
    flag: &str,
    file: Option<&str>,
    var: &str,
) -> Result<Option<(Vec<u8>, String)>, String> {
    let (mut bytes, source) = match file {
        Some(path) => (
            env.read(path).map_err(|error| format!("{flag}: {error}"))?,
            format!("{flag} {path}"),
        ),
        None => match env.var(var) {
            Some(value) => (value, var.to_string()),
            None => return Ok(None),
        },
    };
    while matches!(bytes.last(), Some(b'\n' | b'\r')) {
        bytes.pop();
    }
    if bytes.is_empty() {
        return Err(format!("{source}: the secret is empty"));
    }
    if bytes.len() > MAX_SECRET_BYTES {
        return Err(format!(
            "{source}: the secret is longer than {MAX_SECRET_BYTES} bytes"
        ));
    }
    Ok(Some((bytes, source)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh path in the temporary directory.
    fn path_of(name: &str) -> String {
        let dir = std::env::temp_dir();
        let path = dir.join(format!("bourse-secret-{}-{name}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        path.to_str().unwrap().to_string()
    }

    fn read(path: &str) -> Result<Option<(Vec<u8>, String)>, String> {
        read_secret(&Process, "--secret-file", Some(path), "NO_SUCH_VARIABLE")
    }

    #[test]
    fn a_secrets_file_is_a_regular_file_of_a_few_bytes() {
        let plain = path_of("plain");
        std::fs::write(&plain, "s3cret\r\n").unwrap();
        let (secret, source) = read(&plain).unwrap().unwrap();
        assert_eq!(secret, b"s3cret");
        assert_eq!(source, format!("--secret-file {plain}"));

        let empty = path_of("empty");
        std::fs::write(&empty, "\n\n").unwrap();
        let error = read(&empty).unwrap_err();
        assert_eq!(error, format!("--secret-file {empty}: the secret is empty"));

        let long = path_of("long");
        std::fs::write(&long, "x".repeat(MAX_SECRET_BYTES + 1)).unwrap();
        let error = read(&long).unwrap_err();
        assert!(
            error.ends_with("the secret is longer than 4096 bytes"),
            "{error}"
        );
        assert!(!error.contains("xxx"), "{error}");

        let huge = path_of("huge");
        std::fs::write(&huge, vec![b'x'; 100_000]).unwrap();
        assert!(read(&huge).unwrap_err().contains("larger than 65536 bytes"));

        // A FIFO nobody writes to is refused at once, not waited on; so is a directory.
        let fifo = path_of("fifo");
        let name = std::ffi::CString::new(fifo.clone()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
        let dir = std::env::temp_dir();
        for special in [fifo.as_str(), dir.to_str().unwrap()] {
            let error = read(special).unwrap_err();
            assert!(error.ends_with("not a regular file"), "{error}");
        }
        for path in [plain, empty, long, huge, fifo] {
            std::fs::remove_file(path).unwrap();
        }
    }
}

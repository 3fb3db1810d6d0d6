//! Secrets (the TCP clients' shared secret, the Redis password and key secret): read from a
//! file named on the command line or from the environment, never taken from the arguments.

use std::os::unix::ffi::OsStringExt;

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

    fn read(&self, path: &str) -> Result<Vec<u8>, String> {
        std::fs::read(path).map_err(|error| format!("cannot read {path}: {error}"))
    }
}

/// A secret from `file` (read through `env`) or else the variable `var`; a trailing
/// newline is not part of it.
pub fn read_secret(
    env: &impl Environment,
    flag: &str,
    file: Option<&str>,
    var: &str,
) -> Result<Option<Vec<u8>>, String> {
    let mut bytes = match file {
        Some(path) => env.read(path).map_err(|error| format!("{flag}: {error}"))?,
        None => match env.var(var) {
            Some(value) => value,
            None => return Ok(None),
        },
    };
    while matches!(bytes.last(), Some(b'\n' | b'\r')) {
        bytes.pop();
    }
    if bytes.is_empty() {
        return Err(format!("{flag} / {var}: the secret is empty"));
    }
    Ok(Some(bytes))
}

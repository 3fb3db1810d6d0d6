//! Secrets (the TCP clients' shared secret, the Redis password and key secret): read from a
//! file named on the command line or from the environment, never taken from the arguments.

/// Where secrets may come from: a file named on the command line, or the environment.
pub trait Environment {
    fn var(&self, name: &str) -> Option<String>;
    fn read(&self, path: &str) -> Result<Vec<u8>, String>;
}

/// The process's own environment and files.
pub struct Process;

impl Environment for Process {
    fn var(&self, name: &str) -> Option<String> {
        std::env::var(name).ok().filter(|value| !value.is_empty())
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
            Some(value) => value.into_bytes(),
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

//! The arguments read into flags, one at a time: each flag's value checked on its own
//! (`--flag value` or `--flag=value`); what they mean together is judged by `parse`.

use std::net::SocketAddr;
use std::path::PathBuf;

use bourse_core::rules::{
    DEFAULT_BOOKING_SLACK_MS, MAX_CHECKS, MAX_KEY_PART_BYTES, MAX_SETTING_MS, MAX_STORE_TIMEOUT_MS,
};

/// Bounds of the numeric options.
const FRAME_BYTES: (u64, u64) = (64, 64 * 1024 * 1024);
/// The default largest request frame: room for the largest `check_many` a limiter accepts
/// (its most checks, each of three key parts of the most bytes, and 1 KiB for the rest), so
/// that a shared daemon takes every call the other backends take (4 MiB).
pub const DEFAULT_MAX_FRAME_BYTES: usize = MAX_CHECKS * (3 * MAX_KEY_PART_BYTES + 1024);

/// Every flag as given, or its default.
pub struct Flags {
    pub stdio: bool,
    pub stdio_socket: Option<PathBuf>,
    pub tcp: Vec<SocketAddr>,
    pub unix: Vec<PathBuf>,
    pub allow_remote: bool,
    pub assume_busy_at_start: bool,
    pub booking_slack_ms: u64,
    pub sweep_interval_ms: u64,
    pub max_frame_bytes: usize,
    pub redis_url: Option<String>,
    pub cluster_seeds: Vec<String>,
    pub redis_prefix: Option<String>,
    pub redis_timeout_ms: Option<u64>,
    pub redis_password_file: Option<String>,
    pub redis_key_secret_file: Option<String>,
    pub secret_file: Option<String>,
    pub socket_mode: u32,
    pub max_connections: usize,
    pub idle_timeout_ms: u64,
}

impl Default for Flags {
    fn default() -> Self {
        Self {
            stdio: false,
            stdio_socket: None,
            tcp: Vec::new(),
            unix: Vec::new(),
            allow_remote: false,
            assume_busy_at_start: false,
            booking_slack_ms: DEFAULT_BOOKING_SLACK_MS,
            sweep_interval_ms: 1000,
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
            redis_url: None,
            cluster_seeds: Vec::new(),
            redis_prefix: None,
            redis_timeout_ms: None,
            redis_password_file: None,
            redis_key_secret_file: None,
            secret_file: None,
            socket_mode: 0o600,
            max_connections: 256,
            idle_timeout_ms: 300_000,
        }
    }
}

/// What the arguments ask for.
pub enum Read {
    Help,
    Version,
    Flags(Box<Flags>),
}

/// Reads the arguments after the program name; `--help` and `--version` stop the reading.
pub fn read<I: IntoIterator<Item = String>>(args: I) -> Result<Read, String> {
    let mut flags = Flags::default();
    let mut given: Vec<String> = Vec::new();
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        // `--flag=value` is the same as `--flag value`.
        let (flag, inline) = match arg.split_once('=') {
            Some((flag, value)) if flag.starts_with("--") => (flag.to_string(), Some(value)),
            _ => (arg.clone(), None),
        };
        let mut value = |name: &str| -> Result<String, String> {
            match &inline {
                Some(value) => Ok(value.to_string()),
                None => args.next().ok_or_else(|| format!("{name} needs a value")),
            }
        };
        let f = &mut flags;
        match flag.as_str() {
            "-h" | "--help" => return Ok(Read::Help),
            "-V" | "--version" => return Ok(Read::Version),
            "--stdio" => f.stdio = true,
            "--stdio-socket" => {
                let path = value("--stdio-socket")?;
                if path.is_empty() {
                    return Err("--stdio-socket needs a non-empty path".into());
                }
                f.stdio_socket = Some(PathBuf::from(path));
            }
            "--listen" => f.tcp.push(socket_addr(&value("--listen")?)?),
            "--socket" => {
                let path = value("--socket")?;
                if path.is_empty() {
                    return Err("--socket needs a non-empty path".into());
                }
                f.unix.push(PathBuf::from(path));
            }
            "--allow-remote" => f.allow_remote = true,
            "--assume-busy-at-start" => f.assume_busy_at_start = true,
            "--booking-slack-ms" => {
                f.booking_slack_ms = number(
                    "--booking-slack-ms",
                    &value("--booking-slack-ms")?,
                    (0, MAX_SETTING_MS),
                )?
            }
            "--sweep-interval-ms" => {
                f.sweep_interval_ms = number(
                    "--sweep-interval-ms",
                    &value("--sweep-interval-ms")?,
                    (1, MAX_SETTING_MS),
                )?
            }
            "--max-frame-bytes" => {
                f.max_frame_bytes = number(
                    "--max-frame-bytes",
                    &value("--max-frame-bytes")?,
                    FRAME_BYTES,
                )? as usize
            }
            "--redis" => f.redis_url = Some(value("--redis")?),
            "--redis-cluster" => f.cluster_seeds.push(value("--redis-cluster")?),
            "--redis-password-file" => {
                f.redis_password_file = Some(value("--redis-password-file")?)
            }
            "--redis-key-secret-file" => {
                f.redis_key_secret_file = Some(value("--redis-key-secret-file")?)
            }
            "--secret-file" => f.secret_file = Some(value("--secret-file")?),
            "--socket-mode" => {
                f.socket_mode = match value("--socket-mode")?.as_str() {
                    "600" | "0600" => 0o600,
                    "660" | "0660" => 0o660,
                    other => {
                        return Err(format!("--socket-mode must be 600 or 660, got {other:?}"))
                    }
                }
            }
            "--max-connections" => {
                f.max_connections = number(
                    "--max-connections",
                    &value("--max-connections")?,
                    (1, 65_536),
                )? as usize
            }
            "--idle-timeout-ms" => {
                f.idle_timeout_ms = number(
                    "--idle-timeout-ms",
                    &value("--idle-timeout-ms")?,
                    (0, MAX_SETTING_MS),
                )?
            }
            "--redis-prefix" => f.redis_prefix = Some(value("--redis-prefix")?),
            "--redis-timeout-ms" => {
                f.redis_timeout_ms = Some(number(
                    "--redis-timeout-ms",
                    &value("--redis-timeout-ms")?,
                    (1, MAX_STORE_TIMEOUT_MS),
                )?)
            }
            _ => return Err(unknown(&flag)),
        }
        if inline.is_some()
            && matches!(
                flag.as_str(),
                "--stdio" | "--allow-remote" | "--assume-busy-at-start"
            )
        {
            return Err(format!("{flag} takes no value"));
        }
        // A later setting wins, but a later URL or secret file would replace an earlier one
        // unchecked (a `--redis` URL holding a password, say): those are given once.
        if matches!(
            flag.as_str(),
            "--redis" | "--secret-file" | "--redis-password-file" | "--redis-key-secret-file"
        ) {
            if given.contains(&flag) {
                return Err(format!("{flag} given more than once"));
            }
            given.push(flag);
        }
    }
    Ok(Read::Flags(Box::new(flags)))
}

/// An unknown argument, named when it reads as a flag (a misspelt one, say), else
/// described by its size: it may be a secret put on the command line by mistake.
fn unknown(arg: &str) -> String {
    let flag = arg.len() <= 40
        && arg.starts_with('-')
        && arg.bytes().all(|b| b == b'-' || b.is_ascii_lowercase());
    match flag {
        true => format!("unknown argument {arg:?}"),
        false => format!("unknown argument of {} bytes (flags are --name)", arg.len()),
    }
}

fn socket_addr(text: &str) -> Result<SocketAddr, String> {
    text.parse().map_err(|_| {
        format!("--listen needs IP:PORT such as 127.0.0.1:7400 or [::1]:7400 (no host names), got {text:?}")
    })
}

fn number(flag: &str, text: &str, (min, max): (u64, u64)) -> Result<u64, String> {
    match text.parse::<u64>() {
        Ok(n) if (min..=max).contains(&n) => Ok(n),
        _ => Err(format!(
            "{flag} needs an integer from {min} to {max}, got {text:?}"
        )),
    }
}

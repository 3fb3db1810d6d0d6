//! Command-line options.

use std::net::SocketAddr;
use std::path::PathBuf;

pub const USAGE: &str = "\
Usage: bourse_daemon --stdio [OPTIONS]
       bourse_daemon (--listen 127.0.0.1:PORT | --socket PATH)... [OPTIONS]

A shared rate-limiter table speaking the Bourse JSON protocol (docs/PROTOCOL.md).

Modes:
  --stdio                   Serve one client on stdin/stdout, as an Erlang port:
                            4-byte big-endian length-prefixed JSON frames ({:packet, 4}).
                            Exits when stdin closes.
  --listen ADDR             Serve many clients on a TCP address (PORT 0 picks a free one);
                            newline-delimited JSON. Repeatable.
  --socket PATH             Serve many clients on a Unix socket; a stale socket file is
                            replaced, the file is removed on exit. Repeatable.
  On start a server prints `listening tcp ADDR` / `listening unix PATH` per listener.

Storage:
  (default)                 The buckets live in this process.
  --redis URL               The buckets live in Redis (redis://[user:pass@]HOST:PORT[/DB] or
                            unix:///PATH), shared by every daemon using the same server and
                            prefix, timed by the Redis server's clock. While Redis cannot be
                            reached, requests are answered with an `unavailable` error and
                            nothing is admitted; the connection is retried on each request.
  --redis-prefix P          Prefix of every Redis key (default bourse; A-Z a-z 0-9 _ - . :).
  --redis-timeout-ms N      Longest wait for Redis per command, connecting included
                            (default 1000, 1..=60000).

Options:
  --allow-remote            Accept a non-loopback --listen address (the protocol has no
                            authentication: only do this on a trusted network).
  --assume-busy-at-start    Buckets first seen within their fill time after start begin
                            as if empty at start (use after a restart).
  --booking-slack-ms N      How long past its ready time a booking may be claimed
                            (default 250, at most 86400000).
  --sweep-interval-ms N     How often idle full buckets are dropped (default 1000,
                            1..=86400000).
  --max-frame-bytes N       Largest request frame (default 65536, 64..=67108864); a larger
                            one is answered with a frame_too_large error, then the
                            connection is closed.
  -h, --help                Print this text.
  -V, --version             Print the version and the protocol version.

Signals: SIGTERM (and SIGINT in server mode) stop accepting, answer the requests already
received, remove the socket files and exit 0. In --stdio mode SIGINT is ignored (Ctrl-C in
the BEAM shell reaches the whole process group); closing stdin is the way to stop it.
";

/// Bounds of the numeric options.
const MAX_MS_OPTION: u64 = 86_400_000;
const FRAME_BYTES: (u64, u64) = (64, 64 * 1024 * 1024);

/// What the daemon was asked to do.
#[derive(Debug, PartialEq, Eq)]
pub enum Command {
    Help,
    Version,
    Run(Options),
}

/// How to serve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    Stdio,
    Server {
        tcp: Vec<SocketAddr>,
        unix: Vec<PathBuf>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    pub mode: Mode,
    pub assume_busy_at_start: bool,
    pub booking_slack_ms: u64,
    pub sweep_interval_ms: u64,
    pub max_frame_bytes: usize,
    /// Where the buckets live: this process, or a Redis server.
    pub redis: Option<RedisOptions>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisOptions {
    pub url: String,
    pub prefix: String,
    pub timeout_ms: u64,
}

/// Parses the arguments after the program name. An error is a message for stderr.
pub fn parse<I: IntoIterator<Item = String>>(args: I) -> Result<Command, String> {
    let mut stdio = false;
    let mut tcp = Vec::new();
    let mut unix = Vec::new();
    let mut allow_remote = false;
    let mut assume_busy_at_start = false;
    let mut booking_slack_ms = 250;
    let mut sweep_interval_ms = 1000;
    let mut max_frame_bytes = 65536;
    let mut redis_url = None;
    let mut redis_prefix = None;
    let mut redis_timeout_ms = None;

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
        match flag.as_str() {
            "-h" | "--help" => return Ok(Command::Help),
            "-V" | "--version" => return Ok(Command::Version),
            "--stdio" => stdio = true,
            "--listen" => tcp.push(socket_addr(&value("--listen")?)?),
            "--socket" => {
                let path = value("--socket")?;
                if path.is_empty() {
                    return Err("--socket needs a non-empty path".into());
                }
                unix.push(PathBuf::from(path));
            }
            "--allow-remote" => allow_remote = true,
            "--assume-busy-at-start" => assume_busy_at_start = true,
            "--booking-slack-ms" => {
                booking_slack_ms = number(
                    "--booking-slack-ms",
                    &value("--booking-slack-ms")?,
                    (0, MAX_MS_OPTION),
                )?
            }
            "--sweep-interval-ms" => {
                sweep_interval_ms = number(
                    "--sweep-interval-ms",
                    &value("--sweep-interval-ms")?,
                    (1, MAX_MS_OPTION),
                )?
            }
            "--max-frame-bytes" => {
                max_frame_bytes = number(
                    "--max-frame-bytes",
                    &value("--max-frame-bytes")?,
                    FRAME_BYTES,
                )? as usize
            }
            "--redis" => redis_url = Some(value("--redis")?),
            "--redis-prefix" => redis_prefix = Some(value("--redis-prefix")?),
            "--redis-timeout-ms" => {
                redis_timeout_ms = Some(number(
                    "--redis-timeout-ms",
                    &value("--redis-timeout-ms")?,
                    (1, 60_000),
                )?)
            }
            _ => return Err(format!("unknown argument {arg:?}")),
        }
        if inline.is_some()
            && matches!(
                flag.as_str(),
                "--stdio" | "--allow-remote" | "--assume-busy-at-start"
            )
        {
            return Err(format!("{flag} takes no value"));
        }
    }

    let mode = match (stdio, tcp.is_empty() && unix.is_empty()) {
        (true, false) => return Err("--stdio cannot be combined with --listen or --socket".into()),
        (true, true) => Mode::Stdio,
        (false, false) => {
            if let Some(remote) = tcp.iter().find(|addr| !addr.ip().is_loopback()) {
                if !allow_remote {
                    return Err(format!(
                        "refusing to listen on {remote}: not a loopback address, and the protocol \
                         has no authentication; pass --allow-remote to accept other hosts"
                    ));
                }
            }
            Mode::Server { tcp, unix }
        }
        (false, true) => {
            return Err("choose a mode: --stdio, --listen ADDR or --socket PATH".into())
        }
    };
    let redis = match redis_url {
        Some(url) => Some(RedisOptions {
            url,
            prefix: redis_prefix.unwrap_or_else(|| "bourse".into()),
            timeout_ms: redis_timeout_ms.unwrap_or(1000),
        }),
        None if redis_prefix.is_some() || redis_timeout_ms.is_some() => {
            return Err("--redis-prefix and --redis-timeout-ms need --redis URL".into())
        }
        None => None,
    };
    Ok(Command::Run(Options {
        mode,
        assume_busy_at_start,
        booking_slack_ms,
        sweep_interval_ms,
        max_frame_bytes,
        redis,
    }))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn run(args: &[&str]) -> Result<Command, String> {
        parse(args.iter().map(|s| s.to_string()))
    }

    fn options(args: &[&str]) -> Options {
        match run(args) {
            Ok(Command::Run(options)) => options,
            other => panic!("expected options, got {other:?}"),
        }
    }

    #[test]
    fn defaults_and_values() {
        let o = options(&["--stdio"]);
        assert_eq!(o.mode, Mode::Stdio);
        assert_eq!(
            (o.booking_slack_ms, o.sweep_interval_ms, o.max_frame_bytes),
            (250, 1000, 65536)
        );
        assert!(!o.assume_busy_at_start);
        let o = options(&[
            "--listen",
            "127.0.0.1:0",
            "--socket=/tmp/x.sock",
            "--booking-slack-ms=0",
            "--sweep-interval-ms",
            "5",
            "--max-frame-bytes",
            "1024",
            "--assume-busy-at-start",
        ]);
        assert_eq!(
            o.mode,
            Mode::Server {
                tcp: vec!["127.0.0.1:0".parse().unwrap()],
                unix: vec![PathBuf::from("/tmp/x.sock")]
            }
        );
        assert_eq!(
            (o.booking_slack_ms, o.sweep_interval_ms, o.max_frame_bytes),
            (0, 5, 1024)
        );
        assert!(o.assume_busy_at_start);
        assert_eq!(o.redis, None);
        let o = options(&["--stdio", "--redis", "redis://127.0.0.1:6379"]);
        assert_eq!(
            o.redis,
            Some(RedisOptions {
                url: "redis://127.0.0.1:6379".into(),
                prefix: "bourse".into(),
                timeout_ms: 1000
            })
        );
        let o = options(&[
            "--stdio",
            "--redis=redis://h:1",
            "--redis-prefix",
            "team",
            "--redis-timeout-ms=50",
        ]);
        assert_eq!(
            o.redis.map(|r| (r.prefix, r.timeout_ms)),
            Some(("team".into(), 50))
        );
        assert_eq!(run(&["--stdio", "--help"]), Ok(Command::Help));
        assert_eq!(run(&["-V"]), Ok(Command::Version));
    }

    #[test]
    fn rejects_bad_arguments() {
        for bad in [
            &[][..],
            &["--stdio", "--listen", "127.0.0.1:1"],
            &["--bogus"],
            &["--listen"],
            &["--listen", "localhost:80"],
            &["--listen", "0.0.0.0:80"],
            &["--stdio", "--sweep-interval-ms", "0"],
            &["--stdio", "--max-frame-bytes", "10"],
            &["--stdio", "--booking-slack-ms", "-1"],
            &["--stdio", "--booking-slack-ms", "1e3"],
            &["--stdio=yes"],
            &["--socket", ""],
            &["--stdio", "--redis"],
            &["--stdio", "--redis-prefix", "x"],
            &[
                "--stdio",
                "--redis",
                "redis://h:1",
                "--redis-timeout-ms",
                "0",
            ],
        ] {
            assert!(run(bad).is_err(), "{bad:?} accepted");
        }
        assert!(run(&["--listen", "0.0.0.0:80", "--allow-remote"]).is_ok());
    }
}

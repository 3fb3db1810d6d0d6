//! Command-line options.

use std::net::SocketAddr;
use std::path::PathBuf;

use crate::redis::Servers;

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

Access (server mode):
  Unix sockets are created owner-only (0600) whatever the umask.
  --socket-mode 660         Let the socket file's group connect too (give the directory
                            that group; only 600 and 660 are accepted).
  TCP clients must prove a shared secret before anything but `hello` is served: the
  secret (at least 16 bytes, a trailing newline ignored) comes from the file named by
  --secret-file PATH, or else from the environment variable BOURSE_DAEMON_SECRET; never
  from the command line. --listen without a secret is refused.
  --max-connections N       Connections served at once (default 256, 1..=65536); past it
                            a connection is told so and closed.
  --idle-timeout-ms N       Close a connection that sent nothing for N ms (default
                            300000; 0: never). A connection that must prove the secret
                            has 10 s to do it.

Storage:
  (default)                 The buckets live in this process.
  --redis URL               The buckets live in Redis (redis://[user@]HOST:PORT[/DB] or
                            unix:///PATH), shared by every daemon using the same server and
                            prefix, timed by the Redis server's clock. While Redis cannot be
                            reached, requests are answered with an `unavailable` error and
                            nothing is admitted; the connection is retried on each request.
                            The URL may not hold a password: it comes from the file named by
                            --redis-password-file PATH, or from BOURSE_REDIS_PASSWORD.
  --redis-cluster URL       The buckets live in a Redis Cluster found through this seed node
                            (redis://[user@]HOST:PORT; repeat for more seeds), instead of
                            --redis. Each check runs on the master of its exchange's slot;
                            a check over several exchanges is refused. The password comes
                            as for --redis. Failover: see docs/PROTOCOL.md.
  --redis-key-secret-file P Key of the fingerprints that stand for credentials in Redis key
                            names (else BOURSE_REDIS_KEY_SECRET, else a fixed key: names
                            are then plain SHA-256 fingerprints). Every daemon sharing the
                            buckets needs the same one.
  --redis-prefix P          Prefix of every Redis key (default bourse; A-Z a-z 0-9 _ - . :).
  --redis-timeout-ms N      Longest wait for Redis per command, connecting included
                            (default 1000, 1..=60000).

Options:
  --allow-remote            Accept a non-loopback --listen address (the secret is proved,
                            never sent, but requests travel in clear: trusted networks only).
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
    Run(Box<Options>),
}

/// Where the clients are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transport {
    Stdio,
    Server {
        tcp: Vec<SocketAddr>,
        unix: Vec<PathBuf>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    pub transport: Transport,
    pub assume_busy_at_start: bool,
    pub booking_slack_ms: u64,
    pub sweep_interval_ms: u64,
    pub max_frame_bytes: usize,
    pub access: Access,
    /// Where the buckets live: this process, or a Redis server.
    pub redis: Option<RedisOptions>,
}

/// Who may connect in server mode.
#[derive(Clone, PartialEq, Eq)]
pub struct Access {
    /// What TCP clients prove.
    pub secret: Option<Vec<u8>>,
    pub socket_mode: u32,
    pub max_connections: usize,
    pub idle_timeout_ms: u64,
}

// Never shows the secret.
impl std::fmt::Debug for Access {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Access")
            .field("secret", &self.secret.as_ref().map(|_| "<set>"))
            .field("socket_mode", &self.socket_mode)
            .field("max_connections", &self.max_connections)
            .field("idle_timeout_ms", &self.idle_timeout_ms)
            .finish()
    }
}

#[derive(Clone, PartialEq, Eq)]
pub struct RedisOptions {
    pub servers: Servers,
    pub password: Option<String>,
    pub key_secret: Option<Vec<u8>>,
    pub prefix: String,
    pub timeout_ms: u64,
}

// Never shows the password or the key secret.
impl std::fmt::Debug for RedisOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisOptions")
            .field("servers", &self.servers)
            .field("password", &self.password.as_ref().map(|_| "<set>"))
            .field("key_secret", &self.key_secret.as_ref().map(|_| "<set>"))
            .field("prefix", &self.prefix)
            .field("timeout_ms", &self.timeout_ms)
            .finish()
    }
}

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
fn read_secret(
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

/// Parses the arguments after the program name. An error is a message for stderr.
pub fn parse<I: IntoIterator<Item = String>>(
    args: I,
    env: &impl Environment,
) -> Result<Command, String> {
    let mut stdio = false;
    let mut tcp = Vec::new();
    let mut unix = Vec::new();
    let mut allow_remote = false;
    let mut assume_busy_at_start = false;
    let mut booking_slack_ms = 250;
    let mut sweep_interval_ms = 1000;
    let mut max_frame_bytes = 65536;
    let mut redis_url = None;
    let mut cluster_seeds = Vec::new();
    let mut redis_prefix = None;
    let mut redis_timeout_ms = None;
    let mut redis_password_file = None;
    let mut redis_key_secret_file = None;
    let mut secret_file = None;
    let mut socket_mode = 0o600;
    let mut max_connections = 256;
    let mut idle_timeout_ms = 300_000;

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
            "--redis-cluster" => cluster_seeds.push(value("--redis-cluster")?),
            "--redis-password-file" => redis_password_file = Some(value("--redis-password-file")?),
            "--redis-key-secret-file" => {
                redis_key_secret_file = Some(value("--redis-key-secret-file")?)
            }
            "--secret-file" => secret_file = Some(value("--secret-file")?),
            "--socket-mode" => {
                socket_mode = match value("--socket-mode")?.as_str() {
                    "600" | "0600" => 0o600,
                    "660" | "0660" => 0o660,
                    other => {
                        return Err(format!("--socket-mode must be 600 or 660, got {other:?}"))
                    }
                }
            }
            "--max-connections" => {
                max_connections = number(
                    "--max-connections",
                    &value("--max-connections")?,
                    (1, 65_536),
                )? as usize
            }
            "--idle-timeout-ms" => {
                idle_timeout_ms = number(
                    "--idle-timeout-ms",
                    &value("--idle-timeout-ms")?,
                    (0, MAX_MS_OPTION),
                )?
            }
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

    let secret = read_secret(
        env,
        "--secret-file",
        secret_file.as_deref(),
        "BOURSE_DAEMON_SECRET",
    )?;
    let transport = match (stdio, tcp.is_empty() && unix.is_empty()) {
        (true, false) => return Err("--stdio cannot be combined with --listen or --socket".into()),
        (true, true) => Transport::Stdio,
        (false, false) => {
            if let Some(remote) = tcp.iter().find(|addr| !addr.ip().is_loopback()) {
                if !allow_remote {
                    return Err(format!(
                        "refusing to listen on {remote}: not a loopback address, and requests \
                         travel in clear; pass --allow-remote to accept other hosts"
                    ));
                }
            }
            match &secret {
                None if !tcp.is_empty() => {
                    return Err("--listen needs a shared secret for its clients to prove: \
                                --secret-file PATH or BOURSE_DAEMON_SECRET"
                        .into())
                }
                Some(secret) if secret.len() < 16 => {
                    return Err("the shared secret must be at least 16 bytes".into())
                }
                _ => {}
            }
            Transport::Server { tcp, unix }
        }
        (false, true) => {
            return Err("choose a mode: --stdio, --listen ADDR or --socket PATH".into())
        }
    };
    let servers = match (redis_url, cluster_seeds.is_empty()) {
        (Some(_), false) => return Err("choose one of --redis and --redis-cluster".into()),
        (Some(url), true) => Some(Servers::One(url)),
        (None, false) => Some(Servers::Cluster(cluster_seeds)),
        (None, true) => None,
    };
    let redis = match servers {
        Some(servers) => {
            let urls = match &servers {
                Servers::One(url) => std::slice::from_ref(url),
                Servers::Cluster(seeds) => seeds.as_slice(),
            };
            if urls.iter().any(|url| has_password(url)) {
                return Err(
                    "--redis URL must not hold a password (the command line is public): \
                            use --redis-password-file PATH or BOURSE_REDIS_PASSWORD"
                        .into(),
                );
            }
            let password = read_secret(
                env,
                "--redis-password-file",
                redis_password_file.as_deref(),
                "BOURSE_REDIS_PASSWORD",
            )?
            .map(|bytes| String::from_utf8(bytes).map_err(|_| "the Redis password must be UTF-8"))
            .transpose()?;
            Some(RedisOptions {
                servers,
                password,
                key_secret: read_secret(
                    env,
                    "--redis-key-secret-file",
                    redis_key_secret_file.as_deref(),
                    "BOURSE_REDIS_KEY_SECRET",
                )?,
                prefix: redis_prefix.unwrap_or_else(|| "bourse".into()),
                timeout_ms: redis_timeout_ms.unwrap_or(1000),
            })
        }
        None if redis_prefix.is_some()
            || redis_timeout_ms.is_some()
            || redis_password_file.is_some()
            || redis_key_secret_file.is_some() =>
        {
            return Err(
                "--redis-prefix, --redis-timeout-ms, --redis-password-file and \
                        --redis-key-secret-file need --redis or --redis-cluster"
                    .into(),
            )
        }
        None => None,
    };
    Ok(Command::Run(Box::new(Options {
        transport,
        access: Access {
            secret,
            socket_mode,
            max_connections,
            idle_timeout_ms,
        },
        assume_busy_at_start,
        booking_slack_ms,
        sweep_interval_ms,
        max_frame_bytes,
        redis,
    })))
}

/// Whether a Redis URL holds `user:password@` (or `:password@`).
fn has_password(url: &str) -> bool {
    let Some((_, rest)) = url.split_once("://") else {
        return false;
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    authority
        .rsplit_once('@')
        .is_some_and(|(userinfo, _)| userinfo.contains(':'))
        || url.contains("password=")
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

    /// An environment holding `vars`, whose files all read as `file: <path>`.
    struct Fake(Vec<(&'static str, &'static str)>);

    impl Environment for Fake {
        fn var(&self, name: &str) -> Option<String> {
            self.0
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.to_string())
        }
        fn read(&self, path: &str) -> Result<Vec<u8>, String> {
            Ok(format!("file: {path}\n").into_bytes())
        }
    }

    const SECRET: (&str, &str) = ("BOURSE_DAEMON_SECRET", "0123456789abcdef");

    fn run_in(env: &Fake, args: &[&str]) -> Result<Command, String> {
        parse(args.iter().map(|s| s.to_string()), env)
    }

    fn run(args: &[&str]) -> Result<Command, String> {
        run_in(&Fake(vec![SECRET]), args)
    }

    #[test]
    fn secrets_come_from_files_or_the_environment_never_argv() {
        let o = match run(&["--listen", "127.0.0.1:1"]) {
            Ok(Command::Run(o)) => o,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            o.access.secret.as_deref(),
            Some(b"0123456789abcdef".as_slice())
        );
        assert!(!format!("{o:?}").contains("0123456789abcdef"));
        let none = Fake(vec![]);
        let error = run_in(&none, &["--listen", "127.0.0.1:1"]).unwrap_err();
        assert!(error.contains("needs a shared secret"), "{error}");
        // A socket alone needs none.
        assert!(run_in(&none, &["--socket", "/tmp/x"]).is_ok());
        let o = match run_in(
            &none,
            &["--listen", "127.0.0.1:1", "--secret-file", "/s/long-enough"],
        ) {
            Ok(Command::Run(o)) => o,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            o.access.secret.as_deref(),
            Some(b"file: /s/long-enough".as_slice())
        );
        let short = Fake(vec![("BOURSE_DAEMON_SECRET", "short")]);
        assert!(run_in(&short, &["--listen", "127.0.0.1:1"]).is_err());
        // Redis passwords: never in the URL.
        for url in [
            "redis://:pw@h:1",
            "redis://user:pw@h:1/2",
            "redis://h:1/?password=pw",
        ] {
            let error = run(&["--stdio", "--redis", url]).unwrap_err();
            assert!(error.contains("must not hold a password"), "{url}: {error}");
        }
        let env = Fake(vec![
            ("BOURSE_REDIS_PASSWORD", "pw"),
            ("BOURSE_REDIS_KEY_SECRET", "k"),
        ]);
        let o = match run_in(&env, &["--stdio", "--redis", "redis://user@h:1"]) {
            Ok(Command::Run(o)) => o,
            other => panic!("{other:?}"),
        };
        let redis = o.redis.unwrap();
        assert_eq!(redis.password.as_deref(), Some("pw"));
        assert_eq!(redis.key_secret.as_deref(), Some(b"k".as_slice()));
        assert!(!format!("{redis:?}").contains("pw"));
        let o = match run_in(
            &env,
            &[
                "--stdio",
                "--redis",
                "redis://h:1",
                "--redis-password-file",
                "/p",
            ],
        ) {
            Ok(Command::Run(o)) => o,
            other => panic!("{other:?}"),
        };
        assert_eq!(o.redis.unwrap().password.as_deref(), Some("file: /p"));
    }

    #[test]
    fn access_limits() {
        let o = options(&["--socket", "/tmp/x"]);
        assert_eq!(
            (
                o.access.socket_mode,
                o.access.max_connections,
                o.access.idle_timeout_ms
            ),
            (0o600, 256, 300_000)
        );
        let o = options(&[
            "--socket",
            "/tmp/x",
            "--socket-mode",
            "660",
            "--max-connections=3",
            "--idle-timeout-ms",
            "0",
        ]);
        assert_eq!(
            (
                o.access.socket_mode,
                o.access.max_connections,
                o.access.idle_timeout_ms
            ),
            (0o660, 3, 0)
        );
        for bad in [
            &["--socket", "/x", "--socket-mode", "666"][..],
            &["--socket", "/x", "--max-connections", "0"],
        ] {
            assert!(run(bad).is_err(), "{bad:?}");
        }
    }

    fn options(args: &[&str]) -> Options {
        match run(args) {
            Ok(Command::Run(options)) => *options,
            other => panic!("expected options, got {other:?}"),
        }
    }

    #[test]
    fn defaults_and_values() {
        let o = options(&["--stdio"]);
        assert_eq!(o.transport, Transport::Stdio);
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
            o.transport,
            Transport::Server {
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
                servers: Servers::One("redis://127.0.0.1:6379".into()),
                password: None,
                key_secret: None,
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
        let o = options(&[
            "--stdio",
            "--redis-cluster",
            "redis://127.0.0.1:7000",
            "--redis-cluster=redis://127.0.0.1:7001",
        ]);
        assert_eq!(
            o.redis.map(|r| r.servers),
            Some(Servers::Cluster(vec![
                "redis://127.0.0.1:7000".into(),
                "redis://127.0.0.1:7001".into()
            ]))
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
            &["--stdio", "--redis-cluster"],
            &[
                "--stdio",
                "--redis",
                "redis://h:1",
                "--redis-cluster",
                "redis://h:2",
            ],
            &[
                "--stdio",
                "--redis-cluster",
                "redis://h:1",
                "--redis-cluster",
                "redis://:pw@h:2",
            ],
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

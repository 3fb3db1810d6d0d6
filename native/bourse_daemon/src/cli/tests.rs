//! Tests of the command line.

use std::path::PathBuf;

use super::*;

/// An environment holding `vars`, whose files all read as `file: <path>`.
struct Fake(Vec<(&'static str, &'static str)>);

impl Environment for Fake {
    fn var(&self, name: &str) -> Option<Vec<u8>> {
        self.0
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_bytes().to_vec())
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
        "unix:///tmp/redis.sock?pass=pw",
        "unix:///tmp/redis.sock?db=1&pass=pw",
        "unix:///tmp/redis.sock?pa\tss=pw",
        "redis://:p\nw@h:1",
    ] {
        let error = run(&["--stdio", "--redis", url]).unwrap_err();
        assert!(
            error.starts_with("--redis URL must not hold a password"),
            "{url}: {error}"
        );
    }
    // A cluster's seed is named as such.
    let error = run(&["--stdio", "--redis-cluster", "redis://:pw@h:1"]).unwrap_err();
    assert!(
        error.starts_with("--redis-cluster URL must not hold a password"),
        "{error}"
    );
    // Other query fields hold no password.
    assert!(run(&[
        "--stdio",
        "--redis",
        "unix:///tmp/redis.sock?db=1&passive=1"
    ])
    .is_ok());
    // A typo'd flag's value (a URL, a password) is not shown.
    let error = run(&["--stdio", "--redis-clustr=redis://:hunter2@h:1"]).unwrap_err();
    assert!(error.contains("\"--redis-clustr\""), "{error}");
    assert!(!error.contains("hunter2"), "{error}");
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
fn redis_passwords_are_refused_however_the_url_spells_them() {
    use ::redis::IntoConnectionInfo;
    let client_password = |url: &str| {
        url.into_connection_info()
            .is_ok_and(|info| info.redis_settings().password().is_some())
    };
    // The client reads a query field's name percent-decoded (`%70ass` is `pass`), and the
    // query of a unix: URL without `//`.
    for url in [
        "unix:///tmp/redis.sock?%70ass=pw",
        "unix:///tmp/redis.sock?p%61ss=pw",
        "unix:///tmp/redis.sock?db=1&%70%61%73%73=pw",
        "unix:/tmp/redis.sock?pass=pw",
    ] {
        assert!(client_password(url), "{url}");
        let error = run(&["--stdio", "--redis", url]).unwrap_err();
        assert!(error.contains("must not hold a password"), "{url}: {error}");
    }
    // Fields the client does not read (`password`, `pass` in a redis:// URL, either in
    // another letter case: `%50` is `P`), and a URL it refuses (`db=x`, whose error would
    // show the URL), are refused too.
    for url in [
        "unix:///tmp/redis.sock?db=1&%70ass=pw&db=x",
        "unix:///tmp/redis.sock?%70assword=pw",
        "unix:///tmp/redis.sock?passw%6Frd=pw",
        "unix:///tmp/redis.sock?passw%6frd=pw",
        "redis://h:1/?p%61ss=pw",
        "unix:///tmp/redis.sock?%50ass=pw",
        "unix:///tmp/redis.sock?PASSWORD=pw",
        "redis://h:1/?Pass=pw",
    ] {
        let error = run(&["--stdio", "--redis", url]).unwrap_err();
        assert!(error.contains("must not hold a password"), "{url}: {error}");
    }
    // Names read as neither: `+` a space, `%2570` is `%70`, `%3D` is `=`.
    for url in [
        "unix:///tmp/redis.sock?pa+ss=x",
        "unix:///tmp/redis.sock?%2570ass=x",
        "unix:///tmp/redis.sock?pass%3D=x",
    ] {
        assert!(!client_password(url), "{url}");
        assert!(run(&["--stdio", "--redis", url]).is_ok(), "{url}");
    }
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
        (250, 1000, 4 * 1024 * 1024)
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

/// A URL or secret file given twice is refused, not replaced unchecked: a password in the
/// first `--redis` URL went through beside a second one. A later setting wins; lists may
/// repeat.
#[test]
fn a_url_or_secret_file_is_given_once() {
    let twice = [
        "--stdio",
        "--redis",
        "redis://:pw@h:1",
        "--redis",
        "redis://h:2",
    ];
    assert_eq!(
        run(&twice).err().as_deref(),
        Some("--redis given more than once")
    );
    for flag in [
        "--secret-file",
        "--redis-password-file",
        "--redis-key-secret-file",
    ] {
        let twice = ["--listen", "127.0.0.1:1", flag, "/a", &format!("{flag}=/b")];
        assert_eq!(
            run(&twice).err(),
            Some(format!("{flag} given more than once"))
        );
    }
    let both = [
        "--socket",
        "/a",
        "--socket",
        "/b",
        "--listen",
        "127.0.0.1:1",
    ];
    assert!(run(&both).is_ok());
    // A stray argument may be a secret: described, not shown.
    assert_eq!(
        run(&["--stdio", "HunterSECRET2"]).err().as_deref(),
        Some("unknown argument of 13 bytes (flags are --name)")
    );
    assert_eq!(
        run(&["--stdio", "--sweep-intervl"]).err().as_deref(),
        Some("unknown argument \"--sweep-intervl\"")
    );
    let later = [
        "--stdio",
        "--sweep-interval-ms",
        "5",
        "--sweep-interval-ms",
        "7",
    ];
    assert_eq!(options(&later).sweep_interval_ms, 7);
}

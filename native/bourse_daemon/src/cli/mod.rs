//! Command-line options: the arguments read into flags (`flags`), secrets read from files
//! or the environment (`secrets`), and the flags judged together into a [`Command`]
//! (`parse`, here). `usage` is the text of `--help`; `options` the types of a run.

mod flags;
mod options;
mod secrets;
mod usage;

pub use options::{Access, Command, Options, RedisOptions, Transport};
pub use secrets::{Environment, Process};
pub use usage::USAGE;

use std::ffi::OsString;

use crate::redis::{has_password, Servers};
use crate::stdio_socket;
use bourse_core::rules::MIN_SECRET_BYTES;
use flags::{Flags, Read};
use secrets::read_secret;

/// The arguments after the program name as text; one that is not UTF-8 (a flag's value
/// passed as raw bytes) is refused, by its place only: it may hold a secret. The path of
/// `--stdio-socket` may be any bytes: it was used as given before (`stdio_socket`).
pub fn arguments<I: IntoIterator<Item = OsString>>(args: I) -> Result<Vec<String>, String> {
    let mut texts: Vec<String> = Vec::new();
    for (index, arg) in args.into_iter().enumerate() {
        let socket_path = stdio_socket::names_path(texts.last().map(String::as_str), &arg);
        let text = match arg.into_string() {
            Ok(text) => text,
            Err(arg) if socket_path => arg.to_string_lossy().into_owned(),
            Err(_) => return Err(format!("argument {} is not UTF-8", index + 1)),
        };
        texts.push(text);
    }
    Ok(texts)
}

/// Parses the arguments after the program name. An error is a message for stderr.
pub fn parse<I: IntoIterator<Item = String>>(
    args: I,
    env: &impl Environment,
) -> Result<Command, String> {
    let flags = match flags::read(args)? {
        Read::Help => return Ok(Command::Help),
        Read::Version => return Ok(Command::Version),
        Read::Flags(flags) => flags,
    };
    let secret = read_secret(
        env,
        "--secret-file",
        flags.secret_file.as_deref(),
        "BOURSE_DAEMON_SECRET",
    )?
    .map(|(bytes, _source)| bytes);
    let transport = transport(&flags, secret.as_deref())?;
    let redis = redis(&flags, env)?;
    let Flags {
        assume_busy_at_start,
        booking_slack_ms,
        sweep_interval_ms,
        max_frame_bytes,
        socket_mode,
        max_connections,
        idle_timeout_ms,
        ..
    } = *flags;
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

/// Where the clients are: stdio, or listeners (loopback unless allowed; TCP only with a
/// shared secret of at least 16 bytes).
fn transport(flags: &Flags, secret: Option<&[u8]>) -> Result<Transport, String> {
    let Flags {
        stdio, tcp, unix, ..
    } = flags;
    if flags.stdio_socket.is_some() && !stdio {
        return Err("--stdio-socket goes with --stdio".into());
    }
    match (*stdio, tcp.is_empty() && unix.is_empty()) {
        (true, false) => Err("--stdio cannot be combined with --listen or --socket".into()),
        (true, true) => Ok(Transport::Stdio),
        (false, false) => {
            if let Some(remote) = tcp.iter().find(|addr| !addr.ip().is_loopback()) {
                if !flags.allow_remote {
                    return Err(format!(
                        "refusing to listen on {remote}: not a loopback address, and requests \
                         travel in clear; pass --allow-remote to accept other hosts"
                    ));
                }
            }
            match secret {
                None if !tcp.is_empty() => {
                    return Err("--listen needs a shared secret for its clients to prove: \
                                --secret-file PATH or BOURSE_DAEMON_SECRET"
                        .into())
                }
                Some(secret) if secret.len() < MIN_SECRET_BYTES => {
                    return Err(format!(
                        "the shared secret must be at least {MIN_SECRET_BYTES} bytes"
                    ))
                }
                _ => {}
            }
            Ok(Transport::Server {
                tcp: tcp.clone(),
                unix: unix.clone(),
            })
        }
        (false, true) => Err("choose a mode: --stdio, --listen ADDR or --socket PATH".into()),
    }
}

/// Where the buckets live: `None` for this process, else the Redis server or cluster and
/// its secrets (never in a URL: the command line is public).
fn redis(flags: &Flags, env: &impl Environment) -> Result<Option<RedisOptions>, String> {
    let servers = match (&flags.redis_url, flags.cluster_seeds.is_empty()) {
        (Some(_), false) => return Err("choose one of --redis and --redis-cluster".into()),
        (Some(url), true) => Servers::One(url.clone()),
        (None, false) => Servers::Cluster(flags.cluster_seeds.clone()),
        (None, true)
            if flags.redis_prefix.is_some()
                || flags.redis_timeout_ms.is_some()
                || flags.redis_password_file.is_some()
                || flags.redis_key_secret_file.is_some() =>
        {
            return Err(
                "--redis-prefix, --redis-timeout-ms, --redis-password-file and \
                        --redis-key-secret-file need --redis or --redis-cluster"
                    .into(),
            )
        }
        (None, true) => return Ok(None),
    };
    let (urls, flag) = match &servers {
        Servers::One(url) => (std::slice::from_ref(url), "--redis URL"),
        Servers::Cluster(seeds) => (seeds.as_slice(), "--redis-cluster URL"),
    };
    if urls.iter().any(|url| has_password(url)) {
        return Err(format!(
            "{flag} must not hold a password (the command line is public): \
             use --redis-password-file PATH or BOURSE_REDIS_PASSWORD"
        ));
    }
    let password = read_secret(
        env,
        "--redis-password-file",
        flags.redis_password_file.as_deref(),
        "BOURSE_REDIS_PASSWORD",
    )?
    .map(|(bytes, source)| {
        String::from_utf8(bytes).map_err(|_| format!("{source}: the Redis password must be UTF-8"))
    })
    .transpose()?;
    Ok(Some(RedisOptions {
        servers,
        password,
        key_secret: read_secret(
            env,
            "--redis-key-secret-file",
            flags.redis_key_secret_file.as_deref(),
            "BOURSE_REDIS_KEY_SECRET",
        )?
        .map(|(bytes, _source)| bytes),
        prefix: flags
            .redis_prefix
            .clone()
            .unwrap_or_else(|| "bourse".into()),
        timeout_ms: flags.redis_timeout_ms.unwrap_or(1000),
    }))
}

#[cfg(test)]
mod tests;

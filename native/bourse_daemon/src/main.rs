//! `bourse_daemon`: the bourse_core bucket table out of the VM and across OS processes.
//!
//! `--stdio` serves one Erlang port (4-byte length-prefixed JSON frames); `--listen` and
//! `--socket` serve many clients (newline-delimited JSON). The protocol is in
//! docs/PROTOCOL.md. The buckets live in this process, or with `--redis URL` in a Redis
//! server shared by daemons on several machines.

mod cli;
mod fingerprint;
mod protocol;
mod redis;
mod server;
mod spin;
mod stdio;
mod stdio_socket;
mod store;
mod sweeper;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use bourse_core::{Config, Table};
use tokio::runtime::Runtime;

use crate::cli::{Command, Options, Transport};
use crate::protocol::{Service, PROTOCOL_VERSION, SERVER};
use crate::redis::RedisStore;
use crate::server::UnprovedBounds;
use crate::store::{Memory, Store};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    // Its own socket is found before the other arguments are judged, so that a port is told
    // there why they are refused.
    if let Err(message) = stdio_socket::redirect(std::env::args_os().skip(1)) {
        eprintln!("bourse_daemon: {message}");
        return ExitCode::FAILURE;
    }
    let args = match cli::arguments(std::env::args_os().skip(1)) {
        Ok(args) => args,
        Err(message) => return refused(&message, &message),
    };
    let options = match cli::parse(args, &cli::Process) {
        Ok(Command::Help) => {
            print!("{}", cli::USAGE);
            return ExitCode::SUCCESS;
        }
        Ok(Command::Version) => {
            println!("{SERVER} (protocol {PROTOCOL_VERSION})");
            return ExitCode::SUCCESS;
        }
        Ok(Command::Run(options)) => *options,
        Err(message) => {
            // The synopsis, not every flag: a refused port writes into its VM's log.
            let synopsis = cli::USAGE.split("\n\n").next().unwrap_or_default();
            let shown = format!("{message}\n\n{synopsis}\n(--help lists every flag)");
            return refused(&message, &shown);
        }
    };
    // In --stdio mode the main thread runs the runtime: with Redis it reads stdin as one of
    // its tasks (stdio.rs).
    let runtime = match options.transport {
        Transport::Stdio => tokio::runtime::Builder::new_current_thread(),
        Transport::Server { .. } => tokio::runtime::Builder::new_multi_thread(),
    }
    .enable_all()
    .build();
    let runtime = match runtime {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("bourse_daemon: cannot start the runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let config = Config {
        assume_busy_at_start: options.assume_busy_at_start,
        booking_slack_ms: options.booking_slack_ms,
    };
    match options.redis.clone() {
        None => serve(Memory::new(Table::new(config)), options, runtime),
        Some(redis) => {
            let timeout = Duration::from_millis(redis.timeout_ms);
            let (servers, password) = (&redis.servers, redis.password.as_deref());
            let checked = runtime.block_on(redis::refuse_misconfigured(servers, password, timeout));
            if let Err(message) = checked {
                return refused(&message, &message);
            }
            let store = {
                let _context = runtime.enter();
                RedisStore::new(redis::Options {
                    servers: redis.servers,
                    password: redis.password,
                    key_secret: redis.key_secret,
                    prefix: redis.prefix,
                    timeout,
                    config,
                })
            };
            match store {
                Ok(store) => serve(store, options, runtime),
                Err(message) => refused(&message, &message),
            }
        }
    }
}

/// Exits 2 for a refused configuration, `shown` on stderr; a port (`--stdio`) is also told
/// `message` in the answer to its first frame. A port on `--stdio-socket` is told there
/// alone: its client reports it, and stderr would repeat it in the client's log, raw.
fn refused(message: &str, shown: &str) -> ExitCode {
    let port = std::env::args_os().any(|arg| arg == "--stdio");
    if !(port && stdio_socket::named(std::env::args_os().skip(1))) {
        eprintln!("bourse_daemon: {shown}");
    }
    if port {
        stdio::refuse(message)
    } else {
        ExitCode::from(2)
    }
}

/// How long a stop waits for the requests running: 10 s, or the Redis timeout and 1 s when
/// longer, so that each of them is answered.
fn drain_timeout(options: &Options) -> Duration {
    let least = Duration::from_secs(10);
    options.redis.as_ref().map_or(least, |redis| {
        least.max(Duration::from_millis(redis.timeout_ms) + Duration::from_secs(1))
    })
}

/// Serves `store` in the transport the options name, until told to stop.
fn serve<S: Store>(store: S, options: Options, runtime: Runtime) -> ExitCode {
    let drain_timeout = drain_timeout(&options);
    let access = options.access;
    let service = Arc::new(Service::new(store, options.max_frame_bytes, access.secret));
    let sweep_interval = Duration::from_millis(options.sweep_interval_ms);
    match options.transport {
        Transport::Stdio => {
            let max_frame = options.max_frame_bytes;
            stdio::run(service, &runtime, max_frame, sweep_interval, drain_timeout)
        }
        Transport::Server { tcp, unix } => {
            let (max_connections, unproved) = descriptors_for(access.max_connections);
            let limits = server::Limits {
                max_frame_bytes: options.max_frame_bytes,
                max_connections,
                unproved,
                idle_timeout: (access.idle_timeout_ms > 0)
                    .then(|| Duration::from_millis(access.idle_timeout_ms)),
                socket_mode: access.socket_mode,
                drain_timeout,
            };
            let served =
                runtime.block_on(server::run(service, &tcp, &unix, limits, sweep_interval));
            // Connections that outlived the drain must not hold the exit.
            runtime.shutdown_timeout(Duration::from_secs(1));
            match served {
                Ok(()) => ExitCode::SUCCESS,
                Err(message) => {
                    eprintln!("bourse_daemon: {message}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

/// File descriptors kept for the listeners, Redis and the runtime.
const RESERVED_DESCRIPTORS: u64 = 64;

/// `wanted` connections, and the full bounds of those not served yet, if the descriptor
/// limit allows them (raising the soft limit towards the hard one if needed); else each
/// cut in proportion, so that connections past the limit do not fail `accept` (and never
/// learn why), and connections that have not proved the secret cannot take the
/// descriptors of those that will.
fn descriptors_for(wanted: usize) -> (usize, UnprovedBounds) {
    let full = UnprovedBounds::FULL;
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read and write `limit`.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return (wanted, full);
    }
    let need = wanted + full.total();
    let needed = need as u64 + RESERVED_DESCRIPTORS;
    if limit.rlim_cur < needed {
        let raised = libc::rlimit {
            rlim_cur: needed.min(limit.rlim_max),
            rlim_max: limit.rlim_max,
        };
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            limit = raised;
        }
    }
    let have =
        usize::try_from(limit.rlim_cur.saturating_sub(RESERVED_DESCRIPTORS)).unwrap_or(usize::MAX);
    if have >= need {
        return (wanted, full);
    }
    let unproved = full.scaled(have, need);
    let connections = have.saturating_sub(unproved.total()).clamp(1, wanted);
    eprintln!(
        "bourse_daemon: serving at most {connections} connections, and {} waiting to prove \
         the secret (the descriptor limit is {})",
        unproved.silent + unproved.greeted,
        limit.rlim_cur
    );
    (connections, unproved)
}

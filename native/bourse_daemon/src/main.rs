//! `bourse_daemon`: the bourse_core bucket table out of the VM and across OS processes.
//!
//! `--stdio` serves one Erlang port (4-byte length-prefixed JSON frames); `--listen` and
//! `--socket` serve many clients (newline-delimited JSON). The protocol is in
//! docs/PROTOCOL.md. The buckets live in this process, or with `--redis URL` in a Redis
//! server shared by daemons on several machines.

mod cli;
mod protocol;
mod redis;
mod server;
mod stdio;
mod store;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use bourse_core::{Config, Table};
use tokio::runtime::Runtime;

use crate::cli::{Command, Mode, Options};
use crate::protocol::{Service, PROTOCOL_VERSION, SERVER};
use crate::redis::RedisStore;
use crate::store::{Memory, Store};

fn main() -> ExitCode {
    let options = match cli::parse(std::env::args().skip(1)) {
        Ok(Command::Help) => {
            print!("{}", cli::USAGE);
            return ExitCode::SUCCESS;
        }
        Ok(Command::Version) => {
            println!("{SERVER} (protocol {PROTOCOL_VERSION})");
            return ExitCode::SUCCESS;
        }
        Ok(Command::Run(options)) => options,
        Err(message) => {
            eprintln!("bourse_daemon: {message}\n\n{}", cli::USAGE);
            return ExitCode::from(2);
        }
    };
    let runtime = match options.mode {
        Mode::Stdio => tokio::runtime::Builder::new_current_thread(),
        Mode::Server { .. } => tokio::runtime::Builder::new_multi_thread(),
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
            let store = {
                let _context = runtime.enter();
                RedisStore::new(redis::Options {
                    url: redis.url,
                    prefix: redis.prefix,
                    timeout: Duration::from_millis(redis.timeout_ms),
                    config,
                })
            };
            match store {
                Ok(store) => serve(store, options, runtime),
                Err(message) => {
                    eprintln!("bourse_daemon: {message}");
                    ExitCode::from(2)
                }
            }
        }
    }
}

/// Serves `store` in the transport the options name, until told to stop.
fn serve<S: Store>(store: S, options: Options, runtime: Runtime) -> ExitCode {
    let service = Arc::new(Service::new(store, options.max_frame_bytes));
    let sweep_interval = Duration::from_millis(options.sweep_interval_ms);
    match options.mode {
        Mode::Stdio => stdio::run(service, &runtime, options.max_frame_bytes, sweep_interval),
        Mode::Server { tcp, unix } => {
            let served = runtime.block_on(server::run(
                service,
                &tcp,
                &unix,
                options.max_frame_bytes,
                sweep_interval,
            ));
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

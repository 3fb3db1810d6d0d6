//! `bourse_daemon`: the bourse_core bucket table out of the VM and across OS processes.
//!
//! `--stdio` serves one Erlang port (4-byte length-prefixed JSON frames); `--listen` and
//! `--socket` serve many clients (newline-delimited JSON). The protocol is in
//! docs/PROTOCOL.md.

mod cli;
mod protocol;
mod server;
mod stdio;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use bourse_core::{Config, Table};

use crate::cli::{Command, Mode};
use crate::protocol::{Service, PROTOCOL_VERSION, SERVER};

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
    let table = Table::new(Config {
        assume_busy_at_start: options.assume_busy_at_start,
        booking_slack_ms: options.booking_slack_ms,
    });
    let service = Arc::new(Service::new(table, options.max_frame_bytes));
    let sweep_interval = Duration::from_millis(options.sweep_interval_ms);
    match options.mode {
        Mode::Stdio => stdio::run(service, options.max_frame_bytes, sweep_interval),
        Mode::Server { tcp, unix } => {
            let runtime = match tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime,
                Err(error) => {
                    eprintln!("bourse_daemon: cannot start the runtime: {error}");
                    return ExitCode::FAILURE;
                }
            };
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

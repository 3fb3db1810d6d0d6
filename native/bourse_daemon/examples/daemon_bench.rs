//! Throughput of `bourse_daemon`: checks per second over stdio (`{packet, 4}` frames) and
//! over its Unix socket with 1 and 8 clients, pipelined in windows of requests in flight, on
//! distinct keys and on one hot key, and with one request in flight on each, with the CPU
//! time (user and system) the daemon spent per check. Prints a table; asserts nothing.
//!
//! ```text
//! cargo build --release -p bourse_daemon --examples
//! target/release/examples/daemon_bench [--daemon PATH] [--connect SOCKET_PATH]
//!                                      [--checks N] [--window W]
//! ```
//!
//! `--daemon` defaults to the `bourse_daemon` built next to this example; `--connect` uses a
//! running server's Unix socket for the socket rows instead of starting one. (A socket is
//! owner-only, so there is no secret to prove; a TCP listener needs one.) Limits are large
//! enough that every check is admitted: this measures the protocol and table path, not
//! refusals.

#[path = "support/cpu.rs"]
mod cpu;

use cpu::process_cpu;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Distinct keys each client cycles through.
const KEYS_PER_CLIENT: usize = 1000;

struct Options {
    daemon: PathBuf,
    connect: Option<String>,
    checks: usize,
    window: usize,
}

fn main() {
    let options = match parse_options() {
        Ok(options) => options,
        Err(message) => {
            eprintln!("daemon_bench: {message}");
            eprintln!(
                "usage: daemon_bench [--daemon PATH] [--connect SOCKET_PATH] [--checks N] [--window W]"
            );
            std::process::exit(2);
        }
    };
    println!(
        "bourse_daemon throughput: {} checks per row, windows of {} in flight",
        options.checks, options.window
    );
    println!(
        "{:<34} {:>10} {:>9} {:>12} {:>15}",
        "transport", "checks", "seconds", "checks/s", "daemon CPU µs"
    );

    for hot in [false, true] {
        let label = format!("stdio, 1 client, {}", keys_label(hot));
        let mut daemon = spawn(&options.daemon, &["--stdio"], true);
        let cpu = Cpu::of(Some(daemon.id()));
        let elapsed = run_stdio(&mut daemon, options.checks, options.window, hot);
        report(&label, options.checks, elapsed, cpu.since());
        stop(daemon);
    }
    // One request in flight: the round trip through the pipes, as one port caller sees it.
    let unpipelined = options.checks / 10;
    let mut daemon = spawn(&options.daemon, &["--stdio"], true);
    let cpu = Cpu::of(Some(daemon.id()));
    let elapsed = run_stdio(&mut daemon, unpipelined, 1, false);
    report(
        "stdio, 1 client, no pipelining",
        unpipelined,
        elapsed,
        cpu.since(),
    );
    stop(daemon);

    let socket =
        std::env::temp_dir().join(format!("bourse_daemon_bench_{}.sock", std::process::id()));
    let (server, addr) = match &options.connect {
        Some(addr) => (None, addr.clone()),
        None => {
            let path = socket.to_str().expect("a UTF-8 temporary path");
            let mut child = spawn(&options.daemon, &["--socket", path], false);
            let addr = listening_addr(&mut child);
            (Some(child), addr)
        }
    };
    let server_pid = server.as_ref().map(Child::id);
    let mut scenario = 0;
    for clients in [1, 8] {
        for hot in [false, true] {
            scenario += 1;
            let label = format!("socket, {clients} client(s), {}", keys_label(hot));
            let per_client = options.checks / clients;
            let cpu = Cpu::of(server_pid);
            let elapsed = run_socket(&addr, clients, per_client, options.window, hot, scenario);
            report(&label, per_client * clients, elapsed, cpu.since());
        }
    }
    scenario += 1;
    let unpipelined = options.checks / 10;
    let cpu = Cpu::of(server_pid);
    let elapsed = run_socket(&addr, 1, unpipelined, 1, false, scenario);
    report(
        "socket, 1 client, no pipelining",
        unpipelined,
        elapsed,
        cpu.since(),
    );
    if let Some(server) = server {
        stop(server);
        let _ = std::fs::remove_file(&socket);
    }
}

fn parse_options() -> Result<Options, String> {
    let mut options = Options {
        daemon: default_daemon(),
        connect: None,
        checks: 400_000,
        window: 64,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--daemon" => options.daemon = PathBuf::from(value()?),
            "--connect" => options.connect = Some(value()?),
            "--checks" => options.checks = positive(&flag, &value()?)?,
            "--window" => options.window = positive(&flag, &value()?)?,
            _ => return Err(format!("unknown argument {flag:?}")),
        }
    }
    Ok(options)
}

fn positive(flag: &str, text: &str) -> Result<usize, String> {
    match text.parse() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("{flag} needs a positive integer, got {text:?}")),
    }
}

/// `target/<profile>/bourse_daemon`, next to `target/<profile>/examples/daemon_bench`.
fn default_daemon() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.join("bourse_daemon")))
        .unwrap_or_else(|| PathBuf::from("bourse_daemon"))
}

fn keys_label(hot: bool) -> &'static str {
    if hot {
        "one hot key"
    } else {
        "distinct keys"
    }
}

fn report(label: &str, checks: usize, elapsed: Duration, cpu: Option<Duration>) {
    let secs = elapsed.as_secs_f64();
    let cpu = match cpu {
        Some(cpu) => format!("{:.1}", cpu.as_secs_f64() * 1e6 / checks as f64),
        None => "–".to_string(),
    };
    println!(
        "{label:<34} {checks:>10} {secs:>9.3} {:>12.0} {cpu:>15}",
        checks as f64 / secs
    );
}

/// The CPU time a daemon this bench started had used at some moment (none for a daemon
/// it did not start).
struct Cpu {
    pid: Option<u32>,
    at_start: Option<Duration>,
}

impl Cpu {
    fn of(pid: Option<u32>) -> Self {
        Self {
            pid,
            at_start: pid.and_then(process_cpu),
        }
    }

    /// CPU time used since [`Cpu::of`].
    fn since(&self) -> Option<Duration> {
        let now = process_cpu(self.pid?)?;
        Some(now.saturating_sub(self.at_start?))
    }
}

fn spawn(daemon: &PathBuf, args: &[&str], stdin: bool) -> Child {
    Command::new(daemon)
        .args(args)
        .stdin(if stdin { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .spawn()
        .unwrap_or_else(|error| {
            eprintln!("daemon_bench: cannot start {}: {error}", daemon.display());
            std::process::exit(1)
        })
}

fn stop(mut child: Child) {
    let _ = child.kill();
    let _ = child.wait();
}

fn listening_addr(child: &mut Child) -> String {
    let stdout = child.stdout.as_mut().expect("piped stdout");
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("read the listening line");
    line.trim()
        .strip_prefix("listening unix ")
        .unwrap_or_else(|| panic!("unexpected daemon output {line:?}"))
        .to_string()
}

/// The check requests one client cycles through, as JSON text.
fn requests(client: usize, hot: bool, scenario: usize) -> Vec<String> {
    let keys = if hot { 1 } else { KEYS_PER_CLIENT };
    (0..keys)
        .map(|i| {
            let credential = if hot {
                "hot".to_string()
            } else {
                format!("c{client}-{i}")
            };
            format!(
                r#"{{"op":"check","key":{{"exchange":"bench{scenario}","credential":"{credential}"}},"limit":{{"capacity":1e12,"refill_per_sec":1e12}},"cost":1}}"#
            )
        })
        .collect()
}

fn run_stdio(daemon: &mut Child, checks: usize, window: usize, hot: bool) -> Duration {
    let mut stdin = daemon.stdin.take().expect("piped stdin");
    let mut stdout = BufReader::new(daemon.stdout.take().expect("piped stdout"));
    let requests = requests(0, hot, 0);
    let mut batch = Vec::new();
    let mut frame = Vec::new();
    let started = Instant::now();
    let mut sent = 0;
    while sent < checks {
        let window = window.min(checks - sent);
        batch.clear();
        for i in sent..sent + window {
            let request = requests[i % requests.len()].as_bytes();
            batch.extend_from_slice(&(request.len() as u32).to_be_bytes());
            batch.extend_from_slice(request);
        }
        stdin.write_all(&batch).expect("write to the daemon");
        stdin.flush().expect("flush");
        for _ in 0..window {
            let mut header = [0u8; 4];
            stdout.read_exact(&mut header).expect("answer header");
            frame.resize(u32::from_be_bytes(header) as usize, 0);
            stdout.read_exact(&mut frame).expect("answer");
            expect_admitted(&frame);
        }
        sent += window;
    }
    started.elapsed()
}

fn run_socket(
    addr: &str,
    clients: usize,
    per_client: usize,
    window: usize,
    hot: bool,
    scenario: usize,
) -> Duration {
    let start = std::sync::Arc::new(std::sync::Barrier::new(clients + 1));
    let workers: Vec<_> = (0..clients)
        .map(|client| {
            let stream = UnixStream::connect(addr).expect("connect to the daemon");
            let requests = requests(client, hot, scenario);
            let start = std::sync::Arc::clone(&start);
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().expect("clone stream"));
                let mut writer = stream;
                let mut batch = Vec::new();
                let mut line = Vec::new();
                start.wait();
                let mut sent = 0;
                while sent < per_client {
                    let window = window.min(per_client - sent);
                    batch.clear();
                    for i in sent..sent + window {
                        batch.extend_from_slice(requests[i % requests.len()].as_bytes());
                        batch.push(b'\n');
                    }
                    writer.write_all(&batch).expect("write to the daemon");
                    for _ in 0..window {
                        line.clear();
                        reader.read_until(b'\n', &mut line).expect("answer");
                        expect_admitted(&line);
                    }
                    sent += window;
                }
            })
        })
        .collect();
    start.wait();
    let started = Instant::now();
    for worker in workers {
        worker.join().expect("client thread");
    }
    started.elapsed()
}

fn expect_admitted(answer: &[u8]) {
    if !answer.starts_with(br#"{"ok":true,"result":"admitted""#) {
        eprintln!(
            "daemon_bench: unexpected answer {}",
            String::from_utf8_lossy(answer)
        );
        std::process::exit(1);
    }
}

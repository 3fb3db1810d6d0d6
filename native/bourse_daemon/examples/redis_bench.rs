//! Checks per second and latency of `bourse_daemon --redis` and `--redis-cluster` on
//! loopback, 1, 8 and 64 clients, single-bucket and three-bucket checks, next to the
//! in-memory daemon with the same clients, each on the daemon's Unix socket. Each client
//! waits for every answer (one check in flight), so the latency is a full round trip:
//! client -> daemon -> Redis script -> daemon -> client. The keys spread over 16 exchanges (so,
//! on the cluster, over every master), or over as many as `--exchanges` gives.
//! Beside the rates, the CPU time per check of the daemon (all its threads) and of the Redis
//! server (`INFO cpu`; on the cluster, the masters'), which a loaded machine inflates far
//! less than it does latencies, and the time Redis spent running the script per call
//! (`INFO commandstats`). Before the rows through the daemon, the floor of one check in
//! flight: clients sending `PING` straight to Redis, one round trip in flight each.
//! Prints a table; asserts nothing.
//!
//! ```text
//! cargo build --release -p bourse_daemon --examples
//! target/release/examples/redis_bench [--redis redis://127.0.0.1:PORT] [--seconds S]
//!     [--store memory|redis|cluster]... [--clients N]... [--exchanges N]
//! ```
//!
//! `--store` and `--clients` (repeatable) run only the rows of the stores and client counts
//! named.
//!
//! Without `--redis` it starts its own `redis-server` (no persistence) on a free port; it
//! always starts its own cluster (three masters, three replicas, see
//! tests/cluster_support), and stops them at the end. Without `redis-cli --cluster` the
//! cluster rows are left out.

#[path = "../tests/cluster_support/mod.rs"]
mod cluster_support;

#[path = "support/cpu.rs"]
mod cpu;

#[path = "support/own_redis.rs"]
mod own_redis;

use cpu::process_cpu;
use own_redis::OwnRedis;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// Distinct keys each client cycles through; limits large enough that all are admitted.
const KEYS_PER_CLIENT: usize = 1000;

fn main() {
    let mut args = std::env::args().skip(1);
    let mut url = None;
    let mut seconds = 3.0;
    let mut stores = Vec::new();
    let mut client_counts = Vec::new();
    let mut exchanges = 16;
    while let Some(arg) = args.next() {
        match (arg.as_str(), args.next()) {
            ("--redis", Some(value)) => url = Some(value),
            ("--store", Some(value))
                if ["memory", "redis", "cluster"].contains(&value.as_str()) =>
            {
                stores.push(value)
            }
            ("--clients", Some(value)) if value.parse::<usize>().is_ok_and(|n| n > 0) => {
                client_counts.push(value.parse().unwrap())
            }
            ("--exchanges", Some(value)) if value.parse::<usize>().is_ok_and(|n| n > 0) => {
                exchanges = value.parse().unwrap()
            }
            ("--seconds", Some(value)) if value.parse::<f64>().is_ok_and(|s| s > 0.0) => {
                seconds = value.parse().unwrap()
            }
            _ => {
                eprintln!(
                    "usage: redis_bench [--redis redis://HOST:PORT] [--seconds S] \
                     [--store memory|redis|cluster]... [--clients N]... [--exchanges N]"
                );
                std::process::exit(2);
            }
        }
    }
    if client_counts.is_empty() {
        client_counts = vec![1, 8, 64];
    }
    if stores.is_empty() {
        stores = ["memory", "redis", "cluster"].map(String::from).to_vec();
    }
    let mut own_redis = OwnRedis::default();
    let url = url.unwrap_or_else(|| own_redis.start());
    let run_for = Duration::from_secs_f64(seconds);
    let cluster = stores
        .iter()
        .any(|store| store == "cluster")
        .then(|| cluster_support::Cluster::start(2000))
        .flatten();
    let seeds = cluster
        .as_ref()
        .map(|cluster| cluster.urls())
        .unwrap_or_default();

    println!(
        "bourse_daemon through Redis ({url}) and a Redis Cluster of 3 masters + 3 replicas, \
         {seconds} s per row, one check in flight per client"
    );
    println!(
        "{:<10} {:<9} {:>7} {:>10} {:>10} {:>9} {:>9} {:>13} {:>12} {:>14}",
        "store",
        "buckets",
        "clients",
        "checks",
        "checks/s",
        "p50 µs",
        "p99 µs",
        "daemon µs/ck",
        "redis µs/ck",
        "script µs/call"
    );
    if stores.iter().any(|store| store == "redis") {
        for &clients in &client_counts {
            let servers = [url.clone()];
            let cpu_before = redis_cpu(&servers);
            let latencies = round_trips(clients, run_for, |_| ping(&url));
            let redis_cpu = per_check(cpu_before, redis_cpu(&servers), latencies.len());
            print_row(
                "PING",
                "–",
                clients,
                latencies,
                seconds,
                ["–", &redis_cpu, "–"],
            );
        }
    }
    for store in stores.iter().map(String::as_str) {
        if store == "cluster" && seeds.is_empty() {
            continue;
        }
        // A Unix socket: owner-only, so no secret to prove (a TCP listener needs one).
        let socket = std::env::temp_dir().join(format!(
            "bourse-redis-bench-{}-{store}.sock",
            std::process::id()
        ));
        let mut daemon = start_daemon(store, &url, &seeds, &socket);
        let addr = listening_addr(&mut daemon);
        let servers = match store {
            "redis" => vec![url.clone()],
            "cluster" => seeds.clone(),
            _ => Vec::new(),
        };
        for buckets in [1, 3] {
            for &clients in &client_counts {
                let before = (
                    process_cpu(daemon.id()),
                    redis_cpu(&servers),
                    script_time(&servers),
                );
                let latencies = round_trips(clients, run_for, |client| {
                    checks(&addr, client, buckets, exchanges)
                });
                let checks = latencies.len();
                let daemon_cpu = per_check(before.0, process_cpu(daemon.id()), checks);
                let (redis_cpu, script) = match store {
                    "memory" => ("–".to_string(), "–".to_string()),
                    _ => (
                        per_check(before.1, redis_cpu(&servers), checks),
                        per_call(before.2, script_time(&servers)),
                    ),
                };
                let buckets = buckets.to_string();
                print_row(
                    store,
                    &buckets,
                    clients,
                    latencies,
                    seconds,
                    [&daemon_cpu, &redis_cpu, &script],
                );
            }
        }
        let _ = daemon.kill();
        let _ = daemon.wait();
        let _ = std::fs::remove_file(&socket);
    }
    drop(cluster);
}

/// Prints one row: its round trips' count, rate and latencies, then `cpu` (daemon and Redis
/// µs per check, script µs per call).
fn print_row(
    store: &str,
    buckets: &str,
    clients: usize,
    mut latencies: Vec<Duration>,
    seconds: f64,
    cpu: [&str; 3],
) {
    latencies.sort_unstable();
    let quantile = |q: f64| latencies[((latencies.len() - 1) as f64 * q) as usize];
    println!(
        "{:<10} {:<9} {:>7} {:>10} {:>10.0} {:>9.0} {:>9.0} {:>13} {:>12} {:>14}",
        store,
        buckets,
        clients,
        latencies.len(),
        latencies.len() as f64 / seconds,
        quantile(0.5).as_secs_f64() * 1e6,
        quantile(0.99).as_secs_f64() * 1e6,
        cpu[0],
        cpu[1],
        cpu[2],
    );
}

/// µs of CPU time per check between two readings, "–" if either is unknown.
fn per_check(before: Option<Duration>, after: Option<Duration>, checks: usize) -> String {
    match (before, after) {
        (Some(before), Some(after)) => {
            let micros = after.saturating_sub(before).as_secs_f64() * 1e6;
            format!("{:.1}", micros / checks.max(1) as f64)
        }
        _ => "–".to_string(),
    }
}

/// µs Redis spent running the script per call between two readings, "–" if either is
/// unknown.
fn per_call(before: Option<(u64, u64)>, after: Option<(u64, u64)>) -> String {
    match (before, after) {
        (Some((calls, micros)), Some((calls_after, micros_after))) if calls_after > calls => {
            format!(
                "{:.1}",
                (micros_after - micros) as f64 / (calls_after - calls) as f64
            )
        }
        _ => "–".to_string(),
    }
}

/// The script's calls so far on the Redis servers at `urls`, and the µs they ran
/// (`INFO commandstats`: `fcall`, `evalsha` and `eval`).
fn script_time(urls: &[String]) -> Option<(u64, u64)> {
    let (mut calls, mut micros) = (0, 0);
    for url in urls {
        let mut connection = redis::Client::open(url.as_str())
            .ok()?
            .get_connection()
            .ok()?;
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query(&mut connection)
            .ok()?;
        for line in info.lines() {
            let stats = ["cmdstat_fcall:", "cmdstat_evalsha:", "cmdstat_eval:"]
                .iter()
                .find_map(|name| line.strip_prefix(name));
            for field in stats.into_iter().flat_map(|stats| stats.split(',')) {
                match field.split_once('=') {
                    Some(("calls", n)) => calls += n.parse::<u64>().ok()?,
                    Some(("usec", n)) => micros += n.parse::<u64>().ok()?,
                    _ => {}
                }
            }
        }
    }
    (!urls.is_empty()).then_some((calls, micros))
}

/// CPU time (user and system) the Redis servers at `urls` used so far (`INFO cpu`).
fn redis_cpu(urls: &[String]) -> Option<Duration> {
    let mut total = 0.0;
    for url in urls {
        let mut connection = redis::Client::open(url.as_str())
            .ok()?
            .get_connection()
            .ok()?;
        let info: String = redis::cmd("INFO").arg("cpu").query(&mut connection).ok()?;
        for line in info.lines() {
            if let Some(seconds) = line
                .strip_prefix("used_cpu_sys:")
                .or_else(|| line.strip_prefix("used_cpu_user:"))
            {
                total += seconds.trim().parse::<f64>().ok()?;
            }
        }
    }
    (!urls.is_empty()).then(|| Duration::from_secs_f64(total))
}

fn start_daemon(store: &str, url: &str, seeds: &[String], socket: &Path) -> Child {
    let path = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.join("bourse_daemon")))
        .unwrap_or_else(|| PathBuf::from("bourse_daemon"));
    let mut command = Command::new(&path);
    command.arg("--socket").arg(socket);
    match store {
        "redis" => {
            command.args(["--redis", url]);
        }
        "cluster" => {
            for seed in &seeds[..2] {
                command.args(["--redis-cluster", seed]);
            }
        }
        _ => {}
    }
    command
        .stdout(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", path.display()))
}

fn listening_addr(child: &mut Child) -> String {
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().expect("stdout"))
        .read_line(&mut line)
        .expect("listening line");
    line.trim()
        .strip_prefix("listening unix ")
        .expect("a listening line")
        .to_string()
}

/// `clients` threads each making round trips for `run_for`, one at a time (`client(i)` gives
/// client i's, which makes one round trip per call); every round trip's latency.
fn round_trips<F: FnMut()>(
    clients: usize,
    run_for: Duration,
    client: impl Fn(usize) -> F + Sync,
) -> Vec<Duration> {
    thread::scope(|scope| {
        let workers: Vec<_> = (0..clients)
            .map(|i| {
                let client = &client;
                scope.spawn(move || {
                    let mut round_trip = client(i);
                    let mut latencies = Vec::new();
                    let started = Instant::now();
                    while started.elapsed() < run_for {
                        let sent = Instant::now();
                        round_trip();
                        latencies.push(sent.elapsed());
                    }
                    latencies
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().expect("client"))
            .collect()
    })
}

/// Client `client`'s round trip to the daemon at `addr`: a check of its next keys.
fn checks(addr: &str, client: usize, buckets: usize, exchanges: usize) -> impl FnMut() {
    let requests = requests(client, buckets, exchanges);
    let stream = UnixStream::connect(addr).expect("connect");
    let mut writer = stream.try_clone().expect("clone");
    let mut reader = BufReader::new(stream);
    let mut answer = String::new();
    let mut next = requests.into_iter().cycle();
    move || {
        let request = next.next().expect("a request");
        writer.write_all(request.as_bytes()).expect("send");
        answer.clear();
        reader.read_line(&mut answer).expect("answer");
        assert!(answer.contains("\"admitted\""), "{answer}");
    }
}

/// A round trip straight to Redis at `url`: `PING`.
fn ping(url: &str) -> impl FnMut() {
    let addr = url
        .trim_start_matches("redis://")
        .split('/')
        .next()
        .unwrap_or(url);
    let stream = TcpStream::connect(addr).expect("connect to redis");
    stream.set_nodelay(true).expect("nodelay");
    let mut writer = stream.try_clone().expect("clone");
    let mut reader = BufReader::new(stream);
    let mut answer = String::new();
    move || {
        writer.write_all(b"PING\r\n").expect("send");
        answer.clear();
        reader.read_line(&mut answer).expect("answer");
        assert_eq!(answer, "+PONG\r\n");
    }
}

fn requests(client: usize, buckets: usize, exchanges: usize) -> Vec<String> {
    let limit = r#"{"capacity":1e9,"refill_per_sec":1e9}"#;
    (0..KEYS_PER_CLIENT)
        .map(|i| {
            let credential = format!("c{client}-{i}");
            let exchange = format!("bench{}", i % exchanges);
            if buckets == 1 {
                format!(
                    r#"{{"op":"check","key":{{"exchange":"{exchange}","credential":"{credential}"}},"limit":{limit}}}"#
                ) + "\n"
            } else {
                let checks: Vec<String> = ["request", "ip", "order"][..buckets]
                    .iter()
                    .map(|axis| {
                        format!(
                            r#"{{"key":{{"exchange":"{exchange}","credential":"{credential}","axis":"{axis}"}},"limit":{limit}}}"#
                        )
                    })
                    .collect();
                format!(r#"{{"op":"check_many","checks":[{}]}}"#, checks.join(",")) + "\n"
            }
        })
        .collect()
}

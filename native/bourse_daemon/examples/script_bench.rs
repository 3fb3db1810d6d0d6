//! The Redis script's cost per check, side by side in one run: bucket.lua as it is, whose
//! `admit_plain` decides the common check without `decide`'s tables, and the same script
//! with `admit_plain` never taken (every check through `decide`). Both are loaded into one
//! `redis-server` as function libraries and sent the same `checks` calls as the daemon
//! writes them (1, 16 and 64 checks of one key each, over 1,000 credentials, every check
//! admitted), in alternating rounds; Redis's own time per call (`INFO commandstats`) gives
//! the µs per check, the median of the rounds. Prints a table; asserts nothing.
//!
//! ```text
//! cargo run --release -p bourse_daemon --example script_bench [-- --redis redis://127.0.0.1:PORT]
//! ```
//!
//! Without `--redis` it starts its own `redis-server` (no persistence) on a free port.

#[path = "support/own_redis.rs"]
mod own_redis;

use own_redis::OwnRedis;

const BUCKET: &str = include_str!("../src/redis/bucket.lua");
/// Where bucket.lua's `decide` takes `admit_plain`'s answer; replaced to never take it.
const PLAIN_TAKEN: &str = "local line, marker, kept = admit_plain(now, k, at, read, max_wait)";
const PLAIN_NEVER: &str = "local line, marker, kept = nil, nil, nil";
const CREDENTIALS: usize = 1000;
const ROUNDS: usize = 5;
/// Checks per round of each row.
const CHECKS_PER_ROUND: usize = 12_800;

fn main() {
    let mut args = std::env::args().skip(1);
    let mut url = None;
    while let Some(arg) = args.next() {
        match (arg.as_str(), args.next()) {
            ("--redis", Some(value)) => url = Some(value),
            _ => {
                eprintln!("usage: script_bench [--redis URL]");
                std::process::exit(2);
            }
        }
    }
    let mut own_redis = OwnRedis::default();
    let url = url.unwrap_or_else(|| own_redis.start());
    let mut connection = redis::Client::open(url.as_str())
        .and_then(|client| client.get_connection())
        .expect("a connection to Redis");
    assert_eq!(BUCKET.matches(PLAIN_TAKEN).count(), 1, "bucket.lua changed");
    let scripts = [
        (
            "every check through decide",
            BUCKET.replace(PLAIN_TAKEN, PLAIN_NEVER),
        ),
        ("as it is (admit_plain)", BUCKET.to_string()),
    ];
    let names = ["bourse_bench_decide", "bourse_bench_plain"];
    for ((_, source), name) in scripts.iter().zip(names) {
        let library =
            format!("#!lua name={name}\n{source}\nredis.register_function('{name}', run)\n");
        let _: String = redis::cmd("FUNCTION")
            .arg("LOAD")
            .arg("REPLACE")
            .arg(library)
            .query(&mut connection)
            .expect("FUNCTION LOAD (Redis >= 7.0)");
    }
    println!(
        "bucket.lua in Redis ({url}): Redis µs per check inside the script call, median of \
         {ROUNDS} alternating rounds of {CHECKS_PER_ROUND} checks"
    );
    println!(
        "{:>16} {:>28} {:>24} {:>7}",
        "checks per call", scripts[0].0, scripts[1].0, "ratio"
    );
    let mut call_number = 0;
    for checks in [1, 16, 64] {
        let mut rounds = [Vec::new(), Vec::new()];
        for _ in 0..ROUNDS {
            for (times, name) in rounds.iter_mut().zip(names) {
                let _: () = redis::cmd("CONFIG")
                    .arg("RESETSTAT")
                    .query(&mut connection)
                    .unwrap();
                let mut pipeline = redis::pipe();
                for _ in 0..CHECKS_PER_ROUND / checks {
                    call_number += 1;
                    pipeline.add_command(checks_call(name, call_number, checks));
                }
                let _: Vec<redis::Value> = pipeline.query(&mut connection).expect("the calls");
                times.push(script_micros(&mut connection) / CHECKS_PER_ROUND as f64);
            }
        }
        let [decide, plain] = rounds.map(median);
        println!(
            "{checks:>16} {decide:>28.2} {plain:>24.2} {:>7.2}",
            decide / plain
        );
    }
}

/// One `checks` call of `checks` admitted checks, each of one key, as the daemon writes it
/// (script.rs `checks`; its run marker named by `call_number`).
fn checks_call(function: &str, call_number: usize, checks: usize) -> redis::Cmd {
    let tag = "bourse:{7:binance}";
    let mut keys = vec![format!("{tag}:r:bench{call_number}")];
    let mut args: Vec<String> = ["checks", "2000", &checks.to_string()]
        .map(String::from)
        .to_vec();
    for check in 0..checks {
        let credential = format!("{:032x}", (call_number * 7919 + check) % CREDENTIALS);
        let name = format!("h{credential}:7:request");
        keys.extend([
            format!("{tag}:b:{name}"),
            format!("{tag}:w:{name}"),
            format!("{tag}:p"),
            "bourse:e{7:binance}".to_string(),
        ]);
        args.extend(
            [
                "0",
                "4",
                "12",
                &format!("{call_number}:{check}"),
                "0",
                "250000",
                "0",
                "1",
                "1000000000000",
                "1000000000",
                "1",
                "1",
                &format!("c:h{credential}"),
                &format!("k:{name}"),
                "key:0000bench",
            ]
            .map(String::from),
        );
    }
    args.push("0".to_string());
    let mut command = redis::cmd("FCALL");
    command.arg(function).arg(keys.len()).arg(keys).arg(args);
    command
}

/// The µs Redis ran `FCALL`s since its statistics were reset (`INFO commandstats`).
fn script_micros(connection: &mut redis::Connection) -> f64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(connection)
        .unwrap();
    info.lines()
        .filter_map(|line| line.strip_prefix("cmdstat_fcall:"))
        .flat_map(|stats| stats.split(','))
        .find_map(|field| field.strip_prefix("usec="))
        .and_then(|micros| micros.parse().ok())
        .unwrap_or(f64::NAN)
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

//! Concurrent load from several daemons sharing one store: clients checking one bucket
//! for a while, or sending one request a number of times.

use std::thread;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::{borrowed, check, key, Server, Transport};

/// One answer a client saw: when it came (since the start), how long it took, and what it
/// was.
pub struct Answer {
    pub at: Duration,
    pub took: Duration,
    pub kind: &'static str,
}

/// `admitted`, `delay` or `unavailable`; panics on any other answer.
pub fn classify(answer: &Value) -> &'static str {
    match (answer["result"].as_str(), answer["error"]["type"].as_str()) {
        (Some("admitted"), _) => "admitted",
        (Some("delay"), _) => "delay",
        (_, Some("unavailable")) => "unavailable",
        _ => panic!("unexpected answer {answer}"),
    }
}

pub fn count(answers: &[Answer], kind: &str) -> usize {
    answers.iter().filter(|a| a.kind == kind).count()
}

/// Runs `workers` clients per daemon, each checking `k` (cost 1) one call at a time until
/// `stop` after `started`, and `during` meanwhile; every answer.
pub fn load(
    daemons: &[Server],
    workers: usize,
    k: &Value,
    limit: &Value,
    started: Instant,
    stop: Duration,
    during: impl FnOnce(),
) -> Vec<Answer> {
    thread::scope(|scope| {
        let handles: Vec<_> = daemons
            .iter()
            .flat_map(|server| std::iter::repeat_n(server, workers))
            .map(|server| {
                scope.spawn(move || {
                    let mut t = server.connect();
                    let mut answers = Vec::new();
                    while started.elapsed() < stop {
                        let sent = Instant::now();
                        let answer = t.call(check(k, limit.clone(), 1.0));
                        answers.push(Answer {
                            at: started.elapsed(),
                            took: sent.elapsed(),
                            kind: classify(&answer),
                        });
                    }
                    answers
                })
            })
            .collect();
        during();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    })
}

/// The P1 bound (docs/CONTRACT.md) on the checks of cost 1 admitted on one bucket
/// `(capacity, refill)` in `elapsed` seconds, and that they come near it: at least half the
/// refill was admitted.
pub fn assert_conforms(admitted: usize, capacity: f64, refill: f64, elapsed: f64, what: &str) {
    let bound = capacity + refill * elapsed;
    eprintln!("{what}: admitted {admitted} in {elapsed:.2} s, bound C + r*T = {bound:.1}");
    assert!(
        admitted as f64 <= bound,
        "{what}: admitted {admitted} > {bound}"
    );
    assert!(
        admitted as f64 >= 0.5 * refill * elapsed,
        "{what}: admitted only {admitted} of {bound}"
    );
}

/// One client per daemon sends `request` `times` times, all at once; the answers admitted.
fn admitted_concurrently(daemons: &[Server], request: &Value, times: usize) -> usize {
    thread::scope(|scope| {
        let workers: Vec<_> = daemons
            .iter()
            .map(|server| {
                scope.spawn(move || {
                    let mut t = server.connect();
                    (0..times)
                        .filter(|_| t.call(request.clone())["result"] == "admitted")
                        .count()
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).sum()
    })
}

/// Several daemons' concurrent checks over one credential's bucket (capacity 50) and its
/// exchange's public ip bucket (capacity 30), both refilling at 0.001/s: all buckets pay or
/// none (P4), so exactly 30 are admitted and each bucket paid 30.
pub fn assert_multi_bucket_checks_atomic(daemons: &[Server], credential: &str) {
    let credential = key("binance", Some(credential));
    let ip = json!({"exchange": "binance", "credential": null, "axis": "ip"});
    let request = json!({"op": "check_many", "checks": [
        {"key": credential, "limit": {"capacity": 50, "refill_per_sec": 0.001}},
        {"key": ip, "limit": {"capacity": 30, "refill_per_sec": 0.001}},
    ]});
    assert_eq!(admitted_concurrently(daemons, &request, 40), 30);
    let mut t = daemons[0].connect();
    assert!((borrowed(&mut t, &credential) - 30.0).abs() < 0.01);
    assert!((borrowed(&mut t, &ip) - 30.0).abs() < 0.01);
}

//! Memory follows the buckets held, not the keys ever seen (docs/CONTRACT.md, P7): once a
//! reset or a sweep dropped them, the daemon hands their memory back to the OS, also while
//! nobody sends it anything (its request threads asleep).

mod common;

use serde_json::{json, Value};

use common::{eventually, key, Server, StdioDaemon, Transport};

/// Keys checked: their buckets take tens of MB, far more than RSS varies by otherwise.
const KEYS: usize = 100_000;
/// Checks per `check_many`.
const BATCH: usize = 1_000;
/// Least growth of RSS, in KiB, that [`KEYS`] buckets must show for the test to mean
/// anything.
const LEAST_GROWTH_KB: u64 = 16 * 1024;

/// A limit whose buckets no sweep drops during the test.
fn lasting() -> Value {
    json!({"capacity": 10, "refill_per_sec": 0.001})
}

#[test]
fn a_port_gives_back_what_a_reset_and_a_sweep_dropped() {
    let mut port = StdioDaemon::start(&["--sweep-interval-ms", "100"]);
    let pid = port.child.id();
    gives_back(&mut port, pid, "reset_all", lasting(), |port| {
        assert_eq!(port.call(json!({"op": "reset_all"}))["ok"], true);
    });
    // Full again, and so dropped by a sweep, 5 s after their check.
    let short_lived = json!({"capacity": 1, "refill_per_sec": 0.2});
    gives_back(&mut port, pid, "swept", short_lived, |_| {});
}

#[test]
fn a_server_gives_back_what_a_reset_dropped() {
    let server = Server::tcp(&[]);
    let mut client = server.connect();
    gives_back(
        &mut client,
        server.child.id(),
        "reset_all",
        lasting(),
        |client| {
            assert_eq!(client.call(json!({"op": "reset_all"}))["ok"], true);
        },
    );
}

/// Checks [`KEYS`] new keys with `limit` on `t` (the daemon `pid`), has `dropped` drop
/// every bucket (or not, for the sweep to drop), then sends nothing until the daemon's
/// resident memory falls back to within a quarter of what the buckets added.
fn gives_back<T: Transport>(
    t: &mut T,
    pid: u32,
    tag: &str,
    limit: Value,
    dropped: impl FnOnce(&mut T),
) {
    // Once it serves: a daemon just spawned may not have mapped all it needs yet.
    assert_eq!(t.call(json!({"op": "stats"}))["ok"], true);
    let start = resident_kb(pid);
    for batch in 0..KEYS / BATCH {
        let checks: Vec<Value> = (0..BATCH)
            .map(|i| {
                let key = key("e", Some(&format!("{tag}-{batch}-{i}")));
                json!({"key": key, "limit": limit, "cost": 1})
            })
            .collect();
        let answer = t.call(json!({"op": "check_many", "checks": checks}));
        assert_eq!(answer["result"], "admitted", "{answer}");
    }
    let full = resident_kb(pid);
    assert!(
        full >= start + LEAST_GROWTH_KB,
        "{KEYS} buckets took only {} KiB",
        full.saturating_sub(start)
    );
    dropped(t);
    let bound = start + (full - start) / 4;
    eventually(
        &format!("resident memory back under {bound} KiB (from {full}, {start} before)"),
        || resident_kb(pid) <= bound,
    );
}

/// Process `pid`'s resident memory, in KiB (Linux `/proc`).
fn resident_kb(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|kb| kb.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("a VmRSS line")
}

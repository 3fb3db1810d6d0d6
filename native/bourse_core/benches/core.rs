//! Nanoseconds per check in the core table, printed side by side: one hot key and
//! 10,000 keys, one and two threads, and a three-bucket check. `cargo bench -p bourse_core`.

use std::hint::black_box;
use std::time::Instant;

use bourse_core::{Check, Config, KeyRef, Limit, Mode, Table};

const CHECKS: usize = 2_000_000;

fn keys(count: usize) -> Vec<String> {
    (0..count).map(|i| format!("api-key-{i:05}")).collect()
}

/// Mean nanoseconds per check over `CHECKS` checks on each of `threads` threads.
fn run(threads: usize, key_count: usize, per_check: usize) -> f64 {
    let table = Table::new(Config::default());
    let limit = Limit::new(1e9, 1e9).unwrap();
    let names = keys(key_count);
    let started = Instant::now();
    std::thread::scope(|scope| {
        for thread in 0..threads {
            let (table, names) = (&table, &names);
            scope.spawn(move || {
                let mut checks = Vec::with_capacity(per_check);
                for i in 0..CHECKS {
                    checks.clear();
                    for axis in [&b"request"[..], b"ip", b"order"].iter().take(per_check) {
                        let name = &names[(i + thread * 7919) % names.len()];
                        let key = KeyRef::new(b"binance", Some(name.as_bytes()), axis);
                        checks.push(Check {
                            key,
                            limit,
                            cost: 1.0,
                        });
                    }
                    black_box(table.check(thread as u64, &checks, Mode::Probe).unwrap());
                }
            });
        }
    });
    started.elapsed().as_nanos() as f64 / CHECKS as f64
}

fn main() {
    // `cargo bench -p bourse_core -- <text>` runs only the workloads whose label has it.
    let filter = std::env::args().skip(1).find(|arg| !arg.starts_with('-'));
    println!(
        "{:<34} {:>12} {:>14}",
        "workload", "ns/check", "checks/s total"
    );
    for (label, threads, key_count, per_check) in [
        ("1 thread, 1 key", 1, 1, 1),
        ("1 thread, 10,000 keys", 1, 10_000, 1),
        ("2 threads, 1 key", 2, 1, 1),
        ("2 threads, 10,000 keys", 2, 10_000, 1),
        ("1 thread, 3-bucket check, 1 key", 1, 1, 3),
        ("1 thread, 3-bucket check, 10k keys", 1, 10_000, 3),
    ] {
        if filter
            .as_ref()
            .is_some_and(|text| !label.contains(text.as_str()))
        {
            continue;
        }
        let ns = run(threads, key_count, per_check);
        println!("{label:<34} {ns:>12.1} {:>14.0}", threads as f64 * 1e9 / ns);
    }
}

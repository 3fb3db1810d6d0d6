//! The core table's cost per check, printed, never asserted.
//!
//! `cargo run --release -p bourse_core --example checks` prints ns per check (median of 5
//! rounds) on one hot key, over 10,000 keys, on two threads with keys of their own (and
//! their throughput over one thread's), and for a 3-bucket check; then the same with
//! buckets prepared once ([`Table::prepare`], [`Table::check_prepared`]).
//!
//! `checks --count N WORKLOAD` (`hot`, `10k`, `3-bucket`, or one of them followed by
//! `-prepared`) runs exactly `N` checks of one workload on one thread and prints nothing:
//! run it under `valgrind --tool=callgrind` with two counts, and the difference of the
//! instructions counted, divided by the difference of the counts, is the instructions per
//! check, whatever the machine's load.

use std::hint::black_box;
use std::time::Instant;

use bourse_core::{Check, Config, KeyRef, Limit, Mode, PreparedBucket, PreparedCheck, Table};

const CHECKS: usize = 1_000_000;
const ROUNDS: usize = 5;
const AXES: [&[u8]; 3] = [b"request", b"ip", b"order"];

/// A workload: how many keys each thread cycles through, buckets per check, and whether
/// the buckets are prepared once ([`Table::prepare`]) or given as key and limit per check.
#[derive(Clone, Copy)]
struct Workload {
    keys: usize,
    buckets: usize,
    prepared: bool,
}

const HOT: Workload = Workload {
    keys: 1,
    buckets: 1,
    prepared: false,
};
const MANY: Workload = Workload {
    keys: 10_000,
    ..HOT
};
const THREE: Workload = Workload { buckets: 3, ..HOT };
const WORKLOADS: [(&str, Workload); 6] = [
    ("hot", HOT),
    ("10k", MANY),
    ("3-bucket", THREE),
    (
        "hot-prepared",
        Workload {
            prepared: true,
            ..HOT
        },
    ),
    (
        "10k-prepared",
        Workload {
            prepared: true,
            ..MANY
        },
    ),
    (
        "3-bucket-prepared",
        Workload {
            prepared: true,
            ..THREE
        },
    ),
];

/// The credentials of `thread`: distinct from every other thread's.
fn credentials(thread: usize, count: usize) -> Vec<String> {
    (0..count)
        .map(|i| format!("thread-{thread}-api-key-{i:05}"))
        .collect()
}

/// Runs `count` checks of `workload` on `table` as `thread`.
fn checks(table: &Table, thread: usize, workload: Workload, count: usize) {
    let limit = Limit::new(1e9, 1e9).unwrap();
    let names = credentials(thread, workload.keys);
    let axes = &AXES[..workload.buckets];
    if workload.prepared {
        let prepare = |name: &String| -> Vec<PreparedBucket> {
            axes.iter()
                .map(|axis| {
                    table.prepare(KeyRef::new(b"binance", Some(name.as_bytes()), axis), limit)
                })
                .collect()
        };
        let buckets: Vec<Vec<PreparedBucket>> = names.iter().map(prepare).collect();
        let mut batch = Vec::with_capacity(workload.buckets);
        for i in 0..count {
            match &buckets[i % buckets.len()][..] {
                [bucket] => {
                    black_box(table.check_prepared(thread as u64, bucket, 1.0, Mode::Probe));
                }
                several => {
                    batch.clear();
                    batch.extend(
                        several
                            .iter()
                            .map(|bucket| PreparedCheck { bucket, cost: 1.0 }),
                    );
                    black_box(
                        table
                            .check_prepared_all(thread as u64, &batch, Mode::Probe)
                            .unwrap(),
                    );
                }
            }
        }
        return;
    }
    let mut batch = Vec::with_capacity(workload.buckets);
    for i in 0..count {
        let name = names[i % names.len()].as_bytes();
        if workload.buckets == 1 {
            let key = KeyRef::new(b"binance", Some(name), AXES[0]);
            let check = Check {
                key,
                limit,
                cost: 1.0,
            };
            black_box(table.check_rate(thread as u64, check, Mode::Probe));
        } else {
            batch.clear();
            batch.extend(axes.iter().map(|axis| Check {
                key: KeyRef::new(b"binance", Some(name), axis),
                limit,
                cost: 1.0,
            }));
            black_box(
                table
                    .check_rates(thread as u64, &batch, Mode::Probe)
                    .unwrap(),
            );
        }
    }
}

/// What a thread of a round runs: checks of a workload, or as many steps of integer
/// arithmetic that touch no shared memory (what the machine's cores allow at the moment:
/// the yardstick of the table's scaling over two threads).
#[derive(Clone, Copy)]
enum Work {
    Checks(Workload),
    Arithmetic,
}

/// `CHECKS` steps of a pseudo-random sequence.
fn arithmetic() -> u64 {
    (0..CHECKS as u64).fold(1, |x, i| {
        let x = x.wrapping_mul(0x5851_f42d_4c95_7f2d).wrapping_add(i);
        black_box(x ^ (x >> 29))
    })
}

/// Wall-clock ns per check (or step) of one round: `CHECKS` on each of `threads`
/// threads, all together.
fn round(threads: usize, work: Work) -> f64 {
    let Work::Checks(workload) = work else {
        let started = Instant::now();
        std::thread::scope(|scope| {
            for _ in 0..threads {
                scope.spawn(arithmetic);
            }
        });
        return started.elapsed().as_nanos() as f64 / (CHECKS * threads) as f64;
    };
    let table = Table::new(Config::default());
    // The keys exist before the clock starts: the rounds time checks, not first inserts.
    for thread in 0..threads {
        checks(&table, thread, workload, workload.keys);
    }
    let started = Instant::now();
    std::thread::scope(|scope| {
        for thread in 0..threads {
            let table = &table;
            scope.spawn(move || checks(table, thread, workload, CHECKS));
        }
    });
    started.elapsed().as_nanos() as f64 / (CHECKS * threads) as f64
}

/// Median ns per check of each `(threads, work)` over `ROUNDS` rounds, interleaved
/// (each round runs every one once, in turn) so that load from other programs hits them
/// alike.
fn medians(works: &[(usize, Work)]) -> Vec<f64> {
    let mut times = vec![Vec::with_capacity(ROUNDS); works.len()];
    for _ in 0..ROUNDS {
        for (times, &(threads, work)) in times.iter_mut().zip(works) {
            times.push(round(threads, work));
        }
    }
    times
        .into_iter()
        .map(|mut times| {
            times.sort_by(f64::total_cmp);
            times[ROUNDS / 2]
        })
        .collect()
}

fn timings() {
    use Work::{Arithmetic, Checks};
    let prepared = |workload: Workload| Workload {
        prepared: true,
        ..workload
    };
    let works = [
        (1, Checks(HOT)),
        (1, Checks(MANY)),
        (2, Checks(HOT)),
        (2, Checks(MANY)),
        (1, Checks(THREE)),
        (1, Checks(prepared(HOT))),
        (1, Checks(prepared(MANY))),
        (2, Checks(prepared(HOT))),
        (1, Checks(prepared(THREE))),
        (1, Arithmetic),
        (2, Arithmetic),
    ];
    let [hot, many, hot_two, many_two, three, p_hot, p_many, p_hot_two, p_three, spin, spin_two] =
        medians(&works)[..]
    else {
        unreachable!("one median per workload")
    };
    println!("| workload | ns/check | checks/s | ratio |");
    println!("| --- | --- | --- | --- |");
    let row = |label: &str, ns: f64, ratio: String| {
        let per_second = 1e9 / ns;
        println!(
            "| {label} | {ns:.1} | {:.2} M | {ratio} |",
            per_second / 1e6
        );
    };
    let scaling = |one: f64, two: f64| format!("{:.2}× one thread", one / two);
    let buckets = |three: f64, one: f64| format!("{:.2}× one bucket", three / one);
    row("1 thread, 1 key (hot)", hot, String::new());
    row("1 thread, 10,000 keys", many, String::new());
    row(
        "2 threads, 1 key each (distinct)",
        hot_two,
        scaling(hot, hot_two),
    );
    row(
        "2 threads, 10,000 keys each (distinct)",
        many_two,
        scaling(many, many_two),
    );
    row(
        "1 thread, 3-bucket check, 1 credential",
        three,
        buckets(three, hot),
    );
    row("prepared: 1 thread, 1 key (hot)", p_hot, String::new());
    row("prepared: 1 thread, 10,000 keys", p_many, String::new());
    row(
        "prepared: 2 threads, 1 key each (distinct)",
        p_hot_two,
        scaling(p_hot, p_hot_two),
    );
    row(
        "prepared: 1 thread, 3-bucket check, 1 credential",
        p_three,
        buckets(p_three, p_hot),
    );
    println!(
        "\nThe machine meanwhile: two threads of arithmetic ran {:.2}× one thread's steps.",
        spin / spin_two
    );
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [] => timings(),
        [flag, count, workload] if flag == "--count" => {
            let count: usize = count.parse().expect("--count takes a number of checks");
            let Some(&(_, workload)) = WORKLOADS.iter().find(|(name, _)| name == workload) else {
                let names: Vec<&str> = WORKLOADS.iter().map(|(name, _)| *name).collect();
                panic!("unknown workload {workload}: one of {}", names.join(", "));
            };
            let table = Table::new(Config::default());
            checks(&table, 0, workload, count);
        }
        _ => panic!("usage: checks [--count N WORKLOAD]"),
    }
}

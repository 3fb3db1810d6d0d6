//! How long table-wide work and many pauses hold up a check, printed, never asserted:
//! `cargo run --release -p bourse_core --example latency`.
//!
//! 1. One thread checks a hot key in a loop, timing every check, while another inserts
//!    1,000,000 distinct keys and then sweeps them all: the slowest hot-key checks in
//!    each phase show how long growth and the sweep hold a shard. Then the same with the
//!    other thread working on a table of its own: what the machine alone costs.
//! 2. Checks of a key that no pause covers, with 0 and with 20,000 pauses in force.
//! 3. Resident memory before, after the 1,000,000 keys and after the sweep.
//! 4. One check of a key whose queue is full (`MAX_BOOKINGS` bookings), on a manual clock:
//!    when they have all lapsed, and a waiter's late claim once most have.
//!
//! Where allowed (root, or `CAP_SYS_NICE`), the two threads of part 1 run under
//! `SCHED_FIFO` so that other processes cannot preempt them: the slowest checks then show
//! the table, not the machine's load.

use std::hint::black_box;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

use bourse_core::rules::MAX_BOOKINGS;
use bourse_core::{Check, Config, KeyRef, Limit, ManualClock, Mode, Outcome, PauseTarget, Table};

const KEYS: usize = 1_000_000;
const PAUSES: usize = 20_000;

/// Phases of the background thread, as the hot-key thread sees them.
const INSERTING: u8 = 0;
const SWEEPING: u8 = 1;
const DONE: u8 = 2;

/// Runs the calling thread under `SCHED_FIFO` if allowed; says whether it does.
fn real_time() -> bool {
    let param = libc::sched_param { sched_priority: 1 };
    // SAFETY: sets the calling thread's policy; `param` is a valid sched_param.
    unsafe { libc::pthread_setschedparam(libc::pthread_self(), libc::SCHED_FIFO, &param) == 0 }
}

fn resident_mb() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kb = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches(" kB")
                .trim()
                .parse::<f64>()
                .ok()
        })
        .unwrap_or(0.0);
    kb / 1024.0
}

/// Latencies of one phase: slowest, 99.99th percentile, median (µs), and the count.
fn summary(mut latencies: Vec<Duration>) -> String {
    latencies.sort();
    let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e6;
    format!(
        "slowest {:>8.1} µs   p99.99 {:>6.1} µs   median {:>5.2} µs   ({} checks)",
        at(1.0),
        at(0.9999),
        at(0.5),
        latencies.len()
    )
}

/// Which table the background thread fills and sweeps.
#[derive(Clone, Copy, PartialEq)]
enum Background {
    /// The hot key's own table: its checks may wait for the shard locks.
    SameTable,
    /// A table of its own: the hot key's checks share nothing with it but the machine.
    OtherTable,
}

/// Milliseconds of CPU time stolen by the hypervisor so far (`/proc/stat`).
fn steal_ms() -> f64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let steal = stat
        .lines()
        .next()
        .and_then(|cpu| cpu.split_whitespace().nth(8))
        .and_then(|ticks| ticks.parse::<f64>().ok())
        .unwrap_or(0.0);
    // USER_HZ is 100 on Linux.
    steal * 10.0
}

fn hot_key_during_growth_and_sweep(background: Background) {
    let table = Table::new(Config::default());
    let other = Table::new(Config::default());
    let worked = if background == Background::SameTable {
        &table
    } else {
        &other
    };
    // Refilled within a microsecond: every inserted key can be swept at once.
    let quick = Limit::new(1.0, 1e6).unwrap();
    let hot = Limit::new(1e12, 1e12).unwrap();
    let phase = AtomicU8::new(INSERTING);
    let rss_before = resident_mb();
    let (mut real, mut slowest_insert, mut rss_inserted) = (false, Duration::ZERO, 0.0);
    let (mut dropped, mut sweep_time, mut stolen) = (0, Duration::ZERO, 0.0);
    let (inserting, sweeping) = std::thread::scope(|scope| {
        let hot_thread = scope.spawn(|| {
            real_time();
            let key = KeyRef::new(b"binance", Some(b"hot"), b"request");
            let mut phases = [Vec::new(), Vec::new()];
            loop {
                let now = phase.load(Ordering::Relaxed);
                if now == DONE {
                    break;
                }
                let started = Instant::now();
                black_box(table.check_rate(
                    1,
                    Check {
                        key,
                        limit: hot,
                        cost: 1.0,
                    },
                    Mode::Probe,
                ));
                phases[now as usize].push(started.elapsed());
                // Sleeping between checks keeps both threads within the kernel's budget
                // for real-time threads (they would be stopped for 50 ms each second).
                std::thread::sleep(Duration::from_micros(20));
            }
            phases
        });
        let worker = scope.spawn(|| {
            let fifo = real_time();
            let mut slowest_insert = Duration::ZERO;
            let mut name = String::new();
            for i in 0..KEYS {
                name.clear();
                name.push_str("key-");
                name.push_str(&i.to_string());
                let key = KeyRef::new(b"binance", Some(name.as_bytes()), b"request");
                let check = Check {
                    key,
                    limit: quick,
                    cost: 1.0,
                };
                let started = Instant::now();
                black_box(worked.check_rate(2, check, Mode::Probe));
                slowest_insert = slowest_insert.max(started.elapsed());
                if i % 256 == 0 {
                    std::thread::sleep(Duration::from_micros(50));
                }
            }
            let rss = resident_mb();
            // A fresh period of the real-time budget for the sweep.
            std::thread::sleep(Duration::from_millis(1100));
            phase.store(SWEEPING, Ordering::Relaxed);
            let (started, steal_before) = (Instant::now(), steal_ms());
            let dropped = worked.sweep();
            let sweep_time = started.elapsed();
            let stolen = steal_ms() - steal_before;
            phase.store(DONE, Ordering::Relaxed);
            (fifo, slowest_insert, rss, dropped, sweep_time, stolen)
        });
        let [inserting, sweeping] = hot_thread.join().unwrap();
        (
            real,
            slowest_insert,
            rss_inserted,
            dropped,
            sweep_time,
            stolen,
        ) = worker.join().unwrap();
        (inserting, sweeping)
    });
    let policy = if real {
        "SCHED_FIFO"
    } else {
        "ordinary scheduling: figures include preemption"
    };
    match background {
        Background::SameTable => {
            println!("## Hot-key checks while another thread works on the same table");
        }
        Background::OtherTable => println!(
            "## The same, the other thread working on a table of its own (what the machine \
             alone costs: no lock is shared)"
        ),
    }
    println!("({policy})");
    println!(
        "inserting {KEYS} keys (slowest insert {:.1} µs): {}",
        slowest_insert.as_secs_f64() * 1e6,
        summary(inserting)
    );
    println!(
        "sweeping them ({dropped} dropped in {:.0} ms, {stolen:.0} ms stolen by the \
         hypervisor meanwhile): {}",
        sweep_time.as_secs_f64() * 1e3,
        summary(sweeping)
    );
    println!();
    if background == Background::SameTable {
        println!("## Resident memory (VmRSS)");
        println!("before: {rss_before:.1} MB");
        println!("after {KEYS} keys: {rss_inserted:.1} MB");
        println!(
            "after the sweep: {:.1} MB ({} buckets left)",
            resident_mb(),
            table.stats().buckets
        );
        println!();
    }
}

fn checks_with_pauses() {
    let table = Table::new(Config::default());
    let limit = Limit::new(1e12, 1e12).unwrap();
    let key = KeyRef::new(b"okx", Some(b"unpaused"), b"request");
    let time = |table: &Table| {
        let rounds = 200_000;
        let started = Instant::now();
        for _ in 0..rounds {
            black_box(table.check_rate(
                1,
                Check {
                    key,
                    limit,
                    cost: 1.0,
                },
                Mode::Probe,
            ));
        }
        started.elapsed().as_secs_f64() * 1e9 / rounds as f64
    };
    let without = time(&table);
    for i in 0..PAUSES {
        let credential = format!("paused-{i}");
        let key = KeyRef::new(b"binance", Some(credential.as_bytes()), b"request");
        table.pause(PauseTarget::Key(key.to_owned_key()), 60_000);
    }
    let with = time(&table);
    println!("## A check of a key no pause covers");
    println!("no pauses: {without:.0} ns/check");
    println!(
        "{PAUSES} pauses in force: {with:.0} ns/check ({:.1}x)",
        with / without
    );
}

/// The slowest of 20 runs of `check` on a fresh table whose key has a full queue of
/// bookings (1 ms apart, 100 ms of slack) and whose clock then moved `later_ms` on.
fn full_queue_check(later_ms: u64, check: impl Fn(&Table<ManualClock>) -> bool) -> f64 {
    let limit = Limit::new(1.0, 1000.0).unwrap();
    let key = KeyRef::new(b"okx", Some(b"queued"), b"request");
    let wait = Mode::Wait {
        max_wait_ms: 60_000,
        booking_slack_ms: Some(100),
    };
    let mut slowest: f64 = 0.0;
    for _ in 0..20 {
        let clock = ManualClock::new();
        let table = Table::with_clock(Config::default(), clock.clone());
        let request = Check {
            key,
            limit,
            cost: 1.0,
        };
        table.check_rate(0, request, Mode::Probe);
        for owner in 1..=MAX_BOOKINGS as u64 {
            table.check_rate(owner, request, wait);
        }
        clock.advance_ms(later_ms);
        let started = Instant::now();
        assert!(check(&table));
        slowest = slowest.max(started.elapsed().as_secs_f64() * 1e6);
    }
    slowest
}

fn checks_of_full_queues() {
    let request = Check {
        key: KeyRef::new(b"okx", Some(b"queued"), b"request"),
        limit: Limit::new(1.0, 1000.0).unwrap(),
        cost: 1.0,
    };
    let all_lapsed = full_queue_check(1_000, |table| {
        table.check_rate(0, request, Mode::Probe) == Outcome::Admitted
    });
    let late_claim = full_queue_check(300, |table| {
        let wait = Mode::Wait {
            max_wait_ms: 60_000,
            booking_slack_ms: Some(100),
        };
        table.check_rate(MAX_BOOKINGS as u64, request, wait) == Outcome::Claimed
    });
    println!("## One check of a key with {MAX_BOOKINGS} bookings (slowest of 20)");
    println!("all lapsed: {all_lapsed:.1} µs");
    println!("a late claim, most lapsed: {late_claim:.1} µs");
}

fn main() {
    hot_key_during_growth_and_sweep(Background::SameTable);
    hot_key_during_growth_and_sweep(Background::OtherTable);
    checks_with_pauses();
    checks_of_full_queues();
}

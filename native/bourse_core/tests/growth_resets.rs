//! `reset_all` and `reset_exchange` while shards grow, are swept and get the tables they
//! asked for: nothing deadlocks or panics, a table given to a shard emptied meanwhile is
//! handed back, and afterwards the table holds exactly what was checked since.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Barrier;

use bourse_core::{Check, Config, KeyRef, Limit, ManualClock, Mode, Outcome, Table};

fn check(table: &Table<ManualClock>, exchange: &[u8], credential: &str) -> Outcome {
    let check = Check {
        key: KeyRef::new(exchange, Some(credential.as_bytes()), b"request"),
        limit: Limit::new(2.0, 1e-9).unwrap(),
        cost: 1.0,
    };
    table.check_rate(1, check, Mode::Probe)
}

#[test]
fn resets_while_shards_grow_leave_a_working_table() {
    let clock = ManualClock::new();
    let table = Table::with_clock(Config::default(), clock.clone());
    let done = AtomicBool::new(false);
    let start = Barrier::new(4);
    std::thread::scope(|scope| {
        for thread in 0..2 {
            let (table, start, done) = (&table, &start, &done);
            scope.spawn(move || {
                start.wait();
                for i in 0..80_000 {
                    let exchange: &[u8] = if i % 3 == 0 { b"kraken" } else { b"binance" };
                    check(table, exchange, &format!("grow-{thread}-{i}"));
                }
                done.store(true, Ordering::SeqCst);
            });
        }
        let (table, start, done) = (&table, &start, &done);
        scope.spawn(move || {
            start.wait();
            while !done.load(Ordering::SeqCst) {
                table.reset_all();
                table.reset_exchange(b"kraken");
            }
        });
        let clock = &clock;
        scope.spawn(move || {
            start.wait();
            while !done.load(Ordering::SeqCst) {
                clock.advance_ms(1);
                table.sweep();
            }
        });
    });
    table.reset_all();
    assert_eq!(table.stats().buckets, 0);
    for i in 0..5_000 {
        assert_eq!(
            check(&table, b"binance", &format!("after-{i}")),
            Outcome::Admitted
        );
        assert_eq!(
            check(&table, b"binance", &format!("after-{i}")),
            Outcome::Admitted
        );
        assert!(matches!(
            check(&table, b"binance", &format!("after-{i}")),
            Outcome::Delay(_)
        ));
    }
    assert_eq!(table.stats().buckets, 5_000);
}

#[test]
fn walks_while_shards_grow_visit_every_bucket_held_once() {
    let table = Table::with_clock(Config::default(), ManualClock::new());
    let done = AtomicBool::new(false);
    let mut rounds = 0;
    std::thread::scope(|scope| {
        let (table, done) = (&table, &done);
        scope.spawn(move || {
            // Shards small enough to grow again and again while they are walked.
            for i in 0.. {
                if done.load(Ordering::SeqCst) {
                    break;
                }
                check(table, b"binance", &format!("grow-{i}"));
                if i % 50_000 == 49_999 {
                    table.reset_exchange(b"binance");
                }
            }
        });
        // Stops the growing thread however this one ends.
        let _stop = Stop(done);
        for round in 0..60 {
            rounds = round + 1;
            let held: Vec<String> = (0..3_000).map(|i| format!("held-{round}-{i}")).collect();
            for credential in &held {
                assert_eq!(check(table, b"kraken", credential), Outcome::Admitted);
            }
            let rows = table.busiest(usize::MAX);
            let kraken: Vec<_> = rows
                .iter()
                .filter(|(key, _)| key.exchange() == b"kraken")
                .map(|(key, _)| key.as_ref().credential.unwrap().to_vec())
                .collect();
            let listed: std::collections::HashSet<_> = kraken.iter().collect();
            assert_eq!(
                listed.len(),
                kraken.len(),
                "round {round}: a key listed twice"
            );
            assert_eq!(
                kraken.len(),
                held.len(),
                "round {round}: busy keys not listed"
            );
            table.reset_exchange(b"kraken");
            let left = held
                .iter()
                .filter(|credential| {
                    let key = KeyRef::new(b"kraken", Some(credential.as_bytes()), b"request");
                    table.inspect(key).is_some()
                })
                .count();
            assert_eq!(left, 0, "round {round}: buckets left after reset_exchange");
        }
    });
    assert_eq!(rounds, 60);
}

struct Stop<'a>(&'a AtomicBool);

impl Drop for Stop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// A walk whose shard another walk empties (and frees its table) ends: `busiest` and
/// `stats` beside `reset_exchange` on a table that nothing else writes.
#[test]
fn walks_beside_a_reset_that_empties_their_shards_end() {
    let table = std::sync::Arc::new(Table::with_clock(Config::default(), ManualClock::new()));
    for round in 0..10 {
        for i in 0..100_000 {
            check(&table, b"kraken", &format!("k-{round}-{i}"));
        }
        let start = std::sync::Arc::new(Barrier::new(3));
        let (done, walks) = std::sync::mpsc::channel();
        for walk in 0..3 {
            let (table, start, done) = (table.clone(), start.clone(), done.clone());
            // Detached: a walk that never ends fails the test instead of holding it.
            std::thread::spawn(move || {
                start.wait();
                match walk {
                    0 => table.reset_exchange(b"kraken"),
                    1 => drop(table.busiest(10)),
                    _ => drop(table.stats()),
                }
                let _ = done.send(walk);
            });
        }
        for _ in 0..3 {
            walks
                .recv_timeout(std::time::Duration::from_secs(60))
                .unwrap_or_else(|_| panic!("round {round}: a walk still running after 60 s"));
        }
    }
}

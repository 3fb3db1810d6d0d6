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

//! A check of buckets the table already holds allocates nothing, whether of one bucket or
//! of several, by key and limit or prepared.

use bourse_core::{Check, Config, KeyRef, Limit, Mode, PreparedCheck, Table};

#[path = "support/counting.rs"]
mod counting;

use counting::allocations;

#[test]
fn checks_of_known_buckets_allocate_nothing() {
    let table = Table::new(Config::default());
    let limit = Limit::new(1e9, 1e9).unwrap();
    let axes: [&[u8]; 3] = [b"request", b"ip", b"order"];
    let checks: Vec<Check> = axes
        .iter()
        .map(|axis| Check {
            key: KeyRef::new(b"binance", Some(b"api-key"), axis),
            limit,
            cost: 1.0,
        })
        .collect();
    let prepared: Vec<_> = checks.iter().map(|c| table.prepare(c.key, limit)).collect();
    let prepared_checks: Vec<PreparedCheck> = prepared
        .iter()
        .map(|bucket| PreparedCheck { bucket, cost: 1.0 })
        .collect();
    // The buckets exist: first seen, each allocates its key.
    table.check_rates(1, &checks, Mode::Probe).unwrap();

    let (_, one) = allocations(|| table.check_rate(1, checks[0], Mode::Probe));
    let (_, one_prepared) = allocations(|| table.check_prepared(1, &prepared[0], 1.0, Mode::Probe));
    let (_, three) = allocations(|| table.check_rates(1, &checks, Mode::Probe).unwrap());
    let (_, three_prepared) = allocations(|| {
        table
            .check_prepared_all(1, &prepared_checks, Mode::Probe)
            .unwrap()
    });
    assert_eq!((one, one_prepared, three, three_prepared), (0, 0, 0, 0));
}

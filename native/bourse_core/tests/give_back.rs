//! A check whose caller never learnt of its payment is taken back exactly, on all its
//! buckets or none, only while nothing else changed them, and never lets more out than P1
//! allows.

use bourse_core::{Check, Clock, Config, KeyRef, Limit, ManualClock, Mode, Outcome, Table};
use proptest::prelude::*;

#[path = "support/conformance.rs"]
mod conformance;

const WAIT: Mode = Mode::Wait {
    max_wait_ms: 60_000,
    booking_slack_ms: None,
};

fn set_up() -> (ManualClock, Table<ManualClock>) {
    let clock = ManualClock::new();
    (clock.clone(), Table::with_clock(Config::default(), clock))
}

fn key(axis: &[u8]) -> KeyRef<'_> {
    KeyRef::new(b"binance", Some(b"k1"), axis)
}

fn check(axis: &[u8], cost: f64) -> Check<'_> {
    Check {
        key: key(axis),
        limit: Limit::new(10.0, 1.0).unwrap(),
        cost,
    }
}

fn tokens(table: &Table<ManualClock>, axis: &[u8]) -> f64 {
    table
        .inspect(key(axis))
        .map_or(f64::NAN, |info| info.tokens)
}

#[test]
fn an_admitted_check_given_back_leaves_the_bucket_as_if_never_paid() {
    let (clock, table) = set_up();
    table.check_rate(1, check(b"a", 4.0), Mode::Probe);
    clock.advance_ms(500);
    let (outcome, receipt) = table
        .check_rates_receipted(1, &[check(b"a", 3.0)], Mode::Probe)
        .unwrap();
    assert_eq!(outcome, Outcome::Admitted);
    assert!((tokens(&table, b"a") - 3.5).abs() < 1e-9);
    clock.advance_ms(200);
    assert!(table.give_back(&receipt));
    assert!((tokens(&table, b"a") - 6.7).abs() < 1e-9);
    // Once only.
    assert!(!table.give_back(&receipt));
    assert!((tokens(&table, b"a") - 6.7).abs() < 1e-9);
}

#[test]
fn checks_given_back_last_first_are_all_taken_back() {
    let (clock, table) = set_up();
    let receipts: Vec<_> = (0..5)
        .map(|_| {
            clock.advance(1_000);
            table
                .check_rates_receipted(1, &[check(b"a", 2.0)], Mode::Probe)
                .unwrap()
                .1
        })
        .collect();
    // The first, while later ones paid after it, keeps its payment.
    assert!(!table.give_back(&receipts[0]));
    assert!(receipts.iter().rev().all(|r| table.give_back(r)));
    assert!(full(&table, b"a"));
}

/// Whether the bucket holds its whole capacity: a check of all of it is admitted.
fn full(table: &Table<ManualClock>, axis: &[u8]) -> bool {
    table.check_rate(1, check(axis, 10.0), Mode::Probe) == Outcome::Admitted
}

#[test]
fn nothing_is_given_back_once_something_else_changed_the_bucket() {
    let (clock, table) = set_up();
    let paid = |axis| {
        table
            .check_rates_receipted(1, &[check(axis, 2.0)], Mode::Probe)
            .unwrap()
            .1
    };
    let debited = paid(b"debited");
    table.record_request(key(b"debited"), 1.0);
    let lowered = paid(b"lowered");
    table.sync(key(b"lowered"), 3.0, 0);
    // A sync that lowers nothing (the exchange allows 9 of the 8 the payment left, and the
    // payment never reached it): given back, the bucket would hold 10.
    let synced = paid(b"synced");
    clock.advance(1);
    assert_eq!(table.sync(key(b"synced"), 9.0, 0), 0.0);
    let refused = paid(b"refused");
    clock.advance(1);
    table.check_rate(2, check(b"refused", 9.0), Mode::Probe);
    let redefined = paid(b"redefined");
    let other = Limit::new(20.0, 1.0).unwrap();
    let changed = Check {
        limit: other,
        ..check(b"redefined", 1.0)
    };
    table.check_rate(1, changed, Mode::Probe);
    let reset = paid(b"reset");
    table.reset(key(b"reset"));
    let paid_again = paid(b"paid_again");
    clock.advance(1);
    table.check_rate(2, check(b"paid_again", 1.0), Mode::Probe);
    for (axis, receipt) in [
        (&b"debited"[..], debited),
        (b"lowered", lowered),
        (b"synced", synced),
        (b"refused", refused),
        (b"redefined", redefined),
        (b"reset", reset),
        (b"paid_again", paid_again),
    ] {
        let before = table.inspect(key(axis));
        assert!(
            !table.give_back(&receipt),
            "{}",
            String::from_utf8_lossy(axis)
        );
        assert_eq!(table.inspect(key(axis)), before);
    }
}

#[test]
fn a_booking_given_back_is_gone_and_its_cost_with_it() {
    let (clock, table) = set_up();
    table.check_rate(1, check(b"a", 10.0), Mode::Probe);
    let (outcome, receipt) = table
        .check_rates_receipted(7, &[check(b"a", 3.0)], WAIT)
        .unwrap();
    assert_eq!(outcome, Outcome::Booked(3_000));
    assert!(table.give_back(&receipt));
    let info = table.inspect(key(b"a")).unwrap();
    assert_eq!((info.bookings, info.tokens.abs() < 1e-9), (0, true));
    // Its owner coming back books anew: there is nothing to claim.
    clock.advance_ms(3_000);
    assert_eq!(
        table.check_rate(7, check(b"a", 3.0), WAIT),
        Outcome::Admitted
    );
    assert!(tokens(&table, b"a").abs() < 1e-9);
}

#[test]
fn a_booking_beside_others_stays_paid() {
    let (_clock, table) = set_up();
    table.check_rate(1, check(b"a", 10.0), Mode::Probe);
    table.check_rate(1, check(b"a", 1.0), WAIT);
    let (outcome, receipt) = table
        .check_rates_receipted(2, &[check(b"a", 1.0)], WAIT)
        .unwrap();
    assert!(matches!(outcome, Outcome::Booked(_)));
    assert!(!receipt.can_give_back());
    assert!(!table.give_back(&receipt));
    assert_eq!(table.inspect(key(b"a")).unwrap().bookings, 2);
}

#[test]
fn a_check_over_several_buckets_is_taken_back_on_all_or_none() {
    let (clock, table) = set_up();
    let both = [check(b"a", 2.0), check(b"b", 5.0)];
    let (outcome, receipt) = table.check_rates_receipted(1, &both, Mode::Probe).unwrap();
    assert_eq!(outcome, Outcome::Admitted);
    assert!(table.give_back(&receipt));
    assert!(full(&table, b"a") && full(&table, b"b"));

    // One bucket moved since: both keep the payment.
    let both = [check(b"c", 2.0), check(b"d", 5.0)];
    let (_, receipt) = table.check_rates_receipted(1, &both, Mode::Probe).unwrap();
    clock.advance(1);
    table.check_rate(2, check(b"d", 1.0), Mode::Probe);
    assert!(!table.give_back(&receipt));
    assert!((tokens(&table, b"c") - 8.0).abs() < 1e-6);
    assert!((tokens(&table, b"d") - 4.0).abs() < 1e-6);
}

#[test]
fn a_check_that_paid_beside_another_booking_is_not_taken_back_at_all() {
    let (_clock, table) = set_up();
    table.check_rate(1, check(b"b", 10.0), Mode::Probe);
    table.check_rate(9, check(b"b", 1.0), WAIT);
    let both = [check(b"a", 2.0), check(b"b", 1.0)];
    let (outcome, receipt) = table.check_rates_receipted(1, &both, WAIT).unwrap();
    assert!(matches!(outcome, Outcome::Booked(_)));
    assert!(!receipt.can_give_back());
    assert!(!table.give_back(&receipt));
    assert_eq!(table.inspect(key(b"a")).unwrap().bookings, 1);
    assert_eq!(table.inspect(key(b"b")).unwrap().bookings, 2);
}

#[test]
fn a_refused_check_has_nothing_to_give_back() {
    let (_clock, table) = set_up();
    let (outcome, receipt) = table
        .check_rates_receipted(1, &[check(b"a", 11.0)], Mode::Probe)
        .unwrap();
    assert!(matches!(outcome, Outcome::Delay(_)));
    assert!(!receipt.can_give_back());
}

#[derive(Debug, Clone)]
enum Op {
    Check(f64),
    Advance(u64),
    /// Gives back the receipt this many from the latest kept.
    GiveBack(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0.1f64..4.0).prop_map(Op::Check),
        3 => (0u64..400_000_000).prop_map(Op::Advance),
        2 => (0usize..3).prop_map(Op::GiveBack),
    ]
}

proptest! {
    /// P1 over the checks that kept their payment, whatever was given back when.
    #[test]
    fn p1_holds_over_what_was_not_given_back(ops in prop::collection::vec(op(), 1..120)) {
        let (clock, table) = set_up();
        let mut paid: Vec<(u64, f64, bourse_core::Receipt)> = Vec::new();
        let mut kept: Vec<(u64, u64, f64)> = Vec::new();
        for op in ops {
            match op {
                Op::Check(cost) => {
                    let (outcome, receipt) = table
                        .check_rates_receipted(1, &[check(b"a", cost)], Mode::Probe)
                        .unwrap();
                    if outcome == Outcome::Admitted {
                        paid.push((clock.now(), cost, receipt));
                    }
                }
                Op::Advance(ns) => clock.advance(ns),
                Op::GiveBack(back) => {
                    if let Some(at) = paid.len().checked_sub(back + 1) {
                        let (_, _, receipt) = &paid[at];
                        if table.give_back(receipt) {
                            paid.remove(at);
                        }
                    }
                }
            }
        }
        kept.extend(paid.iter().map(|&(at, cost, _)| (at, at, cost)));
        let excess = conformance::first_excess(10.0, 1.0, &mut kept);
        prop_assert!(excess.is_none(), "{}", excess.unwrap_or_default());
    }
}

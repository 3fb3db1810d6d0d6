//! Prepared buckets answer exactly as their key and limit do, on the same bucket.

use bourse_core::{Check, Config, KeyRef, Limit, ManualClock, Mode, Outcome, PreparedCheck, Table};

const ME: u64 = 1;

fn table() -> (Table<ManualClock>, ManualClock) {
    let clock = ManualClock::new();
    (Table::with_clock(Config::default(), clock.clone()), clock)
}

fn key(axis: &str) -> KeyRef<'_> {
    KeyRef::new(b"binance", Some(b"api-key"), axis.as_bytes())
}

fn limit(capacity: f64, refill: f64) -> Limit {
    Limit::new(capacity, refill).unwrap()
}

fn check(axis: &str, limit: Limit, cost: f64) -> Check<'_> {
    Check {
        key: key(axis),
        limit,
        cost,
    }
}

const WAIT: Mode = Mode::Wait {
    max_wait_ms: 60_000,
    booking_slack_ms: None,
};

#[test]
fn a_prepared_bucket_is_the_bucket_of_its_key() {
    let (t, _) = table();
    let l = limit(10.0, 10.0);
    let bucket = t.prepare(key("request"), l);
    assert_eq!(bucket.key(), key("request"));
    assert_eq!(bucket.limit(), l);
    for i in 0..10 {
        let outcome = if i % 2 == 0 {
            t.check_prepared(ME, &bucket, 1.0, Mode::Probe)
        } else {
            t.check_rate(ME, check("request", l, 1.0), Mode::Probe)
        };
        assert_eq!(outcome, Outcome::Admitted);
    }
    assert_eq!(
        t.check_prepared(ME, &bucket, 1.0, Mode::Probe),
        Outcome::Delay(100)
    );
    assert_eq!(
        t.check_rate(ME, check("request", l, 1.0), Mode::Probe),
        Outcome::Delay(100)
    );
    assert_eq!(t.stats().buckets, 1);
}

#[test]
fn a_booking_made_prepared_is_claimed_by_key_and_limit() {
    let (t, clock) = table();
    let l = limit(1.0, 1.0);
    let bucket = t.prepare(key("request"), l);
    assert_eq!(t.check_prepared(ME, &bucket, 1.0, WAIT), Outcome::Admitted);
    assert_eq!(
        t.check_prepared(ME, &bucket, 1.0, WAIT),
        Outcome::Booked(1000)
    );
    clock.advance_ms(1000);
    assert_eq!(
        t.check_rate(ME, check("request", l, 1.0), WAIT),
        Outcome::Claimed
    );
}

#[test]
fn a_bucket_prepared_by_another_table_is_hashed_again() {
    let (mine, _) = table();
    let (other, _) = table();
    let l = limit(3.0, 1.0);
    let foreign = other.prepare(key("request"), l);
    for _ in 0..3 {
        assert_eq!(
            mine.check_prepared(ME, &foreign, 1.0, Mode::Probe),
            Outcome::Admitted
        );
    }
    // The same bucket as the key's in this table, and none in the other.
    assert_eq!(
        mine.check_rate(ME, check("request", l, 1.0), Mode::Probe),
        Outcome::Delay(1000)
    );
    assert_eq!(mine.stats().buckets, 1);
    assert_eq!(other.stats().buckets, 0);
    let both = [
        PreparedCheck {
            bucket: &foreign,
            cost: 0.0,
        },
        PreparedCheck {
            bucket: &mine.prepare(key("ip"), l),
            cost: 1.0,
        },
    ];
    assert_eq!(
        mine.check_prepared_all(ME, &both, Mode::Probe),
        Ok(Outcome::Admitted)
    );
    assert_eq!(mine.stats().buckets, 2);
}

#[test]
fn prepared_multi_bucket_checks_coalesce_and_refuse_conflicts_as_keys_do() {
    let (t, _) = table();
    let l = limit(5.0, 1.0);
    let request = t.prepare(key("request"), l);
    let ip = t.prepare(key("ip"), limit(2.0, 1.0));
    let checks = [
        PreparedCheck {
            bucket: &request,
            cost: 2.0,
        },
        PreparedCheck {
            bucket: &ip,
            cost: 1.0,
        },
        PreparedCheck {
            bucket: &request,
            cost: 2.0,
        },
    ];
    assert_eq!(
        t.check_prepared_all(ME, &checks, Mode::Probe),
        Ok(Outcome::Admitted)
    );
    assert_eq!(t.get_cost(key("request")), 4.0);
    assert_eq!(t.get_cost(key("ip")), 1.0);
    // All or nothing: `request` has 1 token left, so nothing is paid on `ip`.
    assert_eq!(
        t.check_prepared_all(ME, &checks[1..], Mode::Probe),
        Ok(Outcome::Delay(1000))
    );
    assert_eq!(t.get_cost(key("ip")), 1.0);
    let conflicting = t.prepare(key("request"), limit(9.0, 1.0));
    let error = t
        .check_prepared_all(
            ME,
            &[
                PreparedCheck {
                    bucket: &request,
                    cost: 0.0,
                },
                PreparedCheck {
                    bucket: &conflicting,
                    cost: 0.0,
                },
            ],
            Mode::Probe,
        )
        .unwrap_err();
    let expected = t
        .check_rates(
            ME,
            &[
                check("request", l, 0.0),
                check("request", limit(9.0, 1.0), 0.0),
            ],
            Mode::Probe,
        )
        .unwrap_err();
    assert_eq!(error, expected);
}

#[test]
fn recorded_debt_waits_for_a_prepared_bucket_as_for_a_key() {
    let (t, _) = table();
    t.record_request(key("request"), 4.0);
    let bucket = t.prepare(key("request"), limit(5.0, 1.0));
    assert_eq!(
        t.check_prepared(ME, &bucket, 1.0, Mode::Probe),
        Outcome::Admitted
    );
    assert_eq!(
        t.check_prepared(ME, &bucket, 1.0, Mode::Probe),
        Outcome::Delay(1000)
    );
}

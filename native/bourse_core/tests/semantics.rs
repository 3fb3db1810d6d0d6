//! Exact scenarios on a manual clock: delays in whole milliseconds, token counts to the unit.

use bourse_core::rules::{
    BACKOFF_LAPSE_MS, DEBT_KEEP_MS, KEEP_MARGIN_MS, MAX_BOOKINGS, MAX_PAUSES,
};
use bourse_core::{
    BackoffScope, Caller, Check, Config, KeyRef, Limit, ManualClock, Mode, Outcome, PauseTarget,
    Table,
};

const ME: u64 = 1;
const OTHER: u64 = 2;

fn table() -> (Table<ManualClock>, ManualClock) {
    table_with(Config::default())
}

fn table_with(config: Config) -> (Table<ManualClock>, ManualClock) {
    let clock = ManualClock::new();
    (Table::with_clock(config, clock.clone()), clock)
}

fn key(axis: &str) -> KeyRef<'_> {
    KeyRef::new(b"binance", Some(b"api-key"), axis.as_bytes())
}

fn limit(capacity: f64, refill: f64) -> Limit {
    Limit::new(capacity, refill).unwrap()
}

fn check<'a>(key: KeyRef<'a>, limit: Limit, cost: f64) -> Check<'a> {
    Check { key, limit, cost }
}

fn probe(t: &Table<ManualClock>, axis: &str, l: Limit, cost: f64) -> Outcome {
    t.check_rate(ME, check(key(axis), l, cost), Mode::Probe)
}

/// A waiter with a budget of a minute and the table's booking slack.
const WAITER: Mode = Mode::Wait {
    max_wait_ms: 60_000,
    booking_slack_ms: None,
};

fn wait(t: &Table<ManualClock>, owner: u64, axis: &str, l: Limit, cost: f64) -> Outcome {
    t.check_rate(owner, check(key(axis), l, cost), WAITER)
}

/// The public pool's IP bucket.
fn ip() -> KeyRef<'static> {
    KeyRef::new(b"binance", None, b"ip")
}

/// A check of the credential's bucket and the IP's, each at `cost` under `l`.
fn credential_and_ip(l: Limit, cost: f64) -> [Check<'static>; 2] {
    [check(key("request"), l, cost), check(ip(), l, cost)]
}

#[test]
fn fresh_bucket_is_full_then_delays_to_the_next_token() {
    let (t, _) = table();
    let l = limit(10.0, 10.0);
    for _ in 0..10 {
        assert_eq!(probe(&t, "request", l, 1.0), Outcome::Admitted);
    }
    assert_eq!(probe(&t, "request", l, 1.0), Outcome::Delay(100));
    assert_eq!(t.get_cost(key("request")), 10.0);
}

#[test]
fn delays_round_up_to_whole_milliseconds_and_never_below_one() {
    let (t, clock) = table();
    let l = limit(1.0, 3.0);
    assert_eq!(probe(&t, "request", l, 1.0), Outcome::Admitted);
    assert_eq!(probe(&t, "request", l, 1.0), Outcome::Delay(334));
    clock.advance(333_333_000);
    assert_eq!(probe(&t, "request", l, 1.0), Outcome::Delay(1));
    clock.advance(1_000);
    assert_eq!(probe(&t, "request", l, 1.0), Outcome::Admitted);
}

#[test]
fn a_caller_that_sleeps_the_delay_is_admitted() {
    let (t, clock) = table();
    let l = limit(2.0, 7.0);
    for _ in 0..200 {
        match probe(&t, "request", l, 1.0) {
            Outcome::Admitted => {}
            Outcome::Delay(ms) => {
                clock.advance_ms(ms);
                assert_eq!(probe(&t, "request", l, 1.0), Outcome::Admitted);
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}

#[test]
fn over_capacity_cost_accrues_then_leaves_the_bucket_empty() {
    let (t, clock) = table();
    // The seed's okx system/status: capacity 1, 9.09/s, cost 50.
    let l = limit(1.0, 9.09);
    // Full bucket holds 1; 49 more take 49 / 9.09 s = 5390.54 ms.
    assert_eq!(probe(&t, "request", l, 50.0), Outcome::Delay(5391));
    assert_eq!(
        t.get_cost(key("request")),
        0.0,
        "a refused probe pays nothing"
    );
    clock.advance_ms(5391);
    assert_eq!(probe(&t, "request", l, 50.0), Outcome::Admitted);
    assert_eq!(t.inspect(key("request")).unwrap().tokens, 0.0);
    assert_eq!(probe(&t, "request", l, 1.0), Outcome::Delay(111));
    // Cheap traffic never sees more than the capacity, however long the bucket idles.
    clock.advance_ms(60_000);
    assert_eq!(probe(&t, "request", l, 1.0), Outcome::Admitted);
    assert_eq!(probe(&t, "request", l, 1.0), Outcome::Delay(111));
}

/// The float tolerance of a check is relative to its cost: tiny limits and costs (any
/// positive number is valid) admit what P1 allows, not what a fixed tolerance would.
#[test]
fn tiny_limits_and_costs_admit_no_more_than_the_bound() {
    for tiny in [1e-9, 1e-10, 1e-12, 1e-300] {
        let (t, clock) = table();
        let l = limit(tiny, tiny);
        assert_eq!(probe(&t, "request", l, tiny), Outcome::Admitted);
        for _ in 0..100 {
            clock.advance(1_000);
            assert!(
                matches!(probe(&t, "request", l, tiny), Outcome::Delay(_)),
                "capacity, refill and cost {tiny}: a second cost admitted within 100 µs"
            );
        }
    }
    // A drained bucket of 10 refilling 1e-9 per second, then costs of 1e-12 for 1 ms: the
    // bound allows none of them (1e-12 tokens accrue in that millisecond).
    let (t, clock) = table();
    let l = limit(10.0, 1e-9);
    assert_eq!(probe(&t, "request", l, 10.0), Outcome::Admitted);
    let admitted = (0..1_000)
        .filter(|_| {
            clock.advance(1_000);
            probe(&t, "request", l, 1e-12) == Outcome::Admitted
        })
        .count();
    assert!(
        admitted <= 1,
        "{admitted} costs of 1e-12 admitted, P1 allows 1"
    );
}

#[test]
fn over_capacity_accrual_restarts_after_any_payment() {
    let (t, clock) = table();
    let l = limit(1.0, 10.0);
    clock.advance_ms(10_000);
    assert_eq!(probe(&t, "request", l, 1.0), Outcome::Admitted);
    // Paid at 10 s: the 5-token cost accrues from zero again.
    assert_eq!(probe(&t, "request", l, 5.0), Outcome::Delay(500));
}

#[test]
fn repeated_keys_are_coalesced_into_one_cost() {
    let (t, _) = table();
    let l = limit(10.0, 10.0);
    t.record_request(key("request"), 6.0);
    let checks = [check(key("request"), l, 3.0), check(key("request"), l, 3.0)];
    // Holds 4, needs 6: 200 ms for the combined cost, nothing paid.
    assert_eq!(
        t.check_rates(ME, &checks, Mode::Probe),
        Ok(Outcome::Delay(200))
    );
    assert_eq!(t.get_cost(key("request")), 6.0);
}

#[test]
fn conflicting_definitions_pay_nothing_on_any_key() {
    let (t, _) = table();
    let checks = [
        check(key("ip"), limit(10.0, 10.0), 1.0),
        check(key("request"), limit(10.0, 10.0), 1.0),
        check(key("request"), limit(5.0, 5.0), 1.0),
    ];
    assert!(t.check_rates(ME, &checks, Mode::Probe).is_err());
    assert_eq!(t.get_cost(key("ip")), 0.0);
    assert_eq!(t.get_cost(key("request")), 0.0);
    assert_eq!(t.stats().invalid, 1);
}

#[test]
fn multi_bucket_check_pays_on_all_or_none() {
    let (t, clock) = table();
    let wide = limit(10.0, 10.0);
    let narrow = limit(1.0, 1.0);
    assert_eq!(probe(&t, "order", narrow, 1.0), Outcome::Admitted);
    let checks = [
        check(key("ip"), wide, 2.0),
        check(key("order"), narrow, 1.0),
    ];
    assert_eq!(
        t.check_rates(ME, &checks, Mode::Probe),
        Ok(Outcome::Delay(1000))
    );
    assert_eq!(t.get_cost(key("ip")), 0.0);
    clock.advance_ms(1000);
    assert_eq!(
        t.check_rates(ME, &checks, Mode::Probe),
        Ok(Outcome::Admitted)
    );
    assert_eq!(t.get_cost(key("order")), 1.0);
    assert_eq!(t.get_cost(key("ip")), 2.0 - 10.0 * 0.0);
}

#[test]
fn a_check_over_more_bookings_than_its_bound_is_left_undone() {
    let (t, clock) = table();
    let l = limit(1.0, 1.0);
    for (owner, axis) in [(10, "ip"), (11, "ip"), (12, "order")] {
        let cost = if owner == 10 { 1.0 } else { 2.0 };
        assert!(matches!(
            wait(&t, owner, axis, l, cost),
            Outcome::Admitted | Outcome::Booked(_)
        ));
    }
    clock.advance_ms(10);
    let checks = [check(key("ip"), l, 1.0), check(key("order"), l, 1.0)];
    let before = (t.inspect(key("ip")), t.inspect(key("order")), t.stats());
    // Two bookings held on the two buckets: over a bound of 1, nothing is done.
    assert_eq!(t.check_rates_within(ME, &checks, Mode::Probe, 1), Ok(None));
    assert_eq!(
        (t.inspect(key("ip")), t.inspect(key("order")), t.stats()),
        before
    );
    // Within the bound, the answer of the unbounded call.
    let within = t.check_rates_within(ME, &checks, Mode::Probe, 2);
    assert_eq!(within, Ok(Some(Outcome::Delay(2990))));
    assert_eq!(
        t.check_rates(ME, &checks, Mode::Probe),
        Ok(Outcome::Delay(2990))
    );
}

/// A waiter's booking on two buckets lapses; another, made since under another definition,
/// is held behind a pause; a probe follows. Returns the probe's answer, `look` run at 1900
/// ms, between the lapse (1825 ms) and the probe.
fn probe_after_a_lapse(look: impl Fn(&Table<ManualClock>)) -> Outcome {
    let (t, clock) = table();
    let (s, big) = (limit(3.0, 2.0), limit(5.0, 4.0));
    let w = Mode::Wait {
        max_wait_ms: 3000,
        booking_slack_ms: None,
    };
    let (b, ip) = (key("b"), key("ip"));
    t.pause(PauseTarget::Exchange(b"binance".to_vec()), 400);
    assert!(matches!(
        t.check_rates(ME, &[check(b, s, 1.0)], w),
        Ok(Outcome::Booked(_))
    ));
    clock.advance_ms(250);
    let lapsing = [check(b, big, 7.0), check(ip, big, 2.0)];
    assert!(matches!(
        t.check_rates(ME, &lapsing, w),
        Ok(Outcome::Booked(_))
    ));
    clock.advance_ms(800);
    assert!(matches!(
        t.check_rates(ME, &[check(b, s, 0.5)], w),
        Ok(Outcome::Booked(_))
    ));
    clock.advance_ms(700);
    assert!(matches!(
        t.check_rates(ME, &[check(b, big, 4.0)], w),
        Ok(Outcome::Booked(_))
    ));
    clock.advance_ms(150);
    look(&t);
    clock.advance_ms(450);
    t.pause(PauseTarget::Exchange(b"binance".to_vec()), 100);
    t.check_rate(ME, check(b, s, 3.0), Mode::Probe)
}

#[test]
fn a_sweep_or_a_look_at_the_table_changes_no_answer() {
    let alone = probe_after_a_lapse(|_| {});
    assert_eq!(alone, Outcome::Delay(4750));
    assert_eq!(probe_after_a_lapse(|t| assert_eq!(t.sweep(), 0)), alone);
    let shown = |t: &Table<ManualClock>| {
        // The lapsed booking is not shown, nor counted, though left for the next check.
        let lapsed = t.stats().lapsed;
        assert_eq!(t.inspect(key("b")).unwrap().bookings, 2);
        assert_eq!(t.busiest(10)[0].1.bookings, 2);
        assert_eq!((t.stats().bookings, t.stats().lapsed), (2, lapsed));
    };
    assert_eq!(probe_after_a_lapse(shown), alone);
}

#[test]
fn a_booking_is_claimed_without_a_second_charge() {
    let (t, clock) = table();
    let l = limit(10.0, 10.0);
    t.record_request(key("request"), 10.0);
    assert_eq!(probe(&t, "request", l, 1.0), Outcome::Delay(100));
    // Bookings take the cost at once: later callers queue behind.
    assert_eq!(wait(&t, ME, "request", l, 5.0), Outcome::Booked(500));
    assert_eq!(probe(&t, "request", l, 1.0), Outcome::Delay(600));
    assert_eq!(t.get_cost(key("request")), 15.0);
    // Early: the remaining wait, nothing charged.
    clock.advance_ms(200);
    assert_eq!(wait(&t, ME, "request", l, 5.0), Outcome::Delay(300));
    // Another caller with the same checks does not own the booking.
    assert_eq!(wait(&t, OTHER, "request", l, 5.0), Outcome::Booked(800));
    clock.advance_ms(300);
    assert_eq!(probe(&t, "request", l, 5.0), Outcome::Claimed);
    assert_eq!(t.get_cost(key("request")), 15.0);
    let stats = t.stats();
    assert_eq!((stats.booked, stats.claimed), (2, 1));
}

#[test]
fn a_booking_not_claimed_within_the_slack_lapses_but_stays_paid() {
    let (t, clock) = table();
    let l = limit(10.0, 10.0);
    t.record_request(key("request"), 10.0);
    assert_eq!(wait(&t, ME, "request", l, 5.0), Outcome::Booked(500));
    clock.advance_ms(500 + 251);
    let info = t.inspect(key("request")).unwrap();
    assert_eq!(info.bookings, 0);
    // 5 booked, 7.51 refilled since: the booking's cost was not handed back.
    assert!((info.tokens - 2.51).abs() < 1e-9, "{info:?}");
    // Coming back now is a new request.
    assert_eq!(wait(&t, ME, "request", l, 5.0), Outcome::Booked(249));
    assert_eq!(t.stats().lapsed, 1);
}

#[test]
fn a_waiter_that_names_its_slack_keeps_its_booking_that_long() {
    let (t, clock) = table();
    let l = limit(10.0, 10.0);
    let wait_with_slack = |owner, slack_ms| {
        t.check_rate(
            owner,
            check(key("request"), l, 5.0),
            Mode::Wait {
                max_wait_ms: 60_000,
                booking_slack_ms: slack_ms,
            },
        )
    };
    t.record_request(key("request"), 10.0);
    assert_eq!(wait_with_slack(ME, Some(5_000)), Outcome::Booked(500));
    assert_eq!(wait_with_slack(OTHER, None), Outcome::Booked(1000));
    // Past the table's 250 ms slack: the other waiter's booking lapsed, not this one's.
    clock.advance_ms(1_000 + 251);
    assert_eq!(wait_with_slack(ME, None), Outcome::Claimed);
    assert_eq!(t.inspect(key("request")).unwrap().bookings, 0);
    assert_eq!(t.stats().lapsed, 1);
    // A slack of 0 lapses a booking once its ready time has passed.
    assert_eq!(wait_with_slack(ME, Some(0)), Outcome::Booked(249));
    clock.advance_ms(250);
    assert_eq!(wait_with_slack(ME, None), Outcome::Booked(499));
    assert_eq!(t.stats().lapsed, 2);
}

#[test]
fn booking_again_after_one_of_its_buckets_was_reset_gives_the_old_booking_back() {
    let (t, _) = table();
    let l = limit(1.0, 1.0);
    let checks = [check(key("request"), l, 1.0), check(key("ip"), l, 1.0)];
    let waiter = WAITER;
    t.record_request(key("request"), 1.0);
    t.record_request(key("ip"), 1.0);
    assert_eq!(
        t.check_rates(ME, &checks, waiter),
        Ok(Outcome::Booked(1000))
    );
    t.reset(key("request"));
    // The booking left on the IP is given back: not charged twice, booked as at first.
    assert_eq!(
        t.check_rates(ME, &checks, waiter),
        Ok(Outcome::Booked(1000))
    );
    assert_eq!(t.inspect(key("ip")).unwrap().bookings, 1);
    assert_eq!(t.stats().bookings, 2);
}

#[test]
fn an_early_claim_or_a_pause_keeps_the_slack_a_booking_was_made_with() {
    let (t, clock) = table();
    let l = limit(1.0, 1.0);
    let check = || check(key("request"), l, 1.0);
    let waiter = Mode::Wait {
        max_wait_ms: 60_000,
        booking_slack_ms: Some(5_000),
    };
    t.record_request(key("request"), 1.0);
    assert_eq!(t.check_rate(ME, check(), waiter), Outcome::Booked(1000));
    // Early, by a probe (the table's slack is 250 ms): told the rest of the wait.
    clock.advance_ms(500);
    assert_eq!(t.check_rate(ME, check(), Mode::Probe), Outcome::Delay(500));
    // A pause moves it later.
    t.pause(PauseTarget::Exchange(b"binance".to_vec()), 1_000);
    assert_eq!(t.check_rate(ME, check(), Mode::Probe), Outcome::Delay(1000));
    // Two seconds past its new ready time: within its own slack still.
    clock.advance_ms(1_000 + 2_000);
    assert_eq!(t.check_rate(ME, check(), Mode::Probe), Outcome::Claimed);
    assert_eq!(t.stats().lapsed, 0);
}

#[test]
fn a_waiter_over_budget_books_nothing() {
    let (t, _) = table();
    let l = limit(10.0, 10.0);
    t.record_request(key("request"), 10.0);
    let outcome = t.check_rate(
        ME,
        check(key("request"), l, 5.0),
        Mode::Wait {
            max_wait_ms: 499,
            booking_slack_ms: None,
        },
    );
    assert_eq!(outcome, Outcome::OverBudget(500));
    assert_eq!(t.inspect(key("request")).unwrap().bookings, 0);
    assert_eq!(t.get_cost(key("request")), 10.0);
}

#[test]
fn a_waiter_back_early_with_a_shorter_budget_keeps_its_booking_and_counts_over_budget() {
    let (t, clock) = table();
    let l = limit(10.0, 10.0);
    t.record_request(key("request"), 10.0);
    assert_eq!(wait(&t, ME, "request", l, 5.0), Outcome::Booked(500));
    clock.advance_ms(100);
    let short = Mode::Wait {
        max_wait_ms: 10,
        booking_slack_ms: None,
    };
    // Its booking's remaining wait, past this budget: refused by its caller, still booked.
    assert_eq!(
        t.check_rate(ME, check(key("request"), l, 5.0), short),
        Outcome::Delay(400)
    );
    assert_eq!(t.inspect(key("request")).unwrap().bookings, 1);
    // Within its budget, or as a probe, an early claim is a delay.
    assert_eq!(wait(&t, ME, "request", l, 5.0), Outcome::Delay(400));
    assert_eq!(probe(&t, "request", l, 5.0), Outcome::Delay(400));
    let stats = t.stats();
    assert_eq!((stats.over_budget, stats.delayed), (1, 2));
}

#[test]
fn heavy_waiter_is_not_starved_by_cheap_traffic() {
    let (t, clock) = table();
    let l = limit(10.0, 10.0);
    t.record_request(key("request"), 10.0);
    let Outcome::Booked(ms) = wait(&t, ME, "request", l, 8.0) else {
        panic!("expected a booking")
    };
    assert_eq!(ms, 800);
    for _ in 0..ms {
        clock.advance_ms(1);
        let _ = probe(&t, "request", l, 1.0);
    }
    assert_eq!(wait(&t, ME, "request", l, 8.0), Outcome::Claimed);
}

#[test]
fn debt_on_an_undefined_key_applies_at_its_first_definition() {
    let (t, clock) = table();
    t.record_request(key("request"), 4.0);
    assert_eq!(t.get_cost(key("request")), 4.0);
    clock.advance_ms(10_000);
    assert_eq!(
        t.get_cost(key("request")),
        4.0,
        "no refill without a definition"
    );
    let l = limit(10.0, 10.0);
    for _ in 0..6 {
        assert_eq!(probe(&t, "request", l, 1.0), Outcome::Admitted);
    }
    assert_eq!(probe(&t, "request", l, 1.0), Outcome::Delay(100));
}

#[test]
fn record_can_push_a_bucket_into_debt() {
    let (t, _) = table();
    let l = limit(10.0, 10.0);
    assert_eq!(probe(&t, "request", l, 1.0), Outcome::Admitted);
    t.record_request(key("request"), 20.0);
    assert_eq!(t.get_cost(key("request")), 21.0);
    assert_eq!(probe(&t, "request", l, 1.0), Outcome::Delay(1200));
}

#[test]
fn a_new_definition_applies_when_admitted_and_clamps_tokens() {
    let (t, _) = table();
    assert_eq!(
        probe(&t, "request", limit(10.0, 10.0), 1.0),
        Outcome::Admitted
    );
    // Refused under the new definition: the old one stays.
    assert_eq!(
        probe(&t, "request", limit(2.0, 1.0), 5.0),
        Outcome::Delay(3000)
    );
    assert_eq!(
        t.inspect(key("request")).unwrap().limit,
        Some(limit(10.0, 10.0))
    );
    // Admitted: 9 tokens clamped to 2, minus 1.
    assert_eq!(
        probe(&t, "request", limit(2.0, 1.0), 1.0),
        Outcome::Admitted
    );
    assert_eq!(t.inspect(key("request")).unwrap().tokens, 1.0);
    assert_eq!(
        t.inspect(key("request")).unwrap().limit,
        Some(limit(2.0, 1.0))
    );
}

/// A bucket kept only for a refused caller's delay (P7) is as new: a check under another
/// definition starts it as a new key (P3: the refusal makes no later answer worse).
#[test]
fn a_refusal_keeps_no_old_definition_for_another() {
    let (t, clock) = table();
    let (small, big) = (limit(4.0, 10.0), limit(100.0, 10.0));
    assert_eq!(probe(&t, "a", small, 4.0), Outcome::Admitted);
    assert_eq!(probe(&t, "b", small, 4.0), Outcome::Admitted);
    clock.advance_ms(50);
    assert_eq!(probe(&t, "a", small, 40.0), Outcome::Delay(3_950));
    clock.advance_ms(3_000);
    assert_eq!(t.sweep(), 1, "b is dropped, a kept for its refused caller");
    assert_eq!(probe(&t, "a", big, 100.0), Outcome::Admitted);
    assert_eq!(probe(&t, "b", big, 100.0), Outcome::Admitted);
    assert_eq!(t.inspect(key("a")).unwrap().limit, Some(big));
}

/// A bucket as new under another definition starts as a new key would, with
/// assume_busy_at_start too; a refused check leaves its definition.
#[test]
fn a_bucket_as_new_takes_another_definition_as_a_new_key() {
    let (t, clock) = table_with(Config {
        assume_busy_at_start: true,
        ..Config::default()
    });
    let (small, big) = (limit(4.0, 10.0), limit(100.0, 10.0));
    clock.advance_ms(1_000);
    assert_eq!(probe(&t, "a", small, 4.0), Outcome::Admitted);
    clock.advance_ms(4_000);
    // A new key now holds 50 (5 s of refill since the start).
    assert_eq!(probe(&t, "a", big, 51.0), Outcome::Delay(100));
    assert_eq!(t.inspect(key("a")).unwrap().limit, Some(small));
    assert_eq!(probe(&t, "fresh", big, 51.0), Outcome::Delay(100));
    assert_eq!(probe(&t, "a", big, 50.0), Outcome::Admitted);
    assert_eq!(probe(&t, "fresh", big, 50.0), Outcome::Admitted);
    assert_eq!(t.inspect(key("a")).unwrap().tokens, 0.0);
}

/// A bucket as new to another definition starts as a new key from when it was full again
/// after its last payment: what it accrued before that paid its last costs, and is not
/// counted twice (P1 holds for costs over the capacity when definitions alternate).
#[test]
fn another_definition_counts_nothing_the_last_payment_used() {
    let (t, clock) = table();
    let (a, b) = (limit(10.0, 10.0), limit(10.0, 10.000001));
    let wait = Mode::Wait {
        max_wait_ms: 60_000,
        booking_slack_ms: None,
    };
    // A waiter under A books 100: ready at 9 s, claimed then.
    assert!(matches!(
        t.check_rate(ME, check(key("k"), a, 100.0), wait),
        Outcome::Booked(_)
    ));
    clock.advance_ms(9_000);
    assert_eq!(
        t.check_rate(ME, check(key("k"), a, 100.0), wait),
        Outcome::Claimed
    );
    // Full again at 10 s: a cost of 110 under either definition waits about 10 s more.
    clock.advance_ms(1_001);
    assert_eq!(probe(&t, "k", a, 110.0), Outcome::Delay(9_999));
    assert_eq!(probe(&t, "k", b, 110.0), Outcome::Delay(9_999));

    // Costs of twice the capacity every 1,001 ms, the definition alternating or not: as
    // many admitted.
    let admitted = |alternate: bool| {
        let (t, clock) = table();
        assert_eq!(probe(&t, "k", a, 10.0), Outcome::Admitted);
        (0..40)
            .filter(|i| {
                clock.advance_ms(1_001);
                let l = if alternate && i % 2 == 0 { b } else { a };
                probe(&t, "k", l, 20.0) == Outcome::Admitted
            })
            .count()
    };
    assert_eq!(admitted(true), admitted(false));
}

#[test]
fn a_refusal_gives_a_new_key_no_definition() {
    let (t, clock) = table();
    let roomy = limit(100.0, 100.0);
    // Refused probe, waiter over its budget, multi-bucket check refused by its other bucket.
    assert_eq!(
        probe(&t, "a", limit(1.0, 0.001), 2.0),
        Outcome::Delay(1_000_000)
    );
    let over_budget = Mode::Wait {
        max_wait_ms: 10,
        booking_slack_ms: None,
    };
    assert_eq!(
        t.check_rate(ME, check(key("b"), limit(1.0, 0.001), 2.0), over_budget),
        Outcome::OverBudget(1_000_000)
    );
    let ip_limit = limit(1.0, 1.0);
    assert_eq!(
        t.check_rate(ME, check(ip(), ip_limit, 1.0), Mode::Probe),
        Outcome::Admitted
    );
    let both = [
        check(key("c"), limit(1.0, 0.001), 1.0),
        check(ip(), ip_limit, 1.0),
    ];
    assert_eq!(
        t.check_rates(ME, &both, Mode::Probe),
        Ok(Outcome::Delay(1_000))
    );
    for axis in ["a", "b", "c"] {
        let info = t.inspect(key(axis)).expect("seen");
        assert_eq!((info.limit, info.debt), (None, 0.0), "{axis}");
        // A later caller finds the key as new under its own definition.
        assert_eq!(probe(&t, axis, roomy, 50.0), Outcome::Admitted, "{axis}");
        assert_eq!(t.inspect(key(axis)).unwrap().tokens, 50.0, "{axis}");
    }
    // Seen but undefined and owing nothing: dropped once no refusal's caller comes back.
    assert_eq!(probe(&t, "d", limit(1.0, 1.0), 3.0), Outcome::Delay(2_000));
    clock.advance_ms(2_000 + KEEP_MARGIN_MS);
    t.sweep();
    assert!(t.inspect(key("d")).is_some(), "kept for the refused caller");
    clock.advance_ms(1);
    t.sweep();
    assert!(t.inspect(key("d")).is_none());
}

#[test]
fn a_refused_check_starts_the_accrual_of_a_key_it_does_not_define() {
    let (t, clock) = table();
    let l = limit(1.0, 1.0);
    // Debt recorded first: a refused check starts the accrual, the debt stays.
    t.record_request(key("ip"), 2.0);
    clock.advance_ms(5_000);
    assert_eq!(probe(&t, "ip", l, 4.0), Outcome::Delay(5_000));
    assert_eq!(
        t.get_cost(key("ip")),
        2.0,
        "no definition, the debt pending"
    );
    clock.advance_ms(5_000);
    assert_eq!(probe(&t, "ip", l, 4.0), Outcome::Admitted);
    // A debit without a definition spends nothing that accrued: the refused caller is
    // admitted when it comes back, though sweeps ran meanwhile.
    assert_eq!(probe(&t, "order", l, 3.0), Outcome::Delay(2_000));
    t.record_request(key("order"), 0.0);
    clock.advance_ms(1_000);
    t.sweep();
    clock.advance_ms(1_000);
    t.sweep();
    assert_eq!(probe(&t, "order", l, 3.0), Outcome::Admitted);
}

#[test]
fn debt_without_a_definition_is_kept_a_day_past_its_last_use() {
    let (t, clock) = table();
    t.record_request(key("ip"), 2.0);
    clock.advance_ms(DEBT_KEEP_MS / 2);
    // A refused check uses the key: it is kept a day from then.
    assert_eq!(probe(&t, "ip", limit(1.0, 1.0), 4.0), Outcome::Delay(5_000));
    clock.advance_ms(DEBT_KEEP_MS + KEEP_MARGIN_MS);
    t.sweep();
    assert_eq!(t.get_cost(key("ip")), 2.0, "kept");
    clock.advance_ms(1);
    t.sweep();
    assert!(t.inspect(key("ip")).is_none(), "dropped");
    assert_eq!(t.stats().buckets, 0);
}

#[test]
fn no_debt_reads_as_positive_zero() {
    let (t, _) = table();
    assert_eq!(
        probe(&t, "request", limit(1.0, 1.0), 3.0),
        Outcome::Delay(2_000)
    );
    t.record_request(key("ip"), 0.0);
    for axis in ["request", "ip"] {
        let info = t.inspect(key(axis)).unwrap();
        for value in [t.get_cost(key(axis)), info.borrowed, info.debt, info.tokens] {
            assert!(value == 0.0 && value.is_sign_positive(), "{axis}: {value}");
        }
    }
}

#[test]
fn keys_with_neither_a_definition_nor_debt_are_swept() {
    let (t, _) = table();
    for i in 0..100 {
        t.record_request(
            KeyRef::new(b"okx", Some(format!("k{i}").as_bytes()), b"request"),
            0.0,
        );
    }
    t.record_request(key("request"), 1.0);
    assert_eq!(t.stats().buckets, 101);
    assert_eq!(t.sweep(), 100);
    assert_eq!(t.get_cost(key("request")), 1.0, "debt stays");
}

#[test]
fn assume_busy_at_start_starts_buckets_as_if_empty_at_start() {
    let (t, clock) = table_with(Config {
        assume_busy_at_start: true,
        ..Config::default()
    });
    let l = limit(10.0, 10.0);
    clock.advance_ms(300);
    for _ in 0..3 {
        assert_eq!(probe(&t, "request", l, 1.0), Outcome::Admitted);
    }
    assert_eq!(probe(&t, "request", l, 1.0), Outcome::Delay(100));
    clock.advance_ms(5_000);
    assert_eq!(probe(&t, "ip", l, 10.0), Outcome::Admitted);
}

#[test]
fn a_caller_busy_since_its_own_start_sees_new_buckets_as_if_empty_then() {
    let (t, clock) = table();
    let l = limit(10.0, 10.0);
    clock.advance_ms(1_000);
    // Another caller sees "seen" first (refused, it stays without a definition).
    assert_eq!(
        probe(&t, "seen", limit(10.0, 10.0), 11.0),
        Outcome::Delay(100)
    );
    assert_eq!(probe(&t, "old", l, 1.0), Outcome::Admitted);
    clock.advance_ms(1_300);
    let busy = Caller {
        owner: ME,
        busy_for: Some(300 * 1_000_000),
    };
    let ask = |axis, cost| t.check_rate(busy, check(key(axis), l, cost), Mode::Probe);
    // New: 3 tokens accrued since the caller's start.
    for _ in 0..3 {
        assert_eq!(ask("new", 1.0), Outcome::Admitted);
    }
    assert_eq!(ask("new", 1.0), Outcome::Delay(100));
    // Seen before the caller's start: as new at that start, not at the sighting.
    assert_eq!(ask("seen", 4.0), Outcome::Delay(100));
    assert_eq!(ask("seen", 3.0), Outcome::Admitted);
    // A bucket the table already held is left as it is.
    assert_eq!(ask("old", 9.0), Outcome::Admitted);
    // Other callers still see new buckets full, and past the fill time so does this one.
    assert_eq!(probe(&t, "other", l, 10.0), Outcome::Admitted);
    let after = Caller {
        owner: ME,
        busy_for: Some(1_300 * 1_000_000),
    };
    assert_eq!(
        t.check_rate(after, check(key("late"), l, 10.0), Mode::Probe),
        Outcome::Admitted
    );
}

#[test]
fn the_later_of_the_table_start_and_the_caller_start_applies() {
    let (t, clock) = table_with(Config {
        assume_busy_at_start: true,
        ..Config::default()
    });
    let l = limit(10.0, 10.0);
    clock.advance_ms(500);
    let busy_for = |ms: u64| Caller {
        owner: ME,
        busy_for: Some(ms * 1_000_000),
    };
    // Started before the table: counted from the table's start.
    let early = busy_for(900);
    let late = busy_for(200);
    let ask = |caller, axis, cost| t.check_rate(caller, check(key(axis), l, cost), Mode::Probe);
    // From the table's start (500 ms ago), not the earlier caller's.
    assert_eq!(ask(early, "a", 5.0), Outcome::Admitted);
    assert_eq!(ask(early, "b", 6.0), Outcome::Delay(100));
    // From the later caller's start (200 ms ago), not the table's.
    assert_eq!(ask(late, "c", 3.0), Outcome::Delay(100));
    assert_eq!(ask(late, "c", 2.0), Outcome::Admitted);
}

#[test]
fn pauses_hold_every_bucket_of_the_target() {
    let (t, clock) = table();
    let l = limit(10.0, 10.0);
    t.pause(
        PauseTarget::Credential(b"binance".to_vec(), Some(b"api-key".to_vec())),
        2_000,
    );
    t.pause(PauseTarget::Key(key("ip").to_owned_key()), 500);
    assert_eq!(probe(&t, "request", l, 1.0), Outcome::Delay(2000));
    assert_eq!(probe(&t, "ip", l, 1.0), Outcome::Delay(2000));
    // Other credentials are untouched.
    let public = KeyRef::new(b"binance", None, b"request");
    assert_eq!(
        t.check_rate(ME, check(public, l, 1.0), Mode::Probe),
        Outcome::Admitted
    );
    // Waiters book behind the pause.
    assert_eq!(wait(&t, ME, "request", l, 1.0), Outcome::Booked(2000));
    clock.advance_ms(1_000);
    assert_eq!(t.inspect(key("request")).unwrap().pause_ms, Some(1000));
    clock.advance_ms(1_000);
    assert_eq!(wait(&t, ME, "request", l, 1.0), Outcome::Claimed);
    assert_eq!(probe(&t, "request", l, 1.0), Outcome::Admitted);
}

#[test]
fn a_pause_that_starts_after_booking_holds_the_claim() {
    let (t, clock) = table();
    let l = limit(1.0, 10.0);
    t.record_request(key("request"), 1.0);
    assert_eq!(wait(&t, ME, "request", l, 1.0), Outcome::Booked(100));
    t.pause(PauseTarget::Exchange(b"binance".to_vec()), 1_000);
    clock.advance_ms(100);
    assert_eq!(wait(&t, ME, "request", l, 1.0), Outcome::Delay(900));
    clock.advance_ms(900);
    assert_eq!(wait(&t, ME, "request", l, 1.0), Outcome::Claimed);
}

#[test]
fn bookings_a_pause_held_and_the_traffic_behind_it_fit_the_bucket_at_its_end() {
    let (t, clock) = table();
    let l = limit(10.0, 10.0);
    for _ in 0..10 {
        assert_eq!(probe(&t, "request", l, 1.0), Outcome::Admitted);
    }
    // Ten waiters book the next ten tokens; a 429 then pauses the exchange for 2 s.
    for owner in 0..10 {
        assert_eq!(
            wait(&t, 100 + owner, "request", l, 1.0),
            Outcome::Booked(100 * (owner + 1))
        );
    }
    clock.advance_ms(50);
    t.pause(PauseTarget::Exchange(b"binance".to_vec()), 2_000);
    // Each comes back at its ready time and is held to the pause's end.
    for owner in 0..10 {
        clock.advance_ms(if owner == 0 { 50 } else { 100 });
        let left = 2_050 - 100 * (owner + 1);
        assert_eq!(
            wait(&t, 100 + owner, "request", l, 1.0),
            Outcome::Delay(left)
        );
    }
    clock.advance_ms(1_050);
    for owner in 0..10 {
        assert_eq!(wait(&t, 100 + owner, "request", l, 1.0), Outcome::Claimed);
    }
    // The bucket refilled during the pause, but the ten it held took those tokens:
    // nothing more goes out with them.
    assert_eq!(probe(&t, "request", l, 1.0), Outcome::Delay(100));
    clock.advance_ms(1_000);
    for _ in 0..10 {
        assert_eq!(probe(&t, "request", l, 1.0), Outcome::Admitted);
    }
    assert_eq!(probe(&t, "request", l, 1.0), Outcome::Delay(100));
}

#[test]
fn a_booking_held_by_a_pause_of_one_of_its_buckets_is_paid_again_on_the_others() {
    // Ten waiters check their credential's bucket and the IP's; a 429 then pauses the
    // credential only. Paid on the IP bucket as of their old ready times, the held waiters
    // would go out at the pause's end beside ten requests of another credential on the IP,
    // which found that bucket refilled: 20 at one instant from 10 tokens.
    let (t, clock) = table();
    let l = limit(10.0, 10.0);
    let ip = ip();
    let both = credential_and_ip(l, 1.0);
    let waiter = WAITER;
    for _ in 0..10 {
        assert_eq!(t.check_rates(ME, &both, Mode::Probe), Ok(Outcome::Admitted));
    }
    for owner in 0..10 {
        assert_eq!(
            t.check_rates(100 + owner, &both, waiter),
            Ok(Outcome::Booked(100 * (owner + 1)))
        );
    }
    clock.advance_ms(50);
    t.pause(
        PauseTarget::Credential(b"binance".to_vec(), Some(b"api-key".to_vec())),
        2_000,
    );
    for owner in 0..10 {
        clock.advance_ms(if owner == 0 { 50 } else { 100 });
        assert_eq!(
            t.check_rates(100 + owner, &both, waiter),
            Ok(Outcome::Delay(2_050 - 100 * (owner + 1)))
        );
    }
    clock.advance_ms(1_050);
    let other = KeyRef::new(b"binance", Some(b"other-key"), b"request");
    let others = [check(other, l, 1.0), check(ip, l, 1.0)];
    assert_eq!(
        t.check_rates(OTHER, &others, Mode::Probe),
        Ok(Outcome::Delay(100))
    );
    for owner in 0..10 {
        assert_eq!(
            t.check_rates(100 + owner, &both, waiter),
            Ok(Outcome::Claimed)
        );
    }
    clock.advance_ms(1_000);
    for _ in 0..10 {
        assert_eq!(
            t.check_rates(OTHER, &others, Mode::Probe),
            Ok(Outcome::Admitted)
        );
    }
    assert_eq!(
        t.check_rates(OTHER, &others, Mode::Probe),
        Ok(Outcome::Delay(100))
    );
}

#[test]
fn a_bucket_holds_at_most_max_bookings_and_a_waiter_beyond_them_pays_nothing() {
    let (t, clock) = table();
    let l = limit(1.0, 1000.0);
    assert_eq!(probe(&t, "request", l, 1.0), Outcome::Admitted);
    for owner in 0..MAX_BOOKINGS as u64 {
        assert!(matches!(
            wait(&t, 100 + owner, "request", l, 1.0),
            Outcome::Booked(_)
        ));
    }
    // Within its budget, but the queue is full: refused with the delay it would have
    // booked, and nothing is paid.
    let borrowed = t.inspect(key("request")).unwrap().borrowed;
    assert_eq!(wait(&t, OTHER, "request", l, 1.0), Outcome::OverBudget(257));
    assert_eq!(t.inspect(key("request")).unwrap().borrowed, borrowed);
    // A claim makes room.
    clock.advance_ms(1);
    assert_eq!(wait(&t, 100, "request", l, 1.0), Outcome::Claimed);
    assert_eq!(wait(&t, OTHER, "request", l, 1.0), Outcome::Booked(256));
}

#[test]
fn a_short_pause_charges_a_held_booking_nothing_more() {
    let (t, clock) = table();
    let l = limit(10.0, 10.0);
    for _ in 0..10 {
        assert_eq!(probe(&t, "request", l, 1.0), Outcome::Admitted);
    }
    assert_eq!(wait(&t, OTHER, "request", l, 5.0), Outcome::Booked(500));
    t.pause(PauseTarget::Exchange(b"binance".to_vec()), 600);
    clock.advance_ms(500);
    assert_eq!(wait(&t, OTHER, "request", l, 5.0), Outcome::Delay(100));
    clock.advance_ms(100);
    assert_eq!(wait(&t, OTHER, "request", l, 5.0), Outcome::Claimed);
    // 6 s of refill less the booking's 5: one token, as without the pause.
    assert_eq!(probe(&t, "request", l, 1.0), Outcome::Admitted);
    assert_eq!(probe(&t, "request", l, 1.0), Outcome::Delay(100));
}

#[test]
fn backoffs_double_per_limited_reply_and_pause_their_scope() {
    let (t, clock) = table();
    let l = limit(10.0, 10.0);
    let me = Some(&b"api-key"[..]);
    let credential = BackoffScope::Credential;
    // Each reply after the last backoff's pause ended counts: the pause doubles.
    let mut steps = Vec::new();
    for _ in 0..4 {
        steps.push(t.back_off(b"binance", me, credential));
        clock.advance_ms(*steps.last().unwrap());
    }
    assert_eq!(steps, [1000, 2000, 4000, 8000]);
    // Replies that come back during a backoff's pause were sent before it: each pauses as
    // long again and counts nothing (a burst of 429s is one backoff, not eight).
    let burst: Vec<u64> = (0..8)
        .map(|_| t.back_off(b"binance", me, credential))
        .collect();
    assert_eq!(burst, [16_000; 8]);
    assert_eq!(probe(&t, "ip", l, 1.0), Outcome::Delay(16_000));
    // Per credential: another one, and the public pool, count for themselves.
    assert_eq!(t.back_off(b"binance", Some(b"k2"), credential), 1000);
    assert_eq!(t.back_off(b"binance", None, credential), 1000);
    // The whole exchange's buckets.
    let okx = KeyRef::new(b"okx", Some(b"other"), b"request");
    assert_eq!(t.back_off(b"okx", me, BackoffScope::Exchange), 1000);
    assert_eq!(
        t.check_rate(ME, check(okx, l, 1.0), Mode::Probe),
        Outcome::Delay(1000)
    );
    // A success sent before the pause (it comes back while the pause holds) leaves the
    // count; one after it starts the count again, as a lapse after the last limited reply.
    t.reset_backoff(b"binance", me);
    clock.advance_ms(16_000);
    assert_eq!(t.back_off(b"binance", me, credential), 32_000);
    clock.advance_ms(32_000);
    t.reset_backoff(b"binance", me);
    assert_eq!(t.back_off(b"binance", me, credential), 1000);
    clock.advance_ms(BACKOFF_LAPSE_MS - 1);
    assert_eq!(t.back_off(b"binance", me, credential), 2000);
    clock.advance_ms(BACKOFF_LAPSE_MS);
    t.sweep();
    assert_eq!(t.back_off(b"binance", me, credential), 1000);
    // Resets forget the counts with the pauses.
    t.reset_exchange(b"binance");
    assert_eq!(t.back_off(b"binance", me, credential), 1000);
    t.reset_all();
    assert_eq!(t.back_off(b"binance", me, credential), 1000);
    // Never a bucket: nothing shows among the keys; a key shows the pause alone.
    assert!(t.busiest(10).is_empty());
    let info = t.inspect(KeyRef::new(b"binance", me, b"")).unwrap();
    assert_eq!((info.limit, info.pause_ms), (None, Some(1000)));
}

#[test]
fn replies_limiting_the_exchange_count_for_the_exchange_whichever_credential_got_them() {
    let (t, clock) = table();
    let exchange = BackoffScope::Exchange;
    let keys = [Some(&b"key-a"[..]), Some(&b"key-b"[..]), None];
    // Keys sharing an IP limited in turn: one count, doubling per reply.
    let mut steps = Vec::new();
    for credential in keys.into_iter().cycle().take(4) {
        steps.push(t.back_off(b"binance", credential, exchange));
        clock.advance_ms(*steps.last().unwrap());
    }
    assert_eq!(steps, [1000, 2000, 4000, 8000]);
    // Another key's reply sent before the pause: held as long again, not counted.
    assert_eq!(t.back_off(b"binance", keys[1], exchange), 16_000);
    assert_eq!(t.back_off(b"binance", keys[0], exchange), 16_000);
    clock.advance_ms(16_000);
    // A credential's own count is apart, and so is another exchange's.
    assert_eq!(
        t.back_off(b"binance", keys[0], BackoffScope::Credential),
        1000
    );
    assert_eq!(t.back_off(b"okx", keys[0], exchange), 1000);
    clock.advance_ms(1000);
    // A reply that went through, to any credential, starts the exchange's count again,
    // unless it comes back while the exchange's backoff holds (it was sent before).
    assert_eq!(t.back_off(b"binance", keys[2], exchange), 32_000);
    t.reset_backoff(b"binance", keys[1]);
    clock.advance_ms(32_000);
    assert_eq!(t.back_off(b"binance", keys[1], exchange), 64_000);
    clock.advance_ms(64_000);
    t.reset_backoff(b"binance", keys[1]);
    assert_eq!(t.back_off(b"binance", keys[0], exchange), 1000);
    assert_eq!(
        t.back_off(b"binance", keys[0], BackoffScope::Credential),
        2000
    );
}

#[test]
fn a_backoff_without_room_for_its_exchange_pause_holds_every_exchange() {
    let (t, clock) = table();
    for i in 0..MAX_PAUSES {
        t.pause(
            PauseTarget::Exchange(format!("ex-{i}").into_bytes()),
            60_000,
        );
    }
    let me = Some(&b"api-key"[..]);
    // A credential's pause fits (its own index); an exchange's holds every exchange.
    assert_eq!(t.back_off(b"binance", me, BackoffScope::Credential), 1000);
    assert_eq!(t.back_off(b"binance", me, BackoffScope::Exchange), 1000);
    clock.advance_ms(1000);
    assert_eq!(t.back_off(b"binance", me, BackoffScope::Exchange), 2000);
    let okx = KeyRef::new(b"okx", Some(b"other-key"), b"ip");
    let l = limit(10.0, 10.0);
    assert_eq!(
        t.check_rate(ME, check(okx, l, 1.0), Mode::Probe),
        Outcome::Delay(2000)
    );
    clock.advance_ms(2000);
    assert_eq!(
        t.check_rate(ME, check(okx, l, 1.0), Mode::Probe),
        Outcome::Admitted
    );
}

#[test]
fn resets_forget_keys_bookings_and_pauses() {
    let (t, _) = table();
    let l = limit(10.0, 10.0);
    let okx = KeyRef::new(b"okx", Some(b"api-key"), b"request");
    t.record_request(key("request"), 10.0);
    t.record_request(key("ip"), 10.0);
    t.record_request(okx, 3.0);
    t.pause(PauseTarget::Exchange(b"binance".to_vec()), 60_000);
    t.reset(key("ip"));
    let info = t.inspect(key("ip")).unwrap();
    assert_eq!((info.limit, info.tokens, info.bookings), (None, 0.0, 0));
    assert_eq!(t.get_cost(key("request")), 10.0);
    t.reset_exchange(b"binance");
    assert_eq!(t.get_cost(key("request")), 0.0);
    assert_eq!(t.get_cost(okx), 3.0);
    assert_eq!(probe(&t, "request", l, 10.0), Outcome::Admitted);
    t.reset_all();
    assert_eq!(t.get_cost(okx), 0.0);
    assert_eq!(t.stats().buckets, 0);
}

#[test]
fn sweep_drops_only_full_idle_buckets() {
    let (t, clock) = table();
    let l = limit(10.0, 10.0);
    assert_eq!(probe(&t, "request", l, 5.0), Outcome::Admitted);
    assert_eq!(probe(&t, "ip", l, 0.0), Outcome::Admitted);
    t.record_request(KeyRef::new(b"okx", None, b"request"), 1.0);
    assert_eq!(t.sweep(), 0, "nothing idle past its fill time yet");
    clock.advance_ms(1_001);
    assert_eq!(
        t.sweep(),
        2,
        "both defined buckets are full and idle; debt stays"
    );
    assert_eq!(t.stats().buckets, 1);
}

#[test]
fn sweep_keeps_a_refused_over_capacity_probe_accruing() {
    let (t, clock) = table();
    let l = limit(1.0, 1.0);
    assert_eq!(probe(&t, "request", l, 30.0), Outcome::Delay(29_000));
    clock.advance_ms(10_000);
    assert_eq!(t.sweep(), 0, "the answered delay keeps the bucket");
    clock.advance_ms(19_000);
    assert_eq!(probe(&t, "request", l, 30.0), Outcome::Admitted);
}

#[test]
fn sweep_keeps_an_over_capacity_accrual_for_a_caller_back_late() {
    let (t, clock) = table();
    let l = limit(1.0, 1.0);
    assert_eq!(probe(&t, "request", l, 4.0), Outcome::Delay(3_000));
    // The caller sleeps 3 s and comes back 15 ms late; a sweep ran 1 ms after its delay.
    clock.advance_ms(3_001);
    assert_eq!(
        t.sweep(),
        0,
        "a sweep right after the delay keeps the accrual"
    );
    clock.advance_ms(14);
    assert_eq!(probe(&t, "request", l, 4.0), Outcome::Admitted);
    // Once full, idle and past its last delay by KEEP_MARGIN_MS, it is dropped.
    assert_eq!(probe(&t, "request", l, 4.0), Outcome::Delay(4_000));
    clock.advance_ms(4_000 + KEEP_MARGIN_MS);
    assert_eq!(t.sweep(), 0, "not later than its margin");
    clock.advance_ms(1);
    assert_eq!(t.sweep(), 1);
}

#[test]
fn sweep_keeps_an_over_capacity_accrual_whatever_others_are_told_meanwhile() {
    let (t, clock) = table();
    let l = limit(1.0, 1.0);
    assert_eq!(probe(&t, "request", l, 1.0), Outcome::Admitted);
    assert_eq!(probe(&t, "request", l, 4.0), Outcome::Delay(4_000));
    // A cheap caller refused meanwhile is told a shorter wait; it pays nothing.
    clock.advance_ms(900);
    assert_eq!(probe(&t, "request", l, 1.0), Outcome::Delay(100));
    clock.advance_ms(3_100 + 20);
    assert_eq!(
        t.sweep(),
        0,
        "the heavy caller's wait still keeps the bucket"
    );
    assert_eq!(probe(&t, "request", l, 4.0), Outcome::Admitted);
}

#[test]
fn zero_cost_is_admitted_without_paying() {
    let (t, _) = table();
    let l = limit(1.0, 1.0);
    assert_eq!(probe(&t, "request", l, 0.0), Outcome::Admitted);
    assert_eq!(t.get_cost(key("request")), 0.0);
}

#[test]
fn sync_lowers_tokens_to_what_the_exchange_still_allows() {
    let (t, clock) = table();
    // 2 + 8/s fits 10 per 1-second window.
    let l = limit(2.0, 8.0);
    assert_eq!(probe(&t, "ip", l, 0.0), Outcome::Admitted);
    // Another program used 9 of 10 with 500 ms of the window left: 1 more, of which the
    // refill until then (4) is already too much: the bucket goes 3 into debt.
    assert_eq!(t.sync(key("ip"), 1.0, 500), 5.0);
    assert_eq!(t.inspect(key("ip")).unwrap().tokens, -3.0);
    assert_eq!(probe(&t, "ip", l, 1.0), Outcome::Delay(500));
    // A header that allows more never hands tokens back.
    clock.advance_ms(500);
    assert_eq!(t.sync(key("ip"), 10.0, 1000), 0.0);
    assert_eq!(t.inspect(key("ip")).unwrap().tokens, 1.0);
    assert_eq!(t.sync(key("unknown"), 0.0, 1000), 0.0);
}

#[test]
fn sync_leaves_room_for_the_bookings_due_within_the_window() {
    // Found by a fake exchange: waiters had booked, then a reading allowed 5 more in the
    // window; the bucket let out the bookings (which the exchange had not counted) and 5
    // new requests besides: 11 of 10, a 429. Now the bookings due by the window's end fit
    // the allowance with the new requests.
    let (t, clock) = table();
    let l = limit(2.0, 8.0);
    assert_eq!(probe(&t, "ip", l, 2.0), Outcome::Admitted);
    assert_eq!(wait(&t, OTHER, "ip", l, 3.0), Outcome::Booked(375));
    assert_eq!(t.sync(key("ip"), 5.0, 1_000), 3.0);
    assert_eq!(t.inspect(key("ip")).unwrap().tokens, -6.0);
    let mut sent = 0.0;
    for ms in 1..1_000 {
        clock.advance_ms(1);
        if ms == 375 {
            assert_eq!(wait(&t, OTHER, "ip", l, 3.0), Outcome::Claimed);
            sent += 3.0;
        }
        if probe(&t, "ip", l, 1.0) == Outcome::Admitted {
            sent += 1.0;
        }
    }
    assert_eq!(sent, 4.0);
    // A booking due after the window's end goes out in the next window: not counted.
    clock.advance_ms(1);
    assert_eq!(probe(&t, "ip", l, 1.0), Outcome::Admitted);
    assert_eq!(wait(&t, OTHER, "ip", l, 3.0), Outcome::Booked(375));
    assert_eq!(t.sync(key("ip"), 0.0, 300), 0.0);
}

#[test]
fn sync_holds_the_bookings_the_allowance_cannot_cover_until_the_window_ends() {
    // Found by a fake exchange: 100 waiters booked at a minute's start, and a reading then
    // allowed less than their bookings: they went out all the same, a 429 at the last.
    let (t, clock) = table();
    let l = limit(2.0, 8.0);
    let third = 3;
    assert_eq!(probe(&t, "ip", l, 2.0), Outcome::Admitted);
    assert_eq!(wait(&t, OTHER, "ip", l, 1.0), Outcome::Booked(125));
    assert_eq!(wait(&t, third, "ip", l, 1.0), Outcome::Booked(250));
    // 1 more in the window's last second: the first booking goes out, the second after it.
    t.sync(key("ip"), 1.0, 1_000);
    let mut new = 0;
    for ms in 1..=1_000 {
        clock.advance_ms(1);
        match ms {
            125 => assert_eq!(wait(&t, OTHER, "ip", l, 1.0), Outcome::Claimed),
            250 => assert_eq!(wait(&t, third, "ip", l, 1.0), Outcome::Delay(750)),
            1_000 => assert_eq!(wait(&t, third, "ip", l, 1.0), Outcome::Claimed),
            _ => {}
        }
        if ms < 1_000 && probe(&t, "ip", l, 1.0) == Outcome::Admitted {
            new += 1;
        }
    }
    assert_eq!(new, 0);
    // Held at the window's end, a booking is not held again by a reading of the same window.
    assert_eq!(wait(&t, OTHER, "ip", l, 1.0), Outcome::Booked(125));
    t.sync(key("ip"), 0.0, 125);
    clock.advance_ms(125);
    assert_eq!(wait(&t, OTHER, "ip", l, 1.0), Outcome::Claimed);
}

#[test]
fn sync_of_an_exchange_counted_past_its_limit_leaves_no_debt_past_its_window() {
    let (t, clock) = table();
    let l = limit(2.0, 8.0);
    assert_eq!(probe(&t, "ip", l, 0.0), Outcome::Admitted);
    // The exchange counted far more than its limit, with 500 ms of its window left: nothing
    // until the window ends, then the refill as usual.
    assert_eq!(t.sync(key("ip"), -1.0e12, 500), 6.0);
    assert_eq!(t.inspect(key("ip")).unwrap().tokens, -4.0);
    assert_eq!(probe(&t, "ip", l, 1.0), Outcome::Delay(625));
    clock.advance_ms(500);
    assert_eq!(probe(&t, "ip", l, 0.0), Outcome::Admitted);
    assert_eq!(t.inspect(key("ip")).unwrap().tokens, 0.0);
}

#[test]
fn a_booking_held_again_does_not_go_out_with_one_booked_behind_it_beyond_the_capacity() {
    // Found by attacking hold_bookings: waiter A's booking, held by a first pause, is held
    // again by a longer one after waiter B booked behind it; paid again after B's payment,
    // A was given B's ready time: 3 + 1 tokens out at one instant from a 3-token bucket.
    let (t, clock) = table();
    let l = limit(3.0, 4.0);
    let credential = || PauseTarget::Credential(b"binance".to_vec(), Some(b"api-key".to_vec()));
    assert_eq!(probe(&t, "request", l, 3.0), Outcome::Admitted);
    assert_eq!(wait(&t, ME, "request", l, 3.0), Outcome::Booked(750));
    clock.advance_ms(271);
    t.pause(credential(), 1_000);
    clock.advance_ms(57);
    let b_ready = match wait(&t, OTHER, "request", l, 1.0) {
        Outcome::Booked(ms) => 328 + ms,
        other => panic!("{other:?}"),
    };
    t.pause(credential(), 1_007);
    clock.advance_ms(422);
    let a_ready = match wait(&t, ME, "request", l, 3.0) {
        Outcome::Delay(ms) => 750 + ms,
        other => panic!("{other:?}"),
    };
    // Each comes back when told, until claimed: A's 3 and B's 1 must be at least
    // 250 ms apart (3 tokens of capacity, 4 per second).
    let mut due = vec![(a_ready, ME, 3.0), (b_ready, OTHER, 1.0)];
    let mut now = 750;
    let mut claimed = vec![];
    while !due.is_empty() {
        due.sort_by_key(|d| d.0);
        let (at, owner, cost) = due.remove(0);
        clock.advance_ms(at - now);
        now = at;
        match wait(&t, owner, "request", l, cost) {
            Outcome::Claimed => claimed.push(at),
            Outcome::Delay(ms) => due.push((at + ms, owner, cost)),
            other => panic!("{other:?}"),
        }
    }
    let apart = claimed[1] - claimed[0];
    assert!(
        apart >= 250,
        "4 tokens within {apart} ms on a 3-token bucket refilling 4/s"
    );
}

#[test]
fn a_held_claim_keeps_its_turn_on_its_other_buckets() {
    // An over-capacity waiter (cost 2, capacity 1) on its credential and the IP; cheaper
    // waiters queue behind it on each bucket alone. A pause of the credential holds it
    // there until 3.5 s. Paid again on the IP behind the bookings made after it but due
    // before 3.5 s, it went out at 5 s there, then behind the credential's at 6.5 s, ...:
    // four rounds, unsettled, told 9.5 s, with its IP booking left due at 8 s, lapsed when
    // it came back as told (booked and paid again). In its turn, it goes out at the
    // pause's end on both, and the queues behind it wait for it.
    let (t, clock) = table();
    let l = limit(1.0, 1.0);
    let ip = ip();
    let both = credential_and_ip(l, 2.0);
    let waiter = WAITER;
    assert_eq!(t.check_rates(ME, &both, waiter), Ok(Outcome::Booked(1_000)));
    for i in 0..10 {
        for k in [key("request"), ip] {
            assert_eq!(
                t.check_rate(100 + i, check(k, l, 1.0), waiter),
                Outcome::Booked(2_000 + 1_000 * i)
            );
        }
    }
    clock.advance_ms(100);
    t.pause(
        PauseTarget::Credential(b"binance".to_vec(), Some(b"api-key".to_vec())),
        3_400,
    );
    clock.advance_ms(900);
    assert_eq!(t.check_rates(ME, &both, waiter), Ok(Outcome::Delay(2_500)));
    clock.advance_ms(2_500);
    assert_eq!(t.check_rates(ME, &both, waiter), Ok(Outcome::Claimed));
    // The first queued on the IP now goes out after it.
    assert_eq!(
        t.check_rate(100, check(ip, l, 1.0), waiter),
        Outcome::Delay(1_000)
    );
}

#[test]
fn a_late_claim_held_by_a_pause_gets_back_nothing_the_cap_took_after_its_ready_time() {
    // A waiter on its credential (empty) and the IP (full) is booked for 100 ms: on the IP
    // its cost is paid as of then, the overflow until then forfeited. Its credential is
    // paused from 50 ms to 1050 ms. At 200 ms the IP has refilled to its cap and another
    // credential takes all 10. The waiter comes back at 300 ms, late but within its slack:
    // its claim is held by the pause and its IP booking paid again as of 1050 ms. Given
    // back its whole cost, the IP let it out at 1050 ms beside 8.5 more: 19.5 over
    // [200 ms, 1050 ms], above 10 + 10 × 0.85 = 18.5 (P1). The cap took its cost at
    // 200 ms: paid again, it leaves the IP 7.5 at 1050 ms.
    let (t, clock) = table();
    let l = limit(10.0, 10.0);
    let ip = ip();
    let both = credential_and_ip(l, 1.0);
    let waiter = WAITER;
    assert_eq!(probe(&t, "request", l, 10.0), Outcome::Admitted);
    assert_eq!(t.check_rates(ME, &both, waiter), Ok(Outcome::Booked(100)));
    clock.advance_ms(50);
    t.pause(
        PauseTarget::Credential(b"binance".to_vec(), Some(b"api-key".to_vec())),
        1_000,
    );
    clock.advance_ms(150);
    let other = KeyRef::new(b"binance", Some(b"other"), b"request");
    let beside = [check(other, l, 10.0), check(ip, l, 10.0)];
    assert_eq!(
        t.check_rates(OTHER, &beside, Mode::Probe),
        Ok(Outcome::Admitted)
    );
    clock.advance_ms(100);
    assert_eq!(t.check_rates(ME, &both, waiter), Ok(Outcome::Delay(750)));
    clock.advance_ms(750);
    assert_eq!(t.check_rates(ME, &both, waiter), Ok(Outcome::Claimed));
    assert_eq!(t.get_cost(ip), 2.5);
    assert_eq!(
        t.check_rate(OTHER, check(ip, l, 7.5), Mode::Probe),
        Outcome::Admitted
    );
}

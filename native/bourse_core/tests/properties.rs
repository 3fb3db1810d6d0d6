//! P1–P4 over random schedules of probes, waiters, over-capacity costs, debits and
//! multi-bucket checks, on a manual clock.

use bourse_core::{
    Check, Clock, Config, KeyInfo, KeyRef, Limit, ManualClock, Mode, Outcome, Table,
};
use proptest::prelude::*;

#[path = "support/conformance.rs"]
mod conformance;

const SLACK_MS: u64 = 250;

#[derive(Debug, Clone)]
enum Op {
    Advance(u64),
    Probe(f64),
    Wait {
        owner: u64,
        cost: f64,
        budget_ms: u64,
    },
    Multi {
        cost: f64,
        other_cost: f64,
        wait: bool,
    },
    Record(f64),
}

fn op(capacity: f64) -> impl Strategy<Value = Op> {
    let cost = prop_oneof![
        4 => 0.0..=capacity,
        1 => capacity..capacity * 3.0,
        1 => (1u32..4).prop_map(f64::from),
    ];
    prop_oneof![
        4 => (0u64..400_000_000).prop_map(Op::Advance),
        6 => cost.clone().prop_map(Op::Probe),
        3 => (0u64..3, cost.clone(), 1u64..5_000)
            .prop_map(|(owner, cost, budget_ms)| Op::Wait { owner, cost, budget_ms }),
        2 => (cost.clone(), 0.0..5.0, any::<bool>())
            .prop_map(|(cost, other_cost, wait)| Op::Multi { cost, other_cost, wait }),
        1 => (0.0..3.0).prop_map(Op::Record),
    ]
}

fn schedule() -> impl Strategy<Value = (f64, f64, Vec<Op>)> {
    (1u32..20, 1u32..40).prop_flat_map(|(capacity, refill)| {
        let (capacity, refill) = (f64::from(capacity), f64::from(refill) / 2.0);
        (
            Just(capacity),
            Just(refill),
            prop::collection::vec(op(capacity), 1..150),
        )
    })
}

struct Pending<'a> {
    owner: u64,
    checks: Vec<Check<'a>>,
    ready_at: u64,
}

const MAIN: KeyRef<'static> = KeyRef {
    exchange: b"binance",
    credential: Some(b"k"),
    axis: b"request",
};
const OTHER: KeyRef<'static> = KeyRef {
    exchange: b"binance",
    credential: Some(b"k"),
    axis: b"order",
};

fn snapshot(table: &Table<ManualClock>) -> (Option<KeyInfo>, Option<KeyInfo>) {
    (table.inspect(MAIN), table.inspect(OTHER))
}

/// The tokens a check under `limit` finds; `seen_secs` ago a check first saw the key.
fn tokens(info: &Option<KeyInfo>, limit: &Limit, seen_secs: f64) -> f64 {
    match info {
        Some(info) if info.limit.is_some() => info.tokens,
        // A new bucket, or one without a definition: full, less the debt, plus what
        // accrued since a check first saw it.
        _ => {
            let debt = info.as_ref().map_or(0.0, |info| info.debt);
            (limit.capacity() - debt + limit.refill_per_sec() * seen_secs).min(limit.capacity())
        }
    }
}

/// Runs a schedule, asserting P2–P4 as it goes; returns admissions on MAIN as
/// `(instant, cost)`, a booking counted at its ready time.
fn run(capacity: f64, refill: f64, ops: &[Op]) -> Result<Vec<(u64, f64)>, TestCaseError> {
    let clock = ManualClock::new();
    let config = Config {
        booking_slack_ms: SLACK_MS,
        ..Config::default()
    };
    let table = Table::with_clock(config, clock.clone());
    let main = Limit::new(capacity, refill).unwrap();
    let other = Limit::new(5.0, 5.0).unwrap();
    let mut admitted = Vec::new();
    let mut pending: Vec<Pending> = Vec::new();
    // When a check first saw MAIN and OTHER.
    let mut first_checked: [Option<u64>; 2] = [None, None];

    for op in ops {
        // P2: every booking is claimed exactly at its ready time, whatever ran before.
        if let Op::Advance(nanos) = op {
            let until = clock.now() + nanos;
            pending.sort_by_key(|p| p.ready_at);
            while let Some(due) = pending.first().filter(|p| p.ready_at <= until) {
                clock.advance(due.ready_at.saturating_sub(clock.now()));
                let outcome = table
                    .check_rates(due.owner, &due.checks, Mode::Probe)
                    .unwrap();
                prop_assert_eq!(
                    outcome,
                    Outcome::Claimed,
                    "booking ready at {}",
                    due.ready_at
                );
                pending.remove(0);
            }
            clock.advance(until - clock.now());
            continue;
        }
        let (owner, checks, mode) = match *op {
            Op::Probe(cost) => (
                99,
                vec![Check {
                    key: MAIN,
                    limit: main,
                    cost,
                }],
                Mode::Probe,
            ),
            Op::Wait {
                owner,
                cost,
                budget_ms,
            } => (
                owner,
                vec![Check {
                    key: MAIN,
                    limit: main,
                    cost,
                }],
                Mode::Wait {
                    max_wait_ms: budget_ms,
                    booking_slack_ms: None,
                },
            ),
            Op::Multi {
                cost,
                other_cost,
                wait,
            } => (
                7,
                vec![
                    Check {
                        key: MAIN,
                        limit: main,
                        cost,
                    },
                    Check {
                        key: OTHER,
                        limit: other,
                        cost: other_cost,
                    },
                ],
                if wait {
                    Mode::Wait {
                        max_wait_ms: 3_000,
                        booking_slack_ms: None,
                    }
                } else {
                    Mode::Probe
                },
            ),
            Op::Record(cost) => {
                table.record_request(MAIN, cost);
                continue;
            }
            Op::Advance(_) => unreachable!(),
        };
        if pending.iter().any(|p| p.owner == owner) {
            // One outstanding booking per owner keeps claims unambiguous.
            continue;
        }
        let before = snapshot(&table);
        let now = clock.now();
        for check in &checks {
            let index = usize::from(check.key == OTHER);
            first_checked[index].get_or_insert(now);
        }
        let outcome = table.check_rates(owner, &checks, mode).unwrap();
        let after = snapshot(&table);
        match outcome {
            Outcome::Admitted | Outcome::Booked(_) => {
                let ready_at = match outcome {
                    Outcome::Booked(ms) => {
                        // The booking is ready within the last millisecond of its delay.
                        let ready_at = now + ms * 1_000_000;
                        pending.push(Pending {
                            owner,
                            checks: checks.clone(),
                            ready_at,
                        });
                        ready_at
                    }
                    _ => now,
                };
                admitted.push((ready_at, checks[0].cost));
                // P4: every bucket paid.
                for (check, (was, is)) in checks
                    .iter()
                    .zip([(&before.0, &after.0), (&before.1, &after.1)])
                {
                    let index = usize::from(check.key == OTHER);
                    let seen = first_checked[index].map_or(0, |at| now - at);
                    let seen_secs = seen as f64 / 1e9;
                    let paid =
                        tokens(was, &check.limit, seen_secs) - tokens(is, &check.limit, seen_secs);
                    prop_assert!(
                        paid >= check.cost.min(check.limit.capacity()) - 1e-6,
                        "{check:?} paid {paid}"
                    );
                }
            }
            Outcome::Delay(_) | Outcome::OverBudget(_) => {
                // P3 and P4: a refusal changes nothing anywhere.
                // (A first sight, or a debt-only key's first definition, is not a change.)
                let unchanged = |was: &Option<KeyInfo>, is: &Option<KeyInfo>| {
                    let view = |info: &Option<KeyInfo>| {
                        info.as_ref()
                            .map_or((0.0, 0, 0.0), |i| (i.borrowed, i.bookings, i.booked_cost))
                    };
                    let ((b0, n0, c0), (b1, n1, c1)) = (view(was), view(is));
                    n0 == n1 && (b0 - b1).abs() < 1e-9 && (c0 - c1).abs() < 1e-9
                };
                prop_assert!(
                    unchanged(&before.0, &after.0),
                    "{:?} -> {:?}",
                    before.0,
                    after.0
                );
                prop_assert!(
                    unchanged(&before.1, &after.1),
                    "{:?} -> {:?}",
                    before.1,
                    after.1
                );
            }
            Outcome::Claimed => prop_assert!(false, "claimed without a booking"),
        }
    }
    Ok(admitted)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn p1_admitted_cost_in_any_interval_is_bounded((capacity, refill, ops) in schedule()) {
        let admitted = run(capacity, refill, &ops)?;
        let mut spans: Vec<_> = admitted.iter().map(|&(at, cost)| (at, at, cost)).collect();
        let excess = conformance::first_excess(capacity, refill, &mut spans);
        prop_assert!(excess.is_none(), "{}", excess.unwrap_or_default());
    }
}

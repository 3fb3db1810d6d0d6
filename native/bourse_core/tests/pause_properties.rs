//! P1 under pauses, on a manual clock: two credentials share an IP bucket, checked with
//! each credential's own bucket or alone; pauses of a credential, of the IP key or of the
//! exchange start at random, and every waiter comes back exactly when told until claimed.
//! Each bucket's cost is counted when it goes out: admitted, or claimed.

use bourse_core::{
    Check, Clock, Config, KeyRef, Limit, ManualClock, Mode, Outcome, PauseTarget, Table,
};
use proptest::prelude::*;

#[path = "support/conformance.rs"]
mod conformance;

const EXCHANGE: &[u8] = b"binance";
const KEYS: [KeyRef<'static>; 3] = [
    KeyRef {
        exchange: EXCHANGE,
        credential: Some(b"k"),
        axis: b"request",
    },
    KeyRef {
        exchange: EXCHANGE,
        credential: Some(b"j"),
        axis: b"request",
    },
    KeyRef {
        exchange: EXCHANGE,
        credential: None,
        axis: b"ip",
    },
];
const IP: usize = 2;

#[derive(Debug, Clone)]
enum Op {
    Advance(u64),
    /// A check of the IP bucket with credential `who`'s (0 or 1), or of the IP alone (2).
    Send {
        who: usize,
        owner: u64,
        cost: f64,
        wait: bool,
    },
    /// A pause of credential 0's, credential 1's, the IP key or the exchange.
    Pause {
        target: usize,
        ms: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u64..400_000_000).prop_map(Op::Advance),
        8 => (0usize..3, 0u64..6, 0.0..4.0, any::<bool>())
            .prop_map(|(who, owner, cost, wait)| Op::Send { who, owner, cost, wait }),
        1 => (0usize..4, 1u64..3_000).prop_map(|(target, ms)| Op::Pause { target, ms }),
    ]
}

fn schedule() -> impl Strategy<Value = ([(f64, f64); 3], Vec<Op>)> {
    let limit = (1u32..12, 1u32..30).prop_map(|(c, r)| (f64::from(c), f64::from(r) / 2.0));
    (
        [limit.clone(), limit.clone(), limit],
        prop::collection::vec(op(), 1..200),
    )
}

struct Waiter {
    owner: u64,
    who: usize,
    cost: f64,
    due: u64,
}

fn target(index: usize) -> PauseTarget {
    match index {
        0 | 1 => PauseTarget::Credential(
            EXCHANGE.to_vec(),
            KEYS[index].credential.map(<[u8]>::to_vec),
        ),
        2 => PauseTarget::Key(KEYS[IP].to_owned_key()),
        _ => PauseTarget::Exchange(EXCHANGE.to_vec()),
    }
}

/// Runs a schedule; returns per bucket what went out, as `(instant, cost)`.
fn run(limits: [(f64, f64); 3], ops: &[Op]) -> Vec<Vec<(u64, u64, f64)>> {
    let clock = ManualClock::new();
    let table = Table::with_clock(Config::default(), clock.clone());
    let limits = limits.map(|(c, r)| Limit::new(c, r).unwrap());
    let checks = |who: usize, cost: f64| -> Vec<Check<'static>> {
        let mut checks = vec![Check {
            key: KEYS[IP],
            limit: limits[IP],
            cost,
        }];
        if who < IP {
            checks.push(Check {
                key: KEYS[who],
                limit: limits[who],
                cost,
            });
        }
        checks
    };
    let waiter = Mode::Wait {
        max_wait_ms: 60_000,
        booking_slack_ms: None,
    };
    let mut out = vec![Vec::new(); 3];
    let mut waiters: Vec<Waiter> = Vec::new();
    let went_out = |out: &mut Vec<Vec<(u64, u64, f64)>>, who: usize, cost: f64, at: u64| {
        out[IP].push((at, at, cost));
        if who < IP {
            out[who].push((at, at, cost));
        }
    };
    for op in ops {
        match *op {
            Op::Advance(nanos) => {
                let until = clock.now() + nanos;
                loop {
                    waiters.sort_by_key(|w| w.due);
                    let Some(w) = waiters.first().filter(|w| w.due <= until) else {
                        break;
                    };
                    clock.advance(w.due - clock.now());
                    let now = clock.now();
                    match table
                        .check_rates(w.owner, &checks(w.who, w.cost), waiter)
                        .unwrap()
                    {
                        Outcome::Claimed | Outcome::Admitted => {
                            went_out(&mut out, w.who, w.cost, now);
                            waiters.remove(0);
                        }
                        Outcome::Delay(ms) | Outcome::Booked(ms) => {
                            waiters[0].due = now + ms * 1_000_000;
                        }
                        Outcome::OverBudget(_) => {
                            waiters.remove(0);
                        }
                    }
                }
                clock.advance(until - clock.now());
            }
            Op::Send {
                who,
                owner,
                cost,
                wait,
            } => {
                if waiters.iter().any(|w| w.owner == owner) {
                    continue;
                }
                let now = clock.now();
                let mode = if wait { waiter } else { Mode::Probe };
                match table.check_rates(owner, &checks(who, cost), mode).unwrap() {
                    Outcome::Admitted => went_out(&mut out, who, cost, now),
                    Outcome::Booked(ms) => waiters.push(Waiter {
                        owner,
                        who,
                        cost,
                        due: now + ms * 1_000_000,
                    }),
                    Outcome::Delay(_) | Outcome::OverBudget(_) => {}
                    Outcome::Claimed => panic!("claimed without a booking"),
                }
            }
            Op::Pause { target: index, ms } => table.pause(target(index), ms),
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn p1_holds_on_every_bucket_when_pauses_hold_waiters((limits, ops) in schedule()) {
        let out = run(limits, &ops);
        for (bucket, mut sent) in out.into_iter().enumerate() {
            let (capacity, refill) = limits[bucket];
            let excess = conformance::first_excess(capacity, refill, &mut sent);
            prop_assert!(excess.is_none(), "bucket {bucket}: {}", excess.unwrap_or_default());
        }
    }
}

//! Claims of multi-bucket bookings under pauses, on a manual clock: 3 credentials, an IP
//! bucket and a uid bucket; checks of 1 to 4 of them; pauses of a credential, a key or the
//! exchange; waiters back early, exactly, or (in the `late` runs) late within or beyond
//! the slack, or late within it once and then on time. A waiter back within the slack of the ready time it was last told never
//! loses its booking, is never told a ready time earlier than before nor claimed before
//! it, and is not delayed 30 times; P1 holds on every bucket, a claim counted as going
//! out at its booking's ready time, which lies between the ready time its waiter was last
//! told and the claim. In the `give_up` runs some waiters give their booking back
//! ([`Table::unbook`]) instead of claiming it, on time or past its slack: nothing of
//! theirs goes out, and P1 holds over what did.
//! SEEDS, START, RESETS=1 (resets too) and SHRINK=1 (shrinks the first failure) in the
//! environment.
use std::collections::HashSet;

use bourse_core::{
    Check, Clock, Config, KeyRef, Limit, ManualClock, Mode, Outcome, PauseTarget, Table,
};

#[path = "support/conformance.rs"]
mod conformance;

const EX: &[u8] = b"binance";
const KEYS: [KeyRef<'static>; 5] = [
    KeyRef {
        exchange: EX,
        credential: Some(b"a"),
        axis: b"request",
    },
    KeyRef {
        exchange: EX,
        credential: Some(b"b"),
        axis: b"request",
    },
    KeyRef {
        exchange: EX,
        credential: Some(b"c"),
        axis: b"request",
    },
    KeyRef {
        exchange: EX,
        credential: None,
        axis: b"ip",
    },
    KeyRef {
        exchange: EX,
        credential: Some(b"a"),
        axis: b"uid",
    },
];
const NB: usize = 5;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn f(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[derive(Clone, Debug)]
struct Waiter {
    owner: u64,
    set: Vec<usize>,
    cost: f64,
    told: u64,
    due: u64,
    delays: u32,
    behaviour: u8,
    booked_at: u64,
    /// Gives its booking back when due instead of claiming it.
    gives_up: bool,
}

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[derive(Clone, Debug)]
enum Op {
    Adv(u64),
    Send {
        owner: u64,
        set: usize,
        cost: f64,
        wait: bool,
        beh: u8,
    },
    Pause(u8, u64),
    Reset(usize),
}

fn gen(seed: u64) -> (u64, Vec<(f64, f64)>, Vec<Op>, u64) {
    let mut rng = Rng(seed.wrapping_mul(0x9e3779b97f4a7c15) | 1);
    let slack_ms = [250u64, 50, 1000, 5000][rng.below(4) as usize];
    let limits: Vec<(f64, f64)> = (0..NB)
        .map(|_| ((1 + rng.below(12)) as f64, (1 + rng.below(30)) as f64 / 2.0))
        .collect();
    let nops = 50 + rng.below(250);
    let mut ops = Vec::new();
    for _ in 0..nops {
        let k = rng.below(14);
        if k < 5 {
            ops.push(Op::Adv(if rng.below(3) == 0 {
                rng.below(5_000_000)
            } else {
                rng.below(400_000_000)
            }));
        } else if k < 12 {
            let owner = 1 + rng.below(12);
            let set = rng.below(11) as usize;
            let cost = [0.5, 1.0, 2.0, 3.0, 4.0 * rng.f(), 8.0][rng.below(6) as usize];
            ops.push(Op::Send {
                owner,
                set,
                cost,
                wait: rng.below(2) == 0,
                beh: rng.below(8) as u8,
            });
        } else if k == 12 {
            ops.push(Op::Pause(rng.below(6) as u8, 1 + rng.below(3000)));
        } else if env("RESETS", 0) == 1 && rng.below(4) == 0 {
            ops.push(Op::Reset(rng.below(NB as u64) as usize));
        }
    }
    (slack_ms, limits, ops, seed)
}

/// How waiters come back: late (within or past the slack) or on time, and whether some
/// give their booking back instead.
#[derive(Clone, Copy)]
struct Run {
    late: bool,
    give_up: bool,
}

fn run(seed: u64, how: Run) -> Result<(), String> {
    let (slack_ms, limits, ops, _) = gen(seed);
    run_ops(slack_ms, &limits, &ops, how, seed)
}

fn run_ops(
    slack_ms: u64,
    limits: &[(f64, f64)],
    ops: &[Op],
    how: Run,
    seed: u64,
) -> Result<(), String> {
    let late = how.late;
    let mut rng = Rng(seed.wrapping_mul(0x2545F4914F6CDD1D) | 1);
    let clock = ManualClock::new();
    let table = Table::with_clock(
        Config {
            assume_busy_at_start: false,
            booking_slack_ms: slack_ms,
        },
        clock.clone(),
    );
    let ls: Vec<Limit> = limits
        .iter()
        .map(|&(c, r)| Limit::new(c, r).unwrap())
        .collect();
    let mode_w = Mode::Wait {
        max_wait_ms: 60_000,
        booking_slack_ms: None,
    };
    let mut out: Vec<Vec<(u64, u64, f64)>> = vec![Vec::new(); NB];
    let mut waiters: Vec<Waiter> = Vec::new();
    let mut gave_up: HashSet<u64> = HashSet::new();
    let mut reset_at: u64 = 0;
    let mut log: Vec<String> = Vec::new();
    let checks = |set: &[usize], cost: f64| -> Vec<Check<'static>> {
        set.iter()
            .map(|&b| Check {
                key: KEYS[b],
                limit: ls[b],
                cost,
            })
            .collect()
    };
    let sets: Vec<Vec<usize>> = vec![
        vec![3],
        vec![0, 3],
        vec![1, 3],
        vec![2, 3],
        vec![0, 3, 4],
        vec![0, 4],
        vec![0, 1, 3],
        vec![0, 1, 2, 3],
        vec![1, 2, 3, 4],
        vec![0],
        vec![4],
    ];
    for op in ops {
        if let Op::Adv(nanos) = *op {
            let until = clock.now() + nanos;
            loop {
                waiters.sort_by_key(|w| (w.due, w.owner));
                let Some(w) = waiters.first().filter(|w| w.due <= until).cloned() else {
                    break;
                };
                clock.advance(w.due - clock.now());
                let now = clock.now();
                if w.gives_up {
                    let given = table.unbook(w.owner, &checks(&w.set, w.cost)).unwrap();
                    gave_up.insert(w.owner);
                    log.push(format!(
                        "{now} waiter {} set {:?} cost {} told {} gives up -> {given}",
                        w.owner, w.set, w.cost, w.told
                    ));
                    waiters.remove(0);
                    continue;
                }
                let o = table
                    .check_rates(w.owner, &checks(&w.set, w.cost), mode_w)
                    .unwrap();
                log.push(format!(
                    "{now} waiter {} set {:?} cost {} told {} beh {} -> {o:?}",
                    w.owner, w.set, w.cost, w.told, w.behaviour
                ));
                let within = now + 1_000_000 <= w.told + slack_ms * 1_000_000;
                match o {
                    Outcome::Claimed => {
                        if now + 1_000_000 < w.told {
                            return Err(format!(
                                "claimed before told ready {now} < {}\n{}",
                                w.told,
                                log[log.len().saturating_sub(40)..].join("\n")
                            ));
                        }
                        for &b in &w.set {
                            out[b].push((w.told.min(now), now, w.cost));
                        }
                        waiters.remove(0);
                    }
                    Outcome::Admitted | Outcome::Booked(_) => {
                        if within && w.booked_at > reset_at {
                            return Err(format!("waiter {} back within slack ({now} <= told {} + slack) lost its booking: {o:?}\n{}", w.owner, w.told, log[log.len().saturating_sub(env("LOG", 40) as usize)..].join("\n")));
                        }
                        if let Outcome::Admitted = o {
                            for &b in &w.set {
                                out[b].push((now, now, w.cost));
                            }
                            waiters.remove(0);
                        } else if let Outcome::Booked(ms) = o {
                            let told = now + ms * 1_000_000;
                            waiters[0].told = told;
                            waiters[0].booked_at = now;
                            waiters[0].delays = 0;
                            waiters[0].due = told;
                        }
                    }
                    Outcome::Delay(ms) => {
                        let told = now + ms * 1_000_000;
                        if told + 1_000_000 < w.told {
                            return Err(format!(
                                "ready moved earlier for {}: {} -> {told}",
                                w.owner, w.told
                            ));
                        }

                        waiters[0].delays += 1;
                        if waiters[0].delays > 30 {
                            return Err(format!(
                                "waiter {} delayed 30 times\n{}",
                                w.owner,
                                log[log.len().saturating_sub(env("LOG", 40) as usize)..].join("\n")
                            ));
                        }
                        waiters[0].told = told;
                        waiters[0].due = told;
                    }
                    Outcome::OverBudget(_) => {
                        waiters.remove(0);
                    }
                }
                // The waiter's next comeback.
                if let Some(w0) = waiters.iter_mut().find(|x| x.owner == w.owner) {
                    let told = w0.told;
                    w0.due = match w0.behaviour {
                        1 if late => told + rng.below(slack_ms * 1_000_000 + 1),
                        2 if late => told + slack_ms * 1_000_000 + 1 + rng.below(100_000_000),
                        3 => now + (told - now.min(told)) / 2 + 1,
                        _ => told,
                    }
                    .max(now + 1);
                    if w0.behaviour == 3 && rng.below(3) == 0 {
                        w0.behaviour = 0;
                    }
                }
            }
            clock.advance(until - clock.now());
        } else if let Op::Send {
            owner,
            set,
            cost,
            wait,
            beh,
        } = *op
        {
            if waiters.iter().any(|w| w.owner == owner) {
                continue;
            }
            let set = sets[set].clone();
            let now = clock.now();
            let o = table
                .check_rates(
                    owner,
                    &checks(&set, cost),
                    if wait { mode_w } else { Mode::Probe },
                )
                .unwrap();
            log.push(format!(
                "{now} send {owner} set {set:?} cost {cost} wait {wait} -> {o:?}"
            ));
            match o {
                Outcome::Admitted => {
                    for &b in &set {
                        out[b].push((now, now, cost));
                    }
                }
                Outcome::Booked(ms) => {
                    let told = now + ms * 1_000_000;
                    let gives_up = how.give_up && beh == 6;
                    let due = match beh {
                        _ if gives_up => told + rng.below(2 * slack_ms * 1_000_000 + 1),
                        1 | 4.. if late => told + rng.below(slack_ms * 1_000_000 + 1),
                        2 if late => told + slack_ms * 1_000_000 + 1 + rng.below(100_000_000),
                        3 => now + (told - now) / 2 + 1,
                        _ => told,
                    };
                    // Late once, then on time: a claim a pause held goes out when told.
                    let behaviour = if beh >= 4 { 0 } else { beh };
                    waiters.push(Waiter {
                        owner,
                        set,
                        cost,
                        told,
                        due,
                        delays: 0,
                        behaviour,
                        booked_at: now,
                        gives_up,
                    });
                }
                // A booking its owner gave up and the table kept paid (one made after it
                // holds the bucket): claimed by the owner's next check, paid once.
                Outcome::Claimed if gave_up.remove(&owner) => {
                    for &b in &set {
                        out[b].push((now, now, cost));
                    }
                }
                Outcome::Claimed => return Err("claimed without booking".into()),
                _ => {}
            }
        } else if let Op::Pause(t, ms) = *op {
            let t = match t {
                i @ 0..=2 => PauseTarget::Credential(
                    EX.to_vec(),
                    KEYS[i as usize].credential.map(<[u8]>::to_vec),
                ),
                3 => PauseTarget::Key(KEYS[3].to_owned_key()),
                4 => PauseTarget::Key(KEYS[4].to_owned_key()),
                _ => PauseTarget::Exchange(EX.to_vec()),
            };
            log.push(format!("{} pause {t:?} {ms}", clock.now()));
            table.pause(t, ms);
        } else if let Op::Reset(b) = *op {
            table.reset(KEYS[b]);
            reset_at = clock.now();
            out[b].clear();
            log.push(format!("{} reset {b}", clock.now()));
        }
    }
    for (b, sent) in out.iter_mut().enumerate() {
        let (c, r) = limits[b];
        if let Some(excess) = conformance::first_excess(c, r, sent) {
            return Err(format!(
                "P1 bucket {b} ({c},{r}): {excess}\n{}",
                log[log.len().saturating_sub(60)..].join("\n")
            ));
        }
    }
    Ok(())
}

fn fuzz(how: Run) {
    let n = env(
        "SEEDS",
        if how.late && !how.give_up {
            10_000
        } else {
            3_000
        },
    );
    let start = env("START", 0);
    let mut fails = 0;
    let mut first = None;
    for seed in start..start + n {
        if let Err(e) = run(seed, how) {
            fails += 1;
            if first.is_none() {
                first = Some((seed, e));
            }
        }
    }
    if let Some((seed, e)) = first {
        if env("SHRINK", 0) == 1 {
            let (slack, limits, mut ops, _) = gen(seed);
            let kind = |e: &str| {
                e.split(':')
                    .next()
                    .unwrap_or("")
                    .split_whitespace()
                    .take(3)
                    .collect::<Vec<_>>()
                    .join(" ")
            };
            let want = kind(&e);
            loop {
                let mut progress = false;
                let mut i = 0;
                while i < ops.len() {
                    let mut trial = ops.clone();
                    trial.remove(i);
                    match run_ops(slack, &limits, &trial, how, seed) {
                        Err(e2)
                            if kind(&e2).split_whitespace().next()
                                == want.split_whitespace().next() =>
                        {
                            ops = trial;
                            progress = true;
                        }
                        _ => i += 1,
                    }
                }
                if !progress {
                    break;
                }
            }
            eprintln!(
                "SHRUNK slack {slack} limits {limits:?}\nops {ops:#?}\n{}",
                run_ops(slack, &limits, &ops, how, seed).unwrap_err()
            );
        }
        panic!("{fails}/{n} failed; first seed {seed}: {e}");
    }
}

#[test]
fn claims_of_waiters_back_on_time() {
    fuzz(Run {
        late: false,
        give_up: false,
    });
}

#[test]
fn claims_of_waiters_back_late() {
    fuzz(Run {
        late: true,
        give_up: false,
    });
}

#[test]
fn claims_beside_waiters_that_give_their_bookings_back() {
    fuzz(Run {
        late: true,
        give_up: true,
    });
}

//! The same calls at the same instants get the same answers, whatever the table's hash seed
//! and whether sweeps ran between them: random schedules of probes, waiters on one and two
//! buckets, definition changes, pauses and clock steps on a manual clock, many calls at one
//! instant, each run on tables of their own.
use bourse_core::{Check, Config, KeyRef, Limit, ManualClock, Mode, PauseTarget, Table};

const AXES: [&str; 3] = ["a", "b", "c"];
const SEEDS: u64 = 300;

fn key(axis: &str) -> KeyRef<'_> {
    KeyRef::new(b"binance", Some(b"api-key"), axis.as_bytes())
}

/// A small xorshift generator: the schedules are the same on every run.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// The answers of the schedule of `seed`, with a sweep before each step `sweep_before`
/// accepts.
fn answers(seed: u64, sweep_before: impl Fn(u64) -> bool) -> Vec<String> {
    let clock = ManualClock::new();
    let config = Config {
        booking_slack_ms: 50,
        ..Config::default()
    };
    let t = Table::with_clock(config, clock.clone());
    let limits = [(3.0, 2.0), (5.0, 4.0), (2.0, 0.5)].map(|(c, r)| Limit::new(c, r).unwrap());
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ seed);
    let mut log = Vec::new();
    for step in 0..400 {
        if sweep_before(step) {
            t.sweep();
        }
        let (op, i) = (rng.below(10), rng.below(3) as usize);
        let cost = (1 + rng.below(4)) as f64 * 0.5;
        let owner = rng.below(4);
        // Now and then a key is checked under another key's definition.
        let redefined = rng.below(8) == 0;
        let check = |i: usize, cost| Check {
            key: key(AXES[i]),
            limit: limits[if redefined { (i + 2) % 3 } else { i }],
            cost,
        };
        let wait = Mode::Wait {
            max_wait_ms: 1 + rng.below(5000),
            booking_slack_ms: None,
        };
        let answer = match op {
            0 | 1 => {
                clock.advance_ms(rng.below(3000));
                continue;
            }
            2 | 8 | 9 => format!("{:?}", t.check_rate(owner, check(i, cost), Mode::Probe)),
            3 | 4 => format!("{:?}", t.check_rate(owner, check(i, cost), wait)),
            5 | 6 => {
                let both = [check(i, cost), check((i + 1) % 3, 0.5)];
                format!("{:?}", t.check_rates(owner, &both, wait))
            }
            _ => {
                let ms = rng.below(1500);
                format!(
                    "{:?}",
                    t.pause(PauseTarget::Exchange(b"binance".to_vec()), ms)
                )
            }
        };
        log.push(format!("step {step}: {answer}"));
    }
    log
}

fn first_difference(a: &[String], b: &[String]) -> Option<(String, String)> {
    a.iter()
        .zip(b)
        .find(|(x, y)| x != y)
        .map(|(x, y)| (x.clone(), y.clone()))
}

#[test]
fn answers_do_not_depend_on_the_hash_seed() {
    for seed in 0..SEEDS {
        let (once, again) = (answers(seed, |_| false), answers(seed, |_| false));
        assert_eq!(first_difference(&once, &again), None, "seed {seed}");
    }
}

#[test]
fn sweeps_change_no_answer() {
    for seed in 0..SEEDS {
        let (alone, swept) = (
            answers(seed, |_| false),
            answers(seed, |step| step % 3 == 0),
        );
        assert_eq!(first_difference(&alone, &swept), None, "seed {seed}");
    }
}

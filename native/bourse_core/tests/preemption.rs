//! P1 when a caller is preempted between reading the clock and paying: a bucket's time
//! never runs backwards, so the refill of the stall is never counted twice.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::{self, ThreadId};
use std::time::{Duration, Instant};

use bourse_core::{Check, Clock, Config, KeyRef, Limit, ManualClock, Mode, MonotonicClock, Table};
use proptest::prelude::*;

/// A manual clock that stops one thread right after it reads the time, until released
/// (or, if the reader holds what the releaser needs, until a timeout).
#[derive(Clone)]
struct StallingClock {
    time: ManualClock,
    stall: Arc<Mutex<Option<Stall>>>,
}

struct Stall {
    thread: ThreadId,
    read: Sender<()>,
    release: Receiver<()>,
}

impl Clock for StallingClock {
    fn now(&self) -> u64 {
        let now = self.time.now();
        let stall = {
            let mut stall = self.stall.lock().unwrap();
            match stall.take() {
                Some(s) if s.thread == thread::current().id() => Some(s),
                other => {
                    *stall = other;
                    None
                }
            }
        };
        if let Some(stall) = stall {
            stall.read.send(()).unwrap();
            let _ = stall.release.recv_timeout(Duration::from_millis(300));
        }
        now
    }
}

fn key() -> KeyRef<'static> {
    KeyRef::new(b"binance", Some(b"api-key"), b"request")
}

fn admit_all(table: &Table<StallingClock>, limit: Limit) -> u32 {
    let mut admitted = 0;
    while table
        .check_rate(
            1,
            Check {
                key: key(),
                limit,
                cost: 1.0,
            },
            Mode::Probe,
        )
        .is_admitted()
    {
        admitted += 1;
    }
    admitted
}

trait Admitted {
    fn is_admitted(&self) -> bool;
}

impl Admitted for bourse_core::Outcome {
    fn is_admitted(&self) -> bool {
        matches!(self, bourse_core::Outcome::Admitted)
    }
}

#[test]
fn a_stale_reading_never_moves_a_bucket_back_in_time() {
    // Bucket 10 + 10/s over [0, 1.1 s]: at most 10 + 10 * 1.1 = 21 admitted.
    let clock = StallingClock {
        time: ManualClock::new(),
        stall: Arc::new(Mutex::new(None)),
    };
    let table = Table::with_clock(Config::default(), clock.clone());
    let limit = Limit::new(10.0, 10.0).unwrap();
    let mut admitted = admit_all(&table, limit);
    assert_eq!(admitted, 10);

    let (read, read_signal) = channel();
    let (release_signal, release) = channel();
    let (go_signal, go) = channel::<()>();
    thread::scope(|scope| {
        let table = &table;
        let stalled = scope.spawn(move || {
            go.recv().unwrap();
            // A cost-0 check reads t = 0, then is preempted for 1.1 s.
            table.check_rate(
                2,
                Check {
                    key: key(),
                    limit,
                    cost: 0.0,
                },
                Mode::Probe,
            )
        });
        *clock.stall.lock().unwrap() = Some(Stall {
            thread: stalled.thread().id(),
            read,
            release,
        });
        go_signal.send(()).unwrap();
        read_signal.recv().unwrap();
        clock.time.advance_ms(1100);
        admitted += admit_all(table, limit);
        let _ = release_signal.send(());
        stalled.join().unwrap();
    });
    admitted += admit_all(&table, limit);
    let bound = 10.0 + 10.0 * 1.1;
    println!("admitted {admitted} in 1.1 s against a bound of {bound}");
    assert!(
        f64::from(admitted) <= bound,
        "admitted {admitted} > {bound}"
    );
}

/// The machine's clock, with a random pause after some readings: a preempted caller.
struct PreemptedClock {
    inner: MonotonicClock,
    state: AtomicU64,
    /// One reading in `every` sleeps up to `max_us` microseconds.
    every: u64,
    max_us: u64,
}

impl Clock for PreemptedClock {
    fn now(&self) -> u64 {
        let now = self.inner.now();
        // A shared xorshift step: which reading stalls, and for how long.
        let mut x = self
            .state
            .fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed);
        x ^= x >> 33;
        x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
        x ^= x >> 29;
        if x.is_multiple_of(self.every) {
            thread::sleep(Duration::from_micros((x >> 32) % self.max_us));
        }
        now
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 6, ..ProptestConfig::default() })]

    /// Threads hammering one bucket with costs 0 to 2, probes and waiters mixed, each
    /// preempted at random right after reading the clock: the cost admitted over the whole
    /// run stays within `C + r * T` (every cost is at most the capacity).
    #[test]
    fn p1_holds_under_random_preemption(
        seed in any::<u64>(),
        threads in 2usize..5,
        costs in prop::collection::vec(0u8..3, 4..12),
        waiters in any::<bool>(),
    ) {
        let (capacity, refill) = (4.0, 200.0);
        let clock = PreemptedClock {
            inner: MonotonicClock::new(),
            state: AtomicU64::new(seed),
            every: 3,
            max_us: 4_000,
        };
        let table = Table::with_clock(Config::default(), clock);
        let limit = Limit::new(capacity, refill).unwrap();
        let admitted = Mutex::new(0.0);
        let started = Instant::now();
        thread::scope(|scope| {
            for thread in 0..threads {
                let (table, costs, admitted) = (&table, &costs, &admitted);
                scope.spawn(move || {
                    for round in 0..60 {
                        let cost = f64::from(costs[(round + thread) % costs.len()]);
                        let mode = if waiters && round % 4 == 0 {
                            Mode::Wait { max_wait_ms: 1, booking_slack_ms: None }
                        } else {
                            Mode::Probe
                        };
                        let check = Check { key: key(), limit, cost };
                        match table.check_rate(thread as u64, check, mode) {
                            bourse_core::Outcome::Admitted => *admitted.lock().unwrap() += cost,
                            // A booking counts as admitted at its ready time, within 1 ms.
                            bourse_core::Outcome::Booked(_) => *admitted.lock().unwrap() += cost,
                            _ => {}
                        }
                    }
                });
            }
        });
        // Bookings are ready at most 1 ms after the run.
        let elapsed = started.elapsed().as_secs_f64() + 0.001;
        let admitted = *admitted.lock().unwrap();
        let bound = capacity + refill * elapsed;
        prop_assert!(admitted <= bound + 1e-6, "admitted {} > {} over {} s", admitted, bound, elapsed);
    }
}

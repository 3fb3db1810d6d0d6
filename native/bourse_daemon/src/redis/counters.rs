//! Counters of the answers this daemon gave; the buckets themselves are in Redis.

use std::sync::atomic::{AtomicU64, Ordering};

use bourse_core::{Mode, Outcome, Stats};

#[derive(Default)]
pub struct Counters {
    admitted: AtomicU64,
    claimed: AtomicU64,
    delayed: AtomicU64,
    booked: AtomicU64,
    over_budget: AtomicU64,
    lapsed: AtomicU64,
    paused: AtomicU64,
    debited: AtomicU64,
    invalid: AtomicU64,
}

fn bump(counter: &AtomicU64, by: u64) {
    counter.fetch_add(by, Ordering::Relaxed);
}

impl Counters {
    /// Counts a check's outcome (of a check in `mode`), whether a pause delayed it, and the
    /// bookings it found lapsed.
    pub fn outcome(&self, outcome: Outcome, mode: Mode, paused: bool, lapsed: u64) {
        bump(&self.lapsed, lapsed);
        bump(&self.paused, u64::from(paused));
        bump(
            match outcome {
                Outcome::Admitted => &self.admitted,
                Outcome::Claimed => &self.claimed,
                Outcome::Delay(_) if outcome.past_budget(mode) => &self.over_budget,
                Outcome::Delay(_) => &self.delayed,
                Outcome::Booked(_) => &self.booked,
                Outcome::OverBudget(_) => &self.over_budget,
            },
            1,
        );
    }

    pub fn debited(&self) {
        bump(&self.debited, 1);
    }

    pub fn invalid(&self) {
        bump(&self.invalid, 1);
    }

    /// The counters as statistics, with no bucket or booking counted yet.
    pub fn stats(&self) -> Stats {
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        Stats {
            admitted: load(&self.admitted),
            claimed: load(&self.claimed),
            delayed: load(&self.delayed),
            booked: load(&self.booked),
            over_budget: load(&self.over_budget),
            lapsed: load(&self.lapsed),
            paused: load(&self.paused),
            debited: load(&self.debited),
            invalid: load(&self.invalid),
            buckets: 0,
            bookings: 0,
        }
    }
}

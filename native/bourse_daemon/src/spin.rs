//! When to busy-poll a connection whose input ran out, before its thread sleeps.
//!
//! Waking a sleeping thread costs tens of microseconds on some machines (a virtual CPU
//! leaving its idle state), more than a check. A peer that sends its next request a few
//! microseconds after reading an answer (one caller, latency-bound) is served faster if
//! the daemon polls for it instead. Polling pays only then: [`Spin`] polls for about twice
//! the recent gap between an answer and the next request, never more than [`MAX_SPIN`],
//! not at all when the peer is idle or slower than that, and not for a while after a poll
//! overran its budget: the loop gives way to other threads between polls (`sched_yield`),
//! so an overrun means one of them needed the CPU. An idle connection is never polled:
//! polling only follows an answer.
//!
//! The policy decides from what it is told (the time, how each wait went); the loop obeys
//! [`Spin::budget`].

use std::time::{Duration, Instant};

/// Longest poll before sleeping.
pub const MAX_SPIN: Duration = Duration::from_micros(50);
/// Shortest poll worth starting.
const MIN_SPIN: Duration = Duration::from_micros(5);
/// A poll that ends this much later than its budget lost the CPU to another thread.
const OVERRUN: Duration = Duration::from_micros(20);
/// Longest polls in a row that may find nothing before polling is held off: a peer whose
/// gaps are mostly shorter than [`MAX_SPIN`] misses now and then.
const MAX_MISSES: u32 = 3;
/// A request that arrives within this of the previous answer, though the thread slept,
/// shows a peer in conversation: polling may catch the next one.
const CONVERSATION: Duration = Duration::from_micros(200);
/// How long polling stops after it failed or overran; doubled each time it does again, up
/// to [`MAX_HOLD`]; back to this after a poll that caught a request in time.
const BASE_HOLD: Duration = Duration::from_millis(10);
const MAX_HOLD: Duration = Duration::from_secs(1);

/// How a wait for input went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waited {
    /// Polling found input after this long.
    Caught(Duration),
    /// Polling found nothing in this long (zero: it did not poll), then the thread slept;
    /// input came after `total` in all.
    Slept { polled: Duration, total: Duration },
}

/// The polling policy of one connection.
#[derive(Debug, Clone)]
pub struct Spin {
    /// How long the next wait polls (zero: it sleeps at once).
    budget: Duration,
    /// Moving average of the gaps polling caught.
    gap: Option<Duration>,
    /// Longest polls that found nothing since the last one that did.
    misses: u32,
    /// No polling before this.
    held_until: Option<Instant>,
    /// The next hold's length.
    hold: Duration,
}

impl Default for Spin {
    fn default() -> Self {
        Self {
            budget: Duration::ZERO,
            gap: None,
            misses: 0,
            held_until: None,
            hold: BASE_HOLD,
        }
    }
}

impl Spin {
    /// How long the wait starting at `now` polls before sleeping.
    pub fn budget(&self, now: Instant) -> Duration {
        match self.held_until {
            Some(until) if now < until => Duration::ZERO,
            _ => self.budget,
        }
    }

    /// Learns from a wait that ended at `now`, which polled for [`Spin::budget`] (nothing
    /// while polling is held off: the wait did not poll).
    pub fn waited(&mut self, waited: Waited, now: Instant) {
        if self.held_until.is_some_and(|until| now < until) {
            return;
        }
        let polled = match waited {
            Waited::Caught(polled) | Waited::Slept { polled, .. } => polled,
        };
        if polled > self.budget + OVERRUN {
            // Another thread had the CPU meanwhile: polling would take it from that thread.
            return self.hold_off(now);
        }
        match waited {
            Waited::Caught(gap) => {
                // Weight 1/4 to the newest gap.
                let average = self.gap.map_or(gap, |old| (old * 3 + gap) / 4);
                self.gap = Some(average);
                self.budget = (average * 2).clamp(MIN_SPIN, MAX_SPIN);
                self.misses = 0;
                self.hold = BASE_HOLD;
            }
            // The longest poll was too short, [`MAX_MISSES`] times in a row: the peer is
            // slower than polling can wait.
            Waited::Slept { .. } if self.budget >= MAX_SPIN => {
                self.misses += 1;
                if self.misses >= MAX_MISSES {
                    self.hold_off(now);
                }
            }
            Waited::Slept { total, .. } if total <= CONVERSATION => {
                self.budget = (self.budget * 2).clamp(MIN_SPIN, MAX_SPIN);
            }
            // The peer paused: poll again once it converses again.
            Waited::Slept { .. } => {
                self.budget = Duration::ZERO;
                self.gap = None;
            }
        }
    }

    /// Calls `ready` until it finds something or [`Spin::budget`] runs out, giving way to
    /// any thread waiting for this CPU between calls (`sched_yield`), and learns from a
    /// catch: what `ready` found, or how long it polled in vain (then the caller sleeps,
    /// and tells [`Spin::waited`] how the whole wait went).
    pub fn poll<R>(&mut self, mut ready: impl FnMut() -> Option<R>) -> Result<R, Duration> {
        let start = Instant::now();
        let budget = self.budget(start);
        let mut polled = Duration::ZERO;
        while polled < budget {
            if let Some(found) = ready() {
                let now = Instant::now();
                self.waited(Waited::Caught(now - start), now);
                return Ok(found);
            }
            std::thread::yield_now();
            polled = start.elapsed();
        }
        Err(polled)
    }

    fn hold_off(&mut self, now: Instant) {
        self.budget = Duration::ZERO;
        self.gap = None;
        self.misses = 0;
        self.held_until = Some(now + self.hold);
        self.hold = (self.hold * 2).min(MAX_HOLD);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    /// A wait that polled for `polled` µs and slept, its request coming after `total` µs.
    fn slept(polled: u64, total: u64) -> Waited {
        Waited::Slept {
            polled: us(polled),
            total: us(total),
        }
    }

    /// A policy armed at `budget` by prompt requests that polling missed.
    fn armed(now: Instant, budget: Duration) -> Spin {
        let mut spin = Spin::default();
        while spin.budget(now) < budget {
            spin.waited(slept(spin.budget(now).as_micros() as u64, 60), now);
        }
        spin
    }

    #[test]
    fn a_new_connection_sleeps_at_once() {
        assert_eq!(Spin::default().budget(Instant::now()), Duration::ZERO);
    }

    #[test]
    fn prompt_requests_arm_polling_doubling_from_the_minimum() {
        let now = Instant::now();
        let mut spin = Spin::default();
        spin.waited(slept(0, 60), now);
        assert_eq!(spin.budget(now), MIN_SPIN);
        spin.waited(slept(5, 60), now);
        assert_eq!(spin.budget(now), MIN_SPIN * 2);
        for polled in [10, 20] {
            spin.waited(slept(polled, 60), now);
        }
        assert_eq!(spin.budget(now), us(40));
        spin.waited(slept(40, 60), now);
        assert_eq!(spin.budget(now), MAX_SPIN);
    }

    #[test]
    fn a_caught_request_sets_the_budget_to_twice_the_average_gap() {
        let now = Instant::now();
        let mut spin = armed(now, MAX_SPIN);
        spin.waited(Waited::Caught(us(12)), now);
        assert_eq!(spin.budget(now), us(24));
        // (12 * 3 + 20) / 4 = 14.
        spin.waited(Waited::Caught(us(20)), now);
        assert_eq!(spin.budget(now), us(28));
        for _ in 0..20 {
            spin.waited(Waited::Caught(us(1)), now);
        }
        assert_eq!(spin.budget(now), MIN_SPIN, "never below the minimum");
        let mut spin = armed(now, MAX_SPIN);
        spin.waited(Waited::Caught(us(45)), now);
        assert_eq!(spin.budget(now), MAX_SPIN, "never above the maximum");
    }

    #[test]
    fn a_paused_peer_stops_polling_until_it_converses_again() {
        let now = Instant::now();
        let mut spin = armed(now, us(20));
        spin.waited(Waited::Caught(us(10)), now);
        spin.waited(slept(20, 5_000), now);
        assert_eq!(spin.budget(now), Duration::ZERO);
        spin.waited(slept(0, 70), now);
        assert_eq!(spin.budget(now), MIN_SPIN);
    }

    #[test]
    fn a_peer_slower_than_the_longest_poll_stops_polling_for_a_doubling_hold() {
        let now = Instant::now();
        let mut spin = armed(now, MAX_SPIN);
        for _ in 1..MAX_MISSES {
            spin.waited(slept(50, 90), now);
            assert_eq!(spin.budget(now), MAX_SPIN);
        }
        spin.waited(slept(50, 90), now);
        assert_eq!(spin.budget(now), Duration::ZERO);
        // Waits during the hold teach nothing: they did not poll.
        for _ in 0..10 {
            spin.waited(slept(0, 90), now + BASE_HOLD - us(1));
        }
        assert_eq!(spin.budget(now + BASE_HOLD), Duration::ZERO);
        // After it, a prompt request arms polling again.
        let now = now + BASE_HOLD;
        spin.waited(slept(0, 90), now);
        assert_eq!(spin.budget(now), MIN_SPIN);
        // Ramped up to the maximum and failing again: held twice as long.
        for polled in [5, 10, 20, 40] {
            spin.waited(slept(polled, 90), now);
        }
        assert_eq!(spin.budget(now), MAX_SPIN);
        for _ in 0..MAX_MISSES {
            spin.waited(slept(50, 90), now);
        }
        assert_eq!(spin.budget(now + BASE_HOLD * 2 - us(1)), Duration::ZERO);
        let now = now + BASE_HOLD * 2;
        spin.waited(slept(0, 90), now);
        assert_eq!(spin.budget(now), MIN_SPIN);
    }

    #[test]
    fn a_peer_mostly_quicker_than_the_longest_poll_keeps_it_polling() {
        let now = Instant::now();
        let mut spin = armed(now, MAX_SPIN);
        for _ in 0..100 {
            for _ in 1..MAX_MISSES {
                spin.waited(slept(50, 150), now);
            }
            spin.waited(Waited::Caught(us(30)), now);
            assert_eq!(spin.budget(now), MAX_SPIN);
        }
    }

    #[test]
    fn a_poll_that_overran_its_budget_holds_polling_off_doubling_up_to_a_second() {
        let mut now = Instant::now();
        let mut spin = armed(now, us(20));
        let mut hold = BASE_HOLD;
        for round in 0..10 {
            let budget = spin.budget(now);
            // Caught or not, a poll that ended well past its budget lost the CPU.
            let overran = budget + OVERRUN + us(1);
            let waited = match round % 2 {
                0 => Waited::Caught(overran),
                _ => Waited::Slept {
                    polled: overran,
                    total: overran,
                },
            };
            spin.waited(waited, now);
            assert_eq!(spin.budget(now + hold - us(1)), Duration::ZERO);
            now += hold;
            spin.waited(slept(0, 60), now);
            assert_eq!(spin.budget(now), MIN_SPIN);
            hold = (hold * 2).min(MAX_HOLD);
        }
        assert_eq!(hold, MAX_HOLD);
        // Within the budget and its slack, a poll did not overrun.
        spin.waited(Waited::Caught(MIN_SPIN + OVERRUN), now);
        assert_eq!(spin.budget(now), MAX_SPIN);
        // A request caught in time brings the hold back to its base.
        for _ in 0..MAX_MISSES {
            spin.waited(slept(50, 90), now);
        }
        spin.waited(slept(0, 60), now + BASE_HOLD);
        assert_eq!(spin.budget(now + BASE_HOLD), MIN_SPIN);
    }
}

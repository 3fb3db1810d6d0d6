//! Deadlines on the Redis server's clock. A call gives up after its timeout, and its
//! caller may give up sooner; the script it sent must then never run, even if Redis
//! receives or resumes it later. So each script is told the latest Redis time at which it
//! may still run, computed from what this daemon has seen of that clock.

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use bourse_core::rules;

/// How long one window of offset samples lasts: the estimate follows a Redis clock that
/// was set back within two windows.
const WINDOW_US: i64 = 10_000_000;
/// No sample yet.
const UNKNOWN: i64 = i64::MIN;

/// What is known of the Redis clock (µs, from `TIME`) against this process's monotonic one.
pub struct ServerClock {
    epoch: Instant,
    /// How long a caller waits: its script may run until `rules::last_run_us` of that.
    timeout: Duration,
    /// The largest lower bound of (Redis time − local time), in µs, seen in the current
    /// window and in the previous one.
    current: AtomicI64,
    previous: AtomicI64,
    /// When the current window began (local µs).
    window: AtomicI64,
}

impl ServerClock {
    pub fn new(timeout: Duration) -> Self {
        Self {
            epoch: Instant::now(),
            timeout,
            current: AtomicI64::new(UNKNOWN),
            previous: AtomicI64::new(UNKNOWN),
            window: AtomicI64::new(0),
        }
    }

    fn local_us(&self, at: Instant) -> i64 {
        at.saturating_duration_since(self.epoch).as_micros() as i64
    }

    /// Records that Redis read `redis_us` on its clock some time before `received`: the
    /// offset is at least `redis_us − received`, so deadlines computed from the largest such
    /// bound fall no later than the moment they stand for. Bounds older than two windows
    /// are forgotten, so a Redis clock that was set back is followed.
    pub fn observe(&self, redis_us: u64, received: Instant) {
        if redis_us == 0 {
            return;
        }
        let local = self.local_us(received);
        let bound = (redis_us as i64).saturating_sub(local);
        let window = self.window.load(Ordering::Relaxed);
        if local - window > WINDOW_US
            && self
                .window
                .compare_exchange(window, local, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            let ended = self.current.swap(bound, Ordering::Relaxed);
            self.previous.store(ended, Ordering::Relaxed);
        } else {
            self.current.fetch_max(bound, Ordering::Relaxed);
        }
    }

    /// The latest Redis time (µs) at which the script of a call sent at `started` may run,
    /// or `None` while nothing is known of the Redis clock: by the timeout, and no later
    /// than the request's own `last_run` (a local instant, converted the same way).
    pub fn deadline(&self, started: Instant, last_run: Option<Instant>) -> Option<u64> {
        let on_redis = self.on_redis()?;
        let timeout_ms = self.timeout.as_millis() as u64;
        let ours = rules::last_run_us(on_redis(started + self.timeout), timeout_ms);
        let theirs = last_run.map_or(u64::MAX, on_redis);
        Some(ours.min(theirs).max(1))
    }

    /// A Redis time (µs) no later than the moment `at`, or `None` while nothing is known of
    /// the Redis clock.
    pub fn at(&self, at: Instant) -> Option<u64> {
        Some(self.on_redis()?(at).max(1))
    }

    /// Converts local instants to Redis times no later than them.
    fn on_redis(&self) -> Option<impl Fn(Instant) -> u64 + '_> {
        let offset = self
            .current
            .load(Ordering::Relaxed)
            .max(self.previous.load(Ordering::Relaxed));
        if offset == UNKNOWN {
            return None;
        }
        Some(move |at: Instant| self.local_us(at).saturating_add(offset).max(0) as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadlines_fall_before_the_timeout_on_the_redis_clock() {
        let clock = ServerClock::new(Duration::from_millis(1000));
        let start = clock.epoch + Duration::from_secs(5);
        assert_eq!(clock.deadline(start, None), None);
        // Redis read 1_000_000_000 µs when this process was at 5 s (answer received then).
        clock.observe(1_000_000_000, start);
        // Sent at 5 s, it gives up at 6 s: the script may run until 5.75 s, in Redis time.
        assert_eq!(clock.deadline(start, None), Some(1_000_750_000));
        // A request that may run until 5.2 s: its script until 5.2 s, in Redis time; one
        // that may run later is held to the timeout's deadline.
        let soon = start + Duration::from_millis(200);
        assert_eq!(clock.deadline(start, Some(soon)), Some(1_000_200_000));
        let late = start + Duration::from_secs(2);
        assert_eq!(clock.deadline(start, Some(late)), Some(1_000_750_000));
        // A slower answer proves less: the tightest bound stays.
        clock.observe(1_000_100_000, start + Duration::from_millis(300));
        assert_eq!(clock.deadline(start, None), Some(1_000_750_000));
        // Redis's clock set back by 1 s: followed once two windows have passed.
        let later = start + Duration::from_secs(11);
        clock.observe(1_010_000_000, later);
        let much_later = later + Duration::from_secs(11);
        clock.observe(1_021_000_000, much_later);
        assert_eq!(clock.deadline(much_later, None), Some(1_021_750_000));
    }
}

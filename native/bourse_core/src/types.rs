//! The table's public types: checks and their answers, pause targets, options, counters
//! and key snapshots.

use crate::key::{Key, KeyRef};
use crate::limit::Limit;
use crate::rules::DEFAULT_BOOKING_SLACK_MS;

/// Options fixed when a table is created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// Buckets first seen within their fill time after start begin as if empty at start.
    pub assume_busy_at_start: bool,
    /// How long past its ready time a booking may still be claimed.
    pub booking_slack_ms: u64,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            assume_busy_at_start: false,
            booking_slack_ms: DEFAULT_BOOKING_SLACK_MS,
        }
    }
}

/// Who checks: the owner of its bookings and, for a client that assumes buckets busy at
/// its own start, that start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caller {
    /// Identifies the caller's bookings.
    pub owner: u64,
    /// Nanoseconds since the caller's busy start, as of the check: buckets first seen
    /// within their fill time after it begin as if empty then, as
    /// [`Config::assume_busy_at_start`] makes them from the table's start (the later start
    /// applies).
    pub busy_for: Option<u64>,
}

impl From<u64> for Caller {
    /// A caller that assumes nothing at its start.
    fn from(owner: u64) -> Self {
        Self {
            owner,
            busy_for: None,
        }
    }
}

/// One bucket of a check: `cost` tokens from `key`'s bucket defined by `limit`.
#[derive(Debug, Clone, Copy)]
pub struct Check<'a> {
    /// The bucket's key.
    pub key: KeyRef<'a>,
    /// The bucket's definition.
    pub limit: Limit,
    /// Tokens to pay, `>= 0`.
    pub cost: f64,
}

/// How the caller treats a delay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Asks only: a delay pays and reserves nothing.
    Probe,
    /// Will sleep the delay and come back: a delay within `max_wait_ms` is booked.
    Wait {
        /// The longest delay the caller accepts, in milliseconds.
        max_wait_ms: u64,
        /// How long past its ready time the caller's booking may be claimed, in
        /// milliseconds; `None`: the table's `booking_slack_ms`.
        booking_slack_ms: Option<u64>,
    },
}

/// The answer to a check. Delays are whole milliseconds, rounded up, at least 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Paid now on every bucket.
    Admitted,
    /// Admitted against the caller's own booking, without a second charge.
    Claimed,
    /// Not admitted; nothing paid (a probe's refusal, or a booking not ready yet).
    Delay(u64),
    /// Paid and booked: the caller's booking is ready in this many milliseconds.
    Booked(u64),
    /// The wait exceeds the caller's budget; nothing paid.
    OverBudget(u64),
}

impl Outcome {
    /// Whether the check paid: admitted now or booked.
    pub fn paid(self) -> bool {
        matches!(self, Outcome::Admitted | Outcome::Booked(_))
    }

    /// Whether a waiter is told a delay past its budget: it is early for a booking of its
    /// own, which stays, and is refused by its caller. Counted as over budget, as a waiter
    /// refused for its wait is.
    pub fn past_budget(self, mode: Mode) -> bool {
        matches!((self, mode), (Outcome::Delay(ms), Mode::Wait { max_wait_ms, .. }) if ms > max_wait_ms)
    }
}

/// What a pause applies to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PauseTarget {
    /// Every key of an exchange.
    Exchange(Vec<u8>),
    /// An exchange's credential; `None` is the public pool.
    Credential(Vec<u8>, Option<Vec<u8>>),
    /// One key.
    Key(Key),
}

impl PauseTarget {
    /// The exchange the pause applies to.
    pub fn exchange(&self) -> &[u8] {
        match self {
            Self::Exchange(exchange) | Self::Credential(exchange, _) => exchange,
            Self::Key(key) => key.exchange(),
        }
    }
}

/// What a backoff pauses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackoffScope {
    /// Every bucket of the credential that was limited.
    Credential,
    /// Every bucket of its exchange (the exchange limits by IP).
    Exchange,
}

/// Counters since the table was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Checks paid now.
    pub admitted: u64,
    /// Checks admitted against the caller's booking.
    pub claimed: u64,
    /// Delays answered without paying.
    pub delayed: u64,
    /// Waiters booked.
    pub booked: u64,
    /// Waiters refused because the delay exceeded their budget.
    pub over_budget: u64,
    /// Bookings not claimed within the slack.
    pub lapsed: u64,
    /// Answers (delays, bookings, refusals) held back by a pause.
    pub paused: u64,
    /// Costs debited without checking.
    pub debited: u64,
    /// Malformed requests refused.
    pub invalid: u64,
    /// Buckets held now.
    pub buckets: u64,
    /// Bookings held now.
    pub bookings: u64,
}

/// A snapshot of one key.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyInfo {
    /// The key's definition; `None` while it has only `record_request` debt, or only a
    /// pause.
    pub limit: Option<Limit>,
    /// Tokens now, capped at the capacity; negative while in debt.
    pub tokens: f64,
    /// `capacity - tokens`, at least 0 (the pending debt for a key without definition).
    pub borrowed: f64,
    /// How far below zero the bucket is, or the pending debt of an undefined key.
    pub debt: f64,
    /// Bookings held on the key.
    pub bookings: usize,
    /// Their total cost.
    pub booked_cost: f64,
    /// Milliseconds until the earliest booking is ready, if any.
    pub next_ready_ms: Option<u64>,
    /// Milliseconds left of a pause covering the key, if any.
    pub pause_ms: Option<u64>,
}

impl KeyInfo {
    /// A key without a bucket, covered by a pause with `pause_ms` left.
    pub fn paused(pause_ms: u64) -> Self {
        Self {
            limit: None,
            tokens: 0.0,
            borrowed: 0.0,
            debt: 0.0,
            bookings: 0,
            booked_cost: 0.0,
            next_ready_ms: None,
            pause_ms: Some(pause_ms),
        }
    }
}

//! A weighted token-bucket table for exchange API rate limits.
//!
//! Each key (`{exchange, credential, axis}`) holds a bucket of `capacity` tokens refilling
//! at `refill_per_sec`. A check pays its cost when the bucket holds it, or answers the
//! delay until it will. Costs above the capacity are limited, not exempt: they wait until
//! that much has accrued since the bucket last paid. Waiters book their cost at once and
//! are served first come, first served; checks over several buckets pay on all or none.
//!
//! Adapters that check the same bucket again and again prepare it once
//! ([`Table::prepare`]: the key packed and hashed, the limit validated) and check the
//! [`PreparedBucket`] ([`Table::check_prepared`], [`Table::check_prepared_all`]); the
//! answers are those of [`Table::check_rate`] and [`Table::check_rates`] for its key and limit,
//! from the same code.
//!
//! Time comes from a [`Clock`], so the semantics are testable to the nanosecond with a
//! [`ManualClock`].

mod backoffs;
mod bucket;
mod buckets;
mod busiest;
mod clock;
mod engine;
mod key;
mod limit;
mod pauses;
mod prepared;
mod receipt;
pub mod rules;
mod table;
mod types;
mod walk;

pub use busiest::Busiest;
pub use clock::{Clock, ManualClock, MonotonicClock};
pub use engine::{coalesce, signature};
pub use key::{Key, KeyRef};
pub use limit::Limit;
pub use prepared::{PreparedBucket, PreparedCheck};
pub use receipt::Receipt;
pub use rules::{InvalidInput, Shape};
pub use table::Table;
pub use types::{BackoffScope, Caller, Check, Config, KeyInfo, Mode, Outcome, PauseTarget, Stats};

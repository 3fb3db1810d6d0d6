//! What the script answers, read back into the core's types. A malformed answer is
//! [`StoreError::Unavailable`]: nothing is admitted on an answer that cannot be read.

use bourse_core::{KeyInfo, Limit, Outcome};

use crate::store::{StoreError, StoreResult};

/// A snapshot and the shown fingerprint of its credential, or `None` for a key Redis does
/// not hold.
pub type Info = Option<(KeyInfo, Option<String>)>;

/// The outcome a `check` answered: its result word and delay.
pub fn outcome(result: &str, ms: u64) -> StoreResult<Outcome> {
    match result {
        "admitted" => Ok(Outcome::Admitted),
        "claimed" => Ok(Outcome::Claimed),
        "delay" => Ok(Outcome::Delay(ms)),
        "booked" => Ok(Outcome::Booked(ms)),
        "over_budget" => Ok(Outcome::OverBudget(ms)),
        other => Err(StoreError::Unavailable(format!(
            "the Redis script answered {other:?}"
        ))),
    }
}

pub fn number(text: &str) -> StoreResult<f64> {
    text.parse().map_err(|_| {
        StoreError::Unavailable(format!(
            "the Redis script answered a non-number of {} bytes",
            text.len()
        ))
    })
}

/// A snapshot from the script's `info` row (see bucket.lua), and the shown fingerprint of
/// its credential when the bucket holds one.
pub fn info_from(fields: &[String]) -> StoreResult<(KeyInfo, Option<String>)> {
    let malformed = || StoreError::Unavailable("malformed bucket in Redis".into());
    let [c, r, tokens, borrowed, debt, bookings, booked, next_ready, pause, shown] = fields else {
        return Err(malformed());
    };
    let optional = |text: &String| -> StoreResult<Option<f64>> {
        if text.is_empty() {
            Ok(None)
        } else {
            number(text).map(Some)
        }
    };
    let limit = match (optional(c)?, optional(r)?) {
        (Some(c), Some(r)) => Some(Limit::new(c, r).map_err(|_| malformed())?),
        _ => None,
    };
    let micros_to_ms = |micros: f64| (micros / 1000.0).ceil() as u64;
    let info = KeyInfo {
        limit,
        tokens: number(tokens)?,
        borrowed: number(borrowed)?,
        debt: number(debt)?,
        bookings: bookings.parse().map_err(|_| malformed())?,
        booked_cost: number(booked)?,
        next_ready_ms: optional(next_ready)?.map(micros_to_ms),
        pause_ms: optional(pause)?.map(|micros| micros_to_ms(micros).max(1)),
    };
    Ok((info, (!shown.is_empty()).then(|| shown.clone())))
}

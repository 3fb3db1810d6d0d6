//! What the script answers, read back into the core's types. A malformed answer is
//! [`StoreError::Unavailable`]: nothing is admitted on an answer that cannot be read.

use bourse_core::{KeyInfo, Limit, Outcome};

use crate::store::{StoreError, StoreResult};

/// What the script answers for one check of a `checks` call: the result, the delay
/// (ms), whether a pause held it (0/1) and the bookings found lapsed.
pub type CheckAnswer = (String, u64, u64, u64);

/// The answers of a `checks` call, one line each (see `encode` in bucket.lua): the result
/// alone when its numbers are all 0, else "<ms> <paused> <lapsed> <result>".
pub fn checks_from(text: &str) -> StoreResult<Vec<CheckAnswer>> {
    let malformed = || StoreError::Unavailable("the Redis script's answers are malformed".into());
    text.split('\n')
        .map(|line| {
            if !line.starts_with(|c: char| c.is_ascii_digit()) {
                return Ok((line.to_string(), 0, 0, 0));
            }
            let mut fields = line.splitn(4, ' ');
            let mut number = || -> StoreResult<u64> {
                fields
                    .next()
                    .and_then(|n| n.parse().ok())
                    .ok_or_else(malformed)
            };
            let (ms, paused, lapsed) = (number()?, number()?, number()?);
            let result = fields.next().ok_or_else(malformed)?;
            Ok((result.to_string(), ms, paused, lapsed))
        })
        .collect()
}

/// A snapshot and the shown fingerprint of its credential, or `None` for a key Redis does
/// not hold.
pub type Info = Option<(KeyInfo, Option<String>)>;

/// A check's result word: an `admitted` result goes on with the definition time of each
/// bucket it paid (for a refund, see bucket.lua's `refunds`).
pub fn word(result: &str) -> &str {
    result.split_once(' ').map_or(result, |(word, _)| word)
}

/// The outcome a `check` answered: its result word and delay.
pub fn outcome(result: &str, ms: u64) -> StoreResult<Outcome> {
    match word(result) {
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

/// What a `record` call answered: the Redis time (µs) it ran, and its bucket's `n` (its
/// definition time, or on a key holding only debt when that debt was first recorded; `-`
/// for none), which a refund of the debit names.
pub struct Recorded<'a> {
    pub at: u64,
    pub definition: &'a str,
}

/// The answer of a `record` call: "recorded <at> <definition>".
pub fn recorded(text: &str) -> StoreResult<Recorded<'_>> {
    let mut fields = text.split(' ');
    let at = fields.nth(1).and_then(|at| at.parse().ok());
    match (
        text.starts_with("recorded "),
        at,
        fields.next(),
        fields.next(),
    ) {
        (true, Some(at), Some(definition), None) => Ok(Recorded { at, definition }),
        _ => Err(StoreError::Unavailable(format!(
            "the Redis script answered {} bytes where a debit was due",
            text.len()
        ))),
    }
}

/// The answer of a call that answers only `OK`.
pub fn done(result: &str) -> StoreResult<()> {
    if result == "OK" {
        Ok(())
    } else {
        Err(StoreError::Unavailable(format!(
            "the Redis script answered {} bytes where OK was due",
            result.len()
        )))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_answers_are_read_line_by_line() {
        let text = "admitted 17 -\n12 1 0 delay\nlate\n0 0 2 claimed\nerror WRONGTYPE 1 2 3";
        let answers = checks_from(text).unwrap();
        let expected = [
            ("admitted 17 -", 0, 0, 0),
            ("delay", 12, 1, 0),
            ("late", 0, 0, 0),
            ("claimed", 0, 0, 2),
            ("error WRONGTYPE 1 2 3", 0, 0, 0),
        ];
        let expected: Vec<CheckAnswer> = expected
            .iter()
            .map(|&(result, ms, paused, lapsed)| (result.to_string(), ms, paused, lapsed))
            .collect();
        assert_eq!(answers, expected);
        for malformed in ["12 1 delay", "12 x 0 delay", "1 2 3"] {
            assert!(checks_from(malformed).is_err(), "{malformed}");
        }
        assert_eq!(outcome("admitted 17 -", 0).unwrap(), Outcome::Admitted);
    }
}

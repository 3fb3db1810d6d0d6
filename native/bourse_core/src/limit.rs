//! Bucket definitions and costs, validated once at the edge.

use std::fmt;

/// The largest capacity, refill rate or cost accepted: far beyond any exchange limit,
/// small enough that every product and sum stays exact to well under a token.
pub const MAX_AMOUNT: f64 = 1e12;

/// A bucket definition: `capacity` tokens refilling at `refill_per_sec`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limit {
    capacity: f64,
    refill_per_sec: f64,
}

impl Limit {
    /// Both values must be finite, positive and at most [`MAX_AMOUNT`].
    pub fn new(capacity: f64, refill_per_sec: f64) -> Result<Self, InvalidInput> {
        check_positive("capacity", capacity)?;
        check_positive("refill_per_sec", refill_per_sec)?;
        Ok(Self {
            capacity,
            refill_per_sec,
        })
    }

    /// `requests` per `period_ms` milliseconds: capacity `requests`, refill
    /// `requests / (period_ms / 1000)` per second.
    pub fn per_period(requests: f64, period_ms: f64) -> Result<Self, InvalidInput> {
        check_positive("requests", requests)?;
        check_positive("period", period_ms)?;
        Self::new(requests, requests / (period_ms / 1000.0))
    }

    pub fn capacity(&self) -> f64 {
        self.capacity
    }

    pub fn refill_per_sec(&self) -> f64 {
        self.refill_per_sec
    }

    /// Seconds for an empty bucket to fill.
    pub fn fill_secs(&self) -> f64 {
        self.capacity / self.refill_per_sec
    }
}

/// A cost must be finite, `>= 0` and at most [`MAX_AMOUNT`].
pub fn check_cost(cost: f64) -> Result<f64, InvalidInput> {
    if cost.is_finite() && (0.0..=MAX_AMOUNT).contains(&cost) {
        Ok(cost)
    } else {
        Err(InvalidInput::new(format!(
            "cost must be a finite number between 0 and {MAX_AMOUNT:e}, got {cost}"
        )))
    }
}

fn check_positive(name: &str, value: f64) -> Result<(), InvalidInput> {
    if value.is_finite() && value > 0.0 && value <= MAX_AMOUNT {
        Ok(())
    } else {
        Err(InvalidInput::new(format!(
            "{name} must be a finite number above 0 and at most {MAX_AMOUNT:e}, got {value}"
        )))
    }
}

/// Malformed input, with a message naming what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidInput(pub String);

impl InvalidInput {
    pub fn new(message: impl Into<String>) -> Self {
        Self(message.into())
    }
}

impl fmt::Display for InvalidInput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for InvalidInput {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_bad_numbers() {
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e13] {
            assert!(Limit::new(bad, 1.0).is_err());
            assert!(Limit::new(1.0, bad).is_err());
        }
        assert!(check_cost(-0.5).is_err());
        assert!(check_cost(f64::NAN).is_err());
        assert_eq!(check_cost(0.0), Ok(0.0));
    }

    #[test]
    fn requests_per_period_normalises() {
        assert_eq!(
            Limit::per_period(10.0, 1000.0).unwrap(),
            Limit::new(10.0, 10.0).unwrap()
        );
        let binance = Limit::per_period(1200.0, 60_000.0).unwrap();
        assert_eq!(binance.refill_per_sec(), 20.0);
    }
}

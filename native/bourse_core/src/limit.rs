//! Bucket definitions, validated by [`crate::rules`] when they are made.

use crate::rules::{self, InvalidInput, Shape};

/// A bucket definition: `capacity` tokens refilling at `refill_per_sec`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limit {
    capacity: f64,
    refill_per_sec: f64,
}

impl Limit {
    /// Both values must be finite, positive and at most [`rules::MAX_AMOUNT`].
    pub fn new(capacity: f64, refill_per_sec: f64) -> Result<Self, InvalidInput> {
        rules::limit(Shape::Float(capacity), Shape::Float(refill_per_sec))
    }

    /// `requests` per `period_ms` milliseconds: capacity `requests`, refill
    /// `requests / (period_ms / 1000)` per second.
    pub fn per_period(requests: f64, period_ms: f64) -> Result<Self, InvalidInput> {
        rules::limit_per_period(Shape::Float(requests), Some(Shape::Float(period_ms)))
    }

    /// A definition whose values [`crate::rules`] has checked.
    pub(crate) fn checked(capacity: f64, refill_per_sec: f64) -> Self {
        Self {
            capacity,
            refill_per_sec,
        }
    }

    /// Tokens the bucket holds when full.
    pub fn capacity(&self) -> f64 {
        self.capacity
    }

    /// Tokens accrued per second.
    pub fn refill_per_sec(&self) -> f64 {
        self.refill_per_sec
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_bad_numbers() {
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e13] {
            assert!(Limit::new(bad, 1.0).is_err());
            assert!(Limit::new(1.0, bad).is_err());
        }
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

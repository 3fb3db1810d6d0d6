//! Prepared buckets: a key and its definition, packed and hashed once, for adapters that
//! check the same bucket many times.

use crate::key::{Key, KeyRef};
use crate::limit::Limit;

/// A bucket made ready for repeated checks by [`crate::Table::prepare`]: its key packed and
/// hashed with the table's hasher, and its definition (validated when the [`Limit`] was
/// made). Checking it with [`crate::Table::check_prepared`] skips the hashing; a prepared
/// bucket of another table is still answered correctly, hashed again on every check.
#[derive(Debug, Clone)]
pub struct PreparedBucket {
    pub(crate) key: Key,
    pub(crate) hash: u64,
    pub(crate) limit: Limit,
    /// The table whose hasher computed `hash`.
    pub(crate) table_id: u64,
}

impl PreparedBucket {
    /// The bucket's key.
    pub fn key(&self) -> KeyRef<'_> {
        self.key.as_ref()
    }

    /// The bucket's definition.
    pub fn limit(&self) -> Limit {
        self.limit
    }
}

/// One bucket of a multi-bucket check of prepared buckets: `cost` tokens from `bucket`.
#[derive(Debug, Clone, Copy)]
pub struct PreparedCheck<'a> {
    /// The prepared bucket.
    pub bucket: &'a PreparedBucket,
    /// Tokens to pay, `>= 0` (see [`crate::rules::cost`]).
    pub cost: f64,
}

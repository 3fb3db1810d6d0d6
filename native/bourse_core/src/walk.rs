//! What a walk over every bucket of the table does, shard by shard.

use crate::bucket::Bucket;
use crate::types::Stats;

/// Visits every bucket, shard by shard. A shard whose buckets move to another table while
/// it is walked is walked again from its start.
pub(crate) trait Walk {
    /// Whether to keep `bucket`, at `now`; `stats` are its shard's.
    fn visit(&mut self, bucket: &mut Bucket, now: u64, stats: &mut Stats) -> bool;

    /// The current shard is walked again: what its visits gathered is to be forgotten.
    fn restart_shard(&mut self) {}

    /// The current shard is walked.
    fn end_shard(&mut self) {}
}

/// A walk that only keeps or drops: visiting a bucket again gives the same answer.
impl<F: FnMut(&mut Bucket, u64, &mut Stats) -> bool> Walk for F {
    fn visit(&mut self, bucket: &mut Bucket, now: u64, stats: &mut Stats) -> bool {
        self(bucket, now, stats)
    }
}

//! What a paid check changed on its buckets, so that a caller who never learnt of the
//! payment (its answer came too late) can have it taken back ([`crate::Table::give_back`]).

use crate::bucket::{Balance, Bucket};
use crate::key::Key;

/// The buckets a check paid on, each with its balance before and after the payment. Only
/// buckets that held no booking before are kept: a payment beside other bookings moves
/// their refunds, which cannot be put back exactly.
#[derive(Debug, Default)]
pub struct Receipt {
    paid: Vec<Paid>,
}

#[derive(Debug)]
pub(crate) struct Paid {
    pub key: Key,
    pub hash: u64,
    before: Balance,
    after: Balance,
}

impl Receipt {
    /// Notes the payment on `bucket`, whose balance was `before` (if it had one).
    pub(crate) fn note(&mut self, bucket: &Bucket, before: Option<Balance>) {
        let (Some(before), Some(after)) = (before, bucket.balance()) else {
            return;
        };
        if !before.holds_booking() {
            self.paid.push(Paid {
                key: bucket.key.clone(),
                hash: bucket.hash,
                before,
                after,
            });
        }
    }

    pub(crate) fn paid(&self) -> &[Paid] {
        &self.paid
    }

    /// Whether no bucket can be given anything back.
    pub fn is_empty(&self) -> bool {
        self.paid.is_empty()
    }
}

impl Paid {
    /// Takes the payment back from `bucket`, if nothing changed it since.
    pub(crate) fn take_back(&self, bucket: &mut Bucket) -> bool {
        bucket.take_back(&self.before, &self.after)
    }
}

//! What a paid check changed on its buckets, so that a caller who never learnt of the
//! payment (its answer came too late) can have it taken back ([`crate::Table::give_back`]).

use crate::bucket::{Balance, Bucket};
use crate::key::Key;

/// The buckets a check paid on, each with its balance before and after the payment. A
/// payment beside other bookings moves their refunds, which cannot be put back exactly: a
/// check that paid on such a bucket is never given back (its receipt is partial).
#[derive(Debug, Default)]
pub struct Receipt {
    paid: Vec<Paid>,
    partial: bool,
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
        match (before, bucket.balance()) {
            (Some(before), Some(after)) if !before.holds_booking() => self.paid.push(Paid {
                key: bucket.key.clone(),
                hash: bucket.hash,
                before,
                after,
            }),
            _ => self.partial = true,
        }
    }

    pub(crate) fn paid(&self) -> &[Paid] {
        &self.paid
    }

    /// Whether the check can be taken back: it paid, on buckets that held no other booking.
    pub fn can_give_back(&self) -> bool {
        !self.partial && !self.paid.is_empty()
    }
}

impl Paid {
    /// Whether `bucket` is still at the balance the payment left it with.
    pub(crate) fn unmoved(&self, bucket: &Bucket) -> bool {
        bucket.balance().as_ref() == Some(&self.after)
    }

    /// Takes the payment back from `bucket`, which is [`Paid::unmoved`].
    pub(crate) fn take_back(&self, bucket: &mut Bucket) {
        bucket.put_back(&self.before);
    }
}

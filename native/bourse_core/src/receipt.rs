//! What a paid check changed on its buckets, so that a caller who never learnt of the
//! payment (its answer came too late) can have it taken back ([`crate::Table::give_back`]).

use crate::bucket::{Balance, Bucket};
use crate::key::Key;

/// The buckets a check (or a debit) paid on, each with its balance before and after the
/// payment and the cost paid. A payment beside other bookings moves their refunds, which cannot be put
/// back exactly: a check that paid on such a bucket is never given back (its receipt is
/// partial).
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
    cost: f64,
}

impl Receipt {
    /// Notes the payment of `cost` on `bucket`, whose balance was `before` (if it had one).
    pub(crate) fn note(&mut self, bucket: &Bucket, before: Option<Balance>, cost: f64) {
        match (before, bucket.balance()) {
            (Some(before), Some(after)) if !before.holds_booking() => self.paid.push(Paid {
                key: bucket.key.clone(),
                hash: bucket.hash,
                before,
                after,
                cost,
            }),
            _ => self.partial = true,
        }
    }

    pub(crate) fn paid(&self) -> &[Paid] {
        &self.paid
    }

    /// How many buckets it paid on.
    pub fn buckets(&self) -> usize {
        self.paid.len()
    }

    /// Whether the check can be taken back: it paid, on buckets that held no other booking.
    pub fn can_give_back(&self) -> bool {
        !self.partial && !self.paid.is_empty()
    }
}

/// How a payment is taken back from its bucket.
pub(crate) enum TakeBack {
    /// Nothing moved the bucket since: it is put back as it was.
    Whole,
    /// Payments, debits, refusals or refunds alone moved it since: these tokens (maybe
    /// none, when the cap may have taken them all) are given back
    /// ([`Bucket::refundable`]).
    Refund(f64),
}

impl Paid {
    /// How the payment can be taken back from `bucket` at `now`, if it can: whole, else if
    /// `refund`, refunded.
    pub(crate) fn take_back_from(
        &self,
        bucket: &Bucket,
        refund: bool,
        now: u64,
    ) -> Option<TakeBack> {
        if bucket.balance().as_ref() == Some(&self.after) {
            return Some(TakeBack::Whole);
        }
        if !refund {
            return None;
        }
        let tokens = bucket.refundable(&self.before, &self.after, self.cost, now)?;
        Some(TakeBack::Refund(tokens))
    }

    /// Takes the payment back from `bucket` as [`Paid::take_back_from`] found it could.
    pub(crate) fn take_back(&self, bucket: &mut Bucket, how: TakeBack) {
        match how {
            TakeBack::Whole => bucket.put_back(&self.before),
            TakeBack::Refund(tokens) => bucket.refund(tokens),
        }
    }
}

//! One key's bucket: token arithmetic, bookings and the sweep rule.

use crate::clock::{NANOS_PER_MS, NANOS_PER_SEC};
use crate::key::Key;
use crate::limit::Limit;
use crate::rules::{DEBT_KEEP_MS, KEEP_MARGIN_MS};
use smallvec::SmallVec;

/// The longest wait the table will compute (about 31 years); longer ones saturate here.
pub(crate) const MAX_WAIT_NS: u64 = 1_000_000_000_000_000_000;

/// `base_at` of a key that only has `record_request` debt, which no check has seen yet.
const UNSEEN: u64 = u64::MAX;

/// A waiter's cost, paid at booking time and claimable from `ready_at`.
#[derive(Debug, Clone)]
pub(crate) struct Booking {
    pub owner: u64,
    pub signature: u64,
    pub cost: f64,
    pub ready_at: u64,
    pub lapse_at: u64,
    /// When it was booked: bookings are paid again in the order they were made, the same
    /// on every bucket.
    pub booked_at: u64,
    /// Its place among the bookings of its bucket, in the order they were made (bookings
    /// made at one instant included): a check that books on several buckets holds all their
    /// locks, so two bookings sharing buckets are in the same order on each.
    pub made: u64,
    /// What paying it again gives back: its cost, less what the cap (or a lowering) has
    /// taken since from the bucket without it (see [`Bucket::limit_refunds`]).
    pub refund: f64,
}

impl Booking {
    /// Whether its waiter may still claim it before `until`: not lapsed at `now`, and due
    /// before then.
    fn due_before(&self, until: u64, now: u64) -> bool {
        self.lapse_at >= now && self.ready_at < until
    }
}

/// A key's state before [`Bucket::define`] gave it a definition for a check.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Previous {
    limit: Option<Limit>,
    base: f64,
    base_at: u64,
}

/// What a payment changes in a bucket holding at most one booking: its definition, its
/// tokens, when it was last seen and told, and that booking. Every check, debit or sync
/// moves it (a sync that lowers nothing still marks when it was seen): a bucket found at
/// the balance a payment left it with was not touched since, but by what was taken back.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Balance {
    limit: Option<Limit>,
    base: f64,
    base_at: u64,
    seen_at: u64,
    told_until: u64,
    /// The owner, signature and place of its one booking.
    booking: Option<(u64, u64, u64)>,
    era: u32,
    rewrites: u32,
    refunded: f64,
}

impl Balance {
    pub fn holds_booking(&self) -> bool {
        self.booking.is_some()
    }
}

/// Tokens are `base + refill * (t - base_at)`, read capped at the capacity (or at the
/// cost of an over-capacity request). `base` only moves when something is paid, so the
/// uncapped reading is what accrued since the last payment.
#[derive(Debug)]
pub(crate) struct Bucket {
    pub key: Key,
    pub hash: u64,
    /// `None` until a check pays under a definition: the key has only `record_request`
    /// debt, or its checks were refused.
    pub limit: Option<Limit>,
    /// Without a limit: minus the pending debt.
    base: f64,
    /// Without a limit: when a check first saw the key (its accrual starts there), or
    /// [`UNSEEN`].
    base_at: u64,
    /// The last access: the bucket is kept for longer than its fill time after it.
    seen_at: u64,
    /// The latest moment an answer since the last payment (or that payment, a booking)
    /// told its caller to come back; 0 for none. The bucket is kept [`KEEP_MARGIN_MS`]
    /// past it.
    told_until: u64,
    pub bookings: Vec<Booking>,
    /// Tells the key's buckets apart: each one made (first, or after a reset or a sweep)
    /// has its own.
    era: u32,
    /// How many times its tokens were set otherwise than lowered by a payment or a debit
    /// (a definition or its taking back, a sync, a booking, bookings paid again): between
    /// two such moments, the tokens only grow by the refill and by refunds.
    rewrites: u32,
    /// All tokens given back by refunds ([`Bucket::refund`]).
    refunded: f64,
}

fn secs(from: u64, to: u64) -> f64 {
    to.saturating_sub(from) as f64 / NANOS_PER_SEC
}

/// Nanoseconds to accrue `tokens` at `limit`'s rate, saturating at [`MAX_WAIT_NS`].
fn accrual_ns(tokens: f64, limit: &Limit) -> u64 {
    // Less a thousandth of a nanosecond, so float noise cannot add a whole one.
    (tokens / limit.refill_per_sec() * NANOS_PER_SEC - 1e-3)
        .ceil()
        .min(MAX_WAIT_NS as f64) as u64
}

/// Whether `tokens` cover `cost`, forgiving float noise of a billionth of the cost: relative,
/// so that P1 holds for tiny limits and costs too (a fixed tolerance admits a thousand costs
/// of 1e-12 where one fits).
fn covers(tokens: f64, cost: f64) -> bool {
    tokens >= cost - 1e-9 * cost
}

/// What the refunds of a bucket's other bookings (`others` together) may still give back
/// once `gone` leaves it for good, the bucket having `accrued` uncapped: less what `gone`'s
/// own refund fell short of its cost, and less what they, with it, would hold beyond the
/// cap now.
fn room_without(limit: &Limit, accrued: f64, others: f64, gone: &Booking) -> f64 {
    let beyond = (accrued + gone.refund + others - limit.capacity()).max(0.0);
    others - beyond - (gone.cost - gone.refund)
}

impl Bucket {
    /// A key first seen by a check at `now`, without a definition until one is paid; `era`
    /// is the shard's next.
    pub fn seen(key: Key, hash: u64, now: u64, era: u32) -> Self {
        Self {
            key,
            hash,
            limit: None,
            base: 0.0,
            base_at: now,
            seen_at: now,
            told_until: 0,
            bookings: Vec::new(),
            era,
            rewrites: 0,
            refunded: 0.0,
        }
    }

    pub fn debt_only(key: Key, hash: u64, debt: f64, now: u64, era: u32) -> Self {
        Self {
            // From +0.0: no debt reads 0.0, not -0.0.
            base: 0.0 - debt,
            base_at: UNSEEN,
            ..Self::seen(key, hash, now, era)
        }
    }

    fn rewritten(&mut self) {
        self.rewrites = self.rewrites.wrapping_add(1);
    }

    /// When a check under `limit` finds the key as new, the instant from which it holds
    /// the tokens a new bucket starts with: a key without a definition from when a check
    /// first saw it (now if none has); a bucket as new under another definition
    /// ([`Bucket::as_new`]) from when it was full again after its last payment, so that
    /// nothing it accrued before is counted twice. `None`: the check starts from the
    /// bucket's tokens ([`Bucket::start_under`]).
    pub fn starts_new(&self, limit: &Limit, now: u64) -> Option<u64> {
        match &self.limit {
            None if self.base_at == UNSEEN => Some(now),
            None => Some(self.base_at),
            Some(current) if current != limit && self.as_new(current, now) => {
                let refill = accrual_ns((current.capacity() - self.base).max(0.0), current);
                Some(self.base_at.saturating_add(refill).min(now))
            }
            Some(_) => None,
        }
    }

    /// Gives the key `limit` for a check, starting from `tokens` at `from` (less the debt of
    /// a key without a definition); returns what [`Bucket::restore`] takes it back with.
    pub fn define(&mut self, limit: Limit, tokens: f64, from: u64) -> Previous {
        let previous = Previous {
            limit: self.limit,
            base: self.base,
            base_at: self.base_at,
        };
        self.base = match self.limit {
            Some(_) => tokens,
            None => self.base + tokens,
        };
        self.base_at = from;
        self.limit = Some(limit);
        self.rewritten();
        previous
    }

    /// Its balance, unless it holds more than one booking.
    pub fn balance(&self) -> Option<Balance> {
        let booking = match self.bookings.as_slice() {
            [] => None,
            [only] => Some((only.owner, only.signature, only.made)),
            _ => return None,
        };
        Some(Balance {
            limit: self.limit,
            base: self.base,
            base_at: self.base_at,
            seen_at: self.seen_at,
            told_until: self.told_until,
            booking,
            era: self.era,
            rewrites: self.rewrites,
            refunded: self.refunded,
        })
    }

    /// Puts back `before`, a balance without bookings, on a bucket still at the balance
    /// one payment left it with: it then is as it would be had that payment never been
    /// made.
    pub fn put_back(&mut self, before: &Balance) {
        debug_assert!(!before.holds_booking());
        self.limit = before.limit;
        self.base = before.base;
        self.base_at = before.base_at;
        self.seen_at = before.seen_at;
        self.told_until = before.told_until;
        self.rewrites = before.rewrites;
        self.refunded = before.refunded;
        self.bookings.clear();
    }

    /// What may be given back of `cost`, paid by the payment that took the bucket from
    /// `before` to `after`, if that payment kept its definition and payments, debits,
    /// refusals and refunds alone moved the bucket since (no rewrite, same definition, no
    /// booking): no more than the bucket without that payment would hold more now, 0 when
    /// the cap may have taken it all; 0 on a bucket made anew since. The tokens never grew but by the
    /// refill and the refunds after it, so until now the bucket without it held at most
    /// `after`'s tokens, those and `cost`; the cap took no more than what that sum passes
    /// the capacity by.
    pub fn refundable(
        &self,
        before: &Balance,
        after: &Balance,
        cost: f64,
        now: u64,
    ) -> Option<f64> {
        if self.era != after.era {
            // Made anew (after a sweep, which drops only full buckets, or a reset): nothing
            // of the payment is left on it.
            return Some(0.0);
        }
        let limit = self.limit?;
        let unchanged = self.rewrites == after.rewrites
            && before.limit == Some(limit)
            && after.limit == Some(limit)
            && after.booking.is_none()
            && self.bookings.is_empty();
        let grown =
            limit.refill_per_sec() * secs(after.base_at, now) + self.refunded - after.refunded;
        let given = cost.min(limit.capacity() - (after.base + grown));
        unchanged.then_some(given.max(0.0))
    }

    /// Leaves `base` tokens at `now` after a payment or debit. One that leaves no trace (a
    /// cost of 0, or below the tokens' precision, at the instant of the last) counts as a
    /// rewrite, so that no payment before it is put back over it.
    fn paid_to(&mut self, base: f64, now: u64) {
        if base == self.base && now == self.base_at {
            self.rewritten();
        }
        self.base = base;
        self.base_at = now;
    }

    /// Gives back `tokens` ([`Bucket::refundable`]).
    pub fn refund(&mut self, tokens: f64) {
        self.base += tokens;
        self.refunded += tokens;
    }

    /// Takes back the definition a check gave the key and then paid nothing under: a
    /// refused call does not change a key's definition. What it saw stays: the accrual of a
    /// key without a definition starts when a check first saw it.
    pub fn restore(&mut self, previous: Previous, now: u64) {
        self.rewritten();
        self.limit = previous.limit;
        self.base = previous.base;
        self.base_at = match previous.base_at {
            UNSEEN => now,
            at => at,
        };
    }

    /// Tokens accrued since the last payment, not capped.
    fn accrued(&self, limit: &Limit, now: u64) -> f64 {
        self.base + limit.refill_per_sec() * secs(self.base_at, now)
    }

    /// Tokens at `now` as cheap traffic sees them: capped at the capacity.
    pub fn tokens(&self, now: u64) -> f64 {
        match &self.limit {
            Some(limit) => self.accrued(limit, now).min(limit.capacity()),
            None => self.base,
        }
    }

    /// Debt recorded before the key had a definition.
    pub fn pending_debt(&self) -> f64 {
        match self.limit {
            Some(_) => 0.0,
            None => 0.0 - self.base,
        }
    }

    /// Tokens borrowed now: `capacity - tokens`, never below zero.
    pub fn borrowed(&self, now: u64) -> f64 {
        match &self.limit {
            Some(limit) => (limit.capacity() - self.tokens(now)).max(0.0),
            None => self.pending_debt(),
        }
    }

    /// The uncapped tokens at `now` for a request made under `limit`. A changed definition
    /// starts from the current tokens clamped to the new capacity (accrual beyond it is
    /// lost), unless the bucket is as new ([`Bucket::starts_new`]).
    pub fn start_under(&self, limit: &Limit, now: u64) -> f64 {
        match &self.limit {
            Some(current) if current == limit => self.accrued(limit, now),
            Some(_) => self.tokens(now).min(limit.capacity()),
            None => self.base,
        }
    }

    /// When `cost` can be paid under `limit`, given `start` from [`Bucket::start_under`].
    /// Over-capacity costs may use everything accrued since the last payment, up to `cost`.
    pub fn ready_at(limit: &Limit, cost: f64, start: f64, now: u64) -> u64 {
        let available = start.min(limit.capacity().max(cost));
        if covers(available, cost) {
            now
        } else {
            now.saturating_add(accrual_ns(cost - available, limit))
        }
    }

    /// Pays `cost` as of instant `at >= now`: the bucket then holds what it would hold had
    /// the cost been paid at `at`, and tokens that would overflow the cap until then are
    /// forfeited, so nobody can spend what the payment needs at `at`. A new definition
    /// clamps the bucket without the bookings as well: their refunds keep only the room
    /// below its capacity.
    pub fn pay(&mut self, limit: Limit, cost: f64, start: f64, now: u64, at: u64) {
        let cap = limit.capacity().max(cost);
        let lead = if at > now {
            // What the cap takes until `at` may pass what it would take by now.
            self.rewritten();
            limit.refill_per_sec() * secs(now, at)
        } else {
            0.0
        };
        if let Some(current) = self.limit.filter(|current| *current != limit) {
            self.limit_refunds(current.capacity().min(limit.capacity()) - start, now);
            self.rewritten();
        }
        let after = (start.min(cap) + lead).min(cap) - cost - lead;
        self.paid_to(after, now);
        self.limit = Some(limit);
    }

    /// Pays `cost` at `now` for good (an admitted check), from `start` (see
    /// [`Bucket::pay`]): the cap takes as much from the bucket without the bookings, whose
    /// refunds keep only the room it had below the cap.
    pub fn spend(&mut self, limit: Limit, cost: f64, start: f64, now: u64) {
        if self.limit == Some(limit) {
            self.limit_refunds(limit.capacity().max(cost) - start, now);
        }
        self.pay(limit, cost, start, now, now);
    }

    /// Bookings due before `pause_until` (> now: a pause began after they were made) go
    /// out after it instead, in their order, each keeping its slack: their costs are paid
    /// again as of their new ready times (the pause's end, or later when the bucket cannot
    /// cover them all then), as if they had been booked behind the pause. Paid as of their
    /// old ready times, they would have left the refill of the pause to the traffic waiting
    /// for its end as well.
    pub fn hold_bookings(&mut self, pause_until: u64, now: u64) {
        if self.bookings.iter().any(|b| b.ready_at < pause_until) {
            self.replan(|b| b.ready_at.max(pause_until), now);
        }
    }

    /// Holds one booking (`owner`'s, of `signature`) until at least `until` (> its ready
    /// time: a pause of the check's other buckets holds it), paid again here as of its new
    /// ready time, which it returns. It keeps its turn: the bookings made after it go out
    /// no earlier ([`Bucket::replan`]).
    pub fn hold_booking(&mut self, owner: u64, signature: u64, until: u64, now: u64) -> u64 {
        let held = |b: &Booking| b.owner == owner && b.signature == signature;
        self.replan(
            |b| {
                if held(b) {
                    b.ready_at.max(until)
                } else {
                    b.ready_at
                }
            },
            now,
        );
        self.bookings
            .iter()
            .find(|b| held(b))
            .map_or(until, |b| b.ready_at)
    }

    /// Holds the bookings due before `until` (a used-weight window's end) beyond `room`
    /// together, first made first, until `until`: from the first that `room` cannot cover
    /// on, they go out after it, in their order, paid again as of their new ready times
    /// ([`Bucket::replan`]). Those before it keep their ready times.
    pub fn hold_bookings_beyond(&mut self, room: f64, until: u64, now: u64) {
        let mut due: SmallVec<[(u64, u64, f64); 8]> = self
            .bookings
            .iter()
            .filter(|b| b.due_before(until, now))
            .map(|b| (b.booked_at, b.made, b.cost))
            .collect();
        due.sort_unstable_by_key(|x| (x.0, x.1));
        let mut left = room.max(0.0);
        let first_held = due.iter().find_map(|&(booked_at, made, cost)| {
            if covers(left, cost) {
                left -= cost;
                None
            } else {
                Some((booked_at, made))
            }
        });
        if let Some(first_held) = first_held {
            self.replan(
                |b| match (b.booked_at, b.made) >= first_held {
                    true => b.ready_at.max(until),
                    false => b.ready_at,
                },
                now,
            );
        }
    }

    /// The cost of the bookings not lapsed at `now` that are due before `until`: their
    /// waiters may send them before then.
    pub fn booked_before(&self, until: u64, now: u64) -> f64 {
        self.bookings
            .iter()
            .filter(|b| b.due_before(until, now))
            .fold(0.0, |sum, b| sum + b.cost)
    }

    /// What the bookings not lapsed at `now` give back when paid again, together.
    fn refunds(&self, now: u64) -> f64 {
        self.bookings
            .iter()
            .filter(|b| b.lapse_at >= now)
            .fold(0.0, |sum, b| sum + b.refund)
    }

    /// Limits what the bookings not lapsed at `now` give back when paid again to `room`
    /// together: a payment for good left the bucket without them no more room than that
    /// below its cap (or a lowering), so the rest would be tokens the cap already took.
    /// The bookings not yet due keep theirs first, then those due, first made first.
    fn limit_refunds(&mut self, room: f64, now: u64) {
        if self.refunds(now) <= room {
            return;
        }
        let mut order: SmallVec<[usize; 8]> = (0..self.bookings.len())
            .filter(|&i| self.bookings[i].lapse_at >= now)
            .collect();
        order.sort_unstable_by_key(|&i| {
            let b = &self.bookings[i];
            (b.ready_at <= now, b.booked_at, b.made)
        });
        let mut left = room.max(0.0);
        for &i in &order {
            let booking = &mut self.bookings[i];
            booking.refund = booking.refund.min(left);
            left -= booking.refund;
        }
    }

    /// Removes the booking at `position` (claimed, lapsed or replaced): its cost stays paid,
    /// as of its ready time. The bucket without the other bookings then holds its cost less
    /// as well, and no more than the cap: their refunds shrink by what its own fell short
    /// of its cost, and by what they, with it, would hold beyond the cap now.
    pub fn remove_booking(&mut self, position: usize, now: u64) {
        let booking = self.bookings.swap_remove(position);
        if let Some(limit) = self.limit {
            let accrued = self.accrued(&limit, now);
            let others = self.refunds(now);
            self.limit_refunds(room_without(&limit, accrued, others, &booking), now);
        }
    }

    /// Takes back the booking at `position`, whose caller will not claim it (it was told
    /// the store was unavailable, or one of the booking's other buckets was reset): the
    /// bucket gets what its refund gives, and the others' refunds keep only the room left
    /// below the cap. Only the latest booking the bucket holds: one made after it was paid
    /// as of its own ready time, forfeiting what the cap would take until then, part of
    /// which the refund would hand out again; and paying such bookings again would move
    /// them, and those before them, later than their waiters were told. A lapsed one only
    /// while nothing wrote the bucket since it lapsed (its refund was last kept within the
    /// room then). Returns whether it was taken back; if not, it stays paid.
    pub fn give_back_booking(&mut self, position: usize, now: u64) -> bool {
        let booking = &self.bookings[position];
        let lapsed_since = booking.lapse_at < now && self.seen_at > booking.lapse_at;
        // Made at the same instant counts as after (Redis cannot tell their order).
        let made_after = self
            .bookings
            .iter()
            .enumerate()
            .any(|(at, b)| at != position && b.booked_at >= booking.booked_at);
        if lapsed_since || made_after {
            return false;
        }
        let booking = self.bookings.swap_remove(position);
        self.rewritten();
        self.base += booking.refund;
        if let Some(limit) = self.limit {
            self.limit_refunds(limit.capacity() - self.accrued(&limit, now), now);
        }
        true
    }

    /// Gives back every booking's refund, then pays each again, in the order they were
    /// made, as of the latest of its `earliest` (when it may go out now, never before its
    /// ready time), when the bucket covers it and the booking before it; each keeps its
    /// slack and may give back its whole cost again. Paying again only the bookings that
    /// moved, after those behind them, would take tokens those counted on, beyond the
    /// capacity at that instant.
    ///
    /// The order is the one the bookings were first paid in, on every bucket alike: a
    /// booking held on some of its buckets keeps its turn on the others, ahead of the
    /// bookings made after it. Ordered by when each may go out instead, it went behind
    /// every booking made after it and due before its new ready time, then on its other
    /// buckets behind theirs, round after round; ordered by ready times, which differ from
    /// bucket to bucket, two waiters whose checks share buckets pushed each other's
    /// bookings later at each claim, forever.
    fn replan(&mut self, earliest: impl Fn(&Booking) -> u64, now: u64) {
        let Some(limit) = self.limit else { return };
        let mut order: SmallVec<[(u64, u64, usize); 8]> = self
            .bookings
            .iter()
            .enumerate()
            .map(|(i, b)| (b.booked_at, b.made, i))
            .collect();
        order.sort_unstable();
        self.rewritten();
        for booking in &self.bookings {
            self.base += booking.refund;
        }
        let mut last = 0;
        for &(.., i) in &order {
            let cost = self.bookings[i].cost;
            let start = self.accrued(&limit, now);
            let ready = Self::ready_at(&limit, cost, start, now)
                .max(earliest(&self.bookings[i]))
                .max(last);
            last = ready;
            self.pay(limit, cost, start, now, ready);
            let booking = &mut self.bookings[i];
            booking.refund = cost;
            let slack_ns = booking.lapse_at.saturating_sub(booking.ready_at);
            booking.ready_at = ready;
            booking.lapse_at = ready.saturating_add(slack_ns);
        }
    }

    /// Debits `cost` without checking; the bucket may go into debt. Under a definition
    /// what accrued is spent ([`Bucket::touch`]); without one the accrual still counts from
    /// when a check first saw the key, so what a refusal told its caller holds.
    pub fn debit(&mut self, cost: f64, now: u64) {
        match self.limit {
            Some(limit) => {
                self.limit_refunds(limit.capacity() - self.accrued(&limit, now), now);
                self.paid_to(self.tokens(now) - cost, now);
                self.touch(now, 0);
            }
            None => {
                self.base -= cost;
                self.told(now, 0);
            }
        }
    }

    /// Lowers the tokens to at most `max_tokens` (possibly below zero); never raises them.
    /// The bucket without the bookings holds at most `max_tokens + booked` (`booked`: what
    /// of their cost `max_tokens` leaves room for). Seen now either way: a payment made
    /// before is not given back past what the exchange allows.
    pub fn lower_to(&mut self, max_tokens: f64, booked: f64, now: u64) {
        let Some(limit) = self.limit else { return };
        self.seen_at = now;
        // Even raising nothing, it can lower the bucket without a payment made before.
        self.rewritten();
        let ceiling = limit.capacity().min(max_tokens + booked);
        self.limit_refunds(ceiling - self.accrued(&limit, now), now);
        if max_tokens < self.tokens(now) {
            self.base = max_tokens;
            self.base_at = now;
        }
    }

    /// Records a payment or debit at `now` whose caller comes back after `delay_ns` (a
    /// booking's wait, else 0): what accrued before is spent, so earlier refusals promise
    /// nothing more.
    pub fn touch(&mut self, now: u64, delay_ns: u64) {
        self.seen_at = now;
        self.told_until = match delay_ns {
            0 => 0,
            delay => now.saturating_add(delay),
        };
    }

    /// Records an answer at `now` that paid nothing (a refusal, a claim) and told its
    /// caller to come back after `delay_ns` (0: not at all); it never shortens what an
    /// earlier answer told.
    pub fn told(&mut self, now: u64, delay_ns: u64) {
        self.seen_at = now;
        if delay_ns > 0 {
            self.told_until = self.told_until.max(now.saturating_add(delay_ns));
        }
    }

    /// Drops bookings whose slack has run out; their cost stays paid. The others' refunds
    /// shrink as [`Bucket::remove_booking`] shrinks them for each lapsed one, in the order
    /// those were made, limited once to the least room of those steps. Returns how many.
    pub fn drop_lapsed(&mut self, now: u64) -> usize {
        let mut lapsed: SmallVec<[Booking; 4]> = SmallVec::new();
        self.bookings.retain(|b| {
            let kept = b.lapse_at >= now;
            if !kept {
                lapsed.push(b.clone());
            }
            kept
        });
        if let (Some(limit), false) = (self.limit, lapsed.is_empty()) {
            lapsed.sort_unstable_by_key(|b| (b.booked_at, b.made));
            let accrued = self.accrued(&limit, now);
            let mut room = self.refunds(now);
            for gone in &lapsed {
                room = room.min(room_without(&limit, accrued, room, gone).max(0.0));
            }
            self.limit_refunds(room, now);
        }
        lapsed.len()
    }

    /// Whether the bucket behaves under `limit`, its definition, as a new one does but for
    /// what accrued beyond the capacity: full, without bookings (but lapsed ones) or debt,
    /// last paid longer ago than its fill time. What refusals told their callers (which
    /// keeps it, [`Bucket::sweepable`]) plays no part: they pay nothing (P3).
    fn as_new(&self, limit: &Limit, now: u64) -> bool {
        now.saturating_sub(self.base_at) > accrual_ns(limit.capacity(), limit)
            && self.bookings.iter().all(|b| b.lapse_at < now)
            && covers(self.tokens(now), limit.capacity())
    }

    /// A bucket as new ([`Bucket::as_new`]), idle past its fill time, behaves exactly as a
    /// new one; so does a key without a definition nor debt. A key
    /// without a definition whose debt was last used [`DEBT_KEEP_MS`] ago (and
    /// [`KEEP_MARGIN_MS`]) is dropped too, as the Redis script's keys expire. One whose
    /// refusals told callers to come back is kept [`KEEP_MARGIN_MS`] past the latest such
    /// moment: a caller back a little late still finds what accrued beyond the capacity,
    /// whatever other callers were told meanwhile.
    pub fn sweepable(&self, now: u64) -> bool {
        let awaited = self.told_until > 0
            && now
                <= self
                    .told_until
                    .saturating_add(KEEP_MARGIN_MS * NANOS_PER_MS);
        !awaited
            && match &self.limit {
                Some(limit) => {
                    now.saturating_sub(self.seen_at) > accrual_ns(limit.capacity(), limit)
                        && self.as_new(limit, now)
                }
                None => {
                    self.base >= 0.0
                        || now.saturating_sub(self.seen_at)
                            > (DEBT_KEEP_MS + KEEP_MARGIN_MS) * NANOS_PER_MS
                }
            }
    }
}

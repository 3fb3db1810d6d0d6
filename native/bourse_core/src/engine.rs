//! The check engine: over the buckets of one check, decides whether it is admitted,
//! claimed, booked or refused, and pays accordingly. It takes no lock and reads no clock:
//! the table hands it the buckets, locked, and the time.

use smallvec::SmallVec;

use crate::bucket::{Booking, Bucket};
use crate::clock::NANOS_PER_MS;
use crate::key::{Key, Sought};
use crate::rules::{self, InvalidInput, MAX_BOOKINGS};
use crate::table::INLINE_CHECKS;
use crate::types::{Check, Mode, Outcome, Stats};

/// A prepared bucket of a check: hashed, coalesced, with its shard slot.
#[derive(Clone, Copy)]
pub(crate) struct Item<'a> {
    pub check: Check<'a>,
    pub hash: u64,
    /// The key packed, when the caller prepared it.
    pub packed: Option<&'a Key>,
    /// Which of the check's locked shards holds the bucket.
    pub slot: usize,
}

impl Item<'_> {
    /// The item's key, to look up.
    pub fn sought(&self) -> Sought<'_> {
        match self.packed {
            Some(key) => Sought::Packed(key),
            None => Sought::Parts(self.check.key),
        }
    }
}

/// What a check needs besides its buckets.
#[derive(Clone, Copy)]
pub(crate) struct Request {
    pub owner: u64,
    pub mode: Mode,
    pub now: u64,
    /// The end of the latest pause covering the check, or 0.
    pub pause_until: u64,
    /// How long past its ready time a booking may be claimed, in nanoseconds.
    pub slack_ns: u64,
    /// Buckets new to the table start as if empty this long (ns) before `now`, if at all.
    pub busy_for: Option<u64>,
}

/// The end of the pause covering each item of a check (0 for none), or nothing when no
/// pause lasts past now.
pub(crate) type ItemPauses = SmallVec<[u64; INLINE_CHECKS]>;

/// Whole milliseconds from `from` to `to`, rounded up, at least 1.
pub(crate) fn delay_ms(from: u64, to: u64) -> u64 {
    to.saturating_sub(from).div_ceil(NANOS_PER_MS).max(1)
}

/// Folds the key hashes and costs of a coalesced check into the signature its booking is
/// claimed by.
pub(crate) fn fold_signature(parts: impl Iterator<Item = (u64, f64)>) -> u64 {
    parts.fold(0x243f_6a88_85a3_08d3, |acc: u64, (hash, cost)| {
        (acc.rotate_left(23) ^ hash ^ cost.to_bits()).wrapping_mul(0x9e37_79b9_7f4a_7c15)
    })
}

/// The signature of a coalesced check (see [`coalesce`]) for stores outside this process:
/// the same for the same checks in every process and run, so a waiter that comes back
/// through another connection claims its booking.
pub fn signature(checks: &[Check]) -> u64 {
    let hasher = foldhash::fast::FixedState::with_seed(0x5eed_b0a5_5e00_0001);
    fold_signature(checks.iter().map(|check| {
        use std::hash::BuildHasher;
        (hasher.hash_one(check.key), check.cost)
    }))
}

/// Repeated keys charged once at their combined cost, sorted by key; one key with two
/// definitions is an error naming both, in the order given, and the key's exchange.
pub fn coalesce<'a>(checks: &[Check<'a>]) -> Result<Vec<Check<'a>>, InvalidInput> {
    let mut sorted = checks.to_vec();
    // Stable: of two checks of one key, the first given stays first.
    sorted.sort_by(|a, b| a.key.cmp(&b.key));
    let kept = merge_runs(&mut sorted, |check| check, |a, b| a.key == b.key)?;
    sorted.truncate(kept);
    Ok(sorted)
}

/// The coalescing rule, over `items` sorted so that the checks of one key (`same_key`) are
/// adjacent, first given first: each run becomes its first check at the run's combined
/// cost, and the runs move to the front; returns how many there are. A run with two
/// definitions is an error naming both and the key's exchange.
pub(crate) fn merge_runs<'a, T>(
    items: &mut [T],
    check: impl Fn(&mut T) -> &mut Check<'a>,
    same_key: impl Fn(&T, &T) -> bool,
) -> Result<usize, InvalidInput> {
    let mut kept = 0;
    for next in 0..items.len() {
        if kept > 0 && same_key(&items[kept - 1], &items[next]) {
            let current = *check(&mut items[next]);
            let last = check(&mut items[kept - 1]);
            if last.limit != current.limit {
                return Err(rules::conflicting_definitions(&last.limit, &current.limit)
                    .for_exchange(current.key.exchange));
            }
            last.cost += current.cost;
            continue;
        }
        if kept != next {
            items.swap(kept, next);
        }
        kept += 1;
    }
    Ok(kept)
}

/// The signature a booking of `items` is claimed by.
pub(crate) fn items_signature(items: &[Item]) -> u64 {
    fold_signature(items.iter().map(|item| (item.hash, item.check.cost)))
}

/// Admits, books or refuses a check over `buckets` (aligned with `items`, and with
/// `pauses` unless that is empty).
pub(crate) fn decide(
    buckets: &mut [&mut Bucket],
    items: &[Item],
    stats: &mut Stats,
    request: Request,
    pauses: &[u64],
) -> Outcome {
    let Request {
        owner,
        mode,
        slack_ns,
        now,
        pause_until,
        ..
    } = request;
    // Does any bucket hold a booking?
    let mut any_booked = false;
    for (i, bucket) in buckets.iter_mut().enumerate() {
        stats.lapsed += bucket.drop_lapsed(now) as u64;
        match pauses.get(i) {
            Some(&held_until) if held_until > now => bucket.hold_bookings(held_until, now),
            _ => {}
        }
        any_booked |= !bucket.bookings.is_empty();
    }
    if any_booked {
        // Does the caller hold a booking for this check on every bucket?
        let signature = items_signature(items);
        let claim_ready = buckets.iter().try_fold(0, |at, bucket| {
            bucket
                .bookings
                .iter()
                .find(|b| b.owner == owner && b.signature == signature)
                .map(|b| at.max(b.ready_at))
        });
        if let Some(booked_ready) = claim_ready {
            return claim(buckets, stats, request, signature, booked_ready);
        }
        // On some only (the others were reset since): given back there where it can be, as
        // its caller never used it, else left paid; the check pays anew on every bucket.
        for bucket in buckets.iter_mut() {
            if let Some(position) = find_booking(bucket, owner, signature) {
                if !bucket.give_back_booking(position, now) {
                    bucket.remove_booking(position, now);
                }
            }
        }
    }
    // When could every bucket pay?
    let mut ready = now;
    let mut starts: SmallVec<[f64; INLINE_CHECKS]> = SmallVec::new();
    for (bucket, item) in buckets.iter().zip(items) {
        let start = bucket.start_under(&item.check.limit, now);
        starts.push(start);
        ready = ready.max(Bucket::ready_at(
            &item.check.limit,
            item.check.cost,
            start,
            now,
        ));
    }
    stats.paused += u64::from(pause_until > ready);
    ready = ready.max(pause_until);
    if ready <= now {
        stats.admitted += 1;
        pay_all(buckets, items, &starts, now, now, None);
        return Outcome::Admitted;
    }
    let ms = delay_ms(now, ready);
    match mode {
        Mode::Wait { max_wait_ms, .. }
            if ms <= max_wait_ms && buckets.iter().all(|b| b.bookings.len() < MAX_BOOKINGS) =>
        {
            stats.booked += 1;
            let booking = Booking {
                owner,
                signature: items_signature(items),
                cost: 0.0,
                ready_at: ready,
                lapse_at: ready.saturating_add(slack_ns),
                booked_at: now,
                made: 0,
                refund: 0.0,
            };
            pay_all(buckets, items, &starts, now, ready, Some(booking));
            Outcome::Booked(ms)
        }
        _ => {
            for bucket in buckets.iter_mut() {
                bucket.told(now, ready - now);
            }
            if mode == Mode::Probe {
                stats.delayed += 1;
                Outcome::Delay(ms)
            } else {
                stats.over_budget += 1;
                Outcome::OverBudget(ms)
            }
        }
    }
}

/// Pays every item as of `at`, from its `starts` (see [`Bucket::start_under`]), recording
/// `booking` (with each item's cost) if given.
fn pay_all(
    buckets: &mut [&mut Bucket],
    items: &[Item],
    starts: &[f64],
    now: u64,
    at: u64,
    booking: Option<Booking>,
) {
    for ((bucket, item), &start) in buckets.iter_mut().zip(items).zip(starts) {
        let Some(booking) = &booking else {
            bucket.spend(item.check.limit, item.check.cost, start, now);
            bucket.touch(now, 0);
            continue;
        };
        bucket.pay(item.check.limit, item.check.cost, start, now, at);
        bucket.touch(now, at - now);
        let made = bucket
            .bookings
            .iter()
            .map(|b| b.made + 1)
            .max()
            .unwrap_or(0);
        bucket.bookings.push(Booking {
            cost: item.check.cost,
            refund: item.check.cost,
            made,
            ..booking.clone()
        });
    }
}

/// Rounds of [`hold_everywhere`] one claim runs at most; a claim left unsettled answers a
/// delay and runs more when the caller comes back.
const HOLD_ROUNDS: usize = 4;

/// The caller comes back for its booking: admitted from its ready time (which a pause that
/// began since moved after it, `Bucket::hold_bookings`), never charged again.
fn claim(
    buckets: &mut [&mut Bucket],
    stats: &mut Stats,
    request: Request,
    signature: u64,
    booked_ready: u64,
) -> Outcome {
    let Request {
        owner,
        now,
        pause_until,
        ..
    } = request;
    let mut ready = booked_ready.max(pause_until);
    let mut settled = false;
    for _ in 0..HOLD_ROUNDS {
        match hold_everywhere(buckets, owner, signature, ready, now) {
            None => {
                settled = true;
                break;
            }
            Some(later) => ready = later,
        }
    }
    if settled && ready <= now {
        for bucket in buckets.iter_mut() {
            let position = booking_position(bucket, owner, signature);
            bucket.remove_booking(position, now);
            bucket.told(now, 0);
        }
        stats.claimed += 1;
        return Outcome::Claimed;
    }
    for bucket in buckets.iter_mut() {
        // Told to come back at `ready`, the caller finds its booking then on every bucket,
        // also one where the rounds left it due earlier: it does not lapse before its
        // slack past `ready` (else the caller, back as told, would book and pay again).
        let position = booking_position(bucket, owner, signature);
        let booking = &mut bucket.bookings[position];
        let slack_ns = booking.lapse_at.saturating_sub(booking.ready_at);
        booking.lapse_at = booking.lapse_at.max(ready.saturating_add(slack_ns));
        bucket.told(now, ready.saturating_sub(now));
    }
    let outcome = Outcome::Delay(delay_ms(now, ready));
    if outcome.past_budget(request.mode) {
        stats.over_budget += 1;
    } else {
        stats.delayed += 1;
    }
    stats.paused += u64::from(pause_until > now);
    outcome
}

/// Holds the booking until `ready` on each bucket where it is due before (a pause of the
/// check's other buckets moved it there, or the caller comes back under a pause that began
/// since): it goes out at one instant on all of them, paid there as of it. Returns the
/// latest ready time this gave it, or `None` when no bucket had it due before `ready`.
fn hold_everywhere(
    buckets: &mut [&mut Bucket],
    owner: u64,
    signature: u64,
    ready: u64,
    now: u64,
) -> Option<u64> {
    let mut held = None;
    for bucket in buckets.iter_mut() {
        let position = booking_position(bucket, owner, signature);
        if bucket.bookings[position].ready_at < ready {
            let moved = bucket.hold_booking(owner, signature, ready, now);
            held = Some(held.unwrap_or(ready).max(moved));
        }
    }
    held
}

fn booking_position(bucket: &Bucket, owner: u64, signature: u64) -> usize {
    find_booking(bucket, owner, signature).expect("booking found in the planning pass")
}

/// Where `owner`'s booking of `signature` stands in `bucket`, if it holds one.
pub(crate) fn find_booking(bucket: &Bucket, owner: u64, signature: u64) -> Option<usize> {
    bucket
        .bookings
        .iter()
        .position(|b| b.owner == owner && b.signature == signature)
}

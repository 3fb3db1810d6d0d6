//! The sharded bucket table: the buckets of each key behind one of 64 locks, the pauses,
//! the backoff counts, and the operations over them (checks, debt, resets, the sweep).

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};

use hashbrown::HashTable;
use parking_lot::{Mutex, MutexGuard, RwLock, RwLockWriteGuard};
use smallvec::SmallVec;

use crate::backoffs::{exchange_backoff, Backoff, Backoffs};
use crate::bucket::{Balance, Bucket, Previous, MAX_WAIT_NS};
use crate::buckets::{Buckets, Pass, Step};
use crate::busiest::Busiest;
use crate::clock::{Clock, MonotonicClock, NANOS_PER_MS, NANOS_PER_SEC};
use crate::engine::{self, delay_ms, Item, ItemPauses, Request};
use crate::key::{Key, KeyRef, Sought};
use crate::limit::Limit;
use crate::pauses::{Pause, Pauses, TAKE_STEP};
use crate::prepared::{PreparedBucket, PreparedCheck};
use crate::receipt::{Paid, Receipt, TakeBack};
use crate::rules::{self, InvalidInput};
use crate::types::{
    BackoffScope, Caller, Check, Config, KeyInfo, Mode, Outcome, PauseTarget, Stats,
};
use crate::walk::Walk;

const SHARDS: usize = 64;
/// Buckets of one multi-bucket check held on the stack; larger checks (up to
/// [`crate::rules::MAX_CHECKS`]) spill to the heap.
pub(crate) const INLINE_CHECKS: usize = 8;
type Items<'a> = SmallVec<[Item<'a>; INLINE_CHECKS]>;

/// The answer of a check run with no bound on its bookings, which is never left undone.
fn unbounded(answer: Result<Option<Outcome>, InvalidInput>) -> Result<Outcome, InvalidInput> {
    answer.map(|outcome| outcome.unwrap_or_else(|| unreachable!("no bound on bookings")))
}

/// Tells tables apart, for the hashes of prepared buckets.
static NEXT_TABLE_ID: AtomicU64 = AtomicU64::new(0);

#[derive(Default)]
struct Shard {
    buckets: Buckets,
    stats: Stats,
    /// The era of the last bucket made ([`Bucket::seen`]).
    next_era: u32,
}

/// The era for a bucket a shard makes now, from its `next_era`. It wraps after 2^32
/// buckets made in one shard: long after any receipt of the earlier bucket was settled.
fn new_era(next_era: &mut u32) -> u32 {
    *next_era = next_era.wrapping_add(1);
    *next_era
}

#[repr(align(128))]
struct Padded<T>(T);

/// The bucket table. All operations are safe to call from many threads at once; none
/// holds a shard's lock for more than a few hundred buckets' work, nor allocates a table
/// under it (but a shard's first, or one that inserts needed before the one asked for
/// came).
pub struct Table<C: Clock = MonotonicClock> {
    id: u64,
    clock: C,
    config: Config,
    started_at: u64,
    /// foldhash, seeded at random per table: far faster than SipHash on short keys, and
    /// keys of colliding hashes cannot be chosen without the seed. Prepared buckets keep
    /// their hash, so their checks hash nothing.
    hasher: foldhash::fast::RandomState,
    shards: Box<[Padded<Mutex<Shard>>]>,
    pauses: RwLock<Pauses>,
    /// Taken after `pauses` when both are.
    backoffs: Mutex<Backoffs>,
    /// The latest end of any pause: past it, checks skip the pauses.
    pause_horizon: AtomicU64,
    invalid: AtomicU64,
}

impl Table<MonotonicClock> {
    /// An empty table on the machine's monotonic clock.
    pub fn new(config: Config) -> Self {
        Self::with_clock(config, MonotonicClock::new())
    }
}

impl<C: Clock> Table<C> {
    /// An empty table on `clock`.
    pub fn with_clock(config: Config, clock: C) -> Self {
        let started_at = clock.now();
        let hasher = foldhash::fast::RandomState::default();
        Self {
            id: NEXT_TABLE_ID.fetch_add(1, Ordering::Relaxed),
            clock,
            config,
            started_at,
            hasher,
            shards: (0..SHARDS)
                .map(|_| Padded(Mutex::new(Shard::default())))
                .collect(),
            pauses: RwLock::new(Pauses::new(hasher)),
            backoffs: Mutex::new(Backoffs::new(hasher)),
            pause_horizon: AtomicU64::new(0),
            invalid: AtomicU64::new(0),
        }
    }

    /// The options the table was created with.
    pub fn config(&self) -> Config {
        self.config
    }

    fn hash(&self, key: &KeyRef) -> u64 {
        self.hasher.hash_one(key)
    }

    fn shard_index(hash: u64) -> usize {
        // Middle bits: hashbrown uses the lowest for slots and the top 7 for tags.
        (hash >> 40) as usize % SHARDS
    }

    fn lock(&self, hash: u64) -> MutexGuard<'_, Shard> {
        self.shards[Self::shard_index(hash)].0.lock()
    }

    /// Releases a shard's lock, then allocates and gives the table its buckets ask for, if
    /// any.
    fn unlock(mut guard: MutexGuard<'_, Shard>) {
        if guard.buckets.may_want_table() {
            let wanted = guard.buckets.take_wanted();
            let shard = MutexGuard::mutex(&guard);
            drop(guard);
            Self::give_table(shard, wanted);
        }
    }

    /// Allocates a table of `capacity` for `shard`, its lock released, and gives it (freed
    /// after the lock if no longer wanted).
    #[cold]
    fn give_table(shard: &Mutex<Shard>, capacity: Option<usize>) {
        if let Some(capacity) = capacity {
            // Allocated before the lock is taken.
            let fresh = HashTable::with_capacity(capacity);
            let unwanted = shard.lock().buckets.give(fresh);
            drop(unwanted);
        }
    }

    /// How long before `now` a check by `caller` assumes the buckets new to it busy from:
    /// since the later of the table's start (with `assume_busy_at_start`) and the caller's.
    fn busy_for(&self, caller: Caller, now: u64) -> Option<u64> {
        let table = self
            .config
            .assume_busy_at_start
            .then(|| now.saturating_sub(self.started_at));
        match (table, caller.busy_for) {
            (Some(table), Some(own)) => Some(table.min(own)),
            (table, own) => table.or(own),
        }
    }

    /// Tokens a bucket new at `from` starts with: full, or as if empty `busy_for` before
    /// `now`.
    fn initial_tokens(limit: &Limit, from: u64, now: u64, busy_for: Option<u64>) -> f64 {
        match busy_for {
            Some(busy_for) => {
                let busy_then = busy_for.saturating_sub(now.saturating_sub(from));
                (limit.refill_per_sec() * (busy_then as f64 / NANOS_PER_SEC)).min(limit.capacity())
            }
            None => limit.capacity(),
        }
    }

    /// Packs and hashes `key` once, with `limit`, for [`Table::check_prepared`].
    pub fn prepare(&self, key: KeyRef, limit: Limit) -> PreparedBucket {
        PreparedBucket {
            key: key.to_owned_key(),
            hash: self.hash(&key),
            limit,
            table_id: self.id,
        }
    }

    /// Checks one bucket for `caller` (its owner id, for its bookings, or a [`Caller`]).
    pub fn check_rate(&self, caller: impl Into<Caller>, check: Check, mode: Mode) -> Outcome {
        self.check_item(caller.into(), self.item(check), mode, None)
    }

    /// Checks one prepared bucket, as [`Table::check_rate`] checks its key and limit.
    pub fn check_prepared(
        &self,
        caller: impl Into<Caller>,
        bucket: &PreparedBucket,
        cost: f64,
        mode: Mode,
    ) -> Outcome {
        self.check_item(
            caller.into(),
            self.prepared_item(PreparedCheck { bucket, cost }),
            mode,
            None,
        )
    }

    /// Checks several buckets all-or-nothing. Repeated keys are coalesced into one combined
    /// cost; the same key with two definitions is an error and pays nothing.
    pub fn check_rates(
        &self,
        caller: impl Into<Caller>,
        checks: &[Check],
        mode: Mode,
    ) -> Result<Outcome, InvalidInput> {
        unbounded(self.check_rates_within(caller, checks, mode, usize::MAX))
    }

    /// [`Table::check_rates`], left undone (`Ok(None)`, nothing changed but the keys seen,
    /// as a refused check sees them) when its buckets hold more than
    /// `max_bookings` bookings together: each costs the check up to about 100 ns, which a
    /// caller on a scheduler that must not be held long runs elsewhere.
    pub fn check_rates_within(
        &self,
        caller: impl Into<Caller>,
        checks: &[Check],
        mode: Mode,
        max_bookings: usize,
    ) -> Result<Option<Outcome>, InvalidInput> {
        self.check_keys(caller.into(), checks, mode, max_bookings, None)
    }

    /// Checks keys and limits, noting what they paid on `receipt` if given.
    fn check_keys(
        &self,
        caller: Caller,
        checks: &[Check],
        mode: Mode,
        max_bookings: usize,
        receipt: Option<&mut Receipt>,
    ) -> Result<Option<Outcome>, InvalidInput> {
        match checks {
            [] => Ok(Some(Outcome::Admitted)),
            [single] => Ok(Some(self.check_item(
                caller,
                self.item(*single),
                mode,
                receipt,
            ))),
            _ => {
                let mut items = Items::new();
                items.extend(checks.iter().map(|&c| self.item(c)));
                self.check_items(caller, &mut items, mode, max_bookings, receipt)
            }
        }
    }

    /// Checks several prepared buckets all-or-nothing, as [`Table::check_rates`] checks keys and
    /// limits.
    pub fn check_prepared_all(
        &self,
        caller: impl Into<Caller>,
        checks: &[PreparedCheck],
        mode: Mode,
    ) -> Result<Outcome, InvalidInput> {
        unbounded(self.check_prepared_all_within(caller, checks, mode, usize::MAX))
    }

    /// [`Table::check_prepared_all`], left undone as [`Table::check_rates_within`] leaves
    /// a check.
    pub fn check_prepared_all_within(
        &self,
        caller: impl Into<Caller>,
        checks: &[PreparedCheck],
        mode: Mode,
        max_bookings: usize,
    ) -> Result<Option<Outcome>, InvalidInput> {
        let caller = caller.into();
        match checks {
            [] => Ok(Some(Outcome::Admitted)),
            [single] => Ok(Some(self.check_item(
                caller,
                self.prepared_item(*single),
                mode,
                None,
            ))),
            _ => {
                let mut items = Items::new();
                items.extend(checks.iter().map(|&c| self.prepared_item(c)));
                self.check_items(caller, &mut items, mode, max_bookings, None)
            }
        }
    }

    fn item<'a>(&self, check: Check<'a>) -> Item<'a> {
        Item {
            check,
            hash: self.hash(&check.key),
            packed: None,
            slot: 0,
        }
    }

    /// The item of a prepared check; a bucket prepared by another table is hashed again.
    fn prepared_item<'a>(&self, check: PreparedCheck<'a>) -> Item<'a> {
        let PreparedCheck { bucket, cost } = check;
        let key = bucket.key.as_ref();
        let hash = if bucket.table_id == self.id {
            bucket.hash
        } else {
            self.hash(&key)
        };
        Item {
            check: Check {
                key,
                limit: bucket.limit,
                cost,
            },
            hash,
            packed: Some(&bucket.key),
            slot: 0,
        }
    }

    /// [`Table::check_rates`], noting what it paid on each bucket, for
    /// [`Table::give_back`].
    pub fn check_rates_receipted(
        &self,
        caller: impl Into<Caller>,
        checks: &[Check],
        mode: Mode,
    ) -> Result<(Outcome, Receipt), InvalidInput> {
        let mut receipt = Receipt::default();
        let checked = self.check_keys(caller.into(), checks, mode, usize::MAX, Some(&mut receipt));
        Ok((unbounded(checked)?, receipt))
    }

    /// Takes back what checks and debits paid ([`Table::check_rates_receipted`],
    /// [`Table::record_request_receipted`]), given in the order they were paid; returns
    /// which it took back, each on all its buckets or none. First,
    /// latest first, those whose buckets nothing moved since (but payments taken back):
    /// each is put back as it was. Then, first paid first, those whose buckets payments,
    /// debits, refusals and refunds alone moved: each gives back as far as the buckets
    /// without it would hold it now ([`Bucket::refundable`]; a refund of an earlier payment
    /// counts, so these go first), nothing on a bucket swept or reset since. Never once
    /// anything else (a sync, a redefinition, a booking) moved a bucket.
    pub fn give_back(&self, receipts: Vec<Receipt>) -> Vec<bool> {
        let mut given = vec![false; receipts.len()];
        for (receipt, given) in receipts.iter().zip(&mut given).rev() {
            *given = self.take_back(receipt, false);
        }
        for (receipt, given) in receipts.iter().zip(&mut given) {
            *given = *given || self.take_back(receipt, true);
        }
        given
    }

    /// Takes back `receipt`'s payment on all its buckets, or none: whole where nothing moved
    /// them, else (if `refund`) as far as [`Bucket::refundable`] allows.
    fn take_back(&self, receipt: &Receipt, refund: bool) -> bool {
        if !receipt.can_give_back() {
            return false;
        }
        // Shards in ascending order, as a check locks them.
        let mut paid: SmallVec<[&Paid; INLINE_CHECKS]> = receipt.paid().iter().collect();
        paid.sort_by_key(|paid| Self::shard_index(paid.hash));
        let mut guards: SmallVec<[(usize, MutexGuard<Shard>); INLINE_CHECKS]> = SmallVec::new();
        for paid in &paid {
            let index = Self::shard_index(paid.hash);
            if guards.last().is_none_or(|(locked, _)| *locked != index) {
                guards.push((index, self.shards[index].0.lock()));
            }
        }
        let now = self.clock.now();
        let mut ways: SmallVec<[TakeBack; INLINE_CHECKS]> = SmallVec::new();
        for paid in &paid {
            let how = match Self::paid_bucket(&mut guards, paid) {
                Some(bucket) => paid.take_back_from(bucket, refund, now),
                // Swept (it was full) or reset since: nothing of the payment is left.
                None => refund.then_some(TakeBack::Refund(0.0)),
            };
            match how {
                Some(how) => ways.push(how),
                None => return false,
            }
        }
        for (paid, how) in paid.iter().zip(ways) {
            if let Some(bucket) = Self::paid_bucket(&mut guards, paid) {
                paid.take_back(bucket, how);
            }
        }
        true
    }

    /// The bucket `paid` was paid on, in its locked shard among `guards`.
    fn paid_bucket<'g>(
        guards: &'g mut [(usize, MutexGuard<Shard>)],
        paid: &Paid,
    ) -> Option<&'g mut Bucket> {
        let index = Self::shard_index(paid.hash);
        let (_, shard) = guards.iter_mut().find(|(locked, _)| *locked == index)?;
        shard.buckets.find_mut(paid.hash, Sought::Packed(&paid.key))
    }

    fn check_item(
        &self,
        caller: Caller,
        item: Item,
        mode: Mode,
        receipt: Option<&mut Receipt>,
    ) -> Outcome {
        let mut guard = self.lock(item.hash);
        let (request, pauses) = self.request(std::slice::from_ref(&item), caller, mode);
        let shard = &mut *guard;
        let bucket = self.bucket(&mut shard.buckets, &mut shard.next_era, &item, request.now);
        let before = receipt.as_ref().and_then(|_| bucket.balance());
        let items = std::slice::from_ref(&item);
        let mut buckets = [bucket];
        let outcome = Self::defining(&mut buckets, items, &request, |buckets| {
            Some(engine::decide(
                buckets,
                items,
                &mut shard.stats,
                request,
                &pauses,
            ))
        });
        let outcome = outcome.expect("a single check is always decided");
        if let Some(receipt) = receipt.filter(|_| outcome.paid()) {
            receipt.note(buckets[0], before, item.check.cost);
        }
        Self::unlock(guard);
        outcome
    }

    /// Runs `decide` over `buckets` (aligned with `items`), those that start as new under
    /// their item's definition (without one, or as new under another) given it for the
    /// check, and their own back if it pays nothing (or is not decided): a refused call
    /// changes no key's definition.
    fn defining(
        buckets: &mut [&mut Bucket],
        items: &[Item],
        request: &Request,
        decide: impl FnOnce(&mut [&mut Bucket]) -> Option<Outcome>,
    ) -> Option<Outcome> {
        // What each bucket given a definition had (usually none is).
        let previous: SmallVec<[(usize, Previous); 2]> = buckets
            .iter_mut()
            .zip(items)
            .enumerate()
            .filter_map(|(at, (bucket, item))| Some((at, Self::define(bucket, item, request)?)))
            .collect();
        let outcome = decide(buckets);
        if !outcome.is_some_and(Outcome::paid) {
            for (at, previous) in previous {
                buckets[at].restore(previous, request.now);
            }
        }
        outcome
    }

    /// The multi-bucket check; left undone when its buckets hold more than `max_bookings`.
    fn check_items(
        &self,
        caller: Caller,
        items: &mut [Item],
        mode: Mode,
        max_bookings: usize,
        receipt: Option<&mut Receipt>,
    ) -> Result<Option<Outcome>, InvalidInput> {
        let kept = self.in_lock_order(items)?;
        let items = &mut items[..kept];
        let mut guards: SmallVec<[MutexGuard<Shard>; INLINE_CHECKS]> = SmallVec::new();
        let mut locked = usize::MAX;
        for item in items.iter_mut() {
            let index = Self::shard_index(item.hash);
            if index != locked {
                guards.push(self.shards[index].0.lock());
                locked = index;
            }
            item.slot = guards.len() - 1;
        }
        let (request, pauses) = self.request(items, caller, mode);
        let mut found = Self::find_buckets(&mut guards, items);
        if found.len() < items.len() {
            // First seen: created first, then looked up again (creating may move others).
            for item in items.iter() {
                let Shard {
                    buckets, next_era, ..
                } = &mut *guards[item.slot];
                self.bucket(buckets, next_era, item, request.now);
            }
            found = Self::find_buckets(&mut guards, items);
        }
        let mut buckets: SmallVec<[&mut Bucket; INLINE_CHECKS]> = SmallVec::new();
        for bucket in found {
            // SAFETY: the items are coalesced, so each pointer is to a different bucket. No
            // bucket moves until the check ends: the shards stay locked, and nothing is
            // inserted or removed after the look-ups. The buckets live in their tables'
            // allocations, apart from the shards' other fields (the stats borrowed below).
            buckets.push(unsafe { &mut *bucket });
        }
        let before: SmallVec<[Option<Balance>; INLINE_CHECKS]> = match receipt {
            Some(_) => buckets.iter().map(|bucket| bucket.balance()).collect(),
            None => SmallVec::new(),
        };
        let stats = &mut guards[0].stats;
        let outcome = Self::defining(&mut buckets, items, &request, |buckets| {
            let bookings: usize = buckets.iter().map(|bucket| bucket.bookings.len()).sum();
            (bookings <= max_bookings)
                .then(|| engine::decide(buckets, items, stats, request, &pauses))
        });
        if let Some(receipt) = receipt.filter(|_| outcome.is_some_and(Outcome::paid)) {
            for ((bucket, before), item) in buckets.iter().zip(before).zip(items.iter()) {
                receipt.note(bucket, before, item.check.cost);
            }
        }
        // Every lock released before any table is allocated.
        let wanted: SmallVec<[(&Mutex<Shard>, Option<usize>); 1]> = guards
            .iter_mut()
            .filter(|guard| guard.buckets.may_want_table())
            .map(|guard| (MutexGuard::mutex(guard), guard.buckets.take_wanted()))
            .collect();
        drop(guards);
        for (shard, capacity) in wanted {
            Self::give_table(shard, capacity);
        }
        Ok(outcome)
    }

    /// Sorts `items` with their shards in ascending order, the order every multi-bucket
    /// check locks them in, and coalesces each key's checks (adjacent, first given first:
    /// the sort is stable) into the first `n` items; returns `n`.
    fn in_lock_order(&self, items: &mut [Item]) -> Result<usize, InvalidInput> {
        items.sort_by(|a, b| {
            (Self::shard_index(a.hash), a.hash, a.check.key).cmp(&(
                Self::shard_index(b.hash),
                b.hash,
                b.check.key,
            ))
        });
        let same_key = |a: &Item, b: &Item| a.hash == b.hash && a.check.key == b.check.key;
        engine::merge_runs(items, |item| &mut item.check, same_key)
            .inspect_err(|_| self.count_invalid())
    }

    /// Takes back `caller`'s booking of `checks` (as [`Table::check_rates`] made it) on
    /// each of their buckets where it is the latest booking held, as
    /// [`Bucket::give_back_booking`] does: its caller was told the store was unavailable
    /// and will not claim it. Returns whether any bucket got it back.
    pub fn unbook(
        &self,
        caller: impl Into<Caller>,
        checks: &[Check],
    ) -> Result<bool, InvalidInput> {
        let owner = caller.into().owner;
        let mut items = Items::new();
        items.extend(checks.iter().map(|&c| self.item(c)));
        let kept = self.in_lock_order(&mut items)?;
        let items = &items[..kept];
        let signature = engine::items_signature(items);
        let mut given = false;
        let mut locked: Option<(usize, MutexGuard<Shard>)> = None;
        for item in items {
            let index = Self::shard_index(item.hash);
            if locked.as_ref().is_none_or(|(at, _)| *at != index) {
                // Shards in ascending order, one at a time.
                drop(locked.take());
                locked = Some((index, self.shards[index].0.lock()));
            }
            let Some((_, shard)) = locked.as_mut() else {
                continue;
            };
            let now = self.clock.now();
            let Some(bucket) = shard.buckets.find_mut(item.hash, item.sought()) else {
                continue;
            };
            if let Some(position) = engine::find_booking(bucket, owner, signature) {
                given |= bucket.give_back_booking(position, now);
            }
        }
        Ok(given)
    }

    /// The buckets of `items` that their shards hold; stops at the first missing one.
    fn find_buckets(
        shards: &mut [MutexGuard<Shard>],
        items: &[Item],
    ) -> SmallVec<[*mut Bucket; INLINE_CHECKS]> {
        let mut found = SmallVec::new();
        for item in items {
            let buckets = &mut shards[item.slot].buckets;
            let Some(bucket) = buckets.find_mut(item.hash, item.sought()) else {
                break;
            };
            found.push(bucket as *mut Bucket);
        }
        found
    }

    /// What a check of `items` needs besides its buckets, as of now, and the end of the
    /// pause covering each item (none when no pause lasts past now). Called with the
    /// buckets' shards locked: a caller preempted before the lock reads the time after it,
    /// so no bucket is ever paid as of an instant before its last payment.
    fn request(&self, items: &[Item], caller: Caller, mode: Mode) -> (Request, ItemPauses) {
        let now = self.clock.now();
        let pauses = self.pauses_of(items, now);
        let request = Request {
            owner: caller.owner,
            mode,
            now,
            busy_for: self.busy_for(caller, now),
            pause_until: pauses.iter().copied().max().unwrap_or(0),
            slack_ns: match mode {
                Mode::Wait {
                    booking_slack_ms: Some(ms),
                    ..
                } => ms,
                _ => self.config.booking_slack_ms,
            }
            .saturating_mul(NANOS_PER_MS),
        };
        (request, pauses)
    }

    /// The bucket of `item`, created (seen now, without a definition) if needed.
    fn bucket<'s>(
        &self,
        buckets: &'s mut Buckets,
        next_era: &mut u32,
        item: &Item,
        now: u64,
    ) -> &'s mut Bucket {
        buckets.get_or_insert_with(item.hash, item.sought(), || {
            let era = new_era(next_era);
            Bucket::seen(item.check.key.to_owned_key(), item.hash, now, era)
        })
    }

    /// Gives a bucket that starts as new under the item's definition that definition, for
    /// the check (taken back if it pays nothing): the tokens a new bucket starts with, from
    /// [`Bucket::starts_new`], less the debt.
    fn define(bucket: &mut Bucket, item: &Item, request: &Request) -> Option<Previous> {
        let mut from = bucket.starts_new(&item.check.limit, request.now)?;
        if let Some(busy_for) = request.busy_for {
            // New before the busy start (seen by another caller): as new at that start.
            from = from.max(request.now.saturating_sub(busy_for));
        }
        let tokens = Self::initial_tokens(&item.check.limit, from, request.now, request.busy_for);
        Some(bucket.define(item.check.limit, tokens, from))
    }

    /// Debits `cost` from `key` without checking (usage spent elsewhere). On a key without
    /// a definition the debt waits for its first check.
    pub fn record_request(&self, key: KeyRef, cost: f64) {
        self.debit(key, cost, None);
    }

    /// [`Table::record_request`], noting what it debited, for [`Table::give_back`] (nothing
    /// on a key no check or debit made before).
    pub fn record_request_receipted(&self, key: KeyRef, cost: f64) -> Receipt {
        let mut receipt = Receipt::default();
        self.debit(key, cost, Some(&mut receipt));
        receipt
    }

    fn debit(&self, key: KeyRef, cost: f64, receipt: Option<&mut Receipt>) {
        let hash = self.hash(&key);
        let mut shard = self.lock(hash);
        let now = self.clock.now();
        shard.stats.debited += 1;
        match shard.buckets.find_mut(hash, Sought::Parts(key)) {
            Some(bucket) => {
                let before = receipt.as_ref().and_then(|_| bucket.balance());
                bucket.debit(cost, now);
                if let Some(receipt) = receipt {
                    receipt.note(bucket, before, cost);
                }
            }
            None => {
                let era = new_era(&mut shard.next_era);
                let bucket = Bucket::debt_only(key.to_owned_key(), hash, cost, now, era);
                shard.buckets.insert(bucket);
            }
        }
        Self::unlock(shard);
    }

    /// Brings `key`'s bucket in line with an exchange that allows only `allowance` more
    /// cost until its window ends in `window_left_ms`: the tokens are lowered so that they
    /// plus the refill until then fit the allowance, less the bookings due by then (paid
    /// here, but not yet sent, so not in the exchange's count); those the allowance cannot
    /// cover, first made first, go out once the window ends. A negative allowance (the
    /// exchange counted more than its limit) allows nothing until the window ends, and no
    /// debt past it: the exchange forgets its count then. Never raises the tokens; a key
    /// without a definition is left alone. Returns the tokens taken.
    pub fn sync(&self, key: KeyRef, allowance: f64, window_left_ms: u64) -> f64 {
        let hash = self.hash(&key);
        let mut shard = self.lock(hash);
        let now = self.clock.now();
        let Some(bucket) = shard.buckets.find_mut(hash, Sought::Parts(key)) else {
            return 0.0;
        };
        let Some(limit) = bucket.limit else {
            return 0.0;
        };
        let before = bucket.tokens(now);
        let refill = limit.refill_per_sec() * window_left_ms as f64 / 1000.0;
        let window_end = now.saturating_add(window_left_ms.saturating_mul(NANOS_PER_MS));
        bucket.hold_bookings_beyond(allowance, window_end, now);
        let booked = bucket.booked_before(window_end, now);
        bucket.lower_to(allowance.max(0.0) - refill - booked, booked, now);
        before - bucket.tokens(now)
    }

    /// Tokens borrowed from `key`'s bucket now: 0 for an unknown key.
    pub fn get_cost(&self, key: KeyRef) -> f64 {
        let hash = self.hash(&key);
        let now = self.clock.now();
        let shard = self.lock(hash);
        shard
            .buckets
            .find(hash, Sought::Parts(key))
            .map_or(0.0, |bucket| bucket.borrowed(now))
    }

    /// A snapshot of `key` (of a pause alone, for a key without a bucket that a pause
    /// covers), or `None` if the table holds nothing for it.
    pub fn inspect(&self, key: KeyRef) -> Option<KeyInfo> {
        let hash = self.hash(&key);
        let now = self.clock.now();
        let pause_ms = self.pause_ms(&key, hash, now);
        let mut shard = self.lock(hash);
        let Some(bucket) = shard.buckets.find_mut(hash, Sought::Parts(key)) else {
            return pause_ms.map(KeyInfo::paused);
        };
        Some(info(bucket, now, pause_ms))
    }

    /// The `count` busy keys (borrowing, or holding bookings) with the most tokens borrowed,
    /// busiest first. Copies of at most `2 * count` keys are held at once (the rows of the
    /// shard being walked apart), whatever the table's size.
    pub fn busiest(&self, count: usize) -> Vec<(Key, KeyInfo)> {
        let mut busiest = BusiestRows::new(count);
        // A few hundred buckets per lock, as the sweep does.
        self.retain(&mut busiest);
        let now = self.clock.now();
        let mut rows = busiest.walked.into_rows();
        for (key, info) in &mut rows {
            let key = key.as_ref();
            info.pause_ms = self.pause_ms(&key, self.hash(&key), now);
        }
        rows
    }

    /// Forgets `key`: its bucket, its bookings and a pause on that key alone.
    pub fn reset(&self, key: KeyRef) {
        let hash = self.hash(&key);
        let mut shard = self.lock(hash);
        let bucket = shard.buckets.take(hash, Sought::Parts(key));
        Self::unlock(shard);
        drop(bucket);
        self.pauses.write().remove_key(&key, hash);
    }

    /// Walks every bucket a few hundred at a time, dropping those `walk` refuses, and
    /// shrinks shards whose occupancy fell. Every bucket held throughout is visited.
    /// Returns how many buckets were dropped.
    fn retain(&self, walk: &mut impl Walk) -> usize {
        let mut dropped = 0;
        for shard in self.shards.iter() {
            let mut pass = Pass::default();
            loop {
                let mut guard = shard.0.lock();
                let now = self.clock.now();
                let Shard { buckets, stats, .. } = &mut *guard;
                let before = buckets.len();
                let step = buckets.retain_step(&mut pass, |bucket| walk.visit(bucket, now, stats));
                dropped += before - buckets.len();
                let (emptied, wanted) = (buckets.take_emptied(), buckets.take_wanted());
                // Straight to a waiting check, if any: otherwise this loop would take the
                // lock again before the woken check runs.
                MutexGuard::unlock_fair(guard);
                drop(emptied);
                Self::give_table(&shard.0, wanted);
                match step {
                    Step::Next => {}
                    Step::Restart => walk.restart_shard(),
                    Step::Done => break,
                }
            }
            walk.end_shard();
        }
        dropped
    }

    /// Forgets every key and pause of `exchange`, a few hundred buckets at a time.
    pub fn reset_exchange(&self, exchange: &[u8]) {
        self.retain(&mut |bucket: &mut Bucket, _, _: &mut Stats| bucket.key.exchange() != exchange);
        self.end_pauses(|pauses| pauses.take_of_exchange(exchange));
        self.backoffs.lock().remove_exchange(exchange);
    }

    /// Forgets every bucket, pause and backoff count, but not the statistics. Each shard's buckets are freed after its lock
    /// is released.
    pub fn reset_all(&self) {
        for shard in self.shards.iter() {
            let buckets = shard.0.lock().buckets.take_all();
            drop(buckets);
        }
        // Freed after the lock is let go.
        let pauses = self.pauses.write().take();
        drop(pauses);
        self.backoffs.lock().clear();
    }

    /// Drops buckets that behave exactly as new ones (full, idle, no bookings but lapsed
    /// ones, no debt), ended pauses and lapsed backoff counts, and shrinks shards whose
    /// occupancy fell. Returns how many buckets were dropped. The lapsed bookings of a
    /// bucket kept are left to its next check: when they are dropped shapes what the
    /// others give back (see [`Bucket::drop_lapsed`]), and a bucket kept answers as if no
    /// sweep had run.
    pub fn sweep(&self) -> usize {
        let dropped = self.retain(&mut |bucket: &mut Bucket, now, stats: &mut Stats| {
            let sweepable = bucket.sweepable(now);
            if sweepable {
                stats.lapsed += bucket.bookings.len() as u64;
            }
            !sweepable
        });
        let now = self.clock.now();
        self.end_pauses(|pauses| pauses.take_ended(now));
        self.backoffs.lock().drop_lapsed(now);
        dropped
    }

    /// Ends the pauses `step` takes out, a step at a time: checks waiting on the pauses'
    /// lock get it between steps, and what a step took is freed once the lock is let go.
    fn end_pauses(&self, step: impl Fn(&mut Pauses) -> Vec<Pause>) {
        loop {
            let mut pauses = self.pauses.write();
            let ended = step(&mut pauses);
            RwLockWriteGuard::unlock_fair(pauses);
            let more = ended.len() == TAKE_STEP;
            drop(ended);
            if !more {
                break;
            }
        }
    }

    /// Holds every bucket of `target` for `ms` milliseconds: nothing is admitted until
    /// then; waiters book behind the pause. Overlapping pauses keep the later end. Past
    /// [`crate::rules::MAX_PAUSES`] pauses of keys and credentials (ended ones count until
    /// the next sweep), a new one holds its whole exchange; past as many of exchanges, a
    /// new exchange pause holds every exchange.
    pub fn pause(&self, target: PauseTarget, ms: u64) {
        let now = self.clock.now();
        let until = now.saturating_add(ms.saturating_mul(NANOS_PER_MS).min(MAX_WAIT_NS));
        let mut pauses = self.pauses.write();
        let ended = pauses.add(&target, until, now);
        self.pause_horizon.fetch_max(until, Ordering::SeqCst);
        drop(pauses);
        drop(ended);
    }

    /// Counts a limited reply without a usable wait for `exchange`'s `credential` (`None`:
    /// the public pool) and pauses `scope` for the backoff: [`rules::backoff_ms`] of the
    /// consecutive replies counted before this one (which lapse
    /// [`rules::BACKOFF_LAPSE_MS`] after the last). A credential's replies count for it;
    /// replies limiting the whole exchange (its IP) count for the exchange, whichever
    /// credential they came to. A reply that comes while the last backoff's pause still
    /// holds is not counted: its request was sent before that pause. Returns the pause in
    /// milliseconds.
    pub fn back_off(&self, exchange: &[u8], credential: Option<&[u8]>, scope: BackoffScope) -> u64 {
        let (counted, target) = match scope {
            BackoffScope::Credential => (
                KeyRef::new(exchange, credential, b""),
                PauseTarget::Credential(exchange.to_vec(), credential.map(<[u8]>::to_vec)),
            ),
            BackoffScope::Exchange => (
                exchange_backoff(exchange),
                PauseTarget::Exchange(exchange.to_vec()),
            ),
        };
        let mut pauses = self.pauses.write();
        let mut backoffs = self.backoffs.lock();
        let now = self.clock.now();
        let backoff = backoffs.get(&counted, now);
        // A reply that comes back while the last backoff's pause holds was sent before it:
        // paused again as long, it does not count (one burst of replies is one backoff).
        let counts = backoff.held_until <= now;
        let level = if counts {
            backoff.count
        } else {
            backoff.count.saturating_sub(1)
        };
        let ms = rules::backoff_ms(level);
        let until = now.saturating_add(ms * NANOS_PER_MS);
        let ended = pauses.add(&target, until, now);
        self.pause_horizon.fetch_max(until, Ordering::SeqCst);
        let backoff = Backoff {
            count: backoff.count.saturating_add(u32::from(counts)),
            held_until: backoff.held_until.max(until),
        };
        backoffs.set(&counted, backoff, now);
        drop(backoffs);
        drop(pauses);
        drop(ended);
        ms
    }

    /// Forgets the backoff counts of `exchange`'s `credential` and of the whole exchange (a
    /// reply that went through): the next backoff of either is the first. A count whose
    /// last pause still holds is kept: the reply's request was sent before that pause.
    pub fn reset_backoff(&self, exchange: &[u8], credential: Option<&[u8]>) {
        let mut backoffs = self.backoffs.lock();
        let now = self.clock.now();
        backoffs.remove_unless_held(&KeyRef::new(exchange, credential, b""), now);
        backoffs.remove_unless_held(&exchange_backoff(exchange), now);
    }

    /// The end of the latest pause covering each of `items` (0 for none); none at all
    /// when no pause lasts past `now`.
    fn pauses_of(&self, items: &[Item], now: u64) -> ItemPauses {
        if self.pause_horizon.load(Ordering::Relaxed) <= now {
            return ItemPauses::new();
        }
        let pauses = self.pauses.read();
        items
            .iter()
            .map(|item| pauses.until(&item.check.key, item.hash))
            .collect()
    }

    fn pause_ms(&self, key: &KeyRef, hash: u64, now: u64) -> Option<u64> {
        let until = self.pauses.read().until(key, hash);
        (until > now).then(|| delay_ms(now, until))
    }

    /// Counts a malformed request that an adapter refused before reaching the table.
    pub fn count_invalid(&self) {
        self.invalid.fetch_add(1, Ordering::Relaxed);
    }

    /// Counters since creation, and the live buckets and bookings now.
    pub fn stats(&self) -> Stats {
        let mut total = Stats {
            invalid: self.invalid.load(Ordering::Relaxed),
            ..Stats::default()
        };
        for shard in self.shards.iter() {
            let shard = shard.0.lock();
            let s = &shard.stats;
            total.admitted += s.admitted;
            total.claimed += s.claimed;
            total.delayed += s.delayed;
            total.booked += s.booked;
            total.over_budget += s.over_budget;
            total.lapsed += s.lapsed;
            total.paused += s.paused;
            total.debited += s.debited;
            total.buckets += shard.buckets.len() as u64;
        }
        // Bookings are counted a few hundred buckets per lock, as the sweep does; those
        // lapsed, left for their bucket's next check, are not.
        let mut bookings = HeldBookings::default();
        self.retain(&mut bookings);
        total.bookings = bookings.walked;
        total
    }
}

/// What `bucket` holds at `now`; lapsed bookings left for its next check are not shown.
fn info(bucket: &Bucket, now: u64, pause_ms: Option<u64>) -> KeyInfo {
    let tokens = bucket.tokens(now);
    let held = || bucket.bookings.iter().filter(|b| b.lapse_at >= now);
    KeyInfo {
        limit: bucket.limit,
        tokens,
        borrowed: bucket.borrowed(now),
        debt: if bucket.limit.is_some() {
            (-tokens).max(0.0)
        } else {
            bucket.pending_debt()
        },
        bookings: held().count(),
        // A fold from +0.0: an empty `sum()` of floats is -0.0.
        booked_cost: held().fold(0.0, |total, b| total + b.cost),
        next_ready_ms: held()
            .map(|b| b.ready_at)
            .min()
            .map(|at| at.saturating_sub(now).div_ceil(NANOS_PER_MS)),
        pause_ms,
    }
}

/// `busiest`'s walk: the busiest rows of the shards walked, and apart those of the shard
/// being walked, so that a shard walked again counts once.
struct BusiestRows {
    count: usize,
    walked: Busiest<Key>,
    shard: Busiest<Key>,
}

impl BusiestRows {
    fn new(count: usize) -> Self {
        Self {
            count,
            walked: Busiest::new(count),
            shard: Busiest::new(count),
        }
    }
}

impl Walk for BusiestRows {
    fn visit(&mut self, bucket: &mut Bucket, now: u64, _: &mut Stats) -> bool {
        self.shard
            .offer(info(bucket, now, None), || bucket.key.clone());
        true
    }

    fn restart_shard(&mut self) {
        self.shard = Busiest::new(self.count);
    }

    fn end_shard(&mut self) {
        let shard = std::mem::replace(&mut self.shard, Busiest::new(self.count));
        self.walked.absorb(shard);
    }
}

/// `stats`' walk: the bookings held (those lapsed, left for their bucket's next check, are
/// not), counted apart for the shard being walked.
#[derive(Default)]
struct HeldBookings {
    walked: u64,
    shard: u64,
}

impl Walk for HeldBookings {
    fn visit(&mut self, bucket: &mut Bucket, now: u64, _: &mut Stats) -> bool {
        self.shard += bucket.bookings.iter().filter(|b| b.lapse_at >= now).count() as u64;
        true
    }

    fn restart_shard(&mut self) {
        self.shard = 0;
    }

    fn end_shard(&mut self) {
        self.walked += std::mem::take(&mut self.shard);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use proptest::prelude::*;

    /// What `busiest` answered when it sorted every busy row: a stable sort, cut to `count`.
    fn sorted(table: &Table<ManualClock>, count: usize) -> Vec<(Key, KeyInfo)> {
        let mut rows = Vec::new();
        table.retain(&mut |bucket: &mut Bucket, now, _: &mut Stats| {
            let info = info(bucket, now, None);
            if info.borrowed > 0.0 || info.bookings > 0 {
                rows.push((bucket.key.clone(), info));
            }
            true
        });
        rows.sort_by(|a, b| b.1.borrowed.total_cmp(&a.1.borrowed));
        rows.truncate(count);
        let now = table.clock.now();
        for (key, info) in &mut rows {
            let key = key.as_ref();
            info.pause_ms = table.pause_ms(&key, table.hash(&key), now);
        }
        rows
    }

    #[derive(Debug, Clone)]
    enum Op {
        Check { key: usize, cost: u8, wait: bool },
        Debit { key: usize, cost: u8 },
        Pause { key: usize, ms: u64 },
        Advance { ms: u64 },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0usize..48, 1u8..4, any::<bool>()).prop_map(|(key, cost, wait)| Op::Check {
                key,
                cost,
                wait
            }),
            (0usize..48, 1u8..4).prop_map(|(key, cost)| Op::Debit { key, cost }),
            (0usize..48, 1u64..3000).prop_map(|(key, ms)| Op::Pause { key, ms }),
            (0u64..1500).prop_map(|ms| Op::Advance { ms }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn busiest_answers_as_sorting_every_busy_row(ops in prop::collection::vec(op(), 1..300)) {
            let clock = ManualClock::new();
            let table = Table::with_clock(Config::default(), clock.clone());
            let credentials: Vec<String> = (0..48).map(|i| format!("key-{}", i / 3)).collect();
            let axes: [&[u8]; 3] = [b"request", b"order", b"ip"];
            let key = |i: usize| KeyRef::new(b"ex", Some(credentials[i].as_bytes()), axes[i % 3]);
            // Small capacities, so that many buckets borrow as much.
            let limits = [Limit::new(2.0, 1.0).unwrap(), Limit::new(4.0, 0.5).unwrap()];
            for op in ops {
                match op {
                    Op::Check { key: i, cost, wait } => {
                        let mode = if wait {
                            Mode::Wait { max_wait_ms: 5000, booking_slack_ms: None }
                        } else {
                            Mode::Probe
                        };
                        let check = Check { key: key(i), limit: limits[i % 2], cost: f64::from(cost) };
                        table.check_rate(1, check, mode);
                    }
                    Op::Debit { key: i, cost } => table.record_request(key(i), f64::from(cost)),
                    Op::Pause { key: i, ms } => {
                        table.pause(PauseTarget::Key(key(i).to_owned_key()), ms)
                    }
                    Op::Advance { ms } => clock.advance_ms(ms),
                }
            }
            for count in [1, 2, 3, 7, 20, 48, 100, rules::MAX_BUSIEST] {
                prop_assert_eq!(table.busiest(count), sorted(&table, count));
            }
        }
    }
}

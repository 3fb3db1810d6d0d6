//! The sharded bucket table: checks, bookings, debt, pauses, resets and the sweep.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};

use hashbrown::HashTable;
use parking_lot::{Mutex, MutexGuard, RwLock};

use crate::bucket::{Booking, Bucket, MAX_WAIT_NS};
use crate::clock::{Clock, MonotonicClock, NANOS_PER_MS, NANOS_PER_SEC};
use crate::key::{Key, KeyRef};
use crate::limit::Limit;
use crate::rules::{self, InvalidInput, DEFAULT_BOOKING_SLACK_MS};

const SHARDS: usize = 64;

/// Options fixed when a table is created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// Buckets first seen within their fill time after start begin as if empty at start.
    pub assume_busy_at_start: bool,
    /// How long past its ready time a booking may still be claimed.
    pub booking_slack_ms: u64,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            assume_busy_at_start: false,
            booking_slack_ms: DEFAULT_BOOKING_SLACK_MS,
        }
    }
}

/// One bucket of a check: `cost` tokens from `key`'s bucket defined by `limit`.
#[derive(Debug, Clone, Copy)]
pub struct Check<'a> {
    /// The bucket's key.
    pub key: KeyRef<'a>,
    /// The bucket's definition.
    pub limit: Limit,
    /// Tokens to pay, `>= 0`.
    pub cost: f64,
}

/// How the caller treats a delay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Asks only: a delay pays and reserves nothing.
    Probe,
    /// Will sleep the delay and come back: a delay within `max_wait_ms` is booked.
    Wait {
        /// The longest delay the caller accepts, in milliseconds.
        max_wait_ms: u64,
    },
}

/// The answer to a check. Delays are whole milliseconds, rounded up, at least 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Paid now on every bucket.
    Admitted,
    /// Admitted against the caller's own booking, without a second charge.
    Claimed,
    /// Not admitted; nothing paid (a probe's refusal, or a booking not ready yet).
    Delay(u64),
    /// Paid and booked: the caller's booking is ready in this many milliseconds.
    Booked(u64),
    /// The wait exceeds the caller's budget; nothing paid.
    OverBudget(u64),
}

/// What a pause applies to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PauseTarget {
    /// Every key of an exchange.
    Exchange(Vec<u8>),
    /// An exchange's credential; `None` is the public pool.
    Credential(Vec<u8>, Option<Vec<u8>>),
    /// One key.
    Key(Key),
}

impl PauseTarget {
    fn covers(&self, key: &KeyRef) -> bool {
        match self {
            Self::Exchange(exchange) => key.exchange == exchange.as_slice(),
            Self::Credential(exchange, credential) => {
                key.exchange == exchange.as_slice() && key.credential == credential.as_deref()
            }
            Self::Key(paused) => paused.as_ref() == *key,
        }
    }

    /// The exchange the pause applies to.
    pub fn exchange(&self) -> &[u8] {
        match self {
            Self::Exchange(exchange) | Self::Credential(exchange, _) => exchange,
            Self::Key(key) => key.exchange(),
        }
    }
}

/// Counters since the table was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Checks paid now.
    pub admitted: u64,
    /// Checks admitted against the caller's booking.
    pub claimed: u64,
    /// Delays answered without paying.
    pub delayed: u64,
    /// Waiters booked.
    pub booked: u64,
    /// Waiters refused because the delay exceeded their budget.
    pub over_budget: u64,
    /// Bookings not claimed within the slack.
    pub lapsed: u64,
    /// Answers (delays, bookings, refusals) held back by a pause.
    pub paused: u64,
    /// Costs debited without checking.
    pub debited: u64,
    /// Malformed requests refused.
    pub invalid: u64,
    /// Buckets held now.
    pub buckets: u64,
    /// Bookings held now.
    pub bookings: u64,
}

/// A snapshot of one key.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyInfo {
    /// The key's definition; `None` while it has only `record` debt.
    pub limit: Option<Limit>,
    /// Tokens now, capped at the capacity; negative while in debt.
    pub tokens: f64,
    /// `capacity - tokens`, at least 0 (the pending debt for a key without definition).
    pub borrowed: f64,
    /// How far below zero the bucket is, or the pending debt of an undefined key.
    pub debt: f64,
    /// Bookings held on the key.
    pub bookings: usize,
    /// Their total cost.
    pub booked_cost: f64,
    /// Milliseconds until the earliest booking is ready, if any.
    pub next_ready_ms: Option<u64>,
    /// Milliseconds left of a pause covering the key, if any.
    pub pause_ms: Option<u64>,
}

#[derive(Default)]
struct Shard {
    buckets: HashTable<Bucket>,
    stats: Stats,
}

#[repr(align(128))]
struct Padded<T>(T);

struct Pause {
    target: PauseTarget,
    until: u64,
}

/// A prepared bucket of a check: hashed, coalesced, with its shard slot.
#[derive(Clone, Copy)]
struct Item<'a> {
    key: KeyRef<'a>,
    hash: u64,
    slot: usize,
    limit: Limit,
    cost: f64,
}

/// The bucket table. All operations are safe to call from many threads at once.
pub struct Table<C: Clock = MonotonicClock> {
    clock: C,
    config: Config,
    started_at: u64,
    hasher: foldhash::fast::RandomState,
    shards: Box<[Padded<Mutex<Shard>>]>,
    pauses: RwLock<Vec<Pause>>,
    /// The latest end of any pause: past it, checks skip the pause list.
    pause_horizon: AtomicU64,
    invalid: AtomicU64,
}

/// Identifies a coalesced check, so its owner can claim the booking it made.
fn signature(items: &[Item]) -> u64 {
    items.iter().fold(0x243f_6a88_85a3_08d3, |acc: u64, item| {
        (acc.rotate_left(23) ^ item.hash ^ item.cost.to_bits()).wrapping_mul(0x9e37_79b9_7f4a_7c15)
    })
}

/// What a check needs besides its buckets.
#[derive(Clone, Copy)]
struct Request {
    owner: u64,
    signature: u64,
    mode: Mode,
    now: u64,
    /// The end of the latest pause covering the check, or 0.
    pause_until: u64,
}

fn delay_ms(from: u64, to: u64) -> u64 {
    to.saturating_sub(from).div_ceil(NANOS_PER_MS).max(1)
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
        Self {
            clock,
            config,
            started_at,
            hasher: foldhash::fast::RandomState::default(),
            shards: (0..SHARDS)
                .map(|_| Padded(Mutex::new(Shard::default())))
                .collect(),
            pauses: RwLock::new(Vec::new()),
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

    /// Tokens a new bucket starts with.
    fn initial_tokens(&self, limit: &Limit, now: u64) -> f64 {
        if self.config.assume_busy_at_start {
            let since_start = now.saturating_sub(self.started_at) as f64 / NANOS_PER_SEC;
            (limit.refill_per_sec() * since_start).min(limit.capacity())
        } else {
            limit.capacity()
        }
    }

    /// Checks one bucket. `owner` identifies the caller, for its bookings.
    pub fn check_one(&self, owner: u64, check: Check, mode: Mode) -> Outcome {
        let hash = self.hash(&check.key);
        let item = Item {
            key: check.key,
            hash,
            slot: 0,
            limit: check.limit,
            cost: check.cost,
        };
        let mut guard = self.lock(hash);
        let request = self.request(std::slice::from_ref(&item), owner, mode);
        let shard = &mut *guard;
        let bucket = self.bucket(&mut shard.buckets, &item, request.now);
        self.decide(&mut [bucket], &[item], &mut shard.stats, request)
    }

    /// Checks several buckets all-or-nothing. Repeated keys are coalesced into one combined
    /// cost; the same key with two definitions is an error and pays nothing.
    pub fn check(&self, owner: u64, checks: &[Check], mode: Mode) -> Result<Outcome, InvalidInput> {
        match checks {
            [] => return Ok(Outcome::Admitted),
            [single] => return Ok(self.check_one(owner, *single, mode)),
            _ => {}
        }
        let mut items: Vec<Item> = checks
            .iter()
            .map(|check| Item {
                key: check.key,
                hash: self.hash(&check.key),
                slot: 0,
                limit: check.limit,
                cost: check.cost,
            })
            .collect();
        // Shards in ascending order: every multi-bucket check locks them in this order.
        items.sort_by(|a, b| {
            (
                Self::shard_index(a.hash),
                a.hash,
                a.key.exchange,
                a.key.credential,
                a.key.axis,
            )
                .cmp(&(
                    Self::shard_index(b.hash),
                    b.hash,
                    b.key.exchange,
                    b.key.credential,
                    b.key.axis,
                ))
        });
        let mut coalesced: Vec<Item> = Vec::with_capacity(items.len());
        for item in items {
            match coalesced.last_mut() {
                Some(last) if last.hash == item.hash && last.key == item.key => {
                    if last.limit != item.limit {
                        self.count_invalid();
                        return Err(rules::conflicting_definitions(&last.limit, &item.limit)
                            .for_exchange(item.key.exchange));
                    }
                    last.cost += item.cost;
                }
                _ => coalesced.push(item),
            }
        }
        let mut shard_indices: Vec<usize> = Vec::with_capacity(coalesced.len());
        for item in &mut coalesced {
            let index = Self::shard_index(item.hash);
            if shard_indices.last() != Some(&index) {
                shard_indices.push(index);
            }
            item.slot = shard_indices.len() - 1;
        }
        let mut guards: Vec<MutexGuard<Shard>> = shard_indices
            .iter()
            .map(|&index| self.shards[index].0.lock())
            .collect();
        let request = self.request(&coalesced, owner, mode);
        let now = request.now;
        // Buckets leave their tables while the check runs (the locks are held), so each can
        // be borrowed mutably at once; they go back afterwards.
        let mut buckets: Vec<Bucket> = coalesced
            .iter()
            .map(|item| self.take_bucket(&mut guards[item.slot].buckets, item, now))
            .collect();
        let mut borrowed: Vec<&mut Bucket> = buckets.iter_mut().collect();
        let outcome = self.decide(&mut borrowed, &coalesced, &mut guards[0].stats, request);
        for (item, bucket) in coalesced.iter().zip(buckets) {
            guards[item.slot]
                .buckets
                .insert_unique(item.hash, bucket, |b| b.hash);
        }
        Ok(outcome)
    }

    /// What a check of `items` needs besides its buckets, as of now. Called with the
    /// buckets' shards locked: a caller preempted before the lock reads the time after it,
    /// so no bucket is ever paid as of an instant before its last payment.
    fn request(&self, items: &[Item], owner: u64, mode: Mode) -> Request {
        let now = self.clock.now();
        Request {
            owner,
            signature: signature(items),
            mode,
            now,
            pause_until: self.pause_until(items, now),
        }
    }

    /// The bucket of `item`, created (or first defined) under the item's limit if needed.
    fn bucket<'s>(
        &self,
        buckets: &'s mut HashTable<Bucket>,
        item: &Item,
        now: u64,
    ) -> &'s mut Bucket {
        let tokens = self.initial_tokens(&item.limit, now);
        let bucket = buckets
            .entry(
                item.hash,
                |b| b.hash == item.hash && b.key.as_ref() == item.key,
                |b| b.hash,
            )
            .or_insert_with(|| {
                Bucket::defined(item.key.to_owned_key(), item.hash, item.limit, tokens, now)
            })
            .into_mut();
        bucket.define(item.limit, tokens, now);
        bucket
    }

    /// Like [`Table::bucket`], but removes the bucket from its table.
    fn take_bucket(&self, buckets: &mut HashTable<Bucket>, item: &Item, now: u64) -> Bucket {
        let tokens = self.initial_tokens(&item.limit, now);
        let mut bucket = match buckets.find_entry(item.hash, |b| {
            b.hash == item.hash && b.key.as_ref() == item.key
        }) {
            Ok(entry) => entry.remove().0,
            Err(_) => Bucket::defined(item.key.to_owned_key(), item.hash, item.limit, tokens, now),
        };
        bucket.define(item.limit, tokens, now);
        bucket
    }

    /// Admits, books or refuses a check over `buckets` (aligned with `items`).
    fn decide(
        &self,
        buckets: &mut [&mut Bucket],
        items: &[Item],
        stats: &mut Stats,
        request: Request,
    ) -> Outcome {
        let Request {
            owner,
            signature,
            mode,
            now,
            pause_until,
        } = request;
        // When could every bucket pay, and does the caller hold a booking for this check?
        let mut ready = now;
        let mut claim_ready: Option<u64> = Some(0);
        for (bucket, item) in buckets.iter_mut().zip(items) {
            stats.lapsed += bucket.drop_lapsed(now) as u64;
            claim_ready = claim_ready.and_then(|at| {
                bucket
                    .bookings
                    .iter()
                    .find(|b| b.owner == owner && b.signature == signature)
                    .map(|b| at.max(b.ready_at))
            });
            let start = bucket.start_under(&item.limit, now);
            ready = ready.max(Bucket::ready_at(&item.limit, item.cost, start, now));
        }
        if let Some(booked_ready) = claim_ready {
            return self.claim(buckets, stats, request, booked_ready);
        }
        stats.paused += u64::from(pause_until > ready);
        ready = ready.max(pause_until);
        if ready <= now {
            stats.admitted += 1;
            Self::pay_all(buckets, items, now, now, None);
            return Outcome::Admitted;
        }
        let ms = delay_ms(now, ready);
        match mode {
            Mode::Wait { max_wait_ms } if ms <= max_wait_ms => {
                stats.booked += 1;
                let booking = Booking {
                    owner,
                    signature,
                    cost: 0.0,
                    ready_at: ready,
                    lapse_at: ready.saturating_add(self.config.booking_slack_ms * NANOS_PER_MS),
                };
                Self::pay_all(buckets, items, now, ready, Some(booking));
                Outcome::Booked(ms)
            }
            _ => {
                for bucket in buckets.iter_mut() {
                    bucket.touch(now, ready - now);
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

    /// Pays every item as of `at`, recording `booking` (with each item's cost) if given.
    fn pay_all(
        buckets: &mut [&mut Bucket],
        items: &[Item],
        now: u64,
        at: u64,
        booking: Option<Booking>,
    ) {
        for (bucket, item) in buckets.iter_mut().zip(items) {
            let start = bucket.start_under(&item.limit, now);
            bucket.pay(item.limit, item.cost, start, now, at);
            bucket.touch(now, at - now);
            if let Some(booking) = &booking {
                bucket.bookings.push(Booking {
                    cost: item.cost,
                    ..booking.clone()
                });
            }
        }
    }

    /// The caller comes back for its booking: admitted from its ready time, held by a pause
    /// that began since, never charged again.
    fn claim(
        &self,
        buckets: &mut [&mut Bucket],
        stats: &mut Stats,
        request: Request,
        booked_ready: u64,
    ) -> Outcome {
        let Request {
            owner,
            signature,
            now,
            pause_until,
            ..
        } = request;
        let ready = booked_ready.max(pause_until);
        let lapse_at = ready.saturating_add(self.config.booking_slack_ms * NANOS_PER_MS);
        for bucket in buckets.iter_mut() {
            let position = bucket
                .bookings
                .iter()
                .position(|b| b.owner == owner && b.signature == signature)
                .expect("booking found in the planning pass");
            if ready <= now {
                bucket.bookings.swap_remove(position);
            } else {
                let booking = &mut bucket.bookings[position];
                booking.ready_at = ready;
                booking.lapse_at = lapse_at;
            }
            bucket.touch(now, ready.saturating_sub(now));
        }
        if ready <= now {
            stats.claimed += 1;
            Outcome::Claimed
        } else {
            stats.delayed += 1;
            stats.paused += u64::from(pause_until > booked_ready);
            Outcome::Delay(delay_ms(now, ready))
        }
    }

    /// Debits `cost` from `key` without checking (usage spent elsewhere). On a key without
    /// a definition the debt waits for its first check.
    pub fn record(&self, key: KeyRef, cost: f64) {
        let hash = self.hash(&key);
        let mut shard = self.lock(hash);
        let now = self.clock.now();
        shard.stats.debited += 1;
        match shard.buckets.find_mut(hash, |b| b.key.as_ref() == key) {
            Some(bucket) => {
                bucket.debit(cost, now);
                bucket.touch(now, 0);
            }
            None => {
                shard.buckets.insert_unique(
                    hash,
                    Bucket::debt_only(key.to_owned_key(), hash, cost, now),
                    |b| b.hash,
                );
            }
        }
    }

    /// Brings `key`'s bucket in line with an exchange that allows only `allowance` more
    /// cost until its window ends in `window_left_ms`: the tokens are lowered so that they
    /// plus the refill until then fit the allowance. Never raises them; a key without a
    /// definition is left alone. Returns the tokens taken.
    pub fn sync(&self, key: KeyRef, allowance: f64, window_left_ms: u64) -> f64 {
        let hash = self.hash(&key);
        let mut shard = self.lock(hash);
        let now = self.clock.now();
        let Some(bucket) = shard.buckets.find_mut(hash, |b| b.key.as_ref() == key) else {
            return 0.0;
        };
        let Some(limit) = bucket.limit else {
            return 0.0;
        };
        let before = bucket.tokens(now);
        let refill = limit.refill_per_sec() * window_left_ms as f64 / 1000.0;
        bucket.lower_to(allowance - refill, now);
        before - bucket.tokens(now)
    }

    /// Tokens borrowed from `key`'s bucket now: 0 for an unknown key.
    pub fn borrowed(&self, key: KeyRef) -> f64 {
        let hash = self.hash(&key);
        let now = self.clock.now();
        let shard = self.lock(hash);
        shard
            .buckets
            .find(hash, |b| b.key.as_ref() == key)
            .map_or(0.0, |bucket| bucket.borrowed(now))
    }

    /// A snapshot of `key`, or `None` if the table does not hold it.
    pub fn inspect(&self, key: KeyRef) -> Option<KeyInfo> {
        let hash = self.hash(&key);
        let now = self.clock.now();
        let pause_ms = self.pause_ms(&key, now);
        let mut shard = self.lock(hash);
        let bucket = shard.buckets.find_mut(hash, |b| b.key.as_ref() == key)?;
        let lapsed = bucket.drop_lapsed(now);
        let info = Self::info(bucket, now, pause_ms);
        shard.stats.lapsed += lapsed as u64;
        Some(info)
    }

    fn info(bucket: &Bucket, now: u64, pause_ms: Option<u64>) -> KeyInfo {
        let tokens = bucket.tokens(now);
        KeyInfo {
            limit: bucket.limit,
            tokens,
            borrowed: bucket.borrowed(now),
            debt: if bucket.limit.is_some() {
                (-tokens).max(0.0)
            } else {
                bucket.pending_debt()
            },
            bookings: bucket.bookings.len(),
            // A fold from +0.0: an empty `sum()` of floats is -0.0.
            booked_cost: bucket.bookings.iter().fold(0.0, |total, b| total + b.cost),
            next_ready_ms: bucket
                .bookings
                .iter()
                .map(|b| b.ready_at)
                .min()
                .map(|at| at.saturating_sub(now).div_ceil(NANOS_PER_MS)),
            pause_ms,
        }
    }

    /// The `count` keys with the most tokens borrowed, busiest first.
    pub fn busiest(&self, count: usize) -> Vec<(Key, KeyInfo)> {
        let now = self.clock.now();
        let mut rows: Vec<(Key, KeyInfo)> = Vec::new();
        for shard in self.shards.iter() {
            let shard = shard.0.lock();
            for bucket in shard.buckets.iter() {
                let borrowed = bucket.borrowed(now);
                if borrowed > 0.0 || !bucket.bookings.is_empty() {
                    rows.push((bucket.key.clone(), Self::info(bucket, now, None)));
                }
            }
        }
        rows.sort_by(|a, b| b.1.borrowed.total_cmp(&a.1.borrowed));
        rows.truncate(count);
        for (key, info) in &mut rows {
            info.pause_ms = self.pause_ms(&key.as_ref(), now);
        }
        rows
    }

    /// Forgets `key`: its bucket, its bookings and a pause on that key alone.
    pub fn reset(&self, key: KeyRef) {
        let hash = self.hash(&key);
        if let Ok(entry) = self
            .lock(hash)
            .buckets
            .find_entry(hash, |b| b.key.as_ref() == key)
        {
            entry.remove();
        }
        self.pauses
            .write()
            .retain(|pause| pause.target != PauseTarget::Key(key.to_owned_key()));
    }

    /// Forgets every key and pause of `exchange`, one shard at a time.
    pub fn reset_exchange(&self, exchange: &[u8]) {
        for shard in self.shards.iter() {
            shard
                .0
                .lock()
                .buckets
                .retain(|bucket| bucket.key.exchange() != exchange);
        }
        self.pauses
            .write()
            .retain(|pause| pause.target.exchange() != exchange);
    }

    /// Forgets everything but the counters.
    pub fn reset_all(&self) {
        for shard in self.shards.iter() {
            shard.0.lock().buckets.clear();
        }
        self.pauses.write().clear();
    }

    /// Drops buckets that behave exactly as new ones (full, idle, no bookings, no debt) and
    /// ended pauses. Returns how many buckets were dropped.
    pub fn sweep(&self) -> usize {
        let now = self.clock.now();
        let mut dropped = 0;
        for shard in self.shards.iter() {
            let mut shard = shard.0.lock();
            let before = shard.buckets.len();
            let mut lapsed = 0;
            shard.buckets.retain(|bucket| {
                lapsed += bucket.drop_lapsed(now);
                !bucket.sweepable(now)
            });
            shard.stats.lapsed += lapsed as u64;
            dropped += before - shard.buckets.len();
        }
        self.pauses.write().retain(|pause| pause.until > now);
        dropped
    }

    /// Holds every bucket of `target` for `ms` milliseconds: nothing is admitted until
    /// then; waiters book behind the pause. Overlapping pauses keep the later end.
    pub fn pause(&self, target: PauseTarget, ms: u64) {
        let until = self
            .clock
            .now()
            .saturating_add(ms.saturating_mul(NANOS_PER_MS).min(MAX_WAIT_NS));
        let mut pauses = self.pauses.write();
        match pauses.iter_mut().find(|pause| pause.target == target) {
            Some(pause) => pause.until = pause.until.max(until),
            None => pauses.push(Pause { target, until }),
        }
        self.pause_horizon.fetch_max(until, Ordering::SeqCst);
    }

    /// The end of the latest pause covering any of `items`, or 0.
    fn pause_until(&self, items: &[Item], now: u64) -> u64 {
        if self.pause_horizon.load(Ordering::Relaxed) <= now {
            return 0;
        }
        let pauses = self.pauses.read();
        pauses
            .iter()
            .filter(|pause| items.iter().any(|item| pause.target.covers(&item.key)))
            .map(|pause| pause.until)
            .max()
            .unwrap_or(0)
    }

    fn pause_ms(&self, key: &KeyRef, now: u64) -> Option<u64> {
        let until = self
            .pauses
            .read()
            .iter()
            .filter(|pause| pause.target.covers(key))
            .map(|pause| pause.until)
            .max()?;
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
            total.bookings += shard
                .buckets
                .iter()
                .map(|b| b.bookings.len() as u64)
                .sum::<u64>();
        }
        total
    }
}

//! One shard's buckets: a hash table that grows, is swept and shrinks a few buckets at a
//! time, so that no operation holds the shard's lock for long whatever the shard's size.
//!
//! A table is never rehashed in place. When it nears its capacity (or a sweep leaves it
//! under a quarter full), a table sized for its buckets is asked for: the caller allocates
//! it once it has released the shard's lock (after many frees an allocation can take
//! milliseconds: the allocator merges the freed chunks) and gives it back
//! ([`Buckets::take_wanted`], [`Buckets::give`]). The old table is then emptied into it a
//! few buckets per insert (and by the sweep), look-ups consulting both until it is empty;
//! the new table has room for every insert until then, so it never fills meanwhile.
//! Emptied tables wait for the sweep, which frees them after the lock: freeing megabytes
//! can take hundreds of microseconds, too long for a check.

use hashbrown::HashTable;
use smallvec::SmallVec;

use crate::bucket::Bucket;
use crate::key::Sought;

/// Buckets of the old table each insert moves at most: each may touch a page of the new
/// table for the first time (a page fault).
const MOVE_BUCKETS: usize = 4;
/// Slots of the old table each insert visits at most.
const MOVE_SLOTS: usize = 64;
/// Slots one sweep step visits.
const SCAN_STEP: usize = 512;
/// Key bytes one sweep step passes over at most (and the key of one more bucket): a step
/// over long keys (up to 3 KiB each) compares and frees far more memory per bucket.
const SCAN_KEY_BYTES: usize = 32 * 1024;
/// Bookings the buckets one sweep step visits hold at most (and those of one more
/// bucket): a walk may go over each booking several times (`busiest` does), and the
/// shard's lock is held for the whole step.
const SCAN_BOOKINGS: usize = 1024;
/// The smallest table allocated.
const MIN_CAPACITY: usize = 16;

#[derive(Default)]
pub(crate) struct Buckets {
    table: HashTable<Bucket>,
    /// While a move runs: the table being emptied into `table`, and the next slot of it
    /// to move.
    old: HashTable<Bucket>,
    old_cursor: usize,
    /// The table asked for, if any.
    next: Next,
    /// Emptied tables, for the sweep to free once it has released the shard's lock.
    emptied: Emptied,
    /// Whether [`Buckets::take_wanted`] may have a table to ask for: set by inserts and
    /// by the sweep's asking.
    may_want: bool,
    /// Moves started: a pass whose buckets move to another table starts again.
    moves: u64,
}

/// Tables emptied under the lock, to be freed after it (one per growth since the last
/// sweep).
pub(crate) type Emptied = SmallVec<[HashTable<Bucket>; 2]>;

/// The table to move the buckets into next.
#[derive(Default, Debug, Clone, Copy, PartialEq, Eq)]
enum Next {
    /// None asked for.
    #[default]
    Unneeded,
    /// Of this capacity, for the next caller to allocate.
    Wanted(usize),
    /// A caller is allocating it.
    Allocating,
}

/// Where a pass over every bucket is (see [`Buckets::retain_step`]).
#[derive(Debug, Default)]
pub(crate) struct Pass {
    /// The next slot of the table to visit.
    cursor: usize,
    /// The shard's moves when the pass last stepped.
    moves: u64,
    /// Whether every slot of the table was visited.
    visited: bool,
    /// Whether the pass asked for a smaller table.
    asked: bool,
}

/// What a step of a pass leaves to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// More steps.
    Next,
    /// The pass visits every bucket again from the start: what it gathered is to be
    /// forgotten.
    Restart,
    /// The pass is over.
    Done,
}

fn matches(hash: u64, key: Sought<'_>) -> impl Fn(&Bucket) -> bool + '_ {
    move |bucket| bucket.hash == hash && key.is(&bucket.key)
}

impl Buckets {
    /// Buckets held.
    pub fn len(&self) -> usize {
        self.table.len() + self.old.len()
    }

    pub fn find(&self, hash: u64, key: Sought) -> Option<&Bucket> {
        let found = self.table.find(hash, matches(hash, key));
        found.or_else(|| self.old.find(hash, matches(hash, key)))
    }

    pub fn find_mut(&mut self, hash: u64, key: Sought) -> Option<&mut Bucket> {
        let Self { table, old, .. } = self;
        match table.find_mut(hash, matches(hash, key)) {
            Some(bucket) => Some(bucket),
            None => old.find_mut(hash, matches(hash, key)),
        }
    }

    /// Removes and returns `key`'s bucket.
    pub fn take(&mut self, hash: u64, key: Sought) -> Option<Bucket> {
        if let Ok(entry) = self.table.find_entry(hash, matches(hash, key)) {
            return Some(entry.remove().0);
        }
        let bucket = self
            .old
            .find_entry(hash, matches(hash, key))
            .ok()?
            .remove()
            .0;
        if self.old.is_empty() {
            self.empty_old();
        }
        Some(bucket)
    }

    /// `key`'s bucket, made by `make` if the shard has none.
    pub fn get_or_insert_with(
        &mut self,
        hash: u64,
        key: Sought,
        make: impl FnOnce() -> Bucket,
    ) -> &mut Bucket {
        if self.old.is_empty() && self.table.len() < self.table.capacity() {
            // One table with room for one more: one probe finds a bucket held.
            let Self {
                table, may_want, ..
            } = self;
            return match table.find_entry(hash, matches(hash, key)) {
                Ok(entry) => entry.into_mut(),
                Err(absent) => {
                    *may_want = true;
                    let table = absent.into_table();
                    table.insert_unique(hash, make(), |b| b.hash).into_mut()
                }
            };
        }
        // Left in its slot, not taken and put back: a pass's cursor stays on its side of it.
        if let Some(index) = self.table.find_bucket_index(hash, matches(hash, key)) {
            return self.table.get_bucket_mut(index).expect("a slot just found");
        }
        let bucket = match self.take(hash, key) {
            Some(bucket) => bucket,
            None => make(),
        };
        self.insert(bucket)
    }

    /// Stores a bucket the shard does not hold. Allocates only a table that did not come
    /// in time: the first, or one that filled before the one asked for was given.
    pub fn insert(&mut self, bucket: Bucket) -> &mut Bucket {
        if self.old.is_empty() && self.table.len() == self.table.capacity() {
            self.next = Next::Unneeded;
            self.start_move(HashTable::with_capacity(self.move_capacity()));
        }
        self.may_want = true;
        self.move_old(MOVE_SLOTS, MOVE_BUCKETS);
        self.table
            .insert_unique(bucket.hash, bucket, |b| b.hash)
            .into_mut()
    }

    /// Whether the table's room fell to an eighth of its slots (a table not allocated
    /// yet is left to the first insert).
    fn nearly_full(&self) -> bool {
        self.table.allocation_size() > 0
            && self.table.capacity() - self.table.len() <= self.table.num_buckets() / 8
    }

    /// The least capacity of a table to move the buckets into: one slot for each bucket and
    /// for each insert until the move ends (each moves [`MOVE_BUCKETS`] or passes
    /// [`MOVE_SLOTS`]), so that it never fills meanwhile.
    fn least_capacity(&self) -> usize {
        let len = self.table.len();
        len + len.div_ceil(MOVE_BUCKETS) + self.table.num_buckets().div_ceil(MOVE_SLOTS)
    }

    /// The capacity of a table to ask for: twice the buckets, at least
    /// [`Buckets::least_capacity`] and [`MIN_CAPACITY`].
    fn move_capacity(&self) -> usize {
        (2 * self.table.len())
            .max(self.least_capacity())
            .max(MIN_CAPACITY)
    }

    /// Starts emptying the table into `fresh`, an empty table; no move may be running.
    fn start_move(&mut self, fresh: HashTable<Bucket>) {
        self.old = std::mem::replace(&mut self.table, fresh);
        self.old_cursor = 0;
        self.moves += 1;
    }

    /// Moves up to `most` buckets from the next `slots` slots of the old table (an insert's
    /// share: [`MOVE_BUCKETS`] of [`MOVE_SLOTS`]; a pass's: every bucket of [`SCAN_STEP`]);
    /// hands it over to be freed once empty.
    fn move_old(&mut self, slots: usize, most: usize) {
        if self.old.is_empty() {
            return;
        }
        let end = (self.old_cursor + slots).min(self.old.num_buckets());
        let mut moved = 0;
        while moved < most && self.old_cursor < end {
            if let Ok(entry) = self.old.get_bucket_entry(self.old_cursor) {
                let bucket = entry.remove().0;
                self.table.insert_unique(bucket.hash, bucket, |b| b.hash);
                moved += 1;
            }
            self.old_cursor += 1;
        }
        if self.old.is_empty() {
            self.empty_old();
        }
    }

    /// Takes every bucket and table, to be freed after the lock; a pass running starts
    /// again (on nothing, or on buckets inserted since).
    pub fn take_all(&mut self) -> Buckets {
        let moves = self.moves + 1;
        let all = std::mem::take(self);
        self.moves = moves;
        all
    }

    /// Hands the emptied old table over to be freed.
    fn empty_old(&mut self) {
        let old = std::mem::take(&mut self.old);
        self.emptied.push(old);
    }

    /// The tables emptied since the last call: to be dropped once the shard's lock is
    /// released.
    pub fn take_emptied(&mut self) -> Emptied {
        std::mem::take(&mut self.emptied)
    }

    /// Asks for a table to move the buckets into.
    fn ask(&mut self) {
        self.next = Next::Wanted(self.move_capacity());
        self.may_want = true;
    }

    /// Whether [`Buckets::take_wanted`] may ask for a table.
    pub fn may_want_table(&self) -> bool {
        self.may_want
    }

    /// The capacity of a table for the caller to allocate once it has released the shard's
    /// lock, and to hand to [`Buckets::give`]: asked for by the sweep, or because the
    /// table is nearly full. Asked of one caller at a time.
    pub fn take_wanted(&mut self) -> Option<usize> {
        self.may_want = false;
        if self.next == Next::Unneeded && self.old.is_empty() && self.nearly_full() {
            self.next = Next::Wanted(self.move_capacity());
        }
        match self.next {
            Next::Wanted(capacity) => {
                self.next = Next::Allocating;
                Some(capacity)
            }
            Next::Unneeded | Next::Allocating => None,
        }
    }

    /// Starts moving the buckets into `fresh`, an empty table allocated for
    /// [`Buckets::take_wanted`], if it is still awaited, no move runs and it has
    /// [`Buckets::least_capacity`]. Otherwise returns it, to be freed after the lock (the
    /// next insert or sweep asks again if need be).
    pub fn give(&mut self, fresh: HashTable<Bucket>) -> Option<HashTable<Bucket>> {
        if self.next != Next::Allocating {
            return Some(fresh);
        }
        self.next = Next::Unneeded;
        if !self.old.is_empty() || fresh.capacity() < self.least_capacity() {
            return Some(fresh);
        }
        self.start_move(fresh);
        None
    }

    /// One step of `pass` over every bucket: over at most [`SCAN_STEP`] slots, about
    /// [`SCAN_KEY_BYTES`] of keys and about [`SCAN_BOOKINGS`] bookings, it drops the buckets
    /// `keep` refuses. A move running is
    /// finished first. Every bucket held from the pass's start to its end is visited once
    /// after the pass's last [`Step::Restart`]; buckets inserted meanwhile may be visited
    /// or not. A step may ask for a table (see [`Buckets::take_wanted`]). Allocates nothing.
    pub fn retain_step(
        &mut self,
        pass: &mut Pass,
        mut keep: impl FnMut(&mut Bucket) -> bool,
    ) -> Step {
        if pass.moves != self.moves {
            pass.moves = self.moves;
            // The buckets visited went to another table, maybe after the cursor, and
            // others maybe before it.
            if pass.cursor > 0 && !pass.visited {
                pass.cursor = 0;
                return Step::Restart;
            }
        }
        if !self.old.is_empty() {
            self.move_old(SCAN_STEP, usize::MAX);
            return Step::Next;
        }
        if !pass.visited {
            let slots = self.table.num_buckets();
            let end = (pass.cursor + SCAN_STEP).min(slots);
            let (mut key_bytes, mut bookings) = (0, 0);
            while pass.cursor < end && key_bytes <= SCAN_KEY_BYTES && bookings <= SCAN_BOOKINGS {
                if let Ok(mut entry) = self.table.get_bucket_entry(pass.cursor) {
                    key_bytes += entry.get().key.byte_len();
                    bookings += entry.get().bookings.len();
                    if !keep(entry.get_mut()) {
                        entry.remove();
                    }
                }
                pass.cursor += 1;
            }
            pass.visited = pass.cursor >= slots;
            return Step::Next;
        }
        if self.table.is_empty() && self.table.allocation_size() > 0 {
            let table = std::mem::take(&mut self.table);
            self.emptied.push(table);
            // Another pass's cursor is past the slots this one has.
            self.moves += 1;
        } else if !pass.asked && self.next == Next::Unneeded && self.sparse() {
            // Moved into a table about half full, or of the least capacity if larger: it
            // shrinks at most 32-fold per pass.
            self.ask();
            pass.asked = true;
            return Step::Next;
        }
        Step::Done
    }

    /// Whether the buckets fill under a quarter of the slots' capacity (and more than
    /// [`MIN_CAPACITY`] would).
    fn sparse(&self) -> bool {
        4 * self.table.len().max(MIN_CAPACITY) < self.table.num_buckets() / 8 * 7
    }
}

#[cfg(test)]
#[path = "../tests/support/counting.rs"]
mod counting;

#[cfg(test)]
mod tests {
    use super::counting::allocations;
    use super::*;
    use crate::bucket::Booking;
    use crate::key::KeyRef;
    use std::hash::BuildHasher;

    fn bucket(hasher: &foldhash::fast::RandomState, i: usize) -> Bucket {
        let credential = format!("key-{i}");
        let key = KeyRef::new(b"ex", Some(credential.as_bytes()), b"request");
        Bucket::seen(key.to_owned_key(), hasher.hash_one(key), 0, 0)
    }

    fn sought(credential: &str) -> (KeyRef<'_>, Sought<'_>) {
        let key = KeyRef::new(b"ex", Some(credential.as_bytes()), b"request");
        (key, Sought::Parts(key))
    }

    fn find(buckets: &Buckets, hasher: &foldhash::fast::RandomState, i: usize) -> bool {
        let credential = format!("key-{i}");
        let (key, sought) = sought(&credential);
        buckets.find(hasher.hash_one(key), sought).is_some()
    }

    /// A table asked for, allocated and given as the table does once it has released the
    /// shard's lock; emptied tables freed as the sweep does, so that their list never
    /// outgrows its inline room (a small allocation, not a table's).
    fn give_wanted(buckets: &mut Buckets) {
        drop(buckets.take_emptied());
        if let Some(capacity) = buckets.take_wanted() {
            drop(buckets.give(HashTable::with_capacity(capacity)));
        }
    }

    #[test]
    fn growth_allocates_no_table_under_the_lock_and_moves_a_few_buckets_per_insert() {
        let hasher = foldhash::fast::RandomState::default();
        let mut buckets = Buckets::default();
        let (mut moves_seen, mut most_moved) = (0, 0);
        for i in 0..100_000 {
            let made = bucket(&hasher, i);
            let before = buckets.table.len();
            let (_, allocated) = allocations(|| {
                buckets.insert(made);
            });
            // Only the shard's first table is allocated under the lock: the others are
            // asked for, and allocated by the caller without it.
            assert_eq!(allocated, usize::from(i == 0), "insert {i} allocated");
            most_moved = most_moved.max(buckets.table.len() - before - 1);
            moves_seen += usize::from(!buckets.old.is_empty());
            assert_eq!(buckets.len(), i + 1);
            give_wanted(&mut buckets);
        }
        assert!(most_moved <= MOVE_BUCKETS);
        assert!(moves_seen > 0, "no growth ran as a move");
        assert!((0..100_000).all(|i| find(&buckets, &hasher, i)));
    }

    #[test]
    fn a_table_that_fills_before_the_one_asked_for_is_given_grows_all_the_same() {
        let hasher = foldhash::fast::RandomState::default();
        let mut buckets = Buckets::default();
        for i in 0..20_000 {
            // No table asked for is ever given.
            buckets.insert(bucket(&hasher, i));
            assert_eq!(buckets.len(), i + 1);
        }
        assert!((0..20_000).all(|i| find(&buckets, &hasher, i)));
    }

    #[test]
    fn a_table_given_too_small_or_unasked_is_handed_back_and_asked_for_again() {
        let hasher = foldhash::fast::RandomState::default();
        let mut buckets = Buckets::default();
        let mut i = 0;
        let mut insert_until_asked = |buckets: &mut Buckets| loop {
            buckets.insert(bucket(&hasher, i));
            i += 1;
            if let Some(capacity) = buckets.take_wanted() {
                return capacity;
            }
        };
        let capacity = insert_until_asked(&mut buckets);
        assert!(buckets.give(HashTable::new()).is_some());
        assert!(buckets.old.is_empty());
        // Given once asked: handed back.
        assert!(buckets.give(HashTable::with_capacity(capacity)).is_some());
        let capacity = insert_until_asked(&mut buckets);
        assert!(buckets.give(HashTable::with_capacity(capacity)).is_none());
        assert!(!buckets.old.is_empty());
        assert!((0..i).all(|i| find(&buckets, &hasher, i)));
    }

    /// A pseudo-random sequence, the same every run.
    fn xorshift(state: &mut u64) -> u64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    }

    #[test]
    fn inserts_removals_and_sweeps_keep_every_bucket_once_and_allocate_no_table_under_the_lock() {
        let hasher = foldhash::fast::RandomState::default();
        let mut buckets = Buckets::default();
        // The hash of each bucket held, and its key's number.
        let mut model = std::collections::HashMap::new();
        let mut dropped = Vec::with_capacity(2 * SCAN_STEP);
        let (mut state, mut sweep) = (0x9e37_79b9_7f4a_7c15_u64, Pass::default());
        let mut tables_grown = 0;
        for round in 0..300_000 {
            let roll = xorshift(&mut state);
            // Keys from a window that slides on: tables grow, fill with removed slots, and
            // the sweep drops the keys left behind.
            let i = round / 4 + (roll >> 8) as usize % 8_192;
            let credential = format!("key-{i}");
            let (key, sought) = sought(&credential);
            let hash = hasher.hash_one(key);
            let first_table = buckets.table.allocation_size() == 0;
            let slots = buckets.table.num_buckets();
            let allocated = match roll % 8 {
                0..=4 => {
                    if model.insert(hash, i).is_some() {
                        continue;
                    }
                    let made = bucket(&hasher, i);
                    let (_, allocated) = allocations(|| {
                        buckets.insert(made);
                    });
                    allocated - usize::from(first_table)
                }
                5 | 6 => {
                    let (taken, allocated) = allocations(|| buckets.take(hash, sought));
                    assert_eq!(taken.is_some(), model.remove(&hash).is_some());
                    allocated
                }
                _ => {
                    let (step, allocated) = allocations(|| {
                        buckets.retain_step(&mut sweep, |b| {
                            let keep = b.hash % 3 != 0;
                            if !keep {
                                dropped.push(b.hash);
                            }
                            keep
                        })
                    });
                    for hash in dropped.drain(..) {
                        assert!(model.remove(&hash).is_some());
                    }
                    if step == Step::Done {
                        sweep = Pass::default();
                    }
                    allocated
                }
            };
            assert_eq!(allocated, 0, "round {round}");
            assert_eq!(buckets.len(), model.len());
            give_wanted(&mut buckets);
            tables_grown += usize::from(buckets.table.num_buckets() > slots);
        }
        assert!(tables_grown > 5);
        assert!(model.values().all(|&i| find(&buckets, &hasher, i)));
    }

    #[test]
    fn a_pass_visits_every_bucket_held_throughout_while_the_shard_grows_and_is_checked() {
        let hasher = foldhash::fast::RandomState::default();
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        for round in 0..200 {
            let mut buckets = Buckets::default();
            let held = 200 + round * 37;
            for i in 0..held {
                buckets.insert(bucket(&hasher, i));
                give_wanted(&mut buckets);
            }
            let mut visited = std::collections::HashSet::new();
            let (mut pass, mut next_key, mut restarts) = (Pass::default(), held, 0);
            loop {
                let step = buckets.retain_step(&mut pass, |b| {
                    assert!(
                        visited.insert(b.hash),
                        "round {round}: a bucket visited twice"
                    );
                    true
                });
                if step == Step::Restart {
                    visited.clear();
                    restarts += 1;
                }
                // Between steps: new keys (the shard grows) and checks of held keys.
                for _ in 0..xorshift(&mut state) % 64 {
                    let roll = xorshift(&mut state);
                    let i = if roll.is_multiple_of(2) {
                        next_key += 1;
                        next_key
                    } else {
                        (roll >> 8) as usize % held
                    };
                    let credential = format!("key-{i}");
                    let (key, sought) = sought(&credential);
                    buckets.get_or_insert_with(hasher.hash_one(key), sought, || bucket(&hasher, i));
                    give_wanted(&mut buckets);
                }
                if step == Step::Done {
                    break;
                }
            }
            // Each growth mid-pass restarts it: the table doubles each time.
            assert!(restarts <= 8, "round {round}: {restarts} restarts");
            let missed = (0..held)
                .filter(|&i| !visited.contains(&bucket(&hasher, i).hash))
                .count();
            assert_eq!(
                missed, 0,
                "round {round}: {missed} of {held} buckets not visited"
            );
        }
    }

    /// Steps `pass` to its end, giving tables asked for between steps; the hashes it
    /// visited after its last restart. Panics past `most` steps.
    fn finish(buckets: &mut Buckets, pass: &mut Pass, most: usize) -> Vec<u64> {
        let mut visited = Vec::new();
        for _ in 0..most {
            let step = buckets.retain_step(pass, |b| {
                visited.push(b.hash);
                true
            });
            give_wanted(buckets);
            match step {
                Step::Restart => visited.clear(),
                Step::Done => return visited,
                Step::Next => {}
            }
        }
        panic!("a pass still running after {most} steps");
    }

    #[test]
    fn a_pass_ends_when_another_empties_its_shard_and_frees_the_table() {
        let hasher = foldhash::fast::RandomState::default();
        let mut buckets = Buckets::default();
        for i in 0..2_000 {
            buckets.insert(bucket(&hasher, i));
            give_wanted(&mut buckets);
        }
        let mut paused = Pass::default();
        buckets.retain_step(&mut paused, |_| true);
        // Another pass drops every bucket, and hands the empty table over to be freed.
        let mut emptying = Pass::default();
        while buckets.retain_step(&mut emptying, |_| false) != Step::Done {}
        assert_eq!(buckets.table.allocation_size(), 0);
        assert!(finish(&mut buckets, &mut paused, 10).is_empty());
    }

    #[test]
    fn a_pass_across_taking_every_bucket_visits_none_twice() {
        let hasher = foldhash::fast::RandomState::default();
        let mut buckets = Buckets::default();
        let fill = |buckets: &mut Buckets| {
            for i in 0..2_000 {
                buckets.insert(bucket(&hasher, i));
                give_wanted(buckets);
            }
        };
        fill(&mut buckets);
        let mut paused = Pass::default();
        buckets.retain_step(&mut paused, |_| true);
        drop(buckets.take_all());
        // The same buckets again, grown through as many tables as before.
        fill(&mut buckets);
        let visited = finish(&mut buckets, &mut paused, 1_000);
        let distinct: std::collections::HashSet<_> = visited.iter().collect();
        assert_eq!(distinct.len(), visited.len(), "a bucket visited twice");
        assert_eq!(visited.len(), 2_000);
    }

    /// What a pass did: its steps, and the most buckets dropped and allocations made by
    /// one step.
    struct Walked {
        steps: usize,
        most_dropped: usize,
        most_allocations: usize,
    }

    /// A whole pass as the table's sweep runs it, tables asked for given between steps (where the
    /// sweep holds no lock).
    fn pass(buckets: &mut Buckets, mut keep: impl FnMut(&mut Bucket) -> bool) -> Walked {
        let mut at = Pass::default();
        let mut pass = Walked {
            steps: 0,
            most_dropped: 0,
            most_allocations: 0,
        };
        loop {
            let before = buckets.len();
            let (step, allocated) = allocations(|| buckets.retain_step(&mut at, &mut keep));
            pass.most_allocations = pass.most_allocations.max(allocated);
            pass.most_dropped = pass.most_dropped.max(before - buckets.len());
            pass.steps += 1;
            give_wanted(buckets);
            if step == Step::Done {
                return pass;
            }
        }
    }

    /// A pass that keeps every bucket: how many it visited, and the most in one step.
    fn visits_per_step(buckets: &mut Buckets) -> (usize, usize) {
        let (mut at, mut visited, mut most) = (Pass::default(), 0, 0);
        loop {
            let mut step_visits = 0;
            let step = buckets.retain_step(&mut at, |_| {
                step_visits += 1;
                true
            });
            give_wanted(buckets);
            visited += step_visits;
            most = most.max(step_visits);
            if step == Step::Done {
                return (visited, most);
            }
        }
    }

    #[test]
    fn a_step_over_long_keys_visits_few_buckets() {
        let hasher = foldhash::fast::RandomState::default();
        let mut buckets = Buckets::default();
        let long = |i: usize| format!("{i:03000}");
        for i in 0..2_000 {
            let credential = long(i);
            let key = KeyRef::new(b"ex", Some(credential.as_bytes()), b"request");
            buckets.insert(Bucket::seen(key.to_owned_key(), hasher.hash_one(key), 0, 0));
            give_wanted(&mut buckets);
        }
        let (visited, most) = visits_per_step(&mut buckets);
        assert_eq!(visited, 2_000);
        assert_eq!(buckets.len(), 2_000);
        // Each key is 3,009 bytes: a step stops once past SCAN_KEY_BYTES (32 KiB), not
        // after the ~250 buckets of its 512 slots.
        assert!(most <= 11, "{most} buckets in one step");
    }

    #[test]
    fn a_step_over_buckets_full_of_bookings_visits_few_buckets() {
        let hasher = foldhash::fast::RandomState::default();
        let mut buckets = Buckets::default();
        for i in 0..1_000 {
            let mut full = bucket(&hasher, i);
            full.bookings = (0..256)
                .map(|made| Booking {
                    owner: made,
                    signature: 0,
                    cost: 1.0,
                    ready_at: 1,
                    lapse_at: 2,
                    booked_at: 0,
                    made,
                    refund: 1.0,
                })
                .collect();
            buckets.insert(full);
            give_wanted(&mut buckets);
        }
        let (visited, most) = visits_per_step(&mut buckets);
        assert_eq!(visited, 1_000);
        // 256 bookings each: a step stops once past SCAN_BOOKINGS (1,024), not after the
        // buckets of its 512 slots (a walk of `busiest` took about 1 ms for 400 of them).
        assert!(most <= 5, "{most} buckets in one step");
    }

    #[test]
    fn a_pass_drops_in_steps_then_shrinks_and_hands_tables_back() {
        let hasher = foldhash::fast::RandomState::default();
        let mut buckets = Buckets::default();
        for i in 0..20_000 {
            buckets.insert(bucket(&hasher, i));
            give_wanted(&mut buckets);
        }
        let slots = buckets.table.num_buckets() + buckets.old.num_buckets();
        let pass = pass(&mut buckets, |b| b.hash.is_multiple_of(100));
        // One step drops at most the buckets of SCAN_STEP slots, and allocates nothing
        // (the shrunk table is allocated between steps).
        assert!(pass.most_dropped <= SCAN_STEP);
        assert_eq!(pass.most_allocations, 0);
        assert!(pass.steps > 20_000 / SCAN_STEP);
        let kept = (0..20_000)
            .filter(|&i| bucket(&hasher, i).hash.is_multiple_of(100))
            .count();
        assert_eq!(buckets.len(), kept);
        assert!(buckets.old.is_empty());
        assert!(
            buckets.table.num_buckets() * 8 < slots,
            "the shard did not shrink"
        );
        assert!((0..20_000)
            .all(|i| find(&buckets, &hasher, i) == (bucket(&hasher, i).hash.is_multiple_of(100))));
        // Emptied entirely, the table frees its allocation too.
        assert_eq!(self::pass(&mut buckets, |_| false).most_allocations, 0);
        assert_eq!(buckets.table.allocation_size(), 0);
    }
}

//! One shard's buckets: a hash table that grows, is swept and shrinks a few buckets at a
//! time, so that no operation holds the shard's lock for long whatever the shard's size.
//!
//! A full table is not rehashed in place: a table of twice the size takes its place, and
//! the old one is emptied into it [`MOVE_STEP`] buckets per insert (and by the sweep).
//! The sweep visits [`SCAN_STEP`] slots per call; when it leaves the table at under a
//! quarter of its capacity, the buckets move the same way into a table sized for them,
//! which the sweep allocates between two steps: a step never allocates, since after many
//! frees an allocation can take milliseconds (the allocator merges the freed chunks).

use hashbrown::HashTable;
use smallvec::SmallVec;

use crate::bucket::Bucket;
use crate::key::Sought;

/// Buckets moved from the old table per insert: the old table is empty long before the
/// new one (twice its size) fills.
const MOVE_STEP: usize = 2;
/// Slots one sweep step visits.
const SCAN_STEP: usize = 512;
/// The smallest table allocated.
const MIN_CAPACITY: usize = 16;

#[derive(Default)]
pub(crate) struct Buckets {
    table: HashTable<Bucket>,
    /// While a move runs: the table being emptied into `table`, and the next slot of it
    /// to move.
    old: HashTable<Bucket>,
    old_cursor: usize,
    /// Emptied tables, kept for the sweep to free once it has released the shard's lock:
    /// freeing megabytes can take milliseconds, too long for a check or under the lock.
    emptied: Emptied,
}

/// Tables emptied under the lock, to be freed after it (rarely more than one).
pub(crate) type Emptied = SmallVec<[HashTable<Bucket>; 2]>;

/// What a step of a pass leaves to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// The next step starts at this slot.
    Next(usize),
    /// The next step starts at this slot, and is to be given an empty table of at least this
    /// capacity, allocated without the shard's lock.
    NeedsTable { cursor: usize, capacity: usize },
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
            // One table with room for one more: a single probe.
            return self
                .table
                .entry(hash, matches(hash, key), |b| b.hash)
                .or_insert_with(make)
                .into_mut();
        }
        let bucket = match self.take(hash, key) {
            Some(bucket) => bucket,
            None => make(),
        };
        self.insert(bucket)
    }

    /// Stores a bucket the shard does not hold.
    pub fn insert(&mut self, bucket: Bucket) -> &mut Bucket {
        if self.table.len() == self.table.capacity() {
            self.start_move((self.table.capacity() * 2).max(MIN_CAPACITY));
        }
        self.move_some(MOVE_STEP);
        self.table
            .insert_unique(bucket.hash, bucket, |b| b.hash)
            .into_mut()
    }

    /// Starts emptying the table into a new one of `capacity`.
    fn start_move(&mut self, capacity: usize) {
        self.start_move_into(HashTable::with_capacity(capacity));
    }

    /// Starts emptying the table into `fresh`, an empty table. A move still running is
    /// finished first (it cannot be: the old table empties long before the new one fills).
    fn start_move_into(&mut self, fresh: HashTable<Bucket>) {
        while !self.old.is_empty() {
            self.move_some(usize::MAX);
        }
        if self.old.capacity() > 0 {
            self.empty_old();
        }
        self.old = std::mem::replace(&mut self.table, fresh);
        self.old_cursor = 0;
    }

    /// Moves up to `count` buckets from the old table, visiting at most 8 slots for each;
    /// frees the old table once empty.
    fn move_some(&mut self, count: usize) {
        let mut moved = 0;
        let end = self
            .old_cursor
            .saturating_add(count.saturating_mul(8))
            .min(self.old.num_buckets());
        while moved < count && self.old_cursor < end {
            if let Ok(entry) = self.old.get_bucket_entry(self.old_cursor) {
                let bucket = entry.remove().0;
                self.table.insert_unique(bucket.hash, bucket, |b| b.hash);
                moved += 1;
            }
            self.old_cursor += 1;
        }
        if self.old.is_empty() && self.old.capacity() > 0 {
            self.empty_old();
        }
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

    /// One step of a pass over every bucket from slot `cursor` (0 to start): drops those
    /// `keep` refuses, and says where the next step starts, and whether it needs a table
    /// (then given in `spare`). Buckets inserted or moved between steps may be visited twice
    /// or not at all. Allocates nothing.
    pub fn retain_step(
        &mut self,
        cursor: usize,
        spare: &mut Option<HashTable<Bucket>>,
        mut keep: impl FnMut(&mut Bucket) -> bool,
    ) -> Step {
        let slots = self.table.num_buckets();
        if cursor < slots {
            let end = (cursor + SCAN_STEP).min(slots);
            for index in cursor..end {
                if let Ok(mut entry) = self.table.get_bucket_entry(index) {
                    if !keep(entry.get_mut()) {
                        entry.remove();
                    }
                }
            }
            return Step::Next(end);
        }
        // The old table is passed over as its buckets move.
        if !self.old.is_empty() {
            let end = (self.old_cursor + SCAN_STEP).min(self.old.num_buckets());
            while self.old_cursor < end {
                if let Ok(entry) = self.old.get_bucket_entry(self.old_cursor) {
                    let mut bucket = entry.remove().0;
                    if keep(&mut bucket) {
                        self.table.insert_unique(bucket.hash, bucket, |b| b.hash);
                    }
                }
                self.old_cursor += 1;
            }
            if self.old.is_empty() {
                self.empty_old();
            }
            return Step::Next(cursor);
        }
        // Occupancy fell under a quarter: move into a table half full (so at most 7/16 full
        // afterwards, never shrunk again by the next pass).
        if self.table.is_empty() && self.table.capacity() > 0 {
            let table = std::mem::take(&mut self.table);
            self.emptied.push(table);
        } else if self.table.capacity() > 4 * self.table.len().max(MIN_CAPACITY) {
            let capacity = 2 * self.table.len().max(MIN_CAPACITY);
            return match spare.take_if(|table| table.capacity() >= capacity) {
                Some(table) => {
                    self.start_move_into(table);
                    Step::Next(cursor)
                }
                None => Step::NeedsTable { cursor, capacity },
            };
        }
        Step::Done
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::KeyRef;
    use crate::limit::Limit;
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;
    use std::hash::BuildHasher;

    fn bucket(hasher: &foldhash::fast::RandomState, i: usize) -> Bucket {
        let credential = format!("key-{i}");
        let key = KeyRef::new(b"ex", Some(credential.as_bytes()), b"request");
        let limit = Limit::new(1.0, 1.0).unwrap();
        Bucket::defined(key.to_owned_key(), hasher.hash_one(key), limit, 1.0, 0)
    }

    fn find(buckets: &Buckets, hasher: &foldhash::fast::RandomState, i: usize) -> bool {
        let credential = format!("key-{i}");
        let key = KeyRef::new(b"ex", Some(credential.as_bytes()), b"request");
        buckets
            .find(hasher.hash_one(key), Sought::Parts(key))
            .is_some()
    }

    #[test]
    fn growth_moves_a_few_buckets_per_insert_and_loses_none() {
        let hasher = foldhash::fast::RandomState::default();
        let mut buckets = Buckets::default();
        let mut moves_seen = 0;
        for i in 0..20_000 {
            let before = buckets.table.len();
            buckets.insert(bucket(&hasher, i));
            // Never a whole table at once: at most MOVE_STEP moved, plus the new bucket.
            assert!(buckets.table.len() <= before + MOVE_STEP + 1 || before == 0);
            moves_seen += usize::from(!buckets.old.is_empty());
            assert_eq!(buckets.len(), i + 1);
        }
        assert!(moves_seen > 0, "no growth ran as a move");
        assert!((0..20_000).all(|i| find(&buckets, &hasher, i)));
    }

    thread_local! {
        static ALLOCATIONS: Cell<usize> = const { Cell::new(0) };
    }

    /// The system allocator, counting each thread's allocations.
    struct Counting;

    // SAFETY: every call is passed on to the system allocator unchanged.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            ALLOCATIONS.with(|count| count.set(count.get() + 1));
            System.alloc(layout)
        }

        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            System.dealloc(ptr, layout)
        }

        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            ALLOCATIONS.with(|count| count.set(count.get() + 1));
            System.realloc(ptr, layout, new_size)
        }
    }

    #[global_allocator]
    static ALLOCATOR: Counting = Counting;

    /// What a pass did: its steps, and the most buckets dropped and allocations made by
    /// one step.
    struct Pass {
        steps: usize,
        most_dropped: usize,
        most_allocations: usize,
    }

    /// A whole pass as the table's sweep runs it: the tables asked for are allocated
    /// between steps (where the sweep holds no lock).
    fn pass(buckets: &mut Buckets, mut keep: impl FnMut(&mut Bucket) -> bool) -> Pass {
        let (mut cursor, mut spare) = (0, None);
        let mut pass = Pass {
            steps: 0,
            most_dropped: 0,
            most_allocations: 0,
        };
        loop {
            let (before, allocations) = (buckets.len(), ALLOCATIONS.with(Cell::get));
            let step = buckets.retain_step(cursor, &mut spare, &mut keep);
            let allocated = ALLOCATIONS.with(Cell::get) - allocations;
            pass.most_allocations = pass.most_allocations.max(allocated);
            pass.most_dropped = pass.most_dropped.max(before - buckets.len());
            pass.steps += 1;
            match step {
                Step::Next(next) => cursor = next,
                Step::NeedsTable {
                    cursor: next,
                    capacity,
                } => {
                    cursor = next;
                    spare = Some(HashTable::with_capacity(capacity));
                }
                Step::Done => return pass,
            }
        }
    }

    #[test]
    fn a_pass_drops_in_steps_then_shrinks_and_hands_tables_back() {
        let hasher = foldhash::fast::RandomState::default();
        let mut buckets = Buckets::default();
        for i in 0..20_000 {
            buckets.insert(bucket(&hasher, i));
        }
        let capacity = buckets.table.capacity() + buckets.old.capacity();
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
            buckets.table.capacity() * 8 < capacity,
            "the shard did not shrink"
        );
        assert!(!buckets.take_emptied().is_empty());
        assert!((0..20_000)
            .all(|i| find(&buckets, &hasher, i) == (bucket(&hasher, i).hash.is_multiple_of(100))));
        // Emptied entirely, the table frees its allocation too.
        assert_eq!(self::pass(&mut buckets, |_| false).most_allocations, 0);
        assert_eq!(buckets.table.capacity(), 0);
    }
}

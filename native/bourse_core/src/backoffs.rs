//! Backoff counts: consecutive limited replies without a usable wait, per credential (and
//! per exchange, for replies limiting the whole exchange), each lapsing
//! [`BACKOFF_LAPSE_MS`] after the last reply that counted into it, with the end of the last
//! backoff's pause.

use std::hash::BuildHasher;

use hashbrown::hash_table::Entry;
use hashbrown::HashTable;

use crate::clock::NANOS_PER_MS;
use crate::key::{Key, KeyRef};
use crate::rules::{BACKOFF_LAPSE_MS, MAX_BACKOFFS};

/// A credential's backoff: the limited replies counted, and when the pause of the last
/// backoff ends.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Backoff {
    pub count: u32,
    pub held_until: u64,
}

/// When a count set at `now` lapses.
fn lapse_after(now: u64) -> u64 {
    now.saturating_add(BACKOFF_LAPSE_MS * NANOS_PER_MS)
}

/// The count of replies limiting the whole of `exchange`, packed as a key: no credential's
/// (each is `{exchange, credential, ""}`).
pub(crate) fn exchange_backoff(exchange: &[u8]) -> KeyRef<'_> {
    KeyRef::new(exchange, None, b"exchange")
}

/// A credential packed as a key (`{exchange, credential, ""}`), or [`exchange_backoff`],
/// its backoff and when it lapses.
struct Count {
    key: Key,
    hash: u64,
    backoff: Backoff,
    lapses_at: u64,
}

/// The backoff counts of one table, at most [`MAX_BACKOFFS`].
pub(crate) struct Backoffs {
    hasher: foldhash::fast::RandomState,
    counts: HashTable<Count>,
    /// No count lapses before this: until then, looking for lapsed ones to make room finds
    /// none, and is skipped.
    no_lapse_before: u64,
}

impl Backoffs {
    pub fn new(hasher: foldhash::fast::RandomState) -> Self {
        Self {
            hasher,
            counts: HashTable::new(),
            no_lapse_before: 0,
        }
    }

    /// The backoff of `credential` at `now`: none (0) when it has none, or it lapsed.
    pub fn get(&self, credential: &KeyRef, now: u64) -> Backoff {
        let hash = self.hasher.hash_one(credential);
        self.counts
            .find(hash, |count| {
                count.hash == hash && count.key.as_ref() == *credential
            })
            .filter(|count| count.lapses_at > now)
            .map_or(Backoff::default(), |count| count.backoff)
    }

    /// Sets the backoff of `credential`, lapsing [`BACKOFF_LAPSE_MS`] after `now`.
    /// When [`MAX_BACKOFFS`] credentials are counted, lapsed counts are dropped first; if
    /// none has lapsed, a new credential is not counted (its next backoff is the first).
    pub fn set(&mut self, credential: &KeyRef, backoff: Backoff, now: u64) {
        let lapses_at = lapse_after(now);
        let hash = self.hasher.hash_one(credential);
        let known = |entry: &Count| entry.hash == hash && entry.key.as_ref() == *credential;
        if self.counts.len() >= MAX_BACKOFFS && self.counts.find(hash, known).is_none() {
            self.drop_lapsed(now);
            if self.counts.len() >= MAX_BACKOFFS {
                return;
            }
        }
        match self.counts.entry(hash, known, |entry| entry.hash) {
            Entry::Occupied(mut entry) => {
                let entry = entry.get_mut();
                entry.backoff = backoff;
                entry.lapses_at = lapses_at;
            }
            Entry::Vacant(vacant) => {
                vacant.insert(Count {
                    key: credential.to_owned_key(),
                    hash,
                    backoff,
                    lapses_at,
                });
            }
        }
    }

    /// Forgets the count of `credential`, unless the pause of its last backoff holds at
    /// `now`.
    pub fn remove_unless_held(&mut self, credential: &KeyRef, now: u64) {
        let hash = self.hasher.hash_one(credential);
        if let Ok(entry) = self.counts.find_entry(hash, |count| {
            count.hash == hash && count.key.as_ref() == *credential
        }) {
            if entry.get().backoff.held_until <= now {
                entry.remove();
            }
        }
    }

    /// Forgets the counts of every credential of `exchange`.
    pub fn remove_exchange(&mut self, exchange: &[u8]) {
        self.counts.retain(|count| count.key.exchange() != exchange);
    }

    /// Forgets every count.
    pub fn clear(&mut self) {
        *self = Self::new(self.hasher);
    }

    /// Drops the counts that lapsed by `now`; nothing when none can have lapsed.
    pub fn drop_lapsed(&mut self, now: u64) {
        if now < self.no_lapse_before {
            return;
        }
        // A count set from now on lapses no earlier than this, nor than those kept.
        let mut next_lapse = lapse_after(now);
        self.counts.retain(|count| {
            let kept = count.lapses_at > now;
            if kept {
                next_lapse = next_lapse.min(count.lapses_at);
            }
            kept
        });
        self.no_lapse_before = next_lapse;
        if self.counts.len() < self.counts.capacity() / 4 {
            self.counts.shrink_to(0, |count| count.hash);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counted(count: u32) -> Backoff {
        Backoff {
            count,
            held_until: 0,
        }
    }

    fn credential(i: usize) -> Vec<u8> {
        format!("key-{i}").into_bytes()
    }

    #[test]
    fn counts_lapse_and_are_per_credential() {
        let mut backoffs = Backoffs::new(foldhash::fast::RandomState::default());
        let a = KeyRef::new(b"ex", Some(b"a"), b"");
        let public = KeyRef::new(b"ex", None, b"");
        backoffs.set(&a, counted(2), 0);
        assert_eq!(backoffs.get(&a, 0).count, 2);
        assert_eq!(backoffs.get(&public, 0).count, 0);
        let lapse = BACKOFF_LAPSE_MS * NANOS_PER_MS;
        assert_eq!(backoffs.get(&a, lapse - 1).count, 2);
        assert_eq!(backoffs.get(&a, lapse).count, 0);
        backoffs.remove_unless_held(&a, 0);
        assert_eq!(backoffs.get(&a, 0).count, 0);
    }

    #[test]
    fn the_number_of_counts_is_bounded_and_lapsed_ones_make_room() {
        let mut backoffs = Backoffs::new(foldhash::fast::RandomState::default());
        let lapse = BACKOFF_LAPSE_MS * NANOS_PER_MS;
        for i in 0..MAX_BACKOFFS {
            backoffs.set(
                &KeyRef::new(b"ex", Some(&credential(i)), b""),
                counted(1),
                0,
            );
        }
        let late = credential(MAX_BACKOFFS);
        let late = KeyRef::new(b"ex", Some(&late), b"");
        backoffs.set(&late, counted(1), 1);
        assert_eq!(
            backoffs.get(&late, 1).count,
            0,
            "full: a new credential is not counted"
        );
        // A counted credential still counts on.
        let first = credential(0);
        let first = KeyRef::new(b"ex", Some(&first), b"");
        backoffs.set(&first, counted(2), lapse - 1);
        assert_eq!(backoffs.get(&first, lapse - 1).count, 2);
        // Once the others lapsed, the new one is counted.
        backoffs.set(&late, counted(1), lapse);
        assert_eq!(backoffs.get(&late, lapse).count, 1);
        assert_eq!(backoffs.counts.len(), 2);
    }

    #[test]
    fn a_full_table_is_walked_for_lapsed_counts_only_once_one_may_have_lapsed() {
        let mut backoffs = Backoffs::new(foldhash::fast::RandomState::default());
        let lapse = BACKOFF_LAPSE_MS * NANOS_PER_MS;
        for i in 0..MAX_BACKOFFS {
            let credential = credential(i);
            let set_at = i as u64;
            backoffs.set(
                &KeyRef::new(b"ex", Some(&credential), b""),
                counted(1),
                set_at,
            );
        }
        // Full, none lapsed: the walk learns that none lapses before the first one's lapse.
        let new = |i: usize| credential(MAX_BACKOFFS + i);
        backoffs.set(&KeyRef::new(b"ex", Some(&new(0)), b""), counted(1), 5);
        assert_eq!(backoffs.no_lapse_before, lapse);
        // Until then, no walk (a removal meanwhile leaves room all the same).
        backoffs.remove_unless_held(&KeyRef::new(b"ex", Some(&credential(7)), b""), 6);
        backoffs.set(&KeyRef::new(b"ex", Some(&new(1)), b""), counted(1), 6);
        assert_eq!(backoffs.counts.len(), MAX_BACKOFFS);
        // At the first lapse, one walk drops it and learns of the next.
        backoffs.set(&KeyRef::new(b"ex", Some(&new(2)), b""), counted(1), lapse);
        assert_eq!(
            backoffs
                .get(&KeyRef::new(b"ex", Some(&new(2)), b""), lapse)
                .count,
            1
        );
        assert_eq!(backoffs.no_lapse_before, lapse + 1);
        // Emptied, it knows that nothing set from then on lapses sooner than a lapse later.
        backoffs.drop_lapsed(3 * lapse);
        assert!(backoffs.counts.is_empty());
        assert_eq!(backoffs.no_lapse_before, 4 * lapse);
    }
}

//! Pauses in force, indexed by what they cover (an exchange, a credential, one key), so a
//! check looks up at most three entries however many pauses there are.

use std::hash::BuildHasher;

use hashbrown::hash_table::Entry;
use hashbrown::HashTable;

use crate::key::{Key, KeyRef};
use crate::rules::MAX_PAUSES;
use crate::types::PauseTarget;

/// Pauses an index holds before it reserves room for all it may ever hold
/// ([`MAX_PAUSES`]): growing step by step past this would rehash every pause under the
/// table's lock, which checks wait for on their callers' schedulers.
const RESERVE_AT: usize = 64;

/// The most pauses one call of [`Pauses::take_ended`] or [`Pauses::take_of_exchange`] takes
/// out: a call walks the indexes once, comparing numbers (a few tens of µs over every pause
/// there may be), and leaves freeing what it took to its caller, once it let the table's
/// lock go.
pub(crate) const TAKE_STEP: usize = 256;

/// A pause's target packed as a key (an exchange is `{exchange, :public, ""}` and a
/// credential `{exchange, credential, ""}`, each in its own index), its exchange's hash,
/// and when it ends.
pub(crate) struct Pause {
    key: Key,
    hash: u64,
    exchange_hash: u64,
    until: u64,
}

/// The pauses of one table. The key index hashes with the table's hasher, so a check
/// reuses the hash it already has.
pub(crate) struct Pauses {
    hasher: foldhash::fast::RandomState,
    exchanges: HashTable<Pause>,
    credentials: HashTable<Pause>,
    keys: HashTable<Pause>,
    /// The end of a pause of every exchange (0: none): what a new exchange pause holds
    /// when [`MAX_PAUSES`] exchanges are paused.
    every: u64,
    /// No pause in the indexes ends before this: until then, looking for ended ones to
    /// make room finds none, and is skipped.
    no_end_before: u64,
}

fn find<'a>(index: &'a HashTable<Pause>, hash: u64, key: &KeyRef) -> Option<&'a Pause> {
    index.find(hash, |pause| {
        pause.hash == hash && pause.key.as_ref() == *key
    })
}

impl Pauses {
    pub fn new(hasher: foldhash::fast::RandomState) -> Self {
        Self {
            hasher,
            exchanges: HashTable::new(),
            credentials: HashTable::new(),
            keys: HashTable::new(),
            every: 0,
            no_end_before: 0,
        }
    }

    /// Holds `target` until `until`; an existing pause of it keeps the later end. Key and
    /// credential pauses are at most [`MAX_PAUSES`], and so are exchange pauses; ended ones
    /// count until taken out, as a new pause without room does first (at `now`). Still
    /// without room, a new key or credential pause holds its whole exchange instead, and a
    /// new exchange pause every exchange: a limited reply is never ignored. Returns the
    /// ended pauses taken out, for the caller to free once it let the lock go.
    pub fn add(&mut self, target: &PauseTarget, until: u64, now: u64) -> Vec<Pause> {
        let mut ended = Vec::new();
        let mut held = self.insert(target, until);
        if !held {
            ended = self.make_room(now);
            held = self.insert(target, until);
        }
        let held = held
            || !matches!(target, PauseTarget::Exchange(_))
                && self.insert(&PauseTarget::Exchange(target.exchange().to_vec()), until);
        if !held {
            self.every = self.every.max(until);
        }
        ended
    }

    /// Takes out up to [`TAKE_STEP`] pauses of each kind that ended by `now`, so that a new
    /// pause of any kind finds room; nothing when none can have ended.
    fn make_room(&mut self, now: u64) -> Vec<Pause> {
        if now < self.no_end_before {
            return Vec::new();
        }
        let mut out = Vec::new();
        let mut next_end = u64::MAX;
        let mut walked_all = true;
        for index in [&mut self.exchanges, &mut self.credentials, &mut self.keys] {
            let taken = out.len();
            out.extend(
                index
                    .extract_if(|pause| {
                        let ended = pause.until <= now;
                        if !ended {
                            next_end = next_end.min(pause.until);
                        }
                        ended
                    })
                    .take(TAKE_STEP),
            );
            walked_all &= out.len() - taken < TAKE_STEP;
        }
        if walked_all {
            self.no_end_before = next_end;
        }
        out
    }

    /// Whether a new pause of `target`'s kind fits.
    fn room(&self, target: &PauseTarget) -> bool {
        let in_force = match target {
            PauseTarget::Exchange(_) => self.exchanges.len(),
            _ => self.credentials.len() + self.keys.len(),
        };
        in_force < MAX_PAUSES
    }

    /// Holds `target` until `until`: an existing pause keeps the later end; a new one is
    /// added if there is room. Returns whether it is held.
    fn insert(&mut self, target: &PauseTarget, until: u64) -> bool {
        let room = self.room(target);
        let (index, key) = match target {
            PauseTarget::Exchange(exchange) => {
                (&mut self.exchanges, KeyRef::new(exchange, None, b""))
            }
            PauseTarget::Credential(exchange, credential) => (
                &mut self.credentials,
                KeyRef::new(exchange, credential.as_deref(), b""),
            ),
            PauseTarget::Key(key) => (&mut self.keys, key.as_ref()),
        };
        if index.len() >= RESERVE_AT && index.capacity() < MAX_PAUSES {
            index.reserve(MAX_PAUSES - index.len(), |pause| pause.hash);
        }
        let hash = self.hasher.hash_one(key);
        let exchange_hash = self.hasher.hash_one(key.exchange);
        let entry = index.entry(
            hash,
            |pause| pause.hash == hash && pause.key.as_ref() == key,
            |pause| pause.hash,
        );
        match entry {
            Entry::Occupied(mut pause) => {
                let pause = pause.get_mut();
                pause.until = pause.until.max(until);
            }
            Entry::Vacant(_) if !room => return false,
            Entry::Vacant(vacant) => {
                vacant.insert(Pause {
                    key: key.to_owned_key(),
                    hash,
                    exchange_hash,
                    until,
                });
                self.no_end_before = self.no_end_before.min(until);
            }
        }
        true
    }

    /// The latest end of the pauses covering `key` (whose hash is `key_hash`), or 0.
    pub fn until(&self, key: &KeyRef, key_hash: u64) -> u64 {
        let mut until = self.every;
        if !self.keys.is_empty() {
            if let Some(pause) = find(&self.keys, key_hash, key) {
                until = pause.until;
            }
        }
        for (index, packed) in [
            (
                &self.credentials,
                KeyRef::new(key.exchange, key.credential, b""),
            ),
            (&self.exchanges, KeyRef::new(key.exchange, None, b"")),
        ] {
            if !index.is_empty() {
                let hash = self.hasher.hash_one(packed);
                if let Some(pause) = find(index, hash, &packed) {
                    until = until.max(pause.until);
                }
            }
        }
        until
    }

    /// Ends a pause on `key` alone.
    pub fn remove_key(&mut self, key: &KeyRef, key_hash: u64) {
        if let Ok(entry) = self.keys.find_entry(key_hash, |pause| {
            pause.hash == key_hash && pause.key.as_ref() == *key
        }) {
            entry.remove();
        }
    }

    /// Takes out up to [`TAKE_STEP`] pauses of `exchange`.
    pub fn take_of_exchange(&mut self, exchange: &[u8]) -> Vec<Pause> {
        let hash = self.hasher.hash_one(exchange);
        self.take_where(|pause| pause.exchange_hash == hash && pause.key.exchange() == exchange)
    }

    /// Ends every pause; returns them, for the caller to free once it let the lock go.
    pub fn take(&mut self) -> Self {
        std::mem::replace(self, Self::new(self.hasher))
    }

    /// Takes out up to [`TAKE_STEP`] pauses that ended by `now`, and the pause of every
    /// exchange if it ended.
    pub fn take_ended(&mut self, now: u64) -> Vec<Pause> {
        if self.every <= now {
            self.every = 0;
        }
        self.take_where(|pause| pause.until <= now)
    }

    /// Takes out up to [`TAKE_STEP`] pauses `taken` picks; an index back to a few pauses
    /// gives its reserved room back.
    fn take_where(&mut self, taken: impl Fn(&Pause) -> bool) -> Vec<Pause> {
        let mut out = Vec::new();
        for index in [&mut self.exchanges, &mut self.credentials, &mut self.keys] {
            let room = TAKE_STEP - out.len();
            out.extend(index.extract_if(|pause| taken(pause)).take(room));
            if index.len() < RESERVE_AT / 4 && index.capacity() > RESERVE_AT {
                index.shrink_to(0, |pause| pause.hash);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(i: usize) -> PauseTarget {
        let credential = format!("key-{i}");
        PauseTarget::Key(KeyRef::new(b"ex", Some(credential.as_bytes()), b"ip").to_owned_key())
    }

    #[test]
    fn lookups_find_each_kind_and_the_latest_end() {
        let hasher = foldhash::fast::RandomState::default();
        let mut pauses = Pauses::new(hasher);
        let key = KeyRef::new(b"ex", Some(b"k"), b"ip");
        let other = KeyRef::new(b"other", Some(b"k"), b"ip");
        pauses.add(&PauseTarget::Exchange(b"ex".to_vec()), 10, 0);
        pauses.add(
            &PauseTarget::Credential(b"ex".to_vec(), Some(b"k".to_vec())),
            30,
            0,
        );
        pauses.add(&PauseTarget::Key(key.to_owned_key()), 20, 0);
        assert_eq!(pauses.until(&key, hasher.hash_one(key)), 30);
        assert_eq!(pauses.until(&other, hasher.hash_one(other)), 0);
        // The public pool is not a credential's pause.
        let public = KeyRef::new(b"ex", None, b"ip");
        assert_eq!(pauses.until(&public, hasher.hash_one(public)), 10);
        take_all(|| pauses.take_ended(25));
        assert_eq!(pauses.until(&key, hasher.hash_one(key)), 30);
        assert_eq!(pauses.until(&public, hasher.hash_one(public)), 0);
    }

    /// Takes steps until one takes less than a full step; returns how many were taken.
    fn take_all(mut step: impl FnMut() -> Vec<Pause>) -> usize {
        let mut taken = 0;
        loop {
            let pauses = step();
            assert!(pauses.len() <= TAKE_STEP);
            taken += pauses.len();
            if pauses.len() < TAKE_STEP {
                return taken;
            }
        }
    }

    #[test]
    fn pauses_are_taken_out_a_step_at_a_time_and_only_those_picked() {
        let hasher = foldhash::fast::RandomState::default();
        let mut pauses = Pauses::new(hasher);
        for exchange in [b"ex".as_slice(), b"other"] {
            for i in 0..1_000 {
                let credential = format!("key-{i}").into_bytes();
                let key = KeyRef::new(exchange, Some(&credential), b"ip").to_owned_key();
                pauses.add(&PauseTarget::Key(key), 100 + i, 0);
                let credential = PauseTarget::Credential(exchange.to_vec(), Some(credential));
                pauses.add(&credential, 100 + i, 0);
            }
            pauses.add(&PauseTarget::Exchange(exchange.to_vec()), 5_000, 0);
        }
        assert_eq!(pauses.take_of_exchange(b"ex").len(), TAKE_STEP);
        assert_eq!(
            take_all(|| pauses.take_of_exchange(b"ex")),
            2_001 - TAKE_STEP
        );
        let other = KeyRef::new(b"other", Some(b"key-999"), b"ip");
        assert_eq!(pauses.until(&other, hasher.hash_one(other)), 5_000);
        let ex = KeyRef::new(b"ex", Some(b"key-999"), b"ip");
        assert_eq!(pauses.until(&ex, hasher.hash_one(ex)), 0);
        // Those of "other" ended by 599: 500 keys and 500 credentials.
        assert_eq!(take_all(|| pauses.take_ended(599)), 1_000);
        assert_eq!(len(&pauses), 1_001);
    }

    fn len(pauses: &Pauses) -> usize {
        pauses.exchanges.len() + pauses.credentials.len() + pauses.keys.len()
    }

    #[test]
    fn past_the_bound_a_key_or_credential_pause_holds_its_exchange() {
        let hasher = foldhash::fast::RandomState::default();
        let mut pauses = Pauses::new(hasher);
        for i in 0..MAX_PAUSES {
            pauses.add(&target(i), 100, 0);
        }
        let other = KeyRef::new(b"ex", Some(b"other"), b"ip");
        assert_eq!(pauses.until(&other, hasher.hash_one(other)), 0);
        // An existing target is extended; a new one holds the exchange.
        pauses.add(&target(0), 200, 0);
        pauses.add(&target(MAX_PAUSES), 300, 0);
        let credential = PauseTarget::Credential(b"ex".to_vec(), Some(b"new".to_vec()));
        pauses.add(&credential, 400, 0);
        assert_eq!(pauses.until(&other, hasher.hash_one(other)), 400);
        assert_eq!(len(&pauses), MAX_PAUSES + 1);
        // Ended pauses make room again.
        take_all(|| pauses.take_ended(350));
        pauses.add(&target(MAX_PAUSES + 1), 500, 0);
        assert_eq!(len(&pauses), 2);
    }

    #[test]
    fn past_the_bound_a_new_exchange_pause_holds_every_exchange_until_it_ends() {
        let hasher = foldhash::fast::RandomState::default();
        let mut pauses = Pauses::new(hasher);
        let exchange = |i: usize| PauseTarget::Exchange(format!("ex-{i}").into_bytes());
        for i in 0..MAX_PAUSES {
            pauses.add(&exchange(i), 100, 0);
        }
        let elsewhere = KeyRef::new(b"elsewhere", Some(b"k"), b"ip");
        let until_elsewhere =
            |pauses: &Pauses| pauses.until(&elsewhere, hasher.hash_one(elsewhere));
        assert_eq!(until_elsewhere(&pauses), 0);
        // A paused exchange is extended as before; a new one holds every exchange.
        pauses.add(&exchange(0), 200, 0);
        assert_eq!(until_elsewhere(&pauses), 0);
        pauses.add(&exchange(MAX_PAUSES), 300, 0);
        assert_eq!(until_elsewhere(&pauses), 300);
        // So does a key or credential pause that has no room and no room for its exchange.
        for i in 0..MAX_PAUSES {
            pauses.add(&target(i), 50, 0);
        }
        let credential = PauseTarget::Credential(b"new".to_vec(), Some(b"k".to_vec()));
        pauses.add(&credential, 400, 0);
        assert_eq!(until_elsewhere(&pauses), 400);
        assert_eq!(len(&pauses), 2 * MAX_PAUSES);
        // It ends as any pause does.
        take_all(|| pauses.take_ended(400));
        assert_eq!(until_elsewhere(&pauses), 0);
        assert_eq!(len(&pauses), 0);
    }

    #[test]
    fn a_new_pause_without_room_takes_out_ended_ones_first() {
        let hasher = foldhash::fast::RandomState::default();
        let mut pauses = Pauses::new(hasher);
        let exchange = |i: usize| PauseTarget::Exchange(format!("ex-{i}").into_bytes());
        for i in 0..MAX_PAUSES {
            pauses.add(&exchange(i), 100, 0);
        }
        // All ended by 150, none swept yet: room is made, and no other exchange is held.
        let ended = pauses.add(&exchange(MAX_PAUSES), 300, 150);
        assert_eq!(ended.len(), TAKE_STEP);
        let elsewhere = KeyRef::new(b"elsewhere", Some(b"k"), b"ip");
        assert_eq!(pauses.until(&elsewhere, hasher.hash_one(elsewhere)), 0);
        let paused = KeyRef::new(format!("ex-{MAX_PAUSES}").as_bytes(), None, b"ip").to_owned_key();
        let paused = paused.as_ref();
        assert_eq!(pauses.until(&paused, hasher.hash_one(paused)), 300);
    }

    #[test]
    fn room_is_made_for_each_kind_and_looked_for_only_once_a_pause_may_have_ended() {
        let hasher = foldhash::fast::RandomState::default();
        let mut pauses = Pauses::new(hasher);
        for i in 0..2 * TAKE_STEP {
            pauses.add(
                &PauseTarget::Exchange(format!("ex-{i}").into_bytes()),
                100,
                0,
            );
        }
        for i in 0..MAX_PAUSES {
            pauses.add(&target(i), 100 + i as u64, 0);
        }
        // Nothing ended at 50: no room, so the credential's exchange is held; the walk
        // learnt that nothing ends before 100, and the next one is skipped.
        let other = KeyRef::new(b"cx", Some(b"other"), b"ip");
        let credential =
            |name: &str| PauseTarget::Credential(b"cx".to_vec(), Some(name.as_bytes().to_vec()));
        assert!(pauses.add(&credential("early"), 1_000, 50).is_empty());
        assert_eq!(pauses.until(&other, hasher.hash_one(other)), 1_000);
        assert_eq!(pauses.no_end_before, 100);
        // At 150, many ended exchange pauses and 51 ended key pauses: a credential gets
        // room of its own kind, and its exchange's pause is not extended.
        let ended = pauses.add(&credential("late"), 2_000, 150);
        assert_eq!(ended.len(), TAKE_STEP + 51);
        assert_eq!(pauses.until(&other, hasher.hash_one(other)), 1_000);
        let late = KeyRef::new(b"cx", Some(b"late"), b"ip");
        assert_eq!(pauses.until(&late, hasher.hash_one(late)), 2_000);
    }
}

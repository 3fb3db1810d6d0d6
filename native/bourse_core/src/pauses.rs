//! Pauses in force, indexed by what they cover (an exchange, a credential, one key), so a
//! check looks up at most three entries however many pauses there are.

use std::hash::BuildHasher;

use hashbrown::hash_table::Entry;
use hashbrown::HashTable;

use crate::key::{Key, KeyRef};
use crate::rules::{self, InvalidInput, MAX_PAUSES};
use crate::types::PauseTarget;

/// A pause's target packed as a key (an exchange is `{exchange, :public, ""}` and a
/// credential `{exchange, credential, ""}`, each in its own index), and when it ends.
struct Pause {
    key: Key,
    hash: u64,
    until: u64,
}

/// The pauses of one table. The key index hashes with the table's hasher, so a check
/// reuses the hash it already has.
pub(crate) struct Pauses {
    hasher: foldhash::fast::RandomState,
    exchanges: HashTable<Pause>,
    credentials: HashTable<Pause>,
    keys: HashTable<Pause>,
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
        }
    }

    fn len(&self) -> usize {
        self.exchanges.len() + self.credentials.len() + self.keys.len()
    }

    /// Holds `target` until `until`; an existing pause of it keeps the later end. Past
    /// [`MAX_PAUSES`] pauses, a new target is refused.
    pub fn add(&mut self, target: &PauseTarget, until: u64) -> Result<(), InvalidInput> {
        let full = self.len() >= MAX_PAUSES;
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
        let hash = self.hasher.hash_one(key);
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
            Entry::Vacant(_) if full => {
                return Err(rules::too_many_pauses().for_exchange(target.exchange()))
            }
            Entry::Vacant(vacant) => {
                vacant.insert(Pause {
                    key: key.to_owned_key(),
                    hash,
                    until,
                });
            }
        }
        Ok(())
    }

    /// The latest end of the pauses covering `key` (whose hash is `key_hash`), or 0.
    pub fn until(&self, key: &KeyRef, key_hash: u64) -> u64 {
        let mut until = 0;
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

    /// Ends every pause of `exchange`.
    pub fn remove_exchange(&mut self, exchange: &[u8]) {
        for index in [&mut self.exchanges, &mut self.credentials, &mut self.keys] {
            index.retain(|pause| pause.key.exchange() != exchange);
        }
    }

    /// Ends every pause.
    pub fn clear(&mut self) {
        *self = Self::new(self.hasher);
    }

    /// Drops the pauses that ended by `now`.
    pub fn drop_ended(&mut self, now: u64) {
        for index in [&mut self.exchanges, &mut self.credentials, &mut self.keys] {
            index.retain(|pause| pause.until > now);
            if index.len() < index.capacity() / 4 {
                index.shrink_to(0, |pause| pause.hash);
            }
        }
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
        pauses
            .add(&PauseTarget::Exchange(b"ex".to_vec()), 10)
            .unwrap();
        pauses
            .add(
                &PauseTarget::Credential(b"ex".to_vec(), Some(b"k".to_vec())),
                30,
            )
            .unwrap();
        pauses
            .add(&PauseTarget::Key(key.to_owned_key()), 20)
            .unwrap();
        assert_eq!(pauses.until(&key, hasher.hash_one(key)), 30);
        assert_eq!(pauses.until(&other, hasher.hash_one(other)), 0);
        // The public pool is not a credential's pause.
        let public = KeyRef::new(b"ex", None, b"ip");
        assert_eq!(pauses.until(&public, hasher.hash_one(public)), 10);
        pauses.drop_ended(25);
        assert_eq!(pauses.until(&key, hasher.hash_one(key)), 30);
        assert_eq!(pauses.until(&public, hasher.hash_one(public)), 0);
    }

    #[test]
    fn the_number_of_pauses_is_bounded_and_ended_ones_make_room() {
        let mut pauses = Pauses::new(foldhash::fast::RandomState::default());
        for i in 0..MAX_PAUSES {
            pauses.add(&target(i), 100).unwrap();
        }
        let refused = pauses.add(&target(MAX_PAUSES), 100).unwrap_err();
        assert_eq!(
            refused.message(),
            format!("at most {MAX_PAUSES} pauses may be in force at once; this one was not added")
        );
        assert_eq!(refused.exchange(), Some(&b"ex"[..]));
        // An existing target may still be extended.
        pauses.add(&target(0), 200).unwrap();
        pauses.drop_ended(150);
        pauses.add(&target(MAX_PAUSES), 300).unwrap();
        assert_eq!(pauses.len(), 2);
    }
}

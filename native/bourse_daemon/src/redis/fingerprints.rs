//! The fingerprints of recently seen credentials, so that the checks of one credential
//! compute its two fingerprints (an HMAC and a SHA-256, about 12k instructions) once, not
//! on every check.
//!
//! A credential is never kept: entries are found by a 128-bit id of it, two SipHash-2-4
//! under two 128-bit keys drawn independently from the system's randomness for each table
//! (never std's `RandomState`, whose keys within a thread differ only by a count). Nobody
//! outside the process knows the keys, so nobody can compute an id or choose credentials
//! that share one; SipHash-2-4 being a pseudorandom function (its design claim), two given
//! credentials share an id with a chance of about 2^-128. At most [`CAPACITY`] entries are
//! held; a full table is emptied at once (the credentials in use come back within a few
//! checks).

use std::collections::HashMap;
use std::hash::Hasher;
#[allow(deprecated)] // std's only SipHash that takes a key.
use std::hash::SipHasher;
use std::sync::{Arc, Mutex, PoisonError};

use crate::fingerprint::{self, Keyed};

/// The most credentials whose fingerprints are kept.
pub const CAPACITY: usize = 4096;

/// A credential's stand-ins.
pub struct Fingerprint {
    /// In Redis key names ([`Keyed::of`]).
    pub keyed: String,
    /// In answers and in the bucket ([`fingerprint::shown`]).
    pub shown: String,
}

pub struct Fingerprints {
    keyed: Keyed,
    /// The SipHash keys (k0, k1) of an id's two halves.
    id_keys: [[u64; 2]; 2],
    recent: Mutex<HashMap<[u64; 2], Arc<Fingerprint>>>,
}

impl Fingerprints {
    /// Keyed fingerprints under `secret` (see [`Keyed::new`]); an error when the system
    /// gives no randomness for the ids' keys.
    pub fn new(secret: Option<&[u8]>) -> Result<Self, String> {
        let mut bytes = [0u8; 32];
        getrandom::fill(&mut bytes)
            .map_err(|error| format!("no system randomness for the fingerprint cache: {error}"))?;
        let word = |i: usize| {
            let mut word = [0u8; 8];
            word.copy_from_slice(&bytes[i * 8..i * 8 + 8]);
            u64::from_le_bytes(word)
        };
        Ok(Self {
            keyed: Keyed::new(secret),
            id_keys: [[word(0), word(1)], [word(2), word(3)]],
            recent: Mutex::new(HashMap::new()),
        })
    }

    /// The id of `credential`'s entry.
    fn id(&self, credential: &[u8]) -> [u64; 2] {
        self.id_keys.map(|[k0, k1]| {
            #[allow(deprecated)]
            let mut hasher = SipHasher::new_with_keys(k0, k1);
            hasher.write(credential);
            hasher.finish()
        })
    }

    pub fn of(&self, credential: &[u8]) -> Arc<Fingerprint> {
        let id = self.id(credential);
        if let Some(found) = self.recent().get(&id) {
            return found.clone();
        }
        let found = Arc::new(Fingerprint {
            keyed: self.keyed.of(credential),
            shown: fingerprint::shown(credential),
        });
        let mut recent = self.recent();
        if recent.len() >= CAPACITY {
            recent.clear();
        }
        recent.insert(id, found.clone());
        found
    }

    /// How many credentials' fingerprints are held.
    #[cfg(test)]
    fn held(&self) -> usize {
        self.recent().len()
    }

    fn recent(&self) -> std::sync::MutexGuard<'_, HashMap<[u64; 2], Arc<Fingerprint>>> {
        // A panic elsewhere cannot leave an entry half written: inserts are whole.
        self.recent.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_are_computed_once_and_bounded() {
        let fingerprints = Fingerprints::new(Some(b"s3cret")).unwrap();
        let keyed = Keyed::new(Some(b"s3cret"));
        let first = fingerprints.of(b"k1");
        assert_eq!(first.keyed, keyed.of(b"k1"));
        assert_eq!(first.shown, fingerprint::shown(b"k1"));
        assert!(Arc::ptr_eq(&first, &fingerprints.of(b"k1")));
        assert_eq!(fingerprints.of(b"k2").keyed, keyed.of(b"k2"));
        for i in 0..CAPACITY * 2 + 1 {
            let credential = format!("c{i}");
            let found = fingerprints.of(credential.as_bytes());
            assert_eq!(found.keyed, keyed.of(credential.as_bytes()));
            assert!(fingerprints.held() <= CAPACITY);
        }
        // Emptied when full: k1 is computed again, equal.
        assert_eq!(fingerprints.of(b"k1").keyed, first.keyed);
    }

    /// An id is the same for one credential within a table, and differs between tables and
    /// between credentials.
    #[test]
    fn ids_are_stable_within_a_table_and_differ_between_tables() {
        let (a, b) = (
            Fingerprints::new(None).unwrap(),
            Fingerprints::new(None).unwrap(),
        );
        assert_eq!(a.id(b"k1"), a.id(b"k1"));
        assert_ne!(a.id(b"k1"), a.id(b"k2"));
        let (in_a, in_b) = (a.id(b"k1"), b.id(b"k1"));
        assert!(
            in_a[0] != in_b[0] && in_a[1] != in_b[1],
            "{in_a:?} {in_b:?}"
        );
    }

    /// The four keys of two tables made one after the other are unrelated: not the keys
    /// of std's `RandomState`, which share k1 within a thread and count k0 up by one.
    #[test]
    fn id_keys_are_independent_within_a_table_and_across_tables() {
        let (a, b) = (
            Fingerprints::new(None).unwrap(),
            Fingerprints::new(None).unwrap(),
        );
        let keys = [a.id_keys, b.id_keys].concat();
        for (i, [k0, k1]) in keys.iter().enumerate() {
            for [other_k0, other_k1] in &keys[i + 1..] {
                assert_ne!(k1, other_k1, "{keys:?}");
                // Apart by more than a count: a chance of 2^-31 for random keys.
                let apart = k0.wrapping_sub(*other_k0);
                assert!(
                    apart > 1 << 32 && apart.wrapping_neg() > 1 << 32,
                    "{keys:?}"
                );
            }
        }
    }
}

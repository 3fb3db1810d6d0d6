//! The fingerprints of recently seen credentials, so that the checks of one credential
//! compute its two fingerprints (an HMAC and a SHA-256, about 12k instructions) once, not
//! on every check.
//!
//! A credential is never kept: entries are found by a keyed 128-bit hash of it (two
//! SipHash-1-3 under random keys drawn by this process), which nobody outside the process
//! can compute or invert, and two credentials share an entry with a chance of 2^-128. At
//! most [`CAPACITY`] entries are held; a full table is emptied at once (the credentials in
//! use come back within a few checks).

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::BuildHasher;
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
    hashers: [RandomState; 2],
    recent: Mutex<HashMap<[u64; 2], Arc<Fingerprint>>>,
}

impl Fingerprints {
    /// Keyed fingerprints under `secret` (see [`Keyed::new`]).
    pub fn new(secret: Option<&[u8]>) -> Self {
        Self {
            keyed: Keyed::new(secret),
            hashers: [RandomState::new(), RandomState::new()],
            recent: Mutex::new(HashMap::new()),
        }
    }

    pub fn of(&self, credential: &[u8]) -> Arc<Fingerprint> {
        let id = self
            .hashers
            .each_ref()
            .map(|hasher| hasher.hash_one(credential));
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
        let fingerprints = Fingerprints::new(Some(b"s3cret"));
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
}

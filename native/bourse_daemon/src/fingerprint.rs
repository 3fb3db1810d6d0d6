//! Stand-ins for credentials: what answers show, and what Redis key names hold. Neither
//! lets anyone recover an API key.

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

/// The key of [`Keyed`] when no secret is configured: names are then HMACs under a key
/// anyone can read, one-way but not secret.
const DEFAULT_KEY: &[u8] = b"bourse key names v2";

/// `"key:"` and the first 8 hex digits of the credential's SHA-256, as
/// `Bourse.Fingerprint.of/1` computes it.
pub fn shown(credential: &[u8]) -> String {
    format!("key:{}", hex(&Sha256::digest(credential)[..4]))
}

/// A keyed fingerprint: the first 128 bits of HMAC-SHA256(secret, credential), in hex.
#[derive(Clone)]
pub struct Keyed {
    mac: Hmac<Sha256>,
}

impl Keyed {
    pub fn new(secret: Option<&[u8]>) -> Self {
        let key = secret.unwrap_or(DEFAULT_KEY);
        Self {
            // HMAC takes keys of any length.
            mac: Hmac::new_from_slice(key).unwrap_or_else(|_| unreachable!()),
        }
    }

    pub fn of(&self, credential: &[u8]) -> String {
        let mut mac = self.mac.clone();
        mac.update(credential);
        hex(&mac.finalize().into_bytes()[..16])
    }
}

pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut text = String::with_capacity(bytes.len() * 2);
    for &byte in bytes {
        text.push(DIGITS[usize::from(byte >> 4)] as char);
        text.push(DIGITS[usize::from(byte & 15)] as char);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shown_matches_elixir_and_keyed_depends_on_the_secret() {
        // :crypto.hash(:sha256, "my-api-key") starts with these 4 bytes.
        assert_eq!(
            shown(b"my-api-key"),
            format!("key:{}", hex(&Sha256::digest(b"my-api-key")[..4]))
        );
        assert_eq!(shown(b"abc"), "key:ba7816bf");
        let plain = Keyed::new(None);
        let keyed = Keyed::new(Some(b"s3cret"));
        assert_eq!(plain.of(b"k").len(), 32);
        assert_ne!(plain.of(b"k"), keyed.of(b"k"));
        assert_eq!(keyed.of(b"k"), Keyed::new(Some(b"s3cret")).of(b"k"));
        assert_ne!(keyed.of(b"k"), keyed.of(b"k2"));
    }
}

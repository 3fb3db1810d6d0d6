//! Bucket keys: `{exchange_id, credential, axis}`, borrowed for look-ups and packed for storage.

use std::hash::{Hash, Hasher};

/// A key as the caller holds it; `credential: None` is the shared `:public` pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct KeyRef<'a> {
    /// The exchange id (`"binance"`).
    pub exchange: &'a [u8],
    /// The API key, or `None` for the `:public` pool.
    pub credential: Option<&'a [u8]>,
    /// The bucket axis (`"request"`, `"ip"`, ...).
    pub axis: &'a [u8],
}

impl<'a> KeyRef<'a> {
    /// A key from its three parts.
    pub fn new(exchange: &'a [u8], credential: Option<&'a [u8]>, axis: &'a [u8]) -> Self {
        Self {
            exchange,
            credential,
            axis,
        }
    }

    /// The key packed for storage.
    pub fn to_owned_key(&self) -> Key {
        let credential = self.credential.unwrap_or_default();
        let mut bytes =
            Vec::with_capacity(self.exchange.len() + credential.len() + self.axis.len());
        bytes.extend_from_slice(self.exchange);
        bytes.extend_from_slice(credential);
        bytes.extend_from_slice(self.axis);
        Key {
            bytes: bytes.into_boxed_slice(),
            exchange_end: self.exchange.len() as u32,
            credential_end: (self.exchange.len() + credential.len()) as u32,
            public: self.credential.is_none(),
        }
    }
}

impl Hash for KeyRef<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // The three lengths and the public flag in one word, then the bytes: four writes.
        let credential = self.credential.unwrap_or_default();
        state.write_u64(
            self.exchange.len() as u64
                | (credential.len() as u64) << 20
                | (self.axis.len() as u64) << 40
                | u64::from(self.credential.is_none()) << 63,
        );
        state.write(self.exchange);
        state.write(credential);
        state.write(self.axis);
    }
}

/// A stored key: the three parts packed into one allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Key {
    bytes: Box<[u8]>,
    exchange_end: u32,
    credential_end: u32,
    public: bool,
}

impl Key {
    /// The key's three parts.
    pub fn as_ref(&self) -> KeyRef<'_> {
        let (exchange_end, credential_end) =
            (self.exchange_end as usize, self.credential_end as usize);
        KeyRef {
            exchange: &self.bytes[..exchange_end],
            credential: (!self.public).then(|| &self.bytes[exchange_end..credential_end]),
            axis: &self.bytes[credential_end..],
        }
    }

    /// The exchange id.
    pub fn exchange(&self) -> &[u8] {
        &self.bytes[..self.exchange_end as usize]
    }

    /// The bytes of its three parts together.
    pub(crate) fn byte_len(&self) -> usize {
        self.bytes.len()
    }
}

/// A key looked up in a table: as the caller holds its parts, or packed as stored (a
/// prepared bucket's), which compares in one piece.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Sought<'a> {
    Parts(KeyRef<'a>),
    Packed(&'a Key),
}

impl Sought<'_> {
    /// Whether `stored` is this key.
    pub fn is(&self, stored: &Key) -> bool {
        match self {
            Self::Parts(key) => stored.is(key),
            Self::Packed(key) => stored == *key,
        }
    }
}

impl Key {
    /// Whether this is `key`: the sizes first, then the bytes of each part.
    fn is(&self, key: &KeyRef) -> bool {
        let credential = key.credential.unwrap_or_default();
        let exchange_end = key.exchange.len();
        let credential_end = exchange_end + credential.len();
        self.public == key.credential.is_none()
            && self.exchange_end as usize == exchange_end
            && self.credential_end as usize == credential_end
            && self.bytes.len() == credential_end + key.axis.len()
            && self.bytes[..exchange_end] == *key.exchange
            && self.bytes[exchange_end..credential_end] == *credential
            && self.bytes[credential_end..] == *key.axis
    }
}

impl Hash for Key {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_ref().hash(state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_key_round_trips() {
        let private = KeyRef::new(b"binance", Some(b"k1"), b"request");
        let public = KeyRef::new(b"binance", None, b"ip");
        assert_eq!(private.to_owned_key().as_ref(), private);
        assert_eq!(public.to_owned_key().as_ref(), public);
        // An empty credential is not the public pool.
        let empty = KeyRef::new(b"binance", Some(b""), b"ip");
        assert_ne!(empty.to_owned_key().as_ref(), public);
    }
}

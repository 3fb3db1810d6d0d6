//! The Redis names of the buckets' data (the layout is described in bucket.lua): every name
//! of an exchange starts with `PREFIX:{E}`, one hash tag, so on Redis Cluster an exchange
//! lives in one slot. Credentials appear only as keyed fingerprints
//! ([`Keyed`](crate::fingerprint::Keyed)).

/// A prefix names keys and is matched by `SCAN` patterns: plain characters only.
pub fn check_prefix(prefix: &str) -> Result<(), String> {
    let plain = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':');
    if !prefix.is_empty() && prefix.len() <= 64 && prefix.chars().all(plain) {
        Ok(())
    } else {
        Err(format!(
            "--redis-prefix must be 1 to 64 characters among A-Z a-z 0-9 _ - . :, got {prefix:?}"
        ))
    }
}

use std::io::Write;

/// Appends `<byte length>:<bytes>`: unambiguous whatever the bytes.
fn part(out: &mut Vec<u8>, bytes: &[u8]) {
    // Writing to a Vec cannot fail.
    let _ = write!(out, "{}:", bytes.len());
    out.extend_from_slice(bytes);
}

/// Appends `-` for the public pool, else `h` and the credential's keyed fingerprint (32 hex
/// digits).
fn credential_part(out: &mut Vec<u8>, credential: Option<&str>) {
    match credential {
        Some(fingerprint) => {
            out.push(b'h');
            out.extend_from_slice(fingerprint.as_bytes());
        }
        None => out.push(b'-'),
    }
}

/// Appends `PREFIX:{E}`: the hash tag every key of the exchange starts with.
fn tagged(out: &mut Vec<u8>, prefix: &[u8], exchange: &[u8]) {
    out.extend_from_slice(prefix);
    out.extend_from_slice(b":{");
    part(out, exchange);
    out.push(b'}');
}

/// A name written by `write`, in one allocation for most names.
fn written(write: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut name = Vec::with_capacity(128);
    write(&mut name);
    name
}

/// Appends the name of the hash of an exchange's pauses.
pub fn write_pauses(out: &mut Vec<u8>, prefix: &[u8], exchange: &[u8]) {
    tagged(out, prefix, exchange);
    out.extend_from_slice(b":p");
}

/// The hash of an exchange's pauses.
pub fn pauses_name(prefix: &[u8], exchange: &[u8]) -> Vec<u8> {
    written(|out| write_pauses(out, prefix, exchange))
}

/// Appends the name of the marker of when an exchange's state began.
pub fn write_marker(out: &mut Vec<u8>, prefix: &[u8], exchange: &[u8]) {
    out.extend_from_slice(prefix);
    out.extend_from_slice(b":e{");
    part(out, exchange);
    out.push(b'}');
}

/// Appends the name of the record of since when a Redis server's data is whole (on one
/// server only: it has no hash tag).
pub fn write_data_since(out: &mut Vec<u8>, prefix: &[u8]) {
    out.extend_from_slice(prefix);
    out.extend_from_slice(b":data");
}

/// Appends the name of the marker of the call numbered `run` (in hex, after `process`), in
/// the slot of the hash tag `tag`.
pub fn write_run_marker(out: &mut Vec<u8>, prefix: &[u8], tag: &[u8], process: u64, run: u64) {
    out.extend_from_slice(prefix);
    out.extend_from_slice(b":{");
    out.extend_from_slice(tag);
    let _ = write!(out, "}}:r:{process:016x}{run:x}");
}

/// The backoff count of the replies that limited the whole of `exchange`.
pub fn exchange_backoff_name(prefix: &[u8], exchange: &[u8]) -> Vec<u8> {
    written(|out| {
        tagged(out, prefix, exchange);
        out.extend_from_slice(b":o");
    })
}

/// A credential's names: its backoff count, and its field in the exchange's pauses.
pub struct CredentialNames {
    pub backoff: Vec<u8>,
    pub pause: Vec<u8>,
}

impl CredentialNames {
    /// The names of `exchange`'s credential given by its keyed fingerprint (`None`: public).
    pub fn new(prefix: &[u8], exchange: &[u8], credential: Option<&str>) -> Self {
        let key = KeyParts {
            prefix,
            exchange,
            credential,
            axis: b"",
        };
        Self {
            backoff: written(|out| {
                tagged(out, prefix, exchange);
                out.extend_from_slice(b":o:");
                credential_part(out, credential);
            }),
            pause: written(|out| key.credential_pause(out)),
        }
    }
}

/// The `SCAN` pattern of every key of every exchange (state markers excepted).
pub fn every_key_pattern(prefix: &[u8]) -> Vec<u8> {
    let mut pattern = prefix.to_vec();
    pattern.extend_from_slice(b":{*");
    pattern
}

/// The `SCAN` pattern of every key of `exchange` (its state marker excepted).
pub fn exchange_pattern(prefix: &[u8], exchange: &[u8]) -> Vec<u8> {
    let mut pattern = prefix.to_vec();
    pattern.extend_from_slice(b":{");
    let mut tag = Vec::new();
    part(&mut tag, exchange);
    for &byte in &tag {
        if matches!(byte, b'*' | b'?' | b'[' | b']' | b'\\') {
            pattern.push(b'\\');
        }
        pattern.push(byte);
    }
    pattern.extend_from_slice(b"}:*");
    pattern
}

/// What one key's names are made of; each name is appended to a buffer (a check writes
/// them straight into its call).
#[derive(Clone, Copy)]
pub struct KeyParts<'a> {
    pub prefix: &'a [u8],
    pub exchange: &'a [u8],
    /// The credential's keyed fingerprint, `None` for the public pool.
    pub credential: Option<&'a str>,
    pub axis: &'a [u8],
}

impl KeyParts<'_> {
    /// `PREFIX:{E}<kind>C:A`.
    fn named(&self, out: &mut Vec<u8>, kind: &[u8]) {
        tagged(out, self.prefix, self.exchange);
        out.extend_from_slice(kind);
        credential_part(out, self.credential);
        out.push(b':');
        part(out, self.axis);
    }

    /// Appends the bucket's name.
    pub fn bucket(&self, out: &mut Vec<u8>) {
        self.named(out, b":b:");
    }

    /// Appends the name of the bucket's bookings.
    pub fn bookings(&self, out: &mut Vec<u8>) {
        self.named(out, b":w:");
    }

    /// Appends the credential's field in the exchange's pauses.
    pub fn credential_pause(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(b"c:");
        credential_part(out, self.credential);
    }

    /// Appends the key's field in the exchange's pauses.
    pub fn key_pause(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(b"k:");
        credential_part(out, self.credential);
        out.push(b':');
        part(out, self.axis);
    }
}

/// The Redis names of one key's data (see bucket.lua for the layout).
#[derive(Clone)]
pub struct KeyNames {
    pub bucket: Vec<u8>,
    pub bookings: Vec<u8>,
    pub pauses: Vec<u8>,
    pub credential_pause: Vec<u8>,
    pub key_pause: Vec<u8>,
}

impl KeyNames {
    /// The names of a key given its credential's keyed fingerprint (`None`: public).
    pub fn from_parts(
        prefix: &[u8],
        exchange: &[u8],
        credential: Option<&str>,
        axis: &[u8],
    ) -> Self {
        let key = KeyParts {
            prefix,
            exchange,
            credential,
            axis,
        };
        Self {
            bucket: written(|out| key.bucket(out)),
            bookings: written(|out| key.bookings(out)),
            pauses: pauses_name(prefix, exchange),
            credential_pause: written(|out| key.credential_pause(out)),
            key_pause: written(|out| key.key_pause(out)),
        }
    }
}

/// A key as its bucket's name holds it: the credential by its keyed fingerprint.
pub struct NamedKey {
    pub exchange: Vec<u8>,
    pub credential: Option<String>,
    pub axis: Vec<u8>,
}

impl NamedKey {
    pub fn names(&self, prefix: &[u8]) -> KeyNames {
        KeyNames::from_parts(
            prefix,
            &self.exchange,
            self.credential.as_deref(),
            &self.axis,
        )
    }
}

/// The key of a bucket's name, or `None` for any other name.
pub fn decode_bucket_name(prefix: &[u8], name: &[u8]) -> Option<NamedKey> {
    fn take_part<'a>(rest: &mut &'a [u8]) -> Option<&'a [u8]> {
        let colon = rest.iter().position(|&b| b == b':')?;
        let length: usize = std::str::from_utf8(&rest[..colon]).ok()?.parse().ok()?;
        let value = rest.get(colon + 1..colon + 1 + length)?;
        *rest = &rest[colon + 1 + length..];
        Some(value)
    }
    let mut rest = name.strip_prefix(prefix)?.strip_prefix(b":{")?;
    let exchange = take_part(&mut rest)?;
    rest = rest.strip_prefix(b"}:b:")?;
    let credential = match rest.strip_prefix(b"-") {
        Some(after) => {
            rest = after;
            None
        }
        None => {
            let after = rest.strip_prefix(b"h")?;
            let (hex, after) = after.split_at_checked(32)?;
            rest = after;
            Some(std::str::from_utf8(hex).ok()?.to_string())
        }
    };
    rest = rest.strip_prefix(b":")?;
    let axis = take_part(&mut rest)?;
    rest.is_empty().then(|| NamedKey {
        exchange: exchange.to_vec(),
        credential,
        axis: axis.to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use bourse_core::KeyRef;

    use super::*;
    use crate::fingerprint::Keyed;
    use crate::redis::connection::hash_tag;

    fn names_of(prefix: &[u8], key: &KeyRef, keyed: &Keyed) -> KeyNames {
        let credential = key.credential.map(|credential| keyed.of(credential));
        KeyNames::from_parts(prefix, key.exchange, credential.as_deref(), key.axis)
    }

    /// On a cluster every key one check or pause touches must be in one slot.
    #[test]
    fn every_name_of_an_exchange_shares_one_hash_tag() {
        let keyed = Keyed::new(None);
        for exchange in [&b"binance"[..], b"a}b", b"{x}", b"", b"}{"] {
            let tags: Vec<Vec<u8>> = [
                KeyRef::new(exchange, None, b"ip"),
                KeyRef::new(exchange, Some(b"k1"), b"request"),
                KeyRef::new(exchange, Some(b"}{"), b"{order}"),
            ]
            .iter()
            .flat_map(|key| {
                let names = names_of(b"bourse", key, &keyed);
                let marker = written(|out| write_marker(out, b"bourse", key.exchange));
                [names.bucket, names.bookings, names.pauses, marker]
            })
            .map(|name| hash_tag(&name).to_vec())
            .collect();
            assert!(
                tags.iter().all(|tag| *tag == tags[0]),
                "{:?}: {tags:?}",
                String::from_utf8_lossy(exchange)
            );
        }
    }

    #[test]
    fn names_hold_no_credential_and_are_tagged_by_exchange() {
        let keyed = Keyed::new(None);
        let public = KeyRef::new(b"binance", None, b"ip");
        let secret = KeyRef::new(b"binance", Some(b"SECRET-KEY"), b"ip");
        let a = names_of(b"bourse", &public, &keyed);
        let b = names_of(b"bourse", &secret, &keyed);
        let h = keyed.of(b"SECRET-KEY");
        assert_eq!(a.bucket, b"bourse:{7:binance}:b:-:2:ip");
        assert_eq!(
            b.bucket,
            format!("bourse:{{7:binance}}:b:h{h}:2:ip").as_bytes()
        );
        assert_eq!(a.bookings, b"bourse:{7:binance}:w:-:2:ip");
        assert_eq!(a.pauses, b"bourse:{7:binance}:p");
        let marker = written(|out| write_marker(out, b"bourse", b"binance"));
        assert_eq!(marker, b"bourse:e{7:binance}");
        assert_eq!(a.key_pause, b"k:-:2:ip");
        assert_eq!(b.credential_pause, format!("c:h{h}").as_bytes());
        let credential = CredentialNames::new(b"bourse", b"binance", Some(&h));
        assert_eq!(
            credential.backoff,
            format!("bourse:{{7:binance}}:o:h{h}").as_bytes()
        );
        assert_eq!(credential.pause, b.credential_pause);
        assert_eq!(hash_tag(&credential.backoff), hash_tag(&a.pauses));
        assert!(decode_bucket_name(b"bourse", &credential.backoff).is_none());
        let exchange_backoff = exchange_backoff_name(b"bourse", b"binance");
        assert_eq!(exchange_backoff, b"bourse:{7:binance}:o");
        assert_eq!(hash_tag(&exchange_backoff), hash_tag(&a.pauses));
        for names in [&a, &b] {
            for name in [
                &names.bucket,
                &names.bookings,
                &names.credential_pause,
                &names.key_pause,
            ] {
                assert!(!String::from_utf8_lossy(name).contains("SECRET"));
            }
        }
        // Separators inside the parts cannot make two keys collide.
        let tricky = KeyRef::new(b"a:b", Some(b"}:b:"), b"x:1:y");
        let names = names_of(b"p", &tricky, &keyed);
        let decoded = decode_bucket_name(b"p", &names.bucket).unwrap();
        assert_eq!(
            (
                decoded.exchange.as_slice(),
                decoded.credential,
                decoded.axis.as_slice()
            ),
            (&b"a:b"[..], Some(keyed.of(b"}:b:")), &b"x:1:y"[..])
        );
        let decoded = decode_bucket_name(b"bourse", &a.bucket).unwrap();
        assert_eq!(decoded.credential, None);
        assert!(decode_bucket_name(b"bourse", &a.bookings).is_none());
        assert!(decode_bucket_name(b"bourse", &a.pauses).is_none());
        assert!(decode_bucket_name(b"other", &a.bucket).is_none());
    }

    #[test]
    fn run_markers_are_tagged_and_numbered() {
        let mut marker = Vec::new();
        write_run_marker(&mut marker, b"bourse", b"7:binance", 0xab, 0x1f);
        assert_eq!(marker, b"bourse:{7:binance}:r:00000000000000ab1f");
        assert_eq!(hash_tag(&marker), b"7:binance");
    }

    #[test]
    fn prefixes_are_plain() {
        assert!(check_prefix("bourse").is_ok());
        assert!(check_prefix("team-a:limits.v1").is_ok());
        for bad in ["", "a*", "a{b}", "a b", &"x".repeat(65)] {
            assert!(check_prefix(bad).is_err(), "{bad:?}");
        }
    }
}

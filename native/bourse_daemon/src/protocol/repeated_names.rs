//! Whether a JSON text has an object that names a member twice. `serde_json` keeps the
//! last one, so `{"cost": 1, "cost": 2}` would cost 2 where another reader sees 1: such a
//! request is refused instead. A second pass over the text, reading names only.

use std::collections::HashSet;
use std::fmt;

use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};

/// Objects up to this many members are searched in a list, larger ones in a set.
const LISTED: usize = 16;

/// The message for a text in which some object names a member twice, or `None`.
pub fn find(text: &[u8]) -> Option<&'static str> {
    let mut reader = serde_json::Deserializer::from_slice(text);
    match reader.deserialize_any(Names) {
        Err(error) if error.to_string().starts_with(REPEATED) => Some(REPEATED),
        _ => None,
    }
}

const REPEATED: &str = "an object names one of its members twice";

/// Reads every value, ignoring all but member names.
struct Names;

impl<'de> Visitor<'de> for Names {
    type Value = ();

    fn expecting(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
        formatter.write_str("any JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }

    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }

    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }

    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }

    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut items: A) -> Result<(), A::Error> {
        while items.next_element_seed(Seed)?.is_some() {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut members: A) -> Result<(), A::Error> {
        let mut listed: Vec<String> = Vec::new();
        let mut set: HashSet<String> = HashSet::new();
        while let Some(name) = members.next_key::<String>()? {
            let repeated = if set.is_empty() && listed.len() < LISTED {
                let repeated = listed.contains(&name);
                listed.push(name);
                repeated
            } else {
                set.extend(listed.drain(..));
                !set.insert(name)
            };
            if repeated {
                return Err(de::Error::custom(REPEATED));
            }
            members.next_value_seed(Seed)?;
        }
        Ok(())
    }
}

/// [`Names`] as a seed, for nested values.
struct Seed;

impl<'de> de::DeserializeSeed<'de> for Seed {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, reader: D) -> Result<(), D::Error> {
        reader.deserialize_any(Names)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_member_named_twice_is_found_at_any_depth_and_size() {
        assert_eq!(find(br#"{"cost": 1, "cost": 2}"#), Some(REPEATED));
        assert_eq!(find(br#"{"op": "check", "op": "stats"}"#), Some(REPEATED));
        assert_eq!(
            find(br#"{"key": {"axis": "a", "axis": "b"}}"#),
            Some(REPEATED)
        );
        assert_eq!(
            find(br#"{"checks": [{"cost": 1}, {"cost": 1, "cost": 1}]}"#),
            Some(REPEATED)
        );
        let many: Vec<String> = (0..100).map(|i| format!("\"k{i}\": {i}")).collect();
        assert_eq!(
            find(format!("{{{}, \"k7\": 0}}", many.join(",")).as_bytes()),
            Some(REPEATED)
        );
        // The same name in two objects, escaped names that differ, numbers of any size.
        assert_eq!(find(br#"{"a": {"b": 1}, "c": {"b": 1e999999}}"#), None);
        assert_eq!(
            find(br#"{"a": 1, "\u0061b": 2, "n": 123456789012345678901234567890}"#),
            None
        );
        assert_eq!(find(format!("{{{}}}", many.join(",")).as_bytes()), None);
        // Not JSON: for the parser to describe.
        assert_eq!(find(b"{\"a\": "), None);
    }
}

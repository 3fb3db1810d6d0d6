//! Whether a JSON text has an object that names a member twice. `serde_json` keeps the
//! last one, so `{"cost": 1, "cost": 2}` would cost 2 where another reader sees 1: such a
//! request is refused instead. A scan of the text serde_json has read whole, looking at
//! member names only: no value is built, and no name is copied unless it has escapes.

use std::borrow::Cow;
use std::collections::HashSet;

/// Objects up to this many members are searched in a list, larger ones in a set.
const LISTED: usize = 16;

const REPEATED: &str = "an object names one of its members twice";

/// An object being scanned: where its names start in the shared list, and its set once it
/// has more than [`LISTED`] of them.
struct Object<'a> {
    first: usize,
    set: Option<HashSet<Cow<'a, [u8]>>>,
}

/// The message for `text`, valid JSON, when some object in it names a member twice.
pub fn find(text: &[u8]) -> Option<&'static str> {
    // `None` for an array.
    let mut open: Vec<Option<Object>> = Vec::new();
    let mut names: Vec<Cow<[u8]>> = Vec::new();
    let mut expect_name = false;
    let mut at = 0;
    while at < text.len() {
        match text[at] {
            b'"' => {
                let end = string_end(text, at);
                if let (true, Some(Some(object))) = (expect_name, open.last_mut()) {
                    let name = name(&text[at..=end]);
                    let repeated = match &mut object.set {
                        Some(set) => !set.insert(name),
                        None if names.len() - object.first < LISTED => {
                            let repeated = names[object.first..].contains(&name);
                            names.push(name);
                            repeated
                        }
                        None => {
                            let mut set: HashSet<_> = names.drain(object.first..).collect();
                            let repeated = !set.insert(name);
                            object.set = Some(set);
                            repeated
                        }
                    };
                    if repeated {
                        return Some(REPEATED);
                    }
                    expect_name = false;
                }
                at = end;
            }
            b'{' => {
                let first = names.len();
                open.push(Some(Object { first, set: None }));
                expect_name = true;
            }
            b'[' => {
                open.push(None);
                expect_name = false;
            }
            b'}' | b']' => {
                if let Some(Some(object)) = open.pop() {
                    names.truncate(object.first);
                }
                expect_name = false;
            }
            b',' => expect_name = matches!(open.last(), Some(Some(_))),
            b':' => expect_name = false,
            _ => {}
        }
        at += 1;
    }
    None
}

/// Where the string opened at `start` closes (the text's last byte if it does not).
pub(super) fn string_end(text: &[u8], start: usize) -> usize {
    let mut at = start + 1;
    while at < text.len() {
        match text[at] {
            b'\\' => at += 2,
            b'"' => return at,
            _ => at += 1,
        }
    }
    text.len() - 1
}

/// A name as its characters: its bytes, or unescaped if it has escapes.
fn name(quoted: &[u8]) -> Cow<'_, [u8]> {
    let raw = &quoted[1..quoted.len() - 1];
    if !raw.contains(&b'\\') {
        return Cow::Borrowed(raw);
    }
    match serde_json::from_slice::<String>(quoted) {
        Ok(name) => Cow::Owned(name.into_bytes()),
        Err(_) => Cow::Borrowed(raw),
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
        // Names that are values, in arrays or after a colon.
        assert_eq!(
            find(br#"{"a": "a", "b": ["a", "a"], "c": {"a": "c"}}"#),
            None
        );
        assert_eq!(find(br#"[{"a": 1}, {"a": 1}]"#), None);
    }

    #[test]
    fn escaped_names_are_compared_by_their_characters() {
        assert_eq!(find(br#"{"a": 1, "\u0061": 2}"#), Some(REPEATED));
        let nested = br#"{"a": {"x": [1, {"b": 2}], "y": "\"z\\"}, "a": 0}"#;
        assert_eq!(find(nested), Some(REPEATED));
    }
}

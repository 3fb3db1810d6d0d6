//! How many values a request may hold, whatever its codec. A value read into a tree costs
//! up to a hundred times the bytes that wrote it (an object of one member, `{"a":0}`, is a
//! node of several hundred bytes), so a request of many small values is refused: a JSON
//! text before it is read, a term as it is read. The largest request, a `check_many` of
//! [`MAX_CHECKS`] checks, holds fewer than 12,000 values in JSON and 22,000 terms as a
//! term with binary keys.
//!
//! [`MAX_CHECKS`]: bourse_core::rules::MAX_CHECKS

use super::repeated_names::string_end;

/// Values (objects, arrays, strings, numbers, literals; in the external term format every
/// term, binary keys too, and each byte of a list of bytes) a request may hold.
pub const MAX_VALUES: usize = 32_768;

/// Why a request holding more than [`MAX_VALUES`] values is refused.
pub fn too_many() -> String {
    format!("a request holds at most {MAX_VALUES} values, and this one holds more")
}

/// Whether JSON `text` holds more than [`MAX_VALUES`] values, a member's name not counted.
/// Counted from the text, with nothing built or copied; text that is not JSON is counted as
/// far as it goes, for the parser to refuse.
pub fn too_many_in_json(text: &[u8]) -> bool {
    // Every value takes a byte at least.
    if text.len() <= MAX_VALUES {
        return false;
    }
    let mut values = 0;
    // For each open array or object, whether it is an object.
    let mut objects: Vec<bool> = Vec::new();
    let mut name_next = false;
    let mut at = 0;
    while at < text.len() {
        match text[at] {
            open @ (b'{' | b'[') => {
                values += 1;
                objects.push(open == b'{');
                name_next = open == b'{';
            }
            b'}' | b']' => {
                objects.pop();
                name_next = false;
            }
            b',' => name_next = objects.last() == Some(&true),
            b':' => name_next = false,
            b'"' => {
                values += usize::from(!name_next);
                name_next = false;
                at = string_end(text, at);
            }
            b' ' | b'\t' | b'\n' | b'\r' => {}
            // A number or literal: counted once, at its first byte.
            _ => {
                values += 1;
                while at + 1 < text.len() && !ends_scalar(text[at + 1]) {
                    at += 1;
                }
            }
        }
        if values > MAX_VALUES {
            return true;
        }
        at += 1;
    }
    false
}

fn ends_scalar(byte: u8) -> bool {
    matches!(
        byte,
        b',' | b':' | b'{' | b'}' | b'[' | b']' | b'"' | b' ' | b'\t' | b'\n' | b'\r'
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn array_of(value: &str, count: usize) -> String {
        format!("[{}]", vec![value; count].join(","))
    }

    #[test]
    fn values_are_counted_once_each_and_names_not_at_all() {
        // The array itself and its elements.
        assert!(!too_many_in_json(array_of("0", MAX_VALUES - 1).as_bytes()));
        assert!(too_many_in_json(array_of("0", MAX_VALUES).as_bytes()));
        // Numbers and literals of many bytes, strings holding delimiters, empty containers.
        for value in ["-12.5e300", "true", "null", r#""a,b:[{\"""#, "[]", "{}"] {
            assert!(!too_many_in_json(
                array_of(value, MAX_VALUES - 1).as_bytes()
            ));
            assert!(too_many_in_json(array_of(value, MAX_VALUES).as_bytes()));
        }
        // An object of one member: the object and its value.
        let objects = array_of(r#"{"a" : "b"}"#, (MAX_VALUES - 1) / 2);
        assert!(!too_many_in_json(objects.as_bytes()));
        let objects = array_of(r#"{"a":{"b":0}}"#, MAX_VALUES / 3 + 1);
        assert!(too_many_in_json(objects.as_bytes()));
    }

    #[test]
    fn the_largest_request_is_far_from_the_bound() {
        let check = r#"{"key": {"exchange": "binance", "credential": "k", "axis": "orders"},
            "limit": {"capacity": 1200, "refill_per_sec": 20, "requests": 1200, "period": 60},
            "cost": 1}"#;
        let checks = array_of(check, bourse_core::rules::MAX_CHECKS);
        let request = format!(r#"{{"id": 1, "op": "check_many", "checks": {checks}}}"#);
        assert!(!too_many_in_json(request.as_bytes()));
    }

    #[test]
    fn text_that_is_not_json_is_counted_as_far_as_it_goes() {
        assert!(!too_many_in_json(b""));
        assert!(!too_many_in_json(b"\"unclosed"));
        assert!(!too_many_in_json(b"]]]}}},,,::"));
        assert!(too_many_in_json(&vec![b'['; MAX_VALUES + 1]));
    }
}

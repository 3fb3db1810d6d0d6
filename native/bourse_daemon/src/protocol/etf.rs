//! Erlang's external term format (ETF), the codec a BEAM client may choose in its first
//! `hello` (docs/PROTOCOL.md, "Codecs"). A request term is read into the same
//! `serde_json::Value` a JSON request parses to, so both codecs go through one request
//! parser; an answer `Value` is written back as a term.
//!
//! Reading is bounded and never panics, whatever the bytes: nesting deeper than
//! [`MAX_DEPTH`] is refused, every length is checked against the bytes left before anything
//! is allocated, compressed terms are refused (no inflating), and no atom is ever created
//! (atoms are read as their names). Terms JSON cannot hold are read as their shape alone,
//! `{"$term": KIND, ...}`, as a JSON client would send them; lists longer than
//! [`MAX_CHECKS`] and maps of more than [`MAX_MAP_KEYS`] keys are read as their shape too,
//! their elements checked and dropped. A term holding more than [`MAX_VALUES`] terms is
//! refused.

use bourse_core::rules::MAX_CHECKS;
use serde_json::{json, Map, Number, Value};

use super::values::{self, MAX_VALUES};

/// The version byte every external term starts with.
pub const VERSION: u8 = 131;
/// Lists, tuples, maps and the other terms read as a JSON array or object, nested deeper
/// than this, are refused, as the JSON parser refuses such arrays and objects.
pub const MAX_DEPTH: usize = 127;
/// Maps with more keys are read as their shape: no request has nearly as many.
pub const MAX_MAP_KEYS: usize = 1024;

pub(super) const NEW_FLOAT: u8 = b'F';
const BIT_BINARY: u8 = b'M';
const COMPRESSED: u8 = b'P';
pub(super) const SMALL_INTEGER: u8 = b'a';
pub(super) const INTEGER: u8 = b'b';
const FLOAT: u8 = b'c';
pub(super) const ATOM: u8 = b'd';
const REFERENCE: u8 = b'e';
const PORT: u8 = b'f';
const PID: u8 = b'g';
const SMALL_TUPLE: u8 = b'h';
const LARGE_TUPLE: u8 = b'i';
const NIL: u8 = b'j';
const STRING: u8 = b'k';
const LIST: u8 = b'l';
pub(super) const BINARY: u8 = b'm';
pub(super) const SMALL_BIG: u8 = b'n';
const LARGE_BIG: u8 = b'o';
const NEW_FUN: u8 = b'p';
const EXPORT: u8 = b'q';
const NEW_REFERENCE: u8 = b'r';
pub(super) const SMALL_ATOM: u8 = b's';
pub(super) const MAP: u8 = b't';
pub(super) const ATOM_UTF8: u8 = b'v';
pub(super) const SMALL_ATOM_UTF8: u8 = b'w';
const V4_PORT: u8 = b'x';
const NEW_PID: u8 = b'X';
const NEW_PORT: u8 = b'Y';
const NEWER_REFERENCE: u8 = b'Z';

/// A frame that is not a readable term: why (never quoting it), and the request's `id`
/// when the top-level map's `id` was read before the fault.
#[derive(Debug)]
pub struct Unreadable {
    pub message: String,
    pub id: Option<Value>,
}

/// Reads one external term, the whole frame, into a `Value` (the tests' reader of answers).
#[cfg(test)]
pub fn decode(frame: &[u8]) -> Result<Value, Unreadable> {
    decode_with_id(frame).map(|(value, _)| value)
}

/// Reads one external term, the whole frame, into a `Value`, with the `id` of its top-level
/// map, if it is one with an `id` named by an atom or binary (also when the map is read
/// as its shape).
pub fn decode_with_id(frame: &[u8]) -> Result<(Value, Option<Value>), Unreadable> {
    let mut reader = Reader::new(frame, false);
    let value = reader.whole().map_err(|message| {
        if reader.values <= MAX_VALUES {
            return Unreadable {
                message: format!("malformed external term ({message})"),
                id: reader.id.take(),
            };
        }
        // The id as read, or else read again for it alone, keeping nothing else.
        let id = reader.id.take().or_else(|| {
            let mut skimmer = Reader::new(frame, true);
            let _ = skimmer.whole();
            skimmer.id
        });
        Unreadable {
            message: values::too_many(),
            id,
        }
    })?;
    Ok((value, reader.id))
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    /// The top-level map's `id`, once read.
    id: Option<Value>,
    /// The terms read so far.
    values: usize,
    /// Whether the terms are read for the top-level map's `id` alone: lists and maps read
    /// as their shape whatever their size, and no bound on how many terms.
    skim: bool,
}

type Read<T> = Result<T, String>;

/// What a map key reads as: a name (an atom or a UTF-8 binary), or another term.
enum Key {
    Name(String),
    Other,
}

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8], skim: bool) -> Self {
        Reader {
            bytes,
            at: 0,
            id: None,
            values: 0,
            skim,
        }
    }

    fn whole(&mut self) -> Read<Value> {
        match self.u8()? {
            VERSION => {}
            _ => return Err("it does not start with the version byte 131".into()),
        }
        if self.peek() == Some(COMPRESSED) {
            return Err("compressed terms are not read: send them uncompressed".into());
        }
        let value = self.term(0, true)?;
        match self.bytes.len() - self.at {
            0 => Ok(value),
            left => Err(format!("{left} bytes after the term")),
        }
    }

    fn left(&self) -> usize {
        self.bytes.len() - self.at
    }

    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.at).copied()
    }

    /// `n` bytes of a field of fixed size.
    fn fixed(&mut self, n: usize) -> Read<&'a [u8]> {
        if n > self.left() {
            return Err("it ends in the middle of a term".into());
        }
        self.take(n)
    }

    /// `n` bytes, a length the frame declared.
    fn take(&mut self, n: usize) -> Read<&'a [u8]> {
        if n > self.left() {
            return Err(format!(
                "a length of {n} bytes beyond the {} left in the frame",
                self.left()
            ));
        }
        let slice = &self.bytes[self.at..self.at + n];
        self.at += n;
        Ok(slice)
    }

    fn u8(&mut self) -> Read<u8> {
        Ok(self.fixed(1)?[0])
    }

    fn u16(&mut self) -> Read<usize> {
        let b = self.fixed(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]) as usize)
    }

    fn u32(&mut self) -> Read<usize> {
        let b = self.fixed(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize)
    }

    /// A count of elements each at least `min_bytes` long: refused when the frame cannot
    /// hold them, so nothing is allocated for a count the bytes do not back.
    fn count(&mut self, count: usize, min_bytes: usize) -> Read<usize> {
        match count.checked_mul(min_bytes) {
            Some(bytes) if bytes <= self.left() => Ok(count),
            _ => Err(format!(
                "a count of {count} elements beyond the {} bytes left in the frame",
                self.left()
            )),
        }
    }

    /// Counts `n` more values read, up to [`MAX_VALUES`] unless skimming.
    fn count_values(&mut self, n: usize) -> Read<()> {
        self.values += n;
        if self.values > MAX_VALUES && !self.skim {
            return Err(values::too_many());
        }
        Ok(())
    }

    /// One term at nesting `depth` (the frame's own term, `top`, whose `id` is kept, is at 0).
    fn term(&mut self, depth: usize, top: bool) -> Read<Value> {
        let deeper = || Err(format!("nesting deeper than {MAX_DEPTH}"));
        if depth > MAX_DEPTH {
            return deeper();
        }
        self.count_values(1)?;
        let tag = self.u8()?;
        let value = match tag {
            SMALL_INTEGER => Value::from(self.u8()?),
            INTEGER => {
                let b = self.fixed(4)?;
                Value::from(i32::from_be_bytes([b[0], b[1], b[2], b[3]]))
            }
            SMALL_BIG => {
                let n = self.u8()? as usize;
                self.big(n)?
            }
            LARGE_BIG => {
                let n = self.u32()?;
                self.big(n)?
            }
            NEW_FLOAT => {
                let b = self.fixed(8)?;
                let float = f64::from_be_bytes(b.try_into().map_err(|_| "a short float")?);
                match Number::from_f64(float) {
                    Some(number) => Value::Number(number),
                    None => return Err("a float that is not finite".into()),
                }
            }
            FLOAT => return Err("the old float format (FLOAT_EXT) is not read".into()),
            ATOM | SMALL_ATOM | ATOM_UTF8 | SMALL_ATOM_UTF8 => {
                let name = self.atom_name(tag)?;
                match name.as_str() {
                    "nil" => Value::Null,
                    "true" => Value::Bool(true),
                    "false" => Value::Bool(false),
                    _ => shape("atom"),
                }
            }
            BINARY => {
                let n = self.u32()?;
                let bytes = self.take(n)?;
                match std::str::from_utf8(bytes) {
                    Ok(text) => Value::String(text.to_owned()),
                    Err(_) => {
                        return Err(format!(
                            "a binary of {n} bytes that is not UTF-8: strings must be UTF-8"
                        ))
                    }
                }
            }
            BIT_BINARY => {
                let n = self.u32()?;
                let bits = self.u8()?;
                if !(1..=8).contains(&bits) || n == 0 {
                    return Err("a bitstring with a bad tail".into());
                }
                self.take(n)?;
                shape("bitstring")
            }
            NIL => Value::Array(Vec::new()),
            STRING => {
                let n = self.u16()?;
                let bytes = self.take(n)?;
                if n > MAX_CHECKS {
                    json!({"$term": "list"})
                } else {
                    self.count_values(n)?;
                    Value::Array(bytes.iter().map(|&b| Value::from(b)).collect())
                }
            }
            LIST => {
                let n = self.u32()?;
                let n = self.count(n, 1)?;
                self.list(n, depth)?
            }
            SMALL_TUPLE => {
                let n = self.u8()? as usize;
                self.tuple(n, depth)?
            }
            LARGE_TUPLE => {
                let n = self.u32()?;
                let n = self.count(n, 1)?;
                self.tuple(n, depth)?
            }
            MAP => {
                let n = self.u32()?;
                let n = self.count(n, 2)?;
                self.map(n, depth, top)?
            }
            PID | NEW_PID => {
                self.node()?;
                self.take(if tag == PID { 9 } else { 12 })?;
                shape("pid")
            }
            PORT | NEW_PORT | V4_PORT => {
                self.node()?;
                self.take(match tag {
                    PORT => 5,
                    NEW_PORT => 8,
                    _ => 12,
                })?;
                shape("port")
            }
            REFERENCE => {
                self.node()?;
                self.take(5)?;
                shape("reference")
            }
            NEW_REFERENCE | NEWER_REFERENCE => {
                let words = self.u16()?;
                self.node()?;
                let creation = if tag == NEW_REFERENCE { 1 } else { 4 };
                self.take(creation + 4 * words)?;
                shape("reference")
            }
            NEW_FUN => {
                // Its size counts itself; the rest is skipped unread.
                let size = self.u32()?;
                self.take(size.checked_sub(4).ok_or("a fun of a bad size")?)?;
                shape("function")
            }
            EXPORT => {
                for _ in 0..3 {
                    self.term(depth + 1, false)?;
                }
                shape("function")
            }
            COMPRESSED => return Err("a compressed term inside a term".into()),
            other => return Err(format!("unknown tag {other}")),
        };
        // An array or object at `depth` is the JSON parser's level `depth + 1`; an integer
        // beyond 64 bits, read as its shape, is a number in JSON.
        match value {
            Value::Array(_) | Value::Object(_)
                if depth >= MAX_DEPTH && !matches!(tag, SMALL_BIG | LARGE_BIG) =>
            {
                deeper()
            }
            value => Ok(value),
        }
    }

    /// An integer of `n` little-endian magnitude bytes after its sign: a number within 64
    /// bits, else the shape of a big integer.
    fn big(&mut self, n: usize) -> Read<Value> {
        let negative = match self.u8()? {
            0 => false,
            1 => true,
            _ => return Err("a big integer with a bad sign byte".into()),
        };
        let Some(magnitude) = magnitude(self.take(n)?) else {
            return Ok(shape("big_integer"));
        };
        Ok(if !negative {
            Value::from(magnitude)
        } else if magnitude <= 1 << 63 {
            Value::from((magnitude as i64).wrapping_neg())
        } else {
            shape("big_integer")
        })
    }

    /// An atom's name (latin-1 names converted to UTF-8); never an atom.
    fn atom_name(&mut self, tag: u8) -> Read<String> {
        let n = match tag {
            ATOM | ATOM_UTF8 => self.u16()?,
            _ => self.u8()? as usize,
        };
        let bytes = self.take(n)?;
        match tag {
            // Latin-1, as OTP 25 writes every atom it can; ASCII is the same in UTF-8.
            ATOM | SMALL_ATOM if !bytes.is_ascii() => {
                Ok(bytes.iter().map(|&b| char::from(b)).collect())
            }
            _ => std::str::from_utf8(bytes)
                .map(str::to_owned)
                .map_err(|_| "an atom whose name is not UTF-8".into()),
        }
    }

    /// The node of a pid, port or reference: an atom.
    fn node(&mut self) -> Read<()> {
        match self.u8()? {
            tag @ (ATOM | SMALL_ATOM | ATOM_UTF8 | SMALL_ATOM_UTF8) => {
                self.atom_name(tag).map(drop)
            }
            _ => Err("a node name that is not an atom".into()),
        }
    }

    /// `n` elements and a tail: an array when proper and short enough, else its shape.
    fn list(&mut self, n: usize, depth: usize) -> Read<Value> {
        let keep = n <= MAX_CHECKS && !self.skim;
        let mut items = Vec::with_capacity(if keep { n } else { 0 });
        for _ in 0..n {
            let item = self.term(depth + 1, false)?;
            if keep {
                items.push(item);
            }
        }
        let proper = self.peek() == Some(NIL);
        self.term(depth + 1, false)?;
        Ok(match (proper, keep) {
            (false, _) => shape("improper_list"),
            (true, true) => Value::Array(items),
            (true, false) => shape("list"),
        })
    }

    /// A tuple's elements are checked and dropped: only its arity travels on.
    fn tuple(&mut self, n: usize, depth: usize) -> Read<Value> {
        for _ in 0..n {
            self.term(depth + 1, false)?;
        }
        Ok(json!({"$term": "tuple", "arity": n}))
    }

    /// A map whose keys are all names (atoms, UTF-8 binaries) as an object; any other map
    /// as its shape.
    fn map(&mut self, n: usize, depth: usize, top: bool) -> Read<Value> {
        let mut object = Map::new();
        let mut named = n <= MAX_MAP_KEYS && !self.skim;
        for _ in 0..n {
            let key = self.key(depth + 1)?;
            let value = self.term(depth + 1, false)?;
            match key {
                Key::Name(name) => {
                    if top && name == "id" {
                        self.id = Some(value.clone());
                    }
                    // An atom and a binary of one name: the request would read as one.
                    if named && object.insert(name, value).is_some() {
                        return Err("a map has two keys of one name".into());
                    }
                }
                Key::Other => named = false,
            }
        }
        Ok(if named {
            Value::Object(object)
        } else {
            json!({"$term": "map", "size": n})
        })
    }

    fn key(&mut self, depth: usize) -> Read<Key> {
        match self.peek() {
            Some(tag @ (ATOM | SMALL_ATOM | ATOM_UTF8 | SMALL_ATOM_UTF8)) => {
                self.at += 1;
                Ok(Key::Name(self.atom_name(tag)?))
            }
            Some(BINARY) => match self.term(depth, false)? {
                Value::String(name) => Ok(Key::Name(name)),
                _ => Ok(Key::Other),
            },
            _ => self.term(depth, false).map(|_| Key::Other),
        }
    }
}

/// `{"$term": kind}`: a term JSON cannot hold, by its kind alone.
fn shape(kind: &str) -> Value {
    json!({ "$term": kind })
}

/// A big integer's little-endian magnitude bytes as a number, if it fits in 64 bits.
pub(super) fn magnitude(digits: &[u8]) -> Option<u64> {
    let significant = digits.iter().rposition(|&b| b != 0).map_or(0, |at| at + 1);
    (significant <= 8).then(|| {
        digits[..significant]
            .iter()
            .rev()
            .fold(0u64, |acc, &b| (acc << 8) | u64::from(b))
    })
}

/// Appends the map term `fields` with its version byte: `extra` entries written first by
/// `first`, then `fields` with binary keys (see [`write_value`]).
pub fn encode_map(
    out: &mut Vec<u8>,
    extra: usize,
    first: impl FnOnce(&mut Vec<u8>),
    fields: &Map<String, Value>,
) {
    out.push(VERSION);
    out.push(MAP);
    out.extend_from_slice(&((fields.len() + extra) as u32).to_be_bytes());
    first(out);
    write_fields(out, fields);
}

fn write_fields(out: &mut Vec<u8>, fields: &Map<String, Value>) {
    for (name, value) in fields {
        write_binary(out, name.as_bytes());
        write_value(out, value);
    }
}

/// Appends `value` as a term, without the version byte: `null` as `nil`, strings as
/// binaries, arrays as lists, objects as maps with binary keys.
pub fn write_value(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::Null => write_atom(out, "nil"),
        Value::Bool(true) => write_atom(out, "true"),
        Value::Bool(false) => write_atom(out, "false"),
        Value::Number(number) => write_number(out, number),
        Value::String(text) => write_binary(out, text.as_bytes()),
        Value::Array(items) if items.is_empty() => out.push(NIL),
        Value::Array(items) => {
            out.push(LIST);
            out.extend_from_slice(&(items.len() as u32).to_be_bytes());
            for item in items {
                write_value(out, item);
            }
            out.push(NIL);
        }
        Value::Object(fields) => {
            out.push(MAP);
            out.extend_from_slice(&(fields.len() as u32).to_be_bytes());
            write_fields(out, fields);
        }
    }
}

/// Appends an atom: only the daemon's own names (`nil`, `true`, `false`) are written.
pub fn write_atom(out: &mut Vec<u8>, name: &str) {
    out.push(SMALL_ATOM_UTF8);
    out.push(name.len() as u8);
    out.extend_from_slice(name.as_bytes());
}

pub fn write_binary(out: &mut Vec<u8>, bytes: &[u8]) {
    out.push(BINARY);
    out.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
    out.extend_from_slice(bytes);
}

/// Appends an integer as the BEAM writes it (so a client can match it as bytes).
pub fn write_integer(out: &mut Vec<u8>, n: i128) {
    if (0..=255).contains(&n) {
        out.extend_from_slice(&[SMALL_INTEGER, n as u8]);
    } else if let Ok(small) = i32::try_from(n) {
        out.push(INTEGER);
        out.extend_from_slice(&small.to_be_bytes());
    } else {
        let magnitude = n.unsigned_abs().to_le_bytes();
        let len = magnitude
            .iter()
            .rposition(|&b| b != 0)
            .map_or(0, |at| at + 1);
        out.extend_from_slice(&[SMALL_BIG, len as u8, u8::from(n < 0)]);
        out.extend_from_slice(&magnitude[..len]);
    }
}

fn write_number(out: &mut Vec<u8>, number: &Number) {
    if let Some(n) = number.as_i64() {
        write_integer(out, i128::from(n));
    } else if let Some(n) = number.as_u64() {
        write_integer(out, i128::from(n));
    } else {
        match number.as_f64().filter(|f| f.is_finite()) {
            Some(float) => {
                out.push(NEW_FLOAT);
                out.extend_from_slice(&float.to_be_bytes());
            }
            // A JSON number beyond a double (a client's id): its text.
            None => write_binary(out, number.to_string().as_bytes()),
        }
    }
}

#[cfg(test)]
mod tests;

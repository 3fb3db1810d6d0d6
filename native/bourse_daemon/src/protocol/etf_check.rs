//! The most common request read straight from its bytes: a `check` of one bucket in the
//! external term format, as `Bourse.RateLimiter` writes it (atom field names, a key map, a
//! limit map with binary keys `capacity` and `refill_per_sec`), its key parts and owner
//! borrowed from the frame. Only a request that the general reader (`read_etf`, then
//! `Request::parse`) would read into the same [`Request`] is read here: anything else, and
//! anything the rules refuse, is left to it, and it gives the answer or the error. This
//! path only skips building a JSON value for each field.

use bourse_core::rules::{self, KeyPart, MAX_KEY_PART_BYTES};
use bourse_core::{Check, KeyRef, Mode, Shape};

use super::etf::{
    magnitude, ATOM, ATOM_UTF8, BINARY, INTEGER, MAP, NEW_FLOAT, SMALL_ATOM, SMALL_ATOM_UTF8,
    SMALL_BIG, SMALL_INTEGER, VERSION,
};
use super::request::{Owner, Request};

/// A check request read here: its id, the request, and its last moment to run.
pub struct FastCheck<'a> {
    pub id: i64,
    pub request: Request<'a>,
    pub last_run_us: Option<u64>,
}

/// The fields of a check request, each at most once.
#[derive(Default)]
struct Fields<'a> {
    op: Option<&'a [u8]>,
    key: Option<KeyRef<'a>>,
    limit: Option<(Shape, Shape)>,
    cost: Option<Shape>,
    owner: Option<&'a str>,
    id: Option<i64>,
    deadline_us: Option<Shape>,
    timeout_ms: Option<Shape>,
    max_wait_ms: Option<Shape>,
    booking_slack_ms: Option<Shape>,
}

/// `frame` as a check request, if it is one in the common form that the rules accept.
pub fn read(frame: &[u8]) -> Option<FastCheck<'_>> {
    let mut reader = Reader { bytes: frame };
    reader.tag(VERSION)?;
    let mut fields = Fields::default();
    for _ in 0..reader.map_size(10)? {
        match reader.atom()? {
            b"op" => once(&mut fields.op, reader.binary()?)?,
            b"key" => once(&mut fields.key, reader.key()?)?,
            b"limit" => once(&mut fields.limit, reader.limit()?)?,
            b"cost" => once(&mut fields.cost, reader.number()?)?,
            b"owner" => once(&mut fields.owner, reader.text()?)?,
            b"id" => match reader.number()? {
                Shape::Integer(id) => once(&mut fields.id, id)?,
                _ => return None,
            },
            b"deadline_us" => once(&mut fields.deadline_us, reader.number()?)?,
            b"timeout_ms" => once(&mut fields.timeout_ms, reader.number()?)?,
            b"max_wait_ms" => once(&mut fields.max_wait_ms, reader.number()?)?,
            b"booking_slack_ms" => once(&mut fields.booking_slack_ms, reader.number()?)?,
            _ => return None,
        }
    }
    if !reader.bytes.is_empty() || fields.op? != b"check" {
        return None;
    }
    let (capacity, refill_per_sec) = fields.limit?;
    let check = Check {
        key: fields.key?,
        limit: rules::limit(capacity, refill_per_sec).ok()?,
        cost: fields.cost.map_or(Ok(1.0), rules::cost).ok()?,
    };
    let booking_slack_ms = fields
        .booking_slack_ms
        .map(rules::booking_slack_ms)
        .transpose()
        .ok()?;
    let mode = match fields.max_wait_ms {
        None => Mode::Probe,
        Some(max_wait_ms) => Mode::Wait {
            max_wait_ms: rules::max_wait_ms(max_wait_ms).ok()?,
            booking_slack_ms,
        },
    };
    let owner = match fields.owner {
        None => Owner::Connection,
        Some(owner) if owner.len() <= MAX_KEY_PART_BYTES => Owner::Named(owner),
        Some(_) => return None,
    };
    let last_run_us = match (fields.deadline_us, fields.timeout_ms) {
        (None, None) => None,
        (Some(deadline_us), Some(timeout_ms)) => Some(rules::last_run_us(
            rules::deadline_us(deadline_us).ok()?,
            rules::timeout_ms(timeout_ms).ok()?,
        )),
        _ => return None,
    };
    Some(FastCheck {
        id: fields.id?,
        request: Request::Check {
            checks: vec![check],
            owner,
            mode,
        },
        last_run_us,
    })
}

/// Sets a field seen for the first time; a field seen twice is left to the general reader.
fn once<T>(field: &mut Option<T>, value: T) -> Option<()> {
    field.is_none().then(|| *field = Some(value))
}

struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (taken, rest) = self.bytes.split_at_checked(n)?;
        self.bytes = rest;
        Some(taken)
    }

    fn u8(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }

    fn u32(&mut self) -> Option<usize> {
        Some(u32::from_be_bytes(self.take(4)?.try_into().ok()?) as usize)
    }

    fn tag(&mut self, tag: u8) -> Option<()> {
        (self.u8()? == tag).then_some(())
    }

    fn map_size(&mut self, max: usize) -> Option<usize> {
        self.tag(MAP)?;
        self.u32().filter(|&size| size <= max)
    }

    /// An atom's name; only ASCII names are compared, and they read alike in Latin-1 (as
    /// OTP 25 writes them) and UTF-8.
    fn atom(&mut self) -> Option<&'a [u8]> {
        let length = match self.u8()? {
            ATOM | ATOM_UTF8 => u16::from_be_bytes(self.take(2)?.try_into().ok()?).into(),
            SMALL_ATOM | SMALL_ATOM_UTF8 => self.u8()?.into(),
            _ => return None,
        };
        self.take(length)
    }

    fn binary(&mut self) -> Option<&'a [u8]> {
        self.tag(BINARY)?;
        let length = self.u32()?;
        self.take(length)
    }

    fn text(&mut self) -> Option<&'a str> {
        std::str::from_utf8(self.binary()?).ok()
    }

    /// A number's shape as the general reader describes it: an integer within 64 bits, or
    /// a finite float.
    fn number(&mut self) -> Option<Shape> {
        match self.u8()? {
            SMALL_INTEGER => Some(Shape::Integer(self.u8()?.into())),
            INTEGER => Some(Shape::Integer(
                i32::from_be_bytes(self.take(4)?.try_into().ok()?).into(),
            )),
            SMALL_BIG => {
                let length = self.u8()? as usize;
                let negative = match self.u8()? {
                    0 => false,
                    1 => true,
                    _ => return None,
                };
                let value = i64::try_from(magnitude(self.take(length)?)?).ok()?;
                Some(Shape::Integer(if negative { -value } else { value }))
            }
            NEW_FLOAT => {
                let float = f64::from_be_bytes(self.take(8)?.try_into().ok()?);
                float.is_finite().then_some(Shape::Float(float))
            }
            _ => None,
        }
    }

    /// A key map: `exchange`, `credential` (text, or `nil` for the public pool) and
    /// optionally `axis`, each part as the rules allow it.
    fn key(&mut self) -> Option<KeyRef<'a>> {
        let (mut exchange, mut credential, mut axis) = (None, None, None);
        for _ in 0..self.map_size(3)? {
            match self.atom()? {
                b"exchange" => once(&mut exchange, self.part(KeyPart::Exchange)?)?,
                b"credential" => once(&mut credential, self.credential()?)?,
                b"axis" => once(&mut axis, self.part(KeyPart::Axis)?)?,
                _ => return None,
            }
        }
        Some(KeyRef::new(
            exchange?,
            credential?,
            axis.unwrap_or(b"request"),
        ))
    }

    fn credential(&mut self) -> Option<Option<&'a [u8]>> {
        if self.bytes.first() == Some(&BINARY) {
            return self.part(KeyPart::Credential).map(Some);
        }
        (self.atom()? == b"nil").then_some(None)
    }

    fn part(&mut self, part: KeyPart) -> Option<&'a [u8]> {
        let text = self.text()?;
        rules::key_part(part, Shape::Binary { len: text.len() }, || true).ok()?;
        Some(text.as_bytes())
    }

    /// A limit map `%{"capacity" => c, "refill_per_sec" => r}`: the shapes of both numbers.
    fn limit(&mut self) -> Option<(Shape, Shape)> {
        let (mut capacity, mut refill_per_sec) = (None, None);
        if self.map_size(2)? != 2 {
            return None;
        }
        for _ in 0..2 {
            match self.binary()? {
                b"capacity" => once(&mut capacity, self.number()?)?,
                b"refill_per_sec" => once(&mut refill_per_sec, self.number()?)?,
                _ => return None,
            }
        }
        Some((capacity?, refill_per_sec?))
    }
}

#[cfg(test)]
mod tests;

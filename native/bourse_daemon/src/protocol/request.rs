//! A request frame parsed into a typed [`Request`]. The envelope (ops, fields, their JSON
//! types) is judged here; every value is judged by `bourse_core::rules`, as the NIF judges
//! Elixir terms, so the same input gets the same message from every backend. Values are
//! described by their [`Shape`] (kind and size), never by their content.
//!
//! JSON cannot hold every Elixir term: a client may send a value as its shape alone,
//! `{"$term": KIND}` with `"arity"`, `"size"` or `"len"` (docs/PROTOCOL.md, "Values").

use bourse_core::rules::{self, KeyPart, LimitKeys, MAX_CHECKS};
use bourse_core::{BackoffScope, Check, InvalidInput, KeyRef, Limit, Mode, PauseTarget, Shape};
use serde_json::{Map, Value};

use super::Codec;

pub type Result<T> = std::result::Result<T, InvalidInput>;

/// Who owns the bookings of a check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner<'a> {
    /// No `owner` field: the connection.
    Connection,
    Named(&'a str),
    Numbered(i128),
}

/// One valid request; keys borrow from the parsed frame.
pub enum Request<'a> {
    /// With `codec`: the codec the connection speaks from its answer on; with
    /// `busy_since_us_ago`, the client's checks assume buckets busy from that long before.
    Hello {
        codec: Option<Codec>,
        busy_since_us_ago: Option<u64>,
    },
    /// Proves the connection's secret: the HMAC of the hello's nonce, in hex; with a
    /// `challenge`, asks the daemon to prove it too.
    Auth {
        proof: &'a str,
        challenge: Option<&'a str>,
    },
    /// `check` (one check, or none when its limit is null) and `check_many`.
    Check {
        checks: Vec<Check<'a>>,
        owner: Owner<'a>,
        mode: Mode,
    },
    /// `unbook`: gives back the owner's booking of a check (its checks as `check_many`
    /// takes them), whose caller was told the store was unavailable.
    Unbook {
        checks: Vec<Check<'a>>,
        owner: Owner<'a>,
    },
    Record {
        key: KeyRef<'a>,
        cost: f64,
    },
    GetCost {
        key: KeyRef<'a>,
    },
    Sync {
        key: KeyRef<'a>,
        allowance: f64,
        window_left_ms: u64,
    },
    Reset {
        key: KeyRef<'a>,
    },
    ResetExchange {
        exchange: &'a [u8],
    },
    ResetAll,
    Pause {
        target: PauseTarget,
        ms: u64,
    },
    /// Counts a limited reply for a credential and pauses its scope for the backoff.
    BackOff {
        exchange: &'a [u8],
        credential: Option<&'a [u8]>,
        scope: BackoffScope,
    },
    ResetBackoff {
        exchange: &'a [u8],
        credential: Option<&'a [u8]>,
    },
    Inspect {
        key: KeyRef<'a>,
    },
    Busiest {
        count: usize,
    },
    Stats,
    Sweep,
    /// Asks back what an earlier request on the connection paid, whose answer came after
    /// its caller stopped waiting: `of` is that request's id.
    GiveBack {
        of: &'a Value,
    },
}

impl<'a> Request<'a> {
    /// Parses the fields of a request object (`id` is the envelope's, not judged here).
    pub fn parse(request: &'a Map<String, Value>) -> Result<Self> {
        let op = match request.get("op") {
            Some(Value::String(op)) => op.as_str(),
            Some(other) => {
                return Err(envelope(format!(
                    "op must be a string, got {}",
                    shape(other)
                )))
            }
            None => return Err(envelope("missing field op")),
        };
        let fields = |allowed: &[&str], what: &str| {
            let allowed = [allowed, DEADLINE_FIELDS.as_slice()].concat();
            only(request, &allowed, what).map_err(|error| naming_exchange(error, request))
        };
        let key_field = || key(required(request, "key")?);
        Ok(match op {
            "check" => {
                fields(
                    &[
                        "key",
                        "limit",
                        "cost",
                        "owner",
                        "max_wait_ms",
                        "booking_slack_ms",
                    ],
                    "a check request",
                )?;
                let key = key_field()?;
                let checked = || {
                    let cost = cost(request.get("cost"))?;
                    let mode = mode(request)?;
                    let owner = owner(request)?;
                    Ok((limit(required(request, "limit")?)?, cost, mode, owner))
                };
                let (limit, cost, mode, owner) =
                    checked().map_err(|error: InvalidInput| error.for_exchange(key.exchange))?;
                let checks = limit
                    .map(|limit| Check { key, limit, cost })
                    .into_iter()
                    .collect();
                Self::Check {
                    checks,
                    owner,
                    mode,
                }
            }
            "check_many" => {
                fields(
                    &["checks", "owner", "max_wait_ms", "booking_slack_ms"],
                    "a check_many request",
                )?;
                let options = || Ok((mode(request)?, owner(request)?));
                let (mode, owner) = options().map_err(|error| naming_exchange(error, request))?;
                Self::Check {
                    checks: checks(required(request, "checks")?)?,
                    owner,
                    mode,
                }
            }
            "unbook" => {
                fields(&["checks", "owner"], "an unbook request")?;
                let owner = owner(request).map_err(|error| naming_exchange(error, request))?;
                Self::Unbook {
                    checks: checks(required(request, "checks")?)?,
                    owner,
                }
            }
            "record" => {
                fields(&["key", "cost"], "a record request")?;
                let key = key_field()?;
                let cost =
                    cost(request.get("cost")).map_err(|error| error.for_exchange(key.exchange))?;
                Self::Record { key, cost }
            }
            "get_cost" => {
                // `period` is accepted and ignored, as in the Elixir API.
                fields(&["key", "period"], "a get_cost request")?;
                Self::GetCost { key: key_field()? }
            }
            "sync" => {
                fields(&["key", "allowance", "window_left_ms"], "a sync request")?;
                let key = key_field()?;
                let checked = || {
                    let allowance = rules::allowance(number(required(request, "allowance")?))?;
                    let window =
                        rules::window_left_ms(number(required(request, "window_left_ms")?))?;
                    Ok((allowance, window))
                };
                let (allowance, window_left_ms) =
                    checked().map_err(|error: InvalidInput| error.for_exchange(key.exchange))?;
                Self::Sync {
                    key,
                    allowance,
                    window_left_ms,
                }
            }
            "reset" => {
                fields(&["key"], "a reset request")?;
                Self::Reset { key: key_field()? }
            }
            "reset_exchange" => {
                fields(&["exchange"], "a reset_exchange request")?;
                Self::ResetExchange {
                    exchange: part(required(request, "exchange")?, KeyPart::Exchange)?,
                }
            }
            "reset_all" => {
                fields(&[], "a reset_all request")?;
                Self::ResetAll
            }
            "pause" => {
                fields(&["target", "ms"], "a pause request")?;
                let target = pause_target(required(request, "target")?)?;
                let ms = rules::pause_ms(number(required(request, "ms")?))
                    .map_err(|error| error.for_exchange(target.exchange()))?;
                Self::Pause { target, ms }
            }
            "back_off" => {
                fields(&["credential", "scope"], "a back_off request")?;
                let (exchange, credential) = backoff_credential(required(request, "credential")?)?;
                let scope = match required(request, "scope")? {
                    Value::String(scope) if scope == "credential" => BackoffScope::Credential,
                    Value::String(scope) if scope == "exchange" => BackoffScope::Exchange,
                    other => {
                        return Err(rules::not_a_backoff_scope(shape(other)).for_exchange(exchange))
                    }
                };
                Self::BackOff {
                    exchange,
                    credential,
                    scope,
                }
            }
            "reset_backoff" => {
                fields(&["credential"], "a reset_backoff request")?;
                let (exchange, credential) = backoff_credential(required(request, "credential")?)?;
                Self::ResetBackoff {
                    exchange,
                    credential,
                }
            }
            "inspect" => {
                fields(&["key"], "an inspect request")?;
                Self::Inspect { key: key_field()? }
            }
            "busiest" => {
                fields(&["count"], "a busiest request")?;
                let count = match request.get("count") {
                    Some(count) => rules::busiest_count(number(count))?,
                    None => 10,
                };
                Self::Busiest { count }
            }
            "stats" => {
                fields(&[], "a stats request")?;
                Self::Stats
            }
            "sweep" => {
                fields(&[], "a sweep request")?;
                Self::Sweep
            }
            "give_back" => {
                fields(&["of"], "a give_back request")?;
                Self::GiveBack {
                    of: required(request, "of")?,
                }
            }
            "hello" => {
                fields(&["codec", "busy_since_us_ago"], "a hello request")?;
                let codec = match request.get("codec") {
                    None => None,
                    Some(Value::String(name)) if name == "json" => Some(Codec::Json),
                    Some(Value::String(name)) if name == "etf" => Some(Codec::Etf),
                    Some(other) => {
                        return Err(envelope(format!(
                            "codec must be \"json\" or \"etf\", got {}",
                            shape(other)
                        )))
                    }
                };
                let busy_since_us_ago = match request.get("busy_since_us_ago") {
                    None => None,
                    Some(ago) => Some(rules::busy_since_us_ago(number(ago))?),
                };
                Self::Hello {
                    codec,
                    busy_since_us_ago,
                }
            }
            "auth" => {
                fields(&["proof", "challenge"], "an auth request")?;
                let string = |name: &str, value: &'a Value| match value {
                    Value::String(text) => Ok(text.as_str()),
                    other => Err(envelope(format!(
                        "{name} must be a string, got {}",
                        shape(other)
                    ))),
                };
                Self::Auth {
                    proof: string("proof", required(request, "proof")?)?,
                    challenge: match request.get("challenge") {
                        None => None,
                        Some(challenge) => Some(string("challenge", challenge)?),
                    },
                }
            }
            _ => {
                return Err(envelope(format!(
                    "unknown op {}; expected one of check, check_many, record, get_cost, sync, \
                     reset, reset_exchange, reset_all, pause, back_off, reset_backoff, inspect, \
                     busiest, stats, sweep, give_back, hello, auth",
                    name_of(op)
                )))
            }
        })
    }

    /// Whether the request may be sent before the connection proved its secret.
    pub fn before_auth(&self) -> bool {
        matches!(self, Self::Hello { .. } | Self::Auth { .. })
    }

    /// Whether it only gives back what its client's callers paid (no answer needed).
    pub fn gives_back(&self) -> bool {
        matches!(self, Self::Unbook { .. } | Self::GiveBack { .. })
    }
}

/// The envelope's optional deadline: every request may carry both or neither.
const DEADLINE_FIELDS: [&str; 2] = ["deadline_us", "timeout_ms"];

/// The latest moment (µs on the daemon's clock) the request may run, from its `deadline_us`
/// (when its caller stops waiting) and `timeout_ms` (how long it waits in all); `None`
/// for a request without them.
pub fn last_run_us(request: &Map<String, Value>) -> Result<Option<u64>> {
    match (request.get("deadline_us"), request.get("timeout_ms")) {
        (None, None) => Ok(None),
        (Some(deadline), Some(timeout)) => Ok(Some(rules::last_run_us(
            rules::deadline_us(number(deadline))?,
            rules::timeout_ms(number(timeout))?,
        ))),
        (None, Some(_)) => Err(envelope("missing field deadline_us (sent with timeout_ms)")),
        (Some(_), None) => Err(envelope("missing field timeout_ms (sent with deadline_us)")),
    }
}

/// An error in the envelope (ops and fields), which only this protocol has.
fn envelope(message: impl Into<String>) -> InvalidInput {
    InvalidInput::new(message)
}

/// What a JSON value is, as the rules describe values: the shape a client sent for a term
/// JSON cannot hold, else the JSON value's own.
pub fn shape(value: &Value) -> Shape {
    match value {
        Value::Null => Shape::Nil,
        Value::Bool(b) => Shape::Boolean(*b),
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                return Shape::Integer(i);
            }
            let integral = !n.as_str().bytes().any(|b| matches!(b, b'.' | b'e' | b'E'));
            match n.as_f64() {
                _ if integral => Shape::BigInteger,
                Some(f) => Shape::Float(f),
                // A float beyond a double: no Elixir float is; described as the overflow.
                None => Shape::Float(f64::INFINITY),
            }
        }
        Value::String(s) => Shape::Binary { len: s.len() },
        Value::Array(items) => Shape::List {
            len: (items.len() <= MAX_CHECKS).then_some(items.len()),
        },
        Value::Object(fields) => match fields.get("$term") {
            Some(Value::String(kind)) => described(kind, fields),
            _ => Shape::Map { size: fields.len() },
        },
    }
}

/// The shape a client described, `{"$term": KIND, ...}`; one whose count is missing or no
/// count (not a whole number from 0 to 2^64 - 1) is no term's: [`Shape::Other`].
fn described(kind: &str, fields: &Map<String, Value>) -> Shape {
    let count = |name: &str| fields.get(name).and_then(Value::as_u64).map(|n| n as usize);
    let counted = |name: &str, shape: fn(usize) -> Shape| count(name).map_or(Shape::Other, shape);
    match kind {
        "atom" => Shape::Atom,
        "nil" => Shape::Nil,
        "binary" => counted("size", |len| Shape::Binary { len }),
        "bitstring" => Shape::Bitstring,
        "big_integer" => Shape::BigInteger,
        "list" => Shape::List {
            len: count("len").filter(|&len| len <= MAX_CHECKS),
        },
        "improper_list" => Shape::ImproperList,
        "tuple" => counted("arity", |arity| Shape::Tuple { arity }),
        "map" => counted("size", |size| Shape::Map { size }),
        "pid" => Shape::Pid,
        "port" => Shape::Port,
        "reference" => Shape::Reference,
        "function" => Shape::Function,
        _ => Shape::Other,
    }
}

/// A number's shape with its value, or the value's shape.
fn number(value: &Value) -> Shape {
    shape(value)
}

/// The checks of a `check_many` request; those with a null limit are validated and dropped.
fn checks(value: &Value) -> Result<Vec<Check<'_>>> {
    let items = match value {
        Value::Array(items) if items.len() <= MAX_CHECKS => items,
        other => return Err(rules::not_a_check_list(shape(other))),
    };
    let mut checks = Vec::with_capacity(items.len());
    for item in items {
        let Value::Object(fields) = item else {
            return Err(rules::not_a_check(shape(item)));
        };
        if fields.contains_key("$term") {
            // A term other than `{key, limit, cost}`; a tuple that starts with a key names
            // its exchange (`exchange`), which the error names too.
            let error = rules::not_a_check(shape(item));
            let exchange = fields.get("exchange").map(|e| part(e, KeyPart::Exchange));
            return Err(match exchange {
                Some(Ok(exchange)) => error.for_exchange(exchange),
                _ => error,
            });
        }
        only(fields, &["key", "limit", "cost"], "a check")?;
        let key = key(required(fields, "key")?)?;
        let checked = || {
            Ok((
                cost(fields.get("cost"))?,
                limit(required(fields, "limit")?)?,
            ))
        };
        let (cost, limit) =
            checked().map_err(|error: InvalidInput| error.for_exchange(key.exchange))?;
        if let Some(limit) = limit {
            checks.push(Check { key, limit, cost });
        }
    }
    Ok(checks)
}

/// The exchange every check of a `check_many` names, where one alone can be read: the
/// exchange its errors of the whole request name, as the Elixir API's do.
fn one_exchange(checks: &Value) -> Option<&[u8]> {
    let Value::Array(items) = checks else {
        return None;
    };
    let mut named = items
        .iter()
        .take(MAX_CHECKS)
        .map(|item| item.get("key")?.get("exchange"));
    let first = named.next()??;
    named
        .all(|other| other == Some(first))
        .then(|| part(first, KeyPart::Exchange).ok())
        .flatten()
}

/// `error`, naming the request's exchange ([`named_exchange`]) unless it names one.
fn naming_exchange(error: InvalidInput, request: &Map<String, Value>) -> InvalidInput {
    match named_exchange(request) {
        Some(exchange) => error.for_exchange(exchange),
        None => error,
    }
}

/// The exchange a request names, for an error found before its fields are read: that of
/// its key, of its checks when they name one, or its `exchange`, pause target's or
/// backoff credential's; `None` when none is a valid exchange id.
fn named_exchange(request: &Map<String, Value>) -> Option<&[u8]> {
    if let Some(checks) = request.get("checks") {
        return one_exchange(checks);
    }
    let named = ["key", "target", "credential"]
        .iter()
        .find_map(|field| request.get(*field)?.get("exchange"))
        .or_else(|| request.get("exchange"))?;
    part(named, KeyPart::Exchange).ok()
}

/// The request's `owner`: a string or an integer.
fn owner(request: &Map<String, Value>) -> Result<Owner<'_>> {
    match request.get("owner") {
        None => Ok(Owner::Connection),
        Some(Value::String(owner)) if owner.len() <= rules::MAX_KEY_PART_BYTES => {
            Ok(Owner::Named(owner))
        }
        Some(Value::Number(n)) if n.as_i64().is_some() || n.as_u64().is_some() => {
            let value = n.as_i64().map(i128::from).or(n.as_u64().map(i128::from));
            Ok(Owner::Numbered(value.unwrap_or_default()))
        }
        Some(other) => Err(envelope(format!(
            "owner must be a string of at most {} bytes or an integer, got {}",
            rules::MAX_KEY_PART_BYTES,
            shape(other)
        ))),
    }
}

/// `max_wait_ms` present: the caller is a waiter with that budget (and the booking slack
/// it names, if any); absent: a probe.
fn mode(request: &Map<String, Value>) -> Result<Mode> {
    let booking_slack_ms = request
        .get("booking_slack_ms")
        .map(|value| rules::booking_slack_ms(number(value)))
        .transpose()?;
    Ok(match request.get("max_wait_ms") {
        None => Mode::Probe,
        Some(value) => Mode::Wait {
            max_wait_ms: rules::max_wait_ms(number(value))?,
            booking_slack_ms,
        },
    })
}

/// A misspelt field must not be silently ignored by a rate limiter; `op` and `id` are the
/// envelope's.
fn only(fields: &Map<String, Value>, allowed: &[&str], what: &str) -> Result<()> {
    let known =
        |name: &String| allowed.contains(&name.as_str()) || matches!(name.as_str(), "op" | "id");
    match fields.keys().find(|name| !known(name)) {
        Some(name) => {
            let listed = if allowed.is_empty() {
                "none".to_string()
            } else {
                allowed.join(", ")
            };
            Err(envelope(format!(
                "unknown field {} in {what} (known fields: {listed})",
                name_of(name)
            )))
        }
        None => Ok(()),
    }
}

fn required<'a>(fields: &'a Map<String, Value>, name: &str) -> Result<&'a Value> {
    fields
        .get(name)
        .ok_or_else(|| envelope(format!("missing field {name}")))
}

/// A key object `{exchange, credential, axis}` (credential null: the public pool; axis
/// absent: `"request"`), as the NIF reads `{exchange_id, credential_key, bucket_axis}`.
pub fn key(value: &Value) -> Result<KeyRef<'_>> {
    let fields = match value {
        Value::Object(fields) if !fields.contains_key("$term") => fields,
        other => return Err(rules::not_a_key(shape(other))),
    };
    // Every error past a readable exchange names it.
    let exchange = part(required(fields, "exchange")?, KeyPart::Exchange)?;
    let rest = || {
        only(fields, &["exchange", "credential", "axis"], "a key")?;
        let credential = match required(fields, "credential")? {
            Value::Null => None,
            other => Some(part(other, KeyPart::Credential)?),
        };
        let axis = match fields.get("axis") {
            Some(axis) => part(axis, KeyPart::Axis)?,
            None => b"request".as_slice(),
        };
        Ok(KeyRef::new(exchange, credential, axis))
    };
    rest().map_err(|error: InvalidInput| error.for_exchange(exchange))
}

/// A key part's bytes, as `rules::key_part` allows them: only a string can pass (a binary
/// that is not UTF-8 travels as its shape, `{"$term": "binary", "size": N}`).
fn part(value: &Value, part: KeyPart) -> Result<&[u8]> {
    match value {
        Value::String(text) => {
            rules::key_part(part, shape(value), || true).map(|()| text.as_bytes())
        }
        other => rules::key_part(part, shape(other), || false).map(|()| &[][..]),
    }
}

/// A limit object, or `None` for null (no limit), read as the NIF reads the limit maps.
fn limit(value: &Value) -> Result<Option<Limit>> {
    let fields = match value {
        Value::Null => return Ok(None),
        Value::Object(fields) if !fields.contains_key("$term") => fields,
        other => return Err(rules::not_a_limit(shape(other))),
    };
    let field = |name: &str| fields.get(name);
    let not_a_limit = || {
        let keys = LimitKeys {
            capacity: fields.contains_key("capacity"),
            refill_per_sec: fields.contains_key("refill_per_sec"),
            requests: fields.contains_key("requests"),
            period: fields.contains_key("period"),
        };
        rules::not_a_limit_map(fields.len(), keys)
    };
    let limit = match (fields.len(), field("capacity"), field("requests")) {
        (2, Some(capacity), None) => {
            let refill = field("refill_per_sec").ok_or_else(not_a_limit)?;
            rules::limit(number(capacity), number(refill))?
        }
        (1, None, Some(requests)) => rules::limit_per_period(number(requests), None)?,
        (2, None, Some(requests)) => {
            let period = field("period").ok_or_else(not_a_limit)?;
            rules::limit_per_period(number(requests), Some(number(period)))?
        }
        _ => return Err(not_a_limit()),
    };
    Ok(Some(limit))
}

/// A cost: absent is 1, else what `rules::cost` allows.
fn cost(value: Option<&Value>) -> Result<f64> {
    value.map_or(Ok(1.0), |value| rules::cost(number(value)))
}

/// `{exchange}`, `{exchange, credential}` or a full key `{exchange, credential, axis}`.
fn pause_target(value: &Value) -> Result<PauseTarget> {
    let fields = match value {
        Value::Object(fields) if !fields.contains_key("$term") => fields,
        other => return Err(rules::not_a_pause_target(shape(other))),
    };
    if fields.contains_key("axis") {
        return Ok(PauseTarget::Key(key(value)?.to_owned_key()));
    }
    let exchange = part(required(fields, "exchange")?, KeyPart::Exchange)?;
    only(fields, &["exchange", "credential"], "a pause target")
        .map_err(|error| error.for_exchange(exchange))?;
    Ok(match fields.get("credential") {
        None => PauseTarget::Exchange(exchange.to_vec()),
        Some(Value::Null) => PauseTarget::Credential(exchange.to_vec(), None),
        Some(credential) => {
            let credential = part(credential, KeyPart::Credential)
                .map_err(|error| error.for_exchange(exchange))?;
            PauseTarget::Credential(exchange.to_vec(), Some(credential.to_vec()))
        }
    })
}

/// `{exchange, credential}` (credential null: the public pool): whose backoff counts, as
/// the NIF reads `{exchange_id, credential_key}`.
fn backoff_credential(value: &Value) -> Result<(&[u8], Option<&[u8]>)> {
    let fields = match value {
        Value::Object(fields) if !fields.contains_key("$term") => fields,
        other => return Err(rules::not_a_credential(shape(other))),
    };
    let exchange = part(required(fields, "exchange")?, KeyPart::Exchange)?;
    let credential = || {
        only(fields, &["exchange", "credential"], "a credential")?;
        match required(fields, "credential")? {
            Value::Null => Ok(None),
            other => Ok(Some(part(other, KeyPart::Credential)?)),
        }
    };
    let credential = credential().map_err(|error: InvalidInput| error.for_exchange(exchange))?;
    Ok((exchange, credential))
}

/// A client-chosen name (an op, a field): quoted when it is short and made of lowercase
/// letters and `_`, else only its size (it may be a misplaced secret).
fn name_of(name: &str) -> String {
    if name.len() <= 24 && name.bytes().all(|b| b.is_ascii_lowercase() || b == b'_') {
        format!("{name:?}")
    } else {
        format!("of {} bytes", name.len())
    }
}

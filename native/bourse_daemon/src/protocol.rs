//! Protocol version 1 (docs/PROTOCOL.md): decodes and validates one JSON request, runs it on
//! the store (this process's table, or Redis) and encodes the answer. Transports only frame
//! bytes; everything a client can send is judged here, and nothing it sends can panic.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};

use bourse_core::{
    rules::{self, Shape, MAX_AMOUNT},
    Check, Key, KeyInfo, KeyRef, Limit, Mode, Outcome, PauseTarget, Stats,
};
use serde_json::{json, Map, Value};

use crate::store::{Memory, Store, StoreError};

pub const PROTOCOL_VERSION: u64 = 1;
/// The longest exchange, credential, axis or string owner, in bytes (as in the NIF).
pub const MAX_KEY_PART_BYTES: usize = 1024;
/// The most rows a `busiest` request may ask for.
pub const MAX_BUSIEST: u64 = 10_000;
pub const SERVER: &str = concat!("bourse_daemon ", env!("CARGO_PKG_VERSION"));

/// The store and what every connection shares.
pub struct Service<S: Store = Memory> {
    store: S,
    /// The transport's frame limit, reported by `hello` so clients can refuse larger requests.
    max_frame_bytes: usize,
    /// Keyed hashing of owner ids: a client cannot forge another connection's default owner.
    owners: RandomState,
    connections: AtomicU64,
}

/// One client connection: supplies the owner of requests that name none.
pub struct Session {
    default_owner: u64,
}

/// A malformed request. `counted` when the store already counted it as invalid.
struct Invalid {
    message: String,
    counted: bool,
}

impl Invalid {
    fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            counted: false,
        }
    }
}

type Result<T> = std::result::Result<T, Invalid>;

/// Why a request got no answer of its own.
enum Failure {
    Invalid(Invalid),
    /// The store cannot be reached: nothing was admitted.
    Unavailable(String),
}

impl From<Invalid> for Failure {
    fn from(invalid: Invalid) -> Self {
        Self::Invalid(invalid)
    }
}

impl From<StoreError> for Failure {
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::Invalid(error) => Self::Invalid(Invalid {
                message: error.to_string(),
                counted: true,
            }),
            StoreError::Unavailable(message) => Self::Unavailable(message),
        }
    }
}

/// What a request answers, before encoding.
enum Answer {
    Done,
    Outcome(Outcome),
    Borrowed(f64),
    Taken(f64),
    Info(Option<KeyInfo>),
    Stats(Stats),
    Hello {
        assume_busy_at_start: bool,
        max_frame_bytes: usize,
    },
    Swept(usize),
    Busiest(Vec<(Key, KeyInfo)>),
}

impl<S: Store> Service<S> {
    pub fn new(store: S, max_frame_bytes: usize) -> Self {
        Self {
            store,
            max_frame_bytes,
            owners: RandomState::new(),
            connections: AtomicU64::new(0),
        }
    }

    pub fn store(&self) -> &S {
        &self.store
    }

    /// A new connection, with an owner id of its own.
    pub fn session(&self) -> Session {
        let n = self.connections.fetch_add(1, Ordering::Relaxed);
        Session {
            default_owner: self.owners.hash_one(("connection", n)),
        }
    }

    /// Answers one request frame, appending one JSON object (no framing) to `out`.
    pub async fn handle(&self, session: &Session, frame: &[u8], out: &mut Vec<u8>) {
        let request = match serde_json::from_slice::<Value>(frame) {
            Ok(Value::Object(fields)) => fields,
            Ok(other) => {
                let message = format!("a request must be a JSON object, got {}", kind(&other));
                return self.fail(out, None, Invalid::new(message));
            }
            Err(error) => {
                let message = format!("malformed JSON: {error}");
                return self.fail(out, None, Invalid::new(message));
            }
        };
        let id = request.get("id");
        match self.dispatch(session, &request).await {
            Ok(answer) => encode(out, id, answer),
            Err(Failure::Invalid(invalid)) => self.fail(out, id, invalid),
            Err(Failure::Unavailable(message)) => error(out, id, "unavailable", &message),
        }
    }

    /// The answer to a frame longer than `max` bytes; the transport then closes.
    pub fn frame_too_large(&self, out: &mut Vec<u8>, max: usize) {
        self.store.count_invalid();
        let message = format!("frame longer than {max} bytes (--max-frame-bytes); closing");
        error(out, None, "frame_too_large", &message);
    }

    /// The answer to bytes left without their end when the stream closed.
    pub fn truncated_frame(&self, out: &mut Vec<u8>) {
        let message = "the stream ended in the middle of a frame; it was not executed";
        self.fail(out, None, Invalid::new(message));
    }

    fn fail(&self, out: &mut Vec<u8>, id: Option<&Value>, invalid: Invalid) {
        if !invalid.counted {
            self.store.count_invalid();
        }
        error(out, id, "invalid_parameters", &invalid.message);
    }

    async fn dispatch(
        &self,
        session: &Session,
        request: &Map<String, Value>,
    ) -> std::result::Result<Answer, Failure> {
        let op = match request.get("op") {
            Some(Value::String(op)) => op.as_str(),
            Some(other) => {
                return Err(
                    Invalid::new(format!("op must be a string, got {}", kind(other))).into(),
                )
            }
            None => return Err(Invalid::new("missing field op").into()),
        };
        let store = &self.store;
        match op {
            "check" => {
                only_request(
                    request,
                    &["key", "limit", "cost", "owner", "max_wait_ms"],
                    "a check request",
                )?;
                let key = key(required(request, "key", "")?, "key")?;
                let limit = limit(required(request, "limit", " (null for no limit)")?, "limit")?;
                let cost = cost(request.get("cost"), "cost")?;
                let owner = self.owner(session, request)?;
                let mode = mode(request)?;
                Ok(Answer::Outcome(match limit {
                    Some(limit) => {
                        store
                            .check_one(owner, Check { key, limit, cost }, mode)
                            .await?
                    }
                    None => Outcome::Admitted,
                }))
            }
            "check_many" => {
                only_request(
                    request,
                    &["checks", "owner", "max_wait_ms"],
                    "a check_many request",
                )?;
                let items = match required(request, "checks", "")? {
                    Value::Array(items) => items,
                    other => {
                        return Err(Invalid::new(format!(
                            "checks must be an array of {{key, limit, cost}}, got {}",
                            kind(other)
                        ))
                        .into())
                    }
                };
                let mut checks = Vec::with_capacity(items.len());
                for (i, item) in items.iter().enumerate() {
                    let what = format!("checks[{i}]");
                    let Value::Object(fields) = item else {
                        return Err(Invalid::new(format!(
                            "{what} must be an object {{key, limit, cost}}, got {}",
                            json_type(item)
                        ))
                        .into());
                    };
                    only(fields, &["key", "limit", "cost"], &what)?;
                    let key = key(required(fields, "key", "")?, &format!("{what}.key"))?;
                    let limit = limit(
                        required(fields, "limit", " (null for no limit)")?,
                        &format!("{what}.limit"),
                    )?;
                    let cost = cost(fields.get("cost"), &format!("{what}.cost"))?;
                    if let Some(limit) = limit {
                        checks.push(Check { key, limit, cost });
                    }
                }
                let owner = self.owner(session, request)?;
                let mode = mode(request)?;
                Ok(Answer::Outcome(store.check(owner, &checks, mode).await?))
            }
            "record" => {
                only_request(request, &["key", "cost"], "a record request")?;
                let key = key(required(request, "key", "")?, "key")?;
                let cost = cost(request.get("cost"), "cost")?;
                store.record(key, cost).await?;
                Ok(Answer::Done)
            }
            "get_cost" => {
                // `period` is accepted and ignored, as in the Elixir API.
                only_request(request, &["key", "period"], "a get_cost request")?;
                let key = key(required(request, "key", "")?, "key")?;
                Ok(Answer::Borrowed(store.borrowed(key).await?))
            }
            "sync" => {
                only_request(
                    request,
                    &["key", "allowance", "window_left_ms"],
                    "a sync request",
                )?;
                let key = key(required(request, "key", "")?, "key")?;
                let allowance = allowance(required(request, "allowance", "")?)?;
                let window_left_ms = integer(
                    required(request, "window_left_ms", "")?,
                    "window_left_ms",
                    0,
                )?;
                Ok(Answer::Taken(
                    store.sync(key, allowance, window_left_ms).await?,
                ))
            }
            "reset" => {
                only_request(request, &["key"], "a reset request")?;
                store
                    .reset(key(required(request, "key", "")?, "key")?)
                    .await?;
                Ok(Answer::Done)
            }
            "reset_exchange" => {
                only_request(request, &["exchange"], "a reset_exchange request")?;
                let exchange = part(required(request, "exchange", "")?, "exchange")?;
                store.reset_exchange(exchange).await?;
                Ok(Answer::Done)
            }
            "reset_all" => {
                only_request(request, &[], "a reset_all request")?;
                store.reset_all().await?;
                Ok(Answer::Done)
            }
            "pause" => {
                only_request(request, &["target", "ms"], "a pause request")?;
                let target = pause_target(required(request, "target", "")?)?;
                let ms = integer(required(request, "ms", "")?, "ms", 0)?;
                store.pause(target, ms).await?;
                Ok(Answer::Done)
            }
            "inspect" => {
                only_request(request, &["key"], "an inspect request")?;
                let key = key(required(request, "key", "")?, "key")?;
                Ok(Answer::Info(store.inspect(key).await?))
            }
            "busiest" => {
                only_request(request, &["count"], "a busiest request")?;
                let count = match request.get("count") {
                    Some(count) => integer(count, "count", 1)?,
                    None => 10,
                };
                if count > MAX_BUSIEST {
                    return Err(Invalid::new(format!(
                        "count must be at most {MAX_BUSIEST}, got {count}"
                    ))
                    .into());
                }
                Ok(Answer::Busiest(store.busiest(count as usize).await?))
            }
            "stats" => {
                only_request(request, &[], "a stats request")?;
                Ok(Answer::Stats(store.stats().await?))
            }
            "sweep" => {
                only_request(request, &[], "a sweep request")?;
                Ok(Answer::Swept(store.sweep()))
            }
            "hello" => {
                only_request(request, &[], "a hello request")?;
                Ok(Answer::Hello {
                    assume_busy_at_start: store.config().assume_busy_at_start,
                    max_frame_bytes: self.max_frame_bytes,
                })
            }
            other => Err(Invalid::new(format!(
                "unknown op {other:?}; expected one of check, check_many, record, get_cost, sync, \
                 reset, reset_exchange, reset_all, pause, inspect, busiest, stats, sweep, hello"
            ))
            .into()),
        }
    }

    /// The request's `owner` (a string or an integer, hashed), or the connection's own.
    fn owner(&self, session: &Session, request: &Map<String, Value>) -> Result<u64> {
        match request.get("owner") {
            None => Ok(session.default_owner),
            Some(Value::String(owner)) if owner.len() <= MAX_KEY_PART_BYTES => {
                Ok(self.owners.hash_one(("string", owner.as_str())))
            }
            Some(Value::Number(n)) if n.is_i64() || n.is_u64() => {
                let value = n.as_i64().map(i128::from).or(n.as_u64().map(i128::from));
                Ok(self.owners.hash_one(("integer", value)))
            }
            Some(other) => Err(Invalid::new(format!(
                "owner must be a string of at most {MAX_KEY_PART_BYTES} bytes or an integer, got {}",
                kind(other)
            ))),
        }
    }
}

/// `max_wait_ms` present: the caller is a waiter with that budget; absent: a probe.
fn mode(request: &Map<String, Value>) -> Result<Mode> {
    Ok(match request.get("max_wait_ms") {
        None => Mode::Probe,
        Some(value) => Mode::Wait {
            max_wait_ms: integer(value, "max_wait_ms", 1)?,
        },
    })
}

/// Rejects a request's fields other than `allowed`, `op` and `id`.
fn only_request(request: &Map<String, Value>, allowed: &[&str], what: &str) -> Result<()> {
    unknown_field(request, allowed, &["op", "id"], what)
}

/// Rejects fields other than `allowed`.
fn only(fields: &Map<String, Value>, allowed: &[&str], what: &str) -> Result<()> {
    unknown_field(fields, allowed, &[], what)
}

/// A misspelt field must not be silently ignored by a rate limiter.
fn unknown_field(
    fields: &Map<String, Value>,
    allowed: &[&str],
    envelope: &[&str],
    what: &str,
) -> Result<()> {
    let known =
        |name: &String| allowed.contains(&name.as_str()) || envelope.contains(&name.as_str());
    match fields.keys().find(|name| !known(name)) {
        Some(name) => {
            let listed = if allowed.is_empty() {
                "none".to_string()
            } else {
                allowed.join(", ")
            };
            Err(Invalid::new(format!(
                "unknown field {name:?} in {what} (known fields: {listed})"
            )))
        }
        None => Ok(()),
    }
}

fn required<'a>(fields: &'a Map<String, Value>, name: &str, hint: &str) -> Result<&'a Value> {
    fields
        .get(name)
        .ok_or_else(|| Invalid::new(format!("missing field {name}{hint}")))
}

/// A key object `{exchange, credential, axis}`; credential null is the public pool, axis
/// defaults to `"request"`.
fn key<'a>(value: &'a Value, what: &str) -> Result<KeyRef<'a>> {
    let Value::Object(fields) = value else {
        return Err(Invalid::new(format!(
            "{what} must be an object {{exchange, credential, axis}}, got {}",
            json_type(value)
        )));
    };
    only(fields, &["exchange", "credential", "axis"], what)?;
    let exchange = part(
        fields
            .get("exchange")
            .ok_or_else(|| Invalid::new(format!("{what}.exchange is missing")))?,
        &format!("{what}.exchange"),
    )?;
    let credential = match fields.get("credential") {
        None => {
            return Err(Invalid::new(format!(
                "{what}.credential is missing (use null for the public pool)"
            )))
        }
        Some(Value::Null) => None,
        Some(credential) => Some(credential_part(credential, &format!("{what}.credential"))?),
    };
    let axis = match fields.get("axis") {
        None => b"request".as_slice(),
        Some(axis) => part(axis, &format!("{what}.axis"))?,
    };
    Ok(KeyRef::new(exchange, credential, axis))
}

fn part<'a>(value: &'a Value, what: &str) -> Result<&'a [u8]> {
    match value {
        Value::String(s) if s.len() <= MAX_KEY_PART_BYTES => Ok(s.as_bytes()),
        Value::String(s) => Err(Invalid::new(format!(
            "{what} must be at most {MAX_KEY_PART_BYTES} bytes, got {}",
            s.len()
        ))),
        other => Err(Invalid::new(format!(
            "{what} must be a string, got {}",
            kind(other)
        ))),
    }
}

/// A credential: like [`part`], but an error names only the value's JSON type, never
/// the value (it may be an API key).
fn credential_part<'a>(value: &'a Value, what: &str) -> Result<&'a [u8]> {
    match value {
        Value::String(_) => part(value, what),
        other => Err(Invalid::new(format!(
            "{what} must be a string or null, got {}",
            json_type(other)
        ))),
    }
}

/// A limit object, or `None` for null (no limit).
fn limit(value: &Value, what: &str) -> Result<Option<Limit>> {
    let fields = match value {
        Value::Null => return Ok(None),
        Value::Object(fields) => fields,
        other => {
            return Err(Invalid::new(format!(
                "{what} must be an object or null, got {}",
                kind(other)
            )))
        }
    };
    let has = |name: &str| fields.contains_key(name);
    let rate = has("capacity") || has("refill_per_sec");
    let period = has("requests") || has("period");
    let in_what = |message: String| Invalid::new(format!("{what}: {message}"));
    let limit = match (rate, period) {
        (true, true) => {
            return Err(in_what(
                "give either capacity and refill_per_sec, or requests (and period), not both"
                    .into(),
            ))
        }
        (true, false) => {
            only(fields, &["capacity", "refill_per_sec"], what)?;
            let capacity = number(fields.get("capacity"), what, "capacity")?;
            let refill = number(fields.get("refill_per_sec"), what, "refill_per_sec")?;
            Limit::new(capacity, refill)
        }
        (false, true) => {
            only(fields, &["requests", "period"], what)?;
            let requests = number(fields.get("requests"), what, "requests")?;
            let period = match fields.get("period") {
                Some(_) => number(fields.get("period"), what, "period")?,
                None => 1000.0,
            };
            Limit::per_period(requests, period)
        }
        (false, false) => {
            only(fields, &[], what)?;
            return Err(in_what(
                "needs capacity and refill_per_sec, or requests (and period in ms)".into(),
            ));
        }
    };
    limit.map(Some).map_err(|error| in_what(error.to_string()))
}

fn number(value: Option<&Value>, what: &str, name: &str) -> Result<f64> {
    match value {
        Some(Value::Number(n)) => n
            .as_f64()
            .ok_or_else(|| Invalid::new(format!("{what}.{name} is not a usable number"))),
        Some(other) => Err(Invalid::new(format!(
            "{what}.{name} must be a number, got {}",
            kind(other)
        ))),
        None => Err(Invalid::new(format!("{what}.{name} is missing"))),
    }
}

/// A cost: absent is 1; otherwise a finite number from 0 to `MAX_AMOUNT`.
fn cost(value: Option<&Value>, what: &str) -> Result<f64> {
    match value {
        None => Ok(1.0),
        Some(Value::Number(n)) => n
            .as_f64()
            .ok_or_else(|| Invalid::new(format!("{what} is not a usable number")))
            .and_then(|cost| {
                rules::cost(Shape::Float(cost))
                    .map_err(|error| Invalid::new(format!("{what}: {error}")))
            }),
        Some(other) => Err(Invalid::new(format!(
            "{what} must be a number, got {}",
            kind(other)
        ))),
    }
}

/// What the exchange still allows: a finite number of at most `MAX_AMOUNT` either way (a
/// negative allowance means the exchange counted more than its limit).
fn allowance(value: &Value) -> Result<f64> {
    match value {
        Value::Number(n) => match n.as_f64() {
            Some(allowance) if allowance.abs() <= MAX_AMOUNT => Ok(allowance),
            _ => Err(Invalid::new(format!(
                "allowance must be a finite number from -{MAX_AMOUNT:e} to {MAX_AMOUNT:e}, got {n}"
            ))),
        },
        other => Err(Invalid::new(format!(
            "allowance must be a number, got {}",
            kind(other)
        ))),
    }
}

/// An integer from `min` to `u64::MAX`.
fn integer(value: &Value, what: &str, min: u64) -> Result<u64> {
    match value.as_u64() {
        Some(n) if n >= min => Ok(n),
        _ => Err(Invalid::new(format!(
            "{what} must be an integer of at least {min}, got {}",
            kind(value)
        ))),
    }
}

/// `{exchange}`, `{exchange, credential}` or a full key `{exchange, credential, axis}`.
fn pause_target(value: &Value) -> Result<PauseTarget> {
    let Value::Object(fields) = value else {
        return Err(Invalid::new(format!(
            "target must be an object {{exchange}}, {{exchange, credential}} or \
             {{exchange, credential, axis}}, got {}",
            json_type(value)
        )));
    };
    if fields.contains_key("axis") {
        return Ok(PauseTarget::Key(key(value, "target")?.to_owned_key()));
    }
    only(fields, &["exchange", "credential"], "target")?;
    let exchange = part(
        fields
            .get("exchange")
            .ok_or_else(|| Invalid::new("target.exchange is missing"))?,
        "target.exchange",
    )?
    .to_vec();
    Ok(match fields.get("credential") {
        None => PauseTarget::Exchange(exchange),
        Some(Value::Null) => PauseTarget::Credential(exchange, None),
        Some(credential) => PauseTarget::Credential(
            exchange,
            Some(credential_part(credential, "target.credential")?.to_vec()),
        ),
    })
}

/// Names a JSON value's type without its contents, for values that may hold an API key.
fn json_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Names a JSON value's type, with short scalars shown, for error messages.
fn kind(value: &Value) -> String {
    match value {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("a boolean ({b})"),
        Value::Number(n) => format!("the number {n}"),
        Value::String(s) if s.len() <= 40 => format!("the string {s:?}"),
        Value::String(_) => "a long string".into(),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "an object".into(),
    }
}

fn encode(out: &mut Vec<u8>, id: Option<&Value>, answer: Answer) {
    let (result, ms) = match answer {
        Answer::Outcome(outcome) => match outcome {
            Outcome::Admitted => ("admitted", None),
            Outcome::Claimed => ("claimed", None),
            Outcome::Delay(ms) => ("delay", Some(ms)),
            Outcome::Booked(ms) => ("booked", Some(ms)),
            Outcome::OverBudget(ms) => ("over_budget", Some(ms)),
        },
        other => {
            let mut body = match other {
                Answer::Borrowed(borrowed) => json!({"ok": true, "borrowed": borrowed}),
                Answer::Taken(taken) => json!({"ok": true, "taken": taken}),
                Answer::Info(info) => json!({"ok": true, "info": info.as_ref().map(info_json)}),
                Answer::Stats(stats) => json!({"ok": true, "stats": stats_json(&stats)}),
                Answer::Hello {
                    assume_busy_at_start,
                    max_frame_bytes,
                } => json!({
                    "ok": true,
                    "protocol": PROTOCOL_VERSION,
                    "server": SERVER,
                    "assume_busy_at_start": assume_busy_at_start,
                    "max_frame_bytes": max_frame_bytes,
                }),
                Answer::Swept(dropped) => json!({"ok": true, "dropped": dropped}),
                Answer::Busiest(rows) => json!({
                    "ok": true,
                    "keys": rows
                        .iter()
                        .map(|(key, info)| json!({"key": key_json(key), "info": info_json(info)}))
                        .collect::<Vec<_>>(),
                }),
                Answer::Done | Answer::Outcome(_) => json!({"ok": true}),
            };
            if let (Some(id), Value::Object(fields)) = (id, &mut body) {
                fields.insert("id".into(), id.clone());
            }
            write_value(out, &body);
            return;
        }
    };
    // The hot path, written directly.
    out.extend_from_slice(b"{\"ok\":true,\"result\":\"");
    out.extend_from_slice(result.as_bytes());
    out.push(b'"');
    if let Some(ms) = ms {
        out.extend_from_slice(b",\"ms\":");
        out.extend_from_slice(ms.to_string().as_bytes());
    }
    if let Some(id) = id {
        out.extend_from_slice(b",\"id\":");
        write_value(out, id);
    }
    out.push(b'}');
}

fn error(out: &mut Vec<u8>, id: Option<&Value>, kind: &str, message: &str) {
    let mut body = json!({"ok": false, "error": {"type": kind, "message": message}});
    if let (Some(id), Value::Object(fields)) = (id, &mut body) {
        fields.insert("id".into(), id.clone());
    }
    write_value(out, &body);
}

fn write_value(out: &mut Vec<u8>, value: &Value) {
    // Writing a `Value` to a Vec cannot fail: its keys are strings and Vec writes succeed.
    let _ = serde_json::to_writer(out, value);
}

fn key_json(key: &Key) -> Value {
    let key = key.as_ref();
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    json!({
        "exchange": text(key.exchange),
        "credential": key.credential.map(text),
        "axis": text(key.axis),
    })
}

fn info_json(info: &KeyInfo) -> Value {
    json!({
        "limit": info.limit.map(|limit| json!({
            "capacity": limit.capacity(),
            "refill_per_sec": limit.refill_per_sec(),
        })),
        "tokens": info.tokens,
        "borrowed": info.borrowed,
        "debt": info.debt,
        "bookings": info.bookings,
        "booked_cost": info.booked_cost,
        "next_ready_ms": info.next_ready_ms,
        "pause_ms": info.pause_ms,
    })
}

fn stats_json(stats: &Stats) -> Value {
    json!({
        "admitted": stats.admitted,
        "claimed": stats.claimed,
        "delayed": stats.delayed,
        "booked": stats.booked,
        "over_budget": stats.over_budget,
        "lapsed": stats.lapsed,
        "paused": stats.paused,
        "debited": stats.debited,
        "invalid": stats.invalid,
        "buckets": stats.buckets,
        "bookings": stats.bookings,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context, Waker};

    use bourse_core::{Config, ManualClock, Table};

    struct Fixture {
        clock: ManualClock,
        service: Service<Memory<ManualClock>>,
        session: Session,
    }

    impl Fixture {
        fn new() -> Self {
            let clock = ManualClock::new();
            let table = Table::with_clock(Config::default(), clock.clone());
            let service = Service::new(Memory::new(table), 65_536);
            let session = service.session();
            Self {
                clock,
                service,
                session,
            }
        }

        fn call_as(&self, session: &Session, request: &str) -> Value {
            let mut out = Vec::new();
            {
                // The in-memory store answers without waiting.
                let handled = pin!(self.service.handle(session, request.as_bytes(), &mut out));
                let polled = handled.poll(&mut Context::from_waker(Waker::noop()));
                assert!(polled.is_ready(), "the in-memory store made a request wait");
            }
            serde_json::from_slice(&out).expect("answers are JSON")
        }

        fn call(&self, request: &str) -> Value {
            self.call_as(&self.session, request)
        }

        fn stat(&self, name: &str) -> u64 {
            self.call(r#"{"op":"stats"}"#)["stats"][name]
                .as_u64()
                .unwrap()
        }
    }

    const KEY: &str = r#"{"exchange":"binance","credential":"k1"}"#;

    fn check(limit: &str, extra: &str) -> String {
        format!(r#"{{"op":"check","key":{KEY},"limit":{limit}{extra}}}"#)
    }

    #[test]
    fn hello_names_the_protocol() {
        let f = Fixture::new();
        assert_eq!(
            f.call(r#"{"op":"hello","id":7}"#),
            json!({"ok": true, "protocol": 1, "server": SERVER,
                   "assume_busy_at_start": false, "max_frame_bytes": 65_536, "id": 7})
        );
    }

    #[test]
    fn probes_admit_then_delay_without_paying() {
        let f = Fixture::new();
        let limit = r#"{"requests":2,"period":1000}"#;
        for _ in 0..2 {
            assert_eq!(
                f.call(&check(limit, "")),
                json!({"ok": true, "result": "admitted"})
            );
        }
        assert_eq!(
            f.call(&check(limit, r#","id":"a""#)),
            json!({"ok": true, "result": "delay", "ms": 500, "id": "a"})
        );
        assert_eq!(
            f.call(&check(limit, "")),
            json!({"ok": true, "result": "delay", "ms": 500})
        );
        f.clock.advance_ms(500);
        assert_eq!(f.call(&check(limit, ""))["result"], "admitted");
        // The same definition written as capacity and refill is the same bucket.
        f.clock.advance_ms(500);
        assert_eq!(
            f.call(&check(r#"{"capacity":2,"refill_per_sec":2.0}"#, "")),
            json!({"ok": true, "result": "admitted"})
        );
        // No limit: validated, then nothing happens.
        assert_eq!(
            f.call(&check("null", r#","cost":1000"#))["result"],
            "admitted"
        );
        assert_eq!(
            f.call(&check(r#"{"requests":2}"#, r#","cost":1"#))["result"],
            "delay"
        );
    }

    #[test]
    fn waiters_book_and_claim_by_owner() {
        let f = Fixture::new();
        let limit = r#"{"capacity":1,"refill_per_sec":10}"#;
        assert_eq!(
            f.call(&check(limit, r#","max_wait_ms":1000"#))["result"],
            "admitted"
        );
        let booked = f.call(&check(limit, r#","max_wait_ms":1000,"owner":"a""#));
        assert_eq!(booked, json!({"ok": true, "result": "booked", "ms": 100}));
        // Another owner queues behind; a budget too short books nothing.
        assert_eq!(
            f.call(&check(limit, r#","max_wait_ms":1000,"owner":5"#))["ms"],
            200
        );
        assert_eq!(
            f.call(&check(limit, r#","max_wait_ms":250,"owner":"5""#)),
            json!({"ok": true, "result": "over_budget", "ms": 300})
        );
        assert_eq!(f.stat("bookings"), 2);
        // Early: the remaining wait; on time: claimed, from any connection, not charged again.
        f.clock.advance_ms(40);
        assert_eq!(
            f.call(&check(limit, r#","owner":"a""#)),
            json!({"ok": true, "result": "delay", "ms": 60})
        );
        f.clock.advance_ms(60);
        let other = f.service.session();
        assert_eq!(
            f.call_as(&other, &check(limit, r#","owner":"a""#))["result"],
            "claimed"
        );
        f.clock.advance_ms(100);
        assert_eq!(
            f.call(&check(limit, r#","owner":5,"max_wait_ms":1"#))["result"],
            "claimed"
        );
        assert_eq!(f.stat("bookings"), 0);
        assert_eq!(f.stat("claimed"), 2);
    }

    #[test]
    fn the_default_owner_is_the_connection() {
        let f = Fixture::new();
        let limit = r#"{"capacity":1,"refill_per_sec":10}"#;
        f.call(&check(limit, ""));
        assert_eq!(f.call(&check(limit, r#","max_wait_ms":1000"#))["ms"], 100);
        let other = f.service.session();
        assert_eq!(
            f.call_as(&other, &check(limit, r#","max_wait_ms":1000"#))["ms"],
            200
        );
        f.clock.advance_ms(100);
        assert_eq!(f.call(&check(limit, ""))["result"], "claimed");
        assert_eq!(f.call_as(&other, &check(limit, ""))["result"], "delay");
    }

    #[test]
    fn check_many_is_all_or_nothing() {
        let f = Fixture::new();
        let a = r#"{"key":{"exchange":"x","credential":null},"limit":{"requests":3},"cost":2}"#;
        let b = r#"{"key":{"exchange":"x","credential":null,"axis":"ip"},"limit":{"requests":1}}"#;
        let many = |checks: &str, extra: &str| {
            format!(r#"{{"op":"check_many","checks":[{checks}]{extra}}}"#)
        };
        assert_eq!(
            f.call(&many("", "")),
            json!({"ok": true, "result": "admitted"})
        );
        assert_eq!(f.call(&many(&format!("{a},{b}"), ""))["result"], "admitted");
        // `b` is empty: `a` must not pay either.
        assert_eq!(f.call(&many(&format!("{a},{b}"), ""))["result"], "delay");
        let x = r#"{"exchange":"x","credential":null}"#;
        assert!(
            f.call(&format!(r#"{{"op":"get_cost","key":{x}}}"#))["borrowed"]
                .as_f64()
                .unwrap()
                < 2.01
        );
        // Coalesced: the same key twice is charged once at the combined cost.
        f.clock.advance_ms(1000);
        let half = r#"{"key":{"exchange":"x","credential":null},"limit":{"requests":3}}"#;
        assert_eq!(
            f.call(&many(
                &format!("{half},{half},{half}"),
                r#","max_wait_ms":10"#
            ))["result"],
            "admitted"
        );
        // Conflicting definitions: an error, nothing paid, counted once.
        f.clock.advance_ms(1000);
        let other = r#"{"key":{"exchange":"x","credential":null},"limit":{"requests":4}}"#;
        let answer = f.call(&many(&format!("{half},{other}"), r#","id":1"#));
        assert_eq!(answer["ok"], false);
        assert_eq!(answer["id"], 1);
        assert!(answer["error"]["message"]
            .as_str()
            .unwrap()
            .contains("conflicting"));
        assert_eq!(f.stat("invalid"), 1);
        // A check without limit is dropped and does not conflict.
        let free = r#"{"key":{"exchange":"x","credential":null},"limit":null,"cost":99}"#;
        assert_eq!(
            f.call(&many(&format!("{half},{free}"), ""))["result"],
            "admitted"
        );
    }

    #[test]
    fn record_get_cost_and_resets() {
        let f = Fixture::new();
        let key = |exchange: &str| format!(r#"{{"exchange":"{exchange}","credential":"k"}}"#);
        let get = |exchange: &str| {
            f.call(&format!(
                r#"{{"op":"get_cost","key":{},"period":60000}}"#,
                key(exchange)
            ))["borrowed"]
                .as_f64()
                .unwrap()
        };
        assert_eq!(get("a"), 0.0);
        assert_eq!(
            f.call(&format!(r#"{{"op":"record","key":{},"cost":3}}"#, key("a"))),
            json!({"ok": true})
        );
        f.call(&format!(r#"{{"op":"record","key":{}}}"#, key("b")));
        assert_eq!((get("a"), get("b")), (3.0, 1.0));
        let info = f.call(&format!(r#"{{"op":"inspect","key":{}}}"#, key("a")));
        assert_eq!(info["info"]["limit"], Value::Null);
        assert_eq!(info["info"]["debt"], 3.0);
        f.call(&format!(r#"{{"op":"reset","key":{}}}"#, key("a")));
        assert_eq!(
            f.call(&format!(r#"{{"op":"inspect","key":{}}}"#, key("a"))),
            json!({"ok": true, "info": null})
        );
        f.call(&format!(r#"{{"op":"record","key":{}}}"#, key("a")));
        assert_eq!(
            f.call(r#"{"op":"reset_exchange","exchange":"b"}"#),
            json!({"ok": true})
        );
        assert_eq!((get("a"), get("b")), (1.0, 0.0));
        assert_eq!(f.call(r#"{"op":"reset_all"}"#), json!({"ok": true}));
        assert_eq!(get("a"), 0.0);
        assert_eq!(f.stat("debited"), 3);
    }

    #[test]
    fn sync_lowers_tokens_to_what_the_exchange_allows() {
        let f = Fixture::new();
        let sync = |allowance: &str, window_left_ms: u64| {
            f.call(&format!(
                r#"{{"op":"sync","key":{KEY},"allowance":{allowance},"window_left_ms":{window_left_ms},"id":3}}"#
            ))
        };
        // An unknown key is left alone.
        assert_eq!(sync("5", 0), json!({"ok": true, "taken": 0.0, "id": 3}));
        f.call(&check(r#"{"capacity":10,"refill_per_sec":1}"#, ""));
        // 9 tokens; the exchange allows 5 more in a window ending in 2 s, which refills 2.
        assert_eq!(sync("5", 2000)["taken"], 6.0);
        let borrowed = f.call(&format!(r#"{{"op":"get_cost","key":{KEY}}}"#))["borrowed"].clone();
        assert_eq!(borrowed, 7.0);
        // Never raises the tokens; a negative allowance puts the bucket in debt.
        assert_eq!(sync("100", 0)["taken"], 0.0);
        assert_eq!(sync("-2.5", 0)["taken"], 5.5);
        let info = f.call(&format!(r#"{{"op":"inspect","key":{KEY}}}"#))["info"].clone();
        assert_eq!(info["debt"], 2.5);
    }

    #[test]
    fn pauses_hold_their_targets() {
        let f = Fixture::new();
        let limit = r#"{"requests":100}"#;
        let on = |key: &str| format!(r#"{{"op":"check","key":{key},"limit":{limit}}}"#);
        let k1 = r#"{"exchange":"binance","credential":"k1"}"#;
        let k2 = r#"{"exchange":"binance","credential":"k2","axis":"order"}"#;
        let public = r#"{"exchange":"binance","credential":null}"#;
        let other = r#"{"exchange":"okx","credential":"k1"}"#;
        let pause = |target: &str, ms: u64| {
            f.call(&format!(r#"{{"op":"pause","target":{target},"ms":{ms}}}"#))
        };
        assert_eq!(
            pause(
                r#"{"exchange":"binance","credential":"k1","axis":"request"}"#,
                100
            ),
            json!({"ok": true})
        );
        assert_eq!(
            f.call(&on(k1)),
            json!({"ok": true, "result": "delay", "ms": 100})
        );
        assert_eq!(f.call(&on(k2))["result"], "admitted");
        pause(r#"{"exchange":"binance","credential":null}"#, 200);
        assert_eq!(f.call(&on(public))["ms"], 200);
        assert_eq!(f.call(&on(k2))["result"], "admitted");
        pause(r#"{"exchange":"binance"}"#, 300);
        assert_eq!(f.call(&on(k2))["ms"], 300);
        assert_eq!(f.call(&on(other))["result"], "admitted");
        let info = f.call(&format!(r#"{{"op":"inspect","key":{k2}}}"#));
        assert_eq!(info["info"]["pause_ms"], 300);
        f.clock.advance_ms(300);
        assert_eq!(f.call(&on(k1))["result"], "admitted");
        assert_eq!(pause(r#"{"exchange":"binance"}"#, 0), json!({"ok": true}));
    }

    #[test]
    fn stats_sweep_and_busiest() {
        let f = Fixture::new();
        let limit = r#"{"capacity":4,"refill_per_sec":4}"#;
        f.call(&check(limit, r#","cost":3"#));
        f.call(&format!(
            r#"{{"op":"check","key":{{"exchange":"e","credential":null}},"limit":{limit}}}"#
        ));
        let busiest = f.call(r#"{"op":"busiest","count":1}"#);
        assert_eq!(busiest["keys"].as_array().unwrap().len(), 1);
        assert_eq!(
            busiest["keys"][0]["key"],
            json!({"exchange": "binance", "credential": "k1", "axis": "request"})
        );
        assert_eq!(busiest["keys"][0]["info"]["borrowed"], 3.0);
        assert_eq!(
            f.call(r#"{"op":"sweep"}"#),
            json!({"ok": true, "dropped": 0})
        );
        f.clock.advance_ms(10_000);
        assert_eq!(
            f.call(r#"{"op":"sweep","id":null}"#),
            json!({"ok": true, "dropped": 2, "id": null})
        );
        let stats = f.call(r#"{"op":"stats"}"#)["stats"].clone();
        for name in [
            "admitted",
            "claimed",
            "delayed",
            "booked",
            "over_budget",
            "lapsed",
            "paused",
            "debited",
            "invalid",
            "buckets",
            "bookings",
        ] {
            assert!(stats[name].is_u64(), "{name} missing from {stats}");
        }
        assert_eq!(
            (stats["admitted"].as_u64(), stats["buckets"].as_u64()),
            (Some(2), Some(0))
        );
    }

    #[test]
    fn errors_never_echo_a_credential() {
        let f = Fixture::new();
        let secret = "SECRET-API-KEY-123";
        let limit = r#"{"requests":1}"#;
        let requests = [
            format!(r#"{{"op":"check","key":"{secret}","limit":{limit}}}"#),
            format!(r#"{{"op":"check","key":["binance","{secret}"],"limit":{limit}}}"#),
            format!(
                r#"{{"op":"check","key":{{"exchange":"b","credential":["{secret}"]}},"limit":{limit}}}"#
            ),
            r#"{"op":"check","key":{"exchange":"b","credential":12345678987654321},"limit":null}"#
                .into(),
            format!(r#"{{"op":"check_many","checks":["{secret}"]}}"#),
            format!(r#"{{"op":"pause","target":"{secret}","ms":1}}"#),
            r#"{"op":"pause","target":{"exchange":"b","credential":12345678987654321},"ms":1}"#
                .into(),
        ];
        for request in requests {
            let answer = f.call(&request);
            let message = answer["error"]["message"].as_str().unwrap_or_default();
            assert!(!message.is_empty(), "{request}: {answer}");
            assert!(
                !message.contains("SECRET") && !message.contains("12345678987654321"),
                "{request}: {message:?} echoes the credential"
            );
        }
    }

    #[test]
    fn malformed_requests_name_the_problem_and_touch_nothing() {
        let f = Fixture::new();
        let big = "x".repeat(MAX_KEY_PART_BYTES + 1);
        let deep = format!("{}{}", "[".repeat(1000), "]".repeat(1000));
        let cases: Vec<(String, &str)> = vec![
            ("".into(), "malformed JSON"),
            ("{".into(), "malformed JSON"),
            ("\u{0}".into(), "malformed JSON"),
            (deep, "malformed JSON"),
            ("[1]".into(), "must be a JSON object"),
            ("{}".into(), "missing field op"),
            (r#"{"op":1}"#.into(), "op must be a string"),
            (r#"{"op":"nope"}"#.into(), "unknown op"),
            (r#"{"op":"hello","x":1}"#.into(), "unknown field \"x\""),
            (r#"{"op":"check","limit":null}"#.into(), "missing field key"),
            (format!(r#"{{"op":"check","key":{KEY}}}"#), "missing field limit"),
            (r#"{"op":"check","key":"binance","limit":null}"#.into(), "key must be an object"),
            (r#"{"op":"check","key":{"credential":null},"limit":null}"#.into(), "key.exchange is missing"),
            (r#"{"op":"check","key":{"exchange":"b"},"limit":null}"#.into(), "key.credential is missing"),
            (r#"{"op":"check","key":{"exchange":1,"credential":null},"limit":null}"#.into(), "key.exchange must be a string"),
            (r#"{"op":"check","key":{"exchange":"b","credential":2},"limit":null}"#.into(), "key.credential must be a string"),
            (r#"{"op":"check","key":{"exchange":"b","credential":null,"axis":null},"limit":null}"#.into(), "key.axis must be a string"),
            (r#"{"op":"check","key":{"exchange":"b","credential":null,"axes":"ip"},"limit":null}"#.into(), "unknown field \"axes\""),
            (format!(r#"{{"op":"check","key":{{"exchange":"{big}","credential":null}},"limit":null}}"#), "at most 1024 bytes"),
            (check("5", ""), "limit must be an object or null"),
            (check("{}", ""), "needs capacity and refill_per_sec"),
            (check(r#"{"capacity":1}"#, ""), "limit.refill_per_sec is missing"),
            (check(r#"{"capacity":"1","refill_per_sec":1}"#, ""), "limit.capacity must be a number"),
            (check(r#"{"capacity":0,"refill_per_sec":1}"#, ""), "capacity must be a finite number > 0"),
            (check(r#"{"capacity":1,"refill_per_sec":-1}"#, ""), "refill_per_sec must be"),
            (check(r#"{"capacity":1e13,"refill_per_sec":1}"#, ""), "capacity must be"),
            (check(r#"{"requests":10,"refill_per_sec":1}"#, ""), "not both"),
            (check(r#"{"period":10}"#, ""), "limit.requests is missing"),
            (check(r#"{"requests":10,"period":0}"#, ""), "period must be"),
            (check(r#"{"requests":10,"rate":1}"#, ""), "unknown field \"rate\""),
            (check(r#"{"requests":1}"#, r#","cost":-1"#), "cost: cost must be a finite number"),
            (check(r#"{"requests":1}"#, r#","cost":1e13"#), "cost must be"),
            (check(r#"{"requests":1}"#, r#","cost":"1""#), "cost must be a number"),
            (check(r#"{"requests":1}"#, r#","cost":null"#), "cost must be a number"),
            (check(r#"{"requests":1}"#, r#","cost":1e999"#), "malformed JSON"),
            (check("null", r#","cost":-1"#), "cost"),
            (check(r#"{"requests":1}"#, r#","max_wait_ms":0"#), "max_wait_ms must be an integer of at least 1"),
            (check(r#"{"requests":1}"#, r#","max_wait_ms":1.5"#), "max_wait_ms must be"),
            (check(r#"{"requests":1}"#, r#","max_wait_ms":-5"#), "max_wait_ms must be"),
            (check(r#"{"requests":1}"#, r#","max_wait_ms":99999999999999999999999"#), "max_wait_ms must be"),
            (check(r#"{"requests":1}"#, r#","owner":null"#), "owner must be"),
            (check(r#"{"requests":1}"#, r#","owner":1.5"#), "owner must be"),
            (check(r#"{"requests":1}"#, r#","owner":[1]"#), "owner must be"),
            (check(r#"{"requests":1}"#, r#","max_wait":100"#), "unknown field \"max_wait\""),
            (r#"{"op":"check_many"}"#.into(), "missing field checks"),
            (r#"{"op":"check_many","checks":{}}"#.into(), "checks must be an array"),
            (r#"{"op":"check_many","checks":[1]}"#.into(), "checks[0] must be an object"),
            (format!(r#"{{"op":"check_many","checks":[{{"key":{KEY},"limit":null}},{{"key":{KEY},"limit":null,"cost":-1}}]}}"#), "checks[1].cost"),
            (format!(r#"{{"op":"check_many","checks":[{{"key":{KEY},"limit":{{"requests":0}}}}]}}"#), "checks[0].limit: requests"),
            (format!(r#"{{"op":"check_many","checks":[{{"key":{KEY},"limit":null,"owner":1}}]}}"#), "unknown field \"owner\" in checks[0]"),
            (format!(r#"{{"op":"record","key":{KEY},"cost":-3}}"#), "cost"),
            (r#"{"op":"get_cost"}"#.into(), "missing field key"),
            (format!(r#"{{"op":"sync","key":{KEY},"window_left_ms":0}}"#), "missing field allowance"),
            (format!(r#"{{"op":"sync","key":{KEY},"allowance":1}}"#), "missing field window_left_ms"),
            (format!(r#"{{"op":"sync","key":{KEY},"allowance":"1","window_left_ms":0}}"#), "allowance must be a number"),
            (format!(r#"{{"op":"sync","key":{KEY},"allowance":-1e13,"window_left_ms":0}}"#), "allowance must be a finite number"),
            (format!(r#"{{"op":"sync","key":{KEY},"allowance":1,"window_left_ms":-1}}"#), "window_left_ms must be an integer"),
            (format!(r#"{{"op":"sync","key":{KEY},"allowance":1,"window_left_ms":1.5}}"#), "window_left_ms must be an integer"),
            (format!(r#"{{"op":"sync","key":{KEY},"allowance":1,"window_left_ms":0,"cost":1}}"#), "unknown field \"cost\""),
            (r#"{"op":"sync","key":"k","allowance":1,"window_left_ms":0}"#.into(), "key must be an object"),
            (r#"{"op":"reset_exchange","exchange":null}"#.into(), "exchange must be a string"),
            (r#"{"op":"reset_all","exchange":"b"}"#.into(), "unknown field \"exchange\""),
            (r#"{"op":"pause","target":{"exchange":"b"}}"#.into(), "missing field ms"),
            (r#"{"op":"pause","target":{"exchange":"b"},"ms":-1}"#.into(), "ms must be an integer"),
            (r#"{"op":"pause","target":"b","ms":1}"#.into(), "target must be an object"),
            (r#"{"op":"pause","target":{"credential":"k"},"ms":1}"#.into(), "target.exchange is missing"),
            (r#"{"op":"pause","target":{"exchange":"b","axis":"ip"},"ms":1}"#.into(), "target.credential is missing"),
            (r#"{"op":"pause","target":{"exchange":"b","cred":"k"},"ms":1}"#.into(), "unknown field \"cred\""),
            (r#"{"op":"busiest","count":0}"#.into(), "count must be"),
            (r#"{"op":"busiest","count":10001}"#.into(), "count must be at most"),
        ];
        let total = cases.len() as u64;
        for (request, expected) in cases {
            let answer = f.call(&request);
            let message = answer["error"]["message"].as_str().unwrap_or_default();
            assert_eq!(answer["ok"], false, "{request}");
            assert_eq!(answer["error"]["type"], "invalid_parameters", "{request}");
            assert!(
                message.contains(expected),
                "{request}: {message:?} lacks {expected:?}"
            );
        }
        assert_eq!(f.stat("invalid"), total);
        assert_eq!(f.stat("buckets"), 0);
        // The id is echoed whenever the request was an object.
        let answer = f.call(r#"{"op":"nope","id":{"n":[1]}}"#);
        assert_eq!(answer["id"], json!({"n": [1]}));
    }

    #[test]
    fn frame_errors() {
        let f = Fixture::new();
        let mut out = Vec::new();
        f.service.frame_too_large(&mut out, 64);
        let answer: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(answer["error"]["type"], "frame_too_large");
        out.clear();
        f.service.truncated_frame(&mut out);
        let answer: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(answer["error"]["type"], "invalid_parameters");
        assert_eq!(f.stat("invalid"), 2);
    }
}

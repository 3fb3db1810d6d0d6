//! Answers encoded in the connection's codec (no framing): JSON objects, or map terms of
//! the external term format. The hot path is written directly, the rest through a
//! `serde_json::Value`, the same for both codecs.

use bourse_core::{InvalidInput, KeyInfo, Outcome, Stats};
use serde_json::{json, Value};

use crate::store::ShownKey;

use super::{etf, Codec, PROTOCOL_VERSION, SERVER};

/// What a request answers, before encoding.
pub enum Answer {
    Done,
    Outcome(Outcome),
    Borrowed(f64),
    Taken(f64),
    /// The pause a backoff set, in milliseconds.
    Paused(u64),
    Info(Option<KeyInfo>),
    Stats(Stats),
    Hello(Hello),
    /// A proved `auth`, with the daemon's own proof when the client asked for it.
    Proved(Option<String>),
    Swept(usize),
    Busiest(Vec<(ShownKey, KeyInfo)>),
    /// Whether a `give_back` found what it names and gave it back.
    GivenBack(bool),
}

/// What a `hello` tells the client.
pub struct Hello {
    pub assume_busy_at_start: bool,
    pub max_frame_bytes: usize,
    /// The nonce to prove the secret over, while the connection has not proved it.
    pub nonce: Option<String>,
    pub idle_timeout_ms: Option<u64>,
    /// The daemon's monotonic clock (µs) when it answered: deadlines are sent on it.
    pub clock_us: u64,
    /// The id of the in-memory table, new at each start (`None` with Redis).
    pub table: Option<String>,
}

/// Where an answer goes: the request's id, or for a frame whose id could not be read, its
/// position on the connection (1 for the first frame).
#[derive(Clone, Copy)]
pub enum To<'a> {
    Id(Option<&'a Value>),
    Frame(u64),
}

impl To<'_> {
    /// Appends `,"id":ID` (or `,"frame":N`) to a JSON object being written.
    fn write_json(self, out: &mut Vec<u8>) {
        match self {
            To::Id(None) => {}
            To::Id(Some(id)) => {
                out.extend_from_slice(b",\"id\":");
                write_value(out, id);
            }
            To::Frame(n) => {
                out.extend_from_slice(b",\"frame\":");
                out.extend_from_slice(n.to_string().as_bytes());
            }
        }
    }

    /// Appends the `id` (or `frame`) entry of a map being written as a term.
    fn write_etf(self, out: &mut Vec<u8>) {
        match self {
            To::Id(None) => {}
            To::Id(Some(id)) => {
                etf::write_binary(out, b"id");
                etf::write_value(out, id);
            }
            To::Frame(n) => {
                etf::write_binary(out, b"frame");
                etf::write_integer(out, i128::from(n));
            }
        }
    }

    fn is_some(self) -> bool {
        !matches!(self, To::Id(None))
    }
}

/// Appends `answer` in `codec`: a JSON object whose last member is its id (or frame), or a
/// map term whose first key is.
pub fn encode(out: &mut Vec<u8>, codec: Codec, to: To, answer: Answer) {
    let body = match answer {
        Answer::Outcome(outcome) => return outcome_answer(out, codec, to, outcome),
        Answer::Done => json!({"ok": true}),
        Answer::Borrowed(borrowed) => json!({"ok": true, "borrowed": borrowed}),
        Answer::Taken(taken) => json!({"ok": true, "taken": taken}),
        Answer::Paused(ms) => json!({"ok": true, "ms": ms}),
        Answer::Info(info) => json!({"ok": true, "info": info.as_ref().map(info_json)}),
        Answer::Stats(stats) => json!({"ok": true, "stats": stats_json(&stats)}),
        Answer::Hello(hello) => {
            let mut body = json!({
                "ok": true,
                "protocol": PROTOCOL_VERSION,
                "server": SERVER,
                "assume_busy_at_start": hello.assume_busy_at_start,
                "max_frame_bytes": hello.max_frame_bytes,
                "clock_us": hello.clock_us,
            });
            if let Some(nonce) = hello.nonce {
                body["auth"] = json!({"scheme": "hmac-sha256", "nonce": nonce});
            }
            if let Some(ms) = hello.idle_timeout_ms {
                body["idle_timeout_ms"] = json!(ms);
            }
            if let Some(table) = hello.table {
                body["table"] = json!(table);
            }
            body
        }
        Answer::Proved(None) => json!({"ok": true}),
        Answer::Proved(Some(proof)) => json!({"ok": true, "proof": proof}),
        Answer::Swept(dropped) => json!({"ok": true, "dropped": dropped}),
        Answer::GivenBack(given) => json!({"ok": true, "given_back": given}),
        Answer::Busiest(rows) => json!({
            "ok": true,
            "keys": rows
                .iter()
                .map(|(key, info)| json!({"key": key_json(key), "info": info_json(info)}))
                .collect::<Vec<_>>(),
        }),
    };
    close(out, codec, &body, to);
}

/// The hot path, written directly.
fn outcome_answer(out: &mut Vec<u8>, codec: Codec, to: To, outcome: Outcome) {
    let (result, ms) = match outcome {
        Outcome::Admitted => ("admitted", None),
        Outcome::Claimed => ("claimed", None),
        Outcome::Delay(ms) => ("delay", Some(ms)),
        Outcome::Booked(ms) => ("booked", Some(ms)),
        Outcome::OverBudget(ms) => ("over_budget", Some(ms)),
    };
    match codec {
        Codec::Json => {
            out.extend_from_slice(b"{\"ok\":true,\"result\":\"");
            out.extend_from_slice(result.as_bytes());
            out.push(b'"');
            if let Some(ms) = ms {
                out.extend_from_slice(b",\"ms\":");
                out.extend_from_slice(ms.to_string().as_bytes());
            }
            to.write_json(out);
            out.push(b'}');
        }
        Codec::Etf => {
            let arity = 2 + u32::from(ms.is_some()) + u32::from(to.is_some());
            out.extend_from_slice(&[etf::VERSION, b't']);
            out.extend_from_slice(&arity.to_be_bytes());
            to.write_etf(out);
            etf::write_binary(out, b"ok");
            etf::write_atom(out, "true");
            etf::write_binary(out, b"result");
            etf::write_binary(out, result.as_bytes());
            if let Some(ms) = ms {
                etf::write_binary(out, b"ms");
                etf::write_integer(out, i128::from(ms));
            }
        }
    }
}

/// Appends an error answer of `kind` (`invalid_parameters`, `unavailable`, ...), naming
/// the request's exchange when it could be read.
pub fn error(out: &mut Vec<u8>, codec: Codec, to: To, kind: &str, error: &InvalidInput) {
    let mut body = json!({"ok": false, "error": {"type": kind, "message": error.message()}});
    if let Some(exchange) = error.exchange() {
        body["error"]["exchange"] = json!(String::from_utf8_lossy(exchange));
    }
    close(out, codec, &body, to);
}

/// Appends the answer of a daemon that refused its configuration (`message`) to whatever
/// was asked: an `invalid_parameters` error, after which the daemon exits.
pub fn refused(out: &mut Vec<u8>, codec: Codec, to: To, message: &str) {
    let body = json!({"ok": false, "error": {"type": "invalid_parameters", "message": message}});
    close(out, codec, &body, to);
}

/// Writes the object `body` with `to` as its last member (JSON) or first key (a term).
fn close(out: &mut Vec<u8>, codec: Codec, body: &Value, to: To) {
    match (codec, body) {
        (Codec::Etf, Value::Object(fields)) => {
            etf::encode_map(
                out,
                usize::from(to.is_some()),
                |out| to.write_etf(out),
                fields,
            );
        }
        (Codec::Etf, other) => {
            out.push(etf::VERSION);
            etf::write_value(out, other);
        }
        (Codec::Json, _) => {
            write_value(out, body);
            if out.last() == Some(&b'}') {
                out.pop();
                to.write_json(out);
                out.push(b'}');
            }
        }
    }
}

fn write_value(out: &mut Vec<u8>, value: &Value) {
    // Writing a `Value` to a Vec cannot fail: its keys are strings and Vec writes succeed.
    let _ = serde_json::to_writer(out, value);
}

fn key_json(key: &ShownKey) -> Value {
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    json!({
        "exchange": text(&key.exchange),
        "credential": key.credential,
        "axis": text(&key.axis),
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

//! The protocol against the in-memory table on a manual clock.

use super::*;
use bourse_core::rules::{MAX_CHECKS, MAX_KEY_PART_BYTES};
use serde_json::json;
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
        let service = Service::new(Memory::new(table), 65_536, None);
        let session = service.session(false, None);
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
            let handled = pin!(self.service.handle(
                session,
                session.next_frame(),
                request.as_bytes(),
                &mut out
            ));
            let polled = handled.poll(&mut Context::from_waker(Waker::noop()));
            assert!(polled.is_ready(), "the in-memory store made a request wait");
        }
        serde_json::from_slice(&out).expect("answers are JSON")
    }

    fn call(&self, request: &str) -> Value {
        self.call_as(&self.session, request)
    }

    /// The answer's bytes to `frame`, whatever its codec.
    fn call_bytes(&self, session: &Session, frame: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        {
            let number = session.next_frame();
            let handled = pin!(self.service.handle(session, number, frame, &mut out));
            let polled = handled.poll(&mut Context::from_waker(Waker::noop()));
            assert!(polled.is_ready(), "the in-memory store made a request wait");
        }
        out
    }

    /// A new connection that chose the external term format in its first hello.
    fn etf_session(&self) -> Session {
        let session = self.service.session(false, None);
        let hello = self.call_bytes(&session, br#"{"op":"hello","codec":"etf","id":0}"#);
        let hello = etf::decode(&hello).expect("the hello's answer is a term");
        assert_eq!(
            (hello["ok"].clone(), hello["id"].clone()),
            (json!(true), json!(0))
        );
        assert_eq!(session.codec(), Codec::Etf);
        session
    }

    /// `request` (a JSON object) sent as a term on `session`; the answer term, read back.
    fn call_etf(&self, session: &Session, request: &Value) -> Value {
        let Value::Object(fields) = request else {
            panic!("{request} is not an object");
        };
        let mut frame = Vec::new();
        etf::encode_map(&mut frame, 0, |_| {}, fields);
        etf::decode(&self.call_bytes(session, &frame)).expect("answers are terms")
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
    let mut hello = f.call(r#"{"op":"hello","id":7}"#);
    let clock_us = hello
        .as_object_mut()
        .and_then(|hello| hello.remove("clock_us"));
    assert!(clock_us.is_some_and(|clock| clock.is_u64()));
    let table = hello
        .as_object_mut()
        .and_then(|hello| hello.remove("table"));
    let table = table.as_ref().and_then(Value::as_str).unwrap_or_default();
    assert!(table.len() == 32 && table.bytes().all(|b| b.is_ascii_hexdigit()));
    assert_eq!(
        hello,
        json!({"ok": true, "protocol": 1, "server": SERVER,
               "assume_busy_at_start": false, "max_frame_bytes": 65_536, "id": 7})
    );
}

#[test]
fn requests_past_their_deadline_do_nothing() {
    let f = Fixture::new();
    let etf = f.etf_session();
    let now = f.call(r#"{"op":"hello"}"#)["clock_us"].as_u64().unwrap();
    let key = json!({"exchange": "binance", "credential": "k1"});
    let check =
        json!({"op": "check", "key": key, "limit": {"capacity": 1, "refill_per_sec": 0.001}});
    let with_deadline = |request: &Value, id: u64, deadline_us: u64, timeout_ms: u64| {
        let mut request = request.clone();
        request["id"] = json!(id);
        request["deadline_us"] = json!(deadline_us);
        request["timeout_ms"] = json!(timeout_ms);
        request
    };
    // Its caller gives up 99 ms from `now` after 400 ms in all: it could run until 1 ms
    // before `now`, for its answer to travel back within a quarter of the timeout.
    let late = with_deadline(&check, 3, now + 99_000, 400);
    let record = with_deadline(&json!({"op": "record", "key": key, "cost": 5}), 4, now, 4);
    for answer in [
        f.call(&late.to_string()),
        f.call(&record.to_string()),
        f.call_etf(&etf, &late),
    ] {
        assert_eq!(answer["ok"], false, "{answer}");
        assert_eq!(answer["error"]["type"], "unavailable", "{answer}");
        assert!(answer["id"] == 3 || answer["id"] == 4, "{answer}");
        let message = answer["error"]["message"].as_str().unwrap();
        assert!(message.contains("it was not executed"), "{message}");
    }
    let cost = f.call(&json!({"op": "get_cost", "key": key}).to_string());
    assert_eq!(cost["borrowed"], 0.0, "{cost}");
    // In time (or without a deadline): run.
    let in_time = with_deadline(&check, 5, now + 60_000_000, 1000);
    assert_eq!(f.call(&in_time.to_string())["result"], "admitted");
    assert_eq!(f.call(&check.to_string())["result"], "delay");
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
    let other = f.service.session(false, None);
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
fn a_waiter_may_name_its_own_booking_slack() {
    let f = Fixture::new();
    let limit = r#"{"capacity":1,"refill_per_sec":10}"#;
    f.call(&check(limit, ""));
    let slack = r#","max_wait_ms":1000,"booking_slack_ms":"#;
    let patient = format!(r#"{slack}5000,"owner":"patient""#);
    let hasty = format!(r#"{slack}0,"owner":"hasty""#);
    assert_eq!(f.call(&check(limit, &patient))["result"], "booked");
    assert_eq!(f.call(&check(limit, &hasty))["result"], "booked");
    // Coming back early without a budget keeps the booking's own slack.
    f.clock.advance_ms(50);
    assert_eq!(
        f.call(&check(limit, r#","owner":"patient""#))["result"],
        "delay"
    );
    // Both are late by more than the daemon's own slack of 250 ms.
    f.clock.advance_ms(150 + 300);
    assert_eq!(
        f.call(&check(limit, r#","owner":"patient""#))["result"],
        "claimed"
    );
    assert_eq!(
        f.call(&check(limit, r#","owner":"hasty""#))["result"],
        "admitted"
    );
    assert_eq!(f.stat("lapsed"), 1);
}

#[test]
fn the_default_owner_is_the_connection() {
    let f = Fixture::new();
    let limit = r#"{"capacity":1,"refill_per_sec":10}"#;
    f.call(&check(limit, ""));
    assert_eq!(f.call(&check(limit, r#","max_wait_ms":1000"#))["ms"], 100);
    let other = f.service.session(false, None);
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
    let many =
        |checks: &str, extra: &str| format!(r#"{{"op":"check_many","checks":[{checks}]{extra}}}"#);
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
    // Never raises the tokens; a negative allowance allows nothing until the window ends,
    // with no debt past it.
    assert_eq!(sync("100", 0)["taken"], 0.0);
    assert_eq!(sync("-2.5", 1000)["taken"], 4.0);
    let info = f.call(&format!(r#"{{"op":"inspect","key":{KEY}}}"#))["info"].clone();
    assert_eq!(info["debt"], 1.0);
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
    let pause =
        |target: &str, ms: u64| f.call(&format!(r#"{{"op":"pause","target":{target},"ms":{ms}}}"#));
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
fn backoffs_double_per_limited_reply_and_are_shared_by_connections() {
    let f = Fixture::new();
    let on = r#"{"op":"check","key":{"exchange":"binance","credential":"k1","axis":"ip"},"limit":{"requests":100}}"#;
    let back_off = |credential: &str, scope: &str| {
        f.call(&format!(
            r#"{{"op":"back_off","credential":{{"exchange":"binance","credential":{credential}}},"scope":"{scope}"}}"#
        ))
    };
    assert_eq!(
        back_off(r#""k1""#, "credential"),
        json!({"ok": true, "ms": 1000})
    );
    // A reply that comes while that pause holds was sent before it: not counted.
    assert_eq!(back_off(r#""k1""#, "credential")["ms"], 1000);
    f.clock.advance_ms(1000);
    assert_eq!(back_off(r#""k1""#, "credential")["ms"], 2000);
    assert_eq!(f.call(on)["ms"], 2000);
    // Replies limiting the whole exchange count for it, whichever credential got them.
    assert_eq!(back_off("null", "exchange")["ms"], 1000);
    f.clock.advance_ms(2000);
    assert_eq!(back_off(r#""k1""#, "exchange")["ms"], 2000);
    let reset = r#"{"op":"reset_backoff","credential":{"exchange":"binance","credential":"k1"}}"#;
    assert_eq!(f.call(reset), json!({"ok": true}));
    assert_eq!(back_off(r#""k1""#, "credential")["ms"], 1000);
    f.clock.advance_ms(bourse_core::rules::BACKOFF_LAPSE_MS);
    assert_eq!(back_off(r#""k1""#, "credential")["ms"], 1000);
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
        json!({"exchange": "binance", "credential": crate::fingerprint::shown(b"k1"), "axis": "request"})
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
        format!(r#"{{"op":"check_many","checks":["{secret}"]}}"#),
        format!(r#"{{"op":"pause","target":"{secret}","ms":1}}"#),
    ];
    for request in requests {
        let answer = f.call(&request);
        let message = answer["error"]["message"].as_str().unwrap_or_default();
        assert!(!message.is_empty(), "{request}: {answer}");
        assert!(
            !message.contains("SECRET"),
            "{request}: {message:?} echoes the credential"
        );
    }
}

#[test]
fn malformed_requests_name_the_problem_and_touch_nothing() {
    let f = Fixture::new();
    let cases = malformed_cases();
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
fn an_error_names_the_exchange_whenever_it_could_be_read() {
    let f = Fixture::new();
    let limit = r#""limit":{"requests":3}"#;
    for request in [
        format!(r#"{{"op":"check","key":{{"exchange":"binance"}},{limit}}}"#),
        format!(r#"{{"op":"check","key":{{"exchange":"binance","credential":null,"foo":1}},{limit}}}"#),
        format!(r#"{{"op":"check","key":{{"exchange":"binance","credential":5}},{limit}}}"#),
        format!(r#"{{"op":"check","key":{{"exchange":"binance","credential":null,"axis":7}},{limit}}}"#),
        format!(r#"{{"op":"check","key":{{"exchange":"binance","credential":"k"}},{limit},"owner":[1]}}"#),
        format!(r#"{{"op":"check_many","checks":[{{"key":{{"exchange":"binance","credential":"k"}},{limit}}}],"owner":[1]}}"#),
        format!(r#"{{"op":"check_many","checks":[{{"key":{{"exchange":"binance","credential":"k"}},{limit}}}],"max_wait_ms":0}}"#),
        r#"{"op":"record","key":{"exchange":"binance"},"cost":1}"#.to_string(),
        r#"{"op":"pause","target":{"exchange":"binance","foo":1},"ms":5}"#.to_string(),
        r#"{"op":"back_off","credential":{"exchange":"binance"},"scope":"credential"}"#.to_string(),
        r#"{"op":"back_off","credential":{"exchange":"binance","credential":null,"x":1},"scope":"credential"}"#.to_string(),
        format!(r#"{{"op":"check_many","checks":[{{"key":{{"exchange":"okx","credential":"k"}},{limit}}},{{"$term":"tuple","arity":2,"exchange":"binance"}}]}}"#),
    ] {
        let answer = f.call(&request);
        assert_eq!(answer["error"]["type"], "invalid_parameters", "{request}");
        assert_eq!(answer["error"]["exchange"], "binance", "{request}: {answer}");
    }
    // An exchange that cannot be read is not named, nor one of several.
    let answer = f.call(r#"{"op":"check","key":{"exchange":5,"credential":null},"limit":null}"#);
    assert!(answer["error"].get("exchange").is_none(), "{answer}");
    let answer = f.call(&format!(
        r#"{{"op":"check_many","checks":[{{"key":{{"exchange":"a","credential":"k"}},{limit}}},{{"key":{{"exchange":"b","credential":"k"}},{limit}}}],"max_wait_ms":0}}"#
    ));
    assert_eq!(answer["error"]["type"], "invalid_parameters", "{answer}");
    assert!(answer["error"].get("exchange").is_none(), "{answer}");
}

/// Malformed requests, each with what its error message says.
fn malformed_cases() -> Vec<(String, &'static str)> {
    let big = "x".repeat(MAX_KEY_PART_BYTES + 1);
    let deep = format!("{}{}", "[".repeat(1000), "]".repeat(1000));
    vec![
        ("".into(), "malformed JSON"),
        ("{".into(), "malformed JSON"),
        ("\u{0}".into(), "malformed JSON"),
        (deep, "malformed JSON"),
        ("[1]".into(), "must be a JSON object"),
        ("{}".into(), "missing field op"),
        (r#"{"op":1}"#.into(), "op must be a string"),
        (r#"{"op":"nope"}"#.into(), "unknown op"),
        (r#"{"op":"hello","x":1}"#.into(), "unknown field \"x\""),
        (
            r#"{"op":"stats","deadline_us":-1,"timeout_ms":5}"#.into(),
            "deadline_us must be an integer from 0 to 9223372036854775807, got -1",
        ),
        (
            r#"{"op":"stats","deadline_us":1.5,"timeout_ms":5}"#.into(),
            "deadline_us must be an integer",
        ),
        (
            r#"{"op":"check","key":{"exchange":"b","credential":null},"limit":null,"deadline_us":5,"timeout_ms":0}"#.into(),
            "timeout_ms must be an integer from 1 to 4294967295, got 0",
        ),
        (
            r#"{"op":"stats","deadline_us":5}"#.into(),
            "missing field timeout_ms (sent with deadline_us)",
        ),
        (
            r#"{"op":"stats","timeout_ms":5}"#.into(),
            "missing field deadline_us (sent with timeout_ms)",
        ),
        (r#"{"op":"check","limit":null}"#.into(), "missing field key"),
        (
            format!(r#"{{"op":"check","key":{KEY}}}"#),
            "missing field limit",
        ),
        (
            r#"{"op":"check","key":"binance","limit":null}"#.into(),
            "key must be {exchange_id, credential_key, bucket_axis}",
        ),
        (
            r#"{"op":"check","key":{"credential":null},"limit":null}"#.into(),
            "missing field exchange",
        ),
        (
            r#"{"op":"check","key":{"exchange":"b"},"limit":null}"#.into(),
            "missing field credential",
        ),
        (
            r#"{"op":"check","key":{"exchange":1,"credential":null},"limit":null}"#.into(),
            "exchange_id must be a UTF-8 binary of at most 1024 bytes, got an integer",
        ),
        (
            r#"{"op":"check","key":{"exchange":"b","credential":2},"limit":null}"#.into(),
            "credential_key must be :public or a UTF-8 binary",
        ),
        (
            r#"{"op":"check","key":{"exchange":"b","credential":null,"axis":null},"limit":null}"#
                .into(),
            "bucket_axis must be a UTF-8 binary of at most 1024 bytes, got nil",
        ),
        (
            r#"{"op":"check","key":{"exchange":"b","credential":{"$term":"binary","size":2}},"limit":null}"#
                .into(),
            "credential_key must be :public or a UTF-8 binary of at most 1024 bytes, got a binary of 2 bytes that is not UTF-8",
        ),
        (
            r#"{"op":"check","key":{"exchange":"b","credential":null},"limit":null,"cost":{"$term":"binary","size":2}}"#
                .into(),
            "cost must be a finite number >= 0 and at most 1.0e12, got a binary of 2 bytes",
        ),
        (
            r#"{"op":"check","key":{"exchange":"b","credential":null,"axes":"ip"},"limit":null}"#
                .into(),
            "unknown field \"axes\" in a key",
        ),
        // A shape without its count, or with one no term has, is no term's.
        (
            r#"{"op":"check","key":{"exchange":{"$term":"binary","size":-1},"credential":null},"limit":null}"#
                .into(),
            "exchange_id must be a UTF-8 binary of at most 1024 bytes, got a term of unknown type",
        ),
        (
            r#"{"op":"check","key":{"exchange":{"$term":"binary"},"credential":null},"limit":null}"#
                .into(),
            "got a term of unknown type",
        ),
        (
            r#"{"op":"check","key":{"exchange":{"$term":"binary","size":99999999999999999999},"credential":null},"limit":null}"#
                .into(),
            "got a term of unknown type",
        ),
        (
            r#"{"op":"check","key":{"$term":"tuple","arity":2.5},"limit":null}"#.into(),
            "got a term of unknown type",
        ),
        (
            r#"{"op":"check","key":{"exchange":"b","credential":null},"limit":{"$term":"map","size":-1}}"#
                .into(),
            "got a term of unknown type",
        ),
        (
            format!(
                r#"{{"op":"check","key":{{"exchange":"{big}","credential":null}},"limit":null}}"#
            ),
            "at most 1024 bytes",
        ),
        (check("5", ""), "limit must be %{capacity: c, refill_per_sec: r}, %{requests: n, period: ms}, %{requests: n} or nil, got 5"),
        (check("{}", ""), "got an empty map"),
        (
            check(r#"{"capacity":1}"#, ""),
            "got a map of :capacity alone",
        ),
        (
            check(r#"{"capacity":"1","refill_per_sec":1}"#, ""),
            "capacity must be a finite number > 0 and at most 1.0e12, got a binary of 1 byte",
        ),
        (
            check(r#"{"capacity":0,"refill_per_sec":1}"#, ""),
            "capacity must be a finite number > 0",
        ),
        (
            check(r#"{"capacity":1,"refill_per_sec":-1}"#, ""),
            "refill_per_sec must be",
        ),
        (
            check(r#"{"capacity":1e13,"refill_per_sec":1}"#, ""),
            "capacity must be",
        ),
        (
            check(r#"{"requests":10,"refill_per_sec":1}"#, ""),
            "or nil, got a map of :refill_per_sec and :requests",
        ),
        (check(r#"{"period":10}"#, ""), "or nil, got a map of :period alone"),
        (check(r#"{"requests":10,"period":0}"#, ""), "period must be"),
        (
            check(r#"{"requests":10,"rate":1}"#, ""),
            "or nil, got a map of :requests and 1 key other than :capacity, :refill_per_sec, \
             :requests and :period",
        ),
        (
            check(r#"{"requests":1}"#, r#","cost":-1"#),
            "cost must be a finite number >= 0 and at most 1.0e12, got -1",
        ),
        (
            check(r#"{"requests":1}"#, r#","cost":1e13"#),
            "cost must be",
        ),
        (
            check(r#"{"requests":1}"#, r#","cost":"1""#),
            "cost must be a finite number >= 0",
        ),
        (
            check(r#"{"requests":1}"#, r#","cost":null"#),
            "cost must be a finite number >= 0",
        ),
        (
            check(r#"{"requests":1}"#, r#","cost":1e999"#),
            "cost must be a finite number >= 0 and at most 1.0e12, got a number beyond a double",
        ),
        (check("null", r#","cost":-1"#), "cost"),
        (
            check(r#"{"requests":1}"#, r#","max_wait_ms":0"#),
            "max_wait_ms must be an integer from 1 to 4294967295, got 0",
        ),
        (
            check(r#"{"requests":1}"#, r#","max_wait_ms":1.5"#),
            "max_wait_ms must be",
        ),
        (
            check(r#"{"requests":1}"#, r#","max_wait_ms":-5"#),
            "max_wait_ms must be",
        ),
        (
            check(
                r#"{"requests":1}"#,
                r#","max_wait_ms":99999999999999999999999"#,
            ),
            "max_wait_ms must be",
        ),
        (
            check(r#"{"requests":1}"#, r#","owner":null"#),
            "owner must be",
        ),
        (
            check(
                r#"{"requests":1}"#,
                r#","max_wait_ms":10,"booking_slack_ms":86400001"#,
            ),
            "booking_slack_ms must be an integer from 0 to 86400000, got 86400001",
        ),
        (
            check(r#"{"requests":1}"#, r#","booking_slack_ms":-1"#),
            "booking_slack_ms must be",
        ),
        (
            check(r#"{"requests":1}"#, r#","owner":1.5"#),
            "owner must be",
        ),
        (
            check(r#"{"requests":1}"#, r#","owner":[1]"#),
            "owner must be",
        ),
        (
            check(r#"{"requests":1}"#, r#","max_wait":100"#),
            "unknown field \"max_wait\"",
        ),
        (r#"{"op":"check_many"}"#.into(), "missing field checks"),
        (
            r#"{"op":"check_many","checks":{}}"#.into(),
            "checks must be a list of at most 1024 {key, limit, cost}, got an empty map",
        ),
        (
            r#"{"op":"check_many","checks":[1]}"#.into(),
            "each check must be {key, limit, cost} or {bucket, cost}, got 1",
        ),
        (
            format!(
                r#"{{"op":"check_many","checks":[{{"key":{KEY},"limit":null}},{{"key":{KEY},"limit":null,"cost":-1}}]}}"#
            ),
            "cost must be a finite number >= 0 and at most 1.0e12, got -1",
        ),
        (
            format!(r#"{{"op":"check_many","checks":[{{"key":{KEY},"limit":{{"requests":0}}}}]}}"#),
            "requests must be a finite number > 0",
        ),
        (
            format!(r#"{{"op":"check_many","checks":[{{"key":{KEY},"limit":null,"owner":1}}]}}"#),
            "unknown field \"owner\" in a check",
        ),
        (
            format!(r#"{{"op":"record","key":{KEY},"cost":-3}}"#),
            "cost",
        ),
        (r#"{"op":"get_cost"}"#.into(), "missing field key"),
        (
            format!(r#"{{"op":"sync","key":{KEY},"window_left_ms":0}}"#),
            "missing field allowance",
        ),
        (
            format!(r#"{{"op":"sync","key":{KEY},"allowance":1}}"#),
            "missing field window_left_ms",
        ),
        (
            format!(r#"{{"op":"sync","key":{KEY},"allowance":"1","window_left_ms":0}}"#),
            "allowance must be a finite number from -1.0e12 to 1.0e12, got a binary of 1 byte",
        ),
        (
            format!(r#"{{"op":"sync","key":{KEY},"allowance":-1e13,"window_left_ms":0}}"#),
            "allowance must be a finite number",
        ),
        (
            format!(r#"{{"op":"sync","key":{KEY},"allowance":1,"window_left_ms":-1}}"#),
            "window_left_ms must be an integer from 0 to 4294967295",
        ),
        (
            format!(r#"{{"op":"sync","key":{KEY},"allowance":1,"window_left_ms":1.5}}"#),
            "window_left_ms must be an integer from 0 to 4294967295",
        ),
        (
            format!(r#"{{"op":"sync","key":{KEY},"allowance":1,"window_left_ms":0,"cost":1}}"#),
            "unknown field \"cost\"",
        ),
        (
            r#"{"op":"sync","key":"k","allowance":1,"window_left_ms":0}"#.into(),
            "key must be {exchange_id, credential_key, bucket_axis}",
        ),
        (
            r#"{"op":"reset_exchange","exchange":null}"#.into(),
            "exchange_id must be a UTF-8 binary of at most 1024 bytes, got nil",
        ),
        (
            r#"{"op":"reset_all","exchange":"b"}"#.into(),
            "unknown field \"exchange\"",
        ),
        (
            r#"{"op":"pause","target":{"exchange":"b"}}"#.into(),
            "missing field ms",
        ),
        (
            r#"{"op":"pause","target":{"exchange":"b"},"ms":-1}"#.into(),
            "pause (in milliseconds) must be an integer from 0 to 4294967295, got -1",
        ),
        (
            r#"{"op":"pause","target":"b","ms":1}"#.into(),
            "pause target must be a key, {exchange_id, credential_key} or an exchange_id, got a binary of 1 byte",
        ),
        (
            r#"{"op":"pause","target":{"credential":"k"},"ms":1}"#.into(),
            "missing field exchange",
        ),
        (
            r#"{"op":"pause","target":{"exchange":"b","axis":"ip"},"ms":1}"#.into(),
            "missing field credential",
        ),
        (
            r#"{"op":"pause","target":{"exchange":"b","cred":"k"},"ms":1}"#.into(),
            "unknown field \"cred\"",
        ),
        (
            r#"{"op":"back_off","credential":{"exchange":"b","credential":"k"}}"#.into(),
            "missing field scope",
        ),
        (
            r#"{"op":"back_off","credential":{"exchange":"b","credential":"k"},"scope":"ip"}"#
                .into(),
            "scope must be :credential or :exchange, got a binary of 2 bytes",
        ),
        (
            r#"{"op":"back_off","credential":"b","scope":"exchange"}"#.into(),
            "credential must be {exchange_id, credential_key}, got a binary of 1 byte",
        ),
        (
            r#"{"op":"reset_backoff","credential":{"exchange":"b","credential":"k","axis":"ip"}}"#
                .into(),
            "unknown field \"axis\" in a credential",
        ),
        (
            r#"{"op":"reset_backoff","credential":{"exchange":"b","credential":1}}"#.into(),
            "credential_key must be :public or a UTF-8 binary of at most 1024 bytes, got an integer",
        ),
        (r#"{"op":"busiest","count":0}"#.into(), "count must be an integer from 1 to 10000"),
        (
            r#"{"op":"busiest","count":10001}"#.into(),
            "count must be an integer from 1 to 10000, got 10001",
        ),
    ]
}

#[test]
fn frame_errors() {
    let f = Fixture::new();
    let mut out = Vec::new();
    f.service.frame_too_large(&f.session, &mut out, 3, 64, None);
    let answer: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(answer["error"]["type"], "frame_too_large");
    out.clear();
    f.service.truncated_frame(&f.session, &mut out, 4, None);
    let answer: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(answer["error"]["type"], "invalid_parameters");
    assert_eq!(answer["frame"], 4);
    assert_eq!(f.stat("invalid"), 2);
    // A line the stream ended in is answered with the id that leads it.
    for (line, to) in [
        (r#"{"id":1,"op":"stats"}"#, json!({"id": 1})),
        (r#"{"id":2,"op":"sta"#, json!({"id": 2})),
        (r#"{"id":3"#, json!({"frame": 5})),
        (r#"{"op":"stats","id":4"#, json!({"frame": 5})),
    ] {
        out.clear();
        f.service
            .truncated_frame(&f.session, &mut out, 5, Some(line.as_bytes()));
        let answer: Value = serde_json::from_slice(&out).unwrap();
        let key = if to.get("id").is_some() {
            "id"
        } else {
            "frame"
        };
        assert_eq!(answer[key], to[key], "{line}: {answer}");
    }
}

#[test]
fn every_answer_names_its_request() {
    let f = Fixture::new();
    let big = "1".repeat(401);
    // A number beyond a double, as capacity or cost: answered at once, with the id.
    for limit in [
        format!(r#"{{"capacity":{big},"refill_per_sec":1}}"#),
        r#"{"capacity":1,"refill_per_sec":1e400}"#.to_string(),
    ] {
        let answer = f.call(&check(&limit, r#","id":41"#));
        assert_eq!(
            (answer["ok"].clone(), answer["id"].clone()),
            (json!(false), json!(41)),
            "{answer}"
        );
        assert!(answer["error"]["message"]
            .as_str()
            .unwrap()
            .contains("must be a finite number"));
    }
    let answer = f.call(&check(
        r#"{"requests":1}"#,
        &format!(r#","cost":{big},"id":42"#),
    ));
    assert_eq!(answer["id"], 42);
    assert_eq!(answer["error"]["type"], "invalid_parameters");
    // Frames that are not JSON: the id when it comes first, else the frame's number.
    // (Those that hold too many values are refused before: see `values`.)
    let deep = "[".repeat(100_000);
    for (frame, to) in [
        (
            format!(r#"{{"id":7,"op":"check","key":{deep}"#),
            json!({"id": 7}),
        ),
        (
            r#"{ "id" : "x-1" , "op":"#.to_string(),
            json!({"id": "x-1"}),
        ),
        (format!(r#"{{"id":{big},"op":"#), json!({"frame": 0})),
        (
            r#"{"id":123456789012345678901234567890,"op":"#.into(),
            json!({"id": 123456789012345678901234567890u128}),
        ),
        ("{\"id\":8,\"op\":\"\u{0}".into(), json!({"id": 8})),
        // Refused for the values it holds before it is read: its id is found anywhere.
        (
            format!(r#"{{"op":"check","id":9,"key":{deep}"#),
            json!({"id": 9}),
        ),
        ("[1,2]".into(), json!({"frame": 0})),
        // A value that only begins like an integer is no id.
        (r#"{"id":56.5, bad"#.into(), json!({"frame": 0})),
        (r#"{"id":56e3, bad"#.into(), json!({"frame": 0})),
        (r#"{"id":12abc, bad"#.into(), json!({"frame": 0})),
        (r#"{"id":0x10, bad"#.into(), json!({"frame": 0})),
        (r#"{"id":5 6, bad"#.into(), json!({"frame": 0})),
        (r#"{"id":"a" b, bad"#.into(), json!({"frame": 0})),
        (r#"{"id":56 , bad"#.into(), json!({"id": 56})),
    ] {
        let session = f.service.session(false, None);
        for _ in 0..4 {
            session.next_frame();
        }
        let mut out = Vec::new();
        {
            let handled = pin!(f.service.handle(&session, 5, frame.as_bytes(), &mut out));
            assert!(handled
                .poll(&mut Context::from_waker(Waker::noop()))
                .is_ready());
        }
        let answer: Value = serde_json::from_slice(&out).expect("answers are JSON");
        assert_eq!(answer["error"]["type"], "invalid_parameters", "{answer}");
        match to.get("id") {
            Some(id) => assert_eq!(&answer["id"], id, "{answer}"),
            None => assert_eq!(answer["frame"], 5, "{answer}"),
        }
    }
}

#[test]
fn one_call_checks_at_most_1024_buckets() {
    let f = Fixture::new();
    let item = format!(r#"{{"key":{KEY},"limit":{{"requests":5000}}}}"#);
    let many = |n: usize| {
        format!(
            r#"{{"op":"check_many","checks":[{}]}}"#,
            vec![item.as_str(); n].join(",")
        )
    };
    assert_eq!(f.call(&many(1024))["result"], "admitted");
    let answer = f.call(&many(1025));
    assert_eq!(
        answer["error"]["message"],
        "checks must be a list of at most 1024 {key, limit, cost}, got a list of more than 1024 elements"
    );
    assert_eq!(
        f.call(&format!(r#"{{"op":"get_cost","key":{KEY}}}"#))["borrowed"],
        1024.0
    );
}

#[test]
fn a_request_of_too_many_values_is_refused_with_its_id_in_either_codec() {
    let f = Fixture::new();
    let session = f.etf_session();
    // The largest request, every field given, binary keys in its term: admitted.
    let check = json!({"key": {"exchange": "binance", "credential": "k1", "axis": "orders"},
        "limit": {"capacity": 5000, "refill_per_sec": 50}, "cost": 1});
    let largest = json!({"id": 3, "op": "check_many", "checks": vec![check; MAX_CHECKS]});
    assert_eq!(f.call(&largest.to_string())["result"], "admitted");
    assert_eq!(f.call_etf(&session, &largest)["result"], "admitted");
    // Small values by the tens of thousands, in few bytes; in the id too.
    let objects = json!(vec![json!({"a": {"b": 0}}); values::MAX_VALUES / 3 + 1]);
    let numbers = json!(vec![0; values::MAX_VALUES]);
    let short = "i".repeat(owed::MAX_KEPT_ID_BYTES);
    for (id, many, echoed) in [
        (json!(7), &numbers, json!(7)),
        (json!(short), &objects, json!(short)),
        (objects.clone(), &numbers, Value::Null),
        (
            json!("i".repeat(owed::MAX_KEPT_ID_BYTES + 1)),
            &numbers,
            Value::Null,
        ),
    ] {
        let request = json!({"id": id, "op": "check_many", "checks": many});
        let answer = f.call(&request.to_string());
        assert_eq!(answer["error"]["message"], values::too_many());
        assert_eq!(answer["id"], echoed);
        assert!(answer.to_string().len() < 1000);
        // A term's id, scalar, is echoed too.
        let answer = f.call_etf(&session, &request);
        assert_eq!(answer["error"]["message"], values::too_many());
        assert!(echoed.is_null() || answer["id"] == echoed);
    }
    // A list of bytes (STRING_EXT) counts each of its elements.
    let mut bytes = vec![etf::VERSION, b't', 0, 0, 0, 2];
    etf::write_binary(&mut bytes, b"id");
    bytes.extend_from_slice(&[b'a', 9]);
    etf::write_binary(&mut bytes, b"x");
    let lists = values::MAX_VALUES / MAX_CHECKS + 1;
    bytes.extend_from_slice(&[b'l', 0, 0, 0, lists as u8]);
    for _ in 0..lists {
        bytes.extend_from_slice(&[b'k', 4, 0]);
        bytes.extend_from_slice(&[b'a'; MAX_CHECKS]);
    }
    bytes.push(b'j');
    let answer = etf::decode(&f.call_bytes(&session, &bytes)).unwrap();
    assert_eq!(answer["error"]["message"], values::too_many());
    assert_eq!(answer["id"], 9);
}

#[test]
fn misplaced_credentials_are_described_by_type_and_size() {
    let f = Fixture::new();
    let secret = "SECRET-API-KEY-123";
    let requests = [
        format!(r#"{{"op":"check","key":{KEY},"limit":{{"requests":1}},"cost":"{secret}"}}"#),
        format!(
            r#"{{"op":"check","key":{{"exchange":"b","credential":null,"axis":["{secret}"]}},"limit":null}}"#
        ),
        format!(
            r#"{{"op":"check","key":{{"exchange":{{"b":"{secret}"}},"credential":null}},"limit":null}}"#
        ),
        format!(r#"{{"op":"reset_exchange","exchange":["{secret}"]}}"#),
        format!(r#"{{"op":"sync","key":{KEY},"allowance":"{secret}","window_left_ms":0}}"#),
        format!(r#"{{"op":"{secret}"}}"#),
        format!(r#"{{"op":"hello","{secret}":1}}"#),
        format!(r#"{{"op":"check","key":{KEY},"limit":{{"requests":"{secret}"}}}}"#),
        format!(r#"{{"op":"check","key":{KEY},"limit":"{secret}"}}"#),
        format!(r#"{{"op":"check","key":{KEY},"limit":null,"owner":["{secret}"]}}"#),
        format!(r#"{{"op":"check","key":{KEY},"limit":null,"max_wait_ms":"{secret}"}}"#),
        format!(r#"{{"op":"pause","target":{{"exchange":"b"}},"ms":"{secret}"}}"#),
        format!(r#"{{"op":"{secret}"#),
    ];
    for request in requests {
        let answer = f.call(&request);
        let message = answer["error"]["message"].as_str().unwrap_or_default();
        assert!(!message.is_empty(), "{request}: {answer}");
        assert!(!message.contains("SECRET"), "{request}: {message:?}");
    }
    let answer = f.call(&format!(
        r#"{{"op":"check","key":{KEY},"limit":{{"requests":1}},"cost":"{secret}"}}"#
    ));
    assert_eq!(
        answer["error"]["message"],
        "cost must be a finite number >= 0 and at most 1.0e12, got a binary of 18 bytes"
    );
}

#[test]
fn connections_that_must_prove_the_secret_serve_nothing_else_before() {
    use hmac::{Hmac, Mac};
    let clock = ManualClock::new();
    let table = Table::with_clock(Config::default(), clock);
    let service = Service::new(
        Memory::new(table),
        65_536,
        Some(b"0123456789abcdef".to_vec()),
    );
    let call = |session: &Session, request: &str| -> Value {
        let mut out = Vec::new();
        {
            let number = session.next_frame();
            let handled = pin!(service.handle(session, number, request.as_bytes(), &mut out));
            assert!(handled
                .poll(&mut Context::from_waker(Waker::noop()))
                .is_ready());
        }
        serde_json::from_slice(&out).unwrap()
    };
    let session = service.session(true, Some(1000));
    let hello = call(&session, r#"{"op":"hello","id":1}"#);
    assert_eq!(hello["auth"]["scheme"], "hmac-sha256");
    assert_eq!(hello["idle_timeout_ms"], 1000);
    let nonce = hello["auth"]["nonce"].as_str().unwrap().to_string();
    assert_eq!(nonce.len(), 64);
    for request in [
        r#"{"op":"reset_all","id":2}"#.to_string(),
        r#"{"op":"busiest","id":2}"#.to_string(),
        r#"{"op":"pause","target":{"exchange":"b"},"ms":86400000,"id":2}"#.to_string(),
        check(r#"{"requests":1}"#, r#","id":2"#),
    ] {
        let answer = call(&session, &request);
        assert_eq!(
            (answer["error"]["type"].as_str(), answer["id"].as_u64()),
            (Some("unauthorized"), Some(2)),
            "{request}"
        );
    }
    // A wrong proof, or a proof for another connection's nonce, is refused.
    let prove = |secret: &[u8], nonce: &str| {
        let mut mac = Hmac::<sha2::Sha256>::new_from_slice(secret).unwrap();
        mac.update(nonce.as_bytes());
        crate::fingerprint::hex(&mac.finalize().into_bytes())
    };
    let wrong = call(
        &session,
        &format!(
            r#"{{"op":"auth","proof":"{}"}}"#,
            prove(b"another-secret-1", &nonce)
        ),
    );
    assert_eq!(wrong["error"]["type"], "unauthorized");
    let other = service.session(true, None);
    let other_nonce = call(&other, r#"{"op":"hello"}"#)["auth"]["nonce"]
        .as_str()
        .unwrap()
        .to_string();
    let replayed = call(
        &session,
        &format!(
            r#"{{"op":"auth","proof":"{}"}}"#,
            prove(b"0123456789abcdef", &other_nonce)
        ),
    );
    assert_eq!(replayed["error"]["type"], "unauthorized");
    assert_eq!(
        call(&session, r#"{"op":"stats"}"#)["error"]["type"],
        "unauthorized"
    );
    // Hex digits only: not the sign an integer parser takes ("+1" for "01").
    let signed = call(
        &session,
        &format!(
            r#"{{"op":"auth","proof":"{}","challenge":"+1{}"}}"#,
            prove(b"0123456789abcdef", &nonce),
            "ab".repeat(31)
        ),
    );
    assert_eq!(signed["error"]["type"], "unauthorized", "{signed}");
    let proved = call(
        &session,
        &format!(
            r#"{{"op":"auth","proof":"{}","id":3}}"#,
            prove(b"0123456789abcdef", &nonce)
        ),
    );
    assert_eq!(proved, json!({"ok": true, "id": 3}));
    assert_eq!(
        call(&session, &check(r#"{"requests":1}"#, ""))["result"],
        "admitted"
    );
    assert!(call(&session, r#"{"op":"hello"}"#).get("auth").is_none());
    // Connections that need no proof (Unix sockets) are served at once.
    let local = service.session(false, None);
    assert_eq!(call(&local, r#"{"op":"stats"}"#)["ok"], true);

    // A client's challenge is answered with the daemon's own proof, once the client's holds.
    let mac = |message: &str| {
        let mut mac = Hmac::<sha2::Sha256>::new_from_slice(b"0123456789abcdef").unwrap();
        mac.update(message.as_bytes());
        crate::fingerprint::hex(&mac.finalize().into_bytes())
    };
    let challenged = service.session(true, None);
    let nonce = call(&challenged, r#"{"op":"hello"}"#)["auth"]["nonce"]
        .as_str()
        .unwrap()
        .to_string();
    let challenge = "0f".repeat(32);
    let auth = |proof: &str, challenge: &str| {
        format!(r#"{{"op":"auth","proof":"{proof}","challenge":"{challenge}"}}"#)
    };
    for (proof, challenge, message) in [
        (
            mac("wrong"),
            challenge.clone(),
            "wrong proof: the secret differs",
        ),
        (
            mac(&nonce),
            "0f".repeat(31),
            "challenge must be 64 hex digits (32 random bytes)",
        ),
    ] {
        let refused = call(&challenged, &auth(&proof, &challenge));
        assert_eq!(refused["error"]["message"], message, "{refused}");
        assert!(refused.get("proof").is_none());
    }
    let proved = call(&challenged, &auth(&mac(&nonce), &challenge));
    assert_eq!(
        proved,
        json!({"ok": true, "proof": mac(&format!("daemon {challenge} {nonce}"))})
    );
}

#[test]
fn the_first_hello_chooses_the_external_term_format() {
    let f = Fixture::new();
    let session = f.etf_session();
    let request = json!({"op": "check", "key": {"exchange": "b", "credential": null},
                         "limit": {"requests": 1}, "id": 1});
    let Value::Object(fields) = &request else {
        unreachable!()
    };
    let mut frame = Vec::new();
    etf::encode_map(&mut frame, 0, |_| {}, fields);
    let answer = f.call_bytes(&session, &frame);
    // The id first, as term_to_binary writes a small integer: clients route without decoding.
    assert_eq!(
        answer[..15],
        [131, b't', 0, 0, 0, 3, b'm', 0, 0, 0, 2, b'i', b'd', b'a', 1]
    );
    assert_eq!(
        etf::decode(&answer).unwrap(),
        json!({"id": 1, "ok": true, "result": "admitted"})
    );
    // Later hellos keep the codec; they cannot change it.
    let hello = f.call_etf(&session, &json!({"op": "hello", "codec": "etf", "id": 2}));
    assert_eq!(hello["protocol"], 1);
    let refused = f.call_etf(&session, &json!({"op": "hello", "codec": "json", "id": 3}));
    assert_eq!(
        (refused["error"]["message"].as_str(), refused["id"].as_u64()),
        (
            Some("codec is chosen by a connection's first frame; this one speaks etf"),
            Some(3)
        )
    );
    // A JSON frame on it is not a term; the error is a term too.
    let answer = etf::decode(&f.call_bytes(&session, br#"{"op":"hello"}"#)).unwrap();
    assert!(answer["error"]["message"]
        .as_str()
        .unwrap()
        .starts_with("malformed external term (it does not start with the version byte"));
    assert!(answer["frame"].is_u64());

    // A connection that did not choose in its first frame stays JSON.
    let json_session = f.service.session(false, None);
    assert_eq!(f.call_as(&json_session, r#"{"op":"hello"}"#)["ok"], true);
    let answer = f.call_as(&json_session, r#"{"op":"hello","codec":"etf"}"#);
    assert_eq!(
        answer["error"]["message"],
        "codec is chosen by a connection's first frame; this one speaks json"
    );
    let answer = f.call_as(&json_session, r#"{"op":"hello","codec":"xml"}"#);
    assert_eq!(
        answer["error"]["message"],
        "codec must be \"json\" or \"etf\", got a binary of 3 bytes"
    );
}

#[test]
fn both_codecs_read_requests_alike() {
    // The same requests in JSON and as terms, each on a table of its own.
    let (json_side, etf_side) = (Fixture::new(), Fixture::new());
    let session = etf_side.etf_session();
    let limit = json!({"capacity": 2, "refill_per_sec": 1});
    let key = json!({"exchange": "binance", "credential": "k", "axis": "ip"});
    let mut requests = vec![
        json!({"op": "check", "key": key, "limit": limit, "id": 1}),
        json!({"op": "check", "key": key, "limit": limit, "cost": 1.5, "id": "two"}),
        json!({"op": "check", "key": key, "limit": limit, "owner": "me", "max_wait_ms": 5000}),
        json!({"op": "check", "key": key, "limit": limit, "owner": "me", "max_wait_ms": 1}),
        json!({"op": "check_many", "checks": [{"key": key, "limit": limit},
                                             {"key": key, "limit": {"requests": 9}}]}),
        json!({"op": "record", "key": key, "cost": 3}),
        json!({"op": "get_cost", "key": key, "period": 60000}),
        json!({"op": "sync", "key": key, "allowance": -2, "window_left_ms": 100}),
        json!({"op": "pause", "target": {"exchange": "binance", "credential": null}, "ms": 5}),
        json!({"op": "inspect", "key": key}),
        json!({"op": "busiest", "count": 3}),
        json!({"op": "reset", "key": key, "id": [1, {"a": null}]}),
        json!({"op": "check", "key": {"$term": "tuple", "arity": 4}, "limit": limit}),
        json!({"op": "check", "key": key, "limit": {"$term": "map", "size": 3}, "cost": true}),
        json!({"op": "stats"}),
    ];
    // Every malformed request JSON and a term can both hold (a term has no 1e400).
    for (text, _) in malformed_cases() {
        match serde_json::from_str::<Value>(&text) {
            Ok(request @ Value::Object(_)) if !text.contains("e400") && !text.contains("999") => {
                requests.push(request)
            }
            _ => {}
        }
    }
    assert!(requests.len() > 60, "{}", requests.len());
    for request in &requests {
        let json_answer = json_side.call(&request.to_string());
        assert_eq!(
            etf_side.call_etf(&session, request),
            json_answer,
            "{request}"
        );
    }
}

#[test]
fn a_term_the_protocol_cannot_read_is_answered_with_its_id() {
    let f = Fixture::new();
    let session = f.etf_session();
    // %{id: 9, op: <<0xff>>}: a binary that is not UTF-8, after the id.
    let frame = [
        131, b't', 0, 0, 0, 2, b'd', 0, 2, b'i', b'd', b'a', 9, b'd', 0, 2, b'o', b'p', b'm', 0, 0,
        0, 1, 0xff,
    ];
    let answer = etf::decode(&f.call_bytes(&session, &frame)).unwrap();
    assert_eq!(answer["id"], 9);
    assert_eq!(answer["error"]["type"], "invalid_parameters");
    // A big integer (2^160) reads as JSON's 400-digit one: an integer beyond 64 bits.
    let mut big = vec![131, b't', 0, 0, 0, 4];
    for (name, value) in [
        ("op", Value::from("check")),
        ("key", json!({"exchange": "b", "credential": null})),
        ("limit", json!({"requests": 1})),
    ] {
        etf::write_binary(&mut big, name.as_bytes());
        etf::write_value(&mut big, &value);
    }
    etf::write_binary(&mut big, b"cost");
    big.extend_from_slice(&[b'n', 21, 0]);
    big.extend_from_slice(&[0; 20]);
    big.push(1);
    let answer = etf::decode(&f.call_bytes(&session, &big)).unwrap();
    let json_answer = f.call(&format!(
        r#"{{"op":"check","key":{{"exchange":"b","credential":null}},"limit":{{"requests":1}},"cost":{}}}"#,
        "9".repeat(400)
    ));
    assert_eq!(answer["error"], json_answer["error"]);
    assert!(answer["error"]["message"]
        .as_str()
        .unwrap()
        .contains("an integer outside the signed 64-bit range"));
}

#[test]
fn an_unsigned_64_bit_integer_is_described_as_outside_the_signed_range() {
    let f = Fixture::new();
    let answer = f.call(&format!(
        r#"{{"op":"check","key":{{"exchange":"b","credential":null}},"limit":{{"requests":1}},"cost":{}}}"#,
        u64::MAX
    ));
    let message = answer["error"]["message"].as_str().unwrap();
    assert!(
        message.ends_with("got an integer outside the signed 64-bit range"),
        "{message}"
    );
}

#[test]
fn a_map_that_is_no_request_is_answered_with_its_id() {
    let f = Fixture::new();
    let session = f.etf_session();
    // %{id: 9, 1 => 2}: a key that is no name.
    let frame = [
        131, b't', 0, 0, 0, 2, b'd', 0, 2, b'i', b'd', b'a', 9, b'a', 1, b'a', 2,
    ];
    let answer = etf::decode(&f.call_bytes(&session, &frame)).unwrap();
    assert_eq!(answer["id"], 9, "{answer}");
    assert_eq!(answer["error"]["type"], "invalid_parameters");
    // A map of more keys than a request may have, its id first.
    let keys = etf::MAX_MAP_KEYS + 1;
    let mut wide = vec![131, b't'];
    wide.extend_from_slice(&(keys as u32).to_be_bytes());
    wide.extend_from_slice(&[b'd', 0, 2, b'i', b'd', b'a', 9]);
    for i in 1..keys {
        etf::write_binary(&mut wide, format!("k{i}").as_bytes());
        wide.extend_from_slice(&[b'a', 1]);
    }
    let answer = etf::decode(&f.call_bytes(&session, &wide)).unwrap();
    assert_eq!(answer["id"], 9, "{answer}");
    assert_eq!(answer["error"]["type"], "invalid_parameters");
}

/// A request that names one field twice is refused, whatever the codec: read by another
/// reader it could mean the other request (`serde_json` alone would keep the last one).
#[test]
fn a_field_named_twice_is_refused_in_json_and_in_terms() {
    let f = Fixture::new();
    let json = f.call(r#"{"op":"check","op":"stats","id":3}"#);
    assert_eq!(
        (json["id"].clone(), json["error"]["type"].clone()),
        (json!(3), json!("invalid_parameters"))
    );
    assert_eq!(
        json["error"]["message"],
        "an object names one of its members twice"
    );
    let nested = f.call(&check(r#"{"requests":5,"requests":500}"#, r#","id":4"#));
    assert_eq!(nested["error"]["type"], "invalid_parameters");
    // %{:id => 3, :op => "stats", "op" => "check"}, as term_to_binary writes it.
    let mut frame = vec![131, 116, 0, 0, 0, 3, 119, 2, b'i', b'd', 97, 3];
    frame.extend_from_slice(&[119, 2, b'o', b'p', 109, 0, 0, 0, 5]);
    frame.extend_from_slice(b"stats");
    frame.extend_from_slice(&[109, 0, 0, 0, 2, b'o', b'p', 109, 0, 0, 0, 5]);
    frame.extend_from_slice(b"check");
    let session = f.etf_session();
    let term = etf::decode(&f.call_bytes(&session, &frame)).expect("an answer term");
    assert_eq!(
        (term["id"].clone(), term["error"]["message"].clone()),
        (
            json!(3),
            json!("malformed external term (a map has two keys of one name)")
        )
    );
    assert_eq!(f.stat("invalid"), 3);
}

#[test]
fn only_a_first_frame_that_may_set_up_the_session_is_answered_before_the_next() {
    for frame in [
        &br#"{"op":"hello","codec":"etf","id":0}"#[..],
        br#"{"op":"auth","proof":"00"}"#,
        br#"{"op":"hell\u006f"}"#,
    ] {
        assert!(may_set_up(frame), "{}", String::from_utf8_lossy(frame));
    }
    let check = br#"{"op":"check","key":{"exchange":"x","axis":"a"},"cost":1}"#;
    assert!(!may_set_up(check));
}

/// An unknown field is refused before the fields are read; the error still names the
/// request's exchange when one can be read, as every other error of the request does.
#[test]
fn an_unknown_field_names_the_requests_exchange() {
    let f = Fixture::new();
    let key = r#"{"exchange":"binance","credential":null}"#;
    for (request, exchange) in [
        (
            format!(r#"{{"op":"check","key":{key},"limit":{{"requests":1}},"max_wait":5}}"#),
            json!("binance"),
        ),
        (
            format!(r#"{{"op":"record","key":{key},"cost":1,"x":1}}"#),
            json!("binance"),
        ),
        (
            r#"{"op":"reset_exchange","exchange":"okx","x":1}"#.to_string(),
            json!("okx"),
        ),
        (
            r#"{"op":"pause","target":{"exchange":"okx"},"ms":1,"x":1}"#.to_string(),
            json!("okx"),
        ),
        (
            format!(r#"{{"op":"check_many","checks":[{{"key":{key}}},{{"key":1}}],"x":1}}"#),
            Value::Null,
        ),
        (
            format!(
                r#"{{"op":"check","key":{{"exchange":"{}"}},"x":1}}"#,
                "e".repeat(1025)
            ),
            Value::Null,
        ),
    ] {
        let answer = f.call(&request);
        let message = answer["error"]["message"].as_str().unwrap();
        assert!(message.starts_with("unknown field"), "{message}");
        assert_eq!(answer["error"]["exchange"], exchange, "{request}");
    }
}

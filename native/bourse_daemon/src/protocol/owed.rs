//! Answers of checks and debits that paid, written but not sent yet. A transport settles them right
//! before it sends ([`Service::settle`]): one sent past its check's last moment to run (the
//! daemon was stopped or starved between running the check and sending) could reach a
//! caller who stopped waiting, and who was told `unavailable`. Its payment is taken back
//! and its answer becomes `unavailable`, so that such a caller never pays.
//!
//! One settled in time may still be sent late: the daemon was stopped after settling and
//! before the bytes left. A transport that tells when each answer's last byte went
//! ([`Service::written`], [`Service::sent`]) has such answers kept for a while
//! ([`OVERDUE_KEPT`]), and the client, which alone knows its caller stopped waiting, may
//! ask for one back by its id (`give_back`, [`Service::give_back_overdue`]).

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use bourse_core::{rules, InvalidInput, Receipt};
use serde_json::Value;

use super::answer::{error, To};
use super::{Service, Session};
use crate::store::Store;

/// How long an answer sent past its last moment to run may be asked back.
pub const OVERDUE_KEPT: Duration = Duration::from_secs(10);

/// Such answers are kept per connection for at most this many buckets' payments in all,
/// the oldest dropped first.
pub const MAX_OVERDUE_BUCKETS: usize = 4096;

/// Only answers whose id is a number or a string of at most this many bytes (a number as
/// written) are kept.
pub const MAX_KEPT_ID_BYTES: usize = 256;

/// The answers a session owes, in the order written, and those it sent.
#[derive(Default)]
pub struct Owed(Mutex<Ledger>);

#[derive(Default)]
struct Ledger {
    unsent: Vec<Unsent>,
    /// Settled in time at the last settling, being sent, in the order of their bytes.
    sending: VecDeque<Sending>,
    /// Sent past their last moment to run, by id.
    overdue: VecDeque<Overdue>,
    /// The buckets their receipts name, in all.
    overdue_buckets: usize,
}

struct Overdue {
    id: Value,
    receipt: Receipt,
    kept_until: Instant,
}

/// An answer settled in time, and where its framed bytes end in the transport's buffer.
struct Sending {
    end: usize,
    answer: Unsent,
}

impl Ledger {
    /// Keeps, of the answers whose bytes up to `through` (all: `usize::MAX`) are sent as
    /// of `now`, those past their last moment to run. An id kept twice names neither: the
    /// client could not say which it means.
    fn note_sent(&mut self, through: usize, now: Instant) {
        while self
            .sending
            .front()
            .is_some_and(|sending| sending.end <= through)
        {
            let Some(Sending { answer, .. }) = self.sending.pop_front() else {
                break;
            };
            if let (true, Recipient::Id(Some(id))) = (answer.last_run < now, answer.to) {
                // Ids kept are unique: a twin is dropped, and the answer not kept.
                match self.overdue.iter().position(|kept| kept.id == id) {
                    Some(at) => {
                        if let Some(twin) = self.overdue.remove(at) {
                            self.overdue_buckets -= twin.buckets();
                        }
                    }
                    None if kept_id(&id) => {
                        self.overdue_buckets += answer.receipt.buckets();
                        self.overdue.push_back(Overdue {
                            id,
                            receipt: answer.receipt,
                            kept_until: answer.last_run + OVERDUE_KEPT,
                        });
                    }
                    None => {}
                }
            }
        }
        while self.overdue_buckets > MAX_OVERDUE_BUCKETS
            || self
                .overdue
                .front()
                .is_some_and(|kept| kept.kept_until < now)
        {
            if let Some(dropped) = self.overdue.pop_front() {
                self.overdue_buckets -= dropped.buckets();
            }
        }
    }

    /// Takes out the answer kept under `of` until `now` or later.
    fn take_overdue(&mut self, of: &Value, now: Instant) -> Option<Overdue> {
        let at = self
            .overdue
            .iter()
            .position(|kept| kept.id == *of && kept.kept_until >= now)?;
        let taken = self.overdue.remove(at)?;
        self.overdue_buckets -= taken.buckets();
        Some(taken)
    }
}

impl Overdue {
    fn buckets(&self) -> usize {
        self.receipt.buckets()
    }
}

struct Unsent {
    /// Where it was written in the transport's buffer, before framing.
    bytes: Range<usize>,
    last_run: Instant,
    receipt: Receipt,
    to: Recipient,
}

/// Whom an answer names ([`To`]), kept past the request's frame.
enum Recipient {
    Id(Option<Value>),
    Frame(u64),
}

impl Recipient {
    fn to(&self) -> To<'_> {
        match self {
            Recipient::Id(id) => To::Id(id.as_ref()),
            Recipient::Frame(number) => To::Frame(*number),
        }
    }
}

/// Whether an answer with this id may be kept: ids are held, and compared, whole.
fn kept_id(id: &Value) -> bool {
    match id {
        Value::Number(number) => number.as_str().len() <= MAX_KEPT_ID_BYTES,
        Value::String(text) => text.len() <= MAX_KEPT_ID_BYTES,
        _ => false,
    }
}

impl Owed {
    pub fn note(&self, bytes: Range<usize>, last_run: Instant, receipt: Receipt, to: To) {
        let to = match to {
            To::Id(id) => Recipient::Id(id.cloned()),
            To::Frame(number) => Recipient::Frame(number),
        };
        self.lock().unsent.push(Unsent {
            bytes,
            last_run,
            receipt,
            to,
        });
    }

    fn lock(&self) -> MutexGuard<'_, Ledger> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<S: Store> Service<S> {
    /// Notes that the answers last settled on `session` were sent, as of now: those past
    /// their last moment to run may be asked back ([`Self::give_back_overdue`]).
    pub fn sent(&self, session: &Session) {
        self.written(session, usize::MAX);
    }

    /// Notes that the first `through` bytes of the buffer last settled on `session` were
    /// sent, as of now: the answers they end are noted as [`Self::sent`] notes them. A
    /// transport that writes a buffer in parts says so after each part, so that an answer
    /// whose bytes went in time is not taken for late because those after it went late.
    pub fn written(&self, session: &Session, through: usize) {
        let mut ledger = session.owed.lock();
        if ledger
            .sending
            .front()
            .is_some_and(|sending| sending.end <= through)
        {
            ledger.note_sent(through, Instant::now());
        }
    }

    /// Gives back what the request `of` paid, if its answer was sent on `session` past its
    /// last moment to run, within [`OVERDUE_KEPT`], and not asked back already. Only its
    /// client may ask: the caller stopped waiting before the answer came, and was told
    /// `unavailable`. True if it was given back.
    pub fn give_back_overdue(&self, session: &Session, of: &Value) -> bool {
        let now = Instant::now();
        let receipt = session.owed.lock().take_overdue(of, now);
        receipt.is_some_and(|kept| self.store.give_back(vec![kept.receipt]) == [true])
    }

    /// Settles what `session` owes before `out` (its answers, each framed by `frame` after
    /// it was written) is sent whole: the answers of checks and debits past their last
    /// moment to run are taken back ([`Store::give_back`]) and rewritten as `unavailable`;
    /// one that
    /// cannot be taken back (its buckets moved since otherwise than by payments, debits,
    /// refusals and refunds, or held another booking) stays as true as it was.
    pub fn settle(&self, session: &Session, out: &mut Vec<u8>, frame: impl Fn(&mut Vec<u8>)) {
        let mut guard = session.owed.lock();
        let ledger = &mut *guard;
        if ledger.unsent.is_empty() && ledger.sending.is_empty() {
            return;
        }
        // Those no transport noted as sent are not kept.
        ledger.sending.clear();
        let now = Instant::now();
        // Framing adds as many bytes to every answer: a line's end, or a length before it.
        let mut framing = Vec::new();
        frame(&mut framing);
        let (mut late, mut receipts) = (Vec::new(), Vec::new());
        for answer in ledger.unsent.drain(..) {
            let framed = answer.bytes.start..answer.bytes.end + framing.len();
            if framed.end > out.len() {
                continue;
            }
            match now.checked_duration_since(answer.last_run) {
                Some(late_by) => {
                    late.push((framed, late_by, answer.to));
                    receipts.push(answer.receipt);
                }
                None => ledger.sending.push_back(Sending {
                    end: framed.end,
                    answer,
                }),
            }
        }
        drop(guard);
        if late.is_empty() {
            return;
        }
        let given = self.store.give_back(receipts);
        // Each rewritten answer moves the bytes after it by the change in its length.
        let mut moves = Vec::new();
        // Last first, so that the bytes of those before stay where they were written.
        for ((framed, late_by, to), _) in late.into_iter().zip(given).rev().filter(|(_, g)| *g) {
            let mut rewritten = Vec::new();
            let message = InvalidInput::new(rules::answered_too_late(late_by.as_micros() as u64));
            error(
                &mut rewritten,
                session.codec(),
                to.to(),
                "unavailable",
                &message,
            );
            frame(&mut rewritten);
            moves.push((framed.end, rewritten.len() as isize - framed.len() as isize));
            out.splice(framed, rewritten);
        }
        if moves.is_empty() {
            return;
        }
        // Both in the order of their bytes: each answer moves by those rewritten before it.
        moves.reverse();
        let (mut moves, mut moved) = (moves.into_iter().peekable(), 0isize);
        let mut ledger = session.owed.lock();
        for sending in &mut ledger.sending {
            while let Some((_, by)) = moves.next_if(|(end, _)| *end <= sending.end) {
                moved += by;
            }
            sending.end = sending.end.saturating_add_signed(moved);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context, Waker};
    use std::time::Duration;

    use bourse_core::{Config, Table};
    use serde_json::{json, Value};

    use super::super::{etf, Codec, Service, Session};
    use crate::store::Memory;

    /// A transport's buffer: answers written and framed, not sent yet.
    struct Batch<'s> {
        service: &'s Service<Memory>,
        session: Session,
        out: Vec<u8>,
        /// Each answer after its length (a term), or ended by a newline (JSON).
        prefixed: bool,
        /// Where each answer last settled ended in `out`.
        ends: Vec<usize>,
    }

    impl<'s> Batch<'s> {
        fn new(service: &'s Service<Memory>, etf: bool) -> Self {
            let session = service.session(false, None);
            let mut batch = Self {
                service,
                session,
                out: Vec::new(),
                prefixed: etf,
                ends: Vec::new(),
            };
            if etf {
                batch.write(&json!({"op": "hello", "codec": "etf"}));
                assert_eq!(batch.session.codec(), Codec::Etf);
                batch.out.clear();
            }
            batch
        }

        fn frame(&self, answer: &mut Vec<u8>, start: usize) {
            match self.prefixed {
                true => {
                    let length = (answer.len() - start) as u32;
                    answer.splice(start..start, length.to_be_bytes());
                }
                false => answer.push(b'\n'),
            }
        }

        fn write(&mut self, request: &Value) {
            let frame = match (self.session.codec(), request) {
                (Codec::Etf, Value::Object(fields)) => {
                    let mut frame = Vec::new();
                    etf::encode_map(&mut frame, 0, |_| {}, fields);
                    frame
                }
                _ => request.to_string().into_bytes(),
            };
            let mut out = std::mem::take(&mut self.out);
            let start = out.len();
            let number = self.session.next_frame();
            {
                let handled = pin!(self.service.handle(&self.session, number, &frame, &mut out));
                let polled = handled.poll(&mut Context::from_waker(Waker::noop()));
                assert!(polled.is_ready(), "the in-memory store made a request wait");
            }
            self.frame(&mut out, start);
            self.out = out;
        }

        /// Settles the batch, reads its answers back, and sends them at once.
        fn settle(&mut self) -> Vec<Value> {
            let answers = self.settle_unsent();
            self.service.sent(&self.session);
            answers
        }

        /// Settles the batch and reads its answers back, then sends them only once every
        /// check written with a last moment to run 300 ms from `now` passed it (the daemon
        /// was stopped between settling and sending).
        fn settle_then_send_late(&mut self, now: u64) -> Vec<Value> {
            let answers = self.settle_unsent();
            held_past(now, self.service);
            self.service.sent(&self.session);
            answers
        }

        /// Settles the batch and reads its answers back; they are sent later ([`Service::sent`]).
        fn settle_unsent(&mut self) -> Vec<Value> {
            let prefixed = self.prefixed;
            let frame = |answer: &mut Vec<u8>| match prefixed {
                true => {
                    let length = answer.len() as u32;
                    answer.splice(0..0, length.to_be_bytes());
                }
                false => answer.push(b'\n'),
            };
            self.service.settle(&self.session, &mut self.out, frame);
            let mut answers = Vec::new();
            self.ends.clear();
            let mut rest = &self.out[..];
            while !rest.is_empty() {
                let (answer, next) = match prefixed {
                    true => {
                        let length = u32::from_be_bytes(rest[..4].try_into().unwrap()) as usize;
                        let answer = etf::decode(&rest[4..4 + length]).unwrap();
                        (answer, &rest[4 + length..])
                    }
                    false => {
                        let end = rest.iter().position(|&b| b == b'\n').unwrap();
                        (
                            serde_json::from_slice(&rest[..end]).unwrap(),
                            &rest[end + 1..],
                        )
                    }
                };
                answers.push(answer);
                rest = next;
                self.ends.push(self.out.len() - rest.len());
            }
            self.out.clear();
            answers
        }
    }

    fn clock_us(service: &Service<Memory>) -> u64 {
        let mut batch = Batch::new(service, false);
        batch.write(&json!({"op": "hello"}));
        batch.settle()[0]["clock_us"].as_u64().unwrap()
    }

    /// A check of one token of `axis`, whose last moment to run is `last_run_us`.
    fn check(id: u64, axis: &str, last_run_us: u64) -> Value {
        json!({
            "op": "check", "id": id,
            "key": {"exchange": "binance", "credential": "k1", "axis": axis},
            "limit": {"capacity": 5, "refill_per_sec": 0.0001},
            "deadline_us": last_run_us + 250_000, "timeout_ms": 1000,
        })
    }

    fn without_deadline(mut request: Value) -> Value {
        let fields = request.as_object_mut().unwrap();
        fields.remove("deadline_us");
        fields.remove("timeout_ms");
        request
    }

    fn borrowed(service: &Service<Memory>, axis: &str) -> f64 {
        let mut batch = Batch::new(service, false);
        let key = json!({"exchange": "binance", "credential": "k1", "axis": axis});
        batch.write(&json!({"op": "get_cost", "key": key}));
        batch.settle()[0]["borrowed"].as_f64().unwrap()
    }

    fn service() -> Service<Memory> {
        Service::new(Memory::new(Table::new(Config::default())), 65_536, None)
    }

    /// Lets every check written with a last moment to run 300 ms from `now` pass it.
    fn held_past(now: u64, service: &Service<Memory>) {
        std::thread::sleep(Duration::from_millis(400));
        assert!(clock_us(service) > now + 300_000);
    }

    #[test]
    fn answers_sent_past_their_last_moment_are_given_back_and_unavailable() {
        for etf in [false, true] {
            let service = service();
            let now = clock_us(&service);
            let mut batch = Batch::new(&service, etf);
            batch.write(&check(1, "late", now + 300_000));
            batch.write(&check(2, "in_time", now + 60_000_000));
            batch.write(&check(3, "late", now + 300_000));
            held_past(now, &service);
            let answers = batch.settle();
            assert_eq!(answers.len(), 3);
            for (answer, id) in [(&answers[0], 1), (&answers[2], 3)] {
                assert_eq!(
                    (&answer["ok"], &answer["error"]["type"], &answer["id"]),
                    (&json!(false), &json!("unavailable"), &json!(id)),
                    "{answer}"
                );
                let message = answer["error"]["message"].as_str().unwrap();
                assert!(message.contains("what it paid was given back"), "{message}");
            }
            assert_eq!(
                (&answers[1]["result"], &answers[1]["id"]),
                (&json!("admitted"), &json!(2))
            );
            assert_eq!(borrowed(&service, "late"), 0.0);
            assert!((borrowed(&service, "in_time") - 1.0).abs() < 1e-3);
        }
    }

    /// A sync of `axis` to an allowance of `allowance`, with no deadline.
    fn sync(axis: &str, allowance: f64) -> Value {
        let key = json!({"exchange": "binance", "credential": "k1", "axis": axis});
        json!({"op": "sync", "key": key, "allowance": allowance, "window_left_ms": 0})
    }

    #[test]
    fn a_late_answer_is_given_back_past_a_later_payment() {
        let service = service();
        let now = clock_us(&service);
        let mut batch = Batch::new(&service, false);
        // The key's definition, given before: a check that gave it is given back only whole.
        batch.write(&without_deadline(check(1, "a", 0)));
        batch.write(&check(2, "a", now + 300_000));
        // Its caller's retry, paid after it with no deadline: nothing to settle.
        batch.write(&without_deadline(check(3, "a", 0)));
        held_past(now, &service);
        let answers = batch.settle();
        assert_eq!(answers[1]["error"]["type"], "unavailable", "{}", answers[1]);
        assert_eq!(answers[2]["result"], "admitted", "{}", answers[2]);
        assert!((borrowed(&service, "a") - 2.0).abs() < 1e-3);
    }

    #[test]
    fn a_late_debit_is_given_back_and_unavailable() {
        let service = service();
        let now = clock_us(&service);
        let mut batch = Batch::new(&service, false);
        batch.write(&without_deadline(check(1, "a", 0)));
        let mut record = check(2, "a", now + 300_000);
        let fields = record.as_object_mut().unwrap();
        fields.remove("limit");
        fields.insert("op".into(), json!("record"));
        fields.insert("cost".into(), json!(2));
        batch.write(&record);
        held_past(now, &service);
        let answers = batch.settle();
        assert_eq!(answers[1]["error"]["type"], "unavailable", "{}", answers[1]);
        assert!((borrowed(&service, "a") - 1.0).abs() < 1e-3);
    }

    #[test]
    fn a_late_answer_whose_bucket_was_synced_since_stays_as_it_was() {
        let service = service();
        let now = clock_us(&service);
        let mut batch = Batch::new(&service, false);
        batch.write(&check(1, "a", now + 300_000));
        batch.write(&sync("a", 4.5));
        held_past(now, &service);
        let answers = batch.settle();
        assert_eq!(answers[0]["result"], "admitted", "{}", answers[0]);
        assert!((borrowed(&service, "a") - 1.0).abs() < 1e-3);
    }

    #[test]
    fn a_late_check_of_several_buckets_is_given_back_on_all_or_stays_as_it_was() {
        let service = service();
        let now = clock_us(&service);
        let many = |id: u64, axes: [&str; 2]| {
            let mut many = check(id, axes[0], now + 300_000);
            let checks: Vec<Value> = axes
                .iter()
                .map(|axis| {
                    let mut one = without_deadline(check(id, axis, 0));
                    let fields = one.as_object_mut().unwrap();
                    fields.remove("op");
                    fields.remove("id");
                    one
                })
                .collect();
            let fields = many.as_object_mut().unwrap();
            fields.remove("key");
            fields.remove("limit");
            fields.insert("op".into(), json!("check_many"));
            fields.insert("checks".into(), json!(checks));
            many
        };
        let mut batch = Batch::new(&service, false);
        batch.write(&many(1, ["a", "b"]));
        batch.write(&many(2, ["c", "d"]));
        // `d` synced after it.
        batch.write(&sync("d", 4.5));
        held_past(now, &service);
        let answers = batch.settle();
        assert_eq!(answers[0]["error"]["type"], "unavailable", "{}", answers[0]);
        assert_eq!(answers[1]["result"], "admitted", "{}", answers[1]);
        for (axis, paid) in [("a", 0.0), ("b", 0.0), ("c", 1.0), ("d", 1.0)] {
            assert!((borrowed(&service, axis) - paid).abs() < 1e-3, "{axis}");
        }
    }

    /// The answer to a `give_back` of request `of`, sent on `batch`'s session.
    fn asked_back(batch: &mut Batch, of: u64) -> Value {
        batch.write(&json!({"op": "give_back", "id": 9, "of": of}));
        batch.settle().remove(0)
    }

    #[test]
    fn an_answer_sent_past_its_last_moment_is_given_back_once_when_its_client_asks() {
        for etf in [false, true] {
            let service = service();
            let now = clock_us(&service);
            let mut batch = Batch::new(&service, etf);
            batch.write(&check(1, "a", now + 300_000));
            batch.write(&check(2, "b", now + 60_000_000));
            // Stopped after settling, before the bytes left: sent past the last moment.
            let answers = batch.settle_then_send_late(now);
            assert_eq!(answers[0]["result"], "admitted");
            assert_eq!(answers[1]["result"], "admitted");
            for (of, given) in [(1, true), (1, false), (2, false), (77, false)] {
                let answer = asked_back(&mut batch, of);
                assert_eq!(answer["given_back"], json!(given), "{of}: {answer}");
                assert_eq!(answer["id"], json!(9));
            }
            assert_eq!(borrowed(&service, "a"), 0.0);
            assert!((borrowed(&service, "b") - 1.0).abs() < 1e-3);
        }
    }

    #[test]
    fn an_answer_asked_back_before_its_last_moment_went_out_in_time_and_stays_paid() {
        let service = service();
        let now = clock_us(&service);
        let mut batch = Batch::new(&service, false);
        batch.write(&check(1, "a", now + 300_000));
        batch.settle();
        assert_eq!(asked_back(&mut batch, 1)["given_back"], json!(false));
        held_past(now, &service);
        assert_eq!(asked_back(&mut batch, 1)["given_back"], json!(false));
        assert!((borrowed(&service, "a") - 1.0).abs() < 1e-3);
    }

    #[test]
    fn an_answer_sent_in_time_and_asked_back_past_its_last_moment_stays_paid() {
        let service = service();
        let now = clock_us(&service);
        let mut batch = Batch::new(&service, false);
        batch.write(&check(1, "a", now + 300_000));
        batch.settle();
        // The connection idle past the last moment: the answer had left in time.
        held_past(now, &service);
        assert_eq!(asked_back(&mut batch, 1)["given_back"], json!(false));
        assert!((borrowed(&service, "a") - 1.0).abs() < 1e-3);
    }

    #[test]
    fn an_answer_whose_bytes_went_in_time_stays_paid_though_those_after_it_went_late() {
        for etf in [false, true] {
            let service = service();
            let first = clock_us(&service);
            let mut batch = Batch::new(&service, etf);
            // Rewritten as unavailable, longer: the answers after it move.
            batch.write(&check(0, "rewritten", first + 300_000));
            held_past(first, &service);
            let now = clock_us(&service);
            batch.write(&check(1, "in_time", now + 300_000));
            batch.write(&check(2, "late", now + 300_000));
            let answers = batch.settle_unsent();
            assert_eq!(answers[0]["error"]["type"], json!("unavailable"));
            // The first two went at once, the last once the daemon was resumed.
            service.written(&batch.session, batch.ends[1]);
            held_past(now, &service);
            service.sent(&batch.session);
            assert_eq!(asked_back(&mut batch, 1)["given_back"], json!(false));
            assert_eq!(asked_back(&mut batch, 2)["given_back"], json!(true));
            assert!((borrowed(&service, "in_time") - 1.0).abs() < 1e-3);
            assert!(borrowed(&service, "late").abs() < 1e-3);
        }
    }

    #[test]
    fn a_late_answer_is_kept_only_under_a_short_number_or_string() {
        let service = service();
        let now = clock_us(&service);
        let mut batch = Batch::new(&service, false);
        let long = "i".repeat(super::MAX_KEPT_ID_BYTES + 1);
        let short = "i".repeat(super::MAX_KEPT_ID_BYTES);
        let number = |digits| serde_json::from_str::<Value>(&"7".repeat(digits)).unwrap();
        let long_number = number(super::MAX_KEPT_ID_BYTES + 1);
        let short_number = number(super::MAX_KEPT_ID_BYTES);
        let ids = [
            json!(long),
            json!([1]),
            long_number.clone(),
            json!(short),
            short_number.clone(),
        ];
        for (n, id) in ids.into_iter().enumerate() {
            let mut request = check(0, &format!("k{n}"), now + 300_000);
            request["id"] = id;
            batch.write(&request);
        }
        batch.settle_then_send_late(now);
        for (id, given) in [
            (json!(long), false),
            (json!([1]), false),
            (long_number, false),
            (json!(short), true),
            (short_number, true),
        ] {
            batch.write(&json!({"op": "give_back", "id": 9, "of": id}));
            assert_eq!(batch.settle()[0]["given_back"], json!(given));
        }
    }

    #[test]
    fn an_id_kept_twice_names_neither_answer() {
        let service = service();
        let now = clock_us(&service);
        let mut batch = Batch::new(&service, false);
        batch.write(&check(1, "a", now + 300_000));
        batch.write(&check(1, "b", now + 300_000));
        batch.settle_then_send_late(now);
        assert_eq!(asked_back(&mut batch, 1)["given_back"], json!(false));
        assert!((borrowed(&service, "a") - 1.0).abs() < 1e-3);
        assert!((borrowed(&service, "b") - 1.0).abs() < 1e-3);
    }

    #[test]
    fn the_oldest_late_answers_go_past_the_buckets_a_connection_keeps() {
        let service = service();
        let now = clock_us(&service);
        let mut batch = Batch::new(&service, true);
        let last = super::MAX_OVERDUE_BUCKETS as u64 + 1;
        for id in 1..=last {
            batch.write(&check(id, &format!("k{id}"), now + 300_000));
        }
        batch.settle_then_send_late(now);
        assert_eq!(asked_back(&mut batch, 1)["given_back"], json!(false));
        assert_eq!(asked_back(&mut batch, 2)["given_back"], json!(true));
        assert_eq!(asked_back(&mut batch, last)["given_back"], json!(true));
    }

    #[test]
    fn answers_sent_in_time_stay_paid() {
        let service = service();
        let now = clock_us(&service);
        let mut batch = Batch::new(&service, false);
        batch.write(&check(1, "a", now + 60_000_000));
        let answers = batch.settle();
        assert_eq!(answers[0]["result"], "admitted");
        assert!((borrowed(&service, "a") - 1.0).abs() < 1e-3);
    }
}

//! The fast reader against the general one: every frame, a check request as the Elixir
//! client writes it, a few hundred variations of it (each field missing, twice, of another
//! type or out of the rules' bounds, atoms in each of their four forms) and thousands of
//! random mutations of its bytes, gets the same answer bytes whether [`Service::handle`]
//! may read it here or only the general reader does, from two tables on manual clocks fed
//! the same frames.

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use bourse_core::{Config, ManualClock, Table};

use serde_json::Value;

use super::read;
use crate::protocol::request::{self, Request};
use crate::protocol::{etf, Codec, Service, Session};
use crate::store::Memory;

/// A term, written as OTP writes it.
#[derive(Clone)]
enum Term {
    /// An atom, with the tag it is written with.
    Atom(u8, &'static str),
    Binary(Vec<u8>),
    Integer(i128),
    Float(f64),
    Map(Vec<(Term, Term)>),
}

use Term::{Atom, Binary, Float, Integer, Map};

/// ATOM_EXT, as OTP 25 writes every atom by default.
const ATOM: u8 = 100;
const ATOM_TAGS: [u8; 4] = [100, 115, 118, 119];

fn atom(name: &'static str) -> Term {
    Atom(ATOM, name)
}

fn text(text: &str) -> Term {
    Binary(text.as_bytes().to_vec())
}

fn write(term: &Term, out: &mut Vec<u8>) {
    match term {
        Atom(tag, name) => {
            out.push(*tag);
            if matches!(tag, 100 | 118) {
                out.extend_from_slice(&(name.len() as u16).to_be_bytes());
            } else {
                out.push(name.len() as u8);
            }
            out.extend_from_slice(name.as_bytes());
        }
        Binary(bytes) => {
            out.push(b'm');
            out.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
            out.extend_from_slice(bytes);
        }
        Integer(n) => crate::protocol::etf::write_integer(out, *n),
        Float(f) => {
            out.push(b'F');
            out.extend_from_slice(&f.to_be_bytes());
        }
        Map(entries) => {
            out.push(b't');
            out.extend_from_slice(&(entries.len() as u32).to_be_bytes());
            for (key, value) in entries {
                write(key, out);
                write(value, out);
            }
        }
    }
}

fn frame(term: &Term) -> Vec<u8> {
    let mut out = vec![131];
    write(term, &mut out);
    out
}

/// The top-level fields of a check as `Bourse.RateLimiter` writes them.
fn fields() -> Vec<(Term, Term)> {
    vec![
        (atom("op"), text("check")),
        (
            atom("key"),
            Map(vec![
                (atom("exchange"), text("binance")),
                (atom("credential"), text("k1")),
            ]),
        ),
        (
            atom("limit"),
            Map(vec![
                (text("capacity"), Float(3.0)),
                (text("refill_per_sec"), Float(0.5)),
            ]),
        ),
        (atom("cost"), Integer(1)),
        (atom("owner"), text("<0.123.0>")),
        (atom("id"), Integer(7)),
        (atom("deadline_us"), Integer(1 << 60)),
        (atom("timeout_ms"), Integer(5_000)),
    ]
}

/// A value of every kind a field may be sent as, in and out of the rules' bounds.
fn values() -> Vec<Term> {
    let mut values = vec![
        Integer(0),
        Integer(1),
        Integer(-1),
        Integer(255),
        Integer(70_000),
        Integer(1 << 40),
        Integer(-(1 << 40)),
        Integer(i64::MAX.into()),
        Integer(i128::from(i64::MAX) + 1),
        Integer(i64::MIN.into()),
        Integer(1 << 70),
        Float(0.0),
        Float(-0.0),
        Float(0.001),
        Float(2.5),
        Float(1.0e12),
        Float(1.0e300),
        Float(-3.5),
        text(""),
        text("ip"),
        text("k2"),
        text(&"é".repeat(512)),
        text(&"x".repeat(1025)),
        Binary(vec![0xff, 0xfe]),
        atom("nil"),
        atom("true"),
        atom("public"),
        Map(vec![]),
        Map(vec![(text("capacity"), Integer(5))]),
        Map(vec![
            (text("requests"), Integer(10)),
            (text("period"), Integer(1000)),
        ]),
        Map(vec![
            (atom("capacity"), Integer(5)),
            (atom("refill_per_sec"), Integer(1)),
        ]),
        Map(vec![
            (atom("exchange"), text("okx")),
            (atom("credential"), atom("nil")),
            (atom("axis"), text("order")),
        ]),
    ];
    for (capacity, refill) in [(10, 1), (0, 1), (-1, 1), (1, 0), (5, -2)] {
        values.push(Map(vec![
            (text("capacity"), Integer(capacity)),
            (text("refill_per_sec"), Integer(refill)),
        ]));
    }
    values
}

/// The request with `replace` done to its fields.
fn with(replace: impl FnOnce(&mut Vec<(Term, Term)>)) -> Term {
    let mut fields = fields();
    replace(&mut fields);
    Map(fields)
}

fn variations() -> Vec<Term> {
    let mut terms = vec![Map(fields())];
    let count = fields().len();
    for at in 0..count {
        terms.push(with(|fields| drop(fields.remove(at))));
        terms.push(with(|fields| fields.push(fields[at].clone())));
        for value in values() {
            terms.push(with(|fields| fields[at].1 = value));
        }
        for tag in ATOM_TAGS {
            terms.push(with(|fields| {
                if let Atom(_, name) = fields[at].0 {
                    fields[at].0 = Atom(tag, name);
                }
            }));
        }
    }
    // Each key part given each value, beside an axis.
    for part in 0..2 {
        for value in values() {
            terms.push(with(|fields| {
                if let Map(key) = &mut fields[1].1 {
                    key[part].1 = value;
                    key.push((atom("axis"), text("ip")));
                }
            }));
        }
    }
    terms.push(with(|fields| {
        fields.push((atom("max_wait_ms"), Integer(250)))
    }));
    terms.push(with(|fields| {
        fields.push((atom("max_wait_ms"), Integer(-1)))
    }));
    for slack in [Integer(0), Integer(5_000), Integer(86_400_001), Float(1.5)] {
        terms.push(with(|fields| {
            fields.push((atom("max_wait_ms"), Integer(250)));
            fields.push((atom("booking_slack_ms"), slack.clone()));
        }));
        terms.push(with(|fields| {
            fields.push((atom("booking_slack_ms"), slack.clone()))
        }));
    }
    terms.push(with(|fields| fields.push((atom("unknown"), Integer(1)))));
    terms.push(with(|fields| fields.push((text("cost"), Integer(2)))));
    terms
}

struct Side {
    service: Service<Memory<ManualClock>>,
    session: Session,
}

impl Side {
    fn new() -> Self {
        let table = Table::with_clock(Config::default(), ManualClock::new());
        let service = Service::new(Memory::new(table), 65_536, None);
        let session = service.session(false, None);
        let side = Self { service, session };
        side.answer(br#"{"op":"hello","codec":"etf","id":0}"#, false);
        assert_eq!(side.session.codec(), Codec::Etf);
        side
    }

    /// The answer to `frame` through `handle` (`fast`), or through the general reader.
    fn answer(&self, frame: &[u8], fast: bool) -> Vec<u8> {
        let mut out = Vec::new();
        let number = self.session.next_frame();
        let mut context = Context::from_waker(Waker::noop());
        let polled = if fast {
            pin!(self.service.handle(&self.session, number, frame, &mut out)).poll(&mut context)
        } else {
            pin!(self
                .service
                .read_and_run(&self.session, number, frame, &mut out))
            .poll(&mut context)
        };
        assert_eq!(
            polled,
            Poll::Ready(()),
            "the in-memory store made a request wait"
        );
        out
    }
}

/// `frame` is read alike either way, and its answers from `fast` (through `handle`) and
/// `general` (the general reader alone) are the same bytes; or, for a request past its deadline, the same answer but for
/// how late each side found it (real time, the one thing the manual clocks do not hold).
fn assert_same(fast: &Side, general: &Side, frame: &[u8]) {
    assert_read_alike(frame);
    let (a, b) = (fast.answer(frame, true), general.answer(frame, false));
    if a != b {
        assert_eq!(on_time(&a), on_time(&b), "frame {frame:?}");
    }
}

/// A frame read here is read alike by the general reader: the same id, last moment to run
/// (to the µs), owner, mode, key, and cost and limit to the bit. (The answers alone could
/// not tell a different owner or cost when the outcome is the same.)
fn assert_read_alike(frame: &[u8]) {
    let Some(fast) = read(frame) else {
        return;
    };
    let Ok(Value::Object(fields)) = etf::decode(frame) else {
        panic!("read here, not by the general reader: {frame:?}");
    };
    let general = Request::parse(&fields).expect("the general reader refused it");
    assert_eq!(Some(&Value::from(fast.id)), fields.get("id"), "{frame:?}");
    assert_eq!(
        Ok(fast.last_run_us),
        request::last_run_us(&fields),
        "{frame:?}"
    );
    let (
        Request::Check {
            checks: a,
            owner: owner_a,
            mode: mode_a,
        },
        Request::Check {
            checks: b,
            owner: owner_b,
            mode: mode_b,
        },
    ) = (fast.request, general)
    else {
        panic!("not both checks: {frame:?}");
    };
    assert_eq!((owner_a, mode_a), (owner_b, mode_b), "{frame:?}");
    assert_eq!(format!("{a:?}"), format!("{b:?}"), "{frame:?}");
    let bits = |checks: &[bourse_core::Check]| {
        checks
            .iter()
            .map(|check| {
                let limit = &check.limit;
                let numbers = [check.cost, limit.capacity(), limit.refill_per_sec()];
                numbers.map(f64::to_bits)
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(bits(&a), bits(&b), "{frame:?}");
}

fn on_time(answer: &[u8]) -> Value {
    let mut answer = etf::decode(answer).expect("answers are terms");
    if let Some(Value::String(message)) = answer.pointer_mut("/error/message") {
        if let Some((_, after)) = message.split_once(" ms after the last moment") {
            *message = format!("late{after}");
        }
    }
    answer
}

#[test]
fn every_frame_gets_the_answer_the_general_reader_gives() {
    let (fast, general) = (Side::new(), Side::new());
    let mut read_here = 0;
    for term in variations() {
        let mut frame = frame(&term);
        for _ in 0..2 {
            read_here += usize::from(read(&frame).is_some());
            assert_same(&fast, &general, &frame);
        }
        // The same frame with a byte too many, then cut short.
        frame.push(0);
        assert_same(&fast, &general, &frame);
        frame.truncate(frame.len() - 2);
        assert_same(&fast, &general, &frame);
    }
    assert!(read_here > 100, "only {read_here} frames were read here");
}

#[test]
fn the_elixir_clients_check_is_read_here() {
    let common = frame(&Map(fields()));
    let check = read(&common).expect("read here");
    assert_eq!(check.id, 7);
    assert!(check.last_run_us.is_some());
    let without_deadline = with(|fields| fields.truncate(6));
    assert!(read(&frame(&without_deadline)).is_some_and(|check| check.last_run_us.is_none()));
}

#[test]
fn random_mutations_get_the_answer_the_general_reader_gives() {
    let (fast, general) = (Side::new(), Side::new());
    let common = frame(&Map(fields()));
    // xorshift64*: reproducible without a dependency.
    let mut seed: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = |below: usize| {
        seed ^= seed >> 12;
        seed ^= seed << 25;
        seed ^= seed >> 27;
        (seed.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % below
    };
    let mut read_here = 0;
    for _ in 0..20_000 {
        let mut frame = common.clone();
        for _ in 0..=next(3) {
            let at = next(frame.len());
            frame[at] = match next(4) {
                0 => 0,
                1 => 0xff,
                2 => frame[at] ^ (1 << next(8)),
                _ => next(256) as u8,
            };
        }
        read_here += usize::from(read(&frame).is_some());
        assert_same(&fast, &general, &frame);
    }
    assert!(
        read_here > 1_000,
        "only {read_here} mutations were read here"
    );
}

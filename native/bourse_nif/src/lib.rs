//! Rustler glue between `Bourse.Native` and `bourse_core`: term decoding, the table
//! resource and answers. Malformed input becomes `{:error, message}`; nothing here sleeps,
//! and table-wide work runs on dirty schedulers.

use bourse_core::{
    check_cost, Check, Config, InvalidInput, Key, KeyInfo, KeyRef, Limit, Mode, Outcome,
    PauseTarget, Stats, Table,
};
use rustler::{Atom, Binary, Encoder, Env, LocalPid, NewBinary, ResourceArc, Term, TermType};

mod atoms {
    rustler::atoms! {
        ok, error, delay, booked, over_budget, public, nil,
        capacity, refill_per_sec, requests, period,
        admitted, claimed, delayed, lapsed, paused, debited, invalid, buckets, bookings,
        limit, tokens, borrowed, debt, booked_cost, next_ready_ms, pause_ms,
    }
}

/// Longest accepted exchange id, credential or axis, in bytes.
const MAX_KEY_PART: usize = 1024;
/// Most checks accepted in one `check_many`.
const MAX_CHECKS: usize = 1024;

pub struct TableResource(Table);

#[rustler::resource_impl]
impl rustler::Resource for TableResource {}

// The table's locks never poison: a panic (caught by rustler) leaves it usable.
impl std::panic::RefUnwindSafe for TableResource {}

type Decoded<T> = Result<T, InvalidInput>;

/// The elements of an `N`-tuple, without allocating; `None` for anything else.
fn tuple<const N: usize>(term: Term) -> Option<[Term; N]> {
    let env = term.get_env();
    // SAFETY: enif_get_tuple only reads `term`; the element array it returns lives on the
    // process heap as long as `term` does, and the elements are copied out at once.
    let elements = unsafe { rustler::wrapper::tuple::get_tuple(env.as_c_arg(), term.as_c_arg()) };
    let elements = elements.ok().filter(|elements| elements.len() == N)?;
    Some(std::array::from_fn(|i| unsafe {
        Term::new(env, elements[i])
    }))
}

fn is_atom(term: Term, atom: Atom) -> bool {
    // Atoms are immediate terms: equal atoms are equal words, no call into the VM needed.
    term.as_c_arg() == atom.as_c_arg()
}

fn invalid<T>(message: impl Into<String>) -> Decoded<T> {
    Err(InvalidInput::new(message))
}

/// What kind of term `term` is, without its contents: for messages about terms that may
/// hold an API key (a credential, or a whole key or check), which must never be echoed.
fn shape(term: Term) -> String {
    match term.get_type() {
        TermType::Tuple => match rustler::types::tuple::get_tuple(term) {
            Ok(elements) => format!("a tuple of {} elements", elements.len()),
            Err(_) => "a tuple".into(),
        },
        TermType::List => match term.list_length() {
            Ok(length) => format!("a list of {length} elements"),
            Err(_) => "an improper list".into(),
        },
        TermType::Binary => "a binary".into(),
        TermType::Atom => "an atom".into(),
        TermType::Integer | TermType::Float => "a number".into(),
        TermType::Map => "a map".into(),
        TermType::Fun => "a function".into(),
        TermType::Pid => "a pid".into(),
        TermType::Port => "a port".into(),
        TermType::Ref => "a reference".into(),
        TermType::Unknown => "an unknown term".into(),
    }
}

/// A binary of at most `MAX_KEY_PART` bytes; `shown` says what was given instead.
fn bounded_binary<'a>(
    term: Term<'a>,
    what: &str,
    shown: impl FnOnce() -> String,
) -> Decoded<&'a [u8]> {
    match term.decode::<Binary>() {
        Ok(binary) if binary.len() <= MAX_KEY_PART => Ok(binary.as_slice()),
        Ok(_) => invalid(format!("{what} is longer than {MAX_KEY_PART} bytes")),
        Err(_) => invalid(format!("{what} must be a binary, got {}", shown())),
    }
}

fn key_part<'a>(term: Term<'a>, what: &str) -> Decoded<&'a [u8]> {
    bounded_binary(term, what, || format!("{term:?}"))
}

fn credential<'a>(term: Term<'a>) -> Decoded<Option<&'a [u8]>> {
    if is_atom(term, atoms::public()) {
        Ok(None)
    } else {
        bounded_binary(term, "credential_key (a binary or :public)", || shape(term)).map(Some)
    }
}

/// `{exchange_id, credential_key, bucket_axis}`, or `{exchange_id, credential_key}` for
/// the `"request"` axis.
fn key(term: Term) -> Decoded<KeyRef> {
    if let Some([exchange, cred, axis]) = tuple(term) {
        Ok(KeyRef::new(
            key_part(exchange, "exchange_id")?,
            credential(cred)?,
            key_part(axis, "bucket_axis")?,
        ))
    } else if let Some([exchange, cred]) = tuple(term) {
        Ok(KeyRef::new(
            key_part(exchange, "exchange_id")?,
            credential(cred)?,
            b"request",
        ))
    } else {
        invalid(format!(
            "key must be {{exchange_id, credential_key, bucket_axis}} or {{exchange_id, credential_key}}, got {}",
            shape(term)
        ))
    }
}

fn number(term: Term, what: &str) -> Decoded<f64> {
    term.decode::<f64>()
        .map_err(|_| InvalidInput::new(format!("{what} must be a number, got {term:?}")))
}

fn cost(term: Term) -> Decoded<f64> {
    check_cost(number(term, "cost")?)
}

/// A limit map, or `None` for `nil` (no limit).
fn limit(term: Term) -> Decoded<Option<Limit>> {
    if is_atom(term, atoms::nil()) {
        return Ok(None);
    }
    let shape_error = || {
        InvalidInput::new(format!(
            "limit must be %{{capacity: c, refill_per_sec: r}}, %{{requests: n, period: ms}}, %{{requests: n}} or nil, got {term:?}"
        ))
    };
    let size = term.map_size().map_err(|_| shape_error())?;
    let field = |name: Atom| term.map_get(name).ok();
    let parsed = if let Some(capacity) = field(atoms::capacity()) {
        let refill = field(atoms::refill_per_sec()).filter(|_| size == 2);
        let refill = refill.ok_or_else(shape_error)?;
        Limit::new(
            number(capacity, "capacity")?,
            number(refill, "refill_per_sec")?,
        )
    } else if let Some(requests) = field(atoms::requests()) {
        let requests = number(requests, "requests")?;
        match (size, field(atoms::period())) {
            (1, None) => Limit::per_period(requests, 1000.0),
            (2, Some(period)) => Limit::per_period(requests, number(period, "period")?),
            _ => return Err(shape_error()),
        }
    } else {
        return Err(shape_error());
    };
    parsed.map(Some)
}

fn max_wait(term: Term) -> Decoded<Mode> {
    if is_atom(term, atoms::nil()) {
        return Ok(Mode::Probe);
    }
    match term.decode::<i64>() {
        Ok(ms) if ms > 0 => Ok(Mode::Wait {
            max_wait_ms: ms as u64,
        }),
        _ => invalid(format!(
            "max_wait_ms must be a positive integer, got {term:?}"
        )),
    }
}

/// A booking owner: the pid itself for a local process, a 64-bit hash for anything else.
fn owner(term: Term) -> u64 {
    match term.decode::<LocalPid>() {
        // A local pid is an immediate term: its value names the process while it lives.
        Ok(_) => term.as_c_arg() as u64,
        Err(_) => {
            (u64::from(term.hash_internal(0x9e37_79b9)) << 32) | u64::from(term.hash_internal(7))
        }
    }
}

fn error<'a>(env: Env<'a>, table: &Table, err: InvalidInput) -> Term<'a> {
    table.count_invalid();
    (atoms::error(), err.0).encode(env)
}

fn outcome(env: Env, outcome: Outcome) -> Term {
    match outcome {
        Outcome::Admitted | Outcome::Claimed => atoms::ok().encode(env),
        Outcome::Delay(ms) => (atoms::delay(), ms).encode(env),
        Outcome::Booked(ms) => (atoms::booked(), ms).encode(env),
        Outcome::OverBudget(ms) => (atoms::over_budget(), ms).encode(env),
    }
}

/// Answers `run`'s result, or counts and reports the malformed input.
fn answer<'a>(env: Env<'a>, table: &Table, run: impl FnOnce() -> Decoded<Term<'a>>) -> Term<'a> {
    run().unwrap_or_else(|err| error(env, table, err))
}

#[rustler::nif]
fn new_table(assume_busy_at_start: bool, booking_slack_ms: u64) -> ResourceArc<TableResource> {
    ResourceArc::new(TableResource(Table::new(Config {
        assume_busy_at_start,
        booking_slack_ms,
    })))
}

#[rustler::nif]
fn check_one<'a>(
    env: Env<'a>,
    table: ResourceArc<TableResource>,
    owner_term: Term<'a>,
    key_term: Term<'a>,
    limit_term: Term<'a>,
    cost_term: Term<'a>,
    max_wait_term: Term<'a>,
) -> Term<'a> {
    let table = &table.0;
    answer(env, table, || {
        let key = key(key_term)?;
        let cost = cost(cost_term)?;
        let mode = max_wait(max_wait_term)?;
        Ok(match limit(limit_term)? {
            Some(limit) => {
                let check = Check { key, limit, cost };
                outcome(env, table.check_one(owner(owner_term), check, mode))
            }
            None => atoms::ok().encode(env),
        })
    })
}

#[rustler::nif]
fn check_many<'a>(
    env: Env<'a>,
    table: ResourceArc<TableResource>,
    owner_term: Term<'a>,
    checks_term: Term<'a>,
    max_wait_term: Term<'a>,
) -> Term<'a> {
    let table = &table.0;
    answer(env, table, || {
        let mode = max_wait(max_wait_term)?;
        // The length first: it refuses improper lists, which rustler's iterator panics on.
        match checks_term.list_length() {
            Ok(length) if length <= MAX_CHECKS => {}
            Ok(_) => return invalid(format!("at most {MAX_CHECKS} checks in one call")),
            Err(_) => return invalid("checks must be a proper list of {key, limit, cost}"),
        }
        let list = checks_term
            .into_list_iterator()
            .map_err(|_| InvalidInput::new("checks must be a list of {key, limit, cost}"))?;
        let mut checks = Vec::with_capacity(4);
        for term in list {
            let Some([key_term, limit_term, cost_term]) = tuple(term) else {
                return invalid(format!(
                    "each check must be {{key, limit, cost}}, got {}",
                    shape(term)
                ));
            };
            let (key, cost) = (key(key_term)?, cost(cost_term)?);
            if let Some(limit) = limit(limit_term)? {
                checks.push(Check { key, limit, cost });
            }
        }
        Ok(outcome(env, table.check(owner(owner_term), &checks, mode)?))
    })
}

#[rustler::nif]
fn record<'a>(
    env: Env<'a>,
    table: ResourceArc<TableResource>,
    key_term: Term<'a>,
    cost_term: Term<'a>,
) -> Term<'a> {
    let table = &table.0;
    answer(env, table, || {
        table.record(key(key_term)?, cost(cost_term)?);
        Ok(atoms::ok().encode(env))
    })
}

#[rustler::nif]
fn sync<'a>(
    env: Env<'a>,
    table: ResourceArc<TableResource>,
    key_term: Term<'a>,
    allowance: Term<'a>,
    window_left_ms: Term<'a>,
) -> Term<'a> {
    let table = &table.0;
    answer(env, table, || {
        let key = key(key_term)?;
        let allowance = number(allowance, "allowance")?;
        if !allowance.is_finite() || allowance.abs() > bourse_core::MAX_AMOUNT {
            return invalid(format!(
                "allowance must be a finite number, got {allowance}"
            ));
        }
        match window_left_ms.decode::<i64>() {
            Ok(ms) if ms >= 0 => Ok(table.sync(key, allowance, ms as u64).encode(env)),
            _ => invalid(format!(
                "window_left_ms must be a non-negative integer, got {window_left_ms:?}"
            )),
        }
    })
}

#[rustler::nif]
fn borrowed<'a>(env: Env<'a>, table: ResourceArc<TableResource>, key_term: Term<'a>) -> Term<'a> {
    let table = &table.0;
    answer(env, table, || {
        Ok(table.borrowed(key(key_term)?).encode(env))
    })
}

#[rustler::nif]
fn reset<'a>(env: Env<'a>, table: ResourceArc<TableResource>, key_term: Term<'a>) -> Term<'a> {
    let table = &table.0;
    answer(env, table, || {
        table.reset(key(key_term)?);
        Ok(atoms::ok().encode(env))
    })
}

#[rustler::nif(schedule = "DirtyCpu")]
fn reset_exchange<'a>(
    env: Env<'a>,
    table: ResourceArc<TableResource>,
    exchange: Term<'a>,
) -> Term<'a> {
    let table = &table.0;
    answer(env, table, || {
        table.reset_exchange(key_part(exchange, "exchange_id")?);
        Ok(atoms::ok().encode(env))
    })
}

#[rustler::nif(schedule = "DirtyCpu")]
fn reset_all(table: ResourceArc<TableResource>) -> Atom {
    table.0.reset_all();
    atoms::ok()
}

#[rustler::nif(schedule = "DirtyCpu")]
fn sweep(table: ResourceArc<TableResource>) -> usize {
    table.0.sweep()
}

/// A full key, `{exchange_id, credential_key}` (every axis of a credential) or an
/// exchange id.
fn pause_target(term: Term) -> Decoded<PauseTarget> {
    if let Ok(exchange) = term.decode::<Binary>() {
        return Ok(PauseTarget::Exchange(
            key_part(term, "exchange_id").map(|_| exchange.as_slice().to_vec())?,
        ));
    }
    if let Some([exchange, cred]) = tuple(term) {
        Ok(PauseTarget::Credential(
            key_part(exchange, "exchange_id")?.to_vec(),
            credential(cred)?.map(<[u8]>::to_vec),
        ))
    } else if tuple::<3>(term).is_some() {
        Ok(PauseTarget::Key(key(term)?.to_owned_key()))
    } else {
        invalid(format!(
            "pause target must be a key, {{exchange_id, credential_key}} or an exchange id, got {}",
            shape(term)
        ))
    }
}

#[rustler::nif]
fn pause<'a>(
    env: Env<'a>,
    table: ResourceArc<TableResource>,
    target: Term<'a>,
    ms: Term<'a>,
) -> Term<'a> {
    let table = &table.0;
    answer(env, table, || {
        let target = pause_target(target)?;
        match ms.decode::<i64>() {
            Ok(ms) if ms >= 0 => table.pause(target, ms as u64),
            _ => {
                return invalid(format!(
                    "pause must be a non-negative integer of milliseconds, got {ms:?}"
                ))
            }
        }
        Ok(atoms::ok().encode(env))
    })
}

fn binary<'a>(env: Env<'a>, bytes: &[u8]) -> Term<'a> {
    let mut binary = NewBinary::new(env, bytes.len());
    binary.as_mut_slice().copy_from_slice(bytes);
    Term::from(binary)
}

fn key_term<'a>(env: Env<'a>, key: &Key) -> Term<'a> {
    let key = key.as_ref();
    let credential = match key.credential {
        Some(credential) => binary(env, credential),
        None => atoms::public().encode(env),
    };
    (binary(env, key.exchange), credential, binary(env, key.axis)).encode(env)
}

fn info_term<'a>(env: Env<'a>, info: &KeyInfo) -> Term<'a> {
    let limit = match info.limit {
        Some(limit) => Term::map_from_pairs(
            env,
            &[
                (atoms::capacity(), limit.capacity()),
                (atoms::refill_per_sec(), limit.refill_per_sec()),
            ],
        )
        .expect("distinct keys"),
        None => atoms::nil().encode(env),
    };
    let optional = |value: Option<u64>| match value {
        Some(ms) => ms.encode(env),
        None => atoms::nil().encode(env),
    };
    let pairs = [
        (atoms::limit(), limit),
        (atoms::tokens(), info.tokens.encode(env)),
        (atoms::borrowed(), info.borrowed.encode(env)),
        (atoms::debt(), info.debt.encode(env)),
        (atoms::bookings(), info.bookings.encode(env)),
        (atoms::booked_cost(), info.booked_cost.encode(env)),
        (atoms::next_ready_ms(), optional(info.next_ready_ms)),
        (atoms::pause_ms(), optional(info.pause_ms)),
    ];
    Term::map_from_pairs(env, &pairs).expect("distinct keys")
}

#[rustler::nif]
fn inspect<'a>(env: Env<'a>, table: ResourceArc<TableResource>, key_term: Term<'a>) -> Term<'a> {
    let table = &table.0;
    answer(env, table, || {
        Ok(match table.inspect(key(key_term)?) {
            Some(info) => info_term(env, &info),
            None => atoms::nil().encode(env),
        })
    })
}

#[rustler::nif(schedule = "DirtyCpu")]
fn busiest(env: Env, table: ResourceArc<TableResource>, count: usize) -> Term {
    table
        .0
        .busiest(count)
        .iter()
        .map(|(key, info)| (key_term(env, key), info_term(env, info)))
        .collect::<Vec<_>>()
        .encode(env)
}

#[rustler::nif(schedule = "DirtyCpu")]
fn stats(env: Env, table: ResourceArc<TableResource>) -> Term {
    let Stats {
        admitted,
        claimed,
        delayed,
        booked,
        over_budget,
        lapsed,
        paused,
        debited,
        invalid,
        buckets,
        bookings,
    } = table.0.stats();
    let pairs = [
        (atoms::admitted(), admitted),
        (atoms::claimed(), claimed),
        (atoms::delayed(), delayed),
        (atoms::booked(), booked),
        (atoms::over_budget(), over_budget),
        (atoms::lapsed(), lapsed),
        (atoms::paused(), paused),
        (atoms::debited(), debited),
        (atoms::invalid(), invalid),
        (atoms::buckets(), buckets),
        (atoms::bookings(), bookings),
    ];
    Term::map_from_pairs(env, &pairs).expect("distinct keys")
}

#[rustler::nif]
fn count_invalid(table: ResourceArc<TableResource>) -> Atom {
    table.0.count_invalid();
    atoms::ok()
}

rustler::init!("Elixir.Bourse.Native");

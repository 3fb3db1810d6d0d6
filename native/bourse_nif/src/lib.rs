//! Rustler glue between `Bourse.Native` and `bourse_core`: term decoding, the table
//! resource and answers. Malformed input becomes `{:error, message}`; nothing here sleeps,
//! and table-wide work and long check lists run on dirty schedulers.

use bourse_core::rules::{self, KeyPart, LimitKeys, MAX_CHECKS};
use bourse_core::{
    BackoffScope, Check, Config, InvalidInput, Key, KeyInfo, KeyRef, Limit, Mode, Outcome,
    PauseTarget, Shape, Stats, Table,
};
use rustler::{Atom, Binary, Encoder, Env, LocalPid, NewBinary, Term, TermType};

/// mimalloc: what a dirty scheduler frees (a sweep, a reset of millions of buckets) goes
/// back to the thread that allocated it without a lock, where glibc's allocator merged the
/// freed chunks under a lock that checks on normal schedulers then waited on (150 ms after
/// a `reset_all` of 2,000,000 buckets).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod bounds;
mod entry;
mod gate;
mod handle;
mod prepared;

use entry::in_place_nif;

use handle::Handle;

mod atoms {
    rustler::atoms! {
        ok, error, delay, booked, over_budget, public, nil, true_ = "true", false_ = "false",
        capacity, refill_per_sec, requests, period,
        admitted, claimed, delayed, lapsed, paused, debited, invalid, buckets, bookings,
        limit, tokens, borrowed, debt, booked_cost, next_ready_ms, pause_ms,
        credential, exchange, not_prepared,
    }
}

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

/// The exchange id of a tuple whose first element is a key with a valid one (a malformed
/// check that still names its key), for its error.
fn exchange_of_first(term: Term<'_>) -> Option<&[u8]> {
    let env = term.get_env();
    // SAFETY: as in `tuple`.
    let elements = unsafe { rustler::wrapper::tuple::get_tuple(env.as_c_arg(), term.as_c_arg()) };
    let first = unsafe { Term::new(env, *elements.ok()?.first()?) };
    let (exchange, _, _) = key_terms(first)?;
    key_part(exchange, KeyPart::Exchange).ok()
}

fn is_atom(term: Term, atom: Atom) -> bool {
    // Atoms are immediate terms: equal atoms are equal words, no call into the VM needed.
    term.as_c_arg() == atom.as_c_arg()
}

/// The head and tail of a list cell, `None` for anything else.
fn list_cell(term: Term) -> Option<(Term, Term)> {
    let env = term.get_env();
    // SAFETY: enif_get_list_cell only reads `term`; head and tail live as long as it does.
    let (head, tail) =
        unsafe { rustler::wrapper::list::get_list_cell(env.as_c_arg(), term.as_c_arg()) }?;
    Some(unsafe { (Term::new(env, head), Term::new(env, tail)) })
}

/// The length of a proper list of at most `MAX_CHECKS` elements, walking at most one
/// cell more; otherwise the list's shape.
fn bounded_len(term: Term) -> Result<usize, Shape> {
    let mut len = 0;
    let mut rest = term;
    while let Some((_, tail)) = list_cell(rest) {
        if len == MAX_CHECKS {
            return Err(Shape::List { len: None });
        }
        len += 1;
        rest = tail;
    }
    if rest.is_empty_list() {
        Ok(len)
    } else if len == 0 {
        Err(shape(term))
    } else {
        Err(Shape::ImproperList)
    }
}

/// The elements of a list whose shape `bounded_len` accepted.
fn elements(list: Term) -> impl Iterator<Item = Term> {
    std::iter::successors(list_cell(list), |&(_, tail)| list_cell(tail)).map(|(head, _)| head)
}

/// What `term` is, without reading a binary's bytes or walking more than `MAX_CHECKS`
/// cells of a list: for messages, which must never echo a value that may be an API key.
fn shape(term: Term) -> Shape {
    match term.get_type() {
        TermType::Atom if is_atom(term, atoms::nil()) => Shape::Nil,
        TermType::Atom if is_atom(term, atoms::true_()) => Shape::Boolean(true),
        TermType::Atom if is_atom(term, atoms::false_()) => Shape::Boolean(false),
        TermType::Atom => Shape::Atom,
        TermType::Binary => match term.decode::<Binary>() {
            Ok(binary) => Shape::Binary { len: binary.len() },
            Err(_) => Shape::Bitstring,
        },
        TermType::Integer => term
            .decode::<i64>()
            .map_or(Shape::BigInteger, Shape::Integer),
        TermType::Float => term.decode::<f64>().map_or(Shape::Other, Shape::Float),
        TermType::List if term.is_empty_list() => Shape::List { len: Some(0) },
        TermType::List => match bounded_len(term) {
            Ok(len) => Shape::List { len: Some(len) },
            Err(shape) => shape,
        },
        // SAFETY: enif_get_tuple only reads `term`; only the arity is kept.
        TermType::Tuple => {
            match unsafe {
                rustler::wrapper::tuple::get_tuple(term.get_env().as_c_arg(), term.as_c_arg())
            } {
                Ok(elements) => Shape::Tuple {
                    arity: elements.len(),
                },
                Err(_) => Shape::Other,
            }
        }
        TermType::Map => term
            .map_size()
            .map_or(Shape::Other, |size| Shape::Map { size }),
        TermType::Fun => Shape::Function,
        TermType::Pid => Shape::Pid,
        TermType::Port => Shape::Port,
        TermType::Ref => Shape::Reference,
        TermType::Unknown => Shape::Other,
    }
}

/// A number's shape with its value (integers first: the common cost), or `term`'s shape.
fn number(term: Term) -> Shape {
    if let Ok(integer) = term.decode::<i64>() {
        Shape::Integer(integer)
    } else if let Ok(float) = term.decode::<f64>() {
        Shape::Float(float)
    } else {
        shape(term)
    }
}

/// A key part's bytes, as `rules::key_part` allows them.
fn key_part<'a>(term: Term<'a>, part: KeyPart) -> Decoded<&'a [u8]> {
    match term.decode::<Binary>() {
        Ok(binary) => {
            let bytes = binary.as_slice();
            let utf8 = || std::str::from_utf8(bytes).is_ok();
            rules::key_part(part, Shape::Binary { len: bytes.len() }, utf8).map(|()| bytes)
        }
        // Not a binary, so the rule refuses it: its shape is never `Shape::Binary`.
        Err(_) => rules::key_part(part, shape(term), || false).map(|()| &[][..]),
    }
}

fn credential<'a>(term: Term<'a>) -> Decoded<Option<&'a [u8]>> {
    if is_atom(term, atoms::public()) {
        Ok(None)
    } else {
        key_part(term, KeyPart::Credential).map(Some)
    }
}

/// `{exchange_id, credential_key, bucket_axis}`, or `{exchange_id, credential_key}` for
/// the `"request"` axis. Errors after the exchange id name it.
fn key(term: Term) -> Decoded<KeyRef> {
    let Some((exchange, cred, axis)) = key_terms(term) else {
        return Err(rules::not_a_key(shape(term)));
    };
    let exchange = key_part(exchange, KeyPart::Exchange)?;
    naming(exchange, || {
        let credential = credential(cred)?;
        let axis = match axis {
            Some(axis) => key_part(axis, KeyPart::Axis)?,
            None => b"request",
        };
        Ok(KeyRef::new(exchange, credential, axis))
    })
}

/// A key's elements: exchange id, credential and axis (`None` in a key of two).
fn key_terms(term: Term) -> Option<(Term, Term, Option<Term>)> {
    if let Some([exchange, cred, axis]) = tuple(term) {
        return Some((exchange, cred, Some(axis)));
    }
    let [exchange, cred] = tuple(term)?;
    Some((exchange, cred, None))
}

/// What `read` decodes after an exchange id was read: its errors name that exchange.
fn naming<T>(exchange: &[u8], read: impl FnOnce() -> Decoded<T>) -> Decoded<T> {
    read().map_err(|err| err.for_exchange(exchange))
}

/// A limit map, or `None` for `nil` (no limit).
fn limit(term: Term) -> Decoded<Option<Limit>> {
    if is_atom(term, atoms::nil()) {
        return Ok(None);
    }
    let size = term
        .map_size()
        .map_err(|_| rules::not_a_limit(shape(term)))?;
    let field = |name: Atom| term.map_get(name).ok();
    let not_a_limit = || {
        let held = |name: Atom| field(name).is_some();
        let keys = LimitKeys {
            capacity: held(atoms::capacity()),
            refill_per_sec: held(atoms::refill_per_sec()),
            requests: held(atoms::requests()),
            period: held(atoms::period()),
        };
        rules::not_a_limit_map(size, keys)
    };
    let limit = match (size, field(atoms::capacity())) {
        // Two keys, one of them `capacity`: the other must be `refill_per_sec`.
        (2, Some(capacity)) => {
            let refill = field(atoms::refill_per_sec()).ok_or_else(not_a_limit)?;
            rules::limit(number(capacity), number(refill))?
        }
        (1 | 2, None) => {
            let requests = field(atoms::requests()).ok_or_else(not_a_limit)?;
            let period = match size {
                2 => Some(number(field(atoms::period()).ok_or_else(not_a_limit)?)),
                _ => None,
            };
            rules::limit_per_period(number(requests), period)?
        }
        _ => return Err(not_a_limit()),
    };
    Ok(Some(limit))
}

/// A cost, as `rules::cost` allows it.
fn cost(term: Term) -> Decoded<f64> {
    rules::cost(number(term))
}

fn max_wait(term: Term) -> Decoded<Mode> {
    if is_atom(term, atoms::nil()) {
        return Ok(Mode::Probe);
    }
    rules::max_wait_ms(number(term)).map(|max_wait_ms| Mode::Wait {
        max_wait_ms,
        booking_slack_ms: None,
    })
}

/// A booking owner: the pid itself for a local process, a mix of its pid and number for
/// `{pid, integer}` (one of a process's calls). Nothing else is sent (`Bourse.Native` is
/// internal); anything else is one owner, never walked, whatever its size.
fn owner(term: Term) -> u64 {
    // A local pid is an immediate term: its value names the process while it lives.
    let pid = |term: Term| {
        term.decode::<LocalPid>()
            .ok()
            .map(|_| term.as_c_arg() as u64)
    };
    if let Some(pid) = pid(term) {
        return pid;
    }
    match tuple::<2>(term) {
        Some([process, number]) => match (pid(process), number.decode::<i64>()) {
            (Some(pid), Ok(number)) => mix(pid ^ mix(number as u64)),
            _ => u64::MAX,
        },
        None => u64::MAX,
    }
}

/// SplitMix64's finaliser: every bit of `x` moves every bit of the result.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn binary<'a>(env: Env<'a>, bytes: &[u8]) -> Term<'a> {
    let mut binary = NewBinary::new(env, bytes.len());
    binary.as_mut_slice().copy_from_slice(bytes);
    Term::from(binary)
}

/// `{:error, message, exchange_id | nil}`; the input is counted as malformed.
fn error<'a>(env: Env<'a>, table: &Table, err: InvalidInput) -> Term<'a> {
    table.count_invalid();
    error_term(env, err)
}

/// `{:error, message, exchange_id | nil}`.
fn error_term(env: Env, err: InvalidInput) -> Term {
    let exchange = match err.exchange() {
        Some(exchange) => binary(env, exchange),
        None => atoms::nil().encode(env),
    };
    (atoms::error(), err.message(), exchange).encode(env)
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
fn new_table(env: Env, assume_busy_at_start: bool, booking_slack_ms: u64) -> Term {
    let config = Config {
        assume_busy_at_start,
        booking_slack_ms,
    };
    handle::new(env, Table::new(config))
}

in_place_nif!("check_rate", 6, check_rate);

/// `check_rate(table, owner, key, limit, cost, max_wait)`.
fn check_rate<'a>(env: Env<'a>, args: [Term<'a>; 6]) -> Term<'a> {
    let [table, owner_term, key_term, limit_term, cost_term, max_wait_term] = args;
    let Ok(Handle(table)) = table.decode() else {
        return entry::badarg(env);
    };
    answer(env, table, || {
        let key = key(key_term)?;
        let (cost, mode, limit) = naming(key.exchange, || {
            Ok((
                cost(cost_term)?,
                max_wait(max_wait_term)?,
                limit(limit_term)?,
            ))
        })?;
        Ok(match limit {
            Some(limit) => {
                let check = Check { key, limit, cost };
                outcome(env, table.check_rate(owner(owner_term), check, mode))
            }
            None => atoms::ok().encode(env),
        })
    })
}

/// One `{key, limit, cost}` from its three terms; `None` when its limit is `nil`.
fn check_parts<'a>(
    key_term: Term<'a>,
    limit_term: Term<'a>,
    cost_term: Term<'a>,
) -> Decoded<Option<Check<'a>>> {
    let key = key(key_term)?;
    let (cost, limit) = naming(key.exchange, || Ok((cost(cost_term)?, limit(limit_term)?)))?;
    Ok(limit.map(|limit| Check { key, limit, cost }))
}

/// The longest check list answered on a normal scheduler: longer ones (up to
/// `MAX_CHECKS`, ~150 ns per check) continue on a dirty CPU scheduler, so that no call
/// holds a normal scheduler for more than a few tens of microseconds.
pub(crate) const MAX_INLINE_CHECKS: usize = 64;
/// The most bookings the buckets of a check list answered on a normal scheduler hold
/// together: dropping lapsed ones, re-planning them behind a pause and limiting their
/// refunds cost up to about 100 ns each (a list over 64 buckets of 256 bookings took
/// over a millisecond). A list over more continues on a dirty CPU scheduler.
pub(crate) const MAX_INLINE_BOOKINGS: usize = 512;
/// The most key bytes a check list answered on a normal scheduler holds: checking and
/// hashing multi-byte UTF-8 takes up to ~1.3 ns a byte (64 checks of three 1 KiB parts of
/// `"é"`: 250 µs).
const MAX_INLINE_KEY_BYTES: usize = 16 * 1024;

/// Whether a list of `len` checks, whose keys hold `key_bytes`, is answered on a dirty
/// scheduler. The keys are measured only when they could hold that many bytes: not for the
/// short lists of the common case.
fn runs_dirty(len: usize, key_bytes: impl FnOnce() -> usize) -> bool {
    let most_key_bytes = len.saturating_mul(3 * rules::MAX_KEY_PART_BYTES);
    len > MAX_INLINE_CHECKS
        || (most_key_bytes > MAX_INLINE_KEY_BYTES && key_bytes() > MAX_INLINE_KEY_BYTES)
}

/// The bytes of the binary key parts of the checks of a proper list: `{key, limit, cost}`
/// and `{bucket, cost}` of a bucket not prepared (a prepared bucket's key was read when it
/// was prepared).
fn key_bytes(checks: Term) -> usize {
    let of = |parts: &[Term]| -> usize {
        parts
            .iter()
            .map(|part| part.decode::<Binary>().map_or(0, |binary| binary.len()))
            .sum()
    };
    let mut bytes = 0;
    let mut rest = checks;
    while let Some((check, tail)) = list_cell(rest) {
        let key = match tuple::<3>(check) {
            Some([key, _limit, _cost]) => Some(key),
            None => tuple::<2>(check).and_then(|[bucket, _cost]| prepared::unprepared_key(bucket)),
        };
        if let Some(key) = key {
            bytes += match tuple::<3>(key) {
                Some(parts) => of(&parts),
                None => tuple::<2>(key).map_or(0, |parts| of(&parts)),
            };
        }
        rest = tail;
    }
    bytes
}

/// The most key bytes a check list answered on a dirty scheduler without closing the
/// [`gate`] holds: comparing and copying them under the shards' locks takes well under
/// 100 µs.
const MAX_UNGATED_KEY_BYTES: usize = 4 * MAX_INLINE_KEY_BYTES;

in_place_nif!("check_rates", 4, check_rates);
entry::dirty_entry!(check_rates_dirty, 4, check_rates_on_dirty);
entry::dirty_entry!(check_rates_gated, 4, check_rates_past_gate);

/// `check_rates(table, owner, checks, max_wait)`, each check `{key, limit, cost}` or
/// `{bucket, cost}` (`prepared::entry`): the list's length is measured first
/// (walking at most `MAX_CHECKS + 1` cells); a long list continues on a dirty scheduler.
fn check_rates<'a>(env: Env<'a>, args: [Term<'a>; 4]) -> Term<'a> {
    match bounded_len(args[2]) {
        Ok(len) if runs_dirty(len, || key_bytes(args[2])) => {
            entry::on_dirty_scheduler(env, c"check_rates", check_rates_dirty, args)
        }
        len => checks_answer(env, args, len, MAX_INLINE_BOOKINGS),
    }
}

/// `check_rates` continued on a dirty scheduler: a long list of short keys over buckets
/// holding few bookings holds the shards' locks about as long as a short one (~150 ns a
/// check), and leaves the [`gate`] open; others close it.
fn check_rates_on_dirty<'a>(env: Env<'a>, args: [Term<'a>; 4]) -> Term<'a> {
    if key_bytes(args[2]) > MAX_UNGATED_KEY_BYTES {
        return check_rates_past_gate(env, args);
    }
    checks_answer(env, args, bounded_len(args[2]), MAX_INLINE_BOOKINGS)
}

/// `check_rates` continued on a dirty scheduler, long: past the [`gate`], closed to calls
/// on normal schedulers while it holds shard locks.
fn check_rates_past_gate<'a>(env: Env<'a>, args: [Term<'a>; 4]) -> Term<'a> {
    let _long = gate::long();
    checks_answer(env, args, bounded_len(args[2]), usize::MAX)
}

/// The answer to `check_rates` whose list `bounded_len` measured as `len`; continued past
/// the [`gate`] on a dirty scheduler when its buckets hold more than `max_bookings`
/// bookings.
fn checks_answer<'a>(
    env: Env<'a>,
    args: [Term<'a>; 4],
    len: Result<usize, Shape>,
    max_bookings: usize,
) -> Term<'a> {
    let [table, owner_term, checks_term, max_wait_term] = args;
    let Ok(Handle(table)) = table.decode() else {
        return entry::badarg(env);
    };
    answer(env, table, || {
        let mode = max_wait(max_wait_term)?;
        len.map_err(rules::not_a_check_list)?;
        let owner = owner(owner_term);
        let answered =
            prepared::check_list(table, owner, elements(checks_term), mode, max_bookings)?;
        Ok(match answered {
            Ok(Some(answered)) => outcome(env, answered),
            Ok(None) => entry::on_dirty_scheduler(env, c"check_rates", check_rates_gated, args),
            // Counted by the table.
            Err(refused) => error_term(env, refused),
        })
    })
}

in_place_nif!("record_request", 3, record_request);

/// `record_request(table, key, cost)`.
fn record_request<'a>(env: Env<'a>, args: [Term<'a>; 3]) -> Term<'a> {
    let [table, key_term, cost_term] = args;
    let Ok(Handle(table)) = table.decode() else {
        return entry::badarg(env);
    };
    answer(env, table, || {
        let key = key(key_term)?;
        let cost = naming(key.exchange, || cost(cost_term))?;
        table.record_request(key, cost);
        Ok(atoms::ok().encode(env))
    })
}

in_place_nif!("sync", 4, sync);

/// `sync(table, key, allowance, window_left_ms)`.
fn sync<'a>(env: Env<'a>, args: [Term<'a>; 4]) -> Term<'a> {
    let [table, key_term, allowance, window_left_ms] = args;
    let Ok(Handle(table)) = table.decode() else {
        return entry::badarg(env);
    };
    answer(env, table, || {
        let key = key(key_term)?;
        let (allowance, window_left_ms) = naming(key.exchange, || {
            let allowance = rules::allowance(number(allowance))?;
            Ok((allowance, rules::window_left_ms(number(window_left_ms))?))
        })?;
        Ok(table.sync(key, allowance, window_left_ms).encode(env))
    })
}

in_place_nif!("get_cost", 2, get_cost);

/// `get_cost(table, key)`.
fn get_cost<'a>(env: Env<'a>, args: [Term<'a>; 2]) -> Term<'a> {
    let [table, key_term] = args;
    let Ok(Handle(table)) = table.decode() else {
        return entry::badarg(env);
    };
    answer(env, table, || {
        Ok(table.get_cost(key(key_term)?).encode(env))
    })
}

in_place_nif!("reset", 2, reset);

/// `reset(table, key)`.
fn reset<'a>(env: Env<'a>, args: [Term<'a>; 2]) -> Term<'a> {
    let [table, key_term] = args;
    let Ok(Handle(table)) = table.decode() else {
        return entry::badarg(env);
    };
    answer(env, table, || {
        table.reset(key(key_term)?);
        Ok(atoms::ok().encode(env))
    })
}

#[rustler::nif(schedule = "DirtyCpu")]
fn reset_exchange<'a>(env: Env<'a>, table: Handle<'a>, exchange: Term<'a>) -> Term<'a> {
    let table = &table.0;
    answer(env, table, || {
        table.reset_exchange(key_part(exchange, KeyPart::Exchange)?);
        Ok(atoms::ok().encode(env))
    })
}

#[rustler::nif(schedule = "DirtyCpu")]
fn reset_all(table: Handle) -> Atom {
    table.0.reset_all();
    purge_freed();
    atoms::ok()
}

#[rustler::nif(schedule = "DirtyCpu")]
fn sweep(table: Handle) -> usize {
    let dropped = table.0.sweep();
    purge_freed();
    dropped
}

/// Returns to the OS what the allocator took back at least its purge delay ago (1 s),
/// from any thread: mimalloc purges only from a later call into it, which the scheduler
/// threads that allocated the buckets may not make for a long time. Run after the sweep
/// (and a reset) on their dirty scheduler: a few microseconds when there is nothing to
/// purge, a few milliseconds for a million buckets.
fn purge_freed() {
    // SAFETY: mi_collect may be called from any thread at any time.
    unsafe { libmimalloc_sys::mi_collect(false) }
}

/// `{exchange_id, credential_key}`: a credential (every axis of it).
fn exchange_credential<'a>(term: Term<'a>) -> Decoded<(&'a [u8], Option<&'a [u8]>)> {
    let Some([exchange, cred]) = tuple(term) else {
        return Err(rules::not_a_credential(shape(term)));
    };
    let exchange = key_part(exchange, KeyPart::Exchange)?;
    let credential = naming(exchange, || credential(cred))?;
    Ok((exchange, credential))
}

/// A full key, `{exchange_id, credential_key}` (every axis of a credential) or an
/// exchange id.
fn pause_target(term: Term) -> Decoded<PauseTarget> {
    if term.is_binary() {
        return Ok(PauseTarget::Exchange(
            key_part(term, KeyPart::Exchange)?.to_vec(),
        ));
    }
    if tuple::<2>(term).is_some() {
        let (exchange, credential) = exchange_credential(term)?;
        Ok(PauseTarget::Credential(
            exchange.to_vec(),
            credential.map(<[u8]>::to_vec),
        ))
    } else if tuple::<3>(term).is_some() {
        Ok(PauseTarget::Key(key(term)?.to_owned_key()))
    } else {
        Err(rules::not_a_pause_target(shape(term)))
    }
}

#[rustler::nif]
fn pause<'a>(env: Env<'a>, table: Handle<'a>, target: Term<'a>, ms: Term<'a>) -> Term<'a> {
    let table = &table.0;
    answer(env, table, || {
        let target = pause_target(target)?;
        let ms = naming(target.exchange(), || rules::pause_ms(number(ms)))?;
        table.pause(target, ms);
        Ok(atoms::ok().encode(env))
    })
}

/// `back_off(table, {exchange_id, credential_key}, :credential | :exchange)`: the pause
/// set, in milliseconds.
#[rustler::nif]
fn back_off<'a>(
    env: Env<'a>,
    table: Handle<'a>,
    credential: Term<'a>,
    scope: Term<'a>,
) -> Term<'a> {
    let table = &table.0;
    answer(env, table, || {
        let (exchange, credential) = exchange_credential(credential)?;
        let scope = if is_atom(scope, atoms::credential()) {
            BackoffScope::Credential
        } else if is_atom(scope, atoms::exchange()) {
            BackoffScope::Exchange
        } else {
            return Err(rules::not_a_backoff_scope(shape(scope)).for_exchange(exchange));
        };
        Ok(table.back_off(exchange, credential, scope).encode(env))
    })
}

/// `reset_backoff(table, {exchange_id, credential_key})`.
#[rustler::nif]
fn reset_backoff<'a>(env: Env<'a>, table: Handle<'a>, credential: Term<'a>) -> Term<'a> {
    let table = &table.0;
    answer(env, table, || {
        let (exchange, credential) = exchange_credential(credential)?;
        table.reset_backoff(exchange, credential);
        Ok(atoms::ok().encode(env))
    })
}

fn key_term<'a>(env: Env<'a>, key: &Key) -> Term<'a> {
    let key = key.as_ref();
    let credential = match key.credential {
        Some(credential) => binary(env, credential),
        None => atoms::public().encode(env),
    };
    (binary(env, key.exchange), credential, binary(env, key.axis)).encode(env)
}

/// A definition as Elixir reads it: `%{capacity: c, refill_per_sec: r}`, or `nil`.
pub(crate) fn limit_term_of(env: Env, limit: Option<Limit>) -> Term {
    match limit {
        Some(limit) => Term::map_from_pairs(
            env,
            &[
                (atoms::capacity(), limit.capacity()),
                (atoms::refill_per_sec(), limit.refill_per_sec()),
            ],
        )
        .expect("distinct keys"),
        None => atoms::nil().encode(env),
    }
}

fn info_term<'a>(env: Env<'a>, info: &KeyInfo) -> Term<'a> {
    let limit = limit_term_of(env, info.limit);
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

in_place_nif!("inspect", 2, inspect);

/// `inspect(table, key)`.
fn inspect<'a>(env: Env<'a>, args: [Term<'a>; 2]) -> Term<'a> {
    let [table, key_term] = args;
    let Ok(Handle(table)) = table.decode() else {
        return entry::badarg(env);
    };
    answer(env, table, || {
        Ok(match table.inspect(key(key_term)?) {
            Some(info) => info_term(env, &info),
            None => atoms::nil().encode(env),
        })
    })
}

#[rustler::nif(schedule = "DirtyCpu")]
fn busiest<'a>(env: Env<'a>, table: Handle<'a>, count: Term<'a>) -> Term<'a> {
    let table = &table.0;
    answer(env, table, || {
        let rows = table.busiest(rules::busiest_count(number(count))?);
        Ok(rows
            .iter()
            .map(|(key, info)| (key_term(env, key), info_term(env, info)))
            .collect::<Vec<_>>()
            .encode(env))
    })
}

#[rustler::nif(schedule = "DirtyCpu")]
fn stats<'a>(env: Env<'a>, table: Handle<'a>) -> Term<'a> {
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

fn load(env: Env, _info: Term) -> bool {
    handle::open_type::<Table>(env) && handle::open_type::<bourse_core::PreparedBucket>(env)
}

rustler::init!("Elixir.Bourse.Native", load = load);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_check_lists_and_long_keys_run_on_a_dirty_scheduler() {
        assert!(!runs_dirty(1, || 0));
        assert!(!runs_dirty(MAX_INLINE_CHECKS, || MAX_INLINE_KEY_BYTES));
        assert!(runs_dirty(MAX_INLINE_CHECKS + 1, || 0));
        assert!(runs_dirty(MAX_CHECKS, || 0));
        assert!(runs_dirty(6, || MAX_INLINE_KEY_BYTES + 1));
        // Five checks' keys hold at most 15 KiB: not measured.
        assert!(!runs_dirty(5, || unreachable!()));
    }
}

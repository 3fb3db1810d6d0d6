//! Prepared buckets (`Bourse.RateLimiter.bucket/3`): a key and its limit decoded,
//! validated and hashed once, into a resource that checks name instead of the key and
//! the limit. The core answers them by the same code as any check.

use bourse_core::{Check, Mode, Outcome, PreparedBucket, PreparedCheck, Table};
use rustler::{Encoder, Env, Term};
use smallvec::SmallVec;

use crate::entry::in_place_nif;
use crate::handle::{self, Handle};
use crate::{answer, atoms, check_parts, cost, exchange_of_first, is_atom, key, limit, max_wait};
use crate::{naming, outcome};
use crate::{owner, rules, shape, tuple, Decoded};

mod names {
    rustler::atoms! {
        __struct__, prepared, key, limit,
        bucket_struct = "Elixir.Bourse.RateLimiter.Bucket",
    }
}

/// `prepare(table, key, limit)`: a prepared bucket of `table`, `nil` for a valid key with
/// a `nil` limit, or the error a check of that key and limit answers.
#[rustler::nif]
fn prepare<'a>(
    env: Env<'a>,
    table: Handle<'a>,
    key_term: Term<'a>,
    limit_term: Term<'a>,
) -> Term<'a> {
    let table = table.0;
    answer(env, table, || {
        let key = key(key_term)?;
        Ok(match naming(key.exchange, || limit(limit_term))? {
            Some(limit) => handle::new(env, table.prepare(key, limit)),
            None => atoms::nil().encode(env),
        })
    })
}

in_place_nif!("check_prepared", 5, check_prepared);

/// `check_prepared(table, owner, bucket, cost, max_wait)`: `check_rate` of a prepared
/// bucket. A bucket prepared for another table is answered there as its key and limit;
/// `:not_prepared` when `table` is no table or `bucket` no prepared bucket (a forged
/// struct's references).
fn check_prepared<'a>(env: Env<'a>, args: [Term<'a>; 5]) -> Term<'a> {
    let [table, owner_term, bucket, cost_term, max_wait_term] = args;
    let (Ok(Handle(table)), Ok(Handle(bucket))) = (
        table.decode::<Handle<Table>>(),
        bucket.decode::<Handle<PreparedBucket>>(),
    ) else {
        return atoms::not_prepared().encode(env);
    };
    answer(env, table, || {
        let (cost, mode) = naming(bucket.key().exchange, || {
            Ok((cost(cost_term)?, max_wait(max_wait_term)?))
        })?;
        Ok(outcome(
            env,
            table.check_prepared(owner(owner_term), bucket, cost, mode),
        ))
    })
}

/// One element of a check list: `{key, limit, cost}`, or `{bucket, cost}` with a
/// `%Bourse.RateLimiter.Bucket{}`.
enum Entry<'a> {
    /// A key and limit given as terms.
    Plain(Check<'a>),
    /// A prepared bucket.
    Prepared(PreparedCheck<'a>),
}

/// One element of a check list; `None` when its limit is `nil`.
fn entry(term: Term) -> Decoded<Option<Entry>> {
    if let Some([bucket, cost_term]) = tuple(term) {
        if let Some(fields) = bucket_fields(bucket) {
            return match fields {
                BucketFields::Prepared(bucket) => {
                    let cost = naming(bucket.key().exchange, || cost(cost_term))?;
                    Ok(Some(Entry::Prepared(PreparedCheck { bucket, cost })))
                }
                BucketFields::Unprepared(key, limit) => {
                    Ok(check_parts(key, limit, cost_term)?.map(Entry::Plain))
                }
            };
        }
    }
    let Some([key, limit, cost]) = tuple(term) else {
        let error = rules::not_a_check(shape(term));
        return Err(match exchange_of_first(term) {
            Some(exchange) => error.for_exchange(exchange),
            None => error,
        });
    };
    Ok(check_parts(key, limit, cost)?.map(Entry::Plain))
}

/// What a bucket struct holds: its prepared resource, or (with a `nil` limit, or from a
/// limiter on another backend) its key and limit.
enum BucketFields<'a> {
    Prepared(&'a PreparedBucket),
    Unprepared(Term<'a>, Term<'a>),
}

/// The key of a bucket struct that holds no prepared bucket: read with each check.
pub(crate) fn unprepared_key(term: Term) -> Option<Term> {
    match bucket_fields(term)? {
        BucketFields::Unprepared(key, _limit) => Some(key),
        BucketFields::Prepared(_) => None,
    }
}

fn bucket_fields(term: Term) -> Option<BucketFields> {
    let field = |name| term.map_get(name).ok();
    if !is_atom(field(names::__struct__())?, names::bucket_struct()) {
        return None;
    }
    let prepared = field(names::prepared())?;
    if let Ok(Handle(bucket)) = prepared.decode() {
        return Some(BucketFields::Prepared(bucket));
    }
    Some(BucketFields::Unprepared(
        field(names::key())?,
        field(names::limit())?,
    ))
}

impl<'a> Entry<'a> {
    /// The check of its key and limit.
    fn into_check(self) -> Check<'a> {
        match self {
            Entry::Plain(check) => check,
            Entry::Prepared(PreparedCheck { bucket, cost }) => Check {
                key: bucket.key(),
                limit: bucket.limit(),
                cost,
            },
        }
    }
}

/// Checks the elements of a check list all-or-nothing: by their prepared buckets when
/// every one has one, otherwise by their keys and limits (in the order given either way).
/// An element that does not decode is the outer error; the inner one is the table's
/// refusal of the checks (conflicting definitions), which the table counted itself.
/// `None`: left undone, its buckets holding more than `max_bookings` bookings.
pub fn check_list<'a>(
    table: &Table,
    owner: u64,
    list: impl Iterator<Item = Term<'a>>,
    mode: Mode,
    max_bookings: usize,
) -> Decoded<Decoded<Option<Outcome>>> {
    // On the stack up to a few buckets: no allocation for the common multi-bucket check.
    let mut prepared: SmallVec<[PreparedCheck; 8]> = SmallVec::new();
    let mut checks: SmallVec<[Check; 8]> = SmallVec::new();
    for term in list {
        match entry(term)? {
            None => {}
            Some(Entry::Prepared(check)) if checks.is_empty() => prepared.push(check),
            Some(entry) => {
                checks.extend(
                    prepared
                        .drain(..)
                        .map(|check| Entry::Prepared(check).into_check()),
                );
                checks.push(entry.into_check());
            }
        }
    }
    Ok(if checks.is_empty() {
        table.check_prepared_all_within(owner, &prepared, mode, max_bookings)
    } else {
        table.check_rates_within(owner, &checks, mode, max_bookings)
    })
}

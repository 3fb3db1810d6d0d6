//! The core's rules for Elixir code that checks its input before any table is reached
//! (`Bourse.RateLimiter.observe_response/6`): the decoders of the table's calls, and the
//! bounds of `bourse_core::rules`, so that Elixir repeats none of them; and the NIF's own
//! `MAX_INLINE_CHECKS` and `MAX_INLINE_BOOKINGS`.

use bourse_core::rules::{
    DEFAULT_BOOKING_SLACK_MS, FIRST_BACKOFF_MS, MAX_AMOUNT, MAX_BUSIEST, MAX_CHECKS,
    MAX_KEY_PART_BYTES, MAX_MS, MAX_PAUSES, MAX_SECRET_BYTES, MAX_SECRET_FILE_BYTES,
    MAX_SECRET_PATH_BYTES, MAX_SETTING_MS, MAX_STORE_TIMEOUT_MS, MIN_SECRET_BYTES,
};
use bourse_core::InvalidInput;
use rustler::{Encoder, Env, Term};

use crate::{atoms, error_term, key, limit, limit_term_of, MAX_INLINE_BOOKINGS, MAX_INLINE_CHECKS};

mod names {
    rustler::atoms! {
        max_key_part_bytes, max_checks, max_busiest, max_pauses, default_booking_slack_ms,
        max_ms, max_setting_ms, max_store_timeout_ms, max_amount, max_inline_checks,
        max_inline_bookings, first_backoff_ms, min_secret_bytes, max_secret_bytes,
        max_secret_file_bytes, max_secret_path_bytes,
    }
}

fn verdict(env: Env, checked: Result<(), InvalidInput>) -> Term {
    match checked {
        Ok(()) => atoms::ok().encode(env),
        Err(err) => error_term(env, err),
    }
}

/// `check_key(key)`: `:ok`, or the `{:error, message, exchange_id | nil}` a table's call
/// answers for that key.
#[rustler::nif]
fn check_key<'a>(env: Env<'a>, key_term: Term<'a>) -> Term<'a> {
    verdict(env, key(key_term).map(|_| ()))
}

/// `limit_definition(limit)`: `{:ok, %{capacity: c, refill_per_sec: r}}` for any form of
/// a limit (`{:ok, nil}` for `nil`), or the error a check answers for it.
#[rustler::nif]
fn limit_definition<'a>(env: Env<'a>, limit_term: Term<'a>) -> Term<'a> {
    match limit(limit_term) {
        Ok(limit) => (atoms::ok(), limit_term_of(env, limit)).encode(env),
        Err(err) => error_term(env, err),
    }
}

/// `bounds()`: the bounds and defaults of `bourse_core::rules`, and the longest check list
/// and most bookings answered on a normal scheduler (`max_inline_checks`,
/// `max_inline_bookings`), as a map.
#[rustler::nif]
fn bounds(env: Env) -> Term {
    let integers = [
        (names::max_key_part_bytes(), MAX_KEY_PART_BYTES as u64),
        (names::max_checks(), MAX_CHECKS as u64),
        (names::max_busiest(), MAX_BUSIEST as u64),
        (names::max_pauses(), MAX_PAUSES as u64),
        (names::default_booking_slack_ms(), DEFAULT_BOOKING_SLACK_MS),
        (names::max_ms(), MAX_MS),
        (names::max_setting_ms(), MAX_SETTING_MS),
        (names::max_store_timeout_ms(), MAX_STORE_TIMEOUT_MS),
        (names::first_backoff_ms(), FIRST_BACKOFF_MS),
        (names::min_secret_bytes(), MIN_SECRET_BYTES as u64),
        (names::max_secret_bytes(), MAX_SECRET_BYTES as u64),
        (names::max_secret_file_bytes(), MAX_SECRET_FILE_BYTES as u64),
        (names::max_secret_path_bytes(), MAX_SECRET_PATH_BYTES as u64),
        (names::max_inline_checks(), MAX_INLINE_CHECKS as u64),
        (names::max_inline_bookings(), MAX_INLINE_BOOKINGS as u64),
    ];
    let mut pairs: Vec<(Term, Term)> = integers
        .iter()
        .map(|&(name, value)| (name.encode(env), value.encode(env)))
        .collect();
    pairs.push((names::max_amount().encode(env), MAX_AMOUNT.encode(env)));
    Term::map_from_pairs(env, &pairs).expect("distinct keys")
}

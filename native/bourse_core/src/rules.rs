//! Every bound, default and validation rule of the limiter, each defined once, with its
//! error message.
//!
//! Adapters (the NIF, the daemon's decoders) describe what they were given as a [`Shape`]
//! (its kind and size, and a number's value, never the content of a binary) and ask the
//! rule for the value or the error. Messages are written in Elixir syntax and are bounded
//! in size whatever the input: a bad value is described by its type and size, so no
//! message can echo a credential. Adapters attach the exchange id to an error with
//! [`InvalidInput::for_exchange`] when they could read it.

use std::fmt;

use crate::limit::Limit;

/// Longest exchange id, credential or bucket axis, in bytes.
pub const MAX_KEY_PART_BYTES: usize = 1024;
/// Most checks in one multi-bucket call.
pub const MAX_CHECKS: usize = 1024;
/// Most bookings one bucket holds: a waiter that would book beyond them is refused as
/// over its budget, with the delay it would have booked, and pays nothing. A pause
/// re-plans a bucket's bookings (and a claim held by a pause of another bucket of its
/// check re-plans the others), sorting and paying each again: about 20 µs for this many.
pub const MAX_BOOKINGS: usize = 256;
/// Most rows one `busiest` call may ask for.
pub const MAX_BUSIEST: usize = 10_000;
/// Most pauses of keys and credentials in force at once in one table, and most of
/// exchanges: small enough that a walk over all of them under the table's lock (a reset,
/// the sweep) stays short.
pub const MAX_PAUSES: usize = 10_000;
/// Most credentials whose backoff is counted at once in one table.
pub const MAX_BACKOFFS: usize = 10_000;
/// The backoff after a limited reply without a usable wait, when none came just before.
pub const FIRST_BACKOFF_MS: u64 = 1000;
/// The longest backoff.
pub const MAX_BACKOFF_MS: u64 = 300_000;
/// How long a backoff count lasts after the last limited reply that counted into it.
pub const BACKOFF_LAPSE_MS: u64 = 600_000;
/// How long past its ready time a booking may still be claimed, unless configured.
pub const DEFAULT_BOOKING_SLACK_MS: u64 = 250;
/// How long a full, idle bucket is kept past the latest moment it told a caller to come
/// back: a caller that sleeps the delay it was told and comes back late still finds what
/// accrued beyond the capacity. The Redis script keeps every key this much longer
/// (`MARGIN`).
pub const KEEP_MARGIN_MS: u64 = 1000;
/// How long a key holding only `record_request` debt (no definition yet) is kept past its
/// last use: any exchange window it was recorded against has ended by then. The Redis
/// script keeps such keys as long (`DEBT_TTL`).
pub const DEBT_KEEP_MS: u64 = 86_400_000;
/// Longest budget, pause, booking slack or exchange window, in milliseconds: what
/// `Process.sleep/1` accepts.
pub const MAX_MS: u64 = 4_294_967_295;
/// Longest booking slack, sweep interval or idle timeout a limiter or daemon is set up
/// with: one day.
pub const MAX_SETTING_MS: u64 = 86_400_000;
/// Longest wait for a remote store (Redis) per command: a call waits several of them.
pub const MAX_STORE_TIMEOUT_MS: u64 = 60_000;
/// Shortest secret a shared daemon's TCP clients prove.
pub const MIN_SECRET_BYTES: usize = 16;
/// Longest secret: Redis closes an unauthenticated connection whose password is much
/// longer (16 KiB), and no secret needs more.
pub const MAX_SECRET_BYTES: usize = 4096;
/// Most bytes read of a secret's file: a larger one (a certificate bundle, a log) is not
/// one, and is not read whole.
pub const MAX_SECRET_FILE_BYTES: usize = 64 * 1024;
/// Longest path of a secret's file.
pub const MAX_SECRET_PATH_BYTES: usize = 4096;
/// Largest capacity, refill rate, cost or allowance: far beyond any exchange limit, small
/// enough that every product and sum stays exact to well under a token.
pub const MAX_AMOUNT: f64 = 1e12;
/// [`MAX_AMOUNT`] as messages write it (Elixir reads it back as the same float).
const MAX_AMOUNT_TEXT: &str = "1.0e12";

/// A value as an adapter found it: its kind and size, and a number's value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Shape {
    /// An integer that fits a signed 64-bit integer.
    Integer(i64),
    /// An integer outside the signed 64-bit range.
    BigInteger,
    /// A float.
    Float(f64),
    /// A binary (an Elixir string) of `len` bytes.
    Binary {
        /// Its size in bytes.
        len: usize,
    },
    /// A bitstring whose length is not a whole number of bytes.
    Bitstring,
    /// An atom other than `nil`, `true` and `false` (never named: it may hold anything).
    Atom,
    /// `nil` (or JSON `null`).
    Nil,
    /// `true` or `false`.
    Boolean(bool),
    /// A proper list; `len: None` when longer than an adapter walks ([`MAX_CHECKS`]).
    List {
        /// Its length, when known.
        len: Option<usize>,
    },
    /// A list whose last tail is not `[]`.
    ImproperList,
    /// A tuple.
    Tuple {
        /// Its number of elements.
        arity: usize,
    },
    /// A map (or a JSON object).
    Map {
        /// Its number of keys.
        size: usize,
    },
    /// A process identifier.
    Pid,
    /// A port.
    Port,
    /// A reference.
    Reference,
    /// A function.
    Function,
    /// Anything else.
    Other,
}

impl Shape {
    /// The value of a number that fits an `f64` exactly enough (integers beyond 2^53
    /// round), `None` for anything else.
    pub fn number(self) -> Option<f64> {
        match self {
            Self::Integer(value) => Some(value as f64),
            Self::Float(value) => Some(value),
            _ => None,
        }
    }

    fn integer(self) -> Option<i64> {
        match self {
            Self::Integer(value) => Some(value),
            _ => None,
        }
    }
}

fn plural(count: usize, one: &str, many: &str) -> String {
    format!("{count} {}", if count == 1 { one } else { many })
}

/// Elixir's description of the value: `-1`, `1.0e13`, `nil`, `a binary of 10 bytes`.
impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::Integer(value) => write!(f, "{value}"),
            Self::BigInteger => f.write_str("an integer outside the signed 64-bit range"),
            Self::Float(value) => f.write_str(&elixir_float(value)),
            Self::Binary { len: 0 } => f.write_str("an empty binary"),
            Self::Binary { len } => write!(f, "a binary of {}", plural(len, "byte", "bytes")),
            Self::Bitstring => f.write_str("a bitstring"),
            Self::Atom => f.write_str("an atom"),
            Self::Nil => f.write_str("nil"),
            Self::Boolean(value) => write!(f, "{value}"),
            Self::List { len: Some(0) } => f.write_str("an empty list"),
            Self::List { len: Some(len) } => {
                write!(f, "a list of {}", plural(len, "element", "elements"))
            }
            Self::List { len: None } => write!(f, "a list of more than {MAX_CHECKS} elements"),
            Self::ImproperList => f.write_str("an improper list"),
            Self::Tuple { arity } => {
                write!(f, "a tuple of {}", plural(arity, "element", "elements"))
            }
            Self::Map { size: 0 } => f.write_str("an empty map"),
            Self::Map { size } => write!(f, "a map of {}", plural(size, "key", "keys")),
            Self::Pid => f.write_str("a pid"),
            Self::Port => f.write_str("a port"),
            Self::Reference => f.write_str("a reference"),
            Self::Function => f.write_str("a function"),
            Self::Other => f.write_str("a term of unknown type"),
        }
    }
}

/// A shape shown without its value, even a number's: a key part (a credential, perhaps).
struct Unshown(Shape);

impl fmt::Display for Unshown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Shape::Integer(_) => f.write_str("an integer"),
            Shape::Float(_) => f.write_str("a float"),
            Shape::Boolean(_) => f.write_str("a boolean"),
            shape => shape.fmt(f),
        }
    }
}

/// A float as Elixir's `inspect/1` writes it: the shortest digits that read back to the
/// same float, `1000.0` for integral values below 1.0e16, otherwise decimal or scientific
/// notation, whichever is shorter (`0.001`, `1.0e-5`, `1.0e16`).
pub fn elixir_float(value: f64) -> String {
    if !value.is_finite() {
        // No Elixir value: only JSON's numbers past a double's range (`1e999`) read as one.
        return if value.is_nan() {
            "NaN"
        } else {
            "a number beyond a double"
        }
        .into();
    }
    let sign = if value.is_sign_negative() { "-" } else { "" };
    let magnitude = value.abs();
    if magnitude == 0.0 {
        return format!("{sign}0.0");
    }
    if (1.0..1e16).contains(&magnitude) && magnitude.fract() == 0.0 {
        return format!("{sign}{magnitude:.0}.0");
    }
    let (digits, exponent) = shortest_digits(magnitude);
    // The decimal point sits after `point` digits of `digits`.
    let point = exponent + 1;
    let count = digits.len() as i32;
    let exponential = match digits.split_at(1) {
        (first, "") => format!("{first}.0e{exponent}"),
        (first, rest) => format!("{first}.{rest}e{exponent}"),
    };
    let decimal = if point <= 0 {
        format!("0.{}{digits}", "0".repeat(-point as usize))
    } else if point < count {
        format!(
            "{}.{}",
            &digits[..point as usize],
            &digits[point as usize..]
        )
    } else {
        format!("{digits}{}.0", "0".repeat((point - count) as usize))
    };
    // Erlang writes floats of 2^53 and above in scientific notation.
    let body = if (0 < point && point < count && magnitude < 9_007_199_254_740_992.0)
        || (magnitude < 9_007_199_254_740_992.0 && decimal.len() <= exponential.len())
    {
        decimal
    } else {
        exponential
    };
    format!("{sign}{body}")
}

/// The shortest digits that read back to `magnitude` (positive, finite), and the exponent
/// of the first: `("12345", -7)` for 1.2345e-7. Of two candidates equally near the exact
/// value, the one ending in an even digit, as Erlang chooses (Rust's `{:e}` takes the
/// upper one: 991159222237595.25 is written `...5.3` there, `...5.2` by Erlang).
fn shortest_digits(magnitude: f64) -> (String, i32) {
    let split = |scientific: &str| {
        let (mantissa, exponent) = scientific.split_once('e').expect("`{:e}` has an exponent");
        let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
        (
            digits,
            exponent.parse::<i32>().expect("an integer exponent"),
        )
    };
    let (mut digits, exponent) = split(&format!("{magnitude:e}"));
    let last = digits.as_bytes()[digits.len() - 1];
    if digits.len() > 1 && last % 2 == 1 {
        let mut lower = digits.clone();
        lower.pop();
        lower.push((last - 1) as char);
        let reads_back = format!("{}.{}e{exponent}", &lower[..1], &lower[1..]).parse::<f64>();
        if reads_back == Ok(magnitude) {
            // A tie: the exact value is the lower candidate followed by a 5.
            let (exact, exact_exponent) = split(&format!("{magnitude:.767e}"));
            if exact_exponent == exponent && exact.trim_end_matches('0') == format!("{lower}5") {
                digits = lower;
            }
        }
    }
    (digits, exponent)
}

/// A bucket definition as Elixir writes the normalised map.
fn elixir_limit(limit: &Limit) -> String {
    format!(
        "%{{capacity: {}, refill_per_sec: {}}}",
        elixir_float(limit.capacity()),
        elixir_float(limit.refill_per_sec())
    )
}

/// Malformed input: a message naming what is wrong, and the exchange id of the request
/// when it could be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidInput {
    message: String,
    exchange: Option<Box<[u8]>>,
}

impl InvalidInput {
    /// An error with `message` and no exchange.
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            exchange: None,
        }
    }

    /// The same error, naming `exchange` unless it already names one.
    pub fn for_exchange(mut self, exchange: &[u8]) -> Self {
        if self.exchange.is_none() {
            self.exchange = Some(exchange.into());
        }
        self
    }

    /// What is wrong, in Elixir syntax.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The exchange id of the request, when it could be read.
    pub fn exchange(&self) -> Option<&[u8]> {
        self.exchange.as_deref()
    }
}

impl fmt::Display for InvalidInput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for InvalidInput {}

fn invalid<T>(message: String) -> Result<T, InvalidInput> {
    Err(InvalidInput::new(message))
}

/// The three parts of a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyPart {
    /// `exchange_id`.
    Exchange,
    /// `credential_key`.
    Credential,
    /// `bucket_axis`.
    Axis,
}

/// A key part must be UTF-8 text in a binary of at most [`MAX_KEY_PART_BYTES`] bytes (a
/// credential may also be `:public`, which the adapter recognises before asking): the
/// daemon's protocol carries key parts as strings, and every backend takes the same keys.
/// `utf8` tells whether a binary's bytes are UTF-8; it is asked only of a binary within
/// the bound, so that no adapter reads more than [`MAX_KEY_PART_BYTES`] bytes of it.
pub fn key_part(
    part: KeyPart,
    given: Shape,
    utf8: impl FnOnce() -> bool,
) -> Result<(), InvalidInput> {
    let not_utf8 = match given {
        Shape::Binary { len } if len <= MAX_KEY_PART_BYTES => {
            if utf8() {
                return Ok(());
            }
            " that is not UTF-8"
        }
        _ => "",
    };
    let name = match part {
        KeyPart::Exchange => "exchange_id",
        KeyPart::Credential => "credential_key",
        KeyPart::Axis => "bucket_axis",
    };
    let public = match part {
        KeyPart::Credential => ":public or ",
        KeyPart::Exchange | KeyPart::Axis => "",
    };
    invalid(format!(
        "{name} must be {public}a UTF-8 binary of at most {MAX_KEY_PART_BYTES} bytes, got {}{not_utf8}",
        Unshown(given)
    ))
}

/// A key is `{exchange_id, credential_key, bucket_axis}` or `{exchange_id, credential_key}`.
pub fn not_a_key(given: Shape) -> InvalidInput {
    InvalidInput::new(format!(
        "key must be {{exchange_id, credential_key, bucket_axis}} or {{exchange_id, credential_key}}, got {given}"
    ))
}

/// A number from `min` (included or not) to [`MAX_AMOUNT`], or the message for `what`.
fn amount(what: &str, given: Shape, positive: bool) -> Result<f64, InvalidInput> {
    match given.number() {
        Some(value) if value.is_finite() && value <= MAX_AMOUNT && value > 0.0 => Ok(value),
        Some(value) if !positive && value == 0.0 => Ok(0.0),
        _ => {
            let bound = if positive { "> 0" } else { ">= 0" };
            invalid(format!(
                "{what} must be a finite number {bound} and at most {MAX_AMOUNT_TEXT}, got {given}"
            ))
        }
    }
}

/// A cost is a finite number `>= 0` and at most [`MAX_AMOUNT`].
pub fn cost(given: Shape) -> Result<f64, InvalidInput> {
    amount("cost", given, false)
}

/// `%{capacity: c, refill_per_sec: r}`: both finite, `> 0` and at most [`MAX_AMOUNT`].
pub fn limit(capacity: Shape, refill_per_sec: Shape) -> Result<Limit, InvalidInput> {
    let capacity = amount("capacity", capacity, true)?;
    let refill_per_sec = amount("refill_per_sec", refill_per_sec, true)?;
    Ok(Limit::checked(capacity, refill_per_sec))
}

/// `%{requests: n, period: ms}` (`period` 1000 ms when absent): `n` and `ms` finite,
/// `> 0` and at most [`MAX_AMOUNT`], and so is the refill rate `n / (ms / 1000)`.
pub fn limit_per_period(requests: Shape, period_ms: Option<Shape>) -> Result<Limit, InvalidInput> {
    let requests = amount("requests", requests, true)?;
    let period_ms = match period_ms {
        Some(period_ms) => amount("period", period_ms, true)?,
        None => 1000.0,
    };
    let refill_per_sec = requests / (period_ms / 1000.0);
    amount(
        "refill_per_sec (requests / period)",
        Shape::Float(refill_per_sec),
        true,
    )?;
    Ok(Limit::checked(requests, refill_per_sec))
}

/// What a limit may be.
const NOT_A_LIMIT: &str = "limit must be %{capacity: c, refill_per_sec: r}, \
    %{requests: n, period: ms}, %{requests: n} or nil, got ";

/// A limit is one of three maps, or `nil`.
pub fn not_a_limit(given: Shape) -> InvalidInput {
    InvalidInput::new(format!("{}{given}", NOT_A_LIMIT))
}

/// Which of a limit's keys a map offered as a limit holds.
#[derive(Debug, Clone, Copy, Default)]
pub struct LimitKeys {
    /// `:capacity`
    pub capacity: bool,
    /// `:refill_per_sec`
    pub refill_per_sec: bool,
    /// `:requests`
    pub requests: bool,
    /// `:period`
    pub period: bool,
}

/// A map of `size` keys that is no limit. One of at most 2 keys is described by the limit
/// keys it holds and how many others (a misspelt key shows); a larger one, which no limit
/// is, by its size alone. Other keys are counted, never shown: any term may be one.
pub fn not_a_limit_map(size: usize, keys: LimitKeys) -> InvalidInput {
    if size == 0 || size > 2 {
        return not_a_limit(Shape::Map { size });
    }
    let held: Vec<&str> = [
        (keys.capacity, ":capacity"),
        (keys.refill_per_sec, ":refill_per_sec"),
        (keys.requests, ":requests"),
        (keys.period, ":period"),
    ]
    .into_iter()
    .filter_map(|(held, name)| held.then_some(name))
    .collect();
    let others = size.saturating_sub(held.len());
    let others_text = format!(
        "{} other than :capacity, :refill_per_sec, :requests and :period",
        plural(others, "key", "keys")
    );
    let given = match (held.as_slice(), others) {
        ([], _) => format!("a map of {others_text}"),
        ([only], 0) => format!("a map of {only} alone"),
        ([one], _) => format!("a map of {one} and {others_text}"),
        (held, _) => format!("a map of {}", held.join(" and ")),
    };
    InvalidInput::new(format!("{}{given}", NOT_A_LIMIT))
}

/// Two checks of one key in a single call must share one definition.
pub fn conflicting_definitions(first: &Limit, second: &Limit) -> InvalidInput {
    InvalidInput::new(format!(
        "conflicting bucket definitions for one key in a single check: {} and {}",
        elixir_limit(first),
        elixir_limit(second)
    ))
}

/// An integer from `min` to `max`, or the message for `what`.
fn integer_in(what: &str, given: Shape, min: u64, max: u64) -> Result<u64, InvalidInput> {
    match given.integer() {
        Some(value) if value >= 0 && (min..=max).contains(&(value as u64)) => Ok(value as u64),
        _ => invalid(format!(
            "{what} must be an integer from {min} to {max}, got {given}"
        )),
    }
}

/// A waiter's budget: a positive integer of milliseconds, at most [`MAX_MS`].
pub fn max_wait_ms(given: Shape) -> Result<u64, InvalidInput> {
    integer_in("max_wait_ms", given, 1, MAX_MS)
}

/// How long a pause lasts: an integer of milliseconds from 0 to [`MAX_MS`].
pub fn pause_ms(given: Shape) -> Result<u64, InvalidInput> {
    integer_in("pause (in milliseconds)", given, 0, MAX_MS)
}

/// A pause covers a key, a credential `{exchange_id, credential_key}` or an exchange id.
pub fn not_a_pause_target(given: Shape) -> InvalidInput {
    InvalidInput::new(format!(
        "pause target must be a key, {{exchange_id, credential_key}} or an exchange_id, got {given}"
    ))
}

/// The backoff after `count` consecutive limited replies without a usable wait:
/// [`FIRST_BACKOFF_MS`], doubling with each, at most [`MAX_BACKOFF_MS`].
pub fn backoff_ms(count: u32) -> u64 {
    // The cap is reached long before the shift could overflow.
    (FIRST_BACKOFF_MS << count.min(30)).min(MAX_BACKOFF_MS)
}

/// A backoff counts for a credential, `{exchange_id, credential_key}`.
pub fn not_a_credential(given: Shape) -> InvalidInput {
    InvalidInput::new(format!(
        "credential must be {{exchange_id, credential_key}}, got {given}"
    ))
}

/// A backoff pauses the credential's buckets or the whole exchange's.
pub fn not_a_backoff_scope(given: Shape) -> InvalidInput {
    InvalidInput::new(format!(
        "scope must be :credential or :exchange, got {given}"
    ))
}

/// The booking slack of a table or of a waiter: an integer of milliseconds from 0 to
/// [`MAX_SETTING_MS`].
pub fn booking_slack_ms(given: Shape) -> Result<u64, InvalidInput> {
    integer_in("booking_slack_ms", given, 0, MAX_SETTING_MS)
}

/// What an exchange still allows: a finite number from `-MAX_AMOUNT` to [`MAX_AMOUNT`]
/// (negative when the exchange counted more than its limit).
pub fn allowance(given: Shape) -> Result<f64, InvalidInput> {
    match given.number() {
        Some(value) if value.is_finite() && value.abs() <= MAX_AMOUNT => Ok(value),
        _ => invalid(format!(
            "allowance must be a finite number from -{MAX_AMOUNT_TEXT} to {MAX_AMOUNT_TEXT}, got {given}"
        )),
    }
}

/// The time left of an exchange's window: an integer of milliseconds from 0 to [`MAX_MS`].
pub fn window_left_ms(given: Shape) -> Result<u64, InvalidInput> {
    integer_in("window_left_ms", given, 0, MAX_MS)
}

/// Rows of `busiest`: an integer from 1 to [`MAX_BUSIEST`].
pub fn busiest_count(given: Shape) -> Result<usize, InvalidInput> {
    integer_in("count", given, 1, MAX_BUSIEST as u64).map(|count| count as usize)
}

/// The moment a caller stops waiting for a request's answer, on the clock of the store
/// that runs it: an integer of microseconds from 0 to `i64::MAX`.
pub fn deadline_us(given: Shape) -> Result<u64, InvalidInput> {
    integer_in("deadline_us", given, 0, i64::MAX as u64)
}

/// How long before its hello a client's own start was, when it assumes buckets busy from
/// it: an integer of microseconds from 0 to `i64::MAX`.
pub fn busy_since_us_ago(given: Shape) -> Result<u64, InvalidInput> {
    integer_in("busy_since_us_ago", given, 0, i64::MAX as u64)
}

/// How long the caller of a request with a deadline waits in all: an integer of
/// milliseconds from 1 to [`MAX_MS`].
pub fn timeout_ms(given: Shape) -> Result<u64, InvalidInput> {
    integer_in("timeout_ms", given, 1, MAX_MS)
}

/// The latest moment a request may run, on the store's clock: a quarter of its caller's
/// timeout before the caller stops waiting, for the answer to travel back.
pub fn last_run_us(deadline_us: u64, timeout_ms: u64) -> u64 {
    deadline_us.saturating_sub(timeout_ms.saturating_mul(1000) / 4)
}

/// What a check is told whose answer was about to be sent `late_us` after [`last_run_us`]
/// (its daemon was stopped or starved meanwhile): what it paid was given back.
pub fn answered_too_late(late_us: u64) -> String {
    format!(
        "the daemon could send the answer only {} ms past the last moment the check could \
         run and still be answered within its caller's timeout; what it paid was given back",
        late_us.div_ceil(1000)
    )
}

/// What a request that reached its store after [`last_run_us`] is told: it did nothing.
pub fn past_deadline(late_us: u64) -> String {
    format!(
        "the request reached the daemon {} ms after the last moment it could run and \
         still be answered within its caller's timeout; it was not executed",
        late_us.div_ceil(1000)
    )
}

/// Checks are a proper list of `{key, limit, cost}`.
pub fn not_a_check_list(given: Shape) -> InvalidInput {
    InvalidInput::new(format!(
        "checks must be a list of at most {MAX_CHECKS} {{key, limit, cost}}, got {given}"
    ))
}

/// One element of the checks list must be `{key, limit, cost}`, or `{bucket, cost}` with a
/// bucket of `Bourse.RateLimiter.bucket/3`.
pub fn not_a_check(given: Shape) -> InvalidInput {
    InvalidInput::new(format!(
        "each check must be {{key, limit, cost}} or {{bucket, cost}}, got {given}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_read_as_elixir_writes_them() {
        // Each pair as `inspect/1` prints it (Elixir 1.14, OTP 25).
        for (value, written) in [
            (1.0e13, "10000000000000.0"),
            (1.0e15, "1000000000000000.0"),
            (9_007_199_254_740_994.0, "9007199254740994.0"),
            (1.0e16, "1.0e16"),
            (1.2345678901234568e16, "1.2345678901234568e16"),
            (1.234e17, "1.234e17"),
            (123_456_789.0, "123456789.0"),
            (123_456.5, "123456.5"),
            (1_000_000_000_000_000.5, "1000000000000000.5"),
            (0.1, "0.1"),
            (0.001, "0.001"),
            (0.0001, "0.0001"),
            (0.00012, "1.2e-4"),
            (0.0012345, "0.0012345"),
            (1.0e-5, "1.0e-5"),
            (1.5e-7, "1.5e-7"),
            (-1.0, "-1.0"),
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (-0.5, "-0.5"),
            (2.5, "2.5"),
            (1.0e300, "1.0e300"),
            (5.0e-324, "5.0e-324"),
            (1.7976931348623157e308, "1.7976931348623157e308"),
            (0.30000000000000004, "0.30000000000000004"),
            // Exactly halfway between two shortest candidates: the even one.
            (991_159_222_237_595.0 + 0.25, "991159222237595.2"),
            (-991_159_222_237_595.0 - 0.25, "-991159222237595.2"),
            (991_159_222_237_595.0 + 0.75, "991159222237595.8"),
        ] {
            assert_eq!(elixir_float(value), written, "{value:e}");
        }
    }

    #[test]
    fn shapes_describe_kind_and_size_never_content() {
        for (shape, written) in [
            (
                Shape::Binary { len: 10_485_760 },
                "a binary of 10485760 bytes",
            ),
            (Shape::Binary { len: 1 }, "a binary of 1 byte"),
            (Shape::Binary { len: 0 }, "an empty binary"),
            (Shape::Atom, "an atom"),
            (Shape::Nil, "nil"),
            (Shape::Boolean(true), "true"),
            (Shape::Integer(-1), "-1"),
            (
                Shape::BigInteger,
                "an integer outside the signed 64-bit range",
            ),
            (Shape::Float(-0.5), "-0.5"),
            (Shape::List { len: Some(0) }, "an empty list"),
            (Shape::List { len: Some(2) }, "a list of 2 elements"),
            (
                Shape::List { len: None },
                "a list of more than 1024 elements",
            ),
            (Shape::Tuple { arity: 4 }, "a tuple of 4 elements"),
            (Shape::Map { size: 1 }, "a map of 1 key"),
            (Shape::Pid, "a pid"),
        ] {
            assert_eq!(shape.to_string(), written);
        }
    }

    #[test]
    fn messages_name_the_rule_and_the_shape() {
        let err = cost(Shape::Binary { len: 10_485_760 }).unwrap_err();
        assert_eq!(
            err.message(),
            "cost must be a finite number >= 0 and at most 1.0e12, got a binary of 10485760 bytes"
        );
        let err = key_part(KeyPart::Exchange, Shape::Atom, || true).unwrap_err();
        assert_eq!(
            err.message(),
            "exchange_id must be a UTF-8 binary of at most 1024 bytes, got an atom"
        );
        let err = key_part(KeyPart::Credential, Shape::Binary { len: 2 }, || false).unwrap_err();
        assert_eq!(
            err.message(),
            "credential_key must be :public or a UTF-8 binary of at most 1024 bytes, \
             got a binary of 2 bytes that is not UTF-8"
        );
        for (number, shown) in [
            (Shape::Integer(123_456_789_012_345), "an integer"),
            (Shape::Float(1.5e14), "a float"),
        ] {
            let err = key_part(KeyPart::Credential, number, || true).unwrap_err();
            assert!(err.message().ends_with(&format!("got {shown}")), "{err:?}");
        }
        let err = limit(Shape::Integer(0), Shape::Integer(1)).unwrap_err();
        assert_eq!(
            err.message(),
            "capacity must be a finite number > 0 and at most 1.0e12, got 0"
        );
        let a = Limit::new(10.0, 10.0).unwrap();
        let b = Limit::new(5.0, 1.0).unwrap();
        assert_eq!(
            conflicting_definitions(&a, &b).message(),
            "conflicting bucket definitions for one key in a single check: \
             %{capacity: 10.0, refill_per_sec: 10.0} and %{capacity: 5.0, refill_per_sec: 1.0}"
        );
        let err = max_wait_ms(Shape::Integer(4_294_967_296)).unwrap_err();
        assert_eq!(
            err.message(),
            "max_wait_ms must be an integer from 1 to 4294967295, got 4294967296"
        );
        assert_eq!(
            err.for_exchange(b"okx").for_exchange(b"other").exchange(),
            Some(&b"okx"[..])
        );
    }

    #[test]
    fn a_map_of_at_most_two_keys_that_is_no_limit_names_its_limit_keys() {
        let keys = |capacity, refill_per_sec, requests, period| LimitKeys {
            capacity,
            refill_per_sec,
            requests,
            period,
        };
        let others = "other than :capacity, :refill_per_sec, :requests and :period";
        for (size, held, got) in [
            (
                2,
                keys(true, false, false, false),
                format!("a map of :capacity and 1 key {others}"),
            ),
            (
                1,
                keys(true, false, false, false),
                "a map of :capacity alone".into(),
            ),
            (
                2,
                keys(false, false, false, false),
                format!("a map of 2 keys {others}"),
            ),
            (
                1,
                keys(false, false, false, false),
                format!("a map of 1 key {others}"),
            ),
            (
                2,
                keys(true, false, true, false),
                "a map of :capacity and :requests".into(),
            ),
            (0, keys(false, false, false, false), "an empty map".into()),
            (3, keys(true, true, true, false), "a map of 3 keys".into()),
        ] {
            let message = not_a_limit_map(size, held).message().to_string();
            assert_eq!(message, format!("{NOT_A_LIMIT}{got}"));
        }
    }

    #[test]
    fn bounds_hold_at_their_edges() {
        let part = |len| key_part(KeyPart::Axis, Shape::Binary { len }, || true);
        assert!(part(MAX_KEY_PART_BYTES).is_ok() && part(MAX_KEY_PART_BYTES + 1).is_err());
        assert!(key_part(KeyPart::Credential, Shape::Bitstring, || true).is_err());
        // UTF-8 is asked only within the bound: a longer binary is refused by its size.
        let long = Shape::Binary {
            len: MAX_KEY_PART_BYTES + 1,
        };
        let err = key_part(KeyPart::Axis, long, || panic!("read past the bound")).unwrap_err();
        assert!(err.message().ends_with("got a binary of 1025 bytes"));
        assert!(key_part(KeyPart::Axis, Shape::Binary { len: 1 }, || false).is_err());
        assert_eq!(cost(Shape::Integer(0)), Ok(0.0));
        assert_eq!(cost(Shape::Float(MAX_AMOUNT)), Ok(MAX_AMOUNT));
        for bad in [
            Shape::Float(-0.5),
            Shape::Float(MAX_AMOUNT * 10.0),
            Shape::Float(f64::NAN),
            Shape::Float(f64::INFINITY),
            Shape::BigInteger,
            Shape::Nil,
        ] {
            assert!(cost(bad).is_err(), "{bad:?}");
            assert!(limit(bad, Shape::Integer(1)).is_err(), "{bad:?}");
            assert!(limit(Shape::Integer(1), bad).is_err(), "{bad:?}");
        }
        assert!(limit(Shape::Float(0.0), Shape::Integer(1)).is_err());
        assert_eq!(max_wait_ms(Shape::Integer(MAX_MS as i64)), Ok(MAX_MS));
        for bad in [0, -1, MAX_MS as i64 + 1] {
            assert!(max_wait_ms(Shape::Integer(bad)).is_err());
        }
        assert!(max_wait_ms(Shape::Float(5.0)).is_err());
        assert!(max_wait_ms(Shape::Nil).is_err());
        assert_eq!(pause_ms(Shape::Integer(0)), Ok(0));
        assert!(pause_ms(Shape::Integer(-1)).is_err());
        assert_eq!(allowance(Shape::Integer(-5)), Ok(-5.0));
        assert!(allowance(Shape::Float(-MAX_AMOUNT * 2.0)).is_err());
        assert_eq!(
            busiest_count(Shape::Integer(MAX_BUSIEST as i64)),
            Ok(MAX_BUSIEST)
        );
        assert!(busiest_count(Shape::Integer(0)).is_err());
        assert_eq!(booking_slack_ms(Shape::Integer(0)), Ok(0));
        assert!(booking_slack_ms(Shape::Integer(MAX_SETTING_MS as i64 + 1)).is_err());
        assert!(window_left_ms(Shape::Integer(MAX_MS as i64 + 1)).is_err());
    }

    #[test]
    fn backoffs_double_up_to_their_cap() {
        let steps: Vec<u64> = (0..10).map(backoff_ms).collect();
        assert_eq!(
            steps,
            [1000, 2000, 4000, 8000, 16_000, 32_000, 64_000, 128_000, 256_000, 300_000]
        );
        assert_eq!(backoff_ms(u32::MAX), MAX_BACKOFF_MS);
    }

    #[test]
    fn requests_per_period_normalise_and_bound_the_rate() {
        assert_eq!(
            limit_per_period(Shape::Integer(10), None),
            Limit::new(10.0, 10.0)
        );
        let binance = limit_per_period(Shape::Integer(1200), Some(Shape::Integer(60_000)));
        assert_eq!(binance.unwrap().refill_per_sec(), 20.0);
        // A rate beyond the bound, from two numbers within it.
        assert!(limit_per_period(Shape::Float(1e12), Some(Shape::Float(1e-3))).is_err());
        assert!(limit_per_period(Shape::Integer(1), Some(Shape::Integer(0))).is_err());
    }
}

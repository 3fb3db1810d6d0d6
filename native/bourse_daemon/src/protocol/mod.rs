//! Protocol version 1 (docs/PROTOCOL.md): a frame is read in the connection's codec (JSON,
//! or the external term format a BEAM client chooses in its first `hello`, `etf`), parsed
//! into a typed [`Request`] (`request`, the same parser for both codecs; `etf_check` reads
//! the most common term straight into it when the parser would read it alike), run on the
//! store (this process's table, or Redis) and its answer encoded in the same codec
//! (`answer`).
//! Transports only frame bytes; nothing a client sends can panic.

mod answer;
mod etf;
mod etf_check;
mod owed;
mod repeated_names;
mod request;
mod values;

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicU8, Ordering};
use std::time::{Duration, Instant};

use bourse_core::{rules, InvalidInput, Outcome, Receipt};
use hmac::{Hmac, Mac};
use serde_json::{Map, Value};
use sha2::Sha256;

use crate::store::{LastRun, Memory, Requester, Store, StoreError};
use answer::{encode, error, refused, Answer, Hello, To};
use request::{Owner, Request};

pub const PROTOCOL_VERSION: u64 = 1;
pub const SERVER: &str = concat!("bourse_daemon ", env!("CARGO_PKG_VERSION"));

/// Whether `frame`, a session's first, may change how the next frames are read or
/// served (a `hello` choosing the codec, an `auth`), so that it must be answered before
/// they are read: it names either op, or escapes a character. Any other first frame
/// runs beside the next ones, so that a client that skips the `hello` waits no longer.
pub fn may_set_up(frame: &[u8]) -> bool {
    let names = |word: &[u8]| frame.windows(word.len()).any(|part| part == word);
    names(b"hello") || names(b"auth") || frame.contains(&b'\\')
}

/// The store and what every connection shares.
pub struct Service<S: Store = Memory> {
    store: S,
    /// The transport's frame limit, reported by `hello` so clients can refuse larger requests.
    max_frame_bytes: usize,
    /// The shared secret TCP clients prove (`auth`).
    secret: Option<Vec<u8>>,
    /// Keyed hashing of connections' default owners: a client cannot forge another's.
    owners: RandomState,
    connections: AtomicU64,
    /// The origin of the clock requests' deadlines are on (docs/PROTOCOL.md, "Deadlines").
    epoch: Instant,
    /// Names this process's in-memory table, new at each start (`None` with Redis, whose
    /// buckets outlive the daemon): a client that reconnects learns whether it restarted.
    table: Option<String>,
}

/// The answer to `first`, the first frame of a port whose daemon refused its configuration
/// (`message`, as printed on stderr): an error in the codec a `hello` asked for, with the
/// frame's id, so that the port's owner learns why the daemon exits.
pub fn refusal(first: &[u8], message: &str) -> Vec<u8> {
    let request: Option<Value> = serde_json::from_slice(first).ok();
    let codec = match request.as_ref().map(|r| (&r["op"], &r["codec"])) {
        Some((Value::String(op), Value::String(codec))) if op == "hello" && codec == "etf" => {
            Codec::Etf
        }
        _ => Codec::Json,
    };
    let mut out = Vec::new();
    refused(
        &mut out,
        codec,
        To::Id(request.as_ref().and_then(|r| r.get("id"))),
        message,
    );
    out
}

/// How a connection's frames are encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    /// JSON objects: every connection starts with it.
    Json,
    /// Erlang's external term format, from the answer to a first `hello` that asks for it.
    Etf,
}

impl Codec {
    fn name(self) -> &'static str {
        match self {
            Self::Json => "json",
            Self::Etf => "etf",
        }
    }
}

/// One client connection: its codec, the owner of requests that name none, and whether it
/// proved the secret.
pub struct Session {
    /// 0: JSON, 1: the external term format.
    codec: AtomicU8,
    default_owner: u64,
    /// The nonce its `auth` must answer, while it has not proved the secret.
    nonce: Option<String>,
    /// Whether a `hello` answer carried the nonce.
    nonce_sent: AtomicBool,
    authenticated: AtomicBool,
    /// Set once its client closed the connection: what it sent before is still read, and
    /// only what gives back is run (nobody reads the answers).
    closed_by_client: AtomicBool,
    idle_timeout_ms: Option<u64>,
    frames: AtomicU64,
    owed: owed::Owed,
    /// From its hello's `busy_since_us_ago`: the client's busy start on the daemon's clock
    /// (µs, [`Server::clock_us`]; before the daemon's start, negative), or [`NOT_BUSY`].
    busy_since_us: AtomicI64,
}

/// A session whose client assumes no buckets busy at its start.
const NOT_BUSY: i64 = i64::MIN;

/// Why a request read after its client closed the connection was not run.
const CLOSED_BY_CLIENT: &str = "the client closed the connection; not run";

impl Session {
    /// Numbers the next frame read on this connection (from 1).
    pub fn next_frame(&self) -> u64 {
        self.frames.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Whether requests other than `hello` and `auth` are served.
    pub fn authenticated(&self) -> bool {
        self.authenticated.load(Ordering::Relaxed)
    }

    /// Notes that the client closed the connection (a write found it gone).
    pub fn close_by_client(&self) {
        self.closed_by_client.store(true, Ordering::Relaxed);
    }

    /// Whether the client closed the connection.
    pub fn closed_by_client(&self) -> bool {
        self.closed_by_client.load(Ordering::Relaxed)
    }

    /// Whether a `hello` answer carried the nonce: the client may be proving the secret.
    pub fn nonce_sent(&self) -> bool {
        self.nonce_sent.load(Ordering::Relaxed)
    }

    /// The codec of the frames read from now on, and of the answers written.
    pub fn codec(&self) -> Codec {
        match self.codec.load(Ordering::Relaxed) {
            0 => Codec::Json,
            _ => Codec::Etf,
        }
    }

    /// A `hello`'s `codec`: chosen by the connection's first frame (which transports
    /// answer before they read the next one); any later one must name the codec in use.
    fn choose_codec(&self, number: u64, codec: Codec) -> Result<(), InvalidInput> {
        if number == 1 {
            self.codec
                .store(u8::from(codec == Codec::Etf), Ordering::Relaxed);
            return Ok(());
        }
        match self.codec() {
            current if current == codec => Ok(()),
            current => Err(InvalidInput::new(format!(
                "codec is chosen by a connection's first frame; this one speaks {}",
                current.name()
            ))),
        }
    }
}

/// Why a request got no answer of its own.
enum Failure {
    Invalid(InvalidInput),
    /// Only the store could judge it (conflicting definitions); it counted it already.
    Refused(InvalidInput),
    /// The store cannot be reached: nothing was admitted.
    Unavailable(String),
    Unauthorized(&'static str),
}

impl From<InvalidInput> for Failure {
    fn from(invalid: InvalidInput) -> Self {
        Self::Invalid(invalid)
    }
}

impl From<StoreError> for Failure {
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::Invalid(error) => Self::Refused(error),
            StoreError::Unavailable(message) => Self::Unavailable(message),
        }
    }
}

const UNAUTHORIZED: &str =
    "authenticate first: send auth with the HMAC-SHA256 of the hello's nonce under the shared secret";

impl<S: Store> Service<S> {
    pub fn new(store: S, max_frame_bytes: usize, secret: Option<Vec<u8>>) -> Self {
        Self {
            store,
            max_frame_bytes,
            secret,
            owners: RandomState::new(),
            connections: AtomicU64::new(0),
            epoch: Instant::now(),
            table: (!S::REMOTE).then(random_hex::<16>),
        }
    }

    /// The daemon's monotonic clock, in µs: what `hello` reports and deadlines are on.
    fn clock_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    /// The instant of a moment on [`Self::clock_us`]; `None` past what `Instant` can hold.
    fn instant(&self, clock_us: u64) -> Option<Instant> {
        self.epoch.checked_add(Duration::from_micros(clock_us))
    }

    pub fn store(&self) -> &S {
        &self.store
    }

    /// A new connection, with an owner id of its own. `prove` when it must prove the
    /// secret before anything but `hello` is served.
    pub fn session(&self, prove: bool, idle_timeout_ms: Option<u64>) -> Session {
        let n = self.connections.fetch_add(1, Ordering::Relaxed);
        Session {
            codec: AtomicU8::new(0),
            default_owner: self.owners.hash_one(("connection", n)),
            nonce: prove.then(nonce),
            nonce_sent: AtomicBool::new(false),
            authenticated: AtomicBool::new(!prove),
            closed_by_client: AtomicBool::new(false),
            idle_timeout_ms,
            frames: AtomicU64::new(0),
            owed: owed::Owed::default(),
            busy_since_us: AtomicI64::new(NOT_BUSY),
        }
    }

    /// Answers frame number `number` of `session`, appending one answer in the session's
    /// codec (no framing) to `out`. Every answer carries the request's id when it could be
    /// read, else the frame's number.
    pub async fn handle(&self, session: &Session, number: u64, frame: &[u8], out: &mut Vec<u8>) {
        if session.codec() == Codec::Etf {
            if let Some(check) = etf_check::read(frame) {
                let id = Value::from(check.id);
                let parsed = Ok((check.request, check.last_run_us));
                return self
                    .run(session, number, To::Id(Some(&id)), parsed, out)
                    .await;
            }
        }
        self.read_and_run(session, number, frame, out).await
    }

    /// [`Self::handle`] through the general reader: the frame read into a JSON value, then
    /// parsed.
    async fn read_and_run(&self, session: &Session, number: u64, frame: &[u8], out: &mut Vec<u8>) {
        let read = match session.codec() {
            Codec::Json => read_json(frame),
            Codec::Etf => read_etf(frame),
        };
        let request = match read {
            Ok(request) => request,
            Err((id, invalid)) => {
                let to = id.as_ref().map_or(To::Frame(number), |id| To::Id(Some(id)));
                return self.invalid(session, out, to, &invalid);
            }
        };
        let to = To::Id(request.get("id"));
        let parsed = Request::parse(&request)
            .and_then(|parsed| Ok((parsed, request::last_run_us(&request)?)));
        self.run(session, number, to, parsed, out).await
    }

    /// Runs a request read from frame number `number` (unless it is past its last moment to
    /// run), or answers why it was not read, to `to`.
    async fn run(
        &self,
        session: &Session,
        number: u64,
        to: To<'_>,
        parsed: request::Result<(Request<'_>, Option<u64>)>,
        out: &mut Vec<u8>,
    ) {
        let failure = match parsed {
            // Before the secret is proved, only `hello` and `auth` are looked at further.
            Ok((request, _)) if !session.authenticated() && !request.before_auth() => {
                Failure::Unauthorized(UNAUTHORIZED)
            }
            // Its caller will never read the answer: only a give-back runs (an `unbook`
            // written before a stopped daemon resumed), nothing that pays.
            Ok((request, _)) if session.closed_by_client() && !request.gives_back() => {
                Failure::Unavailable(CLOSED_BY_CLIENT.to_string())
            }
            // Checked right before it runs: a caller told `unavailable` never pays.
            Ok((_, Some(last_run_us))) if self.clock_us() > last_run_us => {
                Failure::Unavailable(rules::past_deadline(self.clock_us() - last_run_us))
            }
            Ok((request, last_run_us)) => {
                let last_run = last_run_us.and_then(|us| self.instant(us));
                let mut receipt = None;
                match self
                    .execute(session, number, request, last_run, &mut receipt)
                    .await
                {
                    Ok(answer) => {
                        let start = out.len();
                        // In the codec chosen by a first `hello`, if it chose one.
                        encode(out, session.codec(), to, answer);
                        if let (Some(receipt), Some(last_run)) = (receipt, last_run) {
                            session.owed.note(start..out.len(), last_run, receipt, to);
                        }
                        return;
                    }
                    Err(failure) => failure,
                }
            }
            Err(invalid) => Failure::Invalid(invalid),
        };
        let codec = session.codec();
        match failure {
            Failure::Invalid(invalid) => self.invalid(session, out, to, &invalid),
            Failure::Refused(invalid) => error(out, codec, to, "invalid_parameters", &invalid),
            Failure::Unavailable(message) => {
                error(out, codec, to, "unavailable", &InvalidInput::new(message))
            }
            Failure::Unauthorized(message) => {
                error(out, codec, to, "unauthorized", &InvalidInput::new(message))
            }
        }
    }

    /// The answer to a frame longer than `max` bytes (`line`: its bytes read so far, when
    /// frames are JSON lines), with the id that leads it if one does; the transport then
    /// closes.
    pub fn frame_too_large(
        &self,
        session: &Session,
        out: &mut Vec<u8>,
        number: u64,
        max: usize,
        line: Option<&[u8]>,
    ) {
        self.count_invalid(session);
        let message = match session.authenticated() {
            true => format!("frame longer than {max} bytes (--max-frame-bytes); closing"),
            false => format!("frame longer than {max} bytes before the secret is proved; closing"),
        };
        let id = line.and_then(leading_id);
        let to = id.as_ref().map_or(To::Frame(number), |id| To::Id(Some(id)));
        error(
            out,
            session.codec(),
            to,
            "frame_too_large",
            &InvalidInput::new(message),
        );
    }

    /// The answer to the frame the stream closed in the middle of (`number`): with the id
    /// that leads `line`, its bytes when frames are JSON lines, if one does.
    pub fn truncated_frame(
        &self,
        session: &Session,
        out: &mut Vec<u8>,
        number: u64,
        line: Option<&[u8]>,
    ) {
        let message = "the stream ended in the middle of a frame; it was not executed";
        let invalid = InvalidInput::new(message);
        let id = line.and_then(leading_id);
        let to = id.as_ref().map_or(To::Frame(number), |id| To::Id(Some(id)));
        self.invalid(session, out, to, &invalid);
    }

    /// An `unavailable` error answering no request (the connection is then closed).
    pub fn unavailable(&self, session: &Session, out: &mut Vec<u8>, message: String) {
        let message = InvalidInput::new(message);
        error(out, session.codec(), To::Id(None), "unavailable", &message);
    }

    fn invalid(&self, session: &Session, out: &mut Vec<u8>, to: To, invalid: &InvalidInput) {
        self.count_invalid(session);
        error(out, session.codec(), to, "invalid_parameters", invalid);
    }

    /// Counts malformed input in the store's counters, unless a connection that has not
    /// proved the secret sent it: anyone may connect, and only clients count.
    fn count_invalid(&self, session: &Session) {
        if session.authenticated() {
            self.store.count_invalid();
        }
    }

    /// Runs one valid request, which must not start past `last_run`. On a remote store
    /// each request waits as a task holding this future, the size of its largest arm:
    /// every request but a check awaits its store's future boxed, so that the thousands of
    /// checks waiting while Redis is slow hold about 1.7 KB each, not 5.8.
    async fn execute(
        &self,
        session: &Session,
        number: u64,
        request: Request<'_>,
        last_run: LastRun,
        receipt: &mut Option<Receipt>,
    ) -> Result<Answer, Failure> {
        let store = &self.store;
        Ok(match request {
            Request::Hello {
                codec,
                busy_since_us_ago,
            } => {
                if let Some(codec) = codec {
                    session.choose_codec(number, codec)?;
                }
                if let Some(ago) = busy_since_us_ago {
                    // Both at most i64::MAX: the difference fits.
                    let since = self.clock_us() as i64 - ago as i64;
                    session.busy_since_us.store(since, Ordering::Relaxed);
                }
                self.hello(session)
            }
            Request::Auth { proof, challenge } => {
                Answer::Proved(self.authenticate(session, proof, challenge)?)
            }
            Request::Check {
                checks,
                owner,
                mode,
            } => {
                let requester = self.requester(session, owner);
                // With a deadline, what it pays is noted, should its answer be sent too late.
                let receipted =
                    last_run.and_then(|_| store.check_receipted(requester, &checks, mode));
                if let Some(checked) = receipted {
                    let (outcome, paid) = checked?;
                    *receipt = paid.can_give_back().then_some(paid);
                    return Ok(Answer::Outcome(outcome));
                }
                Answer::Outcome(match checks.as_slice() {
                    [] => Outcome::Admitted,
                    [check] => store.check_rate(requester, *check, mode, last_run).await?,
                    checks => store.check_rates(requester, checks, mode, last_run).await?,
                })
            }
            Request::Unbook { checks, owner } => {
                let requester = self.requester(session, owner);
                Answer::GivenBack(Box::pin(store.unbook(requester, &checks, last_run)).await?)
            }
            Request::Record { key, cost } => {
                // With a deadline, what it debits is noted, as a check's payment is.
                let receipted = last_run.and_then(|_| store.record_receipted(key, cost));
                match receipted {
                    Some(debited) => *receipt = debited.can_give_back().then_some(debited),
                    None => Box::pin(store.record_request(key, cost, last_run)).await?,
                }
                Answer::Done
            }
            Request::GetCost { key } => {
                Answer::Borrowed(Box::pin(store.get_cost(key, last_run)).await?)
            }
            Request::Sync {
                key,
                allowance,
                window_left_ms,
            } => {
                Answer::Taken(Box::pin(store.sync(key, allowance, window_left_ms, last_run)).await?)
            }
            Request::Reset { key } => {
                Box::pin(store.reset(key, last_run)).await?;
                Answer::Done
            }
            Request::ResetExchange { exchange } => {
                Box::pin(store.reset_exchange(exchange, last_run)).await?;
                Answer::Done
            }
            Request::ResetAll => {
                Box::pin(store.reset_all(last_run)).await?;
                Answer::Done
            }
            Request::Pause { target, ms } => {
                Box::pin(store.pause(target, ms, last_run)).await?;
                Answer::Done
            }
            Request::BackOff {
                exchange,
                credential,
                scope,
            } => Answer::Paused(
                Box::pin(store.back_off(exchange, credential, scope, last_run)).await?,
            ),
            Request::ResetBackoff {
                exchange,
                credential,
            } => {
                Box::pin(store.reset_backoff(exchange, credential, last_run)).await?;
                Answer::Done
            }
            Request::Inspect { key } => Answer::Info(Box::pin(store.inspect(key, last_run)).await?),
            Request::Busiest { count } => {
                Answer::Busiest(Box::pin(store.busiest(count, last_run)).await?)
            }
            Request::Stats => Answer::Stats(Box::pin(store.stats(last_run)).await?),
            Request::Sweep => Answer::Swept(store.sweep()),
            Request::GiveBack { of } => Answer::GivenBack(self.give_back_overdue(session, of)),
        })
    }

    /// The answer to a `hello`; carrying the nonce, it marks the nonce sent.
    fn hello(&self, session: &Session) -> Answer {
        let nonce = (!session.authenticated())
            .then(|| session.nonce.clone())
            .flatten();
        if nonce.is_some() {
            session.nonce_sent.store(true, Ordering::Relaxed);
        }
        Answer::Hello(Hello {
            assume_busy_at_start: self.store.config().assume_busy_at_start,
            max_frame_bytes: self.max_frame_bytes,
            nonce,
            idle_timeout_ms: session.idle_timeout_ms,
            clock_us: self.clock_us(),
            table: self.table.clone(),
        })
    }

    /// Checks an `auth` proof: the HMAC-SHA256, under the secret, of the session's nonce.
    /// Once it holds, a client's `challenge` (64 hex digits) is answered with the daemon's
    /// own proof: the HMAC-SHA256 of `daemon <challenge> <nonce>`, which no client proof
    /// (of a nonce alone) can be, so that an impostor without the secret is found out.
    fn authenticate(
        &self,
        session: &Session,
        proof: &str,
        challenge: Option<&str>,
    ) -> Result<Option<String>, Failure> {
        let (Some(secret), Some(nonce)) = (&self.secret, &session.nonce) else {
            // Nothing to prove on this connection.
            return Ok(None);
        };
        let proof = decode_hex(proof).ok_or(Failure::Unauthorized(
            "proof must be 64 hex digits (the HMAC-SHA256 of the hello's nonce)",
        ))?;
        if challenge.is_some_and(|challenge| decode_hex(challenge).is_none()) {
            return Err(Failure::Unauthorized(
                "challenge must be 64 hex digits (32 random bytes)",
            ));
        }
        let mac = || {
            Hmac::<Sha256>::new_from_slice(secret)
                .map_err(|_| Failure::Unauthorized("the daemon's secret is unusable"))
        };
        let mut client = mac()?;
        client.update(nonce.as_bytes());
        client
            .verify_slice(&proof)
            .map_err(|_| Failure::Unauthorized("wrong proof: the secret differs"))?;
        session.authenticated.store(true, Ordering::Relaxed);
        Ok(match challenge {
            None => None,
            Some(challenge) => {
                let mut daemon = mac()?;
                daemon.update(format!("daemon {challenge} {nonce}").as_bytes());
                Some(crate::fingerprint::hex(&daemon.finalize().into_bytes()))
            }
        })
    }

    /// Who sent a check on `session`, naming `owner`.
    fn requester(&self, session: &Session, owner: Owner) -> Requester {
        let since = session.busy_since_us.load(Ordering::Relaxed);
        Requester {
            owner: self.owner(session, owner),
            connection: session.default_owner,
            busy_for: (since != NOT_BUSY).then(|| {
                let busy_for = (self.clock_us() as i64).saturating_sub(since);
                Duration::from_micros(busy_for as u64)
            }),
        }
    }

    /// The booking owner: the connection's own, or a named one. A named owner's id is the
    /// same in every daemon process and version, as its bookings in Redis outlive the daemon
    /// that made them: one restarted, or another on the same Redis, knows their owners.
    fn owner(&self, session: &Session, owner: Owner) -> u64 {
        match owner {
            Owner::Connection => session.default_owner,
            Owner::Named(name) => named_owner(b's', name.as_bytes()),
            Owner::Numbered(n) => named_owner(b'i', &n.to_le_bytes()),
        }
    }
}

/// The id of a named owner: XXH3 (its specification fixes its output) of the name, seeded
/// with its kind.
fn named_owner(kind: u8, name: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(name, u64::from(kind))
}

/// 32 random bytes in hex, for a connection to prove the secret over.
fn nonce() -> String {
    random_hex::<32>()
}

/// `N` random bytes in hex.
fn random_hex<const N: usize>() -> String {
    let mut bytes = [0u8; N];
    // Without the system's randomness, still unique: derived from a keyed hash of the
    // time and a counter (`RandomState` keys come from the OS too).
    if getrandom::fill(&mut bytes).is_err() {
        let state = RandomState::new();
        for (i, chunk) in bytes.chunks_mut(8).enumerate() {
            let word = state.hash_one((i, std::time::SystemTime::now()));
            chunk.copy_from_slice(&word.to_le_bytes()[..chunk.len()]);
        }
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// 64 hex digits (either case) as 32 bytes; `None` for anything else.
fn decode_hex(text: &str) -> Option<Vec<u8>> {
    if text.len() != 64 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

/// What a frame could not be read as: the request's id if it was read, and why.
type Unread = (Option<Value>, InvalidInput);

/// A JSON frame's request object.
fn read_json(frame: &[u8]) -> Result<Map<String, Value>, Unread> {
    if values::too_many_in_json(frame) {
        return Err((id_alone(frame), InvalidInput::new(values::too_many())));
    }
    match serde_json::from_slice::<Value>(frame) {
        Ok(Value::Object(fields)) => match repeated_names::find(frame) {
            None => Ok(fields),
            Some(message) => Err((fields.get("id").cloned(), InvalidInput::new(message))),
        },
        Ok(other) => {
            let message = format!(
                "a request must be a JSON object, got {}",
                request::shape(&other)
            );
            Err((None, InvalidInput::new(message)))
        }
        Err(parse) => Err((leading_id(frame), InvalidInput::new(malformed(&parse)))),
    }
}

/// An external term frame's request map, read as JSON's object.
fn read_etf(frame: &[u8]) -> Result<Map<String, Value>, Unread> {
    match etf::decode_with_id(frame) {
        Ok((Value::Object(fields), _)) if !fields.contains_key("$term") => Ok(fields),
        Ok((other, id)) => {
            let message = format!(
                "a request must be a map of at most {} atom or binary keys, got {}",
                etf::MAX_MAP_KEYS,
                request::shape(&other)
            );
            Err((id, InvalidInput::new(message)))
        }
        Err(unreadable) => Err((unreadable.id, InvalidInput::new(unreadable.message))),
    }
}

/// The `id` of a JSON object too large to read, found without reading the rest: its
/// first top-level member named `"id"`, when that is a number or a string of at most
/// [`owed::MAX_KEPT_ID_BYTES`] bytes as written.
fn id_alone(frame: &[u8]) -> Option<Value> {
    let start = frame.iter().position(|b| !b.is_ascii_whitespace())?;
    if frame[start] != b'{' {
        return None;
    }
    let mut depth = 0usize;
    let mut name_next = false;
    let mut at = start;
    while at < frame.len() {
        match frame[at] {
            b'{' | b'[' => {
                depth += 1;
                name_next = depth == 1;
            }
            b'}' | b']' => depth = depth.checked_sub(1).filter(|&depth| depth > 0)?,
            b',' => name_next = depth == 1,
            b'"' => {
                let end = repeated_names::string_end(frame, at);
                if name_next && &frame[at..=end] == b"\"id\"" {
                    return short_scalar(&frame[end + 1..]);
                }
                name_next = false;
                at = end;
            }
            _ => {}
        }
        at += 1;
    }
    None
}

/// The value after a member's name in `rest`, when it is a number or a string of at most
/// [`owed::MAX_KEPT_ID_BYTES`] bytes as written.
fn short_scalar(rest: &[u8]) -> Option<Value> {
    let rest = rest
        .trim_ascii_start()
        .strip_prefix(b":")?
        .trim_ascii_start();
    let end = match rest.first()? {
        b'"' => repeated_names::string_end(rest, 0) + 1,
        b'-' | b'0'..=b'9' => rest
            .iter()
            .position(|&b| matches!(b, b',' | b'}') || b.is_ascii_whitespace())
            .unwrap_or(rest.len()),
        _ => return None,
    };
    let token = &rest[..end];
    let quotes = if token[0] == b'"' { 2 } else { 0 };
    if token.len() > owed::MAX_KEPT_ID_BYTES + quotes {
        return None;
    }
    serde_json::from_slice(token).ok()
}

/// Describes a frame that is not JSON, without quoting it.
fn malformed(error: &serde_json::Error) -> String {
    let reason = match error.classify() {
        serde_json::error::Category::Eof => "it ends in the middle of a value".to_string(),
        _ => {
            // serde_json's messages name the problem and its position, never the input.
            let text = error.to_string();
            text.split(" at line ").next().unwrap_or(&text).to_string()
        }
    };
    format!("malformed JSON ({reason}, column {})", error.column())
}

/// The id of a frame that is not valid JSON, when its first member is `"id"` with an integer
/// or a short plain string: clients that put the id first have every answer attributed.
fn leading_id(frame: &[u8]) -> Option<Value> {
    let rest = frame.trim_ascii_start().strip_prefix(b"{")?;
    let rest = rest.trim_ascii_start().strip_prefix(b"\"id\"")?;
    let rest = rest
        .trim_ascii_start()
        .strip_prefix(b":")?
        .trim_ascii_start();
    let end = match rest.first()? {
        b'"' => 1 + rest[1..].iter().take(64).position(|&b| b == b'"')? + 1,
        // An integer of at most 40 characters, ended within the frame.
        _ => rest
            .iter()
            .take(41)
            .position(|&b| !(b.is_ascii_digit() || b == b'-'))?,
    };
    let token = rest.get(..end)?;
    // The value ends the member: `56.5`, `12abc` or `5 6` is no integer.
    let after = rest[end..].trim_ascii_start().first()?;
    if token.contains(&b'\\') || !matches!(after, b',' | b'}') {
        return None;
    }
    serde_json::from_slice(token).ok()
}

#[cfg(test)]
mod tests;

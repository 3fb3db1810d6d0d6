//! Sends script calls and commands to Redis, each bounded by the timeout. A call that
//! found the connection lost is sent once more on the fresh connection it triggered (a
//! `checks`, `record` or `back_off` call carries a marker that lets it run only once: sent
//! again, it answers what its first run answered; the other calls may run twice).
//!
//! A call answered `Unavailable` never pays later: each script carries a deadline on the
//! Redis server's own clock ([`ServerClock`]), the earlier of the timeout's and the
//! request's own ([`LastRun`]), and refuses to run past it, so a Redis that was stopped and
//! resumes does not run the work of callers already told it was unavailable, by this
//! daemon or by their own timeout. A `checks` or `record` call that ran in time but whose
//! answer came late (Redis stopped before it wrote the answer) is still read, for
//! [`late_wait`] past the timeout, so that what it paid for callers who stopped waiting is
//! given back, by a call that may run until the end of that window
//! ([`Client::invoke_in_window`]).

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ::redis::{Cmd, ErrorKind, FromRedisValue, RedisError, ServerErrorKind};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::answer::{self, CheckAnswer};
use super::clock::ServerClock;
use super::connection::{self, Connection, ScanNode};
use super::link::Link;
use super::script::{self, Call, Script, Sources};
use crate::store::{LastRun, StoreError, StoreResult};

/// Starts the message of a script that found its deadline passed, before the Redis time.
const LATE: &str = "late:";
/// Script calls in flight at once on the connection; further calls wait their turn (within
/// their timeout), so that a burst does not make every call miss its deadline.
const MAX_IN_FLIGHT: usize = 64;
/// Reading table-wide walks (`SCAN`s of `stats` and `busiest`) at once; a further one
/// waits for one to end (within the timeout), so that a burst of them fails fast instead
/// of crawling on together.
const MAX_WALKS: usize = 4;
/// Calls read past their timeout (`checks` and `record` calls) hold at most this many KiB
/// of their keys and arguments at once, each at least 1 KiB (16,384 lone checks or debits);
/// a further one is dropped unread.
const LATE_KIB: usize = 16 * 1024;

/// How long past the timeout a `checks` or `record` call's answer is still read, on one
/// server: 100 timeouts, at most 30 s. (A cluster's calls end with their timeout: its
/// client sends nothing more on a connection that stalled.) The connection waits for
/// answers as long; the calls waiting so hold at most [`LATE_KIB`].
pub fn late_wait(timeout: Duration) -> Duration {
    (timeout * 100).min(Duration::from_secs(30))
}

/// The connection, the code's forms and what is known of the Redis clock.
pub struct Client {
    link: Link,
    sources: Sources,
    /// Whether calls go as `FCALL`: until Redis turns out to have no functions (before 7.0,
    /// or denied to this user), then as `EVALSHA`.
    functions: AtomicBool,
    clock: ServerClock,
    in_flight: tokio::sync::Semaphore,
    walks: Arc<Semaphore>,
    /// One page of a walk at a time: walks take turns page by page.
    pages: Arc<Semaphore>,
    late: Arc<Semaphore>,
    timeout: Duration,
    /// Where Redis is, as errors name it (`Servers::describe`).
    peer: String,
    /// Whether the daemon was given a password for Redis.
    password_given: bool,
}

impl Client {
    pub fn new(link: Link, peer: String, timeout: Duration, password_given: bool) -> Self {
        Self {
            link,
            peer,
            password_given,
            sources: Sources::new(),
            functions: AtomicBool::new(true),
            clock: ServerClock::new(timeout),
            in_flight: tokio::sync::Semaphore::new(MAX_IN_FLIGHT),
            walks: Arc::new(Semaphore::new(MAX_WALKS)),
            pages: Arc::new(Semaphore::new(1)),
            late: Arc::new(Semaphore::new(LATE_KIB)),
            timeout,
        }
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// A place among the calls read past their timeout for one of `bytes` keys and
    /// arguments whose run marker is `marker`, held until dropped; none when too few are
    /// left. With a place, the marker is kept as long as the answer is read
    /// ([`Self::keep_marker`]).
    pub fn late_place(
        self: &Arc<Self>,
        bytes: usize,
        marker: &[u8],
    ) -> Option<OwnedSemaphorePermit> {
        let kib = u32::try_from(bytes / 1024 + 1).unwrap_or(u32::MAX);
        let place = self.late.clone().try_acquire_many_owned(kib).ok()?;
        let (client, marker) = (Arc::clone(self), marker.to_vec());
        tokio::spawn(async move { client.keep_marker(&marker).await });
        Some(place)
    }

    pub fn is_cluster(&self) -> bool {
        self.link.connection().is_cluster()
    }

    /// Redis could not serve a request, for `reason`: the error names where Redis is.
    pub fn unavailable(&self, reason: impl std::fmt::Display) -> StoreError {
        StoreError::Unavailable(self.located(reason))
    }

    /// `reason`, after where Redis is.
    pub fn located(&self, reason: impl std::fmt::Display) -> String {
        format!("{}: {reason}", self.peer)
    }

    /// No answer came within the timeout.
    pub fn no_answer(&self) -> StoreError {
        StoreError::Unavailable(format!(
            "{} did not answer within {} ms",
            self.peer,
            self.timeout.as_millis()
        ))
    }

    /// A Redis time (µs) that the Redis clock has passed now, unless it was set back since
    /// the answers this daemon saw last (within two windows of `ServerClock`); 0 if
    /// nothing is known of the clock.
    pub fn passed(&self) -> u64 {
        self.clock.at(Instant::now()).unwrap_or(0)
    }

    /// Records the Redis time (µs) a script answered with, just received.
    pub fn observe(&self, redis_us: u64) {
        self.clock.observe(redis_us, Instant::now());
    }

    /// Runs the script, bounded by the timeout: the script is told the latest moment, on
    /// the Redis clock, at which it may still run (no later than `last_run`).
    pub async fn invoke<T: FromRedisValue>(
        &self,
        call: &Call,
        last_run: LastRun,
    ) -> StoreResult<T> {
        self.send(call, Some(last_run), self.timeout).await
    }

    /// [`Self::invoke`], its answer awaited until the end of the answer window
    /// ([`Self::answer_window`]): a `record` call, whose debit is given back when its
    /// answer comes after its caller stopped waiting.
    pub async fn invoke_read_late<T: FromRedisValue>(
        &self,
        call: &Call,
        last_run: LastRun,
    ) -> StoreResult<T> {
        self.send(call, Some(last_run), self.answer_window()).await
    }

    /// Runs the script until the end of the answer window ([`Self::answer_window`]), not
    /// only the timeout, and awaits its answer as long: a `refunds` call, which no caller
    /// waits for, and which gives back only what each bucket would hold without the checks
    /// it names, however late it runs. (A call given up on before the connection wrote it
    /// is never sent.) Its run marker must live as long (a copy sent again on a new
    /// connection may run that much later than the first).
    pub async fn invoke_in_window<T: FromRedisValue>(&self, call: &Call) -> StoreResult<T> {
        self.send(call, None, self.answer_window()).await
    }

    /// Runs the script, its answer awaited `within`: not past `last_run` and the timeout,
    /// or when `last_run` is `None`, until the end of the answer window.
    async fn send<T: FromRedisValue>(
        &self,
        call: &Call,
        last_run: Option<LastRun>,
        within: Duration,
    ) -> StoreResult<T> {
        let started = Instant::now();
        let mut connection = self.link.connection();
        // The latest Redis time the script may run at: by the timeout and the request's
        // last moment, or the end of the answer window.
        let deadline = |clock: &ServerClock| match last_run {
            Some(last_run) => clock.deadline(started, last_run),
            None => clock.at(started + within),
        };
        let answer = self
            .bounded_within(within, self.slot_of(call), async {
                // Never closed: acquiring only waits.
                let turn = self.in_flight.acquire().await;
                let running = async {
                    let deadline = self.on_redis_clock(deadline, &mut connection).await?;
                    self.run(
                        |script: Script<'_>| call.command(script, deadline),
                        call.is_read_only(),
                        &mut connection,
                    )
                    .await
                };
                tokio::pin!(running);
                if within <= self.timeout {
                    return running.await;
                }
                // A call whose answer is read past the timeout gives its turn up then.
                match tokio::time::timeout(self.timeout, &mut running).await {
                    Ok(answer) => answer,
                    Err(_) => {
                        drop(turn);
                        running.await
                    }
                }
            })
            .await;
        self.late(answer, started)
    }

    /// Runs the checks `parts` (each sent at its instant, with its request's last moment to
    /// run, so with its own deadline) as one `checks` call that `marker` lets run once; the
    /// Redis time and each check's answer. Bounded by the timeout, and on one server
    /// [`late_wait`] more: past the timeout, the caller waits only in a
    /// [`Client::late_place`].
    pub async fn invoke_checks(
        &self,
        marker: &[u8],
        parts: &[(Instant, LastRun, &Call)],
    ) -> StoreResult<(u64, Vec<CheckAnswer>)> {
        let started = parts.iter().map(|(sent, _, _)| *sent).min();
        let started = started.unwrap_or_else(Instant::now);
        let mut connection = self.link.connection();
        let slot = parts.first().and_then(|(_, _, call)| self.slot_of(call));
        let answer = self
            .bounded_within(self.answer_window(), slot, async {
                let mut deadlines = Vec::with_capacity(parts.len());
                for (sent, last_run, _) in parts {
                    let deadline = |clock: &ServerClock| clock.deadline(*sent, *last_run);
                    deadlines.push(self.on_redis_clock(deadline, &mut connection).await?);
                }
                let latest = match deadlines.contains(&0) {
                    true => 0,
                    false => deadlines.iter().copied().max().unwrap_or(0),
                };
                let each: Vec<(u64, &Call)> = deadlines
                    .into_iter()
                    .zip(parts.iter().map(|(_, _, part)| *part))
                    .collect();
                let lifetime = self.marker_lifetime();
                let command =
                    |script: Script<'_>| script::checks(script, marker, lifetime, latest, &each);
                self.run::<(u64, String)>(command, false, &mut connection)
                    .await
            })
            .await;
        let (now, text) = self.late(answer, started)?;
        Ok((now, answer::checks_from(&text)?))
    }

    /// How long a `checks` call's answer is awaited: the timeout, and on one server
    /// [`late_wait`] more.
    pub fn answer_window(&self) -> Duration {
        match self.is_cluster() {
            true => self.timeout,
            false => self.timeout + late_wait(self.timeout),
        }
    }

    /// How long a call's run marker lives: past any resend of the call, which happens
    /// within the timeout.
    pub fn marker_lifetime(&self) -> Duration {
        self.timeout * 2
    }

    /// The Redis time (µs, 0 for none known) that `time` reads from what is known of the
    /// Redis clock (a deadline: `ServerClock::deadline` or `ServerClock::at`); the clock is
    /// read first while nothing is known of it.
    async fn on_redis_clock(
        &self,
        time: impl Fn(&ServerClock) -> Option<u64>,
        connection: &mut Connection,
    ) -> Result<u64, RedisError> {
        if let Some(time) = time(&self.clock) {
            return Ok(time);
        }
        self.sample_time(connection).await?;
        Ok(time(&self.clock).unwrap_or(0))
    }

    /// Sends a call (`command` writes it for a form of the code) as `fcall` (of the function
    /// that writes nothing when it only reads) while Redis has functions, else (or where a
    /// node lacks the library even after it was loaded) as `evalsha`; each once more on the
    /// fresh connection if the connection was lost.
    async fn run<T: FromRedisValue>(
        &self,
        command: impl Fn(Script) -> Cmd,
        read_only: bool,
        connection: &mut Connection,
    ) -> Result<T, RedisError> {
        if self.functions.load(Ordering::Relaxed) {
            let function = match read_only {
                true => &self.sources.read_only,
                false => &self.sources.function,
            };
            let fcall = command(Script::Function(function));
            let load = || load_library(&self.sources);
            let answer = match loading(&fcall, no_function, load, connection).await {
                Err(error) if lost_connection(&error) => {
                    loading(&fcall, no_function, load, connection).await
                }
                answer => answer,
            };
            match answer {
                Err(error) if lacks_functions(&error) => {
                    self.functions.store(false, Ordering::Relaxed)
                }
                Err(error) if no_function(&error) => {}
                // A Redis out of memory refuses to load the library, not to run a script
                // that only reads.
                Err(error) if read_only && error.code() == Some("OOM") => {}
                answer => return answer,
            }
        }
        let evalsha = command(Script::Sha(&self.sources.sha));
        let load = || load_script(&self.sources);
        match loading(&evalsha, no_script, load, connection).await {
            Err(error) if lost_connection(&error) => {
                loading(&evalsha, no_script, load, connection).await
            }
            // Still missing after the reload on every master known (a replica promoted
            // since): EVAL runs it on that node and caches it there.
            Err(error) if no_script(&error) => {
                command(Script::Source(&self.sources.script))
                    .query_async(connection)
                    .await
            }
            answer => answer,
        }
    }

    /// A call refused by the script for running past its deadline, explained.
    fn late<T>(&self, answer: StoreResult<T>, started: Instant) -> StoreResult<T> {
        if let Err(StoreError::Unavailable(message)) = &answer {
            if let Some(now) = message.strip_prefix(LATE) {
                self.observe(now.parse().unwrap_or(0));
                return Err(late_refusal(started));
            }
        }
        answer
    }

    /// Reads the Redis clock (`TIME`), to place deadlines on it.
    /// Sent once more if the connection was lost, as scripts are.
    async fn sample_time(&self, connection: &mut Connection) -> Result<(), RedisError> {
        let time = ::redis::cmd("TIME");
        let (seconds, micros): (u64, u64) = match time.query_async(connection).await {
            Err(error) if lost_connection(&error) => time.query_async(connection).await?,
            answer => answer?,
        };
        self.observe(seconds * 1_000_000 + micros);
        Ok(())
    }

    /// Keeps the run marker `marker` of a call whose answer is read past its timeout for
    /// the rest of the answer window: sent again that late on a new connection (the first
    /// lost), the call answers what it did rather than being refused as late. Sent after
    /// the call, on one server only (a cluster's calls end with their timeout); a marker
    /// the call has not written yet is left to its own lifetime.
    async fn keep_marker(&self, marker: &[u8]) {
        if self.is_cluster() {
            return;
        }
        let mut connection = self.link.connection();
        let mut command = ::redis::cmd("PEXPIRE");
        command
            .arg(marker)
            .arg(self.answer_window().as_millis() as u64);
        let keeping = command.query_async::<::redis::Value>(&mut connection);
        let _ = tokio::time::timeout(self.answer_window(), keeping).await;
    }

    /// Sends one command, bounded by the timeout, once more if the connection was lost.
    pub async fn command<T: FromRedisValue>(&self, command: &Cmd) -> StoreResult<T> {
        self.command_within(command, self.timeout).await
    }

    async fn command_within<T: FromRedisValue>(
        &self,
        command: &Cmd,
        within: Duration,
    ) -> StoreResult<T> {
        let mut connection = self.link.connection();
        self.bounded_within(within, None, async {
            match command.query_async(&mut connection).await {
                Err(error) if lost_connection(&error) => command.query_async(&mut connection).await,
                answer => answer,
            }
        })
        .await
    }

    /// Sends one command to `node`, answered by `until`.
    pub async fn command_on<T: FromRedisValue>(
        &self,
        node: &ScanNode,
        command: &Cmd,
        until: Instant,
    ) -> StoreResult<T> {
        let within = until.saturating_duration_since(Instant::now());
        match node {
            ScanNode::Server => self.command_within(command, within).await,
            node => {
                let mut connection = self.link.connection();
                self.bounded_within(within, None, connection.query_on(node, command))
                    .await
            }
        }
    }

    /// When a walk's next step (a place and its first page, or a further page) must be done:
    /// a timeout from now, or the request's last moment to run if earlier; unavailable
    /// once that has passed.
    pub fn walk_step_until(&self, last_run: LastRun) -> StoreResult<Instant> {
        let now = Instant::now();
        let until = last_run.map_or(now + self.timeout, |last| last.min(now + self.timeout));
        if until <= now {
            return Err(self.unavailable(
                "the request's deadline passed before its table-wide walk was done \
                 (a reset may have reset part of its keys)",
            ));
        }
        Ok(until)
    }

    /// A place among the reading walks running, held until dropped; waited for until
    /// `until`.
    pub async fn walk_place(&self, until: Instant) -> StoreResult<OwnedSemaphorePermit> {
        self.walk_permit(&self.walks, until, "(stats, busiest) left no place")
            .await
    }

    /// A walk's turn to work on one page, held until dropped; waited for until `until`.
    pub async fn page_turn(&self, until: Instant) -> StoreResult<OwnedSemaphorePermit> {
        self.walk_permit(
            &self.pages,
            until,
            "(stats, busiest, reset_exchange, reset_all) held the turn",
        )
        .await
    }

    async fn walk_permit(
        &self,
        of: &Arc<Semaphore>,
        until: Instant,
        what: &str,
    ) -> StoreResult<OwnedSemaphorePermit> {
        let started = Instant::now();
        let within = until.saturating_duration_since(started);
        match tokio::time::timeout(within, of.clone().acquire_owned()).await {
            // Never closed.
            Ok(Ok(permit)) => Ok(permit),
            Ok(Err(_)) | Err(_) => Err(self.unavailable(format_args!(
                "other table-wide walks {what} for {} ms",
                started.elapsed().as_millis()
            ))),
        }
    }

    /// The nodes that together hold every key (of `slot`, on a cluster), answered by
    /// `until`.
    pub async fn scan_nodes(
        &self,
        until: Instant,
        slot: Option<u16>,
    ) -> StoreResult<Vec<ScanNode>> {
        let within = until.saturating_duration_since(Instant::now());
        let mut connection = self.link.connection();
        self.bounded_within(within, slot, connection.scan_nodes(slot))
            .await
    }

    /// The hash slot of `call`'s keys on a cluster, where one master's connection can go
    /// silent alone (`Link`); `None` on one server.
    fn slot_of(&self, call: &Call) -> Option<u16> {
        self.is_cluster()
            .then(|| connection::slot(call.first_key()))
    }

    /// `call`, a call in `slot` (`None`: without keys), answered within `within`.
    async fn bounded_within<T>(
        &self,
        within: Duration,
        slot: Option<u16>,
        call: impl Future<Output = Result<T, RedisError>>,
    ) -> StoreResult<T> {
        let started = Instant::now();
        tokio::pin!(call);
        let first = self.timeout.min(within);
        let answer = match tokio::time::timeout(first, &mut call).await {
            Err(_) if first < within => {
                // No answer by the timeout, though the call may wait longer (a late
                // answer's window): the connection may have gone silent.
                self.link.unanswered(slot);
                tokio::time::timeout(within.saturating_sub(started.elapsed()), call).await
            }
            answer => answer,
        };
        match &answer {
            Ok(Ok(_)) => self.link.answered(slot),
            Ok(Err(error)) if error.code() == Some("LATE") => self.link.answered(slot),
            // A connection whose authentication Redis refused is never opened again by the
            // `redis` crate (only after an I/O error): opened here as a silent one is, it
            // is taken once Redis takes the password again.
            Ok(Err(error)) if unauthenticated(error) => self.link.unanswered(slot),
            Ok(Err(_)) => {}
            Err(_) => self.link.unanswered(slot),
        }
        match answer {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(error)) if error.code() == Some("LATE") => Err(StoreError::Unavailable(
                format!("{LATE}{}", error.detail().unwrap_or_default()),
            )),
            // Not Redis's protocol: another server listens there.
            Ok(Err(error)) if error.kind() == ErrorKind::Parse => {
                let first_line = error
                    .to_string()
                    .lines()
                    .next()
                    .unwrap_or_default()
                    .to_owned();
                Err(self.unavailable(format_args!(
                    "its answer is not Redis's protocol ({first_line}); \
                     is a Redis server listening there?"
                )))
            }
            Ok(Err(error)) => Err(self.unavailable(
                password_refusal(&error, self.password_given).unwrap_or_else(|| error.to_string()),
            )),
            Err(_) => Err(self.no_answer()),
        }
    }
}

/// Why Redis refused a call, when it refused this daemon's password (`password_given`) or
/// asks for one.
pub(super) fn password_refusal(error: &RedisError, password_given: bool) -> Option<String> {
    let text = error.to_string();
    let first_line = text.lines().next().unwrap_or_default();
    match (unauthenticated(error), password_given) {
        (false, _) => None,
        (true, true) => Some(format!(
            "it refused the password given ({first_line}): is it this Redis's? (a Redis \
             without a password refuses any)"
        )),
        (true, false) => Some(format!(
            "it asks for a password ({first_line}): give it in the Elixir backend's Redis URL \
             (redis://:PASSWORD@host:port) or its password_file, or to the daemon with \
             --redis-password-file or BOURSE_REDIS_PASSWORD"
        )),
    }
}

/// Whether Redis refused a call for want of authentication: a password refused or asked for.
fn unauthenticated(error: &RedisError) -> bool {
    error.kind() == ErrorKind::AuthenticationFailed
        || error.code() == Some("NOAUTH")
        // Redis 7's protocol error for a long command from a client that has not authenticated.
        || error.to_string().contains("unauthenticated")
}

/// What a call that Redis ran past its deadline is told.
pub fn late_refusal(started: Instant) -> StoreError {
    StoreError::Unavailable(format!(
        "redis ran the request after its deadline ({} ms after it was sent); \
         it was refused and nothing was paid",
        started.elapsed().as_millis()
    ))
}

/// Sends `command`; when Redis lacks the code it names (`missing`: Redis restarted, was
/// flushed, failed over) sends `load` (on every master of a cluster) and `command` again.
async fn loading<T: FromRedisValue>(
    command: &Cmd,
    missing: fn(&RedisError) -> bool,
    load: impl FnOnce() -> Cmd,
    connection: &mut Connection,
) -> Result<T, RedisError> {
    match command.query_async(connection).await {
        Err(error) if missing(&error) => {
            load().query_async::<()>(connection).await?;
            command.query_async(connection).await
        }
        answer => answer,
    }
}

fn load_library(sources: &Sources) -> Cmd {
    let mut load = ::redis::cmd("FUNCTION");
    load.arg("LOAD").arg("REPLACE").arg(&sources.library);
    load
}

fn load_script(sources: &Sources) -> Cmd {
    let mut load = ::redis::cmd("SCRIPT");
    load.arg("LOAD").arg(&sources.script);
    load
}

/// Redis has no function library of this name (it restarted, was flushed, failed over).
fn no_function(error: &RedisError) -> bool {
    error.code() == Some("ERR")
        && error
            .detail()
            .is_some_and(|detail| detail.starts_with("Function not found"))
}

/// Redis cannot run functions for this daemon: a version before 7.0 (no `FCALL` or
/// `FUNCTION`), or commands denied to its user.
fn lacks_functions(error: &RedisError) -> bool {
    let detail = error.detail().unwrap_or_default().to_ascii_lowercase();
    match error.code() {
        Some("ERR") => detail.starts_with("unknown command"),
        Some("NOPERM") => detail.contains("'fcall") || detail.contains("'function"),
        _ => false,
    }
}

fn no_script(error: &RedisError) -> bool {
    error.kind() == ErrorKind::Server(ServerErrorKind::NoScript)
}

/// Errors after which the connection manager reconnects: the call may have run, and is sent
/// once more. A reply cut in the middle of its frame (the connection closed there) reads as
/// a parse error.
fn lost_connection(error: &RedisError) -> bool {
    error.is_io_error()
        || error.is_connection_dropped()
        || error.is_connection_refusal()
        || error.kind() == ErrorKind::Parse
}

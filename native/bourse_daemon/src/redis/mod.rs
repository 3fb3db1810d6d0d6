//! The Redis store: buckets shared by every daemon that points at one Redis server.
//!
//! Each operation on a key is one call of `bucket.lua` (loaded once with `SCRIPT LOAD`,
//! called with `EVALSHA`, reloaded on `NOSCRIPT`), which runs the core's bucket atomically
//! on the Redis server's clock (`TIME`): local clocks do not matter. Keys of one exchange
//! share a hash tag, so on Redis Cluster every check within one exchange touches one slot.
//!
//! Every call is bounded by a timeout. When Redis cannot be reached the answer is
//! [`StoreError::Unavailable`] and nothing is admitted; the connection is re-established
//! by the next call. A call answered `Unavailable` never pays later: each script carries
//! a deadline on the Redis server's own clock ([`ServerClock`]) and refuses to run past it,
//! so a Redis that was stopped and resumes does not run the work of callers already told
//! it was unavailable.
//!
//! Credentials never appear in key names: they are replaced by keyed fingerprints
//! ([`Keyed`]); the bucket keeps the displayed fingerprint for `busiest`.

mod clock;
mod connection;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ::redis::{
    ErrorKind, FromRedisValue, RedisError, Script, ScriptInvocation, ServerErrorKind, ToRedisArgs,
};
use bourse_core::{
    coalesce, signature, Check, Config, InvalidInput, KeyInfo, KeyRef, Limit, Mode, Outcome,
    PauseTarget, Stats,
};

use crate::fingerprint::{self, Keyed};
use crate::store::{ShownKey, Store, StoreError, StoreResult};
use clock::ServerClock;
pub use connection::Servers;
use connection::{hash_tag, Connection, ScanNode};

const SCRIPT: &str = include_str!("bucket.lua");
/// Starts the message of a script that found its deadline passed, before the Redis time.
const LATE: &str = "late:";
/// Script calls in flight at once on the connection; further calls wait their turn (within
/// their timeout), so that a burst does not make every call miss its deadline.
const MAX_IN_FLIGHT: usize = 64;
/// Keys asked of each `SCAN` step by table-wide operations.
const SCAN_COUNT: usize = 1000;

/// How to reach Redis and name the keys.
#[derive(Debug, Clone)]
pub struct Options {
    /// One server (`redis://[user@]host:port[/db]`, `unix:///path`) or a cluster's seeds.
    pub servers: Servers,
    pub password: Option<String>,
    /// The key of the fingerprints in key names.
    pub key_secret: Option<Vec<u8>>,
    /// Every key starts with `PREFIX:`; daemons sharing a prefix share their buckets.
    pub prefix: String,
    /// The longest wait for one Redis command (connecting included).
    pub timeout: Duration,
    pub config: Config,
}

/// Counters of the answers this daemon gave; the buckets themselves are in Redis.
#[derive(Default)]
struct Counters {
    admitted: AtomicU64,
    claimed: AtomicU64,
    delayed: AtomicU64,
    booked: AtomicU64,
    over_budget: AtomicU64,
    lapsed: AtomicU64,
    paused: AtomicU64,
    debited: AtomicU64,
    invalid: AtomicU64,
}

fn bump(counter: &AtomicU64, by: u64) {
    counter.fetch_add(by, Ordering::Relaxed);
}

pub struct RedisStore {
    connection: Connection,
    script: Script,
    clock: ServerClock,
    in_flight: tokio::sync::Semaphore,
    names: Keyed,
    prefix: Vec<u8>,
    timeout: Duration,
    config: Config,
    counters: Counters,
}

impl RedisStore {
    /// Prepares the connection without waiting for it: a daemon started while Redis is down
    /// answers `unavailable` until Redis is back. Must run inside a Tokio runtime.
    pub fn new(options: Options) -> Result<Self, String> {
        check_prefix(&options.prefix)?;
        let connection = Connection::open(
            &options.servers,
            options.password.as_deref(),
            options.timeout,
        )?;
        Ok(Self {
            connection,
            script: Script::new(SCRIPT),
            clock: ServerClock::new(options.timeout),
            in_flight: tokio::sync::Semaphore::new(MAX_IN_FLIGHT),
            names: Keyed::new(options.key_secret.as_deref()),
            prefix: options.prefix.into_bytes(),
            timeout: options.timeout,
            config: options.config,
            counters: Counters::default(),
        })
    }

    /// Runs the script, bounded by the timeout: the script is told the latest moment, on
    /// the Redis clock, at which it may still run. A call that found the connection lost is
    /// sent once more on the fresh connection it triggered (with the same deadline).
    async fn invoke<T: FromRedisValue>(&self, call: &Call) -> StoreResult<T> {
        let started = Instant::now();
        let mut connection = self.connection.clone();
        let answer = self
            .bounded(async {
                // Never closed: acquiring only waits.
                let _turn = self.in_flight.acquire().await;
                let deadline = match self.clock.deadline(started) {
                    Some(deadline) => deadline,
                    None => {
                        self.sample_time(&mut connection).await?;
                        self.clock.deadline(started).unwrap_or(0)
                    }
                };
                let invocation = call.invocation(&self.script, deadline);
                match invocation.invoke_async(&mut connection).await {
                    Err(error) if lost_connection(&error) => {
                        invocation.invoke_async(&mut connection).await
                    }
                    // Still missing after the reload on every master known (a replica
                    // promoted since): EVAL runs it on that node and caches it there.
                    Err(error) if error.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                        call.eval(SCRIPT, deadline)
                            .query_async(&mut connection)
                            .await
                    }
                    answer => answer,
                }
            })
            .await;
        if let Err(StoreError::Unavailable(message)) = &answer {
            if let Some(now) = message.strip_prefix(LATE) {
                self.clock.observe(now.parse().unwrap_or(0), Instant::now());
                return Err(StoreError::Unavailable(format!(
                    "redis ran the request after its deadline ({} ms after it was sent); \
                     it was refused and nothing was paid",
                    started.elapsed().as_millis()
                )));
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
        self.clock
            .observe(seconds * 1_000_000 + micros, Instant::now());
        Ok(())
    }

    /// Sends one command, bounded by the timeout, once more if the connection was lost.
    async fn command<T: FromRedisValue>(&self, command: &::redis::Cmd) -> StoreResult<T> {
        let mut connection = self.connection.clone();
        self.bounded(async {
            match command.query_async(&mut connection).await {
                Err(error) if lost_connection(&error) => command.query_async(&mut connection).await,
                answer => answer,
            }
        })
        .await
    }

    async fn bounded<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, RedisError>>,
    ) -> StoreResult<T> {
        match tokio::time::timeout(self.timeout, call).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(error)) if error.code() == Some("LATE") => Err(StoreError::Unavailable(
                format!("{LATE}{}", error.detail().unwrap_or_default()),
            )),
            Ok(Err(error)) => Err(StoreError::Unavailable(format!("redis: {error}"))),
            Err(_) => Err(StoreError::Unavailable(format!(
                "redis did not answer within {} ms",
                self.timeout.as_millis()
            ))),
        }
    }

    fn names(&self, key: &KeyRef) -> KeyNames {
        KeyNames::new(&self.prefix, key, &self.names)
    }

    /// Starts a table-wide `SCAN` of every node holding keys: the server, or each master.
    async fn scan(&self) -> StoreResult<Scan> {
        let mut connection = self.connection.clone();
        let mut nodes = self.bounded(connection.scan_nodes()).await?;
        nodes.reverse();
        Ok(Scan { nodes, cursor: 0 })
    }

    /// The next page of names matching `pattern`, or `None` once every node was scanned.
    async fn scan_step(
        &self,
        scan: &mut Scan,
        pattern: &[u8],
    ) -> StoreResult<Option<Vec<Vec<u8>>>> {
        let Some(node) = scan.nodes.last() else {
            return Ok(None);
        };
        let mut command = ::redis::cmd("SCAN");
        command
            .arg(scan.cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(SCAN_COUNT);
        let (next, names): (u64, Vec<Vec<u8>>) = match node {
            ScanNode::Server => self.command(&command).await?,
            node => {
                let mut connection = self.connection.clone();
                self.bounded(connection.query_on(node, &command)).await?
            }
        };
        scan.cursor = next;
        if next == 0 {
            scan.nodes.pop();
        }
        Ok(Some(names))
    }

    /// Visits every bucket with its snapshot, one `SCAN` page at a time.
    async fn scan_buckets(&self, mut visit: impl FnMut(ShownKey, KeyInfo)) -> StoreResult<()> {
        let mut pattern = self.prefix.clone();
        pattern.extend_from_slice(b":{*");
        let mut scan = self.scan().await?;
        while let Some(names) = self.scan_step(&mut scan, &pattern).await? {
            let keys: Vec<NamedKey> = names
                .iter()
                .filter_map(|name| decode_bucket_name(&self.prefix, name))
                .collect();
            if !keys.is_empty() {
                let names: Vec<KeyNames> = keys
                    .iter()
                    .map(|key| {
                        KeyNames::from_parts(
                            &self.prefix,
                            &key.exchange,
                            key.credential.as_deref(),
                            &key.axis,
                        )
                    })
                    .collect();
                let infos = self.infos(&names).await?;
                for (key, info) in keys.into_iter().zip(infos) {
                    if let Some((info, shown)) = info {
                        let shown = ShownKey {
                            exchange: key.exchange,
                            credential: key
                                .credential
                                .map(|_| shown.unwrap_or_else(|| "key:unknown".into())),
                            axis: key.axis,
                        };
                        visit(shown, info);
                    }
                }
            }
        }
        Ok(())
    }

    /// Snapshots of the keys named `keys` (`None` for a key Redis does not hold), with the
    /// shown fingerprint of their credential. On a cluster one script call per hash tag.
    async fn infos(
        &self,
        keys: &[KeyNames],
    ) -> StoreResult<Vec<Option<(KeyInfo, Option<String>)>>> {
        if !self.connection.is_cluster() {
            return self.infos_in_slot(keys).await;
        }
        let mut slots: BTreeMap<&[u8], Vec<usize>> = BTreeMap::new();
        for (index, names) in keys.iter().enumerate() {
            slots
                .entry(hash_tag(&names.bucket))
                .or_default()
                .push(index);
        }
        let mut infos = vec![None; keys.len()];
        for indices in slots.into_values() {
            let group: Vec<KeyNames> = indices.iter().map(|&i| keys[i].clone()).collect();
            for (index, info) in indices.into_iter().zip(self.infos_in_slot(&group).await?) {
                infos[index] = info;
            }
        }
        Ok(infos)
    }

    /// [`Self::infos`] of keys that share one slot.
    async fn infos_in_slot(
        &self,
        keys: &[KeyNames],
    ) -> StoreResult<Vec<Option<(KeyInfo, Option<String>)>>> {
        let mut call = Call::default();
        call.arg("info");
        for names in keys {
            let names = names.clone();
            call.key(names.bucket)
                .key(names.bookings)
                .key(names.pauses)
                .arg(names.credential_pause)
                .arg(names.key_pause);
        }
        let rows: Vec<Option<Vec<String>>> = self.invoke(&call).await?;
        rows.into_iter()
            .map(|row| row.map(|fields| info_from(&fields)).transpose())
            .collect()
    }

    /// Deletes every key matching `pattern`, one `SCAN` page at a time.
    async fn unlink_matching(&self, pattern: &[u8]) -> StoreResult<()> {
        let mut scan = self.scan().await?;
        while let Some(names) = self.scan_step(&mut scan, pattern).await? {
            if !names.is_empty() {
                let mut unlink = ::redis::cmd("UNLINK");
                unlink.arg(names);
                let _: u64 = self.command(&unlink).await?;
            }
        }
        Ok(())
    }

    /// On a cluster a script runs on the one node serving its slot: a check over buckets of
    /// several exchanges (several hash tags) is refused rather than split, which would not
    /// be atomic.
    fn one_slot(&self, items: &[Check]) -> StoreResult<()> {
        let exchange = items[0].key.exchange;
        if !self.connection.is_cluster() || items.iter().all(|i| i.key.exchange == exchange) {
            return Ok(());
        }
        self.count_invalid();
        Err(StoreError::Invalid(InvalidInput::new(
            "on a Redis Cluster the buckets of one check must all be of one exchange \
             (its keys share one hash tag, so one slot)",
        )))
    }

    fn count_outcome(&self, outcome: Outcome, paused: bool, lapsed: u64) {
        let c = &self.counters;
        bump(&c.lapsed, lapsed);
        bump(&c.paused, u64::from(paused));
        bump(
            match outcome {
                Outcome::Admitted => &c.admitted,
                Outcome::Claimed => &c.claimed,
                Outcome::Delay(_) => &c.delayed,
                Outcome::Booked(_) => &c.booked,
                Outcome::OverBudget(_) => &c.over_budget,
            },
            1,
        );
    }
}

impl Store for RedisStore {
    const REMOTE: bool = true;

    fn config(&self) -> Config {
        self.config
    }

    async fn check_one(&self, owner: u64, check: Check<'_>, mode: Mode) -> StoreResult<Outcome> {
        self.check(owner, &[check], mode).await
    }

    async fn check(&self, owner: u64, checks: &[Check<'_>], mode: Mode) -> StoreResult<Outcome> {
        let items = coalesce(checks).map_err(|error| {
            self.count_invalid();
            StoreError::Invalid(error)
        })?;
        if items.is_empty() {
            return Ok(Outcome::Admitted);
        }
        self.one_slot(&items)?;
        let max_wait = match mode {
            Mode::Probe => 0,
            Mode::Wait { max_wait_ms } => max_wait_ms,
        };
        let mut call = Call::default();
        call.arg("check")
            .arg(format!("{owner}:{}", signature(&items)))
            .arg(max_wait)
            .arg(self.config.booking_slack_ms.saturating_mul(1000))
            .arg(if self.config.assume_busy_at_start {
                "1"
            } else {
                "0"
            })
            .arg(items.len());
        // Items are sorted by exchange: each run of one exchange is a group sharing its
        // pauses and state marker.
        let mut groups: Vec<KeyNames> = Vec::new();
        let mut last_exchange: Option<&[u8]> = None;
        for item in &items {
            let names = self.names(&item.key);
            if last_exchange != Some(item.key.exchange) {
                last_exchange = Some(item.key.exchange);
                groups.push(names.clone());
            }
            call.key(names.bucket)
                .key(names.bookings)
                .arg(item.limit.capacity())
                .arg(item.limit.refill_per_sec())
                .arg(item.cost)
                .arg(groups.len())
                .arg(names.credential_pause)
                .arg(names.key_pause)
                .arg(shown(item.key.credential));
        }
        for group in groups {
            call.key(group.pauses).key(group.marker);
        }
        let (result, ms, paused, lapsed, now): (String, u64, u64, u64, u64) =
            self.invoke(&call).await?;
        self.clock.observe(now, Instant::now());
        let outcome = match result.as_str() {
            "admitted" => Outcome::Admitted,
            "claimed" => Outcome::Claimed,
            "delay" => Outcome::Delay(ms),
            "booked" => Outcome::Booked(ms),
            "over_budget" => Outcome::OverBudget(ms),
            other => {
                return Err(StoreError::Unavailable(format!(
                    "the Redis script answered {other:?}"
                )))
            }
        };
        self.count_outcome(outcome, paused > 0, lapsed);
        Ok(outcome)
    }

    async fn record(&self, key: KeyRef<'_>, cost: f64) -> StoreResult<()> {
        let names = self.names(&key);
        let mut call = Call::default();
        call.key(names.bucket)
            .key(names.bookings)
            .arg("record")
            .arg(cost)
            .arg(shown(key.credential));
        let _: String = self.invoke(&call).await?;
        bump(&self.counters.debited, 1);
        Ok(())
    }

    async fn sync(&self, key: KeyRef<'_>, allowance: f64, window_left_ms: u64) -> StoreResult<f64> {
        let names = self.names(&key);
        let mut call = Call::default();
        call.key(names.bucket)
            .key(names.bookings)
            .arg("sync")
            .arg(allowance)
            .arg(window_left_ms);
        number(&self.invoke::<String>(&call).await?)
    }

    async fn borrowed(&self, key: KeyRef<'_>) -> StoreResult<f64> {
        let mut call = Call::default();
        call.key(self.names(&key).bucket).arg("borrowed");
        number(&self.invoke::<String>(&call).await?)
    }

    async fn inspect(&self, key: KeyRef<'_>) -> StoreResult<Option<KeyInfo>> {
        let mut infos = self.infos(&[self.names(&key)]).await?;
        Ok(infos.pop().flatten().map(|(info, _)| info))
    }

    async fn busiest(&self, count: usize) -> StoreResult<Vec<(ShownKey, KeyInfo)>> {
        let mut rows = Vec::new();
        self.scan_buckets(|key, info| {
            if info.borrowed > 0.0 || info.bookings > 0 {
                rows.push((key, info));
            }
        })
        .await?;
        rows.sort_by(|a, b| b.1.borrowed.total_cmp(&a.1.borrowed));
        rows.truncate(count);
        Ok(rows)
    }

    async fn reset(&self, key: KeyRef<'_>) -> StoreResult<()> {
        let names = self.names(&key);
        let mut call = Call::default();
        call.key(names.bucket)
            .key(names.bookings)
            .key(names.pauses)
            .arg("reset")
            .arg(names.key_pause);
        let _: String = self.invoke(&call).await?;
        Ok(())
    }

    async fn reset_exchange(&self, exchange: &[u8]) -> StoreResult<()> {
        let mut pattern = self.prefix.clone();
        pattern.extend_from_slice(b":{");
        let mut tag = Vec::new();
        part(&mut tag, exchange);
        for &byte in &tag {
            if matches!(byte, b'*' | b'?' | b'[' | b']' | b'\\') {
                pattern.push(b'\\');
            }
            pattern.push(byte);
        }
        pattern.extend_from_slice(b"}:*");
        self.unlink_matching(&pattern).await
    }

    async fn reset_all(&self) -> StoreResult<()> {
        let mut pattern = self.prefix.clone();
        pattern.extend_from_slice(b":{*");
        self.unlink_matching(&pattern).await
    }

    async fn pause(&self, target: PauseTarget, ms: u64) -> StoreResult<()> {
        let (exchange, field) = match &target {
            PauseTarget::Exchange(exchange) => (exchange.as_slice(), b"x".to_vec()),
            PauseTarget::Credential(exchange, credential) => {
                let fingerprint = credential
                    .as_deref()
                    .map(|credential| self.names.of(credential));
                let field = [b"c:".as_slice(), &credential_part(fingerprint.as_deref())].concat();
                (exchange.as_slice(), field)
            }
            PauseTarget::Key(key) => (key.exchange(), self.names(&key.as_ref()).key_pause),
        };
        let mut call = Call::default();
        call.key(pauses_name(&self.prefix, exchange))
            .arg("pause")
            .arg(field)
            .arg(ms);
        let _: String = self.invoke(&call).await?;
        Ok(())
    }

    async fn stats(&self) -> StoreResult<Stats> {
        let c = &self.counters;
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        let mut stats = Stats {
            admitted: load(&c.admitted),
            claimed: load(&c.claimed),
            delayed: load(&c.delayed),
            booked: load(&c.booked),
            over_budget: load(&c.over_budget),
            lapsed: load(&c.lapsed),
            paused: load(&c.paused),
            debited: load(&c.debited),
            invalid: load(&c.invalid),
            buckets: 0,
            bookings: 0,
        };
        self.scan_buckets(|_, info| {
            stats.buckets += 1;
            stats.bookings += info.bookings as u64;
        })
        .await?;
        Ok(stats)
    }

    fn sweep(&self) -> usize {
        // Redis expires idle buckets itself (PEXPIRE on every write).
        0
    }

    fn count_invalid(&self) {
        bump(&self.counters.invalid, 1);
    }
}

/// The keys and arguments of one script call; the first argument names the operation.
/// Where a table-wide `SCAN` stands: the nodes left to scan (the current one last) and the
/// cursor in the current one.
struct Scan {
    nodes: Vec<ScanNode>,
    cursor: u64,
}

#[derive(Default)]
struct Call {
    keys: Vec<Vec<u8>>,
    args: Vec<Vec<u8>>,
}

impl Call {
    fn key(&mut self, key: impl ToRedisArgs) -> &mut Self {
        self.keys.extend(key.to_redis_args());
        self
    }

    fn arg(&mut self, arg: impl ToRedisArgs) -> &mut Self {
        self.args.extend(arg.to_redis_args());
        self
    }

    /// The call as `EVAL` with the script's source, arguments as in [`Self::invocation`]:
    /// it runs, and is cached, on whichever node serves the keys.
    fn eval(&self, source: &str, deadline: u64) -> ::redis::Cmd {
        let mut command = ::redis::cmd("EVAL");
        command.arg(source).arg(self.keys.len()).arg(&self.keys);
        let (op, args) = self
            .args
            .split_first()
            .map_or((&[][..], &[][..]), |(op, args)| (op.as_slice(), args));
        command.arg(op).arg(deadline).arg(args);
        command
    }

    /// The invocation, with `deadline` (µs on the Redis clock, 0 for none) after the
    /// operation: bucket.lua reads it first.
    fn invocation<'a>(&self, script: &'a Script, deadline: u64) -> ScriptInvocation<'a> {
        let mut invocation = script.prepare_invoke();
        for key in &self.keys {
            invocation.key(key);
        }
        let (op, args) = self
            .args
            .split_first()
            .map_or((&[][..], &[][..]), |(op, args)| (op.as_slice(), args));
        invocation.arg(op).arg(deadline);
        for arg in args {
            invocation.arg(arg);
        }
        invocation
    }
}

/// Errors after which the connection manager reconnects.
fn lost_connection(error: &RedisError) -> bool {
    error.is_io_error() || error.is_connection_dropped() || error.is_connection_refusal()
}

/// A prefix names keys and is matched by `SCAN` patterns: plain characters only.
fn check_prefix(prefix: &str) -> Result<(), String> {
    let plain = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':');
    if !prefix.is_empty() && prefix.len() <= 64 && prefix.chars().all(plain) {
        Ok(())
    } else {
        Err(format!(
            "--redis-prefix must be 1 to 64 characters among A-Z a-z 0-9 _ - . :, got {prefix:?}"
        ))
    }
}

/// Appends `<byte length>:<bytes>`: unambiguous whatever the bytes.
fn part(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(bytes.len().to_string().as_bytes());
    out.push(b':');
    out.extend_from_slice(bytes);
}

/// `-` for the public pool, else `h` and the credential's keyed fingerprint (32 hex digits).
fn credential_part(credential: Option<&str>) -> Vec<u8> {
    match credential {
        Some(fingerprint) => [b"h".as_slice(), fingerprint.as_bytes()].concat(),
        None => b"-".to_vec(),
    }
}

/// The fingerprint `busiest` shows for a credential; empty for the public pool.
fn shown(credential: Option<&[u8]>) -> String {
    credential.map(fingerprint::shown).unwrap_or_default()
}

/// `PREFIX:{E}`: the hash tag every key of the exchange starts with.
fn tagged(prefix: &[u8], exchange: &[u8]) -> Vec<u8> {
    let mut name = prefix.to_vec();
    name.extend_from_slice(b":{");
    part(&mut name, exchange);
    name.push(b'}');
    name
}

fn pauses_name(prefix: &[u8], exchange: &[u8]) -> Vec<u8> {
    let mut name = tagged(prefix, exchange);
    name.extend_from_slice(b":p");
    name
}

/// The Redis names of one key's data (see bucket.lua for the layout).
#[derive(Clone)]
struct KeyNames {
    bucket: Vec<u8>,
    bookings: Vec<u8>,
    pauses: Vec<u8>,
    marker: Vec<u8>,
    credential_pause: Vec<u8>,
    key_pause: Vec<u8>,
}

impl KeyNames {
    /// The names of `key`, its credential replaced by its keyed fingerprint.
    fn new(prefix: &[u8], key: &KeyRef, keyed: &Keyed) -> Self {
        let credential = key.credential.map(|credential| keyed.of(credential));
        Self::from_parts(prefix, key.exchange, credential.as_deref(), key.axis)
    }

    /// The names of a key given its credential's keyed fingerprint (`None`: public).
    fn from_parts(prefix: &[u8], exchange: &[u8], credential: Option<&str>, axis: &[u8]) -> Self {
        let mut credential = credential_part(credential);
        let mut suffix = credential.clone();
        suffix.push(b':');
        part(&mut suffix, axis);
        let tag = tagged(prefix, exchange);
        let named = |kind: &[u8]| [tag.as_slice(), kind, &suffix].concat();
        let mut marker = prefix.to_vec();
        marker.extend_from_slice(b":e");
        marker.extend_from_slice(&tag[prefix.len() + 1..]);
        credential.splice(0..0, b"c:".iter().copied());
        Self {
            bucket: named(b":b:"),
            bookings: named(b":w:"),
            pauses: pauses_name(prefix, exchange),
            marker,
            credential_pause: credential,
            key_pause: [b"k:".as_slice(), &suffix].concat(),
        }
    }
}

/// A key as its bucket's name holds it: the credential by its keyed fingerprint.
struct NamedKey {
    exchange: Vec<u8>,
    credential: Option<String>,
    axis: Vec<u8>,
}

/// The key of a bucket's name, or `None` for any other name.
fn decode_bucket_name(prefix: &[u8], name: &[u8]) -> Option<NamedKey> {
    fn take_part<'a>(rest: &mut &'a [u8]) -> Option<&'a [u8]> {
        let colon = rest.iter().position(|&b| b == b':')?;
        let length: usize = std::str::from_utf8(&rest[..colon]).ok()?.parse().ok()?;
        let value = rest.get(colon + 1..colon + 1 + length)?;
        *rest = &rest[colon + 1 + length..];
        Some(value)
    }
    let mut rest = name.strip_prefix(prefix)?.strip_prefix(b":{")?;
    let exchange = take_part(&mut rest)?;
    rest = rest.strip_prefix(b"}:b:")?;
    let credential = match rest.strip_prefix(b"-") {
        Some(after) => {
            rest = after;
            None
        }
        None => {
            let after = rest.strip_prefix(b"h")?;
            let (hex, after) = after.split_at_checked(32)?;
            rest = after;
            Some(std::str::from_utf8(hex).ok()?.to_string())
        }
    };
    rest = rest.strip_prefix(b":")?;
    let axis = take_part(&mut rest)?;
    rest.is_empty().then(|| NamedKey {
        exchange: exchange.to_vec(),
        credential,
        axis: axis.to_vec(),
    })
}

fn number(text: &str) -> StoreResult<f64> {
    text.parse().map_err(|_| {
        StoreError::Unavailable(format!(
            "the Redis script answered a non-number of {} bytes",
            text.len()
        ))
    })
}

/// A snapshot from the script's `info` row (see bucket.lua), and the shown fingerprint of
/// its credential when the bucket holds one.
fn info_from(fields: &[String]) -> StoreResult<(KeyInfo, Option<String>)> {
    let malformed = || StoreError::Unavailable("malformed bucket in Redis".into());
    let [c, r, tokens, borrowed, debt, bookings, booked, next_ready, pause, shown] = fields else {
        return Err(malformed());
    };
    let optional = |text: &String| -> StoreResult<Option<f64>> {
        if text.is_empty() {
            Ok(None)
        } else {
            number(text).map(Some)
        }
    };
    let limit = match (optional(c)?, optional(r)?) {
        (Some(c), Some(r)) => Some(Limit::new(c, r).map_err(|_| malformed())?),
        _ => None,
    };
    let micros_to_ms = |micros: f64| (micros / 1000.0).ceil() as u64;
    let info = KeyInfo {
        limit,
        tokens: number(tokens)?,
        borrowed: number(borrowed)?,
        debt: number(debt)?,
        bookings: bookings.parse().map_err(|_| malformed())?,
        booked_cost: number(booked)?,
        next_ready_ms: optional(next_ready)?.map(micros_to_ms),
        pause_ms: optional(pause)?.map(|micros| micros_to_ms(micros).max(1)),
    };
    Ok((info, (!shown.is_empty()).then(|| shown.clone())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limit(c: f64) -> Limit {
        Limit::new(c, 1.0).unwrap()
    }

    /// On a cluster every key one check or pause touches must be in one slot.
    #[test]
    fn every_name_of_an_exchange_shares_one_hash_tag() {
        let keyed = Keyed::new(None);
        for exchange in [&b"binance"[..], b"a}b", b"{x}", b"", b"}{"] {
            let tags: Vec<Vec<u8>> = [
                KeyRef::new(exchange, None, b"ip"),
                KeyRef::new(exchange, Some(b"k1"), b"request"),
                KeyRef::new(exchange, Some(b"}{"), b"{order}"),
            ]
            .iter()
            .flat_map(|key| {
                let names = KeyNames::new(b"bourse", key, &keyed);
                [names.bucket, names.bookings, names.pauses, names.marker]
            })
            .map(|name| hash_tag(&name).to_vec())
            .collect();
            assert!(
                tags.iter().all(|tag| *tag == tags[0]),
                "{:?}: {tags:?}",
                String::from_utf8_lossy(exchange)
            );
        }
    }

    #[test]
    fn names_hold_no_credential_and_are_tagged_by_exchange() {
        let keyed = Keyed::new(None);
        let public = KeyRef::new(b"binance", None, b"ip");
        let secret = KeyRef::new(b"binance", Some(b"SECRET-KEY"), b"ip");
        let a = KeyNames::new(b"bourse", &public, &keyed);
        let b = KeyNames::new(b"bourse", &secret, &keyed);
        let h = keyed.of(b"SECRET-KEY");
        assert_eq!(a.bucket, b"bourse:{7:binance}:b:-:2:ip");
        assert_eq!(
            b.bucket,
            format!("bourse:{{7:binance}}:b:h{h}:2:ip").as_bytes()
        );
        assert_eq!(a.bookings, b"bourse:{7:binance}:w:-:2:ip");
        assert_eq!(a.pauses, b"bourse:{7:binance}:p");
        assert_eq!(a.marker, b"bourse:e{7:binance}");
        assert_eq!(a.key_pause, b"k:-:2:ip");
        assert_eq!(b.credential_pause, format!("c:h{h}").as_bytes());
        for names in [&a, &b] {
            for name in [
                &names.bucket,
                &names.bookings,
                &names.credential_pause,
                &names.key_pause,
            ] {
                assert!(!String::from_utf8_lossy(name).contains("SECRET"));
            }
        }
        // Separators inside the parts cannot make two keys collide.
        let tricky = KeyRef::new(b"a:b", Some(b"}:b:"), b"x:1:y");
        let names = KeyNames::new(b"p", &tricky, &keyed);
        let decoded = decode_bucket_name(b"p", &names.bucket).unwrap();
        assert_eq!(
            (
                decoded.exchange.as_slice(),
                decoded.credential,
                decoded.axis.as_slice()
            ),
            (&b"a:b"[..], Some(keyed.of(b"}:b:")), &b"x:1:y"[..])
        );
        let decoded = decode_bucket_name(b"bourse", &a.bucket).unwrap();
        assert_eq!(decoded.credential, None);
        assert!(decode_bucket_name(b"bourse", &a.bookings).is_none());
        assert!(decode_bucket_name(b"bourse", &a.pauses).is_none());
        assert!(decode_bucket_name(b"other", &a.bucket).is_none());
    }

    #[test]
    fn coalescing_sums_repeated_keys_and_refuses_conflicts() {
        let a = KeyRef::new(b"x", None, b"request");
        let b = KeyRef::new(b"x", Some(b"k"), b"request");
        let check = |key, c, cost| Check {
            key,
            limit: limit(c),
            cost,
        };
        let items =
            coalesce(&[check(b, 5.0, 1.0), check(a, 3.0, 1.0), check(b, 5.0, 2.5)]).unwrap();
        assert_eq!(items.len(), 2);
        assert_eq!((items[0].key, items[0].cost), (a, 1.0));
        assert_eq!((items[1].key, items[1].cost), (b, 3.5));
        let error = coalesce(&[check(a, 3.0, 1.0), check(a, 4.0, 1.0)]).unwrap_err();
        assert!(error.message().contains("conflicting bucket definitions"));
    }

    #[test]
    fn prefixes_are_plain() {
        assert!(check_prefix("bourse").is_ok());
        assert!(check_prefix("team-a:limits.v1").is_ok());
        for bad in ["", "a*", "a{b}", "a b", &"x".repeat(65)] {
            assert!(check_prefix(bad).is_err(), "{bad:?}");
        }
    }
}

//! [`RedisStore`]: each operation of the protocol as calls of `bucket.lua`.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use bourse_core::rules::{BACKOFF_LAPSE_MS, FIRST_BACKOFF_MS, MAX_BACKOFF_MS};
use bourse_core::{
    coalesce, signature, BackoffScope, Busiest, Check, Config, InvalidInput, KeyInfo, KeyRef, Mode,
    Outcome, PauseTarget, Stats,
};

use super::answer::{self, Info};
use super::batch::Batcher;
use super::client::Client;
use super::connection::{self, hash_tag, Connection, Servers};
use super::counters::Counters;
use super::fingerprints::Fingerprints;
use super::link::Link;
use super::names::{self, CredentialNames, KeyNames, KeyParts};
use super::scan::{unlink_matching, Scan};
use super::script::Call;
use super::timer_anchor::TimerAnchor;
use crate::store::{LastRun, Requester, ShownKey, Store, StoreError, StoreResult};

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

pub struct RedisStore {
    client: Arc<Client>,
    checks: Batcher,
    fingerprints: Fingerprints,
    prefix: Vec<u8>,
    config: Config,
    counters: Counters,
    _timer_anchor: TimerAnchor,
}

impl RedisStore {
    /// Prepares the connection without waiting for it: a daemon started while Redis is down
    /// answers `unavailable` until Redis is back. Must run inside a Tokio runtime.
    pub fn new(options: Options) -> Result<Self, String> {
        names::check_prefix(&options.prefix)?;
        let (servers, password, timeout) = (
            options.servers.clone(),
            options.password.clone(),
            options.timeout,
        );
        let link = Link::open(
            move || Connection::open(&servers, password.as_deref(), timeout),
            timeout,
        )?;
        let peer = options.servers.describe();
        let password_given = options.password.is_some();
        let client = Arc::new(Client::new(link, peer, options.timeout, password_given));
        let prefix = options.prefix.into_bytes();
        if options.config.assume_busy_at_start && matches!(options.servers, Servers::One(_)) {
            note_data_since(client.clone(), &prefix);
        }
        Ok(Self {
            checks: Batcher::start(client.clone(), prefix.clone(), options.timeout),
            client,
            fingerprints: Fingerprints::new(options.key_secret.as_deref())?,
            prefix,
            config: options.config,
            counters: Counters::default(),
            _timer_anchor: TimerAnchor::start(options.timeout),
        })
    }

    fn names(&self, key: &KeyRef) -> KeyNames {
        self.names_and_shown(key).0
    }

    /// The names of `key`, and the fingerprint `busiest` shows for its credential (empty
    /// for the public pool).
    fn names_and_shown(&self, key: &KeyRef) -> (KeyNames, String) {
        let found = key
            .credential
            .map(|credential| self.fingerprints.of(credential));
        let keyed = found.as_ref().map(|found| found.keyed.as_str());
        let names = KeyNames::from_parts(&self.prefix, key.exchange, keyed, key.axis);
        (
            names,
            found.map_or_else(String::new, |found| found.shown.clone()),
        )
    }

    fn credential_names(&self, exchange: &[u8], credential: Option<&[u8]>) -> CredentialNames {
        let fingerprint = credential.map(|credential| self.fingerprints.of(credential));
        let fingerprint = fingerprint.as_ref().map(|found| found.keyed.as_str());
        CredentialNames::new(&self.prefix, exchange, fingerprint)
    }

    /// Visits every bucket with its snapshot, one `SCAN` page at a time.
    async fn scan_buckets(
        &self,
        last_run: LastRun,
        mut visit: impl FnMut(ShownKey, KeyInfo),
    ) -> StoreResult<()> {
        let pattern = names::every_key_pattern(&self.prefix);
        let mut scan = Scan::reading(&self.client, last_run).await?;
        while let Some(page) = scan.next_page(&self.client, &pattern).await? {
            let keys: Vec<names::NamedKey> = page
                .names
                .iter()
                .filter_map(|name| names::decode_bucket_name(&self.prefix, name))
                .collect();
            if keys.is_empty() {
                continue;
            }
            let names: Vec<KeyNames> = keys.iter().map(|key| key.names(&self.prefix)).collect();
            let infos = self.infos(&names, last_run).await?;
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
        Ok(())
    }

    /// Snapshots of the keys named `keys`, with the shown fingerprint of their credential.
    /// On a cluster one script call per hash tag.
    async fn infos(&self, keys: &[KeyNames], last_run: LastRun) -> StoreResult<Vec<Info>> {
        if !self.client.is_cluster() {
            return self.infos_in_slot(keys, last_run).await;
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
            for (index, info) in indices
                .into_iter()
                .zip(self.infos_in_slot(&group, last_run).await?)
            {
                infos[index] = info;
            }
        }
        Ok(infos)
    }

    /// [`Self::infos`] of keys that share one slot.
    async fn infos_in_slot(&self, keys: &[KeyNames], last_run: LastRun) -> StoreResult<Vec<Info>> {
        let mut call = Call::read_only();
        call.arg("info");
        for names in keys {
            let names = names.clone();
            call.key(names.bucket)
                .key(names.bookings)
                .key(names.pauses)
                .arg(names.credential_pause)
                .arg(names.key_pause);
        }
        let rows: Vec<Option<Vec<String>>> = self.client.invoke(&call, last_run).await?;
        rows.into_iter()
            .map(|row| row.map(|fields| answer::info_from(&fields)).transpose())
            .collect()
    }

    /// `checks` coalesced (repeated keys charged once at their combined cost), all in one
    /// slot on a cluster; `None` for no check.
    fn one_check<'a>(&self, checks: &[Check<'a>]) -> StoreResult<Option<Vec<Check<'a>>>> {
        let items = coalesce(checks).map_err(|error| {
            self.count_invalid();
            StoreError::Invalid(error)
        })?;
        if items.is_empty() {
            return Ok(None);
        }
        self.one_slot(&items)?;
        Ok(Some(items))
    }

    /// On a cluster a script runs on the one node serving its slot: a check over buckets of
    /// several exchanges (several hash tags) is refused rather than split, which would not
    /// be atomic.
    fn one_slot(&self, items: &[Check]) -> StoreResult<()> {
        let exchange = items[0].key.exchange;
        let other = items.iter().find(|i| i.key.exchange != exchange);
        let Some(other) = other.filter(|_| self.client.is_cluster()) else {
            return Ok(());
        };
        self.count_invalid();
        // Named: the first check of another exchange than the first's.
        Err(StoreError::Invalid(
            InvalidInput::new(
                "on a Redis Cluster the buckets of one check must all be of one exchange \
                 (its keys share one hash tag, so one slot)",
            )
            .for_exchange(other.key.exchange),
        ))
    }

    /// The keys and arguments of one check of `items` (coalesced, in one slot) for
    /// `requester` (see bucket.lua's `checks`), which a `refunds` call repeats.
    fn check_call(&self, requester: Requester, items: &[Check<'_>], mode: Mode) -> Call {
        let (max_wait, slack_ms) = match mode {
            Mode::Probe => (0, None),
            Mode::Wait {
                max_wait_ms,
                booking_slack_ms,
            } => (max_wait_ms, booking_slack_ms),
        };
        // On one server, the record of since when its data is whole ends the check's keys:
        // with `assume_busy_at_start` no exchange's state began before it, and every
        // limiter keeps it.
        let data_since = !self.client.is_cluster();
        // Each item's two keys, its group's two and its seven arguments, with their names.
        let mut call =
            Call::with_capacity(4 * items.len(), 5 + 7 * items.len(), 64 + 384 * items.len());
        call.arg_with(|out| {
            // Writing to a Vec cannot fail.
            let _ = write!(out, "{}:{}", requester.owner, signature(items));
        })
        .arg(max_wait)
        .arg(
            slack_ms
                .unwrap_or(self.config.booking_slack_ms)
                .saturating_mul(1000),
        )
        .arg_with(|out| {
            // `assume_busy_at_start` (1, or 2 with the server's record) or not (0, or 3),
            // then the µs since the requester's own busy start, if it has one.
            out.push(match (self.config.assume_busy_at_start, data_since) {
                (true, false) => b'1',
                (true, true) => b'2',
                (false, false) => b'0',
                (false, true) => b'3',
            });
            if let Some(busy_for) = requester.busy_for {
                let _ = write!(out, " {}", busy_for.as_micros());
            }
        })
        .arg(items.len());
        // Items are sorted by exchange: each run of one exchange is a group sharing its
        // pauses and state marker.
        let mut groups: Vec<&[u8]> = Vec::new();
        for item in items {
            let exchange = item.key.exchange;
            if groups.last() != Some(&exchange) {
                groups.push(exchange);
            }
            let found = item
                .key
                .credential
                .map(|credential| self.fingerprints.of(credential));
            let key = KeyParts {
                prefix: &self.prefix,
                exchange,
                credential: found.as_ref().map(|found| found.keyed.as_str()),
                axis: item.key.axis,
            };
            let shown = found.as_ref().map_or("", |found| found.shown.as_str());
            call.key_with(|out| key.bucket(out))
                .key_with(|out| key.bookings(out))
                .number(item.limit.capacity())
                .number(item.limit.refill_per_sec())
                .number(item.cost)
                .arg(groups.len())
                .arg_with(|out| key.credential_pause(out))
                .arg_with(|out| key.key_pause(out))
                .arg(shown);
        }
        for exchange in groups {
            call.key_with(|out| names::write_pauses(out, &self.prefix, exchange))
                .key_with(|out| names::write_marker(out, &self.prefix, exchange));
        }
        if data_since {
            call.key_with(|out| names::write_data_since(out, &self.prefix));
        }
        call
    }
}

/// Has one server note since when its data is whole, if it has no such record (bucket.lua's
/// `data_since`): from then on, new exchanges are as old as that. Left to the first check
/// of an exchange new to the server when Redis cannot be reached now.
fn note_data_since(client: Arc<Client>, prefix: &[u8]) {
    let mut call = Call::default();
    call.key_with(|out| names::write_data_since(out, prefix))
        .arg("data_since");
    tokio::spawn(async move {
        let _ = client.invoke::<String>(&call, None).await;
    });
}

impl Store for RedisStore {
    const REMOTE: bool = true;

    fn config(&self) -> Config {
        self.config
    }

    async fn check_rate(
        &self,
        requester: Requester,
        check: Check<'_>,
        mode: Mode,
        last_run: LastRun,
    ) -> StoreResult<Outcome> {
        self.check_rates(requester, &[check], mode, last_run).await
    }

    async fn check_rates(
        &self,
        requester: Requester,
        checks: &[Check<'_>],
        mode: Mode,
        last_run: LastRun,
    ) -> StoreResult<Outcome> {
        let Some(items) = self.one_check(checks)? else {
            return Ok(Outcome::Admitted);
        };
        let call = self.check_call(requester, &items, mode);
        let (result, ms, paused, lapsed) = self
            .checks
            .check(call, requester.connection, last_run)
            .await?;
        let outcome = answer::outcome(&result, ms)?;
        self.counters.outcome(outcome, mode, paused > 0, lapsed);
        Ok(outcome)
    }

    async fn unbook(
        &self,
        requester: Requester,
        checks: &[Check<'_>],
        _last_run: LastRun,
    ) -> StoreResult<bool> {
        let Some(items) = self.one_check(checks)? else {
            return Ok(false);
        };
        let call = self.check_call(requester, &items, Mode::Probe);
        self.checks.unbook(&call).await
    }

    async fn record_request(
        &self,
        key: KeyRef<'_>,
        cost: f64,
        last_run: LastRun,
    ) -> StoreResult<()> {
        let (names, shown) = self.names_and_shown(&key);
        let mut call = Call::default();
        call.key(names.bucket)
            .key(names.bookings)
            .arg("record")
            .arg(cost)
            .arg(shown);
        self.checks.record(call, last_run).await?;
        self.counters.debited();
        Ok(())
    }

    async fn sync(
        &self,
        key: KeyRef<'_>,
        allowance: f64,
        window_left_ms: u64,
        last_run: LastRun,
    ) -> StoreResult<f64> {
        let names = self.names(&key);
        let mut call = Call::default();
        call.key(names.bucket)
            .key(names.bookings)
            .arg("sync")
            .arg(allowance)
            .arg(window_left_ms);
        answer::number(&self.client.invoke::<String>(&call, last_run).await?)
    }

    async fn get_cost(&self, key: KeyRef<'_>, last_run: LastRun) -> StoreResult<f64> {
        let mut call = Call::read_only();
        call.key(self.names(&key).bucket).arg("borrowed");
        answer::number(&self.client.invoke::<String>(&call, last_run).await?)
    }

    async fn inspect(&self, key: KeyRef<'_>, last_run: LastRun) -> StoreResult<Option<KeyInfo>> {
        let mut infos = self.infos(&[self.names(&key)], last_run).await?;
        Ok(infos.pop().flatten().map(|(info, _)| info))
    }

    async fn busiest(
        &self,
        count: usize,
        last_run: LastRun,
    ) -> StoreResult<Vec<(ShownKey, KeyInfo)>> {
        let mut busiest = Busiest::new(count);
        self.scan_buckets(last_run, |key, info| busiest.offer(info, || key))
            .await?;
        Ok(busiest.into_rows())
    }

    async fn reset(&self, key: KeyRef<'_>, last_run: LastRun) -> StoreResult<()> {
        let names = self.names(&key);
        let mut call = Call::default();
        call.key(names.bucket)
            .key(names.bookings)
            .key(names.pauses)
            .arg("reset")
            .arg(names.key_pause);
        answer::done(&self.client.invoke::<String>(&call, last_run).await?)
    }

    async fn reset_exchange(&self, exchange: &[u8], last_run: LastRun) -> StoreResult<()> {
        let pattern = names::exchange_pattern(&self.prefix, exchange);
        // Every key of an exchange has its hash tag: on a cluster, one slot's masters.
        let slot = connection::slot(&names::pauses_name(&self.prefix, exchange));
        unlink_matching(&self.client, &pattern, last_run, Some(slot)).await
    }

    async fn reset_all(&self, last_run: LastRun) -> StoreResult<()> {
        let pattern = names::every_key_pattern(&self.prefix);
        unlink_matching(&self.client, &pattern, last_run, None).await
    }

    async fn pause(&self, target: PauseTarget, ms: u64, last_run: LastRun) -> StoreResult<()> {
        let (exchange, field) = match &target {
            PauseTarget::Exchange(exchange) => (exchange.as_slice(), b"x".to_vec()),
            PauseTarget::Credential(exchange, credential) => {
                let names = self.credential_names(exchange, credential.as_deref());
                (exchange.as_slice(), names.pause)
            }
            PauseTarget::Key(key) => (key.exchange(), self.names(&key.as_ref()).key_pause),
        };
        let mut call = Call::default();
        call.key(names::pauses_name(&self.prefix, exchange))
            .arg("pause")
            .arg(field)
            .arg(ms);
        answer::done(&self.client.invoke::<String>(&call, last_run).await?)
    }

    async fn back_off(
        &self,
        exchange: &[u8],
        credential: Option<&[u8]>,
        scope: BackoffScope,
        last_run: LastRun,
    ) -> StoreResult<u64> {
        let (field, counted) = match scope {
            BackoffScope::Credential => {
                let names = self.credential_names(exchange, credential);
                (names.pause, names.backoff)
            }
            BackoffScope::Exchange => (
                b"x".to_vec(),
                names::exchange_backoff_name(&self.prefix, exchange),
            ),
        };
        let mut call = Call::default();
        call.key(names::pauses_name(&self.prefix, exchange))
            .key(counted)
            .arg("back_off")
            .arg(field)
            .arg(FIRST_BACKOFF_MS)
            .arg(MAX_BACKOFF_MS)
            .arg(BACKOFF_LAPSE_MS);
        self.checks.once(&mut call);
        self.client.invoke(&call, last_run).await
    }

    async fn reset_backoff(
        &self,
        exchange: &[u8],
        credential: Option<&[u8]>,
        last_run: LastRun,
    ) -> StoreResult<()> {
        let names = self.credential_names(exchange, credential);
        let mut call = Call::default();
        call.key(names.backoff)
            .key(names::exchange_backoff_name(&self.prefix, exchange))
            .arg("reset_backoff");
        answer::done(&self.client.invoke::<String>(&call, last_run).await?)
    }

    async fn stats(&self, last_run: LastRun) -> StoreResult<Stats> {
        let mut stats = self.counters.stats();
        self.scan_buckets(last_run, |_, info| {
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
        self.counters.invalid();
    }
}

#[cfg(test)]
mod tests {
    use bourse_core::Limit;

    use super::*;

    /// The check groups its items by runs of one exchange: coalescing must sort them.
    #[test]
    fn coalescing_sums_repeated_keys_and_refuses_conflicts() {
        let a = KeyRef::new(b"x", None, b"request");
        let b = KeyRef::new(b"x", Some(b"k"), b"request");
        let check = |key, c, cost| Check {
            key,
            limit: Limit::new(c, 1.0).unwrap(),
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
    /// Each request runs as a task holding the future of `Service::handle` (`--stdio` and
    /// server mode alike); while Redis is slow or stopped thousands wait at once, each for
    /// up to the timeout. 5.8 KB each before the rare requests' futures were boxed.
    #[test]
    fn a_request_waiting_on_redis_holds_a_small_task() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let _context = runtime.enter();
        let store = RedisStore::new(Options {
            servers: Servers::One("redis://127.0.0.1:1".into()),
            password: None,
            key_secret: None,
            prefix: "bourse".into(),
            timeout: Duration::from_secs(1),
            config: Config::default(),
        })
        .unwrap();
        let service = crate::protocol::Service::new(store, 65_536, None);
        let session = service.session(false, None);
        let mut out = Vec::new();
        let task = service.handle(&session, 1, b"{}", &mut out);
        let bytes = std::mem::size_of_val(&task);
        assert!(bytes <= 2048, "a request's task holds {bytes} bytes");
    }
}

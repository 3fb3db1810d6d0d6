//! Where the buckets live. The protocol validates a request once, then runs it on a
//! [`Store`]: the in-memory [`Table`] of this process, or a Redis server shared by many
//! daemons (`crate::redis`).

use std::future::{ready, Future};
use std::time::{Duration, Instant};

use crate::fingerprint;

use bourse_core::{
    BackoffScope, Caller, Check, Clock, Config, InvalidInput, KeyInfo, KeyRef, Mode,
    MonotonicClock, Outcome, PauseTarget, Receipt, Stats, Table,
};

/// A key as answers show it: the credential only by its fingerprint
/// ([`crate::fingerprint::shown`]), `None` for the public pool.
#[derive(Debug, Clone, PartialEq)]
pub struct ShownKey {
    pub exchange: Vec<u8>,
    pub credential: Option<String>,
    pub axis: Vec<u8>,
}

impl ShownKey {
    pub fn of(key: KeyRef) -> Self {
        Self {
            exchange: key.exchange.to_vec(),
            credential: key.credential.map(fingerprint::shown),
            axis: key.axis.to_vec(),
        }
    }
}

/// Who sent a check: the owner of its bookings, the connection it came on (a shared server
/// serves connections in turn) and, for a client that assumes buckets busy at its own start
/// (its hello's `busy_since_us_ago`), how long ago that start was.
#[derive(Debug, Clone, Copy)]
pub struct Requester {
    pub owner: u64,
    pub connection: u64,
    pub busy_for: Option<Duration>,
}

/// Why a store did not carry out a request.
#[derive(Debug)]
pub enum StoreError {
    /// Input only the store could judge (conflicting definitions in one check); already
    /// counted in the store's `invalid` statistic.
    Invalid(InvalidInput),
    /// The store cannot be reached now: nothing was admitted.
    Unavailable(String),
}

pub type StoreResult<T> = Result<T, StoreError>;

/// The last moment a request may start to run (its caller's deadline less the time the
/// answer needs to travel back, docs/PROTOCOL.md "Deadlines"); `None` when it has no
/// deadline. The protocol refuses a request that arrives later; a store that hands the
/// work on (Redis) makes it refuse to run past this moment too.
pub type LastRun = Option<Instant>;

/// Requests of one client (a connection, a port) running at once on a remote store; past
/// it, reading waits. Each holds a few KB until its answer is written, also for a client
/// that reads none.
pub const MAX_RUNNING: usize = 256;

/// The operations of the protocol, on validated input. Every method of a shared store may
/// fail with [`StoreError::Unavailable`]; none of them may hang. Those given a [`LastRun`]
/// do nothing past it.
pub trait Store: Send + Sync + 'static {
    /// Whether answers wait on another server: transports then run each request as a task
    /// of its own and send its answer as soon as it is ready, in any order. The in-memory
    /// table answers at once, in order.
    const REMOTE: bool;

    fn config(&self) -> Config;

    /// Checks one bucket for `requester`.
    fn check_rate(
        &self,
        requester: Requester,
        check: Check<'_>,
        mode: Mode,
        last_run: LastRun,
    ) -> impl Future<Output = StoreResult<Outcome>> + Send;

    /// Checks several buckets all-or-nothing; repeated keys are coalesced, one key with two
    /// definitions is [`StoreError::Invalid`].
    fn check_rates(
        &self,
        requester: Requester,
        checks: &[Check<'_>],
        mode: Mode,
        last_run: LastRun,
    ) -> impl Future<Output = StoreResult<Outcome>> + Send;

    /// Runs a check as [`Store::check_rates`] does, at once, with what it paid, for
    /// [`Store::give_back`]; `None` from a store that takes back a late check's payment
    /// itself (Redis), whose checks run as usual.
    fn check_receipted(
        &self,
        _requester: Requester,
        _checks: &[Check<'_>],
        _mode: Mode,
    ) -> Option<StoreResult<(Outcome, Receipt)>> {
        None
    }

    /// Debits as [`Store::record_request`] does, at once, with what it debited, for
    /// [`Store::give_back`]; `None` from a store that does not take back debits.
    fn record_receipted(&self, _key: KeyRef<'_>, _cost: f64) -> Option<Receipt> {
        None
    }

    /// Takes back what checks and debits paid ([`Store::check_receipted`],
    /// [`Store::record_receipted`]), given in the order they
    /// were paid, each on all its buckets or none (as [`Table::give_back`] does); returns
    /// which it took back.
    fn give_back(&self, receipts: Vec<Receipt>) -> Vec<bool> {
        vec![false; receipts.len()]
    }

    /// Takes back `requester`'s booking of `checks` on each of their buckets where it is the
    /// latest booking held ([`Table::unbook`]): its caller was told the store was
    /// unavailable. Returns whether any bucket got it back.
    fn unbook(
        &self,
        requester: Requester,
        checks: &[Check<'_>],
        last_run: LastRun,
    ) -> impl Future<Output = StoreResult<bool>> + Send;

    fn record_request(
        &self,
        key: KeyRef<'_>,
        cost: f64,
        last_run: LastRun,
    ) -> impl Future<Output = StoreResult<()>> + Send;

    /// Lowers `key`'s tokens to what the exchange still allows; returns the tokens taken.
    fn sync(
        &self,
        key: KeyRef<'_>,
        allowance: f64,
        window_left_ms: u64,
        last_run: LastRun,
    ) -> impl Future<Output = StoreResult<f64>> + Send;

    fn get_cost(
        &self,
        key: KeyRef<'_>,
        last_run: LastRun,
    ) -> impl Future<Output = StoreResult<f64>> + Send;

    fn inspect(
        &self,
        key: KeyRef<'_>,
        last_run: LastRun,
    ) -> impl Future<Output = StoreResult<Option<KeyInfo>>> + Send;

    fn busiest(
        &self,
        count: usize,
        last_run: LastRun,
    ) -> impl Future<Output = StoreResult<Vec<(ShownKey, KeyInfo)>>> + Send;

    fn reset(
        &self,
        key: KeyRef<'_>,
        last_run: LastRun,
    ) -> impl Future<Output = StoreResult<()>> + Send;

    /// Walks the store (Redis) until done or `last_run`: past it, the keys of the pages
    /// done are reset and the answer is unavailable.
    fn reset_exchange(
        &self,
        exchange: &[u8],
        last_run: LastRun,
    ) -> impl Future<Output = StoreResult<()>> + Send;

    /// As [`Store::reset_exchange`], for every key.
    fn reset_all(&self, last_run: LastRun) -> impl Future<Output = StoreResult<()>> + Send;

    fn pause(
        &self,
        target: PauseTarget,
        ms: u64,
        last_run: LastRun,
    ) -> impl Future<Output = StoreResult<()>> + Send;

    /// Counts a limited reply without a usable wait for the credential and pauses `scope`
    /// for its backoff; returns the pause in milliseconds ([`Table::back_off`]).
    fn back_off(
        &self,
        exchange: &[u8],
        credential: Option<&[u8]>,
        scope: BackoffScope,
        last_run: LastRun,
    ) -> impl Future<Output = StoreResult<u64>> + Send;

    /// Forgets the credential's backoff count.
    fn reset_backoff(
        &self,
        exchange: &[u8],
        credential: Option<&[u8]>,
        last_run: LastRun,
    ) -> impl Future<Output = StoreResult<()>> + Send;

    fn stats(&self, last_run: LastRun) -> impl Future<Output = StoreResult<Stats>> + Send;

    /// Drops what behaves as new; may take a while, so transports call it off their
    /// request path. Stores that expire keys themselves drop nothing here.
    fn sweep(&self) -> usize;

    /// Counts a request refused before it reached the store.
    fn count_invalid(&self);
}

/// The bucket table of this process.
pub struct Memory<C: Clock = MonotonicClock> {
    table: Table<C>,
}

impl<C: Clock> Memory<C> {
    pub fn new(table: Table<C>) -> Self {
        Self { table }
    }

    /// The table's caller for `requester`.
    fn caller(requester: Requester) -> Caller {
        let nanos = |busy_for: Duration| u64::try_from(busy_for.as_nanos()).unwrap_or(u64::MAX);
        Caller {
            owner: requester.owner,
            busy_for: requester.busy_for.map(nanos),
        }
    }
}

impl<C: Clock> Store for Memory<C> {
    const REMOTE: bool = false;

    fn config(&self) -> Config {
        self.table.config()
    }

    fn check_rate(
        &self,
        requester: Requester,
        check: Check<'_>,
        mode: Mode,
        _last_run: LastRun,
    ) -> impl Future<Output = StoreResult<Outcome>> + Send {
        ready(Ok(self.table.check_rate(
            Self::caller(requester),
            check,
            mode,
        )))
    }

    fn check_rates(
        &self,
        requester: Requester,
        checks: &[Check<'_>],
        mode: Mode,
        _last_run: LastRun,
    ) -> impl Future<Output = StoreResult<Outcome>> + Send {
        ready(
            self.table
                .check_rates(Self::caller(requester), checks, mode)
                .map_err(StoreError::Invalid),
        )
    }

    fn check_receipted(
        &self,
        requester: Requester,
        checks: &[Check<'_>],
        mode: Mode,
    ) -> Option<StoreResult<(Outcome, Receipt)>> {
        let checked = self
            .table
            .check_rates_receipted(Self::caller(requester), checks, mode);
        Some(checked.map_err(StoreError::Invalid))
    }

    fn record_receipted(&self, key: KeyRef<'_>, cost: f64) -> Option<Receipt> {
        Some(self.table.record_request_receipted(key, cost))
    }

    fn give_back(&self, receipts: Vec<Receipt>) -> Vec<bool> {
        self.table.give_back(receipts)
    }

    fn unbook(
        &self,
        requester: Requester,
        checks: &[Check<'_>],
        _last_run: LastRun,
    ) -> impl Future<Output = StoreResult<bool>> + Send {
        ready(
            self.table
                .unbook(Self::caller(requester), checks)
                .map_err(StoreError::Invalid),
        )
    }

    fn record_request(
        &self,
        key: KeyRef<'_>,
        cost: f64,
        _last_run: LastRun,
    ) -> impl Future<Output = StoreResult<()>> + Send {
        self.table.record_request(key, cost);
        ready(Ok(()))
    }

    fn sync(
        &self,
        key: KeyRef<'_>,
        allowance: f64,
        window_left_ms: u64,
        _last_run: LastRun,
    ) -> impl Future<Output = StoreResult<f64>> + Send {
        ready(Ok(self.table.sync(key, allowance, window_left_ms)))
    }

    fn get_cost(
        &self,
        key: KeyRef<'_>,
        _last_run: LastRun,
    ) -> impl Future<Output = StoreResult<f64>> + Send {
        ready(Ok(self.table.get_cost(key)))
    }

    fn inspect(
        &self,
        key: KeyRef<'_>,
        _last_run: LastRun,
    ) -> impl Future<Output = StoreResult<Option<KeyInfo>>> + Send {
        ready(Ok(self.table.inspect(key)))
    }

    fn busiest(
        &self,
        count: usize,
        _last_run: LastRun,
    ) -> impl Future<Output = StoreResult<Vec<(ShownKey, KeyInfo)>>> + Send {
        let rows = self.table.busiest(count);
        ready(Ok(rows
            .into_iter()
            .map(|(key, info)| (ShownKey::of(key.as_ref()), info))
            .collect()))
    }

    fn reset(
        &self,
        key: KeyRef<'_>,
        _last_run: LastRun,
    ) -> impl Future<Output = StoreResult<()>> + Send {
        self.table.reset(key);
        ready(Ok(()))
    }

    fn reset_exchange(
        &self,
        exchange: &[u8],
        _last_run: LastRun,
    ) -> impl Future<Output = StoreResult<()>> + Send {
        self.table.reset_exchange(exchange);
        ready(Ok(()))
    }

    fn reset_all(&self, _last_run: LastRun) -> impl Future<Output = StoreResult<()>> + Send {
        self.table.reset_all();
        ready(Ok(()))
    }

    fn pause(
        &self,
        target: PauseTarget,
        ms: u64,
        _last_run: LastRun,
    ) -> impl Future<Output = StoreResult<()>> + Send {
        self.table.pause(target, ms);
        ready(Ok(()))
    }

    fn back_off(
        &self,
        exchange: &[u8],
        credential: Option<&[u8]>,
        scope: BackoffScope,
        _last_run: LastRun,
    ) -> impl Future<Output = StoreResult<u64>> + Send {
        ready(Ok(self.table.back_off(exchange, credential, scope)))
    }

    fn reset_backoff(
        &self,
        exchange: &[u8],
        credential: Option<&[u8]>,
        _last_run: LastRun,
    ) -> impl Future<Output = StoreResult<()>> + Send {
        self.table.reset_backoff(exchange, credential);
        ready(Ok(()))
    }

    fn stats(&self, _last_run: LastRun) -> impl Future<Output = StoreResult<Stats>> + Send {
        ready(Ok(self.table.stats()))
    }

    fn sweep(&self) -> usize {
        self.table.sweep()
    }

    fn count_invalid(&self) {
        self.table.count_invalid()
    }
}

//! The connection to Redis, opened again when it stops answering.
//!
//! A connection can go silent for good while Redis is healthy: the cluster client of the
//! `redis` crate can stop sending anything after its connections were cut under load
//! (`CLIENT KILL`, a master killed), and one server's connection reconnects only on an
//! error, not when a middlebox that lost the flow swallows everything and never closes it.
//! Every later call would then wait for its timeout. So when a call gets no answer within
//! the timeout and nothing else was answered for a whole timeout either (on a cluster:
//! nothing in the call's hash slot, since one master's connection can go silent while the
//! others answer), the connection is opened again (at most once per timeout), in the
//! background: it replaces the old one once it has answered a `PING` within the timeout,
//! and is dropped otherwise. A new
//! connection cannot be set up while Redis (or a cluster's master) is silent, stopped say,
//! so the old one, which may still serve the other masters, is kept meanwhile; calls sent
//! on it still get their late answers.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::connection::Connection;

/// Opens a connection (without waiting for it); must run inside a Tokio runtime.
type Open = Arc<dyn Fn() -> Result<Connection, String> + Send + Sync>;

pub struct Link {
    connection: Arc<Mutex<Connection>>,
    open: Open,
    timeout: Duration,
    started: Instant,
    /// When the connection was last opened (ms after `started`).
    opened: AtomicU64,
    /// When Redis last answered (ms after `started`): on a cluster, a call in each hash slot
    /// and, last, a call without a slot; on one server, any call.
    answered: Box<[AtomicU64]>,
}

/// Hash slots of a Redis Cluster.
const SLOTS: usize = 16_384;

impl Link {
    /// Opens the connection with `open`, which opens it again when it stops answering.
    pub fn open(
        open: impl Fn() -> Result<Connection, String> + Send + Sync + 'static,
        timeout: Duration,
    ) -> Result<Self, String> {
        let connection = open()?;
        let entries = if connection.is_cluster() {
            SLOTS + 1
        } else {
            1
        };
        Ok(Self {
            connection: Arc::new(Mutex::new(connection)),
            open: Arc::new(open),
            timeout,
            started: Instant::now(),
            opened: AtomicU64::new(0),
            answered: (0..entries).map(|_| AtomicU64::new(0)).collect(),
        })
    }

    /// The connection, to send on (clones share it).
    pub fn connection(&self) -> Connection {
        self.connection
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Redis answered a call in `slot` (`None`: a call without keys).
    pub fn answered(&self, slot: Option<u16>) {
        self.last_answer(slot)
            .fetch_max(self.now_ms(), Ordering::Relaxed);
    }

    /// A call in `slot` got no answer within the timeout: opens the connection again when
    /// nothing there was answered for a whole timeout, since it was last opened.
    pub fn unanswered(&self, slot: Option<u16>) {
        let opened = self.opened.load(Ordering::Relaxed);
        let last = self.last_answer(slot).load(Ordering::Relaxed).max(opened);
        let now = self.now_ms();
        let silent = now.saturating_sub(last) >= self.timeout.as_millis() as u64;
        if !silent {
            return;
        }
        // One caller opens it; the others see the new time.
        let mine = self
            .opened
            .compare_exchange(opened, now, Ordering::Relaxed, Ordering::Relaxed);
        if mine.is_ok() {
            let (open, current, timeout) = (
                Arc::clone(&self.open),
                Arc::clone(&self.connection),
                self.timeout,
            );
            tokio::spawn(async move {
                let Ok(mut connection) = open() else { return };
                if let Ok(Ok(())) = tokio::time::timeout(timeout, connection.ping()).await {
                    *current.lock().unwrap_or_else(PoisonError::into_inner) = connection;
                }
            });
        }
    }

    fn last_answer(&self, slot: Option<u16>) -> &AtomicU64 {
        match slot {
            Some(slot) if self.answered.len() > SLOTS => &self.answered[usize::from(slot)],
            _ => &self.answered[self.answered.len() - 1],
        }
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }
}

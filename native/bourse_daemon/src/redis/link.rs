//! The connection to Redis, opened again when it stops answering.
//!
//! A connection can go silent for good while Redis is healthy: the cluster client of the
//! `redis` crate can stop sending anything after its connections were cut under load
//! (`CLIENT KILL`, a master killed), and one server's connection reconnects only on an
//! error, not when a middlebox that lost the flow swallows everything and never closes it.
//! Every later call would then wait for its timeout. So when a call gets no answer within
//! the timeout and nothing else was answered for a whole timeout either, the connection is
//! opened again (at most once per timeout), in the background: it replaces the old one
//! once it has answered a `PING` within the timeout, and is dropped otherwise. A new
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
    /// When Redis last answered, or the connection was last opened (ms after `started`).
    answered: AtomicU64,
}

impl Link {
    /// Opens the connection with `open`, which opens it again when it stops answering.
    pub fn open(
        open: impl Fn() -> Result<Connection, String> + Send + Sync + 'static,
        timeout: Duration,
    ) -> Result<Self, String> {
        Ok(Self {
            connection: Arc::new(Mutex::new(open()?)),
            open: Arc::new(open),
            timeout,
            started: Instant::now(),
            answered: AtomicU64::new(0),
        })
    }

    /// The connection, to send on (clones share it).
    pub fn connection(&self) -> Connection {
        self.connection
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Redis answered a call.
    pub fn answered(&self) {
        self.answered.fetch_max(self.now_ms(), Ordering::Relaxed);
    }

    /// A call got no answer within the timeout: opens the connection again when nothing
    /// was answered for a whole timeout.
    pub fn unanswered(&self) {
        let last = self.answered.load(Ordering::Relaxed);
        let now = self.now_ms();
        let silent = now.saturating_sub(last) >= self.timeout.as_millis() as u64;
        if !silent {
            return;
        }
        // One caller opens it; the others see the new time.
        let mine = self
            .answered
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed);
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

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }
}

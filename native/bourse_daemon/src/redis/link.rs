//! The connection to Redis, opened again when it stops answering.
//!
//! A connection can go silent for good while Redis is healthy: the cluster client of the
//! `redis` crate can stop sending anything after its connections were cut under load
//! (`CLIENT KILL`, a master killed), and one server's connection reconnects only on an
//! error, not when a middlebox that lost the flow swallows everything and never closes it.
//! Every later call would then wait for its timeout. So when a call gets no answer within
//! the timeout and nothing else was answered for a whole timeout either (on a cluster:
//! nothing in the call's hash slot, since one master's connection can go silent while the
//! others answer), the connection is opened again, in the background: it replaces the old
//! one once it has answered (asked again for three timeouts; on a cluster, by the master
//! serving the call's slot), and is dropped otherwise (Redis stopped, say: the old one is
//! kept). Calls sent on the old one still get their late answers. On a cluster a master
//! that stays stopped is left behind once its replica took over; the other masters' calls
//! go on either way.
//!
//! A connection whose authentication Redis refused (its password changed, then the
//! connection was cut) is opened again the same way, so that it is taken once Redis takes
//! the password again.
//!
//! While the same silence goes on (nothing answered there since the last reopening), each
//! further reopening waits twice as long as the one before, up to [`MAX_BACKOFF`] timeouts:
//! a master stopped for a minute does not make every daemon open a connection to every
//! other master each timeout.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::connection::Connection;

/// Opens a connection (without waiting for it); must run inside a Tokio runtime.
type Open = Arc<dyn Fn() -> Result<Connection, String> + Send + Sync>;

/// Hash slots of a Redis Cluster.
const SLOTS: usize = 16_384;
/// The longest wait between reopenings for one silence, in timeouts.
const MAX_BACKOFF: u64 = 16;
/// How long a connection opened again is asked for a `PING`, in timeouts.
const REOPEN_WAIT: u32 = 3;

pub struct Link {
    connection: Arc<Mutex<Connection>>,
    open: Open,
    timeout: Duration,
    started: Instant,
    silence: Silence,
}

impl Link {
    /// Opens the connection with `open`, which opens it again when it stops answering.
    pub fn open(
        open: impl Fn() -> Result<Connection, String> + Send + Sync + 'static,
        timeout: Duration,
    ) -> Result<Self, String> {
        let connection = open()?;
        let silence = Silence::new(connection.is_cluster(), timeout.as_millis() as u64);
        Ok(Self {
            connection: Arc::new(Mutex::new(connection)),
            open: Arc::new(open),
            timeout,
            started: Instant::now(),
            silence,
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
        self.silence.answered(slot, self.now_ms());
    }

    /// A call in `slot` got no answer within the timeout, or was refused for want of
    /// authentication: opens the connection again when [`Silence`] says so.
    pub fn unanswered(&self, slot: Option<u16>) {
        if !self.silence.reopens(slot, self.now_ms()) {
            return;
        }
        let (open, current, timeout) = (
            Arc::clone(&self.open),
            Arc::clone(&self.connection),
            self.timeout,
        );
        tokio::spawn(async move {
            let Ok(mut connection) = open() else { return };
            // Asked of the silent slot's master: a new connection that has the same
            // stalled master serves that slot no better, and taken, it held the other
            // masters' calls past their timeout. A cluster's connection is set up once
            // every seed answered or timed out: a seed that stalls (its port still takes
            // connections) takes the first question's whole timeout; the next finds the
            // connection set up without it, the slot's new master once a replica took over.
            let tried = Instant::now();
            while tried.elapsed() < timeout * REOPEN_WAIT {
                if let Ok(Ok(())) = tokio::time::timeout(timeout, connection.ping(slot)).await {
                    *current.lock().unwrap_or_else(PoisonError::into_inner) = connection;
                    return;
                }
            }
        });
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }
}

/// When a silent connection is opened again. Times are ms from any fixed moment.
struct Silence {
    timeout_ms: u64,
    /// When the connection was last opened again.
    opened: AtomicU64,
    /// How long the silence that made the last reopening must go on before the next one.
    backoff_ms: AtomicU64,
    /// When Redis last answered: on a cluster, a call in each hash slot and, last, a call
    /// without a slot; on one server, any call.
    answered: Box<[AtomicU64]>,
}

impl Silence {
    fn new(by_slot: bool, timeout_ms: u64) -> Self {
        let entries = if by_slot { SLOTS + 1 } else { 1 };
        Self {
            timeout_ms,
            opened: AtomicU64::new(0),
            backoff_ms: AtomicU64::new(timeout_ms),
            answered: (0..entries).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    fn answered(&self, slot: Option<u16>, now: u64) {
        self.last_answer(slot).fetch_max(now, Ordering::Relaxed);
    }

    /// Whether a call in `slot` that got no answer within the timeout makes the connection
    /// open again now: nothing there was answered for a timeout, or, when nothing there was
    /// answered since the last reopening either, for the backoff since that reopening. One
    /// caller is told so; the others see the new time.
    fn reopens(&self, slot: Option<u16>, now: u64) -> bool {
        let opened = self.opened.load(Ordering::Relaxed);
        let last = self.last_answer(slot).load(Ordering::Relaxed);
        let (silent, next_backoff) = if last >= opened {
            (now.saturating_sub(last) >= self.timeout_ms, self.timeout_ms)
        } else {
            let backoff = self.backoff_ms.load(Ordering::Relaxed);
            let longest = self.timeout_ms * MAX_BACKOFF;
            (
                now.saturating_sub(opened) >= backoff,
                (backoff * 2).min(longest),
            )
        };
        let mine = silent
            && self
                .opened
                .compare_exchange(opened, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok();
        if mine {
            self.backoff_ms.store(next_backoff, Ordering::Relaxed);
        }
        mine
    }

    fn last_answer(&self, slot: Option<u16>) -> &AtomicU64 {
        match slot {
            Some(slot) if self.answered.len() > SLOTS => &self.answered[usize::from(slot)],
            _ => &self.answered[self.answered.len() - 1],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The times at which calls in `slot`, each unanswered, reopen the connection, one call
    /// every ms from `from` to `to`.
    fn reopenings(silence: &Silence, slot: Option<u16>, from: u64, to: u64) -> Vec<u64> {
        (from..=to)
            .filter(|&now| silence.reopens(slot, now))
            .collect()
    }

    #[test]
    fn a_silence_reopens_after_a_timeout_then_ever_more_rarely() {
        let silence = Silence::new(false, 100);
        silence.answered(None, 1_000);
        assert_eq!(
            reopenings(&silence, None, 1_001, 6_000),
            [1_100, 1_200, 1_400, 1_800, 2_600, 4_200, 5_800]
        );
    }

    #[test]
    fn an_answer_ends_the_silence_and_its_backoff() {
        let silence = Silence::new(false, 100);
        assert_eq!(reopenings(&silence, None, 0, 1_000), [100, 200, 400, 800]);
        silence.answered(None, 1_000);
        assert_eq!(reopenings(&silence, None, 1_001, 1_300), [1_100, 1_200]);
    }

    #[test]
    fn on_a_cluster_one_silent_slot_reopens_while_others_answer() {
        let silence = Silence::new(true, 100);
        silence.answered(Some(7), 1_000);
        for now in 1_000..=1_500 {
            silence.answered(Some(9), now);
        }
        assert_eq!(
            reopenings(&silence, Some(7), 1_001, 1_500),
            [1_100, 1_200, 1_400]
        );
        // A slot that answered since the last reopening starts from a timeout again.
        assert_eq!(
            reopenings(&silence, Some(9), 1_501, 1_900),
            [1_600, 1_700, 1_900]
        );
    }

    #[test]
    fn one_server_counts_every_call_as_one_silence() {
        let silence = Silence::new(false, 100);
        silence.answered(Some(7), 1_000);
        assert!(!silence.reopens(Some(9), 1_099));
        assert!(silence.reopens(None, 1_100));
    }
}

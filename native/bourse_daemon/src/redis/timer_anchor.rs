//! A timer of the runtime kept due within half the timeout, so that the timers of a call
//! wake no thread.
//!
//! A Tokio timer set for earlier than the time driver's next wake unparks the driver: a
//! write to its eventfd, then one more turn of the runtime's loop, even when the thread
//! that sets it is the one running the runtime. Every check sets a few timers of about
//! the timeout, so on an idle runtime each of them did: four writes and a turn more per
//! check of one caller, on the way from its request to Redis. While this timer is due
//! sooner than any of theirs, they set none off.

use std::time::Duration;

use tokio::task::JoinHandle;

/// Its shortest period: a timeout of a few ms does not make an idle daemon wake hundreds
/// of times a second (timers shorter than twice this then wake the driver, as before).
const MIN_PERIOD: Duration = Duration::from_millis(10);

/// Ends its task when dropped.
pub struct TimerAnchor(JoinHandle<()>);

impl TimerAnchor {
    /// Starts it for calls bounded by `timeout`; must run inside a Tokio runtime.
    pub fn start(timeout: Duration) -> Self {
        let period = (timeout / 2).max(MIN_PERIOD);
        Self(tokio::spawn(async move {
            loop {
                tokio::time::sleep(period).await;
            }
        }))
    }
}

impl Drop for TimerAnchor {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::{poll_fn, Future};
    use std::task::Poll;

    /// Write calls this thread made (`syscw` of its I/O accounting).
    fn writes_of_this_thread() -> u64 {
        let io = std::fs::read_to_string("/proc/thread-self/io").expect("I/O accounting");
        io.lines()
            .find_map(|line| line.strip_prefix("syscw: "))
            .and_then(|count| count.trim().parse().ok())
            .expect("syscw")
    }

    /// The writes made while 100 timers of `timeout` are set, each polled once, on a
    /// runtime of this thread, with or without an anchor.
    fn writes_setting_timers(anchored: bool, timeout: Duration) -> u64 {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let _anchor = anchored.then(|| TimerAnchor::start(timeout));
            // The anchor's task runs and sets its timer; the runtime parks once, so its
            // driver learns when it next wakes.
            tokio::task::yield_now().await;
            let before = writes_of_this_thread();
            let mut timers = Vec::new();
            for _ in 0..100 {
                let mut timer = Box::pin(tokio::time::sleep(timeout));
                poll_fn(|cx| {
                    let _pending = timer.as_mut().poll(cx);
                    Poll::Ready(())
                })
                .await;
                timers.push(timer);
            }
            writes_of_this_thread() - before
        })
    }

    #[test]
    fn timers_of_the_timeout_wake_no_driver_while_anchored() {
        let timeout = Duration::from_secs(1);
        let unanchored = writes_setting_timers(false, timeout);
        let anchored = writes_setting_timers(true, timeout);
        assert!(unanchored >= 100, "without it, {unanchored} writes");
        assert!(anchored <= 2, "with it, {anchored} writes");
    }
}

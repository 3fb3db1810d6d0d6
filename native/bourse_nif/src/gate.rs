//! Keeps calls on normal schedulers from waiting behind a long check. A check list run on
//! a dirty scheduler may hold the locks of every shard for milliseconds (1,024 buckets
//! holding 255 bookings each, re-planned behind a pause: about 11 ms); a call on a normal
//! scheduler that needed one of those locks would hold its scheduler that long. While such
//! a check runs, the calls that take shard locks continue on a dirty scheduler instead,
//! and it starts only once those already past the gate have left.

use std::hint::spin_loop;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::thread::yield_now;

/// Counters of calls past the gate, one cache line each, shared by threads whose number
/// falls on the same one.
const SLOTS: usize = 64;

#[repr(align(128))]
struct Slot(AtomicUsize);

static LONG: AtomicUsize = AtomicUsize::new(0);
static SHORT: [Slot; SLOTS] = [const { Slot(AtomicUsize::new(0)) }; SLOTS];
static NEXT_SLOT: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static MY_SLOT: usize = NEXT_SLOT.fetch_add(1, SeqCst) % SLOTS;
}

/// A call on a normal scheduler past the gate: no long check holds shard locks until it
/// is dropped.
pub(crate) struct Short(&'static AtomicUsize);

impl Drop for Short {
    fn drop(&mut self) {
        self.0.fetch_sub(1, SeqCst);
    }
}

/// Lets a call through unless a long check runs or waits to; `None`: continue on a dirty
/// scheduler.
pub(crate) fn short() -> Option<Short> {
    let slot = &SHORT[MY_SLOT.with(|slot| *slot)].0;
    // Counted before looking: a long check either sees it, and waits, or is seen.
    slot.fetch_add(1, SeqCst);
    if LONG.load(SeqCst) > 0 {
        slot.fetch_sub(1, SeqCst);
        return None;
    }
    Some(Short(slot))
}

/// A long check, on a dirty scheduler: calls on normal schedulers stay out of the shards
/// until it is dropped.
pub(crate) struct Long(());

impl Drop for Long {
    fn drop(&mut self) {
        LONG.fetch_sub(1, SeqCst);
    }
}

/// Closes the gate and waits (spinning, then yielding) for the calls past it to leave:
/// each takes a few microseconds, as none waits for a long check's locks.
pub(crate) fn long() -> Long {
    LONG.fetch_add(1, SeqCst);
    for slot in &SHORT {
        let mut spins = 0u32;
        while slot.0.load(SeqCst) > 0 {
            if spins < 1_000 {
                spins += 1;
                spin_loop();
            } else {
                yield_now();
            }
        }
    }
    Long(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::thread;
    use std::time::Duration;

    // One test: the gate is global.
    #[test]
    fn a_long_check_waits_for_the_calls_past_the_gate_and_turns_away_the_others() {
        let passed = short().expect("open");
        let (started, begun) = mpsc::channel();
        let long_check = thread::spawn(move || {
            let long = long();
            started.send(()).unwrap();
            thread::sleep(Duration::from_millis(50));
            drop(long);
        });
        // Closed at once, but the long check waits for the call already past it.
        while LONG.load(SeqCst) == 0 {
            thread::yield_now();
        }
        assert!(short().is_none(), "a call let through beside a long check");
        assert!(begun.recv_timeout(Duration::from_millis(50)).is_err());
        drop(passed);
        begun.recv_timeout(Duration::from_secs(5)).unwrap();
        assert!(short().is_none());
        long_check.join().unwrap();
        assert!(
            short().is_some(),
            "the gate stays closed after the long check"
        );
    }
}

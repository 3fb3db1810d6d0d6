//! `busiest` holds memory for the rows asked (twice), not for every busy key of the table.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use bourse_core::{Check, Config, KeyRef, Limit, ManualClock, Mode, Table};

thread_local! {
    /// Bytes this thread allocated less those it freed, and the most of it so far.
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn grow(bytes: isize) {
    let live = LIVE.with(|live| {
        live.set(live.get() + bytes);
        live.get()
    });
    PEAK.with(|peak| peak.set(peak.get().max(live)));
}

/// The system allocator, counting each thread's bytes live and their peak.
struct Peak;

// SAFETY: every call is passed on to the system allocator unchanged.
unsafe impl GlobalAlloc for Peak {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grow(layout.size() as isize);
        System.alloc(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        grow(-(layout.size() as isize));
        System.dealloc(ptr, layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        grow(new_size as isize - layout.size() as isize);
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static ALLOCATOR: Peak = Peak;

/// What `run` returns, and the most bytes this thread held meanwhile beyond those it held
/// before.
fn peak_bytes<T>(run: impl FnOnce() -> T) -> (T, usize) {
    let before = LIVE.with(Cell::get);
    PEAK.with(|peak| peak.set(before));
    let value = run();
    (value, (PEAK.with(Cell::get) - before) as usize)
}

const BUSY: usize = 20_000;
/// Each key part's bytes: keys of 3 KiB.
const PART: usize = 1024;

#[test]
fn busiest_holds_the_rows_asked_not_every_busy_key() {
    let table = Table::with_clock(Config::default(), ManualClock::new());
    let exchange = vec![b'e'; PART];
    let axis = vec![b'a'; PART];
    let limit = Limit::new(100.0, 1.0).unwrap();
    for i in 0..BUSY {
        let credential = format!("{i:0>width$}", width = PART);
        let check = Check {
            key: KeyRef::new(&exchange, Some(credential.as_bytes()), &axis),
            limit,
            cost: (1 + i % 50) as f64,
        };
        table.check_rate(1, check, Mode::Probe);
    }

    let (one, one_peak) = peak_bytes(|| table.busiest(1));
    let (hundred, hundred_peak) = peak_bytes(|| table.busiest(100));
    assert_eq!(one[0].1.borrowed, 50.0);
    assert_eq!(hundred.len(), 100);
    // Sorting every busy row held more than BUSY keys: 60 MiB. The rows of the shard
    // walked are kept apart, to be forgotten if it is walked again: twice the rows asked.
    let per_row = 4 * PART + 1024;
    assert!(
        one_peak < 16 * 1024 + 2 * per_row,
        "busiest(1) held {one_peak} bytes"
    );
    assert!(
        hundred_peak < 16 * 1024 + 2 * 100 * per_row,
        "busiest(100) held {hundred_peak} bytes"
    );
}

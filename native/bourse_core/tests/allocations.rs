//! A check of buckets the table already holds allocates nothing, whether of one bucket or
//! of several, by key and limit or prepared.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use bourse_core::{Check, Config, KeyRef, Limit, Mode, PreparedCheck, Table};

/// The system allocator, counting the allocations of each thread.
struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: every call is passed on to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.with(|count| count.set(count.get() + 1));
        System.alloc(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.with(|count| count.set(count.get() + 1));
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn allocations(run: impl FnOnce()) -> usize {
    let before = ALLOCATIONS.with(Cell::get);
    run();
    ALLOCATIONS.with(Cell::get) - before
}

#[test]
fn checks_of_known_buckets_allocate_nothing() {
    let table = Table::new(Config::default());
    let limit = Limit::new(1e9, 1e9).unwrap();
    let axes: [&[u8]; 3] = [b"request", b"ip", b"order"];
    let checks: Vec<Check> = axes
        .iter()
        .map(|axis| Check {
            key: KeyRef::new(b"binance", Some(b"api-key"), axis),
            limit,
            cost: 1.0,
        })
        .collect();
    let prepared: Vec<_> = checks.iter().map(|c| table.prepare(c.key, limit)).collect();
    let prepared_checks: Vec<PreparedCheck> = prepared
        .iter()
        .map(|bucket| PreparedCheck { bucket, cost: 1.0 })
        .collect();
    // The buckets exist: first seen, each allocates its key.
    table.check_rates(1, &checks, Mode::Probe).unwrap();

    let one = allocations(|| {
        table.check_rate(1, checks[0], Mode::Probe);
    });
    let one_prepared = allocations(|| {
        table.check_prepared(1, &prepared[0], 1.0, Mode::Probe);
    });
    let three = allocations(|| {
        table.check_rates(1, &checks, Mode::Probe).unwrap();
    });
    let three_prepared = allocations(|| {
        table
            .check_prepared_all(1, &prepared_checks, Mode::Probe)
            .unwrap();
    });
    assert_eq!((one, one_prepared, three, three_prepared), (0, 0, 0, 0));
}

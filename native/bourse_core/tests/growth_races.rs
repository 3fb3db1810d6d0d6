//! Shards growing, swept and reset while other threads check, inspect and read the same
//! buckets: no bucket is lost or doubled by a move, so a drained bucket never admits
//! again (P1 on a clock that moves by hand), and inspect and get_cost always find it;
//! once the grown keys are swept, the memory they took is given back.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Barrier;

use bourse_core::{Check, Config, KeyRef, Limit, ManualClock, Mode, Outcome, Table};

/// Buckets watched: a few in every shard.
const WATCHED: usize = 512;
/// Their capacity; they refill a token in about 30 years.
const CAPACITY: f64 = 3.0;
/// Keys inserted to grow the shards, by each inserting thread.
const INSERTED: usize = 60_000;

/// Bytes allocated and not yet freed, by every thread.
static LIVE: AtomicUsize = AtomicUsize::new(0);

/// The system allocator, counting the bytes live.
struct Live;

// SAFETY: every call is passed on to the system allocator unchanged.
unsafe impl GlobalAlloc for Live {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size(), Ordering::SeqCst);
        System.alloc(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::SeqCst);
        System.dealloc(ptr, layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size, Ordering::SeqCst);
        LIVE.fetch_sub(layout.size(), Ordering::SeqCst);
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static ALLOCATOR: Live = Live;

fn watched(i: usize) -> String {
    format!("watched-{i}")
}

fn check(table: &Table<ManualClock>, exchange: &[u8], credential: &str, limit: Limit) -> bool {
    let check = Check {
        key: KeyRef::new(exchange, Some(credential.as_bytes()), b"request"),
        limit,
        cost: 1.0,
    };
    table.check_rate(1, check, Mode::Probe) == Outcome::Admitted
}

#[test]
fn buckets_moved_swept_or_reset_nearby_are_never_lost_nor_doubled() {
    let clock = ManualClock::new();
    let table = Table::with_clock(Config::default(), clock.clone());
    let slow = Limit::new(CAPACITY, 1e-9).unwrap();
    // Full again a microsecond after a check: swept once the clock moves.
    let quick = Limit::new(1.0, 1e6).unwrap();
    let admitted: Vec<AtomicU64> = (0..WATCHED).map(|_| AtomicU64::new(0)).collect();
    // Each watched bucket is seen once before the others start.
    for (i, count) in admitted.iter().enumerate() {
        if check(&table, b"binance", &watched(i), slow) {
            count.fetch_add(1, Ordering::SeqCst);
        }
    }
    let before = LIVE.load(Ordering::SeqCst);
    let done = AtomicBool::new(false);
    let inserters_done = AtomicU64::new(0);
    let start = Barrier::new(6);
    std::thread::scope(|scope| {
        for thread in 0..2 {
            let (table, start, done, inserters_done) = (&table, &start, &done, &inserters_done);
            scope.spawn(move || {
                start.wait();
                for i in 0..INSERTED {
                    let exchange: &[u8] = if i % 2 == 0 { b"binance" } else { b"kraken" };
                    check(table, exchange, &format!("grow-{thread}-{i}"), quick);
                    if i % 7 == 0 {
                        let old = format!("grow-{thread}-{}", i / 2);
                        table.reset(KeyRef::new(exchange, Some(old.as_bytes()), b"request"));
                    }
                }
                if inserters_done.fetch_add(1, Ordering::SeqCst) == 1 {
                    done.store(true, Ordering::SeqCst);
                }
            });
        }
        for _ in 0..2 {
            let (table, start, done, admitted) = (&table, &start, &done, &admitted);
            scope.spawn(move || {
                start.wait();
                while !done.load(Ordering::SeqCst) {
                    for (i, count) in admitted.iter().enumerate() {
                        if check(table, b"binance", &watched(i), slow) {
                            count.fetch_add(1, Ordering::SeqCst);
                        }
                        let key = watched(i);
                        let key = KeyRef::new(b"binance", Some(key.as_bytes()), b"request");
                        let info = table.inspect(key).expect("a watched bucket was lost");
                        assert!(info.tokens <= CAPACITY - 1.0 + 1e-6);
                        assert!(table.get_cost(key) >= 1.0 - 1e-6);
                    }
                }
            });
        }
        let (table, start, done, clock) = (&table, &start, &done, &clock);
        scope.spawn(move || {
            start.wait();
            while !done.load(Ordering::SeqCst) {
                clock.advance_ms(1);
                table.sweep();
            }
        });
        scope.spawn(move || {
            start.wait();
            while !done.load(Ordering::SeqCst) {
                table.reset_exchange(b"kraken");
            }
        });
    });
    for (i, count) in admitted.iter().enumerate() {
        let count = count.load(Ordering::SeqCst);
        assert!(count <= CAPACITY as u64, "{} admitted {count}", watched(i));
    }
    // Every grown key is full and idle a millisecond on: the sweep leaves the watched ones.
    clock.advance_ms(1);
    table.sweep();
    assert_eq!(table.stats().buckets, WATCHED as u64);
    // Then grown again by one thread, while nothing sweeps, and swept: each pass shrinks a
    // shard's table at most 32-fold.
    for i in 0..2 * INSERTED {
        check(&table, b"binance", &format!("again-{i}"), quick);
    }
    clock.advance_ms(1);
    let grown = LIVE.load(Ordering::SeqCst);
    for _ in 0..3 {
        table.sweep();
    }
    let after = LIVE.load(Ordering::SeqCst);
    eprintln!("live bytes: {before} before, {grown} grown, {after} swept");
    assert_eq!(table.stats().buckets, WATCHED as u64);
    // What stays is a small table per shard (a shard holding at most 16 buckets keeps a
    // table of up to 64 slots), not the grown ones.
    assert!(
        after < before + 2 * 1024 * 1024 && after - before < (grown - before) / 16,
        "{after} bytes live, {before} before, {grown} grown"
    );
}

//! No shard's lock is held while a table is allocated or freed: each time the inserting
//! thread allocates or frees a large block (a shard's table), another thread checks a key
//! in every shard before the allocation goes on. Were a shard locked, that check would
//! wait for the lock until the inserting thread gives up waiting for it (after
//! [`GIVE_UP`], a deadlock detector, not a speed bound).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bourse_core::{Check, Config, KeyRef, Limit, Mode, Table};

/// Blocks this large are tables (buckets' keys are far smaller).
const LARGE: usize = 128 * 1024;
const GIVE_UP: Duration = Duration::from_secs(10);
/// Keys checked each time: a few in every one of the table's 64 shards.
const PROBES: usize = 2_000;

thread_local! {
    static WATCHED: Cell<bool> = const { Cell::new(false) };
}

/// Large blocks the watched thread asked for or freed; probes done by the other thread.
static ASKED: AtomicU64 = AtomicU64::new(0);
static PROBED: AtomicU64 = AtomicU64::new(0);
/// Whether a probe did not finish in time: a shard was locked.
static BLOCKED: AtomicBool = AtomicBool::new(false);
static STOP: AtomicBool = AtomicBool::new(false);

/// The system allocator; on the watched thread, a large block waits for a probe first.
struct Probing;

/// Has every shard checked by the other thread (allocates nothing, takes no lock).
fn probe(layout: Layout) {
    if layout.size() < LARGE || !WATCHED.with(Cell::get) || BLOCKED.load(Ordering::SeqCst) {
        return;
    }
    let asked = ASKED.fetch_add(1, Ordering::SeqCst) + 1;
    let started = Instant::now();
    while PROBED.load(Ordering::SeqCst) < asked {
        if started.elapsed() > GIVE_UP {
            BLOCKED.store(true, Ordering::SeqCst);
            return;
        }
        std::thread::yield_now();
    }
}

// SAFETY: every call is passed on to the system allocator unchanged.
unsafe impl GlobalAlloc for Probing {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        probe(layout);
        System.alloc(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        probe(layout);
        System.dealloc(ptr, layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        probe(Layout::from_size_align(new_size, layout.align()).unwrap_or(layout));
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static ALLOCATOR: Probing = Probing;

fn check(table: &Table, credential: &str, limit: Limit) {
    let key = KeyRef::new(b"binance", Some(credential.as_bytes()), b"request");
    let check = Check {
        key,
        limit,
        cost: 1.0,
    };
    table.check_rate(1, check, Mode::Probe);
}

#[test]
fn growing_shards_allocate_and_free_their_tables_with_no_lock_held() {
    let table = Table::new(Config::default());
    // Probes stay (full again only a second after a check); the others are full again
    // within a microsecond, and swept.
    let (stays, quick) = (
        Limit::new(1e12, 1e12).unwrap(),
        Limit::new(1.0, 1e6).unwrap(),
    );
    let probes: Vec<String> = (0..PROBES).map(|i| format!("probe-{i}")).collect();
    let inserted: Vec<String> = (0..200_000).map(|i| format!("key-{i}")).collect();
    for credential in &probes {
        check(&table, credential, stays);
    }
    let dropped = std::thread::scope(|scope| {
        scope.spawn(|| {
            let mut probed = 0;
            while !STOP.load(Ordering::SeqCst) {
                if ASKED.load(Ordering::SeqCst) == probed {
                    std::thread::yield_now();
                    continue;
                }
                probed = ASKED.load(Ordering::SeqCst);
                for credential in &probes {
                    check(&table, credential, stays);
                }
                PROBED.store(probed, Ordering::SeqCst);
            }
        });
        WATCHED.with(|watched| watched.set(true));
        for credential in &inserted {
            check(&table, credential, quick);
        }
        // The sweep drops every key but the probes' (full and idle once refilled).
        std::thread::sleep(Duration::from_millis(10));
        let dropped = table.sweep();
        WATCHED.with(|watched| watched.set(false));
        STOP.store(true, Ordering::SeqCst);
        dropped
    });
    assert!(
        !BLOCKED.load(Ordering::SeqCst),
        "a shard was locked while a table was allocated or freed"
    );
    assert!(
        ASKED.load(Ordering::SeqCst) > 64,
        "too few tables grew to be watched"
    );
    assert_eq!(dropped, inserted.len());
}

//! The store's periodic sweep, on a thread of its own started with the daemon: a sweep
//! blocks, and a thread started for each one could not start once the system's threads
//! run out. After each sweep the thread also hands freed memory back to the OS
//! ([`purge_freed`]).

use std::io;
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::Duration;

use crate::protocol::Service;
use crate::store::Store;

/// Sweeps the store every interval, and purges what was freed, until dropped (a sweep under
/// way ends first).
pub struct Sweeper {
    _stop: Sender<()>,
}

/// Starts sweeping `service`'s store every `interval`, the first time one interval from now.
pub fn start<S: Store>(service: Arc<Service<S>>, interval: Duration) -> io::Result<Sweeper> {
    let (stop, stopped) = mpsc::channel::<()>();
    std::thread::Builder::new()
        .name("sweeper".into())
        .spawn(move || {
            while stopped.recv_timeout(interval) == Err(RecvTimeoutError::Timeout) {
                service.store().sweep();
                purge_freed();
            }
        })?;
    Ok(Sweeper { _stop: stop })
}

/// Returns to the OS what the allocator took back, from any thread, at least its purge
/// delay ago (mimalloc's default: 1 s).
///
/// mimalloc purges lazily, from a later call into it: when the request threads went idle
/// after a sweep or a reset that dropped a million buckets (asleep on stdin, or parked in
/// the runtime), nothing called it, and the daemon kept their 400 MB for good. Memory
/// freed less than the delay ago is left for the next sweep, so pages about to be reused
/// are not handed back. A call that finds nothing to purge takes a few microseconds; one
/// that purges a million buckets, a few milliseconds.
fn purge_freed() {
    // SAFETY: mi_collect may be called from any thread at any time.
    unsafe { libmimalloc_sys::mi_collect(false) }
}

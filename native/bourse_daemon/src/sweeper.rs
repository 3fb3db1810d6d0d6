//! The store's periodic sweep, on a thread of its own started with the daemon: a sweep
//! blocks, and a thread started for each one could not start once the system's threads
//! run out.

use std::io;
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::Duration;

use crate::protocol::Service;
use crate::store::Store;

/// Sweeps the store every interval until dropped (a sweep under way ends first).
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
            }
        })?;
    Ok(Sweeper { _stop: stop })
}

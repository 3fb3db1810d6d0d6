//! TCP proxies that fail as middleboxes do: one that turns silent, one that cuts a reply.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;

/// A proxy to `port` on loopback whose open connections can be made to swallow everything
/// (read and dropped, never closed), as a middlebox that lost a flow does; connections
/// made after that are relayed.
pub struct SwallowingProxy {
    pub address: SocketAddr,
    /// Bumped to make every connection open now swallow.
    era: Arc<AtomicU64>,
}

impl SwallowingProxy {
    pub fn to(port: u16) -> Self {
        let era = Arc::new(AtomicU64::new(0));
        let eras = Arc::clone(&era);
        let address = listen(port, move |client, server| {
            let born = eras.load(Ordering::SeqCst);
            for (from, to) in [(clone(&client), clone(&server)), (server, client)] {
                let eras = Arc::clone(&eras);
                pump(from, to, move |bytes, to| {
                    eras.load(Ordering::SeqCst) != born || to.write_all(bytes).is_ok()
                });
            }
        });
        Self { address, era }
    }

    pub fn swallow_open_connections(&self) {
        self.era.fetch_add(1, Ordering::SeqCst);
    }
}

/// A proxy to `port` on loopback that, once armed, cuts the next reply from the server in
/// the middle: it relays the first half of the bytes it reads, then closes both sides, as
/// a middlebox or a network fault may.
pub struct CuttingProxy {
    pub address: SocketAddr,
    armed: Arc<AtomicU64>,
    cuts: Arc<AtomicU64>,
}

impl CuttingProxy {
    pub fn to(port: u16) -> Self {
        let (armed, cuts) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let (arm, cut) = (Arc::clone(&armed), Arc::clone(&cuts));
        let address = listen(port, move |client, server| {
            pump(clone(&client), clone(&server), |bytes, to| {
                to.write_all(bytes).is_ok()
            });
            let (arm, cut) = (Arc::clone(&arm), Arc::clone(&cut));
            let server_side = clone(&server);
            pump(server, client, move |bytes, to| {
                if bytes.len() < 2 || arm.swap(0, Ordering::SeqCst) == 0 {
                    return to.write_all(bytes).is_ok();
                }
                let _ = to.write_all(&bytes[..bytes.len() / 2]);
                let _ = to.shutdown(Shutdown::Both);
                let _ = server_side.shutdown(Shutdown::Both);
                cut.fetch_add(1, Ordering::SeqCst);
                false
            });
        });
        Self {
            address,
            armed,
            cuts,
        }
    }

    /// Cuts the next reply.
    pub fn arm(&self) {
        self.armed.store(1, Ordering::SeqCst);
    }

    /// Replies cut so far.
    pub fn cuts(&self) -> u64 {
        self.cuts.load(Ordering::SeqCst)
    }
}

/// Listens on loopback and hands each connection, with one of its own to the server at
/// `port`, to `relay`.
fn listen(port: u16, relay: impl Fn(TcpStream, TcpStream) + Send + 'static) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap();
    thread::spawn(move || {
        for client in listener.incoming().flatten() {
            if let Ok(server) = TcpStream::connect(("127.0.0.1", port)) {
                relay(client, server);
            }
        }
    });
    address
}

/// Reads `from` until it closes, in a thread of its own, giving what it reads to `forward`
/// with `to`, until `forward` says to stop.
fn pump(
    mut from: TcpStream,
    mut to: TcpStream,
    mut forward: impl FnMut(&[u8], &mut TcpStream) -> bool + Send + 'static,
) {
    thread::spawn(move || {
        let mut buffer = [0u8; 16 * 1024];
        while let Ok(read @ 1..) = from.read(&mut buffer) {
            if !forward(&buffer[..read], &mut to) {
                break;
            }
        }
    });
}

fn clone(stream: &TcpStream) -> TcpStream {
    stream.try_clone().unwrap()
}

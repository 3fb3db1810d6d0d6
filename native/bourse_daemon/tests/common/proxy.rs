//! A TCP proxy that can turn silent, as a middlebox that lost a flow does.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;

/// A proxy to `port` on loopback whose open connections can be made to swallow everything
/// (read and dropped, never closed), as a middlebox that lost a flow does; connections
/// made after that are relayed.
pub struct SwallowingProxy {
    pub address: std::net::SocketAddr,
    /// Bumped to make every connection open now swallow.
    era: Arc<AtomicU64>,
}

impl SwallowingProxy {
    pub fn to(port: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        let era = Arc::new(AtomicU64::new(0));
        let eras = Arc::clone(&era);
        thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let Ok(server) = TcpStream::connect(("127.0.0.1", port)) else {
                    continue;
                };
                let born = eras.load(Ordering::SeqCst);
                for (mut from, mut to) in [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server, client),
                ] {
                    let eras = Arc::clone(&eras);
                    thread::spawn(move || {
                        let mut buffer = [0u8; 16 * 1024];
                        while let Ok(read) = from.read(&mut buffer) {
                            if read == 0 {
                                break;
                            }
                            if eras.load(Ordering::SeqCst) == born
                                && to.write_all(&buffer[..read]).is_err()
                            {
                                break;
                            }
                        }
                    });
                }
            }
        });
        Self { address, era }
    }

    pub fn swallow_open_connections(&self) {
        self.era.fetch_add(1, Ordering::SeqCst);
    }
}

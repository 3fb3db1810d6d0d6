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

/// A proxy to `port` on loopback that, once armed, cuts the next reply from the server in
/// the middle: it relays the first half of the bytes it reads, then closes both sides, as
/// a middlebox or a network fault may.
pub struct CuttingProxy {
    pub address: std::net::SocketAddr,
    armed: Arc<AtomicU64>,
    cuts: Arc<AtomicU64>,
}

impl CuttingProxy {
    pub fn to(port: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        let (armed, cuts) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let (arm, cut) = (Arc::clone(&armed), Arc::clone(&cuts));
        thread::spawn(move || {
            for mut client in listener.incoming().flatten() {
                let Ok(mut server) = TcpStream::connect(("127.0.0.1", port)) else {
                    continue;
                };
                let (mut requests, mut to_server) =
                    (client.try_clone().unwrap(), server.try_clone().unwrap());
                thread::spawn(move || {
                    let mut buffer = [0u8; 16 * 1024];
                    while let Ok(read @ 1..) = requests.read(&mut buffer) {
                        if to_server.write_all(&buffer[..read]).is_err() {
                            break;
                        }
                    }
                });
                let (arm, cut) = (Arc::clone(&arm), Arc::clone(&cut));
                thread::spawn(move || {
                    let mut buffer = [0u8; 16 * 1024];
                    while let Ok(read @ 1..) = server.read(&mut buffer) {
                        if read >= 2 && arm.swap(0, Ordering::SeqCst) == 1 {
                            let _ = client.write_all(&buffer[..read / 2]);
                            let _ = client.shutdown(std::net::Shutdown::Both);
                            let _ = server.shutdown(std::net::Shutdown::Both);
                            cut.fetch_add(1, Ordering::SeqCst);
                            break;
                        }
                        if client.write_all(&buffer[..read]).is_err() {
                            break;
                        }
                    }
                });
            }
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

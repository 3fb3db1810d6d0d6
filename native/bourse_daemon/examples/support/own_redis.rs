//! A `redis-server` a benchmark starts for itself when given none.

use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// The `redis-server` this benchmark started, stopped when it ends, also by a panic.
#[derive(Default)]
pub struct OwnRedis(Option<Child>);

impl OwnRedis {
    /// Starts a `redis-server` without persistence on a free loopback port; its URL.
    pub fn start(&mut self) -> String {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .expect("a free port")
            .port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server not found (pass --redis URL)");
        self.0 = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server did not start");
            thread::sleep(Duration::from_millis(20));
        }
        format!("redis://127.0.0.1:{port}")
    }
}

impl Drop for OwnRedis {
    fn drop(&mut self) {
        if let Some(redis) = &mut self.0 {
            let _ = redis.kill();
            let _ = redis.wait();
        }
    }
}

//! What the command line asks for: the command, and the options of a run. Secrets never
//! show in their `Debug` output.

use std::net::SocketAddr;
use std::path::PathBuf;

use crate::redis::Servers;

/// What the daemon was asked to do.
#[derive(Debug, PartialEq, Eq)]
pub enum Command {
    Help,
    Version,
    Run(Box<Options>),
}

/// Where the clients are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transport {
    Stdio,
    Server {
        tcp: Vec<SocketAddr>,
        unix: Vec<PathBuf>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    pub transport: Transport,
    pub assume_busy_at_start: bool,
    pub booking_slack_ms: u64,
    pub sweep_interval_ms: u64,
    pub max_frame_bytes: usize,
    pub access: Access,
    /// Where the buckets live: this process, or a Redis server.
    pub redis: Option<RedisOptions>,
}

/// Who may connect in server mode.
#[derive(Clone, PartialEq, Eq)]
pub struct Access {
    /// What TCP clients prove.
    pub secret: Option<Vec<u8>>,
    pub socket_mode: u32,
    pub max_connections: usize,
    pub idle_timeout_ms: u64,
}

// Never shows the secret.
impl std::fmt::Debug for Access {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Access")
            .field("secret", &self.secret.as_ref().map(|_| "<set>"))
            .field("socket_mode", &self.socket_mode)
            .field("max_connections", &self.max_connections)
            .field("idle_timeout_ms", &self.idle_timeout_ms)
            .finish()
    }
}

#[derive(Clone, PartialEq, Eq)]
pub struct RedisOptions {
    pub servers: Servers,
    pub password: Option<String>,
    pub key_secret: Option<Vec<u8>>,
    pub prefix: String,
    pub timeout_ms: u64,
}

// Never shows the password or the key secret.
impl std::fmt::Debug for RedisOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisOptions")
            .field("servers", &self.servers)
            .field("password", &self.password.as_ref().map(|_| "<set>"))
            .field("key_secret", &self.key_secret.as_ref().map(|_| "<set>"))
            .field("prefix", &self.prefix)
            .field("timeout_ms", &self.timeout_ms)
            .finish()
    }
}

//! Server mode: many clients on loopback TCP and/or Unix sockets, newline-delimited JSON.
//! Each connection is one task answering its lines in order; answers to pipelined requests
//! are written together once no complete line is left in the input.

use std::io::{self, ErrorKind, Write};
use std::net::SocketAddr;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, UnixListener};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::{mpsc, watch};

use crate::protocol::Service;
use crate::store::Store;

/// How long shutdown waits for connections to finish the lines they had received.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
/// Answers are written out once this many bytes are pending, even mid-batch.
const WRITE_CHUNK: usize = 64 * 1024;

/// Binds every listener, prints `listening ...` lines, serves until SIGTERM or SIGINT, then
/// drains connections and removes the socket files.
pub async fn run<S: Store>(
    service: Arc<Service<S>>,
    tcp: &[SocketAddr],
    unix: &[PathBuf],
    max_frame_bytes: usize,
    sweep_interval: Duration,
) -> Result<(), String> {
    let mut terminate =
        signal(SignalKind::terminate()).map_err(|e| format!("SIGTERM handler: {e}"))?;
    let mut interrupt =
        signal(SignalKind::interrupt()).map_err(|e| format!("SIGINT handler: {e}"))?;

    let mut sockets = SocketFiles(Vec::new());
    let mut tcp_listeners = Vec::new();
    let mut unix_listeners = Vec::new();
    let mut lines = String::new();
    for addr in tcp {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        let bound = listener.local_addr().map_err(|e| format!("{addr}: {e}"))?;
        lines.push_str(&format!("listening tcp {bound}\n"));
        tcp_listeners.push(listener);
    }
    for path in unix {
        remove_stale_socket(path)?;
        let listener = UnixListener::bind(path)
            .map_err(|e| format!("cannot listen on {}: {e}", path.display()))?;
        sockets.0.push(path.clone());
        lines.push_str(&format!("listening unix {}\n", path.display()));
        unix_listeners.push(listener);
    }
    let mut stdout = io::stdout().lock();
    stdout
        .write_all(lines.as_bytes())
        .and_then(|()| stdout.flush())
        .map_err(|e| format!("writing stdout: {e}"))?;
    drop(stdout);

    let (shutdown_tx, shutdown) = watch::channel(false);
    // Every accept loop and connection holds a sender; `recv` answers `None` once all ended.
    let (alive, mut all_ended) = mpsc::channel::<()>(1);
    let context = Context {
        service: Arc::clone(&service),
        max_frame_bytes,
        shutdown,
        _alive: alive,
    };
    let listeners = tcp_listeners
        .into_iter()
        .map(Listener::Tcp)
        .chain(unix_listeners.into_iter().map(Listener::Unix));
    for listener in listeners {
        tokio::spawn(accept_loop(listener, context.clone()));
    }
    drop(context);
    let sweeper = tokio::spawn(async move {
        let mut ticks = tokio::time::interval(sweep_interval);
        ticks.tick().await;
        loop {
            ticks.tick().await;
            let service = Arc::clone(&service);
            let _ = tokio::task::spawn_blocking(move || service.store().sweep()).await;
        }
    });

    tokio::select! {
        _ = terminate.recv() => {}
        _ = interrupt.recv() => {}
    }
    sweeper.abort();
    // Accept loops stop and drop their listeners; connections answer what they hold.
    let _ = shutdown_tx.send(true);
    if tokio::time::timeout(DRAIN_TIMEOUT, all_ended.recv())
        .await
        .is_err()
    {
        eprintln!("bourse_daemon: some connections did not finish within {DRAIN_TIMEOUT:?}");
    }
    drop(sockets);
    Ok(())
}

/// What every accept loop and connection task shares.
struct Context<S: Store> {
    service: Arc<Service<S>>,
    max_frame_bytes: usize,
    shutdown: watch::Receiver<bool>,
    /// Dropped when the task holding this context ends.
    _alive: mpsc::Sender<()>,
}

// Derived `Clone` would require `S: Clone`; only the `Arc` is cloned.
impl<S: Store> Clone for Context<S> {
    fn clone(&self) -> Self {
        Self {
            service: Arc::clone(&self.service),
            max_frame_bytes: self.max_frame_bytes,
            shutdown: self.shutdown.clone(),
            _alive: self._alive.clone(),
        }
    }
}

enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

impl Listener {
    /// Accepts one connection and spawns its task.
    async fn accept<S: Store>(&self, context: &Context<S>) -> io::Result<()> {
        match self {
            Self::Tcp(listener) => {
                let (stream, _) = listener.accept().await?;
                // Small answers must not wait for Nagle (best effort: a reset peer is
                // found out by its first read).
                let _ = stream.set_nodelay(true);
                tokio::spawn(serve(stream, context.clone()));
            }
            Self::Unix(listener) => {
                let (stream, _) = listener.accept().await?;
                tokio::spawn(serve(stream, context.clone()));
            }
        }
        Ok(())
    }
}

async fn accept_loop<S: Store>(listener: Listener, context: Context<S>) {
    let mut shutdown = context.shutdown.clone();
    while !*shutdown.borrow_and_update() {
        tokio::select! {
            accepted = listener.accept(&context) => {
                if let Err(error) = accepted {
                    // Out of descriptors, or a connection reset before it was accepted.
                    eprintln!("bourse_daemon: accept: {error}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
            _ = shutdown.changed() => {}
        }
    }
}

/// Answers one connection's lines in order until it closes, sends an oversized frame, or the
/// daemon shuts down (then the lines already received are answered first).
async fn serve<T: AsyncRead + AsyncWrite + Unpin, S: Store>(
    mut stream: T,
    mut context: Context<S>,
) {
    let service = &context.service;
    let session = service.session();
    let mut input = Lines::new(context.max_frame_bytes);
    let mut out = Vec::with_capacity(4096);
    loop {
        loop {
            match input.next() {
                Next::Line(range) => {
                    let line = &input.buf[range];
                    if line.iter().all(u8::is_ascii_whitespace) {
                        continue;
                    }
                    service.handle(&session, line, &mut out).await;
                    out.push(b'\n');
                    if out.len() >= WRITE_CHUNK && send(&mut stream, &mut out).await.is_err() {
                        return;
                    }
                }
                Next::TooLarge => {
                    service.frame_too_large(&mut out, context.max_frame_bytes);
                    out.push(b'\n');
                    let _ = send(&mut stream, &mut out).await;
                    let _ = stream.shutdown().await;
                    linger(&mut stream, Duration::from_secs(1)).await;
                    return;
                }
                Next::Pending => break,
            }
        }
        if send(&mut stream, &mut out).await.is_err() {
            return;
        }
        if *context.shutdown.borrow_and_update() {
            break;
        }
        tokio::select! {
            read = input.fill(&mut stream) => match read {
                Ok(0) => {
                    if input.has_partial() {
                        service.truncated_frame(&mut out);
                        out.push(b'\n');
                        let _ = send(&mut stream, &mut out).await;
                    }
                    break;
                }
                Ok(_) => {}
                Err(_) => return,
            },
            _ = context.shutdown.changed() => {}
        }
    }
    let _ = stream.shutdown().await;
    if *context.shutdown.borrow() {
        linger(&mut stream, Duration::from_millis(100)).await;
    }
}

/// Reads and discards what the peer still sends, for at most `patience` and 1 MiB: closing
/// a socket with unread input resets it, which can destroy answers the peer has not read.
async fn linger<S: AsyncRead + Unpin>(stream: &mut S, patience: Duration) {
    let mut sink = [0u8; 8192];
    let mut budget = 1usize << 20;
    let _ = tokio::time::timeout(patience, async {
        while budget > 0 {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => budget = budget.saturating_sub(n),
            }
        }
    })
    .await;
}

async fn send<S: AsyncWrite + Unpin>(stream: &mut S, out: &mut Vec<u8>) -> io::Result<()> {
    if !out.is_empty() {
        stream.write_all(out).await?;
        out.clear();
    }
    Ok(())
}

/// Input bytes split into newline-terminated frames of at most `max` bytes.
struct Lines {
    buf: Vec<u8>,
    /// Start of the first unanswered line.
    start: usize,
    /// Bytes before this (and from `start`) hold no newline.
    scanned: usize,
    max: usize,
}

enum Next {
    /// A frame without its line ending.
    Line(std::ops::Range<usize>),
    TooLarge,
    /// No complete line is buffered.
    Pending,
}

impl Lines {
    fn new(max: usize) -> Self {
        Self {
            buf: Vec::with_capacity(8192),
            start: 0,
            scanned: 0,
            max,
        }
    }

    fn next(&mut self) -> Next {
        match self.buf[self.scanned..].iter().position(|&b| b == b'\n') {
            Some(at) => {
                let newline = self.scanned + at;
                let mut end = newline;
                if end > self.start && self.buf[end - 1] == b'\r' {
                    end -= 1;
                }
                let line = self.start..end;
                self.start = newline + 1;
                self.scanned = self.start;
                if line.len() > self.max {
                    Next::TooLarge
                } else {
                    Next::Line(line)
                }
            }
            None => {
                self.scanned = self.buf.len();
                // One more byte may be the `\r` of a `\r\n` ending.
                if self.buf.len() - self.start > self.max + 1 {
                    Next::TooLarge
                } else {
                    Next::Pending
                }
            }
        }
    }

    /// Reads more input after the unanswered bytes. Cancel-safe.
    async fn fill<R: AsyncRead + Unpin>(&mut self, reader: &mut R) -> io::Result<usize> {
        if self.start > 0 {
            self.buf.drain(..self.start);
            self.scanned -= self.start;
            self.start = 0;
        }
        self.buf.reserve(16 * 1024);
        reader.read_buf(&mut self.buf).await
    }

    /// Whether a frame was begun but not ended.
    fn has_partial(&self) -> bool {
        !self.buf[self.start..].iter().all(u8::is_ascii_whitespace)
    }
}

/// Removes a socket file left by a daemon that is gone; refuses to replace a live socket or
/// anything that is not a socket.
fn remove_stale_socket(path: &Path) -> Result<(), String> {
    match std::fs::symlink_metadata(path) {
        Err(error) if error.kind() == ErrorKind::NotFound => Ok(()),
        Err(error) => Err(format!("{}: {error}", path.display())),
        Ok(meta) if !meta.file_type().is_socket() => Err(format!(
            "{} exists and is not a socket; not replacing it",
            path.display()
        )),
        Ok(_) => match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => Err(format!(
                "another process is listening on {}",
                path.display()
            )),
            Err(_) => std::fs::remove_file(path)
                .map_err(|error| format!("cannot remove stale socket {}: {error}", path.display())),
        },
    }
}

/// The Unix socket files this daemon created, removed when it stops.
struct SocketFiles(Vec<PathBuf>);

impl Drop for SocketFiles {
    fn drop(&mut self) {
        for path in &self.0 {
            let _ = std::fs::remove_file(path);
        }
    }
}

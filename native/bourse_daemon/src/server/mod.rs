//! Server mode: many clients on loopback TCP and/or Unix sockets, newline-delimited JSON, or
//! length-prefixed external terms once a connection's first `hello` chose them.
//! A connection to the in-memory table is served on a thread of its own ([`thread`]), a
//! Unix one once accepted, a TCP one once it proved the secret; any other connection is a
//! task of the runtime. When its input runs out and it is the
//! only connection, a connection polls its socket for a few microseconds before it sleeps,
//! as [`Spin`] decides. Unix sockets are created owner-only (or owner and group); TCP
//! clients prove the shared secret before anything but `hello` is served. Connections are
//! bounded in number, and closed when idle.

use std::collections::VecDeque;
use std::io::{self, ErrorKind, Write};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::{mpsc, watch, Notify, OwnedSemaphorePermit, Semaphore};

mod frames;
mod thread;

use self::frames::{framed, Frames, Framing, Next};
pub use self::frames::{length_prefixed, prefixed_length};
use crate::protocol::{self, Codec, Service, Session};
use crate::spin::{Spin, Waited};
use crate::store::{Store, MAX_RUNNING};
use crate::sweeper;

/// Answers are written out once this many bytes are pending, even mid-batch.
const WRITE_CHUNK: usize = 64 * 1024;
/// The most one write hands the socket: a Unix socket frees what it holds for the client
/// only once the client read the whole of a write, so a slow reader's progress shows once
/// it read this much.
const WRITE_PIECE: usize = 8 * 1024;
/// How long a connection that must prove the secret may take to do it.
const AUTH_TIMEOUT: Duration = Duration::from_secs(10);
/// What a refused connection may still send (its hello) before it is closed, at most.
const REFUSED_READ_BYTES: usize = 64 * 1024;
/// TCP connections that have not been sent their nonce yet, at most (see [`Unproved`]).
pub const MAX_SILENT: usize = 64;
/// TCP connections that have been sent their nonce and have not proved the secret yet, at
/// most (see [`Unproved`]).
pub const MAX_GREETED: usize = 256;
/// The longest frame of a connection that has not proved the secret yet (a `hello` or an
/// `auth` takes about 100 bytes): reading one costs an unknown client little.
const UNPROVED_MAX_FRAME_BYTES: usize = 1024;
/// Refused connections read until their client closes, at once, at most; past it a
/// refusal is written and the connection closed at once, so that clients holding refused
/// connections open cannot take the descriptors kept spare.
pub const MAX_LINGERING: usize = 16;

/// How many connections of each kind that are not served (yet) may hold a descriptor at
/// once: TCP ones that have not proved the secret, silent or greeted (see [`Unproved`]),
/// and refused ones lingering.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnprovedBounds {
    pub silent: usize,
    pub greeted: usize,
    pub lingering: usize,
}

impl UnprovedBounds {
    /// [`MAX_SILENT`], [`MAX_GREETED`] and [`MAX_LINGERING`].
    pub const FULL: Self = Self {
        silent: MAX_SILENT,
        greeted: MAX_GREETED,
        lingering: MAX_LINGERING,
    };

    /// The descriptors they hold at most.
    pub fn total(self) -> usize {
        self.silent + self.greeted + self.lingering
    }

    /// Each bound cut to `have / need` of itself (at least 1), for a descriptor limit that
    /// allows `have` descriptors where `need` are wanted.
    pub fn scaled(self, have: usize, need: usize) -> Self {
        let cut = |bound: usize| (bound * have / need.max(1)).clamp(1, bound);
        Self {
            silent: cut(self.silent),
            greeted: cut(self.greeted),
            lingering: cut(self.lingering),
        }
    }
}

/// What bounds the connections.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_frame_bytes: usize,
    pub max_connections: usize,
    /// Connections not served (yet) holding a descriptor, at most.
    pub unproved: UnprovedBounds,
    /// A connection that sends nothing for this long is closed.
    pub idle_timeout: Option<Duration>,
    /// The permission bits of the Unix socket files (0o600 or 0o660).
    pub socket_mode: u32,
    /// How long shutdown waits for connections to finish the lines they had received.
    pub drain_timeout: Duration,
}

/// Binds every listener, prints `listening ...` lines, serves until SIGTERM or SIGINT, then
/// drains connections and removes the socket files.
pub async fn run<S: Store>(
    service: Arc<Service<S>>,
    tcp: &[SocketAddr],
    unix: &[PathBuf],
    limits: Limits,
    sweep_interval: Duration,
) -> Result<(), String> {
    let mut terminate =
        signal(SignalKind::terminate()).map_err(|e| format!("SIGTERM handler: {e}"))?;
    let mut interrupt =
        signal(SignalKind::interrupt()).map_err(|e| format!("SIGINT handler: {e}"))?;

    // Started before the daemon says it listens: its thread is there from then on.
    let sweeper = sweeper::start(Arc::clone(&service), sweep_interval)
        .map_err(|e| format!("cannot start the sweeper thread: {e}"))?;

    let mut sockets = Vec::new();
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
        let (listener, file) = bind_unix(path, limits.socket_mode)?;
        sockets.push(file);
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
    // Readable once the daemon shuts down: wakes the connections' own threads.
    let (stopped, mut stop) = io::pipe().map_err(|e| format!("cannot create a pipe: {e}"))?;
    // Every accept loop and connection holds a sender; `recv` answers `None` once all ended.
    let (alive, mut all_ended) = mpsc::channel::<()>(1);
    let context = Context {
        service: Arc::clone(&service),
        limits,
        connections: Arc::new(Semaphore::new(limits.max_connections)),
        unproved: Arc::new(Unproved::new(limits.unproved, tcp_listeners.len())),
        lingering: Arc::new(Semaphore::new(limits.unproved.lingering)),
        shutdown,
        stopped: Arc::new(stopped),
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

    tokio::select! {
        _ = terminate.recv() => {}
        _ = interrupt.recv() => {}
    }
    drop(sweeper);
    // Accept loops stop and drop their listeners; connections answer what they hold.
    let _ = shutdown_tx.send(true);
    let _ = stop.write_all(&[1]);
    let drain_timeout = limits.drain_timeout;
    if tokio::time::timeout(drain_timeout, all_ended.recv())
        .await
        .is_err()
    {
        eprintln!("bourse_daemon: some connections did not finish within {drain_timeout:?}");
    }
    drop(sockets);
    Ok(())
}

/// Binds a Unix socket whose file has `mode` from the start: the process umask is narrowed
/// around `bind`, so no other user can connect in between. Nothing changes the mode after:
/// `bind` applies the umask to the socket file even under a default ACL of the directory
/// (which may only narrow it), and a change by path could reach another file, put there
/// (as a symlink) by whoever can write the directory.
fn bind_unix(path: &Path, mode: u32) -> Result<(UnixListener, SocketFile), String> {
    let cannot = |e: io::Error| format!("cannot listen on {}: {e}", path.display());
    // SAFETY: umask only changes this process's file-creation mask; no other thread
    // creates files while the listeners are bound.
    let previous = unsafe { libc::umask(0o777 & !(mode as libc::mode_t)) };
    let bound = UnixListener::bind(path);
    unsafe { libc::umask(previous) };
    let listener = bound.map_err(cannot)?;
    let file = SocketFile::bound(path).map_err(cannot)?;
    Ok((listener, file))
}

/// What every accept loop and connection task shares.
struct Context<S: Store> {
    service: Arc<Service<S>>,
    limits: Limits,
    connections: Arc<Semaphore>,
    unproved: Arc<Unproved>,
    /// Places of [`MAX_LINGERING`].
    lingering: Arc<Semaphore>,
    shutdown: watch::Receiver<bool>,
    /// Readable once `shutdown` is true.
    stopped: Arc<io::PipeReader>,
    /// Dropped when the task holding this context ends.
    _alive: mpsc::Sender<()>,
}

impl<S: Store> Context<S> {
    /// A place of [`MAX_LINGERING`] for a refused connection, if one is free.
    fn linger(&self) -> Option<OwnedSemaphorePermit> {
        Arc::clone(&self.lingering).try_acquire_owned().ok()
    }

    /// Whether at most one connection is served (or waits to prove the secret): then
    /// polling its socket before it sleeps takes no CPU another connection needs.
    fn alone(&self) -> bool {
        self.connections.available_permits() + 1 >= self.limits.max_connections
            && self.unproved.is_empty()
    }
}

// Derived `Clone` would require `S: Clone`; only the `Arc` is cloned.
impl<S: Store> Clone for Context<S> {
    fn clone(&self) -> Self {
        Self {
            service: Arc::clone(&self.service),
            limits: self.limits,
            connections: Arc::clone(&self.connections),
            unproved: Arc::clone(&self.unproved),
            lingering: Arc::clone(&self.lingering),
            shutdown: self.shutdown.clone(),
            stopped: Arc::clone(&self.stopped),
            _alive: self._alive.clone(),
        }
    }
}

enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

impl Listener {
    /// Accepts one connection and has it served. A Unix connection needs a connection slot
    /// at once; past the limit, it is told so and closed. A TCP connection takes one when
    /// it has proved the secret, and until then holds one of the few places of
    /// [`Unproved`].
    async fn accept<S: Store>(&self, context: &Context<S>) -> io::Result<()> {
        match self {
            Self::Tcp(listener) => {
                let descriptor = context.unproved.descriptor().await?;
                let (stream, _) = listener.accept().await?;
                // Small answers must not wait for Nagle (best effort: a reset peer is
                // found out by its first read).
                let _ = stream.set_nodelay(true);
                let slot = Slot::Unproved(context.unproved.admit(Some(descriptor)));
                tokio::spawn(serve(stream, context.clone(), slot));
            }
            Self::Unix(listener) => {
                let (stream, _) = listener.accept().await?;
                match Arc::clone(&context.connections).try_acquire_owned() {
                    Ok(permit) => {
                        let slot = Slot::Held { _permit: permit };
                        // A remote store answers concurrently: tasks wait for its answers.
                        let thread = if S::REMOTE {
                            None
                        } else {
                            thread::start::<S>()
                        };
                        match thread {
                            Some(thread) => {
                                let stream = stream.into();
                                let begun = None;
                                let connection = thread::Connection {
                                    stream,
                                    slot,
                                    begun,
                                };
                                thread.serve(connection, context.clone());
                            }
                            None => {
                                tokio::spawn(serve(stream, context.clone(), slot));
                            }
                        }
                    }
                    Err(_) => refuse_unix(stream, context),
                }
            }
        }
        Ok(())
    }
}

/// Tells a Unix connection past the limit so and closes it, lingering if a place of
/// [`MAX_LINGERING`] is free.
fn refuse_unix<S: Store>(stream: UnixStream, context: &Context<S>) {
    let max = context.limits.max_connections;
    match context.linger() {
        Some(linger) => {
            tokio::spawn(refuse::<_, S>(stream, max, Some(linger), None));
        }
        // Told and closed here, before the next accept: refused connections beyond the
        // lingering ones never hold a descriptor, however fast they come. A new socket's
        // buffer takes the short line whole.
        None => {
            let _ = stream.try_write(&refusal_line(max));
        }
    }
}

/// What a connection past `--max-connections` is told before it chose a codec.
fn refusal_line(max: usize) -> Vec<u8> {
    let message = refusal_message(max);
    let error =
        serde_json::json!({"ok": false, "error": {"type": "unavailable", "message": message}});
    format!("{error}\n").into_bytes()
}

fn refusal_message(max: usize) -> String {
    format!("the daemon serves at most {max} connections (--max-connections)")
}

/// Tells a connection past the limit so, and closes it: a JSON line, or for a connection
/// that chose the external term format (`session`), a term in its frame. With a place of
/// [`MAX_LINGERING`] (`linger`), what the client sends meanwhile (its hello) is read and
/// dropped until it closes, for at most a second: closed at once, the socket would fail
/// the client's first write, and that failure, not the refusal, would be all the client
/// learns.
async fn refuse<T: AsyncRead + AsyncWrite + Unpin, S: Store>(
    mut stream: T,
    max: usize,
    linger: Option<OwnedSemaphorePermit>,
    chosen: Option<(&Service<S>, &Session)>,
) {
    let mut out = Vec::new();
    match chosen {
        Some((service, session)) => {
            service.unavailable(session, &mut out, refusal_message(max));
            framed(&mut out, 0, session.codec());
        }
        None => out = refusal_line(max),
    }
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let _ = stream.write_all(&out).await;
        let _ = stream.shutdown().await;
        if linger.is_none() {
            return;
        }
        let mut dropped = [0; 4096];
        let mut left = REFUSED_READ_BYTES;
        while left > 0 {
            match stream.read(&mut dropped).await {
                Ok(0) | Err(_) => break,
                Ok(read) => left = left.saturating_sub(read),
            }
        }
    })
    .await;
}

/// What a connection holds to be served.
enum Slot {
    /// A connection slot, given back when the connection ends.
    Held { _permit: OwnedSemaphorePermit },
    /// A place among the connections that have not proved the secret yet.
    Unproved(Place),
}

/// The TCP connections that have not proved the secret, in two queues: the silent ones,
/// not sent their nonce yet (no `hello`, or nothing valid), at most [`MAX_SILENT`]; and
/// the greeted ones, sent their nonce, at most [`MAX_GREETED`]. A new connection evicts the
/// oldest silent one past their bound; a connection sent its nonce leaves the silent ones
/// and evicts the oldest greeted one past theirs. An evicted connection reads what it had
/// sent by then, and is closed unless that moved it on (a `hello` makes it greeted, an
/// `auth` proves the secret). So connections that send no `hello` (another local user's),
/// however many and fast, never evict a client that was sent its nonce; connections that
/// do must be sent [`MAX_GREETED`] nonces while the client computes its `auth`.
struct Unproved {
    queues: Mutex<Queues>,
    bounds: UnprovedBounds,
    /// The descriptors of the connections in the queues, of those evicted until they
    /// close, and of one connection being accepted per TCP listener: as many as the queues
    /// hold, and one per listener.
    descriptors: Arc<Semaphore>,
}

/// The entries of [`Unproved`], oldest first.
#[derive(Default)]
struct Queues {
    silent: VecDeque<Arc<Evictable>>,
    greeted: VecDeque<Arc<Evictable>>,
}

/// A connection's entry in a queue of [`Unproved`]; evicted, the connection is to close.
struct Evictable {
    /// Whether it is in the greeted queue, not the silent one.
    greeted: bool,
    evicted: AtomicBool,
    notify: Notify,
}

impl Evictable {
    fn evict(&self) {
        self.evicted.store(true, Ordering::Release);
        self.notify.notify_one();
    }

    fn is_evicted(&self) -> bool {
        self.evicted.load(Ordering::Acquire)
    }

    /// Returns once the entry is evicted.
    async fn evicted(&self) {
        // A `notify_one` before the wait leaves a permit: the wait returns at once.
        while !self.is_evicted() {
            self.notify.notified().await;
        }
    }
}

impl Unproved {
    /// Queues of `bounds` for the connections of `listeners` TCP listeners.
    fn new(bounds: UnprovedBounds, listeners: usize) -> Self {
        let places = bounds.silent + bounds.greeted + listeners;
        Self {
            queues: Mutex::default(),
            bounds,
            descriptors: Arc::new(Semaphore::new(places)),
        }
    }

    /// A descriptor for the next connection a listener accepts, once one is free: evicted
    /// connections never hold descriptors beside new ones, however fast these come. The
    /// queues never hold more than their bounds, so when none is free, a connection they
    /// evicted still holds one, and gives it back as it closes.
    async fn descriptor(&self) -> io::Result<OwnedSemaphorePermit> {
        Arc::clone(&self.descriptors)
            .acquire_owned()
            .await
            .map_err(io::Error::other)
    }

    /// A place among the silent connections, for a new one holding `descriptor`.
    fn admit(self: &Arc<Self>, descriptor: Option<OwnedSemaphorePermit>) -> Place {
        self.join(false, descriptor)
    }

    /// A place among the greeted connections, for one just sent its nonce; it takes over
    /// the descriptor of its silent place.
    fn greet(self: &Arc<Self>, silent: &mut Place) -> Place {
        self.join(true, silent.descriptor.take())
    }

    /// A place at the end of a queue, evicting the queue's oldest past its bound.
    fn join(self: &Arc<Self>, greeted: bool, descriptor: Option<OwnedSemaphorePermit>) -> Place {
        let entry = Arc::new(Evictable {
            greeted,
            evicted: AtomicBool::new(false),
            notify: Notify::new(),
        });
        let mut queues = self.queues.lock().unwrap_or_else(|e| e.into_inner());
        let (queue, max) = match greeted {
            false => (&mut queues.silent, self.bounds.silent),
            true => (&mut queues.greeted, self.bounds.greeted),
        };
        if queue.len() >= max {
            if let Some(oldest) = queue.pop_front() {
                oldest.evict();
            }
        }
        queue.push_back(Arc::clone(&entry));
        Place {
            unproved: Arc::clone(self),
            entry,
            descriptor,
        }
    }

    fn is_empty(&self) -> bool {
        let queues = self.queues.lock().unwrap_or_else(|e| e.into_inner());
        queues.silent.is_empty() && queues.greeted.is_empty()
    }
}

/// A connection's place in a queue of [`Unproved`], left when dropped, with the descriptor
/// it was accepted with ([`Unproved::descriptor`]).
struct Place {
    unproved: Arc<Unproved>,
    entry: Arc<Evictable>,
    descriptor: Option<OwnedSemaphorePermit>,
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut queues = self
            .unproved
            .queues
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let queue = match self.entry.greeted {
            false => &mut queues.silent,
            true => &mut queues.greeted,
        };
        queue.retain(|other| !Arc::ptr_eq(other, &self.entry));
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

/// Answers one connection's lines until it closes, sends an oversized frame, stays idle past
/// its timeout, or the daemon shuts down (then the lines already received are answered
/// first). With the in-memory table lines are answered in order; with a remote store each
/// runs as a task and its answer is written as soon as it is ready.
async fn serve<T, S: Store>(mut stream: T, mut context: Context<S>, mut slot: Slot)
where
    T: NonBlocking + AsRawFd + Into<thread::Stream> + AsyncRead + AsyncWrite + Unpin,
{
    let prove = matches!(slot, Slot::Unproved(_));
    let service = Arc::clone(&context.service);
    let idle = context.limits.idle_timeout;
    let mut session = Arc::new(service.session(prove, idle.map(|idle| idle.as_millis() as u64)));
    let max_frame_bytes = context.limits.max_frame_bytes;
    let mut input = Frames::new(match prove {
        true => max_frame_bytes.min(UNPROVED_MAX_FRAME_BYTES),
        false => max_frame_bytes,
    });
    let mut out = Vec::with_capacity(4096);
    let (answered, mut answers) = mpsc::unbounded_channel::<Vec<u8>>();
    let mut running = 0usize;
    let mut spin = Spin::default();
    // Whether it read what it had sent once its place was evicted.
    let mut looked = false;
    let opened = Instant::now();
    let auth_deadline = opened + idle.map_or(AUTH_TIMEOUT, |idle| idle.min(AUTH_TIMEOUT));
    let mut active = opened;
    let mut closing = false;
    let mut handed_over = false;
    loop {
        loop {
            match input.next() {
                Next::Frame(range) => {
                    let frame = &input.buf[range];
                    if input.framing == Framing::Lines && frame.iter().all(u8::is_ascii_whitespace)
                    {
                        continue;
                    }
                    // A request: the connection is not idle. (Bytes alone are not: a client
                    // that adds a byte now and then to a frame it never ends would hold its
                    // connection slot for ever.)
                    active = Instant::now();
                    let number = session.next_frame();
                    // The first frame may choose the codec (and framing) of the next ones,
                    // and `auth` whether the next ones are served: answered before they are
                    // read, if it may.
                    let sets_up = number == 1 && protocol::may_set_up(frame);
                    if S::REMOTE && !sets_up && matches!(slot, Slot::Held { .. }) {
                        running += 1;
                        let (service, session) = (Arc::clone(&service), Arc::clone(&session));
                        let (frame, answered) = (frame.to_vec(), answered.clone());
                        tokio::spawn(async move {
                            let mut out = Vec::with_capacity(128);
                            service.handle(&session, number, &frame, &mut out).await;
                            framed(&mut out, 0, session.codec());
                            let _ = answered.send(out);
                        });
                        continue;
                    }
                    let start = out.len();
                    service.handle(&session, number, frame, &mut out).await;
                    framed(&mut out, start, session.codec());
                    if number == 1 && session.codec() == Codec::Etf {
                        input.length_prefixed();
                    }
                    // Proved: from now on it needs a connection slot, before another
                    // frame is served. Sent its nonce: from now on it is greeted.
                    if let Slot::Unproved(place) = &mut slot {
                        if session.authenticated() {
                            input.allow(max_frame_bytes);
                            match Arc::clone(&context.connections).try_acquire_owned() {
                                Ok(permit) => {
                                    slot = Slot::Held { _permit: permit };
                                    // Served on a thread from here, as a Unix connection.
                                    if !S::REMOTE {
                                        handed_over = true;
                                        break;
                                    }
                                }
                                Err(_) => {
                                    let sent = send_settled(
                                        &mut stream,
                                        &service,
                                        &session,
                                        &mut out,
                                        &slot,
                                        auth_deadline,
                                        idle,
                                    );
                                    if sent.await.is_err() {
                                        return;
                                    }
                                    // Refused: its place is given back.
                                    drop(slot);
                                    let max = context.limits.max_connections;
                                    let linger = context.linger();
                                    let chosen = Some((&*service, &*session));
                                    return refuse(stream, max, linger, chosen).await;
                                }
                            }
                        } else if session.nonce_sent() && !place.entry.greeted {
                            slot = Slot::Unproved(context.unproved.greet(place));
                            looked = false;
                        }
                    }
                    if out.len() >= WRITE_CHUNK {
                        let sent = deliver(
                            &mut stream,
                            &service,
                            &session,
                            &mut out,
                            &slot,
                            auth_deadline,
                            idle,
                        );
                        if sent.await.is_err() {
                            return;
                        }
                        // Its client reads: it is not idle.
                        active = Instant::now();
                    }
                }
                Next::TooLarge => {
                    let number = session.next_frame();
                    let start = out.len();
                    let line = input.partial_line();
                    service.frame_too_large(&session, &mut out, number, input.max(), line);
                    framed(&mut out, start, session.codec());
                    while running > 0 {
                        let Some(answer) = answers.recv().await else {
                            break;
                        };
                        running -= 1;
                        out.extend_from_slice(&answer);
                    }
                    let _ = send_settled(
                        &mut stream,
                        &service,
                        &session,
                        &mut out,
                        &slot,
                        auth_deadline,
                        idle,
                    )
                    .await;
                    let _ = stream.shutdown().await;
                    // A connection that has not proved the secret closes at once: lingering
                    // would hold its descriptor outside the bounds of its queue.
                    if let Slot::Held { .. } = slot {
                        linger(&mut stream, Duration::from_secs(1)).await;
                    }
                    return;
                }
                Next::Pending => break,
            }
        }
        if !out.is_empty() {
            if deliver(
                &mut stream,
                &service,
                &session,
                &mut out,
                &slot,
                auth_deadline,
                idle,
            )
            .await
            .is_err()
            {
                return;
            }
            // Its client reads: it is not idle.
            active = Instant::now();
        }
        // Evicted, and what it had sent by then did not move it on.
        if looked && matches!(&slot, Slot::Unproved(place) if place.entry.is_evicted()) {
            break;
        }
        // A thread serves the rest, unless none can start. No task holds the session: none
        // runs for the in-memory table.
        if std::mem::take(&mut handed_over) {
            match Arc::try_unwrap(session) {
                Ok(owned) => match thread::start::<S>() {
                    Some(thread) => {
                        let stream = stream.into();
                        let begun = Some((owned, input));
                        thread.serve(
                            thread::Connection {
                                stream,
                                slot,
                                begun,
                            },
                            context,
                        );
                        return;
                    }
                    None => session = Arc::new(owned),
                },
                Err(shared) => session = shared,
            }
            // Still a task: the frames read behind the proof are answered first.
            continue;
        }
        if *context.shutdown.borrow_and_update() {
            closing = true;
        }
        if closing && running == 0 {
            break;
        }
        let evicted = async {
            match &slot {
                Slot::Unproved(place) => place.entry.evicted().await,
                Slot::Held { .. } => std::future::pending().await,
            }
        };
        // Until it proves the secret a connection has AUTH_TIMEOUT; then its idle timeout.
        let deadline = if session.authenticated() {
            idle.map(|idle| active + idle)
        } else {
            Some(auth_deadline)
        };
        let expired = async {
            match deadline {
                Some(deadline) => tokio::time::sleep_until(deadline.into()).await,
                None => std::future::pending().await,
            }
        };
        // Polled first only while nothing else can happen: no answer of a remote store is
        // awaited, and no other connection is served.
        let waiting = Instant::now();
        let polled = match running == 0 && !closing && context.alone() {
            // Holds its worker thread for the budget, at most `MAX_SPIN`.
            true => spin
                .poll(|| match input.try_fill(&stream) {
                    Err(error) if error.kind() == ErrorKind::WouldBlock => None,
                    read => Some(read),
                })
                .map_err(Some),
            false => Err(None),
        };
        let read = match polled {
            Ok(read) => read,
            Err(polled) => tokio::select! {
                read = input.fill(&mut stream), if !closing && running < MAX_RUNNING => {
                    if let Some(polled) = polled {
                        let now = Instant::now();
                        let total = now - waiting;
                        spin.waited(Waited::Slept { polled, total }, now);
                    }
                    read
                }
                Some(answer) = answers.recv(), if running > 0 => {
                    running -= 1;
                    out.extend_from_slice(&answer);
                    while let Ok(answer) = answers.try_recv() {
                        running -= 1;
                        out.extend_from_slice(&answer);
                    }
                    continue;
                }
                _ = context.shutdown.changed(), if !closing => continue,
                () = expired, if running == 0 && !closing => break,
                // One last look at what it sent already (nothing: closed), which a
                // `hello` or an `auth` moves on.
                () = evicted, if running == 0 && !closing => {
                    looked = true;
                    input.try_fill(&stream)
                }
            },
        };
        match read {
            Ok(0) => {
                if input.has_partial() {
                    let number = session.next_frame();
                    let start = out.len();
                    service.truncated_frame(&session, &mut out, number, input.partial_line());
                    framed(&mut out, start, session.codec());
                }
                closing = true;
            }
            // Idleness ends with a whole request (above), not with any byte.
            Ok(_) => {}
            Err(_) => return,
        }
    }
    let _ = stream.shutdown().await;
    if *context.shutdown.borrow() {
        linger(&mut stream, Duration::from_millis(100)).await;
    }
}

/// A stream that can be read without waiting.
pub trait NonBlocking {
    /// Appends what can be read now to `buf`; `WouldBlock` if nothing can.
    fn try_read_buf(&self, buf: &mut Vec<u8>) -> io::Result<usize>;
}

impl NonBlocking for TcpStream {
    fn try_read_buf(&self, buf: &mut Vec<u8>) -> io::Result<usize> {
        TcpStream::try_read_buf(self, buf)
    }
}

impl NonBlocking for UnixStream {
    fn try_read_buf(&self, buf: &mut Vec<u8>) -> io::Result<usize> {
        UnixStream::try_read_buf(self, buf)
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

/// `out`, a session's framed answers, once settled for sending ([`Service::settle`]).
fn settled<'o, S: Store>(
    service: &Service<S>,
    session: &Session,
    out: &'o mut Vec<u8>,
) -> &'o mut Vec<u8> {
    service.settle(session, out, |answer| framed(answer, 0, session.codec()));
    out
}

/// What a send of `out` to `session`'s client (`sent`) leaves: none of it, and no error
/// when the client closed the connection ([`Session::close_by_client`]).
fn delivered(session: &Session, out: &mut Vec<u8>, sent: io::Result<()>) -> io::Result<()> {
    match sent {
        Err(error)
            if matches!(
                error.kind(),
                ErrorKind::BrokenPipe | ErrorKind::ConnectionReset
            ) =>
        {
            session.close_by_client()
        }
        Err(error) => return Err(error),
        Ok(()) => {}
    }
    out.clear();
    Ok(())
}

/// Sends `out` ([`send_settled`]), unless its client closed the connection: then the
/// answers are dropped, and the frames it sent before are still read
/// ([`Session::close_by_client`]). Fails as the send does otherwise.
async fn deliver<T: AsyncWrite + AsRawFd + Unpin, S: Store>(
    stream: &mut T,
    service: &Service<S>,
    session: &Session,
    out: &mut Vec<u8>,
    slot: &Slot,
    auth_deadline: Instant,
    idle: Option<Duration>,
) -> io::Result<()> {
    let sent = match session.closed_by_client() {
        true => Ok(()),
        false => send_settled(stream, service, session, out, slot, auth_deadline, idle).await,
    };
    delivered(session, out, sent)
}

/// Writes `session`'s answers in `out`, settled ([`settled`]), noting how far each part
/// went ([`Service::written`]), as [`send_until`] writes.
async fn send_settled<T: AsyncWrite + AsRawFd + Unpin, S: Store>(
    stream: &mut T,
    service: &Service<S>,
    session: &Session,
    out: &mut Vec<u8>,
    slot: &Slot,
    auth_deadline: Instant,
    idle: Option<Duration>,
) -> io::Result<()> {
    let out = settled(service, session, out);
    let written = |through| service.written(session, through);
    send_until(stream, out, slot, auth_deadline, idle, written).await
}

/// Writes `out` and empties it, unless a write makes no progress until [`write_ends`]
/// (then the connection is to close): each part the socket takes starts the wait again,
/// and `written` is told how far it went.
async fn send_until<S: AsyncWrite + AsRawFd + Unpin>(
    stream: &mut S,
    out: &mut Vec<u8>,
    slot: &Slot,
    auth_deadline: Instant,
    idle: Option<Duration>,
    written: impl Fn(usize),
) -> io::Result<()> {
    let mut sent = 0;
    let fd = stream.as_raw_fd();
    while sent < out.len() {
        tokio::select! {
            // A write that can go at once goes without the wait's timer and `SIOCOUTQ`.
            biased;
            wrote = stream.write(&out[sent..out.len().min(sent + WRITE_PIECE)]) => match wrote? {
                0 => return Err(ErrorKind::WriteZero.into()),
                wrote => {
                    sent += wrote;
                    written(sent);
                }
            },
            () = write_ends(slot, auth_deadline, idle, fd) => return Err(ErrorKind::TimedOut.into()),
        }
    }
    out.clear();
    Ok(())
}

/// When a write of answers that the client does not read ends its connection: for one
/// that has not proved the secret, at its deadline or once evicted (whatever it sends,
/// it cannot stay longer by not reading); for any other, once its client read none of
/// what the socket `fd` holds for it for the idle timeout (it stopped reading). A slow
/// reader makes progress though the socket may not take more until it read much more.
async fn write_ends(slot: &Slot, auth_deadline: Instant, idle: Option<Duration>, fd: RawFd) {
    match slot {
        Slot::Unproved(place) => tokio::select! {
            () = tokio::time::sleep_until(auth_deadline.into()) => {}
            () = place.entry.evicted() => {}
        },
        Slot::Held { .. } => match idle {
            Some(idle) => {
                let mut unread = unread_bytes(fd);
                loop {
                    tokio::time::sleep(idle).await;
                    if !read_since(fd, &mut unread) {
                        return;
                    }
                }
            }
            None => std::future::pending().await,
        },
    }
}

/// Whether the peer of socket `fd` read some of the `unread` bytes it had not read at the
/// last look; `unread` becomes what it has not read now.
fn read_since(fd: RawFd, unread: &mut Option<usize>) -> bool {
    match (*unread, unread_bytes(fd)) {
        (Some(before), Some(now)) if now < before => {
            *unread = Some(now);
            true
        }
        _ => false,
    }
}

/// The bytes written to socket `fd` that its peer has not read yet (`SIOCOUTQ`).
fn unread_bytes(fd: RawFd) -> Option<usize> {
    let mut unread: libc::c_int = 0;
    // SAFETY: TIOCOUTQ writes one int at the pointer given, a live local.
    let done = unsafe { libc::ioctl(fd, libc::TIOCOUTQ, &mut unread) };
    (done == 0).then_some(unread as usize)
}

/// How long the check of an existing socket file waits for a connection.
const STALE_CHECK_TIMEOUT: Duration = Duration::from_secs(1);

/// A connection to the Unix socket at `path`, or why not; `None` when none came within
/// `timeout` (the connecting thread is left to its fate: the daemon is about to exit).
fn connect_within(
    path: &Path,
    timeout: Duration,
) -> Option<io::Result<std::os::unix::net::UnixStream>> {
    let (sender, receiver) = std::sync::mpsc::channel();
    let path = path.to_path_buf();
    std::thread::spawn(move || {
        let _ = sender.send(std::os::unix::net::UnixStream::connect(path));
    });
    receiver.recv_timeout(timeout).ok()
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
        // Stale only when refused: nobody listens. Any other failure (another user's
        // socket this one may not connect to) says nothing of whether it is in use, and a
        // listener that accepts nothing (its backlog full) holds a blocking connect.
        Ok(_) => match connect_within(path, STALE_CHECK_TIMEOUT) {
            Some(Ok(_)) => Err(format!(
                "another process is listening on {}",
                path.display()
            )),
            None => Err(format!(
                "another process is listening on {} (it accepts nothing); not replacing it",
                path.display()
            )),
            Some(Err(error)) if error.kind() == ErrorKind::ConnectionRefused => {
                std::fs::remove_file(path).map_err(|error| {
                    format!("cannot remove stale socket {}: {error}", path.display())
                })
            }
            Some(Err(error)) => Err(format!(
                "cannot tell whether {} is in use ({error}); not replacing it",
                path.display()
            )),
        },
    }
}

/// A Unix socket file this daemon bound, removed when dropped if its path still names it.
struct SocketFile {
    path: PathBuf,
    /// Its device and inode, as found right after `bind`.
    id: (u64, u64),
}

impl SocketFile {
    /// The socket file just bound at `path`.
    fn bound(path: &Path) -> io::Result<Self> {
        let found = std::fs::symlink_metadata(path)?;
        if !found.file_type().is_socket() {
            return Err(io::Error::other(
                "replaced by something else right after bind",
            ));
        }
        let path = path.to_path_buf();
        let id = (found.dev(), found.ino());
        Ok(Self { path, id })
    }

    /// Whether its path still names it (a symlink there is not followed).
    fn is_there(&self) -> bool {
        std::fs::symlink_metadata(&self.path).is_ok_and(|found| {
            found.file_type().is_socket() && (found.dev(), found.ino()) == self.id
        })
    }
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        if self.is_there() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Under a low descriptor limit each bound is cut in proportion, never to nothing.
    #[test]
    fn bounds_are_cut_in_proportion_to_the_descriptors() {
        let full = UnprovedBounds::FULL;
        assert_eq!(full.scaled(592, 592), full);
        let cut = full.scaled(136, 592);
        assert_eq!((cut.silent, cut.greeted, cut.lingering), (14, 58, 3));
        let least = full.scaled(0, 592);
        assert_eq!((least.silent, least.greeted, least.lingering), (1, 1, 1));
    }

    /// New connections, however many, evict only the oldest silent ones; a connection sent
    /// its nonce evicts only the oldest greeted one; places are left when dropped.
    #[test]
    fn silent_connections_evict_only_silent_ones() {
        let unproved = Arc::new(Unproved::new(UnprovedBounds::FULL, 1));
        let first = unproved.admit(None);
        let greeted: Vec<Place> = (0..MAX_GREETED).map(|_| greet(&unproved)).collect();
        let silent: Vec<Place> = (0..10 * MAX_SILENT).map(|_| unproved.admit(None)).collect();
        assert!(first.entry.is_evicted());
        assert!(greeted.iter().all(|place| !place.entry.is_evicted()));
        let kept = silent.iter().position(|place| !place.entry.is_evicted());
        assert_eq!(
            kept,
            Some(silent.len() - MAX_SILENT),
            "the newest silent ones kept"
        );
        assert!(silent[silent.len() - MAX_SILENT..]
            .iter()
            .all(|place| !place.entry.is_evicted()));
        let newest = greet(&unproved);
        let evicted: Vec<bool> = greeted
            .iter()
            .map(|place| place.entry.is_evicted())
            .collect();
        assert_eq!(evicted.iter().filter(|&&evicted| evicted).count(), 1);
        assert!(evicted[0] && !newest.entry.is_evicted());
        assert!(!silent.last().unwrap().entry.is_evicted());
        drop((first, greeted, silent, newest));
        assert!(unproved.is_empty());
    }

    /// A place among the greeted connections without one among the silent ones first.
    fn greet(unproved: &Arc<Unproved>) -> Place {
        unproved.join(true, None)
    }

    /// Whether `descriptor` stays pending for a while.
    async fn pending<F: std::future::Future>(descriptor: F) -> bool {
        tokio::time::timeout(Duration::from_millis(50), descriptor)
            .await
            .is_err()
    }

    /// Queues of two silent places and one greeted, for `listeners` listeners.
    fn small(listeners: usize) -> Arc<Unproved> {
        let bounds = UnprovedBounds {
            silent: 2,
            greeted: 1,
            lingering: 1,
        };
        Arc::new(Unproved::new(bounds, listeners))
    }

    /// A connection accepted with a descriptor of `unproved`, in its silent queue.
    async fn accepted(unproved: &Arc<Unproved>) -> Place {
        let descriptor = unproved.descriptor().await.unwrap();
        unproved.admit(Some(descriptor))
    }

    /// A connection evicted holds its descriptor until it closes: past the queues' places
    /// and the listeners' own, the next descriptor is given only then, and evicts no one
    /// meanwhile.
    #[tokio::test]
    async fn an_evicted_connection_holds_its_descriptor_until_it_closes() {
        let unproved = small(1);
        let mut first = accepted(&unproved).await;
        let greeted = unproved.greet(&mut first);
        let mut silent = Vec::new();
        for _ in 0..3 {
            silent.push(accepted(&unproved).await);
        }
        // Three silent ones for two places: the first evicted, still open.
        assert!(silent[0].entry.is_evicted());
        assert!(pending(unproved.descriptor()).await);
        assert!(!silent[1].entry.is_evicted() && !greeted.entry.is_evicted());
        drop(silent.remove(0));
        assert!(unproved.descriptor().await.is_ok());
    }

    /// Each listener waiting to accept holds a descriptor of its own: with every place in
    /// the queues taken and no evicted connection left, another listener's next
    /// connection is still accepted (it evicts the oldest silent one as it joins).
    #[tokio::test]
    async fn a_listener_waiting_to_accept_holds_no_place_of_the_queues() {
        let unproved = small(2);
        let _waiting_to_accept = unproved.descriptor().await.unwrap();
        let mut first = accepted(&unproved).await;
        let _greeted = unproved.greet(&mut first);
        let mut silent = Vec::new();
        for _ in 0..2 {
            silent.push(accepted(&unproved).await);
        }
        let newest = tokio::time::timeout(Duration::from_secs(1), accepted(&unproved));
        let newest = newest.await.unwrap();
        assert!(silent[0].entry.is_evicted() && !newest.entry.is_evicted());
    }
}

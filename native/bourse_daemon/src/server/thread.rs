//! A connection to the in-memory table, served on a thread of its own: the thread that
//! reads a request answers it, and sleeps in `poll` on the socket alone, so no other thread
//! hands it work or is woken for it. (A runtime's reactor also watches the socket for room
//! to write, and wakes whenever the client reads an answer.) A Unix connection comes here
//! once accepted, a TCP connection once it proved the secret. Reads and writes never
//! block; a write waits for room in `poll`, blocking this connection only.

use std::io::{self, ErrorKind};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::mpsc::SyncSender;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::runtime::{Builder, Runtime};

use super::frames::{framed, Frames, Framing, Next};
use super::{
    delivered, read_since, settled, unread_bytes, Context, NonBlocking, Slot, WRITE_CHUNK,
    WRITE_PIECE,
};
use crate::protocol::{Codec, Service, Session};
use crate::spin::{Spin, Waited};
use crate::store::Store;

/// A connection's socket, still registered with the runtime's reactor.
pub enum Stream {
    Unix(tokio::net::UnixStream),
    Tcp(tokio::net::TcpStream),
}

/// What a thread serves: the stream, the slot it holds while it serves, and, for a
/// connection served by the runtime so far, its session and what it read and has not
/// answered yet.
pub struct Connection {
    pub stream: Stream,
    pub slot: Slot,
    pub begun: Option<(Session, Frames)>,
}

impl From<tokio::net::UnixStream> for Stream {
    fn from(stream: tokio::net::UnixStream) -> Self {
        Stream::Unix(stream)
    }
}

impl From<tokio::net::TcpStream> for Stream {
    fn from(stream: tokio::net::TcpStream) -> Self {
        Stream::Tcp(stream)
    }
}

/// A thread started to serve one connection, waiting for it.
pub struct Thread<S: Store> {
    give: SyncSender<(Connection, Context<S>, Runtime)>,
    runtime: Runtime,
}

/// Starts a thread for a connection; `None` at the system's thread limit.
pub fn start<S: Store>() -> Option<Thread<S>> {
    // The store's futures are ready at once: a runtime without drivers runs them.
    let runtime = Builder::new_current_thread().build().ok()?;
    let (give, take) = std::sync::mpsc::sync_channel(1);
    let started = std::thread::Builder::new()
        .name("connection".into())
        .spawn(move || {
            if let Ok((connection, context, runtime)) = take.recv() {
                serve(connection, context, runtime);
            }
        });
    match started {
        Ok(_) => Some(Thread { give, runtime }),
        Err(_) => {
            // Dropped, it would wait for its blocking threads, which the caller must not.
            runtime.shutdown_background();
            None
        }
    }
}

impl<S: Store> Thread<S> {
    /// Hands the connection to the thread.
    pub fn serve(self, connection: Connection, context: Context<S>) {
        let _ = self.give.send((connection, context, self.runtime));
    }
}

/// Answers the connection's frames in order until it closes, sends an oversized frame,
/// stays idle past its timeout, or the daemon shuts down (then the frames already read are
/// answered first).
fn serve<S: Store>(connection: Connection, context: Context<S>, runtime: Runtime) {
    let Connection {
        stream,
        slot: _slot,
        begun,
    } = connection;
    let idle = context.limits.idle_timeout;
    let Some(stream) = Socket::out_of_runtime(stream) else {
        return;
    };
    let service = Arc::clone(&context.service);
    let (session, mut input) = begun.unwrap_or_else(|| {
        let idle_ms = idle.map(|idle| idle.as_millis() as u64);
        let input = Frames::new(context.limits.max_frame_bytes);
        (service.session(false, idle_ms), input)
    });
    let mut out = Vec::with_capacity(4096);
    let mut spin = Spin::default();
    let mut active = Instant::now();
    let mut closing = false;
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
                    let start = out.len();
                    runtime.block_on(service.handle(&session, number, frame, &mut out));
                    framed(&mut out, start, session.codec());
                    // The first frame may choose the codec (and framing) of the next ones.
                    if number == 1 && session.codec() == Codec::Etf {
                        input.length_prefixed();
                    }
                    if out.len() >= WRITE_CHUNK {
                        if deliver(&stream, &service, &session, &mut out, idle).is_err() {
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
                    let _ = send_settled(&stream, &service, &session, &mut out, idle);
                    let _ = stream.shutdown(Shutdown::Write);
                    linger(&stream, Duration::from_secs(1));
                    return;
                }
                Next::Pending => break,
            }
        }
        if !out.is_empty() {
            if deliver(&stream, &service, &session, &mut out, idle).is_err() {
                return;
            }
            active = Instant::now();
        }
        if closing || *context.shutdown.borrow() {
            break;
        }
        let deadline = idle.map(|idle| active + idle);
        let waiting = Instant::now();
        let polled = match context.alone() {
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
            Err(polled) => match wait(stream.as_fd(), Some(context.stopped.as_fd()), deadline) {
                Woken::Input => {
                    if let Some(polled) = polled {
                        let now = Instant::now();
                        spin.waited(
                            Waited::Slept {
                                polled,
                                total: now - waiting,
                            },
                            now,
                        );
                    }
                    input.try_fill(&stream)
                }
                // The frames read so far are answered, then the loop ends.
                Woken::Stopped => continue,
                Woken::Expired => break,
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
            Err(error)
                if matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {}
            Err(_) => return,
        }
    }
    let _ = stream.shutdown(Shutdown::Write);
    if *context.shutdown.borrow() {
        linger(&stream, Duration::from_millis(100));
    }
}

/// A connection's socket out of the runtime's reactor. Its reads and writes never wait.
enum Socket {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Socket {
    fn out_of_runtime(stream: Stream) -> Option<Self> {
        Some(match stream {
            Stream::Unix(stream) => Socket::Unix(stream.into_std().ok()?),
            Stream::Tcp(stream) => Socket::Tcp(stream.into_std().ok()?),
        })
    }

    /// Writes what the socket takes of `bytes` now; `WouldBlock` if it takes nothing.
    fn try_write(&self, bytes: &[u8]) -> io::Result<usize> {
        // SAFETY: send reads at most `bytes.len()` bytes from the slice given.
        let wrote = unsafe {
            libc::send(
                self.as_fd().as_raw_fd(),
                bytes.as_ptr().cast(),
                bytes.len(),
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        match wrote {
            0.. => Ok(wrote as usize),
            _ => Err(io::Error::last_os_error()),
        }
    }

    fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match self {
            Socket::Unix(stream) => stream.shutdown(how),
            Socket::Tcp(stream) => stream.shutdown(how),
        }
    }
}

impl AsFd for Socket {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Socket::Unix(stream) => stream.as_fd(),
            Socket::Tcp(stream) => stream.as_fd(),
        }
    }
}

impl NonBlocking for Socket {
    fn try_read_buf(&self, buf: &mut Vec<u8>) -> io::Result<usize> {
        let spare = buf.spare_capacity_mut();
        // SAFETY: recv writes at most `spare.len()` bytes into the spare capacity, and
        // reports how many it wrote; only those are then counted as initialised.
        let read = unsafe {
            libc::recv(
                self.as_fd().as_raw_fd(),
                spare.as_mut_ptr().cast(),
                spare.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if read < 0 {
            return Err(io::Error::last_os_error());
        }
        let read = read as usize;
        unsafe { buf.set_len(buf.len() + read) };
        Ok(read)
    }
}

/// Sends `out` ([`send_settled`]), unless its client closed the connection: then the
/// answers are dropped, and the frames it sent before are still read
/// ([`Session::close_by_client`]). Fails as the send does otherwise (a client that stopped
/// reading).
fn deliver<S: Store>(
    stream: &Socket,
    service: &Service<S>,
    session: &Session,
    out: &mut Vec<u8>,
    idle: Option<Duration>,
) -> io::Result<()> {
    let sent = match session.closed_by_client() {
        true => Ok(()),
        false => send_settled(stream, service, session, out, idle),
    };
    delivered(session, out, sent)
}

/// Sends `out`, settled ([`settled`]), and notes when it was sent ([`Service::sent`]).
fn send_settled<S: Store>(
    stream: &Socket,
    service: &Service<S>,
    session: &Session,
    out: &mut Vec<u8>,
    idle: Option<Duration>,
) -> io::Result<()> {
    let written = |through| service.written(session, through);
    send(stream, settled(service, session, out), idle, written)
}

/// Writes `out` and empties it, unless the client read none of what the socket holds for
/// it for `idle` while the socket had no room (it stopped reading; the connection is to
/// close); `written` is told how far it went after each part. A slow reader makes progress
/// though the socket may take no more until it read much more.
fn send(
    stream: &Socket,
    out: &mut Vec<u8>,
    idle: Option<Duration>,
    written: impl Fn(usize),
) -> io::Result<()> {
    let mut sent = 0;
    while sent < out.len() {
        match stream.try_write(&out[sent..out.len().min(sent + WRITE_PIECE)]) {
            Ok(wrote) => {
                sent += wrote;
                written(sent);
            }
            Err(error) if error.kind() == ErrorKind::WouldBlock => room(stream, idle)?,
            Err(error) if error.kind() == ErrorKind::Interrupted => {}
            Err(error) => return Err(error),
        }
    }
    out.clear();
    Ok(())
}

/// Waits until `stream` has room to write; fails once its client read none of what the
/// socket holds for it for `idle`.
fn room(stream: &Socket, idle: Option<Duration>) -> io::Result<()> {
    let fd = stream.as_fd().as_raw_fd();
    let mut unread = unread_bytes(fd);
    let timeout = idle.map_or(-1, |idle| {
        idle.as_millis().clamp(1, i32::MAX as u128) as libc::c_int
    });
    loop {
        let mut fds = [libc::pollfd {
            fd,
            events: libc::POLLOUT,
            revents: 0,
        }];
        // SAFETY: `fds` is an array of one initialised pollfd, as its length says.
        // Interrupted or with room, the caller tries to write again.
        if unsafe { libc::poll(fds.as_mut_ptr(), 1, timeout) } != 0 {
            return Ok(());
        }
        if !read_since(fd, &mut unread) {
            return Err(ErrorKind::TimedOut.into());
        }
    }
}

/// What ended a [`wait`].
enum Woken {
    /// The socket has input, or was closed.
    Input,
    /// The daemon is shutting down.
    Stopped,
    /// The deadline passed first.
    Expired,
}

/// Sleeps until `socket` can be read, `stopped` can be read (the daemon shuts down), or
/// `deadline` passes. Only input wakes it: not room to write.
fn wait(socket: BorrowedFd, stopped: Option<BorrowedFd>, deadline: Option<Instant>) -> Woken {
    let mut fds = [
        libc::pollfd {
            fd: socket.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            // A negative descriptor is ignored.
            fd: stopped.map_or(-1, |stopped| stopped.as_raw_fd()),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    loop {
        // Past the deadline, one look without waiting: input that came while this thread
        // was busy (writing, say) is read, not taken for idleness.
        let (timeout, last) = match deadline {
            None => (-1, false),
            Some(deadline) => match deadline.checked_duration_since(Instant::now()) {
                None => (0, true),
                // Rounded up: woken before the deadline, it would only wait again.
                Some(left) => (
                    left.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32,
                    false,
                ),
            },
        };
        // SAFETY: `fds` is an array of two initialised pollfd, as its length says.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
        if ready > 0 {
            return match fds[1].revents != 0 {
                true => Woken::Stopped,
                false => Woken::Input,
            };
        }
        if last {
            return Woken::Expired;
        }
        // Interrupted, or timed out (then the deadline is checked again).
    }
}

/// Reads and discards what the peer still sends, for at most `patience` and 1 MiB: closing
/// a socket with unread input resets it, which can destroy answers the peer has not read.
fn linger(stream: &Socket, patience: Duration) {
    let until = Instant::now() + patience;
    let mut sink = Vec::with_capacity(8192);
    let mut budget = 1usize << 20;
    while budget > 0 {
        // Not ended by a shutdown: it may be part of one.
        if !matches!(wait(stream.as_fd(), None, Some(until)), Woken::Input) {
            return;
        }
        sink.clear();
        match stream.try_read_buf(&mut sink) {
            Ok(0) => return,
            Ok(read) => budget = budget.saturating_sub(read),
            Err(error) if error.kind() == ErrorKind::WouldBlock => {}
            Err(_) => return,
        }
    }
}

//! A Unix connection to the in-memory table, served on a thread of its own: the thread that
//! reads a request answers it, and sleeps in `poll` on the socket alone, so no other thread
//! hands it work or is woken for it. (A runtime's reactor also watches the socket for room
//! to write, and wakes whenever the client reads an answer.) Reads never block; writes
//! block this connection only.

use std::io::{self, ErrorKind, Write};
use std::net::Shutdown;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::runtime::{Builder, Runtime};
use tokio::sync::OwnedSemaphorePermit;

use super::frames::{framed, Frames, Framing, Next};
use super::{Context, NonBlocking, Slot, WRITE_CHUNK};
use crate::protocol::Codec;
use crate::spin::{Spin, Waited};
use crate::store::Store;

/// Serves `stream` on a new thread; without one (at the system's thread limit), as a task
/// of the runtime, as a TCP connection is.
pub fn spawn<S: Store>(
    stream: tokio::net::UnixStream,
    context: Context<S>,
    permit: OwnedSemaphorePermit,
) {
    // The store's futures are ready at once: a runtime without drivers runs them.
    let runtime = Builder::new_current_thread().build();
    let (give, take) = std::sync::mpsc::sync_channel(1);
    let started = runtime.is_ok()
        && std::thread::Builder::new()
            .name("connection".into())
            .spawn(move || {
                if let Ok((stream, context, runtime)) = take.recv() {
                    serve(stream, context, runtime);
                }
            })
            .is_ok();
    let slot = Slot::Held { _permit: permit };
    match runtime {
        Ok(runtime) if started => {
            let _ = give.send((Connection { stream, slot }, context, runtime));
        }
        runtime => {
            // Dropped, it would wait for its blocking threads, which this task must not.
            if let Ok(runtime) = runtime {
                runtime.shutdown_background();
            }
            tokio::spawn(super::serve(stream, context, slot));
        }
    }
}

/// What the thread gets: its stream, and the slot it holds while it serves.
struct Connection {
    stream: tokio::net::UnixStream,
    slot: Slot,
}

/// Answers the connection's frames in order until it closes, sends an oversized frame,
/// stays idle past its timeout, or the daemon shuts down (then the frames already read are
/// answered first).
fn serve<S: Store>(connection: Connection, context: Context<S>, runtime: Runtime) {
    let Connection {
        stream,
        slot: _slot,
    } = connection;
    // Out of the runtime's reactor, and blocking: reads ask not to wait.
    let Ok(stream) = stream.into_std() else {
        return;
    };
    if stream.set_nonblocking(false).is_err() {
        return;
    }
    let service = Arc::clone(&context.service);
    let idle = context.limits.idle_timeout;
    let session = service.session(false, idle.map(|idle| idle.as_millis() as u64));
    let mut input = Frames::new(context.limits.max_frame_bytes);
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
                    let number = session.next_frame();
                    let start = out.len();
                    runtime.block_on(service.handle(&session, number, frame, &mut out));
                    framed(&mut out, start, session.codec());
                    // The first frame may choose the codec (and framing) of the next ones.
                    if number == 1 && session.codec() == Codec::Etf {
                        input.length_prefixed();
                    }
                    if out.len() >= WRITE_CHUNK && send(&stream, &mut out).is_err() {
                        return;
                    }
                }
                Next::TooLarge => {
                    let number = session.next_frame();
                    let start = out.len();
                    let max = context.limits.max_frame_bytes;
                    service.frame_too_large(&session, &mut out, number, max);
                    framed(&mut out, start, session.codec());
                    let _ = send(&stream, &mut out);
                    let _ = stream.shutdown(Shutdown::Write);
                    linger(&stream, Duration::from_secs(1));
                    return;
                }
                Next::Pending => break,
            }
        }
        if send(&stream, &mut out).is_err() {
            return;
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
                    service.truncated_frame(&session, &mut out, number);
                    framed(&mut out, start, session.codec());
                }
                closing = true;
            }
            Ok(_) => active = Instant::now(),
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

impl NonBlocking for UnixStream {
    fn try_read_buf(&self, buf: &mut Vec<u8>) -> io::Result<usize> {
        let spare = buf.spare_capacity_mut();
        // SAFETY: recv writes at most `spare.len()` bytes into the spare capacity, and
        // reports how many it wrote; only those are then counted as initialised.
        let read = unsafe {
            libc::recv(
                self.as_raw_fd(),
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

fn send(mut stream: &UnixStream, out: &mut Vec<u8>) -> io::Result<()> {
    if !out.is_empty() {
        stream.write_all(out)?;
        out.clear();
    }
    Ok(())
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
        let timeout = match deadline {
            None => -1,
            Some(deadline) => match deadline.checked_duration_since(Instant::now()) {
                None => return Woken::Expired,
                // Rounded up: woken before the deadline, it would only wait again.
                Some(left) => left.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32,
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
        // Interrupted, or timed out (then the deadline is checked again).
    }
}

/// Reads and discards what the peer still sends, for at most `patience` and 1 MiB: closing
/// a socket with unread input resets it, which can destroy answers the peer has not read.
fn linger(stream: &UnixStream, patience: Duration) {
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

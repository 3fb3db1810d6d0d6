//! `--stdio`: one client (an Erlang port) on stdin/stdout, 4-byte big-endian length-prefixed
//! frames (JSON, or external terms once the first `hello` chose them), read on the main
//! thread: there is only one stream.
//!
//! - With the in-memory table, blocking reads; each request is answered before the next is
//!   read, and pipelined answers share a write. When the input runs out, stdin is polled for
//!   a few microseconds before the thread sleeps, as [`Spin`] decides.
//! - With a remote store (Redis) the main thread runs the runtime (a current-thread one),
//!   and stdin is read by it as the store's connection is: a request goes to Redis from the
//!   thread that read it, with no other thread to wake on the way. Each request runs as a
//!   task and its answer is written as soon as it is ready, so one slow answer holds back
//!   no other; the answers one reply of the store makes ready share a write.

use std::fs::File;
use std::io::{self, BufRead, BufReader, ErrorKind, Stdout, Write};
use std::mem::ManuallyDrop;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::runtime::Runtime;
use tokio::sync::Notify;

use crate::protocol::{self, Codec, Service, Session};
use crate::server::{length_prefixed, prefixed_length};
use crate::spin::{Spin, Waited};
use crate::store::{Store, MAX_RUNNING};
use crate::sweeper;

mod output;

use output::Output;

/// What reading one frame found.
enum Frame {
    /// A frame is in the buffer.
    Data,
    /// stdin closed between frames: the VM closed the port or died.
    Closed,
    /// stdin closed in the middle of a frame, whose bytes after its header (if whole) are
    /// in the buffer.
    Cut,
    /// The header announced this many bytes, more than allowed.
    TooLarge,
}

/// What the reader and the tasks answering share.
struct Shared<S: Store> {
    service: Arc<Service<S>>,
    session: Session,
    output: Arc<Output<Stdout>>,
    /// Requests running on the remote store.
    running: AtomicUsize,
    /// Told each time one of them ends.
    ended: Notify,
    /// Set by SIGTERM: requests read from now on are not run.
    stopping: AtomicBool,
    /// How long a stop waits for the requests running on the remote store.
    drain_timeout: Duration,
}

impl<S: Store> Shared<S> {
    /// [`Self::drain`] on the thread that runs the requests (a remote store's).
    async fn drained(&self) {
        let deadline = Instant::now() + self.drain_timeout;
        while self.running.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let _ = self.output.flush();
    }

    /// Waits (at most the drain timeout) for the requests still running, then flushes.
    fn drain(&self) {
        let deadline = Instant::now() + self.drain_timeout;
        while self.running.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
        let _ = self.output.flush();
    }
}

/// Serves until stdin closes (exit 0), a frame is too large (exit 1) or SIGTERM (exit 0,
/// after the answers of the requests already running are written). A remote store needs
/// `runtime` to be a current-thread one: this thread runs it; a stop waits for its requests
/// up to `drain_timeout`.
pub fn run<S: Store>(
    service: Arc<Service<S>>,
    runtime: &Runtime,
    max_frame_bytes: usize,
    sweep_interval: Duration,
    drain_timeout: Duration,
) -> ExitCode {
    let shared = Arc::new(Shared {
        session: service.session(false, None),
        service,
        output: Output::new(io::stdout()),
        running: AtomicUsize::new(0),
        ended: Notify::new(),
        stopping: AtomicBool::new(false),
        drain_timeout,
    });
    if let Err(error) = watch_signals(Arc::clone(&shared)) {
        eprintln!("bourse_daemon: cannot install signal handlers: {error}");
        return ExitCode::FAILURE;
    }
    let _sweeper = match sweeper::start(Arc::clone(&shared.service), sweep_interval) {
        Ok(sweeper) => sweeper,
        Err(error) => {
            eprintln!("bourse_daemon: cannot start the sweeper thread: {error}");
            return ExitCode::FAILURE;
        }
    };
    if S::REMOTE {
        return runtime.block_on(serve_remote(shared, max_frame_bytes));
    }
    serve_local(&shared, runtime, max_frame_bytes)
}

/// Serves the in-memory table: blocking reads, each request answered before the next.
fn serve_local<S: Store>(
    shared: &Arc<Shared<S>>,
    runtime: &Runtime,
    max_frame_bytes: usize,
) -> ExitCode {
    // Read unbuffered by std, so that nothing sits in a buffer `poll` cannot see; never
    // closed (ManuallyDrop): fd 0 belongs to the process.
    // SAFETY: fd 0 is open for the life of the process, and read only here.
    let stdin = ManuallyDrop::new(unsafe { File::from_raw_fd(libc::STDIN_FILENO) });
    let mut reader = BufReader::with_capacity(64 * 1024, &*stdin);
    let mut frame = Vec::new();
    let mut answers = Answers::default();
    let mut spin = Spin::default();
    loop {
        if reader.buffer().is_empty() {
            await_input(&mut spin);
        }
        let found = read_frame(&mut reader, &mut frame, max_frame_bytes);
        if !matches!(found, Ok(Frame::Data)) {
            if let Err(error) = answers.send(shared) {
                return write_failed(error);
            }
        }
        let number = shared.session.next_frame();
        let written = match found {
            Ok(Frame::Data) => {
                // Counted as running before `stopping` is read, until its answer is written:
                // a stop either sees it running and waits for its answer, or it sees the
                // stop and runs nothing.
                shared.running.fetch_add(1, Ordering::SeqCst);
                if shared.stopping.load(Ordering::SeqCst) {
                    shared.running.fetch_sub(1, Ordering::SeqCst);
                    answers.send(shared)
                } else {
                    let session = &shared.session;
                    let start = answers.bytes.len();
                    let handled =
                        shared
                            .service
                            .handle(session, number, &frame, &mut answers.bytes);
                    runtime.block_on(handled);
                    answers.framed(start);
                    // Pipelined requests share a write: sent before a read that may wait.
                    match !holds_frame(reader.buffer()) || answers.bytes.len() >= WRITE_BYTES {
                        true => answers.send(shared),
                        false => Ok(()),
                    }
                }
            }
            Ok(Frame::Closed) => {
                shared.drain();
                return ExitCode::SUCCESS;
            }
            Ok(Frame::Cut) => {
                answer_cut(shared, number, &frame);
                shared.drain();
                return ExitCode::SUCCESS;
            }
            Ok(Frame::TooLarge) => {
                let (session, mut out) = (&shared.session, vec![0; 4]);
                shared
                    .service
                    .frame_too_large(session, &mut out, number, max_frame_bytes, None);
                let _ = shared.output.send(&mut out, true);
                eprintln!("bourse_daemon: frame longer than {max_frame_bytes} bytes; exiting");
                shared.drain();
                return ExitCode::FAILURE;
            }
            Err(error) => {
                eprintln!("bourse_daemon: reading stdin: {error}");
                return ExitCode::FAILURE;
            }
        };
        if let Err(error) = written {
            return write_failed(error);
        }
    }
}

/// Answers written with the in-memory table and not sent yet, each after its length.
#[derive(Default)]
struct Answers {
    bytes: Vec<u8>,
    count: usize,
}

/// Answers written past this many bytes are sent without waiting for the input to run out.
const WRITE_BYTES: usize = 64 * 1024;

impl Answers {
    /// Puts its length before the answer written from `start` on.
    fn framed(&mut self, start: usize) {
        length_prefixed(&mut self.bytes, start);
        self.count += 1;
    }

    /// Sends them, settled ([`Service::settle`]), and notes when ([`Service::sent`]); their
    /// requests then stop running.
    fn send<S: Store>(&mut self, shared: &Shared<S>) -> io::Result<()> {
        if self.count == 0 {
            return Ok(());
        }
        let session = &shared.session;
        let bytes = &mut self.bytes;
        shared
            .service
            .settle(session, bytes, |answer| length_prefixed(answer, 0));
        let sent = shared.output.send_framed(bytes);
        shared.service.sent(session);
        bytes.clear();
        shared.running.fetch_sub(self.count, Ordering::SeqCst);
        self.count = 0;
        sent
    }
}

/// Whether `buffer` starts with a whole frame, which can be read without waiting.
fn holds_frame(buffer: &[u8]) -> bool {
    prefixed_length(buffer).is_some_and(|length| buffer.len() - 4 >= length)
}

/// How the daemon stops after a failed write to stdout.
fn write_failed(error: io::Error) -> ExitCode {
    // The VM closed the port (or its socket).
    if matches!(
        error.kind(),
        ErrorKind::BrokenPipe | ErrorKind::ConnectionReset
    ) {
        return ExitCode::SUCCESS;
    }
    eprintln!("bourse_daemon: writing stdout: {error}");
    ExitCode::FAILURE
}

/// Serves a remote store on this thread's runtime: every whole frame read runs as a task
/// (a first one that may choose the codec of the next ones is answered first).
async fn serve_remote<S: Store>(shared: Arc<Shared<S>>, max_frame_bytes: usize) -> ExitCode {
    let mut stdin = match Input::open() {
        Ok(stdin) => stdin,
        Err(error) => {
            eprintln!("bourse_daemon: cannot watch stdin: {error}");
            return ExitCode::FAILURE;
        }
    };
    let mut input = Vec::with_capacity(READ_BYTES);
    let mut start = 0;
    loop {
        let rest = &input[start..];
        let whole = match prefixed_length(rest) {
            Some(length) => {
                if length > max_frame_bytes {
                    let mut out = vec![0; 4];
                    let number = shared.session.next_frame();
                    let session = &shared.session;
                    shared.service.frame_too_large(
                        session,
                        &mut out,
                        number,
                        max_frame_bytes,
                        None,
                    );
                    let _ = shared.output.send(&mut out, true);
                    eprintln!("bourse_daemon: frame longer than {max_frame_bytes} bytes; exiting");
                    shared.drained().await;
                    return ExitCode::FAILURE;
                }
                rest.get(4..4 + length)
            }
            None => None,
        };
        let Some(frame) = whole else {
            input.drain(..start);
            start = 0;
            match stdin.read_into(&mut input).await {
                Ok(0) => {}
                Ok(_) => continue,
                Err(error) if closed(&error) => {}
                Err(error) => {
                    eprintln!("bourse_daemon: reading stdin: {error}");
                    return ExitCode::FAILURE;
                }
            }
            // stdin ended, perhaps in the middle of a frame.
            if !input.is_empty() {
                let number = shared.session.next_frame();
                answer_cut(&shared, number, input.get(4..).unwrap_or_default());
            }
            shared.drained().await;
            return ExitCode::SUCCESS;
        };
        start += 4 + frame.len();
        let number = shared.session.next_frame();
        // Counted as running before `stopping` is read, as in `serve_local`.
        shared.running.fetch_add(1, Ordering::SeqCst);
        if shared.stopping.load(Ordering::SeqCst) {
            shared.running.fetch_sub(1, Ordering::SeqCst);
            continue;
        }
        if number > 1 || !protocol::may_set_up(frame) {
            spawn(&shared, number, frame.to_vec());
            // Past [`MAX_RUNNING`], stdin is read once one of them ends.
            while shared.running.load(Ordering::SeqCst) >= MAX_RUNNING {
                shared.ended.notified().await;
            }
            continue;
        }
        let mut out = vec![0; 4];
        shared
            .service
            .handle(&shared.session, number, frame, &mut out)
            .await;
        let sent = shared.output.send(&mut out, true);
        shared.running.fetch_sub(1, Ordering::SeqCst);
        if let Err(error) = sent {
            return write_failed(error);
        }
    }
}

/// Bytes asked of one read of stdin.
const READ_BYTES: usize = 64 * 1024;

/// stdin as the remote store's runtime reads it: watched by the runtime (a socket, a pipe,
/// a terminal), or, where it cannot be watched (a regular file, `/dev/null`: reading those
/// never waits), read at once.
enum Input {
    /// A socket (`--stdio-socket`, or a socket pair given as stdin): read without waiting
    /// by each call (`MSG_DONTWAIT`), so that one call both reads and finds it empty.
    Socket(AsyncFd<Stdin>),
    /// A pipe or terminal, which stays blocking, since it may be shared: read only once
    /// `poll` finds input (or its end) ready.
    Blocking(AsyncFd<Stdin>),
    Plain,
}

/// Fd 0, which belongs to the process: never closed.
struct Stdin;

impl AsRawFd for Stdin {
    fn as_raw_fd(&self) -> RawFd {
        libc::STDIN_FILENO
    }
}

impl Input {
    fn open() -> io::Result<Self> {
        // SAFETY: fd 0 is open for the life of the process and never closed (see `Stdin`).
        match unsafe { AsyncFd::register_with_interest(Stdin, Interest::READABLE) } {
            Ok(stdin) if stdin_is_socket() => Ok(Input::Socket(stdin)),
            Ok(stdin) => Ok(Input::Blocking(stdin)),
            Err(refused) => match refused.into_parts().1 {
                error if error.raw_os_error() == Some(libc::EPERM) => Ok(Input::Plain),
                error => Err(error),
            },
        }
    }

    /// Appends what one read finds to `input`; 0 bytes when stdin closed. Waits only while
    /// stdin has neither input nor its end.
    async fn read_into(&mut self, input: &mut Vec<u8>) -> io::Result<usize> {
        input.reserve(READ_BYTES);
        loop {
            let read = match self {
                Input::Socket(stdin) => {
                    let mut ready = stdin.readable().await?;
                    let read = read_stdin(input, libc::MSG_DONTWAIT);
                    if read.as_ref().is_err_and(would_block) {
                        ready.clear_ready();
                    }
                    read
                }
                Input::Blocking(stdin) => {
                    let mut ready = stdin.readable().await?;
                    if !stdin_ready(0) {
                        ready.clear_ready();
                        continue;
                    }
                    read_stdin(input, 0)
                }
                Input::Plain => read_stdin(input, 0),
            };
            match read {
                Err(error) if would_block(&error) || error.kind() == ErrorKind::Interrupted => {}
                read => return read,
            }
        }
    }
}

/// The error of a read that found nothing to read.
fn would_block(error: &io::Error) -> bool {
    error.kind() == ErrorKind::WouldBlock
}

/// Whether fd 0 is a socket.
fn stdin_is_socket() -> bool {
    // SAFETY: a stat is plain data, for which zero bytes are a valid value.
    let mut stat: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat writes only the stat it is given.
    let found = unsafe { libc::fstat(libc::STDIN_FILENO, &mut stat) } == 0;
    found && stat.st_mode & libc::S_IFMT == libc::S_IFSOCK
}

/// Appends what one read of stdin finds to `input`, within its spare capacity: `recv` with
/// `flags` when they are set (a socket), `read` otherwise.
fn read_stdin(input: &mut Vec<u8>, flags: libc::c_int) -> io::Result<usize> {
    let spare = input.spare_capacity_mut();
    let (buffer, length) = (spare.as_mut_ptr().cast(), spare.len());
    // SAFETY: both write at most `length` bytes, into memory `input` owns.
    let read = unsafe {
        match flags {
            0 => libc::read(libc::STDIN_FILENO, buffer, length),
            flags => libc::recv(libc::STDIN_FILENO, buffer, length, flags),
        }
    };
    if read < 0 {
        return Err(io::Error::last_os_error());
    }
    let read = read as usize;
    // SAFETY: the read initialised these `read` bytes.
    unsafe { input.set_len(input.len() + read) };
    Ok(read)
}

/// Runs one request on the remote store as a task; its answer is written when ready.
/// The caller counted it as running.
fn spawn<S: Store>(shared: &Arc<Shared<S>>, number: u64, frame: Vec<u8>) {
    let shared = Arc::clone(shared);
    tokio::spawn(async move {
        let mut out = vec![0; 4];
        shared
            .service
            .handle(&shared.session, number, &frame, &mut out)
            .await;
        shared.output.answer(&mut out);
        shared.running.fetch_sub(1, Ordering::SeqCst);
        shared.ended.notify_one();
    });
}

/// Returns once stdin has input (or its end): polls it for the budget `spin` gives, then
/// sleeps in `poll`; tells `spin` how it went.
fn await_input(spin: &mut Spin) {
    let start = Instant::now();
    let Err(polled) = spin.poll(|| stdin_ready(0).then_some(())) else {
        return;
    };
    // Interrupted by a signal, it returns early; the read then blocks in its place.
    stdin_ready(-1);
    let now = Instant::now();
    let total = now - start;
    spin.waited(Waited::Slept { polled, total }, now);
}

/// Whether stdin has input, or has closed, within `timeout_ms` (-1: however long it takes).
fn stdin_ready(timeout_ms: libc::c_int) -> bool {
    let mut fd = libc::pollfd {
        fd: libc::STDIN_FILENO,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: poll reads and writes only the one pollfd it is given.
    unsafe { libc::poll(&mut fd, 1, timeout_ms) > 0 }
}

/// Reads one length-prefixed frame into `frame`.
fn read_frame(reader: &mut impl BufRead, frame: &mut Vec<u8>, max: usize) -> io::Result<Frame> {
    let mut header = [0u8; 4];
    frame.clear();
    match read_full(reader, &mut header)? {
        0 => return Ok(Frame::Closed),
        4 => {}
        _ => return Ok(Frame::Cut),
    }
    let length = u32::from_be_bytes(header) as usize;
    if length > max {
        return Ok(Frame::TooLarge);
    }
    frame.resize(length, 0);
    let read = read_full(reader, frame)?;
    if read < length {
        frame.truncate(read);
        return Ok(Frame::Cut);
    }
    Ok(Frame::Data)
}

/// Reads into `buf` until it is full or stdin ends (or the client is gone); the bytes read.
fn read_full(reader: &mut impl io::Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut read = 0;
    while read < buf.len() {
        match reader.read(&mut buf[read..]) {
            Ok(0) => break,
            Ok(n) => read += n,
            Err(error) if error.kind() == ErrorKind::Interrupted => {}
            Err(error) if closed(&error) => break,
            Err(error) => return Err(error),
        }
    }
    Ok(read)
}

/// Answers frame `number`, which stdin ended in the middle of (`partial`: its bytes after
/// its header), as a server answers a stream that ends so: not executed, with the id that
/// leads it in JSON, if one does.
fn answer_cut<S: Store>(shared: &Shared<S>, number: u64, partial: &[u8]) {
    let mut out = vec![0; 4];
    let json = shared.session.codec() == Codec::Json;
    let line = json.then_some(partial);
    shared
        .service
        .truncated_frame(&shared.session, &mut out, number, line);
    let _ = shared.output.send(&mut out, true);
}

/// The client is gone: stdin ended, or (`--stdio-socket`) the socket was closed with
/// answers unread.
fn closed(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset
    )
}

/// SIGTERM: run nothing more, wait for the answers of the requests running, flush, exit 0;
/// within the drain timeout and [`STUCK_FLUSH`], even when nobody reads stdout.
/// SIGINT is ignored: Ctrl-C in the BEAM shell reaches the port too, and the port's life
/// follows the VM's (stdin).
fn watch_signals<S: Store>(shared: Arc<Shared<S>>) -> io::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()?;
    let (mut term, mut int) = runtime.block_on(async {
        Ok::<_, io::Error>((
            signal(SignalKind::terminate())?,
            signal(SignalKind::interrupt())?,
        ))
    })?;
    std::thread::spawn(move || {
        runtime.block_on(async {
            loop {
                tokio::select! {
                    _ = term.recv() => break,
                    _ = int.recv() => {}
                }
            }
        });
        shared.stopping.store(true, Ordering::SeqCst);
        // The answer being written in memory mode completes under the writer's lock. A
        // stdout nobody reads holds that lock for good: the drain is given up then.
        let (drained, done) = std::sync::mpsc::channel();
        let bound = shared.drain_timeout + STUCK_FLUSH;
        std::thread::spawn(move || {
            shared.drain();
            let _ = drained.send(());
        });
        if done.recv_timeout(bound).is_err() {
            eprintln!("bourse_daemon: stdout is not read; stopping with answers unwritten");
        }
        std::process::exit(0);
    });
    Ok(())
}

/// How long past the drain timeout a stop waits for stdout to take the last answers.
const STUCK_FLUSH: Duration = Duration::from_secs(1);

/// How long a port whose daemon refused its configuration waits for its first frame, in ms.
const REFUSAL_WAIT_MS: libc::c_int = 5_000;
/// The largest first frame read then: a `hello` is a few dozen bytes.
const REFUSAL_MAX_FRAME: usize = 64 * 1024;

/// Answers the port's first frame (its `hello`) with `message`, why the daemon refused its
/// configuration, then exits 2: a port has no stderr of its own, so its owner would
/// otherwise learn only the exit status. Waits at most [`REFUSAL_WAIT_MS`] for the frame
/// to begin; the port's owner closes stdin when it stops waiting for the answer.
pub fn refuse(message: &str) -> ExitCode {
    let mut frame = Vec::new();
    let read = stdin_ready(REFUSAL_WAIT_MS)
        .then(|| read_frame(&mut io::stdin().lock(), &mut frame, REFUSAL_MAX_FRAME));
    if let Some(Ok(Frame::Data)) = read {
        let answer = protocol::refusal(&frame, message);
        let mut stdout = io::stdout().lock();
        let _ = stdout
            .write_all(&(answer.len() as u32).to_be_bytes())
            .and_then(|()| stdout.write_all(&answer))
            .and_then(|()| stdout.flush());
    }
    ExitCode::from(2)
}

//! `--stdio`: one client (an Erlang port) on stdin/stdout, 4-byte big-endian length-prefixed
//! frames (JSON, or external terms once the first `hello` chose them). Blocking reads on
//! the main thread: there is only one stream. When the input runs out, stdin is polled for
//! a few microseconds before the thread sleeps, as [`Spin`] decides. With the in-memory
//! table each request is answered before the next is read, and pipelined answers share a
//! write; with a remote store (Redis) each request runs as a task and its answer is written
//! as soon as it is ready, so one slow answer holds back no other.

use std::fs::File;
use std::io::{self, BufRead, BufReader, BufWriter, ErrorKind, Stdout, Write};
use std::mem::ManuallyDrop;
use std::os::fd::FromRawFd;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::runtime::Runtime;

use crate::protocol::{Service, Session};
use crate::spin::{Spin, Waited};
use crate::store::Store;

/// How long a stop waits for the answers of requests still running on a remote store.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// What reading one frame found.
enum Frame {
    /// A frame is in the buffer.
    Data,
    /// stdin closed (possibly in the middle of a frame): the VM closed the port or died.
    Closed,
    /// The header announced this many bytes, more than allowed.
    TooLarge,
}

/// What the reader and the tasks answering share.
struct Shared<S: Store> {
    service: Arc<Service<S>>,
    session: Session,
    writer: Mutex<BufWriter<Stdout>>,
    /// Requests running on the remote store.
    running: AtomicUsize,
    /// Set by SIGTERM: requests read from now on are not run.
    stopping: AtomicBool,
}

impl<S: Store> Shared<S> {
    /// Writes one answer (`out` starts with 4 bytes for its length) and flushes.
    fn send(&self, out: &mut [u8], flush: bool) -> io::Result<()> {
        let length = (out.len() - 4) as u32;
        out[..4].copy_from_slice(&length.to_be_bytes());
        let mut writer = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        writer.write_all(out)?;
        if flush {
            writer.flush()?;
        }
        Ok(())
    }

    /// Waits (at most [`DRAIN_TIMEOUT`]) for the requests still running, then flushes.
    fn drain(&self) {
        let deadline = Instant::now() + DRAIN_TIMEOUT;
        while self.running.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
        let _ = self
            .writer
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .flush();
    }
}

/// Serves until stdin closes (exit 0), a frame is too large (exit 1) or SIGTERM (exit 0,
/// after the answers of the requests already running are written).
pub fn run<S: Store>(
    service: Arc<Service<S>>,
    runtime: &Runtime,
    max_frame_bytes: usize,
    sweep_interval: Duration,
) -> ExitCode {
    let shared = Arc::new(Shared {
        session: service.session(false, None),
        service,
        writer: Mutex::new(BufWriter::with_capacity(64 * 1024, io::stdout())),
        running: AtomicUsize::new(0),
        stopping: AtomicBool::new(false),
    });
    if let Err(error) = watch_signals(Arc::clone(&shared)) {
        eprintln!("bourse_daemon: cannot install signal handlers: {error}");
        return ExitCode::FAILURE;
    }
    let sweeper = Arc::clone(&shared.service);
    std::thread::spawn(move || loop {
        std::thread::sleep(sweep_interval);
        sweeper.store().sweep();
    });

    // Read unbuffered by std, so that nothing sits in a buffer `poll` cannot see; never
    // closed (ManuallyDrop): fd 0 belongs to the process.
    // SAFETY: fd 0 is open for the life of the process, and read only here.
    let stdin = ManuallyDrop::new(unsafe { File::from_raw_fd(libc::STDIN_FILENO) });
    let mut reader = BufReader::with_capacity(64 * 1024, &*stdin);
    let mut frame = Vec::new();
    let mut out = Vec::with_capacity(256);
    let mut spin = Spin::default();
    loop {
        if reader.buffer().is_empty() {
            await_input(&mut spin);
        }
        let found = read_frame(&mut reader, &mut frame, max_frame_bytes);
        let number = shared.session.next_frame();
        out.clear();
        out.extend_from_slice(&[0; 4]);
        let written = match found {
            Ok(Frame::Data) => {
                // Counted as running before `stopping` is read: a stop either sees it
                // running and waits for its answer, or it sees the stop and runs nothing.
                shared.running.fetch_add(1, Ordering::SeqCst);
                if shared.stopping.load(Ordering::SeqCst) {
                    shared.running.fetch_sub(1, Ordering::SeqCst);
                    continue;
                }
                // The first frame may choose the codec of the next ones: answered first.
                if S::REMOTE && number > 1 {
                    spawn(&shared, runtime, number, frame.clone());
                    continue;
                }
                let session = &shared.session;
                runtime.block_on(shared.service.handle(session, number, &frame, &mut out));
                // Pipelined requests share a write: flush when no further one is waiting.
                let sent = shared.send(&mut out, reader.buffer().is_empty());
                shared.running.fetch_sub(1, Ordering::SeqCst);
                sent
            }
            Ok(Frame::Closed) => {
                shared.drain();
                return ExitCode::SUCCESS;
            }
            Ok(Frame::TooLarge) => {
                let session = &shared.session;
                shared
                    .service
                    .frame_too_large(session, &mut out, number, max_frame_bytes);
                let _ = shared.send(&mut out, true);
                eprintln!("bourse_daemon: frame longer than {max_frame_bytes} bytes; exiting");
                shared.drain();
                return ExitCode::FAILURE;
            }
            Err(error) => {
                eprintln!("bourse_daemon: reading stdin: {error}");
                return ExitCode::FAILURE;
            }
        };
        match written {
            Ok(()) => {}
            // The VM closed the port.
            Err(error) if error.kind() == ErrorKind::BrokenPipe => return ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("bourse_daemon: writing stdout: {error}");
                return ExitCode::FAILURE;
            }
        }
    }
}

/// Runs one request on the remote store as a task; its answer is written when ready.
/// The caller counted it as running.
fn spawn<S: Store>(shared: &Arc<Shared<S>>, runtime: &Runtime, number: u64, frame: Vec<u8>) {
    let shared = Arc::clone(shared);
    runtime.spawn(async move {
        let mut out = vec![0; 4];
        shared
            .service
            .handle(&shared.session, number, &frame, &mut out)
            .await;
        // A closed stdout is found by the reader (stdin closes with it).
        let _ = shared.send(&mut out, true);
        shared.running.fetch_sub(1, Ordering::SeqCst);
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
    match reader.read_exact(&mut header) {
        Ok(()) => {}
        Err(error) if error.kind() == ErrorKind::UnexpectedEof => return Ok(Frame::Closed),
        Err(error) => return Err(error),
    }
    let length = u32::from_be_bytes(header) as usize;
    if length > max {
        return Ok(Frame::TooLarge);
    }
    frame.clear();
    frame.resize(length, 0);
    match reader.read_exact(frame) {
        Ok(()) => Ok(Frame::Data),
        Err(error) if error.kind() == ErrorKind::UnexpectedEof => Ok(Frame::Closed),
        Err(error) => Err(error),
    }
}

/// SIGTERM: run nothing more, wait for the answers of the requests running, flush, exit 0.
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
        // The answer being written in memory mode completes under the writer's lock.
        shared.drain();
        std::process::exit(0);
    });
    Ok(())
}

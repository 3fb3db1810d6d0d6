//! `--stdio`: one client (an Erlang port) on stdin/stdout, 4-byte big-endian length-prefixed
//! JSON frames, answered in order. Plain blocking I/O on the main thread: there is only one
//! stream; each request runs to completion on `runtime` (at once for the in-memory table,
//! one round trip for Redis) before the next is read.

use std::io::{self, BufRead, BufReader, BufWriter, ErrorKind, Write};
use std::process::ExitCode;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::runtime::Runtime;

use crate::protocol::Service;
use crate::store::Store;

/// What reading one frame found.
enum Frame {
    /// A frame is in the buffer.
    Data,
    /// stdin closed (possibly in the middle of a frame): the VM closed the port or died.
    Closed,
    /// The header announced this many bytes, more than allowed.
    TooLarge,
}

/// Serves until stdin closes (exit 0), a frame is too large (exit 1) or SIGTERM (exit 0,
/// after the answer being written is flushed).
pub fn run<S: Store>(
    service: Arc<Service<S>>,
    runtime: &Runtime,
    max_frame_bytes: usize,
    sweep_interval: Duration,
) -> ExitCode {
    let writer = Arc::new(Mutex::new(BufWriter::with_capacity(
        64 * 1024,
        io::stdout(),
    )));
    if let Err(error) = watch_signals(Arc::clone(&writer)) {
        eprintln!("bourse_daemon: cannot install signal handlers: {error}");
        return ExitCode::FAILURE;
    }
    let sweeper = Arc::clone(&service);
    std::thread::spawn(move || loop {
        std::thread::sleep(sweep_interval);
        sweeper.store().sweep();
    });

    let session = service.session();
    let mut reader = BufReader::with_capacity(64 * 1024, io::stdin().lock());
    let mut frame = Vec::new();
    let mut out = Vec::with_capacity(256);
    loop {
        let found = read_frame(&mut reader, &mut frame, max_frame_bytes);
        // Held from answering to flushing, so SIGTERM lets the answer in progress out.
        let mut writer = writer.lock().unwrap_or_else(PoisonError::into_inner);
        out.clear();
        out.extend_from_slice(&[0; 4]);
        let done = match found {
            Ok(Frame::Data) => {
                runtime.block_on(service.handle(&session, &frame, &mut out));
                None
            }
            Ok(Frame::Closed) => Some(ExitCode::SUCCESS),
            Ok(Frame::TooLarge) => {
                service.frame_too_large(&mut out, max_frame_bytes);
                eprintln!("bourse_daemon: frame longer than {max_frame_bytes} bytes; exiting");
                Some(ExitCode::FAILURE)
            }
            Err(error) => {
                eprintln!("bourse_daemon: reading stdin: {error}");
                Some(ExitCode::FAILURE)
            }
        };
        let written = if out.len() > 4 {
            let length = (out.len() - 4) as u32;
            out[..4].copy_from_slice(&length.to_be_bytes());
            writer.write_all(&out)
        } else {
            Ok(())
        };
        // Flush when no further request is already waiting: pipelined requests share a write.
        let flushed = written.and_then(|()| {
            if done.is_some() || reader.buffer().is_empty() {
                writer.flush()
            } else {
                Ok(())
            }
        });
        match (done, flushed) {
            (Some(code), _) => return code,
            (None, Ok(())) => {}
            // The VM closed the port.
            (None, Err(error)) if error.kind() == ErrorKind::BrokenPipe => {
                return ExitCode::SUCCESS
            }
            (None, Err(error)) => {
                eprintln!("bourse_daemon: writing stdout: {error}");
                return ExitCode::FAILURE;
            }
        }
    }
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

/// SIGTERM: wait for the answer in progress, flush, exit 0. SIGINT is ignored: Ctrl-C in
/// the BEAM shell reaches the port too, and the port's life follows the VM's (stdin).
fn watch_signals<W: Write + Send + 'static>(writer: Arc<Mutex<W>>) -> io::Result<()> {
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
        let mut writer = writer.lock().unwrap_or_else(PoisonError::into_inner);
        let _ = writer.flush();
        std::process::exit(0);
    });
    Ok(())
}

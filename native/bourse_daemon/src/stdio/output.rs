//! stdout as the reader and the tasks answering share it: length-prefixed answers in one
//! buffer, flushed by the reader when no further request waits, or, for the tasks of a
//! remote store, once per turn of the runtime.

use std::io::{self, BufWriter, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

/// Bytes buffered before a write is forced.
const BUFFER_BYTES: usize = 64 * 1024;

/// The answers' way out.
pub struct Output<W: Write> {
    writer: Mutex<BufWriter<W>>,
    /// Set while a flush of the answers written by tasks is on its way.
    flush_due: AtomicBool,
}

impl<W: Write + Send + 'static> Output<W> {
    pub fn new(inner: W) -> Arc<Self> {
        Arc::new(Self {
            writer: Mutex::new(BufWriter::with_capacity(BUFFER_BYTES, inner)),
            flush_due: AtomicBool::new(false),
        })
    }

    /// Writes one answer (`out` starts with 4 bytes for its length), and flushes if asked.
    pub fn send(&self, out: &mut [u8], flush: bool) -> io::Result<()> {
        let length = (out.len() - 4) as u32;
        out[..4].copy_from_slice(&length.to_be_bytes());
        let mut writer = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        writer.write_all(out)?;
        if flush {
            writer.flush()?;
        }
        Ok(())
    }

    /// Writes answers already framed, and flushes.
    pub fn send_framed(&self, answers: &[u8]) -> io::Result<()> {
        let mut writer = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        writer.write_all(answers)?;
        writer.flush()
    }

    /// Writes the answer of a task (must run inside a Tokio runtime). The tasks that one
    /// turn of the runtime runs (those one reply of the store woke) share a write: the
    /// first spawns the flush, which runs behind them. A failed write is left to the
    /// reader, which finds stdin closed with stdout.
    pub fn answer(self: &Arc<Self>, out: &mut [u8]) {
        let _ = self.send(out, false);
        if !self.flush_due.swap(true, Ordering::SeqCst) {
            let output = Arc::clone(self);
            tokio::spawn(async move {
                output.flush_due.store(false, Ordering::SeqCst);
                let _ = output.flush();
            });
        }
    }

    pub fn flush(&self) -> io::Result<()> {
        self.writer
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::watch;

    /// Records each write it is given.
    #[derive(Clone, Default)]
    struct Writes(Arc<Mutex<Vec<Vec<u8>>>>);

    impl Write for Writes {
        fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().push(bytes.to_vec());
            Ok(bytes.len())
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// The daemon's runtime (a current-thread one) and an output recording its writes.
    fn set_up() -> (tokio::runtime::Runtime, Writes, Arc<Output<Writes>>) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let writes = Writes::default();
        let output = Output::new(writes.clone());
        (runtime, writes, output)
    }

    fn answer_of(task: u8) -> Vec<u8> {
        vec![0, 0, 0, 0, task]
    }

    #[test]
    fn tasks_woken_together_share_one_write_and_lose_nothing() {
        let (runtime, writes, output) = set_up();
        // One reply of the store wakes every task waiting for it.
        let (reply, replied) = watch::channel(false);
        runtime.block_on(async {
            let tasks: Vec<_> = (0..50u8)
                .map(|task| {
                    let (output, mut replied) = (Arc::clone(&output), replied.clone());
                    tokio::spawn(async move {
                        replied.wait_for(|&done| done).await.unwrap();
                        output.answer(&mut answer_of(task));
                    })
                })
                .collect();
            reply.send(true).unwrap();
            for task in tasks {
                task.await.unwrap();
            }
            tokio::task::yield_now().await;
        });
        let writes = writes.0.lock().unwrap();
        assert_eq!(writes.len(), 1, "one write for 50 answers");
        let expected: Vec<u8> = (0..50u8).flat_map(|task| [0, 0, 0, 1, task]).collect();
        assert_eq!(writes[0], expected);
    }

    #[test]
    fn a_lone_answer_is_written_at_once_and_so_is_the_next() {
        let (runtime, writes, output) = set_up();
        runtime.block_on(async {
            for task in 0..2u8 {
                let output = Arc::clone(&output);
                tokio::spawn(async move { output.answer(&mut answer_of(task)) })
                    .await
                    .unwrap();
                tokio::task::yield_now().await;
                assert_eq!(writes.0.lock().unwrap().len(), usize::from(task) + 1);
            }
        });
        assert_eq!(
            *writes.0.lock().unwrap(),
            vec![vec![0, 0, 0, 1, 0], vec![0, 0, 0, 1, 1]]
        );
    }
}

//! A connection's input split into frames, and its answers framed, in the codec its first
//! `hello` chose: newline-delimited JSON, or external terms after a 4-byte big-endian
//! length.

use std::io;

use tokio::io::{AsyncRead, AsyncReadExt};

use super::NonBlocking;
use crate::protocol::Codec;

/// The input buffer a connection keeps between frames, at most.
const KEPT_BYTES: usize = 64 * 1024;

/// Frames the answer written from `start` on as the connection's codec wants: a JSON line,
/// or an external term after its 4-byte big-endian length.
pub fn framed(out: &mut Vec<u8>, start: usize, codec: Codec) {
    match codec {
        Codec::Json => out.push(b'\n'),
        Codec::Etf => length_prefixed(out, start),
    }
}

/// Puts the 4-byte big-endian length of the answer written from `start` on before it:
/// a term's frame on a socket, and every frame of a port.
pub fn length_prefixed(out: &mut Vec<u8>, start: usize) {
    let length = (out.len() - start) as u32;
    out.splice(start..start, length.to_be_bytes());
}

/// The length a frame starting `bytes` declares in its 4-byte big-endian prefix, once the
/// prefix is there.
pub fn prefixed_length(bytes: &[u8]) -> Option<usize> {
    let header = bytes.first_chunk::<4>()?;
    Some(u32::from_be_bytes(*header) as usize)
}

/// How input bytes are split into frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// Lines ended by `\n` (or `\r\n`): JSON.
    Lines,
    /// A 4-byte big-endian length, then that many bytes: external terms.
    LengthPrefixed,
}

/// Input bytes split into frames of at most `max` bytes.
pub struct Frames {
    pub buf: Vec<u8>,
    /// Start of the first unanswered frame.
    start: usize,
    /// Bytes before this (and from `start`) hold no newline.
    scanned: usize,
    max: usize,
    pub framing: Framing,
}

pub enum Next {
    /// A frame without its line ending or length.
    Frame(std::ops::Range<usize>),
    TooLarge,
    /// No complete frame is buffered.
    Pending,
}

impl Frames {
    pub fn new(max: usize) -> Self {
        Self {
            buf: Vec::with_capacity(8192),
            start: 0,
            scanned: 0,
            max,
            framing: Framing::Lines,
        }
    }

    /// The longest frame taken.
    pub fn max(&self) -> usize {
        self.max
    }

    /// From the next frame on, frames may be `max` bytes long.
    pub fn allow(&mut self, max: usize) {
        self.max = max;
    }

    /// From the next frame on, frames are length-prefixed.
    pub fn length_prefixed(&mut self) {
        self.framing = Framing::LengthPrefixed;
        self.scanned = self.start;
    }

    pub fn next(&mut self) -> Next {
        if self.framing == Framing::LengthPrefixed {
            return self.next_prefixed();
        }
        match self.buf[self.scanned..].iter().position(|&b| b == b'\n') {
            Some(at) => {
                let newline = self.scanned + at;
                let mut end = newline;
                if end > self.start && self.buf[end - 1] == b'\r' {
                    end -= 1;
                }
                let line = self.start..end;
                // Too large, the line stays unread: its start may name its id.
                if line.len() > self.max {
                    return Next::TooLarge;
                }
                self.start = newline + 1;
                self.scanned = self.start;
                Next::Frame(line)
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

    fn next_prefixed(&mut self) -> Next {
        let Some(length) = prefixed_length(&self.buf[self.start..]) else {
            return Next::Pending;
        };
        if length > self.max {
            return Next::TooLarge;
        }
        let body = self.start + 4..self.start + 4 + length;
        if body.end > self.buf.len() {
            return Next::Pending;
        }
        self.start = body.end;
        self.scanned = self.start;
        Next::Frame(body)
    }

    /// Reads more input after the unanswered bytes. Cancel-safe.
    pub async fn fill<R: AsyncRead + Unpin>(&mut self, reader: &mut R) -> io::Result<usize> {
        self.make_room();
        reader.read_buf(&mut self.buf).await
    }

    /// Reads what input there is now after the unanswered bytes, without waiting.
    pub fn try_fill<R: NonBlocking>(&mut self, reader: &R) -> io::Result<usize> {
        self.make_room();
        reader.try_read_buf(&mut self.buf)
    }

    /// Drops the answered bytes; leaves room to read more. A buffer grown for a large frame
    /// is given back once it holds little, so that an idle connection holds little.
    fn make_room(&mut self) {
        if self.start > 0 {
            self.buf.drain(..self.start);
            self.scanned -= self.start;
            self.start = 0;
        }
        if self.buf.capacity() > KEPT_BYTES && self.buf.len() < KEPT_BYTES / 2 {
            self.buf.shrink_to(KEPT_BYTES);
        }
        self.buf.reserve(16 * 1024);
    }

    /// The bytes of the partial frame when frames are lines.
    pub fn partial_line(&self) -> Option<&[u8]> {
        match self.framing {
            Framing::Lines => Some(&self.buf[self.start..]),
            Framing::LengthPrefixed => None,
        }
    }

    /// Whether a frame was begun but not ended.
    pub fn has_partial(&self) -> bool {
        match self.framing {
            Framing::Lines => !self.buf[self.start..].iter().all(u8::is_ascii_whitespace),
            Framing::LengthPrefixed => self.start < self.buf.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use super::*;

    /// Input that gives its bytes in one read, then would block.
    struct Input(RefCell<Vec<u8>>);

    impl NonBlocking for Input {
        fn try_read_buf(&self, buf: &mut Vec<u8>) -> io::Result<usize> {
            let bytes = self.0.take();
            if bytes.is_empty() {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            let read = bytes.len().min(buf.capacity() - buf.len());
            buf.extend_from_slice(&bytes[..read]);
            self.0.replace(bytes[read..].to_vec());
            Ok(read)
        }
    }

    #[test]
    fn a_buffer_grown_for_a_large_frame_is_given_back_once_it_is_answered() {
        let line = [vec![b'x'; 1 << 20], b"\n".to_vec()].concat();
        let input = Input(RefCell::new(line));
        let mut frames = Frames::new(4 << 20);
        while !matches!(frames.next(), Next::Frame(_)) {
            frames.try_fill(&input).unwrap();
        }
        assert!(frames.buf.capacity() > 1 << 20);
        assert!(frames.try_fill(&input).is_err());
        assert!(frames.buf.capacity() <= KEPT_BYTES + 16 * 1024);
    }
}

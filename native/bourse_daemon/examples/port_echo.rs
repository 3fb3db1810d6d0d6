//! The floor under a port's round trip: a peer that does no work. It polls stdin (never
//! sleeping in a read) and writes back every byte it reads, at once or `--answer-after-us`
//! microseconds later, as the daemon answers a check after decoding and running it. Run by
//! `make bench` (`bench/support/port_floor.ex`) as a `{packet, 4}` port from the VM.
//!
//! ```text
//! cargo build --release -p bourse_daemon --examples
//! target/release/examples/port_echo [--answer-after-us N]
//! ```

use std::io::{ErrorKind, Read, Write};
use std::os::fd::FromRawFd;
use std::time::{Duration, Instant};

fn main() {
    let mut args = std::env::args().skip(1);
    let delay = match (args.next().as_deref(), args.next()) {
        (None, _) => Duration::ZERO,
        (Some("--answer-after-us"), Some(us)) => match us.parse() {
            Ok(us) => Duration::from_micros(us),
            Err(_) => usage(),
        },
        _ => usage(),
    };
    // SAFETY: fd 0 is open for the life of the process and read only here.
    let mut stdin = unsafe { std::fs::File::from_raw_fd(libc::STDIN_FILENO) };
    // SAFETY: fcntl on fd 0 changes only its flags.
    unsafe {
        let flags = libc::fcntl(libc::STDIN_FILENO, libc::F_GETFL);
        libc::fcntl(libc::STDIN_FILENO, libc::F_SETFL, flags | libc::O_NONBLOCK);
    }
    let mut stdout = std::io::stdout().lock();
    let mut buffer = vec![0; 64 * 1024];
    loop {
        match stdin.read(&mut buffer) {
            Ok(0) => return,
            Ok(n) => {
                let read_at = Instant::now();
                while read_at.elapsed() < delay {
                    std::hint::spin_loop();
                }
                if stdout
                    .write_all(&buffer[..n])
                    .and_then(|()| stdout.flush())
                    .is_err()
                {
                    return;
                }
            }
            Err(error) if error.kind() == ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(error) if error.kind() == ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

fn usage() -> ! {
    eprintln!("usage: port_echo [--answer-after-us N]");
    std::process::exit(2)
}

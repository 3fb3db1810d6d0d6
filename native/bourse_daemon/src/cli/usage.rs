//! The text of `--help`.

pub const USAGE: &str = "\
Usage: bourse_daemon --stdio [OPTIONS]
       bourse_daemon (--listen 127.0.0.1:PORT | --socket PATH)... [OPTIONS]

A shared rate-limiter table speaking the Bourse JSON protocol (docs/PROTOCOL.md).

Modes:
  --stdio                   Serve one client on stdin/stdout, as an Erlang port:
                            4-byte big-endian length-prefixed JSON frames ({:packet, 4}).
                            Exits when stdin closes.
  --stdio-socket PATH       With --stdio: the one client is on the Unix socket PATH
                            instead (it listens there; the daemon connects at start and
                            exits when the connection closes).
  --listen ADDR             Serve many clients on a TCP address (PORT 0 picks a free one);
                            newline-delimited JSON. Repeatable.
  --socket PATH             Serve many clients on a Unix socket; a stale socket file is
                            replaced, the file is removed on exit (unless replaced
                            meanwhile). Repeatable.
  On start a server prints `listening tcp ADDR` / `listening unix PATH` per listener.

Access (server mode):
  Unix sockets are created owner-only (0600) whatever the umask.
  --socket-mode 660         Let the socket file's group connect too (only 600 and 660
                            are accepted). The file gets the daemon's group, or its
                            directory's when that has the setgid bit (chmod g+s DIR).
  TCP clients must prove a shared secret before anything but `hello` is served: the
  secret (16 to 4096 bytes, a trailing newline ignored) comes from the file named by
  --secret-file PATH, or else from the environment variable BOURSE_DAEMON_SECRET; never
  from the command line. --listen without a secret is refused.
  --max-connections N       Connections served at once (default 256, 1..=65536); past it
                            a connection is told so and closed.
  --idle-timeout-ms N       Close a connection that sent nothing for N ms, or whose
                            client read none of its answers for N ms (default 300000;
                            0: never). A connection that must prove the secret has
                            10 s to do it.

Storage:
  (default)                 The buckets live in this process.
  --redis URL               The buckets live in Redis (redis://[user@]HOST:PORT[/DB] or
                            unix:///PATH), shared by every daemon using the same server and
                            prefix, timed by the Redis server's clock. While Redis cannot be
                            reached, requests are answered with an `unavailable` error and
                            nothing is admitted; the connection is retried on each request.
                            The URL may not hold a password (user:PASSWORD@, nor a query
                            field pass or password, its name percent-encoded or not): it
                            comes from the file named by --redis-password-file PATH, or
                            from BOURSE_REDIS_PASSWORD.
  --redis-cluster URL       The buckets live in a Redis Cluster found through this seed node
                            (redis://[user@]HOST:PORT; repeat for more seeds), instead of
                            --redis. Each check runs on the master of its exchange's slot;
                            a check over several exchanges is refused. The password comes
                            as for --redis. Failover: see docs/PROTOCOL.md.
  --redis-key-secret-file P Key of the fingerprints that stand for credentials in Redis key
                            names (else BOURSE_REDIS_KEY_SECRET, else a fixed built-in key:
                            names are then HMAC-SHA256 under a key anyone can read, one-way
                            but not secret). Every daemon sharing the buckets needs the
                            same one.
  --redis-prefix P          Prefix of every Redis key (default bourse; A-Z a-z 0-9 _ - . :).
  --redis-timeout-ms N      Longest wait for Redis per command, connecting included
                            (default 1000, 1..=60000).

Options:
  --allow-remote            Accept a non-loopback --listen address (the secret is proved,
                            never sent, but requests travel in clear: trusted networks only).
  --assume-busy-at-start    Buckets first seen within their fill time after start begin
                            as if empty at start (use after a restart).
  --booking-slack-ms N      How long past its ready time a booking may be claimed
                            (default 250, at most 86400000).
  --sweep-interval-ms N     How often idle full buckets are dropped (default 1000,
                            1..=86400000).
  --max-frame-bytes N       Largest request frame (default 4194304: room for any call a
                            limiter accepts; 64..=67108864); a larger one is answered with
                            a frame_too_large error, then the connection is closed.
  -h, --help                Print this text.
  -V, --version             Print the version and the protocol version.

Signals: SIGTERM (and SIGINT in server mode) stop accepting, answer the requests already
received, remove the socket files and exit 0. In --stdio mode SIGINT is ignored (Ctrl-C in
the BEAM shell reaches the whole process group); closing stdin is the way to stop it.
";

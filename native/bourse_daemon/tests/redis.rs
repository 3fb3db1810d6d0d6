//! `--redis`: the bucket as a script in a real `redis-server` started by each test on a free
//! loopback port (without persistence), shared by several daemon processes.
//!
//! The tests skip, saying so, only when no `redis-server` binary is installed (`make deps`
//! installs it). Time is Redis's real clock, so delays are checked within tolerances.

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use common::load::{self, assert_conforms};
use common::proxy::{CuttingProxy, SwallowingProxy};
use common::{
    borrowed, check, check_frame, eventually, key, LineClient, Server, StdioDaemon, Transport,
};

/// A `redis-server` child on a loopback port; stopped (without saving) when dropped.
struct Redis {
    child: Child,
    port: u16,
}

impl Redis {
    /// Starts a server on a free port, or `None` (after saying why) when none is installed.
    fn start() -> Option<Self> {
        Self::start_with(&[])
    }

    /// [`Self::start`], or `None` (after saying why) for a `redis-server` before 7.0, which
    /// has no functions.
    fn with_functions() -> Option<Self> {
        let redis = Self::start()?;
        if major_version(&redis) < 7 {
            eprintln!("SKIPPED: redis-server before 7.0 has no functions");
            return None;
        }
        Some(redis)
    }

    /// [`Self::start`] with further `redis-server` options.
    fn start_with(options: &[&str]) -> Option<Self> {
        if Command::new("redis-server")
            .arg("--version")
            .stdout(Stdio::null())
            .status()
            .is_err()
        {
            eprintln!("SKIPPED: no redis-server binary on PATH (make deps installs it)");
            return None;
        }
        // A port found free may be taken by another test's server before this one binds it.
        loop {
            let port = TcpListener::bind("127.0.0.1:0")
                .and_then(|listener| listener.local_addr())
                .expect("a free port")
                .port();
            if let Some(redis) = Self::listening_on(port, options, &[]) {
                return Some(redis);
            }
        }
    }

    fn on_port(port: u16) -> Self {
        Self::on_port_with(port, &[])
    }

    fn on_port_with(port: u16, options: &[&str]) -> Self {
        Self::on_port_with_env(port, options, &[])
    }

    fn on_port_with_env(port: u16, options: &[&str], env: &[(&str, &Path)]) -> Self {
        Self::listening_on(port, options, env)
            .unwrap_or_else(|| panic!("another redis-server took port {port}"))
    }

    /// A server on `port` once it answers there itself, or `None` when it exits (another
    /// server took the port: its answers must not pass for this one's).
    fn listening_on(port: u16, options: &[&str], env: &[(&str, &Path)]) -> Option<Self> {
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .args(options)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn redis-server");
        let mut redis = Self { child, port };
        let mut exited = false;
        eventually("redis-server answers PING, or exits", || {
            exited = matches!(redis.child.try_wait(), Ok(Some(_)));
            exited || redis.answers_itself()
        });
        (!exited).then_some(redis)
    }

    /// Whether the server answering on the port is this one's process.
    fn answers_itself(&self) -> bool {
        let pid = format!("process_id:{}\r\n", self.child.id());
        self.connection().is_some_and(|mut c| {
            ::redis::cmd("INFO")
                .arg("server")
                .query::<String>(&mut c)
                .is_ok_and(|info| info.contains(&pid))
        })
    }

    /// [`Self::start`] with a wall clock that `clock` moves.
    fn with_clock(clock: &ClockShift) -> Option<Self> {
        let redis = Self::start()?;
        let port = redis.port;
        drop(redis);
        let env = [
            ("LD_PRELOAD", clock.library.as_path()),
            ("BOURSE_CLOCK_SHIM", clock.offset.as_path()),
        ];
        Some(Self::on_port_with_env(port, &[], &env))
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn connection(&self) -> Option<::redis::Connection> {
        let client = ::redis::Client::open(self.url()).ok()?;
        client
            .get_connection_with_timeout(Duration::from_secs(1))
            .ok()
    }

    /// Runs one command (test inspection of what the script stored).
    fn query<T: ::redis::FromRedisValue>(&self, command: &mut ::redis::Cmd) -> T {
        command
            .query(&mut self.connection().expect("connect to redis"))
            .expect("redis command")
    }

    /// `SHUTDOWN NOSAVE`: everything in it is lost.
    fn stop(&mut self) {
        if let Some(mut connection) = self.connection() {
            let _: Result<(), _> = ::redis::cmd("SHUTDOWN")
                .arg("NOSAVE")
                .query(&mut connection);
        }
        let _ = self.child.wait();
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A server-mode daemon on `redis` with extra options.
/// A Redis timeout for the tests that are not about it: long enough that a loaded machine's
/// slow Redis is not refused as late (the default is 1 s). A test's own
/// `--redis-timeout-ms`, given after it, wins.
const PATIENT: [&str; 2] = ["--redis-timeout-ms", "10000"];

fn daemon(redis: &Redis, extra: &[&str]) -> Server {
    let url = redis.url();
    let mut args = vec!["--redis", url.as_str()];
    args.extend_from_slice(&PATIENT);
    args.extend_from_slice(extra);
    Server::tcp(&args)
}

/// A daemon on `redis` serving the Unix socket `socket` only, with extra options.
fn socket_daemon(redis: &Redis, socket: &std::path::Path, extra: &[&str]) -> Server {
    let url = redis.url();
    let mut args = vec![
        "--redis",
        url.as_str(),
        "--socket",
        socket.to_str().unwrap(),
    ];
    args.extend_from_slice(&PATIENT);
    args.extend_from_slice(extra);
    Server::start(&args)
}

fn ms(answer: &Value) -> u64 {
    answer["ms"]
        .as_u64()
        .unwrap_or_else(|| panic!("no ms in {answer}"))
}

fn sleep_ms(ms: u64) {
    thread::sleep(Duration::from_millis(ms));
}

/// Asserts `ms` is the exact delay less what may have passed on a loaded machine.
fn about(ms: u64, exact: u64, what: &str) {
    assert!(
        ms <= exact && ms + 400 >= exact,
        "{what}: {ms} ms, expected a little under {exact}"
    );
}

#[test]
fn every_op_through_redis_in_server_and_stdio_mode() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &[]);
    // Its buckets outlive it: a reconnecting client has no table to compare.
    assert_eq!(
        server.connect().call(json!({"op": "hello"}))["table"],
        Value::Null
    );
    common::exercise_every_op(&mut server.connect());
    common::exercise_bad_requests(&mut server.connect());
    let url = redis.url();
    let mut port = StdioDaemon::start(&[&["--redis", url.as_str()][..], &PATIENT].concat());
    common::exercise_every_op(&mut port);
    // Everything lives in Redis: reset_all left nothing but the state markers and the
    // record of since when the server's data is whole.
    let keys: Vec<String> = redis.query(::redis::cmd("KEYS").arg("*"));
    let kept = |k: &String| k.starts_with("bourse:e{") || k == "bourse:data";
    assert!(keys.iter().all(kept), "{keys:?}");
}

/// SIGTERM stops a port on Redis whose stdout nobody reads: its answers are given up after
/// the drain (before, its one thread blocked writing them, and it never exited).
#[test]
fn sigterm_exits_while_nobody_reads_the_ports_stdout() {
    let Some(redis) = Redis::start() else { return };
    let url = redis.url();
    assert!(common::sigterm_with_stdout_unread(&["--redis", url.as_str()]).success());
}

#[test]
fn a_frame_cut_off_by_the_end_of_stdin_is_answered_not_executed() {
    let Some(redis) = Redis::start() else { return };
    let url = redis.url();
    let mut port = StdioDaemon::start(&["--redis", url.as_str()]);
    let record = br#"{"id":8,"op":"record","key":{"exchange":"p","credential":null},"cost":1}"#;
    port.send_raw(&200u32.to_be_bytes());
    port.send_raw(record);
    port.close_stdin();
    let answer = port.recv_frame().expect("the cut frame is answered");
    assert_eq!(answer["id"], 8);
    let message = answer["error"]["message"].as_str().unwrap();
    assert!(message.contains("middle of a frame"), "{message}");
    assert!(common::wait_exit(&mut port.child).success());
    let keys: Vec<String> = redis.query(::redis::cmd("KEYS").arg("*:b:*"));
    assert!(keys.is_empty(), "executed: {keys:?}");
}

/// Voluntary context switches (sleeps) of every thread of process `pid` so far.
fn sleeps_of(pid: u32) -> u64 {
    let mut total = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let status = std::fs::read_to_string(task.unwrap().path().join("status"));
        let status = status.unwrap_or_default();
        let sleeps = status
            .lines()
            .find_map(|line| line.strip_prefix("voluntary_ctxt_switches:"));
        total += sleeps.map_or(0, |n| n.trim().parse::<u64>().unwrap());
    }
    total
}

/// Write calls of every thread of process `pid` so far (`syscw`).
fn writes_of(pid: u32) -> u64 {
    let io = std::fs::read_to_string(format!("/proc/{pid}/io")).unwrap();
    let count = io.lines().find_map(|line| line.strip_prefix("syscw:"));
    count.unwrap().trim().parse().unwrap()
}

/// With `--stdio` the thread that reads a request also sends it to Redis and writes its
/// answer: a caller waiting on each answer costs the daemon at most two sleeps per check
/// (for the request, for Redis's answer), not a third for handing the request to another
/// thread (2.5 per check when a reader thread handed each request to a worker); and two
/// writes, the call to Redis and the answer (six when each of the check's four timers
/// woke the runtime's driver, see timer_anchor.rs).
#[test]
fn a_lone_stdio_check_through_redis_wakes_one_thread() {
    let Some(redis) = Redis::start() else { return };
    let url = redis.url();
    let mut port = StdioDaemon::start(&[&["--redis", url.as_str()][..], &PATIENT].concat());
    let limit = json!({"capacity": 1e9, "refill_per_sec": 1e9});
    let k = key("lone", Some("k"));
    for _ in 0..50 {
        assert_eq!(
            port.call(check(&k, limit.clone(), 1.0))["result"],
            "admitted"
        );
    }
    let n = 400;
    let pid = port.child.id();
    let (sleeps, writes) = (sleeps_of(pid), writes_of(pid));
    for _ in 0..n {
        assert_eq!(
            port.call(check(&k, limit.clone(), 1.0))["result"],
            "admitted"
        );
    }
    let per_check = (sleeps_of(pid) - sleeps) as f64 / n as f64;
    let writes = (writes_of(pid) - writes) as f64 / n as f64;
    eprintln!("{per_check:.2} sleeps and {writes:.2} writes per check");
    assert!(per_check < 2.1, "{per_check:.2} sleeps per check");
    assert!(writes < 2.1, "{writes:.2} writes per check");
}

/// `--stdio` with Redis reads a stdin that cannot be watched (a regular file) at once: every
/// frame is answered, then the daemon exits 0 at its end.
#[test]
fn a_stdio_daemon_reads_frames_from_a_file() {
    let Some(redis) = Redis::start() else { return };
    let path = std::env::temp_dir().join(format!("bourse-frames-{}", std::process::id()));
    let limit = json!({"capacity": 100, "refill_per_sec": 1});
    let mut frames = Vec::new();
    for id in 0..5 {
        let mut request = check(&key("file", Some("k")), limit.clone(), 1.0);
        request["id"] = json!(id);
        let request = serde_json::to_vec(&request).unwrap();
        frames.extend_from_slice(&(request.len() as u32).to_be_bytes());
        frames.extend_from_slice(&request);
    }
    std::fs::write(&path, &frames).unwrap();
    let output = Command::new(common::daemon_binary())
        .args(["--stdio", "--redis", &redis.url()])
        .stdin(std::fs::File::open(&path).unwrap())
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&path);
    assert!(output.status.success(), "{output:?}");
    let mut answers = Vec::new();
    let mut rest = output.stdout.as_slice();
    while let Some((header, after)) = rest.split_first_chunk::<4>() {
        let length = u32::from_be_bytes(*header) as usize;
        let answer: Value = serde_json::from_slice(&after[..length]).unwrap();
        assert_eq!(answer["result"], "admitted", "{answer}");
        answers.push(answer["id"].as_u64().unwrap());
        rest = &after[length..];
    }
    answers.sort_unstable();
    assert_eq!(answers, [0, 1, 2, 3, 4]);
}

#[test]
fn probes_over_capacity_costs_and_definition_changes() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &[]);
    let mut t = server.connect();
    let k = key("binance", Some("k1"));
    let two = json!({"capacity": 2, "refill_per_sec": 2});
    assert_eq!(t.call(check(&k, two.clone(), 1.0))["result"], "admitted");
    assert_eq!(t.call(check(&k, two.clone(), 1.0))["result"], "admitted");
    let refused = t.call(check(&k, two.clone(), 1.0));
    assert_eq!(refused["result"], "delay");
    about(ms(&refused), 500, "the third check");
    // Refusals are free: the next probe's delay is no longer.
    assert!(ms(&t.call(check(&k, two.clone(), 1.0))) <= ms(&refused));
    sleep_ms(ms(&refused));
    assert_eq!(t.call(check(&k, two, 1.0))["result"], "admitted");

    // Over capacity: limited, not exempt. A new bucket holds 2 of the 5; 3 more take 1.5 s.
    // (At 2 a second the cheap check below finds the bucket still short of its token when
    // a loaded machine is slow between the calls.)
    let heavy = key("binance", Some("heavy"));
    let small = json!({"capacity": 2, "refill_per_sec": 2});
    let wait = t.call(check(&heavy, small.clone(), 5.0));
    about(ms(&wait), 1500, "an over-capacity cost");
    sleep_ms(ms(&wait));
    assert_eq!(
        t.call(check(&heavy, small.clone(), 5.0))["result"],
        "admitted"
    );
    // Paying left the bucket empty: cheap traffic never sees the raised cap.
    about(
        ms(&t.call(check(&heavy, small, 1.0))),
        500,
        "after the heavy payment",
    );

    // A changed definition is taken when admitted, with the tokens clamped to it.
    let defined = key("binance", Some("redefined"));
    // Nothing refills within the test's tolerance of 0.01 token for 100 s.
    let slow = |capacity: u64| json!({"capacity": capacity, "refill_per_sec": 0.0001});
    assert_eq!(t.call(check(&defined, slow(10), 2.0))["result"], "admitted");
    assert_eq!(t.call(check(&defined, slow(5), 1.0))["result"], "admitted");
    let info = t.call(json!({"op": "inspect", "key": defined}))["info"].clone();
    assert_eq!(info["limit"]["capacity"], 5.0);
    assert!(
        (info["tokens"].as_f64().unwrap() - 4.0).abs() < 0.01,
        "{info}"
    );
    // A refused call does not change the definition.
    assert_eq!(t.call(check(&defined, slow(3), 9.0))["result"], "delay");
    let info = t.call(json!({"op": "inspect", "key": defined}))["info"].clone();
    assert_eq!(info["limit"]["capacity"], 5.0);

    // Debt recorded before the first check is applied when the key is first defined.
    let debt = key("binance", Some("debt"));
    t.call(json!({"op": "record", "key": debt, "cost": 3}));
    assert_eq!(borrowed(&mut t, &debt), 3.0);
    assert_eq!(t.call(check(&debt, slow(5), 2.0))["result"], "admitted");
    assert_eq!(t.call(check(&debt, slow(5), 1.0))["result"], "delay");
}

/// As many bookings per bucket as the core holds: a waiter beyond them is refused as over
/// its budget, within it, and pays nothing.
#[test]
fn a_bucket_holds_at_most_max_bookings() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &[]);
    let mut t = server.connect();
    let k = key("okx", Some("queue"));
    let limit = json!({"capacity": 1, "refill_per_sec": 1});
    let waiter = |owner: usize| json!({"op": "check", "key": k, "limit": limit, "owner": owner, "max_wait_ms": 1_000_000});
    assert_eq!(t.call(check(&k, limit.clone(), 1.0))["result"], "admitted");
    for owner in 0..bourse_core::rules::MAX_BOOKINGS {
        assert_eq!(t.call(waiter(owner))["result"], "booked");
    }
    let before = borrowed(&mut t, &k);
    let beyond = t.call(waiter(bourse_core::rules::MAX_BOOKINGS));
    assert_eq!(beyond["result"], "over_budget", "{beyond}");
    // The delay it would have booked: 257 s from the first check.
    assert!((250_000..=257_000).contains(&ms(&beyond)), "{beyond}");
    assert!((borrowed(&mut t, &k) - before).abs() < 0.01);
}

#[test]
fn waiters_book_claim_once_and_lapse() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &["--booking-slack-ms", "5000"]);
    let mut t = server.connect();
    let k = key("okx", Some("k"));
    // 2 a second: each step comes before the state it expects has passed, on a loaded
    // machine too.
    let limit = json!({"capacity": 1, "refill_per_sec": 2});
    let waiter = |owner: &str, max_wait: u64| json!({"op": "check", "key": k, "limit": limit, "owner": owner, "max_wait_ms": max_wait});
    assert_eq!(t.call(waiter("a", 5000))["result"], "admitted");
    let a = t.call(waiter("a", 5000));
    assert_eq!(a["result"], "booked");
    about(ms(&a), 500, "the first booking");
    // Later waiters queue behind it; a budget too short books nothing.
    let b = t.call(waiter("b", 5000));
    assert_eq!(b["result"], "booked");
    about(ms(&b), 1000, "the second booking");
    let over = t.call(waiter("c", 50));
    assert_eq!(over["result"], "over_budget");
    assert_eq!(
        t.call(json!({"op": "inspect", "key": k}))["info"]["bookings"],
        2
    );
    // Early: the remaining wait. On time: claimed, not charged again.
    let early = t.call(waiter("b", 5000));
    assert_eq!(early["result"], "delay");
    assert!(ms(&early) <= ms(&b));
    sleep_ms(ms(&b));
    let before = borrowed(&mut t, &k);
    assert_eq!(t.call(waiter("a", 5000))["result"], "claimed");
    assert_eq!(t.call(waiter("b", 5000))["result"], "claimed");
    assert!(borrowed(&mut t, &k) <= before, "a claim charged again");
    let stats = t.call(json!({"op": "stats"}))["stats"].clone();
    assert_eq!(
        (stats["claimed"].as_u64(), stats["bookings"].as_u64()),
        (Some(2), Some(0))
    );

    // A booking not claimed within the slack lapses; its cost stays paid.
    let short = daemon(&redis, &["--booking-slack-ms", "1"]);
    let mut s = short.connect();
    let lapsing = key("okx", Some("lapse"));
    // A token a second: the booking is made, and the check after its lapse still finds the
    // bucket short, on a loaded machine too.
    let slow = json!({"capacity": 1, "refill_per_sec": 1});
    let booking =
        json!({"op": "check", "key": lapsing, "limit": slow, "owner": 1, "max_wait_ms": 5000});
    assert_eq!(s.call(booking.clone())["result"], "admitted");
    let booked = s.call(booking.clone());
    assert_eq!(booked["result"], "booked");
    sleep_ms(ms(&booked) + 100);
    // Coming back finds no booking: a new check, booked behind the lapsed one's payment.
    assert_eq!(s.call(booking)["result"], "booked");
    assert_eq!(s.call(json!({"op": "stats"}))["stats"]["lapsed"], 1);

    // A booking that names its slack keeps it through an early claim without a budget
    // (before, the claim gave it the daemon's slack of 1 ms).
    let named = key("okx", Some("named"));
    let booking = json!({"op": "check", "key": named, "limit": slow, "owner": 2, "max_wait_ms": 5000, "booking_slack_ms": 60_000});
    let claim = json!({"op": "check", "key": named, "limit": slow, "owner": 2});
    assert_eq!(s.call(booking.clone())["result"], "admitted");
    let booked = s.call(booking);
    assert_eq!(booked["result"], "booked");
    assert_eq!(s.call(claim.clone())["result"], "delay");
    sleep_ms(ms(&booked) + 300);
    assert_eq!(s.call(claim)["result"], "claimed");
}

/// As in the in-memory daemon: a lapsed booking is given back while nothing wrote its bucket
/// since it lapsed (its `t` and `z`), not once a debit did.
#[test]
fn a_lapsed_booking_is_unbooked_only_while_nothing_wrote_its_bucket() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &["--booking-slack-ms", "1"]);
    common::assert_lapsed_bookings_unbooked_while_untouched(&mut server.connect());
}

/// A booking is its named owner's in every daemon on the Redis: claimed through a daemon
/// started after the one that booked it was killed (a Redis limiter's own daemon is
/// started again at once), and through another daemon, it is admitted without paying
/// again. Before, each daemon process hashed owners with a key of its own: the claim found
/// no booking of its owner, and booked and paid a second time.
#[test]
fn a_booking_is_claimed_through_another_daemon_on_the_same_redis() {
    let Some(redis) = Redis::start() else { return };
    let limit = json!({"capacity": 5, "refill_per_sec": 5});
    let k = key("okx", Some("owned"));
    let waiter = |owner: &str| json!({"op": "check", "key": k, "limit": limit, "cost": 5, "owner": owner, "max_wait_ms": 5000});
    for (owner, by_a_restarted_one) in [
        ("1234.vm-a.<0.101.0>", true),
        ("1234.vm-a.<0.102.0>", false),
    ] {
        let first = daemon(&redis, &[]);
        let mut t = first.connect();
        assert_eq!(t.call(json!({"op": "reset", "key": k}))["ok"], true);
        assert_eq!(t.call(waiter(owner))["result"], "admitted");
        let booked = t.call(waiter(owner));
        assert_eq!(booked["result"], "booked", "{booked}");
        let second = match by_a_restarted_one {
            true => {
                drop(t);
                drop(first);
                daemon(&redis, &[])
            }
            false => daemon(&redis, &[]),
        };
        let mut claimer = second.connect();
        sleep_ms(ms(&booked) + 50);
        assert_eq!(claimer.call(waiter(owner))["result"], "claimed");
        // Paid once: the booking's 5, less what refilled since it was ready.
        let borrowed = borrowed(&mut claimer, &k);
        assert!(borrowed <= 5.0 && borrowed > 2.0, "{borrowed} borrowed");
    }
}

/// A booking over two buckets whose claim a pause of one of them holds is held on the
/// other too: claimed at the pause's end, not lapsed and booked again, and paid there as of
/// that end, so another credential on the IP finds no refill of the pause left beside it.
#[test]
fn a_booking_held_by_a_pause_of_one_of_its_buckets_is_claimed_and_paid_at_its_end() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &[]);
    let mut t = server.connect();
    let limit = json!({"capacity": 10, "refill_per_sec": 10});
    let order = json!({"exchange": "okx", "credential": "held", "axis": "order"});
    let ip = json!({"exchange": "okx", "credential": null, "axis": "ip"});
    let both = |owner: Option<u64>| {
        let mut request = json!({"op": "check_many", "checks": [
            {"key": order, "limit": limit, "cost": 1}, {"key": ip, "limit": limit, "cost": 1},
        ]});
        if let Some(owner) = owner {
            request["owner"] = json!(owner);
            request["max_wait_ms"] = json!(5000);
        }
        request
    };
    for _ in 0..10 {
        assert_eq!(t.call(both(None))["result"], "admitted");
    }
    let target = json!({"exchange": "okx", "credential": "held"});
    hold_ten_waiters(&mut t, |owner| both(Some(owner)), target);
    let other = json!({"exchange": "okx", "credential": "other", "axis": "order"});
    let beside = t.call(json!({"op": "check_many", "checks": [
        {"key": other, "limit": limit, "cost": 1}, {"key": ip, "limit": limit, "cost": 1},
    ]}));
    assert_eq!(beside["result"], "delay", "{beside}");
}

/// A claim held by a pause of its credential is paid again on the IP in its turn, before
/// the bookings made after it: ordered by when each may go out instead, it went behind
/// the IP's queue, then behind the credential's, round after round, and was told to come
/// back long after the pause with its IP booking left to lapse before then (booked and
/// paid again when it came back as told).
#[test]
fn a_held_claim_keeps_its_turn_on_the_other_buckets() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &[]);
    let mut t = server.connect();
    // 4 tokens a second; the held waiter costs 2, over the capacity of 1.
    let limit = json!({"capacity": 1, "refill_per_sec": 4});
    let cred = json!({"exchange": "okx", "credential": "turn", "axis": "request"});
    let ip = json!({"exchange": "okx", "credential": null, "axis": "ip"});
    let both = json!({"op": "check_many", "owner": 1, "max_wait_ms": 60_000, "checks": [
        {"key": cred, "limit": limit, "cost": 2}, {"key": ip, "limit": limit, "cost": 2},
    ]});
    let booked = t.call(both.clone());
    assert_eq!(booked["result"], "booked", "{booked}");
    let started = Instant::now();
    for owner in 0..10 {
        for k in [&cred, &ip] {
            let queued = t.call(json!({"op": "check", "key": k, "limit": limit, "cost": 1,
                                        "owner": 100 + owner, "max_wait_ms": 60_000}));
            assert_eq!(queued["result"], "booked", "{queued}");
        }
    }
    let pause =
        json!({"op": "pause", "target": {"exchange": "okx", "credential": "turn"}, "ms": 850});
    assert_eq!(t.call(pause)["ok"], true);
    sleep_ms(ms(&booked).saturating_sub(started.elapsed().as_millis() as u64));
    let held = t.call(both.clone());
    assert_eq!(held["result"], "delay", "{held}");
    // Out at the pause's end, about 600 ms from now.
    assert!(ms(&held) <= 900, "{held}");
    sleep_ms(ms(&held));
    let claim = t.call(both);
    assert_eq!(claim["result"], "claimed", "{claim}");
}

/// A waiter back late, within its slack, whose claim a pause of its credential holds, is
/// paid again on the IP from what the IP's cap left it: another credential took the IP's
/// refill after the booking's ready time, and given back its whole cost the waiter went
/// out at the pause's end beside a token more than P1 allows since that take.
#[test]
fn a_late_claim_held_by_a_pause_gets_back_nothing_the_cap_took_after_its_ready_time() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &[]);
    let mut t = server.connect();
    let limit = json!({"capacity": 10, "refill_per_sec": 10});
    let cred = json!({"exchange": "okx", "credential": "late", "axis": "request"});
    let other = json!({"exchange": "okx", "credential": "other", "axis": "request"});
    let ip = json!({"exchange": "okx", "credential": null, "axis": "ip"});
    let both = json!({"op": "check_many", "owner": 1, "max_wait_ms": 60_000, "checks": [
        {"key": cred, "limit": limit, "cost": 1}, {"key": ip, "limit": limit, "cost": 1},
    ]});
    let drain = t.call(json!({"op": "check", "key": cred, "limit": limit, "cost": 10}));
    assert_eq!(drain["result"], "admitted", "{drain}");
    let booked_at = Instant::now();
    let booked = t.call(both.clone());
    assert_eq!(booked["result"], "booked", "{booked}");
    let pause =
        json!({"op": "pause", "target": {"exchange": "okx", "credential": "late"}, "ms": 1000});
    assert_eq!(t.call(pause)["ok"], true);
    // Past the booking's ready time (about 100 ms) the IP refills to its cap; another
    // credential takes all of it.
    sleep_ms(220u64.saturating_sub(booked_at.elapsed().as_millis() as u64));
    let take_sent = Instant::now();
    let take = t.call(json!({"op": "check_many", "checks": [
        {"key": other, "limit": limit, "cost": 10}, {"key": ip, "limit": limit, "cost": 10},
    ]}));
    assert_eq!(take["result"], "admitted", "{take}");
    // Back late, within the 250 ms slack: held by the pause.
    sleep_ms(270u64.saturating_sub(booked_at.elapsed().as_millis() as u64));
    let held = t.call(both.clone());
    assert_eq!(held["result"], "delay", "{held}");
    sleep_ms(ms(&held));
    let claim = t.call(both);
    assert_eq!(claim["result"], "claimed", "{claim}");
    let left = 10.0 - borrowed(&mut t, &ip);
    let window = take_sent.elapsed().as_secs_f64();
    // Out since the take: its 10, the waiter's 1, and what the IP still lets out now.
    let out = 10.0 + 1.0 + left;
    assert!(
        out <= 10.0 + 10.0 * window + 1e-6,
        "{out} out of the IP within {window} s"
    );
}

/// Another credential's check admitted on a shared IP bucket that holds waiters' bookings
/// does not read those bookings when the bucket's `q` shows that what they give back fits
/// below its cap.
#[test]
fn a_check_admitted_beside_bookings_that_fit_does_not_read_them() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &[]);
    let mut t = server.connect();
    let slow = json!({"capacity": 1, "refill_per_sec": 1});
    let ip_limit = json!({"capacity": 100, "refill_per_sec": 1});
    let cred = json!({"exchange": "okx", "credential": "waits", "axis": "request"});
    let ip = json!({"exchange": "okx", "credential": null, "axis": "ip"});
    let both = |owner: u64| {
        json!({"op": "check_many", "owner": owner, "max_wait_ms": 60_000, "checks": [
            {"key": cred, "limit": slow, "cost": 1}, {"key": ip, "limit": ip_limit, "cost": 1},
        ]})
    };
    assert_eq!(t.call(both(0))["result"], "admitted");
    for owner in 1..=5 {
        assert_eq!(t.call(both(owner))["result"], "booked");
    }
    let _: () = redis.query(::redis::cmd("CONFIG").arg("RESETSTAT"));
    let other = json!({"exchange": "okx", "credential": "other", "axis": "request"});
    let n = 10;
    for _ in 0..n {
        let answer = t.call(json!({"op": "check_many", "checks": [
            {"key": other, "limit": ip_limit, "cost": 1}, {"key": ip, "limit": ip_limit, "cost": 1},
        ]}));
        assert_eq!(answer["result"], "admitted", "{answer}");
    }
    assert_eq!(calls_of(&redis, "hgetall"), 0);
    // The bookings are still there, each claimed when due.
    sleep_ms(1_100);
    assert_eq!(t.call(both(1))["result"], "claimed");
}

/// Books ten waiters (`waiter(owner)`), pauses `target` for 1.5 s, has each come back
/// during the pause (told `delay`), and each claim its booking at the pause's end; returns
/// the answers they were told during the pause.
fn hold_ten_waiters(
    t: &mut LineClient<TcpStream>,
    waiter: impl Fn(u64) -> Value,
    target: Value,
) -> Vec<Value> {
    for owner in 0..10 {
        assert_eq!(t.call(waiter(owner))["result"], "booked");
    }
    let pause = json!({"op": "pause", "target": target, "ms": 1500});
    assert_eq!(t.call(pause)["ok"], true);
    let started = std::time::Instant::now();
    let held: Vec<Value> = (0..10).map(|owner| t.call(waiter(owner))).collect();
    for answer in &held {
        assert_eq!(answer["result"], "delay", "{answer}");
    }
    sleep_ms(1500u64.saturating_sub(started.elapsed().as_millis() as u64) + 20);
    for owner in 0..10 {
        let claim = t.call(waiter(owner));
        assert_eq!(claim["result"], "claimed", "{claim}");
    }
    held
}

/// Limited replies that come back during a backoff's pause were sent before it: they
/// pause as long again and are not counted; the next one after the pause is.
#[test]
fn a_burst_of_limited_replies_is_one_backoff() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &[]);
    let mut t = server.connect();
    let credential = json!({"exchange": "burst", "credential": "k"});
    let back_off = json!({"op": "back_off", "credential": credential, "scope": "credential"});
    let burst: Vec<u64> = (0..8).map(|_| ms(&t.call(back_off.clone()))).collect();
    assert_eq!(burst, [1000; 8]);
    sleep_ms(1100);
    assert_eq!(ms(&t.call(back_off)), 2000);
}

/// A pause that began after waiters booked holds them to its end, and they take what
/// refilled meanwhile: traffic waiting for the pause's end does not go out beside them.
#[test]
fn bookings_a_pause_held_and_the_traffic_behind_it_fit_the_bucket() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &[]);
    let mut t = server.connect();
    let k = key("okx", Some("held"));
    let limit = json!({"capacity": 10, "refill_per_sec": 10});
    assert_eq!(t.call(check(&k, limit.clone(), 10.0))["result"], "admitted");
    let waiter = |owner: u64| json!({"op": "check", "key": k, "limit": limit, "owner": owner, "max_wait_ms": 5000});
    for held in hold_ten_waiters(&mut t, waiter, json!({"exchange": "okx"})) {
        about(ms(&held), 1500, "a booking held to the pause's end");
    }
    // Paid again as of the pause's end, the ten leave the bucket empty then.
    let behind = t.call(check(&k, limit.clone(), 5.0));
    assert_eq!(behind["result"], "delay", "{behind}");
}

#[test]
fn multi_bucket_checks_pauses_resets_and_sync() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &[]);
    let mut t = server.connect();
    // Nothing refills within the test's tolerance of 0.01 token for 100 s.
    let slow = |capacity: u64| json!({"capacity": capacity, "refill_per_sec": 0.0001});
    let a = key("bybit", Some("k"));
    let ip = json!({"exchange": "bybit", "credential": null, "axis": "ip"});
    let many = |cost_a: f64| {
        json!({"op": "check_many", "checks": [
            {"key": a, "limit": slow(5), "cost": cost_a},
            {"key": ip, "limit": slow(3), "cost": 1},
        ]})
    };
    for _ in 0..3 {
        assert_eq!(t.call(many(1.0))["result"], "admitted");
    }
    // The ip bucket is empty: the other bucket pays nothing either.
    assert_eq!(t.call(many(1.0))["result"], "delay");
    assert!((borrowed(&mut t, &a) - 3.0).abs() < 0.01);
    // Coalesced: one key twice is charged once at the combined cost; conflicts pay nothing.
    let twice = json!({"op": "check_many", "checks": [
        {"key": a, "limit": slow(5), "cost": 1}, {"key": a, "limit": slow(5), "cost": 1},
    ]});
    assert_eq!(t.call(twice)["result"], "admitted");
    assert!((borrowed(&mut t, &a) - 5.0).abs() < 0.01);
    let conflict = t.call(json!({"op": "check_many", "checks": [
        {"key": ip, "limit": slow(3)}, {"key": ip, "limit": slow(4)},
    ]}));
    assert_eq!(conflict["error"]["type"], "invalid_parameters");

    // Pauses: key, credential and exchange targets; the later end wins.
    let other = key("bybit", Some("other"));
    let fresh = |k: &Value| check(k, slow(100), 1.0);
    let pause = |t: &mut LineClient<TcpStream>, target: Value, ms: u64| {
        assert_eq!(
            t.call(json!({"op": "pause", "target": target, "ms": ms}))["ok"],
            true
        )
    };
    pause(
        &mut t,
        json!({"exchange": "bybit", "credential": "other", "axis": "request"}),
        10_000,
    );
    pause(
        &mut t,
        json!({"exchange": "bybit", "credential": "other", "axis": "request"}),
        10,
    );
    about(ms(&t.call(fresh(&other))), 10_000, "a key pause");
    let other_axis = json!({"exchange": "bybit", "credential": "other", "axis": "order"});
    assert_eq!(t.call(fresh(&other_axis))["result"], "admitted");
    pause(
        &mut t,
        json!({"exchange": "bybit", "credential": "other"}),
        20_000,
    );
    about(
        ms(&t.call(fresh(&other_axis))),
        20_000,
        "a credential pause",
    );
    assert_eq!(
        t.call(fresh(&key("bybit", Some("third"))))["result"],
        "admitted"
    );
    pause(&mut t, json!({"exchange": "bybit"}), 30_000);
    about(
        ms(&t.call(fresh(&key("bybit", Some("third"))))),
        30_000,
        "an exchange pause",
    );
    assert_eq!(t.call(fresh(&key("kraken", None)))["result"], "admitted");
    let info = t.call(json!({"op": "inspect", "key": other}))["info"].clone();
    about(
        info["pause_ms"].as_u64().unwrap(),
        30_000,
        "inspect's pause",
    );
    // A reset drops the pause on that key alone; reset_exchange drops them all.
    t.call(json!({"op": "reset", "key": other}));
    about(
        ms(&t.call(fresh(&other))),
        30_000,
        "the exchange pause after a key reset",
    );
    t.call(json!({"op": "reset_exchange", "exchange": "bybit"}));
    assert_eq!(t.call(fresh(&other))["result"], "admitted");
    assert_eq!(borrowed(&mut t, &a), 0.0);
    assert_eq!(t.call(fresh(&key("kraken", None)))["result"], "admitted");

    // sync: lowered to what the exchange allows, never raised.
    let synced = key("kraken", Some("s"));
    t.call(check(
        &synced,
        json!({"capacity": 10, "refill_per_sec": 0.001}),
        1.0,
    ));
    let taken = t.call(json!({"op": "sync", "key": synced, "allowance": 5, "window_left_ms": 0}));
    assert!(
        (taken["taken"].as_f64().unwrap() - 4.0).abs() < 0.01,
        "{taken}"
    );
    let taken = t.call(json!({"op": "sync", "key": synced, "allowance": 50, "window_left_ms": 0}));
    assert_eq!(taken["taken"], 0.0);
    assert_eq!(
        t.call(json!({"op": "sync", "key": key("kraken", Some("unknown")), "allowance": 0, "window_left_ms": 0}))["taken"],
        0.0
    );
}

#[test]
fn idle_buckets_expire_once_they_behave_as_new() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &["--booking-slack-ms", "100"]);
    let mut t = server.connect();
    let k = key("e", Some("ttl"));
    // Capacity 10 at 10/s: full again 1 s after paying, plus a 1 s margin, and 1 s ahead
    // (paid without bookings, so the next second's checks need not renew it).
    t.call(check(
        &k,
        json!({"capacity": 10, "refill_per_sec": 10}),
        10.0,
    ));
    let names: Vec<String> = redis.query(::redis::cmd("KEYS").arg("bourse:{1:e}:b:h*:7:request"));
    let [bucket] = names.as_slice() else {
        panic!("{names:?}")
    };
    let pttl = |redis: &Redis| -> i64 { redis.query(::redis::cmd("PTTL").arg(bucket)) };
    let ttl = pttl(&redis);
    assert!((2000..=3000).contains(&ttl), "{ttl}");
    // A refused over-capacity probe keeps the bucket past the delay it answered.
    let answer = t.call(check(
        &k,
        json!({"capacity": 10, "refill_per_sec": 10}),
        60.0,
    ));
    let ttl = pttl(&redis);
    assert!(ttl as u64 >= ms(&answer), "{ttl} < {answer}");
    // A bucket left alone disappears.
    let quick = key("e", Some("quick"));
    t.call(check(
        &quick,
        json!({"capacity": 1, "refill_per_sec": 100}),
        1.0,
    ));
    eventually("the idle bucket expires", || {
        t.call(json!({"op": "inspect", "key": quick}))["info"].is_null()
    });
}

/// Several daemon processes (standing in for machines) on one Redis hammer one bucket: the
/// total admitted stays within C + r * T (docs/CONTRACT.md, P1), and near it.
#[test]
fn several_daemons_share_one_bucket() {
    let Some(redis) = Redis::start() else { return };
    let (capacity, refill) = (20.0, 50.0);
    let daemons: Vec<Server> = (0..4).map(|_| daemon(&redis, &[])).collect();
    let k = key("binance", Some("shared"));
    let limit = json!({"capacity": capacity, "refill_per_sec": refill});
    let started = Instant::now();
    let answers = load::load(
        &daemons,
        2,
        &k,
        &limit,
        started,
        Duration::from_secs(2),
        || (),
    );
    let elapsed = started.elapsed().as_secs_f64();
    let what = format!("4 daemons x 2 clients, {} checks", answers.len());
    assert_conforms(
        load::count(&answers, "admitted"),
        capacity,
        refill,
        elapsed,
        &what,
    );
}

/// Connections are served in turn: clients that pipeline seconds of Redis work make
/// another client's check wait for a call or two, not behind all of it. Before, every
/// check waited in one queue, first come first served: the other client's checks were all
/// answered `unavailable` after the Redis timeout.
#[test]
fn checks_pipelined_by_other_connections_do_not_hold_a_client_past_its_timeout() {
    let Some(redis) = Redis::start() else { return };
    // A timeout that a loaded machine's own delays stay well within, and floods of more
    // work than it: behind them all, the other client's checks would still be refused.
    let server = daemon(&redis, &["--redis-timeout-ms", "2000"]);
    let roomy = json!({"capacity": 1e9, "refill_per_sec": 1e9});
    // Four connections, each 600 calls of 200 buckets: about 5 s of Redis work.
    let floods: Vec<_> = (0..4)
        .map(|flooder| {
            let checks: Vec<Value> = (0..200)
                .map(|i| json!({"key": key("flood", Some(&format!("{flooder}-{i}"))), "limit": roomy}))
                .collect();
            let mut frames = Vec::new();
            for id in 0..600 {
                frames.extend(serde_json::to_vec(&json!({"id": id, "op": "check_many", "checks": checks})).unwrap());
                frames.push(b'\n');
            }
            pipelined(&server, frames, 600)
        })
        .collect();
    another_client_is_served(&server, &roomy, floods);
}

/// Sends `frames` (`count` requests) on a connection of its own, from a thread that then
/// reads their answers.
fn pipelined(server: &Server, frames: Vec<u8>, count: usize) -> thread::JoinHandle<()> {
    let mut client = server.connect();
    thread::spawn(move || {
        client.send_raw(&frames);
        for _ in 0..count {
            client.recv();
        }
    })
}

/// Once the `floods` are read (most still waiting for Redis), another client's five checks
/// of a bucket under `limit` are admitted, none answered `unavailable`.
fn another_client_is_served(server: &Server, limit: &Value, floods: Vec<thread::JoinHandle<()>>) {
    sleep_ms(200);
    let mut t = server.connect();
    let k = key("alone", None);
    for _ in 0..5 {
        assert_eq!(t.call(check(&k, limit.clone(), 1.0))["result"], "admitted");
    }
    for flood in floods {
        flood.join().unwrap();
    }
}

/// Table-wide walks run one at a time: a burst of `stats` over many buckets makes checks
/// wait for a page of one walk, not for every walk at once. Before, the walks' pages held
/// Redis together and every check of another client was answered `unavailable`.
#[test]
fn a_burst_of_stats_does_not_hold_checks_past_their_timeout() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &["--redis-timeout-ms", "1000"]);
    let still = json!({"capacity": 10, "refill_per_sec": 0.001});
    fill(&server, 20_000, &still);
    let bursts = (0..4)
        .map(|_| pipelined(&server, b"{\"op\":\"stats\"}\n".repeat(50), 50))
        .collect();
    another_client_is_served(&server, &still, bursts);
}

/// Walks take turns page by page: while clients ask for `stats` over and over, as many as
/// may read at once, each walk far longer than the Redis timeout, another's
/// `reset_exchange` gets its turns. Before, a walk held its turn to the end (and then the
/// reading walks filled every place), and the reset was answered `unavailable`.
#[test]
fn a_long_walk_does_not_keep_another_from_its_turn() {
    let Some(redis) = Redis::start() else { return };
    // A walk of 80,000 buckets takes about 1.2 s on a quiet 2-core machine (40,000 took
    // 597 ms once, under the timeout); a page's turn a few ms, which a loaded one can
    // stretch to hundreds.
    let server = daemon(&redis, &["--redis-timeout-ms", "600"]);
    fill(
        &server,
        80_000,
        &json!({"capacity": 10, "refill_per_sec": 0.001}),
    );
    // A walk alone outlasts the timeout: one that held its turn to the end would fail the
    // reset.
    let walk = Instant::now();
    assert_eq!(server.connect().call(json!({"op": "stats"}))["ok"], true);
    assert!(
        walk.elapsed() > Duration::from_millis(600),
        "{:?}",
        walk.elapsed()
    );
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let walkers: Vec<_> = (0..4)
        .map(|_| {
            let (mut client, stop) = (server.connect(), stop.clone());
            thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    client.call(json!({"op": "stats"}));
                }
            })
        })
        .collect();
    sleep_ms(100);
    let mut t = server.connect();
    for _ in 0..5 {
        let reset = t.call(json!({"op": "reset_exchange", "exchange": "elsewhere"}));
        assert_eq!(reset["ok"], true, "{reset}");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for walker in walkers {
        walker.join().unwrap();
    }
}

/// With Redis stopped, every table-wide walk is answered `unavailable` within one Redis
/// timeout, however many wait for a place or a turn. Before, its place, its turn and its
/// first page were each given a timeout: 2 to 3 timeouts with 4 walks of each kind.
#[test]
fn walks_on_a_stopped_redis_answer_within_one_timeout() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &["--redis-timeout-ms", "1500"]);
    fill(
        &server,
        1_000,
        &json!({"capacity": 10, "refill_per_sec": 0.001}),
    );
    let requests = [
        json!({"op": "stats"}),
        json!({"op": "busiest", "count": 5}),
        json!({"op": "reset_exchange", "exchange": "elsewhere"}),
        json!({"op": "reset_all"}),
    ];
    let mut clients: Vec<_> = (0..16).map(|_| server.connect()).collect();
    kill("STOP", redis.child.id());
    let started = Instant::now();
    for (i, client) in clients.iter_mut().enumerate() {
        client.send(&requests[i % 4]);
    }
    let answers: Vec<(Value, Duration)> = clients
        .iter_mut()
        .map(|client| (client.recv(), started.elapsed()))
        .collect();
    kill("CONT", redis.child.id());
    // One timeout, and slack for a loaded 2-core machine well below a second timeout.
    unavailable_within("walks", &answers, Duration::from_millis(2_700));
}

/// A reset walking a slow Redis (each answer 150 ms late, within the timeout) stops at its
/// caller's deadline: it is answered `unavailable` by then, and resets nothing after.
/// Before, it walked on to the end, long after its caller was told `unavailable`.
#[test]
fn a_reset_on_a_slow_redis_stops_at_its_callers_deadline() {
    let Some(redis) = Redis::start() else { return };
    let relay = AnswerHold::start(redis.port);
    let server = relay.daemon(2000);
    fill(
        &server,
        5_000,
        &json!({"capacity": 10, "refill_per_sec": 0.001}),
    );
    let mut t = server.connect();
    let clock_us = t.call(json!({"op": "hello"}))["clock_us"].as_u64().unwrap();
    let slow = Arc::new(AtomicBool::new(true));
    let slowing = {
        let (slow, relay_held) = (Arc::clone(&slow), Arc::clone(&relay.held));
        thread::spawn(move || {
            while slow.load(Ordering::SeqCst) {
                relay_held.store(true, Ordering::SeqCst);
                sleep_ms(150);
                relay_held.store(false, Ordering::SeqCst);
                sleep_ms(2);
            }
        })
    };
    // Its caller waits 1 s: the walk may go on until 0.75 s from now.
    let started = Instant::now();
    let reset = t.call(json!({"op": "reset_exchange", "exchange": "walked",
        "deadline_us": clock_us + 1_000_000, "timeout_ms": 1000}));
    let took = started.elapsed();
    slow.store(false, Ordering::SeqCst);
    slowing.join().unwrap();
    relay.hold(false);
    assert_eq!(reset["error"]["type"], "unavailable", "{reset}");
    assert!(
        took < Duration::from_millis(2_500),
        "answered after {took:?}"
    );
    let left = || -> u64 {
        let mut connection = redis.connection().unwrap();
        let keys: Vec<String> = ::redis::cmd("KEYS")
            .arg("bourse:{*walked}:b:*")
            .query(&mut connection)
            .unwrap();
        keys.len() as u64
    };
    let at_answer = left();
    sleep_ms(1_500);
    assert!(
        at_answer > 0,
        "the reset walked to the end before its deadline"
    );
    assert_eq!(left(), at_answer, "the reset went on after its answer");
}

/// Fills `server`'s Redis with `count` buckets of `limit`, 1,000 checks pipelined at a time.
fn fill(server: &Server, count: usize, limit: &Value) {
    let mut filler = server.connect();
    for round in 0..count / 1000 {
        let mut frames = Vec::new();
        for i in 0..1000 {
            let k = key("walked", Some(&format!("{round}-{i}")));
            frames.extend(serde_json::to_vec(&check(&k, limit.clone(), 1.0)).unwrap());
            frames.push(b'\n');
        }
        filler.send_raw(&frames);
        for _ in 0..1000 {
            assert_eq!(filler.recv()["result"], "admitted");
        }
    }
}

/// Concurrent multi-bucket checks from several daemons pay on all buckets or none (P4).
#[test]
fn concurrent_multi_bucket_checks_are_atomic() {
    let Some(redis) = Redis::start() else { return };
    let daemons: Vec<Server> = (0..3).map(|_| daemon(&redis, &[])).collect();
    load::assert_multi_bucket_checks_atomic(&daemons, "a");
}

/// Redis restarts empty mid-run: answers while it is down are errors (nothing admitted);
/// afterwards the daemon reconnects by itself, reloads the script, and the lost buckets
/// start over as new (full, or as if empty at the restart with --assume-busy-at-start).
#[test]
fn a_redis_restart_admits_nothing_while_down_and_recovers() {
    let Some(mut redis) = Redis::start() else {
        return;
    };
    let plain = daemon(&redis, &["--redis-timeout-ms", "500"]);
    let busy = daemon(&redis, &["--assume-busy-at-start"]);
    let mut t = plain.connect();
    let mut b = busy.connect();
    let k = key("binance", Some("restart"));
    let limit = json!({"capacity": 5, "refill_per_sec": 1});
    for _ in 0..5 {
        assert_eq!(t.call(check(&k, limit.clone(), 1.0))["result"], "admitted");
    }
    assert_eq!(t.call(check(&k, limit.clone(), 1.0))["result"], "delay");

    redis.stop();
    for _ in 0..3 {
        let started = Instant::now();
        let answer = t.call(check(&k, limit.clone(), 1.0));
        assert_eq!(answer["ok"], false, "{answer}");
        assert_eq!(answer["error"]["type"], "unavailable", "{answer}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }
    assert_eq!(
        t.call(json!({"op": "get_cost", "key": k}))["error"]["type"],
        "unavailable"
    );

    let _restarted = Redis::on_port(redis.port);
    // Lost with Redis: the bucket is new. With --assume-busy-at-start it begins as if empty
    // when this exchange's state began again (now), so nothing is admitted at once.
    let busy_answer = b.call(check(&k, limit.clone(), 1.0));
    assert_eq!(busy_answer["result"], "delay", "{busy_answer}");
    about(ms(&busy_answer), 1000, "assume busy after lost state");
    let other = key("binance", Some("fresh"));
    let admitted = (0..6)
        .filter(|_| t.call(check(&other, limit.clone(), 1.0))["result"] == "admitted")
        .count();
    assert!(admitted <= 5, "admitted {admitted}");
}

/// A connection's own busy start (its hello's `busy_since_us_ago`) holds through Redis as in
/// memory, also beside --assume-busy-at-start, whose start is older here.
#[test]
fn a_connection_assumes_buckets_busy_from_the_start_its_hello_names() {
    let Some(redis) = Redis::start() else { return };
    let plain = daemon(&redis, &[]);
    common::assert_busy_start_of_a_connection(
        &mut plain.connect(),
        &mut plain.connect(),
        "busyhello",
    );
    let busy = daemon(&redis, &["--assume-busy-at-start"]);
    let mut b = busy.connect();
    // The exchange's state begins now; the connection's start, 4 s ago, is the earlier.
    let early = key("busyboth", Some("early"));
    let first = b.call(check(
        &early,
        json!({"capacity": 10, "refill_per_sec": 1}),
        1.0,
    ));
    assert_eq!(first["result"], "delay", "{first}");
    sleep_ms(500);
    assert_eq!(
        b.call(json!({"op": "hello", "busy_since_us_ago": 4_000_000}))["ok"],
        true
    );
    let fresh = key("busyboth", Some("fresh"));
    let later = b.call(check(
        &fresh,
        json!({"capacity": 10, "refill_per_sec": 1}),
        1.0,
    ));
    about(
        ms(&later),
        500,
        "as if empty when the state began, the later start",
    );
}

/// A daemon with --assume-busy-at-start takes an exchange's marker written by daemons
/// without the flag (it names no node) as its node's: the buckets they paid are left as
/// they are, not emptied as after a failover, and the marker then names the node.
#[test]
fn a_busy_daemon_leaves_the_buckets_of_plain_daemons_as_they_are() {
    let Some(redis) = Redis::start() else { return };
    let plain = daemon(&redis, &[]);
    let busy = daemon(&redis, &["--assume-busy-at-start"]);
    let (mut p, mut b) = (plain.connect(), busy.connect());
    let k = key("plainfirst", Some("k"));
    let slow = json!({"capacity": 10, "refill_per_sec": 0.1});
    assert_eq!(p.call(check(&k, slow.clone(), 1.0))["result"], "admitted");
    sleep_ms(300);
    let busy_answer = b.call(check(&k, slow.clone(), 9.0));
    assert_eq!(busy_answer["result"], "admitted", "{busy_answer}");
    let marker: String = redis.query(::redis::cmd("GET").arg("bourse:e{10:plainfirst}"));
    assert_eq!(marker.split(' ').count(), 2, "{marker}");
    // A function library reads the node's run_id once, not at every check (one `INFO`
    // here is the count's own).
    if major_version(&redis) >= 7 {
        let before = calls_of(&redis, "info");
        let other = key("plainfirst", Some("other"));
        for _ in 0..20 {
            assert_eq!(
                b.call(check(&other, slow.clone(), 0.0))["result"],
                "admitted"
            );
        }
        assert_eq!(calls_of(&redis, "info") - before, 1);
    }
}

/// With --assume-busy-at-start, a key that only refused checks saw before its exchange's
/// state began again (Redis restarted from a snapshot, a failover) accrued nothing before
/// then, as a key with a definition.
#[test]
fn a_key_seen_only_by_refusals_accrues_nothing_before_its_state_began_again() {
    let Some(redis) = Redis::start() else { return };
    let busy = daemon(&redis, &["--assume-busy-at-start"]);
    let mut b = busy.connect();
    let k = key("busyseen", Some("refused"));
    let limit = json!({"capacity": 5, "refill_per_sec": 10});
    // The exchange's state begins now: empty, a cost of 3 waits 300 ms.
    let first = b.call(check(&k, limit.clone(), 3.0));
    assert_eq!(first["result"], "delay", "{first}");
    thread::sleep(Duration::from_millis(600));
    // Another node's marker: for this daemon the state begins again at its next check.
    let _: () = redis.query(
        ::redis::cmd("SET")
            .arg("bourse:e{8:busyseen}")
            .arg("1 0ther"),
    );
    let again = b.call(check(&k, limit.clone(), 3.0));
    assert_eq!(again["result"], "delay", "{again}");
    about(ms(&again), 300, "as if empty when the state began again");
}

/// With --assume-busy-at-start on one server, an exchange new to Redis is as old as the
/// server's data, which the daemon notes at its start: its buckets seen after their fill
/// time start full, as on the NIF. A record naming another node (Redis restarted) or none
/// (data lost) begins it at the next check.
#[test]
fn a_new_exchange_on_one_server_is_as_old_as_its_data() {
    let Some(redis) = Redis::start() else { return };
    let busy = daemon(&redis, &["--assume-busy-at-start"]);
    let mut b = busy.connect();
    let limit = json!({"capacity": 5, "refill_per_sec": 50});
    sleep_ms(300);
    // The first check on this Redis, after the bucket's fill time (100 ms): full.
    let later = key("later", Some("k"));
    for _ in 0..5 {
        let answer = b.call(check(&later, limit.clone(), 1.0));
        assert_eq!(answer["result"], "admitted", "{answer}");
    }
    let record: String = redis.query(::redis::cmd("GET").arg("bourse:data"));
    let ttl: i64 = redis.query(::redis::cmd("PTTL").arg("bourse:data"));
    assert_eq!(ttl, -1, "{record}: one key, kept for good");
    // Written by a server since restarted, or lost: the exchange's state begins now.
    let _: () = redis.query(::redis::cmd("SET").arg("bourse:data").arg("1 0ther"));
    let restarted = b.call(check(&key("restarted", Some("k")), limit.clone(), 5.0));
    assert_eq!(restarted["result"], "delay", "{restarted}");
    let _: () = redis.query(::redis::cmd("DEL").arg("bourse:data"));
    let lost = b.call(check(&key("lost", Some("k")), limit.clone(), 5.0));
    assert_eq!(lost["result"], "delay", "{lost}");
    let rewritten: String = redis.query(::redis::cmd("GET").arg("bourse:data"));
    assert_eq!(
        rewritten.split(' ').nth(1),
        record.split(' ').nth(1),
        "{rewritten}"
    );
    // A daemon without the flag writes it too, with an exchange new to the server.
    let _: () = redis.query(::redis::cmd("DEL").arg("bourse:data"));
    let plain = daemon(&redis, &[]);
    let answer = plain
        .connect()
        .call(check(&key("plain", Some("k")), limit, 1.0));
    assert_eq!(answer["result"], "admitted", "{answer}");
    let again: String = redis.query(::redis::cmd("GET").arg("bourse:data"));
    assert_eq!(again.split(' ').nth(1), record.split(' ').nth(1), "{again}");
}

/// With --assume-busy-at-start, a marker that daemons without the flag wrote (it names no
/// node) and that is older than the server's data (restored from a snapshot: the record
/// names the process that saved it) begins its exchange's state when the data did: the
/// buckets lost with the data start as if empty then, not full.
#[test]
fn a_plain_marker_older_than_the_servers_data_begins_the_state_again() {
    let Some(redis) = Redis::start() else { return };
    let plain = daemon(&redis, &[]);
    let limit = json!({"capacity": 5, "refill_per_sec": 50});
    let paid = plain
        .connect()
        .call(check(&key("snap", Some("a")), limit.clone(), 1.0));
    assert_eq!(paid["result"], "admitted", "{paid}");
    let marker: String = redis.query(::redis::cmd("GET").arg("bourse:e{4:snap}"));
    assert_eq!(marker.split(' ').count(), 1, "{marker}");
    sleep_ms(300);
    // As restored from a snapshot another process saved, with the marker.
    let _: () = redis.query(::redis::cmd("SET").arg("bourse:data").arg("1 0ther"));
    let busy = daemon(&redis, &["--assume-busy-at-start"]);
    let lost = busy
        .connect()
        .call(check(&key("snap", Some("b")), limit, 5.0));
    assert_eq!(lost["result"], "delay", "{lost}");
}

/// With --assume-busy-at-start, a bucket as new under another definition starts as a new
/// key would under it: as if empty when the exchange's state began, not from its own tokens.
#[test]
fn a_bucket_as_new_takes_another_definition_as_a_new_key() {
    let Some(redis) = Redis::start() else { return };
    let busy = daemon(&redis, &["--assume-busy-at-start"]);
    let mut b = busy.connect();
    let (k, fresh) = (key("busyredef", Some("k")), key("busyredef", Some("fresh")));
    let small = json!({"capacity": 4, "refill_per_sec": 10});
    let big = json!({"capacity": 100, "refill_per_sec": 10});
    // The exchange's state begins now; the bucket is full under `small` after 400 ms.
    assert_eq!(b.call(check(&k, small, 0.0))["result"], "admitted");
    sleep_ms(1_000);
    // A new key holds 10 of the 30 (1 s of refill since the state began), not 4.
    let redefined = b.call(check(&k, big.clone(), 30.0));
    about(ms(&redefined), 2_000, "the bucket under the new definition");
    about(
        ms(&b.call(check(&fresh, big.clone(), 30.0))),
        2_000,
        "a new key",
    );
    let info = b.call(json!({"op": "inspect", "key": k}))["info"].clone();
    assert_eq!(
        info["limit"]["capacity"], 4.0,
        "a refused call keeps the definition"
    );
    assert_eq!(b.call(check(&k, big, 5.0))["result"], "admitted");
    let info = b.call(json!({"op": "inspect", "key": k}))["info"].clone();
    assert_eq!(info["limit"]["capacity"], 100.0);
}

/// A bucket as new to another definition starts as a new key from when it was full again
/// after its last payment: the refill that paid its last cost is not counted twice.
#[test]
fn another_definition_counts_nothing_the_last_payment_used() {
    let Some(redis) = Redis::start() else { return };
    let d = daemon(&redis, &[]);
    let mut c = d.connect();
    let k = key("redefined", Some("k"));
    let a = json!({"capacity": 10, "refill_per_sec": 10});
    let b = json!({"capacity": 10, "refill_per_sec": 10.000001});
    assert_eq!(c.call(check(&k, a.clone(), 10.0))["result"], "admitted");
    sleep_ms(2_050);
    // 20.5 accrued over the capacity pays a cost of 20: empty (what accrued beyond the cost
    // is not kept), full again 1 s later (the key lives a few seconds past that).
    assert_eq!(c.call(check(&k, a.clone(), 20.0))["result"], "admitted");
    sleep_ms(1_500);
    // 15 now: a cost of 20 waits 0.5 s under either definition.
    about(
        ms(&c.call(check(&k, b, 20.0))),
        500,
        "under the other definition",
    );
    about(ms(&c.call(check(&k, a, 20.0))), 500, "under its own");
}

/// With `--redis` a connection is served by the runtime, not a thread of its own: a client
/// that reads its answers slowly but steadily is not taken for one that stopped reading.
#[test]
fn a_slow_but_steady_reader_is_served_to_the_end() {
    let Some(redis) = Redis::start() else { return };
    let socket = common::temp_path("redis-slow-reader.sock");
    let _daemon = socket_daemon(&redis, &socket, &["--idle-timeout-ms", "1000"]);
    common::read_slowly(&socket);
}

/// With `--redis`, a client that stops reading its answers gives its slot back once it read
/// none of them for the idle timeout.
#[test]
fn a_client_that_stops_reading_gives_its_slot_back() {
    let Some(redis) = Redis::start() else { return };
    let socket = common::temp_path("redis-stop-reading.sock");
    let extra = ["--idle-timeout-ms", "500", "--max-connections", "1"];
    let _daemon = socket_daemon(&redis, &socket, &extra);
    let flood = common::flood_unread(std::os::unix::net::UnixStream::connect(&socket).unwrap());
    thread::sleep(Duration::from_millis(200));
    assert!(!flood.is_finished(), "the flood was read whole");
    eventually("a new client is served", || {
        let stream = std::os::unix::net::UnixStream::connect(&socket).unwrap();
        LineClient::new(stream).call(json!({"op": "hello"}))["ok"] == true
    });
    flood.join().unwrap();
}

/// With `--redis`, clients that pipeline checks and never read their answers hold a bounded
/// share of the daemon's memory each. (With 4,096 requests running per connection, eight
/// such clients grew it past 240 MB.)
#[test]
fn clients_that_never_read_their_answers_hold_little_memory() {
    use std::io::Write;
    let Some(redis) = Redis::start() else { return };
    let socket = common::temp_path("redis-unread-memory.sock");
    let daemon = socket_daemon(&redis, &socket, &[]);
    let line = b"{\"id\":1,\"op\":\"check\",\"key\":{\"exchange\":\"x\",\"credential\":\"k\"},\"limit\":{\"requests\":1000000}}\n";
    let lines = line.repeat(700);
    let floods: Vec<_> = (0..8)
        .map(|_| {
            let mut stream = std::os::unix::net::UnixStream::connect(&socket).unwrap();
            stream
                .set_write_timeout(Some(Duration::from_secs(1)))
                .unwrap();
            let lines = lines.clone();
            thread::spawn(move || {
                let started = std::time::Instant::now();
                while started.elapsed() < Duration::from_secs(4) {
                    if stream.write_all(&lines).is_err() {
                        thread::sleep(Duration::from_millis(10));
                    }
                }
            })
        })
        .collect();
    for flood in floods {
        flood.join().unwrap();
    }
    let rss_kb = status_kb(daemon.child.id(), "VmRSS");
    assert!(rss_kb < 120_000, "the daemon holds {rss_kb} kB");
}

/// The kB of `field` (`VmRSS`, `VmHWM`) in the status of process `pid`.
fn status_kb(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|value| value.trim().trim_end_matches("kB").trim().parse().ok())
        .expect(field)
}

/// With `--redis`, `busiest` holds the rows asked for and one `SCAN` page, not every busy
/// key: four walks at once (as many as may read), each asking for one row of 20,000 busy
/// buckets of 2 KiB keys, raise the daemon's peak memory by about 3 MB. Before, each held
/// every busy row until it sorted them: 177 MB.
#[test]
fn busiest_holds_the_rows_asked_not_every_busy_key() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &[]);
    let (exchange, axis) = ("e".repeat(1000), "a".repeat(1000));
    let limit = json!({"capacity": 10, "refill_per_sec": 0.001});
    let mut filler = server.connect();
    for round in 0..20 {
        let mut frames = Vec::new();
        for i in 0..1000 {
            let k =
                json!({"exchange": exchange, "credential": format!("{round}-{i}"), "axis": axis});
            let cost = f64::from(1 + (round * 1000 + i) % 7);
            frames.extend(serde_json::to_vec(&check(&k, limit.clone(), cost)).unwrap());
            frames.push(b'\n');
        }
        filler.send_raw(&frames);
        for _ in 0..1000 {
            assert_eq!(filler.recv()["result"], "admitted");
        }
    }
    let pid = server.child.id();
    let before = status_kb(pid, "VmHWM");
    let walks: Vec<_> = (0..4)
        .map(|_| {
            let mut client = server.connect();
            thread::spawn(move || client.call(json!({"op": "busiest", "count": 1})))
        })
        .collect();
    for walk in walks {
        let answer = walk.join().unwrap();
        assert_eq!(answer["keys"].as_array().map(Vec::len), Some(1));
        // Checks of cost 7 borrowed most; a token refills in 1,000 s.
        let borrowed = answer["keys"][0]["info"]["borrowed"].as_f64().unwrap();
        assert!(borrowed > 6.9, "busiest borrowed {borrowed}");
    }
    // The kernel counts a thread's resident pages in batches, so a later read can be a few
    // pages lower (128 kB lower in one CI run).
    let grown = status_kb(pid, "VmHWM").saturating_sub(before);
    assert!(
        grown < 30_000,
        "busiest raised the daemon's peak by {grown} kB"
    );
}

/// With `--redis`, a client that adds a byte now and then to a frame it never ends sends
/// no request: it gives its slot back after the idle timeout.
#[test]
fn a_frame_that_never_ends_gives_its_slot_back() {
    let Some(redis) = Redis::start() else { return };
    let socket = common::temp_path("redis-never-ending.sock");
    let extra = ["--idle-timeout-ms", "500", "--max-connections", "1"];
    let _daemon = socket_daemon(&redis, &socket, &extra);
    let slow =
        common::never_ending_frame(std::os::unix::net::UnixStream::connect(&socket).unwrap());
    // Well before the never-ending frame gives up (10 s).
    assert!(
        common::served_within(&socket, Duration::from_secs(5)),
        "no new client served while the never-ending frame goes on"
    );
    assert!(
        slow.join().unwrap(),
        "the never-ending frame's connection stayed open"
    );
}

#[test]
fn redis_down_at_start_or_silent_gives_errors_not_hangs() {
    let Some(redis) = Redis::start() else { return };
    // Nothing listens on this port until later.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("redis://127.0.0.1:{port}");
    let server = Server::tcp(&["--redis", &url, "--redis-timeout-ms", "300"]);
    let mut t = server.connect();
    assert_eq!(t.call(json!({"op": "hello"}))["ok"], true);
    let k = key("x", None);
    let answer = t.call(check(&k, json!({"requests": 5}), 1.0));
    assert_eq!(answer["error"]["type"], "unavailable", "{answer}");
    // The error names where Redis is, so that an app with several limiters can tell.
    let message = answer["error"]["message"].as_str().unwrap();
    assert!(
        message.starts_with(&format!("redis at 127.0.0.1:{port}: ")),
        "{message}"
    );
    let _late = Redis::on_port(port);
    assert_eq!(
        t.call(check(&k, json!({"requests": 5}), 1.0))["result"],
        "admitted"
    );
    drop(redis);

    // A server that accepts but never answers: the timeout answers instead.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("redis://{}", silent.local_addr().unwrap());
    let server = Server::tcp(&["--redis", &url, "--redis-timeout-ms", "200"]);
    let mut t = server.connect();
    let started = Instant::now();
    let answer = t.call(check(&k, json!({"requests": 5}), 1.0));
    assert_eq!(answer["error"]["type"], "unavailable", "{answer}");
    assert!(started.elapsed() < Duration::from_secs(5));
    let within = format!(
        "redis at {} did not answer within 200 ms",
        silent.local_addr().unwrap()
    );
    assert_eq!(answer["error"]["message"], within.as_str());
    drop(silent);
}

/// A connection to one Redis server that goes silent while Redis stays healthy (new
/// connections are answered) is replaced: calls work again within a few timeouts.
#[test]
fn a_silent_connection_to_a_healthy_redis_is_opened_again() {
    let Some(redis) = Redis::start() else { return };
    let proxy = SwallowingProxy::to(redis.port);
    let url = format!("redis://{}", proxy.address);
    let server = Server::tcp(&["--redis", &url, "--redis-timeout-ms", "300"]);
    let mut t = server.connect();
    let limit = json!({"capacity": 1e6, "refill_per_sec": 1e6});
    let k = key("silent", None);
    assert_eq!(t.call(check(&k, limit.clone(), 1.0))["result"], "admitted");
    proxy.swallow_open_connections();
    let answer = t.call(check(&k, limit.clone(), 1.0));
    assert_eq!(answer["error"]["type"], "unavailable", "{answer}");
    let started = Instant::now();
    eventually("a check admitted again", || {
        t.call(check(&k, limit.clone(), 1.0))["result"] == "admitted"
    });
    eprintln!("answered again after {:?}", started.elapsed());
}

/// A reply cut in the middle of its frame (the connection closed there) reads as a parse
/// error: the call is sent again on a new connection, which finds the answers of its run,
/// so a check paid is answered, never told `unavailable`; so is a `record`.
#[test]
fn a_reply_cut_mid_frame_is_read_again_never_paid_unanswered() {
    let Some(redis) = Redis::start() else { return };
    let proxy = CuttingProxy::to(redis.port);
    let url = format!("redis://{}", proxy.address);
    let server = Server::tcp(&["--redis", &url, "--redis-timeout-ms", "1000"]);
    let mut t = server.connect();
    let limit = json!({"capacity": 100, "refill_per_sec": 0.001});
    let k = key("cut", None);
    assert_eq!(t.call(check(&k, limit.clone(), 1.0))["result"], "admitted");
    for (round, request) in [
        check(&k, limit.clone(), 1.0),
        json!({"op": "record", "key": k, "cost": 1}),
    ]
    .into_iter()
    .enumerate()
    {
        proxy.arm();
        let answer = t.call(request);
        assert_eq!(proxy.cuts(), round as u64 + 1, "no reply was cut");
        assert_eq!(answer["ok"], true, "{answer}");
        assert!((borrowed(&mut t, &k) - (round as f64 + 2.0)).abs() < 0.01);
    }
}

/// A Redis that starts asking for a password: the error says so, not only what Redis
/// answers an unauthenticated script call ("Protocol error: unauthenticated multibulk
/// length"), and names no password.
#[test]
fn a_redis_that_asks_for_a_password_is_named_as_such() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &["--redis-timeout-ms", "1000"]);
    let mut t = server.connect();
    let limit = json!({"requests": 5});
    let k = key("auth", None);
    assert_eq!(t.call(check(&k, limit.clone(), 1.0))["result"], "admitted");
    let mut admin = redis.connection().unwrap();
    require_password(&mut admin, "sesame");
    let _: () = ::redis::cmd("CLIENT")
        .arg("KILL")
        .arg("SKIPME")
        .arg("yes")
        .query(&mut admin)
        .unwrap();
    let mut message = String::new();
    eventually("an error that names the password", || {
        let answer = t.call(check(&k, limit.clone(), 1.0));
        message = answer["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        message.contains("asks for a password")
    });
    assert!(
        message.ends_with("--redis-password-file or BOURSE_REDIS_PASSWORD"),
        "{message}"
    );
    assert!(!message.contains("sesame"), "{message}");
    require_password(&mut admin, "");
}

/// A Redis that changes its password and drops the daemon's connection: the daemon's
/// reconnection is refused, and its calls are answered `unavailable` saying so; once the
/// password is put back, it serves again. Before, the refused reconnection was kept (the
/// `redis` crate connects again only after an I/O error) and every call was refused for
/// good.
#[test]
fn a_daemon_refused_its_password_serves_again_once_redis_takes_it() {
    let Some(redis) = Redis::start() else { return };
    let mut admin = redis.connection().unwrap();
    require_password(&mut admin, "sesame");
    let password_file = common::temp_path("changed-password");
    std::fs::write(&password_file, "sesame").unwrap();
    let url = redis.url();
    let server = Server::tcp(&[
        "--redis",
        &url,
        "--redis-password-file",
        password_file.to_str().unwrap(),
        "--redis-timeout-ms",
        "300",
    ]);
    std::fs::remove_file(&password_file).unwrap();
    let mut t = server.connect();
    let (k, limit) = (key("repass", None), json!({"requests": 1000}));
    assert_eq!(t.call(check(&k, limit.clone(), 1.0))["result"], "admitted");
    require_password(&mut admin, "another");
    let _: () = ::redis::cmd("CLIENT")
        .arg(&["KILL", "SKIPME", "yes"])
        .query(&mut admin)
        .unwrap();
    eventually("a call refused for its password", || {
        let answer = t.call(check(&k, limit.clone(), 1.0));
        let message = answer["error"]["message"].as_str().unwrap_or_default();
        message.contains("it refused the password given")
    });
    require_password(&mut admin, "sesame");
    eventually("the daemon serves again", || {
        t.call(check(&k, limit.clone(), 1.0))["result"] == "admitted"
    });
}

/// Another server at the Redis address (HTTP here): the error says so, and where.
#[test]
fn another_server_at_the_redis_address_is_named_as_such() {
    let http = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = http.local_addr().unwrap();
    thread::spawn(move || {
        for mut stream in http.incoming().flatten() {
            let mut request = [0u8; 256];
            let _ = stream.read(&mut request);
            let _ = stream.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
        }
    });
    let url = format!("redis://{address}");
    let server = Server::tcp(&["--redis", &url, "--redis-timeout-ms", "2000"]);
    let answer = server
        .connect()
        .call(check(&key("x", None), json!({"requests": 5}), 1.0));
    assert_eq!(answer["error"]["type"], "unavailable", "{answer}");
    let message = answer["error"]["message"].as_str().unwrap();
    assert!(
        message.starts_with(&format!(
            "redis at {address}: its answer is not Redis's protocol"
        )),
        "{message}"
    );
    assert!(
        message.ends_with("is a Redis server listening there?"),
        "{message}"
    );
}

#[test]
fn bad_redis_options_are_refused_at_start() {
    for args in [
        &["--stdio", "--redis", "http://nowhere"][..],
        &[
            "--stdio",
            "--redis",
            "redis://127.0.0.1:1",
            "--redis-prefix",
            "a*b",
        ],
    ] {
        let status = Command::new(common::DAEMON)
            .args(args)
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap();
        assert_eq!(status.code(), Some(2), "{args:?}");
    }
}

/// Has `admin`'s server ask for `password` from its next connection on ("": for none);
/// `admin` itself stays authenticated.
fn require_password(admin: &mut ::redis::Connection, password: &str) {
    let _: () = ::redis::cmd("CONFIG")
        .arg(&["SET", "requirepass", password])
        .query(admin)
        .unwrap();
}

/// Runs a daemon with `args` (and `env`) that must refuse to start: its stderr.
fn refused_start(args: &[&str], env: &[(&str, &str)]) -> String {
    let mut daemon = Command::new(common::DAEMON)
        .args(args)
        .env("BOURSE_DAEMON_SECRET", common::SECRET)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = common::wait_exit(&mut daemon);
    let mut stderr = String::new();
    daemon
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert_eq!(status.code(), Some(2), "{args:?}: {stderr}");
    stderr
}

#[test]
fn a_single_redis_given_as_cluster_seeds_is_refused_at_start() {
    let Some(redis) = Redis::start() else { return };
    let closed = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let unreachable = format!("redis://{closed}");
    // Whether or not another seed answers first.
    for seeds in [vec![redis.url()], vec![unreachable, redis.url()]] {
        let mut args = vec!["--listen", "127.0.0.1:0"];
        for seed in &seeds {
            args.extend(["--redis-cluster", seed]);
        }
        let stderr = refused_start(&args, &[]);
        assert!(
            stderr.contains(&format!(
                "redis at 127.0.0.1:{}: it is not a Redis Cluster (cluster support disabled)",
                redis.port
            )),
            "{stderr}"
        );
        assert!(stderr.contains("give one URL"), "{stderr}");
    }
}

/// A Redis that refuses the daemon (its password, or a database it does not have) refuses
/// the daemon's start, rather than every request after it; a Redis that does not answer
/// does not.
#[test]
fn a_redis_that_refuses_the_daemon_refuses_its_start() {
    let Some(redis) = Redis::start() else { return };
    let (url, on_db_16) = (redis.url(), format!("{}/16", redis.url()));
    fn with(url: &str) -> [&str; 4] {
        ["--listen", "127.0.0.1:0", "--redis", url]
    }
    let stderr = refused_start(&with(&url), &[("BOURSE_REDIS_PASSWORD", "wrong-pw")]);
    assert!(stderr.contains("it refused the password given"), "{stderr}");
    assert!(!stderr.contains("wrong-pw"), "{stderr}");
    let stderr = refused_start(&with(&on_db_16), &[]);
    assert!(stderr.contains("it has no database 16"), "{stderr}");
    let mut admin = redis.connection().unwrap();
    // Evicted, a bucket would start full again (volatile-lru: 100 admitted where 61 may).
    let config_set = |admin: &mut ::redis::Connection, name: &str, value: &str| {
        let _: () = ::redis::cmd("CONFIG")
            .arg(&["SET", name, value])
            .query(admin)
            .unwrap();
    };
    config_set(&mut admin, "maxmemory", "100mb");
    for policy in ["volatile-lru", "allkeys-lru", "volatile-ttl"] {
        config_set(&mut admin, "maxmemory-policy", policy);
        let stderr = refused_start(&with(&url), &[]);
        assert!(stderr.contains("it may evict keys when full"), "{stderr}");
        assert!(stderr.contains(policy), "{stderr}");
    }
    config_set(&mut admin, "maxmemory-policy", "noeviction");
    Server::tcp(&["--redis", &url]).connect();
    config_set(&mut admin, "maxmemory-policy", "allkeys-lru");
    config_set(&mut admin, "maxmemory", "0");
    Server::tcp(&["--redis", &url]).connect();
    let _: () = ::redis::cmd("ACL")
        .arg(&[
            "SETUSER",
            "noscript",
            "on",
            ">pw",
            "~*",
            "+@all",
            "-@scripting",
        ])
        .query(&mut admin)
        .unwrap();
    let as_noscript = format!("redis://noscript@127.0.0.1:{}", redis.port);
    let stderr = refused_start(&with(&as_noscript), &[("BOURSE_REDIS_PASSWORD", "pw")]);
    assert!(
        stderr.contains("it does not let this user run scripts"),
        "{stderr}"
    );
    // A user that may call functions, not run scripts: the daemon runs its checks as those.
    let _: () = ::redis::cmd("ACL")
        .arg(&["SETUSER", "fcallonly", "on", ">pw", "~*", "+@all"])
        .arg(&["-eval", "-evalsha", "-eval_ro", "-evalsha_ro"])
        .query(&mut admin)
        .unwrap();
    if major_version(&redis) >= 7 {
        let password_file = common::temp_path("fcall-only-password");
        std::fs::write(&password_file, "pw").unwrap();
        let as_fcall_only = format!("redis://fcallonly@127.0.0.1:{}", redis.port);
        let password_file = password_file.to_str().unwrap();
        let server = Server::tcp(&[
            "--redis",
            &as_fcall_only,
            "--redis-password-file",
            password_file,
        ]);
        let mut t = server.connect();
        let k = key("fcall-only", None);
        assert_eq!(
            t.call(check(&k, json!({"requests": 5}), 1.0))["result"],
            "admitted"
        );
        std::fs::remove_file(password_file).unwrap();
    }
    require_password(&mut admin, "sesame");
    let stderr = refused_start(&with(&url), &[]);
    assert!(
        stderr.contains(&format!(
            "--redis: redis at 127.0.0.1:{}: it asks for a password",
            redis.port
        )),
        "{stderr}"
    );
    let stderr = refused_start(&with(&url), &[("BOURSE_REDIS_PASSWORD", "wrong-pw")]);
    assert!(stderr.contains("it refused the password given"), "{stderr}");
    assert!(
        !stderr.contains("wrong-pw") && !stderr.contains("sesame"),
        "{stderr}"
    );
    require_password(&mut admin, "");
    // Stopped: the daemon starts, and serves once Redis is back.
    common::signal(&redis.child, "STOP");
    let server = daemon(&redis, &["--redis-timeout-ms", "300"]);
    common::signal(&redis.child, "CONT");
    let mut t = server.connect();
    let k = key("start", None);
    eventually("a check admitted once Redis answers", || {
        t.call(check(&k, json!({"requests": 5}), 1.0))["result"] == "admitted"
    });
}

/// A small deterministic generator (xorshift64*) for the differential test.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n
    }

    fn pick<T: Clone>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())].clone()
    }
}

/// A random request over a few keys, limits and owners. Refill rates are so slow (at most
/// 0.002 tokens/s) that the few milliseconds between the two daemons' clocks change no
/// answer but the delays, by about that much.
fn random_request(rng: &mut Rng) -> Value {
    let keys = [
        json!({"exchange": "binance", "credential": "k1"}),
        json!({"exchange": "binance", "credential": "k1", "axis": "order"}),
        json!({"exchange": "binance", "credential": null, "axis": "ip"}),
        json!({"exchange": "okx", "credential": "k1"}),
        json!({"exchange": "okx", "credential": ""}),
    ];
    let limits = [
        json!({"capacity": 1, "refill_per_sec": 0.001}),
        json!({"capacity": 2, "refill_per_sec": 0.001}),
        json!({"capacity": 5, "refill_per_sec": 0.002}),
        json!({"requests": 5, "period": 2_500_000}),
        Value::Null,
    ];
    let costs = [0.0, 0.5, 1.0, 1.0, 2.0, 3.0, 7.0];
    let owners = ["a", "b", "c"];
    let waits = [None, Some(100_000u64), Some(100_000_000)];
    let check = |rng: &mut Rng| json!({"key": rng.pick(&keys), "limit": rng.pick(&limits), "cost": rng.pick(&costs)});
    let mut request = match rng.below(20) {
        0..=6 => {
            let mut request = check(rng);
            request["op"] = json!("check");
            request
        }
        7..=10 => {
            let checks: Vec<Value> = (0..1 + rng.below(3)).map(|_| check(rng)).collect();
            json!({"op": "check_many", "checks": checks})
        }
        11 => json!({"op": "record", "key": rng.pick(&keys), "cost": rng.pick(&costs)}),
        12 => json!({"op": "sync", "key": rng.pick(&keys),
                     "allowance": rng.pick(&[-1.0, 0.0, 1.0, 3.0]),
                     "window_left_ms": rng.pick(&[0, 500_000])}),
        13 | 14 => json!({"op": "get_cost", "key": rng.pick(&keys)}),
        15 | 16 => json!({"op": "inspect", "key": rng.pick(&keys)}),
        17 => {
            let key = rng.pick(&keys);
            let target = match rng.below(3) {
                0 => json!({"exchange": key["exchange"]}),
                1 => json!({"exchange": key["exchange"], "credential": key["credential"]}),
                _ => json!({"exchange": key["exchange"], "credential": key["credential"],
                            "axis": key.get("axis").cloned().unwrap_or(json!("request"))}),
            };
            json!({"op": "pause", "target": target, "ms": rng.pick(&[0, 50_000_000])})
        }
        18 => json!({"op": "reset", "key": rng.pick(&keys)}),
        _ => json!({"op": "reset_exchange", "exchange": rng.pick(&["binance", "okx"])}),
    };
    if matches!(request["op"].as_str(), Some("check" | "check_many")) {
        request["owner"] = json!(rng.pick(&owners));
        if let Some(wait) = rng.pick(&waits) {
            request["max_wait_ms"] = json!(wait);
        }
    }
    request
}

/// Equal but for numbers, which may differ by `tolerance` (milliseconds fields by 500),
/// and error messages (the stores may name conflicting limits in another order).
fn same_answer(memory: &Value, redis: &Value, field: &str) -> bool {
    match (memory, redis) {
        (Value::Number(a), Value::Number(b)) => {
            let tolerance = if field.ends_with("ms") { 500.0 } else { 0.01 };
            (a.as_f64().unwrap() - b.as_f64().unwrap()).abs() <= tolerance
        }
        (Value::Object(a), Value::Object(b)) => {
            a.len() == b.len()
                && a.iter().all(|(name, value)| {
                    name == "message" || b.get(name).is_some_and(|v| same_answer(value, v, name))
                })
        }
        (Value::Array(a), Value::Array(b)) => {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| same_answer(x, y, field))
        }
        _ => memory == redis,
    }
}

/// The Lua script against the core: the same random requests to an in-memory daemon and to
/// a Redis daemon get the same answers and leave the same counters.
#[test]
fn the_script_answers_as_the_core_does() {
    let Some(redis) = Redis::start() else { return };
    let memory = Server::tcp(&[]);
    let shared = daemon(&redis, &[]);
    let (mut m, mut r) = (memory.connect(), shared.connect());
    for seed in [1u64, 2, 3] {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ seed);
        for step in 0..300 {
            let request = random_request(&mut rng);
            let (a, b) = (m.call(request.clone()), r.call(request.clone()));
            assert!(
                same_answer(&a, &b, ""),
                "seed {seed} step {step}: {request}\n  memory: {a}\n  redis:  {b}"
            );
        }
        for t in [&mut m as &mut dyn Transport, &mut r] {
            t.call(json!({"op": "reset_all"}));
        }
    }
    let stats = |t: &mut dyn Transport| t.call(json!({"op": "stats"}))["stats"].clone();
    let (a, b) = (stats(&mut m), stats(&mut r));
    assert_eq!(a, b, "counters differ");
}

/// A signal to `pid` with the system's `kill` command.
fn kill(signal: &str, pid: u32) {
    let status = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()
        .expect("run kill");
    assert!(status.success());
}

/// Requests sent without waiting, answers read later.
trait Pipelined {
    fn send_request(&mut self, request: &Value);
    fn recv_answer(&mut self) -> Value;
}

impl Pipelined for StdioDaemon {
    fn send_request(&mut self, request: &Value) {
        self.send_frame(&serde_json::to_vec(request).unwrap());
    }
    fn recv_answer(&mut self) -> Value {
        self.recv_frame().expect("an answer")
    }
}

impl<S: common::Stream> Pipelined for LineClient<S> {
    fn send_request(&mut self, request: &Value) {
        self.send(request);
    }
    fn recv_answer(&mut self) -> Value {
        self.recv()
    }
}

/// Sends `n` checks of one key at once on `send`, then collects their answers with the time
/// each took, by id.
fn burst(n: u64, k: &Value, limit: &Value, t: &mut impl Pipelined) -> Vec<(Value, Duration)> {
    let started = Instant::now();
    for id in 0..n {
        let mut request = check(k, limit.clone(), 1.0);
        request["id"] = json!(id);
        t.send_request(&request);
    }
    let mut answers: Vec<(Value, Duration)> = (0..n)
        .map(|_| (t.recv_answer(), started.elapsed()))
        .collect();
    answers.sort_by_key(|(answer, _)| answer["id"].as_u64());
    // Each request answered once, under its own id.
    let ids: Vec<Option<u64>> = answers.iter().map(|(a, _)| a["id"].as_u64()).collect();
    assert_eq!(ids, (0..n).map(Some).collect::<Vec<_>>());
    answers
}

/// What befalls a call the daemon sent to a stopped Redis.
enum WhileStopped {
    /// Nothing: it waits in Redis until Redis resumes.
    Waiting,
    /// The daemon's connections to Redis are killed behind it: Redis runs it when it
    /// resumes, and its answer is lost.
    AnswerLost,
}

/// Sends `requests` at once, each with its index as id, while Redis is stopped, so that
/// they reach Redis together (where checks may share one script call); lets `then` befall
/// the daemon's call, resumes Redis, and returns the answers in the order they came.
fn pipelined_while_stopped(
    redis: &Redis,
    t: &mut impl Pipelined,
    requests: impl Iterator<Item = Value>,
    then: WhileStopped,
) -> Vec<Value> {
    // Connected (and answered) before the stop, so that its command is queued after the
    // daemon's call.
    let killer = matches!(then, WhileStopped::AnswerLost).then(|| {
        let mut killer = TcpStream::connect(("127.0.0.1", redis.port)).unwrap();
        killer.write_all(b"PING\r\n").unwrap();
        let _ = killer.read(&mut [0u8; 64]).unwrap();
        killer
    });
    kill("STOP", redis.child.id());
    let mut n = 0;
    for (id, mut request) in requests.enumerate() {
        request["id"] = json!(id);
        t.send_request(&request);
        n += 1;
    }
    match killer {
        None => sleep_ms(200),
        Some(mut killer) => {
            // The daemon's call is queued in Redis first, the kill of its connection after it.
            sleep_ms(300);
            killer
                .write_all(b"CLIENT KILL TYPE normal SKIPME yes\r\n")
                .unwrap();
            sleep_ms(100);
        }
    }
    kill("CONT", redis.child.id());
    (0..n).map(|_| t.recv_answer()).collect()
}

/// With Redis stopped (SIGSTOP) under load, every caller is told `unavailable` within the
/// Redis timeout and a small slack, not one after another; once Redis resumes it runs the
/// scripts it had received, and none of them pays: they refuse work past their deadline.
#[test]
fn a_stopped_redis_answers_unavailable_in_time_and_refused_calls_never_pay() {
    let Some(redis) = Redis::start() else { return };
    let url = redis.url();
    let timeout_ms = 500;
    let timeout = timeout_ms.to_string();
    let args = [
        "--redis",
        url.as_str(),
        "--redis-timeout-ms",
        timeout.as_str(),
    ];
    let limit = json!({"capacity": 20, "refill_per_sec": 0.001});
    let mut stdio = StdioDaemon::start(&args);
    let server = Server::tcp(&args);
    let mut tcp = server.connect();
    let (stdio_key, tcp_key) = (key("f", Some("stdio")), key("f", Some("tcp")));
    assert_eq!(
        stdio.call(check(&stdio_key, limit.clone(), 1.0))["result"],
        "admitted"
    );
    assert_eq!(
        tcp.call(check(&tcp_key, limit.clone(), 1.0))["result"],
        "admitted"
    );
    kill("STOP", redis.child.id());
    let stdio_answers = burst(20, &stdio_key, &limit, &mut stdio);
    let tcp_answers = burst(20, &tcp_key, &limit, &mut tcp);
    kill("CONT", redis.child.id());
    // Generous for a loaded 2-core machine; before, answers came one timeout after another
    // (20 × 500 ms), or all after the port's own 5 s.
    let slack = Duration::from_millis(1500);
    let within = Duration::from_millis(timeout_ms) + slack;
    for (name, answers) in [("stdio", &stdio_answers), ("tcp", &tcp_answers)] {
        let slowest = answers.iter().map(|(_, took)| *took).max().unwrap();
        eprintln!("{name}: 20 callers with Redis stopped, slowest answer after {slowest:?}");
        unavailable_within(name, answers, within);
    }
    // Redis ran what it had received; nothing of it was paid.
    sleep_ms(300);
    let transports: [(&str, &mut dyn Transport, &Value); 2] = [
        ("stdio", &mut stdio, &stdio_key),
        ("tcp", &mut tcp, &tcp_key),
    ];
    for (name, t, k) in transports {
        let info = t.call(json!({"op": "inspect", "key": k}));
        let tokens = info["info"]["tokens"].as_f64().unwrap();
        eprintln!("{name}: tokens after SIGCONT {tokens} (19 expected)");
        assert!(
            tokens > 18.99,
            "{name}: calls told unavailable paid: {info}"
        );
    }
}

/// A relay to a Redis port that holds Redis's answers while told to: Redis runs a call,
/// and its answer comes late, as when Redis is stopped between running a call and writing
/// its answer. It may hold the requests too: Redis runs them late, as when it is stopped
/// or still busy with what piled up meanwhile. A connection opened while either way is
/// held is not held that way. What it holds of a connection it cut still goes on.
struct AnswerHold {
    port: u16,
    held: Arc<AtomicBool>,
    requests_held: Arc<AtomicBool>,
    clients: Arc<Mutex<Vec<TcpStream>>>,
}

impl AnswerHold {
    fn start(redis_port: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a free port");
        let port = listener.local_addr().unwrap().port();
        let (held, requests_held): (Arc<AtomicBool>, Arc<AtomicBool>) = Default::default();
        let (answers_of_relay, requests_of_relay) = (Arc::clone(&held), Arc::clone(&requests_held));
        let clients = Arc::new(Mutex::new(Vec::new()));
        let clients_of_relay = clients.clone();
        thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                clients_of_relay
                    .lock()
                    .unwrap()
                    .push(client.try_clone().unwrap());
                let redis = TcpStream::connect(("127.0.0.1", redis_port)).unwrap();
                let (requests, to_redis) =
                    (client.try_clone().unwrap(), redis.try_clone().unwrap());
                pass_on(requests, to_redis, Arc::clone(&requests_of_relay));
                pass_on(redis, client, Arc::clone(&answers_of_relay));
            }
        });
        Self {
            port,
            held,
            requests_held,
            clients,
        }
    }

    /// A daemon on Redis through this relay, with a Redis timeout of `timeout_ms`.
    fn daemon(&self, timeout_ms: u64) -> Server {
        let url = format!("redis://127.0.0.1:{}", self.port);
        let timeout_ms = timeout_ms.to_string();
        Server::tcp(&["--redis", &url, "--redis-timeout-ms", &timeout_ms])
    }

    fn hold(&self, held: bool) {
        self.held.store(held, Ordering::SeqCst);
    }

    fn hold_requests(&self, held: bool) {
        self.requests_held.store(held, Ordering::SeqCst);
    }

    /// Cuts the connections open now: their held answers are lost.
    fn cut(&self) {
        for client in self.clients.lock().unwrap().drain(..) {
            let _ = client.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// A wall clock for `redis-server` that a test sets back: tests/support/clock_shim.c,
/// built with the system's C compiler (the one that links Rust programs) and preloaded.
struct ClockShift {
    library: PathBuf,
    offset: PathBuf,
}

impl ClockShift {
    fn build() -> Self {
        let library = common::temp_path("clock_shim.so");
        let offset = common::temp_path("clock_offset");
        let source = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/support/clock_shim.c");
        let built = Command::new("cc")
            .args(["-O2", "-shared", "-fPIC", "-o"])
            .arg(&library)
            .arg(source)
            .arg("-ldl")
            .status()
            .expect("run cc");
        assert!(built.success(), "cc failed on {source}");
        std::fs::write(&offset, 0i64.to_ne_bytes()).unwrap();
        Self { library, offset }
    }

    /// Moves Redis's wall clock to `us` µs from the real one. Written in place: Redis maps
    /// the file, and reading it while truncated would kill Redis (`SIGBUS`).
    fn set(&self, us: i64) {
        use std::os::unix::fs::FileExt;
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(&self.offset)
            .unwrap();
        file.write_all_at(&us.to_ne_bytes(), 0).unwrap();
    }
}

impl Drop for ClockShift {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.library);
        let _ = std::fs::remove_file(&self.offset);
    }
}

/// Copies `from` to `to` on a thread of its own, waiting while `held` (unless it was held
/// already when this began).
fn pass_on(mut from: TcpStream, mut to: TcpStream, held: Arc<AtomicBool>) {
    let fresh = held.load(Ordering::SeqCst);
    thread::spawn(move || {
        let mut buffer = vec![0; 65536];
        while let Ok(n @ 1..) = from.read(&mut buffer) {
            while !fresh && held.load(Ordering::SeqCst) {
                sleep_ms(5);
            }
            if to.write_all(&buffer[..n]).is_err() {
                return;
            }
        }
    });
}

/// Redis runs checks, but their answers come after the callers' timeout (here a relay holds
/// them; in production Redis was stopped before writing them): the callers are told
/// `unavailable`, and once the answers come, what the checks paid is given back: an
/// admitted check's cost on each of its buckets, and a booking (docs/CONTRACT.md,
/// "Stores": a call answered `unavailable` never pays). Before, each stayed paid.
#[test]
fn checks_whose_answers_came_after_their_callers_were_told_unavailable_pay_nothing() {
    let Some(redis) = Redis::start() else { return };
    let relay = AnswerHold::start(redis.port);
    let server = relay.daemon(500);
    let mut t = server.connect();
    let slow = json!({"capacity": 10, "refill_per_sec": 0.001});
    let (a, b, ip) = (
        key("kraken", Some("a")),
        key("kraken", Some("b")),
        json!({"exchange": "kraken", "credential": null, "axis": "ip"}),
    );
    let many = |cost: f64| {
        json!({"op": "check_many", "checks": [
            {"key": b, "limit": slow, "cost": cost}, {"key": ip, "limit": slow, "cost": 1},
        ]})
    };
    // A bucket of two tokens, one a second, emptied: a waiter of cost 1 books about 1 s.
    let (w, refilling) = (
        key("kraken", Some("w")),
        json!({"capacity": 2, "refill_per_sec": 1}),
    );
    let waiter = |owner: u64, cost: f64| json!({"op": "check", "key": w, "limit": refilling, "owner": owner, "cost": cost, "max_wait_ms": 60_000});
    assert_eq!(t.call(check(&a, slow.clone(), 1.0))["result"], "admitted");
    assert_eq!(t.call(many(1.0))["result"], "admitted");
    assert_eq!(t.call(waiter(1, 2.0))["result"], "admitted");

    relay.hold(true);
    let requests = [check(&a, slow.clone(), 2.0), many(3.0), waiter(2, 1.0)];
    for (id, mut request) in requests.into_iter().enumerate() {
        request["id"] = json!(id);
        t.send_request(&request);
    }
    for _ in 0..3 {
        let answer = t.recv_answer();
        assert_eq!(answer["error"]["type"], "unavailable", "{answer}");
    }
    relay.hold(false);

    let paid = |t: &mut LineClient<_>| {
        let bookings = t.call(json!({"op": "inspect", "key": w}))["info"]["bookings"].clone();
        [borrowed(t, &a), borrowed(t, &b), borrowed(t, &ip)]
            .iter()
            .all(|borrowed| (borrowed - 1.0).abs() < 0.01)
            && bookings == 0
    };
    eventually("what the late checks paid is given back", || paid(&mut t));
    // The waiter's bucket took its booking back: a new waiter books no later than the
    // one whose caller was told unavailable would have.
    let booked = t.call(waiter(3, 1.0));
    assert_eq!(booked["result"], "booked", "{booked}");
    assert!(ms(&booked) <= 1000, "{booked}");
}

/// A daemon (timeout 1 s) on `redis` through a relay, whose check of `cost` on `k` (of
/// `capacity` tokens refilling 0.001/s, 1 paid before) Redis ran while the relay held its
/// answer: its caller was told `unavailable`, and the relay still holds the answer.
fn late_check(
    redis: &Redis,
    k: &Value,
    capacity: f64,
    cost: f64,
) -> (AnswerHold, Server, LineClient<TcpStream>) {
    let relay = AnswerHold::start(redis.port);
    let server = relay.daemon(1000);
    let mut t = server.connect();
    let slow = json!({"capacity": capacity, "refill_per_sec": 0.001});
    assert_eq!(t.call(check(k, slow.clone(), 1.0))["result"], "admitted");
    relay.hold(true);
    assert_eq!(t.call(check(k, slow, cost))["error"]["type"], "unavailable");
    (relay, server, t)
}

/// Whether `k` has `expected` tokens borrowed; false while the daemon answers an error (its
/// connection to Redis, cut by the test, being opened again).
fn borrows(t: &mut impl common::Transport, k: &Value, expected: f64) -> bool {
    t.call(json!({"op": "get_cost", "key": k}))["borrowed"]
        .as_f64()
        .is_some_and(|borrowed| (borrowed - expected).abs() < 0.01)
}

/// The `refunds` call of late checks may itself run late: Redis still working through what
/// piled up while it was stopped, or stopped again (here the relay holds it). It gives back
/// whenever it runs; before, it carried a deadline as a caller's call does, was refused
/// past it, and the checks stayed paid.
#[test]
fn a_refund_that_reaches_redis_late_still_gives_back() {
    let Some(redis) = Redis::start() else { return };
    let k = key("late-refund", Some("k"));
    let (relay, _server, mut t) = late_check(&redis, &k, 10.0, 2.0);
    // The late answer comes; the refund it sends reaches Redis past any deadline it had.
    relay.hold_requests(true);
    relay.hold(false);
    sleep_ms(1500);
    relay.hold_requests(false);
    eventually("the late check's cost is given back", || {
        borrows(&mut t, &k, 1.0)
    });
}

/// A late check's bucket reset and made anew while the Redis clock was set back holds a
/// definition time `n` before the check's payment: by its times it looks like the bucket
/// the check paid, and the refund must give it nothing. A refund names each bucket it gives
/// back to by the `n` the check paid under, and gives back only to that one. Two cases:
/// the clock still set back when the refund runs, and set forward again before it. Before,
/// the new bucket got the check's 50 tokens in both; with only a guard against a clock
/// behind the daemon's last view of it, in the second.
#[test]
fn a_refund_after_the_redis_clock_was_set_back_gives_nothing_to_a_bucket_made_anew() {
    let clock = ClockShift::build();
    let Some(redis) = Redis::with_clock(&clock) else {
        return;
    };
    let other = daemon(&redis, &[]);
    let mut direct = other.connect();
    let slow = json!({"capacity": 100, "refill_per_sec": 0.001});
    for (case, set_forward) in [("behind", false), ("forward-again", true)] {
        clock.set(0);
        let k = key("clock", Some(case));
        let (relay, _server, _t) = late_check(&redis, &k, 100.0, 50.0);
        clock.set(-3_000_000);
        let reset = direct.call(json!({"op": "reset", "key": k}));
        assert_eq!(reset["ok"], true, "{reset}");
        let made_anew = direct.call(check(&k, slow.clone(), 45.0));
        assert_eq!(made_anew["result"], "admitted");
        // Past the late check's payment again, the new bucket pays once more.
        match set_forward {
            true => clock.set(0),
            false => sleep_ms(3500),
        }
        let paid_again = direct.call(check(&k, slow.clone(), 45.0));
        assert_eq!(paid_again["result"], "admitted");
        relay.hold(false);
        sleep_ms(1000);
        let left = borrowed(&mut direct, &k);
        assert!((left - 90.0).abs() < 0.1, "{case}: {left} borrowed, not 90");
    }
}

/// A `refunds` call sent again on a new connection, its first copy still on its way:
/// whichever runs second finds the first's run marker, however late it runs (the marker
/// lives as long as the call may run), and gives back nothing more. Here the relay holds
/// the first copy, then cuts its connection; the daemon sends the call again at once.
#[test]
fn a_refund_sent_twice_gives_back_once() {
    let Some(redis) = Redis::start() else { return };
    let k = key("twice", Some("k"));
    let (relay, _server, mut t) = late_check(&redis, &k, 10.0, 2.0);
    relay.hold_requests(true);
    relay.hold(false);
    sleep_ms(300);
    relay.cut();
    eventually("the copy sent again gives the cost back", || {
        borrows(&mut t, &k, 1.0)
    });
    // Past twice the timeout, the first copy reaches Redis.
    sleep_ms(2500);
    relay.hold_requests(false);
    sleep_ms(500);
    let left = borrowed(&mut t, &k);
    assert!(
        (left - 1.0).abs() < 0.01,
        "given back twice: {left} borrowed"
    );
}

/// What a late check paid is given back only as far as the bucket would hold it had the
/// check not paid: not after the exchange's own count lowered it (a `sync` that took
/// nothing from it, but would have taken what is given back), nor after it was redefined
/// and defined back, nor to a bucket reset and made anew since (it never held that
/// payment), nor to one emptied since by a daemon that found its exchange's state begun
/// again (`--assume-busy-at-start`); in full after a later payment at once, less what accrued since after one
/// later. Another daemon, straight on Redis, acts on the buckets while the answers of the
/// first are held.
#[test]
fn a_late_check_is_given_back_only_what_the_bucket_would_hold_without_it() {
    // Three calls are on their way at most: each case is among the first three of one order.
    late_checks_given_back([0, 1, 2, 3, 4]);
    late_checks_given_back([3, 4, 0, 1, 2]);
}

/// The cases of the test above, their checks sent in `order` (indices of `cases`).
fn late_checks_given_back(order: [usize; 5]) {
    let Some(redis) = Redis::start() else { return };
    let relay = AnswerHold::start(redis.port);
    let url = format!("redis://127.0.0.1:{}", relay.port);
    // The first three calls hold the turns for the timeout; the other two are sent as they
    // end, past their own deadline (three quarters of the timeout after they were sent), so
    // the first three must be seen run within a quarter of it: 1.5 s on a loaded machine.
    let server = Server::tcp(&["--redis", url.as_str(), "--redis-timeout-ms", "6000"]);
    let mut t = server.connect();
    let other = daemon(&redis, &[]);
    let mut direct = other.connect();
    let busy = daemon(&redis, &["--assume-busy-at-start"]);
    // Nothing refills within the test's tolerance of 0.01 token for 100 s.
    let slow = |capacity: u64| json!({"capacity": capacity, "refill_per_sec": 0.0001});
    let (synced, redefined, paid_again, reset, emptied) = (
        key("gate", Some("synced")),
        key("gate", Some("redefined")),
        key("gate", Some("paid-again")),
        key("gate", Some("reset")),
        key("gate", Some("emptied")),
    );
    let cases = [&synced, &redefined, &paid_again, &reset, &emptied];
    let keys = order.map(|i| cases[i]);
    for k in keys {
        assert_eq!(t.call(check(k, slow(10), 1.0))["result"], "admitted");
    }
    relay.hold(true);
    // The daemon takes a connection's requests in no set order: each of the first three is
    // sent once Redis ran the one before (7 tokens left), so that each holds a turn of its
    // own. The other two wait behind them, and do nothing once late.
    for (id, k) in keys.into_iter().enumerate() {
        let mut request = check(k, slow(10), 2.0);
        request["id"] = json!(id);
        t.send_request(&request);
        if id < 3 {
            eventually("Redis runs the held call", || {
                (borrowed(&mut direct, k) - 3.0).abs() < 0.01
            });
        }
    }
    let sync = json!({"op": "sync", "key": synced, "allowance": 7.5, "window_left_ms": 0});
    assert_eq!(direct.call(sync)["taken"], 0.0);
    assert_eq!(
        direct.call(check(&redefined, slow(5), 0.0))["result"],
        "admitted"
    );
    assert_eq!(
        direct.call(check(&redefined, slow(10), 0.0))["result"],
        "admitted"
    );
    assert_eq!(
        direct.call(check(&paid_again, slow(10), 1.0))["result"],
        "admitted"
    );
    assert_eq!(
        direct.call(json!({"op": "reset", "key": reset}))["ok"],
        true
    );
    assert_eq!(
        direct.call(check(&reset, slow(10), 4.0))["result"],
        "admitted"
    );
    // Another node's marker (a failover): for the busy daemon the state begins again.
    let _: () = redis.query(::redis::cmd("SET").arg("bourse:e{4:gate}").arg("1 0ther"));
    let mut busy = busy.connect();
    assert_eq!(
        busy.call(check(&emptied, slow(10), 0.0))["result"],
        "admitted"
    );
    assert!(borrowed(&mut busy, &emptied) > 9.99);
    for _ in 0..5 {
        let answer = t.recv_answer();
        assert_eq!(answer["error"]["type"], "unavailable", "{answer}");
    }
    relay.hold(false);
    eventually("the later payment's bucket gets the cost back", || {
        (borrowed(&mut t, &paid_again) - 2.0).abs() < 0.01
    });
    // Both given their answer to the refund first (one call, in order).
    assert!((borrowed(&mut t, &synced) - 3.0).abs() < 0.01);
    assert!((borrowed(&mut t, &redefined) - 5.0).abs() < 0.01);
    assert!((borrowed(&mut t, &reset) - 4.0).abs() < 0.01);
    assert!(borrowed(&mut t, &emptied) > 9.99);
}

/// A late check's answer lost with its connection: the call, sent again on a fresh one,
/// finds what it ran in its run marker and answers it with the time it ran, not the time
/// it was sent again, so what it paid is judged from then: a bucket reset and made anew
/// since is given nothing back, though it was written after the call was sent again
/// (before, it was given the cost).
#[test]
fn a_late_check_sent_again_is_given_back_as_of_when_it_ran() {
    let Some(redis) = Redis::start() else { return };
    let relay = AnswerHold::start(redis.port);
    let server = relay.daemon(1000);
    let mut t = server.connect();
    let other = daemon(&redis, &[]);
    let mut direct = other.connect();
    let slow = json!({"capacity": 10, "refill_per_sec": 0.001});
    let k = key("again", Some("k"));
    assert_eq!(t.call(check(&k, slow.clone(), 1.0))["result"], "admitted");
    relay.hold(true);
    let mut request = check(&k, slow.clone(), 2.0);
    request["id"] = json!(1);
    t.send_request(&request);
    sleep_ms(100);
    assert_eq!(direct.call(json!({"op": "reset", "key": k}))["ok"], true);
    assert_eq!(
        direct.call(check(&k, slow.clone(), 4.0))["result"],
        "admitted"
    );
    assert_eq!(t.recv_answer()["error"]["type"], "unavailable");
    // Checks of nothing keep writing the bucket, later than the call is sent again.
    let writing = Arc::new(AtomicBool::new(true));
    let traffic = {
        let (writing, mut c, k, slow) = (writing.clone(), other.connect(), k.clone(), slow.clone());
        thread::spawn(move || {
            while writing.load(Ordering::SeqCst) {
                assert_eq!(c.call(check(&k, slow.clone(), 0.0))["result"], "admitted");
            }
        })
    };
    relay.cut();
    sleep_ms(1500);
    writing.store(false, Ordering::SeqCst);
    traffic.join().unwrap();
    let borrowed = borrowed(&mut direct, &k);
    assert!((borrowed - 4.0).abs() < 0.01, "borrowed {borrowed}");
}

/// Redis stopped (SIGSTOP) under a pipelined flood of checks of one bucket, for 15 times the
/// timeout: the bucket ends holding the checks answered `admitted` paid, and no more. Redis
/// had run a few calls whose answers it had not written yet; those answers come after
/// their callers were told `unavailable`, and what they paid is given back. (Where the stop
/// lands is up to the machine: a run may find no such call.)
#[test]
fn a_redis_stopped_under_a_flood_keeps_only_the_admitted_checks_paid() {
    let Some(redis) = Redis::start() else { return };
    let url = redis.url();
    let mut t = StdioDaemon::start(&["--redis", url.as_str(), "--redis-timeout-ms", "200"]);
    let limit = json!({"capacity": 1_000_000, "refill_per_sec": 0.000001});
    let k = key("flood", Some("k"));
    assert_eq!(t.call(check(&k, limit.clone(), 1.0))["result"], "admitted");
    let n = 10_000;
    let frames: Vec<Vec<u8>> = (0..n).map(|id| check_frame(id, &k, &limit)).collect();
    // 100 checks every 2 ms, for about 200 ms: Redis is busy when it is stopped.
    let mut stdin = t.stdin.take().unwrap();
    let sender = thread::spawn(move || {
        for chunk in frames.chunks(100) {
            stdin.write_all(&chunk.concat()).unwrap();
            sleep_ms(2);
        }
        stdin
    });
    sleep_ms(100);
    kill("STOP", redis.child.id());
    sleep_ms(3000);
    kill("CONT", redis.child.id());
    t.stdin = Some(sender.join().unwrap());
    let (mut admitted, mut unavailable) = (0, 0);
    for _ in 0..n {
        match t.recv_answer() {
            answer if answer["result"] == "admitted" => admitted += 1,
            answer if answer["error"]["type"] == "unavailable" => {
                if unavailable == 0 {
                    eprintln!("{answer}");
                }
                unavailable += 1
            }
            answer => panic!("{answer}"),
        }
    }
    // So slow a refill that what a late check is given back less (what refilled since it
    // paid) is far below a token.
    let mut paid = || borrowed(&mut t, &k) - 1.0;
    sleep_ms(300);
    let first = paid();
    sleep_ms(300);
    eprintln!(
        "flood of {n}, Redis stopped 3 s: {admitted} admitted, {unavailable} unavailable, \
         {first:.3} paid"
    );
    assert_eq!(admitted + unavailable, n);
    assert!(
        (paid() - admitted as f64).abs() < 0.5,
        "{admitted} admitted, {first} paid"
    );
}

/// A port's daemon holds at most 256 requests waiting on a stopped Redis, as a server's
/// connection does: it reads no more, so a client writing without end finds stdin full
/// (rather than the daemon's memory growing with it), and every request is answered once
/// Redis resumes.
#[test]
fn a_port_reads_no_more_while_256_requests_wait_on_redis() {
    let Some(redis) = Redis::start() else { return };
    let url = redis.url();
    let mut t = StdioDaemon::start(&["--redis", url.as_str(), "--redis-timeout-ms", "60000"]);
    assert_eq!(t.call(json!({"op": "hello"}))["ok"], true);
    let limit = json!({"capacity": 1_000_000, "refill_per_sec": 1});
    let k = key("held", Some("k"));
    let n = 5_000;
    let frames: Vec<Vec<u8>> = (0..n).map(|id| check_frame(id, &k, &limit)).collect();
    let frame_bytes = frames[0].len();
    kill("STOP", redis.child.id());
    let written = Arc::new(AtomicUsize::new(0));
    let mut stdin = t.stdin.take().unwrap();
    let sender = {
        let written = Arc::clone(&written);
        thread::spawn(move || {
            for frame in frames {
                stdin.write_all(&frame).unwrap();
                written.fetch_add(1, Ordering::SeqCst);
            }
            stdin
        })
    };
    sleep_ms(1_500);
    let taken = written.load(Ordering::SeqCst);
    kill("CONT", redis.child.id());
    t.stdin = Some(sender.join().unwrap());
    // What a pipe holds unread (64 KiB on Linux), and the 256 read.
    let at_most = 256 + 2 * 65_536 / frame_bytes;
    eprintln!("with Redis stopped, {taken} of {n} requests written (at most {at_most})");
    assert!(
        taken <= at_most,
        "{taken} requests taken, more than {at_most}"
    );
    for _ in 0..n {
        let answer = t.recv_answer();
        assert_eq!(answer["result"], "admitted", "{answer}");
    }
}

/// A client that skips the `hello` and pipelines its first requests waits no longer for
/// them than one that said hello: with Redis stopped, the requests behind the first were
/// read only once it was answered, a Redis timeout later, and answered a timeout after that.
#[test]
fn requests_pipelined_behind_a_first_check_are_answered_within_the_timeout() {
    let Some(redis) = Redis::start() else { return };
    let url = redis.url();
    let socket = common::temp_path("redis-first-frame.sock");
    let timeout_ms = 1000;
    let timeout = timeout_ms.to_string();
    let args = [
        "--redis",
        url.as_str(),
        "--redis-timeout-ms",
        timeout.as_str(),
    ];
    let mut stdio = StdioDaemon::start(&args);
    let _server = Server::start(&[&args[..], &["--socket", socket.to_str().unwrap()]].concat());
    let mut unix = LineClient::new(std::os::unix::net::UnixStream::connect(&socket).unwrap());
    let (k, limit) = (
        key("first", None),
        json!({"capacity": 20, "refill_per_sec": 1}),
    );
    // Stopped before a daemon asked it at start, Redis would hold that daemon's first
    // answer a second longer (the start's wait, then the timeout).
    eventually("both daemons asked redis at start", || {
        calls_of(&redis, "fcall") >= 2
    });
    kill("STOP", redis.child.id());
    let stdio_answers = burst(4, &k, &limit, &mut stdio);
    let unix_answers = burst(4, &k, &limit, &mut unix);
    kill("CONT", redis.child.id());
    // Before: 1.0, 2.0, 2.0 and 2.0 s.
    let within = Duration::from_millis(timeout_ms + 700);
    unavailable_within("stdio", &stdio_answers, within);
    unavailable_within("unix", &unix_answers, within);
}

/// Asserts that every answer of `burst` is `unavailable`, each within `within`.
fn unavailable_within(name: &str, answers: &[(Value, Duration)], within: Duration) {
    for (answer, took) in answers {
        assert_eq!(answer["error"]["type"], "unavailable", "{name}: {answer}");
        assert!(*took <= within, "{name}: {answer} after {took:?}");
    }
}

/// A shared daemon whose Redis timeout is longer than its client's: a check Redis ran in
/// time, whose answer then came after its request's last moment to run, is answered
/// `unavailable` at that moment, and what it paid is given back when the answer comes.
/// Before, the daemon waited for the answer up to its own timeout and delivered it to a
/// caller that had given up: paid, and told `unavailable` by its own client.
#[test]
fn a_check_answered_by_redis_after_its_last_moment_to_run_is_given_back() {
    let Some(redis) = Redis::start() else { return };
    let relay = AnswerHold::start(redis.port);
    let server = relay.daemon(8000);
    let mut t = server.connect();
    let limit = json!({"capacity": 20, "refill_per_sec": 0.001});
    let k = key("dl", Some("late"));
    assert_eq!(t.call(check(&k, limit.clone(), 1.0))["result"], "admitted");
    let clock_us = t.call(json!({"op": "hello"}))["clock_us"].as_u64().unwrap();
    relay.hold(true);
    // Its caller waits 1 s: it may run until 0.75 s from now, and does at once.
    let mut request = check(&k, limit.clone(), 3.0);
    request["deadline_us"] = json!(clock_us + 1_000_000);
    request["timeout_ms"] = json!(1000);
    // Redis's answer comes after the caller's deadline, long before the daemon's timeout.
    let held = Arc::clone(&relay.held);
    let releasing = thread::spawn(move || {
        sleep_ms(1_500);
        held.store(false, Ordering::SeqCst);
    });
    let started = Instant::now();
    let answer = t.call(request);
    let took = started.elapsed();
    assert_eq!(answer["error"]["type"], "unavailable", "{answer}");
    assert!(
        took < Duration::from_millis(1_000),
        "answered after {took:?}"
    );
    releasing.join().unwrap();
    eventually("what the late check paid is given back", || {
        (borrowed(&mut t, &k) - 1.0).abs() < 0.01
    });
}

/// Sends `record` of `cost` on `k` while the relay holds Redis's answers: Redis runs it,
/// and its caller is told `unavailable` at the daemon's timeout.
fn late_record(relay: &AnswerHold, t: &mut impl common::Transport, k: &Value, cost: f64) {
    relay.hold(true);
    let answer = t.call(json!({"op": "record", "key": k, "cost": cost}));
    assert_eq!(answer["error"]["type"], "unavailable", "{answer}");
    relay.hold(false);
}

/// A `record` that Redis ran but answered after its caller was told `unavailable` (Redis
/// stopped before writing the answer) is given back when the answer comes, as a check is:
/// on a defined bucket, on a key holding only debt (also one a refused check saw
/// meanwhile), and when the request's own deadline, not the daemon's timeout, ended the
/// wait. A key that got a definition since keeps the debt: its first check took it in.
/// Before, every one of these debits stayed.
#[test]
fn a_debit_answered_after_its_caller_gave_up_is_given_back() {
    let Some(redis) = Redis::start() else { return };
    let relay = AnswerHold::start(redis.port);
    let server = relay.daemon(1000);
    let mut t = server.connect();
    let slow = json!({"capacity": 10, "refill_per_sec": 0.001});
    let (defined, debt_only) = (key("late-debit", Some("a")), key("late-debit", Some("b")));
    assert_eq!(
        t.call(check(&defined, slow.clone(), 1.0))["result"],
        "admitted"
    );
    late_record(&relay, &mut t, &defined, 5.0);
    eventually("the defined bucket's debit is given back", || {
        borrows(&mut t, &defined, 1.0)
    });

    // On a key holding only debt; another daemon's check, refused, sees the key meanwhile
    // (its accrual starts then). Each case has a daemon of its own: a connection the relay
    // saw opened while it held answers is never held.
    let direct = daemon(&redis, &[]);
    let mut d = direct.connect();
    let server = relay.daemon(1000);
    let mut t = server.connect();
    assert_eq!(
        t.call(json!({"op": "record", "key": debt_only, "cost": 2}))["ok"],
        true
    );
    relay.hold(true);
    t.send(&json!({"op": "record", "key": debt_only, "cost": 3, "id": 1}));
    sleep_ms(300);
    assert_eq!(
        d.call(check(&debt_only, slow.clone(), 9.0))["result"],
        "delay"
    );
    assert_eq!(t.recv()["error"]["type"], "unavailable");
    relay.hold(false);
    eventually("the debt is given back", || {
        borrows(&mut t, &debt_only, 2.0)
    });

    // Its caller waits 1 s (the request may run until 0.75 s from now); Redis's answer
    // comes at 1.5 s, long before the daemon's timeout of 8 s.
    let patient = relay.daemon(8000);
    let mut p = patient.connect();
    assert!(borrows(&mut p, &defined, 1.0));
    let clock_us = p.call(json!({"op": "hello"}))["clock_us"].as_u64().unwrap();
    let held = Arc::clone(&relay.held);
    let releasing = thread::spawn(move || {
        sleep_ms(1_500);
        held.store(false, Ordering::SeqCst);
    });
    let started = Instant::now();
    relay.hold(true);
    let answer = p.call(json!({
        "op": "record", "key": defined, "cost": 4,
        "deadline_us": clock_us + 1_000_000, "timeout_ms": 1000,
    }));
    assert_eq!(answer["error"]["type"], "unavailable", "{answer}");
    let took = started.elapsed();
    assert!(
        took < Duration::from_millis(1_000),
        "answered after {took:?}"
    );
    releasing.join().unwrap();
    eventually("the debit past its deadline is given back", || {
        borrows(&mut p, &defined, 1.0)
    });

    // The key gets its definition from another daemon while the debit's answer is held:
    // that check takes in the debt of 5, the late debit included, and keeps it.
    let server = relay.daemon(1000);
    let mut t = server.connect();
    assert!(borrows(&mut t, &debt_only, 2.0));
    relay.hold(true);
    t.send(&json!({"op": "record", "key": debt_only, "cost": 3, "id": 2}));
    sleep_ms(300);
    assert_eq!(d.call(check(&debt_only, slow, 1.0))["result"], "admitted");
    assert!(borrows(&mut d, &debt_only, 6.0));
    assert_eq!(t.recv()["error"]["type"], "unavailable");
    relay.hold(false);
    sleep_ms(500);
    assert!(
        borrows(&mut t, &debt_only, 6.0),
        "the debit was given back to a new definition"
    );
}

/// A check and a debit that Redis ran, whose answers were then lost with their connection
/// more than twice the timeout later (a proxy that dropped it while Redis stalled): sent
/// again on a new connection, each answers what it did, and what it paid is given back.
/// Before, their run markers had expired by then (twice the timeout): sent again, each
/// was refused as late, and both stayed paid.
#[test]
fn late_calls_whose_connection_is_lost_late_are_still_given_back() {
    let Some(redis) = Redis::start() else { return };
    let relay = AnswerHold::start(redis.port);
    let server = relay.daemon(500);
    let mut t = server.connect();
    let slow = json!({"capacity": 10, "refill_per_sec": 0.001});
    let k = key("lost-late", Some("k"));
    assert_eq!(t.call(check(&k, slow.clone(), 1.0))["result"], "admitted");
    relay.hold(true);
    t.send(&json!({"op": "record", "key": k, "cost": 5, "id": 1}));
    let mut late_check = check(&k, slow, 2.0);
    late_check["id"] = json!(2);
    t.send(&late_check);
    for _ in 0..2 {
        assert_eq!(t.recv()["error"]["type"], "unavailable");
    }
    sleep_ms(1_500);
    relay.cut();
    relay.hold(false);
    eventually("what the late calls paid is given back", || {
        borrows(&mut t, &k, 1.0)
    });
}

/// More debits answered late at once than the 64 calls read late before: each is given
/// back. Before, all but 64 of 200 stayed debited.
#[test]
fn many_debits_answered_late_at_once_are_each_given_back() {
    let Some(redis) = Redis::start() else { return };
    let relay = AnswerHold::start(redis.port);
    let server = relay.daemon(1000);
    let mut t = server.connect();
    let k = key("late-debits", Some("k"));
    assert!(borrows(&mut t, &k, 0.0));
    relay.hold(true);
    for id in 0..200 {
        t.send(&json!({"op": "record", "key": k, "cost": 1, "id": id}));
    }
    for _ in 0..200 {
        assert_eq!(t.recv()["error"]["type"], "unavailable");
    }
    relay.hold(false);
    eventually("every debit is given back", || borrows(&mut t, &k, 0.0));
}

/// A shared daemon whose Redis timeout is longer than its client's: a request whose own
/// deadline passed while Redis was stopped is not run when Redis resumes, alone or sharing
/// a call with checks that may still run (which pay).
#[test]
fn a_request_past_its_own_deadline_never_pays_when_redis_resumes() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &["--redis-timeout-ms", "8000"]);
    let mut t = server.connect();
    let limit = json!({"capacity": 20, "refill_per_sec": 0.001});
    let (k, other) = (key("dl", Some("k")), key("dl", Some("other")));
    // The daemon learns Redis's clock; the bucket holds 19.
    assert_eq!(t.call(check(&k, limit.clone(), 1.0))["result"], "admitted");
    let clock_us = t.call(json!({"op": "hello"}))["clock_us"].as_u64().unwrap();
    // Its caller waits 1 s: it may run until 0.75 s from now.
    let impatient = |mut request: Value| {
        request["deadline_us"] = json!(clock_us + 1_000_000);
        request["timeout_ms"] = json!(1000);
        request
    };
    let requests = [
        // Two checks first, each alone in its call; the next ones queue behind them and
        // go as one call when Redis resumes.
        check(&k, limit.clone(), 1.0),
        check(&k, limit.clone(), 1.0),
        impatient(check(&k, limit.clone(), 1.0)),
        check(&k, limit.clone(), 1.0),
        impatient(json!({"op": "check_many", "checks": [
            {"key": k, "limit": limit, "cost": 1}, {"key": other, "limit": limit, "cost": 1},
        ]})),
        impatient(json!({"op": "record", "key": k, "cost": 5})),
    ];
    kill("STOP", redis.child.id());
    let started = Instant::now();
    for (id, mut request) in requests.into_iter().enumerate() {
        request["id"] = json!(id);
        t.send(&request);
    }
    // Resumed well past the impatient requests' deadline (1 s), well before the others'
    // (8 s).
    thread::sleep(Duration::from_millis(1500).saturating_sub(started.elapsed()));
    kill("CONT", redis.child.id());
    let mut answers: Vec<Value> = (0..6).map(|_| t.recv()).collect();
    answers.sort_by_key(|answer| answer["id"].as_u64());
    for (id, answer) in answers.iter().enumerate() {
        match id {
            2 | 4 | 5 => assert_eq!(answer["error"]["type"], "unavailable", "{answer}"),
            _ => assert_eq!(answer["result"], "admitted", "{answer}"),
        }
    }
    // Only the three patient checks paid.
    sleep_ms(200);
    assert!((borrowed(&mut t, &k) - 4.0).abs() < 0.01, "{answers:?}");
    assert!(borrowed(&mut t, &other).abs() < 0.01, "{answers:?}");
}

/// Redis killed: calls are told `unavailable` at once; restarted empty on the same port,
/// the daemon reconnects and reloads its script, and nothing refused was paid.
#[test]
fn a_killed_redis_restarted_empty_serves_again_and_refusals_paid_nothing() {
    let Some(mut redis) = Redis::start() else {
        return;
    };
    let url = redis.url();
    let mut stdio = StdioDaemon::start(&["--redis", &url, "--redis-timeout-ms", "500"]);
    let k = key("g", Some("k"));
    let limit = json!({"capacity": 20, "refill_per_sec": 0.001});
    assert_eq!(
        stdio.call(check(&k, limit.clone(), 1.0))["result"],
        "admitted"
    );
    kill("KILL", redis.child.id());
    let _ = redis.child.wait();
    let answers = burst(20, &k, &limit, &mut stdio);
    for (answer, took) in &answers {
        assert_eq!(answer["error"]["type"], "unavailable", "{answer}");
        assert!(*took < Duration::from_secs(2), "{answer} after {took:?}");
    }
    redis = Redis::on_port(redis.port);
    eventually("the daemon serves again", || {
        stdio.call(check(&k, limit.clone(), 1.0))["result"] == "admitted"
    });
    let tokens = stdio.call(json!({"op": "inspect", "key": k}))["info"]["tokens"]
        .as_f64()
        .unwrap();
    assert!(tokens > 18.99, "{tokens}");
    drop(redis);
}

/// Everything the limiter writes expires: 10,000 exchanges leave no key without a TTL.
#[test]
fn nothing_in_redis_lives_forever() {
    let Some(redis) = Redis::start() else { return };
    let url = redis.url();
    let flags = [
        &["--redis", url.as_str(), "--assume-busy-at-start"][..],
        &PATIENT,
    ]
    .concat();
    let mut stdio = StdioDaemon::start(&flags);
    let limit = json!({"capacity": 5, "refill_per_sec": 1});
    let n = 10_000;
    // In batches, so that no request waits behind thousands on a loaded machine.
    for batch in 0..n / 200 {
        for i in batch * 200..(batch + 1) * 200 {
            let mut request = check(&key(&format!("x{i}"), Some("k")), limit.clone(), 1.0);
            request["id"] = json!(i);
            stdio.send_frame(&serde_json::to_vec(&request).unwrap());
        }
        // With assume_busy_at_start new buckets start empty: refused, but recorded.
        for _ in 0..200 {
            let answer = stdio.recv_frame().unwrap();
            assert_eq!(answer["result"], "delay", "{answer}");
        }
    }
    let pause = json!({"op": "pause", "target": {"exchange": "x1", "credential": "k"}, "ms": 1000});
    assert_eq!(stdio.call(pause), json!({"ok": true}));
    stdio.call(json!({"op": "record", "key": key("y", Some("k")), "cost": 2}));
    let booked = json!({"op": "check", "key": key("x2", Some("k")), "limit": limit, "cost": 5, "max_wait_ms": 60_000});
    assert_eq!(stdio.call(booked)["ok"], true);
    let mut cursor = 0u64;
    let (mut keys, mut forever) = (0, Vec::new());
    loop {
        let (next, names): (u64, Vec<String>) =
            redis.query(::redis::cmd("SCAN").arg(cursor).arg("COUNT").arg(5000));
        for name in names {
            keys += 1;
            let ttl: i64 = redis.query(::redis::cmd("PTTL").arg(&name));
            // -2: expired since the scan, as it should.
            if ttl == -1 {
                forever.push(name);
            }
        }
        if next == 0 {
            break;
        }
        cursor = next;
    }
    eprintln!(
        "{keys} keys in Redis after {n} exchanges, {} without a TTL",
        forever.len()
    );
    assert!(keys > n as usize);
    // The server's record of since when its data is whole, one key, is kept for good.
    forever.retain(|name| name != "bourse:data");
    assert!(
        forever.is_empty(),
        "{} keys without a TTL, e.g. {:?}",
        forever.len(),
        &forever[..forever.len().min(3)]
    );
}

/// Checks pipelined by several clients of several daemons share calls to Redis (the
/// checks waiting at once run in one script call); one bucket hammered so stays within
/// C + r * T (P1), and every request is answered once, under its own id.
#[test]
fn pipelined_checks_from_several_daemons_share_one_bucket() {
    let Some(redis) = Redis::start() else { return };
    let (capacity, refill) = (20.0, 50.0);
    let daemons: Vec<Server> = (0..3).map(|_| daemon(&redis, &[])).collect();
    let k = key("binance", Some("pipelined"));
    let limit = json!({"capacity": capacity, "refill_per_sec": refill});
    let window = 32;
    let run_for = Duration::from_secs(2);
    let started = Instant::now();
    let counts: Vec<(usize, usize)> = thread::scope(|scope| {
        let workers: Vec<_> = daemons
            .iter()
            .flat_map(|server| [server, server])
            .map(|server| {
                let (k, limit) = (&k, &limit);
                scope.spawn(move || {
                    let mut t = server.connect();
                    let (mut admitted, mut calls) = (0, 0);
                    while started.elapsed() < run_for {
                        for (answer, _) in burst(window, k, limit, &mut t) {
                            calls += 1;
                            match load::classify(&answer) {
                                "admitted" => admitted += 1,
                                kind => assert_eq!(kind, "delay", "{answer}"),
                            }
                        }
                    }
                    (admitted, calls)
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    });
    let elapsed = started.elapsed().as_secs_f64();
    let admitted = counts.iter().map(|c| c.0).sum();
    let calls: usize = counts.iter().map(|c| c.1).sum();
    let what = format!("3 daemons x 2 clients, {window} checks in flight each, {calls} checks");
    assert_conforms(admitted, capacity, refill, elapsed, &what);
    // Shared calls: fewer script calls than checks.
    let scripts = ["fcall", "evalsha", "eval"]
        .iter()
        .map(|command| calls_of(&redis, command) as usize)
        .sum::<usize>();
    assert!(scripts > 0, "no script calls in INFO commandstats");
    eprintln!("{calls} checks in {scripts} script calls");
    assert!(scripts < calls, "{scripts} script calls for {calls} checks");
}

/// A stop (stdin closed, or SIGTERM, of a `--stdio` daemon or a server) waits for the
/// requests running on Redis as long as their timeout, even past the 10 s it waits at
/// least: each is answered before the daemon exits. Before, with a timeout of 12 s, it
/// exited after 10 s with none answered.
#[test]
fn a_stop_waits_for_the_answers_of_a_redis_timeout_longer_than_ten_seconds() {
    let Some(redis) = Redis::start() else { return };
    let url = redis.url();
    let limit = json!({"capacity": 100, "refill_per_sec": 1});
    let k = key("d", Some("k"));
    let request = |id: u64| json!({"id": id, "op": "check", "key": k, "limit": limit, "cost": 1});
    let args = ["--redis", url.as_str(), "--redis-timeout-ms", "12000"];
    let (mut eof, mut term) = (StdioDaemon::start(&args), StdioDaemon::start(&args));
    let mut server = Server::tcp(&args);
    let mut tcp = server.connect();
    let clients: [&mut dyn Pipelined; 3] = [&mut eof, &mut term, &mut tcp];
    for t in clients {
        t.send_request(&request(9));
        assert_eq!(t.recv_answer()["result"], "admitted");
    }
    kill("STOP", redis.child.id());
    let clients: [&mut dyn Pipelined; 3] = [&mut eof, &mut term, &mut tcp];
    for t in clients {
        (0..3).for_each(|id| t.send_request(&request(id)));
    }
    // Time for each daemon to read its three, on a loaded machine too.
    sleep_ms(1_000);
    eof.close_stdin();
    kill("TERM", term.child.id());
    kill("TERM", server.child.id());
    let clients: [&mut dyn Pipelined; 3] = [&mut eof, &mut term, &mut tcp];
    for t in clients {
        let mut ids: Vec<u64> = (0..3)
            .map(|_| {
                let answer = t.recv_answer();
                assert_eq!(answer["error"]["type"], "unavailable", "{answer}");
                answer["id"].as_u64().unwrap()
            })
            .collect();
        ids.sort_unstable();
        assert_eq!(ids, [0, 1, 2]);
    }
    for child in [&mut eof.child, &mut term.child, &mut server.child] {
        assert!(child.wait().unwrap().success());
    }
    kill("CONT", redis.child.id());
}

/// Checks that arrive while a call is on its way are divided among the turns free, so that
/// their calls overlap in Redis with the answering of the others, rather than every caller
/// moving as one convoy; a check that finds no call on its way goes alone. With Redis
/// stopped: one check alone, then 20 read at once in two calls of 10 (before, one call of
/// 20).
#[test]
fn checks_arriving_while_a_call_is_on_its_way_share_the_turns_free() {
    let Some(redis) = Redis::start() else { return };
    let url = redis.url();
    let mut t = StdioDaemon::start(&["--redis", url.as_str(), "--redis-timeout-ms", "10000"]);
    let limit = json!({"capacity": 100, "refill_per_sec": 1});
    let k = key("s", Some("k"));
    assert_eq!(t.call(check(&k, limit.clone(), 1.0))["result"], "admitted");
    let _: () = redis.query(::redis::cmd("CONFIG").arg("RESETSTAT"));
    kill("STOP", redis.child.id());
    t.send_request(&json!({"id": 0, "op": "check", "key": k, "limit": limit, "cost": 1}));
    sleep_ms(100);
    // One write of under PIPE_BUF bytes: the daemon reads the 20 frames at once.
    let frames: Vec<u8> = (1..=20)
        .flat_map(|id| check_frame(id, &k, &limit))
        .collect();
    assert!(frames.len() <= 4096, "{} bytes", frames.len());
    t.send_raw(&frames);
    sleep_ms(200);
    kill("CONT", redis.child.id());
    let mut ids: Vec<u64> = (0..21)
        .map(|_| {
            let answer = t.recv_answer();
            assert_eq!(answer["result"], "admitted", "{answer}");
            answer["id"].as_u64().unwrap()
        })
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, (0..21).collect::<Vec<u64>>());
    assert_eq!(calls_of(&redis, "fcall"), 3);
}

/// The connection to Redis lost after Redis ran a call but before its answer came back
/// (Redis stopped, the call and a `CLIENT KILL` of the daemon's connection queued behind
/// it, Redis resumed): the daemon sends the call again on a fresh connection, and the
/// script, finding the call's run marker, does not run it twice. Every check is answered
/// once, under its own id, and the bucket paid at most once per check.
#[test]
fn a_call_whose_answer_was_lost_is_not_paid_twice() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &["--redis-timeout-ms", "3000"]);
    let mut t = server.connect();
    let k = key("h", Some("k"));
    let limit = json!({"capacity": 100, "refill_per_sec": 0.001});
    // Loads the script and reads the Redis clock: the burst below is one script call.
    assert_eq!(t.call(check(&k, limit.clone(), 1.0))["result"], "admitted");
    let n = 20;
    let checks = (0..n).map(|_| check(&k, limit.clone(), 1.0));
    let answers = pipelined_while_stopped(&redis, &mut t, checks, WhileStopped::AnswerLost);
    let mut ids: Vec<u64> = answers
        .iter()
        .map(|answer| {
            let kind = load::classify(answer);
            assert!(matches!(kind, "admitted" | "unavailable"), "{answer}");
            answer["id"].as_u64().unwrap()
        })
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, (0..n).collect::<Vec<_>>());
    let paid = borrowed(&mut t, &k) - 1.0;
    eprintln!("{n} checks, their call's answer lost: {paid:.2} paid");
    assert!(paid < n as f64 + 0.01, "paid {paid} for {n} checks");
}

/// A `record` and a `back_off` whose answers were lost as above run once: sent again on
/// the fresh connection, each finds its run marker. Before, the debt was recorded twice
/// and the backoff counted twice (its next pause four times the first, not twice).
#[test]
fn a_record_or_back_off_whose_answer_was_lost_runs_once() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &["--redis-timeout-ms", "3000"]);
    let mut t = server.connect();
    let k = key("once", Some("k"));
    let credential = json!({"exchange": "once", "credential": "k"});
    let back_off = json!({"op": "back_off", "credential": credential, "scope": "credential"});
    assert_eq!(t.call(json!({"op": "get_cost", "key": k}))["ok"], true);
    let requests = [
        json!({"op": "record", "key": k, "cost": 5}),
        back_off.clone(),
    ];
    let answers = pipelined_while_stopped(
        &redis,
        &mut t,
        requests.into_iter(),
        WhileStopped::AnswerLost,
    );
    for answer in &answers {
        assert_eq!(answer["ok"], true, "{answer}");
    }
    assert_eq!(borrowed(&mut t, &k), 5.0, "the debt was recorded twice");
    let ms = |answer: &Value| answer["ms"].as_u64().unwrap();
    let first = answers.iter().find(|a| a["id"] == 1).map(ms).unwrap();
    // Once its pause has ended, the next limited reply counts.
    sleep_ms(first + 100);
    assert_eq!(
        ms(&t.call(back_off)),
        2 * first,
        "the backoff was counted twice"
    );
}

/// A malformed check among checks pipelined at once is refused alone: the others, which
/// may share one script call, are answered as they would be alone, each under its own id.
#[test]
fn a_malformed_check_among_pipelined_checks_is_refused_alone() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &[]);
    let mut t = server.connect();
    let k = key("m", Some("pipelined"));
    let limit = json!({"capacity": 1000, "refill_per_sec": 0.001});
    assert_eq!(t.call(check(&k, limit.clone(), 1.0))["result"], "admitted");
    let n = 64;
    let checks = (0..n).map(|id| {
        let mut request = check(&k, limit.clone(), 1.0);
        if id == n / 2 {
            request["cost"] = json!("SECRET-api-key");
        }
        request
    });
    let mut answers = pipelined_while_stopped(&redis, &mut t, checks, WhileStopped::Waiting);
    answers.sort_by_key(|answer| answer["id"].as_u64());
    for (id, answer) in answers.iter().enumerate() {
        assert_eq!(answer["id"], json!(id), "{answer}");
        if id as u64 == n / 2 {
            assert_eq!(answer["error"]["type"], "invalid_parameters", "{answer}");
            assert!(!answer.to_string().contains("SECRET"), "{answer}");
        } else {
            assert_eq!(answer["result"], "admitted", "{answer}");
        }
    }
    let paid = borrowed(&mut t, &k) - 1.0;
    assert!((paid - (n - 1) as f64).abs() < 0.01, "paid {paid}");
}

/// The connection to Redis lost after Redis ran a `checks` call but before its answer came
/// back: whatever the daemon answers, a check told `unavailable` must not have paid
/// (docs/CONTRACT.md §8, Stores): what was paid is at most what was admitted.
#[test]
fn a_call_whose_answer_was_lost_pays_only_for_what_it_admitted() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &["--redis-timeout-ms", "3000"]);
    let mut t = server.connect();
    let k = key("h", Some("lost"));
    let limit = json!({"capacity": 100, "refill_per_sec": 0.001});
    assert_eq!(t.call(check(&k, limit.clone(), 1.0))["result"], "admitted");
    let n = 20;
    let checks = (0..n).map(|_| check(&k, limit.clone(), 1.0));
    let answers = pipelined_while_stopped(&redis, &mut t, checks, WhileStopped::AnswerLost);
    let admitted = answers.iter().filter(|a| a["result"] == "admitted").count();
    let paid = borrowed(&mut t, &k) - 1.0;
    eprintln!("{n} checks, their call's answer lost: {admitted} admitted, {paid:.2} paid");
    assert!(
        paid < admitted as f64 + 0.01,
        "paid {paid:.2} for {admitted} admitted checks; the others were told unavailable"
    );
}

/// A call sent again after its answer was lost answers what its first run answered, delays
/// included (each with its wait), and pays nothing more.
#[test]
fn a_call_whose_answer_was_lost_answers_its_delays_when_sent_again() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &["--redis-timeout-ms", "3000"]);
    let mut t = server.connect();
    let k = key("h", Some("replayed"));
    // One token left, and a whole one refills in 1,000 s.
    let limit = json!({"capacity": 2, "refill_per_sec": 0.001});
    assert_eq!(t.call(check(&k, limit.clone(), 1.0))["result"], "admitted");
    let checks = (0..6).map(|_| check(&k, limit.clone(), 1.0));
    let answers = pipelined_while_stopped(&redis, &mut t, checks, WhileStopped::AnswerLost);
    let admitted = answers.iter().filter(|a| a["result"] == "admitted").count();
    let delays: Vec<u64> = answers
        .iter()
        .filter(|a| a["result"] == "delay")
        .map(ms)
        .collect();
    eprintln!("answers after the lost call: {answers:?}");
    assert!(admitted <= 1, "{answers:?}");
    assert!(!delays.is_empty(), "no delay answered: {answers:?}");
    assert!(delays.iter().all(|&ms| ms > 900_000), "{answers:?}");
    let paid = borrowed(&mut t, &k) - 1.0;
    assert!(
        (paid - admitted as f64).abs() < 0.01,
        "paid {paid:.2} for {admitted} admitted"
    );
}

/// A check whose keys Redis cannot use (a key of another type under the bucket's name)
/// fails; the other checks sharing its script call are answered as they would be alone,
/// and none told `unavailable` paid.
#[test]
fn a_check_failing_in_redis_fails_alone_in_its_call() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &["--redis-timeout-ms", "3000"]);
    let mut t = server.connect();
    let (good, bad) = (key("good", None), key("bad", None));
    let limit = json!({"capacity": 1000, "refill_per_sec": 0.001});
    assert_eq!(
        t.call(check(&good, limit.clone(), 1.0))["result"],
        "admitted"
    );
    let _: () = redis.query(
        ::redis::cmd("SET")
            .arg("bourse:{3:bad}:b:-:7:request")
            .arg("x"),
    );
    let n = 60;
    let checks = (0..n).map(|id| check(if id == n / 2 { &bad } else { &good }, limit.clone(), 1.0));
    let answers = pipelined_while_stopped(&redis, &mut t, checks, WhileStopped::Waiting);
    let admitted = answers.iter().filter(|a| a["result"] == "admitted").count();
    let paid = borrowed(&mut t, &good) - 1.0;
    eprintln!(
        "{} good checks with one bad in their call: {admitted} admitted, {paid:.2} paid",
        n - 1
    );
    assert!(
        paid < admitted as f64 + 0.01,
        "paid {paid:.2} for {admitted} admitted"
    );
    assert_eq!(admitted as u64, n - 1, "{answers:?}");
    let failed = answers.iter().find(|a| a["id"] == n / 2).unwrap();
    assert_eq!(load::classify(failed), "unavailable", "{failed}");
    let message = failed["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("WRONGTYPE"), "{failed}");
    // Table-wide reads pass it over as unknown; before, they answered `unavailable`.
    assert_eq!(t.call(json!({"op": "stats"}))["ok"], true);
    let busiest = t.call(json!({"op": "busiest", "count": 10}));
    assert_eq!(
        busiest["keys"].as_array().map(Vec::len),
        Some(1),
        "{busiest}"
    );
}

/// Numbers another program wrote into a bucket that no bucket holds (NaN, an infinity, a
/// definition <= 0) make its checks fail, `unavailable`, never admit: a NaN compares
/// false with everything, so a bucket holding one admitted every check, and kept it. A
/// pause end beyond the longest wait answers the longest wait.
#[test]
fn numbers_no_bucket_holds_are_refused_not_admitted() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &[]);
    let mut t = server.connect();
    let limit = json!({"capacity": 5, "refill_per_sec": 1});
    let cases = [
        ("b", "nan"),
        ("b", "-nan"),
        ("t", "nan"),
        ("b", "inf"),
        ("r", "nan"),
        ("c", "-5"),
        ("r", "inf"),
    ];
    for (n, (field, value)) in cases.into_iter().enumerate() {
        let exchange = format!("h{n}");
        let k = key(&exchange, None);
        assert_eq!(t.call(check(&k, limit.clone(), 1.0))["result"], "admitted");
        let bucket = format!("bourse:{{2:{exchange}}}:b:-:7:request");
        let _: () = redis.query(::redis::cmd("HSET").arg(&bucket).arg(field).arg(value));
        for _ in 0..20 {
            let answer = t.call(check(&k, limit.clone(), 5.0));
            assert_eq!(
                load::classify(&answer),
                "unavailable",
                "{field}={value}: {answer}"
            );
        }
    }
    // A pause whose end is past any wait: the longest wait (1e12 ms), not a larger delay.
    let k = key("h9", None);
    assert_eq!(t.call(check(&k, limit.clone(), 1.0))["result"], "admitted");
    let pauses = "bourse:{2:h9}:p";
    let _: () = redis.query(::redis::cmd("HSET").arg(pauses).arg("x").arg("1e20"));
    let answer = t.call(check(&k, limit.clone(), 1.0));
    assert_eq!(answer["result"], "delay", "{answer}");
    assert_eq!(answer["ms"], 1_000_000_000_000u64, "{answer}");
}

/// A bucket's record of its expiry (`k`) that is not a number, as only another program
/// writes, is renewed by the next payment with the key's expiry, never kept.
#[test]
fn an_expiry_record_that_is_no_number_is_renewed() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &[]);
    let mut t = server.connect();
    let limit = json!({"capacity": 5, "refill_per_sec": 1});
    for (n, odd) in ["nan", "-nan", "x"].into_iter().enumerate() {
        let exchange = format!("k{n}");
        let k = key(&exchange, None);
        assert_eq!(t.call(check(&k, limit.clone(), 1.0))["result"], "admitted");
        let bucket = format!("bourse:{{2:{exchange}}}:b:-:7:request");
        let time: String = redis.query(::redis::cmd("HGET").arg(&bucket).arg("t"));
        let _: () = redis.query(
            ::redis::cmd("HSET")
                .arg(&bucket)
                .arg("k")
                .arg(format!("{time} {odd}")),
        );
        let _: () = redis.query(::redis::cmd("PERSIST").arg(&bucket));
        assert_eq!(t.call(check(&k, limit.clone(), 1.0))["result"], "admitted");
        let ttl: i64 = redis.query(::redis::cmd("PTTL").arg(&bucket));
        assert!(ttl > 0, "k = {odd}: PTTL {ttl}");
        let record: String = redis.query(::redis::cmd("HGET").arg(&bucket).arg("k"));
        assert!(!record.ends_with(odd), "k = {odd}: kept as {record}");
    }
}

/// Commands the script ran on `redis` since the stats were reset: all but the daemon's
/// own (the script call, TIME for its clock, stats reading).
fn script_commands(redis: &Redis) -> (u64, String) {
    let stats: String = redis.query(::redis::cmd("INFO").arg("commandstats"));
    let own = ["fcall", "evalsha", "eval", "time", "info", "ping", "hello"];
    let mut total = 0;
    for line in stats.lines() {
        let Some((name, rest)) = line
            .strip_prefix("cmdstat_")
            .and_then(|l| l.split_once(':'))
        else {
            continue;
        };
        let calls = rest
            .strip_prefix("calls=")
            .and_then(|r| r.split(',').next())
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0);
        let loads = ["config", "script", "function"];
        if !own.contains(&name) && !loads.iter().any(|load| name.starts_with(load)) {
            total += calls;
        }
    }
    (total, stats)
}

/// A definition is stored as the daemon spells it in its calls (Rust's shortest form for a
/// number that is not whole), so that the checks that follow find it equal to theirs as
/// text and take the script's path for the common check.
#[test]
fn a_definition_is_stored_as_the_requests_spell_it() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &[]);
    let mut t = server.connect();
    let k = key("kraken", None);
    let limit = json!({"capacity": 2.5, "refill_per_sec": 0.1});
    assert_eq!(t.call(check(&k, limit, 1.0))["result"], "admitted");
    let bucket = "bourse:{6:kraken}:b:-:7:request";
    let stored: Vec<String> = redis.query(::redis::cmd("HMGET").arg(bucket).arg("c").arg("r"));
    assert_eq!(stored, [format!("{}", 2.5f64), format!("{}", 0.1f64)]);
}

/// The common path stays cheap inside Redis (single-threaded, so its cost per check caps
/// every daemon sharing it): an admitted check of three known buckets without bookings or
/// pauses reads each bucket once and its pauses once per exchange.
#[test]
fn an_admitted_check_of_known_buckets_makes_few_redis_calls() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &[]);
    let mut t = server.connect();
    let limit = json!({"capacity": 100, "refill_per_sec": 1});
    let three = json!({"op": "check_many", "checks": [
        {"key": key("okx", Some("k")), "limit": limit, "cost": 1},
        {"key": {"exchange": "okx", "credential": "k", "axis": "order"}, "limit": limit, "cost": 1},
        {"key": {"exchange": "okx", "credential": null, "axis": "ip"}, "limit": limit, "cost": 1},
    ]});
    assert_eq!(t.call(three.clone())["result"], "admitted");
    let _: () = redis.query(::redis::cmd("CONFIG").arg("RESETSTAT"));
    assert_eq!(t.call(three)["result"], "admitted");
    let (commands, stats) = script_commands(&redis);
    // Per call: the run marker's GET (whether it ran before) and SET (its answers); per
    // exchange one PTTL of its marker (far enough: not renewed) and one HLEN of its pauses;
    // per bucket HMGET and HSET (paid a moment ago without bookings: kept long enough).
    assert!(commands <= 2 + 2 + 3 * 2, "{commands} commands:\n{stats}");
    // The exchange's marker still outlives its last check by a day (less the moments since).
    let markers: Vec<String> = redis.query(::redis::cmd("KEYS").arg("*:e{*"));
    assert_eq!(markers.len(), 1, "{markers:?}");
    let left: i64 = redis.query(::redis::cmd("PTTL").arg(&markers[0]));
    assert!(
        left >= 86_400_000 - 60_000,
        "the marker expires in {left} ms"
    );
}

/// A marker deleted and written again (SET, without an expiry) by a later check still gets
/// an expiry.
#[test]
fn an_exchange_marker_written_again_gets_an_expiry() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &[]);
    let mut t = server.connect();
    let limit = json!({"capacity": 100, "refill_per_sec": 1});
    for round in 0..3 {
        let k = key("okx", Some(&format!("k{round}")));
        assert_eq!(t.call(check(&k, limit.clone(), 1.0))["result"], "admitted");
        assert_eq!(t.call(check(&k, limit.clone(), 1.0))["result"], "admitted");
        let markers: Vec<String> = redis.query(::redis::cmd("KEYS").arg("*:e{*"));
        assert_eq!(markers.len(), 1, "{markers:?}");
        let left: i64 = redis.query(::redis::cmd("PTTL").arg(&markers[0]));
        assert!(left >= 86_400_000 - 60_000, "round {round}: {left} ms");
        let _: () = redis.query(::redis::cmd("DEL").arg(&markers[0]));
    }
}

/// Calls of `command` (lower case) in `INFO commandstats`.
fn calls_of(redis: &Redis, command: &str) -> u64 {
    let stats: String = redis.query(::redis::cmd("INFO").arg("commandstats"));
    let line = format!("cmdstat_{command}:calls=");
    stats
        .lines()
        .find_map(|l| l.strip_prefix(line.as_str()))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |calls| calls.parse().unwrap())
}

/// The `redis-server` major version.
fn major_version(redis: &Redis) -> u64 {
    let info: String = redis.query(::redis::cmd("INFO").arg("server"));
    info.lines()
        .find_map(|line| line.strip_prefix("redis_version:"))
        .and_then(|version| version.split('.').next()?.parse().ok())
        .expect("redis_version in INFO")
}

/// On Redis >= 7 checks and the other operations run as `FCALL` of the daemon's function
/// library (its local functions are created once, when it is loaded, not on every call).
/// A library lost (`FUNCTION FLUSH`, as after a restart without persistence or a failover
/// to a node without it) is loaded again by the next call, which is answered as usual;
/// the script is never needed.
#[test]
fn the_function_library_is_loaded_again_whenever_lost() {
    let Some(redis) = Redis::with_functions() else {
        return;
    };
    let server = daemon(&redis, &[]);
    // Counted from here: the start's probe is no check.
    let _: () = redis.query(::redis::cmd("CONFIG").arg("RESETSTAT"));
    let mut t = server.connect();
    let k = key("fn", Some("k"));
    let limit = json!({"capacity": 100, "refill_per_sec": 0.001});
    for flush in ["FUNCTION", "SCRIPT", "FUNCTION"] {
        assert_eq!(t.call(check(&k, limit.clone(), 1.0))["result"], "admitted");
        let _: () = redis.query(::redis::cmd(flush).arg("FLUSH"));
    }
    assert_eq!(t.call(check(&k, limit.clone(), 1.0))["result"], "admitted");
    assert!((borrowed(&mut t, &k) - 4.0).abs() < 0.01);
    let libraries: Vec<::redis::Value> = redis.query(::redis::cmd("FUNCTION").arg("LIST"));
    assert_eq!(libraries.len(), 1, "{libraries:?}");
    // 4 checks, each sent once, and once more after the library was found missing: at the
    // first call and after each FUNCTION FLUSH; and get_cost (of the function that writes
    // nothing).
    assert_eq!(calls_of(&redis, "fcall"), 5 + 3);
    assert_eq!(calls_of(&redis, "evalsha") + calls_of(&redis, "eval"), 0);
}

/// A Redis out of memory (`maxmemory` reached under `noeviction`) refuses the script's
/// writes: a check is `unavailable` and pays nothing. `get_cost`, `inspect`, `busiest` and
/// `stats` only read, and are still answered (`FCALL` of the library's function that
/// writes nothing).
#[test]
fn a_redis_out_of_memory_admits_nothing_and_still_answers_reads() {
    let Some(redis) = Redis::with_functions() else {
        return;
    };
    let server = daemon(&redis, &[]);
    let mut t = server.connect();
    let k = key("oom", Some("k"));
    let limit = json!({"capacity": 10, "refill_per_sec": 0.001});
    assert_eq!(t.call(check(&k, limit.clone(), 4.0))["result"], "admitted");
    let memory = |bytes: &str| {
        let _: () = redis.query(
            ::redis::cmd("CONFIG")
                .arg("SET")
                .arg("maxmemory")
                .arg(bytes),
        );
    };
    memory("1");
    let refused = t.call(check(&k, limit.clone(), 1.0));
    assert_eq!(refused["error"]["type"], "unavailable", "{refused}");
    assert!((borrowed(&mut t, &k) - 4.0).abs() < 0.01);
    let info = t.call(json!({"op": "inspect", "key": k}));
    assert_eq!(
        info["info"]["limit"],
        json!({"capacity": 10.0, "refill_per_sec": 0.001})
    );
    let busiest = t.call(json!({"op": "busiest", "count": 2}));
    assert_eq!(busiest["ok"], true, "{busiest}");
    assert_eq!(t.call(json!({"op": "stats"}))["ok"], true);
    // The library lost meanwhile cannot be loaded again (Redis refuses FUNCTION LOAD): the
    // reads run as the script.
    let _: () = redis.query(::redis::cmd("FUNCTION").arg("FLUSH"));
    assert!((borrowed(&mut t, &k) - 4.0).abs() < 0.01);
    let info = t.call(json!({"op": "inspect", "key": k}));
    assert_eq!(info["ok"], true, "{info}");
    memory("0");
    assert_eq!(t.call(check(&k, limit, 1.0))["result"], "admitted");
    assert!((borrowed(&mut t, &k) - 5.0).abs() < 0.01);
}

/// A Redis without functions runs the script with `EVALSHA` (loaded again on `NOSCRIPT`):
/// Redis before 7.0 has neither `FCALL` nor `FUNCTION`; here one or the other is renamed
/// away or denied to the daemon's user, as an administrator may do.
#[test]
fn without_functions_the_script_runs_as_evalsha() {
    let ways = [
        ("FCALL", "renamed"),
        ("FUNCTION", "renamed"),
        ("FCALL", "denied"),
        ("FUNCTION", "denied"),
    ];
    for (command, way) in ways {
        let missing = format!("{command} {way}");
        let options = match way {
            "renamed" => vec!["--rename-command", command, ""],
            _ => vec![],
        };
        let Some(redis) = Redis::start_with(&options) else {
            return;
        };
        if way == "denied" {
            let rule = format!("-{}", command.to_lowercase());
            let _: () = redis.query(::redis::cmd("ACL").arg("SETUSER").arg("default").arg(rule));
        }
        let server = daemon(&redis, &[]);
        let _: () = redis.query(::redis::cmd("CONFIG").arg("RESETSTAT"));
        let mut t = server.connect();
        let k = key("nofn", Some("k"));
        let limit = json!({"capacity": 100, "refill_per_sec": 0.001});
        for _ in 0..2 {
            assert_eq!(t.call(check(&k, limit.clone(), 1.0))["result"], "admitted");
            let _: () = redis.query(::redis::cmd("SCRIPT").arg("FLUSH"));
        }
        assert_eq!(t.call(check(&k, limit.clone(), 1.0))["result"], "admitted");
        assert!(
            (borrowed(&mut t, &k) - 3.0).abs() < 0.01,
            "without {missing}"
        );
        // 3 checks and get_cost, once more after NOSCRIPT at the first call and after
        // each SCRIPT FLUSH; the functions given up at the first call.
        assert_eq!(calls_of(&redis, "evalsha"), 4 + 3, "without {missing}");
        assert!(calls_of(&redis, "fcall") <= 1, "without {missing}");
    }
}

/// A TCP client past `--max-connections` that sends checks right behind its proof is
/// refused before they run: a caller told the connection is unavailable must not have paid
/// (docs/CONTRACT.md, 'Stores'), and the limit is not passed by one read's worth of frames.
#[test]
fn checks_sent_behind_the_proof_of_a_refused_connection_pay_nothing() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &["--max-connections", "1"]);
    let mut first = server.connect();
    let k = key("binance", Some("refused"));
    let limit = json!({"capacity": 10, "refill_per_sec": 0.001});
    let mut late = server.connect_unproved();
    let hello = late.call(json!({"op": "hello"}));
    let nonce = hello["auth"]["nonce"]
        .as_str()
        .expect("a nonce")
        .to_string();
    let mut burst =
        json!({"op": "auth", "proof": common::proof(common::SECRET.as_bytes(), &nonce)})
            .to_string();
    for id in 0..5 {
        let mut request = check(&k, limit.clone(), 1.0);
        request["id"] = json!(id);
        burst.push('\n');
        burst.push_str(&request.to_string());
    }
    burst.push('\n');
    late.send_raw(burst.as_bytes());
    let mut answers = Vec::new();
    while let Some(line) = late.recv_line() {
        answers.push(line);
    }
    assert!(
        answers
            .iter()
            .any(|line| line.contains("--max-connections")),
        "no refusal in {answers:?}"
    );
    // Checks the daemon had received would have run by now.
    sleep_ms(500);
    assert_eq!(borrowed(&mut first, &k), 0.0, "answers: {answers:?}");
}

/// Checks sent right behind `auth`, before its answer, are served as proved: each runs
/// after the `auth` before it, although checks on Redis run concurrently.
#[test]
fn checks_sent_right_behind_auth_are_served_as_proved() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &[]);
    let k = key("binance", Some("behind-auth"));
    let limit = json!({"capacity": 100, "refill_per_sec": 0.001});
    let mut client = server.connect_unproved();
    let hello = client.call(json!({"op": "hello"}));
    let nonce = hello["auth"]["nonce"]
        .as_str()
        .expect("a nonce")
        .to_string();
    let proof = common::proof(common::SECRET.as_bytes(), &nonce);
    let mut burst = json!({"op": "auth", "proof": proof}).to_string();
    let n = 20;
    for id in 0..n {
        let mut request = check(&k, limit.clone(), 1.0);
        request["id"] = json!(id);
        burst.push('\n');
        burst.push_str(&request.to_string());
    }
    burst.push('\n');
    client.send_raw(burst.as_bytes());
    assert_eq!(client.recv(), json!({"ok": true}));
    for _ in 0..n {
        let answer = client.recv();
        assert_eq!(answer["result"], "admitted", "{answer}");
    }
}

/// Checks sharing a script call read their exchange's pauses once for the whole call, not
/// once per check: 64 checks of 64 credentials (one bucket each, known, no pause) cost
/// Redis their bucket's reads and writes and little more. A pause still holds them.
#[test]
fn checks_sharing_a_call_read_their_pauses_once() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &[]);
    let mut t = server.connect();
    let limit = json!({"capacity": 100, "refill_per_sec": 0.001});
    let n = 64;
    let keys: Vec<Value> = (0..n)
        .map(|i| key("shared", Some(&format!("k{i}"))))
        .collect();
    for k in &keys {
        assert_eq!(t.call(check(k, limit.clone(), 1.0))["result"], "admitted");
    }
    let _: () = redis.query(::redis::cmd("CONFIG").arg("RESETSTAT"));
    let checks = keys.iter().map(|k| check(k, limit.clone(), 1.0));
    let answers = pipelined_while_stopped(&redis, &mut t, checks, WhileStopped::Waiting);
    assert!(
        answers.iter().all(|a| a["result"] == "admitted"),
        "{answers:?}"
    );
    let (commands, stats) = script_commands(&redis);
    let calls = ["fcall", "evalsha", "eval"]
        .iter()
        .map(|command| calls_of(&redis, command))
        .sum::<u64>();
    eprintln!("{n} checks in {calls} calls: {commands} commands");
    assert!(calls < n / 4, "{calls} calls for {n} checks");
    // Per call 2 (its run marker's GET and SET), 1 reading the exchange marker's expiry
    // (PTTL) and 1 the pauses (HLEN, none held); per bucket HMGET, HSET and, unless paid
    // within the last second, PEXPIRE.
    assert!(
        commands <= calls * 4 + n * 3,
        "{commands} commands:\n{stats}"
    );
    // Paused: every check of the exchange is told to wait, whatever the call.
    let pause = json!({"op": "pause", "target": {"exchange": "shared"}, "ms": 60_000});
    assert_eq!(t.call(pause), json!({"ok": true}));
    let checks = keys.iter().map(|k| check(k, limit.clone(), 1.0));
    let answers = pipelined_while_stopped(&redis, &mut t, checks, WhileStopped::Waiting);
    assert!(
        answers.iter().all(|a| a["result"] == "delay"),
        "{answers:?}"
    );
}

/// A bucket checked again within a second, without bookings, costs Redis its read and its
/// write: its `k` field shows it has no bookings and is kept long enough. Once something
/// else writes its tokens (an older daemon's script, say), the next check reads its
/// bookings and renews its expiry again.
#[test]
fn a_bucket_paid_again_without_bookings_is_read_and_written_only() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &[]);
    let mut t = server.connect();
    let limit = json!({"capacity": 100, "refill_per_sec": 0.001});
    let k = key("kept", Some("k"));
    assert_eq!(t.call(check(&k, limit.clone(), 1.0))["result"], "admitted");
    let _: () = redis.query(::redis::cmd("CONFIG").arg("RESETSTAT"));
    let n = 20;
    for _ in 0..n {
        assert_eq!(t.call(check(&k, limit.clone(), 1.0))["result"], "admitted");
    }
    assert_eq!(calls_of(&redis, "zrange"), 0);
    assert_eq!(
        (calls_of(&redis, "hmget"), calls_of(&redis, "hset")),
        (n, n)
    );
    // At most one renewal, should the machine stall the loop for most of a second.
    assert!(calls_of(&redis, "pexpire") <= 1);
    let names: Vec<String> = redis.query(::redis::cmd("KEYS").arg("bourse:{4:kept}:b:*"));
    let [bucket] = names.as_slice() else {
        panic!("{names:?}")
    };
    let _: () = redis.query(::redis::cmd("HSET").arg(bucket).arg("t").arg(1));
    let _: () = redis.query(::redis::cmd("CONFIG").arg("RESETSTAT"));
    assert_eq!(t.call(check(&k, limit.clone(), 1.0))["result"], "admitted");
    assert_eq!(calls_of(&redis, "zrange"), 1);
    assert_eq!(calls_of(&redis, "pexpire"), 1);
}

/// A bucket known to have no bookings, then booked by a later check of the same script
/// call (one `now` for both): the next calls still find that booking, drop it when it
/// lapses, and count it.
#[test]
fn a_booking_made_in_the_call_that_found_none_lapses_and_is_counted() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &["--booking-slack-ms", "1"]);
    let mut t = server.connect();
    // Two tokens, one a second: the last check of the call books a wait of about 1 s.
    let limit = json!({"capacity": 2, "refill_per_sec": 1});
    let calls = || calls_of(&redis, "fcall") + calls_of(&redis, "evalsha");
    // How the daemon reads the checks sent at once decides which share a call: on a loaded
    // machine it may read the last one alone. Tried again, on fresh keys, until the last
    // two share one.
    for attempt in 0..10 {
        let k = key("okx", Some(&format!("same-call-{attempt}")));
        let waiter = |owner: u64| json!({"op": "check", "key": k, "limit": limit, "owner": owner, "max_wait_ms": 60_000});
        assert_eq!(t.call(waiter(1))["result"], "admitted");
        let before = calls();
        // The first two checks are sent at once, each in its own call; the last two share
        // the next.
        let other = |name: &str| {
            check(
                &key("okx", Some(&format!("{name}-{attempt}"))),
                limit.clone(),
                1.0,
            )
        };
        let checks = [other("x"), other("y"), waiter(2), waiter(3)];
        let mut answers =
            pipelined_while_stopped(&redis, &mut t, checks.into_iter(), WhileStopped::Waiting);
        answers.sort_by_key(|answer| answer["id"].as_u64());
        let results: Vec<&Value> = answers.iter().map(|a| &a["result"]).collect();
        assert_eq!(results[..2], ["admitted", "admitted"]);
        // The two checks of one call run in either order.
        let booked = match (results[2].as_str(), results[3].as_str()) {
            (Some("admitted"), Some("booked")) => 3,
            (Some("booked"), Some("admitted")) => 2,
            _ => panic!("{answers:?}"),
        };
        if calls() - before != 3 {
            eprintln!("attempt {attempt}: the last two checks went in calls of their own");
            continue;
        }
        sleep_ms(ms(&answers[booked as usize]) + 200);
        // The booking's owner comes back past its slack: the booking lapsed, it books again.
        assert_eq!(t.call(waiter(booked))["result"], "booked");
        assert_eq!(t.call(json!({"op": "stats"}))["stats"]["lapsed"], 1);
        return;
    }
    panic!("the last two checks never shared a call");
}

/// The script remembers the numbers it parsed and formatted (from call to call, as a
/// function library) and starts again past 1024 of them: 1,500 distinct costs, several
/// times over, pay exactly what they say.
#[test]
fn many_distinct_costs_are_each_paid_exactly() {
    let Some(redis) = Redis::start() else { return };
    let url = redis.url();
    let flags = [&["--redis", url.as_str()][..], &PATIENT].concat();
    let mut stdio = StdioDaemon::start(&flags);
    let k = key("costs", Some("k"));
    let limit = json!({"capacity": 1e9, "refill_per_sec": 0.001});
    let costs: Vec<f64> = (0..1500).map(|i| 1.0 + i as f64 / 4.0).collect();
    for round in 0..2 {
        for chunk in costs.chunks(250) {
            for (id, cost) in chunk.iter().enumerate() {
                let mut request = check(&k, limit.clone(), *cost);
                request["id"] = json!(id);
                stdio.send_frame(&serde_json::to_vec(&request).unwrap());
            }
            for _ in chunk {
                let answer = stdio.recv_frame().unwrap();
                assert_eq!(answer["result"], "admitted", "{answer}");
            }
        }
        let paid = borrowed(&mut stdio, &k);
        let expected = costs.iter().sum::<f64>() * (round + 1) as f64;
        assert!(
            (paid - expected).abs() < 0.01,
            "paid {paid}, expected {expected}"
        );
    }
}

/// The library and the script flushed again and again (`FUNCTION FLUSH`, `SCRIPT FLUSH`)
/// while two daemons' pipelined checks flow: every check is answered once, under its own
/// id, each admitted check is paid once and nothing else is paid (a call that found the
/// function missing did not run; sent again after the reload, it runs once).
#[test]
fn checks_under_load_survive_the_library_flushed_again_and_again() {
    let Some(redis) = Redis::with_functions() else {
        return;
    };
    let daemons: Vec<Server> = (0..2).map(|_| daemon(&redis, &[])).collect();
    let k = key("flush", Some("k"));
    let limit = json!({"capacity": 150, "refill_per_sec": 0.001});
    let done = std::sync::atomic::AtomicBool::new(false);
    let (admitted, flushes) = thread::scope(|scope| {
        let flusher = scope.spawn(|| {
            let mut flushes = 0;
            let mut connection = redis.connection().expect("connect to redis");
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                for flush in ["FUNCTION", "SCRIPT"] {
                    let _: () = ::redis::cmd(flush)
                        .arg("FLUSH")
                        .query(&mut connection)
                        .unwrap();
                    flushes += 1;
                }
                sleep_ms(1);
            }
            flushes
        });
        let workers: Vec<_> = daemons
            .iter()
            .flat_map(|server| [server, server])
            .map(|server| {
                let (k, limit) = (&k, &limit);
                scope.spawn(move || {
                    let mut t = server.connect();
                    let mut admitted = 0;
                    for _ in 0..4 {
                        for (answer, _) in burst(25, k, limit, &mut t) {
                            match load::classify(&answer) {
                                "admitted" => admitted += 1,
                                kind => assert_eq!(kind, "delay", "{answer}"),
                            }
                        }
                    }
                    admitted
                })
            })
            .collect();
        let admitted: usize = workers.into_iter().map(|w| w.join().unwrap()).sum();
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        (admitted, flusher.join().unwrap())
    });
    let loads = calls_of(&redis, "function|load") + calls_of(&redis, "script|load");
    eprintln!("400 checks, {admitted} admitted, {flushes} flushes, {loads} loads meanwhile");
    // The daemons found what they call missing, more than once.
    assert!(loads > 2, "{loads} loads");
    assert_eq!(admitted, 150);
    let mut t = daemons[0].connect();
    assert!((borrowed(&mut t, &k) - 150.0).abs() < 0.01);
}

/// Checks of one exchange sharing a script call, each held by its own pauses: two
/// credentials paused for different times, a key paused beside an axis of the same
/// credential that is not, and a credential without pause. Each is told its own wait,
/// whether the call read the pauses hash whole or (past 64 pauses) by field.
#[test]
fn checks_sharing_a_call_are_each_held_by_their_own_pauses() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &[]);
    let mut t = server.connect();
    let limit = json!({"capacity": 100, "refill_per_sec": 0.001});
    for others in [0, 70] {
        let exchange = format!("own{others}");
        let target = |credential: &str, axis: Option<&str>| match axis {
            Some(axis) => json!({"exchange": exchange, "credential": credential, "axis": axis}),
            None => json!({"exchange": exchange, "credential": credential}),
        };
        let pause = |t: &mut LineClient<TcpStream>, target: Value, ms: u64| {
            let answer = t.call(json!({"op": "pause", "target": target, "ms": ms}));
            assert_eq!(answer["ok"], true, "{answer}");
        };
        for i in 0..others {
            pause(&mut t, target(&format!("other{i}"), None), 600_000);
        }
        pause(&mut t, target("a", None), 60_000);
        pause(&mut t, target("b", None), 30_000);
        pause(&mut t, target("d", Some("held")), 45_000);
        let keyed = |credential: &str, axis: &str| json!({"exchange": exchange, "credential": credential, "axis": axis});
        let keys = [
            keyed("a", "x"),
            keyed("b", "x"),
            keyed("c", "x"),
            keyed("d", "held"),
            keyed("d", "free"),
        ];
        let checks = keys.iter().map(|k| check(k, limit.clone(), 1.0));
        let mut answers = pipelined_while_stopped(&redis, &mut t, checks, WhileStopped::Waiting);
        answers.sort_by_key(|answer| answer["id"].as_u64());
        let waits: Vec<Option<u64>> = answers
            .iter()
            .map(|answer| (answer["result"] == "delay").then(|| ms(answer)))
            .collect();
        let about = |wait: Option<u64>, exact: u64| {
            wait.is_some_and(|wait| wait <= exact && wait + 10_000 > exact)
        };
        let what = format!("{others} other pauses: {answers:?}");
        assert!(about(waits[0], 60_000), "{what}");
        assert!(about(waits[1], 30_000), "{what}");
        assert_eq!(answers[2]["result"], "admitted", "{what}");
        assert!(about(waits[3], 45_000), "{what}");
        assert_eq!(answers[4]["result"], "admitted", "{what}");
    }
}

/// More credentials than a daemon keeps fingerprints of (4096), cycling through two daemons
/// sharing one Redis, between checks of one hot credential: its fingerprint, computed again
/// after each eviction, names the same bucket, which admits its capacity and no more.
#[test]
fn a_credential_keeps_its_bucket_while_the_fingerprint_cache_churns() {
    let Some(redis) = Redis::start() else { return };
    let daemons: Vec<Server> = (0..2).map(|_| daemon(&redis, &[])).collect();
    let mut clients: Vec<_> = daemons.iter().map(Server::connect).collect();
    let hot = key("churn", Some("hot"));
    let limit = json!({"capacity": 10, "refill_per_sec": 0.001});
    let mut admitted = 0;
    for round in 0..6 {
        for (n, t) in clients.iter_mut().enumerate() {
            let cold = (0..1500).map(|i| {
                let mut request = check(
                    &key("churn", Some(&format!("cold{round}-{n}-{i}"))),
                    limit.clone(),
                    1.0,
                );
                request["id"] = json!(i);
                request
            });
            let mut batch = String::new();
            for request in cold {
                batch.push_str(&request.to_string());
                batch.push('\n');
            }
            t.send_raw(batch.as_bytes());
            for _ in 0..1500 {
                assert_eq!(t.recv()["result"], "admitted");
            }
            for _ in 0..2 {
                if t.call(check(&hot, limit.clone(), 1.0))["result"] == "admitted" {
                    admitted += 1;
                }
            }
        }
    }
    // 6 rounds x 2 daemons x 2 checks, past 4096 credentials on each daemon.
    assert_eq!(admitted, 10);
    assert!((borrowed(&mut clients[0], &hot) - 10.0).abs() < 0.01);
    assert!((borrowed(&mut clients[1], &hot) - 10.0).abs() < 0.01);
    // Only fingerprints name them in Redis.
    for credential in ["*hot*", "*cold*"] {
        let named: Vec<String> = redis.query(::redis::cmd("KEYS").arg(credential));
        assert!(named.is_empty(), "{named:?}");
    }
    let keys: Vec<String> = redis.query(::redis::cmd("KEYS").arg("*churn*"));
    assert!(keys.len() > 2 * 6 * 1500, "{} keys", keys.len());
}

/// Each database keeps its own exchange markers alive: the function library is shared by
/// every database of a server, and what one database's calls learn of their marker says
/// nothing of another's (daemons on `/1` and `/2` with the same prefix).
#[test]
fn each_database_keeps_its_own_markers_past_its_buckets() {
    let Some(redis) = Redis::start() else { return };
    let server = |db: u8| {
        let url = format!("{}/{db}", redis.url());
        let mut args = vec!["--redis", url.as_str()];
        args.extend_from_slice(&PATIENT);
        Server::tcp(&args)
    };
    let (one, two) = (server(1), server(2));
    let (mut a, mut b) = (one.connect(), two.connect());
    let short = json!({"capacity": 5, "refill_per_sec": 5});
    let long = json!({"capacity": 1e12, "refill_per_sec": 1e-3});
    let admitted = |t: &mut LineClient<TcpStream>, axis: &str, limit: &Value| {
        let k = json!({"exchange": "binance", "credential": "k", "axis": axis});
        assert_eq!(t.call(check(&k, limit.clone(), 1.0))["result"], "admitted");
    };
    admitted(&mut b, "short", &short);
    admitted(&mut a, "long", &long);
    admitted(&mut b, "long", &long);
    let db2 = ::redis::Client::open(format!("{}/2", redis.url())).unwrap();
    let mut db2 = db2.get_connection().unwrap();
    let markers: Vec<String> = ::redis::cmd("KEYS").arg("*:e{*").query(&mut db2).unwrap();
    assert_eq!(markers.len(), 1, "{markers:?}");
    let marker: i64 = ::redis::cmd("PTTL")
        .arg(&markers[0])
        .query(&mut db2)
        .unwrap();
    let keys: Vec<String> = ::redis::cmd("KEYS").arg("*").query(&mut db2).unwrap();
    for k in keys.iter().filter(|k| !k.contains(":e{")) {
        let left: i64 = ::redis::cmd("PTTL").arg(k).query(&mut db2).unwrap();
        assert!(marker >= left, "marker {marker} ms, key of db 2 {left} ms");
    }
}

/// A booking held by a pause and held again by a longer one after another waiter booked
/// behind it may not go out with that waiter beyond the capacity (as in bourse_core's
/// `a_booking_held_again_does_not_go_out_with_one_booked_behind_it_beyond_the_capacity`).
#[test]
fn a_booking_held_again_does_not_go_out_with_one_booked_behind_it() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &[]);
    let mut t = server.connect();
    let k = key("okx", Some("again"));
    let limit = json!({"capacity": 3, "refill_per_sec": 4});
    let waiter = |owner: u64, cost: f64| json!({"op": "check", "key": k, "limit": limit, "cost": cost, "owner": owner, "max_wait_ms": 5000});
    let pause = |ms: u64| json!({"op": "pause", "target": {"exchange": "okx", "credential": "again"}, "ms": ms});
    assert_eq!(t.call(check(&k, limit.clone(), 3.0))["result"], "admitted");
    let started = Instant::now();
    assert_eq!(t.call(waiter(1, 3.0))["result"], "booked");
    assert_eq!(t.call(pause(1000))["ok"], true);
    let b = t.call(waiter(2, 1.0));
    assert_eq!(b["result"], "booked", "{b}");
    assert_eq!(t.call(pause(1100))["ok"], true);
    let a = t.call(waiter(1, 3.0));
    assert_eq!(a["result"], "delay", "{a}");
    let mut due = vec![(ms(&a), 1u64, 3.0), (ms(&b), 2, 1.0)];
    let mut claimed = vec![];
    while !due.is_empty() {
        due.sort_by_key(|d| d.0);
        let (at, owner, cost) = due.remove(0);
        sleep_ms(at.saturating_sub(started.elapsed().as_millis() as u64));
        let answer = t.call(waiter(owner, cost));
        let now = started.elapsed().as_millis() as u64;
        match answer["result"].as_str() {
            Some("claimed") => claimed.push(now),
            Some("delay") => due.push((now + ms(&answer), owner, cost)),
            _ => panic!("{answer}"),
        }
    }
    let apart = claimed[1] - claimed[0];
    assert!(
        apart >= 150,
        "4 tokens within {apart} ms on a 3-token bucket refilling 4/s"
    );
}
/// A check that fails in Redis (a key of another type among its buckets, read after a
/// pause's hold would have paid another bucket's bookings again) writes nothing: its
/// bookings are held by the next check as if it never ran. Before, the moved bookings
/// stayed and the bucket's tokens did not: 4 tokens went out at one instant on a bucket
/// of 2 (P1).
#[test]
fn a_check_failing_in_redis_leaves_no_held_booking_behind() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &["--booking-slack-ms", "60000"]);
    let mut t = server.connect();
    let limit = json!({"capacity": 2, "refill_per_sec": 10});
    let ip = json!({"exchange": "okx", "credential": null, "axis": "ip"});
    let bad = json!({"exchange": "okx", "credential": null, "axis": "zzz"});
    let _: () = redis.query(::redis::cmd("SET").arg("bourse:{3:okx}:b:-:3:zzz").arg("x"));
    let waiter = json!({"op": "check", "key": ip, "limit": limit, "cost": 2, "owner": 1, "max_wait_ms": 60_000});
    assert_eq!(t.call(check(&ip, limit.clone(), 2.0))["result"], "admitted");
    assert_eq!(t.call(waiter.clone())["result"], "booked");
    // The owner is late: the bucket refills to its cap beside the due booking, a payment
    // for good takes the booking's refund to 0.
    sleep_ms(600);
    assert_eq!(t.call(check(&ip, limit.clone(), 0.0))["result"], "admitted");
    let paused = t.call(json!({"op": "pause", "target": {"exchange": "okx"}, "ms": 1000}));
    assert_eq!(paused["ok"], true, "{paused}");
    for (x, y) in [(&ip, &bad), (&bad, &ip)] {
        let failed = t.call(json!({"op": "check_many", "checks": [
            {"key": x, "limit": limit, "cost": 1}, {"key": y, "limit": limit, "cost": 1},
        ]}));
        assert_eq!(load::classify(&failed), "unavailable", "{failed}");
    }
    sleep_ms(1100);
    assert_eq!(t.call(waiter)["result"], "claimed");
    let probe = t.call(check(&ip, limit.clone(), 2.0));
    assert_eq!(
        probe["result"], "delay",
        "P1: 4 tokens out at once on a bucket of 2: {probe}"
    );
}

/// A check that fails in Redis on a new exchange (a new bucket, then a key of another type)
/// leaves no key without an expiry: its exchange's marker is written only once every key
/// was read, and with its lifetime.
#[test]
fn a_check_failing_in_redis_leaves_no_key_without_an_expiry() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &[]);
    let mut t = server.connect();
    let limit = json!({"capacity": 2, "refill_per_sec": 10});
    let ip = json!({"exchange": "new", "credential": null, "axis": "ip"});
    let bad = json!({"exchange": "new", "credential": null, "axis": "zzz"});
    let _: () = redis.query(
        ::redis::cmd("SET")
            .arg("bourse:{3:new}:b:-:3:zzz")
            .arg("x")
            .arg("PX")
            .arg(600_000),
    );
    for (x, y) in [(&ip, &bad), (&bad, &ip)] {
        let failed = t.call(json!({"op": "check_many", "checks": [
            {"key": x, "limit": limit, "cost": 1}, {"key": y, "limit": limit, "cost": 1},
        ]}));
        assert_eq!(load::classify(&failed), "unavailable", "{failed}");
    }
    let names: Vec<String> = redis.query(::redis::cmd("KEYS").arg("*"));
    for name in names {
        let ttl: i64 = redis.query(::redis::cmd("PTTL").arg(&name));
        assert!(ttl > 0, "{name} kept forever ({ttl})");
    }
}

/// A waiter's check whose new bucket has a key of another type under its bookings' name
/// fails before it books anywhere: its other bucket pays nothing.
#[test]
fn a_waiter_failing_on_a_bookings_key_books_nothing() {
    let Some(redis) = Redis::start() else { return };
    let server = daemon(&redis, &[]);
    let mut t = server.connect();
    let limit = json!({"capacity": 1, "refill_per_sec": 1});
    let ip = json!({"exchange": "okx", "credential": null, "axis": "ip"});
    let bad = json!({"exchange": "okx", "credential": null, "axis": "zzz"});
    let _: () = redis.query(::redis::cmd("SET").arg("bourse:{3:okx}:w:-:3:zzz").arg("x"));
    assert_eq!(t.call(check(&ip, limit.clone(), 1.0))["result"], "admitted");
    let before = borrowed(&mut t, &ip);
    let failed = t.call(
        json!({"op": "check_many", "owner": 1, "max_wait_ms": 60_000, "checks": [
            {"key": ip, "limit": limit, "cost": 1}, {"key": bad, "limit": limit, "cost": 1},
        ]}),
    );
    assert_eq!(load::classify(&failed), "unavailable", "{failed}");
    assert!(borrowed(&mut t, &ip) <= before, "{failed}");
}

/// A script answering a word where `OK` (or a debit's answer) is due (a Redis whose library
/// was replaced, or a server in its place): a debit, a pause or a reset is `unavailable`,
/// never taken as done.
#[test]
fn a_script_answer_other_than_ok_is_no_success() {
    let Some(redis) = Redis::with_functions() else {
        return;
    };
    let server = daemon(&redis, &[]);
    let mut t = server.connect();
    let k = key("ok", Some("k"));
    assert_eq!(
        t.call(check(&k, json!({"requests": 5}), 1.0))["result"],
        "admitted"
    );
    let libraries: Vec<Vec<::redis::Value>> = redis.query(::redis::cmd("FUNCTION").arg("LIST"));
    let fields = &libraries[0];
    let at = fields
        .iter()
        .position(|field| matches!(field, ::redis::Value::BulkString(b) if b == b"library_name"))
        .expect("a library_name field");
    let ::redis::Value::BulkString(name) = &fields[at + 1] else {
        panic!("{fields:?}")
    };
    let name = String::from_utf8(name.clone()).unwrap();
    let admitted = "function() return 'admitted' end";
    let library = format!(
        "#!lua name={name}\nredis.register_function('{name}', {admitted})\n\
         redis.register_function{{function_name='{name}_ro', callback={admitted}, \
         flags={{'no-writes'}}}}"
    );
    let _: String = redis.query(
        ::redis::cmd("FUNCTION")
            .arg("LOAD")
            .arg("REPLACE")
            .arg(library),
    );
    for request in [
        json!({"op": "record", "key": k, "cost": 1}),
        json!({"op": "reset", "key": k}),
        json!({"op": "pause", "target": {"exchange": "okx", "credential": "k"}, "ms": 100}),
    ] {
        let answer = t.call(request);
        assert_eq!(answer["error"]["type"], "unavailable", "{answer}");
        let message = answer["error"]["message"].as_str().unwrap();
        assert!(message.contains("answered 8 bytes where"), "{message}");
    }
}

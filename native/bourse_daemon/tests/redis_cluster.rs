//! `--redis-cluster`: the buckets in a real Redis Cluster (three masters, three replicas)
//! started by each test on loopback, shared by several daemon processes; a master killed
//! under load, a slot moved under load.
//!
//! The tests skip, saying so, only where no cluster can be created (`redis-server` or a
//! `redis-cli` with `--cluster` missing). Time is the Redis servers' real clock.

mod cluster_support;
mod common;

use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use cluster_support::{key_slot, Cluster};
use common::load::{assert_conforms, assert_multi_bucket_checks_atomic, count, load, Answer};
use common::proxy::SwallowingProxy;
use common::{borrowed, check, eventually, key, Server, Transport};

/// A server-mode daemon on `cluster` through two of its nodes as seeds.
fn daemon(cluster: &Cluster, extra: &[&str]) -> Server {
    let urls = cluster.urls();
    let mut args = vec!["--redis-cluster", &urls[0], "--redis-cluster", &urls[3]];
    args.extend_from_slice(extra);
    Server::tcp(&args)
}

/// The port of the live master holding a key whose name contains `part`.
fn master_holding(cluster: &Cluster, part: &str) -> u16 {
    masters(cluster)
        .into_iter()
        .find(|&port| {
            cluster
                .query::<Vec<String>>(port, ::redis::cmd("KEYS").arg("*"))
                .unwrap_or_default()
                .iter()
                .any(|name| name.contains(part))
        })
        .unwrap_or_else(|| panic!("no master holds a key with {part:?}"))
}

#[test]
fn a_cluster_serves_every_op_shares_buckets_and_keeps_checks_atomic() {
    // A daemon started before the cluster: unavailable at once, served once it is up.
    let first = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let early = Server::tcp(&[
        "--redis-cluster",
        &format!("redis://127.0.0.1:{first}"),
        "--redis-timeout-ms",
        "300",
    ]);
    let mut e = early.connect();
    let k = key("early", None);
    let started = Instant::now();
    let answer = e.call(check(&k, json!({"requests": 5}), 1.0));
    assert_eq!(answer["error"]["type"], "unavailable", "{answer}");
    assert!(started.elapsed() < Duration::from_secs(5));
    let Some(cluster) = Cluster::start_at(first, 2000) else {
        return;
    };
    common::eventually("the early daemon is served by the cluster", || {
        e.call(check(&k, json!({"requests": 5}), 1.0))["result"] == "admitted"
    });
    let server = daemon(&cluster, &[]);
    common::exercise_every_op(&mut server.connect());
    common::exercise_bad_requests(&mut server.connect());
    let mut t = server.connect();

    // Buckets of many exchanges land on every master; table-wide ops see them all.
    let slow = json!({"capacity": 5, "refill_per_sec": 0.001});
    for n in 0..30 {
        let k = key(&format!("exchange{n}"), Some("k"));
        assert_eq!(t.call(check(&k, slow.clone(), 2.0))["result"], "admitted");
    }
    let holding: std::collections::BTreeSet<u16> = (0..30)
        .map(|n| master_holding(&cluster, &format!("exchange{n}}}")))
        .collect();
    assert_eq!(
        holding.len(),
        3,
        "the exchanges should spread over the masters"
    );
    let stats = t.call(json!({"op": "stats"}))["stats"].clone();
    assert_eq!(stats["buckets"], 30, "{stats}");
    let busiest = t.call(json!({"op": "busiest", "count": 100}));
    assert_eq!(busiest["keys"].as_array().unwrap().len(), 30);
    assert_eq!(
        t.call(json!({"op": "reset_exchange", "exchange": "exchange7"})),
        json!({"ok": true})
    );
    assert_eq!(borrowed(&mut t, &key("exchange7", Some("k"))), 0.0);
    assert!(borrowed(&mut t, &key("exchange8", Some("k"))) > 1.9);

    // A check over two exchanges would span slots: refused, nothing paid.
    let a = key("exchange1", Some("k"));
    let b = key("exchange2", Some("k"));
    let spanning = t.call(json!({"op": "check_many", "checks": [
        {"key": a, "limit": slow}, {"key": b, "limit": slow},
    ]}));
    assert_eq!(
        spanning["error"]["type"], "invalid_parameters",
        "{spanning}"
    );
    assert!(
        spanning["error"]["message"]
            .as_str()
            .unwrap()
            .contains("one exchange"),
        "{spanning}"
    );
    // Named: the first check of another exchange.
    assert_eq!(spanning["error"]["exchange"], "exchange2", "{spanning}");
    assert!((borrowed(&mut t, &a) - 2.0).abs() < 0.01);

    // Scripts flushed from every node (as after a restart): loaded again, nothing refused.
    for url in cluster.urls() {
        let port: u16 = url.rsplit(':').next().unwrap().parse().unwrap();
        let _: Option<String> = cluster.query(port, ::redis::cmd("SCRIPT").arg("FLUSH"));
    }
    for n in 0..6 {
        let k = key(&format!("exchange{n}"), Some("k"));
        assert_eq!(t.call(check(&k, slow.clone(), 1.0))["result"], "admitted");
    }

    // A dead seed among the seeds: the live one is enough.
    let dead = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dead_url = format!("redis://127.0.0.1:{dead}");
    let live_url = cluster.urls()[1].clone();
    let seeded = Server::tcp(&["--redis-cluster", &dead_url, "--redis-cluster", &live_url]);
    assert!((borrowed(&mut seeded.connect(), &key("exchange8", Some("k"))) - 2.0).abs() < 0.01);

    // Several daemons, concurrent multi-bucket checks over one credential's bucket and the
    // exchange's public ip bucket: all buckets paid or none (P4).
    let daemons: Vec<Server> = (0..3).map(|_| daemon(&cluster, &[])).collect();
    assert_multi_bucket_checks_atomic(&daemons, "atomic");

    // Two daemons hammering one bucket through the cluster stay within C + r*T (P1).
    let (capacity, refill) = (20.0, 50.0);
    let shared = key("binance", Some("shared"));
    let limit = json!({"capacity": capacity, "refill_per_sec": refill});
    let started = Instant::now();
    let stop = Duration::from_secs(2);
    let answers = load(&daemons[..2], 2, &shared, &limit, started, stop, || ());
    let elapsed = started.elapsed().as_secs_f64();
    let admitted = count(&answers, "admitted");
    assert_conforms(
        admitted,
        capacity,
        refill,
        elapsed,
        "2 daemons x 2 clients on the cluster",
    );

    assert_eq!(t.call(json!({"op": "reset_all"})), json!({"ok": true}));
    assert_eq!(t.call(json!({"op": "stats"}))["stats"]["buckets"], 0);
    let left: Vec<String> = cluster
        .keys()
        .into_iter()
        .filter(|name| name.contains(":b:") || name.contains(":w:"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// A master killed under load: while no master serves its slot, answers are `unavailable`
/// within the Redis timeout (nothing admitted, nothing hangs); once its replica has taken
/// over, checks are admitted again by themselves.
///
/// Replication is asynchronous: here the replica is cut off (stopped, its link closed)
/// just before the load drains two full buckets, so the replica that takes over holds them
/// full again. Through a daemon without options that costs one capacity more than
/// C + r*T; through one with --assume-busy-at-start, a bucket last paid under another master
/// starts as if empty when the new one took over, and stays within C + r*T.
#[test]
fn a_cluster_of_one_node_serves_table_wide_ops() {
    // Its node never met another, so it shows no address of its own.
    let Some(cluster) = Cluster::start_one_node() else {
        return;
    };
    let server = Server::tcp(&["--redis-cluster", &cluster.urls()[0]]);
    let mut t = server.connect();
    let slow = json!({"capacity": 5, "refill_per_sec": 0.001});
    for exchange in ["one", "two"] {
        let k = key(exchange, Some("k"));
        assert_eq!(t.call(check(&k, slow.clone(), 2.0))["result"], "admitted");
    }
    let stats = t.call(json!({"op": "stats"}));
    assert_eq!(stats["stats"]["buckets"], 2, "{stats}");
    let busiest = t.call(json!({"op": "busiest", "count": 10}));
    assert_eq!(
        busiest["keys"].as_array().map(Vec::len),
        Some(2),
        "{busiest}"
    );
    let reset = t.call(json!({"op": "reset_exchange", "exchange": "one"}));
    assert_eq!(reset, json!({"ok": true}));
    assert_eq!(borrowed(&mut t, &key("one", Some("k"))), 0.0);
    assert!(borrowed(&mut t, &key("two", Some("k"))) > 1.9);
    assert_eq!(t.call(json!({"op": "reset_all"})), json!({"ok": true}));
    assert_eq!(borrowed(&mut t, &key("two", Some("k"))), 0.0);

    // A seed's URL naming another database is refused at start.
    let on_db_3 = format!("{}/3", cluster.urls()[0]);
    let refused = std::process::Command::new(common::DAEMON)
        .args(["--listen", "127.0.0.1:0", "--redis-cluster", &on_db_3])
        .env("BOURSE_DAEMON_SECRET", common::SECRET)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("a Redis Cluster has database 0 only"),
        "{stderr}"
    );
}

#[test]
fn a_master_killed_under_load_fails_over() {
    let Some(mut cluster) = Cluster::start(1000) else {
        return;
    };
    let timeout_ms = 500;
    let timeout = timeout_ms.to_string();
    let plain = daemon(&cluster, &["--redis-timeout-ms", &timeout]);
    let busy = daemon(
        &cluster,
        &["--redis-timeout-ms", &timeout, "--assume-busy-at-start"],
    );
    let (capacity, refill) = (20.0, 2.0);
    let limit = json!({"capacity": capacity, "refill_per_sec": refill});
    let plain_key = key("failover", Some("plain"));
    let busy_key = key("failover", Some("busy"));
    // Both buckets exist, full, on the master and its replica. The busy daemon's bucket
    // starts empty (its exchange's state just began, for it) and fills at once under a fast
    // refill; paid a little just before, it is not as new, and the load's definition then
    // keeps its tokens.
    let mut b = busy.connect();
    let fast = json!({"capacity": capacity, "refill_per_sec": 1000});
    assert_eq!(
        b.call(check(&busy_key, fast.clone(), 0.0))["result"],
        "admitted"
    );
    thread::sleep(Duration::from_millis(100));
    assert_eq!(b.call(check(&busy_key, fast, 0.001))["result"], "admitted");
    assert_eq!(
        b.call(check(&busy_key, limit.clone(), 0.0))["result"],
        "admitted"
    );
    let mut t = plain.connect();
    assert_eq!(
        t.call(check(&plain_key, limit.clone(), 0.0))["result"],
        "admitted"
    );
    for (t, k) in [(&mut t, &plain_key), (&mut b, &busy_key)] {
        let tokens = t.call(json!({"op": "inspect", "key": k}))["info"]["tokens"].clone();
        assert!(tokens.as_f64().unwrap() > capacity - 0.1, "{tokens}");
    }
    let victim = master_holding(&cluster, "failover}");
    cluster.wait_healthy();
    let slot = cluster_support::key_slot(
        cluster
            .keys()
            .iter()
            .find(|name| name.contains("failover}"))
            .unwrap()
            .as_bytes(),
    );
    let replica = cluster.cut_replica(victim);

    let started = Instant::now();
    let kill_at = Duration::from_millis(500);
    let stop = Duration::from_secs(6);
    let mut killed = Duration::ZERO;
    // The last moment the slot was seen without a live master.
    let mut masterless = Duration::ZERO;
    let (plain_answers, busy_answers) = thread::scope(|scope| {
        let plain_load =
            scope.spawn(|| load(&[plain], 2, &plain_key, &limit, started, stop, || ()));
        let busy_load = scope.spawn(|| load(&[busy], 2, &busy_key, &limit, started, stop, || ()));
        thread::sleep(kill_at);
        killed = started.elapsed();
        cluster.kill(victim);
        cluster.signal(replica, "CONT");
        while started.elapsed() < stop && !served(&cluster, slot, victim) {
            masterless = started.elapsed();
            thread::sleep(Duration::from_millis(20));
        }
        (plain_load.join().unwrap(), busy_load.join().unwrap())
    });
    let elapsed = started.elapsed().as_secs_f64();
    let bound = capacity + refill * elapsed;
    let report = |name: &str, answers: &[Answer]| {
        let unavailable: Vec<&Answer> =
            answers.iter().filter(|a| a.kind == "unavailable").collect();
        let last_unavailable = unavailable.iter().map(|a| a.at).max();
        let recovered = answers
            .iter()
            .filter(|a| a.kind != "unavailable" && Some(a.at - a.took) > last_unavailable)
            .map(|a| a.at - a.took)
            .min();
        let slowest = answers.iter().map(|a| a.took).max().unwrap();
        let admitted = count(answers, "admitted");
        eprintln!(
            "failover ({name}): {} answers in {elapsed:.1} s, master killed at {:.2} s: \
             {} unavailable, no master until {masterless:?}, answered again {:?} after the \
             kill, slowest answer {slowest:?} (timeout {timeout_ms} ms); admitted {admitted} \
             vs C + r*T = {bound:.1}",
            answers.len(),
            killed.as_secs_f64(),
            unavailable.len(),
            recovered.map(|r| r.saturating_sub(killed)),
        );
        assert!(
            !unavailable.is_empty(),
            "{name}: the failover went unnoticed"
        );
        assert!(recovered.is_some(), "{name}: never answered again");
        // Nothing hangs: the timeout answers (with slack for a loaded machine).
        assert!(
            slowest < Duration::from_millis(timeout_ms + 1500),
            "{name}: an answer took {slowest:?}"
        );
        // Nothing is admitted while the slot has no master.
        assert!(
            !answers
                .iter()
                .any(|a| a.kind == "admitted" && a.at > killed && a.at <= masterless),
            "{name}: admitted while no master served the slot (until {masterless:?})"
        );
        admitted as f64
    };
    let plain_admitted = report("no option", &plain_answers);
    let busy_admitted = report("--assume-busy-at-start", &busy_answers);
    assert!(
        plain_admitted <= bound + capacity,
        "admitted {plain_admitted} > C + r*T + C"
    );
    assert!(busy_admitted <= bound, "admitted {busy_admitted} > C + r*T");
}

/// Whether a live master other than `dead` serves `slot`.
/// Whether any live node, in its own view, has a master other than `dead` serving `slot`
/// (the promoted replica knows first: asking one node only would see the promotion late).
fn served(cluster: &Cluster, slot: u16, dead: u16) -> bool {
    cluster.views().iter().any(|nodes| {
        nodes.iter().any(|n| {
            n.master
                && !n.failed
                && n.port != dead
                && n.slots.iter().any(|&(a, b)| (a..=b).contains(&slot))
        })
    })
}

/// A slot left half moved (its bucket on the old master, a check's new keys not): the
/// check is told `TRYAGAIN` and retried until the daemon's timeout, however long, then
/// answered `unavailable`, nothing paid; served again once the slot settles.
#[test]
fn a_check_told_tryagain_is_retried_until_its_timeout() {
    let Some(cluster) = Cluster::start(2000) else {
        return;
    };
    let server = daemon(&cluster, &["--redis-timeout-ms", "3000"]);
    let mut t = server.connect();
    let k = key("tryagain", Some("k"));
    let limit = json!({"capacity": 10, "refill_per_sec": 0.001});
    assert_eq!(t.call(check(&k, limit.clone(), 1.0))["result"], "admitted");
    let from = master_holding(&cluster, "tryagain}");
    let slot = cluster_support::key_slot(
        cluster
            .keys()
            .iter()
            .find(|name| name.contains("tryagain}"))
            .unwrap()
            .as_bytes(),
    );
    cluster.begin_moving_slot(slot, cluster.other_master(from));
    let started = Instant::now();
    let answer = t.call(check(&k, limit.clone(), 1.0));
    let waited = started.elapsed();
    cluster.settle_slot(slot);
    assert_eq!(answer["error"]["type"], "unavailable", "{answer}");
    assert!(
        waited >= Duration::from_millis(2_500) && waited < Duration::from_secs(6),
        "answered after {waited:?}: {answer}"
    );
    assert_eq!(t.call(check(&k, limit, 1.0))["result"], "admitted");
    assert!((borrowed(&mut t, &k) - 2.0).abs() < 0.01);
}

/// A slot moved to another master key by key while daemons check a bucket in it. While the
/// slot is half moved, the bucket's script (several keys, some not yet created) is answered
/// `ASK` by the old master and `TRYAGAIN` by the new one: the daemon retries until its
/// timeout, so a move shorter than the timeout refuses nothing, and a longer one answers
/// `unavailable` (never admitted) only while it lasts. The bucket stays within C + r*T.
#[test]
fn a_slot_moved_under_load_keeps_serving() {
    let Some(cluster) = Cluster::start(2000) else {
        return;
    };
    let daemons: Vec<Server> = (0..2).map(|_| daemon(&cluster, &[])).collect();
    let k = key("reshard", Some("k"));
    let (capacity, refill) = (20.0, 50.0);
    let limit = json!({"capacity": capacity, "refill_per_sec": refill});
    let mut t = daemons[0].connect();
    assert_eq!(t.call(check(&k, limit.clone(), 0.0))["result"], "admitted");
    // More keys in the slot, so that it is half moved for a while.
    for n in 0..20 {
        let other = key("reshard", Some(&format!("k{n}")));
        t.call(check(&other, limit.clone(), 1.0));
    }
    let from = master_holding(&cluster, "reshard}");
    let to = cluster.other_master(from);
    let slot = cluster_support::key_slot(
        cluster
            .keys()
            .iter()
            .find(|name| name.contains("reshard}"))
            .unwrap()
            .as_bytes(),
    );
    let started = Instant::now();
    let mut moved = 0;
    let mut window = Duration::ZERO..Duration::ZERO;
    let answers = load(
        &daemons,
        2,
        &k,
        &limit,
        started,
        Duration::from_secs(3),
        || {
            thread::sleep(Duration::from_millis(500));
            window.start = started.elapsed();
            moved = cluster.move_slot(slot, to, Duration::from_millis(10));
            window.end = started.elapsed();
        },
    );
    let refused: Vec<&Answer> = answers.iter().filter(|a| a.kind == "unavailable").collect();
    let elapsed = started.elapsed().as_secs_f64();
    let admitted = count(&answers, "admitted");
    let bound = capacity + refill * elapsed;
    eprintln!(
        "resharding: slot {slot} ({moved} keys) moved from {from} to {to} in {:?}; {} answers, \
         {} unavailable, admitted {admitted} vs C + r*T = {bound:.1}",
        window.end - window.start,
        answers.len(),
        refused.len(),
    );
    assert!(moved >= 20, "moved {moved} keys");
    assert_eq!(cluster.master_of_slot(slot), to);
    for answer in refused {
        let sent = answer.at - answer.took;
        assert!(
            sent >= window.start && sent <= window.end,
            "unavailable for a check sent at {sent:?}, outside the move {window:?}"
        );
    }
    assert!(admitted as f64 <= bound, "admitted {admitted} > {bound}");
    // Served while the slot moves or at once after (a check sent during the move waits for
    // its end, within the daemon's 1 s timeout: the move takes about 2 s), and a fair share
    // of the refill overall (a quarter: two loaded cores run Redis nodes, daemons and
    // clients at once).
    let served_by = window.start..window.end + Duration::from_secs(1);
    let during = answers
        .iter()
        .filter(|a| a.kind == "admitted" && served_by.contains(&(a.at - a.took)))
        .count();
    assert!(
        during > 0,
        "nothing admitted while the slot moved, nor within 1 s after"
    );
    assert!(
        admitted as f64 >= 0.25 * refill * elapsed,
        "admitted only {admitted}"
    );
    // The bucket and its neighbours are served from the new master.
    assert_eq!(master_holding(&cluster, "reshard}"), to);
    let many = json!({"op": "check_many", "checks": [
        {"key": key("reshard", Some("k1")), "limit": limit},
        {"key": {"exchange": "reshard", "credential": null, "axis": "ip"}, "limit": limit},
    ]});
    assert_eq!(t.call(many)["result"], "admitted");
}

/// Checks of many exchanges pipelined at once share calls by slot: each is answered once,
/// under its own id, and each exchange's bucket admits at most its capacity.
#[test]
fn pipelined_checks_of_many_exchanges_are_grouped_by_slot() {
    let Some(cluster) = Cluster::start(2000) else {
        return;
    };
    let server = daemon(&cluster, &["--redis-timeout-ms", "3000"]);
    let mut t = server.connect();
    let limit = json!({"capacity": 3, "refill_per_sec": 0.001});
    let (exchanges, per_exchange) = (16, 8);
    // Loads the script and reads the clock of every master first.
    for e in 0..exchanges {
        let k = key(&format!("slot-{e}"), None);
        assert_eq!(t.call(check(&k, limit.clone(), 1.0))["result"], "admitted");
    }
    let n = exchanges * per_exchange;
    for id in 0..n {
        let mut request = check(
            &key(&format!("slot-{}", id % exchanges), None),
            limit.clone(),
            1.0,
        );
        request["id"] = json!(id);
        t.send(&request);
    }
    let mut admitted = vec![0; exchanges];
    let mut ids: Vec<u64> = (0..n)
        .map(|_| {
            let answer = t.recv();
            let id = answer["id"].as_u64().unwrap_or_else(|| panic!("{answer}"));
            match answer["result"].as_str() {
                Some("admitted") => admitted[id as usize % exchanges] += 1,
                Some("delay") => {}
                _ => panic!("{answer}"),
            }
            id
        })
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, (0..n as u64).collect::<Vec<_>>());
    // One admitted before, so two more each, on every exchange.
    assert_eq!(admitted, vec![2; exchanges]);
    for e in 0..exchanges {
        let paid = borrowed(&mut t, &key(&format!("slot-{e}"), None));
        assert!((paid - 3.0).abs() < 0.01, "slot-{e}: paid {paid}");
    }
}

/// The function library is loaded on every master (its replicas get it by replication),
/// and loaded again when the masters lost it (`FUNCTION FLUSH`, as after restarts without
/// persistence): checks of exchanges spread over every master are admitted before and
/// after, and every master then holds the library.
#[test]
fn the_function_library_is_loaded_again_on_every_master() {
    let Some(cluster) = Cluster::start(2000) else {
        return;
    };
    let server = daemon(&cluster, &["--redis-timeout-ms", "10000"]);
    let mut t = server.connect();
    let limit = json!({"capacity": 100, "refill_per_sec": 0.001});
    let keys: Vec<_> = (0..16)
        .map(|i| key(&format!("exchange{i}"), Some("k")))
        .collect();
    let masters: Vec<u16> = cluster
        .topology()
        .expect("a live node")
        .into_iter()
        .filter(|n| n.master && !n.failed && !n.slots.is_empty())
        .map(|n| n.port)
        .collect();
    assert_eq!(masters.len(), 3);
    for round in 0..2 {
        for k in &keys {
            let answer = t.call(check(k, limit.clone(), 1.0));
            assert_eq!(answer["result"], "admitted", "round {round}: {answer}");
        }
        for &port in &masters {
            let libraries: Vec<::redis::Value> = cluster
                .query(port, ::redis::cmd("FUNCTION").arg("LIST"))
                .expect("FUNCTION LIST");
            assert_eq!(libraries.len(), 1, "master {port}: {libraries:?}");
            let _: () = cluster
                .query(port, ::redis::cmd("FUNCTION").arg("FLUSH"))
                .expect("FUNCTION FLUSH");
        }
    }
    for k in &keys {
        assert!((borrowed(&mut t, k) - 2.0).abs() < 0.01);
    }
}

/// A master that stalls holds the checks of its own slots only: while calls to it wait for
/// their timeout, checks of an exchange on another master are admitted.
#[test]
fn a_stalled_master_holds_only_the_checks_of_its_own_slots() {
    let Some(cluster) = Cluster::start(10_000) else {
        return;
    };
    let server = daemon(&cluster, &["--redis-timeout-ms", "1500"]);
    let limit = json!({"capacity": 1e6, "refill_per_sec": 1e6});
    let mut healthy = server.connect();
    let two = two_masters(&cluster, &mut healthy, "stall");
    let (stalled_master, other) = (two.first_master, &two.other);
    let mut stalled = server.connect();
    let stalled_calls = 6;
    cluster.signal(stalled_master, "STOP");
    // One at a time, so that each goes in a call of its own and holds its turn.
    for id in 0..stalled_calls {
        let mut request = check(&key(&two.first, None), limit.clone(), 1.0);
        request["id"] = json!(id);
        stalled.send(&request);
        thread::sleep(Duration::from_millis(30));
    }
    let answers: Vec<_> = (0..10)
        .map(|_| healthy.call(check(&key(other, None), limit.clone(), 1.0)))
        .collect();
    cluster.signal(stalled_master, "CONT");
    let mut ids: Vec<u64> = (0..stalled_calls)
        .map(|_| {
            stalled.recv()["id"]
                .as_u64()
                .expect("an answer with its id")
        })
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, (0..stalled_calls).collect::<Vec<u64>>());
    assert!(
        answers.iter().all(|answer| answer["result"] == "admitted"),
        "{answers:?}"
    );
}

/// A stopped master whose call timed out while nothing else was answered (little traffic)
/// leaves the other masters' exchanges served. Before, the daemon then opened its cluster
/// connection again, which could not be set up while that master was silent: every later
/// call, on every master, waited for its timeout, one reopening after another, until the
/// master resumed.
#[test]
fn a_stopped_master_at_little_traffic_leaves_the_others_served() {
    let Some(cluster) = Cluster::start(10_000) else {
        return;
    };
    let server = daemon(&cluster, &["--redis-timeout-ms", "500"]);
    let limit = json!({"capacity": 1e6, "refill_per_sec": 1e6});
    let mut t = server.connect();
    let two = two_masters(&cluster, &mut t, "quiet");
    let (stopped_master, other) = (two.first_master, &two.other);
    cluster.signal(stopped_master, "STOP");
    let stopped = t.call(check(&key(&two.first, None), limit.clone(), 1.0));
    let started = Instant::now();
    let mut answers: Vec<Value> = Vec::new();
    while started.elapsed() < Duration::from_secs(3) {
        answers.push(t.call(check(&key(other, None), limit.clone(), 1.0)));
    }
    cluster.signal(stopped_master, "CONT");
    assert_eq!(stopped["error"]["type"], "unavailable", "{stopped}");
    let refused = answers.iter().filter(|a| a["result"] != "admitted").count();
    assert_eq!(refused, 0, "{answers:?}");
}

/// A master that stalls (its port still takes connections) and whose replica took over
/// is left behind: its slots are served by the new master while it stays stopped. Before,
/// the connection opened again waited for every seed, the stalled one too, past the
/// budget of its `PING`, and was dropped each time: nothing of those slots was served
/// until the old master resumed (17.7 s of a 20 s stall, every node a seed).
#[test]
fn a_stalled_master_whose_replica_took_over_is_left_behind() {
    let Some(cluster) = Cluster::start(1000) else {
        return;
    };
    let urls = cluster.urls();
    let mut args = vec!["--redis-timeout-ms", "300"];
    for url in &urls {
        args.extend(["--redis-cluster", url.as_str()]);
    }
    let server = Server::tcp(&args);
    let limit = json!({"capacity": 1e6, "refill_per_sec": 1e6});
    let mut t = server.connect();
    let two = two_masters(&cluster, &mut t, "takeover");
    cluster.wait_healthy();
    let replica = cluster.replica_of(two.first_master);
    let stalled_at = Instant::now();
    cluster.signal(two.first_master, "STOP");
    let promoted = loop {
        let info: String = cluster
            .query(replica, ::redis::cmd("INFO").arg("replication"))
            .unwrap_or_default();
        if info.contains("role:master") {
            break stalled_at.elapsed();
        }
        if stalled_at.elapsed() > Duration::from_secs(30) {
            cluster.signal(two.first_master, "CONT");
            panic!("the replica did not take over");
        }
        thread::sleep(Duration::from_millis(50));
    };
    let mut served_at = None;
    while stalled_at.elapsed() < promoted + Duration::from_secs(10) {
        let answer = t.call(check(&key(&two.first, None), limit.clone(), 1.0));
        if answer["result"] == "admitted" {
            served_at = Some(stalled_at.elapsed());
            break;
        }
        thread::sleep(Duration::from_millis(50));
    }
    cluster.signal(two.first_master, "CONT");
    assert!(
        served_at.is_some(),
        "not served in the 10 s after the replica took over ({promoted:?} after the stall)"
    );
}

/// One master's connection that goes silent while Redis stays healthy (a middlebox that
/// lost the flow swallows everything and never closes it) is opened again, though the
/// other masters go on answering all the while.
#[test]
fn a_silent_connection_to_one_master_is_opened_again() {
    let Some(cluster) = Cluster::start(10_000) else {
        return;
    };
    let master = |exchange: &str| {
        let tag = format!("{{{}:{exchange}}}", exchange.len());
        cluster.master_of_slot(key_slot(tag.as_bytes()))
    };
    let exchanges: Vec<String> = (0..16).map(|e| format!("mute-{e}")).collect();
    let (silent, silent_master) = (&exchanges[0], master(&exchanges[0]));
    let other = exchanges[1..]
        .iter()
        .find(|exchange| master(exchange) != silent_master)
        .expect("an exchange on another master");
    // The master is announced at the proxy's port: clients reach it through the proxy.
    let proxy = SwallowingProxy::to(silent_master);
    let proxy_port = proxy.address.port();
    let mut announce = ::redis::cmd("CONFIG");
    announce
        .arg("SET")
        .arg("cluster-announce-port")
        .arg(proxy_port);
    cluster
        .query::<()>(silent_master, &mut announce)
        .expect("the announced port set");
    eventually(
        "every node to announce the master at the proxy's port",
        || {
            let views = cluster.views();
            views.len() == 6 && views.iter().all(|v| v.iter().any(|n| n.port == proxy_port))
        },
    );
    let server = daemon(&cluster, &["--redis-timeout-ms", "300"]);
    let limit = json!({"capacity": 1e6, "refill_per_sec": 1e6});
    let mut t = server.connect();
    for exchange in [silent, other] {
        let answer = t.call(check(&key(exchange, None), limit.clone(), 1.0));
        assert_eq!(answer["result"], "admitted", "{answer}");
    }

    proxy.swallow_open_connections();
    let stop = Arc::new(AtomicBool::new(false));
    let busy = {
        let (stop, mut t, k, limit) = (
            Arc::clone(&stop),
            server.connect(),
            key(other, None),
            limit.clone(),
        );
        thread::spawn(move || {
            let mut refused = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                let answer = t.call(check(&k, limit.clone(), 1.0));
                if answer["result"] != "admitted" {
                    refused.push(answer);
                }
            }
            refused
        })
    };
    let k = key(silent, None);
    let answer = t.call(check(&k, limit.clone(), 1.0));
    assert_eq!(answer["error"]["type"], "unavailable", "{answer}");
    let started = Instant::now();
    eventually("a check on the silent master admitted again", || {
        t.call(check(&k, limit.clone(), 1.0))["result"] == "admitted"
    });
    eprintln!("answered again after {:?}", started.elapsed());
    stop.store(true, Ordering::SeqCst);
    let refused = busy.join().unwrap();
    assert!(refused.is_empty(), "the other master's checks: {refused:?}");
}

/// While a master stays stopped under steady traffic, the daemon opens its cluster
/// connection again ever more rarely: each reopening connects to every other master, and
/// before, one came every timeout for as long as the stop lasted.
#[test]
fn a_stopped_master_under_traffic_is_reconnected_ever_more_rarely() {
    let Some(cluster) = Cluster::start(10_000) else {
        return;
    };
    let server = daemon(&cluster, &["--redis-timeout-ms", "200"]);
    let limit = json!({"capacity": 1e6, "refill_per_sec": 1e6});
    let mut t = server.connect();
    let two = two_masters(&cluster, &mut t, "churn");
    let connections = |port: u16| -> u64 {
        let info: String = cluster
            .query(port, ::redis::cmd("INFO").arg("stats"))
            .expect("INFO stats");
        info.lines()
            .find_map(|line| line.strip_prefix("total_connections_received:"))
            .and_then(|count| count.trim().parse().ok())
            .expect("total_connections_received")
    };
    let before = connections(two.other_master);
    cluster.signal(two.first_master, "STOP");
    let started = Instant::now();
    let mut refused = Vec::new();
    while started.elapsed() < Duration::from_secs(4) {
        let stopped = t.call(check(&key(&two.first, None), limit.clone(), 1.0));
        assert_eq!(stopped["error"]["type"], "unavailable", "{stopped}");
        let answer = t.call(check(&key(&two.other, None), limit.clone(), 1.0));
        if answer["result"] != "admitted" {
            refused.push(answer);
        }
    }
    cluster.signal(two.first_master, "CONT");
    let opened = connections(two.other_master) - before;
    assert!(refused.is_empty(), "{refused:?}");
    // Reopenings at about 0.2, 0.4, 0.8, 1.6 and 3.2 s; before, about 20.
    assert!(
        opened <= 10,
        "{opened} connections to the other master in 4 s"
    );
    eprintln!("{opened} connections to the other master in 4 s");
}

/// `reset_exchange` walks only the masters of its exchange's slot: another master stopped
/// does not keep it from its answer. Before, it walked every master, and was answered
/// `unavailable` (after resetting the exchange all the same).
#[test]
fn a_reset_of_an_exchange_needs_only_its_own_master() {
    let Some(cluster) = Cluster::start(10_000) else {
        return;
    };
    let server = daemon(&cluster, &["--redis-timeout-ms", "500"]);
    let limit = json!({"capacity": 10, "refill_per_sec": 0.001});
    let mut t = server.connect();
    let two = two_masters(&cluster, &mut t, "own");
    let reset = &two.first;
    let keys: Vec<Value> = (0..20)
        .map(|i| key(reset, Some(&format!("c{i}"))))
        .collect();
    for k in &keys {
        assert_eq!(t.call(check(k, limit.clone(), 3.0))["result"], "admitted");
    }
    let stopped_master = two.other_master;
    cluster.signal(stopped_master, "STOP");
    let answer = t.call(json!({"op": "reset_exchange", "exchange": reset}));
    cluster.signal(stopped_master, "CONT");
    assert_eq!(answer["ok"], true, "{answer}");
    for k in &keys {
        assert_eq!(borrowed(&mut t, k), 0.0);
    }
}

/// A master down with no replica to take over its slots: a reset of its exchange, or of
/// everything, cannot reach its keys, and answers `unavailable`. Before, the walk skipped
/// the failed master and answered `ok`, its keys untouched.
#[test]
fn a_reset_that_cannot_reach_a_failed_masters_keys_is_unavailable() {
    let Some(mut cluster) = Cluster::start(1000) else {
        return;
    };
    let server = daemon(&cluster, &["--redis-timeout-ms", "500"]);
    let mut t = server.connect();
    let two = two_masters(&cluster, &mut t, "down");
    let replica = cluster.replica_of(two.first_master);
    cluster.kill(replica);
    cluster.kill(two.first_master);
    eventually("the master is marked failed", || {
        cluster.topology().is_some_and(|nodes| {
            nodes
                .iter()
                .any(|node| node.port == two.first_master && node.failed)
        })
    });
    for request in [
        json!({"op": "reset_exchange", "exchange": two.first}),
        json!({"op": "reset_all"}),
    ] {
        let answer = t.call(request.clone());
        assert_eq!(answer["ok"], false, "{request}: {answer}");
        assert_eq!(
            answer["error"]["type"], "unavailable",
            "{request}: {answer}"
        );
    }
}

/// The first of 16 exchanges and another on a different master, with their masters.
struct TwoMasters {
    first: String,
    first_master: u16,
    other: String,
    other_master: u16,
}

/// Checks a bucket of each of the exchanges `prefix-0` to `prefix-15` (so that their
/// masters hold keys), and finds the first one's master and an exchange on another.
fn two_masters(cluster: &Cluster, t: &mut impl Transport, prefix: &str) -> TwoMasters {
    let limit = json!({"capacity": 1e6, "refill_per_sec": 1e6});
    let exchanges: Vec<String> = (0..16).map(|e| format!("{prefix}-{e}")).collect();
    for exchange in &exchanges {
        let answer = t.call(check(&key(exchange, None), limit.clone(), 1.0));
        assert_eq!(answer["result"], "admitted", "{answer}");
    }
    let master = |exchange: &str| master_holding(cluster, &format!("{exchange}}}"));
    let first_master = master(&exchanges[0]);
    let (other, other_master) = exchanges[1..]
        .iter()
        .map(|exchange| (exchange.clone(), master(exchange)))
        .find(|(_, port)| *port != first_master)
        .expect("an exchange on another master");
    TwoMasters {
        first: exchanges[0].clone(),
        first_master,
        other,
        other_master,
    }
}

/// The masters serving slots.
fn masters(cluster: &Cluster) -> Vec<u16> {
    cluster
        .topology()
        .expect("a live node")
        .into_iter()
        .filter(|n| n.master && !n.failed && !n.slots.is_empty())
        .map(|n| n.port)
        .collect()
}

/// The daemon's connections cut on every master (`CLIENT KILL`), again and again, while a
/// client streams checks through a Unix socket are opened again: checks are admitted again
/// within a few timeouts. (The cluster client could stop sending anything after such cuts,
/// for good; not after every one: each round starts a daemon of its own.)
#[test]
fn connections_cut_under_load_are_opened_again() {
    let Some(cluster) = Cluster::start(10_000) else {
        return;
    };
    let seed = &cluster.urls()[0];
    let limit = json!({"capacity": 1e9, "refill_per_sec": 1e9});
    let burst: Vec<u8> = (0..200)
        .flat_map(|i| {
            let request = check(&key(&format!("cut-{}", i % 30), None), limit.clone(), 1.0);
            let mut line = serde_json::to_vec(&request).unwrap();
            line.push(b'\n');
            line
        })
        .collect();
    let masters = masters(&cluster);
    for round in 0..6 {
        let socket = common::temp_path(&format!("cut-{round}.sock"));
        let _server = Server::start(&[
            "--socket",
            socket.to_str().unwrap(),
            "--redis-cluster",
            seed,
            "--redis-timeout-ms",
            "300",
        ]);
        let connect = || {
            let stream = std::os::unix::net::UnixStream::connect(&socket).expect("connect");
            common::LineClient::new(stream)
        };
        let mut probe = connect();
        let mut client = connect();
        let mut writer = client.stream.try_clone().expect("clone");
        let bursts = 120;
        let reader = thread::spawn(move || {
            (0..bursts * 200)
                .map(|_| client.recv())
                .filter(|answer| answer["result"] != "admitted")
                .inspect(|answer| assert_eq!(answer["error"]["type"], "unavailable", "{answer}"))
                .count()
        });
        for sent in 0..bursts {
            if sent % 20 == 10 {
                for &port in &masters {
                    let mut kill = ::redis::cmd("CLIENT");
                    kill.arg("KILL").arg("TYPE").arg("normal");
                    let killed: Option<i64> = cluster.query(port, &mut kill);
                    assert!(killed.is_some(), "CLIENT KILL on {port}");
                }
            }
            std::io::Write::write_all(&mut writer, &burst).expect("send");
            thread::sleep(Duration::from_millis(10));
        }
        let unavailable = reader.join().expect("every answer");
        let started = Instant::now();
        let served = (0..40).any(|_| {
            let answer = probe.call(check(&key("cut-0", None), limit.clone(), 1.0));
            answer["result"] == "admitted" || {
                thread::sleep(Duration::from_millis(100));
                false
            }
        });
        eprintln!(
            "round {round}: {unavailable} unavailable of {}, served again {:?} after the load",
            bursts * 200,
            started.elapsed()
        );
        assert!(served, "round {round}: not served again");
    }
}

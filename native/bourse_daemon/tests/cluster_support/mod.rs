//! A real Redis Cluster on loopback for the tests: six `redis-server` children (three
//! masters, three replicas) in a temporary directory, joined with `redis-cli --cluster
//! create`, stopped and removed when dropped.
//!
//! [`Cluster::start`] answers `None`, after saying why, only where no cluster can be made
//! here: `redis-server` or `redis-cli` missing, or a `redis-cli` without `--cluster`
//! (Redis < 5). Any other failure is a test failure.

#![allow(dead_code)] // Each test file uses its own subset.

use std::collections::HashMap;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// Generous: the machine is shared with other builds.
const PATIENCE: Duration = Duration::from_secs(60);

/// One node: its process, its client port and its cluster bus port.
struct Node {
    child: Child,
    port: u16,
}

/// A node as `CLUSTER NODES` describes it.
#[derive(Debug, Clone)]
pub struct NodeInfo {
    pub id: String,
    pub port: u16,
    pub master: bool,
    /// The master's id, for a replica.
    pub master_id: Option<String>,
    pub failed: bool,
    /// Slot ranges served, inclusive (masters only).
    pub slots: Vec<(u16, u16)>,
}

pub struct Cluster {
    nodes: Vec<Node>,
    dir: PathBuf,
    node_timeout_ms: u64,
}

/// The slot of a key, as Redis computes it (CRC16 of the hash tag, or of the whole key).
pub fn key_slot(key: &[u8]) -> u16 {
    let hashed = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let close = key[open + 1..].iter().position(|&b| b == b'}')?;
            (close > 0).then(|| &key[open + 1..open + 1 + close])
        })
        .unwrap_or(key);
    crc16_xmodem(hashed) % 16384
}

fn crc16_xmodem(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in bytes {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port()
}

fn runs(program: &str, args: &[&str]) -> Option<String> {
    let output = Command::new(program)
        .args(args)
        .stderr(Stdio::null())
        .output()
        .ok()?;
    Some(String::from_utf8_lossy(&output.stdout).into_owned())
}

impl Cluster {
    /// Three masters with a replica each; failure detection after `node_timeout_ms`.
    pub fn start(node_timeout_ms: u64) -> Option<Self> {
        Self::start_with(None, node_timeout_ms)
    }

    /// As [`Cluster::start`], with the first node on `port`.
    pub fn start_at(port: u16, node_timeout_ms: u64) -> Option<Self> {
        Self::start_with(Some(port), node_timeout_ms)
    }

    /// A cluster of one master serving every slot, which never met another node: it
    /// shows no address of its own in `CLUSTER NODES`.
    pub fn start_one_node() -> Option<Self> {
        let mut cluster = Self::empty()?;
        let node = cluster.spawn_listening(None);
        let port = node.port;
        cluster.nodes.push(node);
        let added: Option<String> = node_query(
            port,
            ::redis::cmd("CLUSTER")
                .arg("ADDSLOTSRANGE")
                .arg(0)
                .arg(16383),
        );
        assert_eq!(added.as_deref(), Some("OK"), "CLUSTER ADDSLOTSRANGE");
        cluster.wait_healthy();
        Some(cluster)
    }

    /// No node yet, in a new directory; `None` without `redis-server`.
    fn empty() -> Option<Self> {
        if runs("redis-server", &["--version"]).is_none() {
            eprintln!("SKIPPED: no redis-server binary on PATH (make deps installs it)");
            return None;
        }
        let dir = std::env::temp_dir().join(format!(
            "bourse-cluster-{}-{}",
            std::process::id(),
            free_port()
        ));
        std::fs::create_dir_all(&dir).expect("create the cluster directory");
        Some(Self {
            nodes: Vec::new(),
            dir,
            node_timeout_ms: 2000,
        })
    }

    fn start_with(first_port: Option<u16>, node_timeout_ms: u64) -> Option<Self> {
        match runs("redis-cli", &["--cluster", "help"]) {
            Some(help) if help.contains("create") => {}
            Some(_) => {
                eprintln!("SKIPPED: this redis-cli cannot create a cluster (Redis >= 5 needed)");
                return None;
            }
            None => {
                eprintln!("SKIPPED: no redis-cli binary on PATH (make deps installs it)");
                return None;
            }
        }
        let mut cluster = Self::empty()?;
        cluster.node_timeout_ms = node_timeout_ms;
        for n in 0..6 {
            let node = cluster.spawn_listening(first_port.filter(|_| n == 0));
            cluster.nodes.push(node);
        }
        let addresses: Vec<String> = cluster
            .nodes
            .iter()
            .map(|node| format!("127.0.0.1:{}", node.port))
            .collect();
        let output = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addresses)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            output.status.success(),
            "redis-cli --cluster create failed: {}",
            String::from_utf8_lossy(&output.stdout)
        );
        cluster.wait_healthy();
        Some(cluster)
    }

    /// A node listening on `port`, or on a free port: a port found free may be taken
    /// before the node binds it (by a node of a test running beside this one), and the node
    /// then exits and starts again on another. Only this node's own answer counts.
    fn spawn_listening(&self, port: Option<u16>) -> Node {
        let mut node = self.spawn(port.unwrap_or_else(free_port));
        let deadline = Instant::now() + PATIENCE;
        loop {
            if answers(&node) {
                return node;
            }
            if port.is_none() && matches!(node.child.try_wait(), Ok(Some(_))) {
                node = self.spawn(free_port());
            }
            assert!(
                Instant::now() < deadline,
                "never happened: a cluster node answers on port {}",
                node.port
            );
            thread::sleep(Duration::from_millis(50));
        }
    }

    fn spawn(&self, port: u16) -> Node {
        let bus = free_port();
        let dir = self.dir.join(port.to_string());
        std::fs::create_dir_all(&dir).expect("create a node directory");
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args([
                "--cluster-enabled",
                "yes",
                "--cluster-port",
                &bus.to_string(),
            ])
            .args(["--cluster-config-file", "nodes.conf"])
            .args(["--cluster-node-timeout", &self.node_timeout_ms.to_string()])
            // A replica always takes over, however long its link was down.
            .args(["--cluster-replica-validity-factor", "0"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&dir)
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn redis-server");
        Node { child, port }
    }

    /// `redis://127.0.0.1:PORT` of every node, masters and replicas.
    pub fn urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|node| format!("redis://127.0.0.1:{}", node.port))
            .collect()
    }

    /// Waits until every live node sees every slot served and each master's replica is in
    /// sync (its link up, its replication offset at its master's).
    pub fn wait_healthy(&self) {
        eventually("the cluster is healthy", || self.healthy());
    }

    fn healthy(&self) -> bool {
        let live: Vec<u16> = self.live_ports();
        let all_ok = live.iter().all(|&port| {
            node_query::<String>(port, ::redis::cmd("CLUSTER").arg("INFO"))
                .is_some_and(|info| info.contains("cluster_state:ok"))
        });
        if !all_ok {
            return false;
        }
        let Some(nodes) = self.topology() else {
            return false;
        };
        let served: u32 = nodes
            .iter()
            .filter(|n| n.master && !n.failed)
            .flat_map(|n| n.slots.iter())
            .map(|&(a, b)| u32::from(b - a) + 1)
            .sum();
        served == 16384
            && nodes
                .iter()
                .filter(|n| !n.master && !n.failed && live.contains(&n.port))
                .all(|replica| in_sync(replica.port))
    }

    fn live_ports(&self) -> Vec<u16> {
        self.nodes
            .iter()
            .filter(|node| node_query::<String>(node.port, &mut ::redis::cmd("PING")).is_some())
            .map(|node| node.port)
            .collect()
    }

    /// The cluster as one live node sees it.
    pub fn topology(&self) -> Option<Vec<NodeInfo>> {
        self.live_ports().into_iter().find_map(|port| {
            let text: String = node_query(port, ::redis::cmd("CLUSTER").arg("NODES"))?;
            Some(parse_nodes(&text))
        })
    }

    /// Every live node's own view of the cluster (views differ until gossip has spread a
    /// change: a promoted replica knows it is a master before the others do).
    pub fn views(&self) -> Vec<Vec<NodeInfo>> {
        self.live_ports()
            .into_iter()
            .filter_map(|port| {
                let text: String = node_query(port, ::redis::cmd("CLUSTER").arg("NODES"))?;
                Some(parse_nodes(&text))
            })
            .collect()
    }

    /// The port of the master serving `slot` now.
    pub fn master_of_slot(&self, slot: u16) -> u16 {
        self.topology()
            .expect("a live node")
            .into_iter()
            .find(|n| {
                n.master && !n.failed && n.slots.iter().any(|&(a, b)| (a..=b).contains(&slot))
            })
            .unwrap_or_else(|| panic!("no master serves slot {slot}"))
            .port
    }

    /// Another live master than `port`.
    pub fn other_master(&self, port: u16) -> u16 {
        self.topology()
            .expect("a live node")
            .into_iter()
            .find(|n| n.master && !n.failed && n.port != port && !n.slots.is_empty())
            .expect("another master")
            .port
    }

    pub fn node_id(&self, port: u16) -> String {
        self.topology()
            .expect("a live node")
            .into_iter()
            .find(|n| n.port == port)
            .unwrap_or_else(|| panic!("no node on port {port}"))
            .id
    }

    /// Kills the node on `port` (SIGKILL: no goodbye, as a crash).
    pub fn kill(&mut self, port: u16) {
        let node = self
            .nodes
            .iter_mut()
            .find(|node| node.port == port)
            .expect("a node on that port");
        let _ = node.child.kill();
        let _ = node.child.wait();
    }

    /// Sends `signal` (`STOP`, `CONT`) to the node on `port`.
    pub fn signal(&self, port: u16, signal: &str) {
        let node = self
            .nodes
            .iter()
            .find(|node| node.port == port)
            .expect("a node on that port");
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(node.child.id().to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{signal} {port}");
    }

    /// The port of the replica of the master on `port`, once the node asked knows it as one
    /// (a replica's role reaches the other nodes by gossip, some time after it attached).
    pub fn replica_of(&self, port: u16) -> u16 {
        let id = self.node_id(port);
        let mut replica = None;
        eventually(&format!("a replica of {port}"), || {
            replica = self.topology().and_then(|nodes| {
                nodes
                    .into_iter()
                    .find(|n| !n.master && n.master_id.as_deref() == Some(id.as_str()))
                    .map(|n| n.port)
            });
            replica.is_some()
        });
        replica.expect("found above")
    }

    /// Cuts the master on `port` off from its replica, which then misses every write until
    /// the end: the replica is stopped (SIGSTOP) and its replication link closed. Returns
    /// the replica's port; `signal(replica, "CONT")` resumes it.
    pub fn cut_replica(&self, port: u16) -> u16 {
        let replica = self.replica_of(port);
        self.signal(replica, "STOP");
        let _: Option<u64> = node_query(
            port,
            ::redis::cmd("CLIENT")
                .arg("KILL")
                .arg("TYPE")
                .arg("replica"),
        );
        replica
    }

    /// Restarts a killed node on its port with its cluster configuration: it rejoins, as a
    /// replica of whoever took over its slots.
    pub fn restart(&mut self, port: u16) {
        let index = self
            .nodes
            .iter()
            .position(|node| node.port == port)
            .expect("a node on that port");
        let node = self.spawn(port);
        self.nodes[index] = node;
        eventually("the restarted node answers PING", || {
            node_query::<String>(port, &mut ::redis::cmd("PING")).is_some()
        });
    }

    /// Marks `slot` as moving from its master to the master on `to` (`IMPORTING`,
    /// `MIGRATING`) without moving a key, until `settle_slot`.
    pub fn begin_moving_slot(&self, slot: u16, to: u16) {
        let from = self.master_of_slot(slot);
        assert_ne!(from, to, "slot {slot} is already on {to}");
        set_slot(to, slot, "IMPORTING", &self.node_id(from));
        set_slot(from, slot, "MIGRATING", &self.node_id(to));
    }

    /// Ends a move `begin_moving_slot` began, the slot staying where it was.
    pub fn settle_slot(&self, slot: u16) {
        for port in self.live_ports() {
            let _: Option<String> = node_query(
                port,
                ::redis::cmd("CLUSTER")
                    .arg("SETSLOT")
                    .arg(slot)
                    .arg("STABLE"),
            );
        }
    }

    /// Moves `slot` with its keys to the master on `to`, one key per `MIGRATE`, `pace` apart,
    /// so that requests meet the slot half-moved (ASK, TRYAGAIN). Returns the keys moved.
    pub fn move_slot(&self, slot: u16, to: u16, pace: Duration) -> usize {
        let from = self.master_of_slot(slot);
        let to_id = self.node_id(to);
        self.begin_moving_slot(slot, to);
        let mut moved = 0;
        loop {
            let keys: Vec<Vec<u8>> = node_query(
                from,
                ::redis::cmd("CLUSTER")
                    .arg("GETKEYSINSLOT")
                    .arg(slot)
                    .arg(1),
            )
            .expect("CLUSTER GETKEYSINSLOT");
            let Some(key) = keys.into_iter().next() else {
                break;
            };
            let _: ::redis::Value = node_query(
                from,
                ::redis::cmd("MIGRATE")
                    .arg("127.0.0.1")
                    .arg(to)
                    .arg("")
                    .arg(0)
                    .arg(5000)
                    .arg("KEYS")
                    .arg(&key),
            )
            .expect("MIGRATE");
            moved += 1;
            thread::sleep(pace);
        }
        // The new owner first, then the old one, then everyone else (as redis-cli does).
        set_slot(to, slot, "NODE", &to_id);
        set_slot(from, slot, "NODE", &to_id);
        for port in self.live_ports() {
            if port != to && port != from {
                let _: Option<String> = node_query(
                    port,
                    ::redis::cmd("CLUSTER")
                        .arg("SETSLOT")
                        .arg(slot)
                        .arg("NODE")
                        .arg(&to_id),
                );
            }
        }
        moved
    }

    /// Runs one command on the node on `port`, `None` if it cannot be reached or refuses.
    pub fn query<T: ::redis::FromRedisValue>(
        &self,
        port: u16,
        command: &mut ::redis::Cmd,
    ) -> Option<T> {
        node_query(port, command)
    }

    /// Every key on the live masters (for inspection).
    pub fn keys(&self) -> Vec<String> {
        let masters: Vec<u16> = self
            .topology()
            .expect("a live node")
            .into_iter()
            .filter(|n| n.master && !n.failed)
            .map(|n| n.port)
            .collect();
        masters
            .into_iter()
            .flat_map(|port| {
                node_query::<Vec<String>>(port, ::redis::cmd("KEYS").arg("*")).unwrap_or_default()
            })
            .collect()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            let _ = node.child.kill();
            let _ = node.child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `CLUSTER SETSLOT slot state id` on the node on `port`.
fn set_slot(port: u16, slot: u16, state: &str, id: &str) {
    let _: String = node_query(
        port,
        ::redis::cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg(state)
            .arg(id),
    )
    .unwrap_or_else(|| panic!("CLUSTER SETSLOT {slot} {state} on {port}"));
}

fn node_query<T: ::redis::FromRedisValue>(port: u16, command: &mut ::redis::Cmd) -> Option<T> {
    let client = ::redis::Client::open(format!("redis://127.0.0.1:{port}")).ok()?;
    let mut connection = client
        .get_connection_with_timeout(Duration::from_secs(2))
        .ok()?;
    connection
        .set_read_timeout(Some(Duration::from_secs(5)))
        .ok()?;
    command.query(&mut connection).ok()
}

/// Whether `node`'s own process answers on its port.
fn answers(node: &Node) -> bool {
    node_query::<String>(node.port, ::redis::cmd("INFO").arg("server"))
        .is_some_and(|info| info.contains(&format!("process_id:{}\r\n", node.child.id())))
}

/// A replica whose link to its master is up and whose offset has caught up with it.
fn in_sync(port: u16) -> bool {
    let Some(info) = node_query::<String>(port, ::redis::cmd("INFO").arg("replication")) else {
        return false;
    };
    let fields: HashMap<&str, &str> = info
        .lines()
        .filter_map(|line| line.trim_end().split_once(':'))
        .collect();
    if fields.get("master_link_status") != Some(&"up") {
        return false;
    }
    let (Some(master_port), Some(offset)) = (
        fields
            .get("master_port")
            .and_then(|p| p.parse::<u16>().ok()),
        fields.get("slave_repl_offset"),
    ) else {
        return false;
    };
    node_query::<String>(master_port, ::redis::cmd("INFO").arg("replication"))
        .is_some_and(|master| master.contains(&format!("master_repl_offset:{offset}")))
}

fn parse_nodes(text: &str) -> Vec<NodeInfo> {
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() < 8 {
                return None;
            }
            let port = fields[1]
                .split('@')
                .next()?
                .rsplit(':')
                .next()?
                .parse()
                .ok()?;
            let flags = fields[2];
            let slots = fields[8..]
                .iter()
                .filter(|range| !range.starts_with('['))
                .filter_map(|range| match range.split_once('-') {
                    Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                    None => range.parse().ok().map(|slot| (slot, slot)),
                })
                .collect();
            Some(NodeInfo {
                id: fields[0].to_string(),
                port,
                master: flags.contains("master"),
                master_id: (fields[3] != "-").then(|| fields[3].to_string()),
                failed: flags.contains("fail") && !flags.contains("fail?"),
                slots,
            })
        })
        .collect()
}

/// Polls `probe` until it holds, failing after [`PATIENCE`].
fn eventually(what: &str, mut probe: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !probe() {
        assert!(Instant::now() < deadline, "never happened: {what}");
        thread::sleep(Duration::from_millis(50));
    }
}

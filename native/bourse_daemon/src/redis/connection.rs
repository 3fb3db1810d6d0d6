//! How the store reaches Redis: one server, or a Redis Cluster through its seed nodes.
//!
//! Both are one [`Connection`], an `aio::ConnectionLike`, so the store sends the same
//! commands and scripts to either. On a cluster each script call goes to the master serving
//! the slot of its keys (every key of one call carries one hash tag); the cluster client
//! follows `MOVED` and `ASK`, and retries `TRYAGAIN` and `CLUSTERDOWN` until the timeout.
//! A function or script missing on a node (a promoted replica, a restarted node) is loaded
//! again on every master (see client.rs).

use std::sync::Arc;
use std::time::Duration;

use ::redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use ::redis::cluster::{ClusterClientBuilder, ClusterConfig};
use ::redis::cluster_async::ClusterConnection;
use ::redis::cluster_routing::{
    MultipleNodeRoutingInfo, ResponsePolicy, Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr,
};
use ::redis::{
    Client, Cmd, ConnectionAddr, ErrorKind, FromRedisValue, IntoConnectionInfo, Pipeline,
    RedisError, RedisFuture, RedisResult, Value,
};

use super::urls::without_password;

/// The pause between two tries of a cluster request (milliseconds), drawn from this range
/// at every try: a slot that moved or a master that took over is found again within its
/// end. (The client's default, a pause growing with each try, overflows past 60 tries,
/// which a timeout of a second or more asks for.)
const CLUSTER_RETRY_WAIT_MS: (u64, u64) = (5, 50);
/// Tries of one cluster request at least: the timeout ends them (`cluster_retries`).
const CLUSTER_RETRIES: u32 = 25;

/// Where the buckets live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Servers {
    /// One Redis server (or a primary behind a fixed address).
    One(String),
    /// A Redis Cluster, found through these seed nodes.
    Cluster(Vec<String>),
}

/// Tries of one cluster request: as many as pauses of the shortest wait take to fill
/// `timeout`, so that the timeout, not the count, ends a request retried (`TRYAGAIN` while
/// a slot moves, `CLUSTERDOWN` while a replica takes over).
fn cluster_retries(timeout: Duration) -> u32 {
    let pauses = timeout.as_millis() / u128::from(CLUSTER_RETRY_WAIT_MS.0);
    u32::try_from(pauses)
        .unwrap_or(u32::MAX)
        .max(CLUSTER_RETRIES)
}

impl Servers {
    /// Where the buckets live, as errors name it: `redis at HOST:PORT` (or a socket's path),
    /// `redis cluster at HOST:PORT, ...` (its seeds). Never a password.
    pub fn describe(&self) -> String {
        let address = |url: &String| {
            url.as_str()
                .into_connection_info()
                .map_or_else(|_| without_password(url), |info| info.addr().to_string())
        };
        match self {
            Self::One(url) => format!("redis at {}", address(url)),
            Self::Cluster(seeds) => {
                let seeds: Vec<String> = seeds.iter().map(address).collect();
                format!("redis cluster at {}", seeds.join(", "))
            }
        }
    }
}

/// A connection to one server or to a whole cluster; cheap to clone (clones share it).
#[derive(Clone)]
pub enum Connection {
    One(ConnectionManager),
    /// The cluster and its seeds' addresses (`host`, `port`).
    Cluster(ClusterConnection, Arc<[(String, u16)]>),
}

/// A node a table-wide `SCAN` runs on.
pub enum ScanNode {
    /// The only server.
    Server,
    /// One master of the cluster.
    Master { host: String, port: u16 },
}

impl Connection {
    /// Prepares the connection without waiting for it: the first command connects. Every
    /// command is bounded by `timeout`, connecting, redirections and retries included (on
    /// one server, its answer is awaited [`super::client::late_wait`] longer).
    /// Must run inside a Tokio runtime.
    pub fn open(
        servers: &Servers,
        password: Option<&str>,
        timeout: Duration,
    ) -> Result<Self, String> {
        match servers {
            Servers::One(url) => {
                let mut info = url
                    .as_str()
                    .into_connection_info()
                    .map_err(|error| format!("--redis {:?}: {error}", without_password(url)))?;
                if let Some(password) = password {
                    let settings = info.redis_settings().clone().set_password(password);
                    info = info.set_redis_settings(settings);
                }
                let client = Client::open(info)
                    .map_err(|error| format!("--redis {:?}: {error}", without_password(url)))?;
                // Answers come late after Redis was stopped: `checks` calls read them
                // (`client::late_wait`); every other call stops waiting at the timeout.
                let manager = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(timeout))
                    .set_response_timeout(Some(timeout + super::client::late_wait(timeout)))
                    .set_number_of_retries(0);
                ConnectionManager::new_lazy_with_config(client, manager)
                    .map(Self::One)
                    .map_err(|error| format!("cannot prepare the Redis connection: {error}"))
            }
            Servers::Cluster(seeds) => {
                let mut addresses = Vec::with_capacity(seeds.len());
                for seed in seeds {
                    let info = seed.as_str().into_connection_info().map_err(|error| {
                        format!("--redis-cluster {:?}: {error}", without_password(seed))
                    })?;
                    if let ConnectionAddr::Tcp(host, port) = info.addr() {
                        addresses.push((host.clone(), *port));
                    }
                }
                let (min_wait, max_wait) = CLUSTER_RETRY_WAIT_MS;
                let mut builder = ClusterClientBuilder::new(seeds.iter().map(String::as_str))
                    .connection_timeout(timeout)
                    .response_timeout(timeout)
                    .overall_response_timeout(Some(timeout))
                    .retries(cluster_retries(timeout))
                    .min_retry_wait(min_wait)
                    .max_retry_wait(max_wait)
                    .retry_wait_formula(max_wait, 1);
                if let Some(password) = password {
                    builder = builder.password(password);
                }
                let client = builder
                    .build()
                    .map_err(|error| format!("--redis-cluster: {error}"))?;
                let config = ClusterConfig::new()
                    .set_connection_timeout(timeout)
                    .set_response_timeout(timeout);
                Ok(Self::Cluster(
                    client.get_pending_async_connection_with_config(config),
                    addresses.into(),
                ))
            }
        }
    }

    pub fn is_cluster(&self) -> bool {
        matches!(self, Self::Cluster(..))
    }

    /// The nodes that together hold every key: the server, or each master serving slots
    /// (with `slot`, those serving it or moving it).
    pub async fn scan_nodes(&mut self, slot: Option<u16>) -> RedisResult<Vec<ScanNode>> {
        match self {
            Self::One(_) => Ok(vec![ScanNode::Server]),
            Self::Cluster(cluster, seeds) => {
                let mut command = ::redis::cmd("CLUSTER");
                command.arg("NODES");
                // Asked of the slot's master, which must answer anyway, or of any node.
                let node = match slot {
                    Some(slot) => {
                        SingleNodeRoutingInfo::SpecificNode(Route::new(slot, SlotAddr::Master))
                    }
                    None => SingleNodeRoutingInfo::Random,
                };
                let text: String = cluster
                    .route_command(command, RoutingInfo::SingleNode(node))
                    .await
                    .and_then(|value| Ok(String::from_redis_value(value)?))?;
                masters(&text, seeds, slot)
                    .map_err(|why| RedisError::from((ErrorKind::Io, "cluster down", why)))
            }
        }
    }

    /// Whether Redis answers: the server a `PING`; a cluster the master serving `slot`
    /// (`EXISTS` of a key there, which another node redirects to it), or any node.
    pub async fn ping(&mut self, slot: Option<u16>) -> RedisResult<()> {
        match (self, slot) {
            (Self::One(connection), _) => ::redis::cmd("PING").query_async(connection).await,
            (Self::Cluster(cluster, _), Some(slot)) => {
                let mut exists = ::redis::cmd("EXISTS");
                exists.arg(key_in(slot));
                exists.query_async::<u8>(cluster).await.map(drop)
            }
            (Self::Cluster(cluster, _), None) => {
                let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random);
                let ping = ::redis::cmd("PING");
                cluster.route_command(ping, routing).await.map(drop)
            }
        }
    }

    /// Runs `command` on `node`.
    pub async fn query_on<T: FromRedisValue>(
        &mut self,
        node: &ScanNode,
        command: &Cmd,
    ) -> RedisResult<T> {
        match (self, node) {
            (Self::Cluster(cluster, _), ScanNode::Master { host, port }) => {
                let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                    host: host.clone(),
                    port: *port,
                });
                let value = cluster.route_command(command.clone(), routing).await?;
                Ok(T::from_redis_value(value)?)
            }
            (connection, _) => command.query_async(connection).await,
        }
    }
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, command: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::One(connection) => connection.req_packed_command(command),
            // The crate may load scripts on every node, replicas included: one replica down
            // would then fail the reload. Every master is enough: only masters run them.
            Self::Cluster(cluster, _) => {
                if is_load(command) {
                    let routing = RoutingInfo::MultiNode((
                        MultipleNodeRoutingInfo::AllMasters,
                        Some(ResponsePolicy::AllSucceeded),
                    ));
                    Box::pin(cluster.route_command(command.clone(), routing))
                } else {
                    cluster.req_packed_command(command)
                }
            }
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::One(connection) => connection.req_packed_commands(pipeline, offset, count),
            Self::Cluster(cluster, _) => cluster.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::One(connection) => connection.get_db(),
            Self::Cluster(cluster, _) => cluster.get_db(),
        }
    }
}

/// `SCRIPT LOAD` or `FUNCTION LOAD`.
fn is_load(command: &Cmd) -> bool {
    let mut args = command.args_iter().map(|arg| match arg {
        ::redis::Arg::Simple(bytes) => bytes,
        _ => b"",
    });
    matches!(
        (args.next(), args.next()),
        (Some(a), Some(b)) if (a.eq_ignore_ascii_case(b"SCRIPT") || a.eq_ignore_ascii_case(b"FUNCTION"))
            && b.eq_ignore_ascii_case(b"LOAD")
    )
}

/// The masters serving slots (with `slot`, serving it or moving it) in a `CLUSTER NODES`
/// answer, or why they cannot all be scanned: a master that failed still serves slots (no
/// replica took over yet), or no master serves `slot`. A node that does not know its own
/// address (a cluster of one node, which never met another) shows an empty host: it is the
/// seed of its port.
fn masters(
    text: &str,
    seeds: &[(String, u16)],
    slot: Option<u16>,
) -> Result<Vec<ScanNode>, String> {
    let mut found = Vec::new();
    for line in text.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let Some(flags) = fields
            .get(2)
            .map(|flags| flags.split(',').collect::<Vec<_>>())
        else {
            continue;
        };
        let serves = fields.len() > 8
            && slot.is_none_or(|slot| fields[8..].iter().any(|range| holds(range, slot)));
        if !flags.contains(&"master") || !serves {
            continue;
        }
        // ip:port@cport[,hostname]
        let address = fields[1].split(['@', ',']).next().unwrap_or_default();
        if flags.contains(&"fail") {
            return Err(format!(
                "the master at {address} is down, its slots not yet taken over"
            ));
        }
        let Some((host, Ok(port))) = address.rsplit_once(':').map(|(h, p)| (h, p.parse())) else {
            continue;
        };
        let host = match seeds.iter().find(|seed| host.is_empty() && seed.1 == port) {
            Some((seed, _)) => seed.clone(),
            None => host.to_string(),
        };
        found.push(ScanNode::Master { host, port });
    }
    match slot {
        Some(slot) if found.is_empty() => Err(format!("no master serves slot {slot}")),
        _ => Ok(found),
    }
}

/// Whether a slot field of `CLUSTER NODES` (`a-b`, `n`, or a slot on its way in or out,
/// `[n->-id]`, `[n-<-id]`) holds `slot`.
fn holds(field: &str, slot: u16) -> bool {
    let moving = field
        .strip_prefix('[')
        .and_then(|rest| rest.split_once('-'));
    if let Some((moving, _)) = moving {
        return moving.parse() == Ok(slot);
    }
    match field.split_once('-') {
        Some((first, last)) => {
            matches!((first.parse::<u16>(), last.parse::<u16>()), (Ok(first), Ok(last)) if first <= slot && slot <= last)
        }
        None => field.parse() == Ok(slot),
    }
}

/// The slot of `name` in a Redis Cluster: CRC16 (XMODEM) of its hash tag, modulo 16384.
pub fn slot(name: &[u8]) -> u16 {
    let crc = hash_tag(name).iter().fold(0u16, |crc, &byte| {
        (0..8).fold(crc ^ (u16::from(byte) << 8), |crc, _| {
            if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            }
        })
    });
    crc % 16384
}

/// A key name in `slot` (a hash tag found by trying numbers: about 16,384 tries).
fn key_in(slot: u16) -> String {
    (0u32..)
        .map(|n| format!("bourse-probe:{{{n}}}"))
        .find(|name| self::slot(name.as_bytes()) == slot)
        .expect("every slot has a number")
}

/// The part of `name` Redis Cluster hashes to choose its slot: the bytes between the first
/// `{` and the next `}` when not empty, else the whole name. Names with one hash tag
/// always share a slot.
pub fn hash_tag(name: &[u8]) -> &[u8] {
    name.iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let length = name[open + 1..].iter().position(|&b| b == b'}')?;
            (length > 0).then(|| &name[open + 1..open + 1 + length])
        })
        .unwrap_or(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_requests_are_retried_until_their_timeout() {
        assert_eq!(cluster_retries(Duration::from_millis(100)), CLUSTER_RETRIES);
        assert_eq!(cluster_retries(Duration::from_secs(5)), 1000);
        assert_eq!(cluster_retries(Duration::from_secs(60)), 12_000);
    }

    #[test]
    fn a_node_without_its_own_address_is_the_seed_of_its_port() {
        let seeds = [("127.0.0.1".to_string(), 7000)];
        let one_node = "07c3 :7000@17000 myself,master - 0 0 0 connected 0-16383\n";
        let found = masters(one_node, &seeds, None).unwrap();
        assert!(
            matches!(&found[..], [ScanNode::Master { host, port: 7000 }] if host == "127.0.0.1")
        );
    }

    #[test]
    fn errors_name_the_servers_by_address_only() {
        let one = Servers::One("redis://user@127.0.0.1:6400/2".into());
        assert_eq!(one.describe(), "redis at 127.0.0.1:6400");
        let socket = Servers::One("unix:///run/redis.sock".into());
        assert_eq!(socket.describe(), "redis at /run/redis.sock");
        let seeds = vec![
            "redis://10.0.0.1:7000".into(),
            "redis://10.0.0.2:7001".into(),
        ];
        assert_eq!(
            Servers::Cluster(seeds).describe(),
            "redis cluster at 10.0.0.1:7000, 10.0.0.2:7001"
        );
        let unread = Servers::One("redis://:hunter2@h:99999".into());
        assert_eq!(unread.describe(), "redis at redis://:***@h:99999");
    }

    #[test]
    fn errors_show_the_urls_without_their_passwords() {
        for servers in [
            Servers::One("unix:///tmp/r.sock?db=1&%70ass=hunter2&db=x".into()),
            Servers::One("redis://:hunter2@h:1/x".into()),
            Servers::Cluster(vec![
                "redis://h:1".into(),
                "redis://:hunter2@h:99999".into(),
            ]),
        ] {
            let error = Connection::open(&servers, None, Duration::from_secs(1))
                .err()
                .unwrap();
            assert!(
                error.contains("***") && !error.contains("hunter2"),
                "{error}"
            );
        }
    }

    #[test]
    fn hash_tags_follow_redis() {
        assert_eq!(hash_tag(b"bourse:{7:binance}:b:-:2:ip"), b"7:binance");
        assert_eq!(hash_tag(b"p:e{3:okx}"), b"3:okx");
        // The first `}` after the first `{` closes the tag; an empty tag hashes the name.
        assert_eq!(hash_tag(b"a{b}c}d"), b"b");
        assert_eq!(hash_tag(b"a{}b{c}"), b"a{}b{c}");
        assert_eq!(hash_tag(b"no tag"), b"no tag");
        assert_eq!(hash_tag(b"open{only"), b"open{only");
    }

    #[test]
    fn masters_serving_slots_are_scanned() {
        let nodes = "\
a1 127.0.0.1:7001@17001 myself,master - 0 0 1 connected 0-5460
b2 127.0.0.1:7002@17002 master - 0 0 2 connected 5461-10922 [5000->-a1]
c3 127.0.0.1:7003@17003,host.example master,fail - 0 0 3 connected
d4 127.0.0.1:7004@17004 slave a1 0 0 1 connected
e5 ::1:7005@17005 master - 0 0 4 connected 10923-16383
f6 127.0.0.1:7006@17006 master - 0 0 5 connected
";
        let found = |slot| -> Vec<u16> {
            masters(nodes, &[], slot)
                .unwrap()
                .into_iter()
                .map(|node| match node {
                    ScanNode::Master { port, .. } => port,
                    ScanNode::Server => unreachable!(),
                })
                .collect()
        };
        assert_eq!(found(None), [7001, 7002, 7005]);
        // A slot: its master, and one moving it.
        assert_eq!(found(Some(6000)), [7002]);
        assert_eq!(found(Some(5000)), [7001, 7002]);
        assert_eq!(found(Some(16383)), [7005]);
        let ports: Vec<u16> = masters(nodes, &[], None)
            .unwrap()
            .into_iter()
            .filter_map(|node| match node {
                ScanNode::Master { host, port } if host == "::1" => Some(port),
                _ => None,
            })
            .collect();
        assert_eq!(ports, [7005]);
    }

    /// A reset that skipped them would answer `ok` with their keys untouched.
    #[test]
    fn a_failed_master_still_serving_slots_fails_the_scan() {
        let nodes = "\
a1 127.0.0.1:7001@17001 myself,master - 0 0 1 connected 0-8191
b2 127.0.0.1:7002@17002 master,fail - 0 0 2 connected 8192-16383
";
        let down = "the master at 127.0.0.1:7002 is down, its slots not yet taken over";
        assert_eq!(masters(nodes, &[], None).err().unwrap(), down);
        assert_eq!(masters(nodes, &[], Some(9000)).err().unwrap(), down);
        assert_eq!(masters(nodes, &[], Some(100)).unwrap().len(), 1);
        let half = "a1 127.0.0.1:7001@17001 myself,master - 0 0 1 connected 0-8191\n";
        assert_eq!(
            masters(half, &[], Some(9000)).err().unwrap(),
            "no master serves slot 9000"
        );
    }

    #[test]
    fn a_probe_key_is_found_in_every_slot() {
        for at in [0, 1, 5_000, 12_182, 16_383] {
            assert_eq!(slot(key_in(at).as_bytes()), at);
        }
    }

    #[test]
    fn slots_follow_redis() {
        // CLUSTER KEYSLOT, as Redis's documentation gives them.
        assert_eq!(slot(b"somekey"), 11058);
        assert_eq!(slot(b"foo"), 12182);
        assert_eq!(slot(b"{user1000}.following"), slot(b"{user1000}.followers"));
        assert_eq!(slot(b"123456789"), 0x31C3);
    }

    #[test]
    fn only_loads_are_rerouted() {
        let mut load = ::redis::cmd("script");
        load.arg("load").arg("return 1");
        assert!(is_load(&load));
        let mut library = ::redis::cmd("FUNCTION");
        library.arg("LOAD").arg("REPLACE").arg("#!lua name=x");
        assert!(is_load(&library));
        let mut other = ::redis::cmd("SCRIPT");
        other.arg("EXISTS");
        assert!(!is_load(&other));
        let mut list = ::redis::cmd("FUNCTION");
        list.arg("LIST");
        assert!(!is_load(&list));
        assert!(!is_load(&::redis::cmd("EVALSHA")));
    }
}

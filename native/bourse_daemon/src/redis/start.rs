//! Redis asked at start: a daemon that Redis refuses (a password it does not take or asks
//! for, a database it does not have) or, with `--redis-cluster`, a seed that is a server
//! without cluster support (it would serve checks but fail the cluster's own commands,
//! `CLUSTER NODES`, for resets and table-wide requests) refuses to start, saying why,
//! rather than answer `unavailable` for every request. A server that does not answer in
//! time is left to the connection, as a Redis down at start is.

use std::time::Duration;

use ::redis::aio::MultiplexedConnection;
use ::redis::{Client, IntoConnectionInfo, RedisError};
use tokio::task::JoinSet;

use super::client::password_refusal;
use super::connection::Servers;

/// The longest wait for the servers' answers at start.
const MAX_WAIT: Duration = Duration::from_secs(1);

/// Asks every server (each seed of a cluster) at once, at most `timeout` (and at most 1 s);
/// the first refusal is the error.
pub async fn refuse_misconfigured(
    servers: &Servers,
    password: Option<&str>,
    timeout: Duration,
) -> Result<(), String> {
    let (flag, urls, cluster) = match servers {
        Servers::One(url) => ("--redis", std::slice::from_ref(url), false),
        Servers::Cluster(seeds) => ("--redis-cluster", seeds.as_slice(), true),
    };
    let wait = timeout.min(MAX_WAIT);
    let mut probes = JoinSet::new();
    for url in urls {
        let (url, password) = (url.clone(), password.map(str::to_owned));
        probes.spawn(async move {
            let refusal = tokio::time::timeout(wait, refusal(&url, password, cluster)).await;
            refusal.ok().flatten().map(|reason| (url, reason))
        });
    }
    while let Some(probe) = probes.join_next().await {
        if let Ok(Some((url, reason))) = probe {
            return Err(format!("{flag}: redis at {}: {reason}", address(&url)));
        }
    }
    Ok(())
}

/// Why the server at `url` refuses this daemon; `None` when it does not, or cannot be asked.
async fn refusal(url: &str, password: Option<String>, cluster: bool) -> Option<String> {
    let password_given = password.is_some();
    let mut connection = match connect(url, password).await {
        Ok(connection) => connection,
        Err(error) => return refused_at_connect(&error, password_given),
    };
    if let Err(error) = ::redis::cmd("PING")
        .query_async::<()>(&mut connection)
        .await
    {
        return password_refusal(&error, password_given);
    }
    if !cluster {
        return None;
    }
    let info: String = ::redis::cmd("INFO")
        .arg("cluster")
        .query_async(&mut connection)
        .await
        .ok()?;
    info.lines()
        .any(|line| line.trim() == "cluster_enabled:0")
        .then(not_a_cluster)
}

async fn connect(url: &str, password: Option<String>) -> Result<MultiplexedConnection, RedisError> {
    let mut info = url.into_connection_info()?;
    if let Some(password) = password {
        let settings = info.redis_settings().clone().set_password(password);
        info = info.set_redis_settings(settings);
    }
    Client::open(info)?.get_multiplexed_async_connection().await
}

/// A password refused, or a database the server does not have (`SELECT` refused).
fn refused_at_connect(error: &RedisError, password_given: bool) -> Option<String> {
    password_refusal(error, password_given).or_else(|| {
        let text = error.to_string();
        text.contains("refused to switch database").then(|| {
            format!(
                "it has no such database ({}): the URL's database number (redis://host:port/N) \
                 must be below its `databases` setting",
                text.lines().next().unwrap_or_default()
            )
        })
    })
}

fn not_a_cluster() -> String {
    "it is not a Redis Cluster (cluster support disabled); for a single Redis server give \
     one URL: --redis URL, or in Elixir backend: {:redis, url}, not a list"
        .to_owned()
}

fn address(url: &str) -> String {
    url.into_connection_info()
        .map_or_else(|_| String::new(), |info| info.addr().to_string())
}

//! `--redis-cluster` seeds checked at start: a seed that is a Redis server without cluster
//! support would serve checks but fail the cluster's own commands (`CLUSTER NODES`, for
//! resets and table-wide requests), so the daemon refuses to start on it. A seed that does
//! not answer in time is left to the cluster client, as a cluster down at start is.

use std::time::Duration;

use ::redis::{Client, IntoConnectionInfo};
use tokio::task::JoinSet;

/// The longest wait for the seeds' answers at start.
const MAX_WAIT: Duration = Duration::from_secs(1);

/// Refuses seeds of which one answers `INFO cluster` with `cluster_enabled:0`. Waits for
/// them at most `timeout` (and at most 1 s).
pub async fn refuse_standalone(
    seeds: &[String],
    password: Option<&str>,
    timeout: Duration,
) -> Result<(), String> {
    let wait = timeout.min(MAX_WAIT);
    let mut probes = JoinSet::new();
    for seed in seeds {
        let (seed, password) = (seed.clone(), password.map(str::to_owned));
        probes.spawn(async move {
            let answer = tokio::time::timeout(wait, cluster_disabled(&seed, password)).await;
            matches!(answer, Ok(Some(true))).then_some(seed)
        });
    }
    while let Some(probe) = probes.join_next().await {
        if let Ok(Some(seed)) = probe {
            return Err(not_a_cluster(&seed));
        }
    }
    Ok(())
}

/// Whether the server at `seed` says its cluster support is disabled; `None` when it
/// cannot be asked.
async fn cluster_disabled(seed: &str, password: Option<String>) -> Option<bool> {
    let mut info = seed.into_connection_info().ok()?;
    if let Some(password) = password {
        let settings = info.redis_settings().clone().set_password(password);
        info = info.set_redis_settings(settings);
    }
    let client = Client::open(info).ok()?;
    let mut connection = client.get_multiplexed_async_connection().await.ok()?;
    let text: String = ::redis::cmd("INFO")
        .arg("cluster")
        .query_async(&mut connection)
        .await
        .ok()?;
    Some(text.lines().any(|line| line.trim() == "cluster_enabled:0"))
}

fn not_a_cluster(seed: &str) -> String {
    let address = seed
        .into_connection_info()
        .map_or_else(|_| String::new(), |info| info.addr().to_string());
    format!(
        "--redis-cluster: redis at {address} is not a Redis Cluster (cluster support \
         disabled); for a single Redis server give one URL: --redis URL, or in Elixir \
         backend: {{:redis, url}}, not a list"
    )
}

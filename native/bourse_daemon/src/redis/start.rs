//! Redis asked at start: a daemon that Redis refuses (a password it does not take or asks
//! for, a user that may not run scripts, a database it does not have), a Redis that may
//! evict keys when full (an evicted bucket would start full again, past P1) or, with
//! `--redis-cluster`, a seed that is a server without cluster support (it would serve
//! checks but fail the cluster's own commands, `CLUSTER NODES`, for resets and table-wide
//! requests) refuses to start, saying why, rather than answer `unavailable` for every
//! request. A server that does not answer in time is left to the connection, as a Redis
//! down at start is.

use std::time::Duration;

use ::redis::aio::MultiplexedConnection;
use ::redis::{Client, IntoConnectionInfo, RedisError};
use tokio::task::JoinSet;

use super::client::password_refusal;
use super::connection::Servers;

/// The SHA-1 of no script, and the name of no function.
const UNKNOWN_SCRIPT: &str = "0000000000000000000000000000000000000000";
const UNKNOWN_FUNCTION: &str = "bourse_start_probe_no_such_function";
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
    // Connected to database 0, the URL's is selected here, so that its refusal is told
    // apart from the others.
    let (mut connection, db) = match connect(url, password).await {
        Ok(connected) => connected,
        Err(error) => return password_refusal(&error, password_given),
    };
    if let Err(error) = ::redis::cmd("PING")
        .query_async::<()>(&mut connection)
        .await
    {
        return password_refusal(&error, password_given);
    }
    // A script and a function that do not exist: `NOSCRIPT` and "not found" for a user that
    // may run them; the daemon runs its checks as either.
    let evalsha = denied(&mut connection, "EVALSHA", UNKNOWN_SCRIPT).await;
    let fcall = denied(&mut connection, "FCALL", UNKNOWN_FUNCTION).await;
    if let (Some(evalsha), Some(_)) = (evalsha, fcall) {
        return Some(format!(
            "it does not let this user run scripts ({evalsha}): the limiter runs every \
             check as one"
        ));
    }
    if db != 0 && cluster {
        return Some(format!(
            "a Redis Cluster has database 0 only: drop the /{db} from the seed's URL"
        ));
    }
    if db != 0 {
        let selected = ::redis::cmd("SELECT")
            .arg(db)
            .query_async::<()>(&mut connection)
            .await;
        if let Err(error) = selected {
            return Some(format!(
                "it has no database {db} ({}): the URL's database number (redis://host:port/N) \
                 must be below its `databases` setting",
                error.to_string().lines().next().unwrap_or_default()
            ));
        }
    }
    if let Some(evicts) = evicts(&mut connection).await {
        return Some(evicts);
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
        .then(|| NOT_A_CLUSTER.to_owned())
}

/// Whether the server may evict keys when full: a `maxmemory` with a policy other than
/// `noeviction`, read from `INFO memory` (which managed services that deny `CONFIG`
/// answer). `volatile-*` policies evict the buckets (they expire) and keep the record of
/// since when the data is whole (it does not), so nothing would tell the loss.
async fn evicts(connection: &mut MultiplexedConnection) -> Option<String> {
    let info: String = ::redis::cmd("INFO")
        .arg("memory")
        .query_async(connection)
        .await
        .ok()?;
    let field = |name: &str| {
        info.lines()
            .find_map(|line| line.trim().strip_prefix(name)?.strip_prefix(':'))
    };
    let (max, policy) = (field("maxmemory")?, field("maxmemory_policy")?);
    (max != "0" && policy != "noeviction").then(|| {
        format!(
            "it may evict keys when full (maxmemory {max} bytes, maxmemory-policy {policy}): \
             a bucket evicted would start full again, past its limit; set maxmemory-policy \
             noeviction (a full Redis then refuses writes, and checks answer unavailable)"
        )
    })
}

/// Why `command` of `name` (with no keys) was denied to this user: its `NOPERM`, or, for a
/// command this server does not know (`FCALL` before Redis 7), that; `None` when allowed.
async fn denied(
    connection: &mut MultiplexedConnection,
    command: &str,
    name: &str,
) -> Option<String> {
    let answer = ::redis::cmd(command)
        .arg(name)
        .arg(0)
        .query_async::<()>(connection)
        .await;
    let error = answer.err()?;
    let text = error.to_string();
    (error.code() == Some("NOPERM") || text.contains("unknown command"))
        .then(|| text.lines().next().unwrap_or_default().to_owned())
}

/// A connection to database 0 of the server at `url`, and the URL's database.
async fn connect(
    url: &str,
    password: Option<String>,
) -> Result<(MultiplexedConnection, i64), RedisError> {
    let info = url.into_connection_info()?;
    let db = info.redis_settings().db();
    let mut settings = info.redis_settings().clone().set_db(0);
    if let Some(password) = password {
        settings = settings.set_password(password);
    }
    let connection = Client::open(info.set_redis_settings(settings))?
        .get_multiplexed_async_connection()
        .await?;
    Ok((connection, db))
}

const NOT_A_CLUSTER: &str = "it is not a Redis Cluster (cluster support disabled); for a \
     single Redis server give one URL: --redis URL, or in Elixir backend: {:redis, url}, not a list";

fn address(url: &str) -> String {
    url.into_connection_info()
        .map_or_else(|_| String::new(), |info| info.addr().to_string())
}

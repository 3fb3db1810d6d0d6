//! The Redis store: buckets shared by every daemon that points at one Redis server.
//!
//! Each operation on a key is one call of `bucket.lua`, which runs the core's bucket
//! atomically on the Redis server's clock (`TIME`): local clocks do not matter. Checks
//! waiting at the same time share one call. Keys of one
//! exchange share a hash tag, so on Redis Cluster every check within one exchange touches
//! one slot.
//!
//! Every call is bounded by a timeout. When Redis cannot be reached the answer is
//! [`StoreError::Unavailable`](crate::store::StoreError) and nothing is admitted; the
//! connection is re-established by the next call. A call answered `Unavailable` never pays
//! later: each script carries a deadline on the Redis server's own clock (the earlier of
//! the timeout's and the request's own) and refuses to run past it.
//!
//! Credentials never appear in key names: they are replaced by keyed fingerprints; the
//! bucket keeps the displayed fingerprint for `busiest`.
//!
//! - `store`: [`RedisStore`], each operation as script calls;
//! - `batch`: concurrent checks gathered into shared calls;
//! - `debit`: `record` calls, a late one's debit given back;
//! - `script`: one call of `bucket.lua`, as `FCALL`, `EVALSHA` or `EVAL`;
//! - `client`: sends calls and commands within the timeout and the script's deadline;
//! - `clock`: the Redis clock as seen from here, to place deadlines on it;
//! - `connection`: one server or a cluster;
//! - `link`: the connection, a cluster's opened again when it stops answering;
//! - `names`: the Redis names of a key's data;
//! - `fingerprints`: the fingerprints of recently seen credentials;
//! - `answer`: the script's answers read back;
//! - `scan`: table-wide `SCAN` of every node;
//! - `start`: Redis asked at start, the daemon refused when Redis refuses it;
//! - `counters`: the statistics of this daemon's answers;
//! - `timer_anchor`: a timer kept due sooner than a call's, so that theirs wake no thread;
//! - `urls`: the passwords in Redis URLs, found and hidden.

mod answer;
mod batch;
mod client;
mod clock;
mod connection;
mod counters;
mod debit;
mod fingerprints;
mod link;
mod names;
mod scan;
mod script;
mod start;
mod store;
mod timer_anchor;
mod urls;

pub use connection::Servers;
pub use start::refuse_misconfigured;
pub use store::{Options, RedisStore};
pub use urls::has_password;

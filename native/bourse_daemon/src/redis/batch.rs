//! Concurrent checks share round trips. Each check waits in its connection's queue; a
//! dispatcher takes checks waiting (up to [`MAX_BATCH`], or [`MAX_BATCH_KEYS`]) into one
//! `checks` call of the script, one per slot on a cluster, while at most
//! [`BATCHES_IN_FLIGHT`] calls are on their way, so the checks that arrive meanwhile form
//! the next calls. A call takes its share of the checks waiting, divided among the turns
//! free: calls on their way together run in Redis while the answers of the others are
//! handled, instead of every caller moving as one convoy. It takes one check of each
//! waiting connection in turn: a connection that pipelines thousands of checks does not
//! make another's wait behind all of them. A check that finds no call on its way is sent
//! alone at once, from its own task.
//!
//! Every check is answered exactly once, with its own outcome or
//! [`StoreError::Unavailable`]: a check that fails inside Redis fails alone, having paid
//! nothing (the script runs each under `pcall`); a call that fails fails each check it
//! carried; a caller whose timeout passes is answered `Unavailable` at once, and its
//! check, if still waiting, is dropped, or refused by the script past its deadline.

use std::collections::hash_map::RandomState;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};

use super::answer::CheckAnswer;
use super::client::{self, Client};
use super::connection::hash_tag;
use super::names;
use super::script::Call;
use crate::store::{LastRun, StoreError, StoreResult};

/// The most checks in one call: a call holds Redis for all of them.
const MAX_BATCH: usize = 128;
/// A call takes no further check once it holds this many keys (large `check_many`s).
const MAX_BATCH_KEYS: usize = 1024;
/// Calls on their way at once.
const BATCHES_IN_FLIGHT: usize = 3;

/// One check waiting for its call.
struct Waiting {
    part: Call,
    connection: u64,
    sent: Instant,
    last_run: LastRun,
    reply: oneshot::Sender<StoreResult<CheckAnswer>>,
}

/// The queue of checks and its dispatcher.
pub struct Batcher {
    client: Arc<Client>,
    runs: Arc<Runs>,
    turns: Arc<Semaphore>,
    queue: mpsc::UnboundedSender<Waiting>,
    timeout: Duration,
}

impl Batcher {
    /// Starts the dispatcher; must run inside a Tokio runtime. Calls' run markers are named
    /// under `prefix`.
    pub fn start(client: Arc<Client>, prefix: Vec<u8>, timeout: Duration) -> Self {
        let (queue, waiting) = mpsc::unbounded_channel();
        let runs = Arc::new(Runs {
            prefix,
            process: RandomState::new().hash_one(std::process::id()),
            next: AtomicU64::new(0),
        });
        let turns = Arc::new(Semaphore::new(BATCHES_IN_FLIGHT));
        tokio::spawn(dispatch(
            client.clone(),
            waiting,
            runs.clone(),
            turns.clone(),
        ));
        Self {
            client,
            runs,
            turns,
            queue,
            timeout,
        }
    }

    /// Ends `call` (a `record` or `back_off`, see bucket.lua) with a run marker of its slot
    /// and the marker's lifetime, as a `checks` call has: sent again after a lost
    /// connection, it does not run twice.
    pub fn once(&self, call: &mut Call) {
        let marker = self.runs.marker(hash_tag(call.first_key()));
        call.key(marker)
            .arg(self.client.marker_lifetime().as_millis() as u64);
    }

    /// Runs one check (its keys and arguments, see bucket.lua) that came on `connection`,
    /// within the timeout and not past `last_run`.
    pub async fn check(
        &self,
        part: Call,
        connection: u64,
        last_run: LastRun,
    ) -> StoreResult<CheckAnswer> {
        let sent = Instant::now();
        let (reply, answer) = oneshot::channel();
        let waiting = Waiting {
            part,
            connection,
            sent,
            last_run,
            reply,
        };
        // No call on its way: this one goes alone, at once, from this task. Otherwise it
        // waits for the next call: alone behind a full call, it would hold a turn for the
        // whole of that call, and the checks arriving meanwhile would wait for it.
        let idle = self.turns.available_permits() == BATCHES_IN_FLIGHT;
        let turn = match idle {
            true => self.turns.clone().try_acquire_owned().ok(),
            false => None,
        };
        if let Some(turn) = turn {
            let marker = self.runs.marker(hash_tag(waiting.part.first_key()));
            let client = self.client.clone();
            run(client, marker, vec![waiting], Arc::new(turn)).await;
        } else if self.queue.send(waiting).is_err() {
            return Err(StoreError::Unavailable(
                "the redis dispatcher stopped".into(),
            ));
        }
        match tokio::time::timeout_at((sent + self.timeout).into(), answer).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Err(self.client.unavailable("the check was dropped unanswered")),
            Err(_) => Err(self.client.no_answer()),
        }
    }
}

/// Names every call's run marker uniquely: this process's random number and a count.
struct Runs {
    prefix: Vec<u8>,
    process: u64,
    next: AtomicU64,
}

impl Runs {
    fn marker(&self, tag: &[u8]) -> Vec<u8> {
        let run = self.next.fetch_add(1, Ordering::Relaxed);
        let mut marker = Vec::with_capacity(self.prefix.len() + tag.len() + 40);
        names::write_run_marker(&mut marker, &self.prefix, tag, self.process, run);
        marker
    }
}

/// Checks waiting for a call, by connection, taken one per connection in turn.
#[derive(Default)]
struct Queues {
    /// Checks in every connection's queue.
    waiting: usize,
    by_connection: HashMap<u64, VecDeque<Waiting>>,
    /// The connections with checks waiting, the next to serve first.
    order: VecDeque<u64>,
}

impl Queues {
    fn push(&mut self, waiting: Waiting) {
        self.waiting += 1;
        let queue = self.by_connection.entry(waiting.connection).or_default();
        if queue.is_empty() {
            self.order.push_back(waiting.connection);
        }
        queue.push_back(waiting);
    }

    fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// The first check waiting of the connection whose turn it is.
    fn pop(&mut self) -> Option<Waiting> {
        let connection = self.order.pop_front()?;
        let queue = self.by_connection.get_mut(&connection)?;
        let waiting = queue.pop_front();
        self.waiting -= usize::from(waiting.is_some());
        if queue.is_empty() {
            self.by_connection.remove(&connection);
        } else {
            self.order.push_back(connection);
        }
        waiting
    }
}

async fn dispatch(
    client: Arc<Client>,
    mut queue: mpsc::UnboundedReceiver<Waiting>,
    runs: Arc<Runs>,
    turns: Arc<Semaphore>,
) {
    let mut queues = Queues::default();
    loop {
        if queues.is_empty() {
            let Some(first) = queue.recv().await else {
                return;
            };
            queues.push(first);
        }
        // Never closed: acquiring only waits. A turn is held only by a call on its way.
        let Ok(turn) = turns.clone().acquire_owned().await else {
            return;
        };
        // Yields once, so that the tasks already woken run and the runtime reads its input:
        // the checks read with the first join this call.
        tokio::task::yield_now().await;
        while let Ok(next) = queue.try_recv() {
            queues.push(next);
        }
        let mut keys = 0;
        let mut batch = Vec::new();
        let share = queues.waiting.div_ceil(1 + turns.available_permits());
        while batch.len() < MAX_BATCH.min(share) && keys < MAX_BATCH_KEYS {
            let Some(next) = queues.pop() else {
                break;
            };
            // Callers that gave up were answered already.
            if !next.reply.is_closed() {
                keys += next.part.key_count();
                batch.push(next);
            }
        }
        let turn = Arc::new(turn);
        for (tag, checks) in by_slot(&client, batch) {
            let marker = runs.marker(&tag);
            tokio::spawn(run(client.clone(), marker, checks, turn.clone()));
        }
    }
}

/// The checks by the hash tag of their keys on a cluster (a call runs on one node); all
/// together on one server, under the first one's tag.
fn by_slot(client: &Client, batch: Vec<Waiting>) -> BTreeMap<Vec<u8>, Vec<Waiting>> {
    let mut slots: BTreeMap<Vec<u8>, Vec<Waiting>> = BTreeMap::new();
    let mut first = None;
    for waiting in batch {
        let tag = hash_tag(waiting.part.first_key()).to_vec();
        let tag = match client.is_cluster() {
            true => tag,
            false => first.get_or_insert(tag).clone(),
        };
        slots.entry(tag).or_default().push(waiting);
    }
    slots
}

/// Sends one call and answers each of its checks.
async fn run(
    client: Arc<Client>,
    marker: Vec<u8>,
    checks: Vec<Waiting>,
    _turn: Arc<OwnedSemaphorePermit>,
) {
    let parts: Vec<(Instant, LastRun, &Call)> = checks
        .iter()
        .map(|w| (w.sent, w.last_run, &w.part))
        .collect();
    let answer = client.invoke_checks(&marker, &parts).await;
    drop(parts);
    match answer {
        Ok((now, answers)) if answers.len() == checks.len() => {
            client.observe(now);
            for (waiting, answer) in checks.into_iter().zip(answers) {
                let answer = match answer.0.as_str() {
                    "late" => Err(client::late_refusal(waiting.sent)),
                    result => match result.strip_prefix("error ") {
                        Some(error) => Err(client.unavailable(error)),
                        None => Ok(answer),
                    },
                };
                let _ = waiting.reply.send(answer);
            }
        }
        Ok((_, answers)) => {
            let message = format!(
                "the Redis script answered {} checks of {}",
                answers.len(),
                checks.len()
            );
            fail(checks, &message);
        }
        Err(StoreError::Unavailable(message)) => fail(checks, &message),
        Err(StoreError::Invalid(error)) => fail(checks, &client.located(error.message())),
    }
}

fn fail(checks: Vec<Waiting>, message: &str) {
    for waiting in checks {
        let _ = waiting
            .reply
            .send(Err(StoreError::Unavailable(message.to_string())));
    }
}

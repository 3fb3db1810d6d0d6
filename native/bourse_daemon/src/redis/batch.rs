//! Concurrent checks share round trips. Each check waits in its connection's queue of its
//! lane; the lane's dispatcher takes checks waiting (up to [`MAX_BATCH`], or
//! [`MAX_BATCH_KEYS`]) into one `checks` call of the script, while at most
//! [`BATCHES_IN_FLIGHT`] calls of the lane are on their way, so the checks that arrive
//! meanwhile form the next calls. A call takes its share of the checks waiting, divided
//! among the turns free: calls on their way together run in Redis while the answers of the
//! others are handled, instead of every caller moving as one convoy. (While calls of other
//! lanes are on their way, Redis is busy with those: it takes every check waiting.) It
//! takes one check of each waiting connection in turn: a connection that pipelines
//! thousands of checks does not make another's wait behind all of them. A check that finds
//! no call of its lane on its way is sent alone at once, from its own task.
//!
//! One server has one lane. A cluster has a lane per hash slot, so that each call runs on
//! one node, and a node that stalls holds the turns of its own slots only: the checks of
//! the other nodes go on.
//!
//! Every check is answered exactly once, with its own outcome or
//! [`StoreError::Unavailable`]: a check that fails inside Redis fails alone, having paid
//! nothing (the script runs each under `pcall`); a call that fails fails each check it
//! carried; a caller whose timeout passes is answered `Unavailable` at once, and its
//! check, if still waiting, is dropped, or refused by the script past its deadline. A
//! call whose answer comes after its callers stopped waiting (Redis ran it, then stopped
//! before answering) is still read, in the background, and what it paid for a caller who
//! got no answer is given back by a `refunds` call.

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};

use super::answer::{self, CheckAnswer};
use super::client::{self, Client};
use super::connection::{self, hash_tag};
use super::debit;
use super::names;
use super::script::{self, Call};
use crate::store::{LastRun, StoreError, StoreResult};

/// The most checks in one call: a call holds Redis for all of them.
const MAX_BATCH: usize = 128;
/// A call takes no further check once it holds this many keys (large `check_many`s).
const MAX_BATCH_KEYS: usize = 1024;
/// Calls on their way at once.
const BATCHES_IN_FLIGHT: usize = 3;
/// Checks waiting in a lane's queues at which those whose callers gave up are first dropped
/// (then again each time the count doubles).
const FIRST_SWEEP: usize = 1024;

/// One check waiting for its call.
struct Waiting {
    part: Call,
    connection: u64,
    sent: Instant,
    last_run: LastRun,
    reply: oneshot::Sender<StoreResult<CheckAnswer>>,
}

/// The lanes of checks and their dispatchers.
pub struct Batcher {
    client: Arc<Client>,
    runs: Arc<Runs>,
    calls: Arc<AtomicUsize>,
    lanes: Lanes,
    timeout: Duration,
}

/// Where checks wait: in one lane, or in a lane per hash slot on a cluster (started with
/// its slot's first check; there are 16,384 slots).
enum Lanes {
    One(Arc<Lane>),
    BySlot(Mutex<HashMap<u16, Arc<Lane>>>),
}

/// Checks waiting for calls to one server or one slot, and the turns of those calls.
/// (Boxed in the queue: its blocks then hold pointers, not checks, so a lane that waits
/// for its next check holds a few hundred bytes.)
struct Lane {
    turns: Arc<Semaphore>,
    queue: mpsc::UnboundedSender<Box<Waiting>>,
}

impl Lane {
    /// Starts the lane's dispatcher, which ends with the lane; must run inside a Tokio
    /// runtime.
    fn start(client: &Arc<Client>, runs: &Arc<Runs>, calls: &Arc<AtomicUsize>) -> Arc<Self> {
        let (queue, waiting) = mpsc::unbounded_channel();
        let turns = Arc::new(Semaphore::new(BATCHES_IN_FLIGHT));
        tokio::spawn(dispatch(
            client.clone(),
            waiting,
            runs.clone(),
            Turns {
                lane: turns.clone(),
                calls: calls.clone(),
            },
        ));
        Arc::new(Self { turns, queue })
    }
}

impl Batcher {
    /// Starts the lane of one server (a cluster's start with their checks); must run inside
    /// a Tokio runtime. Calls' run markers are named under `prefix`.
    pub fn start(client: Arc<Client>, prefix: Vec<u8>, timeout: Duration) -> Self {
        let runs = Arc::new(Runs {
            prefix,
            process: RandomState::new().hash_one(std::process::id()),
            next: AtomicU64::new(0),
        });
        let calls = Arc::default();
        let lanes = match client.is_cluster() {
            true => Lanes::BySlot(Mutex::default()),
            false => Lanes::One(Lane::start(&client, &runs, &calls)),
        };
        Self {
            client,
            runs,
            calls,
            lanes,
            timeout,
        }
    }

    /// Ends `call` (a `back_off`, see bucket.lua) with a run marker of its slot
    /// and the marker's lifetime, as a `checks` call has: sent again after a lost
    /// connection, it does not run twice.
    pub fn once(&self, call: &mut Call) {
        self.runs.once(call, self.client.marker_lifetime());
    }

    /// Runs one `record` call (its keys and arguments, see bucket.lua) once, within the
    /// timeout and not past `last_run`; a debit answered late is given back (`debit`).
    pub async fn record(&self, call: Call, last_run: LastRun) -> StoreResult<()> {
        debit::record(self.client.clone(), self.runs.clone(), call, last_run).await
    }

    /// Gives back the booking of the check `check` (see [`unbook`]).
    pub async fn unbook(&self, check: &Call) -> StoreResult<bool> {
        unbook(&self.client, &self.runs, check).await
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
        let lane = self.lane(part.first_key());
        let waiting = Waiting {
            part,
            connection,
            sent,
            last_run,
            reply,
        };
        // No call of its lane on its way: this one goes alone, at once, from this task.
        // Otherwise it waits for the next call: alone behind a full call, it would hold a
        // turn for the whole of that call, and the checks arriving meanwhile would wait for
        // it.
        let idle = lane.turns.available_permits() == BATCHES_IN_FLIGHT;
        let turn = match idle {
            true => lane.turns.clone().try_acquire_owned().ok(),
            false => None,
        };
        // Its caller is not waited for past its request's last moment to run: an answer that
        // comes later (Redis ran the check, then stalled) would reach a caller who gave up,
        // and be paid; not taken, it is given back when it comes.
        let timeout = sent + self.timeout;
        let until = last_run.map_or(timeout, |last| last.min(timeout));
        if let Some(turn) = turn {
            let turn = Turn::new(turn, &self.calls);
            let client = self.client.clone();
            let mut call = Box::pin(run(client, self.runs.clone(), vec![waiting], turn));
            // Past the timeout, its answer is read in the background.
            if tokio::time::timeout_at(until.into(), &mut call)
                .await
                .is_err()
            {
                tokio::spawn(call);
            }
        } else if lane.queue.send(Box::new(waiting)).is_err() {
            return Err(StoreError::Unavailable(
                "the redis dispatcher stopped".into(),
            ));
        }
        let mut answer = answer;
        match tokio::time::timeout_at(until.into(), &mut answer).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Err(self.client.unavailable("the check was dropped unanswered")),
            // Closed, then read: an answer sent meanwhile is this caller's; none can come
            // after, so every answer that was not read is known to its sender.
            Err(_) => {
                answer.close();
                match answer.try_recv() {
                    Ok(answer) => answer,
                    Err(_) if until < timeout => Err(self.client.unavailable(
                        "no answer by the request's last moment to run; what the check \
                         paid, if it ran, is given back when the answer comes",
                    )),
                    Err(_) => Err(self.client.no_answer()),
                }
            }
        }
    }

    /// The lane of a check whose first key is `key`.
    fn lane(&self, key: &[u8]) -> Arc<Lane> {
        match &self.lanes {
            Lanes::One(lane) => lane.clone(),
            Lanes::BySlot(lanes) => lanes
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(connection::slot(key))
                .or_insert_with(|| Lane::start(&self.client, &self.runs, &self.calls))
                .clone(),
        }
    }
}

/// Names every call's run marker uniquely: this process's random number and a count.
pub struct Runs {
    prefix: Vec<u8>,
    process: u64,
    next: AtomicU64,
}

impl Runs {
    /// Ends `call` with a run marker of its first key's slot and the marker's `lifetime`.
    pub fn once(&self, call: &mut Call, lifetime: Duration) {
        let marker = self.marker(hash_tag(call.first_key()));
        call.key(marker).arg(lifetime.as_millis() as u64);
    }

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
    /// The count of checks waiting at which those whose callers gave up are next dropped.
    sweep_at: usize,
}

impl Queues {
    /// Queues a check; past [`Self::sweep_at`], drops those whose callers gave up (while
    /// Redis is stopped every turn is held, and the callers' timeouts pass in the queue).
    fn push(&mut self, waiting: Waiting) {
        self.waiting += 1;
        let queue = self.by_connection.entry(waiting.connection).or_default();
        if queue.is_empty() {
            self.order.push_back(waiting.connection);
        }
        queue.push_back(waiting);
        if self.waiting >= self.sweep_at.max(FIRST_SWEEP) {
            self.drop_given_up();
            self.sweep_at = 2 * self.waiting;
        }
    }

    fn drop_given_up(&mut self) {
        self.by_connection.retain(|_, queue| {
            queue.retain(|waiting| !waiting.reply.is_closed());
            !queue.is_empty()
        });
        let by_connection = &self.by_connection;
        self.order
            .retain(|connection| by_connection.contains_key(connection));
        self.waiting = by_connection.values().map(VecDeque::len).sum();
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

/// A lane's turns, and the calls on their way in every lane.
struct Turns {
    lane: Arc<Semaphore>,
    calls: Arc<AtomicUsize>,
}

/// A call's turn, counted among the calls on their way while it lives.
struct Turn {
    _permit: OwnedSemaphorePermit,
    calls: Arc<AtomicUsize>,
}

impl Turn {
    fn new(permit: OwnedSemaphorePermit, calls: &Arc<AtomicUsize>) -> Self {
        calls.fetch_add(1, Ordering::Relaxed);
        Self {
            _permit: permit,
            calls: calls.clone(),
        }
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        self.calls.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn dispatch(
    client: Arc<Client>,
    mut queue: mpsc::UnboundedReceiver<Box<Waiting>>,
    runs: Arc<Runs>,
    turns: Turns,
) {
    let mut queues = Queues::default();
    loop {
        if queues.is_empty() {
            let Some(first) = queue.recv().await else {
                return;
            };
            queues.push(*first);
        }
        // A turn is held only by a call on its way. Meanwhile the checks arriving are
        // queued, so that those whose callers give up can be dropped.
        let turn = loop {
            tokio::select! {
                biased;
                turn = turns.lane.clone().acquire_owned() => break turn,
                next = queue.recv(), if !queue.is_closed() => match next {
                    Some(next) => queues.push(*next),
                    None => continue,
                },
            }
        };
        // Never closed: acquiring only waits.
        let Ok(turn) = turn else {
            return;
        };
        let turn = Turn::new(turn, &turns.calls);
        // Yields once, so that the tasks already woken run and the runtime reads its input:
        // the checks read with the first join this call.
        tokio::task::yield_now().await;
        while let Ok(next) = queue.try_recv() {
            queues.push(*next);
        }
        let mut keys = 0;
        let mut batch = Vec::new();
        let free = turns.lane.available_permits();
        // Read apart, the two counts may briefly disagree: never below none.
        let others = turns
            .calls
            .load(Ordering::Relaxed)
            .saturating_sub(BATCHES_IN_FLIGHT - free);
        let share = match others {
            0 => queues.waiting.div_ceil(1 + free),
            _ => queues.waiting,
        };
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
        if !batch.is_empty() {
            tokio::spawn(run(client.clone(), runs.clone(), batch, turn));
        }
    }
}

/// Sends one call of `checks` (not empty) and answers each of them. The call's turn ends
/// with its timeout; past it, its answer is read only in a place for late calls.
async fn run(client: Arc<Client>, runs: Arc<Runs>, checks: Vec<Waiting>, turn: Turn) {
    // Every check of a lane goes to one node: one call, named under the first's tag.
    let marker = runs.marker(hash_tag(checks[0].part.first_key()));
    let answer = {
        let parts: Vec<(Instant, LastRun, &Call)> = checks
            .iter()
            .map(|w| (w.sent, w.last_run, &w.part))
            .collect();
        let call = client.invoke_checks(&marker, &parts);
        tokio::pin!(call);
        match tokio::time::timeout(client.timeout(), &mut call).await {
            Ok(answer) => answer,
            Err(_) => {
                drop(turn);
                let bytes = checks.iter().map(|w| w.part.bytes()).sum();
                match client.late_place(bytes, &marker) {
                    Some(_place) => call.await,
                    None => Err(client.no_answer()),
                }
            }
        }
    };
    match answer {
        Ok((now, answers)) if answers.len() == checks.len() => {
            client.observe(now);
            let mut unanswered = Vec::new();
            for (waiting, answer) in checks.into_iter().zip(answers) {
                let answer = match answer.0.as_str() {
                    "late" => Err(client::late_refusal(waiting.sent)),
                    result => match result.strip_prefix("error ") {
                        Some(error) => Err(client.unavailable(error)),
                        None => Ok(answer),
                    },
                };
                if let Err(Ok((result, ..))) = waiting.reply.send(answer) {
                    if matches!(answer::word(&result), "admitted" | "booked") {
                        unanswered.push((result, waiting.part));
                    }
                }
            }
            if !unanswered.is_empty() {
                give_back(&client, &runs, now, &unanswered).await;
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

/// Gives back the booking the check `check` (its keys and arguments) made, its caller
/// having been told Redis was unavailable (`unbook`); returns whether any bucket got it
/// back. Run once, within the answer window: it may wait behind the caller's last check,
/// which Redis may still be working through.
pub async fn unbook(client: &Client, runs: &Runs, check: &Call) -> StoreResult<bool> {
    let mut call = script::refunds(0, client.passed(), &[("booked", check)]);
    runs.once(&mut call, client.answer_window());
    let given: u64 = client.invoke_in_window(&call).await?;
    Ok(given > 0)
}

/// Gives back what the checks `paid` paid (or a debit, `debit`) in a call that ran at
/// `paid_at` (Redis clock), their callers having had no answer. Run once, until the end of
/// the answer window: Redis may run it late (still working through what piled up while it
/// was stopped), and it is right then too.
pub async fn give_back(client: &Client, runs: &Runs, paid_at: u64, paid: &[(String, Call)]) {
    let paid: Vec<(&str, &Call)> = paid.iter().map(|(r, call)| (r.as_str(), call)).collect();
    let mut call = script::refunds(paid_at, client.passed(), &paid);
    runs.once(&mut call, client.answer_window());
    let _ = client.invoke_in_window::<u64>(&call).await;
}

fn fail(checks: Vec<Waiting>, message: &str) {
    for waiting in checks {
        let _ = waiting
            .reply
            .send(Err(StoreError::Unavailable(message.to_string())));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Answer = oneshot::Receiver<StoreResult<CheckAnswer>>;

    fn waiting(connection: u64) -> (Waiting, Answer) {
        let (reply, answer) = oneshot::channel();
        let waiting = Waiting {
            part: Call::default(),
            connection,
            sent: Instant::now(),
            last_run: None,
            reply,
        };
        (waiting, answer)
    }

    /// While every turn is held (Redis stopped), checks keep arriving and their callers give
    /// up: those are dropped once they pile up, and every check whose caller still waits
    /// stays, in its connection's order.
    #[test]
    fn checks_whose_callers_gave_up_do_not_pile_up() {
        let mut queues = Queues::default();
        let mut still_waiting = Vec::new();
        for i in 0..10_000u64 {
            let (waiting, answer) = waiting(i % 4);
            if i % 1000 == 0 {
                still_waiting.push(answer);
            }
            queues.push(waiting);
        }
        assert!(
            queues.waiting < FIRST_SWEEP + 10,
            "{} waiting",
            queues.waiting
        );
        let mut popped = Vec::new();
        while let Some(waiting) = queues.pop() {
            if !waiting.reply.is_closed() {
                popped.push(waiting.sent);
            }
        }
        assert_eq!(popped.len(), still_waiting.len());
        assert!(popped.is_sorted(), "out of order");
    }
}

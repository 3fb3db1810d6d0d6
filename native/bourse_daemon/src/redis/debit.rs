//! `record` calls: debits. A debit's caller is not waited for past its request's last
//! moment to run; an answer that comes later (Redis ran the debit, then stalled before
//! answering) is still read, in the background, and what it debited is given back by a
//! `refunds` call, as a late check's payment is (`batch`): a caller told `unavailable`
//! never pays.

use std::sync::Arc;
use std::time::Instant;

use super::answer;
use super::batch::{self, Runs};
use super::client::Client;
use super::script::{self, Call};
use crate::store::{LastRun, StoreResult};

/// Runs the `record` call `call` once, within the timeout and not past `last_run`.
pub async fn record(
    client: Arc<Client>,
    runs: Arc<Runs>,
    mut call: Call,
    last_run: LastRun,
) -> StoreResult<()> {
    runs.once(&mut call, client.marker_lifetime());
    let timeout = Instant::now() + client.timeout();
    let until = last_run.map_or(timeout, |last| last.min(timeout));
    let bytes = call.bytes();
    let marker = call.last_key().to_vec();
    let reading = Arc::clone(&client);
    let mut answer = Box::pin(async move {
        let answer = reading.invoke_read_late::<String>(&call, last_run).await;
        (answer, call)
    });
    match tokio::time::timeout_at(until.into(), &mut answer).await {
        Ok((answer, _)) => {
            client.observe(answer::recorded(&answer?)?.at);
            Ok(())
        }
        Err(_) => {
            let error = match until < timeout {
                true => client.unavailable(
                    "no answer by the request's last moment to run; what the debit took, \
                     if it ran, is given back when the answer comes",
                ),
                false => client.no_answer(),
            };
            if let Some(place) = client.late_place(bytes, &marker) {
                tokio::spawn(async move {
                    let _place = place;
                    if let (Ok(text), call) = answer.await {
                        give_back(&client, &runs, &text, &call).await;
                    }
                });
            }
            Err(error)
        }
    }
}

/// Gives back the debit of the `record` call `call`, answered `text` after its caller
/// stopped waiting.
async fn give_back(client: &Client, runs: &Runs, text: &str, call: &Call) {
    let Ok(recorded) = answer::recorded(text) else {
        return;
    };
    client.observe(recorded.at);
    let result = format!("recorded {}", recorded.definition);
    batch::give_back(
        client,
        runs,
        recorded.at,
        &[(result, script::debit_of(call))],
    )
    .await;
}

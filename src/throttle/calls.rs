//! Global calls batched across keys: the calls that fall due together (fetches, charges,
//! hand-backs of any keys, queued within one scheduler turn) go to the store as one
//! [`call_many`](crate::global::GlobalStore::call_many), at most
//! [`global_batch`](crate::Builder::global_batch) calls at a time. Each call keeps its own
//! answer and failure; the batch as a whole has the store time-out, after which its calls end
//! as timed out (their futures dropped, as a single call's would be).

use std::sync::{Arc, Mutex};

use futures_util::StreamExt;
use tokio::sync::oneshot;

use crate::clock::Clock;
use crate::global::{Answer, Call};
use crate::quota::BucketKey;
use crate::sync::lock;
use crate::throttle::{Global, Key, Local, Throttle};

/// Calls waiting for the next batch.
pub(crate) struct CallQueue<K> {
    state: Mutex<Queue<K>>,
}

/// A queued call, and where its answer goes.
type Pending<K> = (
    Call<BucketKey<K>>,
    oneshot::Sender<Result<Answer, CallFailure>>,
);

struct Queue<K> {
    pending: Vec<Pending<K>>,
    /// A flush is scheduled: calls queued now go with it.
    flushing: bool,
}

impl<K> Default for CallQueue<K> {
    fn default() -> Self {
        Self {
            state: Mutex::new(Queue {
                pending: Vec::new(),
                flushing: false,
            }),
        }
    }
}

/// Why a call has no answer.
pub(crate) enum CallFailure {
    /// The store answered with an error, which may have been after it took effect.
    Store {
        error: Box<dyn std::error::Error + Send + Sync>,
        may_have_applied: bool,
    },
    /// No answer within the store time-out (or its batch never ran: no runtime, or the
    /// runtime shut down).
    TimedOut,
}

impl<K: Key, G: Global<K>, L: Local<K>, C: Clock> Throttle<K, G, L, C> {
    /// Makes `call` with the next batch of global calls, and waits for its answer.
    pub(crate) async fn call_store(
        self: &Arc<Self>,
        call: Call<BucketKey<K>>,
    ) -> Result<Answer, CallFailure> {
        let (answer, receiver) = oneshot::channel();
        let first = {
            let mut queue = lock(&self.calls.state);
            queue.pending.push((call, answer));
            !std::mem::replace(&mut queue.flushing, true)
        };
        if first {
            self.schedule_flush();
        }
        receiver.await.unwrap_or(Err(CallFailure::TimedOut))
    }

    /// Runs the next batch in a task of its own; without a runtime, the queued calls end
    /// unanswered.
    fn schedule_flush(self: &Arc<Self>) {
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(self.clone().flush());
            }
            Err(_) => {
                let mut queue = lock(&self.calls.state);
                queue.pending.clear();
                queue.flushing = false;
            }
        }
    }

    async fn flush(self: Arc<Self>) {
        // Calls queued by the tasks already scheduled join this batch.
        tokio::task::yield_now().await;
        let batch: Vec<_> = {
            let mut queue = lock(&self.calls.state);
            let n = queue.pending.len().min(self.config.global_batch);
            let batch = queue.pending.drain(..n).collect();
            if queue.pending.is_empty() {
                queue.flushing = false;
            } else {
                // The rest go in a batch of their own, at the same time.
                drop(queue);
                self.schedule_flush();
            }
            batch
        };
        self.stats.global_batches.incr();
        let (calls, senders): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
        let mut senders: Vec<_> = senders.into_iter().map(Some).collect();
        let deadline = tokio::time::Instant::now() + self.config.store_timeout;
        let answers = self.global.call_many(calls);
        let mut answers = std::pin::pin!(answers);
        while let Ok(Some((i, answer))) = tokio::time::timeout_at(deadline, answers.next()).await {
            let Some(sender) = senders.get_mut(i).and_then(Option::take) else {
                continue;
            };
            let answer = answer.map_err(|error| CallFailure::Store {
                may_have_applied: self.global.may_have_applied(&error),
                error: Box::new(error),
            });
            // Tokens dispensed to a caller that went away (a charge dropped with its
            // response) are neither used nor handed back.
            if let Err(Ok(Answer::Granted(grant))) = sender.send(answer) {
                let tokens = grant.granted.saturating_add(grant.reserved);
                self.stats.tokens_forfeited.add(tokens);
            }
        }
        // Calls still unanswered end as timed out when their senders are dropped here.
    }
}

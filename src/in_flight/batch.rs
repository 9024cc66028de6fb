//! Slot calls batched across keys: the calls of all keys made within one scheduler turn go to
//! the store as one [`hold_many`](SlotStore::hold_many) (on Redis, one script per node), at most
//! [`MAX_BATCH`] at a time. Each call keeps its own answer and its own time-out; the batch as a
//! whole has the store time-out from when it is sent, after which its unanswered calls fail.

use std::hash::Hash;
use std::sync::{Arc, Mutex};

use futures_util::StreamExt;
use tokio::sync::oneshot;

use crate::clock::Clock;
use crate::global::slots::{Holding, SlotHold, SlotStore};
use crate::in_flight::Shared;
use crate::quota::BucketKey;
use crate::sync::lock;

/// The most slot calls sent in one round trip.
const MAX_BATCH: usize = 128;

/// A queued call, and where its answer goes (dropped unanswered: the call failed).
type Pending<K> = (BucketKey<K>, u64, SlotHold, oneshot::Sender<Holding>);

/// The slot calls waiting for the next batch.
pub(crate) struct SlotCalls<K> {
    state: Mutex<Queue<K>>,
}

struct Queue<K> {
    pending: Vec<Pending<K>>,
    /// A flush task is on its way for the pending calls.
    scheduled: bool,
}

impl<K> Default for SlotCalls<K> {
    fn default() -> Self {
        Self {
            state: Mutex::new(Queue {
                pending: Vec::new(),
                scheduled: false,
            }),
        }
    }
}

impl<K, S, C> Shared<K, S, C>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    S: SlotStore<BucketKey<K>>,
    C: Clock,
{
    /// Sets this host's holding of `bucket` with the next batch; `None` when the call failed,
    /// timed out or never ran (its runtime shut down).
    pub(super) async fn hold(
        self: &Arc<Self>,
        bucket: BucketKey<K>,
        max: u64,
        hold: SlotHold,
    ) -> Option<Holding> {
        let (sender, receiver) = oneshot::channel();
        let flush = {
            let mut queue = lock(&self.batch.state);
            queue.pending.push((bucket, max, hold, sender));
            !std::mem::replace(&mut queue.scheduled, true)
        };
        if flush {
            self.schedule_flush();
        }
        receiver.await.ok()
    }

    /// Runs the next batch on a task of its own; without a runtime, the queued calls fail.
    fn schedule_flush(self: &Arc<Self>) {
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(self.clone().flush());
            }
            Err(_) => {
                let mut queue = lock(&self.batch.state);
                queue.pending.clear();
                queue.scheduled = false;
            }
        }
    }

    /// Sends the calls queued by this scheduler turn as one batch (a further batch goes on a
    /// task of its own when more than [`MAX_BATCH`] wait).
    async fn flush(self: Arc<Self>) {
        let mut unflushed = Unflushed {
            calls: &self.batch,
            armed: true,
        };
        // Calls made by the tasks already scheduled join this batch.
        tokio::task::yield_now().await;
        let (batch, more) = {
            let mut queue = lock(&self.batch.state);
            let n = queue.pending.len().min(MAX_BATCH);
            let batch: Vec<_> = queue.pending.drain(..n).collect();
            let more = !queue.pending.is_empty();
            queue.scheduled = more;
            (batch, more)
        };
        unflushed.armed = false;
        if more {
            self.schedule_flush();
        }
        if batch.is_empty() {
            return;
        }
        self.counters
            .store_round_trips
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (holds, senders): (Vec<_>, Vec<_>) = batch
            .into_iter()
            .map(|(bucket, max, hold, sender)| ((bucket, max, hold), sender))
            .unzip();
        let mut senders: Vec<_> = senders.into_iter().map(Some).collect();
        let deadline = tokio::time::Instant::now() + self.settings.store_timeout;
        let answers = self.store.hold_many(holds);
        let mut answers = std::pin::pin!(answers);
        while let Ok(Some((i, answer))) = tokio::time::timeout_at(deadline, answers.next()).await {
            let sender = senders.get_mut(i).and_then(Option::take);
            if let (Some(sender), Ok(holding)) = (sender, answer) {
                let _gone = sender.send(holding);
            }
        }
        // The calls still unanswered fail as their senders drop.
    }
}

/// A flush task until it takes its calls: dropped first (its runtime shut down), it fails the
/// queued calls and lets the next call schedule a flush afresh, rather than leave them for a
/// task that will never run.
struct Unflushed<'a, K> {
    calls: &'a SlotCalls<K>,
    armed: bool,
}

impl<K> Drop for Unflushed<'_, K> {
    fn drop(&mut self) {
        if self.armed {
            let mut queue = lock(&self.calls.state);
            queue.pending.clear();
            queue.scheduled = false;
        }
    }
}

//! Slot calls batched across keys: the calls of all keys made within one scheduler turn go to
//! the store through the [call queue](crate::call_queue) as one
//! [`hold_many`](SlotStore::hold_many) (on Redis, one script per node), at most the layer's
//! `store_batch` at a time. Each call keeps its own answer; the batch as a whole has the store
//! time-out from when it is sent, after which its unanswered calls fail.

use std::hash::Hash;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures_util::{Stream, StreamExt};

use crate::call_queue::{self, CallQueue, Due, SendsCalls};
use crate::clock::Clock;
use crate::global::slots::{Holding, SlotHold, SlotStore};
use crate::in_flight::Shared;
use crate::quota::BucketKey;

/// A call for a holding: the key's bucket, its limit, and the holding asked for.
type HoldCall<K> = (BucketKey<K>, u64, SlotHold);

/// The engine's queue of slot calls (an answer is `None` when the call failed).
pub(crate) type SlotCalls<K> = CallQueue<HoldCall<K>, Option<Holding>>;

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
        let reply = call_queue::call(self, (bucket, max, hold), Due::Now).await;
        reply.answer.flatten()
    }
}

impl<K, S, C> SendsCalls for Shared<K, S, C>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    S: SlotStore<BucketKey<K>>,
    C: Clock,
{
    type Call = HoldCall<K>;
    type Answer = Option<Holding>;

    fn queue(&self) -> &SlotCalls<K> {
        &self.calls
    }

    fn max_batch(&self) -> usize {
        self.settings.store_batch
    }

    fn store_timeout(&self) -> Duration {
        self.settings.store_timeout
    }

    fn now(&self) -> u64 {
        Shared::now(self)
    }

    fn send(&self, calls: Vec<Self::Call>) -> impl Stream<Item = (usize, Self::Answer)> + Send {
        self.store
            .hold_many(calls)
            .map(|(i, answer)| (i, answer.ok()))
    }

    fn count_round_trip(&self) {
        self.counters
            .store_round_trips
            .fetch_add(1, Ordering::Relaxed);
    }
}

//! Global calls batched across keys: fetches, charges and hand-backs of any keys go to the store
//! through the [call queue](crate::call_queue) as one
//! [`call_many`](crate::global::GlobalStore::call_many), at most
//! [`global_batch`](crate::Builder::global_batch) calls at a time. A call nothing waits on (a
//! credit's fetch, a hand-back of a key far from its limit, a refill ahead of a lease running
//! dry) may wait up to [`global_batch_linger`](crate::Builder::global_batch_linger) for others
//! to join it, until a request starts waiting on any call.

use std::sync::Arc;
use std::time::Duration;

use futures_util::{Stream, StreamExt};

use crate::call_queue::{self, CallQueue, SendsCalls};
use crate::clock::Clock;
use crate::error::BoxError;
use crate::global::{Answer, Call};
use crate::quota::BucketKey;
use crate::throttle::{Global, Key, Local, Throttle};

pub(crate) use crate::call_queue::Due;

/// The throttle's queue of global calls.
pub(crate) type GlobalCalls<K> = CallQueue<Call<BucketKey<K>>, Result<Answer, CallFailure>>;

/// A call's answer (or why it has none), and when its batch left for the store (in the
/// throttle's clock).
pub(crate) struct Reply {
    pub(crate) sent_at: u64,
    pub(crate) answer: Result<Answer, CallFailure>,
}

/// Why a call has no answer.
pub(crate) enum CallFailure {
    /// The store answered with an error, which may have been after it took effect.
    Store {
        error: BoxError,
        may_have_applied: bool,
    },
    /// No answer within the store time-out (or its batch never ran: no runtime, or the
    /// runtime shut down).
    TimedOut,
}

impl<K: Key, G: Global<K>, L: Local<K>, C: Clock> Throttle<K, G, L, C> {
    /// Makes `call` with a batch of global calls, sent when `due` says, and waits for its
    /// reply.
    pub(crate) async fn call_store(self: &Arc<Self>, call: Call<BucketKey<K>>, due: Due) -> Reply {
        let reply = call_queue::call(self, call, due).await;
        Reply {
            sent_at: reply.sent_at,
            answer: reply.answer.unwrap_or(Err(CallFailure::TimedOut)),
        }
    }

    /// A request started waiting on a call of the queue (a fetch it joined): calls that were
    /// lingering go now.
    pub(crate) fn expedite_calls(self: &Arc<Self>) {
        call_queue::expedite(self);
    }
}

impl<K: Key, G: Global<K>, L: Local<K>, C: Clock> SendsCalls for Throttle<K, G, L, C> {
    type Call = Call<BucketKey<K>>;
    type Answer = Result<Answer, CallFailure>;

    fn queue(&self) -> &GlobalCalls<K> {
        &self.calls
    }

    fn max_batch(&self) -> usize {
        self.config.global_batch
    }

    fn store_timeout(&self) -> Duration {
        self.config.store_timeout
    }

    fn now(&self) -> u64 {
        Throttle::now(self)
    }

    fn send(&self, calls: Vec<Self::Call>) -> impl Stream<Item = (usize, Self::Answer)> + Send {
        self.global.call_many(calls).map(|(i, answer)| {
            let answer = answer.map_err(|error| CallFailure::Store {
                may_have_applied: self.global.may_have_applied(&error),
                error: Box::new(error),
            });
            (i, answer)
        })
    }

    fn count_round_trip(&self) {
        self.stats.global_batches.incr();
    }

    /// Tokens dispensed to a caller that went away (a charge dropped with its response) are
    /// neither used nor handed back.
    fn undelivered(&self, answer: Self::Answer) {
        if let Ok(Answer::Granted(grant)) = answer {
            let tokens = grant.granted.saturating_add(grant.reserved);
            self.stats.tokens_forfeited.add(tokens);
        }
    }
}

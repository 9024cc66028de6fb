//! Global calls batched across keys: the calls that fall due together (fetches, charges, hand-backs
//! of any keys) go to the store as one [`call_many`](crate::global::GlobalStore::call_many), at
//! most [`global_batch`](crate::Builder::global_batch) calls at a time. A call a request waits on
//! goes with the next scheduler turn, taking every queued call along; a call that may wait
//! ([`Due::Behind`]: a credit's fetch, a batch fetched well ahead of its lease running
//! dry) waits up to [`global_batch_linger`](crate::Builder::global_batch_linger) for others to join
//! it, until a request starts waiting on any call. Each call keeps its own answer and failure; the
//! batch as a whole has the store time-out from when it is sent, after which its calls end as timed
//! out.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::oneshot;

use crate::clock::Clock;
use crate::error::BoxError;
use crate::global::{Answer, Call};
use crate::quota::BucketKey;
use crate::sync::lock;
use crate::throttle::{Global, Key, Local, Throttle};

/// Calls waiting for the next batch.
pub(crate) struct CallQueue<K> {
    state: Mutex<Queue<K>>,
    /// How many times a request started waiting on a call: a call planned with nothing waiting
    /// on it lingers only if no request started waiting since (see [`Due::Behind`]).
    expedites: AtomicU64,
}

/// A queued call, and where its reply goes.
type Pending<K> = (Call<BucketKey<K>>, oneshot::Sender<Reply>);

/// A call's answer (or why it has none), and when its batch left for the store (in the
/// throttle's clock).
pub(crate) struct Reply {
    pub(crate) sent_at: u64,
    pub(crate) answer: Result<Answer, CallFailure>,
}

struct Queue<K> {
    pending: Vec<Pending<K>>,
    next: NextFlush,
}

/// The flush that will take calls queued now.
#[derive(Clone, Copy, PartialEq, Eq)]
enum NextFlush {
    None,
    /// After the linger.
    Lingering,
    /// With the next scheduler turn.
    Now,
}

/// When a call may go to the store.
#[derive(Clone, Copy)]
pub(crate) enum Due {
    /// A request waits on it: with the next scheduler turn.
    Now,
    /// Nothing waited on it when it was planned, at which time the queue's
    /// [`expedites`](CallQueue::expedites) was `since`: it may linger, unless a request started
    /// waiting since (it may be waiting on this call).
    Behind { since: u64 },
}

impl<K> Default for CallQueue<K> {
    fn default() -> Self {
        Self {
            state: Mutex::new(Queue {
                pending: Vec::new(),
                next: NextFlush::None,
            }),
            expedites: AtomicU64::new(0),
        }
    }
}

impl<K> CallQueue<K> {
    /// The count to plan a call nothing waits on with ([`Due::Behind`]).
    pub(crate) fn behind(&self) -> Due {
        Due::Behind {
            since: self.expedites.load(Ordering::SeqCst),
        }
    }
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
        let (sender, receiver) = oneshot::channel();
        let flush = {
            let mut queue = lock(&self.calls.state);
            queue.pending.push((call, sender));
            let lingers = match due {
                Due::Now => false,
                Due::Behind { since } => {
                    !self.config.global_batch_linger.is_zero()
                        && self.calls.expedites.load(Ordering::SeqCst) == since
                }
            };
            let next = match (lingers, queue.next) {
                (false, NextFlush::None | NextFlush::Lingering) => Some(NextFlush::Now),
                (true, NextFlush::None) => Some(NextFlush::Lingering),
                _ => None,
            };
            if let Some(next) = next {
                queue.next = next;
            }
            next
        };
        if let Some(next) = flush {
            self.schedule_flush(next);
        }
        // No reply: its batch never ran (no runtime, or it shut down), so nothing was sent.
        receiver.await.unwrap_or_else(|_| Reply {
            sent_at: self.now(),
            answer: Err(CallFailure::TimedOut),
        })
    }

    /// A request started waiting on a call of the queue (a fetch it joined): calls that were
    /// lingering go now.
    pub(crate) fn expedite_calls(self: &Arc<Self>) {
        self.calls.expedites.fetch_add(1, Ordering::SeqCst);
        let mut queue = lock(&self.calls.state);
        if queue.next == NextFlush::Lingering {
            queue.next = NextFlush::Now;
            drop(queue);
            self.schedule_flush(NextFlush::Now);
        }
    }

    /// Runs the next batch in a task of its own; without a runtime, the queued calls end
    /// unanswered.
    fn schedule_flush(self: &Arc<Self>, next: NextFlush) {
        let linger = match next {
            NextFlush::Lingering => self.config.global_batch_linger,
            _ => Duration::ZERO,
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(self.clone().flush(linger));
            }
            Err(_) => {
                let mut queue = lock(&self.calls.state);
                queue.pending.clear();
                queue.next = NextFlush::None;
            }
        }
    }

    async fn flush(self: Arc<Self>, linger: Duration) {
        if linger.is_zero() {
            // Calls queued by the tasks already scheduled join this batch.
            tokio::task::yield_now().await;
        } else {
            tokio::time::sleep(linger).await;
        }
        let batch: Vec<_> = {
            let mut queue = lock(&self.calls.state);
            let n = queue.pending.len().min(self.config.global_batch);
            let batch: Vec<_> = queue.pending.drain(..n).collect();
            if queue.pending.is_empty() {
                queue.next = NextFlush::None;
            } else {
                // The rest go in a batch of their own, at the same time.
                queue.next = NextFlush::Now;
                drop(queue);
                self.schedule_flush(NextFlush::Now);
            }
            batch
        };
        if batch.is_empty() {
            // An earlier flush took them.
            return;
        }
        self.stats.global_batches.incr();
        let sent_at = self.now();
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
            if let Err(Reply {
                answer: Ok(Answer::Granted(grant)),
                ..
            }) = sender.send(Reply { sent_at, answer })
            {
                let tokens = grant.granted.saturating_add(grant.reserved);
                self.stats.tokens_forfeited.add(tokens);
            }
        }
        // Calls still unanswered end as timed out (their futures are dropped with the batch).
        for sender in senders.into_iter().flatten() {
            let _gone = sender.send(Reply {
                sent_at,
                answer: Err(CallFailure::TimedOut),
            });
        }
    }
}

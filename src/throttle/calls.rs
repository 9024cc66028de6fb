//! Global calls batched across keys: the calls that fall due together (fetches, charges, hand-backs
//! of any keys) go to the store as one [`call_many`](crate::global::GlobalStore::call_many), at
//! most [`global_batch`](crate::Builder::global_batch) calls at a time. Each call has a time it
//! falls due, and the queue goes when the first of its calls does, or at once when it fills a
//! batch. A call a request waits on falls due with the next scheduler turn, taking every queued
//! call along; a call nothing waits on ([`Due::Behind`]: a credit's fetch, a hand-back of a key
//! far from its limit, a refill ahead of a lease running dry) may wait up to
//! [`global_batch_linger`](crate::Builder::global_batch_linger) for others to join it, until a
//! request starts waiting on any call. Each call keeps its own answer and failure; the batch as a
//! whole has the store time-out from when it is sent, after which its calls end as timed out.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::oneshot;
use tokio::time::Instant;

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

/// A queued call, where its reply goes, and when it falls due.
type Pending<K> = (Call<BucketKey<K>>, oneshot::Sender<Reply>, Instant);

/// A call's answer (or why it has none), and when its batch left for the store (in the
/// throttle's clock).
pub(crate) struct Reply {
    pub(crate) sent_at: u64,
    pub(crate) answer: Result<Answer, CallFailure>,
}

struct Queue<K> {
    pending: Vec<Pending<K>>,
    /// When the queued calls go: the earliest time one of them falls due. `None` when empty.
    due_at: Option<Instant>,
    /// Counts the flushes scheduled: a flush task whose number is not the latest finds its
    /// calls taken (or due earlier, by a flush of its own) and leaves.
    window: u64,
}

/// When a call may go to the store.
#[derive(Clone, Copy)]
pub(crate) enum Due {
    /// A request waits on it: with the next scheduler turn.
    Now,
    /// Nothing waited on it when it was planned, at which time the queue's
    /// [`expedites`](CallQueue::expedites) was `since`: it may wait up to `within` for others to
    /// join its batch, unless a request started waiting since (it may be waiting on this call).
    Behind { since: u64, within: Duration },
}

impl<K> Default for CallQueue<K> {
    fn default() -> Self {
        Self {
            state: Mutex::new(Queue {
                pending: Vec::new(),
                due_at: None,
                window: 0,
            }),
            expedites: AtomicU64::new(0),
        }
    }
}

impl<K> CallQueue<K> {
    /// How many times a request started waiting on a call so far: read before planning a call
    /// nothing waits on ([`Due::Behind`]).
    pub(crate) fn expedites(&self) -> u64 {
        self.expedites.load(Ordering::SeqCst)
    }
}

impl<K> Queue<K> {
    /// Makes `at` the time the queued calls go if it is sooner than the one set; returns the
    /// window a flush must be scheduled for.
    fn due(&mut self, at: Instant) -> Option<u64> {
        if self.due_at.is_some_and(|due| due <= at) {
            return None;
        }
        self.due_at = Some(at);
        self.window = self.window.wrapping_add(1);
        Some(self.window)
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
        let now = Instant::now();
        let at = match due {
            Due::Behind { since, within } if self.calls.expedites() == since => now + within,
            _ => now,
        };
        let (window, at) = {
            let mut queue = lock(&self.calls.state);
            queue.pending.push((call, sender, at));
            // A full batch goes at once.
            let at = match queue.pending.len() >= self.config.global_batch {
                true => now,
                false => at,
            };
            (queue.due(at), at)
        };
        if let Some(window) = window {
            self.schedule_flush(window, at);
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
        let now = Instant::now();
        let window = {
            let mut queue = lock(&self.calls.state);
            // Every queued call, as the one waited on may not fit in the next batch.
            for (_, _, at) in &mut queue.pending {
                *at = now;
            }
            match queue.due_at {
                Some(_) => queue.due(now),
                None => None,
            }
        };
        if let Some(window) = window {
            self.schedule_flush(window, now);
        }
    }

    /// Runs the batch of flush `window` at `at` in a task of its own; without a runtime, the
    /// queued calls end unanswered.
    fn schedule_flush(self: &Arc<Self>, window: u64, at: Instant) {
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(self.clone().flush(window, at));
            }
            Err(_) => {
                let mut queue = lock(&self.calls.state);
                queue.pending.clear();
                queue.due_at = None;
            }
        }
    }

    async fn flush(self: Arc<Self>, window: u64, at: Instant) {
        let mut unflushed = Unflushed {
            queue: &self.calls,
            window: Some(window),
        };
        if at <= Instant::now() {
            // Calls queued by the tasks already scheduled join this batch.
            tokio::task::yield_now().await;
        } else {
            tokio::time::sleep_until(at).await;
        }
        let (batch, rest) = {
            let mut queue = lock(&self.calls.state);
            if queue.window != window {
                // Another flush took these calls, or takes them sooner.
                return;
            }
            let n = queue.pending.len().min(self.config.global_batch);
            let batch: Vec<_> = queue.pending.drain(..n).collect();
            queue.due_at = None;
            unflushed.window = None;
            // The rest go when the first of them falls due (at once if they fill a batch).
            let full = queue.pending.len() >= self.config.global_batch;
            let next = queue.pending.iter().map(|(_, _, at)| *at).min();
            let rest = next.map(|at| if full { Instant::now() } else { at });
            let window = rest.and_then(|at| queue.due(at));
            (batch, window.zip(rest))
        };
        if let Some((window, at)) = rest {
            self.schedule_flush(window, at);
        }
        if batch.is_empty() {
            // An earlier flush took them.
            return;
        }
        self.stats.global_batches.incr();
        let sent_at = self.now();
        let (calls, senders): (Vec<_>, Vec<_>) = batch
            .into_iter()
            .map(|(call, sender, _)| (call, sender))
            .unzip();
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

/// A flush task's window until it takes its calls: if the task is dropped first (its runtime
/// shut down), its calls end unanswered and the queue schedules afresh, rather than waiting
/// for a flush that will never run.
struct Unflushed<'a, K> {
    queue: &'a CallQueue<K>,
    window: Option<u64>,
}

impl<K> Drop for Unflushed<'_, K> {
    fn drop(&mut self) {
        let Some(window) = self.window else {
            return;
        };
        let mut queue = lock(&self.queue.state);
        if queue.window == window {
            queue.pending.clear();
            queue.due_at = None;
        }
    }
}

//! Shaping: a throttled request may wait for its tokens instead of being refused.
//!
//! Waiters queue per key and host, in arrival order: only the first of a key's queue checks
//! the buckets, and it sleeps until its tokens are due (the exact time a refusal names), so
//! nothing polls. Each attempt is an ordinary decision of the engine, so shaping never admits
//! more than policing would: the fleet's limit holds whatever waits. A waiter holds no tokens
//! while it waits, so one that goes away (cancelled, timed out by the client) gives nothing
//! back and leaves its place to the next.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::clock::Clock;
use crate::global::GlobalStore;
use crate::local::LocalStore;
use crate::quota::{BucketKey, LeaseKey};
use crate::response::{Rejection, RejectionReason};
use crate::sync::lock;
use crate::throttle::{Check, Throttle};

/// What a request that finds too few tokens does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Shaping {
    /// It is refused at once, with the time until its tokens are due (policing). The default.
    #[default]
    Refuse,
    /// It waits for its tokens when they are due within `max`, behind the requests of its key
    /// already waiting on this host (at most `queue` of them; beyond, it is refused at once),
    /// and is then admitted; one due later than `max` is refused at once with its
    /// `Retry-After`. Go's `Wait` with a deadline, per key.
    Wait {
        /// The longest a request waits.
        max: Duration,
        /// The most requests of one key waiting on one host.
        queue: usize,
    },
}

impl Shaping {
    /// Waiting up to `max`, with at most 128 requests of a key waiting on each host.
    pub fn wait(max: Duration) -> Self {
        Self::Wait { max, queue: 128 }
    }
}

/// The waiting requests of every key with some, on this host.
pub(crate) struct Shaper<K> {
    queues: Mutex<HashMap<K, Queue>>,
}

impl<K> Shaper<K> {
    /// Requests waiting for their tokens now.
    pub(crate) fn waiting(&self) -> usize {
        lock(&self.queues).values().map(|q| q.waiting).sum()
    }
}

impl<K> Default for Shaper<K> {
    fn default() -> Self {
        Self {
            queues: Mutex::new(HashMap::new()),
        }
    }
}

/// One key's waiters: the turn they take in arrival order (tokio's mutex is fair), how many
/// there are and the tokens they need.
struct Queue {
    turn: Arc<tokio::sync::Mutex<()>>,
    waiting: usize,
    tokens: u64,
}

/// A place in a key's queue, left when dropped (admitted, refused or gone away).
struct Place<'a, K: Hash + Eq> {
    shaper: &'a Shaper<K>,
    key: &'a K,
    cost: u64,
    /// The key's turn, to wait for.
    turn: Arc<tokio::sync::Mutex<()>>,
}

impl<K: Hash + Eq> Drop for Place<'_, K> {
    fn drop(&mut self) {
        let mut queues = lock(&self.shaper.queues);
        if let Some(queue) = queues.get_mut(self.key) {
            queue.waiting -= 1;
            queue.tokens = queue.tokens.saturating_sub(self.cost);
            if queue.waiting == 0 {
                queues.remove(self.key);
            }
        }
    }
}

impl<K, G, L, C> Throttle<K, G, L, C>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    G: GlobalStore<BucketKey<K>>,
    L: LocalStore<LeaseKey<K>>,
    C: Clock,
{
    /// Whether throttled requests wait for their tokens.
    #[inline(always)]
    pub(crate) fn shapes(&self) -> bool {
        matches!(self.config.shaping, Shaping::Wait { .. })
    }

    /// Whether `refusal` may wait rather than be refused now.
    pub(crate) fn may_wait(&self, refusal: &Rejection<K>) -> bool {
        self.shapes() && refusal.reason == RejectionReason::Throttled
    }

    /// Waits, in `keys[0]`'s queue, until the request of `cost` on `keys` is admitted, or
    /// refuses it: at once when its tokens are due later than the wait allows (counting those
    /// the requests ahead of it need) or the queue is full, or when the wait runs out.
    pub(crate) async fn wait_for_tokens(
        self: &Arc<Self>,
        keys: &[LeaseKey<K>],
        cost: u64,
        refusal: Rejection<K>,
    ) -> Result<(), Rejection<K>> {
        let Shaping::Wait { max, queue } = self.config.shaping else {
            return Err(refusal);
        };
        let Some(first) = keys.first() else {
            return Err(refusal);
        };
        let deadline = tokio::time::Instant::now() + max;
        let place = self.queue_up(&first.key, cost, max, queue, refusal)?;
        let _turn = place.turn.lock().await;
        loop {
            let refusal = match self.check_keys(keys, cost) {
                Check::Admit => return Ok(()),
                Check::Wait(decision) => match decision.await {
                    Ok(()) => return Ok(()),
                    Err(refusal) => refusal,
                },
                Check::Reject(refusal) => refusal,
            };
            let wait = refusal.retry_after.unwrap_or_default();
            if refusal.reason != RejectionReason::Throttled
                || tokio::time::Instant::now() + wait > deadline
            {
                return Err(refusal);
            }
            tokio::time::sleep(wait).await;
        }
    }

    /// Takes a place in `key`'s queue, or refuses at once.
    fn queue_up<'a>(
        &'a self,
        key: &'a K,
        cost: u64,
        max: Duration,
        bound: usize,
        refusal: Rejection<K>,
    ) -> Result<Place<'a, K>, Rejection<K>> {
        let mut queues = lock(&self.shaper.queues);
        let (waiting, ahead) = queues.get(key).map_or((0, 0), |q| (q.waiting, q.tokens));
        let own = refusal.retry_after.unwrap_or_default();
        // The tokens of the requests ahead come first, at the refusing limit's rate.
        let due = own
            + refusal
                .limit
                .map_or(Duration::ZERO, |l| l.time_to_accrue(ahead));
        if waiting >= bound || due > max {
            self.stats.shaped_refusals.incr();
            return Err(refusal.with_retry_after(due));
        }
        let queue = queues.entry(key.clone()).or_insert_with(|| Queue {
            turn: Arc::default(),
            waiting: 0,
            tokens: 0,
        });
        queue.waiting += 1;
        queue.tokens += cost;
        self.stats.shaped_waits.incr();
        Ok(Place {
            shaper: &self.shaper,
            key,
            cost,
            turn: queue.turn.clone(),
        })
    }
}

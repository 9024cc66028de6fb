//! Shaping: a throttled request may wait for its tokens instead of being refused.
//!
//! Waiters queue per key and host, in arrival order: only the first of a key's queue checks
//! the buckets, and it sleeps until its tokens are due (the exact time a refusal names), so
//! nothing polls. Each attempt is an ordinary decision of the engine, so shaping never admits
//! more than policing would: the fleet's limit holds whatever waits. A waiter holds no tokens
//! while it waits, so one that goes away (cancelled, timed out by the client) gives nothing
//! back and leaves its place to the next.

use std::collections::HashMap;
use std::future::Future;
use std::hash::Hash;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::future::BoxFuture;

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
        Self::Wait {
            max,
            queue: DEFAULT_QUEUE,
        }
    }

    /// The most uses of one key waiting on one host.
    pub(crate) fn queue(&self) -> usize {
        match self {
            Self::Refuse => DEFAULT_QUEUE,
            Self::Wait { queue, .. } => *queue,
        }
    }
}

/// The default bound of a key's queue on a host.
const DEFAULT_QUEUE: usize = 128;

/// A use of a key waiting for its tokens, from
/// [`HierarchicalThrottleLayer::reserve`](crate::HierarchicalThrottleLayer::reserve): it holds
/// a place in the key's queue on this host and knows when its tokens are expected
/// ([`delay`](Self::delay)); awaited, it is admitted once they are there (or refused if they
/// are not by the deadline). Dropping it gives up its place, like Go's `Reservation.Cancel`;
/// it holds no tokens until admitted, so there is nothing to give back.
#[must_use = "a reservation waits for its tokens only when awaited"]
pub struct Reservation<K> {
    delay: Duration,
    admitted: BoxFuture<'static, Result<(), Rejection<K>>>,
}

impl<K> Reservation<K> {
    pub(crate) fn new(
        delay: Duration,
        admitted: BoxFuture<'static, Result<(), Rejection<K>>>,
    ) -> Self {
        Self { delay, admitted }
    }

    /// How long until its tokens are expected: zero when it was admitted at once; otherwise
    /// counting those the uses ahead of it in the key's queue need. Another host may take
    /// them first, in which case awaiting it takes longer (up to its deadline).
    pub fn delay(&self) -> Duration {
        self.delay
    }
}

impl<K> Future for Reservation<K> {
    type Output = Result<(), Rejection<K>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.admitted.as_mut().poll(cx)
    }
}

impl<K> std::fmt::Debug for Reservation<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reservation")
            .field("delay", &self.delay)
            .finish_non_exhaustive()
    }
}

/// Tokens a reservation admitted at once took from each of its key's limits: given back if it
/// is dropped before it is awaited.
struct Taken<K, G, L, C>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    G: GlobalStore<BucketKey<K>>,
    L: LocalStore<LeaseKey<K>>,
    C: Clock,
{
    throttle: Arc<Throttle<K, G, L, C>>,
    id: LeaseKey<K>,
    cost: u64,
    at_once: bool,
    used: bool,
}

impl<K, G, L, C> Taken<K, G, L, C>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    G: GlobalStore<BucketKey<K>>,
    L: LocalStore<LeaseKey<K>>,
    C: Clock,
{
    /// The reservation was awaited: its tokens are its use's.
    fn keep(mut self) {
        self.used = true;
    }
}

impl<K, G, L, C> Drop for Taken<K, G, L, C>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    G: GlobalStore<BucketKey<K>>,
    L: LocalStore<LeaseKey<K>>,
    C: Clock,
{
    fn drop(&mut self) {
        if self.used {
            return;
        }
        let slots = self.throttle.resolve(&self.id).map_or(1, |b| b.slots);
        for slot in 0..slots {
            self.id.slot = slot;
            match self.at_once {
                true => self.throttle.undo(&self.id, self.cost),
                false => self.throttle.give_back(&self.id, self.cost),
            }
        }
    }
}

/// The waiting requests of every key with some, on this host.
pub(crate) struct Shaper<K> {
    queues: Mutex<HashMap<K, Queue>>,
}

impl<K> Shaper<K> {
    /// Requests waiting for their tokens now.
    #[cfg(feature = "metrics")]
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
pub(crate) struct Place<K: Hash + Eq> {
    shaper: Arc<Shaper<K>>,
    key: K,
    cost: u64,
    /// The key's turn, to wait for.
    turn: Arc<tokio::sync::Mutex<()>>,
    /// When the tokens are expected, counting those the requests ahead need.
    pub(crate) due_in: Duration,
    /// The latest it may be admitted.
    deadline: tokio::time::Instant,
}

impl<K: Hash + Eq> Drop for Place<K> {
    fn drop(&mut self) {
        let mut queues = lock(&self.shaper.queues);
        if let Some(queue) = queues.get_mut(&self.key) {
            queue.waiting -= 1;
            queue.tokens = queue.tokens.saturating_sub(self.cost);
            if queue.waiting == 0 {
                queues.remove(&self.key);
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
        let place = self.queue_up(&first.key, cost, max, queue, refusal)?;
        self.take_turn(place, keys, cost).await
    }

    /// Waits for `place`'s turn, then until the request of `cost` on `keys` is admitted, or
    /// its wait runs out.
    pub(crate) async fn take_turn(
        self: &Arc<Self>,
        place: Place<K>,
        keys: &[LeaseKey<K>],
        cost: u64,
    ) -> Result<(), Rejection<K>> {
        let _turn = place.turn.lock().await;
        loop {
            let refusal = match self.check_keys(keys, cost) {
                Check::Admit => return Ok(()),
                Check::Wait(decision) => match decision.await {
                    Ok(()) => return Ok(()),
                    Err(refusal) => refusal,
                },
                Check::Reject(refusal) => *refusal,
            };
            let wait = refusal.retry_after.unwrap_or_default();
            if refusal.reason != RejectionReason::Throttled
                || tokio::time::Instant::now() + wait > place.deadline
            {
                return Err(refusal);
            }
            tokio::time::sleep(wait).await;
        }
    }

    /// A reservation admitted at once on bucket `id`'s key (its tokens taken `at_once` from
    /// the leases, or after a batch): they go back if it is dropped without being awaited.
    pub(crate) fn admitted_reservation(
        self: &Arc<Self>,
        id: LeaseKey<K>,
        cost: u64,
        at_once: bool,
    ) -> Reservation<K> {
        let taken = Taken {
            throttle: self.clone(),
            id,
            cost,
            at_once,
            used: false,
        };
        Reservation::new(
            Duration::ZERO,
            Box::pin(async move {
                taken.keep();
                Ok(())
            }),
        )
    }

    /// Takes a place in `key`'s queue for a request that may wait up to `max`, or refuses it
    /// at once.
    pub(crate) fn queue_up(
        &self,
        key: &K,
        cost: u64,
        max: Duration,
        bound: usize,
        refusal: Rejection<K>,
    ) -> Result<Place<K>, Rejection<K>> {
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
            shaper: self.shaper.clone(),
            key: key.clone(),
            cost,
            turn: queue.turn.clone(),
            due_in: due,
            deadline: tokio::time::Instant::now() + max,
        })
    }
}

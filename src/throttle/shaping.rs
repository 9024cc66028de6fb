//! Shaping: a throttled request may wait for its tokens instead of being refused.
//!
//! Waiters queue per refusing bucket (its level and key) and host, in arrival order: only the
//! first of a queue checks the buckets, and it sleeps until its tokens are due (the exact time
//! a refusal names), so nothing polls, and users waiting on their tenant's tokens wake one at a
//! time. Each attempt is an ordinary decision of the engine, so shaping never admits more than
//! policing would: the fleet's limit holds whatever waits. A waiter holds no tokens while it
//! waits, so one that goes away (cancelled, timed out by the client) gives nothing back and
//! leaves its place to the next. No wait outlasts its own `max`: not even behind a reservation
//! that holds its queue's turn and is never polled again.

use std::collections::HashMap;
use std::future::Future;
use std::hash::Hash;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use crate::clock::Clock;
use crate::key::Keys;
use crate::quota::LeaseKey;
use crate::rejection::{Rejection, RejectionReason};
use crate::sync::lock;
use crate::throttle::{Admitted, Check, Decision, Global, Key, Local, Throttle};

/// What a request that finds too few tokens does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Shaping {
    /// It is refused at once, with the time until its tokens are due (policing). The default.
    #[default]
    Refuse,
    /// It waits for its tokens when they are due within `max` of its arrival, behind the
    /// requests of its key already waiting on this host (at most `queue` of them; beyond, it
    /// is refused at once), and is then admitted; one due later is refused at once with its
    /// `Retry-After`. The batch that found it short is part of its `max`. Go's `Wait` with a
    /// deadline, per key.
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
    admitted: Decision<K>,
}

impl<K> Reservation<K> {
    pub(crate) fn new(delay: Duration, admitted: Decision<K>) -> Self {
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
    type Output = Result<Admitted, Rejection<K>>;

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
/// is dropped before it is awaited (only into the leases that gave them).
struct Taken<K: Key, G: Global<K>, L: Local<K>, C: Clock> {
    throttle: Arc<Throttle<K, G, L, C>>,
    keys: Keys<K>,
    cost: u64,
    at_once: bool,
    admitted: Admitted,
    used: bool,
}

impl<K: Key, G: Global<K>, L: Local<K>, C: Clock> Taken<K, G, L, C> {
    /// The reservation was awaited: its tokens are its use's.
    fn keep(mut self) {
        self.used = true;
    }
}

impl<K: Key, G: Global<K>, L: Local<K>, C: Clock> Drop for Taken<K, G, L, C> {
    fn drop(&mut self) {
        if self.used {
            return;
        }
        if self.at_once {
            // Counted as admitted by its check: it is not, in the end.
            self.throttle.requests_withdrawn.incr();
        }
        for id in self.keys.ids() {
            let slots = self.throttle.resolve(id).map_or(1, |b| b.slots);
            let mut id = id.clone();
            for slot in (0..slots).filter(|&slot| self.admitted.leased(id.level, slot)) {
                id.slot = slot;
                let taken_at = self.admitted.admitted_at();
                self.throttle
                    .take_back(&id, self.cost, Some(taken_at), self.at_once);
            }
        }
    }
}

/// A queue's identity: the refusing bucket's level (its name; none at the first) and key.
type QueueKey<K> = (Option<&'static str>, K);

/// The waiting requests of every refusing bucket with some, on this host.
pub(crate) struct Shaper<K> {
    queues: Mutex<HashMap<QueueKey<K>, Queue>>,
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

/// One queue's waiters: the turn they take in arrival order, how many there are and the
/// tokens they need.
struct Queue {
    turn: Arc<Turn>,
    waiting: usize,
    tokens: u64,
}

/// A queue's turn, taken in arrival order (tokio's mutex is fair). The holder's deadline is
/// kept beside it, so that those behind never wait on a holder past its own: a reservation
/// polled once and then kept unpolled holds the turn until it is dropped.
#[derive(Default)]
struct Turn {
    lock: tokio::sync::Mutex<()>,
    holder_until: Mutex<Option<tokio::time::Instant>>,
}

/// The turn while held: its holder's deadline is cleared when it is given up.
struct Held<'a> {
    turn: &'a Turn,
    _guard: tokio::sync::MutexGuard<'a, ()>,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        *lock(&self.turn.holder_until) = None;
    }
}

/// A place in a queue, left when dropped (admitted, refused or gone away).
pub(crate) struct Place<K: Hash + Eq> {
    shaper: Arc<Shaper<K>>,
    key: QueueKey<K>,
    cost: u64,
    /// The queue's turn, to wait for.
    turn: Arc<Turn>,
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

impl<K: Key, G: Global<K>, L: Local<K>, C: Clock> Throttle<K, G, L, C> {
    /// Whether throttled requests wait for their tokens.
    #[inline(always)]
    pub(crate) fn shapes(&self) -> bool {
        matches!(self.config.shaping, Shaping::Wait { .. })
    }

    /// Whether `refusal` may wait rather than be refused now (never in shadow mode, which
    /// neither waits nor refuses).
    pub(crate) fn may_wait(&self, refusal: &Rejection<K>) -> bool {
        self.shapes() && !self.config.shadow && refusal.reason == RejectionReason::Throttled
    }

    /// Waits, in the refusing bucket's queue, until the request of `cost` on `keys` that
    /// `arrived` then is admitted, or refuses it: at once when its tokens are due later than
    /// the wait allows (counting those the requests ahead of it need) or the queue is full, or
    /// when the wait runs out. The wait counts from the arrival, so that the batch that found
    /// the request short is part of its `max`.
    pub(crate) async fn wait_for_tokens(
        self: &Arc<Self>,
        keys: &[LeaseKey<K>],
        cost: u64,
        refusal: Rejection<K>,
        arrived: tokio::time::Instant,
    ) -> Result<Admitted, Rejection<K>> {
        let Shaping::Wait { max, queue } = self.config.shaping else {
            return Err(refusal);
        };
        let Some(first) = keys.first() else {
            return Err(refusal);
        };
        let place = self.queue_up(&first.key, cost, arrived + max, queue, refusal)?;
        self.take_turn(place, keys, cost).await
    }

    /// Waits for `place`'s turn, then until the request of `cost` on `keys` is admitted, or
    /// its wait runs out (then counted as a shaped refusal).
    pub(crate) async fn take_turn(
        self: &Arc<Self>,
        mut place: Place<K>,
        keys: &[LeaseKey<K>],
        cost: u64,
    ) -> Result<Admitted, Rejection<K>> {
        let waited = self.wait_turn_and_tokens(&mut place, keys, cost).await;
        if waited.is_err() {
            self.stats.shaped_refusals.incr();
        }
        waited
    }

    async fn wait_turn_and_tokens(
        self: &Arc<Self>,
        place: &mut Place<K>,
        keys: &[LeaseKey<K>],
        cost: u64,
    ) -> Result<Admitted, Rejection<K>> {
        let Some(_turn) = place.wait_turn().await else {
            // Its wait ran out behind others: decided now, on what the buckets hold now.
            return self.decide_now(keys, cost).await;
        };
        loop {
            let refusal = match self.decide_now(keys, cost).await {
                Ok(admitted) => return Ok(admitted),
                Err(refusal) => refusal,
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

    /// Decides a request of `cost` on `keys` as it stands: at once, or after one batch.
    async fn decide_now(
        self: &Arc<Self>,
        keys: &[LeaseKey<K>],
        cost: u64,
    ) -> Result<Admitted, Rejection<K>> {
        match self.check_keys(keys, cost) {
            Check::Admit => Ok(Admitted::LEASED),
            Check::Wait(decision) => decision.await,
            Check::Reject(refusal) => Err(*refusal),
        }
    }

    /// A reservation admitted (`admitted`) at once on `keys` (its tokens taken
    /// `at_once` from the leases, or after a batch): they go back if it is dropped without
    /// being awaited.
    pub(crate) fn admitted_reservation(
        self: &Arc<Self>,
        keys: Keys<K>,
        cost: u64,
        at_once: bool,
        admitted: Admitted,
    ) -> Reservation<K> {
        let admitted = self.stamped(admitted);
        let taken = Taken {
            throttle: self.clone(),
            keys,
            cost,
            at_once,
            admitted,
            used: false,
        };
        Reservation::new(
            Duration::ZERO,
            Box::pin(async move {
                // A reservation admitted at once was counted as a request by its check.
                let admitted = match at_once {
                    true => taken.throttle.count_unleased(admitted, cost),
                    false => taken.throttle.count_admitted(admitted, cost),
                };
                taken.keep();
                Ok(admitted)
            }),
        )
    }

    /// Takes a place in the queue of the bucket that refused a request of `cost` (its level
    /// and key, `key` when the refusal names none), for a request that may wait until
    /// `deadline`, or refuses it at once.
    pub(crate) fn queue_up(
        &self,
        key: &K,
        cost: u64,
        deadline: tokio::time::Instant,
        bound: usize,
        refusal: Rejection<K>,
    ) -> Result<Place<K>, Rejection<K>> {
        let key = (
            refusal.level,
            refusal.key.clone().unwrap_or_else(|| key.clone()),
        );
        let mut queues = lock(&self.shaper.queues);
        let (waiting, ahead) = queues.get(&key).map_or((0, 0), |q| (q.waiting, q.tokens));
        let own = refusal.retry_after.unwrap_or_default();
        // The tokens of the requests ahead come first, at the refusing limit's rate (a
        // calendar quota's, with the first, at its reset).
        let due = own
            + refusal
                .limit
                .filter(|l| l.calendar().is_none())
                .map_or(Duration::ZERO, |l| l.time_to_accrue(ahead));
        let now = tokio::time::Instant::now();
        if waiting >= bound || now + due > deadline {
            self.stats.shaped_refusals.incr();
            return Err(refusal.with_retry_after(due));
        }
        let queue = queues.entry(key.clone()).or_insert_with(|| Queue {
            turn: Arc::default(),
            waiting: 0,
            tokens: 0,
        });
        queue.waiting += 1;
        queue.tokens = queue.tokens.saturating_add(cost);
        self.stats.shaped_waits.incr();
        Ok(Place {
            shaper: self.shaper.clone(),
            key,
            cost,
            turn: queue.turn.clone(),
            due_in: due,
            deadline,
        })
    }
}

impl<K: Hash + Eq + Clone> Place<K> {
    /// Waits for the queue's turn until this place's deadline. `None` when the deadline came
    /// first; the turn is not waited for past its holder's own deadline (a holder past it
    /// holds it without using it), and then the place goes on without it.
    async fn wait_turn(&self) -> Option<Option<Held<'_>>> {
        loop {
            let holder_until = *lock(&self.turn.holder_until);
            let give_up = holder_until.map_or(self.deadline, |h| h.min(self.deadline));
            match tokio::time::timeout_at(give_up, self.turn.lock.lock()).await {
                Ok(guard) => {
                    *lock(&self.turn.holder_until) = Some(self.deadline);
                    let held = Held {
                        turn: &self.turn,
                        _guard: guard,
                    };
                    return Some(Some(held));
                }
                Err(_) if tokio::time::Instant::now() >= self.deadline => return None,
                // The same holder, past its deadline: go on without the turn.
                Err(_) if *lock(&self.turn.holder_until) == holder_until => return Some(None),
                Err(_) => {}
            }
        }
    }
}

//! Uses of keys outside a tower service: acquired, reserved and settled, at the first level
//! or at every level.

use std::hash::Hash;
use std::time::Duration;

use crate::clock::Clock;
use crate::error::ConfigError;
use crate::future::Acquire;
use crate::global::GlobalStore;
use crate::key::Keys;
use crate::local::LocalStore;
use crate::quota::{BucketKey, LeaseKey};
use crate::rejection::{Rejection, RejectionReason};
use crate::throttle::{Admitted, Check, Decision, MAX_SETTING};

use super::HierarchicalThrottleLayer;

impl<Req, K, G, L, C, R> HierarchicalThrottleLayer<Req, K, G, L, C, R>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    G: GlobalStore<BucketKey<K>>,
    L: LocalStore<LeaseKey<K>>,
    C: Clock,
{
    /// Decides one use of `key` costing `cost` tokens, outside a tower service: a message on a
    /// WebSocket, a job taken from a queue, one step of a handler.
    ///
    /// It draws on the same buckets as the layer's services, with the same batches,
    /// throttled-key cache, counters and failure policy; `Err` carries the
    /// [`Rejection`](crate::Rejection) a request would get, `Ok` how the use was
    /// [`Admitted`](crate::Admitted) (keep it to [`settle`](Self::settle) the use). The
    /// returned future is ready at once when the host's leased tokens cover `cost`. In
    /// [shadow mode](crate::Builder::shadow) it never refuses.
    ///
    /// ```
    /// use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let layer = HierarchicalThrottleLayer::builder()
    ///     .key(|message: &(u64, String)| Some(message.0)) // the sender
    ///     .limit(Limit::per_second(1).burst(1)?)
    ///     .global_store(MemoryGlobalStore::new())
    ///     .build()?;
    ///
    /// assert!(layer.acquire(7, 1).await.is_ok());
    /// let refused = layer.acquire(7, 1).await.unwrap_err();
    /// assert_eq!(refused.retry_after_secs(), Some(1));
    /// # Ok(()) }
    /// ```
    ///
    /// With [`Shaping::Wait`](crate::Shaping) it waits for its tokens as requests do.
    ///
    /// It draws on every limit of `key`'s quota at the layer's first level; further
    /// [levels](crate::Builder::level) have their own keys, which a bare key does not carry:
    /// [`acquire_keys`](Self::acquire_keys) draws on them too.
    #[inline]
    pub fn acquire(&self, key: K, cost: u64) -> Acquire<K> {
        if self.throttle.shapes() {
            return self.acquire_shaped(Keys::first_level(key), cost);
        }
        match self.throttle.check_key(key, cost) {
            Check::Admit => self.admitted_at_once(),
            Check::Reject(rejection) => self.refused(rejection),
            Check::Wait(decision) => self.decided_later(decision, cost),
        }
    }

    /// [`acquire`](Self::acquire) for a key given in a borrowed form, as a map's lookups take
    /// it (`&str` for a `String` key, `&[u8]` for a [`CompactKey`](crate::key::CompactKey)):
    /// the key is made only when the host's leased tokens cannot decide alone, as with
    /// [`key_ref`](crate::Builder::key_ref).
    ///
    /// ```
    /// use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let layer = HierarchicalThrottleLayer::builder()
    ///     .key(|user: &String| Some(user.clone()))
    ///     .limit(Limit::per_second(1).build()?)
    ///     .global_store(MemoryGlobalStore::new())
    ///     .build()?;
    /// assert!(layer.acquire_ref("alice", 1).await.is_ok());
    /// assert!(layer.acquire("alice".to_owned(), 1).await.is_err(), "the same bucket");
    /// # Ok(()) }
    /// ```
    pub fn acquire_ref<Q>(&self, key: &Q, cost: u64) -> Acquire<K>
    where
        K: std::borrow::Borrow<Q>,
        Q: crate::key::BorrowedKey<Key = K> + ?Sized,
    {
        if self.throttle.shapes() {
            return self.acquire_shaped(Keys::first_level(key.to_key()), cost);
        }
        match self.throttle.check_by(key, || key.to_key(), cost) {
            Check::Admit => self.admitted_at_once(),
            Check::Reject(rejection) => self.refused(rejection),
            Check::Wait(decision) => self.decided_later(decision, cost),
        }
    }

    /// The keys of one use at every level: `first` at the layer's first level, and at each
    /// further [level](crate::Builder::level) named in `levels` its key (a level left out
    /// does not limit the use, as a request whose level closure finds no key). For
    /// [`acquire_keys`](Self::acquire_keys), [`reserve_keys`](Self::reserve_keys) and
    /// [`settle_keys`](Self::settle_keys). A name that is not one of the layer's levels, or
    /// is named twice, is an error.
    ///
    /// ```
    /// use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// // Jobs from a queue: 10 a second per user, 15 a second per tenant.
    /// let layer = HierarchicalThrottleLayer::builder()
    ///     .key(|job: &(String, String)| Some(job.0.clone()))
    ///     .limit(Limit::per_second(10).build()?)
    ///     .level("tenant", |job: &(String, String)| Some(job.1.clone()),
    ///         Limit::per_second(15).build()?)
    ///     .global_store(MemoryGlobalStore::new())
    ///     .build()?;
    /// let job = |user: &str| layer.keys(user.to_owned(), [("tenant", "acme")]);
    /// for _ in 0..10 {
    ///     layer.acquire_keys(job("alice")?, 1).await?;
    /// }
    /// for _ in 0..5 {
    ///     layer.acquire_keys(job("bob")?, 1).await?;
    /// }
    /// // Bob has 5 of his own left, but the tenant's 15 are used up.
    /// assert!(layer.acquire_keys(job("bob")?, 1).await.is_err());
    /// assert!(layer.keys("bob".to_owned(), [("team", "x")]).is_err());
    /// # Ok(()) }
    /// ```
    pub fn keys<'n, Q: Into<K>>(
        &self,
        first: K,
        levels: impl IntoIterator<Item = (&'n str, Q)>,
    ) -> Result<Keys<K>, ConfigError> {
        let mut ids = vec![LeaseKey::new(first, 0, 0)];
        for (name, key) in levels {
            let level = self
                .throttle
                .level_named(name)
                .filter(|&level| ids.iter().all(|id| id.level != level))
                .ok_or(ConfigError::InvalidSetting {
                    setting: "keys",
                    expected: "the names of the layer's further levels, each once",
                })?;
            ids.push(LeaseKey::new(key.into(), level, 0));
        }
        ids.sort_by_key(|id| id.level);
        Ok(Keys::new(ids))
    }

    /// [`acquire`](Self::acquire) on the keys of every level: admitted only when every
    /// bucket of every level has `cost`, as a request is.
    pub fn acquire_keys(&self, keys: Keys<K>, cost: u64) -> Acquire<K> {
        if self.throttle.shapes() {
            return self.acquire_shaped(keys, cost);
        }
        match self.check(&keys, cost) {
            Check::Admit => self.admitted_at_once(),
            Check::Reject(rejection) => self.refused(rejection),
            Check::Wait(decision) => self.decided_later(decision, cost),
        }
    }

    /// Decides a use of `keys`: the first level's buckets alone, or every level's.
    fn check(&self, keys: &Keys<K>, cost: u64) -> Check<K> {
        match keys.ids() {
            [first] => self.throttle.check_first_bucket(first, cost),
            ids => self.throttle.check_keys(ids, cost),
        }
    }

    /// A use admitted at once (the engine counted it).
    fn admitted_at_once(&self) -> Acquire<K> {
        Acquire::admitted(self.throttle.stamped(Admitted::LEASED).admitted_at())
    }

    #[inline(never)]
    fn refused(&self, mut rejection: Box<Rejection<K>>) -> Acquire<K> {
        if self.throttle.config.shadow {
            let admitted = self.throttle.finish_or_shadow(*rejection);
            return Acquire::waiting(Box::pin(std::future::ready(admitted)));
        }
        self.throttle.finish_refusal(&mut rejection);
        Acquire::rejected(rejection)
    }

    /// A decision that comes later, for a use of `cost`; a refusal is finished as requests'
    /// are.
    #[inline(never)]
    fn decided_later(&self, decision: Decision<K>, cost: u64) -> Acquire<K> {
        let throttle = self.throttle.clone();
        Acquire::waiting(Box::pin(async move {
            match decision.await {
                Ok(admitted) => Ok(throttle.count_admitted(admitted, cost)),
                Err(rejection) => throttle.finish_or_shadow(rejection),
            }
        }))
    }

    /// [`acquire_keys`](Self::acquire_keys) when throttled requests wait for their tokens.
    #[inline(never)]
    fn acquire_shaped(&self, keys: Keys<K>, cost: u64) -> Acquire<K> {
        let decision: Decision<K> = match self.check(&keys, cost) {
            Check::Admit => return self.admitted_at_once(),
            Check::Reject(refusal) if !self.throttle.may_wait(&refusal) => {
                return self.refused(refusal);
            }
            Check::Reject(refusal) => Box::pin(std::future::ready(Err(*refusal))),
            Check::Wait(decision) => decision,
        };
        // Read only off the hot path; the wait counts from here (the check took nanoseconds).
        let arrived = tokio::time::Instant::now();
        let throttle = self.throttle.clone();
        let decided = Box::pin(async move {
            match decision.await {
                Err(refusal) if throttle.may_wait(&refusal) => {
                    throttle
                        .wait_for_tokens(keys.ids(), cost, refusal, arrived)
                        .await
                }
                decided => decided,
            }
        });
        self.decided_later(decided, cost)
    }

    /// A use of `key` costing `cost` tokens that may wait up to `max` for them, for callers
    /// outside tower (queues, WebSocket messages): resolves as soon as it is known when the
    /// tokens are due (at once, or after one batch from the global store), without waiting
    /// for them. The [`Reservation`](crate::Reservation) tells its
    /// [`delay`](crate::Reservation::delay); awaiting it waits in the key's queue on this host
    /// and admits the use once its tokens are there; dropping it gives its place up. `Err` if
    /// the tokens are due later than `max` (at most an hour) or the key's queue is full (the
    /// [`shaping`](crate::Builder::shaping) queue bound, 128 by default), with the `Rejection` a
    /// request would get.
    ///
    /// The tokens are taken when due, not set aside now: another host may take them first,
    /// and then the reservation waits for the next, within `max`. So reservations never let a
    /// fleet admit more than its limit. A reservation with no delay has taken its tokens
    /// already (it was admitted at once): dropped without being awaited, it gives them back,
    /// as Go's `Reservation.Cancel` does. Awaited, it resolves to how the use was
    /// [`Admitted`](crate::Admitted). In [shadow mode](crate::Builder::shadow) it is never refused
    /// and never waits. [`reserve_keys`](Self::reserve_keys) draws on further levels too.
    ///
    /// ```
    /// use std::time::Duration;
    /// use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore};
    /// use hierarchical_throttle::clock::TokioClock;
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let layer = HierarchicalThrottleLayer::builder()
    ///     .key(|message: &(u64, String)| Some(message.0))
    ///     .limit(Limit::per_second(10).burst(1)?)
    ///     .clock(TokioClock::new())
    ///     .global_store(MemoryGlobalStore::with_clock(TokioClock::new()))
    ///     .build()?;
    /// let now = layer.reserve(7, 1, Duration::from_secs(1)).await?;
    /// assert_eq!(now.delay(), Duration::ZERO);
    /// now.await?;
    /// let next = layer.reserve(7, 1, Duration::from_secs(1)).await?;
    /// assert_eq!(next.delay(), Duration::from_millis(100));
    /// next.await?; // admitted 100 ms later
    /// # Ok(()) }
    /// ```
    pub async fn reserve(
        &self,
        key: K,
        cost: u64,
        max: Duration,
    ) -> Result<crate::Reservation<K>, Rejection<K>> {
        self.reserve_keys(Keys::first_level(key), cost, max).await
    }

    /// [`reserve`](Self::reserve) on the keys of every level ([`keys`](Self::keys)): the
    /// use waits in the queue of the bucket that refused it, and is admitted once every
    /// bucket of every level has its tokens.
    pub async fn reserve_keys(
        &self,
        keys: Keys<K>,
        cost: u64,
        max: Duration,
    ) -> Result<crate::Reservation<K>, Rejection<K>> {
        // The clock is read off the hot path only: the wait counts from the check.
        let (arrived, refusal) = match self.check(&keys, cost) {
            Check::Admit => {
                let at_once = Admitted::LEASED;
                return Ok(self
                    .throttle
                    .admitted_reservation(keys, cost, true, at_once));
            }
            Check::Wait(decision) => {
                let arrived = tokio::time::Instant::now();
                match decision.await {
                    Ok(admitted) => {
                        return Ok(self
                            .throttle
                            .admitted_reservation(keys, cost, false, admitted));
                    }
                    Err(refusal) => (arrived, refusal),
                }
            }
            Check::Reject(refusal) => (tokio::time::Instant::now(), *refusal),
        };
        let queued = match refusal.reason {
            RejectionReason::Throttled if !self.throttle.config.shadow => self.throttle.queue_up(
                keys.first(),
                cost,
                arrived + max.min(MAX_SETTING),
                self.throttle.config.shaping.queue(),
                refusal,
            ),
            _ => Err(refusal),
        };
        let place = match queued {
            Ok(place) => place,
            Err(refusal) => {
                let admitted = self.throttle.finish_or_shadow(refusal)?;
                let ready = Box::pin(std::future::ready(Ok(admitted)));
                return Ok(crate::Reservation::new(Duration::ZERO, ready));
            }
        };
        let delay = place.due_in;
        let throttle = self.throttle.clone();
        Ok(crate::Reservation::new(
            delay,
            Box::pin(async move {
                match throttle.take_turn(place, keys.ids(), cost).await {
                    Ok(admitted) => Ok(throttle.count_admitted(admitted, cost)),
                    Err(refusal) => throttle.finish_or_shadow(refusal),
                }
            }),
        ))
    }

    /// Corrects a use of `key` that [`acquire`](Self::acquire) admitted as `admitted`, charged
    /// `charged` tokens, to what it really cost, `actual`, as [`Builder::settle`](crate::Builder::settle) does for
    /// responses: a refund goes into this host's leases, only into those that gave the tokens
    /// (none when the failure policy admitted the use, or in shadow mode); a further charge is
    /// taken from them and from the global buckets, into debt if need be (at most a capacity
    /// per bucket, in one call). Returns once the global store has taken what the leases
    /// lacked (at most the store time-out).
    ///
    /// The limits are those `key` has when it is settled: settle soon after the use, or a
    /// refund may go to a limit the key gained since, if its lease holds that limit's tokens.
    /// A [calendar quota](crate::Limit::per_calendar)'s refund is forfeited when its reset
    /// came (or is near) since the use: the next window never spends the last one's tokens.
    /// [`settle_keys`](Self::settle_keys) settles a use of [`acquire_keys`](Self::acquire_keys).
    pub async fn settle(&self, key: K, admitted: Admitted, charged: u64, actual: u64) {
        self.settle_keys(Keys::first_level(key), admitted, charged, actual)
            .await;
    }

    /// [`settle`](Self::settle) for a use of [`acquire_keys`](Self::acquire_keys): every
    /// level's buckets are corrected.
    pub async fn settle_keys(&self, keys: Keys<K>, admitted: Admitted, charged: u64, actual: u64) {
        let drawn: Vec<_> = keys
            .into_ids()
            .into_iter()
            .filter_map(|id| Some((self.throttle.quota(id.level, &id.key)?, id)))
            .map(|(quota, id)| (id, quota))
            .collect();
        if let Some(charge) = self.throttle.settle_cost(&drawn, charged, actual, admitted) {
            charge.await;
        }
    }
}

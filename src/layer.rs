//! The layer: what every service it wraps shares, and the uses of keys outside a tower service.

use std::fmt;
use std::hash::Hash;
use std::sync::Arc;
use std::time::Duration;

use tower_layer::Layer;

use crate::clock::{Clock, MonotonicClock};
use crate::future::Acquire;
use crate::global::GlobalStore;
use crate::local::LocalStore;
use crate::local::memory::MemoryLocalStore;
use crate::policy::RequestPolicy;
use crate::quota::{BucketKey, LeaseKey};
use crate::response::DefaultRejection;
use crate::service::HierarchicalThrottle;
use crate::stats::ThrottleStats;
use crate::throttle::{Admitted, Check, Decision, MAX_SETTING, Throttle};

/// Applies hierarchical token-bucket throttling to requests, per key, across a fleet.
///
/// Built with [`HierarchicalThrottleLayer::builder`]. Cloning the layer does **not** create new
/// buckets: every clone, and every service it wraps, shares one local store, one connection to
/// the global store and one set of [`stats`](Self::stats). Build one layer per limit you want
/// enforced, and clone it freely.
///
/// Type parameters: `Req` the request, `K` the throttle key, `G` the [`GlobalStore`], `L` the
/// [`LocalStore`], `C` the [`Clock`] and `R` the [`OnRejection`](crate::OnRejection) handler.
pub struct HierarchicalThrottleLayer<
    Req,
    K,
    G,
    L = MemoryLocalStore<K>,
    C = MonotonicClock,
    R = DefaultRejection,
> {
    pub(crate) throttle: Arc<Throttle<K, G, L, C>>,
    pub(crate) policy: Arc<RequestPolicy<Req, K, R>>,
}

impl<Req, K, G, L, C, R> Clone for HierarchicalThrottleLayer<Req, K, G, L, C, R> {
    fn clone(&self) -> Self {
        Self {
            throttle: self.throttle.clone(),
            policy: self.policy.clone(),
        }
    }
}

impl<Req, K, G, L, C, R> fmt::Debug for HierarchicalThrottleLayer<Req, K, G, L, C, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HierarchicalThrottleLayer")
            .field("config", &self.throttle.config)
            .finish_non_exhaustive()
    }
}

impl<Req, K, G, L, C, R> HierarchicalThrottleLayer<Req, K, G, L, C, R>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    G: GlobalStore<BucketKey<K>>,
    L: LocalStore<LeaseKey<K>>,
    C: Clock,
{
    /// Counters of the decisions made so far, shared by all clones.
    pub fn stats(&self) -> ThrottleStats {
        self.throttle.stats()
    }

    /// Whether the global store answered the last call made to it: by any layer on the same
    /// store in this process (every store of this crate shares that among its clones), else by
    /// this one. `false` until a call has been answered, and from a failed call until the next
    /// answer, whether or not this layer is backing off. For readiness probes, and the
    /// `throttle_store_up` gauge.
    pub fn store_up(&self) -> bool {
        self.throttle.store_reachable()
    }

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
    /// It draws on every limit of `key`'s quota at the layer's first level (further
    /// [levels](crate::Builder::level) have their own keys, which a bare key does not carry).
    #[inline]
    pub fn acquire(&self, key: K, cost: u64) -> Acquire<K> {
        if self.throttle.shapes() {
            return self.acquire_shaped(key, cost);
        }
        match self.throttle.check_key(key, cost) {
            Check::Admit => {
                self.throttle.stats.requests_admitted.incr();
                Acquire::admitted()
            }
            Check::Reject(rejection) => self.refused(rejection),
            Check::Wait(decision) => self.decided_later(decision, cost),
        }
    }

    #[inline(never)]
    fn refused(&self, mut rejection: Box<crate::Rejection<K>>) -> Acquire<K> {
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
    /// and never waits.
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
    ) -> Result<crate::Reservation<K>, crate::Rejection<K>> {
        let id = LeaseKey::new(key, 0, 0);
        let refusal = match self.throttle.check_first_bucket(&id, cost) {
            Check::Admit => {
                let at_once = Admitted::LEASED;
                return Ok(self.throttle.admitted_reservation(id, cost, true, at_once));
            }
            Check::Wait(decision) => match decision.await {
                Ok(admitted) => {
                    return Ok(self
                        .throttle
                        .admitted_reservation(id, cost, false, admitted));
                }
                Err(refusal) => refusal,
            },
            Check::Reject(refusal) => *refusal,
        };
        let queued = match refusal.reason {
            crate::RejectionReason::Throttled if !self.throttle.config.shadow => {
                self.throttle.queue_up(
                    &id.key,
                    cost,
                    max.min(MAX_SETTING),
                    self.throttle.config.shaping.queue(),
                    refusal,
                )
            }
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
                match throttle.take_turn(place, &[id], cost).await {
                    Ok(admitted) => Ok(throttle.count_admitted(admitted, cost)),
                    Err(refusal) => throttle.finish_or_shadow(refusal),
                }
            }),
        ))
    }

    /// [`acquire`](Self::acquire) when throttled requests wait for their tokens.
    #[inline(never)]
    fn acquire_shaped(&self, key: K, cost: u64) -> Acquire<K> {
        let id = LeaseKey::new(key, 0, 0);
        let decision: Decision<K> = match self.throttle.check_first_bucket(&id, cost) {
            Check::Admit => {
                self.throttle.stats.requests_admitted.incr();
                return Acquire::admitted();
            }
            Check::Reject(refusal) if !self.throttle.may_wait(&refusal) => {
                return self.refused(refusal);
            }
            Check::Reject(refusal) => Box::pin(std::future::ready(Err(*refusal))),
            Check::Wait(decision) => decision,
        };
        let throttle = self.throttle.clone();
        let decided = Box::pin(async move {
            match decision.await {
                Err(refusal) if throttle.may_wait(&refusal) => {
                    throttle.wait_for_tokens(&[id], cost, refusal).await
                }
                decided => decided,
            }
        });
        self.decided_later(decided, cost)
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
    pub async fn settle(&self, key: K, admitted: Admitted, charged: u64, actual: u64) {
        let Some(quota) = self.throttle.quota(0, &key) else {
            return;
        };
        let drawn = [(LeaseKey::new(key, 0, 0), quota)];
        if let Some(charge) = self.throttle.settle_cost(&drawn, charged, actual, admitted) {
            charge.await;
        }
    }

    /// What every limit of `key` (at the layer's first level) holds as this host sees it,
    /// without taking anything or calling the global store: the host's lease plus the global
    /// bucket's level at its last answer and what has refilled since. Other hosts may have
    /// taken some of that since, so this is an estimate; a limit this host has not used yet
    /// shows full. [`remaining_global`](Self::remaining_global) asks the store.
    ///
    /// ```
    /// use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let layer = HierarchicalThrottleLayer::builder()
    ///     .key(|user: &u64| Some(*user))
    ///     .limit(Limit::per_second(10).burst(10)?)
    ///     .global_store(MemoryGlobalStore::new())
    ///     .build()?;
    /// layer.acquire(7, 3).await?;
    ///
    /// let left = layer.remaining(&7);
    /// assert_eq!((left[0].limit_name, left[0].tokens), ("default", 7));
    /// // The global bucket alone: without the tokens leased to this host.
    /// assert!(layer.remaining_global(&7).await?[0].tokens <= 7);
    /// # Ok(()) }
    /// ```
    ///
    /// `key` may be a borrowed form of the key type, as a map's lookups take it (`&str` for a
    /// `String` key, `&[u8]` for a `CompactKey`).
    pub fn remaining<Q>(&self, key: &Q) -> Vec<crate::Remaining>
    where
        K: std::borrow::Borrow<Q>,
        Q: crate::key::BorrowedKey<Key = K> + ?Sized,
    {
        self.throttle
            .remaining_of(&mut [LeaseKey::new(key.to_key(), 0, 0)])
    }

    /// What every limit of `key` (at the layer's first level) holds in the global store: one
    /// read per limit, taking nothing. Tokens leased to hosts are not in it. `key` may be a
    /// borrowed form of the key type, as for [`remaining`](Self::remaining).
    pub async fn remaining_global<Q>(&self, key: &Q) -> Result<Vec<crate::Remaining>, G::Error>
    where
        K: std::borrow::Borrow<Q>,
        Q: crate::key::BorrowedKey<Key = K> + ?Sized,
    {
        self.throttle.remaining_global(0, &key.to_key()).await
    }

    /// Hands back to the global store the leased tokens not used within the lease time-to-live,
    /// and the leases of evicted buckets.
    ///
    /// A background task does this every half lease time once the layer has served its first
    /// request; call it yourself to do it at a moment of your choosing (for example in tests on
    /// a manual clock).
    pub async fn return_unused_leases(&self) {
        self.throttle.return_unused_leases().await;
    }

    /// The local store, to inspect it.
    pub fn local_store(&self) -> &L {
        &self.throttle.local
    }

    /// The global store.
    pub fn global_store(&self) -> &G {
        &self.throttle.global
    }
}

impl<S, Req, K, G, L, C, R> Layer<S> for HierarchicalThrottleLayer<Req, K, G, L, C, R> {
    type Service = HierarchicalThrottle<S, Req, K, G, L, C, R>;

    fn layer(&self, inner: S) -> Self::Service {
        HierarchicalThrottle::from_parts(inner, self.throttle.clone(), self.policy.clone())
    }
}

//! The layer: what every service it wraps shares, and the uses of keys outside a tower service
//! (in `uses`).

mod handle;
mod uses;

pub use handle::ThrottleHandle;

use std::fmt;
use std::hash::Hash;
use std::sync::Arc;

use tower_layer::Layer;

use crate::clock::{Clock, MonotonicClock};
use crate::global::GlobalStore;
use crate::local::LocalStore;
use crate::local::memory::MemoryLocalStore;
use crate::policy::RequestPolicy;
use crate::quota::{BucketKey, LeaseKey};
use crate::response::DefaultRejection;
use crate::service::HierarchicalThrottle;
use crate::stats::ThrottleStats;
use crate::throttle::Throttle;

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
    ///
    /// Exact: the requests a lease served are counted in its bucket on the hot path, and
    /// gathered here by a walk over every bucket the local store holds, in one go (about 1.6 ms
    /// over 100,000 keys on the machine of `BENCHMARKS.md`). For a scrape every few seconds
    /// that is nothing; on every request, it would be. The `metrics` feature publishes the same
    /// counters from the background pass instead.
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

    /// What every limit of `key` (at the layer's first level) holds as this host sees it,
    /// without taking anything or calling the global store: the host's lease plus the global
    /// bucket's level at its last answer and what has refilled since. Other hosts may have
    /// taken some of that since, so this is an estimate; a limit this host has not used yet
    /// shows full. It is read at the clock's [recent](crate::clock::Clock::recent) time, as
    /// the `RateLimit` fields are (on Linux at most a few milliseconds behind).
    /// [`remaining_global`](Self::remaining_global) asks the store.
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

    /// [`remaining`](Self::remaining) for the keys of every level ([`keys`](Self::keys)):
    /// this host's view of each level's limits of its key, level by level, as a request on
    /// those keys would be told them.
    ///
    /// ```
    /// use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let layer = HierarchicalThrottleLayer::builder()
    ///     .key(|job: &(String, String)| Some(job.0.clone()))
    ///     .limit(Limit::per_second(10).burst(10)?)
    ///     .level("tenant", |job: &(String, String)| Some(job.1.clone()),
    ///         Limit::per_second(15).burst(15)?)
    ///     .global_store(MemoryGlobalStore::new())
    ///     .build()?;
    /// let alice = || layer.keys("alice".to_owned(), [("tenant", "acme")]);
    /// layer.acquire_keys(alice()?, 4).await?;
    ///
    /// let left = layer.remaining_keys(&alice()?);
    /// assert_eq!((left[0].level, left[0].tokens), (None, 6));
    /// assert_eq!((left[1].level, left[1].tokens), (Some("tenant"), 11));
    /// # Ok(()) }
    /// ```
    pub fn remaining_keys(&self, keys: &crate::Keys<K>) -> Vec<crate::Remaining> {
        self.throttle.remaining_of(&mut keys.ids().to_vec())
    }

    /// What every limit of `key` (at the layer's first level) holds in the global store: one
    /// read per limit, taking nothing, each within the
    /// [store time-out](crate::Builder::store_timeout). Tokens leased to hosts are not in it.
    /// `key` may be a borrowed form of the key type, as for [`remaining`](Self::remaining).
    pub async fn remaining_global<Q>(
        &self,
        key: &Q,
    ) -> Result<Vec<crate::Remaining>, crate::StoreError<G::Error>>
    where
        K: std::borrow::Borrow<Q>,
        Q: crate::key::BorrowedKey<Key = K> + ?Sized,
    {
        self.throttle.remaining_global(0, &key.to_key()).await
    }

    /// Changes every limit of `key` (at the layer's first level) in the global store by hand,
    /// as an operator does to lift a block (`Adjustment::Reset`), stop a key at once
    /// (`Drain`), or grant or charge tokens (`Add`, `Remove`); returns each limit's level
    /// after. Never on a request's path: one call per limit, in the quota's order, each within
    /// the [store time-out](crate::Builder::store_timeout). A store error, or a time-out
    /// ([`StoreError::TimedOut`](crate::StoreError::TimedOut): the change may still be applied
    /// when a stalled store resumes), ends it there, the limits before changed: `Reset` and
    /// `Drain` can be sent again as they are, `Add` and `Remove` could apply twice. A calendar
    /// quota's change is for the window it is made in: the store drops it if it reaches it
    /// after that window's reset (by the store's clock), so it never changes the next window,
    /// and the call ends with [`StoreError::WindowEnded`](crate::StoreError::WindowEnded) (the
    /// limits before it changed, as after an error).
    ///
    /// This host applies it at once: it learns the buckets' levels after, and after a drain
    /// revokes the tokens it held. Other hosts keep the tokens already leased to
    /// them (at most a batch each: they spend them or hand them back) and meet the new level at
    /// their next call to the store; a host refusing the key from what it last heard asks
    /// again within a lease time-to-live, so a reset reaches every host within one.
    ///
    /// ```
    /// use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore};
    /// use hierarchical_throttle::global::Adjustment;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let layer = HierarchicalThrottleLayer::builder()
    ///     .key(|user: &u64| Some(*user))
    ///     .limit(Limit::per_day(100).build()?)
    ///     .global_store(MemoryGlobalStore::new())
    ///     .build()?;
    /// layer.acquire(7, 100).await?;
    /// assert!(layer.acquire(7, 1).await.is_err());
    /// // Support lifts the block: the day's allowance again.
    /// let after = layer.adjust(&7, Adjustment::Reset).await?;
    /// assert_eq!(after[0].tokens, 100);
    /// layer.acquire(7, 1).await?;
    /// # Ok(()) }
    /// ```
    pub async fn adjust<Q>(
        &self,
        key: &Q,
        adjustment: crate::global::Adjustment,
    ) -> Result<Vec<crate::Remaining>, crate::StoreError<G::Error>>
    where
        K: std::borrow::Borrow<Q>,
        Q: crate::key::BorrowedKey<Key = K> + ?Sized,
    {
        self.throttle.adjust(0, &key.to_key(), adjustment).await
    }

    /// [`adjust`](Self::adjust) on the keys of every level ([`keys`](Self::keys)): each
    /// level's limits of its key, one after another. Returns every limit's level after, level
    /// by level.
    pub async fn adjust_keys(
        &self,
        keys: crate::Keys<K>,
        adjustment: crate::global::Adjustment,
    ) -> Result<Vec<crate::Remaining>, crate::StoreError<G::Error>> {
        let mut out = Vec::new();
        for id in keys.ids() {
            out.extend(self.throttle.adjust(id.level, &id.key, adjustment).await?);
        }
        Ok(out)
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

    /// Hands back to the global store every token this host holds, used or not, and returns
    /// once the store has answered: for a host about to stop, so that the fleet can spend them
    /// at once instead of losing them (a day's quota leased in batches, say) until its buckets
    /// refill.
    ///
    /// Call it after the server has drained (axum's `with_graceful_shutdown` returned), on the
    /// runtime that served it. It first waits for the host's fetches under way, each with the
    /// charge of the credit it settles, so that nothing admitted on credit goes uncharged; at
    /// most two [store time-outs](crate::Builder::store_timeout) and a
    /// [batch linger](crate::Builder::global_batch_linger), in case requests still arrive. A
    /// bucket with requests waiting for tokens keeps its own. The layer keeps working: a
    /// request after it fetches anew. What the store does not take (it is failing) stays for
    /// the next sweep, and is lost if the host stops first. Of a rate's lease, what the global
    /// bucket refilled around it past its capacity, by this host's estimate, is forfeited
    /// (counted in `tokens_forfeited`): handed back, it would be spent twice.
    pub async fn return_all_leases(&self) {
        self.throttle.return_all_leases().await;
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

/// A layer on the in-memory global store (one process) with the default local store, clock
/// and answers: what `builder().key(..).limit(..).global_store(MemoryGlobalStore::new())
/// .build()` gives, nameable in a struct field or a function's return type.
///
/// ```
/// use axum::{Router, body::Body, routing::get};
/// use http::Request;
/// use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore, MemoryThrottleLayer, key};
///
/// fn per_user() -> Result<MemoryThrottleLayer<Request<Body>, String>, hierarchical_throttle::ConfigError> {
///     HierarchicalThrottleLayer::builder()
///         .key(|req: &Request<Body>| key::header_value(req, "x-user"))
///         .limit(Limit::per_second(10).build()?)
///         .global_store(MemoryGlobalStore::new())
///         .build()
/// }
///
/// struct AppState {
///     throttle: MemoryThrottleLayer<Request<Body>, String>,
/// }
///
/// # fn main() -> Result<(), hierarchical_throttle::ConfigError> {
/// let state = AppState { throttle: per_user()? };
/// let app: Router = Router::new()
///     .route("/", get(|| async { "hi" }))
///     .layer(state.throttle.clone());
/// # let _ = app;
/// # Ok(()) }
/// ```
pub type MemoryThrottleLayer<Req, K> =
    HierarchicalThrottleLayer<Req, K, crate::global::memory::MemoryGlobalStore<K>>;

/// A layer on Redis (feature `redis`) with the default local store, clock and answers.
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub type RedisThrottleLayer<Req, K> =
    HierarchicalThrottleLayer<Req, K, crate::global::redis::RedisGlobalStore<K>>;

/// A settle hook as a function pointer, so that a settling layer can be named: `fn` items,
/// and closures that capture nothing, coerce to it (`.settle(tokens_used as SettleFn<_>)`).
pub type SettleFn<Res> = fn(&Res, u64) -> u64;

/// A settle hook of any closure, boxed, so that a settling layer can be named
/// (`.settle(Box::new(move |res, charged| ..) as BoxSettle<_>)`).
pub type BoxSettle<Res> = Box<dyn Fn(&Res, u64) -> u64 + Send + Sync>;

/// A layer on the in-memory global store that [settles](crate::Builder::settle) costs with
/// `F`: a [`SettleFn`] or a [`BoxSettle`] of the response type.
pub type MemorySettlingLayer<Req, K, F> = HierarchicalThrottleLayer<
    Req,
    K,
    crate::global::memory::MemoryGlobalStore<K>,
    MemoryLocalStore<K>,
    MonotonicClock,
    crate::response::Settle<DefaultRejection, F>,
>;

impl<S, Req, K, G, L, C, R> Layer<S> for HierarchicalThrottleLayer<Req, K, G, L, C, R> {
    type Service = HierarchicalThrottle<S, Req, K, G, L, C, R>;

    fn layer(&self, inner: S) -> Self::Service {
        HierarchicalThrottle::from_parts(inner, self.throttle.clone(), self.policy.clone())
    }
}

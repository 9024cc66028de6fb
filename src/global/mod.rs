//! Global stores: one token bucket per key, shared by every host of a fleet.
//!
//! A [`GlobalStore`] dispenses batches of tokens to hosts and takes back tokens they did not
//! use. It refills lazily by its own clock, so hosts' clocks never matter.
//!
//! This floor (with [`local`](crate::local)) is the stores: all the I/O of the hierarchy. It
//! uses the bucket arithmetic and the model below it, and nothing above.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use futures_util::Stream;
use futures_util::stream::FuturesUnordered;

use crate::limit::Limit;

#[cfg(feature = "conformance")]
#[cfg_attr(docsrs, doc(cfg(feature = "conformance")))]
pub mod conformance;
pub mod memory;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod redis;
pub mod slots;

pub use crate::bucket::{Adjusted, Adjustment, BucketLevel, Grant, TokenRequest, TokenReturn};

/// The global level of the hierarchy: a token bucket per key, refilled lazily by the store's
/// own clock.
///
/// The limit is passed on every call, so it may differ per key and change at run time.
/// A bucket that has never been seen starts full.
pub trait GlobalStore<K>: Send + Sync + 'static {
    /// Why a call failed. The throttle applies its
    /// [`FailurePolicy`](crate::FailurePolicy) to any error.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Dispenses between `request.min` and `request.want` tokens for `key`, or none when fewer
    /// than `request.min` are there or due within `request.max_delay`; see
    /// [`TokenBucket::take_or_reserve`](crate::bucket::TokenBucket::take_or_reserve), whose
    /// arithmetic every store must follow.
    fn acquire(
        &self,
        key: &K,
        limit: &Limit,
        request: TokenRequest,
    ) -> impl Future<Output = Result<Grant, Self::Error>> + Send;

    /// Takes back tokens that a host leased for `key` and did not use, never past capacity,
    /// unless they reach the store (by its clock) at or after they
    /// [expire](TokenReturn::expires); see
    /// [`TokenBucket::give_back`](crate::bucket::TokenBucket::give_back).
    fn release(
        &self,
        key: &K,
        limit: &Limit,
        back: TokenReturn,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Makes several calls in one go, answering each as its answer comes, with its index in
    /// `calls`. The throttle gathers the calls that fall due together (one scheduler turn,
    /// or the [`global_batch_linger`](crate::Builder::global_batch_linger)) across keys, so a store that serves many buckets in one round trip (Redis: one script
    /// per node) saves a round trip per call. A call's failure is its own; an answer that does
    /// not come within the store time-out ends its call as timed out, the others' answers
    /// still count, so one slow node delays only its own calls. Default: each call on its own,
    /// all at once, so stores without a batched form keep working.
    fn call_many(
        &self,
        calls: Vec<Call<K>>,
    ) -> impl Stream<Item = (usize, Result<Answer, Self::Error>)> + Send
    where
        K: Send + Sync,
    {
        calls
            .into_iter()
            .enumerate()
            .map(|(i, call)| async move { (i, self.call_one(call).await) })
            .collect::<FuturesUnordered<_>>()
    }

    /// One [`Call`] on its own.
    fn call_one(&self, call: Call<K>) -> impl Future<Output = Result<Answer, Self::Error>> + Send
    where
        K: Send + Sync,
    {
        async move {
            match call {
                Call::Acquire {
                    key,
                    limit,
                    request,
                } => self
                    .acquire(&key, &limit, request)
                    .await
                    .map(Answer::Granted),
                Call::Release { key, limit, back } => self
                    .release(&key, &limit, back)
                    .await
                    .map(|()| Answer::Released),
            }
        }
    }

    /// Reads `key`'s bucket without changing it (a bucket never seen is full): for
    /// [`remaining_global`](crate::HierarchicalThrottleLayer::remaining_global), never on a
    /// request's path.
    fn level(
        &self,
        key: &K,
        limit: &Limit,
    ) -> impl Future<Output = Result<BucketLevel, Self::Error>> + Send;

    /// Applies an operator's [`Adjustment`] to `key`'s bucket (reset to full, drain, add or
    /// remove tokens), with the same arithmetic in every store, and returns what it did: the
    /// bucket's level after, and whether the change was applied ([`Adjusted`]):
    /// for operators' tools, never on a request's path. Tokens already leased to hosts are not
    /// touched: each host spends what it holds (or hands it back), and meets the new level at
    /// its next call to the store.
    ///
    /// A change that reaches the store at or after `expires` (Unix time by the store's clock;
    /// see [`has_expired`](crate::bucket::has_expired)) is dropped, and answered with the
    /// level as it is and `applied: false`: a calendar quota's change belongs to the window it
    /// was made in, as its hand-backs do ([`TokenReturn::expires`]), so that a change a
    /// stalled store applies after the reset never grows (or empties) the next window.
    /// [`Adjusted::apply`] does all of it on a [`TokenBucket`](crate::bucket::TokenBucket).
    fn adjust(
        &self,
        key: &K,
        limit: &Limit,
        adjustment: Adjustment,
        expires: Option<Duration>,
    ) -> impl Future<Output = Result<Adjusted, Self::Error>> + Send;

    /// Whether a call that ended in `error` may still have taken effect in the store (the
    /// answer was lost, not the call). The throttle retries a failed hand-back only when this
    /// is `false`, so that tokens are never given back twice; tokens of calls that may have
    /// taken effect are counted as lost. Default: `true`, the safe answer.
    fn may_have_applied(&self, error: &Self::Error) -> bool {
        let _ = error;
        true
    }

    /// Housekeeping, called by a layer's background sweeper every half lease time whether or
    /// not requests come (for example, forgetting buckets that have refilled). Default: none.
    fn maintain(&self) {}

    /// The layers built on this store in this process, so that a second layer of the same name
    /// with other limits is refused at build (their buckets would collide), and so that every
    /// layer on the store reports it reachable or not alike
    /// ([`store_up`](crate::HierarchicalThrottleLayer::store_up)). Default: none kept (each
    /// layer then reports the answers to its own calls); a store of your own may hold a
    /// [`LayerRegistry`] and return it.
    fn layers(&self) -> Option<&LayerRegistry> {
        None
    }

    /// Where the store is, for logs: an address (never a password). Default: its type's name.
    fn location(&self) -> String {
        std::any::type_name::<Self>().to_owned()
    }
}

/// One call of a batch: see [`GlobalStore::call_many`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call<K> {
    /// [`GlobalStore::acquire`].
    Acquire {
        /// The bucket.
        key: K,
        /// Its limit.
        limit: Limit,
        /// What to dispense.
        request: TokenRequest,
    },
    /// [`GlobalStore::release`].
    Release {
        /// The bucket.
        key: K,
        /// Its limit.
        limit: Limit,
        /// The tokens to take back.
        back: TokenReturn,
    },
}

/// The answer to one [`Call`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// What an [`Acquire`](Call::Acquire) dispensed.
    Granted(Grant),
    /// A [`Release`](Call::Release) was taken.
    Released,
}

/// The live layers built on one global store in this process, by name, each with a
/// fingerprint of its limits, and whether the store answered the last call any of them made:
/// see [`GlobalStore::layers`]. Clones of a store share one.
#[derive(Debug, Default)]
pub struct LayerRegistry {
    layers: Mutex<HashMap<&'static str, (u64, Weak<()>)>>,
    /// The store answered the last call that ended, whichever layer made it (false until one
    /// has).
    reachable: AtomicBool,
}

impl LayerRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// A call of any layer on the store ended: answered (`true`) or failed.
    pub(crate) fn set_reachable(&self, answered: bool) {
        self.reachable.store(answered, Ordering::Relaxed);
    }

    /// Whether the store answered the last call any layer made to it.
    pub(crate) fn is_reachable(&self) -> bool {
        self.reachable.load(Ordering::Relaxed)
    }

    /// Registers a layer called `layer` whose limits have `fingerprint`: the returned token
    /// keeps the registration while the layer lives. `None` when another live layer of that
    /// name has other limits.
    pub(crate) fn register(&self, layer: &'static str, fingerprint: u64) -> Option<Arc<()>> {
        let mut layers = crate::sync::lock(&self.layers);
        if let Some((known, alive)) = layers.get(layer)
            && let Some(token) = alive.upgrade()
        {
            return (*known == fingerprint).then_some(token);
        }
        let token = Arc::new(());
        layers.insert(layer, (fingerprint, Arc::downgrade(&token)));
        Some(token)
    }
}

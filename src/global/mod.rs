//! Global stores: one token bucket per key, shared by every host of a fleet.
//!
//! A [`GlobalStore`] dispenses batches of tokens to hosts and takes back tokens they did not
//! use. It refills lazily by its own clock, so hosts' clocks never matter.
//!
//! This floor (with [`local`](crate::local)) is the stores: all the I/O of the hierarchy. It
//! uses the bucket arithmetic and the model below it, and nothing above.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, Weak};

use crate::limit::Limit;

pub mod memory;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod redis;

pub use crate::bucket::{BucketLevel, Grant, TokenRequest};

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

    /// Takes back `tokens` that a host leased for `key` and did not use, never past capacity.
    fn release(
        &self,
        key: &K,
        limit: &Limit,
        tokens: u64,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Reads `key`'s bucket without changing it (a bucket never seen is full): for
    /// [`remaining_global`](crate::HierarchicalThrottleLayer::remaining_global), never on a
    /// request's path.
    fn level(
        &self,
        key: &K,
        limit: &Limit,
    ) -> impl Future<Output = Result<BucketLevel, Self::Error>> + Send;

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
    /// with other limits is refused at build (their buckets would collide). Default: none
    /// kept; a store of your own may hold a [`LayerRegistry`] and return it.
    fn layers(&self) -> Option<&LayerRegistry> {
        None
    }

    /// Where the store is, for logs: an address (never a password). Default: its type's name.
    fn location(&self) -> String {
        std::any::type_name::<Self>().to_owned()
    }
}

/// The live layers built on one global store in this process, by name, each with a
/// fingerprint of its limits: see [`GlobalStore::layers`]. Clones of a store share one.
#[derive(Debug, Default)]
pub struct LayerRegistry {
    layers: Mutex<HashMap<&'static str, (u64, Weak<()>)>>,
}

impl LayerRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
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

//! A layer's uses behind one type that names only the key: for storing in application state
//! without the layer's six type parameters.

use std::fmt;
use std::future::Future;
use std::hash::Hash;
use std::pin::Pin;
use std::sync::Arc;

use crate::clock::Clock;
use crate::error::{BoxError, ConfigError};
use crate::future::Acquire;
use crate::global::{Adjustment, GlobalStore};
use crate::key::Keys;
use crate::local::LocalStore;
use crate::quota::{BucketKey, LeaseKey};
use crate::remaining::Remaining;
use crate::stats::ThrottleStats;

use super::HierarchicalThrottleLayer;

/// A layer's uses outside a service, type-erased: [`acquire`](Self::acquire),
/// [`acquire_keys`](Self::acquire_keys), [`remaining`](Self::remaining),
/// [`remaining_keys`](Self::remaining_keys), [`stats`](Self::stats),
/// [`store_up`](Self::store_up), changes by hand ([`adjust`](Self::adjust)) and the hand-back
/// of a host about to stop ([`return_all_leases`](Self::return_all_leases)). Made by
/// [`HierarchicalThrottleLayer::handle`]; it shares the layer's buckets, counters and store
/// (cloning it is a reference count). Each call costs one dynamic dispatch more than on the
/// layer itself (BENCHMARKS.md measures it).
///
/// ```
/// use axum::{Router, extract::State, routing::post};
/// use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore, ThrottleHandle};
///
/// #[derive(Clone)]
/// struct App {
///     // Messages per user, taken by handlers: no store, clock or request type to name.
///     messages: ThrottleHandle<String>,
/// }
///
/// async fn send(State(app): State<App>) -> &'static str {
///     match app.messages.acquire("alice".to_owned(), 1).await {
///         Ok(_) => "sent",
///         Err(_) => "slow down",
///     }
/// }
///
/// # fn main() -> Result<(), hierarchical_throttle::ConfigError> {
/// let messages = HierarchicalThrottleLayer::builder()
///     .key(|user: &String| Some(user.clone()))
///     .limit(Limit::per_second(5).build()?)
///     .global_store(MemoryGlobalStore::new())
///     .build()?;
/// let app: Router = Router::new()
///     .route("/send", post(send))
///     .with_state(App { messages: messages.handle() });
/// # let _ = app;
/// # Ok(()) }
/// ```
pub struct ThrottleHandle<K> {
    uses: Arc<dyn Uses<K>>,
}

impl<K> Clone for ThrottleHandle<K> {
    fn clone(&self) -> Self {
        Self {
            uses: self.uses.clone(),
        }
    }
}

impl<K> fmt::Debug for ThrottleHandle<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ThrottleHandle").finish_non_exhaustive()
    }
}

/// What a handle asks of its layer.
trait Uses<K>: Send + Sync + 'static {
    fn acquire(&self, key: K, cost: u64) -> Acquire<K>;
    fn keys(&self, first: K, levels: Vec<(&str, K)>) -> Result<Keys<K>, ConfigError>;
    fn acquire_keys(&self, keys: Keys<K>, cost: u64) -> Acquire<K>;
    fn remaining(&self, key: &K) -> Vec<Remaining>;
    fn remaining_keys(&self, keys: &Keys<K>) -> Vec<Remaining>;
    fn stats(&self) -> ThrottleStats;
    fn store_up(&self) -> bool;
    fn adjust(&self, key: K, adjustment: Adjustment) -> Adjusting<'_>;
    fn return_all_leases(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>>;
}

/// A change by hand under way, its store's error boxed.
type Adjusting<'a> = Pin<Box<dyn Future<Output = Result<Vec<Remaining>, BoxError>> + Send + 'a>>;

impl<Req, K, G, L, C, R> Uses<K> for HierarchicalThrottleLayer<Req, K, G, L, C, R>
where
    Req: 'static,
    K: Hash + Eq + Clone + Send + Sync + 'static,
    G: GlobalStore<BucketKey<K>>,
    L: LocalStore<LeaseKey<K>>,
    C: Clock,
    R: Send + Sync + 'static,
{
    fn acquire(&self, key: K, cost: u64) -> Acquire<K> {
        HierarchicalThrottleLayer::acquire(self, key, cost)
    }

    fn keys(&self, first: K, levels: Vec<(&str, K)>) -> Result<Keys<K>, ConfigError> {
        HierarchicalThrottleLayer::keys(self, first, levels)
    }

    fn acquire_keys(&self, keys: Keys<K>, cost: u64) -> Acquire<K> {
        HierarchicalThrottleLayer::acquire_keys(self, keys, cost)
    }

    fn remaining(&self, key: &K) -> Vec<Remaining> {
        HierarchicalThrottleLayer::remaining(self, key)
    }

    fn remaining_keys(&self, keys: &Keys<K>) -> Vec<Remaining> {
        HierarchicalThrottleLayer::remaining_keys(self, keys)
    }

    fn stats(&self) -> ThrottleStats {
        HierarchicalThrottleLayer::stats(self)
    }

    fn store_up(&self) -> bool {
        HierarchicalThrottleLayer::store_up(self)
    }

    fn adjust(&self, key: K, adjustment: Adjustment) -> Adjusting<'_> {
        Box::pin(async move {
            self.throttle
                .adjust(0, &key, adjustment)
                .await
                .map_err(|error| Box::new(error) as BoxError)
        })
    }

    fn return_all_leases(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(HierarchicalThrottleLayer::return_all_leases(self))
    }
}

impl<K: 'static> ThrottleHandle<K> {
    /// [`HierarchicalThrottleLayer::acquire`].
    pub fn acquire(&self, key: K, cost: u64) -> Acquire<K> {
        self.uses.acquire(key, cost)
    }

    /// [`HierarchicalThrottleLayer::keys`].
    pub fn keys(&self, first: K, levels: Vec<(&str, K)>) -> Result<Keys<K>, ConfigError> {
        self.uses.keys(first, levels)
    }

    /// [`HierarchicalThrottleLayer::acquire_keys`].
    pub fn acquire_keys(&self, keys: Keys<K>, cost: u64) -> Acquire<K> {
        self.uses.acquire_keys(keys, cost)
    }

    /// [`HierarchicalThrottleLayer::remaining`].
    pub fn remaining(&self, key: &K) -> Vec<Remaining> {
        self.uses.remaining(key)
    }

    /// [`HierarchicalThrottleLayer::remaining_keys`].
    pub fn remaining_keys(&self, keys: &Keys<K>) -> Vec<Remaining> {
        self.uses.remaining_keys(keys)
    }

    /// [`HierarchicalThrottleLayer::stats`].
    pub fn stats(&self) -> ThrottleStats {
        self.uses.stats()
    }

    /// [`HierarchicalThrottleLayer::store_up`].
    pub fn store_up(&self) -> bool {
        self.uses.store_up()
    }

    /// [`HierarchicalThrottleLayer::adjust`] on `key`, its [`StoreError`](crate::StoreError)
    /// boxed (its `source` is the store's own error): for an operator's endpoint in the
    /// application.
    pub async fn adjust(&self, key: K, adjustment: Adjustment) -> Result<Vec<Remaining>, BoxError> {
        self.uses.adjust(key, adjustment).await
    }

    /// [`HierarchicalThrottleLayer::return_all_leases`]: for shutdown code that holds only the
    /// handle.
    pub async fn return_all_leases(&self) {
        self.uses.return_all_leases().await;
    }
}

impl<Req, K, G, L, C, R> HierarchicalThrottleLayer<Req, K, G, L, C, R>
where
    Req: 'static,
    K: Hash + Eq + Clone + Send + Sync + 'static,
    G: GlobalStore<BucketKey<K>>,
    L: LocalStore<LeaseKey<K>>,
    C: Clock,
    R: Send + Sync + 'static,
{
    /// This layer's uses outside a service behind a type that names only the key, for
    /// application state: see [`ThrottleHandle`].
    pub fn handle(&self) -> ThrottleHandle<K> {
        ThrottleHandle {
            uses: Arc::new(self.clone()),
        }
    }
}

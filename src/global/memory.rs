//! The in-process global store.

use std::convert::Infallible;
use std::hash::{BuildHasher, Hash};
use std::sync::{Arc, Mutex};

use hashbrown::HashTable;

use crate::bucket::TokenBucket;
use crate::clock::{Clock, MonotonicClock, micros};
use crate::global::{BucketLevel, GlobalStore, Grant, TokenRequest};
use crate::limit::Limit;
use crate::quota::BucketKey;
use crate::sync::lock;

const SHARDS: usize = 64;

/// The embedded global store: token buckets in this process's memory.
///
/// It is the whole hierarchy's global level for a single process, and the way tests and
/// simulations stand up a fleet: several layers sharing one store behave as several hosts.
/// Cloning it is cheap and **shares the buckets**. Buckets that are full are forgotten (a
/// full bucket is the same as a new one): at once when a call leaves one full, and otherwise
/// by [`maintain`](GlobalStore::maintain), which a layer's background sweeper calls every half
/// lease time whether or not requests come. So an idle key costs no memory a second or so after
/// its bucket has refilled, and a flood of distinct keys holds at most the keys whose buckets
/// are still refilling.
///
/// ```
/// use hierarchical_throttle::{Limit, quota::BucketKey};
/// use hierarchical_throttle::global::{GlobalStore, TokenRequest, memory::MemoryGlobalStore};
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let store = MemoryGlobalStore::new();
/// let limit = Limit::per_second(10).burst(10)?;
/// let bucket = BucketKey::new("tenant-a", "per-second")?;
/// let grant = store.acquire(&bucket, &limit, TokenRequest::now(1, 4)).await.unwrap();
/// assert_eq!((grant.granted, grant.remaining), (4, 6));
/// # Ok::<(), hierarchical_throttle::ConfigError>(()) }).unwrap();
/// ```
#[derive(Debug)]
pub struct MemoryGlobalStore<K, C = MonotonicClock> {
    inner: Arc<Inner<K, C>>,
}

#[derive(Debug)]
struct Inner<K, C> {
    shards: Box<[Mutex<Shard<K>>]>,
    hasher: foldhash::fast::RandomState,
    clock: C,
}

#[derive(Debug)]
struct Shard<K> {
    buckets: HashTable<(BucketKey<K>, TokenBucket, Limit)>,
}

impl<K> MemoryGlobalStore<K> {
    /// A store on the [`MonotonicClock`].
    pub fn new() -> Self {
        Self::with_clock(MonotonicClock::new())
    }
}

impl<K, C> Inner<K, C> {
    /// The shard of a key hashed to `hash` (its top bits).
    fn shard(&self, hash: u64) -> &Mutex<Shard<K>> {
        &self.shards[(hash >> 58) as usize % SHARDS]
    }
}

impl<K> Default for MemoryGlobalStore<K> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K, C> Clone for MemoryGlobalStore<K, C> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<K, C> MemoryGlobalStore<K, C> {
    /// A store refilled by `clock` (a [`ManualClock`](crate::clock::ManualClock) in tests).
    pub fn with_clock(clock: C) -> Self {
        let shards = (0..SHARDS)
            .map(|_| {
                Mutex::new(Shard {
                    buckets: HashTable::new(),
                })
            })
            .collect();
        Self {
            inner: Arc::new(Inner {
                shards,
                hasher: foldhash::fast::RandomState::default(),
                clock,
            }),
        }
    }

    /// Buckets held now: keys whose bucket is not full (or has not been swept since it filled).
    pub fn len(&self) -> usize {
        self.inner
            .shards
            .iter()
            .map(|s| lock(s).buckets.len())
            .sum()
    }

    /// Whether no bucket is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<K, C> MemoryGlobalStore<K, C>
where
    K: Hash + Eq + Clone,
    C: Clock,
{
    /// Runs `f` on `key`'s bucket brought up to now, creating it full if absent, and forgets it
    /// again if it is full afterwards.
    fn with_bucket<R>(
        &self,
        key: &BucketKey<K>,
        limit: &Limit,
        f: impl FnOnce(&mut TokenBucket, u64) -> R,
    ) -> R {
        let now = micros(self.inner.clock.now());
        let hash = self.inner.hasher.hash_one(key);
        let mut shard = lock(self.inner.shard(hash));
        let hasher = |e: &(BucketKey<K>, TokenBucket, Limit)| self.inner.hasher.hash_one(&e.0);
        let mut entry = shard
            .buckets
            .entry(hash, |e| e.0 == *key, hasher)
            .or_insert_with(|| (key.clone(), TokenBucket::full(limit, now), *limit));
        let (_, bucket, stored_limit) = entry.get_mut();
        *stored_limit = *limit;
        let out = f(bucket, now);
        if bucket.is_full_at(limit, now) {
            entry.remove();
        }
        out
    }
}

impl<K, C> MemoryGlobalStore<K, C>
where
    K: Hash + Eq,
    C: Clock,
{
    /// `key`'s bucket brought up to now, without taking anything: a full bucket if the store
    /// holds none. Its [`tokens`](TokenBucket::tokens) are what an acquire could get at once,
    /// and [`micros_until`](TokenBucket::micros_until) tells when more are due.
    pub fn peek(&self, key: &BucketKey<K>, limit: &Limit) -> TokenBucket {
        let now = micros(self.inner.clock.now());
        let hash = self.inner.hasher.hash_one(key);
        let shard = lock(self.inner.shard(hash));
        let mut bucket = shard
            .buckets
            .find(hash, |e| e.0 == *key)
            .map_or_else(|| TokenBucket::full(limit, now), |e| e.1);
        bucket.refill(limit, now);
        bucket
    }
}

impl<K, C> GlobalStore<BucketKey<K>> for MemoryGlobalStore<K, C>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    C: Clock,
{
    type Error = Infallible;

    fn acquire(
        &self,
        key: &BucketKey<K>,
        limit: &Limit,
        request: TokenRequest,
    ) -> impl Future<Output = Result<Grant, Infallible>> + Send {
        let max_delay = micros(request.max_delay);
        let taken = self.with_bucket(key, limit, |b, now| {
            b.take_or_reserve(limit, now, request.min, request.want, max_delay)
        });
        std::future::ready(Ok(Grant {
            granted: taken.granted,
            reserved: taken.reserved,
            ready_in: std::time::Duration::from_micros(taken.ready_in_micros),
            remaining: taken.remaining,
            refill_in: std::time::Duration::from_micros(taken.refill_in_micros),
        }))
    }

    fn release(
        &self,
        key: &BucketKey<K>,
        limit: &Limit,
        tokens: u64,
    ) -> impl Future<Output = Result<(), Infallible>> + Send {
        self.with_bucket(key, limit, |b, now| b.give_back(limit, now, tokens));
        std::future::ready(Ok(()))
    }

    fn level(
        &self,
        key: &BucketKey<K>,
        limit: &Limit,
    ) -> impl Future<Output = Result<BucketLevel, Infallible>> + Send {
        let bucket = self.peek(key, limit);
        // Read after the peek's own reading, so never earlier than the bucket's update.
        let now = micros(self.inner.clock.now());
        std::future::ready(Ok(BucketLevel::of(&bucket, limit, now)))
    }

    /// Forgets every bucket that has refilled, one shard (of 64) locked at a time.
    fn maintain(&self) {
        let now = micros(self.inner.clock.now());
        for shard in self.inner.shards.iter() {
            lock(shard)
                .buckets
                .retain(|(_, b, l)| !b.is_full_at(l, now));
        }
    }
}

//! The in-process global store.

use std::convert::Infallible;
use std::hash::{BuildHasher, Hash};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hashbrown::HashTable;
use hashbrown::hash_table::Entry;

use crate::bucket::{Adjusted, FullAt, TokenBucket};
use crate::clock::{Clock, MonotonicClock, micros, unix_micros};
use crate::error::ConfigError;
use crate::global::slots::{Holding, SlotHold, SlotStore, SlotTable};
use crate::global::{
    Adjustment, BucketLevel, GlobalStore, Grant, LayerRegistry, TokenRequest, TokenReturn,
};
use crate::limit::Limit;
use crate::quota::{BucketKey, BucketNames};
use crate::sync::{lock, shard_index};

const SHARD_BITS: u32 = 6;
const SHARDS: usize = 1 << SHARD_BITS;

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
/// A bucket costs about 50 bytes (with `u64` keys; see `BENCHMARKS.md`), plus its key's own
/// bytes: the store keeps only the key and the instant its bucket is full again ([`FullAt`]),
/// in one table per layer, level and limit name (a limit that [warms up](Limit::warm_up)
/// keeps its whole bucket, about 80 bytes). The store holds at most
/// [`DEFAULT_MAX_BUCKETS`] buckets by default ([`with_max_buckets`](Self::with_max_buckets)):
/// beyond, it forgets the buckets nearest to full first (an eighth of a shard at a time), so a
/// flood of distinct keys (a per-day limit sprayed with a million keys) cannot grow it without
/// bound. A forgotten bucket starts full again: each can admit what it lacked then, at most
/// the few tokens a nearly full bucket lacks while the store holds fewer keys than the bound.
///
/// When a key's limit changes (raised, lowered, another tier under the same name), its bucket
/// keeps its whole tokens (a debt too), at most the new capacity, as the Redis store does (see
/// [`TokenBucket::carried`]): a raised limit is not held back by the old one's refill.
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
    /// The most buckets a shard holds.
    shard_bound: usize,
    hasher: foldhash::fast::RandomState,
    clock: C,
    layers: LayerRegistry,
    slots: SlotTable<BucketKey<K>>,
}

/// The most buckets a [`MemoryGlobalStore`] holds unless told otherwise: twice the keys of the
/// default local store.
pub const DEFAULT_MAX_BUCKETS: usize = 200_000;

#[derive(Debug)]
struct Shard<K> {
    /// One per level and limit name: a handful, looked up in order.
    tables: Vec<Table<K>>,
}

/// The buckets of one limit at one level.
#[derive(Debug)]
struct Table<K> {
    names: BucketNames,
    /// The limit every bucket of `buckets` is kept under (its instant full says nothing
    /// without it): the first a compact bucket was kept with, then the one most buckets have.
    compact_limit: Option<Limit>,
    buckets: HashTable<(K, FullAt)>,
    /// Buckets kept whole with their limit: those of limits that [warm up](Limit::warm_up)
    /// (their cold permits are state of their own), and those full again beyond the clock's
    /// range (limits that refill over hundreds of thousands of years).
    far: HashTable<(K, (TokenBucket, Limit))>,
}

impl<K> Shard<K> {
    fn table(&mut self, names: BucketNames) -> &mut Table<K> {
        let index = match self.tables.iter().position(|t| t.names == names) {
            Some(index) => index,
            None => {
                self.tables.push(Table {
                    names,
                    compact_limit: None,
                    buckets: HashTable::new(),
                    far: HashTable::new(),
                });
                self.tables.len() - 1
            }
        };
        &mut self.tables[index]
    }

    fn find(&self, names: BucketNames) -> Option<&Table<K>> {
        self.tables.iter().find(|t| t.names == names)
    }

    fn len(&self) -> usize {
        self.tables
            .iter()
            .map(|t| t.buckets.len() + t.far.len())
            .sum()
    }

    /// Brings the shard back under `bound` buckets once it is past it: forgets those full at
    /// `now`, then, if that is not enough, the eighth nearest to full (whichever table holds
    /// them).
    fn make_room(&mut self, now: u64, bound: usize)
    where
        K: Eq,
    {
        if self.len() <= bound {
            return;
        }
        for table in &mut self.tables {
            table.forget_full(now);
        }
        let len = self.len();
        if len <= bound {
            return;
        }
        let mut full_at: Vec<u64> = self
            .tables
            .iter()
            .flat_map(|t| {
                let compact = t.buckets.iter().map(|(_, at)| at.micros());
                compact.chain(t.far.iter().map(|(_, (b, limit))| b.full_by(limit)))
            })
            .collect();
        let nth = (len / 8).min(full_at.len() - 1);
        let (_, &mut threshold, _) = full_at.select_nth_unstable(nth);
        for table in &mut self.tables {
            table.buckets.retain(|(_, at)| at.micros() > threshold);
            table
                .far
                .retain(|(_, (b, limit))| b.full_by(limit) > threshold);
        }
    }
}

impl<K: Eq> Table<K> {
    /// `key`'s bucket at `now`: full if the table holds none.
    fn get(&self, hash: u64, key: &K, limit: &Limit, now: u64) -> TokenBucket {
        let compact = self.buckets.find(hash, |e| e.0 == *key);
        if let (Some((_, full_at)), Some(kept_with)) = (compact, &self.compact_limit) {
            let bucket = TokenBucket::from_full_at(*full_at, kept_with, now);
            return match kept_with == limit {
                true => bucket,
                false => bucket.carried(kept_with, limit, now),
            };
        }
        match self.far.find(hash, |e| e.0 == *key) {
            Some((_, (bucket, kept_with))) => bucket.carried(kept_with, limit, now),
            None => TokenBucket::full(limit, now),
        }
    }

    /// Keeps `bucket` as `key`'s, or forgets it if it is full at `now`.
    fn put(
        &mut self,
        hash: u64,
        key: &K,
        bucket: &TokenBucket,
        limit: &Limit,
        now: u64,
        hasher: impl Fn(&K) -> u64,
    ) where
        K: Clone,
    {
        match bucket.full_at(limit) {
            Some(full_at) if full_at.is_full_at(now) => {
                take_out(&mut self.buckets, hash, key);
                take_out(&mut self.far, hash, key);
            }
            Some(full_at) if self.keeps_compact(limit, now, &hasher) => {
                take_out(&mut self.far, hash, key);
                upsert(&mut self.buckets, hash, key, full_at, hasher);
            }
            _ => {
                take_out(&mut self.buckets, hash, key);
                upsert(&mut self.far, hash, key, (*bucket, *limit), hasher);
            }
        }
    }

    /// Whether a bucket of `limit` may be kept compact: when the compact buckets are kept under
    /// it (or there are none yet). Once most of the table's buckets are of another limit than
    /// its compact ones (a limit changed for every key), the compact ones are kept whole and
    /// `limit` becomes the compact one; with a margin, so that two tiers under one name never
    /// make it swap back and forth.
    fn keeps_compact(&mut self, limit: &Limit, now: u64, hasher: impl Fn(&K) -> u64) -> bool
    where
        K: Clone,
    {
        match &self.compact_limit {
            Some(kept_with) if kept_with == limit => return true,
            Some(_)
                if !self.buckets.is_empty() && self.far.len() <= 2 * self.buckets.len() + 64 =>
            {
                return false;
            }
            _ => {}
        }
        if let Some(kept_with) = self.compact_limit.replace(*limit) {
            for (key, full_at) in self.buckets.drain() {
                let bucket = TokenBucket::from_full_at(full_at, &kept_with, now);
                upsert(
                    &mut self.far,
                    hasher(&key),
                    &key,
                    (bucket, kept_with),
                    &hasher,
                );
            }
        }
        true
    }

    /// Forgets the buckets full at `now`.
    fn forget_full(&mut self, now: u64) {
        self.buckets.retain(|(_, full_at)| !full_at.is_full_at(now));
        self.far
            .retain(|(_, (bucket, limit))| !bucket.is_full_at(limit, now));
    }
}

/// Sets `key`'s entry in `table` to `value`.
fn upsert<K: Eq + Clone, V>(
    table: &mut HashTable<(K, V)>,
    hash: u64,
    key: &K,
    value: V,
    hasher: impl Fn(&K) -> u64,
) {
    match table.entry(hash, |e| e.0 == *key, |e| hasher(&e.0)) {
        Entry::Occupied(mut entry) => entry.get_mut().1 = value,
        Entry::Vacant(entry) => {
            entry.insert((key.clone(), value));
        }
    }
}

/// Removes `key`'s entry from `table`, if any.
fn take_out<K: Eq, V>(table: &mut HashTable<(K, V)>, hash: u64, key: &K) {
    if let Ok(entry) = table.find_entry(hash, |e| e.0 == *key) {
        entry.remove();
    }
}

impl<K> MemoryGlobalStore<K> {
    /// A store on the [`MonotonicClock`], holding at most [`DEFAULT_MAX_BUCKETS`] buckets.
    pub fn new() -> Self {
        Self::with_clock(MonotonicClock::new())
    }
}

impl<K, C> Inner<K, C> {
    fn shard(&self, hash: u64) -> &Mutex<Shard<K>> {
        &self.shards[shard_index(hash, SHARD_BITS)]
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
        Self::build(clock, DEFAULT_MAX_BUCKETS)
    }

    /// This store (not yet shared with a clone) holding at most `max` buckets (64 to 1
    /// billion); see the type's docs for what happens beyond.
    pub fn with_max_buckets(self, max: usize) -> Result<Self, ConfigError> {
        if !(SHARDS..=1_000_000_000).contains(&max) {
            return Err(ConfigError::InvalidSetting {
                setting: "MemoryGlobalStore::with_max_buckets",
                expected: "64 to 1,000,000,000 buckets",
            });
        }
        match Arc::try_unwrap(self.inner) {
            Ok(inner) => Ok(Self::build(inner.clock, max)),
            Err(_) => Err(ConfigError::InvalidSetting {
                setting: "MemoryGlobalStore::with_max_buckets",
                expected: "a store not cloned yet",
            }),
        }
    }

    fn build(clock: C, max: usize) -> Self {
        let shards = (0..SHARDS)
            .map(|_| Mutex::new(Shard { tables: Vec::new() }))
            .collect();
        Self {
            inner: Arc::new(Inner {
                shards,
                shard_bound: max.div_ceil(SHARDS),
                hasher: foldhash::fast::RandomState::default(),
                clock,
                layers: LayerRegistry::new(),
                slots: SlotTable::default(),
            }),
        }
    }

    /// Buckets held now: keys whose bucket is not full (or has not been swept since it filled).
    pub fn len(&self) -> usize {
        self.inner.shards.iter().map(|s| lock(s).len()).sum()
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
        let now = unix_micros(&self.inner.clock);
        let hash = self.inner.hasher.hash_one(key.key());
        let mut shard = lock(self.inner.shard(hash));
        let table = shard.table(key.names());
        let mut bucket = table.get(hash, key.key(), limit, now);
        let out = f(&mut bucket, now);
        let hasher = |k: &K| self.inner.hasher.hash_one(k);
        table.put(hash, key.key(), &bucket, limit, now, hasher);
        shard.make_room(now, self.inner.shard_bound);
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
        let now = unix_micros(&self.inner.clock);
        let hash = self.inner.hasher.hash_one(key.key());
        let shard = lock(self.inner.shard(hash));
        shard.find(key.names()).map_or_else(
            || TokenBucket::full(limit, now),
            |table| table.get(hash, key.key(), limit, now),
        )
    }
}

/// Concurrency slots, by the store's clock; see [`SlotStore`].
impl<K, C> SlotStore<BucketKey<K>> for MemoryGlobalStore<K, C>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    C: Clock,
{
    type Error = Infallible;

    async fn hold(
        &self,
        key: &BucketKey<K>,
        max: u64,
        hold: SlotHold,
    ) -> Result<Holding, Infallible> {
        let now = micros(self.inner.clock.now());
        Ok(self.inner.slots.hold(key, max, hold, now))
    }
}

impl<K: Hash + Eq + Clone, C: Clock> MemoryGlobalStore<K, C> {
    /// Keys of which some host holds concurrency slots now.
    pub fn keys_with_slots_held(&self) -> usize {
        self.inner.slots.keys_held(micros(self.inner.clock.now()))
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
        back: TokenReturn,
    ) -> impl Future<Output = Result<(), Infallible>> + Send {
        self.with_bucket(key, limit, |b, now| b.give_back(limit, now, back));
        std::future::ready(Ok(()))
    }

    fn level(
        &self,
        key: &BucketKey<K>,
        limit: &Limit,
    ) -> impl Future<Output = Result<BucketLevel, Infallible>> + Send {
        let bucket = self.peek(key, limit);
        // Read after the peek's own reading, so never earlier than the bucket's update.
        let now = unix_micros(&self.inner.clock);
        std::future::ready(Ok(BucketLevel::of(&bucket, limit, now)))
    }

    fn adjust(
        &self,
        key: &BucketKey<K>,
        limit: &Limit,
        adjustment: Adjustment,
        expires: Option<Duration>,
    ) -> impl Future<Output = Result<Adjusted, Infallible>> + Send {
        let adjusted = self.with_bucket(key, limit, |b, now| {
            Adjusted::apply(b, limit, now, adjustment, expires)
        });
        std::future::ready(Ok(adjusted))
    }

    fn layers(&self) -> Option<&LayerRegistry> {
        Some(&self.inner.layers)
    }

    fn location(&self) -> String {
        "memory".to_owned()
    }

    /// Forgets every bucket that has refilled, one shard (of 64) locked at a time.
    fn maintain(&self) {
        let now = unix_micros(&self.inner.clock);
        for shard in self.inner.shards.iter() {
            for table in &mut lock(shard).tables {
                table.forget_full(now);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use std::time::Duration;

    fn acquire(store: &MemoryGlobalStore<u64, ManualClock>, limit: &Limit, want: u64) -> Grant {
        let key = BucketKey::new(7, "slow").unwrap();
        let call = store.acquire(&key, limit, TokenRequest::now(1, want));
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(call)
            .unwrap()
    }

    /// Buckets of two limits under one name (two tiers) keep their levels, whichever limit
    /// the table keeps compact; once most keys have moved to the second (a limit changed for
    /// every key), it becomes the compact one and the first's buckets are kept whole.
    #[test]
    fn buckets_of_two_limits_under_one_name_keep_their_levels() {
        let clock = ManualClock::new();
        let store = MemoryGlobalStore::with_clock(clock.clone());
        let (first, second) = (
            Limit::per_hour(10).burst(10).unwrap(),
            Limit::per_hour(20).burst(20).unwrap(),
        );
        let key = |k: u64| BucketKey::new(k, "tier").unwrap();
        let run = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let take = |k: u64, limit: &Limit, want: u64| {
            let bucket = key(k);
            let call = store.acquire(&bucket, limit, TokenRequest::now(1, want));
            run.block_on(call).unwrap().remaining
        };
        for k in 0..1_000 {
            assert_eq!(take(k, &first, 3), 7);
        }
        for k in 1_000..20_000 {
            assert_eq!(take(k, &second, 5), 15);
        }
        for k in 0..1_000 {
            assert_eq!(store.peek(&key(k), &first).tokens(), 7, "key {k}");
        }
        for k in 1_000..20_000 {
            assert_eq!(store.peek(&key(k), &second).tokens(), 15, "key {k}");
        }
        let compact: Vec<Option<Limit>> = (store.inner.shards.iter())
            .flat_map(|s| {
                lock(s)
                    .tables
                    .iter()
                    .map(|t| t.compact_limit)
                    .collect::<Vec<_>>()
            })
            .collect();
        assert!(compact.iter().all(|l| *l == Some(second)), "{compact:?}");
        // A key of the first tier moved to the second keeps its tokens (7, below 20).
        assert_eq!(take(3, &second, 1), 6);
    }

    /// A bucket that refilled under the limit it was kept with is full under any other: a
    /// limit raised after the bucket refilled gives the new capacity at once, whether the
    /// bucket was kept compact (the table's limit) or whole (another tier's), and whether or
    /// not a pass over the store forgot it first.
    #[test]
    fn a_bucket_refilled_under_its_old_limit_is_full_under_a_raised_one() {
        let clock = ManualClock::new();
        let store = MemoryGlobalStore::with_clock(clock.clone());
        let (old, raised) = (
            Limit::per_second(1).burst(1).unwrap(),
            Limit::per_second(10).burst(10).unwrap(),
        );
        let run = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let take = |k: u64, limit: &Limit, want: u64| {
            let bucket = BucketKey::new(k, "tier").unwrap();
            let call = store.acquire(&bucket, limit, TokenRequest::now(1, want));
            run.block_on(call).unwrap().granted
        };
        // Enough keys under the first limit that every shard's table keeps it compact, then
        // one under another limit, kept whole.
        for k in 0..1_000 {
            assert_eq!(take(k, &old, 1), 1);
        }
        let other = Limit::per_second(2).burst(1).unwrap();
        assert_eq!(take(1_000, &other, 1), 1);
        clock.advance(Duration::from_secs(1));
        assert_eq!(take(1_000, &raised, 10), 10, "kept whole");
        assert_eq!(take(1, &raised, 10), 10, "kept compact");
    }

    /// A bucket whose refill reaches beyond the clock's range has no compact form: it is kept
    /// whole, as exactly as any other, and forgotten once full like any other.
    #[test]
    fn buckets_refilled_over_ages_are_kept_whole_and_exact() {
        let clock = ManualClock::new();
        let store = MemoryGlobalStore::with_clock(clock.clone());
        let limit = Limit::per_day(1).burst(Limit::MAX_CAPACITY).unwrap();
        let day = Duration::from_secs(86_400);
        assert_eq!(
            acquire(&store, &limit, u64::MAX).granted,
            Limit::MAX_CAPACITY
        );
        store.maintain();
        assert_eq!(store.len(), 1);
        let grant = acquire(&store, &limit, 1);
        assert_eq!((grant.granted, grant.refill_in), (0, day));
        clock.advance(day * 3);
        assert_eq!(acquire(&store, &limit, 5).granted, 3);

        // The same key under a limit that refills in a day is compact again.
        let daily = Limit::per_day(10).burst(10).unwrap();
        assert_eq!(
            acquire(&store, &daily, 10).granted,
            0,
            "the debt carries over"
        );
        clock.advance(day * 2);
        assert_eq!(acquire(&store, &daily, 10).granted, 10);
        assert_eq!(store.len(), 1);
        clock.advance(day);
        store.maintain();
        assert!(store.is_empty(), "a bucket full again is forgotten");
    }

    /// A flood of distinct keys of a per-day limit: the store stays within its bound, and
    /// forgets the buckets nearest to full first.
    #[test]
    fn a_key_flood_stays_within_the_bound_and_forgets_the_fullest_first() {
        let clock = ManualClock::new();
        let store = MemoryGlobalStore::<u64, ManualClock>::with_clock(clock.clone())
            .with_max_buckets(6_400)
            .unwrap();
        let limit = Limit::per_day(100).build().unwrap();
        let take = |key: u64, tokens: u64| {
            let bucket = BucketKey::new(key, "daily").unwrap();
            let grant = store.acquire(&bucket, &limit, TokenRequest::now(1, tokens));
            futures_util::FutureExt::now_or_never(grant)
                .unwrap()
                .unwrap()
        };
        // Heavy users first: their buckets are far from full.
        for key in 0..100 {
            take(key, 90);
        }
        for key in 100..100_000 {
            take(key, 1);
        }
        assert!(store.len() <= 6_400, "{} buckets", store.len());
        for key in 0..100 {
            let bucket = BucketKey::new(key, "daily").unwrap();
            assert_eq!(
                store.peek(&bucket, &limit).tokens(),
                10,
                "a heavy user is kept"
            );
        }
        // Buckets that warm up are kept whole, and bounded and chosen alike.
        let warm = limit.warm_up(Duration::from_secs(3_600)).unwrap();
        let take_warm = |key: u64, tokens: u64| {
            let bucket = BucketKey::new(key, "warm").unwrap();
            let grant = store.acquire(&bucket, &warm, TokenRequest::now(tokens, tokens));
            futures_util::FutureExt::now_or_never(grant)
                .unwrap()
                .unwrap()
        };
        for key in 0..100 {
            assert_eq!(take_warm(key, 50).granted, 50);
        }
        for key in 100..100_000 {
            take_warm(key, 1);
        }
        assert!(store.len() <= 6_400, "{} buckets", store.len());
        for key in 0..100 {
            let bucket = BucketKey::new(key, "warm").unwrap();
            // 50 permits paid with their warm-up surcharge; a forgotten bucket would hold 100.
            let tokens = store.peek(&bucket, &warm).tokens();
            assert!(tokens < 50, "a heavy user is kept: {tokens}");
        }
        assert!(
            MemoryGlobalStore::<u64>::new()
                .with_max_buckets(10)
                .is_err()
        );
        let shared = MemoryGlobalStore::<u64>::new();
        let _clone = shared.clone();
        assert!(
            shared.with_max_buckets(1_000).is_err(),
            "a shared store keeps its bound"
        );
    }
}

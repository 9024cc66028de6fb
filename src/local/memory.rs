//! The in-memory, sharded, bounded local store.

use std::hash::{BuildHasher, Hash};
use std::sync::Mutex;

use hashbrown::HashTable;

use crate::error::ConfigError;
use crate::local::{LocalBucket, LocalStore};
use crate::quota::LeaseKey;
use crate::sync::{ShardLock, lock};

/// The default local store: buckets in memory, in independently locked shards, bounded to a
/// maximum number of keys.
///
/// A request touches one shard's lock for a few nanoseconds; a known key costs one hash and one
/// probe, and no allocation. When a shard is full, a new key evicts buckets that were not used
/// since the previous eviction pass (second chance), then any that are not fetching; evicted
/// leases are handed back to the global store. Memory stays bounded however many distinct keys
/// arrive.
#[derive(Debug)]
pub struct MemoryLocalStore<K> {
    shards: Box<[CacheLine<ShardLock<Shard<K>>>]>,
    shard_bits: u32,
    per_shard: usize,
    hasher: foldhash::fast::RandomState,
    /// Evicted buckets holding leased tokens or uncounted requests, until the throttle takes
    /// them.
    evicted: Mutex<Vec<(LeaseKey<K>, LocalBucket)>>,
}

type Shard<K> = HashTable<Entry<LeaseKey<K>>>;

/// A key and its bucket, on cache lines of their own (one for small keys): threads serving
/// different keys of one shard never write to the same line.
#[derive(Debug)]
#[repr(align(64))]
struct Entry<K> {
    key: K,
    bucket: LocalBucket,
}

/// A shard's lock on a cache line of its own (two, against adjacent-line prefetch), so threads
/// working different shards do not slow each other down. A shard is held for tens of
/// nanoseconds, so its lock spins briefly rather than parking the thread.
#[derive(Debug)]
#[repr(align(128))]
struct CacheLine<T>(T);

/// The most keys a shard holds: an eviction pass scans one shard under its lock, so this
/// bounds how long a new key can hold a shard (a few microseconds).
const MAX_KEYS_PER_SHARD: usize = 512;

impl<K> MemoryLocalStore<K> {
    /// The default bound: 100,000 keys.
    pub const DEFAULT_MAX_KEYS: usize = 100_000;

    /// A store holding at most [`DEFAULT_MAX_KEYS`](Self::DEFAULT_MAX_KEYS) keys.
    pub fn new() -> Self {
        Self::build(Self::DEFAULT_MAX_KEYS)
    }

    /// A store holding at most `max_keys` keys (at least 64).
    pub fn with_max_keys(max_keys: usize) -> Result<Self, ConfigError> {
        if max_keys < 64 {
            return Err(ConfigError::InvalidSetting {
                setting: "MemoryLocalStore::with_max_keys",
                expected: "at least 64 keys",
            });
        }
        Ok(Self::build(max_keys))
    }

    fn build(max_keys: usize) -> Self {
        // Sixteen shards per core, so threads on different keys rarely meet on a lock, and
        // enough that none holds more than MAX_KEYS_PER_SHARD; at least 64 keys per shard.
        let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
        let shards = (cores * 16)
            .max(max_keys.div_ceil(MAX_KEYS_PER_SHARD))
            .next_power_of_two()
            .min((max_keys / 64).max(1).next_power_of_two());
        let shards = if shards > max_keys / 64 {
            (shards / 2).max(1)
        } else {
            shards
        };
        let shard_bits = shards.trailing_zeros();
        Self {
            shards: (0..shards)
                .map(|_| CacheLine(ShardLock::new(HashTable::new())))
                .collect(),
            shard_bits,
            per_shard: max_keys / shards,
            hasher: foldhash::fast::RandomState::default(),
            evicted: Mutex::new(Vec::new()),
        }
    }

    /// The most keys this store holds.
    pub fn max_keys(&self) -> usize {
        self.per_shard * self.shards.len()
    }

    fn shard(&self, hash: u64) -> &ShardLock<Shard<K>> {
        let index = if self.shard_bits == 0 {
            0
        } else {
            (hash >> (64 - self.shard_bits)) as usize
        };
        &self.shards[index].0
    }
}

impl<K> Default for MemoryLocalStore<K> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: Clone> MemoryLocalStore<K> {
    /// A key seen for the first time (or again after its eviction): out of line, so the hit
    /// path stays small enough to inline.
    #[inline(never)]
    fn insert<R>(
        &self,
        table: &mut Shard<K>,
        hash: u64,
        key: &LeaseKey<K>,
        f: impl FnOnce(&mut LocalBucket) -> R,
    ) -> R
    where
        K: Hash,
    {
        if table.len() >= self.per_shard {
            self.make_room(table);
        }
        let entry = Entry {
            key: key.clone(),
            bucket: LocalBucket::default(),
        };
        let entry = table.insert_unique(hash, entry, |e| self.hasher.hash_one(&e.key));
        let bucket = &mut entry.into_mut().bucket;
        bucket.mark_used();
        f(bucket)
    }

    /// Frees at least an eighth of a full shard: first buckets not used since the last pass,
    /// then any that are not fetching. Evicted buckets holding leased tokens or uncounted
    /// requests are all kept for the throttle (it takes them every half lease time), so no
    /// leased token is stranded.
    fn make_room(&self, table: &mut Shard<K>) {
        let target = self.per_shard - (self.per_shard / 8).max(1);
        let mut evicted = Vec::new();
        for second_chance in [true, false] {
            if table.len() <= target {
                break;
            }
            let mut len = table.len();
            let victims = table.extract_if(|Entry { bucket, .. }| {
                let used = second_chance && bucket.take_used_mark();
                let evict = len > target && !used && !bucket.is_fetching();
                len -= usize::from(evict);
                evict
            });
            evicted.extend(
                victims
                    .filter(|e| e.bucket.leased_tokens() > 0 || e.bucket.uncounted_requests() > 0)
                    .map(|e| (e.key, e.bucket)),
            );
        }
        if !evicted.is_empty() {
            lock(&self.evicted).append(&mut evicted);
        }
    }
}

impl<K> LocalStore<LeaseKey<K>> for MemoryLocalStore<K>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
{
    #[inline]
    fn with_bucket<R>(&self, key: &LeaseKey<K>, f: impl FnOnce(&mut LocalBucket) -> R) -> R {
        let hash = self.hasher.hash_one(key);
        let mut table = self.shard(hash).lock();
        match table.find_entry(hash, |e| e.key == *key) {
            Ok(entry) => {
                let bucket = &mut entry.into_mut().bucket;
                bucket.mark_used();
                f(bucket)
            }
            Err(absent) => self.insert(absent.into_table(), hash, key, f),
        }
    }

    fn peek_bucket<R>(&self, key: &LeaseKey<K>, f: impl FnOnce(&LocalBucket) -> R) -> Option<R> {
        let hash = self.hasher.hash_one(key);
        let table = self.shard(hash).lock();
        table.find(hash, |e| e.key == *key).map(|e| f(&e.bucket))
    }

    fn for_each_bucket(&self, mut f: impl FnMut(&LeaseKey<K>, &mut LocalBucket)) {
        for shard in self.shards.iter() {
            for entry in shard.0.lock().iter_mut() {
                f(&entry.key, &mut entry.bucket);
            }
        }
    }

    fn take_evicted(&self) -> Vec<(LeaseKey<K>, LocalBucket)> {
        std::mem::take(&mut *lock(&self.evicted))
    }

    fn len(&self) -> usize {
        self.shards.iter().map(|s| s.0.lock().len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_million_keys_stay_within_the_bound() {
        let store = MemoryLocalStore::<u64>::with_max_keys(10_000).unwrap();
        let max = store.max_keys();
        assert!((9_000..=10_000).contains(&max), "max_keys {max}");
        let table_capacity =
            || -> usize { store.shards.iter().map(|s| s.0.lock().capacity()).sum() };
        for key in 0..1_000_000u64 {
            store.with_bucket(&LeaseKey::new(key, 0, 0), |b| b.mark_used());
            assert!(store.len() <= max);
            if key % 100_000 == 0 {
                // Eviction leaves tombstones, so a table may double once, then rehashes in place.
                assert!(
                    table_capacity() <= 3 * max,
                    "table capacity {}",
                    table_capacity()
                );
            }
        }
        assert!(store.len() > max / 2, "eviction frees only part of a shard");
        assert!(
            table_capacity() <= 3 * max,
            "table capacity {}",
            table_capacity()
        );
    }

    #[test]
    fn recently_used_keys_survive_eviction() {
        let store = MemoryLocalStore::<u64>::with_max_keys(64).unwrap();
        assert_eq!(store.shards.len(), 1);
        for key in 0..64u64 {
            store.with_bucket(&LeaseKey::new(key, 0, 0), |_| ());
        }
        // A first pass clears every mark and evicts in table order; mark key 7 after it.
        let touch = |key: u64| store.with_bucket(&LeaseKey::new(key, 0, 0), |_| ());
        touch(1000);
        touch(7);
        for key in 2000..2060u64 {
            touch(key);
            touch(7);
        }
        let mut present = false;
        store.for_each_bucket(|k, _| present |= *k.key() == 7);
        assert!(present, "a key used between passes is kept");
    }
}

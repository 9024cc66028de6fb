//! The in-memory, sharded, bounded local store.

use std::borrow::Borrow;
use std::hash::{BuildHasher, Hash};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use hashbrown::HashTable;

use crate::error::ConfigError;
use crate::local::reserves::{CoreReserves, Reserves, Taken};
use crate::local::{Hit, LocalBucket, LocalStore};
use crate::quota::LeaseKey;
use crate::sync::{CacheLine, ShardLock, key_hasher, lock, shard_index};

/// The default local store: buckets in memory, in shards under a few locks, bounded to a
/// maximum number of keys.
///
/// A request holds one lock for a few nanoseconds; a known key costs one hash and one probe,
/// and no allocation. When a shard is full, a new key evicts buckets that were not used since
/// the eviction pass last went by them (second chance), then any other that [may be
/// evicted](LocalBucket::may_evict) (not fetching, paying for credit or waiting for tokens it
/// reserved); evicted leases are handed back to the global store, unless their key comes back
/// first and gets its bucket back as it was. Memory stays
/// bounded however many distinct keys arrive (beyond the buckets that may not be evicted, each
/// for at most a round trip or a reservation's wait).
#[derive(Debug)]
pub struct MemoryLocalStore<K> {
    /// The shards, in runs of `1 << run_bits` shards under one lock each: few locks, so their
    /// lines stay in cache however many keys there are (one lock per shard cost a cache miss
    /// per request over 1,000 keys); small shards, so an eviction pass stays short.
    locks: Box<[CacheLine<ShardLock<Run<K>>>]>,
    shard_bits: u32,
    run_bits: u32,
    per_shard: usize,
    hasher: foldhash::fast::SeedableRandomState,
    /// Evicted buckets holding leased tokens or uncounted requests, or remembering tokens they
    /// held lately, until the throttle takes them or their key comes back.
    evicted: Mutex<Shard<K>>,
    /// How many there are (read without the lock: a new key looks for its evicted bucket only
    /// when there may be one).
    evicted_count: AtomicUsize,
    /// Tokens of hot keys lent to the cores serving them.
    reserves: Reserves<K>,
}

type Shard<K> = HashTable<Entry<LeaseKey<K>>>;

/// The shards under one lock, and the requests admitted whole on the hot path under it
/// (counted in the lock's line, which the take owns already: free, where a shared counter
/// would cost the hot path a locked instruction).
#[derive(Debug)]
struct Run<K> {
    shards: Box<[Shard<K>]>,
    admitted: u64,
}

/// A key and its bucket. Packed, not padded to cache lines: every entry of a shard is behind
/// one lock, so neighbours never race for a line, and a small entry keeps a large store in
/// cache (48 bytes with `u64` keys).
#[derive(Debug)]
struct Entry<K> {
    key: K,
    bucket: LocalBucket,
}

/// The most keys a shard holds: an eviction pass scans one shard under its lock, so this
/// bounds how long a new key can hold a lock (a few microseconds).
const MAX_KEYS_PER_SHARD: usize = 512;

impl<K> MemoryLocalStore<K> {
    /// The default bound: 100,000 keys (at most about 29 MB with `u64` keys when every key is
    /// active, 11 MB when they are merely tracked; see `BENCHMARKS.md`).
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
        // Eight locks per core, so threads on different keys rarely meet on one; enough
        // shards that none holds more than MAX_KEYS_PER_SHARD, and at least 64 keys each.
        let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
        let locks = (cores * 8).next_power_of_two();
        let shards = locks
            .max(max_keys.div_ceil(MAX_KEYS_PER_SHARD))
            .next_power_of_two()
            .min(1 << (max_keys / 64).max(1).ilog2());
        let locks = locks.min(shards);
        let (shard_bits, run_bits) = (shards.ilog2(), (shards / locks).ilog2());
        let run = || Run {
            shards: (0..shards / locks).map(|_| HashTable::new()).collect(),
            admitted: 0,
        };
        Self {
            locks: (0..locks)
                .map(|_| CacheLine(ShardLock::new(run())))
                .collect(),
            shard_bits,
            run_bits,
            per_shard: max_keys / shards,
            hasher: key_hasher(None),
            evicted: Mutex::new(HashTable::new()),
            evicted_count: AtomicUsize::new(0),
            reserves: Reserves::new(CoreReserves::default()),
        }
    }

    /// When a hot key's leased tokens are lent to the cores that serve it (default:
    /// [`CoreReserves::WhenContended`]), so that a key served by many cores at once does not
    /// pass one lock's cache line between them on every request. Refusals stay exact: a
    /// request the lease cannot serve takes every core's reserve of its key back first.
    pub fn with_core_reserves(mut self, policy: CoreReserves) -> Self {
        self.reserves = Reserves::new(policy);
        self
    }

    /// When this store lends a hot key's tokens to the cores that serve it.
    pub fn core_reserves(&self) -> CoreReserves {
        self.reserves.policy()
    }

    /// Keys with a reserve, over all cores.
    #[cfg(test)]
    pub(crate) fn keys_in_reserve(&self) -> usize {
        self.reserves.keys()
    }

    /// Lays keys out by a hash of `seed` rather than a random one, so that evictions and
    /// sweeps visit them in the same order in every run: for reproducible tests and
    /// simulations. Leave it random where clients choose the keys, so that they cannot aim many
    /// keys at one shard.
    pub fn with_hash_seed(mut self, seed: u64) -> Self {
        self.hasher = key_hasher(Some(seed));
        self
    }

    /// The most keys this store holds.
    pub fn max_keys(&self) -> usize {
        self.per_shard << self.shard_bits
    }

    /// Calls `f` on the shard of a group hashed to `hash`, its lock held.
    #[inline(always)]
    fn with_shard<R>(&self, hash: u64, f: impl FnOnce(&mut Shard<K>) -> R) -> R {
        self.with_shard_counted(hash, |shard, _| f(shard))
    }

    /// [`with_shard`](Self::with_shard), with the count of requests admitted whole under the
    /// shard's lock.
    #[inline(always)]
    fn with_shard_counted<R>(&self, hash: u64, f: impl FnOnce(&mut Shard<K>, &mut u64) -> R) -> R {
        let (lock, shard) = self.place(shard_index(hash, self.shard_bits));
        let mut run = self.locks[lock].0.lock();
        let Run { shards, admitted } = &mut *run;
        f(&mut shards[shard], admitted)
    }

    /// Where shard `index` is: its lock's run, and its place in the run.
    #[inline(always)]
    fn place(&self, index: usize) -> (usize, usize) {
        (index >> self.run_bits, index & ((1 << self.run_bits) - 1))
    }

    /// Runs `f` on every shard, taking the lock once per shard: a pass over a whole run under
    /// one hold (thousands of keys in a large store) would keep every request of the run's
    /// keys waiting for it.
    fn each_shard(&self, mut f: impl FnMut(usize, &mut Shard<K>)) {
        for index in 0..1usize << self.shard_bits {
            self.with_shard_at(index, |shard| f(index, shard));
        }
    }

    /// Runs `f` on shard `index` (of `1 << shard_bits`), its lock held; none beyond the last.
    fn with_shard_at(&self, index: usize, f: impl FnOnce(&mut Shard<K>)) {
        let (lock, shard) = self.place(index);
        let Some(lock) = self.locks.get(lock) else {
            return;
        };
        if let Some(shard) = lock.0.lock().shards.get_mut(shard) {
            f(shard);
        }
    }

    /// Requests admitted whole by [`take_group`](Self::take_group) so far: every limit of their
    /// key taken from the leases at once.
    pub(crate) fn admitted_whole(&self) -> u64 {
        self.locks.iter().fold(self.reserves.served(), |sum, lock| {
            sum.saturating_add(lock.0.lock().admitted)
        })
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
        (index, table): (usize, &mut Shard<K>),
        hash: u64,
        key: &LeaseKey<K>,
        f: impl FnOnce(&mut LocalBucket) -> R,
    ) -> R
    where
        K: Hash + Eq,
    {
        if table.len() >= self.per_shard {
            self.make_room(index, table, hash);
        }
        let entry = Entry {
            key: key.clone(),
            bucket: self.take_evicted_bucket(hash, key).unwrap_or_default(),
        };
        let entry = table.insert_unique(hash, entry, |e| self.hashes(&e.key).1);
        let bucket = &mut entry.into_mut().bucket;
        bucket.mark_used();
        f(bucket)
    }

    /// Frees at least an eighth of a full shard: first buckets not used since the pass last
    /// went by them, then any other that [may be evicted](LocalBucket::may_evict). The pass
    /// starts at a place in the table the new key's hash picks, not at its first slot: from a
    /// fixed start, the keys placed late in the table would never be reached while the early
    /// ones turned over, however long they had gone unused. Evicted buckets holding leased
    /// tokens or uncounted requests, or remembering tokens they held lately, are all kept, for
    /// the throttle (it takes them every half lease time) or for their key if it comes back
    /// first, so no leased token is stranded and no refill around one is spent.
    fn make_room(&self, index: usize, table: &mut Shard<K>, hash: u64)
    where
        K: Hash + Eq,
    {
        let target = self.per_shard - (self.per_shard / 8).max(1);
        self.recall_shard(index, table);
        let slots = table.num_buckets();
        // Bits of the hash that vary from key to key within a shard.
        let start = (hash >> 32) as usize;
        let mut evicted = Vec::new();
        for second_chance in [true, false] {
            for step in 0..slots {
                if table.len() <= target {
                    break;
                }
                let Ok(mut entry) = table.get_bucket_entry(start.wrapping_add(step) % slots) else {
                    continue;
                };
                let bucket = &mut entry.get_mut().bucket;
                let used = second_chance && bucket.take_used_mark();
                if !used && bucket.may_evict() {
                    let (victim, _) = entry.remove();
                    if worth_keeping(&victim.bucket) {
                        evicted.push(victim);
                    }
                }
            }
        }
        if !evicted.is_empty() {
            let mut kept = lock(&self.evicted);
            for entry in evicted {
                kept.insert_unique(self.hashes(&entry.key).1, entry, |e| self.hashes(&e.key).1);
            }
            self.evicted_count.store(kept.len(), Ordering::Relaxed);
        }
    }

    /// The bucket `key` (hashed to `hash`) had when it was evicted, if the throttle has not
    /// taken it yet: the key gets it back as it was, its leased tokens and what it knew of the
    /// global bucket. Handed back instead, those tokens could reach the store after the key's
    /// new bucket had fetched the bucket refilled around them, and be spent twice.
    fn take_evicted_bucket(&self, hash: u64, key: &LeaseKey<K>) -> Option<LocalBucket>
    where
        K: Hash + Eq,
    {
        if self.evicted_count.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let mut kept = lock(&self.evicted);
        let entry = kept.find_entry(hash, |e| e.key == *key).ok()?;
        let (Entry { bucket, .. }, _) = entry.remove();
        self.evicted_count.store(kept.len(), Ordering::Relaxed);
        Some(bucket)
    }
}

impl<K: Hash + Eq + Clone> MemoryLocalStore<K> {
    /// The hash of `id`'s group (its key at its level), which picks the shard, so that every
    /// bucket of a key at a level sits in one shard; and `id`'s own, within the shard's table.
    #[inline(always)]
    fn hashes(&self, id: &LeaseKey<K>) -> (u64, u64) {
        let group = self.group_hash(&id.key, id.level);
        let own = if id.slot == 0 {
            group
        } else {
            slot_hash(group, id.slot)
        };
        (group, own)
    }

    /// The hash of `key`'s group at `level`: a key at the first level hashes as itself, and
    /// so as any borrowed form of it (`String` and `str` alike).
    #[inline(always)]
    fn group_hash<Q: Hash + ?Sized>(&self, key: &Q, level: u8) -> u64 {
        let group = self.hasher.hash_one(key);
        if level == 0 {
            group
        } else {
            mix(group, u64::from(level))
        }
    }

    /// The hot path for a request on every limit of `first`'s key at its level, under one
    /// lock: takes `cost` from the first bucket, and when it knows its key has more limits,
    /// from each of theirs too. All of them admit, or only the first bucket's outcome is
    /// known and the others are left as they were. A request admitted whole (every limit of
    /// its key taken) is counted under the lock ([`admitted_whole`](Self::admitted_whole)):
    /// callers take only whole requests here, whose only level is this one.
    #[inline]
    pub(crate) fn take_group(&self, first: &LeaseKey<K>, cost: u64) -> GroupHit {
        self.take_group_by(&first.key, first.level, cost)
    }

    /// [`take_group`](Self::take_group) for a key given in a borrowed form (a `str` for a
    /// `String` key), so that a request's key is made only when the slow path needs it. A key
    /// with one limit is served from its reserve on this core when there is one.
    #[inline]
    pub(crate) fn take_group_by<Q>(&self, key: &Q, level: u8, cost: u64) -> GroupHit
    where
        K: Borrow<Q> + Clone,
        Q: Hash + Eq + ?Sized,
    {
        let group = self.group_hash(key, level);
        let short = match self.reserves.take(group, key, level, cost) {
            Taken::Served => return GroupHit::First(Hit::Admitted, 1),
            Taken::Short => true,
            Taken::None => false,
        };
        self.take_in_shard(group, (key, level), cost, Some(short), |_| ())
            .0
    }

    /// [`take_group_by`](Self::take_group_by) that also reads the first bucket once it has
    /// taken (`read`, under the same lock; `None` when the key has no bucket here): one lookup
    /// for a request whose response tells the state of its limit. Such a request reads the
    /// lease itself, so it neither takes from a reserve nor lends to one.
    #[inline(always)]
    pub(crate) fn take_group_then<Q, R>(
        &self,
        key: &Q,
        level: u8,
        cost: u64,
        read: impl FnOnce(&LocalBucket) -> R,
    ) -> (GroupHit, Option<R>)
    where
        K: Borrow<Q> + Clone,
        Q: Hash + Eq + ?Sized,
    {
        let group = self.group_hash(key, level);
        self.take_in_shard(group, (key, level), cost, None, read)
    }

    /// The take under the shard lock of `key` at `level` (hashed to `group`); when `lend` is
    /// `Some(short)` (this core's reserve of the key was short, if it has one), the lease
    /// may lend this core some of its tokens.
    #[inline(always)]
    fn take_in_shard<Q, R>(
        &self,
        group: u64,
        (key, level): (&Q, u8),
        cost: u64,
        lend: Option<bool>,
        read: impl FnOnce(&LocalBucket) -> R,
    ) -> (GroupHit, Option<R>)
    where
        K: Borrow<Q> + Clone,
        Q: Hash + Eq + ?Sized,
    {
        let (lock, shard) = self.place(shard_index(group, self.shard_bits));
        let (mut run, contended) = self.locks[lock].0.lock_noting_contention();
        let Run { shards, admitted } = &mut *run;
        let table = &mut shards[shard];
        let Some(entry) = table.find_mut(group, |e| is_bucket(&e.key, key, level, 0)) else {
            return (GroupHit::First(Hit::Short, 0), None);
        };
        entry.bucket.mark_used();
        let mut hit = entry.bucket.take_leased(cost);
        if hit == Hit::Short {
            hit = self.take_recalled(group, entry, cost);
        }
        let slots = entry.bucket.slots();
        let read = Some(read(&entry.bucket));
        if slots <= 1 || hit == Hit::Short {
            let whole = slots == 1 && hit != Hit::Short;
            *admitted += u64::from(whole);
            if whole
                && hit == Hit::Admitted
                && lend.is_some_and(|short| self.reserves.lends(contended, short))
            {
                self.reserves.lend(group, &entry.key, &mut entry.bucket);
            }
            return (GroupHit::First(hit, slots), read);
        }
        let taken = take_rest(table, group, (key, level), hit, slots, cost);
        *admitted += u64::from(matches!(taken, GroupHit::All { .. }));
        (taken, read)
    }

    /// The take of a lease that held fewer than `cost` tokens, again once every core's
    /// reserve of its key is back in it: a request is refused (or waits) only when this host
    /// holds none of the key's tokens anywhere.
    #[cold]
    #[inline(never)]
    fn take_recalled(&self, group: u64, entry: &mut Entry<LeaseKey<K>>, cost: u64) -> Hit {
        if !self.reserves.may_hold(group) {
            return Hit::Short;
        }
        self.reserves.recall(group, &entry.key, &mut entry.bucket);
        entry.bucket.take_leased(cost)
    }

    /// Takes every core's reserve of `id`'s bucket (hashed to `group`) back into it: done
    /// before anything but a request's take looks at a bucket.
    #[inline(always)]
    fn recall_into(&self, group: u64, id: &LeaseKey<K>, bucket: &mut LocalBucket) {
        if id.slot == 0 && self.reserves.may_hold(group) {
            self.reserves.recall(group, id, bucket);
        }
    }

    /// Takes every core's reserve of a bucket of `shard` (number `index`) back into it: by the
    /// reserves, a few hundred per core at most, rather than by the shard's buckets.
    fn recall_shard(&self, index: usize, shard: &mut Shard<K>) {
        if !self.reserves.any() {
            return;
        }
        let here = |group| shard_index(group, self.shard_bits) == index;
        self.reserves
            .recall_where(here, |group, id, unspent, served| {
                let entry = shard.find_mut(group, |e| e.key == *id);
                // A reserve's bucket is there: it goes only after its reserves came back.
                debug_assert!(entry.is_some(), "a reserve outlived its bucket");
                if let Some(entry) = entry {
                    entry.bucket.repay(unspent, served);
                }
            });
    }

    /// Runs `f` on every bucket of `shard` (number `index`), each with its reserves back.
    fn each_entry(
        &self,
        index: usize,
        shard: &mut Shard<K>,
        f: &mut impl FnMut(&LeaseKey<K>, &mut LocalBucket),
    ) {
        self.recall_shard(index, shard);
        for entry in shard.iter_mut() {
            f(&entry.key, &mut entry.bucket);
        }
    }
}

/// Whether an evicted bucket is kept (for the throttle, or for its key if it comes back
/// first): it holds leased tokens or uncounted requests, or remembers holding tokens lately
/// ([`LocalBucket::remembers_held`]).
fn worth_keeping(bucket: &LocalBucket) -> bool {
    bucket.leased_tokens() > 0 || bucket.uncounted_requests() > 0 || bucket.remembers_held()
}

/// The limits after the first, for [`MemoryLocalStore::take_group_by`].
#[inline(never)]
fn take_rest<K, Q>(
    table: &mut Shard<K>,
    group: u64,
    first: (&Q, u8),
    hit: Hit,
    slots: u8,
    cost: u64,
) -> GroupHit
where
    K: Borrow<Q>,
    Q: Eq + ?Sized,
{
    let mut fetch = u16::from(hit == Hit::AdmittedStartFetch);
    for slot in 1..slots {
        let taken = slot_bucket(table, group, first, slot).map(|b| {
            b.mark_used();
            b.take_leased(cost)
        });
        match taken {
            Some(Hit::Admitted) => {}
            Some(Hit::AdmittedStartFetch) => fetch |= 1 << slot,
            Some(Hit::Short) | None => {
                // Put back what the limits between took, and the fetches ahead they asked
                // for (none will be started): the slow path decides them.
                for undone in 1..slot {
                    if let Some(b) = slot_bucket(table, group, first, undone) {
                        // Taken under this lock a moment ago: nothing can overflow.
                        b.undo_take(cost, u64::MAX);
                        if fetch & 1 << undone != 0 {
                            b.cancel_fetch_ahead();
                        }
                    }
                }
                return GroupHit::First(hit, slots);
            }
        }
    }
    GroupHit::All { fetch }
}

/// Whether `id` names the bucket of `key` at `level` and `slot`.
#[inline(always)]
fn is_bucket<K: Borrow<Q>, Q: Eq + ?Sized>(id: &LeaseKey<K>, key: &Q, level: u8, slot: u8) -> bool {
    id.slot == slot && id.level == level && id.key.borrow() == key
}

/// The bucket of `first`'s key and level at `slot`, in the shard of their group.
fn slot_bucket<'t, K: Borrow<Q>, Q: Eq + ?Sized>(
    table: &'t mut Shard<K>,
    group: u64,
    (key, level): (&Q, u8),
    slot: u8,
) -> Option<&'t mut LocalBucket> {
    table
        .find_mut(slot_hash(group, slot), |e| {
            is_bucket(&e.key, key, level, slot)
        })
        .map(|e| &mut e.bucket)
}

/// The hash of a further limit's bucket (`slot` > 0) in the group hashing as `group`.
#[inline(always)]
fn slot_hash(group: u64, slot: u8) -> u64 {
    mix(group, 0x100 | u64::from(slot))
}

/// A cheap, well-spread mix of a hash and a small number.
#[inline(always)]
fn mix(hash: u64, n: u64) -> u64 {
    (hash ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15)).wrapping_mul(0xD6E8_FEB8_6659_FD93)
}

/// [`MemoryLocalStore::take_group`]'s answer.
pub(crate) enum GroupHit {
    /// Every limit's bucket had the cost and gave it; `fetch` has a bit set for each slot
    /// whose lease ran low (a fetch ahead to start).
    All { fetch: u16 },
    /// Only the first bucket was decided (`Hit`), with its key's number of limits (0 when
    /// unknown); the others are untouched.
    First(Hit, u8),
}

impl GroupHit {
    /// Whether every limit of the key admitted with nothing more to do (no fetch ahead, no
    /// limit left to check).
    #[inline(always)]
    pub(crate) fn is_plain_admission(&self) -> bool {
        matches!(self, Self::All { fetch: 0 } | Self::First(Hit::Admitted, 1))
    }
}

impl<K> LocalStore<LeaseKey<K>> for MemoryLocalStore<K>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
{
    #[inline]
    fn with_bucket<R>(&self, key: &LeaseKey<K>, f: impl FnOnce(&mut LocalBucket) -> R) -> R {
        let (group, hash) = self.hashes(key);
        self.with_shard(group, |table| {
            match table.find_entry(hash, |e| e.key == *key) {
                Ok(entry) => {
                    let Entry { key, bucket } = entry.into_mut();
                    self.recall_into(group, key, bucket);
                    bucket.mark_used();
                    f(bucket)
                }
                Err(absent) => {
                    let index = shard_index(group, self.shard_bits);
                    self.insert((index, absent.into_table()), hash, key, f)
                }
            }
        })
    }

    /// A bucket as it is: tokens lent to cores' reserves are not in it (a view of it tells
    /// up to those fewer, never more).
    fn peek_bucket<R>(&self, key: &LeaseKey<K>, f: impl FnOnce(&LocalBucket) -> R) -> Option<R> {
        let (group, hash) = self.hashes(key);
        self.with_shard(group, |table| {
            table.find(hash, |e| e.key == *key).map(|e| f(&e.bucket))
        })
    }

    fn for_each_bucket(&self, mut f: impl FnMut(&LeaseKey<K>, &mut LocalBucket)) {
        self.each_shard(|index, shard| self.each_entry(index, shard, &mut f));
    }

    /// One part per shard (a few hundred keys at most).
    fn parts(&self) -> usize {
        1 << self.shard_bits
    }

    fn for_each_bucket_in(&self, part: usize, mut f: impl FnMut(&LeaseKey<K>, &mut LocalBucket)) {
        self.with_shard_at(part, |shard| self.each_entry(part, shard, &mut f));
    }

    fn take_evicted(&self) -> Vec<(LeaseKey<K>, LocalBucket)> {
        let mut kept = lock(&self.evicted);
        self.evicted_count.store(0, Ordering::Relaxed);
        kept.drain().map(|e| (e.key, e.bucket)).collect()
    }

    fn len(&self) -> usize {
        let mut len = 0;
        self.each_shard(|_, shard| len += shard.len());
        len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unused_key_is_evicted_wherever_the_layout_places_it() {
        let mut longest = 0;
        for seed in 0..64 {
            let store = MemoryLocalStore::<u64>::with_max_keys(64)
                .unwrap()
                .with_hash_seed(seed);
            let unused = LeaseKey::new(0, 0, 0);
            // Holding a token, so that its eviction shows in what is kept for the throttle.
            store.with_bucket(&unused, |b| b.give_back(1, u64::MAX));
            let newcomers = (1..10_000).position(|key| {
                store.with_bucket(&LeaseKey::new(key, 0, 0), |b| b.mark_used());
                store.take_evicted().iter().any(|(id, _)| *id == unused)
            });
            let Some(newcomers) = newcomers else {
                panic!("seed {seed}: never evicted in 10,000 new keys");
            };
            longest = longest.max(newcomers);
        }
        // A shard of 64 frees 8 at a time: a few passes, not the whole run.
        assert!(longest < 1_000, "{longest} new keys");
    }

    #[test]
    fn every_bucket_is_in_exactly_one_part() {
        let store = MemoryLocalStore::<u64>::with_max_keys(10_000).unwrap();
        for k in 0..3_000 {
            store.with_bucket(&LeaseKey::new(k, 0, 0), |b| b.mark_used());
        }
        let mut seen = vec![0u32; 3_000];
        let mut visits_per_part = Vec::new();
        for part in 0..store.parts() {
            let mut visits = 0;
            store.for_each_bucket_in(part, |id, _| {
                seen[*id.key() as usize] += 1;
                visits += 1;
            });
            visits_per_part.push(visits);
        }
        assert!(seen.iter().all(|&n| n == 1), "every key once");
        // Small parts: a pass yields between them.
        assert!(store.parts() >= 16);
        assert!(visits_per_part.iter().all(|&n| n <= 512));
        store.for_each_bucket_in(store.parts(), |_, _| panic!("no part beyond the last"));
    }

    #[test]
    fn a_seeded_store_visits_its_keys_in_the_same_order_every_time() {
        let order = |seed: u64| {
            let store = MemoryLocalStore::<u64>::with_max_keys(1_000)
                .unwrap()
                .with_hash_seed(seed);
            for k in 0..200 {
                store.with_bucket(&LeaseKey::new(k, 0, 0), |b| b.mark_used());
            }
            let mut keys = Vec::new();
            store.for_each_bucket(|id, _| keys.push(*id.key()));
            keys
        };
        assert_eq!(order(7), order(7));
        assert_ne!(
            order(7),
            order(8),
            "another seed lays the keys out otherwise"
        );
    }

    #[test]
    fn a_million_keys_stay_within_the_bound() {
        let store = MemoryLocalStore::<u64>::with_max_keys(10_000).unwrap();
        let max = store.max_keys();
        assert!((9_000..=10_000).contains(&max), "max_keys {max}");
        let table_capacity = || -> usize {
            let mut capacity = 0;
            store.each_shard(|_, s| capacity += s.capacity());
            capacity
        };
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
    fn shards_are_small_and_share_a_few_locks() {
        let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
        for max_keys in [64, 1_000, 100_000, 10_000_000] {
            let store = MemoryLocalStore::<u64>::with_max_keys(max_keys).unwrap();
            let shards = 1usize << store.shard_bits;
            // Short eviction passes, and no shard too small to keep its recent keys.
            assert!((64..=MAX_KEYS_PER_SHARD).contains(&store.per_shard));
            assert!(store.max_keys() <= max_keys && store.max_keys() > max_keys - shards);
            // Every shard under exactly one of a few locks.
            assert!(store.locks.len() <= (cores * 8).next_power_of_two());
            let runs: Vec<usize> = store
                .locks
                .iter()
                .map(|l| l.0.lock().shards.len())
                .collect();
            assert!(runs.iter().all(|&run| run == 1 << store.run_bits));
            assert_eq!(runs.iter().sum::<usize>(), shards);
        }
    }

    #[test]
    fn a_key_is_found_by_its_borrowed_form_at_its_own_level_and_slot_only() {
        let store = MemoryLocalStore::<String>::new();
        let id = |level, slot| LeaseKey::new("k1".to_owned(), level, slot);
        store.with_bucket(&id(0, 0), |b| {
            b.give_back(5, u64::MAX);
            b.set_slots(2);
        });
        store.with_bucket(&id(0, 1), |b| b.give_back(1, u64::MAX));
        store.with_bucket(&id(1, 0), |b| b.give_back(7, u64::MAX));
        let tokens = |level, slot| store.with_bucket(&id(level, slot), |b| b.leased_tokens());

        // A `str` finds the `String` key's buckets: the first, then its second limit.
        assert!(store.take_group_by("k1", 0, 1).is_plain_admission());
        assert_eq!((tokens(0, 0), tokens(0, 1), tokens(1, 0)), (4, 0, 7));
        // At the second level the same text is another bucket, with one limit known so far.
        assert!(matches!(
            store.take_group_by("k1", 1, 2),
            GroupHit::First(Hit::Admitted, 0)
        ));
        assert_eq!(tokens(1, 0), 5);
        // Another key, or the same one with its second limit now short, is for the slow path.
        assert!(matches!(
            store.take_group_by("k2", 0, 1),
            GroupHit::First(Hit::Short, 0)
        ));
        assert!(matches!(
            store.take_group_by("k1", 0, 1),
            GroupHit::First(Hit::Admitted, 2)
        ));
        assert_eq!((tokens(0, 0), tokens(0, 1)), (3, 0));
    }

    #[test]
    fn a_key_s_limits_are_taken_all_together_or_only_the_first_is_decided() {
        let store = MemoryLocalStore::<u64>::new();
        let id = |slot| LeaseKey::new(1, 0, slot);
        store.with_bucket(&id(0), |b| {
            b.give_back(5, u64::MAX);
            b.set_slots(3);
        });
        store.with_bucket(&id(1), |b| b.give_back(5, u64::MAX));
        store.with_bucket(&id(2), |_| ());
        let tokens = || [0, 1, 2].map(|slot| store.with_bucket(&id(slot), |b| b.leased_tokens()));

        // The third limit is short: the second is put back, the first is left to the caller.
        assert!(matches!(
            store.take_group(&id(0), 2),
            GroupHit::First(Hit::Admitted, 3)
        ));
        assert_eq!(tokens(), [3, 5, 0]);
        store.with_bucket(&id(2), |b| b.give_back(5, u64::MAX));
        assert!(matches!(
            store.take_group(&id(0), 2),
            GroupHit::All { fetch: 0 }
        ));
        assert_eq!(tokens(), [1, 3, 3]);
        // A key it does not hold is for the slow path.
        assert!(matches!(
            store.take_group(&LeaseKey::new(2, 0, 0), 1),
            GroupHit::First(Hit::Short, 0)
        ));
    }

    /// A limit added at run time was short while the one before it ran low: its fetch ahead,
    /// asked for and then put back with its tokens, must not stay marked as under way (no one
    /// would start it, and every request after would wait for it).
    #[test]
    fn a_fetch_ahead_put_back_with_its_tokens_is_not_left_marked() {
        use crate::global::Grant;
        use crate::lease::FetchOutcome;
        let store = MemoryLocalStore::<u64>::new();
        let id = |slot| LeaseKey::new(1, 0, slot);
        let limit = crate::Limit::per_second(100).build().unwrap();
        let batch = |granted| FetchOutcome::Granted {
            grant: Grant {
                granted,
                reserved: 0,
                ready_in: std::time::Duration::ZERO,
                remaining: 50,
                refill_in: std::time::Duration::ZERO,
            },
            sent_at: 0,
            from: crate::quota::Name::intern("default"),
            shape: 0,
        };
        store.with_bucket(&id(0), |b| {
            b.settle(&batch(100), 0, 0, &limit);
            b.set_slots(3);
        });
        // Slot 1 holds 10, so taking 6 runs it below half its batch.
        store.with_bucket(&id(1), |b| b.settle(&batch(10), 0, 0, &limit));
        store.with_bucket(&id(2), |_| ());
        assert!(matches!(
            store.take_group(&id(0), 6),
            GroupHit::First(Hit::Admitted, 3)
        ));
        let (tokens, fetching) =
            store.with_bucket(&id(1), |b| (b.leased_tokens(), b.is_fetching()));
        assert_eq!((tokens, fetching), (10, false));
    }

    /// A bucket waiting for tokens it reserved survives eviction passes, used or not: one made
    /// afresh would reserve again, behind them.
    #[test]
    fn a_bucket_waiting_for_reserved_tokens_survives_eviction() {
        use crate::global::Grant;
        use crate::lease::{FetchOutcome, Waiter};
        use crate::quota::Name;
        use std::time::Duration;
        let store = MemoryLocalStore::<u64>::with_max_keys(64).unwrap();
        let limit = crate::Limit::per_second(10).burst(10).unwrap();
        let reserving = LeaseKey::new(7, 0, 0);
        store.with_bucket(&reserving, |b| {
            let (waiter, _verdict) = Waiter::new(1, 0, 50_000);
            b.miss(1, 0, 0, &limit, true, 0, u64::MAX, || waiter);
            let grant = Grant {
                granted: 0,
                reserved: 5,
                ready_in: Duration::from_millis(300),
                remaining: 0,
                refill_in: Duration::from_millis(400),
            };
            let from = Name::intern("default");
            let answer = FetchOutcome::Granted {
                grant,
                sent_at: 0,
                from,
                shape: 0,
            };
            b.settle(&answer, 1_000, 0, &limit);
        });
        for key in 1000..1200u64 {
            store.with_bucket(&LeaseKey::new(key, 0, 0), |_| ());
        }
        let mut reserved = None;
        store.for_each_bucket(|k, b| {
            if *k == reserving {
                reserved = Some(b.leased_tokens());
            }
        });
        assert_eq!(
            reserved,
            Some(5),
            "kept through three passes, with its reservation"
        );
    }

    #[test]
    fn an_evicted_bucket_that_held_tokens_lately_is_kept_for_its_key() {
        let limit = crate::Limit::per_second(160).burst(160).unwrap();
        let store = MemoryLocalStore::<u64>::with_max_keys(64)
            .unwrap()
            .with_hash_seed(1);
        let id = |key| LeaseKey::new(key, 0, 0);
        // Key 7 leased 10 tokens and spent them: its lease is empty, but the global bucket
        // refills around what it held, which its next fetch takes back.
        store.with_bucket(&id(7), |b| {
            b.settle(&crate::lease::tests::grant_leaving(10, 150), 0, 0, &limit);
            b.take_up_to(10);
            assert!(b.leased_tokens() == 0 && b.remembers_held() && b.may_evict());
        });
        let present = || {
            let mut present = false;
            store.for_each_bucket(|k, _| present |= *k.key() == 7);
            present
        };
        let mut flood = 1000..100_000u64;
        while present() {
            assert!(!flood.is_empty(), "evicted within the flood");
            for key in flood.by_ref().take(64) {
                store.with_bucket(&id(key), |_| ());
            }
        }
        // It comes back knowing it; the flood's buckets, which knew nothing, were dropped.
        assert!(store.with_bucket(&id(7), |b| b.remembers_held()));
        assert!(store.take_evicted().is_empty());
    }

    #[test]
    fn an_evicted_key_that_comes_back_before_the_sweep_gets_its_bucket_back() {
        // Laid out the same in every run: the flood reaches both keys' places.
        let store = MemoryLocalStore::<u64>::with_max_keys(64)
            .unwrap()
            .with_hash_seed(1);
        let id = |key| LeaseKey::new(key, 0, 0);
        store.with_bucket(&id(7), |b| b.give_back(5, u64::MAX));
        store.with_bucket(&id(8), |b| b.give_back(3, u64::MAX));
        // A flood of other keys evicts both, with their tokens.
        let held = || {
            let mut held = 0;
            store.for_each_bucket(|k, b| held += u64::from(*k.key() < 1000) * b.leased_tokens());
            held
        };
        let mut flood = 1000..100_000u64;
        while held() > 0 {
            assert!(!flood.is_empty(), "evicted within the flood");
            for key in flood.by_ref().take(64) {
                store.with_bucket(&id(key), |_| ());
            }
        }
        // Key 7 comes back first: its bucket is its own again, and no longer to hand back.
        assert_eq!(store.with_bucket(&id(7), |b| b.leased_tokens()), 5);
        let evicted = store.take_evicted();
        assert_eq!(evicted.len(), 1);
        assert_eq!((*evicted[0].0.key(), evicted[0].1.leased_tokens()), (8, 3));
        // Taken by the throttle: a key coming back now starts afresh.
        assert_eq!(store.with_bucket(&id(8), |b| b.leased_tokens()), 0);
    }

    #[test]
    fn recently_used_keys_survive_eviction() {
        for seed in 0..16 {
            let store = MemoryLocalStore::<u64>::with_max_keys(64)
                .unwrap()
                .with_hash_seed(seed);
            assert_eq!(store.shard_bits, 0);
            let touch = |key: u64| store.with_bucket(&LeaseKey::new(key, 0, 0), |_| ());
            for key in 0..64u64 {
                touch(key);
            }
            // Key 7 holds a token, so that its eviction shows in what is kept. The first
            // pass finds every key used and may take any; key 7 is used after it (and gets
            // its bucket back if that pass took it).
            store.with_bucket(&LeaseKey::new(7, 0, 0), |b| b.give_back(1, u64::MAX));
            touch(1000);
            touch(7);
            for key in 2000..2400u64 {
                touch(key);
                let evicted = store.take_evicted();
                assert!(
                    evicted.iter().all(|(id, _)| *id.key() != 7),
                    "seed {seed}: key 7, used between passes, evicted at {key}"
                );
                touch(7);
            }
        }
    }
}

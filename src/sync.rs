//! Small synchronisation helpers.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `m`, recovering from poisoning: the guarded data are plain counters that stay
/// consistent between statements, and a request path must not panic because another did.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The hasher that lays keys out in shards: by a hash of `seed` when one is given, so that a
/// run visits keys in the same order every time (reproducible tests and simulations), else a
/// random one, so that clients choosing keys cannot aim many at one shard.
pub(crate) fn key_hasher(seed: Option<u64>) -> foldhash::fast::SeedableRandomState {
    match seed {
        Some(seed) => foldhash::fast::SeedableRandomState::with_seed(
            seed,
            foldhash::SharedSeed::global_fixed(),
        ),
        None => foldhash::fast::SeedableRandomState::random(),
    }
}

/// The shard, of `1 << bits`, of an entry hashed to `hash`. A hashbrown table keeps the top
/// seven bits of an entry's hash as its control byte, which a probe compares before any key,
/// so the shard is picked from the other bits: picked from the top, the entries of a shard
/// would share their control bytes, and a probe would compare every key of a group. Those bits
/// are mixed by a multiplication (Fibonacci hashing) first: the fast hash of small integers
/// varies, for some seeds, only in its lower bits, and bits taken as they are would then put
/// sequential keys (user ids) in one shard, whose bound evicts while the others stand empty.
#[inline(always)]
pub(crate) fn shard_index(hash: u64, bits: u32) -> usize {
    if bits == 0 {
        0
    } else {
        ((hash << 7).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - bits)) as usize
    }
}

/// When a background pass over many keys gives its worker thread up: once it has visited
/// [`ITEMS_BETWEEN_YIELDS`](Self::ITEMS_BETWEEN_YIELDS) since it last did, at the end of a
/// part (a shard), so that requests queued on the thread never wait for a whole pass.
#[derive(Default)]
pub(crate) struct PassPacing {
    since_yield: usize,
}

impl PassPacing {
    /// A key's state out of cache costs a pass a memory read or two, so a few hundred keys
    /// take tens of microseconds.
    pub(crate) const ITEMS_BETWEEN_YIELDS: usize = 256;

    /// Counts `items` more visited; whether the pass should yield now.
    pub(crate) fn visited(&mut self, items: usize) -> bool {
        self.since_yield += items;
        let due = self.since_yield >= Self::ITEMS_BETWEEN_YIELDS;
        if due {
            self.since_yield = 0;
        }
        due
    }
}

/// Tasks under way (a key's fetch, a slot call), counted so that a host about to stop can wait
/// for them to end.
#[derive(Default)]
pub(crate) struct UnderWay {
    count: AtomicUsize,
    none_left: tokio::sync::Notify,
}

impl UnderWay {
    pub(crate) fn started(&self) {
        self.count.fetch_add(1, Ordering::AcqRel);
    }

    pub(crate) fn ended(&self) {
        if self.count.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.none_left.notify_waiters();
        }
    }

    /// Returns once none is under way.
    pub(crate) async fn none_left(&self) {
        loop {
            // Registered before the count is read, so that an end between the two wakes it.
            let mut ended = std::pin::pin!(self.none_left.notified());
            ended.as_mut().enable();
            if self.count.load(Ordering::Acquire) == 0 {
                return;
            }
            ended.await;
        }
    }
}

/// A lock for critical sections of a few nanoseconds (a run of local-store shards): taking it
/// is one compare-and-swap and releasing it a plain store, where a parking mutex pays a second
/// atomic read-modify-write to release. A thread that finds it taken spins briefly, then yields
/// its time slice, so a holder that was preempted gets to finish.
#[derive(Debug)]
pub(crate) struct ShardLock<T>(spin::mutex::SpinMutex<T>);

impl<T> ShardLock<T> {
    pub(crate) fn new(value: T) -> Self {
        Self(spin::mutex::SpinMutex::new(value))
    }

    #[inline]
    pub(crate) fn lock(&self) -> spin::mutex::SpinMutexGuard<'_, T> {
        self.lock_noting_contention().0
    }

    /// [`lock`](Self::lock), telling whether another thread held it at first (the key it
    /// guards may be hot on several cores).
    #[inline]
    pub(crate) fn lock_noting_contention(&self) -> (spin::mutex::SpinMutexGuard<'_, T>, bool) {
        match self.0.try_lock() {
            Some(guard) => (guard, false),
            None => (self.lock_contended(), true),
        }
    }

    #[cold]
    fn lock_contended(&self) -> spin::mutex::SpinMutexGuard<'_, T> {
        const SPINS_BEFORE_YIELD: u32 = 64;
        loop {
            for _ in 0..SPINS_BEFORE_YIELD {
                // Wait on a plain read, so waiters do not bounce the cache line between cores.
                if !self.0.is_locked()
                    && let Some(guard) = self.0.try_lock()
                {
                    return guard;
                }
                std::hint::spin_loop();
            }
            std::thread::yield_now();
        }
    }
}

/// A value on a cache line of its own (two, against adjacent-line prefetch), so threads
/// working on different ones do not slow each other down.
#[derive(Debug)]
#[repr(align(128))]
pub(crate) struct CacheLine<T>(pub(crate) T);

#[cfg(test)]
mod tests {
    use super::{ShardLock, UnderWay, shard_index};

    #[test]
    fn a_shard_is_picked_from_bits_outside_the_control_byte() {
        let hash = 0x0123_4567_89ab_cdef_u64;
        let control_byte = |h: u64| h >> 57;
        for bits in [1, 6, 8, 12] {
            let index = shard_index(hash, bits);
            assert!(index < 1 << bits);
            // Any control byte, the same shard: keys of one shard keep all seven bits apart.
            for top in 0..128u64 {
                let other = (hash & !(0x7f << 57)) | top << 57;
                assert_eq!(control_byte(other), top);
                assert_eq!(shard_index(other, bits), index);
            }
        }
        assert_eq!(shard_index(hash, 0), 0);
    }

    #[test]
    fn sequential_keys_spread_over_the_shards_whatever_the_seed() {
        // The fast hash of small integers (user ids) varies, for some seeds, only in bits
        // below those just under the control byte: picked from those bits alone, a hundred
        // such keys fell into one or two shards (about one process in a thousand).
        use std::hash::BuildHasher;
        for seed in 0..20_000u64 {
            // A process's random seed, as `RandomState` draws one (leaked: a hasher keeps it).
            let shared = Box::leak(Box::new(foldhash::SharedSeed::from_u64(seed)));
            let hasher = foldhash::fast::SeedableRandomState::with_seed(seed, shared);
            let mut shards = [0u32; 64];
            for key in 0..100u64 {
                shards[shard_index(hasher.hash_one(key), 6)] += 1;
            }
            let fullest = shards.iter().max().copied().unwrap_or_default();
            assert!(
                fullest <= 12,
                "seed {seed}: {fullest} of 100 keys in one shard"
            );
        }
    }

    #[test]
    fn a_pass_yields_once_it_has_visited_enough_since_it_last_did() {
        let mut pacing = super::PassPacing::default();
        let most = super::PassPacing::ITEMS_BETWEEN_YIELDS;
        assert!(!pacing.visited(most - 1));
        assert!(pacing.visited(1));
        assert!(!pacing.visited(most - 1), "counted afresh after a yield");
        assert!(pacing.visited(most * 3), "one yield for a large part");
        assert!(!pacing.visited(0));
    }

    #[test]
    fn a_shard_lock_excludes_other_threads() {
        // A non-atomic read-modify-write under the lock: any overlap would lose increments.
        let counter = ShardLock::new(0u64);
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| {
                    for _ in 0..100_000 {
                        let mut value = counter.lock();
                        *value = std::hint::black_box(*value) + 1;
                    }
                });
            }
        });
        assert_eq!(*counter.lock(), 400_000);
    }

    #[tokio::test]
    async fn the_wait_for_tasks_under_way_ends_with_the_last_of_them() {
        let under_way = std::sync::Arc::new(UnderWay::default());
        under_way.none_left().await;
        under_way.started();
        under_way.started();
        let waiting = tokio::spawn({
            let under_way = under_way.clone();
            async move { under_way.none_left().await }
        });
        tokio::task::yield_now().await;
        under_way.ended();
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "one is still under way");
        under_way.ended();
        tokio::time::timeout(std::time::Duration::from_secs(5), waiting)
            .await
            .expect("woken by the last end")
            .expect("the waiting task");
    }
}

//! Small synchronisation helpers.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `m`, recovering from poisoning: the guarded data are plain counters that stay
/// consistent between statements, and a request path must not panic because another did.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The shard, of `1 << bits`, of an entry hashed to `hash`. A hashbrown table keeps the top
/// seven bits of an entry's hash as its control byte, which a probe compares before any key,
/// so the shard is picked from the bits just below them: picked from the top, the entries of a
/// shard would share their control bytes, and a probe would compare every key of a group.
#[inline(always)]
pub(crate) fn shard_index(hash: u64, bits: u32) -> usize {
    if bits == 0 {
        0
    } else {
        ((hash << 7) >> (64 - bits)) as usize
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
        match self.0.try_lock() {
            Some(guard) => guard,
            None => self.lock_contended(),
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

#[cfg(test)]
mod tests {
    use super::{ShardLock, shard_index};

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
            // The highest bit below the control byte picks the other half of the shards.
            assert_eq!(shard_index(hash ^ 1 << 56, bits), index ^ 1 << (bits - 1));
        }
        assert_eq!(shard_index(hash, 0), 0);
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
}

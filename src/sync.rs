//! Small synchronisation helpers.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `m`, recovering from poisoning: the guarded data are plain counters that stay
/// consistent between statements, and a request path must not panic because another did.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A lock for critical sections of a few nanoseconds (a local-store shard): taking it is one
/// compare-and-swap and releasing it a plain store, where a parking mutex pays a second atomic
/// read-modify-write to release. A thread that finds it taken spins briefly, then yields its
/// time slice, so a holder that was preempted gets to finish.
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
    use super::ShardLock;

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

//! Local stores: the per-host level of the hierarchy.
//!
//! A host keeps one [`LocalBucket`] per key: the tokens leased to it by the global store, when
//! they were leased, the host's recent demand, and whether the key is throttled. A
//! [`LocalStore`] decides where those buckets live and how many; the throttle decides what
//! happens in them.
//!
//! This floor (with [`global`](crate::global)) is the stores: it holds the lease state machines
//! of the floor below and uses the model; nothing above it.

pub mod memory;
mod reserves;

pub use reserves::CoreReserves;

pub use crate::lease::LocalBucket;
pub(crate) use crate::lease::{Hit, View};

/// The per-host cache of local buckets.
///
/// Implementations must be cheap on [`with_bucket`](Self::with_bucket): it runs on every
/// request, and must never call back into the throttle while they hold a lock. They may bound
/// their size; a bucket dropped while it holds leased tokens must be returned, every one of
/// them, by [`take_evicted`](Self::take_evicted), so its tokens go back to the fleet and its
/// counts reach the statistics; a bucket that [may not be evicted](LocalBucket::may_evict) must
/// not be (requests are waiting on it, or tokens it reserved are still to come). A store that
/// evicts should give an evicted bucket back to its key if the key returns before
/// [`take_evicted`](Self::take_evicted) took it, as [`MemoryLocalStore`](memory::MemoryLocalStore)
/// does, and keep for that even a bucket whose lease is empty if it
/// [remembers holding tokens lately](LocalBucket::remembers_held): a bucket made afresh would
/// not know to take back what the global bucket refilled around them.
pub trait LocalStore<K>: Send + Sync + 'static {
    /// Runs `f` on `key`'s bucket, creating an empty one first if there is none.
    fn with_bucket<R>(&self, key: &K, f: impl FnOnce(&mut LocalBucket) -> R) -> R;

    /// Runs `f` on `key`'s bucket if there is one, without creating it or marking it used
    /// (for read-only views). The default goes through [`with_bucket`](Self::with_bucket),
    /// which creates an empty bucket for a key not held.
    fn peek_bucket<R>(&self, key: &K, f: impl FnOnce(&LocalBucket) -> R) -> Option<R> {
        Some(self.with_bucket(key, |bucket| f(bucket)))
    }

    /// Runs `f` on every bucket held.
    fn for_each_bucket(&self, f: impl FnMut(&K, &mut LocalBucket));

    /// How many parts [`for_each_bucket_in`](Self::for_each_bucket_in) divides the buckets
    /// into. The throttle's background pass over a large store goes part by part and lets
    /// other tasks run between parts, so it never holds a worker thread for the whole pass.
    /// The default: one part, every bucket.
    fn parts(&self) -> usize {
        1
    }

    /// Runs `f` on every bucket of part `part` (below [`parts`](Self::parts)); each bucket
    /// held belongs to exactly one part. The default runs
    /// [`for_each_bucket`](Self::for_each_bucket) for part 0.
    fn for_each_bucket_in(&self, part: usize, f: impl FnMut(&K, &mut LocalBucket)) {
        if part == 0 {
            self.for_each_bucket(f);
        }
    }

    /// The buckets evicted since the last call.
    fn take_evicted(&self) -> Vec<(K, LocalBucket)>;

    /// Number of buckets held.
    fn len(&self) -> usize;

    /// Whether no bucket is held.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

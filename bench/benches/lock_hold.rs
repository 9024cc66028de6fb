//! How long a local-store shard lock is held while a spray of distinct keys fills the store and
//! forces evictions: each `with_bucket` call on a new key takes the shard's lock, inserts, and
//! (when the shard is full) runs an eviction pass, all under the lock. The time of the whole
//! call bounds the time the lock is held.
//!
//! Then what a sweep (the background pass over every bucket that hands back unused leases)
//! costs the requests beside it: one thread passes over the full store again and again while
//! another times `with_bucket` on keys the store holds.
//!
//! Run with: cargo bench -p hierarchical-throttle-bench --bench lock_hold
//! (Under `cargo test` it sprays 100,000 keys, only to show that it works.)

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use hierarchical_throttle::MemoryLocalStore;
use hierarchical_throttle::local::LocalStore;
use hierarchical_throttle::quota::LeaseKey;

fn main() {
    let keys: u64 = if std::env::args().any(|a| a == "--bench") {
        1_000_000
    } else {
        100_000
    };
    let store = MemoryLocalStore::<u64>::new();
    let key_of = |n: u64| n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut nanos: Vec<u64> = Vec::with_capacity(keys as usize);
    for key in 0..keys {
        let started = Instant::now();
        store.with_bucket(&LeaseKey::new(key_of(key), 0, 0), |b| {
            std::hint::black_box(b.leased_tokens())
        });
        nanos.push(started.elapsed().as_nanos() as u64);
    }
    let (p50, p99, p999, max) = quantiles(nanos);
    println!(
        "lock hold under a spray of {keys} distinct keys into a store of {} keys: \
         p50 {p50:.2} us, p99 {p99:.2} us, p99.9 {p999:.2} us, max {max:.1} us",
        store.max_keys(),
    );
    // The last keys sprayed are still held: requests for them find their buckets.
    let held: Vec<u64> = (keys - 10_000..keys).map(key_of).collect();
    requests_beside_sweeps(&store, &held);
}

/// Times `with_bucket` on `held` keys while another thread sweeps the store.
fn requests_beside_sweeps(store: &MemoryLocalStore<u64>, held: &[u64]) {
    const PASSES: u32 = 20;
    let swept = AtomicBool::new(false);
    let (pass, nanos) = std::thread::scope(|scope| {
        let sweeper = scope.spawn(|| {
            let started = Instant::now();
            for _ in 0..PASSES {
                store.for_each_bucket(|_, b| {
                    std::hint::black_box(b.leased_tokens());
                });
            }
            swept.store(true, Ordering::Release);
            started.elapsed() / PASSES
        });
        let mut nanos = Vec::new();
        for key in held.iter().cycle() {
            if swept.load(Ordering::Acquire) {
                break;
            }
            let started = Instant::now();
            store.with_bucket(&LeaseKey::new(*key, 0, 0), |b| {
                std::hint::black_box(b.leased_tokens())
            });
            nanos.push(started.elapsed().as_nanos() as u64);
        }
        (sweeper.join().unwrap_or(Duration::ZERO), nanos)
    });
    let calls = nanos.len();
    let (p50, p99, p999, max) = quantiles(nanos);
    println!(
        "requests beside sweeps of {} keys ({pass:?} a pass, {calls} calls): \
         p50 {p50:.2} us, p99 {p99:.2} us, p99.9 {p999:.2} us, max {max:.1} us",
        store.len(),
    );
}

/// p50, p99, p99.9 and the maximum of `nanos`, in microseconds.
fn quantiles(mut nanos: Vec<u64>) -> (f64, f64, f64, f64) {
    nanos.sort_unstable();
    let at = |q: f64| {
        let i = ((nanos.len().saturating_sub(1)) as f64 * q) as usize;
        nanos.get(i).map_or(0.0, |n| *n as f64 / 1000.0)
    };
    (at(0.5), at(0.99), at(0.999), at(1.0))
}

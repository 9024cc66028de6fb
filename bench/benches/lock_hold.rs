//! How long a local-store shard lock is held while a spray of distinct keys fills the store and
//! forces evictions: each `with_bucket` call on a new key takes the shard's lock, inserts, and
//! (when the shard is full) runs an eviction pass, all under the lock. The time of the whole
//! call bounds the time the lock is held.
//!
//! Run with: cargo bench -p hierarchical-throttle-bench --bench lock_hold
//! (Under `cargo test` it sprays 100,000 keys, only to show that it works.)

use std::time::Instant;

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
    let mut nanos: Vec<u64> = Vec::with_capacity(keys as usize);
    for key in 0..keys {
        let started = Instant::now();
        store.with_bucket(
            &LeaseKey::new(key.wrapping_mul(0x9E37_79B9_7F4A_7C15), 0, 0),
            |b| std::hint::black_box(b.leased_tokens()),
        );
        nanos.push(started.elapsed().as_nanos() as u64);
    }
    nanos.sort_unstable();
    let at = |q: f64| nanos[((nanos.len() - 1) as f64 * q) as usize] as f64 / 1000.0;
    println!(
        "lock hold under a spray of {keys} distinct keys into a store of {} keys: \
         p50 {:.2} us, p99 {:.2} us, p99.9 {:.2} us, max {:.1} us",
        store.max_keys(),
        at(0.5),
        at(0.99),
        at(0.999),
        at(1.0)
    );
}

//! Memory per tracked key, measured as the growth of the process's resident set while a store
//! fills with distinct `u64` keys: this crate's local store (what each host keeps per key), its
//! in-memory global store, a whole layer after one request per key (local and global state of
//! keys that have fetched a batch), and governor's keyed limiter (what tower_governor keeps per
//! key); then the local store with 15-byte text keys (`customer-000042`) kept as `String`s and
//! as `CompactKey`s (what `key::header_str` and `key::header_bytes` keep).
//!
//! Run with: cargo bench -p hierarchical-throttle-bench --bench memory
//! (Under `cargo test` it runs on 10,000 keys, only to show that it works.)

use std::hint::black_box;
use std::num::NonZeroU32;
use std::time::Duration;

use governor::{Quota, RateLimiter};
use hierarchical_throttle::global::{GlobalStore, TokenRequest};
use hierarchical_throttle::key::CompactKey;
use hierarchical_throttle::local::LocalStore;
use hierarchical_throttle::quota::{BucketKey, LeaseKey};
use hierarchical_throttle::{
    HierarchicalThrottleLayer, Limit, MemoryGlobalStore, MemoryLocalStore,
};

/// Resident memory of this process, in bytes (Linux).
fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

/// Bytes of resident memory per key that `fill` adds.
fn per_key(keys: u64, fill: impl FnOnce() -> Box<dyn std::any::Any>) -> f64 {
    let before = resident_bytes();
    let store = fill();
    let after = resident_bytes();
    black_box(&store);
    (after.saturating_sub(before)) as f64 / keys as f64
}

/// A local store holding `keys` keys made by `key`.
fn local_store<K>(keys: u64, key: impl Fn(u64) -> K) -> Box<dyn std::any::Any>
where
    K: std::hash::Hash + Eq + Clone + Send + Sync + 'static,
{
    let store = MemoryLocalStore::<K>::with_max_keys(keys as usize * 2).expect("a bound");
    for k in 0..keys {
        store.with_bucket(&LeaseKey::new(key(k), 0, 0), |b| b.mark_used());
    }
    assert_eq!(store.len() as u64, keys);
    Box::new(store)
}

/// A 15-byte text key.
fn text_key(k: u64) -> String {
    format!("customer-{k:06}")
}

/// A global store in which each of `keys` buckets of `limit` was taken from once.
fn global_store(keys: u64, limit: &Limit) -> Box<dyn std::any::Any> {
    let store = MemoryGlobalStore::<u64>::new()
        .with_max_buckets(keys as usize * 2)
        .expect("a bound");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        for k in 0..keys {
            let key = BucketKey::new(k, "default").expect("a valid name");
            let _ = store.acquire(&key, limit, TokenRequest::now(1, 1)).await;
        }
    });
    assert_eq!(store.len() as u64, keys);
    Box::new(store)
}

/// Fills one store in this process and prints its bytes per key.
fn measure(store: &str, keys: u64) {
    let limit = Limit::per_second(100).burst(100).expect("a valid limit");
    let bytes = match store {
        "local" => per_key(keys, || local_store(keys, |k| k)),
        "local_string" => per_key(keys, || local_store(keys, text_key)),
        "local_compact" => per_key(keys, || {
            local_store(keys, |k| CompactKey::from(text_key(k)))
        }),
        "global" => per_key(keys, || global_store(keys, &limit)),
        "global_warm" => per_key(keys, || {
            let warm = limit
                .warm_up(Duration::from_secs(60))
                .expect("a valid warm-up");
            global_store(keys, &warm)
        }),
        "layer" => per_key(keys, || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
                .expect("a runtime");
            let global = MemoryGlobalStore::<u64>::new()
                .with_max_buckets(keys as usize * 2)
                .expect("a bound");
            // Slow enough that no global bucket is full again (and forgotten) during the run.
            let daily = Limit::per_day(100).burst(100).expect("a valid limit");
            // Each request waits for its key's batch (no credit), so that every key's state is
            // complete, here and in the global store, when it is measured.
            let layer = HierarchicalThrottleLayer::builder()
                .key(|k: &u64| Some(*k))
                .limit(daily)
                .cold_start(hierarchical_throttle::ColdStart::Exact)
                .local_store(MemoryLocalStore::with_max_keys(keys as usize * 2).expect("a bound"))
                .global_store(global.clone())
                .build()
                .expect("a valid layer");
            runtime.block_on(async {
                for k in 0..keys {
                    assert!(layer.acquire(k, 1).await.is_ok(), "a fresh key is admitted");
                }
            });
            assert_eq!(layer.local_store().len() as u64, keys);
            assert_eq!(global.len() as u64, keys);
            Box::new((layer, global, runtime))
        }),
        _ => per_key(keys, || {
            let limiter =
                RateLimiter::keyed(Quota::per_second(NonZeroU32::new(100).expect("non-zero")));
            for k in 0..keys {
                let _ = limiter.check_key(&k);
            }
            assert_eq!(limiter.len() as u64, keys);
            Box::new(limiter)
        }),
    };
    println!("{bytes:.0}");
}

fn main() {
    let bench = std::env::args().any(|a| a == "--bench");
    let keys: u64 = if bench { 1_000_000 } else { 10_000 };
    // Each store in a fresh process: freed memory would otherwise be reused by the next.
    if let Ok(store) = std::env::var("MEMORY_BENCH_STORE") {
        return measure(&store, keys);
    }
    let exe = std::env::current_exe().expect("this benchmark's path");
    let run = |store: &str| -> String {
        let out = std::process::Command::new(&exe)
            .args(std::env::args().skip(1))
            .env("MEMORY_BENCH_STORE", store)
            .output()
            .expect("run a measurement");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    println!(
        "memory per tracked key, {keys} distinct keys, u64 unless a row says (resident set growth, one process each):"
    );
    println!("| store | bytes per key |");
    println!("|---|---:|");
    println!(
        "| hierarchical-throttle `MemoryLocalStore` (per host) | {} |",
        run("local")
    );
    println!(
        "| hierarchical-throttle `MemoryGlobalStore` (one process's global level) | {} |",
        run("global")
    );
    println!(
        "| hierarchical-throttle `MemoryGlobalStore`, a limit that warms up (buckets kept whole) | {} |",
        run("global_warm")
    );
    println!(
        "| hierarchical-throttle whole layer, after one request per key (local and global) | {} |",
        run("layer")
    );
    println!(
        "| governor keyed (dashmap), as tower_governor keeps | {} |",
        run("governor")
    );
    println!(
        "| hierarchical-throttle `MemoryLocalStore`, 15-byte text keys as `String` | {} |",
        run("local_string")
    );
    println!(
        "| hierarchical-throttle `MemoryLocalStore`, 15-byte text keys as `CompactKey` | {} |",
        run("local_compact")
    );
}

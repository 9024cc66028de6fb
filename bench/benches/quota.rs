//! The hit path with 1, 2 and 3 limits per request, against governor's keyed `check_key` (one
//! limit) in the same run, over 1,000 keys that all hold tokens.
//!
//! Run with: cargo bench -p hierarchical-throttle-bench --bench quota

use std::hint::black_box;
use std::num::NonZeroU32;
use std::time::Duration;

mod support;

use criterion::{Criterion, criterion_group, criterion_main};
use governor::{Quota as GovernorQuota, RateLimiter};
use hierarchical_throttle::batch::FractionOfCapacity;
use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore, Quota};
use support::{keys, poll_once};

const KEYS: u64 = 1_000;

/// A quota of `n` limits the benchmark never reaches.
fn quota(n: usize) -> Quota {
    let limit = Limit::per_second(1_000_000)
        .burst(Limit::MAX_CAPACITY)
        .unwrap();
    let mut quota = Quota::new("l0", limit).unwrap();
    for i in 1..n {
        quota = quota.and(&format!("l{i}"), limit).unwrap();
    }
    quota
}

fn bench(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let _guard = runtime.enter();
    let keys = keys(KEYS);
    let mut group = c.benchmark_group("hit path by number of limits (1,000 keys)");
    let governor = RateLimiter::keyed(GovernorQuota::per_second(NonZeroU32::MAX));
    for k in &keys {
        assert!(governor.check_key(k).is_ok());
    }
    let mut i = 0;
    group.bench_function("governor check_key, 1 limit", |b| {
        b.iter(|| {
            i = (i + 1) % keys.len();
            black_box(governor.check_key(black_box(&keys[i])).is_ok())
        })
    });
    for limits in 1..=3 {
        let layer = HierarchicalThrottleLayer::builder()
            .key(|k: &u64| Some(*k))
            .quota(quota(limits))
            .batch_policy(FractionOfCapacity::new(1.0).unwrap())
            .lease_ttl(Duration::from_secs(3600))
            .global_store(MemoryGlobalStore::new())
            .build()
            .unwrap();
        for &k in &keys {
            let warm = runtime.block_on(layer.acquire(k, 1));
            assert!(warm.is_ok(), "every key is admitted");
        }
        // A cold key passes on credit; its lease comes with the batch the warm-up started: let
        // those land.
        runtime.block_on(async { tokio::time::sleep(support::BATCHES_LAND).await });
        group.bench_function(format!("acquire, {limits} limit(s)"), |b| {
            b.iter(|| {
                i = (i + 1) % keys.len();
                black_box(poll_once(layer.acquire(black_box(keys[i]), 1)))
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

//! Many requests for one key on one host share one global call.

mod common;

use common::*;
use futures_util::future::join_all;
use hierarchical_throttle::clock::ManualClock;
use hierarchical_throttle::{Limit, MemoryGlobalStore};
use tower::Layer;

#[tokio::test(flavor = "current_thread")]
async fn a_hundred_concurrent_requests_on_an_empty_bucket_make_one_global_call() {
    let clock = ManualClock::new();
    let global = FaultyStore::new(MemoryGlobalStore::with_clock(clock.clone()));
    let layer = host_builder(&clock, Limit::per_second(1000).burst(1000).unwrap())
        .global_store(global.clone())
        .build()
        .unwrap();
    let host = layer.layer(backend());
    // A task per request, as a server runs them.
    let calls = (0..100).map(|_| {
        let mut host = host.clone();
        tokio::spawn(async move { send(&mut host, "hot", 1).await })
    });
    let outcomes = join_all(calls).await;
    assert!(outcomes.iter().all(|o| matches!(o, Ok(Outcome::Served))));
    assert_eq!(global.acquire_count(), 1);
    assert_eq!(layer.stats().global_calls, 1);
    assert_eq!(layer.stats().admitted_after_fetch, 100);
    // The one batch covered all hundred waiters.
    assert_eq!(global.acquires.lock().unwrap()[0].want, 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_on_two_threads_never_exceed_the_limit() {
    let clock = ManualClock::new();
    let global = MemoryGlobalStore::with_clock(clock.clone());
    let layer = host_builder(&clock, Limit::per_hour(500).burst(500).unwrap())
        .global_store(global)
        .build()
        .unwrap();
    let host = layer.layer(backend());
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let mut host = host.clone();
            tokio::spawn(async move {
                let mut served = 0;
                for _ in 0..200 {
                    if send(&mut host, "shared", 1).await == Outcome::Served {
                        served += 1;
                    }
                }
                served
            })
        })
        .collect();
    let mut served = 0;
    for task in tasks {
        served += task.await.unwrap();
    }
    assert_eq!(
        served, 500,
        "exactly the capacity is admitted, no more, no less"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_with_tokens_to_spare_refuses_nothing_under_heavy_concurrency() {
    let clock = ManualClock::new();
    let global = MemoryGlobalStore::with_clock(clock.clone());
    let layer = host_builder(&clock, Limit::per_hour(1_000_000).burst(1_000_000).unwrap())
        .global_store(global)
        .build()
        .unwrap();
    let host = layer.layer(backend());
    let tasks: Vec<_> = (0..200)
        .map(|_| {
            let mut host = host.clone();
            tokio::spawn(async move {
                let mut refused = 0;
                for _ in 0..50 {
                    if send(&mut host, "busy", 1).await != Outcome::Served {
                        refused += 1;
                    }
                }
                refused
            })
        })
        .collect();
    let mut refused = 0;
    for task in tasks {
        refused += task.await.unwrap();
    }
    let stats = layer.stats();
    assert_eq!(refused, 0, "stats: {stats:?}");
    assert_eq!(
        stats.fallback_decisions, 0,
        "every decision was the store's: {stats:?}"
    );
    assert_eq!(stats.admitted_local + stats.admitted_after_fetch, 10_000);
}

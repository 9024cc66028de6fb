//! `HierarchicalThrottleLayer::acquire`: the layer's decision outside a tower service, on the
//! same buckets, counters and failure policy as its services.

mod common;

use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use common::*;
use hierarchical_throttle::batch::FractionOfCapacity;
use hierarchical_throttle::clock::ManualClock;
use hierarchical_throttle::{
    FailurePolicy, HierarchicalThrottleLayer, Limit, MemoryGlobalStore, RejectionReason,
};
use tower::Layer;

fn key(name: &str) -> String {
    name.to_owned()
}

#[tokio::test(flavor = "current_thread")]
async fn acquire_and_requests_draw_on_the_same_buckets() {
    let clock = ManualClock::new();
    // 3 tokens, one more every 2 s; the first batch takes all of them.
    let limit = Limit::per_minute(30).burst(3).unwrap();
    let layer = host_builder(&clock, limit)
        .batch_policy(FractionOfCapacity::new(1.0).unwrap())
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    let mut host = layer.layer(backend());

    assert_eq!(send(&mut host, "a", 2).await, Outcome::Served);
    assert_eq!(
        layer.acquire(key("a"), 1).await.map(|a| a.from_leases()),
        Ok(true)
    );
    let refused = layer
        .acquire(key("a"), 1)
        .await
        .expect_err("the bucket is empty");
    assert_eq!(refused.reason, RejectionReason::Throttled);
    assert_eq!(refused.key.as_deref(), Some("a"));
    // The next token is due in 2 s, exactly.
    assert_eq!(refused.retry_after, Some(Duration::from_secs(2)));
    // The request path now finds the key throttled, without asking the store again.
    assert!(matches!(
        send(&mut host, "a", 1).await,
        Outcome::Refused(RejectionReason::Throttled, _)
    ));

    let stats = layer.stats();
    // The batch's answer said the global bucket was empty: both refusals came from the cache.
    assert_eq!(stats.global_calls, 1, "one batch");
    assert_eq!(stats.admitted_after_fetch, 1);
    assert_eq!(stats.admitted_local, 1);
    assert_eq!((stats.rejected_global, stats.rejected_cached), (0, 2));

    // Another key is limited on its own.
    assert_eq!(
        layer.acquire(key("b"), 3).await.map(|a| a.from_leases()),
        Ok(true)
    );
}

#[tokio::test(flavor = "current_thread")]
async fn acquire_waits_for_a_batch_when_the_host_holds_no_tokens() {
    let clock = ManualClock::new();
    let layer = host_builder(&clock, Limit::per_second(10).burst(10).unwrap())
        .batch_policy(FractionOfCapacity::new(0.5).unwrap())
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();

    let mut first = layer.acquire(key("a"), 1);
    let polled = poll_fn(|cx| Poll::Ready(Pin::new(&mut first).poll(cx))).await;
    assert!(polled.is_pending(), "the batch comes from the global store");
    assert_eq!(first.await.map(|a| a.from_leases()), Ok(true));

    let mut second = layer.acquire(key("a"), 1);
    let polled = poll_fn(|cx| Poll::Ready(Pin::new(&mut second).poll(cx))).await;
    assert!(
        matches!(polled, Poll::Ready(Ok(a)) if a.from_leases()),
        "served from the batch at once"
    );
    assert_eq!(layer.stats().global_calls, 1);
}

#[tokio::test(flavor = "current_thread")]
async fn a_cost_above_capacity_is_refused_at_once_without_a_global_call() {
    let clock = ManualClock::new();
    let store = FaultyStore::new(MemoryGlobalStore::with_clock(clock.clone()));
    let layer = host_builder(&clock, Limit::per_second(1).burst(5).unwrap())
        .global_store(store.clone())
        .build()
        .unwrap();

    let refused = layer
        .acquire(key("a"), 6)
        .await
        .expect_err("never servable");
    assert_eq!(
        refused.reason,
        RejectionReason::CostExceedsCapacity {
            cost: 6,
            capacity: 5
        }
    );
    assert_eq!(refused.retry_after, None);
    assert_eq!(store.acquire_count(), 0);
    assert_eq!(layer.stats().refused_cost, 1);
}

#[tokio::test(flavor = "current_thread")]
async fn acquire_follows_the_failure_policy() {
    let clock = ManualClock::new();
    let store = FaultyStore::new(MemoryGlobalStore::with_clock(clock.clone()));
    store.set(Fault::Error);
    let layer = host_builder(&clock, Limit::per_second(1).burst(5).unwrap())
        .failure_policy(FailurePolicy::Reject)
        .global_store(store)
        .build()
        .unwrap();

    let refused = layer.acquire(key("a"), 1).await.expect_err("fail closed");
    assert_eq!(refused.reason, RejectionReason::StoreUnavailable);
    assert_eq!(layer.stats().global_errors, 1);
}

#[tokio::test]
async fn views_take_a_borrowed_key_as_maps_do() {
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key(|k: &String| Some(k.clone()))
        .limit(Limit::per_second(10).burst(10).unwrap())
        .global_store(MemoryGlobalStore::new())
        .build()
        .unwrap();
    assert!(layer.acquire("k".to_owned(), 3).await.is_ok());
    assert_eq!(layer.remaining("k")[0].tokens, 7);
    assert_eq!(layer.remaining(&"k".to_owned())[0].tokens, 7);
    assert!(layer.remaining_global("k").await.unwrap()[0].tokens <= 7);
}

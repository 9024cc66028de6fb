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

/// A host of 3 tokens, one more every 2 s, whose first batch takes all of them.
fn three_tokens(clock: &ManualClock) -> HostLayer {
    host_builder(clock, Limit::per_minute(30).burst(3).unwrap())
        .batch_policy(FractionOfCapacity::new(1.0).unwrap())
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap()
}

#[tokio::test(flavor = "current_thread")]
async fn acquire_and_requests_draw_on_the_same_buckets() {
    let clock = ManualClock::new();
    let layer = three_tokens(&clock);
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

/// A layer of 10 a second per user and a tenant level of 15 a second, on a manual clock,
/// for uses outside a service.
type JobLayer = HierarchicalThrottleLayer<
    (String, String),
    String,
    MemoryGlobalStore<String, ManualClock>,
    hierarchical_throttle::MemoryLocalStore<String>,
    ManualClock,
>;

fn user_and_tenant(clock: &ManualClock) -> JobLayer {
    HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key(|job: &(String, String)| Some(job.0.clone()))
        .clock(clock.clone())
        .limit(Limit::per_second(10).build().unwrap())
        .level(
            "tenant",
            |job: &(String, String)| Some(job.1.clone()),
            Limit::per_second(15).build().unwrap(),
        )
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap()
}

#[tokio::test(flavor = "current_thread")]
async fn acquire_keys_draws_on_every_level() {
    let clock = ManualClock::new();
    let layer = user_and_tenant(&clock);
    let job = |user: &str| layer.keys(key(user), [("tenant", "acme")]).unwrap();
    for _ in 0..10 {
        assert!(layer.acquire_keys(job("alice"), 1).await.is_ok());
    }
    for _ in 0..5 {
        assert!(layer.acquire_keys(job("bob"), 1).await.is_ok());
    }
    let refused = layer.acquire_keys(job("bob"), 1).await.unwrap_err();
    assert_eq!(refused.level, Some("tenant"), "the tenant's 15 are used up");
    assert_eq!(refused.key.as_deref(), Some("acme"));
    // Read without a use: every level's limits of bob's keys, as his requests are told them.
    let left = layer.remaining_keys(&job("bob"));
    let levels: Vec<_> = left.iter().map(|r| (r.level, r.tokens)).collect();
    assert_eq!(levels, [(None, 5), (Some("tenant"), 0)]);
    assert_eq!(layer.handle().remaining_keys(&job("bob")), left);
    // Without the tenant's key, bob is limited as a user only: 5 of his own are left.
    assert!(layer.acquire(key("bob"), 5).await.is_ok());
    assert!(layer.acquire(key("bob"), 1).await.is_err());
    // The refused use took nothing: a second later the tenant has its 15 again.
    clock.advance(Duration::from_secs(1));
    assert!(layer.acquire_keys(job("carol"), 10).await.is_ok());
    assert!(layer.acquire_keys(job("dave"), 5).await.is_ok());
    assert!(layer.acquire_keys(job("dave"), 1).await.is_err());
}

#[tokio::test(flavor = "current_thread")]
async fn keys_name_the_layers_levels_each_once() {
    let clock = ManualClock::new();
    let layer = user_and_tenant(&clock);
    let error = layer.keys(key("a"), [("team", "x")]).unwrap_err();
    assert!(error.to_string().contains("levels"), "{error}");
    assert!(
        layer
            .keys(key("a"), [("tenant", "x"), ("tenant", "y")])
            .is_err()
    );
    let keys = layer
        .keys(key("a"), std::iter::empty::<(&str, String)>())
        .unwrap();
    assert_eq!(keys.first(), "a");
}

#[tokio::test(flavor = "current_thread")]
async fn reservations_and_settlements_cover_every_level() {
    let clock = ManualClock::new();
    let layer = user_and_tenant(&clock);
    let job = |user: &str| layer.keys(key(user), [("tenant", "acme")]).unwrap();
    // A reservation admitted at once and dropped unused gives its tokens back at both levels.
    let dropped = layer
        .reserve_keys(job("alice"), 10, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(dropped.delay(), Duration::ZERO);
    drop(dropped);
    assert_eq!(layer.remaining("alice")[0].tokens, 10);
    // The tenant's tokens came back too: 15 can be taken at once.
    assert!(layer.acquire_keys(job("bob"), 10).await.is_ok());
    assert!(layer.acquire_keys(job("carol"), 5).await.is_ok());
    // The tenant is empty: a reservation for it waits for its next token (1/15 s).
    let later = layer
        .reserve_keys(job("dave"), 1, Duration::from_secs(1))
        .await
        .unwrap();
    assert_eq!(later.delay(), Duration::from_micros(66_667));
    drop(later);
    // A use charged 10 that cost 2 is refunded at both levels: the tenant has 13 left.
    clock.advance(Duration::from_secs(1));
    let admitted = layer.acquire_keys(job("erin"), 10).await.unwrap();
    layer.settle_keys(job("erin"), admitted, 10, 2).await;
    assert_eq!(layer.stats().tokens_refunded, 2 * 8);
    assert_eq!(layer.remaining("erin")[0].tokens, 8);
    assert!(layer.acquire_keys(job("frank"), 8).await.is_ok());
    assert!(layer.acquire_keys(job("gina"), 5).await.is_ok());
    assert!(layer.acquire_keys(job("gina"), 1).await.is_err());
}

/// `acquire_ref` decides exactly as `acquire` on the same buckets, for a key given in a
/// borrowed form, with one limit or several, on the lease and after a batch.
#[tokio::test(flavor = "current_thread")]
async fn acquire_ref_takes_a_borrowed_key_and_decides_as_acquire() {
    let clock = ManualClock::new();
    let quota: hierarchical_throttle::Quota = "per-second: 3/s; per-minute: 5/min".parse().unwrap();
    let build = || {
        HierarchicalThrottleLayer::builder()
            .cold_start(hierarchical_throttle::ColdStart::Exact)
            .key(|k: &String| Some(k.clone()))
            .clock(clock.clone())
            .quota(quota.clone())
            .global_store(MemoryGlobalStore::with_clock(clock.clone()))
            .build()
            .unwrap()
    };
    let (owned, borrowed) = (build(), build());
    let mut decisions = (Vec::new(), Vec::new());
    for step in 0..8 {
        decisions
            .0
            .push(owned.acquire(key("k"), 1).await.map_err(|r| r.limit_name));
        decisions
            .1
            .push(borrowed.acquire_ref("k", 1).await.map_err(|r| r.limit_name));
        if step == 3 {
            clock.advance(Duration::from_secs(1));
        }
    }
    assert_eq!(decisions.0, decisions.1);
    let admitted = decisions.1.iter().filter(|d| d.is_ok()).count();
    assert_eq!(admitted, 5, "per-minute's 5, whatever per-second allows");
    assert_eq!(borrowed.stats().requests_admitted, 5);
    assert_eq!(borrowed.remaining("k")[1].tokens, 0);

    // A `CompactKey` by its bytes.
    let bytes = HierarchicalThrottleLayer::builder()
        .key(|k: &hierarchical_throttle::key::CompactKey| Some(k.clone()))
        .limit(Limit::per_minute(1).build().unwrap())
        .global_store(MemoryGlobalStore::new())
        .build()
        .unwrap();
    assert!(bytes.acquire_ref(&b"k1"[..], 1).await.is_ok());
    assert!(bytes.acquire("k1".into(), 1).await.is_err());
}

/// A cost of zero is a request that takes no token: admitted while its key is throttled and
/// on a key never seen, without a store call, and it leaves the bucket as it was.
#[tokio::test(flavor = "current_thread")]
async fn a_request_costing_nothing_is_admitted_and_takes_nothing() {
    let clock = ManualClock::new();
    let layer = three_tokens(&clock);
    let mut host = layer.layer(backend());
    assert_eq!(send(&mut host, "a", 3).await, Outcome::Served);
    assert!(matches!(
        send(&mut host, "a", 1).await,
        Outcome::Refused(RejectionReason::Throttled, _)
    ));
    assert_eq!(send(&mut host, "a", 0).await, Outcome::Served);
    assert!(layer.acquire(key("a"), 0).await.is_ok());
    assert_eq!(send(&mut host, "never-seen", 0).await, Outcome::Served);
    assert_eq!(layer.stats().global_calls, 1, "only the first batch");
    // The next token still comes 2 s after the batch, and serves a request of one.
    clock.advance(Duration::from_secs(2));
    assert_eq!(send(&mut host, "a", 1).await, Outcome::Served);
    assert!(matches!(
        send(&mut host, "a", 1).await,
        Outcome::Refused(RejectionReason::Throttled, _)
    ));
}

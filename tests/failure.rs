//! The failure policy: what a request gets when the global store errs or hangs, that no request
//! waits past the time-out, and that a failing store is left alone for a back-off.

mod common;

use std::time::Duration;

use common::*;
use hierarchical_throttle::clock::ManualClock;
use hierarchical_throttle::{FailurePolicy, Limit, MemoryGlobalStore, RejectionReason};
use tower::Layer;

fn limit() -> Limit {
    Limit::per_minute(10).burst(10).unwrap()
}

fn faulty(clock: &ManualClock, fault: Fault) -> FaultyStore<Store> {
    let store = FaultyStore::new(MemoryGlobalStore::with_clock(clock.clone()));
    store.set(fault);
    store
}

#[tokio::test(flavor = "current_thread")]
async fn fail_open_admits_while_the_store_errs() {
    let clock = ManualClock::new();
    let layer = host_builder(&clock, limit())
        .failure_policy(FailurePolicy::Admit)
        .global_store(faulty(&clock, Fault::Error))
        .build()
        .unwrap();
    let mut host = layer.layer(backend());
    for _ in 0..50 {
        assert_eq!(send(&mut host, "a", 1).await, Outcome::Served);
    }
    let stats = layer.stats();
    assert_eq!((stats.global_errors, stats.fallback_decisions), (1, 50));
}

#[tokio::test(flavor = "current_thread")]
async fn fail_closed_rejects_with_its_own_reason_and_a_retry_time() {
    let clock = ManualClock::new();
    let layer = host_builder(&clock, limit())
        .failure_policy(FailurePolicy::Reject)
        .global_store(faulty(&clock, Fault::Error))
        .build()
        .unwrap();
    let mut host = layer.layer(backend());
    // The first failure backs off for 50 ms.
    assert_eq!(
        send(&mut host, "a", 1).await,
        Outcome::Refused(
            RejectionReason::StoreUnavailable,
            Some(Duration::from_millis(50))
        )
    );
}

#[tokio::test(flavor = "current_thread")]
async fn local_fallback_enforces_the_hosts_share_of_the_limit() {
    let clock = ManualClock::new();
    let layer = host_builder(&clock, limit())
        .failure_policy(FailurePolicy::local_fallback(2).unwrap())
        .global_store(faulty(&clock, Fault::Error))
        .build()
        .unwrap();
    let mut host = layer.layer(backend());
    for _ in 0..5 {
        assert_eq!(send(&mut host, "a", 1).await, Outcome::Served);
    }
    // Half of 10 per minute: the next token in 12 s.
    assert_eq!(
        send(&mut host, "a", 1).await,
        Outcome::Refused(RejectionReason::Throttled, Some(Duration::from_secs(12)))
    );
}

#[tokio::test(flavor = "current_thread")]
async fn a_cost_above_the_hosts_fallback_share_waits_for_the_store() {
    let clock = ManualClock::new();
    let layer = host_builder(&clock, limit())
        .failure_policy(FailurePolicy::local_fallback(4).unwrap())
        .global_store(faulty(&clock, Fault::Error))
        .build()
        .unwrap();
    let mut host = layer.layer(backend());
    // A quarter of 10 holds at most 3 tokens: a request of 4 is told to come back when the
    // store is probed again (50 ms), not after a refill that can never make room for it.
    assert_eq!(
        send(&mut host, "a", 4).await,
        Outcome::Refused(RejectionReason::Throttled, Some(Duration::from_millis(50)))
    );
    assert_eq!(send(&mut host, "a", 3).await, Outcome::Served);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_hanging_store_costs_a_request_no_more_than_the_time_out() {
    let clock = ManualClock::new();
    let timeout = Duration::from_millis(30);
    let layer = host_builder(&clock, limit())
        .store_timeout(timeout)
        .failure_policy(FailurePolicy::Admit)
        .global_store(faulty(&clock, Fault::Hang))
        .build()
        .unwrap();
    let mut host = layer.layer(backend());
    let start = tokio::time::Instant::now();
    assert_eq!(send(&mut host, "a", 1).await, Outcome::Served);
    assert_eq!(start.elapsed(), timeout);
    settle_background().await;
    assert_eq!(layer.stats().global_timeouts, 1);
}

#[tokio::test(flavor = "current_thread")]
async fn a_failing_store_is_left_alone_during_back_off_then_probed() {
    let clock = ManualClock::new();
    let store = faulty(&clock, Fault::Error);
    let layer = host_builder(&clock, limit())
        .failure_policy(FailurePolicy::Admit)
        .max_store_backoff(Duration::from_millis(400))
        .global_store(store.clone())
        .build()
        .unwrap();
    let mut host = layer.layer(backend());
    let calls_after = |host| {
        let store = store.clone();
        async move {
            let mut host = host;
            let _ = send(&mut host, "a", 1).await;
            store.acquire_count()
        }
    };
    assert_eq!(calls_after(host.clone()).await, 1);
    // Back-off 50 ms, then 100, 200, 400, 400: no call inside, one probe after each.
    for (backoff, expected_calls) in [(50, 2), (100, 3), (200, 4), (400, 5), (400, 6)] {
        clock.advance(Duration::from_millis(backoff - 1));
        assert_eq!(
            calls_after(host.clone()).await,
            expected_calls - 1,
            "inside back-off"
        );
        clock.advance(Duration::from_millis(1));
        assert_eq!(
            calls_after(host.clone()).await,
            expected_calls,
            "probe after back-off"
        );
    }
    // The store recovers: the next probe succeeds and the limit holds again.
    store.set(Fault::None);
    clock.advance(Duration::from_millis(400));
    let mut served = 0;
    for _ in 0..20 {
        if send(&mut host, "b", 1).await == Outcome::Served {
            served += 1;
        }
    }
    assert_eq!(served, 10);
}

/// `store_up` is the store's reachability, shared by every layer on it: false until a call is
/// answered, false for all of them once one fails (even a layer that made no call and is not
/// backing off), true again at the next answer, whoever made the call.
#[tokio::test(flavor = "current_thread")]
async fn every_layer_on_a_store_reports_it_down_alike() {
    let clock = ManualClock::new();
    let store = faulty(&clock, Fault::None);
    let layer = |name: &str| {
        host_builder(&clock, limit())
            .name(name)
            .failure_policy(FailurePolicy::Admit)
            .global_store(store.clone())
            .build()
            .unwrap()
    };
    let (a, b) = (layer("a"), layer("b"));
    assert!(!a.store_up() && !b.store_up(), "never answered yet");
    let (mut host_a, mut host_b) = (a.layer(backend()), b.layer(backend()));
    assert_eq!(send(&mut host_a, "k", 1).await, Outcome::Served);
    assert!(
        a.store_up() && b.store_up(),
        "b made no call, the store answered a's"
    );

    store.set(Fault::Error);
    assert_eq!(send(&mut host_a, "other", 1).await, Outcome::Served);
    assert_eq!(a.stats().global_errors, 1);
    assert!(
        !a.store_up() && !b.store_up(),
        "b is not backing off, but the store is down"
    );

    store.set(Fault::None);
    assert_eq!(send(&mut host_b, "k", 1).await, Outcome::Served);
    assert_eq!(b.stats().global_calls, 1);
    assert!(
        a.store_up() && b.store_up(),
        "a is still backing off, but the store answers"
    );
}

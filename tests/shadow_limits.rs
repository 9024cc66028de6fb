//! Limits in shadow beside enforced ones: their would-be refusals are counted under their
//! names, and requests go on to the other limits; a level in shadow alike; names that are
//! not the layer's limits are errors at build; a fleet on memory and on a real Redis.

use std::time::Duration;

mod common;

use common::levels::{call, router, tenant, user};
use common::redis_server::RedisServer;
use hierarchical_throttle::clock::ManualClock;
use hierarchical_throttle::global::GlobalStore;
use hierarchical_throttle::quota::BucketKey;
use hierarchical_throttle::{
    ColdStart, HierarchicalThrottleLayer, Limit, MemoryGlobalStore, Quota, RejectionReason,
};
use http::StatusCode;

fn quota() -> Quota {
    "per-second: 3/s; per-minute: 4/min".parse().unwrap()
}

#[tokio::test]
async fn a_limit_in_shadow_counts_its_refusals_and_refuses_nothing() {
    let clock = ManualClock::new();
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(ColdStart::Exact)
        .key(user)
        .clock(clock.clone())
        .quota(quota())
        .shadow_limit("per-minute")
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    let app = router().layer(layer.clone());
    let mut statuses = Vec::new();
    for second in 0..3 {
        for _ in 0..4 {
            statuses.push(call(&app, "/", "u1", None).await.status());
        }
        if second < 2 {
            clock.advance(Duration::from_secs(1));
        }
    }
    // Per second enforced: 3 of every 4; per minute, in shadow, would have stopped at 4.
    let served = statuses.iter().filter(|s| **s == StatusCode::OK).count();
    assert_eq!(served, 9, "{statuses:?}");
    let stats = layer.stats();
    assert_eq!(
        stats.shadow_limit_refusals, 5,
        "the 5 served past per-minute's 4"
    );
    assert_eq!(stats.requests_refused, 3, "per-second's refusals");
    assert_eq!(
        stats.shadow_admitted, 0,
        "the layer itself is not in shadow"
    );
    // The refusals name the enforced limit.
    let refused = layer.acquire("u1".to_owned(), 1).await.unwrap_err();
    assert_eq!(refused.limit_name, Some("per-second"));
}

#[tokio::test]
async fn a_request_refused_by_an_enforced_limit_takes_nothing_from_the_shadow_one() {
    let clock = ManualClock::new();
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(ColdStart::Exact)
        .key(user)
        .clock(clock.clone())
        .quota(
            "per-second: 1/s; per-minute: 5/min"
                .parse::<Quota>()
                .unwrap(),
        )
        .shadow_limit("per-minute")
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    assert!(layer.acquire("u1".to_owned(), 1).await.is_ok());
    for _ in 0..3 {
        let refused = layer.acquire("u1".to_owned(), 1).await.unwrap_err();
        assert_eq!(refused.reason, RejectionReason::Throttled);
    }
    let left = layer.remaining("u1");
    assert_eq!((left[0].tokens, left[1].tokens), (0, 4));
    assert_eq!(layer.stats().shadow_limit_refusals, 0);
}

#[tokio::test]
async fn a_level_in_shadow_lets_its_keys_through_and_counts_them() {
    let clock = ManualClock::new();
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(ColdStart::Exact)
        .key(user)
        .clock(clock.clone())
        .limit(Limit::per_second(10).build().unwrap())
        .level("tenant", tenant, Limit::per_minute(2).build().unwrap())
        .shadow_level("tenant")
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    let app = router().layer(layer.clone());
    for user in ["u1", "u2", "u3", "u4"] {
        let response = call(&app, "/", user, Some("acme")).await;
        assert_eq!(response.status(), StatusCode::OK);
    }
    assert_eq!(layer.stats().shadow_limit_refusals, 2);
    assert_eq!(layer.stats().requests_refused, 0);
    // The users' own limit is enforced still.
    for _ in 0..9 {
        assert_eq!(
            call(&app, "/", "u1", Some("acme")).await.status(),
            StatusCode::OK
        );
    }
    assert_eq!(
        call(&app, "/", "u1", Some("acme")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test]
async fn shadow_names_must_be_the_layers_limits() {
    let build = |shadow: &str, level: bool| {
        let builder = HierarchicalThrottleLayer::builder()
            .key(user)
            .quota(quota())
            .level("tenant", tenant, Limit::per_minute(2).build().unwrap());
        let builder = match level {
            true => builder.shadow_level(shadow),
            false => builder.shadow_limit(shadow),
        };
        builder
            .global_store(MemoryGlobalStore::new())
            .build()
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    assert_eq!(build("per-minute", false), Ok(()));
    assert_eq!(build("tenant/default", false), Ok(()));
    assert_eq!(build("tenant", true), Ok(()));
    let error = build("per-week", false).unwrap_err();
    assert!(error.contains("`per-week`"), "{error}");
    let error = build("team", true).unwrap_err();
    assert!(error.contains("`team`"), "{error}");
    let error = build("team/per-minute", false).unwrap_err();
    assert!(error.contains("`team`"), "{error}");
}

/// Two hosts on `global`: the enforced limit holds fleet-wide while the shadow one is counted
/// on both, and its global bucket takes only what it had.
async fn a_fleet_enforces_the_rest_and_counts_the_shadow_limit<G>(global: G, clock: &ManualClock)
where
    G: GlobalStore<BucketKey<String>> + Clone,
{
    let host = || {
        HierarchicalThrottleLayer::builder()
            .cold_start(ColdStart::Exact)
            .key(user)
            .clock(clock.clone())
            .quota("per-minute: 6/min; per-hour: 2/h".parse::<Quota>().unwrap())
            .shadow_limit("per-hour")
            .batch_policy(|_: &hierarchical_throttle::batch::BatchContext<'_>| 0)
            .global_store(global.clone())
            .build()
            .unwrap()
    };
    let (a, b) = (host(), host());
    let mut served = 0;
    for i in 0..10 {
        let layer = if i % 2 == 0 { &a } else { &b };
        served += usize::from(layer.acquire("u1".to_owned(), 1).await.is_ok());
    }
    assert_eq!(served, 6, "per-minute's 6, fleet-wide");
    // Counted per bucket decision: at least the 4 served past per-hour's 2, at most the 8
    // requests past them (one per-minute refused may count too, decided at the same time).
    let shadowed = a.stats().shadow_limit_refusals + b.stats().shadow_limit_refusals;
    assert!((4..=8).contains(&shadowed), "{shadowed}");
    let served_past = a.stats().requests_admitted + b.stats().requests_admitted - 2;
    assert_eq!(served_past, 4);
    let left = a.remaining_global("u1").await.unwrap();
    assert_eq!((left[0].limit_name, left[0].tokens), ("per-minute", 0));
    assert_eq!((left[1].limit_name, left[1].tokens), ("per-hour", 0));
}

#[tokio::test]
async fn a_fleet_on_memory_enforces_the_other_limits_and_counts_the_shadow_one() {
    let clock = ManualClock::new();
    let global = MemoryGlobalStore::with_clock(clock.clone());
    a_fleet_enforces_the_rest_and_counts_the_shadow_limit(global, &clock).await;
}

#[tokio::test]
async fn a_fleet_on_redis_enforces_the_other_limits_and_counts_the_shadow_one() {
    let server = RedisServer::start();
    let clock = ManualClock::new();
    let global = server.store_on(&clock).await;
    a_fleet_enforces_the_rest_and_counts_the_shadow_limit(global, &clock).await;
}

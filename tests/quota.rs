//! Quotas of several named limits and levels of keys, through an axum `Router` on a manual
//! clock, and over a fleet of layers sharing one global store.

use std::collections::HashMap;
use std::time::Duration;

mod common;

use axum::Router;
use common::levels::{self, call, route, router, tenant, user};
use hierarchical_throttle::clock::ManualClock;
use hierarchical_throttle::local::{LocalBucket, LocalStore};
use hierarchical_throttle::quota::{BucketKey, LeaseKey};
use hierarchical_throttle::{
    HierarchicalThrottleLayer, Limit, MemoryGlobalStore, Quota, RejectionReason,
};
use http::StatusCode;

fn per_second_and_minute() -> Quota {
    "per-second: 2/s; per-minute: 3/min".parse().unwrap()
}

#[tokio::test]
async fn every_limit_must_admit_and_the_refusal_names_the_limit_with_the_longest_wait() {
    let clock = ManualClock::new();
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key(user)
        .clock(clock.clone())
        .quota(per_second_and_minute())
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    let app = router().layer(layer.clone());

    for _ in 0..2 {
        assert_eq!(call(&app, "/", "u1", None).await.status(), StatusCode::OK);
    }
    // Per second is out, per minute has one left: refused by per-second, 0.5 s away.
    let refused = call(&app, "/", "u1", None).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.headers()["ratelimit"], "\"per-second\";r=0;t=1");
    assert_eq!(
        refused.headers()["ratelimit-policy"],
        "\"per-second\";q=2;qu=\"requests\";w=1"
    );

    clock.advance(Duration::from_secs(1));
    assert_eq!(call(&app, "/", "u1", None).await.status(), StatusCode::OK);
    // Both out now: per-minute's wait (its next token is due 20 s after the first take) is
    // the longer one.
    let refused = call(&app, "/", "u1", None).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.headers()["ratelimit"], "\"per-minute\";r=0;t=19");
    assert_eq!(refused.headers()["retry-after"], "19");

    // A second later per-second has tokens again, per-minute still refuses: the per-second
    // token taken for the refused request stays in its lease, it is not lost.
    clock.advance(Duration::from_secs(1));
    let refused = layer.acquire("u1".to_owned(), 1).await.unwrap_err();
    assert_eq!(refused.limit_name, Some("per-minute"));
    assert_eq!(refused.retry_after, Some(Duration::from_secs(18)));
    clock.advance(Duration::from_secs(18));
    assert_eq!(
        layer
            .acquire("u1".to_owned(), 1)
            .await
            .map(|a| a.from_leases()),
        Ok(true)
    );
    assert_eq!(
        layer
            .acquire("u1".to_owned(), 1)
            .await
            .unwrap_err()
            .limit_name,
        Some("per-minute"),
        "one per-minute token every 20 s, however many per-second ones there are"
    );
}

#[tokio::test]
async fn tokens_taken_for_a_refused_request_go_back_to_the_other_limits() {
    let clock = ManualClock::new();
    let global = MemoryGlobalStore::with_clock(clock.clone());
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key(|n: &u64| Some(*n))
        .clock(clock.clone())
        .cost(|_: &u64| 1)
        .quota(
            Quota::new("large", Limit::per_hour(100).build().unwrap())
                .unwrap()
                .and("small", Limit::per_hour(1).build().unwrap())
                .unwrap(),
        )
        .global_store(global.clone())
        .build()
        .unwrap();
    assert_eq!(layer.acquire(7, 1).await.map(|a| a.from_leases()), Ok(true));
    // Each refusal by "small" takes a "large" token and must give it back.
    for _ in 0..50 {
        let refused = layer.acquire(7, 1).await.unwrap_err();
        assert_eq!(refused.limit_name, Some("small"));
    }
    layer.return_unused_leases().await;
    clock.advance(Duration::from_secs(60));
    layer.return_unused_leases().await;
    let large = BucketKey::new(7, "large").unwrap();
    let limit = Limit::per_hour(100).build().unwrap();
    let left = global.peek(&large, &limit).tokens();
    // One token admitted in an hour's bucket of 100, refilled by a minute's 1.67 tokens.
    assert_eq!(
        left, 100,
        "every token taken for a refused request came back"
    );
    let stats = layer.stats();
    assert_eq!(stats.tokens_lost, 0);
}

#[tokio::test]
async fn a_cost_above_any_limits_capacity_is_refused_at_once_naming_it() {
    let clock = ManualClock::new();
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key(|n: &u64| Some(*n))
        .clock(clock.clone())
        .cost(|n: &u64| *n)
        .quota(
            "burst: 100/s burst 50; hourly: 10/h"
                .parse::<Quota>()
                .unwrap(),
        )
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    let refused = layer.acquire(20, 20).await.unwrap_err();
    assert_eq!(
        refused.reason,
        RejectionReason::CostExceedsCapacity {
            cost: 20,
            capacity: 10
        }
    );
    assert_eq!(refused.limit_name, Some("hourly"));
    assert_eq!(layer.stats().refused_cost, 1);
    // What the refused request took from "burst" stayed there: 50 + 10 fit.
    assert_eq!(
        layer.acquire(10, 10).await.map(|a| a.from_leases()),
        Ok(true)
    );
    assert_eq!(
        layer.acquire(40, 40).await.unwrap_err().limit_name,
        Some("hourly")
    );
}

fn levels_layer(clock: &ManualClock, global: &MemoryGlobalStore<String, ManualClock>) -> Router {
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key(user)
        .clock(clock.clone())
        .limit(Limit::per_second(2).burst(2).unwrap())
        .level("tenant", tenant, Limit::per_second(3).burst(3).unwrap())
        .level("route", route, Limit::per_second(1).burst(1).unwrap())
        .global_store(global.clone())
        .build()
        .unwrap();
    router().layer(layer)
}

#[tokio::test]
async fn a_tenants_ceiling_holds_whatever_its_users_do_and_a_users_limit_within_it() {
    let clock = ManualClock::new();
    let global = MemoryGlobalStore::with_clock(clock.clone());
    let app = levels_layer(&clock, &global);

    assert_eq!(
        call(&app, "/", "u1", Some("acme")).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        call(&app, "/", "u1", Some("acme")).await.status(),
        StatusCode::OK
    );
    let refused = call(&app, "/", "u1", Some("acme")).await;
    assert_eq!(
        refused.headers()["ratelimit-policy"],
        "\"default\";q=2;qu=\"requests\";w=1"
    );
    // u2 has its own 2, but acme has only 1 left.
    assert_eq!(
        call(&app, "/", "u2", Some("acme")).await.status(),
        StatusCode::OK
    );
    let refused = call(&app, "/", "u2", Some("acme")).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        refused.headers()["ratelimit-policy"],
        "\"tenant\";q=3;qu=\"requests\";w=1"
    );
    // Another tenant is not touched; a user without a tenant is limited as a user only.
    assert_eq!(
        call(&app, "/", "u3", Some("other")).await.status(),
        StatusCode::OK
    );
    assert_eq!(call(&app, "/", "u4", None).await.status(), StatusCode::OK);
    // The route level: one bulk call per second across all users and tenants.
    assert_eq!(
        call(&app, "/bulk", "u5", None).await.status(),
        StatusCode::OK
    );
    let refused = call(&app, "/bulk", "u6", Some("other")).await;
    assert_eq!(
        refused.headers()["ratelimit-policy"],
        "\"route\";q=1;qu=\"requests\";w=1"
    );
    // The refused u2 request took a u2 token and gave it back to u2's lease. A second later
    // u2's bucket is full again, 2, as is acme's, 3: the token the lease held meanwhile is taken
    // back out of the refill (or 3 would pass in one instant), so u2 gets its 2.
    clock.advance(Duration::from_secs(1));
    for _ in 0..2 {
        assert_eq!(
            call(&app, "/", "u2", Some("acme")).await.status(),
            StatusCode::OK
        );
    }
    let refused = call(&app, "/", "u2", Some("acme")).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        refused.headers()["ratelimit-policy"],
        "\"default\";q=2;qu=\"requests\";w=1"
    );
}

#[tokio::test]
async fn tiers_choose_a_quota_per_key_and_changes_apply_within_a_lease() {
    let clock = ManualClock::new();
    let free: Quota = "per-minute: 2/min".parse().unwrap();
    let pro: Quota = "per-second: 100/s; per-day: 4/day".parse().unwrap();
    let tiers = std::sync::Arc::new(std::sync::Mutex::new(HashMap::from([(
        "p".to_owned(),
        pro.clone(),
    )])));
    let lookup = tiers.clone();
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key(|k: &String| Some(k.clone()))
        .clock(clock.clone())
        .cost(|_: &String| 1)
        .limit_per_key(move |k: &String| {
            lookup
                .lock()
                .unwrap()
                .get(k)
                .cloned()
                .unwrap_or(free.clone())
        })
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    let take = |k: &str| layer.acquire(k.to_owned(), 1);
    assert_eq!(take("f").await.map(|a| a.from_leases()), Ok(true));
    assert_eq!(take("f").await.map(|a| a.from_leases()), Ok(true));
    assert_eq!(take("f").await.unwrap_err().limit_name, Some("per-minute"));
    for _ in 0..4 {
        assert_eq!(take("p").await.map(|a| a.from_leases()), Ok(true));
    }
    let refused = take("p").await.unwrap_err();
    assert_eq!(refused.limit_name, Some("per-day"));
    assert_eq!(refused.retry_after, Some(Duration::from_secs(6 * 3600)));

    // "f" is upgraded: its next lookup gives it the pro quota's buckets.
    tiers.lock().unwrap().insert("f".to_owned(), pro);
    for _ in 0..4 {
        assert_eq!(take("f").await.map(|a| a.from_leases()), Ok(true));
    }
    assert_eq!(take("f").await.unwrap_err().limit_name, Some("per-day"));
}

#[tokio::test]
async fn a_fleet_on_one_memory_store_never_over_admits_any_bucket() {
    let clock = ManualClock::new();
    levels::fleet_holds_every_bucket(&clock, MemoryGlobalStore::with_clock(clock.clone())).await;
}

/// A local store that can drop every bucket at once, as evictions under a key flood do.
#[derive(Default)]
struct Forgetful {
    buckets: std::sync::Mutex<HashMap<LeaseKey<u64>, LocalBucket>>,
    evicted: std::sync::Mutex<Vec<(LeaseKey<u64>, LocalBucket)>>,
}

impl Forgetful {
    fn evict_all(&self) {
        let all: Vec<_> = self.buckets.lock().unwrap().drain().collect();
        self.evicted.lock().unwrap().extend(all);
    }
}

impl LocalStore<LeaseKey<u64>> for Forgetful {
    fn with_bucket<R>(&self, key: &LeaseKey<u64>, f: impl FnOnce(&mut LocalBucket) -> R) -> R {
        f(self.buckets.lock().unwrap().entry(key.clone()).or_default())
    }

    fn for_each_bucket(&self, mut f: impl FnMut(&LeaseKey<u64>, &mut LocalBucket)) {
        for (key, bucket) in self.buckets.lock().unwrap().iter_mut() {
            f(key, bucket);
        }
    }

    fn take_evicted(&self) -> Vec<(LeaseKey<u64>, LocalBucket)> {
        std::mem::take(&mut *self.evicted.lock().unwrap())
    }

    fn len(&self) -> usize {
        self.buckets.lock().unwrap().len()
    }
}

/// A key's first bucket made again after an eviction by a refund (so holding tokens without
/// having looked up the key's quota) must not admit on its own: the key's other limits still
/// apply.
#[tokio::test]
async fn a_first_bucket_remade_with_tokens_still_draws_on_every_limit() {
    let clock = ManualClock::new();
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key(|n: &u64| Some(*n))
        .clock(clock.clone())
        .quota("fast: 1000/s; slow: 5/min".parse::<Quota>().unwrap())
        .local_store(Forgetful::default())
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();

    // The slow limit's 5 are all taken; then both buckets are evicted.
    let admitted = layer.acquire(7, 5).await.unwrap();
    assert!(admitted.from_leases());
    layer.local_store().evict_all();
    // The use cost 4: one token back into each limit's (new) bucket.
    layer.settle(7, admitted, 5, 4).await;
    assert_eq!(
        layer.acquire(7, 1).await.map(|a| a.from_leases()),
        Ok(true),
        "the slow limit's refunded token"
    );
    let refused = layer.acquire(7, 1).await.unwrap_err();
    assert_eq!(
        refused.limit_name,
        Some("slow"),
        "5 a minute, whatever the fast bucket holds"
    );
}

/// `requests_admitted` and `requests_refused` count each request once, while the per-bucket
/// counters count each limit it drew on.
#[tokio::test]
async fn requests_are_counted_once_whatever_the_buckets_they_drew_on() {
    let clock = ManualClock::new();
    let global = MemoryGlobalStore::with_clock(clock.clone());
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key(user)
        .clock(clock.clone())
        .quota(per_second_and_minute())
        .level("tenant", tenant, Limit::per_minute(100).build().unwrap())
        .global_store(global)
        .build()
        .unwrap();
    let app = router().layer(layer.clone());
    let mut statuses = Vec::new();
    for _ in 0..3 {
        statuses.push(call(&app, "/", "u1", Some("acme")).await.status());
    }
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );
    let stats = layer.stats();
    assert_eq!((stats.requests_admitted, stats.requests_refused), (2, 1));
    let per_bucket = stats.admitted_local + stats.admitted_after_fetch + stats.admitted_on_credit;
    assert!(
        per_bucket >= 6,
        "three buckets per admitted request: {stats:?}"
    );
    // `acquire` uses count alike.
    assert!(layer.acquire("u2".to_owned(), 1).await.is_ok());
    assert!(layer.acquire("u2".to_owned(), 1).await.is_ok());
    assert!(layer.acquire("u2".to_owned(), 1).await.is_err());
    let stats = layer.stats();
    assert_eq!((stats.requests_admitted, stats.requests_refused), (4, 2));
    // A reservation admitted at once counts when awaited; dropped unused, it does not.
    let dropped = layer
        .reserve("u3".to_owned(), 1, Duration::ZERO)
        .await
        .unwrap();
    drop(dropped);
    assert_eq!(layer.stats().requests_admitted, 4);
    let kept = layer
        .reserve("u3".to_owned(), 1, Duration::ZERO)
        .await
        .unwrap();
    assert!(kept.await.is_ok());
    assert_eq!(layer.stats().requests_admitted, 5);
}

//! `RateLimit-Policy` and `RateLimit` on every response, through an axum `Router` on a manual
//! clock: the values, the opt-out, shadow mode, several hosts, jitter on `Retry-After`, and a
//! Structured Fields parser reading them for ordinary and extreme limits.

use std::time::Duration;

mod common;

use axum::Router;
use common::levels::{call, router, tenant, user};
use hierarchical_throttle::clock::ManualClock;
use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore, Quota};
use http::StatusCode;

fn ten_per_second() -> Limit {
    Limit::per_second(10).burst(10).unwrap()
}

fn app(clock: &ManualClock, global: &MemoryGlobalStore<String, ManualClock>) -> Router {
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key(user)
        .clock(clock.clone())
        .limit(ten_per_second())
        .global_store(global.clone())
        .build()
        .unwrap();
    router().layer(layer)
}

fn field(response: &http::Response<axum::body::Body>, name: &str) -> Option<String> {
    let values: Vec<_> = response
        .headers()
        .get_all(name)
        .iter()
        .map(|v| v.to_str().unwrap().to_owned())
        .collect();
    (!values.is_empty()).then(|| values.join(", "))
}

#[tokio::test]
async fn admitted_responses_tell_the_tokens_left_and_when_more_come() {
    let clock = ManualClock::new();
    let app = app(&clock, &MemoryGlobalStore::with_clock(clock.clone()));

    for left in (0..10).rev() {
        let response = call(&app, "/", "u1", None).await;
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(
            field(&response, "ratelimit-policy").as_deref(),
            Some("\"default\";q=10;w=1")
        );
        // One token every 100 ms: more within the second, rounded up to 1.
        assert_eq!(
            field(&response, "ratelimit"),
            Some(format!("\"default\";r={left};t=1"))
        );
    }
    let refused = call(&app, "/", "u1", None).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        field(&refused, "ratelimit").as_deref(),
        Some("\"default\";r=0;t=1")
    );

    // Half a second later, five tokens have refilled: the next response counts them.
    clock.advance(Duration::from_millis(500));
    let response = call(&app, "/", "u1", None).await;
    assert_eq!(
        field(&response, "ratelimit").as_deref(),
        Some("\"default\";r=4;t=1")
    );
}

#[tokio::test]
async fn a_host_counts_what_other_hosts_took_from_the_global_bucket() {
    let clock = ManualClock::new();
    let global = MemoryGlobalStore::with_clock(clock.clone());
    // Batches of exactly what a request needs, so the counts below are exact.
    let host = || {
        let layer = HierarchicalThrottleLayer::builder()
            .cold_start(hierarchical_throttle::ColdStart::Exact)
            .key(user)
            .clock(clock.clone())
            .limit(ten_per_second())
            .batch_policy(|_: &hierarchical_throttle::batch::BatchContext<'_>| 0)
            .global_store(global.clone())
            .build()
            .unwrap();
        (router().layer(layer.clone()), layer)
    };
    let ((a, _), (b, layer_b)) = (host(), host());

    for _ in 0..4 {
        assert_eq!(call(&a, "/", "u1", None).await.status(), StatusCode::OK);
    }
    let on_b = call(&b, "/", "u1", None).await;
    assert_eq!(
        field(&on_b, "ratelimit").as_deref(),
        Some("\"default\";r=5;t=1"),
        "10, less host a's 4 and this one"
    );
    let view = &layer_b.remaining(&"u1".to_owned())[0];
    assert_eq!((view.tokens, view.full_in), (5, Duration::from_millis(500)));
    let global_view = &layer_b.remaining_global(&"u1".to_owned()).await.unwrap()[0];
    assert_eq!(global_view.tokens, 5);
    assert_eq!(global_view.next_in, Duration::from_millis(100));
    clock.advance(Duration::from_millis(250));
    assert_eq!(
        layer_b.remaining(&"u1".to_owned())[0].tokens,
        7,
        "refilled since"
    );
    assert_eq!(
        layer_b.remaining(&"u9".to_owned())[0].tokens,
        10,
        "a key never seen is full"
    );
}

#[tokio::test]
async fn every_limit_at_every_level_is_one_item() {
    let clock = ManualClock::new();
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key(user)
        .clock(clock.clone())
        .quota(
            "per-second: 5/s; per-minute: 20/min"
                .parse::<Quota>()
                .unwrap(),
        )
        .level("tenant", tenant, "default: 100/h".parse::<Quota>().unwrap())
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    let app = router().layer(layer);

    let response = call(&app, "/", "u1", Some("acme")).await;
    assert_eq!(
        field(&response, "ratelimit-policy").as_deref(),
        Some("\"per-second\";q=5;w=1, \"per-minute\";q=20;w=60, \"tenant/default\";q=100;w=3600")
    );
    assert_eq!(
        field(&response, "ratelimit").as_deref(),
        Some("\"per-second\";r=4;t=1, \"per-minute\";r=19;t=3, \"tenant/default\";r=99;t=36")
    );
    // Without a tenant, only the user's limits applied.
    let response = call(&app, "/", "u2", None).await;
    assert_eq!(
        field(&response, "ratelimit").as_deref(),
        Some("\"per-second\";r=4;t=1, \"per-minute\";r=19;t=3")
    );
}

#[tokio::test]
async fn the_fields_can_be_turned_off_for_admitted_responses_but_refusals_keep_them() {
    let clock = ManualClock::new();
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key(user)
        .clock(clock.clone())
        .limit(Limit::per_second(1).burst(1).unwrap())
        .ratelimit_fields(false)
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    let app = router().layer(layer);

    let admitted = call(&app, "/", "u1", None).await;
    assert_eq!(admitted.status(), StatusCode::OK);
    assert_eq!(field(&admitted, "ratelimit"), None);
    assert_eq!(field(&admitted, "ratelimit-policy"), None);
    let refused = call(&app, "/", "u1", None).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        field(&refused, "ratelimit").as_deref(),
        Some("\"default\";r=0;t=1")
    );
}

#[tokio::test]
async fn shadow_mode_serves_the_request_with_the_fields_of_its_refusal() {
    let clock = ManualClock::new();
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key(user)
        .clock(clock.clone())
        .limit(Limit::per_minute(1).burst(1).unwrap())
        .shadow(true)
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    let app = router().layer(layer.clone());

    let first = call(&app, "/", "u1", None).await;
    assert_eq!(
        field(&first, "ratelimit").as_deref(),
        Some("\"default\";r=0;t=60")
    );
    clock.advance(Duration::from_secs(15));
    let would_be_refused = call(&app, "/", "u1", None).await;
    assert_eq!(would_be_refused.status(), StatusCode::OK);
    assert_eq!(would_be_refused.headers().get("retry-after"), None);
    assert_eq!(
        field(&would_be_refused, "ratelimit").as_deref(),
        Some("\"default\";r=0;t=45")
    );
    assert_eq!(
        field(&would_be_refused, "ratelimit-policy").as_deref(),
        Some("\"default\";q=1;w=60")
    );
    assert_eq!(layer.stats().shadow_admitted, 1);
}

#[tokio::test]
async fn jitter_spreads_retry_after_without_ever_shortening_it() {
    let clock = ManualClock::new();
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key(user)
        .clock(clock.clone())
        .limit(Limit::per_minute(1).burst(1).unwrap())
        .retry_after_jitter(Duration::from_secs(30))
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    let app = router().layer(layer);

    assert_eq!(call(&app, "/", "u1", None).await.status(), StatusCode::OK);
    let mut waits = std::collections::BTreeSet::new();
    for _ in 0..50 {
        let refused = call(&app, "/", "u1", None).await;
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        let secs: u64 = field(&refused, "retry-after").unwrap().parse().unwrap();
        assert!(
            (60..=90).contains(&secs),
            "{secs} s is not 60 s plus at most 30 s"
        );
        let t = format!("\"default\";r=0;t={secs}");
        assert_eq!(
            field(&refused, "ratelimit"),
            Some(t),
            "t agrees with Retry-After"
        );
        waits.insert(secs);
    }
    assert!(waits.len() >= 10, "50 refusals spread over only {waits:?}");
}

/// The fields parsed by a Structured Fields parser: lists of strings with integer parameters,
/// integers within the 15 digits allowed, for ordinary and extreme limits.
#[tokio::test]
async fn the_fields_are_valid_structured_fields_for_any_limit() {
    let limits = [
        ten_per_second(),
        Limit::per_day(100_000).build().unwrap(),
        Limit::per_millisecond(1_000_000)
            .burst(Limit::MAX_CAPACITY)
            .unwrap(),
        // An empty bucket takes 2^53 years to fill: `w` is clamped to 15 digits.
        Limit::per(1, Limit::MAX_PERIOD)
            .burst(Limit::MAX_CAPACITY)
            .unwrap(),
    ];
    for limit in limits {
        let clock = ManualClock::new();
        let layer = HierarchicalThrottleLayer::builder()
            .cold_start(hierarchical_throttle::ColdStart::Exact)
            .key(user)
            .clock(clock.clone())
            .quota(
                Quota::new("per-x.y_z", limit)
                    .unwrap()
                    .and("default", limit)
                    .unwrap(),
            )
            .global_store(MemoryGlobalStore::with_clock(clock.clone()))
            .build()
            .unwrap();
        let app = router().layer(layer);
        let mut responses = Vec::new();
        for _ in 0..4 {
            responses.push(call(&app, "/", "u1", None).await);
        }
        for response in &responses {
            for name in ["ratelimit-policy", "ratelimit"] {
                let value = field(response, name).unwrap_or_else(|| panic!("no {name}"));
                let list: sfv::List = sfv::Parser::new(&value)
                    .parse()
                    .unwrap_or_else(|e| panic!("{name}: {value:?} does not parse: {e}"));
                assert_eq!(list.len(), 2, "{value}");
                for entry in list {
                    let sfv::ListEntry::Item(item) = entry else {
                        panic!("{value}: an inner list");
                    };
                    let policy = item.bare_item.as_string().unwrap().as_str().to_owned();
                    assert!(["per-x.y_z", "default"].contains(&policy.as_str()));
                    let params: Vec<_> = item.params.keys().map(|k| k.as_str()).collect();
                    let expected = if name == "ratelimit" {
                        ["r", "t"]
                    } else {
                        ["q", "w"]
                    };
                    assert_eq!(params, expected, "{value}");
                    for v in item.params.values() {
                        let n = i64::from(v.as_integer().unwrap());
                        assert!((0..=999_999_999_999_999).contains(&n), "{value}");
                    }
                }
            }
        }
        let policy = field(&responses[0], "ratelimit-policy").unwrap();
        let q = limit.capacity().min(999_999_999_999_999);
        assert!(policy.contains(&format!(";q={q};")), "{policy}");
    }
}

/// While the store is down and the host decides alone with its share of the limit, the fields
/// of admitted responses tell what that share holds, not a full bucket.
#[tokio::test]
async fn fields_follow_the_fallback_share_while_the_store_is_down() {
    let clock = ManualClock::new();
    let store = common::FaultyStore::new(MemoryGlobalStore::with_clock(clock.clone()));
    store.set(common::Fault::Error);
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key(user)
        .clock(clock.clone())
        .limit(Limit::per_second(10).burst(200).unwrap())
        .failure_policy(hierarchical_throttle::FailurePolicy::local_fallback(2).unwrap())
        .global_store(store)
        .build()
        .unwrap();
    let app = router().layer(layer);
    let mut left = Vec::new();
    for _ in 0..101 {
        let response = call(&app, "/", "u1", None).await;
        match response.status() {
            StatusCode::OK => left.push(field(&response, "ratelimit").unwrap()),
            refused => {
                assert_eq!(refused, StatusCode::TOO_MANY_REQUESTS);
                break;
            }
        }
    }
    // The host's share: 100 of the burst of 200.
    assert_eq!(left.len(), 100);
    assert_eq!(left[0], r#""default";r=99;t=1"#);
    assert_eq!(left[99], r#""default";r=0;t=1"#);
}

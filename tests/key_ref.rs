//! Keys borrowed from the request (`key_ref`): decided exactly as the same keys made by `key`,
//! in the same buckets, with the missing-key policy, further limits and levels, and with a
//! local store of the user's own.

mod common;

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use hierarchical_throttle::clock::ManualClock;
use hierarchical_throttle::key::CompactKey;
use hierarchical_throttle::local::{LocalBucket, LocalStore};
use hierarchical_throttle::quota::LeaseKey;
use hierarchical_throttle::{
    Builder, DefaultRejection, HierarchicalThrottleLayer, Limit, MemoryGlobalStore,
    MemoryLocalStore, MissingKey, Quota, Unset, key,
};
use http::{HeaderName, Request, StatusCode};
use tower::ServiceExt;

const API_KEY: HeaderName = HeaderName::from_static("x-api-key");

fn api_key(req: &Request<Body>) -> Option<&str> {
    key::header_str(req, &API_KEY)
}

/// A layer borrowing its key from `x-api-key`, on `clock`, without the `RateLimit` fields on
/// admitted responses (the borrowed hot path): each test adds its limits and stores.
fn borrowing(
    clock: &ManualClock,
) -> Builder<Request<Body>, String, Unset, MemoryLocalStore<String>, ManualClock, DefaultRejection>
{
    HierarchicalThrottleLayer::builder()
        .key_ref(api_key)
        .clock(clock.clone())
        .ratelimit_fields(false)
}

type Layer<L> = HierarchicalThrottleLayer<
    Request<Body>,
    String,
    MemoryGlobalStore<String, ManualClock>,
    L,
    ManualClock,
>;

fn router<L: LocalStore<LeaseKey<String>>>(layer: Layer<L>) -> Router {
    Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer)
}

async fn send(app: &Router, api_key: Option<&str>) -> http::Response<Body> {
    let mut req = Request::get("/");
    if let Some(k) = api_key {
        req = req.header("x-api-key", k);
    }
    app.clone()
        .oneshot(req.body(Body::empty()).unwrap())
        .await
        .unwrap()
}

/// What a client sees of an answer: status, Retry-After and RateLimit.
async fn seen(app: &Router, api_key: Option<&str>) -> (StatusCode, Option<String>, Option<String>) {
    let response = send(app, api_key).await;
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .map(|v| v.to_str().unwrap().to_owned())
    };
    (
        response.status(),
        header("retry-after"),
        header("ratelimit"),
    )
}

#[tokio::test]
async fn a_borrowed_key_is_decided_exactly_as_the_same_key_made() {
    for fields in [false, true] {
        let clock = ManualClock::new();
        let made = HierarchicalThrottleLayer::builder()
            .key(|req: &Request<Body>| key::header_value(req, &API_KEY))
            .clock(clock.clone())
            .limit(Limit::per_second(1).burst(3).unwrap())
            .ratelimit_fields(fields)
            .global_store(MemoryGlobalStore::with_clock(clock.clone()))
            .build()
            .unwrap();
        let borrowed = borrowing(&clock)
            .limit(Limit::per_second(1).burst(3).unwrap())
            .ratelimit_fields(fields)
            .global_store(MemoryGlobalStore::with_clock(clock.clone()))
            .build()
            .unwrap();
        let (made, borrowed) = (router(made), router(borrowed));

        let script = [
            (Some("k1"), 0),
            (Some("k1"), 0),
            (Some("k2"), 0),
            (Some("k1"), 0),
            (Some("k1"), 200),
            (None, 0),
            (Some("k1"), 800),
            (Some("k1"), 0),
        ];
        let mut statuses = Vec::new();
        for (key, advance_ms) in script {
            clock.advance(Duration::from_millis(advance_ms));
            let expected = seen(&made, key).await;
            assert_eq!(
                seen(&borrowed, key).await,
                expected,
                "key {key:?}, fields {fields}"
            );
            statuses.push(expected.0);
        }
        use StatusCode as S;
        assert_eq!(
            statuses,
            [
                S::OK,
                S::OK,
                S::OK,
                S::OK,
                S::TOO_MANY_REQUESTS,
                S::BAD_REQUEST,
                S::OK,
                S::TOO_MANY_REQUESTS
            ]
        );
    }
}

#[tokio::test]
async fn a_borrowed_key_draws_on_the_bucket_of_its_owned_form() {
    let clock = ManualClock::new();
    let layer = borrowing(&clock)
        .limit(Limit::per_minute(1).burst(3).unwrap())
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    // Two tokens taken by the owned key, so a request borrowing it has one left.
    layer.acquire("k1".to_owned(), 2).await.unwrap();
    let app = router(layer.clone());
    assert_eq!(send(&app, Some("k1")).await.status(), StatusCode::OK);
    let refused = send(&app, Some("k1")).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.headers()["retry-after"], "60");
    assert!(layer.acquire("k1".to_owned(), 1).await.is_err());
    assert_eq!(send(&app, Some("k2")).await.status(), StatusCode::OK);
}

#[tokio::test]
async fn a_request_without_its_borrowed_key_follows_the_missing_key_policy() {
    let clock = ManualClock::new();
    let layer = borrowing(&clock)
        .limit(Limit::per_minute(1).burst(2).unwrap())
        .missing_key(MissingKey::UseKey("anonymous".to_owned()))
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    layer.acquire("anonymous".to_owned(), 1).await.unwrap();
    let app = router(layer);
    assert_eq!(send(&app, None).await.status(), StatusCode::OK);
    assert_eq!(
        send(&app, None).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        send(&app, Some("anonymous")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(send(&app, Some("k1")).await.status(), StatusCode::OK);
}

#[tokio::test]
async fn a_borrowed_key_draws_on_every_limit_of_its_quota() {
    let clock = ManualClock::new();
    let layer = borrowing(&clock)
        .quota("fast: 1000/s; slow: 5/min".parse::<Quota>().unwrap())
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    let app = router(layer);
    for _ in 0..5 {
        assert_eq!(send(&app, Some("k1")).await.status(), StatusCode::OK);
    }
    let refused = send(&app, Some("k1")).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.headers()["retry-after"], "12");
}

#[tokio::test]
async fn a_borrowed_key_works_beside_a_further_level() {
    let clock = ManualClock::new();
    let layer = borrowing(&clock)
        .limit(Limit::per_minute(1).burst(5).unwrap())
        .level(
            "tenant",
            |req: &Request<Body>| key::header_value(req, "x-tenant"),
            Limit::per_minute(1).burst(3).unwrap(),
        )
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    let app = router(layer);
    let send_as = |user: &'static str| {
        let app = app.clone();
        async move {
            let req = Request::get("/")
                .header("x-api-key", user)
                .header("x-tenant", "t1")
                .body(Body::empty())
                .unwrap();
            app.oneshot(req).await.unwrap().status()
        }
    };
    // Three users of one tenant: the tenant's burst of 3 binds before any user's 5.
    assert_eq!(send_as("u1").await, StatusCode::OK);
    assert_eq!(send_as("u2").await, StatusCode::OK);
    assert_eq!(send_as("u3").await, StatusCode::OK);
    assert_eq!(send_as("u1").await, StatusCode::TOO_MANY_REQUESTS);
}

/// A local store of the user's own: buckets in a map behind one lock.
#[derive(Default)]
struct MapStore(Mutex<HashMap<LeaseKey<String>, LocalBucket>>);

impl LocalStore<LeaseKey<String>> for MapStore {
    fn with_bucket<R>(&self, key: &LeaseKey<String>, f: impl FnOnce(&mut LocalBucket) -> R) -> R {
        f(self.0.lock().unwrap().entry(key.clone()).or_default())
    }

    fn for_each_bucket(&self, mut f: impl FnMut(&LeaseKey<String>, &mut LocalBucket)) {
        for (key, bucket) in self.0.lock().unwrap().iter_mut() {
            f(key, bucket);
        }
    }

    fn take_evicted(&self) -> Vec<(LeaseKey<String>, LocalBucket)> {
        Vec::new()
    }

    fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

#[tokio::test]
async fn a_borrowed_key_is_made_for_a_local_store_of_ones_own() {
    let clock = ManualClock::new();
    let layer = borrowing(&clock)
        .limit(Limit::per_minute(1).burst(2).unwrap())
        .local_store(MapStore::default())
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    let app = router(layer);
    assert_eq!(send(&app, Some("k1")).await.status(), StatusCode::OK);
    assert_eq!(send(&app, Some("k1")).await.status(), StatusCode::OK);
    assert_eq!(
        send(&app, Some("k1")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(send(&app, Some("k2")).await.status(), StatusCode::OK);
}

#[tokio::test]
async fn a_key_borrowed_as_bytes_is_kept_compactly_and_decided_as_the_same_key_made() {
    let clock = ManualClock::new();
    let limit = || Limit::per_second(1).burst(2).unwrap();
    let made = HierarchicalThrottleLayer::builder()
        .key(|req: &Request<Body>| key::header_value(req, &API_KEY))
        .clock(clock.clone())
        .limit(limit())
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    let bytes = HierarchicalThrottleLayer::builder()
        .key_ref(|req: &Request<Body>| key::header_bytes(req, &API_KEY))
        .clock(clock.clone())
        .limit(limit())
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    // Two tokens taken by the key made from the same bytes: one left for the requests.
    let long = "k".repeat(CompactKey::INLINE_LEN + 1);
    for k in ["k1", long.as_str()] {
        made.acquire(k.to_owned(), 1).await.unwrap();
        bytes.acquire(CompactKey::from(k), 1).await.unwrap();
    }
    let (made, bytes) = (
        router(made),
        Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(bytes),
    );
    // Inline, on the heap, absent, then again after the refill.
    let script = [
        ("k1", 0),
        ("k1", 0),
        (long.as_str(), 0),
        (long.as_str(), 0),
        ("k1", 1000),
    ];
    for (k, advance_ms) in script {
        clock.advance(Duration::from_millis(advance_ms));
        assert_eq!(
            seen(&bytes, Some(k)).await,
            seen(&made, Some(k)).await,
            "key {k}"
        );
    }
    assert_eq!(seen(&bytes, None).await.0, StatusCode::BAD_REQUEST);
    // Not UTF-8, still a key of its own, with its own two tokens.
    let mut statuses = Vec::new();
    for _ in 0..3 {
        let value = http::HeaderValue::from_bytes(b"k\xff").unwrap();
        let req = Request::get("/").header("x-api-key", value);
        let response = bytes
            .clone()
            .oneshot(req.body(Body::empty()).unwrap())
            .await;
        statuses.push(response.unwrap().status());
    }
    use StatusCode as S;
    assert_eq!(statuses, [S::OK, S::OK, S::TOO_MANY_REQUESTS]);
}

/// A level's keys may be of another type than the main key, converted into it: a tenant
/// level read with `header_value` (a `String`) beside a main key borrowed as bytes.
#[tokio::test]
async fn a_level_keyed_by_another_type_converts_into_the_key_type() {
    let clock = ManualClock::new();
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key_ref(|req: &Request<Body>| key::header_bytes(req, &API_KEY))
        .clock(clock.clone())
        .limit(Limit::per_minute(10).build().unwrap())
        .level(
            "tenant",
            |req: &Request<Body>| key::header_value(req, "x-tenant"),
            Limit::per_minute(3).build().unwrap(),
        )
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer.clone());
    let call = |user: &'static str| {
        let request = Request::get("/")
            .header(API_KEY, user)
            .header("x-tenant", "acme")
            .body(Body::empty())
            .unwrap();
        app.clone().oneshot(request)
    };
    let mut statuses = Vec::new();
    for user in ["u1", "u2", "u3", "u4"] {
        statuses.push(call(user).await.unwrap().status());
    }
    // Four users, each well within their own 10 a minute; the tenant's 3 a minute refuses
    // the fourth.
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );
    assert_eq!(layer.stats().requests_refused, 1);
}

/// The `RateLimit` fields of a borrowed key's admitted response are read in the same lookup
/// as its take: they must say what the fields read after it say, for the same key made, on
/// a long script with refills, several keys, and the store failing for a while (each host's
/// share then, under `FailurePolicy::local_fallback`).
#[tokio::test(start_paused = true)]
async fn the_fields_read_with_the_take_are_those_read_after_it() {
    let clock = ManualClock::new();
    let limit = Limit::per_second(5).burst(8).unwrap();
    let stores: Vec<_> = (0..2)
        .map(|_| common::FaultyStore::new(MemoryGlobalStore::with_clock(clock.clone())))
        .collect();
    let fallback = || hierarchical_throttle::FailurePolicy::local_fallback(2).unwrap();
    let made = HierarchicalThrottleLayer::builder()
        .key(|req: &Request<Body>| key::header_value(req, &API_KEY))
        .clock(clock.clone())
        .limit(limit)
        .failure_policy(fallback())
        // Batches go at once: no timer on tokio's clock to make the two hosts' timing differ.
        .global_batch_linger(Duration::ZERO)
        .global_store(stores[0].clone())
        .build()
        .unwrap();
    let borrowed = HierarchicalThrottleLayer::builder()
        .key_ref(api_key)
        .clock(clock.clone())
        .limit(limit)
        .failure_policy(fallback())
        .global_batch_linger(Duration::ZERO)
        .global_store(stores[1].clone())
        .build()
        .unwrap();
    let app = |layer| {
        Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(layer)
    };
    let (made, borrowed) = (app(made), app(borrowed));
    let fields = |response: &http::Response<Body>| {
        let header = |name| response.headers().get(name).cloned();
        (
            response.status(),
            header("ratelimit"),
            header("ratelimit-policy"),
            header("retry-after"),
        )
    };
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let mut admitted_with_fields = 0;
    for step in 0..400 {
        if step == 150 || step == 300 {
            let fault = match step {
                150 => common::Fault::Error,
                _ => common::Fault::None,
            };
            stores.iter().for_each(|store| store.set(fault));
        }
        clock.advance(Duration::from_millis(next(300)));
        let key = ["a", "b", "c"][next(3) as usize];
        let expected = fields(&send(&made, Some(key)).await);
        let got = fields(&send(&borrowed, Some(key)).await);
        assert_eq!(got, expected, "step {step}, key {key}");
        admitted_with_fields += usize::from(expected.0 == StatusCode::OK && expected.1.is_some());
        // Paused time moves on once every task is idle: both hosts' batches have landed.
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // Both outcomes are on the script: admissions with fields and refusals.
    assert!(admitted_with_fields > 100, "{admitted_with_fields}");
}

//! Costs known after the response, through an axum `Router` on a manual clock: an LLM-style
//! endpoint reserving 1,000 tokens and settling to its `x-tokens-used` header, refunds, debt
//! that later requests pay, every limit and level corrected, and `settle` beside `acquire`.

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use hierarchical_throttle::clock::ManualClock;
use hierarchical_throttle::quota::BucketKey;
use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore, Quota, key};
use http::{HeaderMap, Request, Response, StatusCode};
use tower::ServiceExt;

/// The handler reports the tokens it used in `x-tokens-used`, as asked by `x-use` (a 500 when
/// asked for `fail`).
async fn generate(headers: HeaderMap) -> Response<Body> {
    let asked = headers["x-use"].to_str().unwrap().to_owned();
    if asked == "fail" {
        let mut failed = Response::new(Body::empty());
        *failed.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
        return failed;
    }
    Response::builder()
        .header("x-tokens-used", asked)
        .body(Body::empty())
        .unwrap()
}

/// 1,000 tokens reserved per request, settled to `x-tokens-used`; a 5xx costs nothing.
fn tokens_used(response: &Response<Body>, reserved: u64) -> u64 {
    if response.status().is_server_error() {
        return 0;
    }
    response
        .headers()
        .get("x-tokens-used")
        .and_then(|used| used.to_str().ok()?.parse().ok())
        .unwrap_or(reserved)
}

fn app(
    clock: &ManualClock,
    global: &MemoryGlobalStore<String, ManualClock>,
    limit: Limit,
) -> Router {
    app_and_layer(clock, global, limit).0
}

type Layer = HierarchicalThrottleLayer<
    Request<Body>,
    String,
    MemoryGlobalStore<String, ManualClock>,
    hierarchical_throttle::MemoryLocalStore<String>,
    ManualClock,
    hierarchical_throttle::Settle<
        hierarchical_throttle::DefaultRejection,
        fn(&Response<Body>, u64) -> u64,
    >,
>;

fn app_and_layer(
    clock: &ManualClock,
    global: &MemoryGlobalStore<String, ManualClock>,
    limit: Limit,
) -> (Router, Layer) {
    let layer = HierarchicalThrottleLayer::builder()
        .key(|req: &Request<Body>| key::header_value(req, "x-api-key"))
        .clock(clock.clone())
        .limit(limit)
        .cost(|_: &Request<Body>| 1_000)
        .settle(tokens_used as fn(&Response<Body>, u64) -> u64)
        .global_store(global.clone())
        .build()
        .unwrap();
    (
        Router::new().route("/", get(generate)).layer(layer.clone()),
        layer,
    )
}

async fn call(app: &Router, used: &str) -> Response<Body> {
    let request = Request::get("/")
        .header("x-api-key", "k1")
        .header("x-use", used)
        .body(Body::empty())
        .unwrap();
    app.clone().oneshot(request).await.unwrap()
}

fn left(response: &Response<Body>) -> String {
    response.headers()["ratelimit"].to_str().unwrap().to_owned()
}

#[tokio::test]
async fn responses_settle_to_the_tokens_they_used() {
    let clock = ManualClock::new();
    let global = MemoryGlobalStore::with_clock(clock.clone());
    let limit = Limit::per_minute(10_000).build().unwrap();
    let (app, layer) = app_and_layer(&clock, &global, limit);

    // Each response's fields already count its settled cost.
    let response = call(&app, "200").await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(left(&response), "\"default\";r=9800;t=1");
    assert_eq!(left(&call(&app, "1000").await), "\"default\";r=8800;t=1");
    assert_eq!(left(&call(&app, "3000").await), "\"default\";r=5800;t=1");
    assert_eq!(
        left(&call(&app, "fail").await),
        "\"default\";r=5800;t=1",
        "a 5xx is refunded in full"
    );
    assert_eq!(layer.stats().tokens_refunded, 800 + 1_000);
    // Once the lease has expired and gone back, the global bucket holds exactly what is left
    // (and what refilled in the lease's 2 s).
    clock.advance(Duration::from_secs(2));
    layer.return_unused_leases().await;
    let in_global = global
        .peek(&BucketKey::new("k1".to_owned(), "default").unwrap(), &limit)
        .tokens();
    assert_eq!(in_global, 5_800 + 333);
}

#[tokio::test]
async fn a_response_that_used_more_than_the_bucket_had_leaves_a_debt_later_requests_pay() {
    let clock = ManualClock::new();
    let global = MemoryGlobalStore::with_clock(clock.clone());
    let limit = Limit::per_minute(1_000).build().unwrap();
    let app = app(&clock, &global, limit);

    // 2,500 used against a full bucket of 1,000: 1,500 owed.
    assert_eq!(call(&app, "2500").await.status(), StatusCode::OK);
    let bucket = global.peek(&BucketKey::new("k1".to_owned(), "default").unwrap(), &limit);
    assert_eq!(bucket.owed(), 1_500);
    // The next 1,000 come once the debt and they have accrued: 2,500 at 1,000 a minute.
    let refused = call(&app, "10").await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.headers()["retry-after"], "150");
    clock.advance(Duration::from_secs(149));
    assert_eq!(
        call(&app, "10").await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    clock.advance(Duration::from_secs(1));
    assert_eq!(call(&app, "10").await.status(), StatusCode::OK);
}

#[tokio::test]
async fn every_limit_and_level_a_request_drew_on_is_settled() {
    let clock = ManualClock::new();
    let layer = HierarchicalThrottleLayer::builder()
        .key(|req: &Request<Body>| key::header_value(req, "x-api-key"))
        .clock(clock.clone())
        .quota(
            "per-minute: 10000/min; per-day: 100000/day"
                .parse::<Quota>()
                .unwrap(),
        )
        .level(
            "tenant",
            |req: &Request<Body>| key::header_value(req, "x-tenant"),
            "default: 50000/min".parse::<Quota>().unwrap(),
        )
        .cost(|_: &Request<Body>| 1_000)
        .settle(tokens_used)
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    let app = Router::new().route("/", get(generate)).layer(layer);
    let request = Request::get("/")
        .header("x-api-key", "k1")
        .header("x-tenant", "acme")
        .header("x-use", "1500")
        .body(Body::empty())
        .unwrap();
    let response = app.oneshot(request).await.unwrap();
    assert_eq!(
        left(&response),
        "\"per-minute\";r=8500;t=1, \"per-day\";r=98500;t=1, \"tenant/default\";r=48500;t=1"
    );
}

#[tokio::test]
async fn acquire_settles_beside_it() {
    let clock = ManualClock::new();
    let global = MemoryGlobalStore::with_clock(clock.clone());
    let limit = Limit::per_minute(1_000).build().unwrap();
    let layer = HierarchicalThrottleLayer::builder()
        .key(|job: &String| Some(job.clone()))
        .clock(clock.clone())
        .limit(limit)
        .global_store(global.clone())
        .build()
        .unwrap();

    layer.acquire("job".to_owned(), 600).await.unwrap();
    layer.settle("job".to_owned(), 600, 100).await;
    assert_eq!(layer.remaining(&"job".to_owned())[0].tokens, 900);
    layer.settle("job".to_owned(), 100, 1_300).await;
    assert_eq!(layer.remaining(&"job".to_owned())[0].tokens, 0);
    let bucket = global.peek(
        &BucketKey::new("job".to_owned(), "default").unwrap(),
        &limit,
    );
    assert_eq!(
        bucket.owed(),
        300,
        "what neither the lease nor the bucket had is owed"
    );
    assert_eq!(layer.stats().tokens_refunded, 500);
}

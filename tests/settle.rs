//! Costs known after the response, through an axum `Router` on a manual clock: an LLM-style
//! endpoint reserving 1,000 tokens and settling to its `x-tokens-used` header, refunds, debt
//! that later requests pay, every limit and level corrected, and `settle` beside `acquire`.

mod common;

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

    // Each response's fields already count its settled cost: `r` is what is left, and the
    // 9,999 tokens that refill within the minute's window (one every 6 ms).
    let within = |left: u64| format!("\"default\";r={};t=60", left + 9_999);
    let response = call(&app, "200").await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(left(&response), within(9_800));
    assert_eq!(left(&call(&app, "1000").await), within(8_800));
    assert_eq!(left(&call(&app, "3000").await), within(5_800));
    assert_eq!(
        left(&call(&app, "fail").await),
        within(5_800),
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
    let (app, layer) = app_and_layer(&clock, &global, limit);

    // 2,500 used against a full bucket of 1,000: 1,500 more than charged. One call takes at
    // most a capacity into debt: 1,000 owed, the other 500 counted as uncharged.
    assert_eq!(call(&app, "2500").await.status(), StatusCode::OK);
    let bucket = global.peek(&BucketKey::new("k1".to_owned(), "default").unwrap(), &limit);
    assert_eq!(bucket.owed(), 1_000);
    assert_eq!(layer.stats().tokens_uncharged, 500);
    assert_eq!(layer.stats().global_calls, 2, "one fetch, one charge");
    // The next 1,000 come once the debt and they have accrued: 2,000 at 1,000 a minute.
    let refused = call(&app, "10").await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.headers()["retry-after"], "120");
    clock.advance(Duration::from_secs(119));
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
    // What is left of each, and what refills within its window.
    assert_eq!(
        left(&response),
        format!(
            "\"per-minute\";r={};t=60, \"per-day\";r={};t=86400, \"tenant\";r={};t=60",
            8_500 + 9_999,
            98_500 + 99_999,
            48_500 + 49_999
        )
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

    let admitted = layer.acquire("job".to_owned(), 600).await.unwrap();
    layer.settle("job".to_owned(), admitted, 600, 100).await;
    assert_eq!(layer.remaining(&"job".to_owned())[0].tokens, 900);
    layer.settle("job".to_owned(), admitted, 100, 1_300).await;
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

mod failures {
    //! Settling beside a failing or slow store, on tokio's paused time.

    use std::time::Duration;

    use axum::Router;
    use axum::body::Body;
    use axum::routing::get;
    use hierarchical_throttle::clock::TokioClock;
    use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore, key};
    use http::{HeaderMap, Request, Response, StatusCode};
    use tokio::time::Instant;
    use tower::ServiceExt;

    use super::common::{Fault, FaultyStore};

    type Store = FaultyStore<MemoryGlobalStore<String, TokioClock>>;

    fn store() -> Store {
        FaultyStore::new(MemoryGlobalStore::with_clock(TokioClock::new()))
    }

    /// The handler takes `x-wait` ms and reports `x-use` tokens used.
    async fn handle(headers: HeaderMap) -> Response<Body> {
        let wait = headers["x-wait"].to_str().unwrap().parse().unwrap();
        tokio::time::sleep(Duration::from_millis(wait)).await;
        Response::builder()
            .header("x-tokens-used", headers["x-use"].clone())
            .body(Body::empty())
            .unwrap()
    }

    async fn call(app: &Router, used: u64, wait_ms: u64) -> StatusCode {
        call_as(app, "k", used, wait_ms).await
    }

    async fn call_as(app: &Router, key: &str, used: u64, wait_ms: u64) -> StatusCode {
        let request = Request::get("/")
            .header("x-api-key", key)
            .header("x-use", used)
            .header("x-wait", wait_ms)
            .body(Body::empty())
            .unwrap();
        let response = app.clone().oneshot(request).await.unwrap();
        response.status()
    }

    fn app(
        store: &Store,
        limit: Limit,
        cost: u64,
    ) -> (Router, impl Fn() -> hierarchical_throttle::ThrottleStats) {
        let layer = HierarchicalThrottleLayer::builder()
            .key_ref(|req: &Request<Body>| key::header_str(req, "x-api-key"))
            .clock(TokioClock::new())
            .limit(limit)
            .cost(move |_: &Request<Body>| cost)
            .settle(super::tokens_used as fn(&Response<Body>, u64) -> u64)
            .store_timeout(Duration::from_millis(200))
            .global_store(store.clone())
            .build()
            .unwrap();
        let router = Router::new().route("/", get(handle)).layer(layer.clone());
        (router, move || layer.stats())
    }

    /// A request the failure policy admitted took no leased tokens: refunding it would mint
    /// tokens no store dispensed.
    #[tokio::test(start_paused = true)]
    async fn a_refund_of_a_request_the_failure_policy_admitted_mints_nothing() {
        let store = store();
        let (app, stats) = app(&store, Limit::per_minute(100).build().unwrap(), 100);
        store.set(Fault::Error);
        // Admitted by the host's own fallback bucket; the response comes after the store's
        // back-off, and says it used nothing.
        assert_eq!(call(&app, 0, 300).await, StatusCode::OK);
        assert_eq!(stats().fallback_decisions, 1);
        assert_eq!(stats().tokens_refunded, 0);
        assert_eq!(stats().tokens_forfeited, 100);
        // Back up: the global bucket's 100 serve one request, and nothing more is there.
        store.set(Fault::None);
        assert_eq!(call(&app, 100, 0).await, StatusCode::OK);
        assert_eq!(call(&app, 100, 0).await, StatusCode::TOO_MANY_REQUESTS);
    }

    /// One bogus usage figure makes one call per bucket, not a loop of calls: what one call
    /// cannot take into debt (a capacity) is counted as uncharged.
    #[tokio::test(start_paused = true)]
    async fn a_huge_settled_cost_makes_one_bounded_call() {
        let store = store();
        let (app, stats) = app(&store, Limit::per_second(100).burst(100).unwrap(), 1);
        for (key, used) in [("k1", 1_000_000), ("k2", u64::MAX)] {
            let calls = store.acquire_count();
            let start = Instant::now();
            assert_eq!(call_as(&app, key, used, 0).await, StatusCode::OK);
            assert!(store.acquire_count() - calls <= 2, "a fetch and one charge");
            assert!(start.elapsed() <= Duration::from_millis(200));
        }
        assert!(stats().tokens_uncharged >= 1_000_000 - 200);
        // The fleet owes one capacity: the key's next request waits for it.
        assert_eq!(
            call_as(&app, "k1", 1, 0).await,
            StatusCode::TOO_MANY_REQUESTS
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(call_as(&app, "k1", 1, 0).await, StatusCode::OK);
    }

    /// During an outage, settling responses do not call the store inside its back-off, and
    /// never wait for one bucket after another.
    #[tokio::test(start_paused = true)]
    async fn debt_charges_keep_the_back_off_and_run_side_by_side() {
        let store = store();
        let layer = HierarchicalThrottleLayer::builder()
            .key_ref(|req: &Request<Body>| key::header_str(req, "x-api-key"))
            .clock(TokioClock::new())
            .quota(
                "a: 10/s burst 10; b: 20/s burst 20"
                    .parse::<hierarchical_throttle::Quota>()
                    .unwrap(),
            )
            .cost(|_: &Request<Body>| 1)
            .settle(super::tokens_used as fn(&Response<Body>, u64) -> u64)
            .store_timeout(Duration::from_millis(50))
            .max_store_backoff(Duration::from_secs(10))
            .global_store(store.clone())
            .build()
            .unwrap();
        let app = Router::new().route("/", get(handle)).layer(layer.clone());
        assert_eq!(call(&app, 1, 0).await, StatusCode::OK);
        // The store hangs: a response that used 500 more waits one time-out for both buckets.
        store.set(Fault::Hang);
        let start = Instant::now();
        assert_eq!(call(&app, 500, 0).await, StatusCode::OK);
        assert_eq!(start.elapsed(), Duration::from_millis(50));
        // Now in back-off: the next settles neither call nor wait.
        let calls = store.acquire_count();
        let start = Instant::now();
        assert_eq!(call(&app, 500, 0).await, StatusCode::OK);
        assert_eq!(start.elapsed(), Duration::ZERO);
        assert_eq!(store.acquire_count(), calls);
        assert!(layer.stats().tokens_uncharged >= 2 * (2 * 499 - 30));
    }
}

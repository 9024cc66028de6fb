//! The layer in an axum `Router`, driven with `ServiceExt::oneshot`.

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use hierarchical_throttle::clock::{ManualClock, TokioClock};
use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore, MissingKey, key};
use http::{Request, StatusCode};
use tower::ServiceExt;

fn app(clock: &ManualClock, missing: MissingKey<String>) -> Router {
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key(|req: &Request<Body>| key::header_value(req, "x-api-key"))
        .clock(clock.clone())
        .limit(Limit::per_second(1).burst(3).unwrap())
        .missing_key(missing)
        .cost(|req: &Request<Body>| if req.uri().path() == "/bulk" { 5 } else { 1 })
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    Router::new()
        .route("/", get(|| async { "ok" }))
        .route("/bulk", get(|| async { "ok" }))
        .layer(layer)
}

async fn get_status(app: &Router, path: &str, api_key: Option<&str>) -> http::Response<Body> {
    let mut req = Request::get(path);
    if let Some(k) = api_key {
        req = req.header("x-api-key", k);
    }
    app.clone()
        .oneshot(req.body(Body::empty()).unwrap())
        .await
        .unwrap()
}

#[tokio::test]
async fn serves_then_answers_429_with_retry_after_and_ratelimit_fields() {
    let clock = ManualClock::new();
    let app = app(&clock, MissingKey::Reject);
    for _ in 0..3 {
        assert_eq!(
            get_status(&app, "/", Some("k1")).await.status(),
            StatusCode::OK
        );
    }
    clock.advance(Duration::from_millis(200));
    let refused = get_status(&app, "/", Some("k1")).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let headers = refused.headers();
    // 0.8 s until the next token: Retry-After rounds up to 1.
    assert_eq!(headers["retry-after"], "1");
    assert_eq!(headers["ratelimit"], "\"default\";r=0;t=1");
    // One token a second, burst 3, each request costing 1 or 5: counted in tokens.
    assert_eq!(
        headers["ratelimit-policy"],
        "\"default\";q=1;qu=\"tokens\";w=1;ht-burst=3"
    );

    // Other keys have their own buckets.
    assert_eq!(
        get_status(&app, "/", Some("k2")).await.status(),
        StatusCode::OK
    );

    clock.advance(Duration::from_millis(800));
    assert_eq!(
        get_status(&app, "/", Some("k1")).await.status(),
        StatusCode::OK
    );
}

#[tokio::test]
async fn a_long_wait_rounds_retry_after_up_to_whole_seconds() {
    let clock = ManualClock::new();
    let app = app(&clock, MissingKey::Reject);
    for _ in 0..3 {
        get_status(&app, "/", Some("k1")).await;
    }
    // Cost 5 > capacity 3: refused at once, 413, whatever tokens there are.
    let bulk = get_status(&app, "/bulk", Some("k1")).await;
    assert_eq!(bulk.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert!(
        bulk.headers().get("retry-after").is_none(),
        "waiting cannot help"
    );
    clock.advance(Duration::from_millis(1));
    let refused = get_status(&app, "/", Some("k1")).await;
    assert_eq!(
        refused.headers()["retry-after"],
        "1",
        "999 ms rounds up to 1 s"
    );
}

async fn text(response: http::Response<Body>) -> String {
    use http_body_util::BodyExt;
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(bytes.to_vec()).unwrap()
}

#[tokio::test]
async fn requests_without_a_key_are_rejected_by_default_and_told_why() {
    let clock = ManualClock::new();
    let app = app(&clock, MissingKey::Reject);
    let refused = get_status(&app, "/", None).await;
    assert_eq!(refused.status(), StatusCode::BAD_REQUEST);
    assert_eq!(
        refused.headers()["content-type"],
        "text/plain; charset=utf-8"
    );
    assert_eq!(text(refused).await, "request has no throttle key");
}

#[tokio::test]
async fn a_missing_key_can_get_its_own_status_and_words() {
    let clock = ManualClock::new();
    let missing = MissingKey::RejectWith {
        status: StatusCode::UNAUTHORIZED,
        message: "send your API key in the x-api-key header",
    };
    let app = app(&clock, missing);
    let refused = get_status(&app, "/", None).await;
    assert_eq!(refused.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(
        text(refused).await,
        "send your API key in the x-api-key header"
    );
    assert_eq!(
        get_status(&app, "/", Some("k1")).await.status(),
        StatusCode::OK
    );
}

#[tokio::test]
async fn a_throttled_request_is_told_which_limit_and_how_long() {
    let clock = ManualClock::new();
    let app = app(&clock, MissingKey::Reject);
    for _ in 0..3 {
        assert_eq!(
            get_status(&app, "/", Some("k1")).await.status(),
            StatusCode::OK
        );
    }
    let refused = get_status(&app, "/", Some("k1")).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        text(refused).await,
        "rate limit exceeded (limit default, retry in 1 s)"
    );
    let too_big = get_status(&app, "/bulk", Some("k2")).await;
    assert_eq!(too_big.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(
        text(too_big).await,
        "request costs 5 tokens but the limit holds at most 3 (limit default)"
    );
}

#[tokio::test]
async fn requests_without_a_key_can_share_one_bucket_or_pass() {
    let clock = ManualClock::new();
    let shared = app(&clock, MissingKey::UseKey("anonymous".to_owned()));
    for _ in 0..3 {
        assert_eq!(
            get_status(&shared, "/", None).await.status(),
            StatusCode::OK
        );
    }
    assert_eq!(
        get_status(&shared, "/", None).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );

    let open = app(&clock, MissingKey::Admit);
    for _ in 0..10 {
        assert_eq!(get_status(&open, "/", None).await.status(), StatusCode::OK);
    }
}

#[tokio::test]
async fn clones_of_the_router_and_of_the_layer_share_limits() {
    let clock = ManualClock::new();
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key(|req: &Request<Body>| key::header_value(req, "x-api-key"))
        .clock(clock.clone())
        .limit(Limit::per_minute(4).burst(4).unwrap())
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    let a = Router::new()
        .route("/", get(|| async { "a" }))
        .layer(layer.clone());
    let b = Router::new()
        .route("/", get(|| async { "b" }))
        .layer(layer.clone());
    let a2 = a.clone();
    let mut statuses = Vec::new();
    for app in [&a, &b, &a2, &b, &a] {
        statuses.push(get_status(app, "/", Some("k")).await.status().as_u16());
    }
    assert_eq!(statuses, [200, 200, 200, 200, 429]);
    assert_eq!(
        layer.stats().rejected_global + layer.stats().rejected_cached,
        1
    );
}

#[tokio::test]
async fn shadow_mode_serves_what_it_would_refuse_and_counts_it() {
    let clock = ManualClock::new();
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key(|req: &Request<Body>| key::header_value(req, "x-api-key"))
        .clock(clock.clone())
        .limit(Limit::per_second(1).burst(2).unwrap())
        .shadow(true)
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer.clone());
    for _ in 0..5 {
        assert_eq!(
            get_status(&app, "/", Some("k1")).await.status(),
            StatusCode::OK
        );
    }
    // A request without a key would be refused too.
    assert_eq!(get_status(&app, "/", None).await.status(), StatusCode::OK);
    let stats = layer.stats();
    assert_eq!(stats.admitted_local + stats.admitted_after_fetch, 2);
    assert_eq!(
        stats.rejected_cached + stats.rejected_global,
        3,
        "{stats:?}"
    );
    assert_eq!((stats.missing_key, stats.shadow_admitted), (1, 4));
}

/// Behind a load balancer, each client gets its own bucket by the address the balancer
/// forwarded, whatever the client writes into the header itself; IPv6 clients share their /64.
#[tokio::test]
async fn clients_behind_a_load_balancer_are_keyed_by_the_address_it_forwarded() {
    use axum::extract::ConnectInfo;
    use std::net::SocketAddr;

    let clock = ManualClock::new();
    let client_ip = key::ClientIp::behind_networks(["10.0.0.0/8"]).unwrap();
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key(move |req: &Request<Body>| client_ip.key(req))
        .clock(clock.clone())
        .limit(Limit::per_minute(1).burst(1).unwrap())
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    let send = |peer: &str, forwarded: Option<&str>| {
        let mut req = Request::get("/");
        if let Some(forwarded) = forwarded {
            req = req.header("x-forwarded-for", forwarded);
        }
        let mut req = req.body(Body::empty()).unwrap();
        let peer: SocketAddr = peer.parse().unwrap();
        req.extensions_mut().insert(ConnectInfo(peer));
        let app = app.clone();
        async move { app.oneshot(req).await.unwrap().status() }
    };
    let balancer = "10.0.0.5:443";
    assert_eq!(send(balancer, Some("203.0.113.7")).await, StatusCode::OK);
    // The same client again, claiming to be someone else: still itself.
    assert_eq!(
        send(balancer, Some("198.51.100.1, 203.0.113.7")).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    // Another client through the same balancer has its own bucket.
    assert_eq!(send(balancer, Some("203.0.113.8")).await, StatusCode::OK);
    // A client reaching the host directly cannot take another's key by writing it.
    assert_eq!(
        send("192.0.2.50:5000", Some("203.0.113.9")).await,
        StatusCode::OK
    );
    assert_eq!(
        send("192.0.2.50:5000", Some("203.0.113.10")).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    // Two addresses of one IPv6 network are one client.
    assert_eq!(
        send(balancer, Some("2001:db8:0:1::a")).await,
        StatusCode::OK
    );
    assert_eq!(
        send(balancer, Some("2001:db8:0:1::b")).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    // No peer address at all (the app served without ConnectInfo): no key, refused as such.
    let no_peer = app
        .clone()
        .oneshot(Request::get("/").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(no_peer.status(), StatusCode::BAD_REQUEST);
}

/// With `x_ratelimit_headers(true)`, responses also carry the de facto `X-RateLimit-*`
/// headers: the limit's capacity, the tokens left and the seconds until they are back; off by
/// default.
#[tokio::test]
async fn x_ratelimit_headers_tell_the_capacity_what_is_left_and_when_it_is_back() {
    use hierarchical_throttle::DefaultRejection;

    let clock = ManualClock::new();
    let layer = |x_ratelimit: bool| {
        HierarchicalThrottleLayer::builder()
            .cold_start(hierarchical_throttle::ColdStart::Exact)
            .key(|req: &Request<Body>| key::header_value(req, "x-api-key"))
            .clock(clock.clone())
            .limit(Limit::per_second(1).burst(3).unwrap())
            .on_rejection(DefaultRejection::by_content_type().x_ratelimit_headers(x_ratelimit))
            .global_store(MemoryGlobalStore::with_clock(clock.clone()))
            .build()
            .unwrap()
    };
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer(true));
    let x = |response: &http::Response<Body>| {
        [
            "x-ratelimit-limit",
            "x-ratelimit-remaining",
            "x-ratelimit-reset",
        ]
        .map(|name| response.headers()[name].to_str().unwrap().to_owned())
    };
    let first = get_status(&app, "/", Some("k1")).await;
    assert_eq!(x(&first), ["3", "2", "1"]);
    get_status(&app, "/", Some("k1")).await;
    let third = get_status(&app, "/", Some("k1")).await;
    assert_eq!(x(&third), ["3", "0", "3"]);
    clock.advance(Duration::from_millis(200));
    let refused = get_status(&app, "/", Some("k1")).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(x(&refused), ["3", "0", "1"]);
    assert_eq!(refused.headers()["retry-after"], "1");

    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer(false));
    let plain = get_status(&app, "/", Some("k2")).await;
    assert!(plain.headers().get("x-ratelimit-remaining").is_none());
    assert!(plain.headers().get("ratelimit").is_some());
}

#[tokio::test]
async fn exempt_requests_pass_untouched_while_their_key_is_throttled() {
    let clock = ManualClock::new();
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key(|req: &Request<Body>| key::header_value(req, "x-api-key"))
        .clock(clock.clone())
        .limit(Limit::per_second(1).burst(2).unwrap())
        .exempt(|req: &Request<Body>| req.uri().path() == "/health")
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route("/health", get(|| async { "up" }))
        .layer(layer.clone());

    // k1 spends its burst and is throttled; its health checks still pass, told nothing.
    for _ in 0..2 {
        assert_eq!(
            get_status(&app, "/", Some("k1")).await.status(),
            StatusCode::OK
        );
    }
    let refused = get_status(&app, "/", Some("k1")).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let health = get_status(&app, "/health", Some("k1")).await;
    assert_eq!(health.status(), StatusCode::OK);
    assert!(health.headers().get("ratelimit").is_none());
    assert!(health.headers().get("ratelimit-policy").is_none());
    assert_eq!(text(health).await, "up");
    // Without a key: not refused as missing one.
    let keyless = get_status(&app, "/health", None).await;
    assert_eq!(keyless.status(), StatusCode::OK);

    // Exempt requests take nothing: k2 keeps its whole burst, and no store call is made.
    let calls = layer.stats().global_calls;
    for _ in 0..5 {
        assert_eq!(
            get_status(&app, "/health", Some("k2")).await.status(),
            StatusCode::OK
        );
    }
    assert_eq!(layer.stats().global_calls, calls);
    for _ in 0..2 {
        assert_eq!(
            get_status(&app, "/", Some("k2")).await.status(),
            StatusCode::OK
        );
    }
    assert_eq!(
        get_status(&app, "/", Some("k2")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );

    let stats = layer.stats();
    assert_eq!(stats.requests_exempt, 7);
    assert_eq!(stats.requests_admitted, 4);
    assert_eq!(stats.requests_refused, 2);
    assert_eq!(stats.missing_key, 0);
}

/// The README's lead example (every setting at its default) on one host, on tokio's clock, with
/// a key limited to 100/s burst 100.
fn lead_example() -> Router {
    let clock = hierarchical_throttle::clock::TokioClock::new();
    lead_example_on(&MemoryGlobalStore::with_clock(clock))
}

/// The lead example as one host of a fleet sharing `global`.
fn lead_example_on(global: &MemoryGlobalStore<key::CompactKey, TokioClock>) -> Router {
    Router::new().route("/", get(|| async { "ok" })).layer(
        HierarchicalThrottleLayer::builder()
            .key_ref(|req: &Request<Body>| key::header_bytes(req, "x-api-key"))
            .clock(TokioClock::new())
            .limit(Limit::per_second(100).burst(100).unwrap())
            .global_store(global.clone())
            .build()
            .unwrap(),
    )
}

/// Sends `requests` of key `k` at one instant; returns how many were served.
async fn burst(app: &Router, requests: usize) -> usize {
    burst_at(std::slice::from_ref(app), requests).await
}

/// Sends `requests` of key `k` to each of `hosts`, all at one instant; returns how many were
/// served.
async fn burst_at(hosts: &[Router], requests: usize) -> usize {
    let burst = hosts
        .iter()
        .flat_map(|app| (0..requests).map(move |_| get_status(app, "/", Some("k"))));
    futures_util::future::join_all(burst)
        .await
        .iter()
        .filter(|r| r.status() == StatusCode::OK)
        .count()
}

/// The lead example's key, served slowly at one of several rates, then a burst of 300 at one
/// of twenty moments after. A perfect bucket would have refilled to its capacity: the burst
/// gets at most that, though the host held leased tokens of the key while its global bucket
/// refilled around them (its fetch takes that refill back first), and at most a tenth less
/// (what it takes back is reckoned from what it held at its last answer or sweep, and the
/// traffic served since is counted as held).
#[tokio::test(start_paused = true)]
async fn a_burst_after_slow_traffic_gets_at_most_the_capacity() {
    let mut bursts = Vec::new();
    for every_ms in [1000, 300, 100, 37] {
        for moment in 0..20u64 {
            let app = lead_example();
            for _ in 0..10_000 / every_ms {
                let served = get_status(&app, "/", Some("k")).await.status();
                assert_eq!(served, StatusCode::OK, "far from the limit");
                tokio::time::sleep(Duration::from_millis(every_ms)).await;
            }
            tokio::time::sleep(Duration::from_millis(moment * 97)).await;
            bursts.push((every_ms, moment * 97, burst(&app, 300).await));
        }
    }
    println!("(every ms, burst after ms, admitted): {bursts:?}");
    assert!(bursts.iter().all(|&(_, _, n)| (90..=100).contains(&n)));
    assert!(bursts.iter().any(|&(_, _, n)| n == 100));
}

/// The lead example's key served at 10x, 5x, 1.1x or half its limit for 5 s, then quiet for
/// less than the lease time-to-live (so the host still holds its last batch) but long enough
/// for the global bucket to refill, then a burst of 300: at most the capacity.
#[tokio::test(start_paused = true)]
async fn a_burst_after_busy_traffic_and_a_short_quiet_gets_at_most_the_capacity() {
    let mut bursts = Vec::new();
    for every_us in [1_000, 2_000, 9_000, 20_000] {
        for quiet_ms in [1_200, 1_900] {
            let app = lead_example();
            for _ in 0..5_000_000 / every_us {
                get_status(&app, "/", Some("k")).await;
                tokio::time::sleep(Duration::from_micros(every_us)).await;
            }
            tokio::time::sleep(Duration::from_millis(quiet_ms)).await;
            bursts.push((every_us, quiet_ms, burst(&app, 300).await));
        }
    }
    println!("(every us, quiet ms, admitted): {bursts:?}");
    assert!(bursts.iter().all(|&(_, _, n)| (90..=100).contains(&n)));
}

/// Four hosts of the lead example serve the key slowly or at four fifths of its limit, go
/// quiet, then a burst comes to every host at once, and heavy traffic after it. The first
/// host's fetch takes the whole refilled bucket; the others spend what they held on top, and
/// can take back none of the refill: they owe it, and their next fetches take it back. So
/// windows from the burst exceed the bound only while shorter than about what the hosts held
/// at the key's rate; every window of a second and a half or more holds it.
#[tokio::test(start_paused = true)]
async fn a_burst_at_every_host_at_once_is_taken_back_out_of_the_refill_after_it() {
    let mut runs = Vec::new();
    for every_ms in [1_000, 50] {
        let global = MemoryGlobalStore::with_clock(TokioClock::new());
        let hosts: Vec<Router> = (0..4).map(|_| lead_example_on(&global)).collect();
        for _ in 0..10_000 / every_ms {
            for app in &hosts {
                let served = get_status(app, "/", Some("k")).await.status();
                assert_eq!(served, StatusCode::OK, "under the limit");
            }
            tokio::time::sleep(Duration::from_millis(every_ms)).await;
        }
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        // Admitted from the burst to the end of each 10 ms after it.
        let mut admitted = vec![burst_at(&hosts, 300).await];
        for _ in 0..300 {
            tokio::time::sleep(Duration::from_millis(10)).await;
            let since = admitted[admitted.len() - 1] + burst_at(&hosts, 20).await;
            admitted.push(since);
        }
        // What each window from the burst admitted past `capacity + rate x length`.
        let excess: Vec<i64> = (admitted.iter().enumerate())
            .map(|(tens_of_ms, &n)| n as i64 - (100 + tens_of_ms as i64))
            .collect();
        runs.push((every_ms, admitted[0], excess));
    }
    for (every_ms, burst, excess) in &runs {
        println!(
            "every {every_ms} ms: burst {burst}, past the bound after 0.5 s {}, 1 s {}, 1.5 s {}",
            excess[50], excess[100], excess[150]
        );
        assert!(
            *burst > 100,
            "the other hosts spent what they held: {burst}"
        );
        let longest_over = excess.iter().rposition(|&e| e > 0).unwrap_or(0);
        assert!(
            longest_over < 150,
            "every {every_ms} ms: a window of {} ms from the burst exceeded the bound",
            longest_over * 10
        );
    }
}

//! The layer inside a `ServiceBuilder` stack with tower-http's CORS layer, as the README
//! recommends: CORS outside the throttle, so a 429 still carries the CORS headers and browsers
//! may read `Retry-After` and the `RateLimit` fields.

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore, key};
use http::{HeaderName, Method, Request, StatusCode, header};
use tower::{ServiceBuilder, ServiceExt};
use tower_http::cors::{Any, CorsLayer};

fn app() -> Router {
    let throttle = HierarchicalThrottleLayer::builder()
        .key(|req: &Request<Body>| key::header_value(req, "x-api-key"))
        .limit(Limit::per_minute(1).burst(1).unwrap())
        .global_store(MemoryGlobalStore::new())
        .build()
        .unwrap();
    let cors = CorsLayer::new()
        .allow_origin(Any)
        .allow_headers([HeaderName::from_static("x-api-key")])
        .expose_headers([
            header::RETRY_AFTER,
            HeaderName::from_static("ratelimit"),
            HeaderName::from_static("ratelimit-policy"),
        ]);
    Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(ServiceBuilder::new().layer(cors).layer(throttle))
}

fn call(method: Method) -> Request<Body> {
    Request::builder()
        .method(method)
        .uri("/")
        .header(header::ORIGIN, "https://app.example")
        .header("x-api-key", "k1")
        .header(header::ACCESS_CONTROL_REQUEST_METHOD, "GET")
        .body(Body::empty())
        .unwrap()
}

#[tokio::test]
async fn a_429_behind_cors_carries_cors_headers_and_exposes_the_rate_limit_fields() {
    let app = app();
    assert_eq!(
        app.clone()
            .oneshot(call(Method::GET))
            .await
            .unwrap()
            .status(),
        StatusCode::OK
    );
    let throttled = app.clone().oneshot(call(Method::GET)).await.unwrap();
    assert_eq!(throttled.status(), StatusCode::TOO_MANY_REQUESTS);
    let headers = throttled.headers();
    assert_eq!(headers[header::ACCESS_CONTROL_ALLOW_ORIGIN], "*");
    assert_eq!(headers[header::RETRY_AFTER], "60");
    let exposed = headers[header::ACCESS_CONTROL_EXPOSE_HEADERS]
        .to_str()
        .unwrap()
        .to_ascii_lowercase();
    for name in ["retry-after", "ratelimit", "ratelimit-policy"] {
        assert!(exposed.contains(name), "{name} is not exposed: {exposed}");
    }
    // Preflights are answered by CORS before the throttle: even a throttled key's succeeds.
    let preflight = app.clone().oneshot(call(Method::OPTIONS)).await.unwrap();
    assert_eq!(preflight.status(), StatusCode::OK);
}

//! An axum `Router` throttled by an API-key header, on a manual clock and an in-memory store.

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use hierarchical_throttle::clock::ManualClock;
use hierarchical_throttle::{ColdStart, HierarchicalThrottleLayer, Limit, MemoryGlobalStore, key};
use http::Request;
use tower::ServiceExt;

/// `GET /` answering "ok", throttled per `x-api-key` by `limit`, on `clock`.
pub fn app(clock: &ManualClock, limit: Limit, cold_start: ColdStart) -> Router {
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(cold_start)
        .key(|req: &Request<Body>| key::header_value(req, "x-api-key"))
        .clock(clock.clone())
        .limit(limit)
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer)
}

/// `GET /` with `api_key`.
pub async fn call(app: &Router, api_key: &str) -> http::Response<Body> {
    let req = Request::get("/").header("x-api-key", api_key);
    app.clone()
        .oneshot(req.body(Body::empty()).unwrap())
        .await
        .unwrap()
}

//! The app of `examples/prometheus.rs`, shared with `tests/metrics.rs`: a throttled route and,
//! beside it and not throttled, `/metrics` in the Prometheus text format.

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use hierarchical_throttle::clock::Clock;
use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore, key};
use http::Request;
use metrics_exporter_prometheus::PrometheusHandle;

/// `/` throttled per `x-api-key` at `limit` (a layer named `api`), and `/metrics`.
pub fn app(
    handle: PrometheusHandle,
    limit: Limit,
    clock: impl Clock,
) -> Result<Router, hierarchical_throttle::ConfigError> {
    let throttle = HierarchicalThrottleLayer::builder()
        .key_ref(|req: &Request<Body>| key::header_str(req, "x-api-key"))
        .name("api")
        .limit(limit)
        .clock(clock)
        .global_store(MemoryGlobalStore::new())
        .build()?;
    let api = Router::new()
        .route("/", get(|| async { "hello\n" }))
        .layer(throttle);
    Ok(api.route("/metrics", get(move || async move { handle.render() })))
}

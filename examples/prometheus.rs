//! Run with: cargo run -p hierarchical-throttle-suite --example prometheus
//!
//! A throttled route on 127.0.0.1:3001 (3 requests per 10 s per `x-api-key`) and, beside it,
//! `/metrics` for Prometheus to scrape. The layer publishes its counters every half lease time
//! (1 s by default). Then:
//!
//! ```text
//! for i in $(seq 5); do curl -s -o /dev/null -w '%{http_code}\n' -H 'x-api-key: demo' http://127.0.0.1:3001/; done
//! sleep 1; curl -s http://127.0.0.1:3001/metrics | grep throttle_
//! ```

#[path = "support/prometheus_app.rs"]
mod prometheus_app;

use std::time::Duration;

use hierarchical_throttle::Limit;
use hierarchical_throttle::clock::MonotonicClock;
use hierarchical_throttle::metrics::GLOBAL_CALL_BUCKETS;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Buckets for the latency, so that it renders as a histogram (summable across hosts).
    let latency = Matcher::Full("throttle_global_call_seconds".to_owned());
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(latency, GLOBAL_CALL_BUCKETS)?
        .install_recorder()?;
    let limit = Limit::per(3, Duration::from_secs(10)).burst(3)?;
    let app = prometheus_app::app(handle, limit, MonotonicClock::new())?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3001").await?;
    println!("listening on http://127.0.0.1:3001 (metrics at /metrics)");
    axum::serve(listener, app).await?;
    Ok(())
}

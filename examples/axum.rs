//! Run with: cargo run --example axum
//!
//! An axum server on 127.0.0.1:3000, throttled per API key (the `x-api-key` header), or per
//! client IP for requests without one (IPv6 clients by their /64; behind a load balancer, use
//! `ClientIp::behind_networks` with its addresses): 5 requests per 10 seconds, bursts of 5.
//!
//! Then, in another terminal:
//!
//! ```text
//! for i in $(seq 7); do curl -si -H 'x-api-key: demo' http://127.0.0.1:3000/ | head -1; done
//! curl -si -H 'x-api-key: demo' http://127.0.0.1:3000/    # 429, Retry-After, RateLimit fields
//! curl -si http://127.0.0.1:3000/                          # keyed by your IP instead
//! curl -si http://127.0.0.1:3000/health                    # exempt: never limited
//! ```

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use hierarchical_throttle::key::{self, ClientIp};
use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore};
use http::Request;

/// The API key, or the client's IP when there is none: nobody escapes the limit by leaving
/// the header out.
fn throttle_key(client_ip: &ClientIp, req: &Request<Body>) -> Option<String> {
    key::header_value(req, "x-api-key")
        .map(|k| format!("key:{k}"))
        .or_else(|| Some(format!("ip:{}", client_ip.key(req)?)))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Served directly here; `ClientIp::behind_networks([..])` behind your load balancers.
    let client_ip = ClientIp::direct();
    let throttle = HierarchicalThrottleLayer::builder()
        .key(move |req: &Request<Body>| throttle_key(&client_ip, req))
        .limit(Limit::per(5, Duration::from_secs(10)).burst(5)?)
        // The load balancer's health checks are never limited (nor counted against anyone).
        .exempt(|req: &Request<Body>| req.uri().path() == "/health")
        .global_store(MemoryGlobalStore::new())
        .build()?;
    let app = Router::new()
        .route("/", get(|| async { "hello\n" }))
        .route("/health", get(|| async { "up\n" }))
        .layer(throttle.clone());

    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    println!("listening on http://127.0.0.1:3000 (5 requests per 10 s per key)");
    println!(
        "try: for i in $(seq 7); do curl -si -H 'x-api-key: demo' http://127.0.0.1:3000/ | head -1; done"
    );
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await?;
    // Drained: give the fleet back what this host leased, then report.
    throttle.return_all_leases().await;
    println!("\n{:?}", throttle.stats());
    Ok(())
}

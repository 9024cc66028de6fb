//! Run with: cargo run --example axum
//!
//! An axum server on 127.0.0.1:3000, throttled per API key (the `x-api-key` header), or per
//! peer IP for requests without one: 5 requests per 10 seconds, bursts of 5.
//!
//! Then, in another terminal:
//!
//! ```text
//! for i in $(seq 7); do curl -si -H 'x-api-key: demo' http://127.0.0.1:3000/ | head -1; done
//! curl -si -H 'x-api-key: demo' http://127.0.0.1:3000/    # 429, Retry-After, RateLimit fields
//! curl -si http://127.0.0.1:3000/                          # keyed by your IP instead
//! ```

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore, key};
use http::Request;

/// The API key, or the peer's IP when there is none: nobody escapes the limit by leaving the
/// header out.
fn throttle_key(req: &Request<Body>) -> Option<String> {
    key::header_value(req, "x-api-key")
        .map(|k| format!("key:{k}"))
        .or_else(|| {
            let ConnectInfo(peer) = req.extensions().get::<ConnectInfo<SocketAddr>>()?;
            Some(format!("ip:{}", peer.ip()))
        })
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let throttle = HierarchicalThrottleLayer::builder()
        .key(throttle_key)
        .limit(Limit::per(5, Duration::from_secs(10)).burst(5)?)
        .global_store(MemoryGlobalStore::new())
        .build()?;
    let app = Router::new()
        .route("/", get(|| async { "hello\n" }))
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

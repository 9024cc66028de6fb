//! Tiers and levels loaded from a TOML file (`examples/tiers.toml`).
//!
//! Run with: `cargo run -p hierarchical-throttle-suite --example config_file`

use std::collections::HashMap;
use std::sync::Arc;

use axum::{Router, body::Body, routing::get};
use hierarchical_throttle::{HierarchicalThrottleLayer, MemoryGlobalStore, Quota, key};
use http::Request;
use serde::Deserialize;

/// The file's shape: quotas by tier, and the levels' quotas.
#[derive(Debug, Deserialize)]
struct Settings {
    default_tier: String,
    tiers: HashMap<String, Quota>,
    levels: Levels,
}

#[derive(Debug, Deserialize)]
struct Levels {
    tenant: Quota,
    route: Quota,
}

/// Which tier an API key is on; a real service would read this from its database.
fn tier_of(api_key: &str) -> &'static str {
    if api_key.starts_with("pro-") {
        "pro"
    } else {
        "free"
    }
}

fn app(settings: Settings) -> Result<Router, Box<dyn std::error::Error>> {
    let tiers = Arc::new(settings.tiers);
    let fallback = tiers
        .get(&settings.default_tier)
        .cloned()
        .ok_or("default_tier names no tier")?;
    let layer = HierarchicalThrottleLayer::builder()
        .key_ref(|req: &Request<Body>| key::header_str(req, "x-api-key"))
        .limit_per_key(move |api_key: &String| {
            tiers
                .get(tier_of(api_key))
                .cloned()
                .unwrap_or_else(|| fallback.clone())
        })
        .level(
            "tenant",
            |req: &Request<Body>| key::header_value(req, "x-tenant"),
            settings.levels.tenant,
        )
        .level(
            "route",
            |req: &Request<Body>| (req.uri().path() == "/export").then(|| "export".to_owned()),
            settings.levels.route,
        )
        .global_store(MemoryGlobalStore::new())
        .build()?;
    Ok(Router::new()
        .route("/", get(|| async { "hello" }))
        .route("/export", get(|| async { "a large export" }))
        .layer(layer))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let settings: Settings = toml::from_str(include_str!("tiers.toml"))?;
    println!("tiers: {:?}", settings.tiers);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3002").await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app(settings)?).await?;
    Ok(())
}

//! Run with: cargo run -p hierarchical-throttle-suite --example tonic
//!
//! A gRPC server (`demo.Echo`) on 127.0.0.1:50051, throttled per `x-api-key` metadata (or per
//! peer IP without one): 5 calls per 10 seconds, bursts of 5. In another terminal, the client
//! mode sends 8 calls and prints what each got:
//!
//! ```text
//! cargo run -p hierarchical-throttle-suite --example tonic -- client
//! ```
//!
//! The sixth call on gets `RESOURCE_EXHAUSTED` with `retry-after` metadata and a
//! `google.rpc.RetryInfo` detail. Server-streaming calls count once, when they start.

#[path = "support/echo.rs"]
mod echo;

use std::time::Duration;

use echo::{EchoClient, EchoRequest, EchoServer};
use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore, key};
use tonic::transport::Server;

type Body = tonic::body::Body;
type Error = Box<dyn std::error::Error + Send + Sync>;

const ADDR: &str = "127.0.0.1:50051";

#[tokio::main]
async fn main() -> Result<(), Error> {
    match std::env::args().nth(1).as_deref() {
        Some("client") => client().await,
        _ => server().await,
    }
}

async fn server() -> Result<(), Error> {
    let throttle = HierarchicalThrottleLayer::builder()
        .key(|req: &http::Request<Body>| {
            key::header_value(req, "x-api-key")
                .or_else(|| key::tonic_peer_ip(req).map(|ip| ip.to_string()))
        })
        .limit(Limit::per(5, Duration::from_secs(10)).burst(5)?)
        .global_store(MemoryGlobalStore::new())
        .build()?;
    println!("serving demo.Echo on {ADDR} (5 calls per 10 s per key)");
    println!("try: cargo run -p hierarchical-throttle-suite --example tonic -- client");
    Server::builder()
        .layer(throttle)
        .add_service(EchoServer)
        .serve(ADDR.parse()?)
        .await?;
    Ok(())
}

async fn client() -> Result<(), Error> {
    let mut client = EchoClient::connect(format!("http://{ADDR}")).await?;
    for i in 1..=8 {
        let mut request = tonic::Request::new(EchoRequest {
            message: format!("call {i}"),
        });
        request.metadata_mut().insert("x-api-key", "demo".parse()?);
        match client.say(request).await {
            Ok(reply) => println!("{i}: OK {:?}", reply.into_inner().message),
            Err(status) => println!(
                "{i}: {:?} {:?}, retry-after {:?}",
                status.code(),
                status.message(),
                status.metadata().get("retry-after")
            ),
        }
    }
    Ok(())
}

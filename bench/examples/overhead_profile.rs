//! One side of the `layer_overhead` benchmark in a plain loop, for a profiler: `perf record`,
//! or `valgrind --tool=callgrind` (instruction counts, repeatable whatever else the machine is
//! doing; run two iteration counts and subtract to leave out the set-up).
//!
//! Run with: cargo run --release -p hierarchical-throttle-bench --example overhead_profile -- <side> <keys> <iterations>
//!
//! Sides: `unthrottled`, `tower_governor`, `tower_governor_header_name`, `throttled` (`key` with
//! `key::header_value`), `throttled_key_ref` (`key_ref` with `key::header_str`),
//! `throttled_key_ref_fields` (the same with the `RateLimit` fields), and `constant_key` (the
//! layer with a key read from nothing: what remains is the layer's own work).

use std::convert::Infallible;
use std::future::{Ready, ready};
use std::hint::black_box;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use governor::clock::QuantaInstant;
use governor::middleware::NoOpMiddleware;
use hierarchical_throttle::batch::FractionOfCapacity;
use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore, key};
use http::{HeaderName, Request, Response};
use tower::{Layer, Service, ServiceExt};
use tower_governor::GovernorError;
use tower_governor::GovernorLayer;
use tower_governor::governor::GovernorConfigBuilder;
use tower_governor::key_extractor::KeyExtractor;

const API_KEY: HeaderName = HeaderName::from_static("x-api-key");

/// The inner service: answers at once.
#[derive(Clone, Copy)]
struct Echo;

impl Service<Request<()>> for Echo {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Ready<Result<Response<Body>, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Request<()>) -> Self::Future {
        ready(Ok(Response::new(Body::empty())))
    }
}

/// tower_governor's key, the header's name given as text.
#[derive(Clone, Copy)]
struct ApiKey;

impl KeyExtractor for ApiKey {
    type Key = String;

    fn extract<T>(&self, req: &Request<T>) -> Result<String, GovernorError> {
        key::header_value(req, "x-api-key").ok_or(GovernorError::UnableToExtractKey)
    }
}

/// tower_governor's key, the header's name made once.
#[derive(Clone, Copy)]
struct ApiKeyByName;

impl KeyExtractor for ApiKeyByName {
    type Key = String;

    fn extract<T>(&self, req: &Request<T>) -> Result<String, GovernorError> {
        key::header_value(req, &API_KEY).ok_or(GovernorError::UnableToExtractKey)
    }
}

fn api_key(req: &Request<()>) -> Option<&str> {
    key::header_str(req, &API_KEY)
}

fn poll_once<F: std::future::Future>(future: F) -> Option<F::Output> {
    let mut context = Context::from_waker(std::task::Waker::noop());
    match std::pin::pin!(future).poll(&mut context) {
        Poll::Ready(output) => Some(output),
        Poll::Pending => None,
    }
}

/// Calls `service` `iterations` times over `requests` after one warm-up round.
fn run<S>(mut service: S, requests: &[Request<()>], iterations: usize)
where
    S: Service<Request<()>, Response = Response<Body>, Error = Infallible> + Clone,
{
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    for request in requests {
        let warm = runtime.block_on(service.clone().oneshot(request.clone()));
        assert!(warm.is_ok());
    }
    let _guard = runtime.enter();
    let mut i = 0;
    for _ in 0..iterations {
        i = if i + 1 == requests.len() { 0 } else { i + 1 };
        black_box(poll_once(service.call(black_box(requests[i].clone()))));
    }
}

fn governor<X: KeyExtractor>(
    extractor: X,
) -> GovernorLayer<X, NoOpMiddleware<QuantaInstant>, Body> {
    let config = GovernorConfigBuilder::default()
        .per_nanosecond(1)
        .burst_size(u32::MAX)
        .key_extractor(extractor)
        .finish()
        .expect("a valid governor config");
    GovernorLayer::new(config)
}

/// This layer with everything but the key and the fields set.
macro_rules! throttle {
    ($key_setter:ident, $key:expr, $fields:expr) => {
        HierarchicalThrottleLayer::builder()
            .$key_setter($key)
            .limit(
                Limit::per_second(1_000_000)
                    .burst(Limit::MAX_CAPACITY)
                    .expect("a valid limit"),
            )
            .batch_policy(FractionOfCapacity::new(1.0).expect("a fraction"))
            .lease_ttl(Duration::from_secs(3600))
            .ratelimit_fields($fields)
            .global_store(MemoryGlobalStore::new())
            .build()
            .expect("a valid layer")
    };
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let side = args.get(1).map_or("throttled_key_ref", String::as_str);
    let keys: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(1_000);
    let iterations: usize = args
        .get(3)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1_000_000);
    let requests: Vec<Request<()>> = (0..keys)
        .map(|i| {
            Request::get("/")
                .header("x-api-key", format!("customer-{i:06}"))
                .body(())
                .expect("a valid request")
        })
        .collect();
    let owned = |req: &Request<()>| key::header_value(req, "x-api-key");
    match side {
        "unthrottled" => run(Echo, &requests, iterations),
        "tower_governor" => run(governor(ApiKey).layer(Echo), &requests, iterations),
        "tower_governor_header_name" => {
            run(governor(ApiKeyByName).layer(Echo), &requests, iterations)
        }
        "throttled" => run(
            throttle!(key, owned, false).layer(Echo),
            &requests,
            iterations,
        ),
        "throttled_key_ref" => run(
            throttle!(key_ref, api_key, false).layer(Echo),
            &requests,
            iterations,
        ),
        "throttled_key_ref_fields" => run(
            throttle!(key_ref, api_key, true).layer(Echo),
            &requests,
            iterations,
        ),
        "constant_key" => run(
            throttle!(key, |_: &Request<()>| Some(7u64), false).layer(Echo),
            &requests,
            iterations,
        ),
        other => {
            eprintln!("unknown side {other}: see the example's header");
            std::process::exit(2);
        }
    }
}

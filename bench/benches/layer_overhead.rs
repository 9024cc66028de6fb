//! What the whole layer adds to a trivial service when the key is a request header, over 1 and
//! 1,000 keys, every request admitted, in the same run: the unthrottled service;
//! tower_governor (GCRA per host) with its key made by `key::header_value` (a `String` per
//! request), the header's name given as text and as a `HeaderName` made once; and this layer
//! with its default rejection: the same `String` key (`key`), the key borrowed from the header
//! (`key_ref` with `key::header_str` and a `HeaderName`), both with the `RateLimit` fields on
//! admitted responses turned off, and the borrowed key with them on (the default), beside
//! tower_governor with its own headers on (`use_headers`, the name made once). Each iteration
//! clones a prepared request.
//!
//! Run with: cargo bench -p hierarchical-throttle-bench --bench layer_overhead

use std::convert::Infallible;

use axum::body::Body;
use std::future::{Ready, ready};
use std::hint::black_box;
use std::task::{Context, Poll};
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use governor::clock::QuantaInstant;
use governor::middleware::{NoOpMiddleware, StateInformationMiddleware};
use hierarchical_throttle::batch::FractionOfCapacity;
use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore, key};
use http::{Request, Response};
use tower::{Layer, Service, ServiceExt};
use tower_governor::GovernorError;
use tower_governor::GovernorLayer;
use tower_governor::governor::GovernorConfigBuilder;
use tower_governor::key_extractor::KeyExtractor;

/// The key's header, parsed once.
const API_KEY: http::HeaderName = http::HeaderName::from_static("x-api-key");

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

/// tower_governor's key: the header's value as a `String`, its name given as text.
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

/// This layer's borrowed key: a function, as a closure kept in a variable would not borrow its
/// result from its argument.
fn api_key(req: &Request<()>) -> Option<&str> {
    key::header_str(req, &API_KEY)
}

fn requests(keys: usize) -> Vec<Request<()>> {
    (0..keys)
        .map(|i| {
            Request::get("/")
                .header("x-api-key", format!("customer-{i:06}"))
                .body(())
                .expect("a valid request")
        })
        .collect()
}

fn poll_once<F: std::future::Future>(future: F) -> Option<F::Output> {
    let mut context = Context::from_waker(std::task::Waker::noop());
    match std::pin::pin!(future).poll(&mut context) {
        Poll::Ready(output) => Some(output),
        Poll::Pending => None,
    }
}

fn limit() -> Limit {
    Limit::per_second(1_000_000)
        .burst(Limit::MAX_CAPACITY)
        .expect("a valid limit")
}

/// Measures `service` on `requests` after one warm-up round (every key then holds tokens).
fn measure<S>(c: &mut Criterion, name: String, mut service: S, requests: &[Request<()>])
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
    c.bench_function(&name, |b| {
        b.iter(|| {
            i = if i + 1 == requests.len() { 0 } else { i + 1 };
            black_box(poll_once(service.call(black_box(requests[i].clone()))))
        })
    });
}

/// tower_governor with `use_headers`: its `x-ratelimit-*` headers on every admitted response.
fn governor_with_headers<X>(extractor: X) -> GovernorLayer<X, StateInformationMiddleware, Body>
where
    X: KeyExtractor,
{
    let config = GovernorConfigBuilder::default()
        .per_nanosecond(1)
        .burst_size(u32::MAX)
        .key_extractor(extractor)
        .use_headers()
        .finish()
        .expect("a valid governor config");
    GovernorLayer::new(config)
}

fn governor<X>(extractor: X) -> GovernorLayer<X, NoOpMiddleware<QuantaInstant>, Body>
where
    X: KeyExtractor,
{
    let config = GovernorConfigBuilder::default()
        .per_nanosecond(1)
        .burst_size(u32::MAX)
        .key_extractor(extractor)
        .finish()
        .expect("a valid governor config");
    GovernorLayer::new(config)
}

/// This layer's builder with everything but the key and the fields set.
macro_rules! throttle {
    ($key_setter:ident, $key:expr, $fields:expr) => {
        HierarchicalThrottleLayer::builder()
            .$key_setter($key)
            .limit(limit())
            .batch_policy(FractionOfCapacity::new(1.0).expect("a fraction"))
            .lease_ttl(Duration::from_secs(3600))
            .ratelimit_fields($fields)
            .global_store(MemoryGlobalStore::new())
            .build()
            .expect("a valid layer")
    };
}

fn bench(c: &mut Criterion) {
    for keys in [1, 1_000] {
        let requests = requests(keys);
        let name = |side: &str| format!("layer_overhead/{side}/{keys}");
        measure(c, name("unthrottled"), Echo, &requests);
        let side = governor(ApiKey).layer(Echo);
        measure(c, name("tower_governor"), side, &requests);
        let side = governor(ApiKeyByName).layer(Echo);
        measure(c, name("tower_governor_header_name"), side, &requests);
        let owned = |req: &Request<()>| key::header_value(req, "x-api-key");
        let side = throttle!(key, owned, false).layer(Echo);
        measure(c, name("throttled"), side, &requests);
        let side = throttle!(key_ref, api_key, false).layer(Echo);
        measure(c, name("throttled_key_ref"), side, &requests);
        let side = governor_with_headers(ApiKeyByName).layer(Echo);
        measure(c, name("tower_governor_headers"), side, &requests);
        let side = throttle!(key_ref, api_key, true).layer(Echo);
        measure(c, name("throttled_key_ref_fields"), side, &requests);
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);

//! The sides of the whole-layer comparison (`layer_overhead`, and the `overhead_profile`
//! example that runs one of them under a profiler): a trivial inner service, tower_governor's
//! keys, and this layer, all keyed by the `x-api-key` header.

use std::convert::Infallible;
use std::future::{Ready, ready};
use std::task::{Context, Poll};

use axum::body::Body;
use governor::middleware::RateLimitingMiddleware;
use hierarchical_throttle::{Limit, key};
use http::{HeaderName, Request, Response};
use tower::Service;
use tower_governor::governor::GovernorConfigBuilder;
use tower_governor::key_extractor::KeyExtractor;
use tower_governor::{GovernorError, GovernorLayer};

/// The key's header, parsed once.
pub const API_KEY: HeaderName = HeaderName::from_static("x-api-key");

/// The inner service: answers at once.
#[derive(Clone, Copy)]
pub struct Echo;

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
pub struct ApiKey;

impl KeyExtractor for ApiKey {
    type Key = String;

    fn extract<T>(&self, req: &Request<T>) -> Result<String, GovernorError> {
        key::header_value(req, "x-api-key").ok_or(GovernorError::UnableToExtractKey)
    }
}

/// tower_governor's key, the header's name made once.
#[derive(Clone, Copy)]
pub struct ApiKeyByName;

impl KeyExtractor for ApiKeyByName {
    type Key = String;

    fn extract<T>(&self, req: &Request<T>) -> Result<String, GovernorError> {
        key::header_value(req, &API_KEY).ok_or(GovernorError::UnableToExtractKey)
    }
}

/// This layer's key made as a `String`, as tower_governor's is.
pub fn owned_key(req: &Request<()>) -> Option<String> {
    key::header_value(req, "x-api-key")
}

/// This layer's borrowed key: a function, as a closure kept in a variable would not borrow its
/// result from its argument.
pub fn api_key(req: &Request<()>) -> Option<&str> {
    key::header_str(req, &API_KEY)
}

/// This layer's borrowed key as bytes: no UTF-8 check, kept as a `CompactKey` (inline).
pub fn api_key_bytes(req: &Request<()>) -> Option<&[u8]> {
    key::header_bytes(req, &API_KEY)
}

/// `keys` requests, one per key.
/// A fleet-wide concurrency limit no key reaches (1,000 in flight per key), keyed by
/// `x-api-key`, with or without the `RateLimit` fields on admitted responses. Holdings last an
/// hour and free slots stay on the host: the runtime is not driven while measuring, so a
/// holding could not be renewed, nor a slot given back be fetched again.
pub fn in_flight(
    fields: bool,
) -> hierarchical_throttle::HierarchicalConcurrencyLayer<
    Request<()>,
    String,
    hierarchical_throttle::MemoryGlobalStore<String>,
> {
    hierarchical_throttle::HierarchicalConcurrencyLayer::builder()
        .key(owned_key)
        .max_in_flight(1_000)
        .slot_ttl(std::time::Duration::from_secs(3_600))
        .linger(std::time::Duration::from_secs(900))
        .ratelimit_fields(fields)
        .store(hierarchical_throttle::MemoryGlobalStore::new())
        .build()
        .expect("a valid layer")
}

pub fn requests(keys: usize) -> Vec<Request<()>> {
    (0..keys)
        .map(|i| {
            Request::get("/")
                .header("x-api-key", format!("customer-{i:06}"))
                .body(())
                .expect("a valid request")
        })
        .collect()
}

/// A limit no side reaches: every request is admitted.
pub fn limit() -> Limit {
    Limit::per_second(1_000_000)
        .burst(Limit::MAX_CAPACITY)
        .expect("a valid limit")
}

/// A limit every key is over once its first request is served: one a day, burst 1.
pub fn spent_limit() -> Limit {
    Limit::per_day(1).build().expect("a valid limit")
}

/// tower_governor refusing every request after a key's first (one a day, burst 1), with its
/// headers on, the header's name made once.
pub fn governor_refusing()
-> GovernorLayer<ApiKeyByName, governor::middleware::StateInformationMiddleware, Body> {
    let config = tower_governor::governor::GovernorConfigBuilder::default()
        .key_extractor(ApiKeyByName)
        .use_headers()
        .per_second(86_400)
        .burst_size(1)
        .finish()
        .expect("a valid governor config");
    GovernorLayer::new(config)
}

/// tower_governor, as `config` (a key extractor, and `use_headers` or not) sets it, with a
/// limit no side reaches.
pub fn governor<X, M>(mut config: GovernorConfigBuilder<X, M>) -> GovernorLayer<X, M, Body>
where
    X: KeyExtractor,
    M: RateLimitingMiddleware<governor::clock::QuantaInstant>,
{
    let config = config
        .per_nanosecond(1)
        .burst_size(u32::MAX)
        .finish()
        .expect("a valid governor config");
    GovernorLayer::new(config)
}

/// This layer with its key set by `$key_setter` (`key` or `key_ref`) to `$key`, the
/// `RateLimit` fields on or off, a limit no side reaches (or `$limit`), and every other setting at its
/// default (a slow key's batches are a sixteenth of the capacity while it is far from its
/// limit, so the benchmark needs no tuned batch policy).
#[macro_export]
macro_rules! throttle {
    ($key_setter:ident, $key:expr, $fields:expr) => {
        $crate::throttle!($key_setter, $key, $fields, $crate::sides::limit())
    };
    ($key_setter:ident, $key:expr, $fields:expr, $limit:expr) => {
        hierarchical_throttle::HierarchicalThrottleLayer::builder()
            .$key_setter($key)
            .limit($limit)
            .ratelimit_fields($fields)
            .global_store(hierarchical_throttle::MemoryGlobalStore::new())
            .build()
            .expect("a valid layer")
    };
    // Every request refused from the throttled-key cache, for the whole run: the cache keeps a
    // key an hour (by default a lease TTL, 2 s, after which one request asks the store again,
    // and a loop that does not drive the runtime never hears its answer).
    (refusing $key_setter:ident, $key:expr, $fields:expr) => {
        hierarchical_throttle::HierarchicalThrottleLayer::builder()
            .$key_setter($key)
            .limit($crate::sides::spent_limit())
            .refusal_memory(std::time::Duration::from_secs(3600))
            .ratelimit_fields($fields)
            .global_store(hierarchical_throttle::MemoryGlobalStore::new())
            .build()
            .expect("a valid layer")
    };
}

/// Sends every request of `requests` through `service` for a few rounds, each followed by
/// the time the batches it started take to land, so that what is measured after is the hit
/// path: a cold key passes on credit and its first batch pays that credit; the next round
/// learns the global bucket's level, and the batch it starts fills the lease for the run. One
/// round in a debug build, where the test suite runs each benchmark once to see it work.
pub fn warm_up<S>(runtime: &tokio::runtime::Runtime, service: &S, requests: &[Request<()>])
where
    S: Service<Request<()>, Error = Infallible> + Clone,
{
    use tower::ServiceExt;
    let rounds = if cfg!(debug_assertions) { 1 } else { 3 };
    for _ in 0..rounds {
        for request in requests {
            let warm = runtime.block_on(service.clone().oneshot(request.clone()));
            assert!(warm.is_ok());
        }
        runtime.block_on(async { tokio::time::sleep(crate::support::BATCHES_LAND).await });
    }
}

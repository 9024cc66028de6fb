//! Tower middleware that throttles requests per key across a whole fleet of hosts, with
//! hierarchical token buckets.
//!
//! ```
//! use axum::{Router, body::Body, routing::get};
//! use http::{Request, StatusCode};
//! use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore, key};
//! use tower::ServiceExt;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let global = MemoryGlobalStore::new(); // one per process; RedisGlobalStore for a fleet
//! let app = Router::new().route("/", get(|| async { "hello" })).layer(
//!     HierarchicalThrottleLayer::builder()
//!         .key_ref(|req: &Request<Body>| key::header_bytes(req, "x-api-key"))
//!         .limit(Limit::per_second(1).burst(2)?)
//!         .global_store(global.clone())
//!         .build()?,
//! );
//!
//! let call = || Request::get("/").header("x-api-key", "k1").body(Body::empty());
//! assert_eq!(app.clone().oneshot(call()?).await?.status(), StatusCode::OK);
//! assert_eq!(app.clone().oneshot(call()?).await?.status(), StatusCode::OK);
//! let throttled = app.clone().oneshot(call()?).await?;
//! assert_eq!(throttled.status(), StatusCode::TOO_MANY_REQUESTS);
//! assert_eq!(throttled.headers()["retry-after"], "1");
//! # Ok(()) }
//! ```
//!
//! # How it works
//!
//! Each host keeps a **local** token bucket per key, filled with tokens leased in batches from
//! a **global** token bucket per key ([`MemoryGlobalStore`] in one process, a Redis store for a
//! fleet). A request is served from local tokens when it can be: one hash, one
//! compare-and-swap on a shard lock, no clock read, no I/O (a key hot on several cores lends
//! each of them a reserve, so they do not share that lock's line: [`CoreReserves`]). When the
//! local tokens run short, the host asks the global store for a batch sized by its recent
//! demand ([`batch`]); one request per key and host is in flight, and the requests that queued
//! for it are served from it in arrival order. A batch is also fetched in the background when the local tokens run low, so
//! steady traffic never waits. When the global bucket cannot give the whole batch, it reserves
//! for the host the tokens due soon (see
//! [`Builder::max_reservation`]), so a key over its limit costs one call per batch, not per
//! token. When the global bucket is empty, the key is remembered as throttled until its next
//! token is due (exactly: counted from when the call was sent) and refused without further
//! global calls, and the client is told how long to wait (`429` with `Retry-After`).
//!
//! A request this host holds no tokens for, on a key not known to be throttled (the first
//! request of a key on a host, a key too slow to keep a lease), is by default admitted at once
//! on a small credit ([`ColdStart`]): the fetch it starts pays for it, into debt when the
//! global bucket had run dry, which the fleet pays before that key is admitted again. So no
//! decision waits for the store unless a key is near its limit, and a bucket admits at most
//! `capacity + rate × t + hosts × credit` (a credit of 1 % of the capacity, at least one token);
//! [`ColdStart::Exact`] makes such requests wait, for `capacity + rate × t`.
//!
//! Tokens leased to a host and not used within the lease time-to-live are handed back, so the
//! fleet admits close to its limit: every leased token was dispensed once by the global bucket.
//! A host about to stop hands back all it holds with
//! [`HierarchicalThrottleLayer::return_all_leases`].
//!
//! Beyond one limit per key: a [`Quota`] of several named limits and further
//! [levels](Builder::level) of keys, all or nothing; limits that [warm up](Limit::warm_up)
//! after idleness; [calendar quotas](Limit::per_calendar) (a day, week or month, in UTC, at a
//! fixed offset or, with the `tz` feature, in a time zone); [`Shaping`] to wait for tokens instead of being refused; [`Builder::settle`] to correct a cost from the response; `RateLimit-Policy`
//! and `RateLimit` fields on every response ([`RateLimitFields`], draft revision 11); limits
//! and levels in shadow ([`Builder::shadow_limit`]); uses outside a service on every level
//! ([`HierarchicalThrottleLayer::acquire_keys`]); bodies charged by the byte ([`MeteredBody`]);
//! a type-erased [`ThrottleHandle`] for application state; read-only views
//! ([`HierarchicalThrottleLayer::remaining`]); requests [exempt](Builder::exempt) from every
//! limit; clients keyed past trusted proxies ([`key::ClientIp`]); and fleet-wide limits on
//! requests in flight ([`HierarchicalConcurrencyLayer`], slots leased to hosts like tokens).
//!
//! # Modules
//!
//! The crate is built in floors, each using only those below it (a test keeps it so):
//! foundations (errors, clocks, locks, arithmetic); the model ([`Limit`], [`Quota`], keys,
//! rejections, [`Remaining`], policies, counters); pure state machines (the token bucket, each
//! key's lease, each key's concurrency slots); the stores ([`local`], [`global`]); the engines
//! (fetching, back-off, the sweeper, settling, shaping; concurrency slots: plain decisions, no
//! HTTP); the answers (HTTP and gRPC rejections, the `RateLimit` fields); and the tower
//! surface (builder, layer, service, response future).
//!
//! - [`bucket`]: the lazy token bucket's exact arithmetic, shared by every store;
//! - [`global`]: the [`GlobalStore`](global::GlobalStore) trait, [`MemoryGlobalStore`] and, with
//!   the `redis` feature, `global::redis::RedisGlobalStore` (Redis, Redis Cluster, Sentinel;
//!   TLS with the `tls` feature), and with the `conformance` feature,
//!   `global::conformance`, the suite a store of your own must pass;
//! - [`local`]: the [`LocalStore`](local::LocalStore) trait and [`MemoryLocalStore`];
//! - [`batch`]: how many tokens a host asks for ([`batch::WeightedDemand`] by default);
//! - [`clock`]: [`clock::MonotonicClock`], and [`clock::ManualClock`] for exact tests;
//! - [`key`]: key helpers ([`key::ClientIp`] finds a client behind load balancers), the
//!   [`MissingKey`] policy, and [`Keys`] for uses on every level;
//! - [`metered`]: bodies charged by the byte as they stream ([`MeteredBody`]);
//! - [`concurrency`]: at most N requests in flight per key over the fleet
//!   ([`HierarchicalConcurrencyLayer`]), on the stores' [`SlotStore`](global::slots::SlotStore);
//! - [`quota`]: [`Quota`], and the identities of global and local buckets;
//! - [`grpc`]: gRPC rejections (`RESOURCE_EXHAUSTED` with retry information), chosen by
//!   [`DefaultRejection`] from the request's content type.
//!
//! [`HierarchicalThrottleLayer::acquire`] makes the same decision for a key outside a tower
//! service (a WebSocket message, a queued job).
//!
//! # Failures
//!
//! Every global call has a time-out; a failing store is left alone for a back-off, and the
//! requests whose call failed are decided by the [`FailurePolicy`] (by default, each host
//! enforces the limit on its own until the store is back). A slow store that answers in time
//! never hands a request to the policy. A fetch whose task dies (cancelled, panicking, its
//! runtime shut down) settles its key as failed, so no key is ever left waiting.
//!
//! # Runtime
//!
//! The service must run on a Tokio runtime with the time driver enabled (as axum and tonic do):
//! global calls have a time-out and background fetches are spawned.

// A refusal travels as a `Rejection` by value: boxing it would cost an allocation per refusal,
// on the path a key flood takes.
#![allow(clippy::result_large_err)]
#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]

mod arith;
pub mod batch;
pub mod bucket;
mod builder;
pub mod calendar;
mod call_queue;
pub mod clock;
pub mod concurrency;
mod credit;
mod error;
mod failure;
mod fields;
mod future;
pub mod global;
mod in_flight;
pub mod key;
mod layer;
mod lease;
mod limit;
pub mod local;
pub mod metered;
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub mod metrics;
mod policy;
pub mod quota;
mod rejection;
mod remaining;
mod response;
mod service;
mod slots;
mod stats;
mod sync;
mod throttle;

pub use builder::{Builder, MAX_LEVELS, Unset};
pub use concurrency::{
    AcquireSlot, ConcurrencyBuilder, ConcurrencyStats, HierarchicalConcurrency,
    HierarchicalConcurrencyLayer, SlotBody, SlotPermit,
};
pub use credit::ColdStart;
pub use error::{ConfigError, StoreError};
pub use failure::FailurePolicy;
pub use fields::{PartitionKey, RateLimitFields, Revision};
pub use future::{Acquire, ResponseFuture};
pub use global::memory::MemoryGlobalStore;
pub use key::{Keys, MissingKey};
#[cfg(feature = "redis")]
pub use layer::RedisThrottleLayer;
pub use layer::{
    BoxSettle, HierarchicalThrottleLayer, MemorySettlingLayer, MemoryThrottleLayer, SettleFn,
    ThrottleHandle,
};
pub use limit::{CalendarQuota, Limit, LimitBuilder};
pub use local::CoreReserves;
pub use local::memory::MemoryLocalStore;
pub use metered::MeteredBody;
pub use quota::Quota;
pub use rejection::{Rejection, RejectionReason};
pub use remaining::Remaining;
pub use response::grpc;
pub use response::{
    DefaultRejection, OnRejection, Settle, append_ratelimit_fields, http_problem_response,
    http_response,
};
pub use service::HierarchicalThrottle;
pub use stats::ThrottleStats;
pub use throttle::Admitted;
pub use throttle::shaping::{Reservation, Shaping};

/// The README's examples, run as doc tests.
#[cfg(all(doctest, feature = "redis", feature = "conformance"))]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

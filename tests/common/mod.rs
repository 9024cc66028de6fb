//! Shared test fixtures: a plain (non-HTTP) request type, hosts on a manual clock, and global
//! stores that record or fail.
#![allow(dead_code)]

pub mod conformance;
pub mod redis_server;

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hierarchical_throttle::clock::ManualClock;
use hierarchical_throttle::global::{GlobalStore, Grant, TokenRequest};
use hierarchical_throttle::{
    Builder, HierarchicalThrottleLayer, Limit, MemoryGlobalStore, MemoryLocalStore, Rejection,
    RejectionReason, Unset,
};
use tower::{Service, ServiceExt, service_fn};

/// A request that is not HTTP: a key and a cost.
#[derive(Debug, Clone)]
pub struct Job {
    pub key: Option<String>,
    pub cost: u64,
}

/// What a host answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Served,
    Refused(RejectionReason, Option<Duration>),
}

pub type Rejector = fn(&Job, Rejection<String>) -> Result<Outcome, Infallible>;

pub fn refuse(_: &Job, rejection: Rejection<String>) -> Result<Outcome, Infallible> {
    Ok(Outcome::Refused(rejection.reason, rejection.retry_after))
}

pub type Store = MemoryGlobalStore<String, ManualClock>;
pub type HostLayer<G = Store> =
    HierarchicalThrottleLayer<Job, String, G, MemoryLocalStore<String>, ManualClock, Rejector>;

/// A builder for a host of `Job`s on `clock`, keyed by `Job::key`, costing `Job::cost`.
pub fn host_builder(
    clock: &ManualClock,
    limit: Limit,
) -> Builder<Job, String, Unset, MemoryLocalStore<String>, ManualClock, Rejector> {
    HierarchicalThrottleLayer::builder()
        .key(|job: &Job| job.key.clone())
        .clock(clock.clone())
        .cost(|job: &Job| job.cost)
        .limit(limit)
        .on_rejection(refuse as Rejector)
}

pub fn backend() -> impl Service<Job, Response = Outcome, Error = Infallible, Future: Send> + Clone
{
    service_fn(|_: Job| async { Ok::<_, Infallible>(Outcome::Served) })
}

/// Sends one job through `service`.
pub async fn send<S>(service: &mut S, key: &str, cost: u64) -> Outcome
where
    S: Service<Job, Response = Outcome, Error = Infallible>,
{
    let job = Job {
        key: Some(key.to_owned()),
        cost,
    };
    match service.ready().await {
        Ok(ready) => match ready.call(job).await {
            Ok(outcome) => outcome,
            Err(never) => match never {},
        },
        Err(never) => match never {},
    }
}

/// Lets spawned background tasks (prefetches) run to completion on a current-thread runtime.
pub async fn settle_background() {
    for _ in 0..16 {
        tokio::task::yield_now().await;
    }
}

/// A global store that records every acquire and can be told to fail or to hang.
#[derive(Clone)]
pub struct FaultyStore<G> {
    inner: G,
    mode: Arc<AtomicU8>,
    pub acquires: Arc<Mutex<Vec<TokenRequest>>>,
    pub releases: Arc<AtomicU64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Fault {
    None = 0,
    Error = 1,
    Hang = 2,
}

#[derive(Debug)]
pub struct StoreDown;

impl std::fmt::Display for StoreDown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("store down")
    }
}

impl std::error::Error for StoreDown {}

impl<G> FaultyStore<G> {
    pub fn new(inner: G) -> Self {
        Self {
            inner,
            mode: Arc::new(AtomicU8::new(Fault::None as u8)),
            acquires: Arc::default(),
            releases: Arc::default(),
        }
    }

    pub fn set(&self, fault: Fault) {
        self.mode.store(fault as u8, Ordering::SeqCst);
    }

    fn fault(&self) -> u8 {
        self.mode.load(Ordering::SeqCst)
    }

    pub fn acquire_count(&self) -> usize {
        self.acquires.lock().unwrap().len()
    }
}

impl<K: Sync, G: GlobalStore<K>> GlobalStore<K> for FaultyStore<G> {
    type Error = StoreDown;

    fn acquire(
        &self,
        key: &K,
        limit: &Limit,
        request: TokenRequest,
    ) -> impl Future<Output = Result<Grant, StoreDown>> + Send {
        self.acquires.lock().unwrap().push(request);
        let fault = self.fault();
        let call = self.inner.acquire(key, limit, request);
        async move {
            match fault {
                0 => Ok(call.await.map_err(|_| StoreDown)?),
                1 => Err(StoreDown),
                _ => std::future::pending().await,
            }
        }
    }

    fn release(
        &self,
        key: &K,
        limit: &Limit,
        tokens: u64,
    ) -> impl Future<Output = Result<(), StoreDown>> + Send {
        self.releases.fetch_add(tokens, Ordering::SeqCst);
        let call = self.inner.release(key, limit, tokens);
        async move { call.await.map_err(|_| StoreDown) }
    }
}

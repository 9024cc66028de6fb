//! Shared test fixtures: a plain (non-HTTP) request type, hosts on a manual clock, and global
//! stores that record or fail.
#![allow(dead_code)]

pub mod calendar;
pub mod held_back;
pub mod levels;
pub mod proxy;
pub mod redis_server;
pub mod router;
pub mod stopping;
pub mod warm_up;

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hierarchical_throttle::clock::ManualClock;
use hierarchical_throttle::global::{
    Adjusted, Adjustment, BucketLevel, GlobalStore, Grant, TokenRequest, TokenReturn,
};
use hierarchical_throttle::quota::BucketKey;
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

/// A builder for a host of `Job`s on `clock`, keyed by `Job::key`, costing `Job::cost`; its
/// requests wait for the store rather than pass on credit (`ColdStart::Exact`), so that the
/// lease's paths show in what these tests count (credit has tests of its own).
pub fn host_builder(
    clock: &ManualClock,
    limit: Limit,
) -> Builder<Job, String, Unset, MemoryLocalStore<String>, ManualClock, Rejector> {
    HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
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
    send_job(service, job).await
}

/// Sends a job without a key, costing 1.
pub async fn send_without_key<S>(service: &mut S) -> Outcome
where
    S: Service<Job, Response = Outcome, Error = Infallible>,
{
    send_job(service, Job { key: None, cost: 1 }).await
}

async fn send_job<S>(service: &mut S, job: Job) -> Outcome
where
    S: Service<Job, Response = Outcome, Error = Infallible>,
{
    match service.ready().await {
        Ok(ready) => match ready.call(job).await {
            Ok(outcome) => outcome,
            Err(never) => match never {},
        },
        Err(never) => match never {},
    }
}

/// What a fleet run admitted.
#[derive(Debug)]
pub struct FleetRun {
    pub requests: u64,
    pub admitted: u64,
    /// What the limit allows over the run: burst + rate x time.
    pub allowed: u64,
    pub global_calls: u64,
}

impl FleetRun {
    /// Checks the fleet's promise: never more than the limit allows, and at least 97% of it.
    pub fn assert_holds_the_limit(&self) {
        let FleetRun {
            admitted, allowed, ..
        } = *self;
        assert!(admitted <= allowed, "over-admission: {self:?}");
        assert!(admitted * 100 >= allowed * 97, "under-admission: {self:?}");
    }
}

/// Four hosts on `global` with `limit`, on `clock`, for `seconds` simulated seconds: at each
/// millisecond, host `i` sends a request for `"tenant"` when `sends(i, ms)`. Every 500 ms each
/// host hands back its expired leases, as its background sweeper would.
pub async fn run_fleet<G>(
    clock: &ManualClock,
    global: G,
    limit: Limit,
    seconds: u64,
    sends: impl Fn(usize, u64) -> bool,
) -> FleetRun
where
    G: GlobalStore<BucketKey<String>> + Clone,
{
    run_hosts(4, clock, global, limit, seconds, |i, ms| {
        u64::from(sends(i, ms))
    })
    .await
}

/// `hosts` layers of [`host_builder`] with `limit`, on `global`.
pub fn host_layers<G>(
    hosts: usize,
    clock: &ManualClock,
    global: &G,
    limit: Limit,
) -> Vec<HostLayer<G>>
where
    G: GlobalStore<BucketKey<String>> + Clone,
{
    (0..hosts)
        .map(|_| {
            host_builder(clock, limit)
                .global_store(global.clone())
                .build()
                .unwrap()
        })
        .collect()
}

/// Like [`run_fleet`], with `hosts` hosts, host `i` sending `sends(i, ms)` requests at each
/// millisecond.
pub async fn run_hosts<G>(
    hosts: usize,
    clock: &ManualClock,
    global: G,
    limit: Limit,
    seconds: u64,
    sends: impl Fn(usize, u64) -> u64,
) -> FleetRun
where
    G: GlobalStore<BucketKey<String>> + Clone,
{
    let layers = host_layers(hosts, clock, &global, limit);
    let mut hosts: Vec<_> = layers
        .iter()
        .map(|l| tower::Layer::layer(l, backend()))
        .collect();
    let (mut requests, mut admitted) = (0, 0);
    for ms in 1..=seconds * 1000 {
        clock.set(Duration::from_millis(ms));
        for (i, host) in hosts.iter_mut().enumerate() {
            for _ in 0..sends(i, ms) {
                requests += 1;
                admitted += u64::from(send(host, "tenant", 1).await == Outcome::Served);
            }
        }
        if ms % 500 == 0 {
            for layer in &layers {
                layer.return_unused_leases().await;
            }
        }
    }
    let allowed = limit.capacity()
        + seconds * 1_000_000 * limit.refill_amount() / limit.refill_period().as_micros() as u64;
    let global_calls = layers.iter().map(|l| l.stats().global_calls).sum();
    FleetRun {
        requests,
        admitted,
        allowed,
        global_calls,
    }
}

/// Lets spawned background tasks (prefetches) run to completion on a current-thread runtime.
pub async fn settle_background() {
    for _ in 0..16 {
        tokio::task::yield_now().await;
    }
}

/// A global store that records every acquire and can be told to answer late, to fail (before
/// doing anything) or to hang.
#[derive(Clone)]
pub struct FaultyStore<G> {
    inner: G,
    mode: Arc<AtomicU8>,
    delay_micros: Arc<AtomicU64>,
    /// Up to this much more delay, varying from call to call (deterministically).
    spread_micros: Arc<AtomicU64>,
    pub acquires: Arc<Mutex<Vec<TokenRequest>>>,
    pub releases: Arc<AtomicU64>,
    /// How long a change by hand's answer comes after the change was made (on tokio's clock).
    adjust_answer_micros: Arc<AtomicU64>,
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
            delay_micros: Arc::default(),
            spread_micros: Arc::default(),
            acquires: Arc::default(),
            releases: Arc::default(),
            adjust_answer_micros: Arc::default(),
        }
    }

    /// A change by hand (or a read of a level) is made at once, its answer comes `delay` later
    /// (on tokio's clock).
    pub fn delay_adjust_answers(&self, delay: Duration) {
        self.adjust_answer_micros
            .store(delay.as_micros() as u64, Ordering::SeqCst);
    }

    pub fn set(&self, fault: Fault) {
        self.mode.store(fault as u8, Ordering::SeqCst);
    }

    /// Every answer (acquire and release) comes `delay` late (on tokio's clock).
    pub fn delay(&self, delay: Duration) {
        self.delay_micros
            .store(delay.as_micros() as u64, Ordering::SeqCst);
    }

    /// Every answer comes between `min` and `max` late, varying from call to call.
    pub fn delay_between(&self, min: Duration, max: Duration) {
        self.delay(min);
        self.spread_micros
            .store((max - min).as_micros() as u64, Ordering::SeqCst);
    }

    fn delayed(&self) -> Duration {
        let spread = self.spread_micros.load(Ordering::SeqCst);
        let calls = self.acquires.lock().unwrap().len() as u64;
        // A fixed, well-spread sequence: the same delays in every run.
        let extra = match spread {
            0 => 0,
            spread => calls.wrapping_mul(0x9E37_79B9_7F4A_7C15) % (spread + 1),
        };
        Duration::from_micros(self.delay_micros.load(Ordering::SeqCst) + extra)
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
        let delay = self.delayed();
        async move {
            tokio::time::sleep(delay).await;
            // The store is asked only when it does not fail first (a store may do its work
            // when called, before its future is awaited).
            match fault {
                0 => Ok(self
                    .inner
                    .acquire(key, limit, request)
                    .await
                    .map_err(|_| StoreDown)?),
                1 => Err(StoreDown),
                _ => std::future::pending().await,
            }
        }
    }

    fn release(
        &self,
        key: &K,
        limit: &Limit,
        back: TokenReturn,
    ) -> impl Future<Output = Result<(), StoreDown>> + Send {
        let fault = self.fault();
        let delay = self.delayed();
        let releases = self.releases.clone();
        async move {
            tokio::time::sleep(delay).await;
            match fault {
                0 => {
                    self.inner
                        .release(key, limit, back)
                        .await
                        .map_err(|_| StoreDown)?;
                    releases.fetch_add(back.tokens, Ordering::SeqCst);
                    Ok(())
                }
                1 => Err(StoreDown),
                _ => std::future::pending().await,
            }
        }
    }

    fn level(
        &self,
        key: &K,
        limit: &Limit,
    ) -> impl Future<Output = Result<BucketLevel, StoreDown>> + Send {
        let read = self.inner.level(key, limit);
        let answer_after = Duration::from_micros(self.adjust_answer_micros.load(Ordering::SeqCst));
        async move {
            let level = read.await.map_err(|_| StoreDown);
            tokio::time::sleep(answer_after).await;
            level
        }
    }

    fn adjust(
        &self,
        key: &K,
        limit: &Limit,
        adjustment: Adjustment,
        expires: Option<Duration>,
    ) -> impl Future<Output = Result<Adjusted, StoreDown>> + Send {
        // The memory store does its work when called: a failing store is not called at all.
        let done = (self.fault() == Fault::None as u8)
            .then(|| self.inner.adjust(key, limit, adjustment, expires));
        let answer_after = Duration::from_micros(self.adjust_answer_micros.load(Ordering::SeqCst));
        async move {
            tokio::time::sleep(answer_after).await;
            match done {
                Some(done) => done.await.map_err(|_| StoreDown),
                None => Err(StoreDown),
            }
        }
    }

    /// Its errors come before it does anything.
    fn may_have_applied(&self, _: &StoreDown) -> bool {
        false
    }

    fn layers(&self) -> Option<&hierarchical_throttle::global::LayerRegistry> {
        self.inner.layers()
    }
}

/// A current-thread runtime on paused time, for a test that outlives one runtime and goes on
/// on another.
pub fn paused_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("a runtime")
}

//! The engine shared by a layer and all its services: the hierarchy's decisions.
//!
//! Hot path: one local-store lookup and a subtraction. Slow path (the local bucket is short):
//! read the clock, check the throttled-key cache, then join or start the single fetch in flight
//! for the key on this host. A fetch runs in a task of its own and the waiting requests share
//! its outcome, so a cancelled request never strands the others; what it brings is reserved for
//! them.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures_util::FutureExt;
use futures_util::future::{BoxFuture, Shared};

use crate::batch::BatchPolicy;
use crate::clock::{Clock, micros};
use crate::failure::FailurePolicy;
use crate::global::{GlobalStore, Grant, TokenRequest};
use crate::limit::Limit;
use crate::local::{LocalStore, Miss};
use crate::response::{Rejection, RejectionReason};
use crate::stats::{Stats, ThrottleStats};

/// A batch being fetched from the global store, awaited by every request that needs it.
pub(crate) type Fetch = Shared<BoxFuture<'static, FetchOutcome>>;

/// How a fetch ended.
#[derive(Debug, Clone, Copy)]
pub(crate) enum FetchOutcome {
    /// The store answered `grant` to `request`.
    Granted {
        request: TokenRequest,
        grant: Grant,
    },
    /// Nothing was asked: the key is throttled or the bucket is full.
    Skipped,
    Failed,
}

/// The decision for one request.
pub(crate) enum Check<K> {
    Admit,
    Reject(Rejection<K>),
    Wait(BoxFuture<'static, Result<(), Rejection<K>>>),
}

/// Where a key's limit comes from.
pub(crate) enum Limits<K> {
    Fixed(Limit),
    PerKey(Box<dyn Fn(&K) -> Limit + Send + Sync>),
}

#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) store_timeout: Duration,
    pub(crate) lease_ttl: Duration,
    pub(crate) demand_interval: Duration,
    pub(crate) demand_intervals: usize,
    pub(crate) failure_policy: FailurePolicy,
    pub(crate) max_backoff: Duration,
}

pub(crate) struct Throttle<K, G, L, C> {
    pub(crate) global: G,
    pub(crate) local: L,
    pub(crate) clock: C,
    pub(crate) limits: Limits<K>,
    pub(crate) batch: Box<dyn BatchPolicy>,
    pub(crate) config: Config,
    pub(crate) stats: Stats,
    health: StoreHealth,
    sweeper_started: AtomicBool,
    /// Leases of evicted buckets not handed back yet.
    evicted_leases: std::sync::Mutex<Vec<(K, u64)>>,
}

impl<K, G, L, C> Throttle<K, G, L, C>
where
    K: std::hash::Hash + Eq + Clone + Send + Sync + 'static,
    G: GlobalStore<K>,
    L: LocalStore<K>,
    C: Clock,
{
    pub(crate) fn new(
        global: G,
        local: L,
        clock: C,
        limits: Limits<K>,
        batch: Box<dyn BatchPolicy>,
        config: Config,
    ) -> Self {
        Self {
            global,
            local,
            clock,
            limits,
            batch,
            config,
            stats: Stats::default(),
            health: StoreHealth::default(),
            sweeper_started: AtomicBool::new(false),
            evicted_leases: std::sync::Mutex::default(),
        }
    }

    pub(crate) fn limit_for(&self, key: &K) -> Limit {
        match &self.limits {
            Limits::Fixed(limit) => *limit,
            Limits::PerKey(f) => f(key),
        }
    }

    fn now(&self) -> u64 {
        micros(self.clock.now())
    }

    /// How long past its next token a refused host may wait for the rest of its batch: a tenth
    /// of a demand interval.
    fn max_batch_wait(&self) -> u64 {
        micros(self.config.demand_interval) / 10
    }

    fn interval(&self, now: u64) -> u64 {
        now / micros(self.config.demand_interval).max(1)
    }

    /// Decides a request for `key` costing `cost` tokens. Inlined into its callers, so a hit
    /// builds no decision value in memory; the slow path stays out of line.
    #[inline(always)]
    pub(crate) fn check(self: &Arc<Self>, key: K, cost: u64) -> Check<K> {
        let taken = self
            .local
            .with_bucket(&key, |b| b.take_leased(cost, || self.fetch(key.clone())));
        if taken {
            Check::Admit
        } else {
            self.check_short(key, cost)
        }
    }

    /// The slow path: the local bucket held fewer than `cost` tokens.
    #[inline(never)]
    fn check_short(self: &Arc<Self>, key: K, cost: u64) -> Check<K> {
        let limit = self.limit_for(&key);
        if cost > limit.capacity() {
            self.stats.refused_cost.incr();
            tracing::debug!(
                cost,
                capacity = limit.capacity(),
                "refused: cost above capacity"
            );
            let reason = RejectionReason::CostExceedsCapacity {
                cost,
                capacity: limit.capacity(),
            };
            return Check::Reject(Rejection::new(Some(key), reason, Some(limit)));
        }
        self.start_sweeper();
        let now = self.now();
        if !self.health.is_up(now) {
            return self.on_store_failure(key, cost, &limit);
        }
        let interval = self.interval(now);
        let miss = self.local.with_bucket(&key, |b| {
            self.stats.admitted_local.add(b.take_uncounted());
            b.miss(cost, false, now, interval, || self.fetch(key.clone()))
        });
        match miss {
            Miss::Admitted => {
                self.stats.admitted_local.incr();
                Check::Admit
            }
            Miss::Throttled { until } => {
                self.stats.rejected_cached.incr();
                tracing::debug!(cost, "throttled by the throttled-key cache");
                Check::Reject(throttled(key, limit, until - now))
            }
            Miss::Wait(fetch) => Check::Wait(Box::pin(self.clone().wait(key, cost, limit, fetch))),
        }
    }

    /// Waits for `fetch` (and, rarely, later ones) until the request can be decided.
    async fn wait(
        self: Arc<Self>,
        key: K,
        cost: u64,
        limit: Limit,
        mut fetch: Fetch,
    ) -> Result<(), Rejection<K>> {
        // However many batches it takes (a batch is reserved for the requests waiting for it, so
        // one is almost always enough), a request waits no longer than the store's time-out;
        // past it, the failure policy decides.
        let deadline = tokio::time::Instant::now() + self.config.store_timeout;
        loop {
            let outcome = tokio::time::timeout_at(deadline, fetch)
                .await
                .unwrap_or(FetchOutcome::Failed);
            if matches!(outcome, FetchOutcome::Failed) {
                return self.decide_on_failure(key, cost, &limit);
            }
            let now = self.now();
            let interval = self.interval(now);
            let miss = self.local.with_bucket(&key, |b| {
                b.miss(cost, true, now, interval, || self.fetch(key.clone()))
            });
            match miss {
                Miss::Admitted => {
                    self.stats.admitted_after_fetch.incr();
                    return Ok(());
                }
                Miss::Throttled { until } => {
                    self.stats.rejected_global.incr();
                    tracing::debug!(cost, "throttled by the global store");
                    return Err(throttled(key, limit, until - now));
                }
                Miss::Wait(next) => fetch = next,
            }
        }
    }

    /// A new fetch for `key`'s next batch, running in its own task so that it is sized only
    /// once the requests arriving in the same instant have joined it. Without a Tokio runtime it
    /// runs inside whichever waiting request polls it.
    fn fetch(self: &Arc<Self>, key: K) -> Fetch {
        let run = self.clone().run_fetch(key);
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let task = runtime.spawn(run);
                async move { task.await.unwrap_or(FetchOutcome::Failed) }
                    .boxed()
                    .shared()
            }
            Err(_) => run.boxed().shared(),
        }
    }

    async fn run_fetch(self: Arc<Self>, key: K) -> FetchOutcome {
        // Let requests already scheduled join this batch before it is sized.
        tokio::task::yield_now().await;
        let limit = self.limit_for(&key);
        let now = self.now();
        let interval = self.interval(now);
        let plan = self.local.with_bucket(&key, |b| {
            b.plan(
                now,
                interval,
                &limit,
                &*self.batch,
                self.config.demand_intervals,
            )
        });
        let outcome = match plan {
            None => FetchOutcome::Skipped,
            Some(request) => {
                self.stats.global_calls.incr();
                let call = self.global.acquire(&key, &limit, request);
                match tokio::time::timeout(self.config.store_timeout, call).await {
                    Ok(Ok(grant)) => {
                        tracing::debug!(
                            min = request.min,
                            want = request.want,
                            granted = grant.granted,
                            "global acquire"
                        );
                        self.health.succeeded();
                        FetchOutcome::Granted { request, grant }
                    }
                    Ok(Err(error)) => {
                        self.stats.global_errors.incr();
                        tracing::debug!(%error, "global acquire failed");
                        self.health.failed(self.now(), self.config.max_backoff);
                        FetchOutcome::Failed
                    }
                    Err(_) => {
                        self.stats.global_timeouts.incr();
                        tracing::debug!(timeout = ?self.config.store_timeout, "global acquire timed out");
                        self.health.failed(self.now(), self.config.max_backoff);
                        FetchOutcome::Failed
                    }
                }
            }
        };
        let now = self.now();
        let excess = self.local.with_bucket(&key, |b| {
            b.settle(&outcome, now, &limit, self.max_batch_wait())
        });
        if excess > 0 {
            spawn(async move { self.release(&key, excess).await });
        }
        outcome
    }

    /// Hands `tokens` of `key` back to the global store.
    async fn release(&self, key: &K, tokens: u64) {
        let limit = self.limit_for(key);
        let call = self.global.release(key, &limit, tokens);
        match tokio::time::timeout(self.config.store_timeout, call).await {
            Ok(Ok(())) => self.stats.tokens_returned.add(tokens),
            Ok(Err(error)) => tracing::debug!(%error, tokens, "global release failed"),
            Err(_) => tracing::debug!(tokens, "global release timed out"),
        }
    }

    fn on_store_failure(&self, key: K, cost: u64, limit: &Limit) -> Check<K> {
        match self.decide_on_failure(key, cost, limit) {
            Ok(()) => Check::Admit,
            Err(rejection) => Check::Reject(rejection),
        }
    }

    /// Applies the [`FailurePolicy`] to a request the global store could not decide.
    fn decide_on_failure(&self, key: K, cost: u64, limit: &Limit) -> Result<(), Rejection<K>> {
        self.stats.fallback_decisions.incr();
        let now = self.now();
        match self.config.failure_policy {
            FailurePolicy::Admit => Ok(()),
            FailurePolicy::Reject => {
                let wait = self.health.down_until().saturating_sub(now).max(1);
                let rejection =
                    Rejection::new(Some(key), RejectionReason::StoreUnavailable, Some(*limit));
                Err(rejection.with_retry_after(Duration::from_micros(wait)))
            }
            FailurePolicy::LocalFallback { expected_hosts } => {
                let share = limit.share(expected_hosts.get());
                if cost > share.capacity() {
                    // This host's share can never hold it: it waits for the store instead.
                    let wait = self.health.down_until().saturating_sub(now).max(1);
                    return Err(throttled(key, share, wait));
                }
                let wait = self
                    .local
                    .with_bucket(&key, |b| b.take_fallback(&share, now, cost));
                if wait == 0 {
                    Ok(())
                } else {
                    Err(throttled(key, share, wait))
                }
            }
        }
    }

    /// Hands back leases not used within the lease time-to-live, and those of evicted buckets.
    pub(crate) async fn return_unused_leases(&self) {
        let now = self.now();
        let ttl = micros(self.config.lease_ttl);
        self.collect_evicted();
        let mut returns = std::mem::take(&mut *crate::sync::lock(&self.evicted_leases));
        self.local.for_each_bucket(|key, b| {
            self.stats.admitted_local.add(b.take_uncounted());
            let tokens = b.take_expired(now, ttl);
            if tokens > 0 {
                returns.push((key.clone(), tokens));
            }
        });
        for (key, tokens) in returns {
            self.release(&key, tokens).await;
        }
    }

    /// Counts the requests served by evicted buckets, and keeps their leases for the next sweep.
    fn collect_evicted(&self) {
        let evicted = self.local.take_evicted();
        if evicted.is_empty() {
            return;
        }
        let mut leases = crate::sync::lock(&self.evicted_leases);
        for (key, mut bucket) in evicted {
            self.stats.admitted_local.add(bucket.take_uncounted());
            if bucket.leased_tokens() > 0 {
                leases.push((key, bucket.leased_tokens()));
            }
        }
    }

    /// The counters, with every request served so far counted.
    pub(crate) fn stats(&self) -> ThrottleStats {
        self.local
            .for_each_bucket(|_, b| self.stats.admitted_local.add(b.take_uncounted()));
        self.collect_evicted();
        self.stats.snapshot()
    }

    /// Starts, once, the background task that hands back expired leases every half lease time.
    fn start_sweeper(self: &Arc<Self>) {
        if self.sweeper_started.load(Ordering::Relaxed)
            || self.sweeper_started.swap(true, Ordering::Relaxed)
        {
            return;
        }
        let weak: Weak<Self> = Arc::downgrade(self);
        let period = (self.config.lease_ttl / 2).max(Duration::from_millis(1));
        spawn(async move {
            let mut ticks = tokio::time::interval(period);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                let Some(throttle) = weak.upgrade() else {
                    return;
                };
                throttle.return_unused_leases().await;
            }
        });
    }
}

fn throttled<K>(key: K, limit: Limit, wait_micros: u64) -> Rejection<K> {
    Rejection::new(Some(key), RejectionReason::Throttled, Some(limit))
        .with_retry_after(Duration::from_micros(wait_micros.max(1)))
}

/// Runs `future` in the background on the current Tokio runtime; without one it is dropped
/// (a prefetch is then done by the next request that needs it).
fn spawn<F>(future: F)
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    if let Ok(handle) = tokio::runtime::Handle::try_current() {
        handle.spawn(future);
    }
}

/// A circuit breaker over the global store: after a failure, no key calls the store until a
/// back-off has passed (doubling per consecutive failure, up to a maximum). The first call after
/// it is the probe.
#[derive(Debug, Default)]
struct StoreHealth {
    down_until: AtomicU64,
    failures: AtomicU32,
}

const FIRST_BACKOFF: Duration = Duration::from_millis(50);

impl StoreHealth {
    fn is_up(&self, now: u64) -> bool {
        now >= self.down_until.load(Ordering::Relaxed)
    }

    fn down_until(&self) -> u64 {
        self.down_until.load(Ordering::Relaxed)
    }

    fn succeeded(&self) {
        if self.failures.load(Ordering::Relaxed) != 0 {
            self.failures.store(0, Ordering::Relaxed);
            self.down_until.store(0, Ordering::Relaxed);
        }
    }

    fn failed(&self, now: u64, max_backoff: Duration) {
        let failures = self.failures.fetch_add(1, Ordering::Relaxed).min(16);
        let backoff = FIRST_BACKOFF.saturating_mul(1 << failures).min(max_backoff);
        self.down_until
            .fetch_max(now.saturating_add(micros(backoff)), Ordering::Relaxed);
    }
}

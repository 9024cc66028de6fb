//! The engine shared by a layer and all its services: it reads the clock, calls the global store
//! and delivers what each key's lease state machine ([`LocalBucket`](crate::local::LocalBucket))
//! decides.
//!
//! Hot path: one local-store lookup and a subtraction. Slow path (the lease is short): read the
//! clock, then refuse at once if the global bucket is known to be short, or queue for the single
//! fetch in flight for the key on this host. A fetch runs in a task of its own and decides every
//! request queued for it; whatever ends that task (an answer, a time-out, a panic, a cancelled
//! task, a dropped runtime) settles the key, so no key is ever left waiting on a fetch that will
//! not finish. Nothing is spawned and no user code runs while a local-store lock is held.

use std::hash::BuildHasher;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use futures_util::future::BoxFuture;
use futures_util::{StreamExt, stream};
use tokio::sync::oneshot;
use tracing::Instrument;

use crate::batch::{BatchContext, BatchPolicy};
use crate::clock::{Clock, micros};
use crate::failure::FailurePolicy;
use crate::global::GlobalStore;
use crate::limit::Limit;
use crate::local::{FetchOutcome, Hit, LocalBucket, LocalStore, Miss, Settled, Verdict, Waiter};
use crate::quota::{BucketKey, LeaseKey, Name, Quota};
use crate::response::{Rejection, RejectionReason};
use crate::stats::{Stats, ThrottleStats};
use crate::sync::lock;

/// The decision for one request.
pub(crate) enum Check<K> {
    /// Admitted with leased tokens.
    Admit,
    // Boxed, so that an admission (the common case) is a small value, returned in registers
    // through the hot path's calls rather than copied.
    Reject(Box<Rejection<K>>),
    /// Decided later (after a batch), or by the failure policy (a ready future: rare).
    Wait(Decision<K>),
}

/// A decision that comes later.
pub(crate) type Decision<K> = BoxFuture<'static, Result<Admitted, Rejection<K>>>;

/// How a use of a key was admitted: from tokens leased by the global store, or, on some of
/// its buckets, by the [`FailurePolicy`] while the store could not be asked. It travels with
/// the use, so that settling it never refunds into a lease tokens the lease never gave.
///
/// Returned by [`HierarchicalThrottleLayer::acquire`](crate::HierarchicalThrottleLayer::acquire)
/// and handed back to [`settle`](crate::HierarchicalThrottleLayer::settle).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Admitted {
    /// Bit `level * 16 + slot` set for each bucket the failure policy decided.
    by_policy: u128,
    /// Admitted in shadow mode: it took nothing, and has nothing to settle.
    shadow: bool,
}

impl Admitted {
    /// Every bucket admitted with leased tokens.
    pub(crate) const LEASED: Self = Self {
        by_policy: 0,
        shadow: false,
    };

    /// Served in shadow mode instead of refused.
    pub(crate) const SHADOW: Self = Self {
        by_policy: u128::MAX,
        shadow: true,
    };

    /// Bucket `id` admitted by the failure policy.
    fn by_policy<K>(id: &LeaseKey<K>) -> Self {
        Self {
            by_policy: 1 << Self::bit(id.level, id.slot),
            shadow: false,
        }
    }

    fn bit(level: u8, slot: u8) -> u32 {
        (u32::from(level) * 16 + u32::from(slot)).min(127)
    }

    /// The buckets of both.
    pub(crate) fn and(self, other: Self) -> Self {
        Self {
            by_policy: self.by_policy | other.by_policy,
            shadow: self.shadow || other.shadow,
        }
    }

    /// Whether it was served in shadow mode, taking nothing.
    pub(crate) fn in_shadow(&self) -> bool {
        self.shadow
    }

    /// Buckets the failure policy decided (none in shadow mode, which took nothing).
    fn policy_buckets(&self) -> u32 {
        match self.shadow {
            true => 0,
            false => self.by_policy.count_ones(),
        }
    }

    /// Whether every bucket the use drew on admitted it with leased tokens (`false` when the
    /// failure policy decided any of them: a refund then goes nowhere).
    pub fn from_leases(&self) -> bool {
        self.by_policy == 0
    }

    /// Whether the bucket at `level` and `slot` admitted it with leased tokens.
    pub(crate) fn leased(&self, level: u8, slot: u8) -> bool {
        self.by_policy & (1 << Self::bit(level, slot)) == 0
    }
}

impl<K> Check<K> {
    pub(crate) fn reject(rejection: Rejection<K>) -> Self {
        Self::Reject(Box::new(rejection))
    }
}

/// A level of keys: its name (none for the layer's first) and where its keys' quotas come
/// from.
pub(crate) struct Level<K> {
    pub(crate) name: Option<Name>,
    pub(crate) quota: QuotaSource<K>,
}

pub(crate) enum QuotaSource<K> {
    Fixed(Quota),
    PerKey(Box<dyn Fn(&K) -> Quota + Send + Sync>),
}

/// A bucket's limit and names, looked up from its key's quota.
#[derive(Clone, Copy)]
pub(crate) struct Resolved {
    pub(crate) limit: Limit,
    pub(crate) name: Name,
    pub(crate) level: Option<Name>,
    /// How many limits the key's quota has.
    pub(crate) slots: u8,
}

#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) store_timeout: Duration,
    pub(crate) lease_ttl: Duration,
    pub(crate) demand_interval: Duration,
    pub(crate) demand_intervals: usize,
    pub(crate) failure_policy: FailurePolicy,
    pub(crate) max_backoff: Duration,
    pub(crate) max_reservation: Duration,
    pub(crate) shadow: bool,
    /// Admitted responses get `RateLimit` fields (when the rejection handler writes them).
    pub(crate) ratelimit_fields: bool,
    /// Whether throttled requests wait for their tokens.
    pub(crate) shaping: crate::Shaping,
    /// The most added at random to a refusal's `retry_after`.
    pub(crate) retry_jitter: Duration,
    /// The layer's name, a label on its metrics.
    pub(crate) name: std::sync::Arc<str>,
    /// The layer's name in its global buckets' identities.
    pub(crate) layer: Name,
}

/// Random delays for refusals' waits: a seeded hash of a counter, spread evenly enough for
/// clients to scatter, and no lock.
#[derive(Default)]
struct Jitter {
    seed: foldhash::fast::RandomState,
    draws: AtomicU64,
}

impl Jitter {
    /// A delay from 0 to `max` micros, both included.
    fn draw(&self, max: u64) -> u64 {
        let n = self.draws.fetch_add(1, Ordering::Relaxed);
        self.seed.hash_one(n) % max.saturating_add(1)
    }
}

/// Hand-backs in flight at once during a sweep.
const CONCURRENT_RETURNS: usize = 32;

pub(crate) struct Throttle<K, G, L, C> {
    pub(crate) global: G,
    pub(crate) local: L,
    pub(crate) clock: C,
    pub(crate) levels: Box<[Level<K>]>,
    pub(crate) batch: Box<dyn BatchPolicy>,
    pub(crate) config: Config,
    pub(crate) stats: Stats,
    pub(crate) health: StoreHealth,
    sweeper_running: AtomicBool,
    jitter: Jitter,
    pub(crate) refusals: crate::stats::RefusalsByLimit,
    /// Requests waiting for a batch at the last sweep.
    pub(crate) waiting_for_batches: AtomicU64,
    pub(crate) shaper: Arc<crate::shaping::Shaper<K>>,
    /// Tokens to hand back: evicted leases, and hand-backs the store did not take.
    returns: Mutex<Vec<Return<K>>>,
    /// When a request without a key was last logged at warn (clock micros; 0: never).
    missing_key_warned_at: AtomicU64,
    /// Where the global store is, for logs.
    store_location: String,
    /// Keeps this layer's name registered with its global store while it lives.
    pub(crate) registration: Option<Arc<()>>,
}

/// Leased tokens on their way back to the global bucket that dispensed them (the limit whose
/// name's [id](Name::id) is `dispenser`; 0 when the lease did not know it).
pub(crate) struct Return<K> {
    id: LeaseKey<K>,
    dispenser: u32,
    tokens: u64,
}

impl<K, G, L, C> Throttle<K, G, L, C>
where
    K: std::hash::Hash + Eq + Clone + Send + Sync + 'static,
    G: GlobalStore<BucketKey<K>>,
    L: LocalStore<LeaseKey<K>>,
    C: Clock,
{
    pub(crate) fn new(
        global: G,
        local: L,
        clock: C,
        levels: Box<[Level<K>]>,
        batch: Box<dyn BatchPolicy>,
        config: Config,
    ) -> Self {
        Self {
            local,
            clock,
            levels,
            batch,
            config,
            stats: Stats::default(),
            health: StoreHealth::default(),
            sweeper_running: AtomicBool::new(false),
            jitter: Jitter::default(),
            refusals: crate::stats::RefusalsByLimit::default(),
            waiting_for_batches: AtomicU64::new(0),
            shaper: Arc::default(),
            returns: Mutex::default(),
            missing_key_warned_at: AtomicU64::new(0),
            store_location: global.location(),
            registration: None,
            global,
        }
    }

    /// The quota of `key` at `level`.
    pub(crate) fn quota(&self, level: u8, key: &K) -> Option<Quota> {
        Some(self.level_quota(level, key)?.1.into_owned())
    }

    /// The name of `level` and the quota of `key` there: borrowed when it is the same for
    /// every key, so reading it costs no reference count.
    pub(crate) fn level_quota(
        &self,
        level: u8,
        key: &K,
    ) -> Option<(Option<Name>, std::borrow::Cow<'_, Quota>)> {
        let level = self.levels.get(usize::from(level))?;
        let quota = match &level.quota {
            QuotaSource::Fixed(quota) => std::borrow::Cow::Borrowed(quota),
            QuotaSource::PerKey(f) => std::borrow::Cow::Owned(f(key)),
        };
        Some((level.name, quota))
    }

    /// The limit and names of bucket `id`; `None` if its key's quota no longer has that limit.
    pub(crate) fn resolve(&self, id: &LeaseKey<K>) -> Option<Resolved> {
        let quota = self.quota(id.level, &id.key)?;
        let (name, limit) = quota.slot(id.slot)?;
        Some(Resolved {
            limit,
            name,
            level: self.levels.get(usize::from(id.level))?.name,
            slots: quota.slots(),
        })
    }

    pub(crate) fn global_key(&self, id: &LeaseKey<K>, limit: Name) -> BucketKey<K> {
        let level = self.levels.get(usize::from(id.level)).and_then(|l| l.name);
        BucketKey::from_parts(id.key.clone(), self.config.layer, level, limit)
    }

    pub(crate) fn now(&self) -> u64 {
        micros(self.clock.now())
    }

    fn interval(&self, now: u64) -> u64 {
        now / micros(self.config.demand_interval).max(1)
    }

    /// Decides one bucket's share of a request costing `cost` tokens, and tells how many limits
    /// the key's quota has (read from its first bucket).
    #[inline(always)]
    pub(crate) fn check(self: &Arc<Self>, id: &LeaseKey<K>, cost: u64) -> (Check<K>, u8) {
        let (hit, slots) = self.take_leased(id, cost);
        self.after_take(id, hit, slots, cost)
    }

    /// The hot path: takes `cost` leased tokens from bucket `id` if it holds them. No clock,
    /// no allocation, no shared counter.
    #[inline(always)]
    pub(crate) fn take_leased(&self, id: &LeaseKey<K>, cost: u64) -> (Hit, u8) {
        self.local
            .with_bucket(id, |b| (b.take_leased(cost), b.slots()))
    }

    /// The decision after [`take_leased`](Self::take_leased) answered `hit`.
    #[inline(always)]
    pub(crate) fn after_take(
        self: &Arc<Self>,
        id: &LeaseKey<K>,
        hit: Hit,
        slots: u8,
        cost: u64,
    ) -> (Check<K>, u8) {
        match hit {
            Hit::Admitted => (Check::Admit, self.known_slots(id, slots)),
            Hit::AdmittedStartFetch => {
                self.start_fetch(id.clone());
                (Check::Admit, self.known_slots(id, slots))
            }
            Hit::Short => self.check_short(id, cost),
        }
    }

    /// `slots`, or when the bucket does not know its key's number of limits (0), the quota's,
    /// which a first bucket then keeps: a bucket holding tokens without having been through
    /// the slow path (a give-back or refund after its eviction) must not admit alone.
    #[inline(always)]
    fn known_slots(&self, id: &LeaseKey<K>, slots: u8) -> u8 {
        if slots != 0 {
            return slots;
        }
        self.learn_slots(id)
    }

    #[cold]
    #[inline(never)]
    fn learn_slots(&self, id: &LeaseKey<K>) -> u8 {
        let slots = self.resolve(id).map_or(1, |bucket| bucket.slots);
        if id.slot == 0 {
            self.local.with_bucket(id, |b| b.set_slots(slots));
        }
        slots
    }

    /// The slow path: the lease held fewer than `cost` tokens.
    #[inline(never)]
    fn check_short(self: &Arc<Self>, id: &LeaseKey<K>, cost: u64) -> (Check<K>, u8) {
        let Some(bucket) = self.resolve(id) else {
            // The key's quota no longer has this limit: nothing to enforce.
            return (Check::Admit, 1);
        };
        let limit = bucket.limit;
        if cost > limit.capacity() {
            self.stats.refused_cost.incr();
            tracing::debug!(
                cost,
                capacity = limit.capacity(),
                "refused: cost above capacity"
            );
            return (Check::reject(bucket.cost_rejection(id, cost)), bucket.slots);
        }
        self.start_sweeper();
        let now = self.now();
        let interval = self.interval(now);
        let store_up = self.health.is_up(now);
        let deadline = now.saturating_add(micros(self.config.store_timeout));
        // Made only for a request that waits: a refusal allocates nothing.
        let mut verdict = None;
        let mut forfeited = 0;
        let miss = self.local.with_bucket(id, |b| {
            forfeited = self.serve(id, &bucket, b);
            self.stats.admitted_local.add(b.take_uncounted());
            b.miss(cost, now, interval, &limit, store_up, || {
                let (waiter, receiver) = Waiter::new(cost, deadline);
                verdict = Some(receiver);
                waiter
            })
        });
        self.stats.tokens_forfeited.add(forfeited);
        let check = match miss {
            Miss::Admitted => {
                self.stats.admitted_local.incr();
                Check::Admit
            }
            Miss::Throttled { until } => {
                if self.counts_throttled() {
                    self.stats.rejected_cached.incr();
                }
                tracing::debug!(cost, "throttled by the throttled-key cache");
                Check::reject(bucket.throttled(id, until.saturating_sub(now)))
            }
            Miss::StoreDown => match self.decide_on_failure(id, cost, &bucket) {
                Ok(admitted) => Check::Wait(Box::pin(std::future::ready(Ok(admitted)))),
                Err(rejection) => Check::reject(rejection),
            },
            Miss::Joined | Miss::StartFetch => {
                if miss == Miss::StartFetch {
                    self.start_fetch(id.clone());
                }
                // Always there: `miss` made the waiter when it queued the request.
                let Some(verdict) = verdict else {
                    return (Check::reject(bucket.throttled(id, 1)), bucket.slots);
                };
                let pending = PendingVerdict {
                    throttle: self.clone(),
                    id: id.clone(),
                    cost,
                    verdict,
                };
                let wait = Self::wait(pending, bucket);
                Check::Wait(Box::pin(wait))
            }
        };
        (check, bucket.slots)
    }

    /// Without taking anything: the refusal bucket `id` would give a request of `cost`, if it
    /// is known now (cost above capacity, or the global bucket known to be short). For the
    /// other buckets of a request one bucket has refused, so that the answer names the longest
    /// wait without taking tokens or calling the store.
    /// Also tells how many limits the key's quota has.
    pub(crate) fn known_refusal(&self, id: &LeaseKey<K>, cost: u64) -> (Option<Rejection<K>>, u8) {
        let Some(bucket) = self.resolve(id) else {
            return (None, 1);
        };
        if cost > bucket.limit.capacity() {
            return (Some(bucket.cost_rejection(id, cost)), bucket.slots);
        }
        let now = self.now();
        let until = self
            .local
            .with_bucket(id, |b| b.known_short(cost, now, &bucket.limit));
        let refusal = until.map(|until| bucket.throttled(id, until.saturating_sub(now)));
        (refusal, bucket.slots)
    }

    /// Puts back the `cost` tokens a request took from bucket `id` when another of its buckets
    /// refused it.
    pub(crate) fn undo(&self, id: &LeaseKey<K>, cost: u64) {
        self.local.with_bucket(id, |b| b.undo_take(cost));
    }

    /// Puts back the `cost` tokens a waiting request was admitted with by bucket `id`, when
    /// another of its buckets refused it or it went away.
    pub(crate) fn give_back(&self, id: &LeaseKey<K>, cost: u64) {
        self.local.with_bucket(id, |b| b.give_back(cost));
    }

    /// Tells bucket `b` (of `id`) the limit it serves now, `bucket`: a first bucket learns how
    /// many limits its key has, and a lease of another global bucket (the key changed tiers)
    /// is forfeited. Returns the tokens forfeited.
    fn serve(&self, id: &LeaseKey<K>, bucket: &Resolved, b: &mut LocalBucket) -> u64 {
        if id.slot == 0 {
            b.set_slots(bucket.slots);
        }
        b.reshape(bucket.name, bucket.shape())
    }

    /// Waits for the verdict of the fetch the request was queued for.
    async fn wait(
        mut pending: PendingVerdict<K, G, L, C>,
        bucket: Resolved,
    ) -> Result<Admitted, Rejection<K>> {
        // A fetch always settles its waiters, even when its task dies; a closed channel is
        // taken as a failed fetch all the same.
        let verdict = (&mut pending.verdict).await.unwrap_or(Verdict::Failed);
        let (this, id, cost) = (&pending.throttle, &pending.id, pending.cost);
        match verdict {
            Verdict::Admitted => {
                this.stats.admitted_after_fetch.incr();
                Ok(Admitted::LEASED)
            }
            Verdict::Throttled { until } => {
                if this.counts_throttled() {
                    this.stats.rejected_global.incr();
                }
                tracing::debug!(cost, "throttled by the global store");
                // Named after the limit the batch was settled with: it may have changed while
                // the request waited.
                let bucket = this.resolve(id).unwrap_or(bucket);
                Err(bucket.throttled(id, until.saturating_sub(this.now())))
            }
            Verdict::Failed => this.decide_on_failure(id, cost, &bucket),
            Verdict::Unlimited => Ok(Admitted::LEASED),
        }
    }

    /// Runs a fetch for bucket `id` in a task of its own (the bucket is marked as fetching).
    /// Without a Tokio runtime the fetch fails at once, and its waiters go to the failure
    /// policy. Out of line and cold: the hit path that calls it once per batch stays small.
    #[cold]
    #[inline(never)]
    pub(crate) fn start_fetch(self: &Arc<Self>, id: LeaseKey<K>) {
        let fetch = FetchTask {
            throttle: self.clone(),
            id,
            settled: false,
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(fetch.run());
        }
    }

    /// Asks the global store for bucket `id`'s next batch.
    async fn fetch(&self, id: &LeaseKey<K>) -> FetchOutcome {
        // Let requests already scheduled join this batch before it is sized.
        tokio::task::yield_now().await;
        let Some(bucket) = self.resolve(id) else {
            // The key's quota no longer has this limit: settling finds that too.
            return FetchOutcome::Skipped;
        };
        let limit = bucket.limit;
        let now = self.now();
        let interval = self.interval(now);
        // Every batch reads the key's quota afresh: a limit changed at run time applies from
        // the next batch, even on a lease that never runs dry.
        let mut forfeited = 0;
        let plan = self.local.with_bucket(id, |b| {
            forfeited = self.serve(id, &bucket, b);
            b.plan(now, interval, &limit)
        });
        self.stats.tokens_forfeited.add(forfeited);
        let Some(plan) = plan else {
            return FetchOutcome::Skipped;
        };
        if !self.health.is_up(now) {
            return FetchOutcome::Failed;
        }
        let batch = self.batch_size(&limit, plan.needed, &plan.demand);
        let request = plan.request(batch, self.config.max_reservation);
        self.stats.global_calls.incr();
        let span = tracing::debug_span!(
            "global_acquire",
            key_hash = KEY_HASH.hash_one(&id.key),
            limit = bucket.name.as_str(),
            want = request.want,
            granted = tracing::field::Empty,
            reserved = tracing::field::Empty,
            latency_us = tracing::field::Empty,
        );
        let key = self.global_key(id, bucket.name);
        let call = self.global.acquire(&key, &limit, request);
        let answer = tokio::time::timeout(self.config.store_timeout, call)
            .instrument(span.clone())
            .await;
        let answered = self.now();
        let latency = answered.saturating_sub(now);
        span.record("latency_us", latency);
        #[cfg(feature = "metrics")]
        crate::metrics::global_call(&self.config.name, Duration::from_micros(latency));
        if let Ok(Ok(grant)) = &answer {
            span.record("granted", grant.granted);
            span.record("reserved", grant.reserved);
        }
        let _entered = span.enter();
        match answer {
            Ok(Ok(grant)) => {
                tracing::debug!(
                    want = request.want,
                    granted = grant.granted,
                    ready_in = ?grant.ready_in,
                    "global acquire"
                );
                self.store_answered();
                FetchOutcome::Granted {
                    grant,
                    sent_at: now,
                    from: bucket.name,
                    shape: bucket.shape(),
                }
            }
            Ok(Err(error)) => {
                self.stats.global_errors.incr();
                tracing::debug!(%error, "global acquire failed");
                if self.global.may_have_applied(&error) {
                    self.stats.tokens_lost.add(request.want);
                }
                self.store_failed(now, answered, &error);
                FetchOutcome::Failed
            }
            Err(_) => {
                self.stats.global_timeouts.incr();
                self.stats.tokens_lost.add(request.want);
                tracing::debug!(timeout = ?self.config.store_timeout, "global acquire timed out");
                self.store_failed(now, answered, &TimedOut(self.config.store_timeout));
                FetchOutcome::Failed
            }
        }
    }

    /// The batch policy's answer; a policy that panics asks for what the waiters need.
    fn batch_size(&self, limit: &Limit, needed: u64, demand: &[u32]) -> u64 {
        let cx = BatchContext {
            limit,
            needed,
            demand,
            intervals: self.config.demand_intervals,
        };
        catch_unwind(AssertUnwindSafe(|| self.batch.batch_size(&cx))).unwrap_or_else(|_| {
            tracing::debug!("the batch policy panicked; asking for what the waiters need");
            needed
        })
    }

    /// Takes in `outcome` for bucket `id` and delivers the verdicts, then hands back what the
    /// lease cannot hold and starts the next fetch if requests still wait. The limit is read
    /// again: one changed while the call was under way makes its answer's times stale (and
    /// another name, its tokens another bucket's). Without a limit (the key's quota lost it)
    /// the waiters pass: nothing is left to enforce.
    fn settle(self: &Arc<Self>, id: &LeaseKey<K>, outcome: &FetchOutcome) {
        let now = self.now();
        if let FetchOutcome::Granted { grant, .. } = outcome {
            self.stats
                .tokens_leased
                .add(grant.granted.saturating_add(grant.reserved));
        }
        let bucket = self.resolve(id);
        let mut forfeited = 0;
        let (settled, dispenser) = self.local.with_bucket(id, |b| {
            let settled = match &bucket {
                Some(bucket) => {
                    forfeited = self.serve(id, bucket, b);
                    b.settle(outcome, now, self.interval(now), &bucket.limit)
                }
                None => b.drop_limit(),
            };
            (settled, b.dispenser())
        });
        self.stats.tokens_forfeited.add(forfeited);
        let Settled {
            verdicts,
            excess,
            forfeited,
            refetch,
        } = settled;
        self.stats.tokens_forfeited.add(forfeited);
        self.deliver(id, verdicts);
        if excess > 0 {
            self.defer_return(id.clone(), dispenser, excess);
        }
        if refetch {
            self.start_fetch(id.clone());
        }
    }

    /// Sends each verdict; tokens taken for a request that went away go back to the lease.
    fn deliver(&self, id: &LeaseKey<K>, verdicts: Vec<(Waiter, Verdict)>) {
        let mut unclaimed = 0u64;
        for (waiter, verdict) in verdicts {
            let cost = waiter.cost();
            if waiter.deliver(verdict) == Err(Verdict::Admitted) {
                unclaimed = unclaimed.saturating_add(cost);
            }
        }
        if unclaimed > 0 {
            self.local.with_bucket(id, |b| b.give_back(unclaimed));
        }
    }

    /// Applies the [`FailurePolicy`] to a request the global store could not decide.
    fn decide_on_failure(
        &self,
        id: &LeaseKey<K>,
        cost: u64,
        bucket: &Resolved,
    ) -> Result<Admitted, Rejection<K>> {
        self.stats.fallback_decisions.incr();
        self.apply_failure_policy(id, cost, bucket)
            .map(|()| Admitted::by_policy(id))
    }

    fn apply_failure_policy(
        &self,
        id: &LeaseKey<K>,
        cost: u64,
        bucket: &Resolved,
    ) -> Result<(), Rejection<K>> {
        let now = self.now();
        let until_probe = self.health.down_until().saturating_sub(now).max(1);
        let limit = &bucket.limit;
        match self.config.failure_policy {
            FailurePolicy::Admit => Ok(()),
            FailurePolicy::Reject => {
                let rejection = bucket.rejection(id, RejectionReason::StoreUnavailable, *limit);
                Err(rejection.with_retry_after(Duration::from_micros(until_probe)))
            }
            FailurePolicy::LocalFallback { expected_hosts } => {
                let share = limit.share(expected_hosts.get());
                let throttled = |wait| {
                    bucket
                        .rejection(id, RejectionReason::Throttled, share)
                        .with_retry_after(Duration::from_micros(wait))
                };
                if cost > share.capacity() {
                    // This host's share can never hold it: it waits for the store instead.
                    return Err(throttled(until_probe));
                }
                let wait = self
                    .local
                    .with_bucket(id, |b| b.take_fallback(&share, now, cost));
                if wait == 0 {
                    Ok(())
                } else {
                    Err(throttled(wait))
                }
            }
        }
    }

    /// Hands back leases not used within the lease time-to-live, those of evicted buckets, and
    /// earlier hand-backs the store did not take.
    pub(crate) async fn return_unused_leases(&self) {
        let now = self.now();
        let ttl = micros(self.config.lease_ttl);
        let interval = self.interval(now);
        self.collect_evicted();
        let mut returns = std::mem::take(&mut *lock(&self.returns));
        let mut waiting = 0;
        self.local.for_each_bucket(|id, b| {
            self.stats.admitted_local.add(b.take_uncounted());
            waiting += b.waiting() as u64;
            let tokens = b.take_expired(now, ttl, interval);
            if tokens > 0 {
                returns.push(Return {
                    id: id.clone(),
                    dispenser: b.dispenser(),
                    tokens,
                });
            }
        });
        self.waiting_for_batches.store(waiting, Ordering::Relaxed);
        stream::iter(returns)
            .for_each_concurrent(CONCURRENT_RETURNS, |back| self.hand_back(back))
            .await;
    }

    /// Hands leased tokens back to the global bucket that dispensed them, or keeps them for a
    /// later sweep if the store is backing off or refused them. Tokens of a hand-back that may
    /// have reached the store are never sent twice: they are counted as lost. Tokens of a
    /// bucket the key no longer draws on are forfeited (the limit that would take them back
    /// is not known any more).
    async fn hand_back(&self, back: Return<K>) {
        let now = self.now();
        if !self.health.is_up(now) {
            lock(&self.returns).push(back);
            return;
        }
        let Return {
            id,
            dispenser,
            tokens,
        } = back;
        let bucket = self.resolve(&id);
        let Some(bucket) = bucket.filter(|b| dispenser == 0 || dispenser == b.name.id()) else {
            self.stats.tokens_forfeited.add(tokens);
            return;
        };
        let key = self.global_key(&id, bucket.name);
        let call = self.global.release(&key, &bucket.limit, tokens);
        match tokio::time::timeout(self.config.store_timeout, call).await {
            Ok(Ok(())) => {
                self.store_answered();
                self.stats.tokens_returned.add(tokens);
            }
            Ok(Err(error)) => {
                tracing::debug!(%error, tokens, "global release failed");
                self.store_failed(now, self.now(), &error);
                if self.global.may_have_applied(&error) {
                    self.stats.tokens_lost.add(tokens);
                } else {
                    self.defer_return(id, dispenser, tokens);
                }
            }
            Err(_) => {
                tracing::debug!(tokens, "global release timed out");
                self.store_failed(now, self.now(), &TimedOut(self.config.store_timeout));
                self.stats.tokens_lost.add(tokens);
            }
        }
    }

    /// A call sent at `sent_at` failed at `failed_at`: the store's back-off steps. Logged at
    /// warn once when the store goes down (not once per call), naming the layer and the store.
    pub(crate) fn store_failed(&self, sent_at: u64, failed_at: u64, error: &dyn std::fmt::Display) {
        let went_down = self
            .health
            .failed(sent_at, failed_at, self.config.max_backoff);
        if went_down {
            tracing::warn!(
                layer = %self.config.name,
                store = %self.store_location,
                %error,
                policy = ?self.config.failure_policy,
                "the global store failed; the failure policy decides until it answers"
            );
        }
    }

    /// A call was answered: the store is up (logged when it was down).
    pub(crate) fn store_answered(&self) {
        if self.health.succeeded() {
            tracing::info!(
                layer = %self.config.name,
                store = %self.store_location,
                "the global store answers again"
            );
        }
    }

    /// Counts a request without a key, and logs it at warn: the first, then at most one a
    /// minute, so that a key closure that never finds its key (a mistyped header name) shows.
    pub(crate) fn note_missing_key(&self, policy: &str) {
        self.stats.missing_key.incr();
        // Stamped one past the clock, so that 0 means never.
        let stamp = self.now().saturating_add(1);
        let last = self.missing_key_warned_at.load(Ordering::Relaxed);
        let due = last == 0 || stamp.saturating_sub(last) >= MISSING_KEY_WARNING_EVERY;
        let claimed = due
            && self
                .missing_key_warned_at
                .compare_exchange(last, stamp, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok();
        if claimed {
            tracing::warn!(
                layer = %self.config.name,
                policy,
                without_key_so_far = self.stats.missing_key.get(),
                "a request had no throttle key: is the key closure reading what clients send? \
                 (logged at most once a minute; each one is counted in stats().missing_key)"
            );
        } else {
            tracing::debug!(policy, "request without a throttle key");
        }
    }

    fn defer_return(&self, id: LeaseKey<K>, dispenser: u32, tokens: u64) {
        lock(&self.returns).push(Return {
            id,
            dispenser,
            tokens,
        });
    }

    /// Counts the requests served by evicted buckets, and keeps their leases for the next sweep.
    fn collect_evicted(&self) {
        let evicted = self.local.take_evicted();
        if evicted.is_empty() {
            return;
        }
        let mut returns = lock(&self.returns);
        for (id, mut bucket) in evicted {
            self.stats.admitted_local.add(bucket.take_uncounted());
            let tokens = bucket.take_all_leased();
            if tokens > 0 {
                let dispenser = bucket.dispenser();
                returns.push(Return {
                    id,
                    dispenser,
                    tokens,
                });
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

    /// Starts the background task that hands back unused leases every half lease time, unless
    /// it runs. It stops with the last clone of the layer, or with its runtime; the next slow
    /// path then starts it again on its own runtime.
    fn start_sweeper(self: &Arc<Self>) {
        if self.sweeper_running.load(Ordering::Relaxed)
            || self.sweeper_running.swap(true, Ordering::Relaxed)
        {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.sweeper_running.store(false, Ordering::Relaxed);
            return;
        };
        let sweeper = Sweeper {
            throttle: Arc::downgrade(self),
        };
        runtime.spawn(sweeper.run());
    }
}

impl<K, G, L, C> Throttle<K, G, L, C> {
    /// A use of `cost` tokens is admitted, finally, as `admitted`: counts the tokens the
    /// failure policy admitted without a lease (once the use is sure to go ahead, so that one
    /// refused by another bucket, or dropped, counts nothing).
    pub(crate) fn count_admitted(&self, admitted: Admitted, cost: u64) -> Admitted {
        let buckets = u64::from(admitted.policy_buckets());
        if buckets > 0 {
            self.stats.tokens_unleased.add(cost.saturating_mul(buckets));
        }
        admitted
    }

    /// Counts and logs a refusal that shadow mode turns into an admission.
    fn count_shadow(&self, rejection: &Rejection<K>) {
        self.stats.shadow_admitted.incr();
        tracing::debug!(reason = %rejection.reason, "shadow mode: served a use it would refuse");
    }

    /// A refusal for a use outside a tower service: finished on its way to the caller, or in
    /// shadow mode turned into an admission that took nothing.
    pub(crate) fn finish_or_shadow(
        &self,
        mut rejection: Rejection<K>,
    ) -> Result<Admitted, Rejection<K>> {
        if self.config.shadow {
            self.count_shadow(&rejection);
            return Ok(Admitted::SHADOW);
        }
        self.finish_refusal(&mut rejection);
        Err(rejection)
    }

    /// Whether a throttled refusal is counted where it is made: not when it goes on to wait for
    /// its tokens (shaping counts a waiting request once, when its wait ends).
    pub(crate) fn counts_throttled(&self) -> bool {
        self.config.shadow || matches!(self.config.shaping, crate::Shaping::Refuse)
    }

    /// A refusal on its way to the client: counted once, by its limit and reason, and its wait
    /// given the configured random delay.
    pub(crate) fn finish_refusal(&self, rejection: &mut Rejection<K>) {
        let reason = match rejection.reason {
            RejectionReason::Throttled => "throttled",
            RejectionReason::CostExceedsCapacity { .. } => "cost_above_capacity",
            RejectionReason::MissingKey => "missing_key",
            RejectionReason::StoreUnavailable => "store_unavailable",
        };
        self.refusals
            .count((rejection.level, rejection.limit_name, reason));
        let max = micros(self.config.retry_jitter);
        if let (Some(wait), true) = (&mut rejection.retry_after, max > 0) {
            *wait += Duration::from_micros(self.jitter.draw(max));
        }
    }

    /// Serves a request shadow mode would have refused: counted, logged, and given its
    /// refusal's `RateLimit` fields when `annotate`; never settled (it took no tokens).
    pub(crate) fn admit_in_shadow(
        &self,
        rejection: &Rejection<K>,
        annotate: bool,
    ) -> crate::future::Admission {
        self.count_shadow(rejection);
        let remaining = crate::remaining::Remaining::of_refusal(rejection).filter(|_| annotate);
        crate::future::Admission {
            remaining: remaining.into_iter().collect(),
            settle: None,
        }
    }
}

/// A request's pending verdict: if the request goes away after its tokens were taken for it,
/// they go back to the lease.
///
/// It is made with the request's waiter, before the future that awaits it is first polled: a
/// future dropped unpolled (one of several buckets' waits, after another refused) still gives
/// back what a delivered verdict took.
struct PendingVerdict<K, G, L, C>
where
    K: std::hash::Hash + Eq + Clone + Send + Sync + 'static,
    G: GlobalStore<BucketKey<K>>,
    L: LocalStore<LeaseKey<K>>,
    C: Clock,
{
    throttle: Arc<Throttle<K, G, L, C>>,
    id: LeaseKey<K>,
    cost: u64,
    verdict: oneshot::Receiver<Verdict>,
}

impl<K, G, L, C> Drop for PendingVerdict<K, G, L, C>
where
    K: std::hash::Hash + Eq + Clone + Send + Sync + 'static,
    G: GlobalStore<BucketKey<K>>,
    L: LocalStore<LeaseKey<K>>,
    C: Clock,
{
    fn drop(&mut self) {
        self.verdict.close();
        if let Ok(Verdict::Admitted) = self.verdict.try_recv() {
            self.throttle
                .local
                .with_bucket(&self.id, |b| b.give_back(self.cost));
        }
    }
}

/// A fetch in its task. However the task ends, the key is settled: by the store's answer, or,
/// if the task is dropped first (cancelled, panicked, its runtime shut down), as failed.
struct FetchTask<K, G, L, C>
where
    K: std::hash::Hash + Eq + Clone + Send + Sync + 'static,
    G: GlobalStore<BucketKey<K>>,
    L: LocalStore<LeaseKey<K>>,
    C: Clock,
{
    throttle: Arc<Throttle<K, G, L, C>>,
    id: LeaseKey<K>,
    settled: bool,
}

impl<K, G, L, C> FetchTask<K, G, L, C>
where
    K: std::hash::Hash + Eq + Clone + Send + Sync + 'static,
    G: GlobalStore<BucketKey<K>>,
    L: LocalStore<LeaseKey<K>>,
    C: Clock,
{
    async fn run(mut self) {
        let outcome = self.throttle.fetch(&self.id).await;
        self.settled = true;
        self.throttle.settle(&self.id, &outcome);
    }
}

impl<K, G, L, C> Drop for FetchTask<K, G, L, C>
where
    K: std::hash::Hash + Eq + Clone + Send + Sync + 'static,
    G: GlobalStore<BucketKey<K>>,
    L: LocalStore<LeaseKey<K>>,
    C: Clock,
{
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        tracing::debug!("a fetch ended without an answer; its requests go to the failure policy");
        let failed = self
            .throttle
            .local
            .with_bucket(&self.id, |b| b.fail_fetch());
        self.throttle.deliver(&self.id, failed.verdicts);
    }
}

/// The background sweep; marks the sweeper as stopped when it ends, however it ends.
struct Sweeper<K, G, L, C>
where
    K: std::hash::Hash + Eq + Clone + Send + Sync + 'static,
    G: GlobalStore<BucketKey<K>>,
    L: LocalStore<LeaseKey<K>>,
    C: Clock,
{
    throttle: Weak<Throttle<K, G, L, C>>,
}

impl<K, G, L, C> Sweeper<K, G, L, C>
where
    K: std::hash::Hash + Eq + Clone + Send + Sync + 'static,
    G: GlobalStore<BucketKey<K>>,
    L: LocalStore<LeaseKey<K>>,
    C: Clock,
{
    async fn run(self) {
        let Some(period) = self.throttle.upgrade().map(|t| t.config.lease_ttl / 2) else {
            return;
        };
        let mut ticks = tokio::time::interval(period.max(Duration::from_millis(1)));
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            let Some(throttle) = self.throttle.upgrade() else {
                return;
            };
            throttle.global.maintain();
            throttle.return_unused_leases().await;
            // The sweep has just counted every bucket's requests: no second pass over them.
            #[cfg(feature = "metrics")]
            crate::metrics::publish(&crate::metrics::Snapshot {
                layer: &throttle.config.name,
                stats: &throttle.stats.snapshot(),
                refusals: &throttle.refusals.snapshot(),
                local_keys: throttle.local.len(),
                waiting: throttle.waiting_for_batches.load(Ordering::Relaxed)
                    + throttle.shaper.waiting() as u64,
                store_up: throttle.health.is_up(throttle.now()),
            });
        }
    }
}

impl<K, G, L, C> Drop for Sweeper<K, G, L, C>
where
    K: std::hash::Hash + Eq + Clone + Send + Sync + 'static,
    G: GlobalStore<BucketKey<K>>,
    L: LocalStore<LeaseKey<K>>,
    C: Clock,
{
    fn drop(&mut self) {
        if let Some(throttle) = self.throttle.upgrade() {
            throttle.sweeper_running.store(false, Ordering::Relaxed);
        }
    }
}

/// Keys appear in traces only hashed, with a fixed seed so that one key's hash is the same on
/// every host: a key can be followed without being shown.
static KEY_HASH: foldhash::fast::FixedState = foldhash::fast::FixedState::with_seed(0x7468_726f);

/// A call that did not answer within the store time-out.
pub(crate) struct TimedOut(pub(crate) Duration);

impl std::fmt::Display for TimedOut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "no answer within {:?}", self.0)
    }
}

impl Resolved {
    /// A fingerprint of the limit's name and shape.
    fn shape(&self) -> u32 {
        KEY_HASH.hash_one((self.name, self.level, self.limit)) as u32
    }
    fn rejection<K: Clone>(
        &self,
        id: &LeaseKey<K>,
        reason: RejectionReason,
        limit: Limit,
    ) -> Rejection<K> {
        Rejection::new(Some(id.key.clone()), reason).of_limit(
            limit,
            self.name.as_str(),
            self.level.map(Name::as_str),
        )
    }

    /// Refused until `wait_micros` from now.
    fn throttled<K: Clone>(&self, id: &LeaseKey<K>, wait_micros: u64) -> Rejection<K> {
        self.rejection(id, RejectionReason::Throttled, self.limit)
            .with_retry_after(Duration::from_micros(wait_micros.max(1)))
    }

    fn cost_rejection<K: Clone>(&self, id: &LeaseKey<K>, cost: u64) -> Rejection<K> {
        let capacity = self.limit.capacity();
        let reason = RejectionReason::CostExceedsCapacity { cost, capacity };
        self.rejection(id, reason, self.limit)
    }
}

/// A circuit breaker over the global store: after a failure, no key calls the store until a
/// back-off has passed (doubling per failure window, up to a maximum). The first call after it
/// is the probe. Calls that were already under way when the circuit opened belong to the same
/// window, so a burst of concurrent failures is one step, not one per call.
#[derive(Debug, Default)]
pub(crate) struct StoreHealth {
    down_until: AtomicU64,
    failures: Mutex<u32>,
}

const FIRST_BACKOFF: Duration = Duration::from_millis(50);

/// How often a request without a key is logged at warn, at most (micros).
const MISSING_KEY_WARNING_EVERY: u64 = 60_000_000;

impl StoreHealth {
    pub(crate) fn is_up(&self, now: u64) -> bool {
        now >= self.down_until.load(Ordering::Relaxed)
    }

    fn down_until(&self) -> u64 {
        self.down_until.load(Ordering::Relaxed)
    }

    /// A call was answered; `true` when the store was down until then.
    pub(crate) fn succeeded(&self) -> bool {
        if self.down_until.load(Ordering::Relaxed) == 0 {
            return false;
        }
        let mut failures = lock(&self.failures);
        let was_down = *failures > 0;
        *failures = 0;
        self.down_until.store(0, Ordering::Relaxed);
        was_down
    }

    /// A call sent at `sent_at` failed at `now`; `true` when the store goes down with it (the
    /// first failure since it last answered).
    fn failed(&self, sent_at: u64, now: u64, max_backoff: Duration) -> bool {
        let mut failures = lock(&self.failures);
        if sent_at < self.down_until.load(Ordering::Relaxed) {
            return false;
        }
        let went_down = *failures == 0;
        let backoff = FIRST_BACKOFF
            .saturating_mul(1 << (*failures).min(16))
            .min(max_backoff);
        *failures = failures.saturating_add(1);
        self.down_until
            .store(now.saturating_add(micros(backoff)), Ordering::Relaxed);
        went_down
    }
}

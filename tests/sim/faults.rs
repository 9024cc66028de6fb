//! A global store that fails the way real ones do: it answers late (up to and past the
//! throttle's time-out), fails before or after doing its work, hangs, does its work only after
//! the host gave up on it, grants less than it could, and restarts with its state lost. It
//! keeps a ledger of every token it dispensed and took back, and of tokens lost in answers
//! that never arrived, so a run can check that no token appears or disappears.

use hierarchical_throttle::quota::BucketKey;
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hierarchical_throttle::bucket::{TokenBucket, has_expired};
use hierarchical_throttle::clock::{Clock, TokioClock};
use hierarchical_throttle::global::{
    Adjusted, Adjustment, BucketLevel, GlobalStore, Grant, TokenRequest, TokenReturn,
};
use hierarchical_throttle::{Limit, MemoryGlobalStore};

use super::Rng;

/// How often each fault strikes (per mille of calls), and when the store restarts.
#[derive(Debug, Clone, Default)]
pub struct FaultPlan {
    /// Every answer is delayed uniformly up to this.
    pub latency_max: Duration,
    /// Fails without doing anything.
    pub error_before: u64,
    /// Does its work, then fails: the answer is lost.
    pub error_after: u64,
    /// Does its work, then never answers.
    pub hang: u64,
    /// Does its work, then answers after the time-out.
    pub too_slow: u64,
    /// Does its work only after the host gave up on it, and never answers: a store that
    /// stalled with the call in its socket buffer (between `late_by` and `late_reach` after it
    /// was sent).
    pub applied_late: u64,
    /// The time-out the hosts give a call: a late call is applied no sooner.
    pub late_by: Duration,
    /// The latest a late call is applied after it was sent: three time-outs, or a stall long
    /// enough to reach past a calendar quota's reset.
    pub late_reach: Duration,
    /// A stall of the whole store, from and to (the run's time): every call sent during it
    /// is applied when it ends and never answered (a server paused by a fork, a long script
    /// or a failover, its socket buffers full of calls).
    pub stall: Option<(Duration, Duration)>,
    /// Grants fewer tokens than asked (a store's right).
    pub partial: u64,
    /// When the store restarts, losing every bucket.
    pub restarts: Vec<Duration>,
}

impl FaultPlan {
    /// A plan drawn from `rng`; with `faulty` false, only latency below `timeout` and partial
    /// grants (which are not failures).
    pub fn draw(rng: &mut Rng, timeout: Duration, faulty: bool) -> Self {
        let latencies = [0, 1, 5, 20, 45];
        let latency_max = Duration::from_millis(latencies[rng.below(5) as usize]);
        let partial = [0, 100, 500][rng.below(3) as usize];
        if !faulty {
            return Self {
                latency_max,
                partial,
                ..Self::default()
            };
        }
        let latency_max = if rng.chance(0.2) {
            timeout * 2
        } else {
            latency_max
        };
        let per_mille = |rng: &mut Rng, max: u64| {
            if rng.chance(0.5) {
                rng.range(1, max)
            } else {
                0
            }
        };
        Self {
            latency_max,
            error_before: per_mille(rng, 200),
            error_after: per_mille(rng, 100),
            hang: per_mille(rng, 50),
            too_slow: per_mille(rng, 100),
            partial,
            // Drawn apart (`late`, a stream of the seed's own), so that earlier seeds keep
            // their other draws.
            applied_late: 0,
            late_by: timeout,
            late_reach: timeout * 3,
            stall: None,
            restarts: (0..rng.below(2))
                .map(|_| Duration::from_millis(rng.range(100, 1_500)))
                .collect(),
        }
    }
}

/// Tokens through the store.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Ledger {
    /// Granted or reserved by the store.
    pub dispensed: u64,
    /// Taken back by the store.
    pub returned: u64,
    /// Dispensed in answers that never reached the host, or handed back in calls the host gave
    /// up on before the store saw them.
    pub lost: u64,
    /// Calls applied after their host gave up on them.
    pub applied_late: u64,
    /// Hand-backs and operators' changes dropped because they had expired when they reached
    /// the store.
    pub dropped_expired: u64,
    /// Operators' changes dropped as expired whose answer reached their host (which must tell
    /// the operator so).
    pub dropped_answered: u64,
    /// A calendar quota's tokens taken back into a window after the one they were handed back
    /// in (the next window's allowance grown by the last one's), and operators' changes
    /// applied in a window after the one they were made in.
    pub carried_over: u64,
}

/// A failure the injector made up.
#[derive(Debug, Clone, Copy)]
pub struct Injected {
    pub applied: bool,
}

impl std::fmt::Display for Injected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "injected failure (applied: {})", self.applied)
    }
}

impl std::error::Error for Injected {}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    None,
    ErrorBefore,
    ErrorAfter,
    Hang,
    TooSlow,
    AppliedLate,
}

/// The fault-injecting store, over a [`MemoryGlobalStore`] on tokio's clock. Clones share it.
#[derive(Clone)]
pub struct FaultyGlobal {
    inner: Arc<Mutex<MemoryGlobalStore<String, TokioClock>>>,
    clock: TokioClock,
    plan: Arc<FaultPlan>,
    rng: Arc<Mutex<Rng>>,
    healed: Arc<AtomicBool>,
    ledger: Arc<Mutex<Ledger>>,
    /// When tokens last came back to each bucket.
    returned_at: Arc<Mutex<HashMap<BucketKey<String>, Duration>>>,
    /// The limit of each bucket's last call.
    last_limit: Arc<Mutex<HashMap<BucketKey<String>, Limit>>>,
    restarts: Arc<Mutex<Vec<Duration>>>,
    forgiven: Arc<Mutex<HashMap<BucketKey<String>, u64>>>,
    /// The calls still to be applied late.
    late: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>>,
}

impl FaultyGlobal {
    pub fn new(clock: TokioClock, plan: FaultPlan, seed: u64) -> Self {
        Self {
            inner: Arc::new(Mutex::new(MemoryGlobalStore::with_clock(clock))),
            clock,
            plan: Arc::new(plan),
            rng: Arc::new(Mutex::new(Rng::new(seed ^ 0xfa17))),
            healed: Arc::default(),
            ledger: Arc::default(),
            returned_at: Arc::default(),
            last_limit: Arc::default(),
            restarts: Arc::default(),
            forgiven: Arc::default(),
            late: Arc::default(),
        }
    }

    /// Waits until every call the store is to apply late has been applied.
    pub async fn late_calls_applied(&self) {
        let late = std::mem::take(&mut *self.late.lock().unwrap());
        for call in late {
            call.await.expect("a late call applied");
        }
    }

    /// The store takes `back` for `bucket` now, or drops it if its tokens have expired (a
    /// calendar quota's window they belong to has ended): those are lost. A calendar quota's
    /// tokens taken into a window after the one the hand-back was sent in are carried over.
    async fn take_back(
        &self,
        bucket: BucketKey<String>,
        limit: Limit,
        back: TokenReturn,
        sent_at: Duration,
    ) {
        let origin = self.clock.unix_origin();
        let now = self.clock.now() + origin;
        let expired = back.has_expired(now.as_micros() as u64);
        self.note_limit(&bucket, &limit);
        let Ok(()) = self.store().release(&bucket, &limit, back).await;
        let mut ledger = self.ledger.lock().unwrap();
        if expired {
            ledger.lost += back.tokens;
            ledger.dropped_expired += 1;
            return;
        }
        if self.in_a_later_window(&limit, sent_at) {
            ledger.carried_over += back.tokens;
        }
        ledger.returned += back.tokens;
        self.mark_returned(bucket);
    }

    /// A call to `bucket` under `limit`. While a limit change spreads, hosts call under both
    /// limits, and the store refills the bucket at the rate of the limit it is called under:
    /// a call under another limit than the last is taken as tokens come back, which a host
    /// on the other limit cannot foresee.
    fn note_limit(&self, bucket: &BucketKey<String>, limit: &Limit) {
        let last = self
            .last_limit
            .lock()
            .unwrap()
            .insert(bucket.clone(), *limit);
        if last.is_some_and(|last| last != *limit) {
            self.mark_returned(bucket.clone());
        }
    }

    /// Tokens came back to `bucket` now (see `tokens_reappeared_since`).
    fn mark_returned(&self, bucket: BucketKey<String>) {
        let now = self.clock.now();
        self.returned_at.lock().unwrap().insert(bucket, now);
    }

    /// Whether, for a calendar quota, now is in a window after the one of `sent_at`.
    fn in_a_later_window(&self, limit: &Limit, sent_at: Duration) -> bool {
        let origin = self.clock.unix_origin();
        limit.calendar().is_some_and(|calendar| {
            calendar.next_reset(sent_at + origin) <= self.clock.now() + origin
        })
    }

    /// The store applies an operator's change now, or drops it if it has expired; tokens it
    /// adds are ones the fleet may use on top of its allowance, as if they came back. A
    /// calendar quota's change applied in a window after the one it was made in is carried
    /// over.
    async fn apply_adjustment(
        &self,
        key: BucketKey<String>,
        limit: Limit,
        adjustment: Adjustment,
        expires: Option<Duration>,
        sent_at: Duration,
    ) -> Adjusted {
        let store = self.store();
        let now = (self.clock.now() + self.clock.unix_origin()).as_micros() as u64;
        if has_expired(expires, now) {
            self.ledger.lock().unwrap().dropped_expired += 1;
        } else if self.in_a_later_window(&limit, sent_at) {
            self.ledger.lock().unwrap().carried_over += 1;
        }
        let level = |b: TokenBucket| i128::from(b.tokens()) - i128::from(b.owed());
        let before = level(store.peek(&key, &limit));
        self.note_limit(&key, &limit);
        let Ok(after) = store.adjust(&key, &limit, adjustment, expires).await;
        let added = level(store.peek(&key, &limit)) - before;
        if added > 0 {
            *self
                .forgiven
                .lock()
                .unwrap()
                .entry(key.clone())
                .or_default() += added as u64;
            self.mark_returned(key);
        }
        after
    }

    /// Applies `work` after the delay of a late call (at the end of the stall, if the store
    /// is stalled), whatever became of the call's host.
    fn apply_late(&self, work: impl Future<Output = ()> + Send + 'static) {
        let delay = match self.stalled_until() {
            Some(end) => end - self.clock.now(),
            None => late_delay(
                &mut self.rng.lock().unwrap(),
                self.plan.late_by,
                self.plan.late_reach,
            ),
        };
        let call = tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            work.await;
        });
        self.late.lock().unwrap().push(call);
    }

    /// No more faults or latency from now on.
    pub fn heal(&self) {
        self.healed.store(true, Ordering::SeqCst);
    }

    /// Restarts the store: every bucket is lost, and with them the tokens `limits` owed for
    /// reservations, which the fleet may now use on top of a fresh allowance.
    pub fn restart<'a>(
        &self,
        buckets: impl IntoIterator<Item = (&'a BucketKey<String>, &'a Limit)>,
    ) {
        let old = self.store();
        let mut forgiven = self.forgiven.lock().unwrap();
        for (bucket, limit) in buckets {
            *forgiven.entry(bucket.clone()).or_default() += old.peek(bucket, limit).owed();
        }
        *self.inner.lock().unwrap() = MemoryGlobalStore::with_clock(self.clock);
        self.restarts.lock().unwrap().push(self.clock.now());
    }

    /// Tokens `bucket` gained outside its refill: owed when the store restarted
    /// (reservations it forgot), or added by an operator's change.
    pub fn forgiven(&self, bucket: &BucketKey<String>) -> u64 {
        self.forgiven
            .lock()
            .unwrap()
            .get(bucket)
            .copied()
            .unwrap_or(0)
    }

    pub fn restarts_at(&self) -> Vec<Duration> {
        self.restarts.lock().unwrap().clone()
    }

    pub fn ledger(&self) -> Ledger {
        *self.ledger.lock().unwrap()
    }

    /// A bucket as of now, without taking anything.
    pub fn peek(&self, bucket: &BucketKey<String>, limit: &Limit) -> TokenBucket {
        self.store().peek(bucket, limit)
    }

    /// Whether tokens came back to `bucket` (a hand-back, a restart) within `slack` of `now`:
    /// a host cannot know of those until it next asks.
    pub fn tokens_reappeared_since(
        &self,
        bucket: &BucketKey<String>,
        now: Duration,
        slack: Duration,
    ) -> bool {
        let since = now.saturating_sub(slack);
        let returned = self
            .returned_at
            .lock()
            .unwrap()
            .get(bucket)
            .is_some_and(|&t| t >= since);
        returned || self.restarts.lock().unwrap().iter().any(|&r| r >= since)
    }

    fn store(&self) -> MemoryGlobalStore<String, TokioClock> {
        self.inner.lock().unwrap().clone()
    }

    /// When the stall the store is in now ends, if it is in one.
    fn stalled_until(&self) -> Option<Duration> {
        let now = self.clock.now();
        let (from, to) = self.plan.stall?;
        (from <= now && now < to).then_some(to)
    }

    fn draw(&self) -> (Fault, Duration, bool) {
        if self.healed.load(Ordering::SeqCst) {
            return (Fault::None, Duration::ZERO, false);
        }
        if self.stalled_until().is_some() {
            return (Fault::AppliedLate, Duration::ZERO, false);
        }
        let plan = &self.plan;
        let mut rng = self.rng.lock().unwrap();
        let latency = Duration::from_micros(rng.below(plan.latency_max.as_micros() as u64 + 1));
        let roll = rng.below(1000);
        let mut edge = 0;
        let mut fault = Fault::None;
        for (per_mille, kind) in [
            (plan.error_before, Fault::ErrorBefore),
            (plan.error_after, Fault::ErrorAfter),
            (plan.hang, Fault::Hang),
            (plan.too_slow, Fault::TooSlow),
            (plan.applied_late, Fault::AppliedLate),
        ] {
            edge += per_mille;
            if roll < edge {
                fault = kind;
                break;
            }
        }
        let partial = rng.below(1000) < plan.partial;
        (fault, latency, partial)
    }

    fn cut_want(&self, want: u64) -> u64 {
        self.rng.lock().unwrap().range(1, want.max(1))
    }
}

/// How long after it was sent a store that stalled applies a call the host gave up on after
/// `timeout`: between that and `reach`.
pub fn late_delay(rng: &mut Rng, timeout: Duration, reach: Duration) -> Duration {
    let spread = reach.saturating_sub(timeout).as_micros() as u64;
    timeout + Duration::from_micros(rng.below(spread + 1))
}

/// The way back of a call the store has done: the answer fails, hangs, comes too late, or comes
/// after `latency`.
async fn answer(fault: Fault, latency: Duration) -> Result<(), Injected> {
    match fault {
        Fault::ErrorAfter => return Err(Injected { applied: true }),
        Fault::Hang => std::future::pending::<()>().await,
        Fault::TooSlow => tokio::time::sleep(Duration::from_secs(1)).await,
        Fault::AppliedLate | Fault::None | Fault::ErrorBefore => {}
    }
    tokio::time::sleep(latency).await;
    Ok(())
}

/// Counts `tokens` as lost if dropped armed: the answer carrying them never arrived.
struct LostUnlessDelivered {
    ledger: Arc<Mutex<Ledger>>,
    tokens: u64,
}

impl Drop for LostUnlessDelivered {
    fn drop(&mut self) {
        self.ledger.lock().unwrap().lost += self.tokens;
    }
}

impl GlobalStore<BucketKey<String>> for FaultyGlobal {
    type Error = Injected;

    fn acquire(
        &self,
        key: &BucketKey<String>,
        limit: &Limit,
        request: TokenRequest,
    ) -> impl Future<Output = Result<Grant, Injected>> + Send {
        let (fault, latency, partial) = self.draw();
        let this = self.clone();
        let key = key.clone();
        let limit = *limit;
        async move {
            if fault == Fault::AppliedLate {
                let late = this.clone();
                this.apply_late(async move {
                    late.note_limit(&key, &limit);
                    let Ok(grant) = late.store().acquire(&key, &limit, request).await;
                    let tokens = grant.granted + grant.reserved;
                    let mut ledger = late.ledger.lock().unwrap();
                    ledger.dispensed += tokens;
                    ledger.lost += tokens;
                    ledger.applied_late += 1;
                });
                return std::future::pending().await;
            }
            tokio::time::sleep(latency / 2).await;
            if fault == Fault::ErrorBefore {
                return Err(Injected { applied: false });
            }
            let mut request = request;
            if partial {
                request.want = this.cut_want(request.want).max(request.min);
            }
            this.note_limit(&key, &limit);
            let Ok(grant) = this.store().acquire(&key, &limit, request).await;
            let tokens = grant.granted + grant.reserved;
            this.ledger.lock().unwrap().dispensed += tokens;
            let undelivered = LostUnlessDelivered {
                ledger: this.ledger.clone(),
                tokens,
            };
            answer(fault, latency - latency / 2).await?;
            std::mem::forget(undelivered);
            Ok(grant)
        }
    }

    fn level(
        &self,
        key: &BucketKey<String>,
        limit: &Limit,
    ) -> impl Future<Output = Result<BucketLevel, Injected>> + Send {
        let (store, key, limit) = (self.store(), key.clone(), *limit);
        async move {
            let Ok(level) = store.level(&key, &limit).await;
            Ok(level)
        }
    }

    fn release(
        &self,
        key: &BucketKey<String>,
        limit: &Limit,
        back: TokenReturn,
    ) -> impl Future<Output = Result<(), Injected>> + Send {
        let (fault, latency, _) = self.draw();
        let this = self.clone();
        let key = key.clone();
        let limit = *limit;
        let sent_at = self.clock.now();
        async move {
            if fault == Fault::AppliedLate {
                let late = this.clone();
                this.apply_late(async move {
                    late.take_back(key, limit, back, sent_at).await;
                    late.ledger.lock().unwrap().applied_late += 1;
                });
                return std::future::pending().await;
            }
            // Tokens the host gave up on before the store took them are lost.
            let unsent = LostUnlessDelivered {
                ledger: this.ledger.clone(),
                tokens: back.tokens,
            };
            tokio::time::sleep(latency / 2).await;
            std::mem::forget(unsent);
            if fault == Fault::ErrorBefore {
                return Err(Injected { applied: false });
            }
            this.take_back(key, limit, back, sent_at).await;
            answer(fault, latency - latency / 2).await
        }
    }

    /// An operator's change, with the same latency and errors as other calls (a hang or a late
    /// answer is an error after the change, as the layer's time-out ends it); the oracle
    /// counts tokens a change adds as allowed on top, and as reappeared.
    fn adjust(
        &self,
        key: &BucketKey<String>,
        limit: &Limit,
        adjustment: Adjustment,
        expires: Option<Duration>,
    ) -> impl Future<Output = Result<Adjusted, Injected>> + Send {
        let sent_at = self.clock.now();
        let (fault, latency, _) = self.draw();
        let fault = match fault {
            Fault::Hang | Fault::TooSlow => Fault::ErrorAfter,
            // Only a stalled store applies an operator's change after its caller gave up.
            Fault::AppliedLate if self.stalled_until().is_none() => Fault::None,
            other => other,
        };
        let (this, key, limit) = (self.clone(), key.clone(), *limit);
        async move {
            if fault == Fault::AppliedLate {
                let late = this.clone();
                this.apply_late(async move {
                    late.apply_adjustment(key, limit, adjustment, expires, sent_at)
                        .await;
                    late.ledger.lock().unwrap().applied_late += 1;
                });
                return std::future::pending().await;
            }
            tokio::time::sleep(latency / 2).await;
            if fault == Fault::ErrorBefore {
                return Err(Injected { applied: false });
            }
            let after = this.apply_adjustment(key, limit, adjustment, expires, sent_at);
            let after = after.await;
            answer(fault, latency - latency / 2).await?;
            if !after.applied {
                this.ledger.lock().unwrap().dropped_answered += 1;
            }
            Ok(after)
        }
    }

    fn may_have_applied(&self, error: &Injected) -> bool {
        error.applied
    }

    fn maintain(&self) {
        self.store().maintain();
    }
}

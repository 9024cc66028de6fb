//! Fetching a batch for a key's bucket: one fetch per key and host, in a task of its own
//! whose end, however it comes, settles the key; settling the answer against the limit as it
//! is now, and delivering the verdicts.

use std::hash::BuildHasher;
use std::panic::{AssertUnwindSafe, catch_unwind};

use tracing::Instrument;

use crate::batch::BatchContext;

use crate::global::{Answer, Call};
use crate::lease::{FetchOutcome, Plan, Settled, Verdict, Waiter};
use crate::limit::Limit;
use crate::throttle::calls::{CallFailure, Due, Reply};
use crate::throttle::settle::Owed;
use crate::throttle::{Global, KEY_HASH, Key, Local, Throttle};

use std::sync::Arc;
use std::time::Duration;

use crate::clock::{Clock, micros};
use crate::quota::LeaseKey;

impl<K: Key, G: Global<K>, L: Local<K>, C: Clock> Throttle<K, G, L, C> {
    /// Runs a fetch for bucket `id` in a task of its own (the bucket is marked as fetching).
    /// Without a Tokio runtime the fetch fails at once, and its waiters go to the failure
    /// policy. Out of line and cold: the hit path that calls it once per batch stays small.
    #[cold]
    #[inline(never)]
    pub(crate) fn start_fetch(self: &Arc<Self>, id: LeaseKey<K>) {
        self.fetches.started();
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
    pub(super) async fn fetch(self: &Arc<Self>, id: &LeaseKey<K>) -> FetchOutcome {
        // Let requests already scheduled join this batch before it is sized.
        tokio::task::yield_now().await;
        self.await_hand_backs(id).await;
        let Some(bucket) = self.resolve(id) else {
            // The key's quota no longer has this limit: settling finds that too.
            return FetchOutcome::Skipped;
        };
        let limit = bucket.limit;
        let now = self.now();
        let interval = self.interval(now);
        // Every batch reads the key's quota afresh: a limit changed at run time applies from
        // the next batch, even on a lease that never runs dry.
        // A calendar quota's tokens are not reserved ahead: they would come due in the next
        // window, where the lease does not keep tokens.
        let max_reservation = match limit.calendar() {
            Some(_) => Duration::ZERO,
            None => self.config.max_reservation,
        };
        let reserving = !max_reservation.is_zero();
        // Read before the plan, so a request that joins the fetch after it sends it at once.
        let expedites = self.calls.expedites();
        let plan = self.local.with_bucket(id, |b| {
            self.serve(id, &bucket, b, now);
            b.plan(now, interval, &limit, reserving, self.recheck_after())
        });
        let Some(plan) = plan else {
            return FetchOutcome::Skipped;
        };
        if !self.health.is_up(now) {
            return FetchOutcome::Failed;
        }
        self.note_limit(&limit);
        // Near a calendar quota's reset, before or after it, only what the waiting requests
        // need.
        let batch = match self.keeps_no_tokens(&limit, now) {
            true => plan.needed,
            false => self.batch_size(&limit, &plan),
        };
        let request = plan.request(batch, max_reservation);
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
        let call = Call::Acquire {
            key,
            limit,
            request,
        };
        let linger = micros(self.config.global_batch_linger);
        let interval = micros(self.config.demand_interval);
        let due = match plan.may_wait(linger, now, interval) {
            0 => Due::Now,
            within => Due::Behind {
                since: expedites,
                within: Duration::from_micros(within),
            },
        };
        let Reply { sent_at, answer } = self.call_store(call, due).instrument(span.clone()).await;
        let answered = self.now();
        let latency = answered.saturating_sub(sent_at);
        span.record("latency_us", latency);
        #[cfg(feature = "metrics")]
        crate::metrics::global_call(&self.config.name, Duration::from_micros(latency));
        let _entered = span.enter();
        match answer {
            Ok(Answer::Granted(grant)) => {
                span.record("granted", grant.granted);
                span.record("reserved", grant.reserved);
                tracing::debug!(
                    want = request.want,
                    granted = grant.granted,
                    ready_in = ?grant.ready_in,
                    "global acquire"
                );
                self.store_answered();
                FetchOutcome::Granted {
                    grant,
                    sent_at,
                    from: bucket.name,
                    shape: bucket.shape(),
                }
            }
            Ok(Answer::Released) => FetchOutcome::Failed,
            Err(CallFailure::Store {
                error,
                may_have_applied,
            }) => {
                self.stats.global_errors.incr();
                tracing::debug!(%error, "global acquire failed");
                if may_have_applied {
                    self.stats.tokens_lost.add(request.want);
                }
                self.store_failed(sent_at, answered, &error);
                FetchOutcome::Failed
            }
            Err(CallFailure::TimedOut) => {
                self.stats.global_timeouts.incr();
                self.stats.tokens_lost.add(request.want);
                tracing::debug!(timeout = ?self.config.store_timeout, "global acquire timed out");
                self.store_failed(sent_at, answered, &TimedOut(self.config.store_timeout));
                FetchOutcome::Failed
            }
        }
    }

    /// The batch policy's answer; a policy that panics asks for what the waiters need.
    pub(super) fn batch_size(&self, limit: &Limit, plan: &Plan) -> u64 {
        let cx = BatchContext {
            limit,
            needed: plan.needed,
            demand: &plan.demand,
            intervals: self.config.demand_intervals,
            keep: match self.config.keep_small_leases {
                true => plan.keep,
                false => 0,
            },
        };
        catch_unwind(AssertUnwindSafe(|| self.batch.batch_size(&cx))).unwrap_or_else(|_| {
            tracing::debug!("the batch policy panicked; asking for what the waiters need");
            plan.needed
        })
    }

    /// Takes in `outcome` for bucket `id` and delivers the verdicts, then hands back what the
    /// lease cannot hold and starts the next fetch if requests still wait. The limit is read
    /// again: one changed while the call was under way makes its answer's times stale (and
    /// another name, its tokens another bucket's). Without a limit (the key's quota lost it)
    /// the waiters pass: nothing is left to enforce. Returns what the bucket owes for credit
    /// that the answer did not pay, to charge into debt.
    pub(super) fn settle(
        self: &Arc<Self>,
        id: &LeaseKey<K>,
        outcome: &FetchOutcome,
    ) -> Option<Owed<K>> {
        let now = self.now();
        if let FetchOutcome::Granted { grant, .. } = outcome {
            self.stats
                .tokens_leased
                .add(grant.granted.saturating_add(grant.reserved));
        }
        let bucket = self.resolve(id);
        // When the answer's tokens were asked for: a calendar quota's, handed back, go back
        // into their own window only.
        let asked_at = match outcome {
            FetchOutcome::Granted { sent_at, .. } => *sent_at,
            _ => now,
        };
        let (settled, dispenser) = self.local.with_bucket(id, |b| {
            let settled = match &bucket {
                Some(bucket) => {
                    self.serve(id, bucket, b, now);
                    let mut settled = b.settle(outcome, now, self.interval(now), &bucket.limit);
                    if let FetchOutcome::Granted { .. } = outcome {
                        let next_sweep = now.saturating_add(micros(self.config.lease_ttl) / 2);
                        b.arm_after_answer(next_sweep, &bucket.limit);
                    }
                    // Served the waiters; no token of this window is kept for the next: not
                    // near a reset, nor from an answer asked for before one (a waiter gone
                    // meanwhile left its tokens, which the next window must not spend).
                    if !self.may_take_back(&bucket.limit, asked_at, now) {
                        settled.excess = settled.excess.saturating_add(b.take_usable());
                    }
                    settled
                }
                None => b.drop_limit(),
            };
            (settled, b.dispenser())
        });
        let Settled {
            verdicts,
            excess,
            forfeited,
            refetch,
            unpaid,
            uncharged,
        } = settled;
        self.stats.tokens_forfeited.add(forfeited);
        self.stats.tokens_uncharged.add(uncharged);
        self.deliver(id, verdicts, Some(asked_at));
        if excess > 0 {
            self.defer_return(id.clone(), dispenser, excess, asked_at);
        }
        if refetch {
            self.start_fetch(id.clone());
        }
        let bucket = bucket.filter(|_| unpaid > 0)?;
        Some(Owed {
            id: id.clone(),
            name: bucket.name,
            limit: bucket.limit,
            tokens: unpaid,
        })
    }

    /// Charges into debt what bucket `owed.id` owes for credit that an answer did not pay,
    /// then lets the bucket give credit again. However it ends (an answer, a failure, its task
    /// dropped), what the store did not take is counted as uncharged.
    async fn charge_credit(self: &Arc<Self>, owed: Owed<K>) {
        let mut charge = CreditCharge {
            throttle: self.clone(),
            id: owed.id.clone(),
            uncharged: owed.tokens,
        };
        let charged = self.charge_debt(&owed, true).await;
        charge.uncharged = owed.tokens.saturating_sub(charged);
    }

    /// Sends each verdict; tokens taken for a request that went away go back to the lease
    /// (a calendar quota's only within the window of the batch asked for at `asked_at`;
    /// `None`: moments ago).
    pub(super) fn deliver(
        &self,
        id: &LeaseKey<K>,
        verdicts: Vec<(Waiter, Verdict)>,
        asked_at: Option<u64>,
    ) {
        let mut unclaimed = 0u64;
        for (waiter, verdict) in verdicts {
            let cost = waiter.cost();
            if waiter.deliver(verdict) == Err(Verdict::Admitted) {
                unclaimed = unclaimed.saturating_add(cost);
            }
        }
        if unclaimed > 0 {
            self.take_back(id, unclaimed, asked_at, false);
        }
    }
}

/// A fetch in its task. However the task ends, the key is settled: by the store's answer, or,
/// if the task is dropped first (cancelled, panicked, its runtime shut down), as failed.
struct FetchTask<K: Key, G: Global<K>, L: Local<K>, C: Clock> {
    throttle: Arc<Throttle<K, G, L, C>>,
    id: LeaseKey<K>,
    settled: bool,
}

impl<K: Key, G: Global<K>, L: Local<K>, C: Clock> FetchTask<K, G, L, C> {
    async fn run(mut self) {
        let outcome = self.throttle.fetch(&self.id).await;
        self.settled = true;
        if let Some(owed) = self.throttle.settle(&self.id, &outcome) {
            self.throttle.charge_credit(owed).await;
        }
    }
}

/// A charge of credit into debt under way: when it ends, however it ends, the bucket may give
/// credit again, and what the store did not take is counted.
struct CreditCharge<K: Key, G: Global<K>, L: Local<K>, C: Clock> {
    throttle: Arc<Throttle<K, G, L, C>>,
    id: LeaseKey<K>,
    uncharged: u64,
}

impl<K: Key, G: Global<K>, L: Local<K>, C: Clock> Drop for CreditCharge<K, G, L, C> {
    fn drop(&mut self) {
        self.throttle.stats.tokens_uncharged.add(self.uncharged);
        self.throttle
            .local
            .with_bucket(&self.id, |b| b.end_charge());
    }
}

impl<K: Key, G: Global<K>, L: Local<K>, C: Clock> Drop for FetchTask<K, G, L, C> {
    fn drop(&mut self) {
        self.throttle.fetches.ended();
        if self.settled {
            return;
        }
        tracing::debug!("a fetch ended without an answer; its requests go to the failure policy");
        let failed = self
            .throttle
            .local
            .with_bucket(&self.id, |b| b.fail_fetch());
        self.throttle.stats.tokens_uncharged.add(failed.uncharged);
        self.throttle.deliver(&self.id, failed.verdicts, None);
    }
}

/// A call that did not answer within the store time-out.
pub(crate) struct TimedOut(pub(crate) Duration);

impl std::fmt::Display for TimedOut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "no answer within {:?}", self.0)
    }
}

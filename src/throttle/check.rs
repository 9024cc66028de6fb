//! Deciding a request on one bucket: the hot take, and the slow path when the lease is short
//! (the throttled-key cache, or a place in the key's fetch); waiting for that fetch's verdict.

use tokio::sync::oneshot;

use crate::clock::micros;
use crate::lease::{Hit, LocalBucket, Miss, Verdict, Waiter};
use crate::rejection::Rejection;
use crate::throttle::{Admitted, Check, Global, Key, Local, Resolved, Throttle};

use std::sync::Arc;

use crate::clock::Clock;
use crate::quota::{LeaseKey, Name};

impl<K: Key, G: Global<K>, L: Local<K>, C: Clock> Throttle<K, G, L, C> {
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
    pub(super) fn known_slots(&self, id: &LeaseKey<K>, slots: u8) -> u8 {
        if slots != 0 {
            return slots;
        }
        self.learn_slots(id)
    }

    #[cold]
    #[inline(never)]
    pub(super) fn learn_slots(&self, id: &LeaseKey<K>) -> u8 {
        let slots = self.resolve(id).map_or(1, |bucket| bucket.slots);
        if id.slot == 0 {
            self.local.with_bucket(id, |b| b.set_slots(slots));
        }
        slots
    }

    /// The slow path: the lease held fewer than `cost` tokens.
    #[inline(never)]
    pub(super) fn check_short(self: &Arc<Self>, id: &LeaseKey<K>, cost: u64) -> (Check<K>, u8) {
        let Some(bucket) = self.resolve(id) else {
            // The key's quota no longer has this limit: nothing to enforce.
            return (Check::Admit, 1);
        };
        let limit = bucket.limit;
        if cost > limit.capacity() && bucket.shadow {
            return (self.refused_in_shadow(id, &bucket).into(), bucket.slots);
        }
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
        let credit = self.config.cold_start.credit(&limit);
        let memory = self.recheck_after();
        // Made only for a request that waits: a refusal allocates nothing.
        let mut verdict = None;
        let miss = self.local.with_bucket(id, |b| {
            self.serve(id, &bucket, b, now);
            self.count_served(b);
            b.miss(
                cost,
                now,
                interval,
                &limit,
                store_up,
                credit,
                memory,
                || {
                    let (waiter, receiver) = Waiter::new(cost, now, deadline);
                    verdict = Some(receiver);
                    waiter
                },
            )
        });
        let check = match miss {
            Miss::Admitted => {
                self.stats.admitted_local.incr();
                Check::Admit
            }
            Miss::Credited { start_fetch } => {
                self.stats.admitted_on_credit.incr();
                if start_fetch {
                    self.start_fetch(id.clone());
                }
                Check::Admit
            }
            Miss::Throttled { .. } if bucket.shadow => self.refused_in_shadow(id, &bucket).into(),
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
                match miss {
                    Miss::StartFetch => self.start_fetch(id.clone()),
                    // The fetch may be lingering for others to join its batch.
                    _ => self.expedite_calls(),
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
    /// is known now (cost above capacity, or the global bucket known to be short; the bucket
    /// learns the limit it serves first, as every check makes it). For the
    /// other buckets of a request one bucket has refused, so that the answer names the longest
    /// wait without taking tokens or calling the store.
    /// Also tells how many limits the key's quota has.
    pub(crate) fn known_refusal(&self, id: &LeaseKey<K>, cost: u64) -> (Option<Rejection<K>>, u8) {
        let Some(bucket) = self.resolve(id) else {
            return (None, 1);
        };
        if bucket.shadow {
            return (None, bucket.slots);
        }
        if cost > bucket.limit.capacity() {
            return (Some(bucket.cost_rejection(id, cost)), bucket.slots);
        }
        let (now, memory) = (self.now(), self.recheck_after());
        // What the lease knows must be of the limit it serves now: after a change of limit,
        // a wait known of the one before says nothing.
        let until = self.local.with_bucket(id, |b| {
            self.serve(id, &bucket, b, now);
            b.known_short(cost, now, &bucket.limit, memory)
        });
        let refusal = until.map(|until| bucket.throttled(id, until.saturating_sub(now)));
        (refusal, bucket.slots)
    }

    /// A refusal by bucket `id` of a limit in shadow: counted under the limit's name, and the
    /// use goes on, this bucket having taken nothing.
    pub(crate) fn refused_in_shadow(&self, id: &LeaseKey<K>, bucket: &Resolved) -> Admitted {
        self.stats.shadow_limit_refusals.incr();
        let (level, name) = (bucket.level.map(Name::as_str), bucket.name.as_str());
        self.refusals.count((level, Some(name), "shadow"));
        tracing::debug!(limit = name, "a limit in shadow would have refused");
        Admitted::untaken(id)
    }

    /// Puts back the `cost` tokens a request took from bucket `id` when another of its buckets
    /// refused it in the same check (a later undo goes through
    /// [`take_back`](Self::take_back) too).
    pub(crate) fn undo(&self, id: &LeaseKey<K>, cost: u64) {
        self.take_back(id, cost, None, true);
    }

    /// Tells bucket `b` (of `id`) the limit it serves now, `bucket`: a first bucket learns how
    /// many limits its key has, and a lease of another global bucket (the key changed tiers)
    /// is forfeited, what it owed that bucket for credit uncharged.
    pub(super) fn serve(&self, id: &LeaseKey<K>, bucket: &Resolved, b: &mut LocalBucket, now: u64) {
        if id.slot == 0 {
            b.set_slots(bucket.slots);
        }
        let reshaped = b.reshape(bucket.name, bucket.shape(), &bucket.limit, now);
        self.stats.tokens_forfeited.add(reshaped.forfeited);
        self.stats.tokens_uncharged.add(reshaped.uncharged);
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
            Verdict::Throttled { .. } | Verdict::CostAboveCapacity if bucket.shadow => {
                Ok(this.refused_in_shadow(id, &bucket))
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
            Verdict::CostAboveCapacity => {
                this.stats.refused_cost.incr();
                let bucket = this.resolve(id).unwrap_or(bucket);
                Err(bucket.cost_rejection(id, cost))
            }
        }
    }
}

/// A request's pending verdict: if the request goes away after its tokens were taken for it,
/// they go back to the lease.
///
/// It is made with the request's waiter, before the future that awaits it is first polled: a
/// future dropped unpolled (one of several buckets' waits, after another refused) still gives
/// back what a delivered verdict took.
struct PendingVerdict<K: Key, G: Global<K>, L: Local<K>, C: Clock> {
    throttle: Arc<Throttle<K, G, L, C>>,
    id: LeaseKey<K>,
    cost: u64,
    verdict: oneshot::Receiver<Verdict>,
}

impl<K: Key, G: Global<K>, L: Local<K>, C: Clock> Drop for PendingVerdict<K, G, L, C> {
    fn drop(&mut self) {
        self.verdict.close();
        if let Ok(Verdict::Admitted) = self.verdict.try_recv() {
            self.throttle.take_back(&self.id, self.cost, None, false);
        }
    }
}

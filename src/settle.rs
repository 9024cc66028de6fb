//! Costs known after the response: a request is charged its cost up front, and its response
//! may correct it. A refund goes back into this host's lease (the tokens were leased to it, and
//! are usable again or handed back when the lease expires); a further charge is taken from the
//! lease, and what the lease lacks from the global bucket, into debt if need be, so later
//! requests wait or are refused until the debt is paid.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;

use crate::clock::Clock;
use crate::future::{Admission, Settled, Settling};
use crate::global::{GlobalStore, TokenRequest};
use crate::local::LocalStore;
use crate::quota::{BucketKey, LeaseKey};
use crate::remaining::Remaining;
use crate::response::{OnRejection, Rejection};
use crate::stats::Counter;
use crate::throttle::{Throttle, TimedOut};

/// A rejection handler with a settle hook: made by
/// [`Builder::settle`](crate::Builder::settle). It answers rejections and admitted responses
/// as `R` does, and corrects each admitted request's cost from its response with `F`.
#[derive(Debug, Clone)]
pub struct Settle<R, F> {
    inner: R,
    settle: F,
}

impl<R, F> Settle<R, F> {
    pub(crate) fn new(inner: R, settle: F) -> Self {
        Self { inner, settle }
    }
}

impl<R, F, Req, K, Res, E> OnRejection<Req, K, Res, E> for Settle<R, F>
where
    R: OnRejection<Req, K, Res, E>,
    F: Fn(&Res, u64) -> u64 + Send + Sync + 'static,
{
    fn on_rejection(&self, request: &Req, rejection: Rejection<K>) -> Result<Res, E> {
        self.inner.on_rejection(request, rejection)
    }

    fn annotates_admitted(&self) -> bool {
        self.inner.annotates_admitted()
    }

    fn on_admitted(&self, response: &mut Res, remaining: &[Remaining]) {
        self.inner.on_admitted(response, remaining);
    }

    fn settles(&self) -> bool {
        true
    }

    fn settle(&self, response: &Res, charged: u64) -> u64 {
        (self.settle)(response, charged)
    }
}

/// Tokens used beyond the leases that the global store has not taken yet: counted as
/// uncharged when the charge ends without them (failed, timed out, or dropped with its
/// response).
struct Uncharged<'a> {
    counter: &'a Counter,
    tokens: u64,
}

impl Drop for Uncharged<'_> {
    fn drop(&mut self) {
        if self.tokens > 0 {
            self.counter.add(self.tokens);
        }
    }
}

/// What settling leaves to do: nothing, or charging debt to the global store.
pub(crate) type Charge = Option<BoxFuture<'static, ()>>;

impl<K, G, L, C> Throttle<K, G, L, C>
where
    K: std::hash::Hash + Eq + Clone + Send + Sync + 'static,
    G: GlobalStore<BucketKey<K>>,
    L: LocalStore<LeaseKey<K>>,
    C: Clock,
{
    /// What follows a request of `cost` admitted on `keys` (first buckets of their levels):
    /// the state of its limits when `annotate`, and when `settle`, correcting its cost from
    /// its response first. A request admitted while the store was down may have been admitted
    /// by the failure policy, not from a lease: it gets no refund (its tokens may never have
    /// been taken), only further charges.
    pub(crate) fn admission(
        self: &Arc<Self>,
        mut keys: Vec<LeaseKey<K>>,
        cost: u64,
        annotate: bool,
        settle: bool,
    ) -> Admission {
        if !settle {
            return Admission {
                remaining: self.remaining(&mut keys, annotate),
                settle: None,
            };
        }
        let from_lease = self.admits_from_leases();
        let throttle = self.clone();
        let finish = move |actual: u64| {
            let charge = match from_lease || actual > cost {
                true => throttle.settle_cost(&mut keys, cost, actual),
                false => None,
            };
            let Some(charge) = charge else {
                return Settled::Done(throttle.remaining(&mut keys, annotate));
            };
            Settled::Charging(Box::pin(async move {
                charge.await;
                throttle.remaining(&mut keys, annotate)
            }))
        };
        Admission {
            remaining: Vec::new(),
            settle: Some(Settling {
                charged: cost,
                finish: Box::new(finish),
            }),
        }
    }

    /// Whether a request admitted now took its tokens from a lease: yes while the store is up,
    /// or when the failure policy never admits without one.
    pub(crate) fn admits_from_leases(&self) -> bool {
        self.health.is_up(self.now())
            || matches!(self.config.failure_policy, crate::FailurePolicy::Reject)
    }

    /// The state of the limits of `keys` when `annotate`.
    fn remaining(&self, keys: &mut [LeaseKey<K>], annotate: bool) -> Vec<Remaining> {
        match annotate {
            true => self.remaining_of(keys),
            false => Vec::new(),
        }
    }

    /// Corrects a request charged `charged` tokens on every bucket of `keys` (first buckets of
    /// their levels) to `actual`: refunds into the leases at once; further charges from the
    /// leases at once, and what they lack from the global buckets by the returned future.
    pub(crate) fn settle_cost(
        self: &Arc<Self>,
        keys: &mut [LeaseKey<K>],
        charged: u64,
        actual: u64,
    ) -> Charge {
        if actual == charged {
            return None;
        }
        let mut owed = Vec::new();
        for id in keys.iter_mut() {
            let Some(slots) = self.level_quota(id.level, &id.key).map(|(_, q)| q.slots()) else {
                continue;
            };
            for slot in 0..slots {
                id.slot = slot;
                if actual < charged {
                    self.local
                        .with_bucket(id, |b| b.give_back(charged - actual));
                    continue;
                }
                let more = actual - charged;
                let taken = self.local.with_bucket(id, |b| b.take_up_to(more));
                if taken < more {
                    owed.push((id.clone(), more - taken));
                }
            }
            id.slot = 0;
        }
        if actual < charged {
            self.stats.tokens_refunded.add(charged - actual);
        }
        if owed.is_empty() {
            return None;
        }
        let throttle = self.clone();
        Some(Box::pin(async move {
            let mut uncharged = Uncharged {
                counter: &throttle.stats.tokens_uncharged,
                tokens: owed.iter().map(|(_, tokens)| tokens).sum(),
            };
            for (id, tokens) in owed {
                uncharged.tokens -= throttle.charge_debt(&id, tokens).await;
            }
        }))
    }

    /// Takes `tokens` a host used beyond its lease from bucket `id`'s global bucket, into debt
    /// if need be (reserving them ahead of the refill), in calls of at most a capacity each;
    /// returns how many the store took (all, unless it failed).
    async fn charge_debt(&self, id: &LeaseKey<K>, tokens: u64) -> u64 {
        let Some(bucket) = self.resolve(id) else {
            // The key's quota no longer has this limit: nothing to charge.
            return tokens;
        };
        let mut taken = 0;
        let key = BucketKey::from_parts(id.key.clone(), bucket.level, bucket.name);
        while taken < tokens {
            let chunk = (tokens - taken).min(bucket.limit.capacity());
            // At least one token, so that the answer tells when the next is due (as a fetch's
            // does); the rest reserved ahead of the refill.
            let request = TokenRequest {
                min: 1,
                want: chunk,
                // Far enough for the whole chunk, whatever is owed already.
                max_delay: bucket.limit.time_to_accrue(chunk) + Duration::from_secs(1),
            };
            self.stats.global_calls.incr();
            let call = self.global.acquire(&key, &bucket.limit, request);
            let sent_at = self.now();
            let charged = match tokio::time::timeout(self.config.store_timeout, call).await {
                Ok(Ok(grant)) => {
                    self.health.succeeded();
                    let now = self.now();
                    self.local
                        .with_bucket(id, |b| b.note_global(&grant, sent_at, now, &bucket.limit));
                    grant.granted + grant.reserved
                }
                Ok(Err(error)) => {
                    self.stats.global_errors.incr();
                    self.store_failed(sent_at, self.now(), &error);
                    0
                }
                Err(_) => {
                    self.stats.global_timeouts.incr();
                    self.store_failed(sent_at, self.now(), &TimedOut(self.config.store_timeout));
                    0
                }
            };
            taken += charged;
            if charged < chunk {
                tracing::debug!(tokens, taken, "settle could not charge the global store");
                break;
            }
        }
        taken
    }
}

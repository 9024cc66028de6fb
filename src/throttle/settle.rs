//! Costs known after the response: a request is charged its cost up front, and its response
//! may correct it. A refund goes back into this host's lease, only the lease that gave the
//! tokens (the tokens were leased to it, and are usable again or handed back when the lease
//! expires); a further charge is taken from the lease, and what the lease lacks from the
//! global bucket, into debt if need be (at most a capacity, in one call per bucket), so later
//! requests wait or are refused until the debt is paid.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_util::future::BoxFuture;

use crate::clock::Clock;
use crate::global::{Answer, Call, TokenRequest};
use crate::limit::Limit;
use crate::quota::{LeaseKey, Name, Quota};
use crate::remaining::Remaining;
use crate::stats::Counter;
use crate::throttle::calls::{CallFailure, Due, Reply};
use crate::throttle::{Admitted, Global, Key, Local, Throttle, TimedOut};

/// What follows an admitted request's response: settling its cost, then adding the state of
/// its limits.
#[derive(Default)]
pub(crate) struct Admission {
    /// The state of its limits to add (when not settling: settling reads them afterwards).
    pub(crate) remaining: LimitStates,
    pub(crate) settle: Option<Settling>,
}

/// The state of a request's limits, for its response. It travels in the response future, so
/// the common case is small: the layer's one limit (the same for every key, see
/// [`RequestPolicy::one_limit`](crate::policy::RequestPolicy)) as three numbers, filled into
/// the layer's description of that limit only when the response is annotated.
#[derive(Default)]
pub(crate) enum LimitStates {
    #[default]
    None,
    /// The state of the layer's one limit.
    OfTheOneLimit(OneLimitState),
    One(Box<Remaining>),
    Many(Vec<Remaining>),
}

/// What the lease told of the layer's one limit for a request: the rest of its description is
/// the same for every request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OneLimitState {
    pub(crate) tokens: u64,
    /// Microseconds until the bucket holds more (zero when full).
    pub(crate) next_in: u64,
    /// Microseconds until the bucket is full again (zero when it is).
    pub(crate) full_in: u64,
}

impl OneLimitState {
    /// `template` (the layer's one limit, described as its fields describe it) in this state.
    pub(crate) fn filled_in(self, template: &Remaining) -> Remaining {
        Remaining {
            tokens: self.tokens,
            next_in: Duration::from_micros(self.next_in),
            full_in: Duration::from_micros(self.full_in),
            ..template.clone()
        }
    }
}

impl LimitStates {
    /// The states, with the layer's one limit described by `one_limit`: `f` sees them as a
    /// slice.
    pub(crate) fn with_slice<T>(
        &self,
        one_limit: Option<&Remaining>,
        f: impl FnOnce(&[Remaining]) -> T,
    ) -> T {
        match self {
            Self::None => f(&[]),
            Self::OfTheOneLimit(state) => match one_limit {
                Some(template) => f(std::slice::from_ref(&state.filled_in(template))),
                None => f(&[]),
            },
            Self::One(one) => f(std::slice::from_ref(one)),
            Self::Many(many) => f(many),
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        match self {
            Self::None => true,
            Self::Many(many) => many.is_empty(),
            Self::OfTheOneLimit(_) | Self::One(_) => false,
        }
    }
}

impl From<Vec<Remaining>> for LimitStates {
    fn from(mut states: Vec<Remaining>) -> Self {
        match states.len() {
            0 => Self::None,
            1 => states
                .pop()
                .map_or(Self::None, |one| Self::One(Box::new(one))),
            _ => Self::Many(states),
        }
    }
}

impl From<Option<Remaining>> for LimitStates {
    fn from(state: Option<Remaining>) -> Self {
        state.map_or(Self::None, |one| Self::One(Box::new(one)))
    }
}

impl Admission {
    /// Whether nothing follows the response: no cost to settle, no fields to add.
    pub(crate) fn is_plain(&self) -> bool {
        self.remaining.is_empty() && self.settle.is_none()
    }
}

/// A request's cost to correct from its response: what it was charged, and what corrects it
/// to the real cost.
pub(crate) struct Settling {
    pub(crate) charged: u64,
    pub(crate) finish: Box<dyn FnOnce(u64) -> Corrected + Send>,
}

/// A corrected cost: the state of the request's limits to add now, or once the global store
/// has taken what the leases lacked.
pub(crate) enum Corrected {
    Done(Vec<Remaining>),
    Charging(BoxFuture<'static, Vec<Remaining>>),
}

/// Tokens used beyond the leases that the global store has not taken yet: counted as
/// uncharged when the charge ends without them (failed, timed out, skipped during a back-off,
/// beyond what one call can take, or dropped with its response).
struct Uncharged<'a> {
    counter: &'a Counter,
    tokens: AtomicU64,
}

impl Uncharged<'_> {
    fn charged(&self, tokens: u64) {
        self.tokens.fetch_sub(tokens, Ordering::Relaxed);
    }
}

impl Drop for Uncharged<'_> {
    fn drop(&mut self) {
        let tokens = *self.tokens.get_mut();
        if tokens > 0 {
            self.counter.add(tokens);
        }
    }
}

/// A key's buckets a request drew on at one level: the first's id and the key's quota there
/// when the request was admitted, so that settling reaches the buckets that gave the tokens
/// even if the key changed tiers since.
pub(crate) type Drawn<K> = (LeaseKey<K>, Quota);

/// What a bucket is owed beyond its lease: its id, the limit's name and shape, and the tokens.
pub(super) struct Owed<K> {
    pub(super) id: LeaseKey<K>,
    pub(super) name: Name,
    pub(super) limit: Limit,
    pub(super) tokens: u64,
}

/// What settling leaves to do: nothing, or charging debt to the global store.
pub(crate) type Charge = Option<BoxFuture<'static, ()>>;

impl<K: Key, G: Global<K>, L: Local<K>, C: Clock> Throttle<K, G, L, C> {
    /// What follows a request of `cost` admitted on `keys` (first buckets of their levels) as
    /// `admitted`: the state of its limits when `annotate`, and when `settle`, correcting its
    /// cost from its response first, on the buckets it drew on (their quotas are read now).
    pub(crate) fn admission(
        self: &Arc<Self>,
        mut keys: Vec<LeaseKey<K>>,
        cost: u64,
        admitted: Admitted,
        annotate: bool,
        settle: bool,
    ) -> Admission {
        if !settle {
            return Admission {
                remaining: self.remaining(&mut keys, annotate).into(),
                settle: None,
            };
        }
        let admitted = self.stamped(admitted);
        let drawn: Vec<Drawn<K>> = keys
            .iter()
            .filter_map(|id| Some((id.clone(), self.quota(id.level, &id.key)?)))
            .collect();
        let throttle = self.clone();
        let finish = move |actual: u64| {
            let Some(charge) = throttle.settle_cost(&drawn, cost, actual, admitted) else {
                return Corrected::Done(throttle.remaining(&mut keys, annotate));
            };
            Corrected::Charging(Box::pin(async move {
                charge.await;
                throttle.remaining(&mut keys, annotate)
            }))
        };
        Admission {
            remaining: LimitStates::None,
            settle: Some(Settling {
                charged: cost,
                finish: Box::new(finish),
            }),
        }
    }

    /// The state of the limits of `keys` when `annotate`.
    fn remaining(&self, keys: &mut [LeaseKey<K>], annotate: bool) -> Vec<Remaining> {
        match annotate {
            true => self.remaining_of(keys),
            false => Vec::new(),
        }
    }

    /// Corrects a request charged `charged` tokens on every bucket it `drew` on, admitted as
    /// `admitted`, to `actual`. A refund goes at once into each lease that gave the tokens: not
    /// into a bucket the failure policy decided (it gave none), nor into a lease that now holds
    /// another limit's tokens (the key changed tiers), nor into a calendar quota's lease when
    /// its reset came (or is near) since the admission; those refunds are forfeited. A further
    /// charge is taken from the leases at once, and what they lack from the global buckets by
    /// the returned future.
    pub(crate) fn settle_cost(
        self: &Arc<Self>,
        drawn: &[Drawn<K>],
        charged: u64,
        actual: u64,
        admitted: Admitted,
    ) -> Charge {
        if actual == charged || admitted.in_shadow() {
            return None;
        }
        let mut owed = Vec::new();
        let (mut refunded, mut forfeited) = (0u64, 0u64);
        for (first, quota) in drawn {
            let mut id = first.clone();
            for (slot, (name, limit)) in (0..).zip(quota.slots_iter()) {
                id.slot = slot;
                if actual < charged {
                    let refund = charged - actual;
                    // `None`: not the lease's to take back. What overflows a lease that holds
                    // its capacity is forfeited too.
                    let into_lease = admitted.leased(id.level, slot)
                        && self.may_take_back_now(&limit, admitted.admitted_at());
                    let overflowed = match into_lease {
                        true => self.local.with_bucket(&id, |b| {
                            let ours = b.holds_tokens_of(name);
                            ours.then(|| b.give_back(refund, limit.capacity()))
                        }),
                        false => None,
                    };
                    match overflowed {
                        Some(lost) => {
                            refunded = refunded.saturating_add(refund - lost);
                            forfeited = forfeited.saturating_add(lost);
                        }
                        None => forfeited = forfeited.saturating_add(refund),
                    }
                    continue;
                }
                let more = actual - charged;
                let taken = self
                    .local
                    .with_bucket(&id, |b| match b.holds_tokens_of(name) {
                        true => b.take_up_to(more),
                        false => 0,
                    });
                if taken < more {
                    let tokens = more - taken;
                    let id = id.clone();
                    owed.push(Owed {
                        id,
                        name,
                        limit,
                        tokens,
                    });
                }
            }
        }
        self.stats.tokens_refunded.add(refunded);
        self.stats.tokens_forfeited.add(forfeited);
        if owed.is_empty() {
            return None;
        }
        let throttle = self.clone();
        Some(Box::pin(async move {
            let uncharged = Uncharged {
                counter: &throttle.stats.tokens_uncharged,
                tokens: AtomicU64::new(owed.iter().fold(0, |sum, o| sum.saturating_add(o.tokens))),
            };
            let charges = owed.iter().map(|owed| async {
                uncharged.charged(throttle.charge_debt(owed, false).await);
            });
            futures_util::future::join_all(charges).await;
        }))
    }

    /// Takes the tokens a host used beyond its lease from their global bucket, into debt if
    /// need be (reserving them ahead of the refill): one call, of at most a capacity, and none
    /// while the store is backing off. Returns how many the store took. `for_credit`: the
    /// tokens were admitted on credit, which its answer lets the bucket give again.
    pub(super) async fn charge_debt(self: &Arc<Self>, owed: &Owed<K>, for_credit: bool) -> u64 {
        if !self.health.is_up(self.now()) {
            return 0;
        }
        let limit = &owed.limit;
        let chunk = owed.tokens.min(limit.capacity());
        // At least one token, so that the answer tells when the next is due (as a fetch's
        // does); the rest reserved ahead of the refill, far enough for the whole chunk at its
        // highest price, whatever is owed already.
        let request = TokenRequest {
            min: 1,
            want: chunk,
            max_delay: limit.time_to_pay(chunk) + Duration::from_secs(1),
        };
        self.stats.global_calls.incr();
        let key = self.global_key(&owed.id, owed.name);
        let call = Call::Acquire {
            key,
            limit: *limit,
            request,
        };
        // At once: a settle's response (or its caller) waits for its charge, and while a
        // credit's debt is being charged its key gives no credit, so its requests wait.
        let Reply { sent_at, answer } = self.call_store(call, Due::Now).await;
        match answer {
            Ok(Answer::Granted(grant)) => {
                self.store_answered();
                let now = self.now();
                // What the answer says of its bucket, for the lease of that bucket only, and
                // only while its limit is the one the answer was computed with (the key may
                // have moved to another tier, or its limit changed, since it was admitted).
                let current = self.resolve(&owed.id);
                if current.is_some_and(|c| c.name == owed.name && c.limit == *limit) {
                    self.local.with_bucket(&owed.id, |b| {
                        if !b.holds_tokens_of(owed.name) {
                            return;
                        }
                        match for_credit {
                            true => b.note_charge(&grant, sent_at, now, limit),
                            false => b.note_global(&grant, sent_at, now, limit),
                        }
                    });
                }
                grant.granted.saturating_add(grant.reserved)
            }
            Ok(Answer::Released) => 0,
            Err(CallFailure::Store { error, .. }) => {
                self.stats.global_errors.incr();
                self.store_failed(sent_at, self.now(), &error);
                0
            }
            Err(CallFailure::TimedOut) => {
                self.stats.global_timeouts.incr();
                self.store_failed(sent_at, self.now(), &TimedOut(self.config.store_timeout));
                0
            }
        }
    }
}

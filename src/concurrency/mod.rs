//! Fleet-wide concurrency limits: at most N requests in flight per key across all hosts.
//!
//! A [`HierarchicalConcurrencyLayer`] takes a slot when it admits a request and gives it back
//! when the response's body ends (or the request is cancelled, or its handler panics). Slots
//! are leased to hosts like tokens: each host asks the [`SlotStore`] for what it needs, uses
//! what it holds without a call, and gives back what stays idle; each holding expires unless
//! renewed, so the slots of a host that dies come back. Refusals and admitted responses carry
//! the limit's `RateLimit` fields (admitted ones: the slots the host sees free).

mod acquire;
mod body;
mod builder;
mod future;
mod service;

use std::hash::Hash;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::clock::{Clock, MonotonicClock};
use crate::global::slots::SlotStore;
use crate::in_flight::{Acquired, InFlight, NoSlot};
use crate::key::MissingKey;
use crate::policy::ExemptFn;
use crate::quota::BucketKey;
use crate::rejection::{Rejection, RejectionReason};
use crate::response::{DefaultRejection, OnRejection};

pub use crate::in_flight::SlotPermit;
pub use acquire::AcquireSlot;
pub use body::SlotBody;
pub use builder::{ConcurrencyBuilder, DEFAULT_CONCURRENCY_NAME};
pub use future::ResponseFuture;
pub use service::HierarchicalConcurrency;

type KeyFn<Req, K> = Box<dyn Fn(&Req) -> Option<K> + Send + Sync>;

/// A [`tower_layer::Layer`] that limits each key to `max` requests in flight, fleet-wide.
///
/// ```
/// use axum::{Router, body::Body, routing::get};
/// use http::{Request, StatusCode};
/// use hierarchical_throttle::{HierarchicalConcurrencyLayer, MemoryGlobalStore, key};
/// use tower::ServiceExt;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let in_flight = HierarchicalConcurrencyLayer::builder()
///     .key(|req: &Request<Body>| key::header_value(req, "x-api-key"))
///     .max_in_flight(2)
///     .store(MemoryGlobalStore::new()) // RedisGlobalStore for a fleet
///     .build()?;
/// let app = Router::new().route("/", get(|| async { "hello" })).layer(in_flight.clone());
///
/// // Two slots for k1: both taken by requests still running (held here by hand).
/// let (a, b) = (in_flight.acquire("k1".to_owned()).await?, in_flight.acquire("k1".to_owned()).await?);
/// let call = || Request::get("/").header("x-api-key", "k1").body(Body::empty());
/// let refused = app.clone().oneshot(call()?).await?;
/// assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
/// assert_eq!(refused.headers()["ratelimit-policy"], r#""concurrency";q=2;qu="concurrent-requests""#);
/// drop((a, b));
/// let admitted = app.oneshot(call()?).await?;
/// assert_eq!(admitted.status(), StatusCode::OK);
/// // One slot left while this response's body is open.
/// assert_eq!(admitted.headers()["ratelimit"], r#""concurrency";r=1"#);
/// # Ok(()) }
/// ```
///
/// Cloning the layer (or a service it made) shares its slots, its store and its counters: it
/// is one host's view of the key's slots, not a new limit.
pub struct HierarchicalConcurrencyLayer<Req, K, S, C = MonotonicClock, R = DefaultRejection> {
    shared: Arc<Shared<Req, K, S, C, R>>,
}

pub(crate) struct Shared<Req, K, S, C, R> {
    key: KeyFn<Req, K>,
    /// Requests passed straight through, before their key is read.
    exempt: Option<ExemptFn<Req>>,
    missing_key: MissingKey<K>,
    engine: InFlight<K, S, C>,
    retry_after: Duration,
    /// What a refused request is answered with.
    on_rejection: R,
    /// The `RateLimit` fields of admitted responses (`None`: off).
    fields: Option<Arc<FieldsOf>>,
    /// Shadow mode: a request that gets no slot is served all the same, without one.
    shadow: bool,
}

/// What a layer's admitted responses show of its limit: the item name, and the policy field
/// of the layer-wide limit (when there is one), written once.
pub(crate) struct FieldsOf {
    name: Arc<str>,
    common: Option<(u64, http::HeaderValue)>,
}

impl FieldsOf {
    pub(crate) fn new(name: Arc<str>, common_max: Option<u64>) -> Self {
        let common = common_max.map(|max| (max, Self::policy_of(&name, max)));
        Self { name, common }
    }

    fn policy_of(name: &str, max: u64) -> http::HeaderValue {
        crate::response::concurrency_policy(name, max, crate::fields::CONCURRENT_REQUESTS)
    }

    /// The policy field for a key whose limit is `max`.
    fn policy(&self, max: u64) -> http::HeaderValue {
        match &self.common {
            Some((common, policy)) if *common == max => policy.clone(),
            _ => Self::policy_of(&self.name, max),
        }
    }
}

/// The `RateLimit` fields an admitted response gets: the layer's, and the key's limit when it
/// was admitted.
pub(crate) struct AdmittedFields {
    of: Arc<FieldsOf>,
    max: u64,
}

impl AdmittedFields {
    /// Appends the fields to `headers`, with the slots `permit`'s host sees free now (none
    /// for a request served without a slot in shadow mode, as its refusal would have said).
    pub(crate) fn append_to(&self, headers: &mut http::HeaderMap, permit: Option<&SlotPermit>) {
        let free = permit.map_or(0, |permit| permit.free(self.max));
        let policy = self.of.policy(self.max);
        crate::response::append_concurrency_fields(headers, &self.of.name, policy, free);
    }
}

impl<Req, K, S, C, R> Clone for HierarchicalConcurrencyLayer<Req, K, S, C, R> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl<Req, K, S, C, R> std::fmt::Debug for HierarchicalConcurrencyLayer<Req, K, S, C, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HierarchicalConcurrencyLayer")
            .finish_non_exhaustive()
    }
}

/// A concurrency layer's counters on this host, since it was built.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConcurrencyStats {
    /// Requests given a slot (or admitted by the failure policy).
    pub admitted: u64,
    /// Of the admitted, those admitted at once on credit
    /// ([`cold_start`](crate::ConcurrencyBuilder::cold_start)).
    pub admitted_on_credit: u64,
    /// Requests refused because their key's slots were all in use, fleet-wide (counted as
    /// each hears it: a request cancelled while it waited is neither admitted nor refused).
    pub refused_full: u64,
    /// Requests refused because the store failed and the failure policy refused them
    /// (counted alike).
    pub refused_unavailable: u64,
    /// Calls made to the slot store.
    pub store_calls: u64,
    /// Round trips to the slot store: the calls of all keys made together go as one batch
    /// (on Redis, one script per node).
    pub store_round_trips: u64,
    /// Calls to the slot store that failed or timed out.
    pub store_failures: u64,
    /// Requests passed through without a slot: [exempt](crate::ConcurrencyBuilder::exempt)
    /// from the limit. Not counted above.
    pub requests_exempt: u64,
    /// Requests served all the same, without a slot, that would have been refused
    /// ([shadow mode](crate::ConcurrencyBuilder::shadow)): as full or unavailable (counted
    /// above too), or for want of a key under [`MissingKey::Reject`].
    pub shadow_admitted: u64,
}

impl<Req, K, S, C, R> HierarchicalConcurrencyLayer<Req, K, S, C, R>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    S: SlotStore<BucketKey<K>>,
    C: Clock,
{
    /// A slot for `key`, outside a tower service (a WebSocket session, a job): held until the
    /// permit is dropped. Refused with [`RejectionReason::TooManyInFlight`] when the key's
    /// slots are all in use fleet-wide (in [shadow mode](crate::ConcurrencyBuilder::shadow),
    /// given a permit that [holds no slot](SlotPermit::holds_slot) instead). Call it on a
    /// Tokio runtime: the slot is taken (or the store asked) when it is called, and the
    /// returned future only waits for the answer.
    pub fn acquire(&self, key: K) -> AcquireSlot<K> {
        match self.shared.engine.try_acquire(&key) {
            Acquired::Now(permit) => AcquireSlot::taken(permit),
            Acquired::Refused(_) if self.shared.shadow => {
                AcquireSlot::taken(self.shared.engine.shadow_permit())
            }
            Acquired::Refused(no_slot) => {
                AcquireSlot::refused(self.shared.rejection(Some(key), no_slot))
            }
            Acquired::Wait(wait) => {
                let (engine, retry_after) = (self.shared.engine.clone(), self.shared.retry_after);
                let shadow = self.shared.shadow;
                let refuse = move |no_slot| match shadow {
                    true => Ok(engine.shadow_permit()),
                    false => Err(rejection(&engine, retry_after, Some(key), no_slot)),
                };
                AcquireSlot::waiting(wait, Box::new(refuse))
            }
        }
    }

    /// The most requests `key` may have in flight, fleet-wide, now.
    pub fn max_in_flight(&self, key: &K) -> u64 {
        self.shared.engine.max_for(key)
    }

    /// The slots of `key` this host sees free now, `permit` (one of `key`'s) counted as taken:
    /// [`max_in_flight`](Self::max_in_flight) less what the other hosts held at the store's
    /// last answer and this host's requests in flight; while the store is failing, what the
    /// failure policy's share leaves. What the `RateLimit` field of an admitted response says
    /// (`r`), for slots held outside a tower service.
    pub fn free_slots(&self, key: &K, permit: &SlotPermit) -> u64 {
        permit.free(self.max_in_flight(key))
    }

    /// Requests in flight on this host now, over all keys (an O(keys) walk: for tests and
    /// diagnostics).
    pub fn in_flight(&self) -> u64 {
        self.shared.engine.in_flight()
    }

    /// The engine, for the engine's own tests.
    #[cfg(test)]
    pub(crate) fn engine(&self) -> &InFlight<K, S, C> {
        &self.shared.engine
    }

    /// Keys this host keeps slot state for now.
    pub fn keys(&self) -> usize {
        self.shared.engine.keys()
    }

    /// Gives back to the slot store every slot this host holds beyond its requests still in
    /// flight, and returns once the store has answered: for a host about to stop, so that the
    /// fleet can use them at once instead of after the holding expires
    /// ([`slot_ttl`](crate::ConcurrencyBuilder::slot_ttl)). Call it after the server has
    /// drained, on the runtime that served it; it first waits for the calls under way (each
    /// wait at most two store time-outs). The layer keeps working: a request after it asks the
    /// store anew.
    pub async fn return_all_slots(&self) {
        self.shared.engine.return_all_slots().await;
    }

    /// This host's counters.
    pub fn stats(&self) -> ConcurrencyStats {
        let c = self.shared.engine.counters();
        ConcurrencyStats {
            admitted: self.shared.engine.admitted(),
            admitted_on_credit: c.on_credit.load(Ordering::Relaxed),
            refused_full: c.refused_full.load(Ordering::Relaxed),
            refused_unavailable: c.refused_unavailable.load(Ordering::Relaxed),
            store_calls: c.store_calls.load(Ordering::Relaxed),
            store_round_trips: c.store_round_trips.load(Ordering::Relaxed),
            store_failures: c.store_failures.load(Ordering::Relaxed),
            requests_exempt: c.exempt.load(Ordering::Relaxed),
            shadow_admitted: c.shadow_admitted.load(Ordering::Relaxed),
        }
    }
}

impl<Req, K, S, C, R> Shared<Req, K, S, C, R>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    S: SlotStore<BucketKey<K>>,
    C: Clock,
{
    /// Whether `request` is exempt from the limit (counted when it is).
    fn exempts(&self, request: &Req) -> bool {
        let exempt = self.exempt.as_ref().is_some_and(|exempt| exempt(request));
        if exempt {
            self.engine.count_exempt();
        }
        exempt
    }

    /// The fields of an admitted response for `key`, when they are on.
    fn admitted_fields(&self, key: &K) -> Option<AdmittedFields> {
        let of = self.fields.as_ref()?;
        Some(AdmittedFields {
            of: of.clone(),
            max: self.engine.max_for(key),
        })
    }

    /// The refusal of a request for `key` that got no slot.
    fn rejection(&self, key: Option<K>, no_slot: NoSlot) -> Rejection<K> {
        rejection(&self.engine, self.retry_after, key, no_slot)
    }

    /// The answer to `request` for `key`, which got no slot (at once, or after its wait); none
    /// in shadow mode, where it is served without a slot (and counted so).
    fn refuse<Res, E>(&self, request: &Req, key: K, no_slot: NoSlot) -> Option<Result<Res, E>>
    where
        R: OnRejection<Req, K, Res, E>,
    {
        if self.shadow {
            self.engine.count_shadow_admitted();
            return None;
        }
        let rejection = self.rejection(Some(key), no_slot);
        Some(self.on_rejection.on_rejection(request, rejection))
    }
}

/// The refusal of a request for `key` that got no slot from `engine`.
fn rejection<K, S, C>(
    engine: &InFlight<K, S, C>,
    retry_after: Duration,
    key: Option<K>,
    no_slot: NoSlot,
) -> Rejection<K>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    S: SlotStore<BucketKey<K>>,
    C: Clock,
{
    let settings = engine.settings();
    let reason = match no_slot {
        NoSlot::Full => RejectionReason::TooManyInFlight {
            max: key.as_ref().map_or(0, |key| engine.max_for(key)),
        },
        NoSlot::Unavailable => RejectionReason::StoreUnavailable,
    };
    let mut rejection = Rejection::new(key, reason).with_retry_after(retry_after);
    rejection.limit_name = Some(settings.name.as_str());
    rejection.unit = crate::fields::CONCURRENT_REQUESTS;
    if settings.layer != crate::quota::Name::intern(crate::quota::DEFAULT_LAYER) {
        rejection.layer = Some(settings.layer.as_str());
    }
    rejection
}

impl<Inner, Req, K, S, C, R> tower_layer::Layer<Inner>
    for HierarchicalConcurrencyLayer<Req, K, S, C, R>
{
    type Service = HierarchicalConcurrency<Inner, Req, K, S, C, R>;

    fn layer(&self, inner: Inner) -> Self::Service {
        HierarchicalConcurrency::new(inner, self.clone())
    }
}

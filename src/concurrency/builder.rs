//! [`ConcurrencyBuilder`]: a concurrency layer's settings, checked when it is built.

use std::hash::Hash;
use std::sync::Arc;
use std::time::Duration;

use crate::builder::Unset;
use crate::clock::{Clock, MonotonicClock};
use crate::concurrency::{FieldsOf, HierarchicalConcurrencyLayer, KeyFn, Shared};
use crate::credit::ColdStart;
use crate::error::ConfigError;
use crate::failure::FailurePolicy;
use crate::global::slots::SlotStore;
use crate::in_flight::{Fallback, InFlight, MaxFn, Settings};
use crate::key::MissingKey;
use crate::policy::ExemptFn;
use crate::quota::{BucketKey, DEFAULT_LAYER, Name, item_name};
use crate::response::DefaultRejection;

/// The name a concurrency limit goes by unless told (in the `RateLimit` fields and the
/// store's keys).
pub const DEFAULT_CONCURRENCY_NAME: &str = "concurrency";

/// Builds a [`HierarchicalConcurrencyLayer`]; see its example. Setters consume and return
/// the builder; [`build`](Self::build) checks every setting.
pub struct ConcurrencyBuilder<Req, K, S, C = MonotonicClock, R = DefaultRejection> {
    key: Option<KeyFn<Req, K>>,
    exempt: Option<ExemptFn<Req>>,
    missing_key: MissingKey<K>,
    max_per_key: Option<MaxFn<K>>,
    store: S,
    clock: C,
    on_rejection: R,
    tuning: Tuning,
}

/// The settings that do not change the builder's type.
struct Tuning {
    max: u64,
    name: String,
    layer: String,
    slot_ttl: Duration,
    linger: Duration,
    store_timeout: Duration,
    store_batch: usize,
    back_off: Duration,
    failure_policy: FailurePolicy,
    retry_after: Duration,
    host: Option<u64>,
    hash_seed: Option<u64>,
    max_wait: Duration,
    fields: bool,
    cold_start: ColdStart,
    shadow: bool,
}

impl HierarchicalConcurrencyLayer<Unset, Unset, Unset> {
    /// A builder with the defaults: slots held 10 s unless renewed, idle slots given back
    /// after 50 ms, a store time-out of 50 ms, up to 128 slot calls in a round trip, a
    /// `Retry-After` of 1 s, and while the store fails each host admitting up to the whole
    /// limit on its own ([`FailurePolicy::LocalFallback`] with one host).
    pub fn builder() -> ConcurrencyBuilder<Unset, Unset, Unset> {
        ConcurrencyBuilder {
            key: None,
            exempt: None,
            missing_key: MissingKey::Reject,
            max_per_key: None,
            store: Unset,
            clock: MonotonicClock::new(),
            on_rejection: DefaultRejection::by_content_type(),
            tuning: Tuning {
                max: 0,
                name: DEFAULT_CONCURRENCY_NAME.to_owned(),
                layer: DEFAULT_LAYER.to_owned(),
                slot_ttl: Duration::from_secs(10),
                linger: Duration::from_millis(50),
                store_timeout: Duration::from_millis(50),
                store_batch: 128,
                back_off: Duration::from_secs(1),
                failure_policy: FailurePolicy::default(),
                retry_after: Duration::from_secs(1),
                host: None,
                hash_seed: None,
                max_wait: Duration::ZERO,
                fields: true,
                cold_start: ColdStart::Exact,
                shadow: false,
            },
        }
    }
}

impl<Req, K, S, C, R> ConcurrencyBuilder<Req, K, S, C, R> {
    /// How a request's key is found: `None` when it has none (see
    /// [`missing_key`](Self::missing_key)).
    pub fn key<Req2, K2, F>(self, key: F) -> ConcurrencyBuilder<Req2, K2, S, C, R>
    where
        F: Fn(&Req2) -> Option<K2> + Send + Sync + 'static,
    {
        ConcurrencyBuilder {
            key: Some(Box::new(key)),
            exempt: None,
            missing_key: MissingKey::Reject,
            // A limit per key of the earlier key type means nothing for the new one.
            max_per_key: None,
            store: self.store,
            clock: self.clock,
            on_rejection: self.on_rejection,
            tuning: self.tuning,
        }
    }

    /// The store the hosts share: a [`MemoryGlobalStore`](crate::MemoryGlobalStore) in one
    /// process, a `RedisGlobalStore` for a fleet (the one a throttle layer uses will do).
    pub fn store<S2>(self, store: S2) -> ConcurrencyBuilder<Req, K, S2, C, R> {
        self.swap(|_, clock, on_rejection| (store, clock, on_rejection))
    }

    /// The clock slot holdings are timed by on this host (a
    /// [`ManualClock`](crate::clock::ManualClock) or [`TokioClock`](crate::clock::TokioClock)
    /// in tests).
    pub fn clock<C2: Clock>(self, clock: C2) -> ConcurrencyBuilder<Req, K, S, C2, R> {
        self.swap(|store, _, on_rejection| (store, clock, on_rejection))
    }

    /// The most requests a key may have in flight, over all hosts, the same for every key
    /// (required unless [`max_in_flight_per_key`](Self::max_in_flight_per_key); at least 1).
    pub fn max_in_flight(mut self, max: u64) -> Self {
        self.tuning.max = max;
        self
    }

    /// Each key's own limit, read every time this host calls the store for the key (so it
    /// may come from a tier and change at run time). A key whose limit is 0 is refused. A
    /// change applies from each host's next call for the key: a raised limit at once for a
    /// host that has none free; a lowered one for new admissions once every host has renewed
    /// (within half the slot time-to-live) and the requests admitted before it have ended.
    pub fn max_in_flight_per_key(
        mut self,
        max: impl Fn(&K) -> u64 + Send + Sync + 'static,
    ) -> Self {
        self.max_per_key = Some(Arc::new(max));
        self
    }

    /// Requests the limit does not apply to: those for which `exempt` returns true go
    /// straight to the inner service, before their key is read, and take no slot (counted in
    /// [`ConcurrencyStats::requests_exempt`](crate::ConcurrencyStats)). Default: none. See
    /// the throttle layer's [`exempt`](crate::Builder::exempt).
    pub fn exempt(mut self, exempt: impl Fn(&Req) -> bool + Send + Sync + 'static) -> Self {
        self.exempt = Some(Box::new(exempt));
        self
    }

    /// How a refused request is answered, as the throttle layer's
    /// [`on_rejection`](crate::Builder::on_rejection): an `Fn(&Req, Rejection<K>) ->
    /// Result<Response, Error>` or any [`OnRejection`](crate::OnRejection). Default:
    /// [`DefaultRejection`] (HTTP 429 with `Retry-After` and the `RateLimit` fields, or gRPC
    /// `RESOURCE_EXHAUSTED`, by the request's content type). The rejection's
    /// [`reason`](crate::Rejection) is [`TooManyInFlight`](crate::RejectionReason) for a key
    /// whose slots are all in use, `StoreUnavailable` or `MissingKey` otherwise.
    pub fn on_rejection<R2>(self, on_rejection: R2) -> ConcurrencyBuilder<Req, K, S, C, R2> {
        self.swap(|store, clock, _| (store, clock, on_rejection))
    }

    /// This builder with its store, clock and rejection types replaced by `f`'s.
    fn swap<S2, C2, R2>(
        self,
        f: impl FnOnce(S, C, R) -> (S2, C2, R2),
    ) -> ConcurrencyBuilder<Req, K, S2, C2, R2> {
        let (store, clock, on_rejection) = f(self.store, self.clock, self.on_rejection);
        ConcurrencyBuilder {
            key: self.key,
            exempt: self.exempt,
            missing_key: self.missing_key,
            max_per_key: self.max_per_key,
            store,
            clock,
            on_rejection,
            tuning: self.tuning,
        }
    }

    /// What to do with a request without a key (default: refuse it, HTTP 400).
    pub fn missing_key(mut self, policy: MissingKey<K>) -> Self {
        self.missing_key = policy;
        self
    }

    /// The limit's name in the `RateLimit` fields and the store (default
    /// [`DEFAULT_CONCURRENCY_NAME`]): ASCII letters, digits, `-`, `_` and `.`.
    pub fn name(mut self, name: &str) -> Self {
        self.tuning.name = name.to_owned();
        self
    }

    /// The layer's name: two concurrency layers on one store with different names keep
    /// their slots apart (default: `default`).
    pub fn layer_name(mut self, name: &str) -> Self {
        self.tuning.layer = name.to_owned();
        self
    }

    /// How long a host's holding lasts at the store unless renewed (default 10 s; at least
    /// ten store time-outs, at most a day). Hosts renew what they hold when half of it is
    /// gone, so this is how long a host that died keeps its slots from the others.
    pub fn slot_ttl(mut self, ttl: Duration) -> Self {
        self.tuning.slot_ttl = ttl;
        self
    }

    /// How long a free slot stays on this host for the next request before it goes back to
    /// the store (default 50 ms, between 1 ms and a quarter of the slot time-to-live). Longer
    /// saves calls to the store; shorter leaves fewer slots idle on one host while another
    /// host's request is refused.
    pub fn linger(mut self, linger: Duration) -> Self {
        self.tuning.linger = linger;
        self
    }

    /// Whether admitted responses carry the limit's `RateLimit-Policy` and `RateLimit` fields
    /// (default: on): `"<name>";q=<max>;qu="concurrent-requests"` and `"<name>";r=<free>`, the
    /// slots this host sees free for the key as the response leaves (the request's own still
    /// taken: its body holds it). Refusals carry them either way.
    pub fn ratelimit_fields(mut self, on: bool) -> Self {
        self.tuning.fields = on;
        self
    }

    /// Shadow mode (a dry run): every decision is made and counted as usual, but no request is
    /// refused and none waits for a slot ([`wait_for_slot`](Self::wait_for_slot) applies only
    /// when enforcing); one that gets no slot (its key's slots all in use fleet-wide, or the
    /// store failing under a refusing [failure policy](Self::failure_policy)) is counted as
    /// refused and in [`ConcurrencyStats::shadow_admitted`](crate::ConcurrencyStats), and
    /// served at once without a slot, so it takes none from the others (a request without a
    /// key that [`missing_key`](Self::missing_key) would refuse is served and counted so too):
    /// its response carries the fields its refusal would have (`r=0`), and
    /// [`acquire`](HierarchicalConcurrencyLayer::acquire) gives it a permit that
    /// [holds no slot](crate::SlotPermit::holds_slot). For rolling a limit out on live traffic
    /// before enforcing it. Default: off.
    pub fn shadow(mut self, on: bool) -> Self {
        self.tuning.shadow = on;
        self
    }

    /// How long a call to the store may take before it counts as failed (default 50 ms).
    pub fn store_timeout(mut self, timeout: Duration) -> Self {
        self.tuning.store_timeout = timeout;
        self
    }

    /// The most slot calls sent to the store in one round trip (default 128; 1 sends every
    /// call on its own; at most 4,096). The calls of all keys made within one scheduler turn
    /// go together as one [`hold_many`](crate::global::slots::SlotStore::hold_many) (on Redis,
    /// one script per node); a queue longer than this goes in several. Each call keeps its own
    /// answer and failure; a round trip has the store time-out. Larger batches save round
    /// trips when many cold keys arrive at once; smaller ones keep each script short, so that
    /// one batch holds a Redis node for less time.
    pub fn store_batch(mut self, max_calls: usize) -> Self {
        self.tuning.store_batch = max_calls;
        self
    }

    /// How long a key's requests are decided by the failure policy, without calls, after a
    /// call for it failed (default 1 s).
    pub fn back_off(mut self, back_off: Duration) -> Self {
        self.tuning.back_off = back_off;
        self
    }

    /// What a host does while the store fails: [`FailurePolicy::Admit`] admits every
    /// request, [`FailurePolicy::Reject`] refuses those that need the store (HTTP 503),
    /// [`FailurePolicy::LocalFallback`] admits up to `max / expected_hosts` (rounded up) in
    /// flight per key on this host (the default, with one host: the whole limit).
    pub fn failure_policy(mut self, policy: FailurePolicy) -> Self {
        self.tuning.failure_policy = policy;
        self
    }

    /// The `Retry-After` a refused client is told (default 1 s; at least 1 s, since the
    /// header counts whole seconds). Slots have no refill time: this is a hint.
    pub fn retry_after(mut self, wait: Duration) -> Self {
        self.tuning.retry_after = wait;
        self
    }

    /// Lets a request wait up to `max_wait` for a slot when its key's slots are all in use,
    /// instead of refusing it at once (the default, `Duration::ZERO`), as tower's
    /// `ConcurrencyLimit` waits: a slot freed on this host goes to the first request waiting
    /// at once; while requests wait, the host asks the store again every linger for slots
    /// freed on other hosts. At most an hour.
    pub fn wait_for_slot(mut self, max_wait: Duration) -> Self {
        self.tuning.max_wait = max_wait;
        self
    }

    /// Whether a request this host's holding cannot cover waits for the store
    /// ([`ColdStart::Exact`], the default) or is admitted at once on credit
    /// ([`ColdStart::Credit`]): then each key not known to be full may have up to `share` of
    /// its limit (at least one request) in flight on this host beyond what the store holds
    /// for it, while a call asks the store to hold them. A key's first request on a host, and
    /// the next one after its idle slots went back, then waits for no round trip. The bound
    /// becomes `max + hosts × credit` requests in flight per key, reached only by a key
    /// already full elsewhere; once an answer says the key is full, no more credit until one
    /// leaves a slot free, and never past the slots the last answer left this host.
    ///
    /// Exact by default, unlike the throttle layer's tokens: a slot taken beyond the limit is
    /// held as long as its request runs, and a concurrency limit usually guards a resource
    /// with little room to spare (a limit of 2 on 8 hosts with one request of credit each
    /// could have 10 in flight).
    pub fn cold_start(mut self, cold_start: ColdStart) -> Self {
        self.tuning.cold_start = cold_start;
        self
    }

    /// This host's identity at the store (default: drawn at random when built). Two hosts
    /// must never share one.
    pub fn host_id(mut self, host: u64) -> Self {
        self.tuning.host = Some(host);
        self
    }

    /// Lays keys out by a hash of `seed` rather than a random one, so that sweeps visit them,
    /// and their calls go to the store, in the same order in every run: for reproducible tests
    /// and simulations. Leave it random where clients choose the keys, so that they cannot aim
    /// many keys at one shard.
    pub fn hash_seed(mut self, seed: u64) -> Self {
        self.tuning.hash_seed = Some(seed);
        self
    }
}

impl<Req, K, S, C, R> ConcurrencyBuilder<Req, K, S, C, R>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    S: SlotStore<BucketKey<K>>,
    C: Clock,
{
    /// The layer, or the first setting that is invalid.
    pub fn build(self) -> Result<HierarchicalConcurrencyLayer<Req, K, S, C, R>, ConfigError> {
        let invalid = |setting, expected| ConfigError::InvalidSetting { setting, expected };
        let t = self.tuning;
        let key = self.key.ok_or(invalid("key", "a key closure"))?;
        // The limit of every key, when it is one for all: its policy field is written once.
        let common_max = self.max_per_key.is_none().then_some(t.max);
        let max: MaxFn<K> = match (self.max_per_key, t.max) {
            (Some(per_key), _) => per_key,
            (None, 0) => return Err(invalid("max_in_flight", "at least one request")),
            (None, max) => Arc::new(move |_: &K| max),
        };
        let ten_time_outs = t.store_timeout.checked_mul(10).unwrap_or(Duration::MAX);
        let day = Duration::from_secs(86_400);
        if t.slot_ttl < ten_time_outs || t.slot_ttl < Duration::from_millis(10) || t.slot_ttl > day
        {
            return Err(invalid(
                "slot_ttl",
                "at least ten store time-outs and 10 ms, at most a day",
            ));
        }
        if t.linger < Duration::from_millis(1) || t.linger > t.slot_ttl / 4 {
            return Err(invalid(
                "linger",
                "between 1 ms and a quarter of the slot time-to-live",
            ));
        }
        if t.store_timeout.is_zero() {
            return Err(invalid("store_timeout", "a time-out above zero"));
        }
        if !(1..=4_096).contains(&t.store_batch) {
            return Err(invalid("store_batch", "1 to 4,096 calls"));
        }
        if t.max_wait > Duration::from_secs(3600) {
            return Err(invalid("wait_for_slot", "at most an hour"));
        }
        if !t.cold_start.is_valid() {
            return Err(invalid("cold_start", "a credit share in (0, 1]"));
        }
        if t.retry_after < Duration::from_secs(1) {
            return Err(invalid("retry_after", "at least one second"));
        }
        let fallback = match t.failure_policy {
            FailurePolicy::Admit => Fallback::All,
            FailurePolicy::Reject => Fallback::None,
            FailurePolicy::LocalFallback { expected_hosts } => Fallback::ShareOf(expected_hosts),
        };
        let (layer, name) = (Name::new(&t.layer)?, Name::new(&t.name)?);
        let fields = t.fields.then(|| {
            let layer = (layer != Name::intern(DEFAULT_LAYER)).then(|| layer.as_str());
            let item = Arc::from(item_name(layer, None, name.as_str()));
            Arc::new(FieldsOf::new(item, common_max))
        });
        let settings = Settings {
            layer,
            name,
            fallback,
            cold_start: t.cold_start,
            slot_ttl: t.slot_ttl,
            linger: t.linger,
            store_timeout: t.store_timeout,
            store_batch: t.store_batch,
            back_off: t.back_off,
            host: t.host.unwrap_or_else(random_host),
            hash_seed: t.hash_seed,
            // A dry run changes nothing a client sees: no request waits for a slot.
            max_wait: Some(t.max_wait).filter(|wait| !wait.is_zero() && !t.shadow),
        };
        Ok(HierarchicalConcurrencyLayer {
            shared: Arc::new(Shared {
                key,
                exempt: self.exempt,
                missing_key: self.missing_key,
                engine: InFlight::new(self.store, self.clock, settings, max),
                retry_after: t.retry_after,
                on_rejection: self.on_rejection,
                fields,
                shadow: t.shadow,
            }),
        })
    }
}

/// A host identity unlikely to be drawn twice in a fleet: the process's random hasher keys,
/// the time and the process id, mixed.
fn random_host() -> u64 {
    use std::hash::BuildHasher;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    std::collections::hash_map::RandomState::new().hash_one((nanos, std::process::id()))
}

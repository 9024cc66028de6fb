//! The builder: every setting checked, and the layer made from them (in `build`).

mod build;
mod global_calls;

use std::fmt;
use std::hash::Hash;
use std::sync::Arc;
use std::time::Duration;

use crate::batch::{BatchPolicy, WeightedDemand};
use crate::clock::{Clock, MonotonicClock};
use crate::error::ConfigError;
use crate::failure::FailurePolicy;
use crate::global::GlobalStore;
use crate::key::{BorrowedKey, MissingKey};
use crate::layer::HierarchicalThrottleLayer;
use crate::limit::Limit;
use crate::local::LocalStore;
use crate::local::memory::MemoryLocalStore;
use crate::policy::{CostFn, ExemptFn};
use crate::quota::{BucketKey, LeaseKey, Name, Quota};
use crate::response::DefaultRejection;
use crate::throttle::key::{BorrowKey, KeyFn, KeyReader};
use crate::throttle::{Config, MAX_SETTING, QuotaSource};

impl HierarchicalThrottleLayer<Unset, Unset, Unset> {
    /// Starts a builder. Set the key first, then the limit and the global store:
    ///
    /// ```
    /// use axum::{Router, body::Body, routing::get};
    /// use http::Request;
    /// use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore, key};
    ///
    /// let layer = HierarchicalThrottleLayer::builder()
    ///     .key_ref(|req: &Request<Body>| key::header_bytes(req, "x-api-key"))
    ///     .limit(Limit::per_second(100).burst(200)?)
    ///     .global_store(MemoryGlobalStore::new())
    ///     .build()?;
    /// let app: Router = Router::new().route("/", get(|| async { "hi" })).layer(layer);
    /// # Ok::<(), hierarchical_throttle::ConfigError>(())
    /// ```
    pub fn builder() -> Builder<Unset, Unset, Unset, Unset, MonotonicClock, DefaultRejection> {
        Builder {
            // Until `key` is set the builder cannot build: `Unset` is not a key.
            key: KeyReader::Owned(Box::new(|_| None)),
            cost: None,
            exempt: None,
            quota: None,
            levels: Vec::new(),
            missing_key: MissingKey::Reject,
            global: Unset,
            local: Unset,
            clock: MonotonicClock::new(),
            on_rejection: DefaultRejection::default(),
            batch: Box::new(WeightedDemand),
            config: Config {
                store_timeout: Duration::from_millis(50),
                lease_ttl: Duration::from_secs(2),
                refusal_memory: None,
                demand_interval: Duration::from_secs(1),
                demand_intervals: 10,
                failure_policy: FailurePolicy::default(),
                max_backoff: Duration::from_secs(1),
                max_reservation: Duration::from_millis(100),
                cold_start: crate::credit::ColdStart::default(),
                keep_small_leases: true,
                global_batch: DEFAULT_GLOBAL_BATCH,
                global_batch_linger: DEFAULT_GLOBAL_BATCH_LINGER,
                shadow: false,
                fields: crate::RateLimitFields::default(),
                costs_vary: false,
                shaping: crate::Shaping::Refuse,
                retry_jitter: Duration::ZERO,
                name: Arc::from(crate::quota::DEFAULT_LAYER),
                layer: Name::intern(crate::quota::DEFAULT_LAYER),
                shadow_limits: Vec::new(),
            },
            error: None,
        }
    }
}

/// A builder setting not given yet.
#[derive(Debug, Clone, Copy, Default)]
pub struct Unset;

/// The most levels a layer has, its first included.
pub const MAX_LEVELS: usize = 8;

/// The most global calls sent in one batch unless [`Builder::global_batch`] says otherwise.
const DEFAULT_GLOBAL_BATCH: usize = 128;

/// How long a call nothing waits on may wait for others unless
/// [`Builder::global_batch_linger`] says otherwise.
const DEFAULT_GLOBAL_BATCH_LINGER: Duration = Duration::from_millis(250);

/// Where the first level's quotas come from, as set on the builder.
enum QuotaSetting<K> {
    Fixed(Quota),
    PerKey(Box<dyn Fn(&K) -> Quota + Send + Sync>),
}

/// A further level, as set on the builder.
struct LevelSetting<Req, K> {
    name: Name,
    key: KeyFn<Req, K>,
    quota: QuotaSource<K>,
}

/// Builds a [`HierarchicalThrottleLayer`]. Setters consume and return the builder; invalid
/// values are reported by [`build`](Self::build).
#[must_use = "call .build() to make the layer"]
pub struct Builder<Req, K, G, L, C, R> {
    key: KeyReader<Req, K>,
    cost: Option<CostFn<Req>>,
    exempt: Option<ExemptFn<Req>>,
    quota: Option<QuotaSetting<K>>,
    levels: Vec<LevelSetting<Req, K>>,
    missing_key: MissingKey<K>,
    global: G,
    local: L,
    clock: C,
    on_rejection: R,
    batch: Box<dyn BatchPolicy>,
    config: Config,
    error: Option<ConfigError>,
}

impl<Req, K, G, L, C, R> fmt::Debug for Builder<Req, K, G, L, C, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let quota = match &self.quota {
            Some(QuotaSetting::Fixed(quota)) => Some(quota.to_string()),
            Some(QuotaSetting::PerKey(_)) => Some("per key".to_owned()),
            None => None,
        };
        f.debug_struct("Builder")
            .field("quota", &quota)
            .field("levels", &self.levels.len())
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl<C, R> Builder<Unset, Unset, Unset, Unset, C, R> {
    /// How a request becomes its throttle key: `None` when it has none (see
    /// [`missing_key`](Builder::missing_key)).
    ///
    /// For a key read from the request as it is (a header, the path), prefer
    /// [`key_ref`](Self::key_ref), which borrows it.
    pub fn key<Req, K, F>(self, key: F) -> Builder<Req, K, Unset, MemoryLocalStore<K>, C, R>
    where
        F: Fn(&Req) -> Option<K> + Send + Sync + 'static,
    {
        self.with_key(KeyReader::Owned(Box::new(key)))
    }

    /// How a request's throttle key is borrowed from it: `Some(&[u8])` for a
    /// [`CompactKey`](crate::key::CompactKey), `Some(&str)` for a `String`, `Some(&T)` for a
    /// `T` (see [`BorrowedKey`](crate::key::BorrowedKey)); `None` when it has none (see
    /// [`missing_key`](Builder::missing_key)).
    ///
    /// With the default local store, a request that the host's leased tokens admit finds its
    /// bucket by the borrowed key and never makes the owned one: no allocation per request.
    /// The key is made only when the request goes further (a batch to fetch, a
    /// refusal to explain, the `RateLimit` fields or levels to read), by calling the closure
    /// again: it must find the same key in the same request (it does, unless it reads
    /// something other than the request).
    ///
    /// Pass the closure here directly, or a `fn`: a closure first kept in a variable does not
    /// borrow its result from its argument, and is refused.
    ///
    /// ```
    /// use axum::body::Body;
    /// use http::{HeaderName, Request};
    /// use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore, key};
    ///
    /// // Parsed once, so that no request parses or hashes the name's text.
    /// const API_KEY: HeaderName = HeaderName::from_static("x-api-key");
    ///
    /// let layer = HierarchicalThrottleLayer::builder()
    ///     .key_ref(|req: &Request<Body>| key::header_bytes(req, &API_KEY))
    ///     .limit(Limit::per_second(100).burst(200)?)
    ///     .global_store(MemoryGlobalStore::new())
    ///     .build()?;
    /// # Ok::<(), hierarchical_throttle::ConfigError>(())
    /// ```
    pub fn key_ref<Req, Q, F>(
        self,
        key: F,
    ) -> Builder<Req, Q::Key, Unset, MemoryLocalStore<Q::Key>, C, R>
    where
        F: for<'r> Fn(&'r Req) -> Option<&'r Q> + Send + Sync + 'static,
        Q: BorrowedKey + ?Sized + 'static,
        Q::Key: 'static,
    {
        self.with_key(KeyReader::Borrowed(Box::new(BorrowKey::new(key))))
    }

    fn with_key<Req, K>(
        self,
        key: KeyReader<Req, K>,
    ) -> Builder<Req, K, Unset, MemoryLocalStore<K>, C, R> {
        Builder {
            key,
            cost: None,
            exempt: None,
            quota: match self.quota {
                Some(QuotaSetting::Fixed(quota)) => Some(QuotaSetting::Fixed(quota)),
                _ => None,
            },
            levels: Vec::new(),
            missing_key: MissingKey::Reject,
            global: Unset,
            local: MemoryLocalStore::new(),
            clock: self.clock,
            on_rejection: self.on_rejection,
            batch: self.batch,
            config: self.config,
            error: self.error,
        }
    }
}

impl<Req, K, G, L, C, R> Builder<Req, K, G, L, C, R> {
    /// The limits every key gets, all of which a request must satisfy: a [`Limit`] or a
    /// [`Quota`] of several named limits (`100/s` **and** `100000/day`).
    ///
    /// ```
    /// use axum::body::Body;
    /// use http::Request;
    /// use hierarchical_throttle::{HierarchicalThrottleLayer, MemoryGlobalStore, Quota, key};
    ///
    /// let layer = HierarchicalThrottleLayer::builder()
    ///     .key_ref(|req: &Request<Body>| key::header_str(req, "x-api-key"))
    ///     .quota("per-second: 100/s burst 200; per-day: 100000/day".parse::<Quota>()?)
    ///     .global_store(MemoryGlobalStore::new())
    ///     .build()?;
    /// # Ok::<(), hierarchical_throttle::ConfigError>(())
    /// ```
    pub fn quota(mut self, quota: impl Into<Quota>) -> Self {
        self.quota = Some(QuotaSetting::Fixed(quota.into()));
        self
    }

    /// The limit every key gets: a [`Quota`] of one limit called
    /// [`default`](crate::quota::DEFAULT_NAME).
    pub fn limit(self, limit: Limit) -> Self {
        self.quota(limit)
    }

    /// How a request is decided when this host holds no leased tokens for it and the global
    /// bucket is not known to be short: admitted at once on a small credit, charged behind the
    /// response (the default, [`ColdStart::Credit`](crate::ColdStart::Credit) of 1 % of the capacity), or kept waiting
    /// for the store ([`ColdStart::Exact`](crate::ColdStart::Exact)). See [`ColdStart`](crate::ColdStart) for the bound each gives. A
    /// share outside `(0, 1]` is a configuration error.
    pub fn cold_start(mut self, cold_start: crate::ColdStart) -> Self {
        self.check(
            cold_start.is_valid(),
            "cold_start",
            "a credit share in (0, 1]",
        );
        self.config.cold_start = cold_start;
        self
    }

    /// The layer's name: part of its global buckets' identities, so that layers sharing a
    /// global store (one Redis for several services, or several layers of one app) never
    /// share buckets; and the `layer` label of its metrics. Give every layer that shares a
    /// store a name of its own, and the same layer the same name on every host of a fleet
    /// (hosts share buckets by it). Names follow [`Quota`]'s rules (1 to 64 ASCII letters,
    /// digits, `-`, `_` or `.`). Default: [`default`](crate::quota::DEFAULT_LAYER).
    ///
    /// In one process, a layer built on a store that another live layer of the same name uses
    /// with other limits is refused at [`build`](Self::build): their buckets would collide.
    pub fn name(mut self, name: &str) -> Self {
        match Name::new(name) {
            Ok(layer) => {
                self.config.layer = layer;
                self.config.name = Arc::from(name);
            }
            Err(error) => {
                self.error.get_or_insert(error);
            }
        }
        self
    }

    /// Shadow mode (a dry run): every decision is made, counted and logged as usual, but no
    /// request is refused; those that would have been are served and counted in
    /// [`ThrottleStats::shadow_admitted`](crate::ThrottleStats), their responses given the
    /// [`RateLimit` fields](Self::ratelimit_fields) of their refusal (or, for a refusal that
    /// names no limit's state, a failed store or a cost above the capacity, those of the key's
    /// limits as the host sees them). For rolling a limit out on live traffic before enforcing
    /// it. Default: off.
    pub fn shadow(mut self, on: bool) -> Self {
        self.config.shadow = on;
        self
    }

    /// One limit in shadow, beside enforced ones: `"per-day"` at the first level, or
    /// `"tenant/per-day"` at level `tenant`. Its bucket takes tokens as usual, but when it
    /// would refuse, the request goes on to the other limits and is served if they admit it;
    /// the would-be refusal is counted under the limit's name
    /// ([`ThrottleStats::shadow_limit_refusals`](crate::ThrottleStats::shadow_limit_refusals),
    /// `throttle_refusals_total{reason="shadow"}`). For rolling out a new limit on live
    /// traffic; [`shadow`](Self::shadow) puts the whole layer in shadow. A name that is not one
    /// of the layer's limits (when its quotas are fixed) is an error at
    /// [`build`](Self::build).
    pub fn shadow_limit(mut self, limit: &str) -> Self {
        let scope = match limit.split_once('/') {
            Some((level, limit)) => {
                Name::new(level).and_then(|level| Ok((Some(level), Name::new(limit)?)))
            }
            None => Name::new(limit).map(|limit| (None, limit)),
        };
        match scope {
            Ok((level, limit)) => self.config.shadow_limits.push((level, Some(limit))),
            Err(error) => {
                self.error.get_or_insert(error);
            }
        }
        self
    }

    /// Every limit of level `level` in shadow: see [`shadow_limit`](Self::shadow_limit).
    pub fn shadow_level(mut self, level: &str) -> Self {
        match Name::new(level) {
            Ok(level) => self.config.shadow_limits.push((Some(level), None)),
            Err(error) => {
                self.error.get_or_insert(error);
            }
        }
        self
    }

    /// What the `RateLimit-Policy` and `RateLimit` fields say ([`RateLimitFields`]: a draft
    /// revision, quota units, partition keys), and whether admitted responses carry them (one
    /// item per limit the request drew on, at every level), as refusals always do. `true` and
    /// `false` turn them on and off. It costs reading each limit's state and writing two
    /// fields per response; turn it off when clients do not read them. Only a rejection
    /// handler that writes them ([`OnRejection::on_admitted`](crate::OnRejection::on_admitted),
    /// as [`DefaultRejection`](crate::DefaultRejection) does) adds anything. Default:
    /// [`RateLimitFields::draft_11`], requests counted in `requests` (in `tokens` with a
    /// [`cost`](Self::cost) or [`settle`](Self::settle)), no partition keys.
    ///
    /// [`RateLimitFields`]: crate::RateLimitFields
    /// [`RateLimitFields::draft_11`]: crate::RateLimitFields::draft_11
    pub fn ratelimit_fields(mut self, fields: impl Into<crate::RateLimitFields>) -> Self {
        let fields = fields.into();
        if let Some(error) = fields.error() {
            self.error.get_or_insert_with(|| error.clone());
        }
        self.config.fields = fields;
        self
    }

    /// Whether a throttled request is refused at once ([`Shaping::Refuse`](crate::Shaping),
    /// the default: policing) or waits for its tokens ([`Shaping::wait`](crate::Shaping::wait):
    /// shaping), in arrival order per key and host, up to a bound.
    ///
    /// A waiting request holds no tokens: each time its tokens are due it is decided like any
    /// other request, so waiting never admits more than refusing would, fleet-wide; if other
    /// hosts took the tokens first it sleeps until the next are due, until its wait runs out.
    /// A request that arrives when its key's lease holds tokens is served at once, ahead of
    /// those waiting. Waits sleep on tokio's timer: in tests, use a clock that follows it
    /// ([`TokioClock`](crate::clock::TokioClock)) with paused time.
    ///
    /// `max` is at most 1 hour, `queue` at least 1.
    pub fn shaping(mut self, shaping: crate::Shaping) -> Self {
        if let crate::Shaping::Wait { max, queue } = shaping {
            self.check(max <= MAX_SETTING, "shaping", "a wait of at most 1 hour");
            self.check(queue >= 1, "shaping", "a queue of at least 1 request");
        }
        self.config.shaping = shaping;
        self
    }

    /// Adds a random delay of up to `max` to every refusal's `retry_after` (so `Retry-After`,
    /// `RateLimit`'s `t` and gRPC's `RetryInfo`), so that clients refused together do not all
    /// come back at the same instant. A client waiting the longer time is never refused for
    /// waiting too little. Default: none; at most 1 hour.
    pub fn retry_after_jitter(mut self, max: Duration) -> Self {
        self.check(max <= MAX_SETTING, "retry_after_jitter", "at most 1 hour");
        self.config.retry_jitter = max;
        self
    }

    /// The clock that times leases, demand and throttled keys. Default: [`MonotonicClock`].
    pub fn clock<C2: Clock>(self, clock: C2) -> Builder<Req, K, G, L, C2, R> {
        self.swap(|global, local, _, on_rejection| (global, local, clock, on_rejection))
    }

    /// How a rejection becomes a response or an error. Default: [`DefaultRejection`] (HTTP and
    /// gRPC, told apart by content type).
    pub fn on_rejection<R2>(self, on_rejection: R2) -> Builder<Req, K, G, L, C, R2> {
        self.swap(|global, local, clock, _| (global, local, clock, on_rejection))
    }

    /// Corrects each admitted request's cost from its response: `settle(&response, charged)`
    /// returns what the request really cost (the [`cost`](Self::cost) closure gave `charged`).
    /// Less refunds the difference into this host's leases; more takes the rest from them,
    /// and what they lack from the global buckets, into debt if need be (so later requests
    /// wait or are refused until it is paid; the response waits for that global call, at most
    /// the store time-out). Every bucket the request drew on is corrected. A request admitted
    /// in shadow mode or by the failure policy's fallback is not settled against the global
    /// store beyond its lease.
    ///
    /// It wraps the rejection handler set so far: call [`on_rejection`](Self::on_rejection)
    /// first.
    ///
    /// ```
    /// use axum::body::Body;
    /// use http::{Request, Response};
    /// use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore, key};
    ///
    /// // An LLM-style endpoint: reserve 1,000 tokens, settle to what the response says it used.
    /// let layer = HierarchicalThrottleLayer::builder()
    ///     .key_ref(|req: &Request<Body>| key::header_str(req, "x-api-key"))
    ///     .limit(Limit::per_minute(100_000).build()?)
    ///     .cost(|_: &Request<Body>| 1_000)
    ///     .settle(|response: &Response<Body>, reserved| {
    ///         response.headers().get("x-tokens-used")
    ///             .and_then(|used| used.to_str().ok()?.parse().ok())
    ///             .unwrap_or(reserved)
    ///     })
    ///     .global_store(MemoryGlobalStore::new())
    ///     .build()?;
    /// # Ok::<(), hierarchical_throttle::ConfigError>(())
    /// ```
    pub fn settle<Res, F>(self, settle: F) -> Builder<Req, K, G, L, C, crate::Settle<R, F>>
    where
        F: Fn(&Res, u64) -> u64 + Send + Sync + 'static,
    {
        let mut settling = self.swap(|global, local, clock, on_rejection| {
            (
                global,
                local,
                clock,
                crate::Settle::new(on_rejection, settle),
            )
        });
        settling.config.costs_vary = true;
        settling
    }

    /// This builder with its store, clock and rejection types replaced by `f`'s.
    fn swap<G2, L2, C2, R2>(
        self,
        f: impl FnOnce(G, L, C, R) -> (G2, L2, C2, R2),
    ) -> Builder<Req, K, G2, L2, C2, R2> {
        let (global, local, clock, on_rejection) =
            f(self.global, self.local, self.clock, self.on_rejection);
        Builder {
            key: self.key,
            cost: self.cost,
            exempt: self.exempt,
            quota: self.quota,
            levels: self.levels,
            missing_key: self.missing_key,
            global,
            local,
            clock,
            on_rejection,
            batch: self.batch,
            config: self.config,
            error: self.error,
        }
    }

    /// Checks that `d` lies between 1 ms and an hour.
    fn check_duration(&mut self, d: Duration, setting: &'static str) {
        let ok = (Duration::from_millis(1)..=MAX_SETTING).contains(&d);
        self.check(ok, setting, "1 ms to 1 hour");
    }

    fn check(&mut self, ok: bool, setting: &'static str, expected: &'static str) {
        if !ok && self.error.is_none() {
            self.error = Some(ConfigError::InvalidSetting { setting, expected });
        }
    }
}

impl<Req, K, G, L, C, R> Builder<Req, K, G, L, C, R>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
{
    /// How many tokens a request costs. Default: 1. A request costing more than its limit's
    /// capacity is refused at once ([`RejectionReason::CostExceedsCapacity`](crate::RejectionReason)).
    /// A request costing nothing takes no token: it is admitted, even while its key is
    /// throttled, without a store call.
    pub fn cost(mut self, cost: impl Fn(&Req) -> u64 + Send + Sync + 'static) -> Self {
        self.cost = Some(Box::new(cost));
        self.config.costs_vary = true;
        self
    }

    /// Requests no limit applies to: those for which `exempt` returns true go straight to
    /// the inner service, before their key is read. They take no token, make no store call,
    /// are never refused (not even for a missing key), get no `RateLimit` fields and leave
    /// their key's state as it was; each is counted in
    /// [`ThrottleStats::requests_exempt`](crate::ThrottleStats). For health checks, internal
    /// networks, operators' keys. Default: none.
    ///
    /// ```
    /// use axum::body::Body;
    /// use http::Request;
    /// use hierarchical_throttle::key::{ClientIp, IpNetwork};
    /// use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore, key};
    ///
    /// let internal: IpNetwork = "10.0.0.0/8".parse()?;
    /// let client_ip = ClientIp::direct();
    /// let layer = HierarchicalThrottleLayer::builder()
    ///     .key_ref(|req: &Request<Body>| key::header_bytes(req, "x-api-key"))
    ///     .limit(Limit::per_second(100).burst(200)?)
    ///     .exempt(move |req: &Request<Body>| {
    ///         req.uri().path() == "/health"
    ///             || client_ip.key(req).is_some_and(|ip| internal.contains(ip))
    ///     })
    ///     .global_store(MemoryGlobalStore::new())
    ///     .build()?;
    /// # Ok::<(), hierarchical_throttle::ConfigError>(())
    /// ```
    pub fn exempt(mut self, exempt: impl Fn(&Req) -> bool + Send + Sync + 'static) -> Self {
        self.exempt = Some(Box::new(exempt));
        self
    }

    /// Limits chosen per key (tiers of customers), instead of [`quota`](Self::quota): a
    /// [`Limit`] or a [`Quota`]. It is asked when a key's tokens run short, never on the hot
    /// path; the global store gets the limit with every call, so a closure that reads a shared
    /// setting changes limits at run time: a lowered limit applies to the next batch (within
    /// one lease time-to-live), and the global bucket is clamped to it. Quotas are cheap to
    /// clone: build each tier once.
    pub fn limit_per_key<Q: Into<Quota>>(
        mut self,
        quota: impl Fn(&K) -> Q + Send + Sync + 'static,
    ) -> Self {
        self.quota = Some(QuotaSetting::PerKey(Box::new(move |key| quota(key).into())));
        self
    }

    /// One more level of keys, drawn on by the same requests: a request is admitted only when
    /// every level's buckets have its cost. A tenant's ceiling holds whatever its users do,
    /// and a user's limit within it. A request whose closure gives no key at this level is
    /// not limited at it. At most [`MAX_LEVELS`] levels, the first included; level names
    /// follow [`Quota`]'s rules for names and prefix the level's limit names in responses
    /// (`tenant/per-second`).
    ///
    /// A level's closure may give any type that converts into the layer's key type: a
    /// `String` from [`key::header_value`](crate::key::header_value) beside a
    /// [`CompactKey`](crate::key::CompactKey) main key from
    /// [`key::header_bytes`](crate::key::header_bytes). Keys of unrelated types are written
    /// into the key type (`tenant_id.to_string()`); a level's keys never meet another level's,
    /// whatever their values.
    ///
    /// ```
    /// use axum::body::Body;
    /// use http::Request;
    /// use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore, key};
    ///
    /// let layer = HierarchicalThrottleLayer::builder()
    ///     .key(|req: &Request<Body>| key::header_value(req, "x-user"))
    ///     .limit(Limit::per_second(10).burst(20)?)
    ///     .level("tenant", |req: &Request<Body>| key::header_value(req, "x-tenant"),
    ///         Limit::per_second(100).burst(100)?)
    ///     .global_store(MemoryGlobalStore::new())
    ///     .build()?;
    /// # Ok::<(), hierarchical_throttle::ConfigError>(())
    /// ```
    pub fn level<Q: Into<K>>(
        self,
        name: &str,
        key: impl Fn(&Req) -> Option<Q> + Send + Sync + 'static,
        quota: impl Into<Quota>,
    ) -> Self {
        let key = Box::new(move |request: &Req| key(request).map(Into::into));
        self.add_level(name, key, QuotaSource::Fixed(quota.into()))
    }

    /// A [`level`](Self::level) whose limits are chosen per key, as
    /// [`limit_per_key`](Self::limit_per_key) chooses them at the first level.
    pub fn level_per_key<Q: Into<K>, T: Into<Quota>>(
        self,
        name: &str,
        key: impl Fn(&Req) -> Option<Q> + Send + Sync + 'static,
        quota: impl Fn(&K) -> T + Send + Sync + 'static,
    ) -> Self {
        let quota = QuotaSource::PerKey(Box::new(move |key: &K| quota(key).into()));
        let key = Box::new(move |request: &Req| key(request).map(Into::into));
        self.add_level(name, key, quota)
    }

    fn add_level(mut self, name: &str, key: KeyFn<Req, K>, quota: QuotaSource<K>) -> Self {
        let name = match Name::new(name) {
            Ok(name) => name,
            Err(error) => {
                self.error.get_or_insert(error);
                return self;
            }
        };
        self.check(
            self.levels.iter().all(|l| l.name != name),
            "level",
            "level names distinct within a layer",
        );
        self.check(
            self.levels.len() + 1 < MAX_LEVELS,
            "level",
            "at most 8 levels, the first included",
        );
        self.levels.push(LevelSetting { name, key, quota });
        self
    }

    /// What to do with a request without a key. Default: [`MissingKey::Reject`].
    pub fn missing_key(mut self, policy: MissingKey<K>) -> Self {
        self.missing_key = policy;
        self
    }

    /// The global store: [`MemoryGlobalStore`](crate::MemoryGlobalStore) for one process, a
    /// Redis store for a fleet, or your own.
    pub fn global_store<G2: GlobalStore<BucketKey<K>>>(
        self,
        global: G2,
    ) -> Builder<Req, K, G2, L, C, R> {
        self.swap(|_, local, clock, on_rejection| (global, local, clock, on_rejection))
    }

    /// The local store. Default: [`MemoryLocalStore::new`] (at most 100,000 keys).
    pub fn local_store<L2: LocalStore<LeaseKey<K>>>(
        self,
        local: L2,
    ) -> Builder<Req, K, G, L2, C, R> {
        self.swap(|global, _, clock, on_rejection| (global, local, clock, on_rejection))
    }
}

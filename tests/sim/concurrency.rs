//! The fleet's concurrency limits under latency, storms of failures and time-outs (calls
//! applied by the store whose answer comes too late, and calls the store applies only after
//! their host gave up on them), cancellations, herds and dead hosts:
//! one seeded run per seed, on paused time, checked by an oracle:
//!
//! - **the limit**: no admission leaves more than the key's limit (its tier's; for a limit
//!   changed at run time, the larger of the two until the change has settled: a slot
//!   time-to-live and the longest request) in flight over the live hosts, plus each host's
//!   credit when the seed draws `ColdStart::Credit` (a share of 1 %, half or all of the
//!   limit), until the first failed call; after it, each host's fallback share in place of
//!   its credit when larger under `LocalFallback`, nothing more under `Reject` (storms are
//!   shorter than a holding's renewal margin, so no holding expires under running requests);
//! - **exact refusals** (runs without faults): a request refused as full arrived at a moment
//!   from which, before its refusal, the key's slots were all in use or freed within the
//!   linger and a round trip (still held by their host); refusals while a dead host's holding
//!   may last are not checked; a refusal blames a failed store only in a run where the store
//!   fails or a host dies;
//! - **bounded waits**: every decision within two store time-outs and a little more;
//! - **the slots seen free** (what an admitted response's `RateLimit` field says; drawn per
//!   seed): never more than the limit less the host's own requests of the key in flight, and
//!   exactly that for a host alone with one key and a store that never fails;
//! - **nothing lost**: once every request has ended and the holdings have expired, no host
//!   holds a slot or keeps a key, and the store holds nothing;
//! - **shadow mode** (drawn per seed): nothing refused, every request served without a slot
//!   counted so, and every refusal the hosts count served so; the limit above then holds for
//!   the requests with slots (checked in the runs that `acquire`, whose permits tell);
//! - **counted refusals**: the hosts count as refused for a full key exactly the refusals
//!   their requests heard (not those of requests cancelled while they waited).
//!
//! Hosts give back their free slots mid-run, as one about to stop does, and serve on (drawn
//! per seed).
//!
//! Some seeds send their requests through the layer's tower service instead of `acquire`
//! (the inner service running each admitted request): then one request in a few may be
//! exempt from the limit (never refused, no slot, each counted once in `requests_exempt`),
//! one in a few may come without a key (served without a slot when `missing_key` admits it
//! or in shadow mode, else refused as missing its key),
//! and refusals are answered by `DefaultRejection` (429 for full, 503 for a failed store;
//! with or without `X-RateLimit-*`, which a 429 must carry exactly when drawn: the limit its
//! policy names, none left, its `Retry-After`)
//! or by a handler of the run's own, which must be told the request's own key. The same
//! oracle decides; the slots seen free are read through `acquire`'s permit only.
//!
//! Each seed draws how many slot calls go in one round trip (`store_batch`: 1, 2 or 128), so
//! that the calls of several keys and hosts queue behind one another or go together, and how
//! long a key's requests go to the failure policy after a failed call (10 ms, 100 ms or 1 s).
//!
//! The hosts' clocks may have a coarse reading (drawn per seed: none, or one that trails by
//! up to a tick of 4 ms to a whole second, past a holding's renewal margin), as the default
//! clock has on Linux: every check above holds whatever the tick.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use hierarchical_throttle::clock::TokioClock;
use hierarchical_throttle::global::slots::{Holding, SlotHold, SlotStore};
use hierarchical_throttle::quota::BucketKey;
use hierarchical_throttle::{
    ColdStart, ConcurrencyStats, DefaultRejection, FailurePolicy, HierarchicalConcurrencyLayer,
    MemoryGlobalStore, MissingKey, OnRejection, Rejection, RejectionReason, SlotBody,
};
use http::{HeaderValue, Request, Response, StatusCode};
use tower::{Layer as _, Service, ServiceExt};

use super::TickedClock;
use super::rng::Rng;

/// One run's draw.
#[derive(Debug, Clone)]
pub struct Scenario {
    pub seed: u64,
    pub hosts: usize,
    pub max: u64,
    /// Each key's limit (a tier); key 0's is `max`.
    pub key_max: Vec<u64>,
    /// Key 0's limit changed at run time: when, and to what (0: the key is shut out).
    pub change: Option<(Duration, u64)>,
    pub keys: usize,
    pub requests: usize,
    /// Mean time between arrivals.
    pub gap: Duration,
    /// Longest a request runs.
    pub longest: Duration,
    pub slot_ttl: Duration,
    pub linger: Duration,
    pub store_timeout: Duration,
    /// Longest a call takes when it does not fail (below the time-out).
    pub latency: Duration,
    pub policy: FailurePolicy,
    /// Windows (start, length) in which calls fail or time out with `storm_failure`.
    pub storms: Vec<(Duration, Duration)>,
    pub storm_failure: f64,
    /// Share of requests cancelled (while waiting or running).
    pub cancel: f64,
    /// A host that dies (stops reaching the store, its requests vanish) at a time.
    pub death: Option<(usize, Duration)>,
    /// Requests that come at once for one key at a time.
    pub herd: Option<(Duration, usize)>,
    /// Requests wait up to this for a slot instead of being refused at once.
    pub max_wait: Duration,
    /// Each admitted request reads the slots its host sees free (what its `RateLimit` field
    /// says).
    pub read_free: bool,
    /// The hosts' clocks' coarse reading trails by up to this (zero: they have none).
    pub tick: Duration,
    /// Whether a request beyond a key's holding waits for the store or goes on credit.
    pub cold_start: ColdStart,
    /// The most slot calls in one round trip (1: the keys' calls go in turn).
    pub store_batch: usize,
    /// How long a key's requests go to the failure policy after a call for it failed.
    pub back_off: Duration,
    /// Hosts that give back every slot they hold beyond their requests in flight, as one
    /// about to stop does (when, which host); each goes on serving after it.
    pub stops: Vec<(Duration, usize)>,
    /// Requests go through the layer's tower service instead of `acquire`.
    pub service: Option<ThroughService>,
    /// Shadow mode: no request is refused; one that gets no slot is served without one.
    pub shadow: bool,
}

/// How a run's requests go through the layer's tower service.
#[derive(Debug, Clone, Copy)]
pub struct ThroughService {
    /// One request in this many is exempt from the limit (`None`: none is).
    pub exempt_every: Option<u64>,
    /// One request in this many (of those not exempt) is sent without a key, and whether the
    /// layer's `missing_key` policy admits it (else refuses it, 400).
    pub keyless: Option<(u64, bool)>,
    /// Refusals are answered by a handler of the run's own, else by `DefaultRejection`.
    pub own_answers: bool,
    /// The `Retry-After` refusals tell (the layer's `retry_after`).
    pub retry_after: Duration,
    /// Admitted responses carry the `RateLimit` fields (the layer's `ratelimit_fields`).
    pub fields: bool,
    /// `DefaultRejection` also writes the `X-RateLimit-*` headers.
    pub x_ratelimit: bool,
}

/// Whether a run's requests go through the tower service, on a stream of its own.
fn through_service(seed: u64) -> Option<ThroughService> {
    let mut rng = Rng::new(seed ^ 0x5E2F_1CE0);
    rng.chance(0.4).then(|| ThroughService {
        exempt_every: rng.chance(0.5).then(|| rng.range(2, 7)),
        // A stream of its own, so that the draws of earlier seeds keep their values.
        keyless: {
            let mut keyless = Rng::new(seed ^ 0x4E7_1E55);
            keyless
                .chance(0.3)
                .then(|| (keyless.range(3, 9), keyless.chance(0.5)))
        },
        own_answers: rng.chance(0.5),
        retry_after: Duration::from_millis(rng.range(1_000, 30_000)),
        fields: !rng.chance(0.3),
        // A stream of its own too.
        x_ratelimit: Rng::new(seed ^ 0x0058_A7E5).chance(0.5),
    })
}

/// Hosts that give back their free slots during the run, on a stream of its own (so that the
/// other draws keep their values per seed).
fn stops(seed: u64, hosts: usize) -> Vec<(Duration, usize)> {
    let mut rng = Rng::new(seed ^ 0x5709_0A11);
    if !rng.chance(0.3) {
        return Vec::new();
    }
    let mut stops: Vec<_> = (0..rng.range(1, 3))
        .map(|_| {
            let at = Duration::from_millis(rng.below(3_000));
            (at, rng.below(hosts as u64) as usize)
        })
        .collect();
    stops.sort_by_key(|(at, _)| *at);
    stops
}

impl Scenario {
    pub fn draw(seed: u64) -> Self {
        let mut rng = Rng::new(seed ^ 0xC0C0_C0C0);
        let hosts = rng.range(1, 4) as usize;
        let slot_ttl = Duration::from_millis([1_000, 2_000, 5_000][rng.below(3) as usize]);
        let store_timeout = Duration::from_millis(50);
        let faulty = rng.chance(0.4);
        let storms = if faulty {
            (0..rng.range(1, 3))
                .map(|i| {
                    let start = Duration::from_millis(300 + i * 1_500 + rng.below(500));
                    // Shorter than the margin a holding has left when it is renewed.
                    (start, Duration::from_millis(rng.range(20, 200)))
                })
                .collect()
        } else {
            Vec::new()
        };
        let policy = match rng.below(3) {
            0 => FailurePolicy::Reject,
            1 => FailurePolicy::local_fallback(hosts as u64).expect("hosts"),
            _ => FailurePolicy::local_fallback(1).expect("one"),
        };
        let max = rng.range(1, 8);
        let keys = rng.range(1, 3) as usize;
        let tiers = rng.chance(0.3);
        let key_max = (0..keys)
            .map(|k| if k > 0 && tiers { rng.range(1, 8) } else { max })
            .collect();
        let change = rng.chance(0.25).then(|| {
            (
                Duration::from_millis(rng.range(100, 2_000)),
                rng.range(1, 8),
            )
        });
        // Now and then the key is shut out (a limit of 0), on a stream of its own so that the
        // draws above keep their values per seed.
        let change = change.map(|(at, new)| match Rng::new(seed ^ 0x2E20).chance(0.2) {
            true => (at, 0),
            false => (at, new),
        });
        Self {
            seed,
            hosts,
            max,
            key_max,
            change,
            keys,
            requests: rng.range(100, 400) as usize,
            gap: Duration::from_micros(rng.range(500, 10_000)),
            longest: Duration::from_millis(rng.range(1, 400)),
            slot_ttl,
            linger: Duration::from_millis([1, 10, 50][rng.below(3) as usize]),
            store_timeout,
            latency: Duration::from_millis(rng.below(45)),
            policy,
            storms,
            storm_failure: [0.3, 0.7, 1.0][rng.below(3) as usize],
            cancel: [0.0, 0.1, 0.3][rng.below(3) as usize],
            death: rng.chance(0.25).then(|| {
                (
                    rng.below(hosts as u64) as usize,
                    Duration::from_millis(rng.range(100, 2_000)),
                )
            }),
            max_wait: Duration::from_millis([0, 0, 100, 500][rng.below(4) as usize]),
            herd: rng.chance(0.3).then(|| {
                (
                    Duration::from_millis(rng.range(0, 2_000)),
                    rng.range(50, 1_000) as usize,
                )
            }),
            // A stream of its own, so that the draws above keep their values per seed.
            read_free: Rng::new(seed ^ 0xF2EE).chance(0.5),
            tick: Duration::from_millis(
                [0, 0, 4, 50, 300, 1_000][Rng::new(seed ^ 0x71C4).below(6) as usize],
            ),
            cold_start: match Rng::new(seed ^ 0xC4ED).below(5) {
                0 | 1 => ColdStart::Exact,
                2 => ColdStart::Credit { share: 0.01 },
                3 => ColdStart::Credit { share: 0.5 },
                _ => ColdStart::Credit { share: 1.0 },
            },
            store_batch: [1, 2, 128][Rng::new(seed ^ 0xBA7C).below(3) as usize],
            back_off: Duration::from_millis(
                [10, 100, 1_000][Rng::new(seed ^ 0xBAC0).below(3) as usize],
            ),
            stops: stops(seed, hosts),
            service: through_service(seed),
            shadow: Rng::new(seed ^ 0x05AD_0111).chance(0.15),
        }
    }

    /// The requests of credit a key of limit `max` has on each host (as the layer counts
    /// them: a share of the limit, at least one, none when exact).
    fn credit(&self, max: u64) -> u64 {
        match self.cold_start {
            ColdStart::Credit { share } => ((max as f64 * share) as u64).clamp(1, max.max(1)),
            _ => 0,
        }
    }

    fn faulty(&self) -> bool {
        !self.storms.is_empty()
    }

    /// Key `key`'s limit at `t`, and whether a change may still be settling (holdings and
    /// requests under the old limit): then the limit before and after.
    fn limits_at(&self, key: usize, t: Duration) -> (u64, u64) {
        let base = self.key_max[key];
        match self.change {
            Some((at, new)) if key == 0 && t >= at => {
                let settling = t < at + self.slot_ttl + self.longest + Duration::from_millis(200);
                if settling {
                    (base.min(new), base.max(new))
                } else {
                    (new, new)
                }
            }
            _ => (base, base),
        }
    }
}

/// What one host's calls meet: the shared store, the run's storms, and the host's death.
#[derive(Clone)]
struct SimStore {
    inner: MemoryGlobalStore<String, TokioClock>,
    rng: Arc<Mutex<Rng>>,
    storms: Arc<Vec<(Duration, Duration)>>,
    storm_failure: f64,
    latency: Duration,
    timeout: Duration,
    dead: Arc<AtomicBool>,
    start: tokio::time::Instant,
    /// Draws which of the calls applied late are applied only after their host gave up: a
    /// stream of its own, so that the draws of `rng` keep their values per seed.
    late_rng: Arc<Mutex<Rng>>,
    /// The calls still to be applied after their host gave up.
    late: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>>,
}

#[derive(Debug)]
struct Unreachable;

impl std::fmt::Display for Unreachable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the store is unreachable")
    }
}

impl std::error::Error for Unreachable {}

impl SlotStore<BucketKey<String>> for SimStore {
    type Error = Unreachable;

    async fn hold(
        &self,
        key: &BucketKey<String>,
        max: u64,
        hold: SlotHold,
    ) -> Result<Holding, Unreachable> {
        if self.dead.load(Ordering::SeqCst) {
            return Err(Unreachable);
        }
        let now = self.start.elapsed();
        let in_storm = self
            .storms
            .iter()
            .any(|(s, len)| now >= *s && now < *s + *len);
        let (fails, applies_then_late, latency) = {
            let mut rng = self.rng.lock().expect("rng");
            let fails = in_storm && rng.chance(self.storm_failure);
            let late = fails && rng.chance(0.5);
            let latency = Duration::from_micros(rng.below(self.latency.as_micros() as u64 + 1));
            (fails, late, latency)
        };
        if fails && !applies_then_late {
            return Err(Unreachable);
        }
        let after_host_gave_up =
            applies_then_late && self.late_rng.lock().expect("rng").chance(0.5);
        if after_host_gave_up {
            // A stalled store with the call in its socket buffer: applied late, never answered.
            let delay = super::faults::late_delay(
                &mut self.late_rng.lock().expect("rng"),
                self.timeout,
                self.timeout * 3,
            );
            let (inner, key) = (self.inner.clone(), key.clone());
            let call = tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                let _ = inner.hold(&key, max, hold).await;
            });
            self.late.lock().expect("late calls").push(call);
            return std::future::pending().await;
        }
        let answer = self
            .inner
            .hold(key, max, hold)
            .await
            .map_err(|_| Unreachable);
        if applies_then_late {
            // Applied, but the answer comes after the host has given up.
            tokio::time::sleep(self.timeout * 2).await;
        } else {
            tokio::time::sleep(latency).await;
        }
        answer
    }
}

#[derive(Default)]
struct Oracle {
    /// Per key: requests in flight on live hosts.
    in_flight: HashMap<usize, u64>,
    /// Per host and key: requests in flight.
    on_host: HashMap<(usize, usize), u64>,
    /// Per key: (start, end) of every admitted request; end `None` while it runs, or the
    /// time its host died plus the holding's life for a dead host's.
    spans: HashMap<usize, Vec<(Duration, Option<Duration>)>>,
    failures: Vec<String>,
    /// Refusals as full to check for exactness once every admission is known: (key, came,
    /// decided).
    refusals: Vec<(usize, Duration, Duration)>,
    decisions: u64,
    refused_full: u64,
    /// Exempt requests sent through the service, and those its inner service ran.
    exempt_sent: u64,
    exempt_served: u64,
    /// Requests served without a slot (shadow mode).
    shadow_served: u64,
    /// Requests sent without a key through the service, and of them those shadow mode served
    /// in place of a refusal.
    keyless_sent: u64,
    keyless_shadowed: u64,
}

type Layer = HierarchicalConcurrencyLayer<Request<()>, String, SimStore, TickedClock, Answers>;

/// How a run answers refusals through the service: `DefaultRejection`, or its own answer
/// naming the reason and whether the handler was told the request's own key.
#[derive(Debug, Clone, Copy)]
struct Answers {
    own: bool,
    x_ratelimit: bool,
}

impl OnRejection<Request<()>, String, Response<()>, Infallible> for Answers {
    fn on_rejection(
        &self,
        request: &Request<()>,
        rejection: Rejection<String>,
    ) -> Result<Response<()>, Infallible> {
        if !self.own {
            return DefaultRejection::default()
                .x_ratelimit_headers(self.x_ratelimit)
                .on_rejection(request, rejection);
        }
        let reason = match rejection.reason {
            RejectionReason::TooManyInFlight { .. } => "full",
            RejectionReason::StoreUnavailable => "unavailable",
            _ => "other",
        };
        let own_key = rejection.key.as_deref() == key_of(request);
        let mut response = Response::new(());
        *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
        let headers = response.headers_mut();
        headers.insert("x-refused", HeaderValue::from_static(reason));
        let told = rejection.retry_after.map_or(0, |wait| wait.as_millis());
        headers.insert("x-retry-after-ms", HeaderValue::from(told as u64));
        headers.insert(
            "x-own-key",
            HeaderValue::from_static(if own_key { "yes" } else { "no" }),
        );
        Ok(response)
    }
}

/// A request's key, from its `k` header.
fn key_of(request: &Request<()>) -> Option<&str> {
    request.headers().get("k").and_then(|v| v.to_str().ok())
}

/// What a request sent through the service carries to the inner service.
#[derive(Clone)]
struct Ticket {
    host: usize,
    key: usize,
    came: Duration,
    runs_for: Duration,
    exempt: bool,
    keyless: bool,
    /// Set when the inner service admits it: its span.
    span: Arc<Mutex<Option<usize>>>,
}

/// The run's state the inner service records admissions in.
struct Run {
    oracle: Arc<Mutex<Oracle>>,
    s: Scenario,
    hosts: Vec<Layer>,
    failed_before: Arc<AtomicBool>,
    start: tokio::time::Instant,
}

/// The service behind the layer: records an admission the moment it is called, then runs
/// the request for its time.
#[derive(Clone)]
struct Handler {
    run: Arc<Run>,
}

impl Service<Request<()>> for Handler {
    type Response = Response<()>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<()>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<()>) -> Self::Future {
        let ticket = request.extensions().get::<Ticket>().cloned();
        let runs_for = ticket.as_ref().map_or(Duration::ZERO, |t| t.runs_for);
        if let Some(t) = ticket.filter(|t| !t.exempt && !t.keyless) {
            let run = &self.run;
            let decided = run.start.elapsed();
            let mut o = run.oracle.lock().expect("oracle");
            let failed = &run.failed_before;
            count_decision(&mut o, &run.s, &run.hosts, failed, t.key, t.came, decided);
            let (span, _) = admit(&mut o, &run.s, failed, (t.host, t.key), t.came, decided);
            *t.span.lock().expect("span") = Some(span);
        }
        Box::pin(async move {
            tokio::time::sleep(runs_for).await;
            let mut response = Response::new(());
            response
                .headers_mut()
                .insert("x-served", HeaderValue::from_static("1"));
            Ok(response)
        })
    }
}

pub fn run(seed: u64) -> Result<String, String> {
    super::paused_runtime().block_on(simulate(Scenario::draw(seed)))
}

async fn simulate(s: Scenario) -> Result<String, String> {
    let clock = TokioClock::new();
    let start = tokio::time::Instant::now();
    let memory = MemoryGlobalStore::with_clock(clock);
    let rng = Arc::new(Mutex::new(Rng::new(s.seed ^ 0x5107)));
    let limits: Arc<Vec<std::sync::atomic::AtomicU64>> = Arc::new(
        s.key_max
            .iter()
            .map(|m| std::sync::atomic::AtomicU64::new(*m))
            .collect(),
    );
    let late_rng = Arc::new(Mutex::new(Rng::new(s.seed ^ 0x1A7E_CA11)));
    let late = Arc::new(Mutex::new(Vec::new()));
    let dead: Vec<Arc<AtomicBool>> = (0..s.hosts)
        .map(|_| Arc::new(AtomicBool::new(false)))
        .collect();
    let hosts: Vec<Layer> = (0..s.hosts)
        .map(|h| {
            let store = SimStore {
                inner: memory.clone(),
                rng: rng.clone(),
                storms: Arc::new(s.storms.clone()),
                storm_failure: s.storm_failure,
                latency: s.latency,
                timeout: s.store_timeout,
                dead: dead[h].clone(),
                start,
                late_rng: late_rng.clone(),
                late: late.clone(),
            };
            let limits = limits.clone();
            let builder = HierarchicalConcurrencyLayer::builder()
                .key(|request: &Request<()>| key_of(request).map(str::to_owned));
            let builder = match s.service.and_then(|t| t.keyless) {
                Some((_, true)) => builder.missing_key(MissingKey::Admit),
                _ => builder,
            };
            let builder = match s.service.and_then(|t| t.exempt_every) {
                Some(_) => {
                    builder.exempt(|request: &Request<()>| request.headers().contains_key("exempt"))
                }
                None => builder,
            };
            builder
                .max_in_flight_per_key(move |key: &String| {
                    let index: usize = key[1..].parse().unwrap_or(0);
                    limits.get(index).map_or(0, |m| m.load(Ordering::SeqCst))
                })
                .store(store)
                .clock(TickedClock::new(clock, s.tick))
                .slot_ttl(s.slot_ttl)
                .linger(s.linger)
                .store_timeout(s.store_timeout)
                .back_off(s.back_off)
                .failure_policy(s.policy)
                .wait_for_slot(s.max_wait)
                .host_id(h as u64 + 1)
                // Each host lays its keys out by a hash of its own, drawn per seed: the
                // order its sweeps visit keys in (and its calls reach the store in) differs
                // between hosts, as it does in a fleet, and stays the same in every run.
                .hash_seed(s.seed.rotate_left(16) ^ h as u64)
                .cold_start(s.cold_start)
                .store_batch(s.store_batch)
                .retry_after(s.service.map_or(Duration::from_secs(1), |t| t.retry_after))
                .ratelimit_fields(s.service.is_none_or(|t| t.fields))
                .shadow(s.shadow)
                .on_rejection(Answers {
                    own: s.service.is_some_and(|t| t.own_answers),
                    x_ratelimit: s.service.is_some_and(|t| t.x_ratelimit),
                })
                .build()
                .expect("valid settings")
        })
        .collect();
    let oracle = Arc::new(Mutex::new(Oracle::default()));
    let failed_before = Arc::new(AtomicBool::new(false));
    let mut traffic = Rng::new(s.seed ^ 0x7AFF);
    let mut tasks = Vec::new();
    let mut at = Duration::ZERO;
    let mut arrivals: Vec<(Duration, usize, usize)> = (0..s.requests)
        .map(|_| {
            at += Duration::from_secs_f64(traffic.exponential(s.gap.as_secs_f64()));
            let key = zipf(&mut traffic, s.keys);
            (at, traffic.below(s.hosts as u64) as usize, key)
        })
        .collect();
    if let Some((when, size)) = s.herd {
        arrivals.extend((0..size).map(|i| (when, i % s.hosts, 0)));
        arrivals.sort_by_key(|a| a.0);
    }
    let deaths_at = s.death;
    let run = Arc::new(Run {
        oracle: oracle.clone(),
        s: s.clone(),
        hosts: hosts.clone(),
        failed_before: failed_before.clone(),
        start,
    });
    for (index, (arrival, host, key)) in arrivals.into_iter().enumerate() {
        let cancel_after = traffic
            .chance(s.cancel)
            .then(|| Duration::from_micros(traffic.below(s.longest.as_micros() as u64 + 80_000)));
        let runs_for = Duration::from_micros(traffic.below(s.longest.as_micros() as u64 + 1));
        if let Some(through) = s.service {
            let exempt = through
                .exempt_every
                .is_some_and(|every| (index as u64).is_multiple_of(every));
            let keyless = !exempt
                && through
                    .keyless
                    .is_some_and(|(every, _)| (index as u64 + 1).is_multiple_of(every));
            let request = Sent {
                arrival,
                host,
                key,
                exempt,
                keyless,
                runs_for,
                cancel_after,
            };
            let service = hosts[host].clone().layer(Handler { run: run.clone() });
            let (run, dead) = (run.clone(), dead[host].clone());
            tasks.push(tokio::spawn(serve(run, service, dead, request)));
            continue;
        }
        let layer = hosts[host].clone();
        let oracle = oracle.clone();
        let dead = dead[host].clone();
        let failed_before = failed_before.clone();
        let hosts_failed: Vec<Layer> = hosts.clone();
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until(start + arrival).await;
            if dead.load(Ordering::SeqCst) {
                return;
            }
            let came = start.elapsed();
            let acquire = layer.acquire(format!("k{key}"));
            let deadline = cancel_after.unwrap_or(Duration::from_secs(86_400));
            let outcome = tokio::time::timeout(deadline, acquire).await;
            let decided = start.elapsed();
            let Some((permit, span)) = decide(
                &oracle,
                &s,
                &hosts_failed,
                &failed_before,
                Decision {
                    host,
                    key,
                    came,
                    decided,
                    outcome,
                },
            ) else {
                return;
            };
            let waited = decided - came;
            let run = cancel_after.map_or(runs_for, |c| runs_for.min(c.saturating_sub(waited)));
            tokio::time::sleep(run).await;
            let ended = end(&oracle, (host, key), span, &dead, start.elapsed());
            if ended {
                drop(permit);
            } else {
                // Its host died under it: the request vanished with its slot.
                std::mem::forget(permit);
            }
        }));
    }
    if let Some((at, new)) = s.change {
        let limits = limits.clone();
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until(start + at).await;
            limits[0].store(new, Ordering::SeqCst);
        }));
    }
    for &(at, host) in &s.stops {
        let layer = hosts[host].clone();
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until(start + at).await;
            layer.return_all_slots().await;
        }));
    }
    if let Some((host, when)) = deaths_at {
        // Its running requests vanish (their spans stay open: the exactness check counts a
        // dead host's slots as taken) and its calls fail from then on.
        let dead = dead[host].clone();
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until(start + when).await;
            dead.store(true, Ordering::SeqCst);
        }));
    }
    for task in tasks {
        task.await
            .map_err(|e| format!("a request task failed: {e}"))?;
    }
    // Everything ends; holdings expire; sweeps forget.
    tokio::time::sleep(s.slot_ttl * 2 + Duration::from_secs(1)).await;
    let late_calls = std::mem::take(&mut *late.lock().expect("late calls"));
    let applied_late = late_calls.len();
    for call in late_calls {
        call.await.map_err(|e| format!("a late call failed: {e}"))?;
    }
    let mut o = oracle.lock().expect("oracle");
    for (key, came, decided) in std::mem::take(&mut o.refusals) {
        check_exact(&mut o, &s, key, came, decided);
    }
    let mut failures = o.failures.clone();
    for (h, layer) in hosts.iter().enumerate() {
        if dead[h].load(Ordering::SeqCst) {
            continue;
        }
        if layer.in_flight() != 0 || layer.keys() != 0 {
            failures.push(format!(
                "host {h} keeps {} in flight over {} keys",
                layer.in_flight(),
                layer.keys()
            ));
        }
    }
    let exempt_counted: u64 = hosts.iter().map(|h| h.stats().requests_exempt).sum();
    if exempt_counted != o.exempt_sent || o.exempt_served > o.exempt_sent {
        failures.push(format!(
            "{} exempt requests sent, {} served, {exempt_counted} counted by the hosts",
            o.exempt_sent, o.exempt_served
        ));
    }
    let counted =
        |f: fn(&ConcurrencyStats) -> u64| hosts.iter().map(|h| f(&h.stats())).sum::<u64>();
    let shadow_admitted = counted(|st| st.shadow_admitted);
    let refused = counted(|st| st.refused_full + st.refused_unavailable);
    // Every request served without a slot was counted so, and every one of the refused was
    // served so (a request is counted refused as it hears it: one cancelled before is not; one
    // served may be cancelled before it is answered).
    let shadow_counts = match s.shadow {
        true => {
            o.shadow_served + o.keyless_shadowed <= shadow_admitted
                && shadow_admitted == refused + o.keyless_shadowed
        }
        false => shadow_admitted == 0,
    };
    if !shadow_counts {
        failures.push(format!(
            "{} served without a slot, {shadow_admitted} counted so, {refused} refused (shadow \
             mode: {})",
            o.shadow_served, s.shadow
        ));
    }
    // Each refusal as full a request heard, and only those, is counted so.
    let refused_full = counted(|st| st.refused_full);
    if !s.shadow && refused_full != o.refused_full {
        failures.push(format!(
            "{refused_full} refused as full by the hosts' count, {} heard so",
            o.refused_full
        ));
    }
    if memory.keys_with_slots_held() != 0 {
        failures.push(format!(
            "the store holds slots of {} keys at the end",
            memory.keys_with_slots_held()
        ));
    }
    match failures.first() {
        Some(first) => Err(format!("{first} (and {} more)", failures.len() - 1)),
        None => Ok(format!(
            "{} decisions, {} refused as full, {} exempt served, {} sent without a key, \
             {applied_late} calls applied late",
            o.decisions, o.refused_full, o.exempt_served, o.keyless_sent
        )),
    }
}

struct Decision {
    host: usize,
    key: usize,
    came: Duration,
    decided: Duration,
    outcome: Result<
        Result<hierarchical_throttle::SlotPermit, hierarchical_throttle::Rejection<String>>,
        tokio::time::error::Elapsed,
    >,
}

/// Records a decision and checks it; an admission's permit and span come back.
fn decide(
    oracle: &Mutex<Oracle>,
    s: &Scenario,
    hosts: &[Layer],
    failed_before: &AtomicBool,
    d: Decision,
) -> Option<(hierarchical_throttle::SlotPermit, usize)> {
    let Decision {
        host,
        key,
        came,
        decided,
        outcome,
    } = d;
    let mut o = oracle.lock().expect("oracle");
    let Ok(outcome) = outcome else {
        cancelled_waiting(&mut o, key, came, decided);
        return None;
    };
    count_decision(&mut o, s, hosts, failed_before, key, came, decided);
    match outcome {
        Ok(permit) if !permit.holds_slot() => {
            served_without_slot(&mut o, s, key, decided);
            None
        }
        Err(rejection) if s.shadow => {
            o.failures.push(format!(
                "k{key} refused in shadow mode at {decided:?}: {rejection}"
            ));
            None
        }
        Ok(permit) => {
            let (span, here) = admit(&mut o, s, failed_before, (host, key), came, decided);
            if s.read_free {
                check_free(&mut o, s, &hosts[host], &permit, (host, key, here), decided);
            }
            Some((permit, span))
        }
        Err(rejection) => {
            let full = matches!(rejection.reason, RejectionReason::TooManyInFlight { .. });
            refused(&mut o, s, key, came, decided, full);
            None
        }
    }
}

/// A request served without a slot: only ever in shadow mode, in place of its refusal.
fn served_without_slot(o: &mut Oracle, s: &Scenario, key: usize, decided: Duration) {
    o.shadow_served += 1;
    if !s.shadow {
        o.failures.push(format!(
            "k{key} served without a slot at {decided:?}, not in shadow mode"
        ));
    }
}

/// A request cancelled while it waited: a slot its call brings stays on its host for the
/// linger, which the exactness check counts as it does a request's end.
fn cancelled_waiting(o: &mut Oracle, key: usize, came: Duration, decided: Duration) {
    o.spans.entry(key).or_default().push((came, Some(decided)));
}

/// Counts a decision and checks how long it took.
fn count_decision(
    o: &mut Oracle,
    s: &Scenario,
    hosts: &[Layer],
    failed_before: &AtomicBool,
    key: usize,
    came: Duration,
    decided: Duration,
) {
    o.decisions += 1;
    let waited = decided - came;
    if waited > s.max_wait + s.store_timeout * 2 + Duration::from_millis(60) {
        o.failures
            .push(format!("a decision for k{key} took {waited:?}"));
    }
    if hosts.iter().any(|h| h.stats().store_failures > 0) {
        failed_before.store(true, Ordering::SeqCst);
    }
}

/// Records an admission and checks the key's requests in flight against the bound; returns
/// its span and the host's requests of the key in flight.
fn admit(
    o: &mut Oracle,
    s: &Scenario,
    failed_before: &AtomicBool,
    (host, key): (usize, usize),
    came: Duration,
    decided: Duration,
) -> (usize, u64) {
    let n = o.in_flight.entry(key).or_default();
    *n += 1;
    let n = *n;
    let (_, max) = s.limits_at(key, decided);
    // Through the service in shadow mode, the inner service cannot tell a request with a slot
    // from one served without: the bound is checked by the runs that acquire.
    let unseen = s.shadow && s.service.is_some();
    if !unseen && n > bound(s, max, failed_before.load(Ordering::SeqCst)) {
        o.failures
            .push(format!("k{key}: {n} in flight of {max} at {decided:?}"));
    }
    let here = o.on_host.entry((host, key)).or_default();
    *here += 1;
    let here = *here;
    // Its slot may have been taken at the store any time after it came (the answer that
    // brings it takes a round trip).
    let spans = o.spans.entry(key).or_default();
    spans.push((came, None));
    (spans.len() - 1, here)
}

/// Records a refusal (as full, or for a failed store: only ever in a run whose store fails).
fn refused(
    o: &mut Oracle,
    s: &Scenario,
    key: usize,
    came: Duration,
    decided: Duration,
    full: bool,
) {
    if !full && !s.faulty() && s.death.is_none() {
        o.failures.push(format!(
            "k{key} refused for a failed store at {decided:?} in a run whose store never fails"
        ));
    }
    if full {
        o.refused_full += 1;
        // A patient request refused when its wait runs out is not checked: its host asks
        // again only every linger.
        if !s.faulty() && s.max_wait.is_zero() {
            o.refusals.push((key, came, decided));
        }
    }
}

/// An admitted request ended at `at`; false when its host died under it (then it vanished
/// with its slot, and its span stays open).
fn end(
    oracle: &Mutex<Oracle>,
    (host, key): (usize, usize),
    span: usize,
    dead: &AtomicBool,
    at: Duration,
) -> bool {
    let mut o = oracle.lock().expect("oracle");
    *o.in_flight.entry(key).or_default() -= 1;
    *o.on_host.entry((host, key)).or_default() -= 1;
    if dead.load(Ordering::SeqCst) {
        return false;
    }
    if let Some(span) = o.spans.get_mut(&key).and_then(|s| s.get_mut(span)) {
        span.1 = Some(at);
    }
    true
}

/// A request sent through the tower service.
struct Sent {
    arrival: Duration,
    host: usize,
    key: usize,
    exempt: bool,
    /// Sent without a key.
    keyless: bool,
    runs_for: Duration,
    cancel_after: Option<Duration>,
}

/// Sends one request through its host's service, cancelled at its time if it has one, and
/// records what became of it.
async fn serve<S>(run: Arc<Run>, service: S, dead: Arc<AtomicBool>, sent: Sent)
where
    S: Service<Request<()>, Response = Response<SlotBody<()>>, Error = Infallible>,
{
    let start = run.start;
    tokio::time::sleep_until(start + sent.arrival).await;
    if dead.load(Ordering::SeqCst) {
        return;
    }
    let came = start.elapsed();
    let span = Arc::new(Mutex::new(None));
    let mut request = Request::new(());
    match sent.keyless {
        false => {
            let key = HeaderValue::from_str(&format!("k{}", sent.key)).expect("a header value");
            request.headers_mut().insert("k", key);
        }
        true => {
            // Counted as sent: the layer decides it in `call`, before any cancellation.
            let admits = run
                .s
                .service
                .and_then(|t| t.keyless)
                .is_some_and(|(_, a)| a);
            let mut o = run.oracle.lock().expect("oracle");
            o.keyless_sent += 1;
            o.keyless_shadowed += u64::from(!admits && run.s.shadow);
        }
    }
    if sent.exempt {
        request
            .headers_mut()
            .insert("exempt", HeaderValue::from_static("1"));
        run.oracle.lock().expect("oracle").exempt_sent += 1;
    }
    request.extensions_mut().insert(Ticket {
        host: sent.host,
        key: sent.key,
        came,
        runs_for: sent.runs_for,
        exempt: sent.exempt,
        keyless: sent.keyless,
        span: span.clone(),
    });
    let mut call = Box::pin(service.oneshot(request));
    let cancel = sent.cancel_after.unwrap_or(Duration::from_secs(86_400));
    let response = tokio::select! {
        biased;
        response = &mut call => Some(response),
        () = tokio::time::sleep(cancel) => None,
    };
    let at = start.elapsed();
    let admitted = span.lock().expect("span").take();
    let response = response.map(|r| match r {
        Ok(response) => response,
        Err(never) => match never {},
    });
    match (admitted, response) {
        (Some(span), response) => {
            if let Some(response) = &response {
                check_fields(&run, &sent, response);
                if !response.body().holds_slot() {
                    let mut o = run.oracle.lock().expect("oracle");
                    served_without_slot(&mut o, &run.s, sent.key, at);
                }
            }
            if end(&run.oracle, (sent.host, sent.key), span, &dead, at) {
                drop((response, call));
            } else {
                // Its host died under it: the request vanished with its slot.
                std::mem::forget((response, call));
            }
        }
        (None, None) if !sent.exempt && !sent.keyless => {
            cancelled_waiting(&mut run.oracle.lock().expect("oracle"), sent.key, came, at);
        }
        (None, None) => {}
        (None, Some(response)) => answered(&run, &sent, came, at, &response),
    }
}

/// Checks the answer to a request sent without a key: served when the layer's `missing_key`
/// admits it (without a slot or fields) or in shadow mode (counted so), else refused as
/// missing its key (400, or the run's own answer).
fn answered_keyless(run: &Run, sent: &Sent, at: Duration, response: &Response<SlotBody<()>>) {
    let s = &run.s;
    let admits = s.service.and_then(|t| t.keyless).is_some_and(|(_, a)| a);
    let own = s.service.is_some_and(|t| t.own_answers);
    let served = response.headers().contains_key("x-served");
    let refused_as_keyless = match own {
        true => response.headers().get("x-refused") == Some(&HeaderValue::from_static("other")),
        false => response.status() == StatusCode::BAD_REQUEST,
    };
    let right = match admits || s.shadow {
        true => served && !response.body().holds_slot(),
        false => refused_as_keyless && !served,
    };
    if !right {
        let mut o = run.oracle.lock().expect("oracle");
        o.failures.push(format!(
            "a request without a key ({}, missing key admitted: {admits}, shadow: {}) answered \
             {} at {at:?}",
            if served { "served" } else { "not served" },
            s.shadow,
            response.status()
        ));
    }
    if served {
        check_fields(run, sent, response);
    }
}

/// Checks a response whose request the inner service did not admit: an exempt request's
/// must come from the inner service, any other is a refusal answered as the run's handler
/// answers.
fn answered(
    run: &Run,
    sent: &Sent,
    came: Duration,
    at: Duration,
    response: &Response<SlotBody<()>>,
) {
    let mut o = run.oracle.lock().expect("oracle");
    let served = response.headers().contains_key("x-served");
    if sent.exempt {
        match served {
            true => {
                o.exempt_served += 1;
                drop(o);
                check_fields(run, sent, response);
            }
            false => o.failures.push(format!(
                "an exempt request of k{} was refused ({}) at {at:?}",
                sent.key,
                response.status()
            )),
        }
        return;
    }
    if sent.keyless {
        drop(o);
        return answered_keyless(run, sent, at, response);
    }
    if run.s.shadow {
        o.failures.push(format!(
            "k{} refused in shadow mode ({}) at {at:?}",
            sent.key,
            response.status()
        ));
        return;
    }
    let own = run.s.service.is_some_and(|t| t.own_answers);
    let header = |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok());
    let full = match (own, response.status(), header("x-refused")) {
        (_, _, _) if served => {
            o.failures
                .push(format!("k{} served without being admitted", sent.key));
            return;
        }
        (true, _, _) if header("x-own-key") != Some("yes") => {
            o.failures.push(format!(
                "the handler was told another key than k{}",
                sent.key
            ));
            return;
        }
        (true, StatusCode::SERVICE_UNAVAILABLE, Some("full")) => true,
        (true, StatusCode::SERVICE_UNAVAILABLE, Some("unavailable")) => false,
        (false, StatusCode::TOO_MANY_REQUESTS, None) => true,
        (false, StatusCode::SERVICE_UNAVAILABLE, None) => false,
        (_, status, reason) => {
            o.failures.push(format!(
                "k{} refused with {status} ({reason:?}), own answers: {own}",
                sent.key
            ));
            return;
        }
    };
    let wrong = wrong_retry_after(&run.s, own, response)
        .or_else(|| wrong_x_ratelimit(&run.s, own, response));
    if let Some(wrong) = wrong {
        o.failures
            .push(format!("k{} refused at {at:?}: {wrong}", sent.key));
    }
    count_decision(
        &mut o,
        &run.s,
        &run.hosts,
        &run.failed_before,
        sent.key,
        came,
        at,
    );
    refused(&mut o, &run.s, sent.key, came, at, full);
}

/// What is wrong with the wait a refusal tells, if anything: the layer's `retry_after`, to
/// the millisecond as the handler is told it, in whole seconds rounded up in `Retry-After`.
fn wrong_retry_after(s: &Scenario, own: bool, response: &Response<SlotBody<()>>) -> Option<String> {
    let set = s.service.map_or(Duration::from_secs(1), |t| t.retry_after);
    let (name, expected) = match own {
        true => ("x-retry-after-ms", set.as_millis().to_string()),
        false => ("retry-after", set.as_secs_f64().ceil().to_string()),
    };
    let told = response.headers().get(name).and_then(|v| v.to_str().ok());
    (told != Some(expected.as_str()))
        .then(|| format!("{name} {told:?}, where the layer's retry_after is {set:?}"))
}

/// What is wrong with the `X-RateLimit-*` headers of a refusal, if anything: when the run
/// writes them and `DefaultRejection` refused a full key, the limit its `RateLimit-Policy`
/// names, none left, and the `Retry-After`; none otherwise.
fn wrong_x_ratelimit(s: &Scenario, own: bool, response: &Response<SlotBody<()>>) -> Option<String> {
    let header = |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok());
    let told = [
        header("x-ratelimit-limit"),
        header("x-ratelimit-remaining"),
        header("x-ratelimit-reset"),
    ];
    let full = response.status() == StatusCode::TOO_MANY_REQUESTS;
    let written = s.service.is_some_and(|t| t.x_ratelimit) && full && !own;
    let expected = match written {
        true => {
            // `"concurrency";q=<max>;qu="concurrent-requests"`.
            let max = header("ratelimit-policy")
                .and_then(|p| p.split(";q=").nth(1))
                .and_then(|q| q.split(';').next());
            [max, Some("0"), header("retry-after")]
        }
        false => [None; 3],
    };
    (told != expected || (written && expected.contains(&None)))
        .then(|| format!("X-RateLimit-* {told:?}, not {expected:?}"))
}

/// The `RateLimit` fields of a response the inner service answered: present on a limited
/// request's exactly when the run turned them on (never on an exempt one's), the policy
/// naming one of the key's limits and the slots free at most that limit less the request's
/// own.
fn check_fields(run: &Run, sent: &Sent, response: &Response<SlotBody<()>>) {
    let s = &run.s;
    let header = |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok());
    let (policy, free) = (header("ratelimit-policy"), header("ratelimit"));
    let on = !sent.exempt && !sent.keyless && s.service.is_none_or(|t| t.fields);
    let wrong = match (on, policy, free) {
        (false, None, None) => return,
        (true, Some(policy), Some(free)) => {
            let number = |field: &str, text: &str| -> Option<u64> {
                text.split(';')
                    .find_map(|part| part.strip_prefix(field))
                    .and_then(|n| n.parse().ok())
            };
            let limits: Vec<u64> = std::iter::once(s.key_max[sent.key])
                .chain(s.change.filter(|_| sent.key == 0).map(|(_, new)| new))
                .collect();
            match (number("q=", policy), number("r=", free)) {
                (Some(q), Some(r)) if limits.contains(&q) && (r < q || r == 0) => return,
                _ => format!("policy {policy:?} and {free:?} for limits {limits:?}"),
            }
        }
        (on, policy, free) => format!("fields on: {on}, policy {policy:?}, remaining {free:?}"),
    };
    let mut o = run.oracle.lock().expect("oracle");
    o.failures.push(format!(
        "k{}{} admitted with wrong fields: {wrong}",
        sent.key,
        if sent.exempt { " (exempt)" } else { "" }
    ));
}

/// The slots an admitted request's host sees free (its `RateLimit` field): never more than
/// the key's limit less the host's requests of the key in flight as the oracle counts them
/// (this one included; the host counts a request from its admission to its end, the oracle
/// from its decision, which one answer for many waiters can put later); and, for a host
/// alone with one key and a store that never fails, exactly the limit less what it has in
/// flight.
fn check_free(
    o: &mut Oracle,
    s: &Scenario,
    layer: &Layer,
    permit: &hierarchical_throttle::SlotPermit,
    (host, key, here): (usize, usize, u64),
    decided: Duration,
) {
    let name = format!("k{key}");
    let max = layer.max_in_flight(&name);
    let free = layer.free_slots(&name, permit);
    let alone = s.hosts == 1 && s.keys == 1 && !s.faulty() && s.death.is_none();
    if free > max.saturating_sub(here) || (alone && free != max.saturating_sub(layer.in_flight())) {
        o.failures.push(format!(
            "k{key} on host {host}: {free} slots seen free of {max} with {here} in flight \
             there ({} by its own count), at {decided:?}",
            layer.in_flight()
        ));
    }
}

/// The most requests of a key in flight the oracle accepts: the limit, and each host's
/// credit when there is some; after a failed call, each host's fallback share instead when
/// it is larger.
fn bound(s: &Scenario, max: u64, failed: bool) -> u64 {
    let beyond = |share: u64| max + s.hosts as u64 * share;
    let credit = s.credit(max);
    if !failed {
        return beyond(credit);
    }
    match s.policy {
        FailurePolicy::Reject => beyond(credit),
        FailurePolicy::LocalFallback { expected_hosts } => {
            beyond(credit.max(max.div_ceil(expected_hosts.get())))
        }
        _ => u64::MAX,
    }
}

/// A refusal as full is exact: from some moment between the request's arrival and its
/// refusal, the key's slots were in use, or freed so recently that their host may still have
/// held them (the linger, a sweep's lateness and a round trip), or held by a dead host.
fn check_exact(o: &mut Oracle, s: &Scenario, key: usize, came: Duration, decided: Duration) {
    let grace = s.linger * 3 + s.store_timeout * 2 + Duration::from_millis(2);
    if let Some((_, death)) = s.death
        && decided + grace >= death
        && came <= death + s.slot_ttl + grace
    {
        // What the dead host held (idle slots too) stays taken until its holding expires.
        return;
    }
    let spans = o.spans.get(&key).cloned().unwrap_or_default();
    let occupied = |t: Duration| {
        spans
            .iter()
            .filter(|(start, end)| *start <= t && end.is_none_or(|end| t < end + grace))
            .count() as u64
    };
    let mut moments: Vec<Duration> = vec![came, decided];
    moments.extend(
        spans
            .iter()
            .filter_map(|(start, _)| Some(*start).filter(|t| *t >= came && *t <= decided)),
    );
    // Refused under the smaller of the limits a change may still be settling between.
    let (max, _) = s.limits_at(key, came);
    let (max_then, _) = s.limits_at(key, decided);
    let max = max.min(max_then);
    if std::env::var("SIM_TRACE").is_ok() && !moments.iter().any(|t| occupied(*t) >= max) {
        for sp in spans
            .iter()
            .filter(|(a, b)| *a <= decided && b.is_none_or(|b| b + grace * 3 >= came))
        {
            eprintln!("span {sp:?}");
        }
    }
    if !moments.iter().any(|t| occupied(*t) >= max) {
        o.failures.push(format!(
            "k{key} refused as full at {decided:?} (came {came:?}) with at most {} of {} occupied",
            moments.iter().map(|t| occupied(*t)).max().unwrap_or(0),
            max
        ));
    }
}

/// A key drawn from a Zipf(1) law over `n` keys.
fn zipf(rng: &mut Rng, n: usize) -> usize {
    let weights: Vec<f64> = (1..=n).map(|i| 1.0 / i as f64).collect();
    let total: f64 = weights.iter().sum();
    let mut pick = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * total;
    for (i, w) in weights.iter().enumerate() {
        if pick < *w {
            return i;
        }
        pick -= w;
    }
    n - 1
}

//! A seeded, deterministic simulation of a fleet: several layers (hosts) sharing one global
//! store behind a fault injector, on tokio's paused time. Each seed draws a fleet, its limits,
//! its traffic and its faults; after the run an oracle checks, for every key:
//!
//! 1. no over-admission: admitted in `[0, t]` <= capacity + rate x t for every `t` (a store
//!    restart that loses state starts a new allowance);
//! 2. liveness: once faults stop, every key serves again (no wedged key, no lost waiter);
//! 3. token conservation: dispensed by the global store = admitted + handed back + still held
//!    + lost in answers that never arrived;
//! 4. exact refusals: a request refused as throttled is one the global bucket could not have
//!    served at that instant (unless tokens reappeared meanwhile: a hand-back or a restart the
//!    host cannot know of), and without injected faults the failure policy decides nothing;
//! 5. bounded waits: every request and every awaited reservation is answered within its
//!    shaping `max` plus a few store time-outs (a batch before, one after, a settle's charge),
//!    whatever other reservations hold their queue's turn without being polled;
//! 6. told waits: a throttled refusal tells how long to wait, and no longer than its bucket
//!    needs to hold the cost again (see `Recorder::wrong_wait`), plus the drawn jitter;
//! 7. told answers (drawn per seed): each refusal and admitted state, answered to a client as
//!    `DefaultRejection` answers it, says what was decided (see `answers`).
//!
//! The store's faults include calls it applies only after their hosts gave up on them (a
//! stalled store with the calls in its socket buffer), and stalls of the whole store, which
//! apply every call sent during them at their end and answer none (some across a calendar
//! quota's reset). A calendar quota's hand-back is never taken into a window after the one it
//! was sent in, nor an operator's change applied in one after the one it was made in.
//!
//! Seeds also draw run-time limit changes (raised, raised fiftyfold, lowered, a limit added,
//! removed, renamed), failure policies that admit (their admissions then settled), settled costs up
//! to `u64::MAX`, reservations parked and dropped, shadow mode, a second limit in shadow (held to
//! nothing, and never to refuse), uses outside a service (`acquire`, `acquire_ref` on a borrowed
//! key, bodies streamed through `meter`, each frame a use), cold starts on credit, batch sizes, a
//! second layer of other limits on the same store, and an operator's changes by hand (reset, drain,
//! tokens added or removed) through one host's layer, hosts that hand back every lease they hold as
//! if about to stop (and serve on; one also while the run winds down, racing the last sweeps),
//! requests exempt from every limit (never refused, counted, and taking nothing), requests without
//! a key under an admitting or a refusing `MissingKey` policy (each counted once and decided as it
//! says), limits that warm up, calendar quotas whose day ends during the run (each window held to
//! its own allowance), a level of tenants above the keys (each tenant's bucket held to the bounds
//! of a key's, its refusals exact, in shadow by level or by limit, its quota changed at run time),
//! one limit for every key as a fixed quota, admitted responses told their limits' state (never
//! more tokens than a bucket holds), beside the traffic and through the store's latency and faults,
//! and how long hosts refuse a key from one answer, how hosts size their batches (the default,
//! fixed fractions, a policy that asks for nothing and one that asks for everything), whether they
//! keep small leases for keys far from their limit, whether they lend a key's tokens to the
//! cores serving it, how long they leave a failing store alone, and how much jitter lengthens refusals' waits; the oracle's bounds follow (see
//! `check_allowance`: tokens a change adds are allowed on top, and count as tokens that reappeared
//! for exactness).
#![allow(dead_code)]

mod answers;
pub mod concurrency;
mod faults;
pub mod rng;
pub mod windows;

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hierarchical_throttle::batch::{BatchContext, FractionOfCapacity, WeightedDemand};
use hierarchical_throttle::calendar::Period;
use hierarchical_throttle::clock::{Clock, TokioClock};
use hierarchical_throttle::global::Adjustment;
use hierarchical_throttle::local::LocalStore;
use hierarchical_throttle::quota::{BucketKey, LeaseKey};
use hierarchical_throttle::{
    ColdStart, CoreReserves, FailurePolicy, HierarchicalThrottleLayer, Keys, Limit,
    MemoryLocalStore, MissingKey, OnRejection, Quota, Rejection, RejectionReason, Remaining,
    Shaping, StoreError,
};
use tower::{Layer, ServiceExt, service_fn};

pub use faults::{FaultPlan, FaultyGlobal};
pub use rng::Rng;

/// A request: a key and a cost.
#[derive(Debug, Clone)]
pub struct Job {
    pub key: String,
    pub cost: u64,
    /// What it turns out to cost, when the fleet settles costs from responses.
    pub actual: u64,
    /// When it was sent (tokio time since the run began).
    pub sent: Duration,
    /// Exempt from every limit: the hosts pass it through untouched.
    pub exempt: bool,
    /// Sent without a key: the `MissingKey` policy decides it.
    pub keyless: bool,
}

/// What a request got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Served,
    /// Served, and reports the tokens it used (settled by the layer).
    Used(u64),
    Refused(RejectionReason),
}

type Host = HierarchicalThrottleLayer<
    Job,
    String,
    FaultyGlobal,
    MemoryLocalStore<String>,
    TickedClock,
    Recorder,
>;

/// Tokio's clock with a coarse reading: the time at the last whole `tick` (none when zero),
/// as a kernel's coarse clock reads it, trailing by up to a tick.
#[derive(Debug, Clone, Copy)]
pub struct TickedClock {
    clock: TokioClock,
    tick: Duration,
}

impl TickedClock {
    pub fn new(clock: TokioClock, tick: Duration) -> Self {
        Self { clock, tick }
    }
}

impl Clock for TickedClock {
    fn now(&self) -> Duration {
        self.clock.now()
    }

    fn recent(&self) -> Duration {
        let now = self.clock.now();
        match self.tick.as_nanos() {
            0 => now,
            tick => now - Duration::from_nanos((now.as_nanos() % tick) as u64),
        }
    }

    fn recent_lag(&self) -> Duration {
        self.tick
    }

    fn unix_origin(&self) -> Duration {
        self.clock.unix_origin()
    }
}

/// One key's limit in a run.
#[derive(Debug, Clone, Copy)]
pub struct KeySpec {
    pub limit: Limit,
    /// Requests per second over the fleet, as a multiple of the limit's rate (in tenths).
    pub load_tenths: u64,
}

/// Everything a seed draws.
#[derive(Debug, Clone)]
pub struct Scenario {
    pub seed: u64,
    pub hosts: usize,
    pub keys: Vec<KeySpec>,
    /// Distinct keys sprayed once each beside the hot keys (to force evictions).
    pub spray: usize,
    pub local_max_keys: usize,
    /// A burst of this many simultaneous requests for key 0 on host 0 at `herd_at`.
    pub herd: usize,
    pub herd_at: Duration,
    /// Requests given up by their client after this long (one in `cancel_one_in`).
    pub cancel_after: Duration,
    pub cancel_one_in: u64,
    pub costs_up_to: u64,
    pub duration: Duration,
    pub store_timeout: Duration,
    pub lease_ttl: Duration,
    pub max_reservation: Duration,
    pub faults: FaultPlan,
    /// Faults are injected at all (else: latency only, and the failure policy must never
    /// decide).
    pub faulty: bool,
    /// Whether throttled requests wait for their tokens (drawn last, so that earlier seeds
    /// keep the rest of their scenario).
    pub shaping: Shaping,
    /// Whether responses settle each request's cost to what it used (0 to twice its cost).
    pub settle: bool,
    /// Whether each hot key also has a second, slower limit with a larger burst (all or
    /// nothing across the two).
    pub two_limits: bool,
    /// The demand interval (ten of them size batches): at 1 or 10 ms, keys go quiet for the
    /// whole window (16 intervals) within the run, and their buckets shed their slow-path
    /// state at sweeps (drawn last, like `shaping`).
    pub demand_interval: Duration,
    // Drawn after the above, so that earlier seeds keep the rest of their scenario.
    /// A change of hot-0's quota while the fleet runs.
    pub change: Option<LimitChange>,
    /// The failure policy when faults are injected (`Reject` keeps every admission leased).
    pub policy: FailurePolicy,
    /// One in this many settled responses reports an enormous cost (0: none).
    pub huge_one_in: u64,
    /// One in this many arrivals reserves through `reserve` instead of calling the service
    /// (0: none); of those, one in `park_one_in` is polled once and then kept unpolled for
    /// `park_for` before it is dropped.
    pub reserve_one_in: u64,
    pub park_one_in: u64,
    pub park_for: Duration,
    /// Every layer in shadow mode.
    pub shadow: bool,
    /// A second layer, called `other`, on the same store, whose limits are these hot keys'
    /// scaled by `other_scale` (in tenths); half the traffic goes to it.
    pub other_scale: Option<u64>,
    /// What a host does with a request its lease cannot serve before the store answers.
    pub cold_start: ColdStart,
    /// The most global calls in one batch (1: each on its own).
    pub global_batch: usize,
    /// How long a call nothing waits on may wait for others to join its batch.
    pub global_batch_linger: Duration,
    /// One in this many arrivals (of those not reserving) is a use through `acquire` instead
    /// of a request (0: none); `acquire_ref` (a borrowed key) for those when `by_ref`.
    pub acquire_one_in: u64,
    pub by_ref: bool,
    /// With `two_limits`, the second limit (`slow`) is in shadow: it never refuses, and the
    /// oracle holds only the first to its bound.
    pub shadow_slow: bool,
    /// One in this many arrivals (of those left) streams its cost as a body of that many
    /// bytes through `meter`, in up to three frames, each frame a use of its length (0: none).
    pub meter_one_in: u64,
    /// Changes an operator makes by hand to hot-0's buckets, each through one host's layer
    /// (when, which host, what), in time order.
    pub adjustments: Vec<(Duration, usize, Adjustment)>,
    /// How long a host refuses a key from one answer (`None`: the lease time-to-live).
    pub refusal_memory: Option<Duration>,
    /// The hot keys' first limits (group 0) are calendar quotas of their capacity a day, and
    /// a day ends during the run (at `unix_origin`'s next midnight).
    pub calendar: bool,
    /// The calendar quotas' time zone (`None`: UTC); in Paris, the day that ends during the
    /// run is one of 23 or 25 hours.
    pub calendar_zone: Option<&'static str>,
    /// Where the run's clock starts on the calendar.
    pub unix_origin: Duration,
    /// Every key has the same one limit, given to the layers as a fixed quota (not per key).
    pub fixed_quota: bool,
    /// Admitted responses get the state of their limits (`RateLimit` fields); with a fixed
    /// quota, hosts that borrow the key read it inside the take's lookup.
    pub annotate: bool,
    /// The layers' `RateLimit` fields on (the default) or off: off, no admitted response is
    /// told the state of its limits, whatever the answers would write.
    pub fields: bool,
    /// How refusals and admitted states are answered to clients and checked (`None`: not).
    pub answers: Option<answers::Answers>,
    /// The hosts' clocks' coarse reading (what responses tell is read at) trails by up to
    /// this (zero: they have none).
    pub tick: Duration,
    /// How the hosts size the batches they ask for.
    pub batch_policy: BatchDraw,
    /// The longest a host leaves a failing store alone before probing it again.
    pub max_store_backoff: Duration,
    /// A second level, `tenant`, above the keys.
    pub tenants: Option<Tenants>,
    /// A change of tenant t-0's quota while the fleet runs (with quotas per tenant).
    pub tenant_change: Option<LimitChange>,
    /// The most a refusal's wait is lengthened by at random.
    pub retry_after_jitter: Duration,
    /// Hosts that hand back every lease they hold, as one about to stop does (when, which
    /// host), in time order; each goes on serving after it.
    pub stops: Vec<(Duration, usize)>,
    /// A host that hands back everything while the run winds down, racing the last sweeps.
    pub stop_at_end: Option<usize>,
    /// Hosts whose counters are read (`stats`, as a metrics scraper does) at these times
    /// (when, which host), in time order: the leases of buckets evicted since the last sweep
    /// are then kept for the next one, or for their keys' next fetches, to hand back.
    pub counter_reads: Vec<(Duration, usize)>,
    /// One request in this many (sent to a service) is exempt from every limit (0: none).
    pub exempt_one_in: u64,
    /// One request in this many (sent to a service, not exempt) has no key, and whether the
    /// hosts admit such requests (`MissingKey::Admit`) or refuse them (`MissingKey::Reject`).
    pub keyless: Option<(u64, bool)>,
    /// Whether hosts keep small leases for keys far from their limit (the default).
    pub keep_small_leases: bool,
    /// When hosts lend a key's tokens to the cores serving it (the run has one thread, so
    /// `WhenContended` never lends, and `Always` lends on every take that finds no reserve).
    pub core_reserves: CoreReserves,
    /// The hot keys get no request for this long before the herd (`windows.rs`).
    pub quiet: Duration,
    /// Checked for every window, not only those from the start (`windows.rs`).
    pub windows: bool,
}

/// A level `tenant` above the keys: hot key `hot-i` belongs to tenant `t-{i % count}`; of the
/// sprayed keys, two in three belong to `t-spray` (a flood of keys under one tenant) and the
/// third to none (not limited at the level).
#[derive(Debug, Clone, Copy)]
pub struct Tenants {
    pub count: usize,
    /// Each tenant's limit.
    pub limit: Limit,
    /// Limits chosen per tenant (`level_per_key`, which gives `t-spray` one of its own), or
    /// one for every tenant (`level`).
    pub per_key: bool,
    pub shadow: LevelShadow,
}

/// What of the level is in shadow: held to nothing, and never to refuse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LevelShadow {
    None,
    /// `shadow_level("tenant")`.
    Level,
    /// `shadow_limit("tenant/default")`, its only limit.
    Limit,
}

/// The name of the level the simulation draws.
const TENANT: &str = "tenant";

/// `key`'s keys on `layer`: its own, and its tenant's at the tenants' level.
fn keys_of(layer: &Host, key: String, tenant: Option<String>) -> Keys<String> {
    let levels = tenant.map(|tenant| (TENANT, tenant));
    layer.keys(key, levels).expect("the layer's level")
}

/// The tenant of `key`, when the run has tenants and the key one.
fn tenant_of(tenants: Option<Tenants>, key: &str) -> Option<String> {
    let tenants = tenants?;
    if let Some(i) = key.strip_prefix("hot-") {
        let i: usize = i.parse().ok()?;
        return Some(format!("t-{}", i % tenants.count));
    }
    let i: usize = key.strip_prefix("spray-")?.parse().ok()?;
    (!i.is_multiple_of(3)).then(|| "t-spray".to_owned())
}

/// The quota of `tenant`.
fn tenant_quota(tenants: Tenants, tenant: &str) -> Quota {
    match tenants.per_key && tenant == "t-spray" {
        true => Quota::from(Limit::per_second(20).burst(20).expect("a valid limit")),
        false => Quota::from(tenants.limit),
    }
}

/// A [`BatchPolicy`](hierarchical_throttle::batch::BatchPolicy) drawn by a seed: the default,
/// fixed fractions of the capacity, and the two ends the throttle clamps (a policy that asks
/// for nothing gets what its waiters need, one that asks for everything gets the capacity).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum BatchDraw {
    WeightedDemand,
    Fraction(f64),
    Nothing,
    Everything,
}

/// A run-time change of a quota (hot-0's, or tenant t-0's), at `at`.
#[derive(Debug, Clone, Copy)]
pub struct LimitChange {
    pub at: Duration,
    pub kind: ChangeKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChangeKind {
    /// The first limit, four times faster with twice the burst.
    Raise,
    /// The first limit, fifty times faster with twice the burst: its window 25 times shorter
    /// (a tier upgrade from a per-minute plan to a per-second one). Drawn in place of some
    /// raises, by a stream of its own.
    RaiseSteeply,
    /// The first limit, four times slower with half the burst (at least 1).
    Lower,
    /// A limit `extra` added: a tenth of the first's rate, a fifth of its burst.
    Add,
    /// The last limit removed (or, for a lone limit, the same limit renamed).
    Remove,
    /// The first limit renamed `tier2`, same shape.
    Rename,
}

/// Every kind of change, in the order seeds draw them.
const CHANGES: [ChangeKind; 5] = [
    ChangeKind::Raise,
    ChangeKind::Lower,
    ChangeKind::Add,
    ChangeKind::Remove,
    ChangeKind::Rename,
];

const LIMITS: &[(u64, u64, u64)] = &[
    // (tokens, per seconds, burst)
    (10, 1, 10),
    (20, 1, 5),
    (100, 1, 100),
    (300, 1, 50),
    (15, 120, 15),
    (1000, 60, 30),
];

impl Scenario {
    /// The scenario of `seed`.
    pub fn draw(seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let keys = (0..rng.range(1, 3))
            .map(|_| {
                let (tokens, secs, burst) = LIMITS[rng.below(LIMITS.len() as u64) as usize];
                KeySpec {
                    limit: Limit::per(tokens, Duration::from_secs(secs))
                        .burst(burst)
                        .expect("valid limit"),
                    load_tenths: [5, 10, 20, 50, 100][rng.below(5) as usize],
                }
            })
            .collect();
        let store_timeout = Duration::from_millis(50);
        let faulty = rng.chance(0.7);
        let herd = if rng.chance(0.05) {
            rng.range(1_000, 10_000) as usize
        } else if rng.chance(0.3) {
            rng.range(10, 300) as usize
        } else {
            0
        };
        Self {
            seed,
            hosts: rng.range(1, 8) as usize,
            keys,
            spray: if rng.chance(0.3) {
                rng.range(100, 800) as usize
            } else {
                0
            },
            local_max_keys: if rng.chance(0.5) { 64 } else { 10_000 },
            herd,
            herd_at: Duration::from_millis(rng.range(0, 1_000)),
            cancel_after: Duration::from_millis(rng.range(1, 80)),
            cancel_one_in: [0, 3, 10][rng.below(3) as usize],
            costs_up_to: if rng.chance(0.3) { 3 } else { 1 },
            duration: Duration::from_millis(rng.range(500, 2_000)),
            store_timeout,
            lease_ttl: Duration::from_millis([100, 500, 2_000][rng.below(3) as usize]),
            max_reservation: Duration::from_millis([0, 20, 100][rng.below(3) as usize]),
            faults: FaultPlan::draw(&mut rng, store_timeout, faulty),
            faulty,
            shaping: if rng.chance(0.3) {
                Shaping::Wait {
                    max: Duration::from_millis([5, 50, 300][rng.below(3) as usize]),
                    queue: [1, 8, 128][rng.below(3) as usize],
                }
            } else {
                Shaping::Refuse
            },
            settle: rng.chance(0.3),
            two_limits: rng.chance(0.3),
            demand_interval: Duration::from_millis([1, 10, 1_000][rng.below(3) as usize]),
            change: None,
            policy: FailurePolicy::Reject,
            huge_one_in: 0,
            reserve_one_in: 0,
            park_one_in: 0,
            park_for: Duration::ZERO,
            shadow: false,
            other_scale: None,
            cold_start: ColdStart::Exact,
            global_batch: 1,
            global_batch_linger: Duration::ZERO,
            acquire_one_in: 0,
            by_ref: false,
            shadow_slow: false,
            meter_one_in: 0,
            adjustments: Vec::new(),
            refusal_memory: None,
            calendar: false,
            calendar_zone: None,
            unix_origin: Duration::ZERO,
            fixed_quota: false,
            annotate: false,
            fields: true,
            answers: None,
            tick: Duration::ZERO,
            batch_policy: BatchDraw::WeightedDemand,
            max_store_backoff: Duration::from_secs(1),
            tenants: None,
            tenant_change: None,
            retry_after_jitter: Duration::ZERO,
            stops: Vec::new(),
            stop_at_end: None,
            counter_reads: Vec::new(),
            exempt_one_in: 0,
            keyless: None,
            keep_small_leases: true,
            core_reserves: CoreReserves::WhenContended,
            quiet: Duration::ZERO,
            windows: false,
        }
        .draw_more(&mut rng)
    }

    /// The draws added later, from the same generator after the others.
    fn draw_more(mut self, rng: &mut Rng) -> Self {
        if rng.chance(0.3) {
            self.change = Some(LimitChange {
                at: Duration::from_micros(rng.below(self.duration.as_micros() as u64)),
                kind: CHANGES[rng.below(5) as usize],
            });
        }
        if self.faulty {
            self.policy = match rng.below(3) {
                0 => FailurePolicy::Reject,
                1 => FailurePolicy::Admit,
                _ => FailurePolicy::local_fallback(rng.range(1, self.hosts as u64))
                    .expect("at least one host"),
            };
        }
        self.huge_one_in = if self.settle && rng.chance(0.3) {
            [5, 50][rng.below(2) as usize]
        } else {
            0
        };
        if rng.chance(0.3) {
            self.reserve_one_in = [2, 10][rng.below(2) as usize];
            self.park_one_in = [0, 3][rng.below(2) as usize];
            self.park_for = Duration::from_millis([10, 300, 30_000][rng.below(3) as usize]);
        }
        self.shadow = rng.chance(0.05);
        self.other_scale = rng.chance(0.15).then(|| [3, 20][rng.below(2) as usize]);
        self.cold_start = match rng.below(4) {
            0 => ColdStart::Exact,
            n => ColdStart::Credit {
                share: [0.01, 0.1, 0.5][n as usize - 1],
            },
        };
        self.global_batch = [1, 4, 128][rng.below(3) as usize];
        if rng.chance(0.3) {
            self.acquire_one_in = [2, 10][rng.below(2) as usize];
            self.by_ref = rng.chance(0.5);
        }
        self.shadow_slow = self.two_limits && rng.chance(0.3);
        if rng.chance(0.3) {
            self.meter_one_in = [2, 10][rng.below(2) as usize];
        }
        if rng.chance(0.2) {
            for _ in 0..rng.range(1, 4) {
                let at = Duration::from_micros(rng.below(self.duration.as_micros() as u64));
                let host = rng.below(self.hosts as u64) as usize;
                let tokens = rng.range(1, 2 * self.keys[0].limit.capacity());
                let adjustment = match rng.below(4) {
                    0 => Adjustment::Reset,
                    1 => Adjustment::Drain,
                    2 => Adjustment::Add(tokens),
                    _ => Adjustment::Remove(tokens),
                };
                self.adjustments.push((at, host, adjustment));
            }
            self.adjustments.sort_by_key(|(at, _, _)| *at);
        }
        if rng.chance(0.2) {
            self.refusal_memory = Some(Duration::from_millis(
                [5, 300, 30_000][rng.below(3) as usize],
            ));
        }
        let mut linger = [0, 500, 5_000, 50_000][rng.below(4) as usize];
        // Half the longest draws linger as long as the default (250 ms), from a stream of their
        // own so that earlier seeds keep their other draws.
        if linger == 50_000 && Rng::new(self.seed ^ 0x11_4e6e).chance(0.5) {
            linger = 250_000;
        }
        self.global_batch_linger = Duration::from_micros(linger);
        let warm = rng.chance(0.25);
        if warm {
            // The hot keys' limits warm up (a change of limit drops it: a key that moves from a
            // warm-up to none and back is drawn too).
            let period = Duration::from_millis([100, 1_000, 10_000][rng.below(3) as usize]);
            for key in &mut self.keys {
                key.limit = key.limit.warm_up(period).expect("a valid warm-up");
            }
        }
        let mut reset_at = None;
        if !warm && rng.chance(0.2) {
            // 2024-11-26 00:00 UTC, a calendar day's reset, comes this far into the run.
            self.calendar = true;
            // Changes derive their limits from a rate; a calendar quota's nominal one (its
            // amount a day) makes limits whose refill takes days of simulated sweeps.
            self.change = None;
            let reset_in = Duration::from_micros(rng.below(self.duration.as_micros() as u64));
            // Or the end of Paris's day of 25 hours (2024-10-27 23:00 UTC), or of its day of
            // 23 (2024-03-31 22:00 UTC): drawn apart from the seed's stream, so the runs of
            // earlier seeds keep their draws (a run's few seconds around a reset are the
            // same in any zone but for the reset's instant).
            let mut zone_rng = Rng::new(reset_in.as_micros() as u64 ^ 0x5a4f_4e45);
            let (zone, reset) = match zone_rng.below(3) {
                0 => (None, 1_732_579_200),
                1 => (Some("Europe/Paris"), 1_730_070_000),
                _ => (Some("Europe/Paris"), 1_711_922_400),
            };
            self.calendar_zone = zone;
            self.unix_origin = Duration::from_secs(reset) - reset_in;
            reset_at = Some(reset_in);
        }
        self.annotate = rng.chance(0.5);
        // One hot key, no spray, no second layer and no change of limit: the same quota for
        // every key the run sends, so a fixed one decides as the per-key one would.
        let uniform = self.keys.len() == 1
            && self.spray == 0
            && self.other_scale.is_none()
            && self.change.is_none();
        self.fixed_quota = uniform && rng.chance(0.7);
        // A stream of its own, so that earlier seeds keep their other draws.
        let ticks = [0, 0, 4, 50, 1_000];
        self.tick = Duration::from_millis(ticks[Rng::new(self.seed ^ 0x71C4).below(5) as usize]);
        self.fields = !Rng::new(self.seed ^ 0x00F1_E1D5).chance(0.25);
        self.answers = answers::Answers::draw(self.seed);
        // Streams of their own too.
        let policies = [
            BatchDraw::WeightedDemand,
            BatchDraw::WeightedDemand,
            BatchDraw::Fraction(0.25),
            BatchDraw::Fraction(1.0),
            BatchDraw::Nothing,
            BatchDraw::Everything,
        ];
        self.batch_policy = policies[Rng::new(self.seed ^ 0xBA7C_4011).below(6) as usize];
        let backoffs = [50, 1_000, 1_000, 3_000];
        self.max_store_backoff =
            Duration::from_millis(backoffs[Rng::new(self.seed ^ 0xB0FF).below(4) as usize]);
        let jitters = [0, 0, 100, 5_000];
        self.retry_after_jitter =
            Duration::from_millis(jitters[Rng::new(self.seed ^ 0x717_7E12).below(4) as usize]);
        // Calls a stalled store applies only after their hosts gave up: a stream of its own.
        let mut late = Rng::new(self.seed ^ 0x1A7E_CA11);
        if self.faulty && late.chance(0.4) {
            self.faults.applied_late = late.range(1, 100);
            if self.calendar && late.chance(0.5) {
                // Stalls long enough that a hand-back sent before a calendar quota's reset
                // lands after it: past the quiet margin in which hosts stop holding its tokens.
                self.faults.late_reach = self.lease_ttl
                    + self.store_timeout * 4
                    + self.global_batch_linger
                    + Duration::from_secs(2);
            }
        }
        if let Some(reset) = reset_at.filter(|_| self.faulty && late.chance(0.3)) {
            // The whole store stalls across the reset, from within the margin before it in
            // which hosts hand back the window's tokens.
            let margin = self.lease_ttl / 2 + self.store_timeout * 2 + Duration::from_secs(2);
            let before = Duration::from_micros(late.below(margin.as_micros() as u64));
            let after = Duration::from_micros(late.range(1_000, 2_000_000));
            self.faults.stall = Some((reset.saturating_sub(before), reset + after));
        } else if self.faulty && late.chance(0.2) {
            // Or at any moment of the run, for up to two lease times-to-live.
            let from = Duration::from_micros(late.below(self.duration.as_micros() as u64));
            let most = (self.lease_ttl * 2).as_micros() as u64;
            let length = Duration::from_micros(late.range(1_000, most));
            self.faults.stall = Some((from, from + length));
        }
        let mut level = Rng::new(self.seed ^ 0x7E_4A47);
        if level.chance(0.3) {
            let shadows = [
                LevelShadow::None,
                LevelShadow::None,
                LevelShadow::None,
                LevelShadow::Level,
                LevelShadow::Limit,
            ];
            self.tenants = Some(Tenants {
                count: level.range(1, 2) as usize,
                // Below one key's limit, between one's and two's, or above both.
                limit: scaled(self.keys[0].limit, [5, 15, 40][level.below(3) as usize]),
                per_key: level.chance(0.5),
                shadow: shadows[level.below(5) as usize],
            });
        }
        if self.tenants.is_some_and(|t| t.per_key) && level.chance(0.4) {
            self.tenant_change = Some(LimitChange {
                at: Duration::from_micros(level.below(self.duration.as_micros() as u64)),
                kind: CHANGES[level.below(5) as usize],
            });
        }
        // Hosts about to stop hand back all they hold: a stream of its own.
        let mut stopping = Rng::new(self.seed ^ 0x5709_0A11);
        if stopping.chance(0.3) {
            for _ in 0..stopping.range(1, 3) {
                let at = Duration::from_micros(stopping.below(self.duration.as_micros() as u64));
                let host = stopping.below(self.hosts as u64) as usize;
                self.stops.push((at, host));
            }
            self.stops.sort_by_key(|(at, _)| *at);
        }
        if stopping.chance(0.2) {
            self.stop_at_end = Some(stopping.below(self.hosts as u64) as usize);
        }
        // Counters read while the fleet runs: a stream of its own.
        let mut reading = Rng::new(self.seed ^ 0x5CA9_E500);
        if reading.chance(0.4) {
            for _ in 0..reading.range(1, 8) {
                let at = Duration::from_micros(reading.below(self.duration.as_micros() as u64));
                let host = reading.below(self.hosts as u64) as usize;
                self.counter_reads.push((at, host));
            }
            self.counter_reads.sort_by_key(|(at, _)| *at);
        }
        // Requests exempt from every limit, mixed into the traffic: a stream of its own.
        let mut exempting = Rng::new(self.seed ^ 0xE8E3_7A11);
        if exempting.chance(0.3) {
            self.exempt_one_in = exempting.range(2, 8);
        }
        // Requests without a key, and the policy for them: a stream of its own.
        let mut keyless = Rng::new(self.seed ^ 0x4E71_E555);
        if keyless.chance(0.25) {
            self.keyless = Some((keyless.range(3, 10), keyless.chance(0.5)));
        }
        // Small leases kept or not: a stream of its own.
        let mut keeping = Rng::new(self.seed ^ 0x6EE9_5A11);
        self.keep_small_leases = !keeping.chance(0.3);
        // Cores' reserves: a stream of its own.
        let reserves = [
            CoreReserves::Always,
            CoreReserves::Always,
            CoreReserves::WhenContended,
            CoreReserves::Off,
        ];
        self.core_reserves = reserves[Rng::new(self.seed ^ 0xC0_4E5E).below(4) as usize];
        // Half the raises are steep: a stream of its own, so other draws stay as they were.
        let mut steep = Rng::new(self.seed ^ 0x57EE_9000);
        for change in [&mut self.change, &mut self.tenant_change]
            .into_iter()
            .flatten()
        {
            if change.kind == ChangeKind::Raise && steep.chance(0.5) {
                change.kind = ChangeKind::RaiseSteeply;
            }
        }
        self
    }

    /// The tenant of `key`, if it has one.
    fn tenant_of(&self, key: &str) -> Option<String> {
        tenant_of(self.tenants, key)
    }

    /// Every tenant of the run, with its quota.
    fn tenant_quotas(&self) -> HashMap<String, Quota> {
        let Some(tenants) = self.tenants else {
            return HashMap::new();
        };
        let hot = (0..self.keys.len()).map(|i| format!("hot-{i}"));
        let spray = (0..self.spray).map(|i| format!("spray-{i}"));
        hot.chain(spray)
            .filter_map(|key| self.tenant_of(&key))
            .map(|tenant| {
                let quota = tenant_quota(tenants, &tenant);
                (tenant, quota)
            })
            .collect()
    }

    /// Whether the tenants' level is held to nothing (in shadow).
    fn tenants_shadowed(&self) -> bool {
        self.tenants.is_some_and(|t| t.shadow != LevelShadow::None)
    }

    /// Whether each admitted request's tokens can be accounted for exactly (conservation).
    fn conserves(&self) -> bool {
        // A limit in shadow takes nothing for the requests it lets through.
        self.change.is_none()
            && self.tenant_change.is_none()
            && self.huge_one_in == 0
            && !self.shadow
            && !self.shadow_slow
            && !self.tenants_shadowed()
    }

    /// The longest a request or an awaited reservation may wait for its answer: its shaping
    /// wait (counted from its arrival, so the batches of its first check are part of it), the
    /// batches of its last check (one in flight, then its own, each within the store
    /// time-out), and a settle's charge; and timer slack.
    fn answer_within(&self) -> Duration {
        let shaping = match self.shaping {
            Shaping::Wait { max, .. } => max,
            _ => Duration::ZERO,
        };
        answer_within(shaping, self.store_timeout)
    }

    /// Hot key `i`'s quota in the layer of group `group` (0: `default`, 1: `other`).
    fn quota(&self, i: usize, group: usize) -> Quota {
        let limit = self.keys[i].limit;
        let limit = match (group, self.other_scale) {
            (1, Some(scale)) => scaled(limit, scale),
            (0, _) if self.calendar => {
                let quota = Limit::per_calendar(limit.capacity(), Period::Day);
                let quota = match self.calendar_zone {
                    Some(zone) => quota.time_zone(zone),
                    None => quota,
                };
                quota.build().expect("a valid calendar quota")
            }
            _ => limit,
        };
        quota_of(limit, self.two_limits)
    }
}

/// The longest a use that may wait `max` is answered in, with store time-out `timeout`.
fn answer_within(max: Duration, timeout: Duration) -> Duration {
    max + timeout * 3 + Duration::from_millis(2)
}

/// `limit` with rate and burst scaled by `tenths` / 10 (at least 1).
fn scaled(limit: Limit, tenths: u64) -> Limit {
    let amount = (limit.refill_amount() * tenths / 10).max(1);
    let burst = (limit.capacity() * tenths / 10).max(1);
    Limit::per(amount, limit.refill_period())
        .burst(burst)
        .expect("a valid limit")
}

/// `quota` after `kind`.
fn changed(quota: &Quota, kind: ChangeKind) -> Quota {
    let limits: Vec<(&str, Limit)> = quota.iter().map(|(n, l)| (n, *l)).collect();
    let (first_name, first) = limits[0];
    let with_first = |name: &str, limit: Limit| {
        let mut q = Quota::new(name, limit).expect("a valid quota");
        for &(n, l) in &limits[1..] {
            q = q.and(n, l).expect("a valid quota");
        }
        q
    };
    match kind {
        ChangeKind::Raise => with_first(
            first_name,
            Limit::per(first.refill_amount() * 4, first.refill_period())
                .burst(first.capacity() * 2)
                .expect("a valid limit"),
        ),
        ChangeKind::RaiseSteeply => with_first(
            first_name,
            Limit::per(first.refill_amount() * 50, first.refill_period())
                .burst(first.capacity() * 2)
                .expect("a valid limit"),
        ),
        ChangeKind::Lower => with_first(
            first_name,
            Limit::per(first.refill_amount(), first.refill_period() * 4)
                .burst((first.capacity() / 2).max(1))
                .expect("a valid limit"),
        ),
        ChangeKind::Add => quota
            .clone()
            .and("extra", with_burst(scaled(first, 1), first.capacity() / 5))
            .expect("a valid quota"),
        ChangeKind::Remove if limits.len() > 1 => {
            Quota::new(first_name, first).expect("a valid quota")
        }
        ChangeKind::Remove | ChangeKind::Rename => with_first("tier2", first),
    }
}

/// `limit` with its burst at `burst` (at least 1).
fn with_burst(limit: Limit, burst: u64) -> Limit {
    Limit::per(limit.refill_amount(), limit.refill_period())
        .burst(burst.max(1))
        .expect("a valid limit")
}

/// An admitted request: its layer group, key (and tenant), when it was sent and admitted, the
/// tokens it used and those it was charged.
#[derive(Debug, Clone)]
pub struct Admission {
    pub group: usize,
    pub key: String,
    /// The tenant whose level it drew on too.
    pub tenant: Option<String>,
    pub sent: Duration,
    pub at: Duration,
    pub used: u64,
    pub charged: u64,
}

/// What the hosts answered and when, for the oracle.
#[derive(Debug, Default)]
pub struct Log {
    /// Every admitted request, in order.
    pub admitted: Vec<Admission>,
    /// Answers that came later than a request may wait, described.
    pub late: Vec<String>,
    /// Refusals that break exactness (see the module's docs), described.
    pub inexact: Vec<String>,
    pub refused: u64,
    /// Refusals by a tenant's limit.
    pub refused_by_tenant: u64,
    pub store_unavailable: u64,
    /// Admitted responses told the state of their limits.
    pub annotated: u64,
    /// Requests of a key (not exempt) admitted through a host's service and answered (not
    /// cancelled first): each is told the state of its limits when the run annotates.
    pub answered_admitted: u64,
    /// States told of admitted responses that no bucket can hold, described.
    pub misreported: Vec<String>,
    /// Refusals and admitted states answered to clients otherwise than they are.
    pub misanswered: Vec<String>,
    /// Exempt requests sent to a host, and served.
    pub exempt_sent: u64,
    pub exempt_served: u64,
    /// Requests without a key sent to a host, served, and refused as missing their key.
    pub keyless_sent: u64,
    pub keyless_served: u64,
    pub keyless_refused: u64,
}

/// The hosts' `OnRejection`: records the refusal, and checks on the spot that a throttled
/// request could not have been served by the global bucket.
#[derive(Clone)]
pub struct Recorder {
    /// The layer's name, in its buckets' identities.
    layer: &'static str,
    log: Arc<Mutex<Log>>,
    global: FaultyGlobal,
    clock: TokioClock,
    /// How long a refusal's basis may be older than a reappearance of tokens.
    slack: Duration,
    /// How long a request may wait for batches before a refusal loses exactness.
    patience: Duration,
    /// Whether refusals are exact: not when the failure policy may refuse on its own
    /// (`LocalFallback` decides with the host's share of the limit, on purpose).
    exact: bool,
    /// Responses settle costs (`Outcome::Used`).
    settle: bool,
    /// The limit in shadow, which must never refuse.
    shadowed: Option<&'static str>,
    /// Admitted responses get the state of their limits.
    annotate: bool,
    answers: Option<answers::Answers>,
    /// The tenants' level, if the run has one.
    tenants: Option<Tenants>,
    /// The most a refusal's wait is lengthened by at random.
    jitter: Duration,
    /// The most tokens waiters in a full queue of a key may cost together.
    queued: u64,
    /// Where the run's clock starts on the calendar.
    unix_origin: Duration,
    /// How far ahead of the refill hosts may reserve.
    max_reservation: Duration,
    /// The keys (by level) whose limit is raised during the run, when, and how many times
    /// faster it refills then.
    raised: Vec<(Option<&'static str>, &'static str, Duration, u32)>,
}

impl Recorder {
    /// What is wrong with the wait a throttled refusal tells, if anything: there must be one,
    /// and no longer than its bucket needs to hold the cost from empty, behind what the bucket
    /// owes (`owed`) or may have owed when the host last heard from it, and the costs a full
    /// queue of waiters holds ahead, at the third of its rate a warming-up limit starts at (for
    /// a calendar quota: the rest of its window and a window for each capacity of those
    /// tokens); plus the jitter and timer slack.
    fn wrong_wait(
        &self,
        job: &Job,
        rejection: &Rejection<String>,
        bucket: &BucketKey<String>,
        limit: &Limit,
        owed: u64,
        now: Duration,
    ) -> Option<String> {
        let Some(wait) = rejection.retry_after else {
            return Some(format!("refused at {now:?} telling no wait"));
        };
        // A host learns when its next tokens are due from an answer: then the bucket may have
        // owed a capacity (a charge of debt) and the tokens reserved ahead, since paid back by
        // hand-backs the host cannot know of.
        let ahead = allowance(limit, self.unix_origin + now, self.max_reservation, &[]);
        let tokens = limit
            .capacity()
            .saturating_mul(2)
            .saturating_add(ahead as u64)
            .saturating_add(owed)
            .saturating_add(job.cost)
            .saturating_add(self.queued);
        let needed = match limit.calendar() {
            // The rest of this window, and a window for each capacity's worth of those tokens.
            Some(calendar) => {
                let unix_now = self.unix_origin + now;
                let mut reset = calendar.next_reset(unix_now);
                for _ in 0..tokens.div_ceil(limit.capacity()) {
                    reset = calendar.next_reset(reset);
                }
                reset - unix_now
            }
            None => {
                // A wait told of a request sent before its limit was raised may be the old
                // limit's; once raised, neither the host nor the store holds a request back
                // by the old limit's refill.
                let raised = (self.raised.iter()).find(|(level, key, at, _)| {
                    (*level, *key) == (bucket.level(), bucket.key().as_str()) && job.sent < *at
                });
                let slower = 3 * raised.map_or(1, |(.., times)| *times);
                limit.time_to_accrue(tokens).saturating_mul(slower)
            }
        };
        let most = needed + self.jitter + Duration::from_millis(1);
        (wait > most).then(|| {
            format!(
                "refused at {now:?} (cost {}, owed {owed}, limit {limit:?}) telling a wait of \
                 {wait:?}, more than {most:?}",
                job.cost
            )
        })
    }
}

impl OnRejection<Job, String, Outcome, Infallible> for Recorder {
    fn on_rejection(&self, job: &Job, rejection: Rejection<String>) -> Result<Outcome, Infallible> {
        let mut log = self.log.lock().unwrap();
        if let Some(wrong) = self.answers.and_then(|a| a.wrong_refusal(&rejection)) {
            log.misanswered.push(wrong);
        }
        if job.exempt {
            log.inexact
                .push(format!("{} refused though exempt: {rejection}", job.key));
        }
        if job.keyless || rejection.reason == RejectionReason::MissingKey {
            if !job.keyless || rejection.reason != RejectionReason::MissingKey {
                log.inexact.push(format!(
                    "{} (sent with a key: {}) refused: {rejection}",
                    job.key, !job.keyless
                ));
            }
            log.keyless_refused += 1;
            return Ok(Outcome::Refused(rejection.reason));
        }
        log.refused += 1;
        log.refused_by_tenant += u64::from(rejection.level == Some(TENANT));
        let now = self.clock.now();
        let by_shadowed_limit = rejection.level.is_none()
            && rejection.limit_name.is_some()
            && rejection.limit_name == self.shadowed;
        let by_shadowed_level = rejection.level == Some(TENANT)
            && match self.tenants.map(|t| t.shadow) {
                Some(LevelShadow::Level) => true,
                // A limit a change adds, or the one it renames, is enforced.
                Some(LevelShadow::Limit) => rejection.limit_name == Some("default"),
                _ => false,
            };
        if by_shadowed_limit || by_shadowed_level {
            log.inexact.push(format!(
                "{} refused by a limit in shadow: {rejection}",
                job.key
            ));
        }
        match rejection.reason {
            RejectionReason::StoreUnavailable => log.store_unavailable += 1,
            // A request that waited out its time while the store answered is refused without
            // that exactness (see `store_timeout`).
            // The refusal names its limit: that bucket must have been short.
            RejectionReason::Throttled if self.exact => {
                let (Some(limit), Some(name)) = (rejection.limit, rejection.limit_name) else {
                    log.inexact
                        .push(format!("{} refused naming no limit", job.key));
                    return Ok(Outcome::Refused(rejection.reason));
                };
                let key = match rejection.level {
                    Some(_) => tenant_of(self.tenants, &job.key),
                    None => Some(job.key.clone()),
                };
                let Some(key) = key else {
                    log.inexact.push(format!(
                        "{} refused at level {:?}, which it has no key at",
                        job.key, rejection.level
                    ));
                    return Ok(Outcome::Refused(rejection.reason));
                };
                let bucket = bucket_key(self.layer, rejection.level, key, name);
                let global = self.global.peek(&bucket, &limit);
                // What it owed before a restart or an operator's change: a host cannot know.
                let owed = global.owed().saturating_add(self.global.forgiven(&bucket));
                if let Some(wrong) = self.wrong_wait(job, &rejection, &bucket, &limit, owed, now) {
                    log.inexact.push(format!("{bucket}: {wrong}"));
                }
                if now >= job.sent + self.patience {
                    return Ok(Outcome::Refused(rejection.reason));
                }
                let there = global.tokens();
                let reappeared = self
                    .global
                    .tokens_reappeared_since(&bucket, now, self.slack);
                if there >= job.cost && !reappeared {
                    log.inexact.push(format!(
                        "{bucket} refused at {now:?} (cost {}, sent {:?}, wait {:?}, limit {:?}) \
                         while the global bucket held {there}",
                        job.cost, job.sent, rejection.retry_after, rejection.limit
                    ));
                }
            }
            _ => {}
        }
        Ok(Outcome::Refused(rejection.reason))
    }

    fn settles(&self) -> bool {
        self.settle
    }

    fn settle(&self, response: &Outcome, charged: u64) -> u64 {
        match response {
            Outcome::Used(tokens) => *tokens,
            _ => charged,
        }
    }

    fn annotates_admitted(&self) -> bool {
        self.annotate
    }

    /// Each state said of an admitted response stays within its limit, and an admitted request
    /// is told of at least one limit.
    fn on_admitted(&self, _: &mut Outcome, remaining: &[Remaining]) {
        let mut log = self.log.lock().unwrap();
        if let Some(wrong) = self.answers.and_then(|a| a.wrong_admitted(remaining)) {
            log.misanswered.push(wrong);
        }
        log.annotated += 1;
        if remaining.is_empty() {
            log.misreported
                .push("an admitted response told of no limit".to_owned());
        }
        for r in remaining.iter().filter(|r| r.tokens > r.limit.capacity()) {
            log.misreported.push(format!(
                "an admitted response told of {} tokens of {} ({:?})",
                r.tokens, r.limit_name, r.limit
            ));
        }
    }
}

/// The result of one seed: `Err` says which property broke.
pub fn run(seed: u64) -> Result<String, String> {
    run_scenario(Scenario::draw(seed))
}

/// Runs `scenario` (a drawn one, maybe changed to narrow a failure down).
pub fn run_scenario(scenario: Scenario) -> Result<String, String> {
    paused_runtime().block_on(simulate(scenario))
}

/// A runtime on paused time, as every simulated run has.
pub fn paused_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("runtime")
}

/// The names of the layers of groups 0 and 1.
const LAYERS: [&str; 2] = ["default", "other"];

/// Each group's quotas by key, which the layers read at run time.
type Quotas = Arc<Mutex<HashMap<String, Quota>>>;

/// A quota's history: from when each held.
type History = Vec<(Duration, Quota)>;

async fn simulate(s: Scenario) -> Result<String, String> {
    let clock = TokioClock::at_unix_time(s.unix_origin);
    let global = FaultyGlobal::new(clock, s.faults.clone(), s.seed);
    let groups = if s.other_scale.is_some() { 2 } else { 1 };
    let spray_limit = Limit::per_second(5).burst(5).expect("valid limit");
    let quotas: Vec<Quotas> = (0..groups)
        .map(|group| {
            let mut quotas: HashMap<String, Quota> = (0..s.keys.len())
                .map(|i| (format!("hot-{i}"), s.quota(i, group)))
                .collect();
            for i in 0..s.spray {
                quotas.insert(format!("spray-{i}"), Quota::from(spray_limit));
            }
            Arc::new(Mutex::new(quotas))
        })
        .collect();
    // Each group's tenants' quotas, which the layers read at run time.
    let tenant_quotas: Vec<Quotas> = (0..groups)
        .map(|_| Arc::new(Mutex::new(s.tenant_quotas())))
        .collect();
    let log = Arc::new(Mutex::new(Log::default()));
    let recorder = |group: usize| Recorder {
        layer: LAYERS[group],
        log: log.clone(),
        global: global.clone(),
        clock,
        slack: s.lease_ttl + s.store_timeout * 2 + s.max_reservation + Duration::from_secs(121),
        patience: s.store_timeout,
        exact: !(s.faulty && matches!(s.policy, FailurePolicy::LocalFallback { .. })),
        settle: s.settle,
        shadowed: s.shadow_slow.then_some("slow"),
        annotate: s.annotate,
        answers: s.answers,
        tenants: s.tenants,
        jitter: s.retry_after_jitter,
        queued: match s.shaping {
            Shaping::Wait { queue, .. } => queue as u64 * s.costs_up_to,
            _ => 0,
        },
        unix_origin: s.unix_origin,
        max_reservation: s.max_reservation,
        raised: [
            (None, "hot-0", s.change),
            (Some(TENANT), "t-0", s.tenant_change),
        ]
        .into_iter()
        .filter_map(|(level, key, change)| match change? {
            LimitChange {
                at,
                kind: ChangeKind::Raise,
            } => Some((level, key, at, 4)),
            LimitChange {
                at,
                kind: ChangeKind::RaiseSteeply,
            } => Some((level, key, at, 50)),
            _ => None,
        })
        .collect(),
    };
    // Layers by group, then host.
    let layers: Vec<Vec<Host>> = (0..groups)
        .map(|group| {
            (0..s.hosts)
                .map(|host| {
                    let quotas = (&quotas[group], &tenant_quotas[group]);
                    build_host(&s, host, group, quotas, recorder(group), &global)
                })
                .collect()
        })
        .collect();
    let hosts: Vec<Vec<_>> = layers
        .iter()
        .enumerate()
        .map(|(group, layers)| {
            layers
                .iter()
                .map(|layer| layer.layer(served(group, log.clone(), clock, s.settle, s.tenants)))
                .collect::<Vec<_>>()
        })
        .collect();

    let mut rng = Rng::new(s.seed ^ 0x5eed);
    let mut arrivals = traffic(&s, &mut rng);
    arrivals.sort_by_key(|a| a.at);
    // Choices drawn later than the traffic, from a generator of their own, so that the
    // traffic of earlier seeds stays as it was.
    let mut more = Rng::new(s.seed ^ 0x7a11);
    // Which requests are exempt, or have no key: streams of their own, so the others' draws
    // stay as they were.
    let mut exempting = Rng::new(s.seed ^ 0xE8E3_7A12);
    let mut drawing_keyless = Rng::new(s.seed ^ 0x4E71_E556);
    let mut tasks = tokio::task::JoinSet::new();
    let start = tokio::time::Instant::now();
    let all_buckets = || -> Vec<(BucketKey<String>, Limit)> {
        (0..groups)
            .flat_map(|g| {
                let quotas = quotas[g].lock().unwrap().clone();
                let keys = quotas.iter().flat_map(|(k, q)| buckets(g, None, k, q));
                let tenant_quotas = tenant_quotas[g].lock().unwrap().clone();
                let tenants = tenant_quotas
                    .iter()
                    .flat_map(|(t, q)| buckets(g, Some(TENANT), t, q));
                keys.chain(tenants).collect::<Vec<_>>()
            })
            .collect()
    };
    let mut restarts = s.faults.restarts.iter().copied().peekable();
    let mut histories: Vec<HashMap<String, History>> = (0..groups)
        .map(|g| {
            let quotas = quotas[g].lock().unwrap();
            quotas
                .iter()
                .map(|(k, q)| (k.clone(), vec![(Duration::ZERO, q.clone())]))
                .collect()
        })
        .collect();
    let mut tenant_histories: Vec<HashMap<String, History>> = (0..groups)
        .map(|_| {
            let quotas = s.tenant_quotas();
            quotas
                .into_iter()
                .map(|(t, q)| (t, vec![(Duration::ZERO, q)]))
                .collect()
        })
        .collect();
    let mut tenant_change = s.tenant_change;
    let mut tenant_grace = vec![0u64; groups];
    let mut change = s.change;
    let mut adjustments = s.adjustments.iter().copied().peekable();
    let mut stops = s.stops.iter().copied().peekable();
    let mut counter_reads = s.counter_reads.iter().copied().peekable();
    // Operators told their change came too late for its window (the store dropped it).
    let window_ended = Arc::new(std::sync::atomic::AtomicU64::new(0));
    // Tokens hot-0's hosts could still admit without a limit added at the change.
    let mut grace = vec![0u64; groups];
    for (n, arrival) in (0u64..).zip(arrivals) {
        tokio::time::sleep_until(start + arrival.at).await;
        while restarts.next_if(|&r| r <= arrival.at).is_some() {
            let buckets = all_buckets();
            global.restart(buckets.iter().map(|(b, l)| (b, l)));
        }
        while let Some((_, host, adjustment)) = adjustments.next_if(|(at, _, _)| *at <= arrival.at)
        {
            // Beside the traffic, each through the store's latency and faults; a failed one
            // changed the bucket or not, as its error says (the oracle follows the store).
            // With tenants, on hot-0's tenant too.
            for group in &layers {
                let layer = group[host].clone();
                let tenant = s.tenant_of("hot-0");
                let window_ended = window_ended.clone();
                tasks.spawn(async move {
                    let answer = match tenant {
                        Some(tenant) => {
                            let keys = keys_of(&layer, "hot-0".to_owned(), Some(tenant));
                            layer.adjust_keys(keys, adjustment).await
                        }
                        None => layer.adjust("hot-0", adjustment).await,
                    };
                    if let Err(StoreError::WindowEnded) = answer {
                        window_ended.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                });
            }
        }
        while let Some((_, host)) = stops.next_if(|(at, _)| *at <= arrival.at) {
            // Beside the traffic, which goes on reaching the host.
            for group in &layers {
                let layer = group[host].clone();
                tasks.spawn(async move { layer.return_all_leases().await });
            }
        }
        while let Some((_, host)) = counter_reads.next_if(|(at, _)| *at <= arrival.at) {
            for group in &layers {
                group[host].stats();
            }
        }
        if let Some(c) = change.take_if(|c| c.at <= arrival.at) {
            let id = LeaseKey::new("hot-0".to_owned(), 0, 0);
            for group in 0..groups {
                grace[group] =
                    apply_change(&s, c, clock.now(), &quotas[group], &id, &layers[group]);
                let quota = quotas[group].lock().unwrap()["hot-0"].clone();
                if let Some(history) = histories[group].get_mut("hot-0") {
                    history.push((clock.now(), quota));
                }
            }
        }
        if let Some(c) = tenant_change.take_if(|c| c.at <= arrival.at) {
            let id = LeaseKey::new("t-0".to_owned(), 1, 0);
            for group in 0..groups {
                let quotas = &tenant_quotas[group];
                tenant_grace[group] = apply_change(&s, c, clock.now(), quotas, &id, &layers[group]);
                let quota = quotas.lock().unwrap()["t-0"].clone();
                if let Some(history) = tenant_histories[group].get_mut("t-0") {
                    history.push((clock.now(), quota));
                }
            }
        }
        let group = if groups == 2 {
            more.below(2) as usize
        } else {
            0
        };
        // Spread over 0 to twice the cost without drawing from the traffic's generator.
        let mut actual = (n.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) % (2 * arrival.cost + 1);
        if s.huge_one_in > 0 && more.below(s.huge_one_in) == 0 {
            actual = [u64::MAX, 1 << 40][more.below(2) as usize];
        }
        let job = Job {
            key: arrival.key,
            actual,
            cost: arrival.cost,
            sent: clock.now(),
            exempt: false,
            keyless: false,
        };
        let reserve = s.reserve_one_in > 0 && more.below(s.reserve_one_in) == 0;
        let park = reserve && s.park_one_in > 0 && more.below(s.park_one_in) == 0;
        let cancel = arrival.cancel_after;
        let within = s.answer_within();
        let log = log.clone();
        if reserve {
            let layer = layers[group][arrival.host].clone();
            let max = match s.shaping {
                Shaping::Wait { max, .. } => max,
                _ => s.store_timeout,
            };
            let park_for = park.then_some(s.park_for);
            // A reservation waits up to its own `max`, with the same batches around it.
            let within = answer_within(max, s.store_timeout);
            let tenant = s.tenant_of(&job.key);
            tasks.spawn(reserve_one(
                layer, job, tenant, group, max, park_for, within, log, clock,
            ));
            continue;
        }
        if s.acquire_one_in > 0 && more.below(s.acquire_one_in) == 0 {
            let layer = layers[group][arrival.host].clone();
            // A borrowed key is the first level's alone.
            let tenant = s.tenant_of(&job.key).filter(|_| !s.by_ref);
            tasks.spawn(acquire_one(
                layer, job, tenant, group, s.by_ref, cancel, within, log, clock,
            ));
            continue;
        }
        if s.meter_one_in > 0 && more.below(s.meter_one_in) == 0 {
            let layer = layers[group][arrival.host].clone();
            tasks.spawn(meter_one(layer, job, group, cancel, within, log, clock));
            continue;
        }
        let service = hosts[group][arrival.host].clone();
        let mut job = job;
        job.exempt = s.exempt_one_in > 0 && exempting.below(s.exempt_one_in) == 0;
        job.keyless = !job.exempt
            && s.keyless
                .is_some_and(|(one_in, _)| drawing_keyless.below(one_in) == 0);
        {
            let mut log = log.lock().unwrap();
            log.exempt_sent += u64::from(job.exempt);
            log.keyless_sent += u64::from(job.keyless);
        }
        tasks.spawn(async move {
            let sent = clock.now();
            let call = service.oneshot(job.clone());
            let answer = match cancel {
                Some(after) => tokio::time::timeout(after, call).await.ok(),
                None => Some(call.await),
            };
            let took = clock.now() - sent;
            let mut log = log.lock().unwrap();
            if answer.is_some() && took > within {
                log.late
                    .push(format!("{} answered after {took:?}", job.key));
            }
            let limited = !job.exempt && !job.keyless;
            if limited && matches!(answer, Some(Ok(Outcome::Served | Outcome::Used(_)))) {
                log.answered_admitted += 1;
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    // Every change the store dropped, and answered, reached its operator as dropped.
    let (dropped, told) = (
        global.ledger().dropped_answered,
        window_ended.load(std::sync::atomic::Ordering::Relaxed),
    );
    if dropped != told {
        return Err(format!(
            "{dropped} operators' changes dropped by the store as too late for their window, \
             {told} reported so"
        ));
    }

    // Quiesce: faults stop; the store's back-off and every lease expire; all is handed back.
    global.heal();
    let quiet =
        s.lease_ttl + s.max_store_backoff.max(Duration::from_secs(1)) + Duration::from_secs(1);
    tokio::time::sleep(quiet).await;
    global.late_calls_applied().await;
    let every_layer = || layers.iter().flatten();
    let sweeps = async {
        for layer in every_layer() {
            layer.return_unused_leases().await;
        }
    };
    let stop = async {
        for group in s
            .stop_at_end
            .iter()
            .flat_map(|&host| layers.iter().map(move |g| &g[host]))
        {
            group.return_all_leases().await;
        }
    };
    tokio::join!(sweeps, stop);
    // Tokens reserved ahead behind a debt may fall due long after the run: a lease's time to
    // live counts from when they do, so the last sweeps come once none is pending.
    let pending = |layer: &Host| {
        let mut pending = false;
        let store = layer.local_store();
        store.for_each_bucket(|_, b| pending |= b.leased_tokens() > b.usable_tokens());
        pending
    };
    for _ in 0..1_000 {
        if !every_layer().any(pending) {
            break;
        }
        tokio::time::sleep(s.lease_ttl).await;
        for layer in every_layer() {
            layer.return_unused_leases().await;
        }
    }
    tokio::time::sleep(s.lease_ttl + Duration::from_millis(1)).await;
    for layer in every_layer() {
        layer.return_unused_leases().await;
    }

    // Costs settled from responses can leave debts that hold reserved tokens back for seconds:
    // those fall due (and start their time-to-live) after the quiet time.
    if s.change.is_none() && s.tenant_change.is_none() && !s.settle {
        check_stranded(every_layer().enumerate(), s.hosts, &quotas, &tenant_quotas)?;
    }
    let log_now = std::mem::take(&mut *log.lock().unwrap());
    if let Some(first) = log_now.late.first() {
        return Err(format!(
            "a wait past its bound ({} in all, bound {:?}): {first}",
            log_now.late.len(),
            s.answer_within()
        ));
    }
    if let Some(first) = log_now.misanswered.first() {
        return Err(format!(
            "a client told otherwise than decided ({} in all): {first}",
            log_now.misanswered.len()
        ));
    }
    if let Some(first) = log_now.misreported.first() {
        return Err(format!(
            "an admitted response's state misreported ({} in all): {first}",
            log_now.misreported.len()
        ));
    }
    check_annotated(&s, &log_now)?;
    let stats: Vec<_> = every_layer().map(|l| l.stats()).collect();
    let counted_exempt: u64 = stats.iter().map(|st| st.requests_exempt).sum();
    if (log_now.exempt_served, counted_exempt) != (log_now.exempt_sent, log_now.exempt_sent) {
        return Err(format!(
            "{} exempt requests sent, {} served, {counted_exempt} counted exempt",
            log_now.exempt_sent, log_now.exempt_served
        ));
    }
    check_keyless(&s, &log_now, &stats)?;
    if s.shadow {
        return check_shadow(&log_now, &stats);
    }
    let unleased: u64 = stats.iter().map(|st| st.tokens_unleased).sum();
    // Credit the store never took (its fetch failed, or the key moved tiers) is use the fleet
    // did not record, like the failure policy's.
    let uncharged: u64 = match s.cold_start {
        ColdStart::Exact => 0,
        _ => stats
            .iter()
            .fold(0u64, |sum, st| sum.saturating_add(st.tokens_uncharged)),
    };
    for group in 0..groups {
        let admitted: Vec<&Admission> = log_now
            .admitted
            .iter()
            .filter(|a| a.group == group)
            .collect();
        check_allowance(
            &s,
            group,
            (&histories[group], &tenant_histories[group]),
            &admitted,
            &global,
            unleased.saturating_add(uncharged),
            (grace[group], tenant_grace[group]),
        )?;
        if s.windows {
            windows::check(
                &s,
                &quotas[group],
                &admitted,
                unleased.saturating_add(uncharged),
            )?;
        }
    }
    if let Some(first) = log_now.inexact.first() {
        return Err(format!(
            "inexact refusal ({} in all): {first}",
            log_now.inexact.len()
        ));
    }
    if !s.faulty {
        let fallback: u64 = stats.iter().map(|st| st.fallback_decisions).sum();
        if fallback > 0 || log_now.store_unavailable > 0 {
            return Err(format!(
                "the failure policy decided {fallback} requests though the store never failed"
            ));
        }
    }
    let carried_over = global.ledger().carried_over;
    if carried_over > 0 {
        return Err(format!(
            "the store took {carried_over} tokens or changes of a calendar window into the next"
        ));
    }
    if s.conserves() {
        // A small lease of a key far from its limit is kept for ten times-to-live (what
        // `check_stranded` bounds), and the hosts' own sweeps hand it back when that ends,
        // lingering for other calls to join the round trip: tokens neither held nor back yet.
        // So once every lease has ended, sweep, and let the hand-backs of any sweep before it
        // land (or be lost) before counting.
        tokio::time::sleep(s.lease_ttl * 10 + Duration::from_millis(1)).await;
        for layer in every_layer() {
            layer.return_unused_leases().await;
        }
        tokio::time::sleep(s.global_batch_linger + s.store_timeout + Duration::from_millis(1))
            .await;
        let quotas: Vec<HashMap<String, Quota>> =
            quotas.iter().map(|q| q.lock().unwrap().clone()).collect();
        let tenant_quotas: Vec<HashMap<String, Quota>> = tenant_quotas
            .iter()
            .map(|q| q.lock().unwrap().clone())
            .collect();
        check_conservation(
            every_layer(),
            &quotas,
            &tenant_quotas,
            &log_now.admitted,
            &global,
        )?;
    }
    for group in 0..groups {
        let quotas = (
            quotas[group].lock().unwrap().clone(),
            tenant_quotas[group].lock().unwrap().clone(),
        );
        check_liveness(&s, group, &layers, &hosts[group], &quotas, &global, clock).await?;
    }
    Ok(format!(
        "{} admitted, {} refused ({} by a tenant), {} global calls ({} applied late, {} \
         hand-backs expired)",
        log_now.admitted.len(),
        log_now.refused,
        log_now.refused_by_tenant,
        stats.iter().map(|st| st.global_calls).sum::<u64>(),
        global.ledger().applied_late,
        global.ledger().dropped_expired,
    ))
}

/// Host `host` of layer group `group`.
fn build_host(
    s: &Scenario,
    host: usize,
    group: usize,
    (quotas, tenant_quotas): (&Quotas, &Quotas),
    recorder: Recorder,
    global: &FaultyGlobal,
) -> Host {
    let quotas = quotas.clone();
    let tenant_quotas = tenant_quotas.clone();
    // Half the hosts borrow the key, half make it: the two ways must decide alike.
    let builder = if host.is_multiple_of(2) {
        HierarchicalThrottleLayer::builder()
            .key_ref(|job: &Job| (!job.keyless).then_some(job.key.as_str()))
    } else {
        HierarchicalThrottleLayer::builder()
            .key(|job: &Job| (!job.keyless).then(|| job.key.clone()))
    };
    let builder = match s.keyless {
        Some((_, true)) => builder.missing_key(MissingKey::Admit),
        Some((_, false)) => builder.missing_key(MissingKey::Reject),
        None => builder,
    };
    let builder = match s.shadow_slow {
        true => builder.shadow_limit("slow"),
        false => builder,
    };
    let builder = match s.refusal_memory {
        Some(memory) => builder.refusal_memory(memory),
        None => builder,
    };
    let builder = builder.name(LAYERS[group]).cost(|job: &Job| job.cost);
    let builder = match s.exempt_one_in {
        0 => builder,
        _ => builder.exempt(|job: &Job| job.exempt),
    };
    // The same one limit for every key: a fixed quota (with the response's state read in the
    // take's lookup, for hosts that borrow the key).
    let builder = match s.fixed_quota {
        true => builder.quota(s.quota(0, group)),
        false => builder.limit_per_key(move |key: &String| quotas.lock().unwrap()[key].clone()),
    };
    let builder = match s.tenants {
        Some(tenants) => {
            let tenant = move |job: &Job| {
                // A request without a key has none at any level.
                (!job.keyless).then(|| tenant_of(Some(tenants), &job.key))?
            };
            let builder = match tenants.per_key {
                true => builder.level_per_key(TENANT, tenant, move |t: &String| {
                    tenant_quotas.lock().unwrap()[t].clone()
                }),
                false => builder.level(TENANT, tenant, tenants.limit),
            };
            match tenants.shadow {
                LevelShadow::None => builder,
                LevelShadow::Level => builder.shadow_level(TENANT),
                LevelShadow::Limit => builder.shadow_limit("tenant/default"),
            }
        }
        None => builder,
    };
    let builder = match s.batch_policy {
        BatchDraw::WeightedDemand => builder.batch_policy(WeightedDemand),
        BatchDraw::Fraction(f) => {
            builder.batch_policy(FractionOfCapacity::new(f).expect("in (0, 1]"))
        }
        BatchDraw::Nothing => builder.batch_policy(|_: &BatchContext<'_>| 0),
        BatchDraw::Everything => builder.batch_policy(|_: &BatchContext<'_>| u64::MAX),
    };
    builder
        .clock(TickedClock::new(
            TokioClock::at_unix_time(s.unix_origin),
            s.tick,
        ))
        .store_timeout(s.store_timeout)
        .lease_ttl(s.lease_ttl)
        .demand_window(10, s.demand_interval)
        .max_reservation(s.max_reservation)
        .cold_start(s.cold_start)
        .global_batch(s.global_batch)
        .global_batch_linger(s.global_batch_linger)
        .keep_small_leases(s.keep_small_leases)
        .max_store_backoff(s.max_store_backoff)
        .retry_after_jitter(s.retry_after_jitter)
        .shaping(s.shaping)
        .shadow(s.shadow)
        .ratelimit_fields(s.fields)
        .failure_policy(if s.faulty {
            s.policy
        } else {
            FailurePolicy::default()
        })
        .on_rejection(recorder)
        .global_store(global.clone())
        // A layout seeded by the run, so that a seed replays exactly: a random one would evict
        // and sweep keys in another order each run.
        .local_store(
            MemoryLocalStore::with_max_keys(s.local_max_keys)
                .expect("bound")
                .with_hash_seed(s.seed ^ host as u64)
                .with_core_reserves(s.core_reserves),
        )
        .build()
        .expect("valid configuration")
}

/// The service behind group `group`'s layers: logs each request it serves.
fn served(
    group: usize,
    log: Arc<Mutex<Log>>,
    clock: TokioClock,
    settle: bool,
    tenants: Option<Tenants>,
) -> impl tower::Service<Job, Response = Outcome, Error = Infallible, Future: Send> + Clone + Send {
    service_fn(move |job: Job| {
        let log = log.clone();
        async move {
            if job.exempt || job.keyless {
                // Invisible to the oracle: no limit applies to it.
                let mut log = log.lock().unwrap();
                log.exempt_served += u64::from(job.exempt);
                log.keyless_served += u64::from(job.keyless);
                return Ok::<_, Infallible>(Outcome::Served);
            }
            let used = if settle { job.actual } else { job.cost };
            log.lock().unwrap().admitted.push(Admission {
                group,
                tenant: tenant_of(tenants, &job.key),
                key: job.key,
                sent: job.sent,
                at: clock.now(),
                used,
                charged: job.cost,
            });
            Ok::<_, Infallible>(match settle {
                true => Outcome::Used(used),
                false => Outcome::Served,
            })
        }
    })
}

/// Changes the quota of `id`'s key (at its level) of one group at `now`; returns the tokens
/// its hosts could still admit on their leases without a limit the change added: what they
/// held in its first bucket, and what a batch asked for before the change could still bring
/// (at most the global bucket's capacity, and what refills while the store answers).
fn apply_change(
    s: &Scenario,
    change: LimitChange,
    now: Duration,
    quotas: &Quotas,
    id: &LeaseKey<String>,
    layers: &[Host],
) -> u64 {
    let mut quotas = quotas.lock().unwrap();
    let Some(old) = quotas.get(id.key()).cloned() else {
        return 0;
    };
    let first = *old.iter().next().expect("a quota has a limit").1;
    let held: u64 = layers
        .iter()
        .map(|l| {
            l.local_store()
                .peek_bucket(id, |b| b.leased_tokens())
                .unwrap_or(0)
        })
        .sum();
    let answering = allowance(&first, s.unix_origin + now, s.store_timeout * 2, &[]);
    let in_flight = first.capacity() + answering as u64;
    quotas.insert(id.key().clone(), changed(&old, change.kind));
    held + in_flight
}

/// One use through `acquire` (or `acquire_ref`, `by_ref`; `acquire_keys` with a tenant),
/// dropped after `cancel` if it has not been decided by then.
#[allow(clippy::too_many_arguments)]
async fn acquire_one(
    layer: Host,
    job: Job,
    tenant: Option<String>,
    group: usize,
    by_ref: bool,
    cancel: Option<Duration>,
    within: Duration,
    log: Arc<Mutex<Log>>,
    clock: TokioClock,
) {
    let sent = clock.now();
    let decision = match (by_ref, tenant.clone()) {
        (true, _) => layer.acquire_ref(job.key.as_str(), job.cost),
        (false, Some(tenant)) => {
            layer.acquire_keys(keys_of(&layer, job.key.clone(), Some(tenant)), job.cost)
        }
        (false, None) => layer.acquire(job.key.clone(), job.cost),
    };
    let decided = match cancel {
        Some(after) => tokio::time::timeout(after, decision).await.ok(),
        None => Some(decision.await),
    };
    let Some(decided) = decided else {
        return;
    };
    if decided.is_ok() {
        log.lock().unwrap().admitted.push(Admission {
            group,
            key: job.key.clone(),
            tenant,
            sent,
            at: clock.now(),
            used: job.cost,
            charged: job.cost,
        });
    }
    let took = clock.now() - sent;
    if took > within {
        log.lock()
            .unwrap()
            .late
            .push(format!("{}'s acquire answered after {took:?}", job.key));
    }
}

/// A body of `job.cost` bytes in up to three frames, streamed through `meter`: each frame
/// delivered is a use of its length; the stream is dropped after `cancel` if it has not ended.
async fn meter_one(
    layer: Host,
    job: Job,
    group: usize,
    cancel: Option<Duration>,
    within: Duration,
    log: Arc<Mutex<Log>>,
    clock: TokioClock,
) {
    use http_body_util::BodyExt;
    let cost = usize::try_from(job.cost).unwrap_or(usize::MAX);
    let sizes = match cost {
        0..=1 => vec![cost],
        2 => vec![1, 1],
        _ => vec![cost / 3, cost / 3, cost - 2 * (cost / 3)],
    };
    let frames = sizes
        .into_iter()
        .map(|n| Ok::<_, Infallible>(http_body::Frame::data(bytes::Bytes::from(vec![0u8; n]))));
    let body = http_body_util::StreamBody::new(futures_util::stream::iter(frames));
    let mut body = std::pin::pin!(layer.meter(job.key.clone(), body));
    let read = async {
        loop {
            let sent = clock.now();
            let Some(Ok(frame)) = body.frame().await else {
                return;
            };
            let used = frame.data_ref().map_or(0, |d| d.len() as u64);
            log.lock().unwrap().admitted.push(Admission {
                group,
                key: job.key.clone(),
                // A metered body draws on the first level alone.
                tenant: None,
                sent,
                at: clock.now(),
                used,
                charged: used,
            });
            let took = clock.now() - sent;
            if took > within {
                log.lock().unwrap().late.push(format!(
                    "{}'s metered frame answered after {took:?}",
                    job.key
                ));
            }
        }
    };
    match cancel {
        Some(after) => {
            let _ = tokio::time::timeout(after, read).await;
        }
        None => read.await,
    }
}

/// One use through `reserve` (`reserve_keys` with a tenant): awaited, or with `park_for`,
/// polled once and kept unpolled that long before it is dropped (holding its queue's turn
/// meanwhile, if it took it).
#[allow(clippy::too_many_arguments)]
async fn reserve_one(
    layer: Host,
    job: Job,
    tenant: Option<String>,
    group: usize,
    max: Duration,
    park_for: Option<Duration>,
    within: Duration,
    log: Arc<Mutex<Log>>,
    clock: TokioClock,
) {
    let sent = clock.now();
    let admitted = |log: &Arc<Mutex<Log>>| {
        log.lock().unwrap().admitted.push(Admission {
            group,
            key: job.key.clone(),
            tenant: tenant.clone(),
            sent,
            at: clock.now(),
            used: job.cost,
            charged: job.cost,
        });
    };
    let reserved = match tenant.clone() {
        Some(tenant) => {
            let keys = keys_of(&layer, job.key.clone(), Some(tenant));
            layer.reserve_keys(keys, job.cost, max).await
        }
        None => layer.reserve(job.key.clone(), job.cost, max).await,
    };
    let Ok(mut reservation) = reserved else {
        return;
    };
    let answered = match park_for {
        None => reservation.await.is_ok(),
        Some(park) => match poll_once(&mut reservation) {
            Some(decided) => decided,
            None => {
                tokio::time::sleep(park).await;
                return;
            }
        },
    };
    if answered {
        admitted(&log);
    }
    let took = clock.now() - sent;
    if took > within {
        log.lock()
            .unwrap()
            .late
            .push(format!("{}'s reservation answered after {took:?}", job.key));
    }
}

/// Polls `reservation` once: whether it was admitted, if it is decided.
fn poll_once(reservation: &mut hierarchical_throttle::Reservation<String>) -> Option<bool> {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match std::pin::Pin::new(reservation).poll(&mut cx) {
        std::task::Poll::Ready(decided) => Some(decided.is_ok()),
        std::task::Poll::Pending => None,
    }
}

/// Shadow mode: nothing is refused.
/// Requests without a key: each counted once, and served or refused as the policy says
/// (served in shadow mode, which refuses nothing).
/// Every admitted response the service answered is told the state of its limits when the
/// answers write it and the fields are on, and none otherwise.
fn check_annotated(s: &Scenario, log: &Log) -> Result<(), String> {
    let admitted = log.answered_admitted;
    let expected = match s.annotate && s.fields {
        true => admitted,
        false => 0,
    };
    match log.annotated == expected {
        true => Ok(()),
        false => Err(format!(
            "{} of {admitted} admitted and answered responses told the state of their limits, where {expected} \
             should (answers annotate: {}, fields on: {})",
            log.annotated, s.annotate, s.fields
        )),
    }
}

fn check_keyless(
    s: &Scenario,
    log: &Log,
    stats: &[hierarchical_throttle::ThrottleStats],
) -> Result<(), String> {
    let counted: u64 = stats.iter().map(|st| st.missing_key).sum();
    let admits = matches!(s.keyless, Some((_, true))) || s.shadow;
    let (served, refused) = match admits {
        true => (log.keyless_sent, 0),
        false => (0, log.keyless_sent),
    };
    if (counted, log.keyless_served, log.keyless_refused) != (log.keyless_sent, served, refused) {
        return Err(format!(
            "{} requests sent without a key ({:?}): {counted} counted, {} served, {} refused",
            log.keyless_sent, s.keyless, log.keyless_served, log.keyless_refused
        ));
    }
    Ok(())
}

fn check_shadow(
    log: &Log,
    stats: &[hierarchical_throttle::ThrottleStats],
) -> Result<String, String> {
    if log.refused > 0 {
        return Err(format!("shadow mode refused {} requests", log.refused));
    }
    let shadowed: u64 = stats.iter().map(|st| st.shadow_admitted).sum();
    Ok(format!(
        "{} admitted, {shadowed} in shadow",
        log.admitted.len()
    ))
}

/// One request of the run.
#[derive(Debug)]
struct Arrival {
    at: Duration,
    host: usize,
    key: String,
    cost: u64,
    cancel_after: Option<Duration>,
}

fn traffic(s: &Scenario, rng: &mut Rng) -> Vec<Arrival> {
    let mut out = Vec::new();
    let duration = s.duration.as_micros() as u64;
    let cancel = |rng: &mut Rng| {
        (s.cancel_one_in > 0 && rng.below(s.cancel_one_in) == 0).then_some(s.cancel_after)
    };
    for (i, spec) in s.keys.iter().enumerate() {
        // Requests per second over the fleet, spread evenly in expectation over the hosts.
        let per_sec = spec.limit.refill_amount() as f64 * 1e6
            / spec.limit.refill_period().as_micros() as f64
            * spec.load_tenths as f64
            / 10.0;
        let per_sec = per_sec.max(spec.limit.capacity() as f64 / s.duration.as_secs_f64());
        let mean_gap = (1e6 / per_sec).max(1.0);
        let mut t = 0f64;
        let quiet = s.herd_at.saturating_sub(s.quiet)..s.herd_at;
        loop {
            t += rng.exponential(mean_gap);
            if t as u64 >= duration {
                break;
            }
            if quiet.contains(&Duration::from_micros(t as u64)) {
                continue;
            }
            out.push(Arrival {
                at: Duration::from_micros(t as u64),
                host: rng.below(s.hosts as u64) as usize,
                key: format!("hot-{i}"),
                cost: rng.range(1, s.costs_up_to),
                cancel_after: cancel(rng),
            });
        }
    }
    for _ in 0..s.herd {
        out.push(Arrival {
            at: s.herd_at,
            host: 0,
            key: "hot-0".to_owned(),
            cost: 1,
            cancel_after: cancel(rng),
        });
    }
    for i in 0..s.spray {
        out.push(Arrival {
            at: Duration::from_micros(rng.below(duration)),
            host: rng.below(s.hosts as u64) as usize,
            key: format!("spray-{i}"),
            cost: 1,
            cancel_after: None,
        });
    }
    out
}

/// Property 1: for every bucket and every `t`, the tokens used in `[0, t]` stay within its
/// allowance: capacity + rate x t, with a new allowance from every store restart on; a limit
/// changed at run time counts from the change with its new capacity and rate (a fresh
/// allowance: the store may carry the bucket over); after a change, a key's limits also allow
/// the tokens its hosts held or had asked for at the change (`grace`): a limit added is not
/// drawn on before each host's next batch reads the new quota.
///
/// When responses settle costs, a request that used more than it was charged takes the rest
/// into debt, which later requests pay: the tokens used by `t` stay within the allowance plus
/// what was used beyond the charges by `t` (the most the debt can hold). Tokens the failure
/// policy admitted without a lease (`unleased`, over the whole fleet) are allowed on top, and so
/// is what each host may owe a bucket for credit (`hosts x credit`, by the largest limit the
/// bucket had).
fn check_allowance(
    s: &Scenario,
    group: usize,
    (histories, tenant_histories): (&HashMap<String, History>, &HashMap<String, History>),
    admitted: &[&Admission],
    global: &FaultyGlobal,
    unleased: u64,
    (grace, tenant_grace): (u64, u64),
) -> Result<(), String> {
    let restarts = global.restarts_at();
    // Each key's admissions, and each tenant's (unless its level is in shadow).
    let mut per_key: HashMap<(Option<&str>, &str), Vec<&Admission>> = HashMap::new();
    for a in admitted {
        per_key.entry((None, &a.key)).or_default().push(a);
        if let Some(tenant) = a.tenant.as_deref().filter(|_| !s.tenants_shadowed()) {
            per_key.entry((Some(TENANT), tenant)).or_default().push(a);
        }
    }
    for ((level, key), events) in per_key {
        let (history, grace) = match level {
            Some(_) => (&tenant_histories[key], tenant_grace),
            None => (&histories[key], grace),
        };
        let mut names: Vec<&str> = history
            .iter()
            .flat_map(|(_, q)| q.iter().map(|(n, _)| n))
            .collect();
        names.sort_unstable();
        names.dedup();
        for name in names {
            if s.shadow_slow && level.is_none() && name == "slow" {
                // In shadow: held to nothing.
                continue;
            }
            let bucket = bucket_key(LAYERS[group], level, key.to_owned(), name);
            let grace = if history.len() > 1 { grace } else { 0 };
            let credit = history
                .iter()
                .filter_map(|(_, q)| q.get(name))
                .map(|limit| s.cold_start.credit(limit))
                .max()
                .unwrap_or(0);
            let credit = u128::from(credit) * s.hosts as u128;
            let mut total = 0u128;
            let mut beyond_charges = 0u128;
            let mut windows: HashMap<Duration, (u128, u128)> = HashMap::new();
            for a in &events {
                let Some(limit) = limit_at(history, name, a.at) else {
                    continue;
                };
                total += u128::from(a.used);
                beyond_charges += u128::from(a.used.saturating_sub(a.charged));
                let calendar = limit.calendar().filter(|_| history.len() == 1);
                let reset = calendar.map(|c| c.next_reset(s.unix_origin + a.at));
                // One sent in an earlier window may have been decided there (its batch was
                // answered before the reset, delivered after): only the cumulative bound holds it.
                let straddles = calendar
                    .zip(reset)
                    .is_some_and(|(c, reset)| c.next_reset(s.unix_origin + a.sent) < reset);
                if let Some(reset) = reset.filter(|_| !straddles) {
                    // A calendar quota's window holds its own allowance: nothing carries over.
                    let (used, beyond) = windows.entry(reset).or_default();
                    *used += u128::from(a.used);
                    *beyond += u128::from(a.used.saturating_sub(a.charged));
                    let restarted = restarts.iter().filter(|&&r| r <= a.at).count() as u128;
                    let allowed = u128::from(limit.capacity()) * (1 + restarted)
                        + u128::from(global.forgiven(&bucket))
                        + *beyond
                        + u128::from(unleased)
                        + credit;
                    if *used > allowed {
                        return Err(format!(
                            "over-admission in a calendar window: {bucket} admitted {used} by \
                             {:?} in the window ending {reset:?}, allowed {allowed}",
                            a.at
                        ));
                    }
                }
                let allowed = allowance_over(history, name, a.at, &restarts, s.unix_origin)
                    + u128::from(global.forgiven(&bucket))
                    + beyond_charges
                    + u128::from(unleased)
                    + u128::from(grace)
                    + credit;
                if total > allowed {
                    return Err(format!(
                        "over-admission: {bucket} admitted {total} by {:?}, allowed {allowed} \
                         (history {history:?}, hosts {}, restarts {restarts:?})",
                        a.at, s.hosts
                    ));
                }
            }
        }
    }
    Ok(())
}

/// The limit called `name` in the quota that held at `t`.
fn limit_at(history: &History, name: &str, t: Duration) -> Option<Limit> {
    let (_, quota) = history.iter().rev().find(|(from, _)| *from <= t)?;
    quota.get(name).copied()
}

/// The allowance of the bucket called `name` by `t`: for each stretch of the history in which
/// it had one limit, that limit's capacity and what it refills over the stretch (plus a token
/// for each stretch after the first: each one's refill is rounded down on its own).
fn allowance_over(
    history: &History,
    name: &str,
    t: Duration,
    restarts: &[Duration],
    origin: Duration,
) -> u128 {
    let mut sum = 0u128;
    let mut stretches = 0u128;
    for (i, (from, quota)) in history.iter().enumerate() {
        if *from > t {
            break;
        }
        let until = history.get(i + 1).map_or(t, |(next, _)| (*next).min(t));
        if let Some(limit) = quota.get(name) {
            let restarts: Vec<Duration> = restarts
                .iter()
                .filter(|&&r| r > *from && r <= until)
                .map(|&r| r - *from)
                .collect();
            sum += allowance(limit, origin + *from, until - *from, &restarts);
            stretches += 1;
        }
    }
    sum + stretches.saturating_sub(1)
}

/// A hot key's quota: its limit, and with `two_limits` a second one, four times slower with
/// twice the burst.
fn quota_of(limit: Limit, two_limits: bool) -> Quota {
    let first = Quota::new("default", limit).expect("a valid quota");
    if !two_limits {
        return first;
    }
    let slow = Limit::per(limit.refill_amount(), limit.refill_period() * 4)
        .burst(limit.capacity() * 2)
        .expect("a valid limit");
    first.and("slow", slow).expect("a valid quota")
}

/// The global buckets of `key` under `quota`, at `level` (`None`: the first).
fn buckets(
    group: usize,
    level: Option<&str>,
    key: &str,
    quota: &Quota,
) -> Vec<(BucketKey<String>, Limit)> {
    quota
        .iter()
        .map(|(name, limit)| {
            let bucket = bucket_key(LAYERS[group], level, key.to_owned(), name);
            (bucket, *limit)
        })
        .collect()
}

/// The identity of the bucket of limit `limit` of `key`, in `layer` at `level`.
fn bucket_key(layer: &str, level: Option<&str>, key: String, limit: &str) -> BucketKey<String> {
    let bucket = BucketKey::new(key, limit).and_then(|b| b.in_layer(layer));
    match level {
        Some(level) => bucket.and_then(|b| b.at_level(level)),
        None => bucket,
    }
    .expect("a valid name")
}

/// capacity + rate x t, plus a fresh bucket from each restart before `t`.
fn allowance(limit: &Limit, start: Duration, t: Duration, restarts: &[Duration]) -> u128 {
    let refilled = match limit.calendar() {
        // A capacity at each reset.
        Some(calendar) => {
            let mut resets = 0u128;
            let mut reset = calendar.next_reset(start);
            while reset <= start + t {
                resets += 1;
                reset = calendar.next_reset(reset);
            }
            resets * u128::from(limit.capacity())
        }
        None => {
            t.as_micros() * u128::from(limit.refill_amount()) / limit.refill_period().as_micros()
        }
    };
    let buckets = 1 + restarts.iter().filter(|&&r| r <= t).count() as u128;
    buckets * u128::from(limit.capacity()) + refilled
}

/// Property 3: dispensed + uncharged + admitted by the failure policy = used + handed back +
/// held + lost + forfeited.
fn check_conservation<'a>(
    layers: impl Iterator<Item = &'a Host> + Clone,
    quotas: &[HashMap<String, Quota>],
    tenant_quotas: &[HashMap<String, Quota>],
    admitted: &[Admission],
    global: &FaultyGlobal,
) -> Result<(), String> {
    // A request uses its tokens in each of its key's buckets, and of its tenant's.
    let used: u128 = admitted
        .iter()
        .map(|a| {
            let tenant = a
                .tenant
                .as_ref()
                .map_or(0, |t| tenant_quotas[a.group][t].len());
            u128::from(a.used) * (quotas[a.group][&a.key].len() + tenant) as u128
        })
        .sum();
    let stats: Vec<_> = layers.clone().map(|l| l.stats()).collect();
    let sum = |f: fn(&hierarchical_throttle::ThrottleStats) -> u64| -> u128 {
        stats.iter().map(|st| u128::from(f(st))).sum()
    };
    // Tokens used beyond a lease that the store did not take are used but never dispensed; so
    // are those the failure policy admitted without a lease.
    let uncharged = sum(|st| st.tokens_uncharged);
    let unleased = sum(|st| st.tokens_unleased);
    let forfeited = sum(|st| st.tokens_forfeited);
    let mut held = 0u128;
    for layer in layers {
        layer
            .local_store()
            .for_each_bucket(|_, b| held += u128::from(b.leased_tokens()));
    }
    let ledger = global.ledger();
    let (dispensed, returned, lost) = (
        u128::from(ledger.dispensed),
        u128::from(ledger.returned),
        u128::from(ledger.lost),
    );
    if dispensed + uncharged + unleased != used + returned + held + lost + forfeited {
        return Err(format!(
            "tokens not conserved: dispensed {dispensed} + uncharged {uncharged} + unleased \
             {unleased} != used {used} + returned {returned} + held {held} + lost {lost} + \
             forfeited {forfeited}"
        ));
    }
    Ok(())
}

/// Leases unused past their time-to-live go back: a host keeps at most a sixteenth of a
/// bucket's capacity (at least one token) of a key far from its limit, so what hosts keep
/// strands at most that per host (tokens reserved ahead are used once due).
fn check_stranded<'a>(
    layers: impl Iterator<Item = (usize, &'a Host)>,
    hosts: usize,
    quotas: &[Quotas],
    tenant_quotas: &[Quotas],
) -> Result<(), String> {
    for (n, layer) in layers {
        let quotas = quotas[n / hosts].lock().unwrap().clone();
        let tenant_quotas = tenant_quotas[n / hosts].lock().unwrap().clone();
        let mut stranded = None;
        layer.local_store().for_each_bucket(|id, b| {
            let quota = match id.level() {
                0 => &quotas[id.key()],
                _ => &tenant_quotas[id.key()],
            };
            let keep = quota
                .iter()
                .map(|(_, limit)| (limit.capacity() / 16).max(1))
                .max()
                .unwrap_or(1);
            // Tokens reserved ahead stay until due (behind a debt, that can be long).
            if b.usable_tokens() > keep {
                stranded = Some(format!(
                    "{} holds {} unused tokens past the lease time-to-live (keeps {keep} at most; \
                     layer {n})",
                    id.key(),
                    b.usable_tokens()
                ));
            }
        });
        if let Some(stranded) = stranded {
            return Err(stranded);
        }
    }
    Ok(())
}

/// Property 2: with faults gone, once other hosts' leases have expired and been handed back
/// and the bucket has refilled, every hot key serves on every host of layer group `group`.
async fn check_liveness(
    s: &Scenario,
    group: usize,
    layers: &[Vec<Host>],
    hosts: &[impl tower::Service<Job, Response = Outcome, Error = Infallible, Future: Send>
      + Clone
      + Send
      + 'static],
    (quotas, tenant_quotas): &(HashMap<String, Quota>, HashMap<String, Quota>),
    global: &FaultyGlobal,
    clock: TokioClock,
) -> Result<(), String> {
    for (i, _) in s.keys.iter().enumerate() {
        let key = format!("hot-{i}");
        let tenant = s.tenant_of(&key);
        let mut buckets = buckets(group, None, &key, &quotas[&key]);
        if let Some(tenant) = &tenant {
            let quota = &tenant_quotas[tenant];
            buckets.extend(self::buckets(group, Some(TENANT), tenant, quota));
        }
        if buckets.iter().any(|(_, limit)| limit.calendar().is_some()) {
            // A calendar quota spent in its window serves again only at the next reset, a day
            // away: its exactness and its windows' bounds are what the oracle holds it to.
            continue;
        }
        // Whatever a host's cache says was due before a full refill (a restarted store cannot
        // tell the hosts it has forgotten what they owe).
        let full = buckets
            .iter()
            .map(|(_, limit)| limit.time_to_accrue(limit.capacity()))
            .max()
            .unwrap_or_default();
        tokio::time::sleep(full + s.max_reservation).await;
        for (h, host) in hosts.iter().enumerate() {
            // The other hosts' leases expire and go back, and the calls a host's request may
            // have left lingering (the fetch that pays a credit it was served on) land; then
            // the bucket refills a token.
            let lingering = s.global_batch_linger + s.store_timeout;
            tokio::time::sleep(s.max_reservation + s.lease_ttl + lingering).await;
            for layer in layers.iter().flatten() {
                layer.return_unused_leases().await;
            }
            let refill = buckets
                .iter()
                .map(|(bucket, limit)| global.peek(bucket, limit).micros_until(limit, 1))
                .max()
                .unwrap_or(0);
            tokio::time::sleep(Duration::from_micros(refill)).await;
            // And until this host's own knowledge lets it ask: a debt that hand-backs paid off
            // at the store is still due in its throttled-key cache (it cannot know).
            let layer = &layers[group][h];
            let keys = keys_of(layer, key.clone(), tenant.clone());
            let known_due = || {
                layer
                    .remaining_keys(&keys)
                    .iter()
                    .filter(|r| r.tokens == 0)
                    .map(|r| r.next_in)
                    .max()
                    .unwrap_or_default()
            };
            tokio::time::sleep(known_due()).await;
            let ask = || {
                let job = Job {
                    key: key.clone(),
                    cost: 1,
                    actual: 1,
                    sent: clock.now(),
                    exempt: false,
                    keyless: false,
                };
                tokio::time::timeout(s.store_timeout * 4, host.clone().oneshot(job))
            };
            let forfeited = || layer.stats().tokens_forfeited;
            let forfeited_before = forfeited();
            let mut answer = ask().await;
            // What an earlier fetch of this host could not take back (other hosts had spent the
            // refill first) is owed, and its next fetch pays it, however late: the grant it
            // takes is refused once.
            let paid_owed = forfeited() > forfeited_before;
            if let Ok(Ok(Outcome::Refused(RejectionReason::Throttled))) = answer
                && (s.change.is_some() || s.tenant_change.is_some() || paid_owed)
            {
                // A store learns of a changed limit at the first call under it, and may count
                // the time before at the old limit's rate (the memory store does; Redis counts
                // it at the new one): the refill the peek above foresaw at the new rate can
                // come later. The refusal tells when the next token is due, exactly: then the
                // key serves.
                tokio::time::sleep(known_due()).await;
                answer = ask().await;
            }
            if !matches!(answer, Ok(Ok(Outcome::Served | Outcome::Used(_)))) {
                return Err(format!(
                    "{key} of layer {} on host {h} does not serve after the faults: {answer:?}",
                    LAYERS[group]
                ));
            }
        }
    }
    Ok(())
}

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
//!    host cannot know of), and without injected faults the failure policy decides nothing.
#![allow(dead_code)]

pub mod faults;
pub mod rng;

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hierarchical_throttle::clock::{Clock, TokioClock};
use hierarchical_throttle::local::LocalStore;
use hierarchical_throttle::quota::BucketKey;
use hierarchical_throttle::{
    FailurePolicy, HierarchicalThrottleLayer, Limit, MemoryLocalStore, OnRejection, Quota,
    Rejection, RejectionReason, Shaping,
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
    TokioClock,
    Recorder,
>;

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
}

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
        }
    }
}

/// What the hosts answered and when, for the oracle.
#[derive(Debug, Default)]
pub struct Log {
    /// (key, time, tokens used, tokens charged) of every admitted request, in order.
    pub admitted: Vec<(String, Duration, u64, u64)>,
    /// Refusals that break exactness (see the module's docs), described.
    pub inexact: Vec<String>,
    pub refused: u64,
    pub store_unavailable: u64,
}

/// The hosts' `OnRejection`: records the refusal, and checks on the spot that a throttled
/// request could not have been served by the global bucket.
#[derive(Clone)]
pub struct Recorder {
    log: Arc<Mutex<Log>>,
    global: FaultyGlobal,
    clock: TokioClock,
    /// How long a refusal's basis may be older than a reappearance of tokens.
    slack: Duration,
    /// How long a request may wait for batches before a refusal loses exactness.
    patience: Duration,
    /// Responses settle costs (`Outcome::Used`).
    settle: bool,
}

impl OnRejection<Job, String, Outcome, Infallible> for Recorder {
    fn on_rejection(&self, job: &Job, rejection: Rejection<String>) -> Result<Outcome, Infallible> {
        let mut log = self.log.lock().unwrap();
        log.refused += 1;
        let now = self.clock.now();
        match rejection.reason {
            RejectionReason::StoreUnavailable => log.store_unavailable += 1,
            // A request that waited out its time while the store answered is refused without
            // that exactness (see `store_timeout`).
            // The refusal names its limit: that bucket must have been short.
            RejectionReason::Throttled if now < job.sent + self.patience => {
                let (Some(limit), Some(name)) = (rejection.limit, rejection.limit_name) else {
                    log.inexact
                        .push(format!("{} refused naming no limit", job.key));
                    return Ok(Outcome::Refused(rejection.reason));
                };
                let bucket = BucketKey::new(job.key.clone(), name).expect("a valid name");
                let there = self.global.peek(&bucket, &limit).tokens();
                let reappeared = self
                    .global
                    .tokens_reappeared_since(&bucket, now, self.slack);
                if there >= job.cost && !reappeared {
                    log.inexact.push(format!(
                        "{bucket} refused at {now:?} (cost {}) while the global bucket held \
                         {there}",
                        job.cost
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
}

/// The result of one seed: `Err` says which property broke.
pub fn run(seed: u64) -> Result<String, String> {
    run_scenario(Scenario::draw(seed))
}

/// Runs `scenario` (a drawn one, maybe changed to narrow a failure down).
pub fn run_scenario(scenario: Scenario) -> Result<String, String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("runtime");
    runtime.block_on(simulate(scenario))
}

async fn simulate(s: Scenario) -> Result<String, String> {
    let clock = TokioClock::new();
    let global = FaultyGlobal::new(clock, s.faults.clone(), s.seed);
    let mut quotas: HashMap<String, Quota> = s
        .keys
        .iter()
        .enumerate()
        .map(|(i, k)| (format!("hot-{i}"), quota_of(k.limit, s.two_limits)))
        .collect();
    let spray_limit = Limit::per_second(5).burst(5).expect("valid limit");
    for i in 0..s.spray {
        quotas.insert(format!("spray-{i}"), Quota::from(spray_limit));
    }
    let quotas = Arc::new(quotas);
    let buckets: Vec<(BucketKey<String>, Limit)> =
        quotas.iter().flat_map(|(k, q)| buckets(k, q)).collect();
    let log = Arc::new(Mutex::new(Log::default()));
    let recorder = Recorder {
        log: log.clone(),
        global: global.clone(),
        clock,
        slack: s.lease_ttl + s.store_timeout * 2 + s.max_reservation + Duration::from_secs(121),
        patience: s.store_timeout,
        settle: s.settle,
    };
    let layers: Vec<Host> = (0..s.hosts)
        .map(|host| {
            let quotas = quotas.clone();
            // Half the hosts borrow the key, half make it: the two ways must decide alike.
            let builder = if host % 2 == 0 {
                HierarchicalThrottleLayer::builder().key_ref(|job: &Job| Some(job.key.as_str()))
            } else {
                HierarchicalThrottleLayer::builder().key(|job: &Job| Some(job.key.clone()))
            };
            builder
                .cost(|job: &Job| job.cost)
                .limit_per_key(move |key: &String| quotas[key].clone())
                .clock(clock)
                .store_timeout(s.store_timeout)
                .lease_ttl(s.lease_ttl)
                .demand_window(10, s.demand_interval)
                .max_reservation(s.max_reservation)
                .shaping(s.shaping)
                .failure_policy(if s.faulty {
                    FailurePolicy::Reject
                } else {
                    FailurePolicy::default()
                })
                .on_rejection(recorder.clone())
                .global_store(global.clone())
                .local_store(MemoryLocalStore::with_max_keys(s.local_max_keys).expect("bound"))
                .build()
                .expect("valid configuration")
        })
        .collect();
    let hosts: Vec<_> = layers
        .iter()
        .map(|layer| {
            let log = log.clone();
            let settle = s.settle;
            layer.layer(service_fn(move |job: Job| {
                let log = log.clone();
                async move {
                    let now = clock.now();
                    let used = if settle { job.actual } else { job.cost };
                    log.lock()
                        .unwrap()
                        .admitted
                        .push((job.key, now, used, job.cost));
                    Ok::<_, Infallible>(match settle {
                        true => Outcome::Used(used),
                        false => Outcome::Served,
                    })
                }
            }))
        })
        .collect();

    let mut rng = Rng::new(s.seed ^ 0x5eed);
    let mut arrivals = traffic(&s, &mut rng);
    arrivals.sort_by_key(|a| a.at);
    let mut tasks = tokio::task::JoinSet::new();
    let start = tokio::time::Instant::now();
    let mut restarts = s.faults.restarts.iter().copied().peekable();
    for (n, arrival) in (0u64..).zip(arrivals) {
        tokio::time::sleep_until(start + arrival.at).await;
        while restarts.next_if(|&r| r <= arrival.at).is_some() {
            global.restart(buckets.iter().map(|(b, l)| (b, l)));
        }
        let service = hosts[arrival.host].clone();
        let job = Job {
            key: arrival.key,
            // Spread over 0 to twice the cost without drawing from the traffic's generator.
            actual: (n.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) % (2 * arrival.cost + 1),
            cost: arrival.cost,
            sent: clock.now(),
        };
        let cancel = arrival.cancel_after;
        tasks.spawn(async move {
            let call = service.oneshot(job);
            match cancel {
                Some(after) => {
                    let _ = tokio::time::timeout(after, call).await;
                }
                None => {
                    let _ = call.await;
                }
            }
        });
    }
    while tasks.join_next().await.is_some() {}

    // Quiesce: faults stop; the store's back-off and every lease expire; all is handed back.
    global.heal();
    let quiet = s.lease_ttl + Duration::from_secs(2);
    tokio::time::sleep(quiet).await;
    for layer in &layers {
        layer.return_unused_leases().await;
    }
    tokio::time::sleep(s.lease_ttl + Duration::from_millis(1)).await;
    for layer in &layers {
        layer.return_unused_leases().await;
    }

    let log_now = std::mem::take(&mut *log.lock().unwrap());
    check_allowance(&s, &quotas, &log_now.admitted, &global)?;
    if let Some(first) = log_now.inexact.first() {
        return Err(format!(
            "inexact refusal ({} in all): {first}",
            log_now.inexact.len()
        ));
    }
    let stats: Vec<_> = layers.iter().map(|l| l.stats()).collect();
    if !s.faulty {
        let fallback: u64 = stats.iter().map(|st| st.fallback_decisions).sum();
        if fallback > 0 || log_now.store_unavailable > 0 {
            return Err(format!(
                "the failure policy decided {fallback} requests though the store never failed"
            ));
        }
    }
    check_conservation(&layers, &quotas, &log_now.admitted, &global)?;
    check_liveness(&s, &layers, &hosts, &quotas, &global, clock).await?;
    Ok(format!(
        "{} admitted, {} refused, {} global calls",
        log_now.admitted.len(),
        log_now.refused,
        stats.iter().map(|st| st.global_calls).sum::<u64>()
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
        loop {
            t += rng.exponential(mean_gap);
            if t as u64 >= duration {
                break;
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

/// Property 1: for every key and every `t`, admitted in `[0, t]` <= capacity + rate x t, with a
/// new allowance from every store restart on.
///
/// When responses settle costs, a request that used more than it was charged takes the rest
/// into debt, which later requests pay: the tokens used by `t` stay within the allowance plus
/// what was used beyond the charges by `t` (the most the debt can hold).
fn check_allowance(
    s: &Scenario,
    quotas: &HashMap<String, Quota>,
    admitted: &[(String, Duration, u64, u64)],
    global: &FaultyGlobal,
) -> Result<(), String> {
    let restarts = global.restarts_at();
    let mut per_key: HashMap<&str, Vec<(Duration, u64, u64)>> = HashMap::new();
    for (key, at, used, charged) in admitted {
        per_key.entry(key).or_default().push((*at, *used, *charged));
    }
    for (key, events) in per_key {
        // Every bucket the key draws on holds on its own.
        for (bucket, limit) in buckets(key, &quotas[key]) {
            let mut total = 0u64;
            let mut beyond_charges = 0u64;
            for &(at, used, charged) in &events {
                total += used;
                beyond_charges += used.saturating_sub(charged);
                let allowed = allowance(&limit, at, &restarts)
                    + u128::from(global.forgiven(&bucket))
                    + u128::from(beyond_charges);
                if u128::from(total) > allowed {
                    return Err(format!(
                        "over-admission: {bucket} admitted {total} by {at:?}, allowed {allowed} \
                         (limit {limit:?}, hosts {}, restarts {restarts:?})",
                        s.hosts
                    ));
                }
            }
        }
    }
    Ok(())
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

/// The global buckets of `key` under `quota`.
fn buckets(key: &str, quota: &Quota) -> Vec<(BucketKey<String>, Limit)> {
    quota
        .iter()
        .map(|(name, limit)| {
            let bucket = BucketKey::new(key.to_owned(), name).expect("a valid name");
            (bucket, *limit)
        })
        .collect()
}

/// capacity + rate x t, plus a fresh bucket from each restart before `t`.
fn allowance(limit: &Limit, t: Duration, restarts: &[Duration]) -> u128 {
    let refilled =
        t.as_micros() * u128::from(limit.refill_amount()) / limit.refill_period().as_micros();
    let buckets = 1 + restarts.iter().filter(|&&r| r <= t).count() as u128;
    buckets * u128::from(limit.capacity()) + refilled
}

/// Property 3: dispensed + uncharged = used + handed back + held + lost.
fn check_conservation(
    layers: &[Host],
    quotas: &HashMap<String, Quota>,
    admitted: &[(String, Duration, u64, u64)],
    global: &FaultyGlobal,
) -> Result<(), String> {
    // A request uses its tokens in each of its key's buckets.
    let admitted: u64 = admitted
        .iter()
        .map(|a| a.2 * quotas[&a.0].len() as u64)
        .sum();
    // Tokens used beyond a lease that the store did not take are used but never dispensed.
    let uncharged: u64 = layers.iter().map(|l| l.stats().tokens_uncharged).sum();
    let mut held = 0u64;
    for layer in layers {
        layer
            .local_store()
            .for_each_bucket(|_, b| held += b.leased_tokens());
    }
    let ledger = global.ledger();
    let accounted = admitted + ledger.returned + held + ledger.lost;
    if ledger.dispensed + uncharged != accounted {
        return Err(format!(
            "tokens not conserved: dispensed {} + uncharged {uncharged} != used {admitted} + \
             returned {} + held {held} + lost {}",
            ledger.dispensed, ledger.returned, ledger.lost
        ));
    }
    Ok(())
}

/// Property 2: with faults gone, once other hosts' leases have expired and been handed back
/// and the bucket has refilled, every hot key serves on every host.
async fn check_liveness(
    s: &Scenario,
    layers: &[Host],
    hosts: &[impl tower::Service<Job, Response = Outcome, Error = Infallible, Future: Send>
      + Clone
      + Send
      + 'static],
    quotas: &HashMap<String, Quota>,
    global: &FaultyGlobal,
    clock: TokioClock,
) -> Result<(), String> {
    for (i, _) in s.keys.iter().enumerate() {
        let key = format!("hot-{i}");
        let buckets = buckets(&key, &quotas[&key]);
        // Whatever a host's cache says was due before a full refill (a restarted store cannot
        // tell the hosts it has forgotten what they owe).
        let full = buckets
            .iter()
            .map(|(_, limit)| limit.time_to_accrue(limit.capacity()))
            .max()
            .unwrap_or_default();
        tokio::time::sleep(full + s.max_reservation).await;
        for (h, host) in hosts.iter().enumerate() {
            // The other hosts' leases expire and go back; then the bucket refills a token.
            tokio::time::sleep(s.max_reservation + s.lease_ttl).await;
            for layer in layers {
                layer.return_unused_leases().await;
            }
            let refill = buckets
                .iter()
                .map(|(bucket, limit)| global.peek(bucket, limit).micros_until(limit, 1))
                .max()
                .unwrap_or(0);
            tokio::time::sleep(Duration::from_micros(refill)).await;
            let job = Job {
                key: key.clone(),
                cost: 1,
                actual: 1,
                sent: clock.now(),
            };
            let answer = tokio::time::timeout(s.store_timeout * 4, host.clone().oneshot(job)).await;
            if !matches!(answer, Ok(Ok(Outcome::Served | Outcome::Used(_)))) {
                return Err(format!(
                    "{key} on host {h} does not serve after the faults: {answer:?}"
                ));
            }
        }
    }
    Ok(())
}

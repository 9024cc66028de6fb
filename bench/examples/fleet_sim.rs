//! Run with: cargo run --release -p hierarchical-throttle-bench --example fleet_sim
//!
//! A fleet of hosts on simulated time, three ways of enforcing one per-key limit across it,
//! side by side in one run:
//!
//! - **hierarchical**: this crate, hosts sharing one `MemoryGlobalStore`, with the default
//!   `WeightedDemand` batches and with `FractionOfCapacity(0.1)`;
//! - **per-request global**: every decision asks the global bucket (what a Redis Lua token
//!   bucket per request does);
//! - **local split**: each host alone with the limit divided by the number of hosts (what
//!   `tower_governor` on each host gives), with governor's own limiter; and each host alone
//!   with the whole limit, as it is often configured.
//!
//! Keys have Zipf popularity; the hottest key is offered 0.5x, 1x, 2x and 10x its limit,
//! steadily or in bursts; hosts get uneven shares of the traffic. Requests run concurrently on
//! tokio's paused time, and the global store answers after a latency of 0, 5, 20 or 45 ms, or
//! 60 ms, past the 50 ms time-out (every call then fails: the hierarchical hosts fall back to
//! their default failure policy, the per-request limiter fails open). The program prints a
//! Markdown table and writes it, with an SVG plot of the hottest key's admitted rate over time,
//! to `docs/`.

use std::collections::HashMap;
use std::convert::Infallible;
use std::fmt::Write as _;
use std::future::Future;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use governor::clock::FakeRelativeClock;
use governor::{Quota, RateLimiter};
use hierarchical_throttle::batch::FractionOfCapacity;
use hierarchical_throttle::bucket::TokenBucket;
use hierarchical_throttle::clock::TokioClock;
use hierarchical_throttle::global::{
    Adjusted, Adjustment, BucketLevel, GlobalStore, Grant, TokenRequest, TokenReturn,
};
use hierarchical_throttle::quota::BucketKey;
use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore, Rejection};
use plotters::prelude::*;
use tower::{Layer, ServiceExt, service_fn};

const HOSTS: usize = 4;
const HOST_SHARE: [f64; HOSTS] = [0.4, 0.3, 0.2, 0.1];
const KEYS: usize = 100;
const ZIPF_S: f64 = 1.1;
const RATE: u64 = 50;
const BURST: u64 = 100;
const SECONDS: u64 = 60;
const TICK_MS: u64 = 1;
const PLOT_BIN_MS: u64 = 1000;
const STORE_TIMEOUT: Duration = Duration::from_millis(50);
const LATENCIES_MS: [u64; 5] = [0, 5, 20, 45, 60];

#[derive(Clone, Copy, PartialEq)]
enum Shape {
    Steady,
    /// 200 ms at 5x the mean rate, then 800 ms of silence.
    Bursty,
}

#[derive(Clone, Copy, PartialEq)]
enum Strategy {
    Hierarchical,
    HierarchicalFraction,
    PerRequestGlobal,
    LocalSplit,
    LocalFull,
}

const STRATEGIES: [Strategy; 5] = [
    Strategy::Hierarchical,
    Strategy::HierarchicalFraction,
    Strategy::PerRequestGlobal,
    Strategy::LocalSplit,
    Strategy::LocalFull,
];

impl Strategy {
    fn name(self) -> &'static str {
        match self {
            Strategy::Hierarchical => "hierarchical (weighted demand)",
            Strategy::HierarchicalFraction => "hierarchical (10% of capacity)",
            Strategy::PerRequestGlobal => "per-request global",
            Strategy::LocalSplit => "local split (governor, limit / 4)",
            Strategy::LocalFull => "local, full limit per host (governor)",
        }
    }
}

/// One request: when, which key, which host.
#[derive(Clone, Copy)]
struct Arrival {
    ms: u64,
    key: usize,
    host: usize,
}

/// A small deterministic PRNG (xorshift64*), so every strategy sees the same arrivals.
struct Rng(u64);

impl Rng {
    fn next_f64(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }

    fn pick(&mut self, weights: &[f64]) -> usize {
        let mut x = self.next_f64() * weights.iter().sum::<f64>();
        for (i, w) in weights.iter().enumerate() {
            if x < *w {
                return i;
            }
            x -= w;
        }
        weights.len() - 1
    }
}

/// Arrivals for `factor` times the limit on the hottest key, Zipf over keys, Poisson in time.
fn arrivals(factor: f64, shape: Shape, seed: u64) -> Vec<Arrival> {
    let mut rng = Rng(seed);
    let popularity: Vec<f64> = (1..=KEYS).map(|r| 1.0 / (r as f64).powf(ZIPF_S)).collect();
    let hottest_rate = factor * RATE as f64;
    let total_rate = hottest_rate * popularity.iter().sum::<f64>() / popularity[0];
    let mut out = Vec::new();
    for ms in (0..SECONDS * 1000).step_by(TICK_MS as usize) {
        let rate = match shape {
            Shape::Steady => total_rate,
            Shape::Bursty if ms % 1000 < 200 => total_rate * 5.0,
            Shape::Bursty => 0.0,
        };
        // Poisson arrivals within the tick, by inversion.
        let lambda = rate * TICK_MS as f64 / 1000.0;
        let (mut count, mut p, limit) = (0, 1.0, (-lambda).exp());
        loop {
            p *= rng.next_f64();
            if p <= limit {
                break;
            }
            count += 1;
        }
        for _ in 0..count {
            out.push(Arrival {
                ms,
                key: rng.pick(&popularity),
                host: rng.pick(&HOST_SHARE),
            });
        }
    }
    out
}

fn limit() -> Limit {
    Limit::per_second(RATE).burst(BURST).expect("a valid limit")
}

/// Per-strategy results.
#[derive(Default)]
struct Outcome {
    requests: u64,
    admitted_per_key: Vec<u64>,
    offered_per_key: Vec<u64>,
    wrongly_refused: u64,
    global_calls: u64,
    /// Global calls made for the hottest key.
    hottest_calls: u64,
    /// Admitted requests of the hottest key per plot bin.
    hottest_series: Vec<u64>,
}

/// Decides one arrival at `now`; the future says whether it was admitted.
trait Fleet {
    fn decide(&mut self, now: Duration, arrival: Arrival) -> BoxFuture<'static, bool>;
    /// Global calls made, in all and for the hottest key.
    fn global_calls(&self) -> (u64, u64);
}

/// The in-memory global store on tokio's clock, answering after `latency` (half each way),
/// counting acquire calls per key.
#[derive(Clone)]
struct CountingStore {
    inner: MemoryGlobalStore<usize, TokioClock>,
    calls: Arc<Vec<AtomicU64>>,
    latency: Duration,
}

impl CountingStore {
    fn new(clock: TokioClock, latency: Duration) -> Self {
        Self {
            inner: MemoryGlobalStore::with_clock(clock),
            calls: Arc::new((0..KEYS).map(|_| AtomicU64::new(0)).collect()),
            latency,
        }
    }

    fn calls(&self) -> (u64, u64) {
        let all = self.calls.iter().map(|c| c.load(Ordering::Relaxed)).sum();
        (all, self.calls[0].load(Ordering::Relaxed))
    }
}

impl GlobalStore<BucketKey<usize>> for CountingStore {
    type Error = Infallible;

    fn acquire(
        &self,
        key: &BucketKey<usize>,
        limit: &Limit,
        request: TokenRequest,
    ) -> impl Future<Output = Result<Grant, Infallible>> + Send {
        self.calls[*key.key()].fetch_add(1, Ordering::Relaxed);
        let (this, key, limit) = (self.clone(), key.clone(), *limit);
        async move {
            tokio::time::sleep(this.latency / 2).await;
            let grant = this.inner.acquire(&key, &limit, request).await;
            tokio::time::sleep(this.latency - this.latency / 2).await;
            grant
        }
    }

    fn level(
        &self,
        key: &BucketKey<usize>,
        limit: &Limit,
    ) -> impl Future<Output = Result<BucketLevel, Infallible>> + Send {
        self.inner.level(key, limit)
    }

    fn adjust(
        &self,
        key: &BucketKey<usize>,
        limit: &Limit,
        adjustment: Adjustment,
        expires: Option<Duration>,
    ) -> impl Future<Output = Result<Adjusted, Infallible>> + Send {
        self.inner.adjust(key, limit, adjustment, expires)
    }

    fn release(
        &self,
        key: &BucketKey<usize>,
        limit: &Limit,
        back: TokenReturn,
    ) -> impl Future<Output = Result<(), Infallible>> + Send {
        let (this, key, limit) = (self.clone(), key.clone(), *limit);
        async move {
            tokio::time::sleep(this.latency / 2).await;
            let released = this.inner.release(&key, &limit, back).await;
            tokio::time::sleep(this.latency - this.latency / 2).await;
            released
        }
    }

    fn maintain(&self) {
        self.inner.maintain();
    }
}

type Reject = fn(&usize, Rejection<usize>) -> Result<bool, Infallible>;
/// A host: decides a request for a key.
type Host = Box<dyn FnMut(usize) -> BoxFuture<'static, bool>>;

struct Hierarchical {
    global: CountingStore,
    hosts: Vec<Host>,
}

impl Hierarchical {
    fn new(fraction: Option<f64>, latency: Duration) -> Self {
        let clock = TokioClock::new();
        let global = CountingStore::new(clock, latency);
        let mut hosts: Vec<Host> = Vec::new();
        for _ in 0..HOSTS {
            let builder = HierarchicalThrottleLayer::builder()
                .key(|key: &usize| Some(*key))
                .clock(clock)
                .limit(limit())
                .store_timeout(STORE_TIMEOUT)
                .on_rejection((|_, _| Ok(false)) as Reject);
            let builder = match fraction {
                Some(f) => builder.batch_policy(FractionOfCapacity::new(f).expect("a fraction")),
                None => builder,
            };
            let layer = builder
                .global_store(global.clone())
                .build()
                .expect("a valid layer");
            let service = layer.layer(service_fn(|_: usize| async { Ok::<_, Infallible>(true) }));
            hosts.push(Box::new(move |key| {
                let service = service.clone();
                async move {
                    service
                        .oneshot(key)
                        .await
                        .unwrap_or_else(|never| match never {})
                }
                .boxed()
            }));
        }
        Self { global, hosts }
    }
}

impl Fleet for Hierarchical {
    fn decide(&mut self, _now: Duration, arrival: Arrival) -> BoxFuture<'static, bool> {
        (self.hosts[arrival.host])(arrival.key)
    }

    fn global_calls(&self) -> (u64, u64) {
        self.global.calls()
    }
}

/// Every decision is one call to the global bucket; a call past the time-out admits (fails
/// open), as such limiters usually do.
struct PerRequestGlobal {
    store: CountingStore,
}

impl Fleet for PerRequestGlobal {
    fn decide(&mut self, _now: Duration, arrival: Arrival) -> BoxFuture<'static, bool> {
        let store = self.store.clone();
        async move {
            let limit = limit();
            let Ok(key) = BucketKey::new(arrival.key, "default") else {
                return false;
            };
            let call = store.acquire(&key, &limit, TokenRequest::now(1, 1));
            match tokio::time::timeout(STORE_TIMEOUT, call).await {
                Ok(grant) => grant.is_ok_and(|g| g.granted == 1),
                Err(_) => true,
            }
        }
        .boxed()
    }

    fn global_calls(&self) -> (u64, u64) {
        self.store.calls()
    }
}

struct LocalSplit {
    clock: FakeRelativeClock,
    now: Duration,
    limiters: Vec<
        RateLimiter<
            usize,
            governor::state::keyed::DefaultKeyedStateStore<usize>,
            FakeRelativeClock,
            governor::middleware::NoOpMiddleware<governor::nanos::Nanos>,
        >,
    >,
}

impl LocalSplit {
    /// Each host alone with the limit divided by `parts`.
    fn new(parts: usize) -> Self {
        let clock = FakeRelativeClock::default();
        let per_host_period = Duration::from_secs(1) * parts as u32 / RATE as u32;
        let burst = NonZeroU32::new((BURST as usize / parts) as u32).expect("a burst");
        let quota = Quota::with_period(per_host_period)
            .expect("a period")
            .allow_burst(burst);
        let limiters = (0..HOSTS)
            .map(|_| RateLimiter::dashmap_with_clock(quota, clock.clone()))
            .collect();
        Self {
            clock,
            now: Duration::ZERO,
            limiters,
        }
    }
}

impl Fleet for LocalSplit {
    fn decide(&mut self, now: Duration, arrival: Arrival) -> BoxFuture<'static, bool> {
        self.clock.advance(now - self.now);
        self.now = now;
        let admitted = self.limiters[arrival.host].check_key(&arrival.key).is_ok();
        std::future::ready(admitted).boxed()
    }

    fn global_calls(&self) -> (u64, u64) {
        (0, 0)
    }
}

/// Runs the arrivals through `fleet` on tokio's paused time, each request in a task of its own.
async fn simulate<F: Fleet>(fleet: &mut F, arrivals: &[Arrival]) -> Outcome {
    let limit = limit();
    let out = Arc::new(std::sync::Mutex::new(Outcome {
        admitted_per_key: vec![0; KEYS],
        offered_per_key: vec![0; KEYS],
        hottest_series: vec![0; (SECONDS * 1000 / PLOT_BIN_MS) as usize],
        ..Outcome::default()
    }));
    // The oracle: one exact bucket per key deciding every request as it arrives, as a perfect
    // global limiter would. A request it admits was within the key's limit; refusing it is
    // refusing a customer who was not over its limit.
    let mut oracle: HashMap<usize, TokenBucket> = HashMap::new();
    let start = tokio::time::Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for a in arrivals {
        let now = Duration::from_millis(a.ms);
        tokio::time::sleep_until(start + now).await;
        let micros = now.as_micros() as u64;
        let bucket = oracle
            .entry(a.key)
            .or_insert_with(|| TokenBucket::full(&limit, micros));
        let within_limit = bucket.take(&limit, micros, 1, 1).granted == 1;
        let decision = fleet.decide(now, *a);
        let (out, a) = (out.clone(), *a);
        tasks.spawn(async move {
            let admitted = decision.await;
            let mut out = out.lock().unwrap_or_else(|e| e.into_inner());
            out.requests += 1;
            out.offered_per_key[a.key] += 1;
            if admitted {
                out.admitted_per_key[a.key] += 1;
                if a.key == 0 {
                    out.hottest_series[(a.ms / PLOT_BIN_MS) as usize] += 1;
                }
            } else if within_limit {
                out.wrongly_refused += 1;
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    let mut out = std::mem::take(&mut *out.lock().unwrap_or_else(|e| e.into_inner()));
    (out.global_calls, out.hottest_calls) = fleet.global_calls();
    out
}

struct Row {
    scenario: String,
    strategy: Strategy,
    admitted_share: f64,
    over_admitted: u64,
    wrongly_refused_share: f64,
    calls_per_1000: f64,
    hottest_calls_per_1000: f64,
}

fn summarize(scenario: &str, strategy: Strategy, out: &Outcome) -> Row {
    let bound = BURST + RATE * SECONDS;
    let allowed: u64 = out.offered_per_key.iter().map(|&o| o.min(bound)).sum();
    let admitted: u64 = out.admitted_per_key.iter().sum();
    let over: u64 = out
        .admitted_per_key
        .iter()
        .map(|&a| a.saturating_sub(bound))
        .sum();
    Row {
        scenario: scenario.to_owned(),
        strategy,
        admitted_share: admitted as f64 / allowed as f64,
        over_admitted: over,
        wrongly_refused_share: out.wrongly_refused as f64 / out.requests as f64,
        calls_per_1000: 1000.0 * out.global_calls as f64 / out.requests as f64,
        hottest_calls_per_1000: 1000.0 * out.hottest_calls as f64 / out.offered_per_key[0] as f64,
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut rows = Vec::new();
    let mut plot: Vec<(Strategy, Vec<u64>)> = Vec::new();
    for shape in [Shape::Steady, Shape::Bursty] {
        for factor in [0.5, 1.0, 2.0, 10.0] {
            for latency_ms in LATENCIES_MS {
                // Latency matters to the strategies that call the store; it is measured on
                // the steady loads at and far over the limit.
                if latency_ms > 0 && (shape == Shape::Bursty || !(factor == 1.0 || factor == 10.0))
                {
                    continue;
                }
                let name = if shape == Shape::Steady {
                    "steady"
                } else {
                    "bursty"
                };
                let scenario = format!("{factor}x {name}, store {latency_ms} ms");
                let arrivals = arrivals(factor, shape, 0x5EED ^ factor.to_bits());
                let latency = Duration::from_millis(latency_ms);
                for strategy in STRATEGIES {
                    let local = matches!(strategy, Strategy::LocalSplit | Strategy::LocalFull);
                    if local && latency_ms > 0 {
                        continue;
                    }
                    let out = run(strategy, latency, &arrivals)?;
                    if shape == Shape::Steady && factor == 10.0 && latency_ms == 0 {
                        plot.push((strategy, out.hottest_series.clone()));
                    }
                    rows.push(summarize(&scenario, strategy, &out));
                }
            }
        }
    }

    let table = markdown(&rows);
    println!("{table}");
    std::fs::create_dir_all("docs")?;
    std::fs::write("docs/fleet_sim.md", &table)?;
    draw(&plot, "docs/fleet_sim.svg")?;
    println!("wrote docs/fleet_sim.md and docs/fleet_sim.svg");
    Ok(())
}

/// One strategy over the arrivals, on a fresh paused runtime.
fn run(
    strategy: Strategy,
    latency: Duration,
    arrivals: &[Arrival],
) -> Result<Outcome, Box<dyn std::error::Error>> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()?;
    Ok(runtime.block_on(async {
        match strategy {
            Strategy::Hierarchical => {
                simulate(&mut Hierarchical::new(None, latency), arrivals).await
            }
            Strategy::HierarchicalFraction => {
                simulate(&mut Hierarchical::new(Some(0.1), latency), arrivals).await
            }
            Strategy::PerRequestGlobal => {
                let store = CountingStore::new(TokioClock::new(), latency);
                simulate(&mut PerRequestGlobal { store }, arrivals).await
            }
            Strategy::LocalSplit => simulate(&mut LocalSplit::new(HOSTS), arrivals).await,
            Strategy::LocalFull => simulate(&mut LocalSplit::new(1), arrivals).await,
        }
    }))
}

fn markdown(rows: &[Row]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{HOSTS} hosts (traffic shares {HOST_SHARE:?}), {KEYS} keys (Zipf s = {ZIPF_S}), limit {RATE}/s burst {BURST} per key, \
         {SECONDS} simulated seconds; the load factor is the hottest key's offered rate over its limit; \
         the store answers after the latency shown (its time-out is 50 ms). \
         *Allowed*: per key, the lesser of what was offered and burst + rate x time. *Refused within \
         the limit*: requests refused that one exact global bucket deciding every request (the \
         oracle) admitted, as a share of all requests.\n"
    );
    let _ = writeln!(
        s,
        "| scenario | strategy | admitted / allowed | over-admitted | refused within the limit | global calls per 1,000 requests | global calls per 1,000 requests of the hottest key |"
    );
    let _ = writeln!(s, "|---|---|---:|---:|---:|---:|---:|");
    for r in rows {
        let _ = writeln!(
            s,
            "| {} | {} | {:.1}% | {} | {:.2}% | {:.1} | {:.1} |",
            r.scenario,
            r.strategy.name(),
            100.0 * r.admitted_share,
            r.over_admitted,
            100.0 * r.wrongly_refused_share,
            r.calls_per_1000,
            r.hottest_calls_per_1000
        );
    }
    s
}

fn draw(series: &[(Strategy, Vec<u64>)], path: &str) -> Result<(), Box<dyn std::error::Error>> {
    let root = SVGBackend::new(path, (900, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let per_second = |n: u64| n as f64 * 1000.0 / PLOT_BIN_MS as f64;
    let y_max = series
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .map(per_second)
        .fold(RATE as f64 * 2.0, f64::max);
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "hottest key, offered 10x its limit: admitted per second",
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(48)
        .build_cartesian_2d(0f64..SECONDS as f64, 0f64..y_max * 1.05)?;
    chart
        .configure_mesh()
        .x_desc("simulated seconds")
        .y_desc("admitted / s")
        .draw()?;
    let colors = [BLUE, CYAN, GREEN, RED, MAGENTA];
    for ((strategy, values), color) in series.iter().zip(colors) {
        let points = values
            .iter()
            .enumerate()
            .map(|(i, &v)| (i as f64 * PLOT_BIN_MS as f64 / 1000.0, per_second(v)));
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))?
            .label(strategy.name())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], color.stroke_width(2)));
    }
    chart
        .draw_series(LineSeries::new(
            [(0.0, RATE as f64), (SECONDS as f64, RATE as f64)],
            BLACK.stroke_width(1),
        ))?
        .label("limit (mean rate)")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 18, y)], BLACK));
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

//! Run with: cargo run --release -p hierarchical-throttle-bench --example many_keys_sim
//!
//! The long tail on simulated time: four hosts (40/30/20/10 % of the traffic) share one
//! in-memory global store that answers after 0 or 5 ms; 10,000 keys of Zipf(1.0) popularity,
//! each limited to 50/s burst 100; the hottest key offered 1x or 10x its limit, Poisson
//! arrivals over 60 s. For the default configuration (credit for cold keys), for
//! `ColdStart::Exact` and for `keep_small_leases(false)`, it reports global calls and round
//! trips (batches) per 1,000 requests over all keys, beside the floor of global calls (a key's
//! first request on a host: each needs a call of its own, for its credit or its first batch),
//! the share of the allowance admitted (per key, `min(offered, burst + rate x
//! 60 s)`), and any key admitted past `burst + rate x 60 s + hosts x credit`. Writes
//! `docs/many_keys_sim.md`.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_util::stream::{FuturesUnordered, Stream};
use hierarchical_throttle::clock::TokioClock;
use hierarchical_throttle::global::{
    Adjusted, Adjustment, Answer, BucketLevel, Call, GlobalStore, Grant, TokenRequest, TokenReturn,
};
use hierarchical_throttle::quota::BucketKey;
use hierarchical_throttle::{
    ColdStart, HierarchicalThrottleLayer, Limit, MemoryGlobalStore, Rejection,
};
use tower::{Layer, ServiceExt, service_fn};

const HOSTS: usize = 4;
const HOST_SHARE: [f64; HOSTS] = [0.4, 0.3, 0.2, 0.1];
const KEYS: usize = 10_000;
const RATE: u64 = 50;
const BURST: u64 = 100;
const SECONDS: u64 = 60;

/// The in-memory store after `latency` (half each way), counting calls and round trips.
#[derive(Clone)]
struct CountingStore {
    inner: MemoryGlobalStore<usize, TokioClock>,
    latency: Duration,
    calls: Arc<AtomicU64>,
    releases: Arc<AtomicU64>,
    round_trips: Arc<AtomicU64>,
}

impl CountingStore {
    async fn answer<T>(&self, work: impl Future<Output = T>) -> T {
        tokio::time::sleep(self.latency / 2).await;
        let answer = work.await;
        tokio::time::sleep(self.latency - self.latency / 2).await;
        answer
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
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.inner.acquire(key, limit, request)
    }

    fn release(
        &self,
        key: &BucketKey<usize>,
        limit: &Limit,
        back: TokenReturn,
    ) -> impl Future<Output = Result<(), Infallible>> + Send {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.releases.fetch_add(1, Ordering::Relaxed);
        self.inner.release(key, limit, back)
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

    /// One round trip for the whole batch, as a store with a batched form makes.
    fn call_many(
        &self,
        calls: Vec<Call<BucketKey<usize>>>,
    ) -> impl Stream<Item = (usize, Result<Answer, Infallible>)> + Send {
        self.round_trips.fetch_add(1, Ordering::Relaxed);
        calls
            .into_iter()
            .enumerate()
            .map(|(i, call)| async move { (i, self.answer(self.call_one(call)).await) })
            .collect::<FuturesUnordered<_>>()
    }

    fn maintain(&self) {
        self.inner.maintain();
    }
}

/// xorshift64*: every configuration sees the same arrivals.
struct Rng(u64);

impl Rng {
    fn next_f64(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// An index drawn by the cumulative weights `cdf` (ending at 1).
    fn pick(&mut self, cdf: &[f64]) -> usize {
        let x = self.next_f64();
        cdf.partition_point(|&c| c < x).min(cdf.len() - 1)
    }
}

fn cumulative(weights: &[f64]) -> Vec<f64> {
    let total: f64 = weights.iter().sum();
    let mut sum = 0.0;
    weights
        .iter()
        .map(|w| {
            sum += w / total;
            sum
        })
        .collect()
}

/// (ms, key, host) for `factor` times the limit on the hottest key, Poisson per millisecond.
fn arrivals(factor: f64) -> Vec<(u64, usize, usize)> {
    let popularity: Vec<f64> = (1..=KEYS).map(|r| 1.0 / r as f64).collect();
    let total_rate = factor * RATE as f64 * popularity.iter().sum::<f64>();
    let (keys, hosts) = (cumulative(&popularity), cumulative(&HOST_SHARE));
    let mut rng = Rng(0x5EED ^ factor.to_bits());
    let lambda = total_rate / 1000.0;
    let mut out = Vec::new();
    for ms in 0..SECONDS * 1000 {
        let (mut count, mut p, limit) = (0, 1.0, (-lambda).exp());
        loop {
            p *= rng.next_f64();
            if p <= limit {
                break;
            }
            count += 1;
        }
        for _ in 0..count {
            out.push((ms, rng.pick(&keys), rng.pick(&hosts)));
        }
    }
    out
}

struct Outcome {
    requests: u64,
    calls: u64,
    releases: u64,
    round_trips: u64,
    admitted_share: f64,
    over_bound: u64,
}

type Reject = fn(&usize, Rejection<usize>) -> Result<bool, Infallible>;

/// How the hosts are set up.
#[derive(Clone, Copy)]
struct Configuration {
    cold_start: ColdStart,
    keep_small_leases: bool,
}

impl Configuration {
    /// The builder's defaults.
    fn defaults() -> Self {
        Self {
            cold_start: ColdStart::default(),
            keep_small_leases: true,
        }
    }
}

async fn simulate(
    arrivals: &[(u64, usize, usize)],
    Configuration {
        cold_start,
        keep_small_leases,
    }: Configuration,
    latency: Duration,
) -> Outcome {
    let limit = Limit::per_second(RATE).burst(BURST).expect("a valid limit");
    let store = CountingStore {
        inner: MemoryGlobalStore::with_clock(TokioClock::new()),
        latency,
        calls: Arc::default(),
        releases: Arc::default(),
        round_trips: Arc::default(),
    };
    let hosts: Vec<_> = (0..HOSTS)
        .map(|_| {
            let layer = HierarchicalThrottleLayer::builder()
                .key(|key: &usize| Some(*key))
                .clock(TokioClock::new())
                .limit(limit)
                .cold_start(cold_start)
                .keep_small_leases(keep_small_leases)
                .on_rejection((|_, _| Ok(false)) as Reject)
                .global_store(store.clone())
                .build()
                .expect("a valid layer");
            layer.layer(service_fn(|_: usize| async { Ok::<_, Infallible>(true) }))
        })
        .collect();
    let admitted: Arc<Vec<AtomicU64>> = Arc::new((0..KEYS).map(|_| AtomicU64::new(0)).collect());
    let mut offered = vec![0u64; KEYS];
    let start = tokio::time::Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for &(ms, key, host) in arrivals {
        tokio::time::sleep_until(start + Duration::from_millis(ms)).await;
        offered[key] += 1;
        let (service, admitted) = (hosts[host].clone(), admitted.clone());
        tasks.spawn(async move {
            if service
                .oneshot(key)
                .await
                .unwrap_or_else(|never| match never {})
            {
                admitted[key].fetch_add(1, Ordering::Relaxed);
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    let bound = BURST + RATE * SECONDS;
    let credit = HOSTS as u64 * cold_start.credit(&limit);
    let admitted: Vec<u64> = admitted.iter().map(|a| a.load(Ordering::Relaxed)).collect();
    let allowed: u64 = offered.iter().map(|&o| o.min(bound)).sum();
    Outcome {
        requests: arrivals.len() as u64,
        calls: store.calls.load(Ordering::Relaxed),
        releases: store.releases.load(Ordering::Relaxed),
        round_trips: store.round_trips.load(Ordering::Relaxed),
        admitted_share: admitted.iter().sum::<u64>() as f64 / allowed as f64,
        over_bound: admitted
            .iter()
            .map(|&a| a.saturating_sub(bound + credit))
            .sum(),
    }
}

/// How many of `arrivals` are a key's first request on its host: each needs a global call of
/// its own, whatever the configuration.
fn first_on_host(arrivals: &[(u64, usize, usize)]) -> u64 {
    let mut seen = std::collections::HashSet::new();
    arrivals
        .iter()
        .filter(|&&(_, key, host)| seen.insert((key, host)))
        .count() as u64
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut table = String::from(
        "| hottest key | store latency | configuration | requests | keys' first requests on a \
         host per 1,000 | global calls per 1,000 requests | of which hand-backs | round trips \
         per 1,000 | allowance admitted | admitted past the bound |\n\
         |---|---:|---|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for factor in [1.0, 10.0] {
        let arrivals = arrivals(factor);
        let firsts = first_on_host(&arrivals);
        for latency_ms in [0, 5] {
            for (name, configuration) in [
                ("defaults (credit)", Configuration::defaults()),
                (
                    "`ColdStart::Exact`",
                    Configuration {
                        cold_start: ColdStart::Exact,
                        ..Configuration::defaults()
                    },
                ),
                (
                    "`keep_small_leases(false)`",
                    Configuration {
                        keep_small_leases: false,
                        ..Configuration::defaults()
                    },
                ),
            ] {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_time()
                    .start_paused(true)
                    .build()?;
                let latency = Duration::from_millis(latency_ms);
                let out = runtime.block_on(simulate(&arrivals, configuration, latency));
                let per_1000 = |n: u64| 1000.0 * n as f64 / out.requests as f64;
                let row = format!(
                    "| {factor}x | {latency_ms} ms | {name} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} % | {} |\n",
                    out.requests,
                    per_1000(firsts),
                    per_1000(out.calls),
                    per_1000(out.releases),
                    per_1000(out.round_trips),
                    100.0 * out.admitted_share,
                    out.over_bound
                );
                print!("{row}");
                table.push_str(&row);
            }
        }
    }
    std::fs::create_dir_all("docs")?;
    std::fs::write("docs/many_keys_sim.md", &table)?;
    println!("wrote docs/many_keys_sim.md");
    Ok(())
}

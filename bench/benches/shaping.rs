//! How close to their tokens' due time shaped requests wake up, on real time: a burst of
//! requests for one key waits behind a bucket of one token every 2 ms, and each admission is
//! compared with the instant its token was due (the bucket's burst at once, then one every
//! 2 ms). Reports the error's percentiles over several rounds, for bursts of 1 and 5, with and without
//! reservations ahead of the refill.
//!
//! Run with: cargo bench -p hierarchical-throttle-bench --bench shaping

use std::time::{Duration, Instant};

use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore, Shaping};

const REQUESTS: u32 = 500;
/// Rounds per case; one in a debug build, where the test suite runs this once to see it work.
const ROUNDS: u64 = if cfg!(debug_assertions) { 1 } else { 5 };
const EVERY: Duration = Duration::from_millis(2);

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    for (burst, reserve) in [(1, 100), (5, 100), (5, 0)] {
        let reserve = Duration::from_millis(reserve);
        let mut errors = runtime.block_on(async {
            let mut errors = Vec::new();
            for round in 0..ROUNDS {
                errors.extend(one_burst(round, burst, reserve).await);
            }
            errors
        });
        errors.sort_unstable();
        let at = |q: f64| errors[((errors.len() - 1) as f64 * q) as usize];
        println!(
            "burst {burst}, max_reservation {reserve:?}: wake-up error over {} admissions: \
             p50 {:?}, p99 {:?}, max {:?}",
            errors.len(),
            at(0.5),
            at(0.99),
            at(1.0)
        );
    }
}

/// The lateness of each admission of a burst of `REQUESTS` against its token's due time.
async fn one_burst(round: u64, burst: u32, reserve: Duration) -> Vec<Duration> {
    let layer = HierarchicalThrottleLayer::builder()
        .key(|k: &u64| Some(*k))
        .limit(
            Limit::per(1, EVERY)
                .burst(u64::from(burst))
                .expect("a valid limit"),
        )
        .shaping(Shaping::Wait {
            max: Duration::from_secs(5),
            queue: REQUESTS as usize,
        })
        .max_reservation(reserve)
        .global_store(MemoryGlobalStore::new())
        .build()
        .expect("a valid layer");
    let start = Instant::now();
    let waits = (0..REQUESTS).map(|_| {
        let layer = layer.clone();
        tokio::spawn(async move {
            layer.acquire(round, 1).await.expect("admitted within 5 s");
            Instant::now()
        })
    });
    let mut admitted = Vec::new();
    for wait in waits.collect::<Vec<_>>() {
        admitted.push(wait.await.expect("the task ran"));
    }
    admitted.sort_unstable();
    admitted
        .iter()
        .zip(0..)
        .map(|(at, i): (&Instant, u32)| {
            let due = start + EVERY * (i + 1).saturating_sub(burst);
            at.saturating_duration_since(due)
        })
        .collect()
}

//! Run with: cargo run --release -p hierarchical-throttle-bench --example sweep_stall -- [KEYS]
//!
//! How long the background pass over a full local store (100,000 keys by default, the default
//! store's bound) holds up the other tasks of its worker thread. One worker thread; a layer with
//! the default settings holding a lease for every key; then passes (`return_unused_leases`)
//! beside a task that yields again and again and records the longest it waited between two of
//! its turns. Reports the pass's time and that longest wait, the median of 20 passes
//! (`SWEEP_STALL_EACH=1`: every pass's, with the layer's counters).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hierarchical_throttle::local::LocalStore;
use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore};

type Error = Box<dyn std::error::Error + Send + Sync>;

fn main() -> Result<(), Error> {
    let keys: u64 = std::env::args().nth(1).map_or(Ok(100_000), |k| k.parse())?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()?;
    runtime.block_on(async move {
        let layer = HierarchicalThrottleLayer::builder()
            .key(|key: &u64| Some(*key))
            .limit(Limit::per_second(100).burst(100)?)
            .global_store(MemoryGlobalStore::new())
            .build()?;
        for key in 0..keys {
            let _ = layer.acquire(key, 1).await;
        }
        // Every key's charge or batch has come back from the store (no task but the pass and
        // the ticker runs while they are timed).
        let started = Instant::now();
        while layer.stats().tokens_leased < keys {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        println!("{keys} keys' first batches in {:?}", started.elapsed());
        let (mut passes, mut stalls) = (Vec::new(), Vec::new());
        for _ in 0..20 {
            let done = Arc::new(AtomicBool::new(false));
            let longest = Arc::new(AtomicU64::new(0));
            let ticking = Arc::new(AtomicBool::new(false));
            let ticker = tokio::spawn(tick_until(ticking.clone(), done.clone(), longest.clone()));
            while !ticking.load(Ordering::Acquire) {
                tokio::task::yield_now().await;
            }
            let started = Instant::now();
            layer.return_unused_leases().await;
            passes.push(started.elapsed());
            done.store(true, Ordering::Release);
            ticker.await?;
            stalls.push(Duration::from_nanos(longest.load(Ordering::Acquire)));
            if std::env::var_os("SWEEP_STALL_EACH").is_some() {
                let stats = layer.stats();
                println!(
                    "pass {:?}, longest wait {:?}, batches {}, tokens leased {}, returned {}",
                    passes.last(),
                    stalls.last(),
                    stats.global_batches,
                    stats.tokens_leased,
                    stats.tokens_returned,
                );
            }
        }
        passes.sort();
        stalls.sort();
        println!(
            "{} keys held: a pass takes {:?}; the longest another task waited for its turn \
             during a pass: {:?} (medians of 20)",
            layer.local_store().len(),
            passes[10],
            stalls[10],
        );
        Ok::<_, Error>(())
    })
}

/// Says it is `ticking`, then yields until `done`, recording in `longest` the longest time
/// between two of its turns.
async fn tick_until(ticking: Arc<AtomicBool>, done: Arc<AtomicBool>, longest: Arc<AtomicU64>) {
    ticking.store(true, Ordering::Release);
    let mut last = Instant::now();
    while !done.load(Ordering::Acquire) {
        tokio::task::yield_now().await;
        let now = Instant::now();
        longest.fetch_max((now - last).as_nanos() as u64, Ordering::AcqRel);
        last = now;
    }
}

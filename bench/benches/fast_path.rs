//! The local fast path against governor's keyed `check_key`, in the same run, on one and two
//! threads; and the slow path that fetches a batch from the global store.
//!
//! Five ways to decide, each taking a `u64` key and calling the same trivial inner service when
//! admitted: this crate's decision alone (`acquire`, on the layer and through the type-erased
//! `ThrottleHandle`), that decision plus a fleet-wide concurrency slot taken and given back
//! (`HierarchicalConcurrencyLayer::acquire`, the permit dropped after the call), this crate's
//! whole service (key closure, decision, response future), and governor's keyed `check_key`.
//! (over 1 and 10k keys). Every key holds tokens (and slots) before measuring, so each iteration is a hit on a known
//! key. Tuned beside the defaults, so that warming a million keys holds through the run: a
//! whole capacity per batch, a lease time-to-live of an hour, and slots held an hour and
//! kept on the host for 15 minutes unused (the runtime is not driven while measuring).
//!
//! Run with: cargo bench -p hierarchical-throttle-bench --bench fast_path

use std::convert::Infallible;
use std::future::{Ready, ready};
use std::hint::black_box;
use std::num::NonZeroU32;
use std::task::{Context, Poll};
use std::time::Duration;

#[allow(
    dead_code,
    reason = "its warm-up wait is for the benchmarks whose keys pass on credit"
)]
mod support;

use criterion::{Criterion, criterion_group, criterion_main};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use hierarchical_throttle::batch::{BatchContext, FractionOfCapacity};
use hierarchical_throttle::clock::MonotonicClock;
use hierarchical_throttle::{
    Builder, HierarchicalConcurrencyLayer, HierarchicalThrottleLayer, Limit, MemoryGlobalStore,
    MemoryLocalStore, Rejection, ThrottleHandle, Unset,
};
use support::{keys, poll_once};
use tower::{Layer, Service, ServiceExt};

/// The inner service: answers at once.
#[derive(Clone, Copy)]
struct Echo;

impl Service<u64> for Echo {
    type Response = u64;
    type Error = Infallible;
    type Future = Ready<Result<u64, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: u64) -> Self::Future {
        ready(Ok(req))
    }
}

type Reject = fn(&u64, Rejection<u64>) -> Result<u64, Infallible>;

/// A layer keyed by the request itself, with a limit the benchmarks never reach.
fn builder() -> Builder<u64, u64, Unset, MemoryLocalStore<u64>, MonotonicClock, Reject> {
    HierarchicalThrottleLayer::builder()
        .key(|k: &u64| Some(*k))
        .limit(
            Limit::per_second(1_000_000)
                .burst(Limit::MAX_CAPACITY)
                .unwrap(),
        )
        .on_rejection((|_, _| Ok(u64::MAX)) as Reject)
}

type OursLayer = HierarchicalThrottleLayer<
    u64,
    u64,
    MemoryGlobalStore<u64>,
    MemoryLocalStore<u64>,
    MonotonicClock,
    Reject,
>;
type Ours = <OursLayer as Layer<Echo>>::Service;

/// Our layer and a service from it, with tokens leased for every key.
fn ours(runtime: &tokio::runtime::Runtime, keys: &[u64]) -> (OursLayer, Ours) {
    let layer = builder()
        // Every key waits for its batch during the warm-up, so that every one holds its lease
        // when the measurement starts: on credit (the default), a million keys' batches were
        // still under way, and their work stayed queued on the shared runtime, slowing the
        // cases measured after them.
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .batch_policy(FractionOfCapacity::new(1.0).unwrap())
        // Warming a million keys takes seconds: keep their leases through the run.
        .lease_ttl(Duration::from_secs(3600))
        .local_store(MemoryLocalStore::with_max_keys(2 * keys.len() + 64).unwrap())
        .global_store(MemoryGlobalStore::new())
        .build()
        .unwrap();
    let mut service = layer.layer(Echo);
    for &k in keys {
        let warm = runtime.block_on(async { service.ready().await?.call(k).await });
        assert_eq!(warm, Ok(k), "every key is admitted");
    }
    (layer, service)
}

type Slots = HierarchicalConcurrencyLayer<u64, u64, MemoryGlobalStore<u64>>;

/// A concurrency layer no key reaches, two slots leased for every key.
fn slots(runtime: &tokio::runtime::Runtime, keys: &[u64]) -> Slots {
    let layer = HierarchicalConcurrencyLayer::builder()
        .key(|k: &u64| Some(*k))
        .max_in_flight(1 << 40)
        .slot_ttl(Duration::from_secs(3600))
        // Slots stay on the host through the run (the runtime is not driven while measuring,
        // so a slot given back could not be fetched again).
        .linger(Duration::from_secs(900))
        .store(MemoryGlobalStore::new())
        .build()
        .unwrap();
    for &k in keys {
        // Two at once, so that two threads on one key each find a free slot.
        let both = runtime.block_on(async { (layer.acquire(k).await, layer.acquire(k).await) });
        assert!(both.0.is_ok() && both.1.is_ok(), "every key gets two slots");
    }
    layer
}

fn governor(keys: &[u64]) -> DefaultKeyedRateLimiter<u64> {
    let limiter = RateLimiter::keyed(Quota::per_second(NonZeroU32::MAX));
    for &k in keys {
        assert!(limiter.check_key(&k).is_ok());
    }
    limiter
}

/// The next index, wrapping without a division (which would cost more than a decision).
#[inline]
fn next(i: usize, len: usize) -> usize {
    if i + 1 == len { 0 } else { i + 1 }
}

/// The three ways to decide a request for `key` and call the inner service when admitted.
#[derive(Clone, Copy)]
enum Way {
    /// `HierarchicalThrottleLayer::acquire`: the decision alone.
    Acquire,
    /// `ThrottleHandle::acquire`: the decision through the type-erased handle.
    Handle,
    /// `acquire`, then a concurrency slot taken, held over the call, and given back.
    AcquireWithSlot,
    /// The throttling service: key closure, decision and response future.
    Service,
    /// governor's keyed `check_key`.
    Governor,
}

impl Way {
    const ALL: [Way; 5] = [
        Way::Acquire,
        Way::Handle,
        Way::AcquireWithSlot,
        Way::Service,
        Way::Governor,
    ];

    fn name(self) -> &'static str {
        match self {
            Way::Acquire => "hierarchical_throttle_acquire",
            Way::Handle => "hierarchical_throttle_handle_acquire",
            Way::AcquireWithSlot => "hierarchical_throttle_acquire_and_concurrency_slot",
            Way::Service => "hierarchical_throttle_service",
            Way::Governor => "governor_check_key",
        }
    }
}

/// What one thread decides with: its own clone of our service (clones share the buckets), or
/// the shared governor limiter.
enum Decider<'a> {
    Ours(&'a OursLayer, Ours, ThrottleHandle<u64>, Option<&'a Slots>),
    Governor(&'a DefaultKeyedRateLimiter<u64>),
}

impl Decider<'_> {
    #[inline(always)]
    fn decide(&mut self, way: Way, key: u64) -> Option<Result<u64, Infallible>> {
        let mut echo = Echo;
        match (way, self) {
            (Way::Service, Decider::Ours(_, service, ..)) => poll_once(service.call(key)),
            (Way::Acquire, Decider::Ours(layer, ..)) => {
                let admitted = poll_once(layer.acquire(key, 1)).is_some_and(|d| d.is_ok());
                admitted.then(|| poll_once(echo.call(key)))?
            }
            (Way::Handle, Decider::Ours(_, _, handle, _)) => {
                let admitted = poll_once(handle.acquire(key, 1)).is_some_and(|d| d.is_ok());
                admitted.then(|| poll_once(echo.call(key)))?
            }
            (Way::AcquireWithSlot, Decider::Ours(layer, _, _, Some(slots))) => {
                let admitted = poll_once(layer.acquire(key, 1)).is_some_and(|d| d.is_ok());
                let slot = admitted.then(|| poll_once(slots.acquire(key)))??.ok()?;
                let answer = poll_once(echo.call(key));
                drop(slot);
                answer
            }
            (_, Decider::Governor(limiter)) => {
                let admitted = limiter.check_key(&key).is_ok();
                admitted.then(|| poll_once(echo.call(key)))?
            }
            (Way::Governor | Way::AcquireWithSlot, Decider::Ours(..)) => None,
        }
    }
}

/// The most keys measured: a million, except in a debug build (the test suite runs each
/// benchmark once), where warming a million keys would take minutes for the same code paths.
const MOST_KEYS: u64 = if cfg!(debug_assertions) {
    20_000
} else {
    1_000_000
};

/// One thread, 1 / 10k / 1M known keys.
fn one_thread(c: &mut Criterion, runtime: &tokio::runtime::Runtime) {
    let mut group = c.benchmark_group("fast_path_1_thread");
    for n in [1u64, 10_000, MOST_KEYS] {
        let keys = keys(n);
        // Built on first use, so a filtered run sets up only what it measures.
        let mut ours_state = None;
        let mut slots_state = None;
        let mut limiter = None;
        for way in Way::ALL {
            // Slots for a million keys take a store call each to warm: not measured there.
            if matches!(way, Way::AcquireWithSlot) && n > 10_000 {
                continue;
            }
            let mut i = 0;
            group.bench_function(format!("{}/{n}", way.name()), |b| {
                let mut decider = match way {
                    Way::Governor => {
                        Decider::Governor(limiter.get_or_insert_with(|| governor(&keys)))
                    }
                    _ => {
                        let (layer, service) =
                            ours_state.get_or_insert_with(|| ours(runtime, &keys));
                        let slots = matches!(way, Way::AcquireWithSlot)
                            .then(|| &*slots_state.get_or_insert_with(|| slots(runtime, &keys)));
                        Decider::Ours(layer, service.clone(), layer.handle(), slots)
                    }
                };
                b.iter(|| {
                    i = next(i, keys.len());
                    black_box(decider.decide(way, black_box(keys[i])))
                })
            });
        }
    }
    group.finish();
}

/// Two threads deciding at once: on one key (both contend for it) and on distinct keys (each
/// thread its own half of 10k). Reported per decision of one thread.
fn two_threads(c: &mut Criterion, runtime: &tokio::runtime::Runtime) {
    let mut group = c.benchmark_group("fast_path_2_threads");
    for (name, n) in [("same_key", 1u64), ("distinct_keys", 10_000)] {
        let keys = keys(n);
        let halves: Vec<&[u64]> = if n == 1 {
            vec![&keys, &keys]
        } else {
            keys.chunks(keys.len() / 2).collect()
        };
        let (layer, service) = ours(runtime, &keys);
        let slots = slots(runtime, &keys);
        let limiter = governor(&keys);
        for way in Way::ALL {
            group.bench_function(format!("{}/{name}", way.name()), |b| {
                b.iter_custom(|iters| {
                    in_parallel(&halves, |keys| {
                        let mut decider = match way {
                            Way::Governor => Decider::Governor(&limiter),
                            _ => {
                                Decider::Ours(&layer, service.clone(), layer.handle(), Some(&slots))
                            }
                        };
                        let mut i = 0;
                        for _ in 0..iters {
                            i = next(i, keys.len());
                            black_box(decider.decide(way, black_box(keys[i])));
                        }
                    })
                })
            });
        }
    }
    group.finish();
}

/// Runs `work` on one thread per slice of keys, all at once; returns the wall time.
fn in_parallel<F>(slices: &[&[u64]], work: F) -> Duration
where
    F: Fn(&[u64]) + Sync,
{
    let barrier = std::sync::Barrier::new(slices.len());
    let start = std::sync::Mutex::new(None);
    std::thread::scope(|scope| {
        for keys in slices {
            scope.spawn(|| {
                if barrier.wait().is_leader() {
                    *start.lock().unwrap() = Some(std::time::Instant::now());
                }
                work(keys);
            });
        }
    });
    start
        .into_inner()
        .unwrap()
        .map_or(Duration::ZERO, |s| s.elapsed())
}

/// A decision whose local bucket is always empty: every request waits for a batch of one token
/// from a `MemoryGlobalStore` (the slow path, with its task spawn and wake-ups; exact, so that
/// no request is admitted on credit before its fetch).
fn global_fetch(c: &mut Criterion, runtime: &tokio::runtime::Runtime) {
    let layer = builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .batch_policy(|_: &BatchContext<'_>| 0)
        .global_store(MemoryGlobalStore::new())
        .build()
        .unwrap();
    let mut service = layer.layer(Echo);
    let mut group = c.benchmark_group("slow_path");
    group.bench_function("hierarchical_throttle/fetch_from_memory_store", |b| {
        b.iter(|| runtime.block_on(async { service.ready().await?.call(black_box(7)).await }))
    });
    group.finish();
}

fn bench(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let _guard = runtime.enter();
    one_thread(c, &runtime);
    two_threads(c, &runtime);
    global_fetch(c, &runtime);
}

criterion_group!(benches, bench);
criterion_main!(benches);

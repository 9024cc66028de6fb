//! The hit path with 1, 2 and 3 limits per request, and with a second limit in shadow, against
//! governor's keyed `check_key` (one limit) in the same run, over 1,000 keys that all hold
//! tokens; and a body charged by the byte as it streams, frame by frame, against the same body
//! unmetered and against governor's `check_key_n` per frame.
//!
//! Run with: cargo bench -p hierarchical-throttle-bench --bench quota

use std::convert::Infallible;
use std::hint::black_box;
use std::num::NonZeroU32;
use std::pin::{Pin, pin};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame};

mod support;

use criterion::{Criterion, criterion_group, criterion_main};
use governor::{Quota as GovernorQuota, RateLimiter};
use hierarchical_throttle::batch::FractionOfCapacity;
use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore, Quota};
use support::{keys, poll_once};

const KEYS: u64 = 1_000;
/// A streamed body: this many frames of `FRAME` bytes (64 KiB).
const FRAMES: u32 = 16;
const FRAME: usize = 4 * 1024;

/// A body of `left` frames, each `chunk` (shared bytes: making a frame copies nothing).
struct Frames {
    left: u32,
    chunk: Bytes,
}

impl Body for Frames {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.left == 0 {
            return Poll::Ready(None);
        }
        self.left -= 1;
        Poll::Ready(Some(Ok(Frame::data(self.chunk.clone()))))
    }
}

/// Polls `body` to its end, as a server writing it would when every frame is ready, and
/// tells how many frames it gave (fewer than all when one was refused or not ready).
#[inline(always)]
fn drain<B: Body>(body: B) -> u32 {
    let mut context = Context::from_waker(std::task::Waker::noop());
    let mut body = pin!(body);
    let mut frames = 0;
    while let Poll::Ready(Some(Ok(_))) = body.as_mut().poll_frame(&mut context) {
        frames += 1;
    }
    frames
}

/// A quota of `n` limits the benchmark never reaches.
fn quota(n: usize) -> Quota {
    let limit = Limit::per_second(1_000_000)
        .burst(Limit::MAX_CAPACITY)
        .unwrap();
    let mut quota = Quota::new("l0", limit).unwrap();
    for i in 1..n {
        quota = quota.and(&format!("l{i}"), limit).unwrap();
    }
    quota
}

fn bench(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let _guard = runtime.enter();
    let keys = keys(KEYS);
    let mut group = c.benchmark_group("hit path by number of limits (1,000 keys)");
    let governor = RateLimiter::keyed(GovernorQuota::per_second(NonZeroU32::MAX));
    for k in &keys {
        assert!(governor.check_key(k).is_ok());
    }
    let mut i = 0;
    group.bench_function("governor check_key, 1 limit", |b| {
        b.iter(|| {
            i = (i + 1) % keys.len();
            black_box(governor.check_key(black_box(&keys[i])).is_ok())
        })
    });
    let sides = [
        (1, false, "acquire, 1 limit(s)"),
        (2, false, "acquire, 2 limit(s)"),
        (3, false, "acquire, 3 limit(s)"),
        (2, true, "acquire, 2 limits, the second in shadow"),
    ];
    for (limits, shadow, name) in sides {
        let mut builder = HierarchicalThrottleLayer::builder()
            .key(|k: &u64| Some(*k))
            .quota(quota(limits))
            .batch_policy(FractionOfCapacity::new(1.0).unwrap())
            .lease_ttl(Duration::from_secs(3600))
            .global_store(MemoryGlobalStore::new());
        if shadow {
            builder = builder.shadow_limit("l1");
        }
        let layer = builder.build().unwrap();
        for &k in &keys {
            let warm = runtime.block_on(layer.acquire(k, 1));
            assert!(warm.is_ok(), "every key is admitted");
        }
        // A cold key passes on credit; its lease comes with the batch the warm-up started: let
        // those land.
        runtime.block_on(async { tokio::time::sleep(support::BATCHES_LAND).await });
        group.bench_function(name, |b| {
            b.iter(|| {
                i = (i + 1) % keys.len();
                black_box(poll_once(layer.acquire(black_box(keys[i]), 1)))
            })
        });
    }
    group.finish();
    bench_metered_bodies(c, &runtime, &keys);
}

/// A 64 KiB body in 16 frames per iteration, over 1,000 keys that all hold tokens: passed on
/// unmetered, charged to its key by this crate's `meter`, and each frame checked by governor's
/// `check_key_n`.
fn bench_metered_bodies(c: &mut Criterion, runtime: &tokio::runtime::Runtime, keys: &[u64]) {
    let chunk = Bytes::from(vec![7u8; FRAME]);
    let body = || Frames {
        left: FRAMES,
        chunk: chunk.clone(),
    };
    let mut group = c.benchmark_group("a body of 16 frames of 4 KiB (1,000 keys)");
    let mut i = 0;
    group.bench_function("unmetered", |b| {
        b.iter(|| black_box(drain(black_box(body()))))
    });
    let governor = RateLimiter::keyed(GovernorQuota::per_second(NonZeroU32::MAX));
    let frame_cost = NonZeroU32::new(FRAME as u32).unwrap();
    group.bench_function("governor check_key_n per frame", |b| {
        b.iter(|| {
            i = (i + 1) % keys.len();
            let key = black_box(&keys[i]);
            let mut body = pin!(body());
            let mut context = Context::from_waker(std::task::Waker::noop());
            let mut frames = 0;
            while let Poll::Ready(Some(Ok(_))) = body.as_mut().poll_frame(&mut context) {
                if !matches!(governor.check_key_n(key, frame_cost), Ok(Ok(()))) {
                    break;
                }
                frames += 1;
            }
            black_box(frames)
        })
    });
    let layer = HierarchicalThrottleLayer::builder()
        .key(|k: &u64| Some(*k))
        .quota(quota(1))
        .batch_policy(FractionOfCapacity::new(1.0).unwrap())
        .lease_ttl(Duration::from_secs(3600))
        .global_store(MemoryGlobalStore::new())
        .build()
        .unwrap();
    for &k in keys {
        let warm = runtime.block_on(layer.acquire(k, FRAME as u64));
        assert!(warm.is_ok(), "every key is admitted");
    }
    runtime.block_on(async { tokio::time::sleep(support::BATCHES_LAND).await });
    assert_eq!(
        drain(layer.meter(keys[0], body())),
        FRAMES,
        "every frame is paid"
    );
    group.bench_function("meter", |b| {
        b.iter(|| {
            i = (i + 1) % keys.len();
            black_box(drain(layer.meter(black_box(keys[i]), body())))
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

//! The token-bucket worked examples of the rate-limiting notes: TB(1/3 token per ms, 4), full at
//! t = 0, each request costing 1. Checked on the global store's arithmetic and through a whole
//! layer that fetches exactly one token per request.

mod common;

use std::time::Duration;

use common::*;
use hierarchical_throttle::bucket::TokenBucket;
use hierarchical_throttle::clock::ManualClock;
use hierarchical_throttle::global::{GlobalStore, TokenRequest};
use hierarchical_throttle::quota::BucketKey;
use hierarchical_throttle::{Limit, MemoryGlobalStore, RejectionReason};

fn tb() -> Limit {
    Limit::per(1, Duration::from_millis(3)).burst(4).unwrap()
}

const ALL_CONFORM: &[u64] = &[0, 0, 0, 2, 3, 6, 9, 12];
const BURSTS: &[u64] = &[0, 0, 0, 0, 12, 12, 12, 12, 24, 24, 24, 24];
const STEADY: &[u64] = &[0, 1, 2, 3, 4, 5];

async fn conforming_on_store(arrivals: &[u64]) -> Vec<bool> {
    let clock = ManualClock::new();
    let store = MemoryGlobalStore::with_clock(clock.clone());
    let mut out = Vec::new();
    for &ms in arrivals {
        clock.set(Duration::from_millis(ms));
        let request = TokenRequest::now(1, 1);
        let key = BucketKey::new("k", "default").unwrap();
        let grant = store.acquire(&key, &tb(), request).await.unwrap();
        out.push(grant.granted == 1);
    }
    out
}

/// A host of TB(1/3 per ms, 4) whose batches are exactly a request's cost, so every decision
/// is the global bucket's.
fn host_deciding_by_the_global_bucket(
    clock: &ManualClock,
) -> impl tower::Service<Job, Response = Outcome, Error = std::convert::Infallible> {
    let layer = host_builder(clock, tb())
        .batch_policy(|_: &hierarchical_throttle::batch::BatchContext<'_>| 0)
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    tower::Layer::layer(&layer, backend())
}

async fn conforming_through_layer(arrivals: &[u64]) -> Vec<bool> {
    let clock = ManualClock::new();
    let mut host = host_deciding_by_the_global_bucket(&clock);
    let mut out = Vec::new();
    for &ms in arrivals {
        clock.set(Duration::from_millis(ms));
        out.push(send(&mut host, "k", 1).await == Outcome::Served);
    }
    out
}

#[tokio::test]
async fn all_arrivals_conform_when_they_follow_the_rate() {
    assert_eq!(conforming_on_store(ALL_CONFORM).await, vec![true; 8]);
    assert_eq!(conforming_through_layer(ALL_CONFORM).await, vec![true; 8]);
}

#[tokio::test]
async fn bursts_of_four_every_twelve_ms_conform() {
    assert_eq!(conforming_on_store(BURSTS).await, vec![true; 12]);
    assert_eq!(conforming_through_layer(BURSTS).await, vec![true; 12]);
}

#[tokio::test]
async fn the_sixth_of_one_per_ms_does_not_conform() {
    let expected = vec![true, true, true, true, true, false];
    assert_eq!(conforming_on_store(STEADY).await, expected);
    assert_eq!(conforming_through_layer(STEADY).await, expected);
}

#[test]
fn tokens_before_each_steady_arrival_match_the_notes() {
    // Tokens before each: 4, 3 1/3, 2 2/3, 2, 1 1/3, 2/3; in thirds 12, 10, 8, 6, 4, 2. One
    // third accrues per ms, so the time to fill up tells the thirds held.
    let limit = tb();
    let mut bucket = TokenBucket::full(&limit, 0);
    let mut thirds_before = Vec::new();
    for ms in 0..6u64 {
        bucket.refill(&limit, ms * 1000);
        thirds_before.push(12 - bucket.micros_until(&limit, 4) / 1000);
        bucket.take(&limit, ms * 1000, 1, 1);
    }
    assert_eq!(thirds_before, vec![12, 10, 8, 6, 4, 2]);
}

#[tokio::test]
async fn the_refused_arrival_is_told_when_a_token_is_due() {
    let clock = ManualClock::new();
    let mut host = host_deciding_by_the_global_bucket(&clock);
    for ms in 0..5 {
        clock.set(Duration::from_millis(ms));
        assert_eq!(send(&mut host, "k", 1).await, Outcome::Served);
    }
    clock.set(Duration::from_millis(5));
    // 2/3 of a token at t = 5 ms: the next whole one is due 1 ms later.
    assert_eq!(
        send(&mut host, "k", 1).await,
        Outcome::Refused(RejectionReason::Throttled, Some(Duration::from_millis(1)))
    );
}

#[tokio::test]
async fn the_memory_store_passes_the_conformance_suite() {
    let clock = ManualClock::new();
    let store = MemoryGlobalStore::with_clock(clock.clone());
    hierarchical_throttle::global::conformance::assert_conformance(&store, &clock).await;
}

#[tokio::test(flavor = "current_thread")]
async fn a_quota_of_15_restoring_1_every_2_minutes_answers_the_16th_with_120_s() {
    // Amazon MWS's example: 25 submissions at once get 15 through; the rest must wait, and the
    // next is due in 2 minutes, exactly.
    let clock = ManualClock::new();
    let quota = Limit::per(1, Duration::from_secs(120)).burst(15).unwrap();
    let layer = host_builder(&clock, quota)
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    let host = tower::Layer::layer(&layer, backend());
    let outcomes = futures_util::future::join_all((0..25).map(|_| {
        let mut host = host.clone();
        tokio::spawn(async move { send(&mut host, "seller", 1).await })
    }))
    .await;
    let outcomes: Vec<_> = outcomes.into_iter().map(Result::unwrap).collect();
    let refused = Outcome::Refused(RejectionReason::Throttled, Some(Duration::from_secs(120)));
    assert_eq!(
        outcomes.iter().filter(|o| **o == Outcome::Served).count(),
        15
    );
    assert_eq!(outcomes.iter().filter(|o| **o == refused).count(), 10);
    let mut host = host.clone();
    clock.advance(Duration::from_secs(119));
    assert_eq!(
        send(&mut host, "seller", 1).await,
        Outcome::Refused(RejectionReason::Throttled, Some(Duration::from_secs(1)))
    );
    clock.advance(Duration::from_secs(1));
    assert_eq!(send(&mut host, "seller", 1).await, Outcome::Served);
    assert_eq!(send(&mut host, "seller", 1).await, refused);
}

#[tokio::test(flavor = "current_thread")]
async fn a_request_that_conforms_after_a_burst_is_admitted() {
    // 10 per second, burst 10: ten at t = 0 empty the bucket; a token is there at 100 ms.
    let clock = ManualClock::new();
    let limit = Limit::per_second(10).burst(10).unwrap();
    let layer = host_builder(&clock, limit)
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    let mut host = tower::Layer::layer(&layer, backend());
    for _ in 0..10 {
        assert_eq!(send(&mut host, "k", 1).await, Outcome::Served);
    }
    clock.set(Duration::from_millis(99));
    assert_eq!(
        send(&mut host, "k", 1).await,
        Outcome::Refused(RejectionReason::Throttled, Some(Duration::from_millis(1)))
    );
    clock.set(Duration::from_millis(100));
    assert_eq!(send(&mut host, "k", 1).await, Outcome::Served);
}

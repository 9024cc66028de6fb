//! What tasks, runtimes, user closures and failing stores can do to a key, and what they must
//! not: a key is never wedged, a sweeper never stays dead, a failure window is one back-off
//! step, a hand-back is never lost to an open circuit, and a slow store never hands a request
//! to the failure policy.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::*;
use futures_util::FutureExt;
use futures_util::future::join_all;
use hierarchical_throttle::batch::{BatchContext, FractionOfCapacity};
use hierarchical_throttle::clock::{ManualClock, TokioClock};
use hierarchical_throttle::local::LocalStore;
use hierarchical_throttle::{ColdStart, FailurePolicy, Limit, MemoryGlobalStore, RejectionReason};
use std::convert::Infallible;
use tower::{Layer, Service};

/// A host limited to 10/s (burst 10) on a faulty memory store, and that store.
fn host_on_a_faulty_store(
    cold_start: ColdStart,
) -> (
    FaultyStore<MemoryGlobalStore<String, ManualClock>>,
    impl Service<Job, Response = Outcome, Error = Infallible, Future: Send> + Clone,
) {
    let clock = ManualClock::new();
    let store = FaultyStore::new(MemoryGlobalStore::with_clock(clock.clone()));
    let layer = host_builder(&clock, Limit::per_second(10).burst(10).unwrap())
        .cold_start(cold_start)
        .global_store(store.clone())
        .build()
        .unwrap();
    (store, layer.layer(backend()))
}

#[test]
fn a_fetch_whose_runtime_is_dropped_leaves_its_key_usable() {
    let (store, host) = host_on_a_faulty_store(ColdStart::Exact);
    store.set(Fault::Hang);

    let first = paused_runtime();
    first.block_on(async {
        let mut waiting = host.clone();
        tokio::spawn(async move { send(&mut waiting, "k", 1).await });
        settle_background().await;
    });
    assert_eq!(store.acquire_count(), 1, "the fetch was under way");
    drop(first);

    store.set(Fault::None);
    paused_runtime().block_on(async {
        let mut host = host.clone();
        let answer = tokio::time::timeout(Duration::from_secs(1), send(&mut host, "k", 1)).await;
        assert_eq!(answer, Ok(Outcome::Served), "a new fetch serves the key");
    });
    assert_eq!(store.acquire_count(), 2);
}

#[test]
fn calls_lingering_when_their_runtime_is_dropped_leave_the_queue_usable() {
    let (store, host) = host_on_a_faulty_store(ColdStart::default());

    let first = paused_runtime();
    first.block_on(async {
        let mut host = host.clone();
        assert_eq!(send(&mut host, "a", 1).await, Outcome::Served, "on credit");
        settle_background().await;
    });
    assert_eq!(store.acquire_count(), 0, "its fetch lingers (250 ms)");
    drop(first);

    paused_runtime().block_on(async {
        // Past the time the dropped flush was due.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut host = host.clone();
        let answer = tokio::time::timeout(Duration::from_secs(1), send(&mut host, "b", 5)).await;
        assert_eq!(
            answer,
            Ok(Outcome::Served),
            "a request over its credit is fetched for"
        );
    });
    assert_eq!(
        store.acquire_count(),
        1,
        "the dropped runtime's call was never sent"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn a_limit_closure_that_panics_in_a_fetch_costs_only_its_requests() {
    let clock = ManualClock::new();
    let panic_in_fetch = Arc::new(AtomicBool::new(false));
    let calls = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (armed, counted) = (panic_in_fetch.clone(), calls.clone());
    let limit = Limit::per_second(10).burst(10).unwrap();
    let layer = host_builder(&clock, limit)
        // The first call is the request's own; the second is the fetch's.
        .limit_per_key(move |_: &String| {
            let n = counted.fetch_add(1, Ordering::SeqCst);
            if armed.load(Ordering::SeqCst) && n % 2 == 1 {
                panic!("limit lookup failed");
            }
            limit
        })
        .failure_policy(FailurePolicy::Reject)
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    let mut host = layer.layer(backend());
    panic_in_fetch.store(true, Ordering::SeqCst);
    assert!(matches!(
        send(&mut host, "k", 1).await,
        Outcome::Refused(RejectionReason::StoreUnavailable, _)
    ));
    panic_in_fetch.store(false, Ordering::SeqCst);
    assert_eq!(send(&mut host, "k", 1).await, Outcome::Served);
}

#[tokio::test(flavor = "current_thread")]
async fn a_batch_policy_that_panics_asks_for_what_the_waiters_need() {
    let clock = ManualClock::new();
    let store = FaultyStore::new(MemoryGlobalStore::with_clock(clock.clone()));
    let layer = host_builder(&clock, Limit::per_second(10).burst(10).unwrap())
        .batch_policy(|_: &BatchContext<'_>| -> u64 { panic!("bad policy") })
        .global_store(store.clone())
        .build()
        .unwrap();
    let mut host = layer.layer(backend());
    assert_eq!(send(&mut host, "k", 3).await, Outcome::Served);
    assert_eq!(store.acquires.lock().unwrap()[0].want, 3);
}

#[test]
fn the_sweeper_starts_again_on_a_later_runtime() {
    // Refilled slowly: a lease the bucket had refilled around would be forfeited, not sent.
    let limit = Limit::per(100, Duration::from_secs(3_600))
        .burst(100)
        .unwrap();
    // Created outside any runtime: its origin comes before both runtimes' time.
    let clock = TokioClock::new();
    let clock_origin = paused_runtime();
    let layer = host_builder(&ManualClock::new(), limit)
        .clock(clock)
        .batch_policy(|_: &BatchContext<'_>| 10)
        .lease_ttl(Duration::from_millis(100))
        .global_store(MemoryGlobalStore::with_clock(clock))
        .build()
        .unwrap();
    let host = layer.layer(backend());
    clock_origin.block_on(async {
        let mut host = host.clone();
        assert_eq!(send(&mut host, "a", 1).await, Outcome::Served);
    });
    drop(clock_origin);

    paused_runtime().block_on(async {
        let mut host = host.clone();
        assert_eq!(send(&mut host, "b", 1).await, Outcome::Served);
        let mut leased = 0;
        layer
            .local_store()
            .for_each_bucket(|_, b| leased += b.leased_tokens());
        assert!(leased > 0);
        // Nobody calls return_unused_leases: the new sweeper does, within a sweep of the time a
        // small lease may be kept (ten lease times), and the hand-back of a key far from its
        // limit lingers 250 ms (the default) for a batch.
        tokio::time::sleep(Duration::from_millis(1_100 + 250)).await;
        assert!(
            layer.stats().tokens_returned >= leased,
            "stats {:?}",
            layer.stats()
        );
    });
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn twenty_simultaneous_time_outs_are_one_back_off_step() {
    let clock = ManualClock::new();
    let store = FaultyStore::new(MemoryGlobalStore::with_clock(clock.clone()));
    store.set(Fault::Hang);
    let layer = host_builder(&clock, Limit::per_second(10).burst(10).unwrap())
        .failure_policy(FailurePolicy::Admit)
        .store_timeout(Duration::from_millis(30))
        .global_store(store.clone())
        .build()
        .unwrap();
    let host = layer.layer(backend());
    let keys: Vec<String> = (0..20).map(|i| format!("k{i}")).collect();
    join_all(keys.iter().map(|k| {
        let mut host = host.clone();
        async move { send(&mut host, k, 1).await }
    }))
    .await;
    assert_eq!(layer.stats().global_timeouts, 20);
    store.set(Fault::None);
    // One step: the store is probed again after the first back-off (50 ms), not after 2^20.
    clock.advance(Duration::from_millis(49));
    let mut h = host.clone();
    assert_eq!(send(&mut h, "probe", 1).await, Outcome::Served);
    assert_eq!(store.acquire_count(), 20, "no call inside the back-off");
    clock.advance(Duration::from_millis(1));
    assert_eq!(send(&mut h, "probe-2", 1).await, Outcome::Served);
    assert_eq!(store.acquire_count(), 21, "the probe after one step");
}

#[tokio::test(flavor = "current_thread")]
async fn hand_backs_wait_out_a_failing_store_and_are_not_lost() {
    let clock = ManualClock::new();
    let store = FaultyStore::new(MemoryGlobalStore::with_clock(clock.clone()));
    // Refilled slowly: a lease the bucket had refilled around would be forfeited, not sent.
    let slowly_refilled = Limit::per(100, Duration::from_secs(3_600))
        .burst(100)
        .unwrap();
    let layer = host_builder(&clock, slowly_refilled)
        .batch_policy(|_: &BatchContext<'_>| 10)
        .global_store(store.clone())
        .build()
        .unwrap();
    let mut host = layer.layer(backend());
    assert_eq!(send(&mut host, "k", 1).await, Outcome::Served);
    store.set(Fault::Error);
    // Past the lease time-to-live, and the ten a small lease may be kept for.
    clock.advance(Duration::from_secs(21));
    layer.return_unused_leases().await;
    let stats = layer.stats();
    assert_eq!((stats.tokens_returned, stats.tokens_lost), (0, 0));
    // The circuit is open: the next sweep does not call the store at all.
    layer.return_unused_leases().await;
    store.set(Fault::None);
    clock.advance(Duration::from_secs(1));
    layer.return_unused_leases().await;
    assert_eq!(layer.stats().tokens_returned, 9);
    assert_eq!(store.releases.load(Ordering::SeqCst), 9);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_store_slower_than_its_answers_need_never_hands_a_request_to_the_policy() {
    let clock = ManualClock::new();
    let store = FaultyStore::new(MemoryGlobalStore::with_clock(clock.clone()));
    store.delay(Duration::from_millis(45));
    let layer = host_builder(&clock, Limit::per_hour(500).burst(500).unwrap())
        .store_timeout(Duration::from_millis(50))
        .failure_policy(FailurePolicy::Admit)
        .global_store(store.clone())
        .build()
        .unwrap();
    let host = layer.layer(backend());
    // A thousand concurrent requests on a cold key: exactly the capacity is admitted, the rest
    // refused with the time the next token is due (7.2 s), none by the failure policy.
    let outcomes = join_all((0..1000).map(|_| {
        let mut host = host.clone();
        tokio::spawn(async move { send(&mut host, "cold", 1).await })
    }))
    .await;
    let served = outcomes
        .iter()
        .filter(|o| matches!(o, Ok(Outcome::Served)))
        .count();
    let refused = outcomes
        .iter()
        .filter(|o| {
            matches!(o, Ok(Outcome::Refused(RejectionReason::Throttled, Some(wait)))
                if *wait == Duration::from_millis(7_200))
        })
        .count();
    assert_eq!((served, refused), (500, 500));
    assert_eq!(layer.stats().fallback_decisions, 0);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn ten_thousand_waiters_on_one_key_are_each_decided_once() {
    let clock = ManualClock::new();
    let store = FaultyStore::new(MemoryGlobalStore::with_clock(clock.clone()));
    store.delay(Duration::from_millis(10));
    let layer = host_builder(&clock, Limit::per_second(3_000).burst(3_000).unwrap())
        .global_store(store.clone())
        .build()
        .unwrap();
    let host = layer.layer(backend());
    let outcomes = join_all((0..10_000).map(|_| {
        let mut host = host.clone();
        tokio::spawn(async move { send(&mut host, "hot", 1).await })
    }))
    .await;
    let served = outcomes
        .iter()
        .filter(|o| matches!(o, Ok(Outcome::Served)))
        .count();
    assert_eq!(served, 3_000);
    assert!(
        store.acquire_count() <= 3,
        "{} calls",
        store.acquire_count()
    );
    assert_eq!(layer.stats().fallback_decisions, 0);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_memory_store_forgets_refilled_buckets_without_traffic() {
    let clock = TokioClock::new();
    let global = MemoryGlobalStore::with_clock(clock);
    let layer = host_builder(
        &ManualClock::new(),
        Limit::per_second(10).burst(10).unwrap(),
    )
    .clock(clock)
    .global_store(global.clone())
    .build()
    .unwrap();
    for i in 0..10_000u64 {
        assert!(layer.acquire(format!("flood-{i}"), 1).await.is_ok());
    }
    assert_eq!(global.len(), 10_000);
    // No more requests: the sweeper hands the leases back and the store forgets the buckets
    // once they have refilled.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(global.len(), 0);
}

/// A pass over a large local store (10,000 keys here) gives its thread up between parts of a
/// few hundred keys, so the requests queued on that thread are not held up for the whole
/// pass, and still visits every key; a pass dropped between parts loses no token.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_pass_over_many_keys_yields_between_parts_and_loses_nothing_when_dropped() {
    let (clock, layer) = host_holding_leases(10_000).await;
    // Nine tokens of each key's batch of ten stay on the host.
    let mut leased = 0;
    layer
        .local_store()
        .for_each_bucket(|_, b| leased += b.leased_tokens());
    assert_eq!(leased, 90_000);
    // Nothing to hand back yet: only the pass itself can give the thread up.
    let yields = times_pending(layer.return_unused_leases()).await;
    assert!(
        (20..=40).contains(&yields),
        "{yields} yields over 10,000 keys"
    );
    assert_eq!(layer.stats().tokens_returned, 0);
    // Past every lease's time: a pass dropped after its first part (its task gone) keeps what
    // it took out of leases for the next, which hands every token back.
    clock.advance(Duration::from_secs(3_600));
    assert!(layer.return_unused_leases().now_or_never().is_none());
    layer.return_unused_leases().await;
    assert_eq!(layer.stats().tokens_returned, leased);
    assert_eq!(layer.stats().tokens_lost, 0);
}

/// A pass dropped while its hand-backs wait in the call queue (they linger for a batch) leaves
/// every token accounted for: those may yet reach the store, so they are counted as lost
/// (never sent again), and the rest come back with the next pass.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_pass_dropped_during_its_hand_backs_accounts_for_every_token() {
    let (clock, layer) = host_holding_leases(2_000).await;
    clock.advance(Duration::from_secs(3_600));
    {
        // Polled until its parts are done and its hand-backs wait for their batch's linger.
        let mut pass = std::pin::pin!(layer.return_unused_leases());
        let mut context = std::task::Context::from_waker(std::task::Waker::noop());
        for _ in 0..100 {
            assert!(pass.as_mut().poll(&mut context).is_pending());
        }
    }
    let dropped = layer.stats();
    assert!(dropped.tokens_lost > 0, "{dropped:?}");
    layer.return_unused_leases().await;
    let stats = layer.stats();
    assert_eq!(
        stats.tokens_returned + stats.tokens_lost,
        18_000,
        "{stats:?}"
    );
}

/// A host whose `keys` keys each hold a lease of nine tokens (a batch of ten, one used), on a
/// manual clock.
async fn host_holding_leases(keys: u64) -> (ManualClock, HostLayer) {
    let clock = ManualClock::new();
    let global = MemoryGlobalStore::with_clock(clock.clone());
    let layer = host_builder(&clock, Limit::per_second(10).burst(10).unwrap())
        .batch_policy(FractionOfCapacity::new(1.0).unwrap())
        .global_store(global)
        .build()
        .unwrap();
    for i in 0..keys {
        assert!(layer.acquire(format!("key-{i}"), 1).await.is_ok());
    }
    (clock, layer)
}

/// How many times `future` returned pending before it finished.
async fn times_pending(future: impl std::future::Future<Output = ()>) -> usize {
    let mut future = std::pin::pin!(future);
    let mut pending = 0;
    std::future::poll_fn(|cx| {
        let polled = future.as_mut().poll(cx);
        pending += usize::from(polled.is_pending());
        polled
    })
    .await;
    pending
}

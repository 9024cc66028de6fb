//! Changes made by hand to a key's global buckets, through the layer: a reset lifts a block on
//! every host (at once on the host that made it, within a lease time-to-live on the others,
//! even those refusing the key from what they last heard), a drain stops the key at once on
//! the host that made it (its leased tokens revoked), tokens added and removed; on memory and
//! on a real Redis.

mod common;

use std::time::Duration;

use common::levels::{call, router, user};
use common::redis_server::RedisServer;
use hierarchical_throttle::batch::FractionOfCapacity;
use hierarchical_throttle::clock::ManualClock;
use hierarchical_throttle::global::{Adjustment, GlobalStore};
use hierarchical_throttle::local::LocalStore;
use hierarchical_throttle::quota::{BucketKey, LeaseKey};
use hierarchical_throttle::{
    ColdStart, HierarchicalThrottleLayer, Limit, MemoryGlobalStore, StoreError,
};
use http::StatusCode;

/// 10 a minute, a token every 6 s.
fn limit() -> Limit {
    Limit::per_minute(10).build().unwrap()
}

async fn status(app: &axum::Router) -> StatusCode {
    call(app, "/", "u1", None).await.status()
}

async fn statuses(app: &axum::Router, n: usize) -> Vec<StatusCode> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(status(app).await);
    }
    out
}

/// Two hosts on `global`: a reset reaches both, a drain stops the key, tokens are added and
/// removed exactly.
async fn adjustments_reach_the_fleet<G>(global: G, clock: &ManualClock)
where
    G: GlobalStore<BucketKey<String>> + Clone,
{
    let host = || {
        HierarchicalThrottleLayer::builder()
            .cold_start(ColdStart::Exact)
            .key(user)
            .clock(clock.clone())
            .limit(limit())
            .global_store(global.clone())
            .build()
            .unwrap()
    };
    let (a, b) = (host(), host());
    let (app_a, app_b) = (router().layer(a.clone()), router().layer(b.clone()));
    // Host b spends the minute's 10; both then refuse, remembering the key as short for 6 s.
    assert!(
        statuses(&app_b, 10)
            .await
            .iter()
            .all(|s| *s == StatusCode::OK)
    );
    assert_eq!(status(&app_a).await, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(status(&app_b).await, StatusCode::TOO_MANY_REQUESTS);

    // Host a resets the key: it serves at once.
    let after = a.adjust("u1", Adjustment::Reset).await.unwrap();
    assert_eq!(after[0].tokens, 10);
    assert_eq!(status(&app_a).await, StatusCode::OK);
    // Host b still refuses from what it last heard, and asks again within a lease TTL (2 s),
    // long before the 6 s it was told.
    clock.advance(Duration::from_millis(1_900));
    assert_eq!(status(&app_b).await, StatusCode::TOO_MANY_REQUESTS);
    clock.advance(Duration::from_millis(100));
    assert_eq!(status(&app_b).await, StatusCode::OK);

    // Host b, which leased what was left of the reset, drains the key: its lease is revoked,
    // it refuses at once, and the next token is a whole interval away.
    let leased = || {
        let id = LeaseKey::new("u1".to_owned(), 0, 0);
        b.local_store()
            .peek_bucket(&id, |bucket| bucket.leased_tokens())
    };
    let held = leased().unwrap();
    assert!(held > 0, "host b holds a lease");
    let after = b.adjust("u1", Adjustment::Drain).await.unwrap();
    assert_eq!(
        (after[0].tokens, after[0].next_in),
        (0, Duration::from_secs(6))
    );
    assert_eq!(leased(), Some(0));
    assert_eq!(b.stats().tokens_forfeited, held);
    let refused = b.acquire("u1".to_owned(), 1).await.unwrap_err();
    assert_eq!(refused.retry_after, Some(Duration::from_secs(6)));

    // Three added by hand: host a, which holds none, asks for them: three served, then none.
    let after = a.adjust("u1", Adjustment::Add(3)).await.unwrap();
    assert_eq!(after[0].tokens, 3);
    assert_eq!(
        statuses(&app_a, 4).await,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );
    // Fifteen removed from none: debt down to its floor, a capacity, so the bucket is full
    // again after twenty tokens' refill (120 s).
    let after = a.adjust("u1", Adjustment::Remove(15)).await.unwrap();
    assert_eq!(
        (after[0].tokens, after[0].full_in),
        (0, Duration::from_secs(120))
    );
}

#[tokio::test]
async fn adjustments_reach_every_host_on_memory() {
    let clock = ManualClock::new();
    let global = MemoryGlobalStore::with_clock(clock.clone());
    adjustments_reach_the_fleet(global, &clock).await;
}

#[tokio::test]
async fn adjustments_reach_every_host_on_redis() {
    let server = RedisServer::start();
    let clock = ManualClock::new();
    let global = server.store_on(&clock).await;
    adjustments_reach_the_fleet(global, &clock).await;
}

#[tokio::test]
async fn a_longer_refusal_memory_asks_less_often_and_a_reset_takes_longer_to_arrive() {
    let clock = ManualClock::new();
    let global = MemoryGlobalStore::with_clock(clock.clone());
    let host = |memory| {
        HierarchicalThrottleLayer::builder()
            .cold_start(ColdStart::Exact)
            .key(user)
            .clock(clock.clone())
            .limit(limit())
            .refusal_memory(memory)
            .global_store(global.clone())
            .build()
            .unwrap()
    };
    let (a, b) = (host(Duration::from_secs(2)), host(Duration::from_secs(4)));
    let app_b = router().layer(b.clone());
    assert!(
        statuses(&app_b, 11).await[..10]
            .iter()
            .all(|s| *s == StatusCode::OK)
    );
    let calls = b.stats().global_calls;
    a.adjust("u1", Adjustment::Reset).await.unwrap();
    clock.advance(Duration::from_millis(3_999));
    assert_eq!(status(&app_b).await, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(b.stats().global_calls, calls, "no call while it remembers");
    clock.advance(Duration::from_millis(1));
    assert_eq!(status(&app_b).await, StatusCode::OK);
    // Out of range: an error at build, naming the setting.
    let error = HierarchicalThrottleLayer::builder()
        .key(user)
        .limit(limit())
        .refusal_memory(Duration::ZERO)
        .global_store(MemoryGlobalStore::new())
        .build()
        .unwrap_err();
    assert!(error.to_string().contains("refusal_memory"), "{error}");
}

#[tokio::test]
async fn a_store_error_is_the_adjustments_answer_and_changes_nothing_here() {
    let clock = ManualClock::new();
    let store = common::FaultyStore::new(MemoryGlobalStore::with_clock(clock.clone()));
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(ColdStart::Exact)
        .key(|k: &String| Some(k.clone()))
        .clock(clock.clone())
        .limit(limit())
        // The whole bucket in one batch: the host holds a lease to revoke.
        .batch_policy(FractionOfCapacity::new(1.0).unwrap())
        .global_store(store.clone())
        .build()
        .unwrap();
    assert!(layer.acquire("u1".to_owned(), 1).await.is_ok());
    let leased = || {
        let id = LeaseKey::new("u1".to_owned(), 0, 0);
        layer.local_store().peek_bucket(&id, |b| b.leased_tokens())
    };
    let (held, level) = (leased(), layer.remaining_global("u1").await.unwrap());
    assert_eq!(held, Some(9));
    store.set(common::Fault::Error);
    assert!(layer.adjust("u1", Adjustment::Drain).await.is_err());
    // Through the type-erased handle too, the store's error boxed.
    let error = layer
        .handle()
        .adjust("u1".to_owned(), Adjustment::Drain)
        .await
        .unwrap_err();
    let error = error.downcast_ref::<StoreError<common::StoreDown>>();
    assert!(matches!(error, Some(StoreError::Store(_))), "{error:?}");
    store.set(common::Fault::None);
    assert_eq!(leased(), held, "the lease is not revoked");
    assert_eq!(layer.remaining_global("u1").await.unwrap(), level);
    let after = layer
        .handle()
        .adjust("u1".to_owned(), Adjustment::Drain)
        .await
        .unwrap();
    assert_eq!(after[0].tokens, 0);
    assert_eq!(
        leased(),
        Some(0),
        "drained through the handle: the lease revoked"
    );
}

/// A change by hand whose answer comes after the key's limit changed tells of the old limit:
/// the host, which meanwhile asked the store under the new one, does not refuse from it.
#[tokio::test(start_paused = true)]
async fn an_adjustment_answered_after_a_limit_change_does_not_throttle_under_the_new_limit() {
    use std::sync::{Arc, Mutex};

    use hierarchical_throttle::batch::{BatchContext, BatchPolicy};

    /// Batches of what the waiting requests need: the lease is empty after each.
    struct Needed;
    impl BatchPolicy for Needed {
        fn batch_size(&self, cx: &BatchContext<'_>) -> u64 {
            cx.needed
        }
    }

    let clock = ManualClock::new();
    let memory = MemoryGlobalStore::with_clock(clock.clone());
    let store = common::FaultyStore::new(memory.clone());
    store.delay_adjust_answers(Duration::from_millis(10));
    let old = Limit::per_second(100).burst(100).unwrap(); // a token every 10 ms
    let new = Limit::per_second(10_000).burst(100).unwrap(); // a token every 100 us
    let current = Arc::new(Mutex::new(old));
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(ColdStart::Exact)
        .key(|key: &String| Some(key.clone()))
        .clock(clock.clone())
        .batch_policy(Needed)
        .limit_per_key({
            let current = current.clone();
            move |_: &String| *current.lock().unwrap()
        })
        .global_store(store)
        .build()
        .unwrap();
    let key = || "k".to_owned();
    let bucket = BucketKey::new(key(), "default").unwrap();
    assert!(layer.acquire(key(), 1).await.is_ok());

    // 150 taken by hand from the 99 left: 51 owed under the old limit. Its answer is held.
    let adjusting = tokio::spawn({
        let layer = layer.clone();
        async move { layer.adjust("k", Adjustment::Remove(150)).await }
    });
    while memory.peek(&bucket, &old).owed() == 0 {
        tokio::task::yield_now().await;
    }
    // Raised: the store keeps the debt of 51 and refills it at the new rate, 100 tokens in
    // 10 ms; the host learns the new limit at its next request, which the store serves.
    *current.lock().unwrap() = new;
    let refused = layer.acquire(key(), 1).await.unwrap_err();
    assert_eq!(refused.retry_after, Some(Duration::from_micros(5_200)));
    clock.advance(Duration::from_millis(10));
    assert!(layer.acquire(key(), 1).await.is_ok());
    assert_eq!(memory.peek(&bucket, &new).tokens(), 48);
    // The answer lands: it said the bucket was short for 510 ms, under the old limit.
    let after = adjusting.await.unwrap().unwrap();
    assert_eq!(after[0].tokens, 0);
    // The host asks the store again rather than refuse from it.
    assert!(layer.acquire(key(), 1).await.is_ok());
    assert_eq!(memory.peek(&bucket, &new).tokens(), 47);
}

#[tokio::test(start_paused = true)]
async fn an_operator_s_call_to_a_stalled_store_ends_at_the_store_time_out() {
    let clock = ManualClock::new();
    let memory = MemoryGlobalStore::with_clock(clock.clone());
    let store = common::FaultyStore::new(memory.clone());
    // The store works, but its answers come a minute late.
    store.delay_adjust_answers(Duration::from_secs(60));
    let timeout = Duration::from_millis(80);
    let layer = HierarchicalThrottleLayer::builder()
        .key(|key: &String| Some(key.clone()))
        .clock(clock.clone())
        .limit(Limit::per_second(10).burst(10).unwrap())
        .store_timeout(timeout)
        .global_store(store)
        .build()
        .unwrap();
    let started = tokio::time::Instant::now();
    let drained = layer.adjust("k", Adjustment::Drain).await;
    assert!(
        matches!(drained, Err(StoreError::TimedOut(t)) if t == timeout),
        "{drained:?}"
    );
    assert_eq!(
        started.elapsed(),
        timeout,
        "given up at the time-out, not later"
    );
    // The change was made all the same (the call reached the store, its answer did not).
    let bucket = BucketKey::new("k".to_owned(), "default").unwrap();
    let limit = Limit::per_second(10).burst(10).unwrap();
    assert_eq!(memory.peek(&bucket, &limit).tokens(), 0);
    let started = tokio::time::Instant::now();
    let read = layer.remaining_global("k").await;
    assert!(matches!(read, Err(StoreError::TimedOut(_))), "{read:?}");
    assert_eq!(started.elapsed(), timeout);
    let error = read.unwrap_err().to_string();
    assert_eq!(error, "the global store did not answer within 80ms");
}

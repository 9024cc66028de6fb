//! A healthy store slower than a token interval, on tokio's paused time: tokens reserved ahead
//! are used as each falls due (a later reservation never delays an earlier one), so the fleet
//! uses its allowance at saturation; and a lease nothing uses goes back within its time to
//! live, even while its host keeps reserving.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::FaultyStore;
use hierarchical_throttle::clock::TokioClock;
use hierarchical_throttle::{
    ColdStart, HierarchicalThrottleLayer, Limit, MemoryGlobalStore, RejectionReason, Shaping,
};
use tokio::time::Instant;

#[tokio::test(start_paused = true)]
async fn a_slow_healthy_store_lets_a_saturated_fleet_use_its_allowance() {
    let store = FaultyStore::new(MemoryGlobalStore::with_clock(TokioClock::new()));
    // 20 to 40 ms a call: two to four token intervals of a 100/s limit.
    store.delay_between(Duration::from_millis(20), Duration::from_millis(40));
    let limit = Limit::per_second(100).burst(100).unwrap();
    let hosts: Vec<_> = (0..3)
        .map(|_| {
            HierarchicalThrottleLayer::builder()
                .key(|k: &String| Some(k.clone()))
                .limit(limit)
                .clock(TokioClock::new())
                .store_timeout(Duration::from_millis(100))
                .global_store(store.clone())
                .build()
                .unwrap()
        })
        .collect();
    let admitted = Arc::new(AtomicU64::new(0));
    let end = Instant::now() + Duration::from_secs(3);
    let mut tasks = tokio::task::JoinSet::new();
    for host in &hosts {
        for _ in 0..30 {
            let (host, admitted) = (host.clone(), admitted.clone());
            // A closed loop of clients that do not read `Retry-After`: each tries again 2 ms
            // after a refusal, so requests also come while reserved tokens are not yet due.
            tasks.spawn(async move {
                while Instant::now() < end {
                    match host.acquire("k".to_owned(), 1).await {
                        Ok(_) if Instant::now() < end => {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(_) => {}
                        Err(_) => tokio::time::sleep(Duration::from_millis(2)).await,
                    }
                }
            });
        }
    }
    while tasks.join_next().await.is_some() {}
    // The allowance over 3 s: a burst of 100 and 100 a second, and a token of credit per host.
    let admitted = admitted.load(Ordering::Relaxed);
    let bound = 400 + 3 * ColdStart::default().credit(&limit);
    assert!(admitted <= bound, "over the allowance: {admitted}");
    assert!(
        admitted >= 360,
        "under 90% of the allowance: {admitted} of 400"
    );
}

#[tokio::test(start_paused = true)]
async fn partial_leases_go_back_while_their_hosts_keep_reserving() {
    // An LLM-style budget: calls cost 1,000, the budget refills 1,000 a minute. Two hosts hold
    // parts of it; neither part serves a call alone.
    let global = MemoryGlobalStore::with_clock(TokioClock::new());
    let limit = Limit::per_minute(1_000).burst(1_000).unwrap();
    let host = || {
        HierarchicalThrottleLayer::builder()
            .key(|k: &String| Some(k.clone()))
            .limit(limit)
            .clock(TokioClock::new())
            .lease_ttl(Duration::from_secs(2))
            .global_store(global.clone())
            .build()
            .unwrap()
    };
    let (a, b) = (host(), host());
    // Both spend 450 in small steps, then each wants 1,000 at once, again and again.
    for _ in 0..45 {
        assert!(a.acquire("k".to_owned(), 10).await.is_ok());
        assert!(b.acquire("k".to_owned(), 10).await.is_ok());
    }
    let start = Instant::now();
    let mut served_at = None;
    while start.elapsed() < Duration::from_secs(120) && served_at.is_none() {
        for host in [&a, &b] {
            if host.acquire("k".to_owned(), 1_000).await.is_ok() {
                served_at = Some(start.elapsed());
            }
            host.return_unused_leases().await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // 54 s refill the 900 spent; the leases unused for their 2 s go back meanwhile, so the
    // whole budget is in one place once it has refilled.
    let served_at = served_at.expect("a 1,000-token call is served");
    assert!(
        served_at <= Duration::from_secs(56),
        "served at {served_at:?}"
    );
    assert!(a.stats().tokens_returned + b.stats().tokens_returned > 0);
}

#[tokio::test(start_paused = true)]
async fn a_shaped_wait_counts_from_the_arrival_so_a_slow_batch_is_part_of_it() {
    // One token a second; every answer 80 ms late. Requests may wait 900 ms.
    let store = FaultyStore::new(MemoryGlobalStore::with_clock(TokioClock::new()));
    store.delay(Duration::from_millis(80));
    let host = || {
        HierarchicalThrottleLayer::builder()
            .key(|k: &String| Some(k.clone()))
            .limit(Limit::per_second(1).burst(1).unwrap())
            .cold_start(ColdStart::Exact)
            .shaping(Shaping::wait(Duration::from_millis(900)))
            .clock(TokioClock::new())
            .store_timeout(Duration::from_secs(1))
            .global_store(store.clone())
            .build()
            .unwrap()
    };
    let (a, b) = (host(), host());
    // Host a takes the bucket's token.
    assert!(a.acquire("k".to_owned(), 1).await.is_ok());
    // Host b learns after its batch (80 ms) that the next token is due 840 ms later (a second
    // after the bucket's answer to a, counted from when b asked): 920 ms after its request's
    // arrival, past its 900 ms, so it is refused then rather than kept past its wait.
    let arrived = Instant::now();
    let refusal = b
        .acquire("k".to_owned(), 1)
        .await
        .map(|admitted| panic!("admitted {admitted:?} after {:?}", arrived.elapsed()))
        .unwrap_err();
    assert_eq!(arrived.elapsed(), Duration::from_millis(80));
    assert_eq!(refusal.reason, RejectionReason::Throttled);
    assert_eq!(refusal.retry_after, Some(Duration::from_millis(840)));
}

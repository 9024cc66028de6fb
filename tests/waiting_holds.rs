//! Tokens a request takes from one of its key's leases while it waits for another limit's
//! batch. They have left the lease but are not spent until the request is admitted, and the
//! global bucket refills around them meanwhile, as around the lease's own tokens: unless they
//! count as held, a burst after the request is admitted gets that refill on top of them.

use std::time::Duration;

use hierarchical_throttle::clock::TokioClock;
use hierarchical_throttle::{ColdStart, HierarchicalThrottleLayer, Limit, MemoryLocalStore, Quota};
use tokio::sync::watch;
use tokio::task::JoinHandle;

mod common;
use common::held_back::HeldBack;

const CAPACITY: u64 = 10;

type Layer =
    HierarchicalThrottleLayer<String, String, HeldBack, MemoryLocalStore<String>, TokioClock>;

/// A layer whose keys have a limit of [`CAPACITY`] a second and a limit whose fetches wait
/// for the gate; its leases are swept every 100 ms.
fn layer() -> (Layer, watch::Sender<bool>) {
    let quota = Quota::new(
        "first",
        Limit::per_second(CAPACITY).burst(CAPACITY).unwrap(),
    )
    .unwrap()
    .and("gated", Limit::per_second(1_000).burst(1_000).unwrap())
    .unwrap();
    let (store, gate) = HeldBack::gated("gated");
    let layer = HierarchicalThrottleLayer::builder()
        .key(|key: &String| Some(key.clone()))
        .clock(TokioClock::new())
        .quota(quota)
        .cold_start(ColdStart::Exact)
        .store_timeout(Duration::from_secs(5))
        .lease_ttl(Duration::from_millis(200))
        .global_store(store)
        .build()
        .unwrap();
    (layer, gate)
}

/// [`CAPACITY`] requests for "k" that take the first limit's whole bucket and wait for the
/// gated limit's batch for a second, over several sweeps, while the first limit's global
/// bucket refills.
async fn waiting_a_second(layer: &Layer) -> Vec<JoinHandle<bool>> {
    let waiting = (0..CAPACITY)
        .map(|_| {
            let request = layer.acquire("k".to_owned(), 1);
            tokio::spawn(async move { request.await.is_ok() })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(1)).await;
    waiting
}

/// How many of `requests` requests for "k", sent at once, are admitted.
async fn burst(layer: &Layer, requests: u64) -> u64 {
    let decided =
        futures_util::future::join_all((0..requests).map(|_| layer.acquire("k".to_owned(), 1)))
            .await;
    decided.iter().filter(|d| d.is_ok()).count() as u64
}

#[tokio::test(start_paused = true)]
async fn tokens_held_by_requests_waiting_for_another_limit_are_not_spent_twice() {
    let (layer, gate) = layer();
    let waiting = waiting_a_second(&layer).await;
    gate.send_replace(true);
    let mut admitted = 0;
    for decided in futures_util::future::join_all(waiting).await {
        admitted += u64::from(decided.unwrap());
    }
    // A burst right after they are admitted: the first limit's bucket refilled around the
    // ten, which are spent now. Before they counted as held, the burst got 10 more in the
    // same instant.
    let right_after = burst(&layer, CAPACITY).await;
    // Spent, they are held no more: two seconds on, the bucket serves its capacity again.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let later = burst(&layer, CAPACITY).await;
    assert_eq!((admitted, right_after, later), (CAPACITY, 0, CAPACITY));
}

#[tokio::test(start_paused = true)]
async fn requests_gone_while_waiting_for_another_limit_hold_nothing() {
    let (layer, gate) = layer();
    let waiting = waiting_a_second(&layer).await;
    for request in &waiting {
        request.abort();
    }
    for gone in futures_util::future::join_all(waiting).await {
        assert!(gone.unwrap_err().is_cancelled());
    }
    gate.send_replace(true);
    // Their tokens are back in the lease; spent by a burst, then the bucket refills: two
    // seconds on it serves its capacity, nothing taken back for tokens no request holds.
    let with_their_tokens = burst(&layer, CAPACITY).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let later = burst(&layer, CAPACITY).await;
    assert_eq!((with_their_tokens, later), (CAPACITY, CAPACITY));
}

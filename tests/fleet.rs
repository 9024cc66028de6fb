//! Fleets sharing one global store, loaded above the limit for a simulated minute: they admit
//! no more than the limit allows, nearly all of it, and rarely call the global store.

mod common;

use common::*;
use hierarchical_throttle::clock::ManualClock;
use hierarchical_throttle::{Limit, MemoryGlobalStore};

#[tokio::test(flavor = "current_thread")]
async fn four_hosts_hold_the_fleet_limit_and_reach_nearly_all_of_it() {
    let clock = ManualClock::new();
    let global = MemoryGlobalStore::with_clock(clock.clone());
    let limit = Limit::per_second(100).burst(200).unwrap();
    // Host i gets a request every (4 - i) ms: 250, 333, 500 and 1000 per second, 20x the
    // limit in all. Host 3 goes quiet for the middle 20 s, stranding whatever it leased.
    let run = run_fleet(&clock, global, limit, 60, |i, ms| {
        let quiet = i == 3 && (20_000..40_000).contains(&ms);
        ms % (4 - i as u64) == 0 && !quiet
    })
    .await;
    println!("memory fleet: {run:?}");
    run.assert_holds_the_limit();
}

/// Eight hosts, one key offered 10x its limit, evenly: at most 2% of requests call the global
/// store, and 97% to 100% of the allowance is admitted.
async fn eight_hosts_at_ten_times(per_second: u64) -> FleetRun {
    let clock = ManualClock::new();
    let global = MemoryGlobalStore::with_clock(clock.clone());
    let limit = Limit::per_second(per_second).burst(per_second).unwrap();
    // 10x the rate in all: each millisecond, host i sends its share, spread over the hosts.
    let per_ms = per_second * 10 / 1000;
    let run = run_hosts(8, &clock, global, limit, 60, |i, ms| {
        let total = if per_ms > 0 {
            per_ms
        } else {
            u64::from(ms % (1000 / (per_second * 10)) == 0)
        };
        // Requests of this millisecond go to hosts in turn.
        (0..total)
            .filter(|r| ((ms * total + r) % 8) as usize == i)
            .count() as u64
    })
    .await;
    println!("8 hosts at 10x {per_second}/s: {run:?}");
    run
}

#[tokio::test(flavor = "current_thread")]
async fn eight_hosts_far_over_the_limit_rarely_call_the_store() {
    for per_second in [100, 1_000] {
        let run = eight_hosts_at_ten_times(per_second).await;
        run.assert_holds_the_limit();
        assert!(
            run.global_calls * 50 <= run.requests,
            "more than 2% of requests called the store: {run:?}"
        );
    }
}

#[tokio::test(flavor = "current_thread")]
async fn a_stopping_host_hands_back_what_it_holds() {
    let clock = ManualClock::new();
    let global = MemoryGlobalStore::with_clock(clock.clone());
    common::stopping::a_stopping_host_hands_back_what_it_holds(&clock, global).await;
}

/// A host stopping while the fetch its credit started is under way (the store 50 ms away)
/// waits for it: the credit is charged, and the batch's leftovers come back with the rest. The
/// global bucket ends one token down, for the one request admitted.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn stopping_waits_for_the_fetch_under_way_and_charges_its_credit() {
    use hierarchical_throttle::ColdStart;
    use hierarchical_throttle::batch::FractionOfCapacity;

    let clock = ManualClock::new();
    let store = FaultyStore::new(MemoryGlobalStore::with_clock(clock.clone()));
    store.delay(std::time::Duration::from_millis(50));
    let layer = host_builder(&clock, Limit::per_minute(100).burst(100).unwrap())
        .cold_start(ColdStart::Credit { share: 0.1 })
        .batch_policy(FractionOfCapacity::new(0.5).unwrap())
        .global_store(store.clone())
        .build()
        .unwrap();
    let mut service = tower::Layer::layer(&layer, backend());
    let started = tokio::time::Instant::now();
    assert_eq!(send(&mut service, "k", 1).await, Outcome::Served);
    assert_eq!(
        started.elapsed(),
        std::time::Duration::ZERO,
        "on credit, at once"
    );

    layer.return_all_leases().await;
    let level = layer.remaining_global("k").await.unwrap()[0].tokens;
    assert_eq!(level, 99);
    let stats = layer.stats();
    assert_eq!(stats.admitted_on_credit, 1);
    assert_eq!(stats.tokens_uncharged, 0);
    assert_eq!(stats.tokens_returned, 49);
}

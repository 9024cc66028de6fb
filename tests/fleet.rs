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

//! A fleet of four hosts sharing one global store, loaded unevenly above the limit for 60
//! simulated seconds: it admits no more than the limit allows, and nearly all of it.

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

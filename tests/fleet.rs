//! A fleet of four hosts sharing one global store, loaded unevenly above the limit for 60
//! simulated seconds: it admits no more than the limit allows, and nearly all of it.

mod common;

use std::time::Duration;

use common::*;
use hierarchical_throttle::clock::ManualClock;
use hierarchical_throttle::{Limit, MemoryGlobalStore};
use tower::Layer;

#[tokio::test(flavor = "current_thread")]
async fn four_hosts_hold_the_fleet_limit_and_reach_nearly_all_of_it() {
    let clock = ManualClock::new();
    let global = MemoryGlobalStore::with_clock(clock.clone());
    let (rate, burst) = (100u64, 200u64);
    let limit = Limit::per_second(rate).burst(burst).unwrap();
    let layers: Vec<_> = (0..4)
        .map(|_| {
            host_builder(&clock, limit)
                .global_store(global.clone())
                .build()
                .unwrap()
        })
        .collect();
    let mut hosts: Vec<_> = layers.iter().map(|l| l.layer(backend())).collect();

    // Host i gets a request every (4 - i) ms: 250, 333, 500 and 1000 per second, 20x the
    // limit in all. Host 3 goes quiet for the middle 20 s, stranding whatever it leased.
    let seconds = 60;
    let mut requests = 0u64;
    let mut admitted = 0u64;
    for ms in 1..=seconds * 1000u64 {
        clock.set(Duration::from_millis(ms));
        for (i, host) in hosts.iter_mut().enumerate() {
            let quiet = i == 3 && (20_000..40_000).contains(&ms);
            if ms % (4 - i as u64) != 0 || quiet {
                continue;
            }
            requests += 1;
            if send(host, "tenant", 1).await == Outcome::Served {
                admitted += 1;
            }
        }
        if ms % 500 == 0 {
            for layer in &layers {
                layer.return_unused_leases().await;
            }
        }
    }

    let allowed = burst + rate * seconds;
    let global_calls: u64 = layers.iter().map(|l| l.stats().global_calls).sum();
    println!(
        "admitted {admitted} of {allowed} allowed ({:.2}%), {requests} requests, {global_calls} global calls",
        100.0 * admitted as f64 / allowed as f64
    );
    assert!(
        admitted <= allowed,
        "over-admission: {admitted} > {allowed}"
    );
    assert!(
        admitted * 100 >= allowed * 97,
        "under-admission: {admitted} < 97% of {allowed}"
    );
}

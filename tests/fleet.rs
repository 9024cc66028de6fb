//! Fleets sharing one global store, loaded above the limit for a simulated minute: they admit
//! no more than the limit allows, nearly all of it, and rarely call the global store; and a
//! burst after a quiet stretch, which may spend what hosts held when it came.

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

/// What four hosts admit in one burst of a key after serving it slowly and then a quiet
/// stretch, and what they held when the burst came.
#[derive(Debug)]
struct BurstAfterQuiet {
    /// Leased tokens the hosts held when the burst came: dispensed to them, not handed back,
    /// not taken back out by a later fetch (forfeited) and not used (every admission here used
    /// a leased token: `ColdStart::Exact`).
    held: u64,
    /// Requests of the burst admitted (800 sent at one instant, 200 per host).
    burst: u64,
    /// The hosts' calls to the global store before the burst.
    calls: u64,
}

/// How the hosts of [`burst_after_quiet`] lease.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Leasing {
    Defaults,
    /// `keep_small_leases(false)`.
    NoSmallLeases,
    /// A batch policy asking only for what the waiting requests need.
    ExactWindows,
}

/// Four hosts of a key limited to 100/s burst 100, each sending it a request every half
/// second for 10 s (far from its limit), then `quiet`, then a burst at one instant. Each host
/// hands back its expired leases every 500 ms, as its sweeper would; its calls go with the
/// scheduler turn they are made in (no linger, which runs on the runtime's time, not the
/// hosts' manual clock), so that what a sweep hands back reaches the store before the burst.
async fn burst_after_quiet(quiet: std::time::Duration, leasing: Leasing) -> BurstAfterQuiet {
    use hierarchical_throttle::batch::BatchContext;
    let clock = ManualClock::new();
    let global = MemoryGlobalStore::with_clock(clock.clone());
    let limit = Limit::per_second(100).burst(100).unwrap();
    let layers: Vec<_> = (0..4)
        .map(|_| {
            let host = host_builder(&clock, limit)
                .global_batch_linger(std::time::Duration::ZERO)
                .global_store(global.clone());
            match leasing {
                Leasing::Defaults => host,
                Leasing::NoSmallLeases => host.keep_small_leases(false),
                // The README's setting: a host asks only for what its waiting requests need.
                Leasing::ExactWindows => host.batch_policy(|cx: &BatchContext<'_>| cx.needed),
            }
            .build()
            .unwrap()
        })
        .collect();
    let mut hosts: Vec<_> = layers
        .iter()
        .map(|l| tower::Layer::layer(l, backend()))
        .collect();
    let mut admitted = 0;
    let end = 10_000 + quiet.as_millis() as u64;
    for ms in 1..=end {
        clock.set(std::time::Duration::from_millis(ms));
        for (i, host) in hosts.iter_mut().enumerate() {
            if ms <= 10_000 && ms % 500 == i as u64 * 100 {
                assert_eq!(
                    send(host, "k", 1).await,
                    Outcome::Served,
                    "far from the limit"
                );
                admitted += 1;
            }
        }
        settle_background().await;
        if ms % 500 == 0 {
            for layer in &layers {
                layer.return_unused_leases().await;
            }
        }
    }
    let dispensed: u64 = layers
        .iter()
        .map(|l| l.stats())
        .map(|s| s.tokens_leased - s.tokens_returned - s.tokens_forfeited)
        .sum();
    let calls = layers.iter().map(|l| l.stats().global_calls).sum();
    let mut burst = 0;
    for _ in 0..200 {
        for host in hosts.iter_mut() {
            burst += u64::from(send(host, "k", 1).await == Outcome::Served);
            settle_background().await;
        }
    }
    BurstAfterQuiet {
        held: dispensed - admitted,
        burst,
        calls,
    }
}

/// Hosts hold leased tokens of a key far from its limit (each at least a sixteenth of the
/// capacity, for up to ten lease times-to-live) while the global bucket refills around them; a
/// burst could spend both. Each host's next fetch first takes back out of the global bucket
/// what it refilled past `capacity - held`, so the burst gets the capacity, exactly.
#[tokio::test(flavor = "current_thread")]
async fn a_burst_after_a_quiet_stretch_gets_the_capacity_though_hosts_held_tokens() {
    let after_a_second =
        burst_after_quiet(std::time::Duration::from_secs(1), Leasing::Defaults).await;
    println!("after a quiet second: {after_a_second:?}");
    let BurstAfterQuiet { held, burst, .. } = after_a_second;
    // Each host's batch was a sixteenth of the capacity (its demand was less), part spent.
    assert!(
        held > 0 && held <= 4 * (100 / 16),
        "what hosts held: {held}"
    );
    assert_eq!(burst, 100, "the refilled bucket, less what hosts held");

    // Ten lease times-to-live (2 s each) and a sweep later, every kept lease has gone back.
    let after_25_s = burst_after_quiet(std::time::Duration::from_secs(25), Leasing::Defaults).await;
    println!("after 25 quiet seconds: {after_25_s:?}");
    assert_eq!(after_25_s.held, 0, "kept leases go back after ten TTLs");
    assert_eq!(after_25_s.burst, 100, "the burst, exactly");
}

/// A batch policy that asks only for what the waiting requests need leaves nothing on the
/// hosts, so every window holds the token bucket's bound exactly (with `ColdStart::Exact`), for
/// a call to the store per request, as a per-request limiter makes.
#[tokio::test(flavor = "current_thread")]
async fn asking_only_for_what_requests_need_keeps_every_burst_exact() {
    let run = burst_after_quiet(std::time::Duration::from_secs(1), Leasing::ExactWindows).await;
    println!("asking for what requests need: {run:?}");
    assert_eq!(run.held, 0);
    assert_eq!(run.burst, 100);
}

/// Without small leases kept, a key's leases go back whole one time-to-live after their last
/// use, and hosts hold nothing after a longer quiet; with them, the hosts' fetches take back
/// what the bucket refilled around what they kept. The burst gets the capacity either way;
/// the slow traffic before it costs more calls without.
#[tokio::test(flavor = "current_thread")]
async fn hosts_keeping_no_small_leases_hold_nothing_once_quiet_for_a_ttl() {
    let quiet = std::time::Duration::from_secs(3);
    let kept = burst_after_quiet(quiet, Leasing::Defaults).await;
    let none = burst_after_quiet(quiet, Leasing::NoSmallLeases).await;
    println!("after 3 quiet seconds: defaults {kept:?}, no small leases {none:?}");
    assert!(kept.held > 0, "the defaults keep small leases: {kept:?}");
    assert_eq!(kept.burst, 100);
    assert_eq!(none.held, 0);
    assert_eq!(none.burst, 100, "the burst, exactly");
    assert!(none.calls > kept.calls, "{none:?} against {kept:?}");
}

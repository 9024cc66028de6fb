//! The hierarchy's claims, one host on a manual clock: local tokens serve without global
//! calls, a batch serves the requests after it, a throttled key is rejected without a global
//! call until its tokens are due, low leases are refilled ahead of need, unused leases return.

mod common;

use std::time::Duration;

use common::*;
use hierarchical_throttle::batch::{BatchContext, FractionOfCapacity};
use hierarchical_throttle::clock::ManualClock;
use hierarchical_throttle::{Limit, MemoryGlobalStore, RejectionReason};
use tower::Layer;

fn store(clock: &ManualClock) -> Store {
    MemoryGlobalStore::with_clock(clock.clone())
}

#[tokio::test(flavor = "current_thread")]
async fn one_fetch_brings_a_batch_that_serves_the_next_requests_locally() {
    let clock = ManualClock::new();
    let limit = Limit::per_second(10).burst(10).unwrap();
    let layer = host_builder(&clock, limit)
        .batch_policy(FractionOfCapacity::new(0.5).unwrap())
        .global_store(store(&clock))
        .build()
        .unwrap();
    let mut host = layer.layer(backend());

    assert_eq!(send(&mut host, "a", 1).await, Outcome::Served);
    let after_first = layer.stats();
    assert_eq!(
        (after_first.global_calls, after_first.admitted_after_fetch),
        (1, 1)
    );

    // The batch was 5: 4 left, and a prefetch starts only below half of it (2).
    assert_eq!(send(&mut host, "a", 1).await, Outcome::Served);
    assert_eq!(send(&mut host, "a", 1).await, Outcome::Served);
    let stats = layer.stats();
    assert_eq!(stats.global_calls, 1, "local tokens need no global call");
    assert_eq!(stats.admitted_local, 2);
}

#[tokio::test(flavor = "current_thread")]
async fn a_low_lease_is_refilled_in_the_background_before_it_runs_out() {
    let clock = ManualClock::new();
    let limit = Limit::per_second(100).burst(100).unwrap();
    let layer = host_builder(&clock, limit)
        .batch_policy(FractionOfCapacity::new(0.1).unwrap())
        .global_store(store(&clock))
        .build()
        .unwrap();
    let mut host = layer.layer(backend());
    // 10 tokens leased; the 5th request leaves 5, the 6th leaves 4 < 5: fetch ahead.
    for _ in 0..6 {
        assert_eq!(send(&mut host, "a", 1).await, Outcome::Served);
    }
    settle_background().await;
    assert_eq!(layer.stats().global_calls, 2);
    for _ in 0..8 {
        assert_eq!(send(&mut host, "a", 1).await, Outcome::Served);
    }
    let stats = layer.stats();
    assert_eq!(
        stats.admitted_after_fetch, 1,
        "only the very first request waited"
    );
    assert_eq!(stats.admitted_local, 13);
}

#[tokio::test(flavor = "current_thread")]
async fn a_throttled_key_is_refused_without_global_calls_until_its_tokens_are_due() {
    let clock = ManualClock::new();
    // One token per 100 ms, at most 2; batches of one token.
    let limit = Limit::per_second(10).burst(2).unwrap();
    let layer = host_builder(&clock, limit)
        .batch_policy(|_: &BatchContext<'_>| 1)
        .global_store(store(&clock))
        .build()
        .unwrap();
    let mut host = layer.layer(backend());
    assert_eq!(send(&mut host, "a", 1).await, Outcome::Served);
    assert_eq!(send(&mut host, "a", 1).await, Outcome::Served);
    assert_eq!(layer.stats().global_calls, 2);

    let throttled =
        |ms| Outcome::Refused(RejectionReason::Throttled, Some(Duration::from_millis(ms)));
    // The second batch emptied the global bucket, and its answer said when the next token is
    // due: the host refuses at once, without asking again.
    assert_eq!(send(&mut host, "a", 1).await, throttled(100));
    clock.advance(Duration::from_millis(60));
    for _ in 0..5 {
        assert_eq!(send(&mut host, "a", 1).await, throttled(40));
    }
    let stats = layer.stats();
    assert_eq!(
        (
            stats.global_calls,
            stats.rejected_cached,
            stats.rejected_global
        ),
        (2, 6, 0),
        "the cache answered"
    );

    // Another key is not affected.
    assert_eq!(send(&mut host, "b", 1).await, Outcome::Served);

    clock.advance(Duration::from_millis(40));
    assert_eq!(send(&mut host, "a", 1).await, Outcome::Served);
    assert_eq!(
        layer.stats().global_calls,
        4,
        "asked again once the token was due"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn a_cost_above_capacity_is_refused_at_once_with_its_reason() {
    let clock = ManualClock::new();
    let limit = Limit::per_second(10).burst(5).unwrap();
    let layer = host_builder(&clock, limit)
        .global_store(store(&clock))
        .build()
        .unwrap();
    let mut host = layer.layer(backend());
    assert_eq!(
        send(&mut host, "a", 6).await,
        Outcome::Refused(
            RejectionReason::CostExceedsCapacity {
                cost: 6,
                capacity: 5
            },
            None
        )
    );
    assert_eq!(
        (layer.stats().global_calls, layer.stats().refused_cost),
        (0, 1)
    );
    assert_eq!(
        send(&mut host, "a", 5).await,
        Outcome::Served,
        "a cost equal to capacity fits"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn unused_leases_return_to_the_fleet_after_their_time_to_live() {
    let clock = ManualClock::new();
    let global = store(&clock);
    let limit = Limit::per_hour(10).burst(10).unwrap();
    let hosts: Vec<_> = (0..3)
        .map(|_| {
            host_builder(&clock, limit)
                .batch_policy(FractionOfCapacity::new(1.0).unwrap())
                .lease_ttl(Duration::from_secs(5))
                .global_store(global.clone())
                .build()
                .unwrap()
        })
        .collect();
    let mut quiet = hosts[0].layer(backend());
    let mut early = hosts[1].layer(backend());
    let mut late = hosts[2].layer(backend());

    // The quiet host leases all 10 tokens and uses one: none are left for another host.
    assert_eq!(send(&mut quiet, "a", 1).await, Outcome::Served);
    assert!(matches!(
        send(&mut early, "a", 1).await,
        Outcome::Refused(RejectionReason::Throttled, _)
    ));

    clock.advance(Duration::from_secs(4));
    hosts[0].return_unused_leases().await;
    assert_eq!(
        hosts[0].stats().tokens_returned,
        0,
        "the lease has not expired yet"
    );

    clock.advance(Duration::from_secs(1));
    hosts[0].return_unused_leases().await;
    assert_eq!(hosts[0].stats().tokens_returned, 9);
    // The 9 unused tokens serve another host.
    for _ in 0..9 {
        assert_eq!(send(&mut late, "a", 1).await, Outcome::Served);
    }
    assert!(matches!(
        send(&mut late, "a", 1).await,
        Outcome::Refused(RejectionReason::Throttled, _)
    ));
}

#[tokio::test(flavor = "current_thread")]
async fn limits_can_differ_per_key() {
    let clock = ManualClock::new();
    let free = Limit::per_minute(2).burst(2).unwrap();
    let paid = Limit::per_minute(5).burst(5).unwrap();
    let layer = host_builder(&clock, free)
        .limit_per_key(move |key: &String| if key.starts_with("paid-") { paid } else { free })
        .global_store(store(&clock))
        .build()
        .unwrap();
    let host = layer.layer(backend());
    let served = |key: &'static str| {
        let mut host = host.clone();
        async move {
            let mut n = 0;
            while send(&mut host, key, 1).await == Outcome::Served {
                n += 1;
            }
            n
        }
    };
    assert_eq!(served("free-1").await, 2);
    assert_eq!(served("paid-1").await, 5);
}

#[tokio::test(flavor = "current_thread")]
async fn a_host_over_its_limit_holds_its_share_of_the_next_tokens_instead_of_polling() {
    let clock = ManualClock::new();
    // One token per 10 ms, at most 10; this host asks for batches of 5.
    let limit = Limit::per_second(100).burst(10).unwrap();
    let layer = host_builder(&clock, limit)
        .batch_policy(|_: &BatchContext<'_>| 5)
        .global_store(store(&clock))
        .build()
        .unwrap();
    let mut host = layer.layer(backend());
    for _ in 0..10 {
        assert_eq!(send(&mut host, "a", 1).await, Outcome::Served);
    }
    let throttled =
        |ms| Outcome::Refused(RejectionReason::Throttled, Some(Duration::from_millis(ms)));
    // Empty: the next token is due in 10 ms, and the refusal says so exactly.
    assert_eq!(send(&mut host, "a", 1).await, throttled(10));
    let calls = layer.stats().global_calls;
    // At 10 ms one call brings the token that is there and reserves the 4 due by 50 ms.
    clock.advance(Duration::from_millis(10));
    assert_eq!(send(&mut host, "a", 1).await, Outcome::Served);
    assert_eq!(layer.stats().global_calls, calls + 1);
    assert_eq!(send(&mut host, "a", 1).await, throttled(40));
    clock.advance(Duration::from_millis(39));
    assert_eq!(send(&mut host, "a", 1).await, throttled(1));
    clock.advance(Duration::from_millis(1));
    for _ in 0..4 {
        assert_eq!(send(&mut host, "a", 1).await, Outcome::Served);
    }
    // The global bucket's next token is due at 60 ms.
    assert_eq!(send(&mut host, "a", 1).await, throttled(10));
    assert_eq!(
        layer.stats().global_calls,
        calls + 1,
        "one call brought five tokens"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn a_limit_read_from_shared_settings_changes_at_run_time() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    let clock = ManualClock::new();
    let per_second = Arc::new(AtomicU64::new(1));
    let setting = per_second.clone();
    let layer = host_builder(&clock, Limit::per_second(1).burst(1).unwrap())
        .limit_per_key(move |_: &String| {
            let n = setting.load(Ordering::Relaxed);
            Limit::per_second(n).burst(n).unwrap()
        })
        .batch_policy(|_: &BatchContext<'_>| 0)
        .global_store(store(&clock))
        .build()
        .unwrap();
    let mut host = layer.layer(backend());
    let served = async |host: &mut _| {
        let mut n = 0;
        while send(host, "a", 1).await == Outcome::Served {
            n += 1;
        }
        n
    };
    assert_eq!(served(&mut host).await, 1);
    per_second.store(10, Ordering::Relaxed);
    clock.advance(Duration::from_secs(1));
    assert_eq!(served(&mut host).await, 10, "a second at the new rate");
}

/// The background sweep runs every half lease time-to-live by the runtime's clock, the first
/// one period after the slow path that started it: an expired lease stays on the host until
/// then, and is handed back by that sweep.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_background_sweep_first_runs_one_period_after_it_starts() {
    let clock = ManualClock::new();
    let layer = host_builder(&clock, Limit::per_hour(10).burst(10).unwrap())
        .batch_policy(FractionOfCapacity::new(1.0).unwrap())
        .lease_ttl(Duration::from_secs(5))
        .global_store(store(&clock))
        .build()
        .unwrap();
    let mut host = layer.layer(backend());
    assert_eq!(send(&mut host, "a", 1).await, Outcome::Served);
    // The lease expires by the host's clock; the runtime's has not moved.
    clock.advance(Duration::from_secs(60));
    tokio::time::sleep(Duration::from_millis(2_499)).await;
    assert_eq!(
        layer.stats().tokens_returned,
        0,
        "no sweep before its period"
    );
    tokio::time::sleep(Duration::from_millis(2)).await;
    assert_eq!(
        layer.stats().tokens_returned,
        9,
        "the first sweep hands the lease back"
    );
}

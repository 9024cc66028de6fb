//! Limits that warm up (Guava's `SmoothWarmingUp`): through an axum `Router`, and a fleet on
//! the in-memory store (the same fleet on Redis is in `redis.rs`).

mod common;

use std::time::Duration;

use common::router::{app, call};
use hierarchical_throttle::clock::ManualClock;
use hierarchical_throttle::{ColdStart, Limit, MemoryGlobalStore};
use http::StatusCode;

#[tokio::test(start_paused = true)]
async fn a_cold_key_is_admitted_on_guava_s_warm_up_schedule() {
    let clock = ManualClock::new();
    let limit: Limit = "2/s burst 1 warm-up 4s".parse().unwrap();
    let app = app(&clock, limit, ColdStart::Exact);
    assert_eq!(call(&app, "k").await.status(), StatusCode::OK);
    for (wait_us, retry_after, t) in [
        (1_375_000, "2", 2),
        (1_125_000, "2", 2),
        (875_000, "1", 1),
        (625_000, "1", 1),
        (500_000, "1", 1),
        (500_000, "1", 1),
    ] {
        let refused = call(&app, "k").await;
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(refused.headers()["retry-after"], retry_after);
        assert_eq!(
            refused.headers()["ratelimit"],
            format!("\"default\";r=0;t={t}")
        );
        clock.advance(Duration::from_micros(wait_us - 1));
        assert_eq!(
            call(&app, "k").await.status(),
            StatusCode::TOO_MANY_REQUESTS
        );
        clock.advance(Duration::from_micros(1));
        assert_eq!(
            call(&app, "k").await.status(),
            StatusCode::OK,
            "after {wait_us} us"
        );
    }
    // Another key is cold on its own.
    assert_eq!(call(&app, "other").await.status(), StatusCode::OK);
    assert_eq!(
        call(&app, "other").await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

/// With the default cold start (credit), a cold key's first request passes at once and its
/// charge pays the warm-up's price: the next is admitted no sooner than the schedule says.
#[tokio::test(start_paused = true)]
async fn credit_pays_the_warm_up_s_price_too() {
    let clock = ManualClock::new();
    let limit: Limit = "2/s burst 1 warm-up 4s".parse().unwrap();
    let app = app(&clock, limit, ColdStart::default());
    let mut admitted_at = Vec::new();
    for ms in 0..=5_000 {
        clock.set(Duration::from_millis(ms));
        if call(&app, "k").await.status() == StatusCode::OK {
            admitted_at.push(ms);
        }
        common::settle_background().await;
    }
    // Never sooner than a cold bucket taken one permit at a time allows.
    let most = common::warm_up::most_admitted(&limit, 5_000_000);
    assert!(admitted_at.len() as u64 <= most, "{admitted_at:?} > {most}");
    assert!(
        admitted_at.len() as u64 + 1 >= most,
        "{admitted_at:?}, {most} possible"
    );
    // Each no sooner after the one before than the schedule spaces them (a store call goes
    // out a scheduler turn after its request, so a millisecond or two later here).
    let gaps: Vec<u64> = admitted_at.windows(2).map(|w| w[1] - w[0]).collect();
    for (gap, least) in gaps.iter().zip([1_375, 1_125, 875, 625, 500]) {
        assert!((least..least + 5).contains(gap), "{admitted_at:?}");
    }
}

/// A key idle past its warm-up period is cold again; a warm one keeps its rate.
#[tokio::test(start_paused = true)]
async fn idleness_cools_a_key_down_again() {
    let clock = ManualClock::new();
    let limit: Limit = "2/s burst 1 warm-up 4s".parse().unwrap();
    let app = app(&clock, limit, ColdStart::Exact);
    // Warm it: eight permits take every cold one out of store (4.5 s), then two at the rate.
    for wait_ms in [0, 1_375, 1_125, 875, 625, 500, 500, 500, 500, 500] {
        clock.advance(Duration::from_millis(wait_ms));
        assert_eq!(call(&app, "k").await.status(), StatusCode::OK);
    }
    clock.advance(Duration::from_millis(500));
    assert_eq!(call(&app, "k").await.status(), StatusCode::OK);
    let refused = call(&app, "k").await;
    assert_eq!(refused.headers()["retry-after"], "1", "warm: 0.5 s");
    // 4.5 s more: full after 0.5 s, then 4 s store all eight cold permits.
    clock.advance(Duration::from_millis(4_500));
    assert_eq!(call(&app, "k").await.status(), StatusCode::OK);
    let refused = call(&app, "k").await;
    assert_eq!(refused.headers()["retry-after"], "2", "cold again: 1.375 s");
}

#[tokio::test(start_paused = true)]
async fn a_fleet_on_memory_warms_up_and_never_beats_a_single_cold_bucket() {
    let clock = ManualClock::new();
    let store = MemoryGlobalStore::with_clock(clock.clone());
    common::warm_up::fleet_warms_up(&clock, store).await;
}

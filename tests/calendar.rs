//! Calendar quotas: through an axum `Router` across a reset on a manual clock, and a fleet on
//! the in-memory store that crosses midnight (the same fleet on Redis is in `redis.rs`).

mod common;

use std::time::Duration;

use common::router::{app, call};
use hierarchical_throttle::clock::ManualClock;
use hierarchical_throttle::{ColdStart, MemoryGlobalStore};
use http::StatusCode;

/// 2024-02-28 23:59:58 UTC.
const BEFORE_LEAP_DAY: Duration = Duration::from_secs(1_709_164_798);

#[tokio::test]
async fn a_daily_quota_is_spent_then_whole_again_at_midnight() {
    let clock = ManualClock::new();
    clock.set(BEFORE_LEAP_DAY);
    let app = app(
        &clock,
        "3 per day at 00:00 UTC".parse().unwrap(),
        ColdStart::Exact,
    );
    let first = call(&app, "k").await;
    assert_eq!(first.status(), StatusCode::OK);
    // Two left, the reset two seconds away; a day's window in the policy.
    assert_eq!(first.headers()["ratelimit"], "\"default\";r=2;t=2");
    assert_eq!(
        first.headers()["ratelimit-policy"],
        "\"default\";q=3;qu=\"requests\";w=86400"
    );
    for _ in 0..2 {
        assert_eq!(call(&app, "k").await.status(), StatusCode::OK);
    }
    clock.advance(Duration::from_millis(500));
    let refused = call(&app, "k").await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    // 1.5 s to midnight: Retry-After rounds up.
    assert_eq!(refused.headers()["retry-after"], "2");
    clock.advance(Duration::from_micros(1_499_999));
    assert_eq!(
        call(&app, "k").await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    clock.advance(Duration::from_micros(1));
    // 2024-02-29 00:00: the leap day's allowance, whole.
    for _ in 0..3 {
        assert_eq!(call(&app, "k").await.status(), StatusCode::OK);
    }
    assert_eq!(
        call(&app, "k").await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test]
async fn a_monthly_quota_waits_for_the_first_of_the_month_whatever_its_length() {
    let clock = ManualClock::new();
    clock.set(BEFORE_LEAP_DAY);
    let app = app(&clock, "2 per month".parse().unwrap(), ColdStart::Exact);
    for _ in 0..2 {
        assert_eq!(call(&app, "k").await.status(), StatusCode::OK);
    }
    let refused = call(&app, "k").await;
    // 2024-03-01 00:00 UTC is a day and two seconds away (February 2024 has 29 days).
    assert_eq!(refused.headers()["retry-after"], (86_400 + 2).to_string());
    clock.set(Duration::from_secs(1_709_251_200));
    for _ in 0..2 {
        assert_eq!(call(&app, "k").await.status(), StatusCode::OK);
    }
    let refused = call(&app, "k").await;
    // March: 31 days to April 1st.
    assert_eq!(refused.headers()["retry-after"], (31 * 86_400).to_string());
}

#[tokio::test]
async fn a_fleet_on_memory_never_carries_a_window_s_tokens_into_the_next() {
    let clock = ManualClock::new();
    let store = MemoryGlobalStore::with_clock(clock.clone());
    common::calendar::fleet_crosses_midnight(&clock, store).await;
}

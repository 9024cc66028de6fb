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
    admits_exactly(&app, 3).await;
}

/// `app` admits `n` requests for key `k`, then refuses the next.
async fn admits_exactly(app: &axum::Router, n: usize) {
    for _ in 0..n {
        assert_eq!(call(app, "k").await.status(), StatusCode::OK);
    }
    assert_eq!(call(app, "k").await.status(), StatusCode::TOO_MANY_REQUESTS);
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

#[tokio::test]
async fn a_fleet_on_memory_keeps_paris_s_day_of_25_hours_whole() {
    let clock = ManualClock::new();
    let store = MemoryGlobalStore::with_clock(clock.clone());
    common::calendar::fleet_crosses_the_end_of_a_long_day(&clock, store).await;
}

#[tokio::test]
async fn a_day_spent_before_midnight_on_memory_is_whole_just_after() {
    let clock = ManualClock::new();
    let memory = MemoryGlobalStore::with_clock(clock.clone());
    common::calendar::a_day_spent_before_midnight_is_whole_just_after(&clock, memory).await;
}

/// The same across many settings, each drawn from a seed: capacities from 1 to 50, batch
/// policies, credit, lease times, reservations ahead, the day spent from a minute to 100 ms
/// before midnight, and the next requests from the instant of the reset to 3 s after it. One
/// host alone: the day before admits exactly its allowance, the new day exactly its own, and
/// each first refusal tells the exact wait to the next reset.
#[tokio::test]
async fn a_day_spent_before_midnight_is_whole_after_it_whatever_the_settings() {
    use hierarchical_throttle::batch::{FractionOfCapacity, WeightedDemand};
    use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, RejectionReason};
    const MIDNIGHT: Duration = Duration::from_secs(1_732_579_200);
    const DAY: Duration = Duration::from_secs(86_400);
    let mut state = 0x9E37_79B9_7F4A_7C15_u64;
    let mut pick = |n: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n as u64) as usize
    };
    let ms = Duration::from_millis;
    for case in 0..300 {
        let capacity = [1, 3, 10, 50][pick(4)];
        let cold_start = [
            ColdStart::Exact,
            ColdStart::default(),
            ColdStart::Credit { share: 0.5 },
            ColdStart::Credit { share: 1.0 },
        ][pick(4)];
        let lease_ttl = [ms(500), ms(2_000), ms(10_000)][pick(3)];
        let ahead = [ms(0), ms(100), ms(1_000)][pick(3)];
        let spent_before = [ms(60_000), ms(10_000), ms(3_000), ms(1_000), ms(100)][pick(5)];
        let after = [ms(0), ms(1), ms(10), ms(500), ms(1_200), ms(3_000)][pick(6)];
        let fraction = [None, Some(0.1), Some(0.5), Some(1.0)][pick(4)];
        let clock = ManualClock::new();
        clock.set(MIDNIGHT - spent_before);
        let builder = HierarchicalThrottleLayer::builder()
            .key(|job: &String| Some(job.clone()))
            .clock(clock.clone())
            .limit(
                format!("{capacity} per day at 00:00 UTC")
                    .parse::<Limit>()
                    .unwrap(),
            )
            .global_store(MemoryGlobalStore::with_clock(clock.clone()))
            .cold_start(cold_start)
            .lease_ttl(lease_ttl)
            .max_reservation(ahead);
        let layer = match fraction {
            Some(f) => builder
                .batch_policy(FractionOfCapacity::new(f).unwrap())
                .build(),
            None => builder.batch_policy(WeightedDemand).build(),
        }
        .unwrap();
        let settings = format!(
            "case {case}: {capacity} a day, {cold_start:?}, lease {lease_ttl:?}, ahead \
             {ahead:?}, batches {fraction:?}, spent {spent_before:?} before, asked {after:?} after"
        );
        for (until_reset, day) in [
            (spent_before, "the day before"),
            (DAY - after, "the new day"),
        ] {
            let mut admitted = 0;
            let refused = loop {
                match layer.acquire("job".to_owned(), 1).await {
                    Ok(_) => admitted += 1,
                    Err(refused) => break refused,
                }
                assert!(admitted <= capacity, "{day} over its allowance: {settings}");
            };
            assert_eq!(admitted, capacity, "{day}: {settings}");
            assert_eq!(
                refused.reason,
                RejectionReason::Throttled,
                "{day}: {settings}"
            );
            assert_eq!(refused.retry_after, Some(until_reset), "{day}: {settings}");
            clock.set(MIDNIGHT + after);
        }
    }
}

mod time_zones {
    //! Quotas in a zone whose offset changes: a day is 23 or 25 hours long on the days the
    //! clocks change, and resets at local midnight on both sides.

    use std::time::Duration;

    use hierarchical_throttle::clock::ManualClock;
    use hierarchical_throttle::{ColdStart, ConfigError, Limit};
    use http::StatusCode;

    use super::admits_exactly;
    use super::common::router::{app, call};

    const HOUR: u64 = 3_600;

    #[tokio::test]
    async fn the_day_the_clocks_go_back_lasts_25_hours() {
        let clock = ManualClock::new();
        // 2024-10-26 23:59:58 in Paris (CEST, 21:59:58 UTC).
        let before_midnight = Duration::from_secs(1_729_979_998);
        clock.set(before_midnight);
        let limit: Limit = "3 per day at 00:00 Europe/Paris".parse().unwrap();
        let app = app(&clock, limit, ColdStart::Exact);
        for _ in 0..3 {
            assert_eq!(call(&app, "k").await.status(), StatusCode::OK);
        }
        let refused = call(&app, "k").await;
        assert_eq!(refused.headers()["retry-after"], "2");
        // Midnight: the 27th's allowance, and its end 25 hours away.
        clock.set(before_midnight + Duration::from_secs(2));
        let first = call(&app, "k").await;
        assert_eq!(first.status(), StatusCode::OK);
        assert_eq!(
            first.headers()["ratelimit"],
            format!("\"default\";r=2;t={}", 25 * HOUR)
        );
        for _ in 0..2 {
            assert_eq!(call(&app, "k").await.status(), StatusCode::OK);
        }
        // 24 hours on, where the day's morning offset would put the reset: an hour to go.
        clock.set(before_midnight + Duration::from_secs(2 + 24 * HOUR));
        let refused = call(&app, "k").await;
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(refused.headers()["retry-after"], HOUR.to_string());
        clock.set(before_midnight + Duration::from_secs(2 + 25 * HOUR));
        admits_exactly(&app, 3).await;
    }

    #[tokio::test]
    async fn the_day_the_clocks_go_forward_lasts_23_hours() {
        let clock = ManualClock::new();
        // 2024-03-31 00:00 in Paris (CET, 2024-03-30 23:00 UTC).
        let midnight = Duration::from_secs(1_711_839_600);
        clock.set(midnight);
        let limit: Limit = "1 per day at 00:00 Europe/Paris".parse().unwrap();
        let app = app(&clock, limit, ColdStart::Exact);
        assert_eq!(call(&app, "k").await.status(), StatusCode::OK);
        let refused = call(&app, "k").await;
        assert_eq!(refused.headers()["retry-after"], (23 * HOUR).to_string());
        clock.set(midnight + Duration::from_secs(23 * HOUR - 1));
        assert_eq!(
            call(&app, "k").await.status(),
            StatusCode::TOO_MANY_REQUESTS
        );
        clock.set(midnight + Duration::from_secs(23 * HOUR));
        assert_eq!(call(&app, "k").await.status(), StatusCode::OK);
    }

    #[test]
    fn zones_are_written_read_and_checked() {
        let paris: Limit = "100000 per day at 00:00 Europe/Paris".parse().unwrap();
        assert_eq!(paris.to_string(), "100000 per day at 00:00 Europe/Paris");
        assert_eq!(paris.to_string().parse::<Limit>().unwrap(), paris);
        let built = Limit::per_calendar(100_000, hierarchical_throttle::calendar::Period::Day)
            .time_zone("Europe/Paris")
            .build()
            .unwrap();
        assert_eq!(built, paris);
        let calendar = paris.calendar().unwrap();
        assert_eq!(calendar.time_zone(), Some("Europe/Paris"));
        assert_eq!(calendar.utc_offset_minutes(), None);
        // The database's spelling, whatever the case it was written in.
        let lower: Limit = "100000 per day at 00:00 europe/paris".parse().unwrap();
        assert_eq!(lower, paris);
        assert_eq!(lower.to_string(), "100000 per day at 00:00 Europe/Paris");
        let monthly: Limit = "5/month at 09:30 America/New_York".parse().unwrap();
        assert_eq!(monthly.to_string(), "5 per month at 09:30 America/New_York");
        let unknown = "10 per day at 00:00 Europe/Atlantis".parse::<Limit>();
        assert!(matches!(
            unknown,
            Err(ConfigError::Unreadable { ref part, .. }) if part == "Europe/Atlantis"
        ));
        let unknown = Limit::per_calendar(10, hierarchical_throttle::calendar::Period::Week)
            .time_zone("Mars/Olympus_Mons")
            .build();
        assert!(matches!(unknown, Err(ConfigError::Unreadable { .. })));
        // Every zone written out reads back the same: `UTC` as the fixed offset it is, names
        // that begin like one (`GMT0`) as names.
        for zone in ["UTC", "GMT0", "Etc/GMT-2", "UTC+02:00", "Asia/Kolkata"] {
            let limit = Limit::per_calendar(10, hierarchical_throttle::calendar::Period::Day)
                .time_zone(zone)
                .build()
                .unwrap();
            assert_eq!(limit.to_string().parse::<Limit>().unwrap(), limit, "{zone}");
        }
        let utc = Limit::per_calendar(10, hierarchical_throttle::calendar::Period::Day);
        assert_eq!(
            utc.clone().time_zone("UTC").build().unwrap(),
            utc.build().unwrap()
        );
        // A zone replaces a fixed offset set before it, and the other way round.
        let offset = Limit::per_calendar(10, hierarchical_throttle::calendar::Period::Day)
            .time_zone("Europe/Paris")
            .utc_offset_minutes(60)
            .build()
            .unwrap();
        assert_eq!(offset.to_string(), "10 per day at 00:00 UTC+01:00");
    }
}

mod tokens_taken_back {
    //! Tokens that leave a use after its admission (a settled refund, a reservation dropped)
    //! go back into the lease within the window they were taken in, and are forfeited when a
    //! reset came since: the next window never spends them.

    use std::time::Duration;

    use axum::Router;
    use axum::body::Body;
    use axum::routing::get;
    use hierarchical_throttle::clock::ManualClock;
    use hierarchical_throttle::{
        HierarchicalThrottleLayer, Limit, MemoryGlobalStore, MemoryLocalStore, key,
    };
    use http::{Request, Response, StatusCode};
    use tower::ServiceExt;

    use super::BEFORE_LEAP_DAY;

    /// 2024-02-28 12:00 UTC: half a day from the reset.
    const MIDDAY: Duration = Duration::from_secs(1_709_121_600);
    /// 2024-02-29 00:00:10 UTC (a refund within a second or so of a reset is forfeited, as
    /// the store's clock may be that far from the host's).
    const AFTER_MIDNIGHT: Duration = Duration::from_secs(1_709_164_810);

    type Jobs = HierarchicalThrottleLayer<
        String,
        String,
        MemoryGlobalStore<String, ManualClock>,
        MemoryLocalStore<String>,
        ManualClock,
    >;

    /// Jobs with a quota of 10 a day.
    fn jobs(clock: &ManualClock) -> Jobs {
        HierarchicalThrottleLayer::builder()
            .key(|job: &String| Some(job.clone()))
            .clock(clock.clone())
            .limit("10 per day at 00:00 UTC".parse::<Limit>().unwrap())
            .global_store(MemoryGlobalStore::with_clock(clock.clone()))
            .build()
            .unwrap()
    }

    /// How many uses of one token the layer admits before refusing.
    async fn admitted_before_refusal(layer: &Jobs) -> u32 {
        let mut admitted = 0;
        while layer.acquire("job".to_owned(), 1).await.is_ok() {
            admitted += 1;
            assert!(admitted <= 100, "never refused");
        }
        admitted
    }

    #[tokio::test]
    async fn a_refund_within_the_window_is_spent_in_it() {
        let clock = ManualClock::new();
        clock.set(MIDDAY);
        let layer = jobs(&clock);
        let admitted = layer.acquire("job".to_owned(), 4).await.unwrap();
        clock.advance(Duration::from_secs(60));
        layer.settle("job".to_owned(), admitted, 4, 1).await;
        assert_eq!(layer.stats().tokens_refunded, 3);
        assert_eq!(admitted_before_refusal(&layer).await, 10 - 1);
    }

    #[tokio::test]
    async fn a_refund_settled_after_the_reset_is_forfeited() {
        let clock = ManualClock::new();
        clock.set(BEFORE_LEAP_DAY);
        let layer = jobs(&clock);
        let admitted = layer.acquire("job".to_owned(), 4).await.unwrap();
        clock.set(AFTER_MIDNIGHT);
        layer.settle("job".to_owned(), admitted, 4, 1).await;
        let stats = layer.stats();
        assert_eq!((stats.tokens_refunded, stats.tokens_forfeited), (0, 3));
        // The leap day's 10, and not the 3 refunded from the day before.
        assert_eq!(admitted_before_refusal(&layer).await, 10);
    }

    #[tokio::test]
    async fn a_reservation_dropped_after_the_reset_gives_nothing_to_the_next_window() {
        let clock = ManualClock::new();
        clock.set(BEFORE_LEAP_DAY);
        let layer = jobs(&clock);
        // A batch fills the lease; the reservation then takes its tokens at once.
        assert!(layer.acquire("job".to_owned(), 1).await.is_ok());
        let reserved = layer
            .reserve("job".to_owned(), 5, Duration::ZERO)
            .await
            .unwrap();
        assert_eq!(reserved.delay(), Duration::ZERO);
        clock.set(AFTER_MIDNIGHT);
        drop(reserved);
        assert_eq!(layer.stats().tokens_forfeited, 5);
        assert_eq!(admitted_before_refusal(&layer).await, 10);
    }

    #[tokio::test]
    async fn a_response_settled_below_its_charge_after_midnight_refunds_nothing_into_the_leap_day()
    {
        let clock = ManualClock::new();
        clock.set(BEFORE_LEAP_DAY);
        let handler_clock = clock.clone();
        // The handler runs across midnight and reports the tokens it used.
        let handler = move || {
            let clock = handler_clock.clone();
            async move {
                clock.set(AFTER_MIDNIGHT);
                Response::builder()
                    .header("x-tokens-used", "1")
                    .body(Body::empty())
                    .unwrap()
            }
        };
        let layer = HierarchicalThrottleLayer::builder()
            .key(|req: &Request<Body>| key::header_value(req, "x-api-key"))
            .cost(|_: &Request<Body>| 4)
            .settle(|response: &Response<Body>, charged| {
                let used = response.headers().get("x-tokens-used");
                used.and_then(|v| v.to_str().ok()?.parse().ok())
                    .unwrap_or(charged)
            })
            .clock(clock.clone())
            .limit("10 per day at 00:00 UTC".parse::<Limit>().unwrap())
            .global_store(MemoryGlobalStore::with_clock(clock.clone()))
            .build()
            .unwrap();
        let app = Router::new().route("/", get(handler)).layer(layer.clone());
        let call = || async {
            let req = Request::get("/").header("x-api-key", "k");
            let response = app.clone().oneshot(req.body(Body::empty()).unwrap());
            response.await.unwrap().status()
        };
        assert_eq!(call().await, StatusCode::OK);
        // Admitted before midnight, settled after it: its refund of 3 is forfeited.
        let stats = layer.stats();
        assert_eq!((stats.tokens_refunded, stats.tokens_forfeited), (0, 3));
        // On the leap day each request is charged 4 and settles to 1 (its refund of 3 back
        // in the lease, within the day): one is admitted while 4 of 10 are left.
        let mut admitted_today = 0;
        while call().await == StatusCode::OK {
            admitted_today += 1;
        }
        assert_eq!(admitted_today, 7, "10 - 6 = 4 left for the 7th");
    }
}

mod stalled_hand_backs {
    //! A hand-back that a stalled store applies only after the reset (the host sent it in
    //! time, then gave up waiting) adds nothing to the next window: its tokens expire at the
    //! reset of the window they were leased in. An operator's change does the same. And a
    //! batch the store took before the reset, answered after it, serves no request that came
    //! after the reset.

    use std::future::Future;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use tokio::sync::{Notify, Semaphore};

    use hierarchical_throttle::batch::FractionOfCapacity;
    use hierarchical_throttle::clock::ManualClock;
    use hierarchical_throttle::global::{
        Adjusted, Adjustment, BucketLevel, GlobalStore, Grant, LayerRegistry, TokenRequest,
        TokenReturn,
    };
    use hierarchical_throttle::quota::BucketKey;
    use hierarchical_throttle::{
        ColdStart, HierarchicalThrottleLayer, Limit, MemoryGlobalStore, MemoryLocalStore,
        StoreError,
    };

    type Inner = MemoryGlobalStore<String, ManualClock>;

    enum Stalled {
        Release(BucketKey<String>, Limit, TokenReturn),
        Adjust(BucketKey<String>, Limit, Adjustment, Option<Duration>),
    }

    /// A store that stalls every hand-back and operator's change: it keeps the call (as a
    /// server keeps it in its socket buffer) and never answers, until the test applies it.
    /// With a `transit`, it answers operators' changes instead, each applied that long after
    /// it was sent (by the store's clock, the test's). A batch is taken at once (`taken` is
    /// told), and answered as `answers` lets it (at once unless the test holds them).
    #[derive(Clone)]
    struct StallingStore {
        inner: Inner,
        stalled: Arc<Mutex<Vec<Stalled>>>,
        clock: ManualClock,
        transit: Arc<Mutex<Option<Duration>>>,
        taken: Arc<Notify>,
        answers: Arc<Semaphore>,
    }

    impl StallingStore {
        /// Applies every stalled call now, and returns the tokens the hand-backs carried.
        async fn resume(&self) -> u64 {
            let stalled = std::mem::take(&mut *self.stalled.lock().unwrap());
            let mut tokens = 0;
            for call in stalled {
                match call {
                    Stalled::Release(key, limit, back) => {
                        tokens += back.tokens;
                        let Ok(()) = self.inner.release(&key, &limit, back).await;
                    }
                    Stalled::Adjust(key, limit, adjustment, expires) => {
                        let Ok(_) = self.inner.adjust(&key, &limit, adjustment, expires).await;
                    }
                }
            }
            tokens
        }
    }

    impl GlobalStore<BucketKey<String>> for StallingStore {
        type Error = std::convert::Infallible;

        fn acquire(
            &self,
            key: &BucketKey<String>,
            limit: &Limit,
            request: TokenRequest,
        ) -> impl Future<Output = Result<Grant, Self::Error>> + Send {
            let this = self.clone();
            let (key, limit) = (key.clone(), *limit);
            async move {
                let grant = this.inner.acquire(&key, &limit, request).await;
                this.taken.notify_one();
                let _answer = this.answers.acquire().await;
                grant
            }
        }

        fn release(
            &self,
            key: &BucketKey<String>,
            limit: &Limit,
            back: TokenReturn,
        ) -> impl Future<Output = Result<(), Self::Error>> + Send {
            let call = Stalled::Release(key.clone(), *limit, back);
            self.stalled.lock().unwrap().push(call);
            std::future::pending()
        }

        fn level(
            &self,
            key: &BucketKey<String>,
            limit: &Limit,
        ) -> impl Future<Output = Result<BucketLevel, Self::Error>> + Send {
            self.inner.level(key, limit)
        }

        fn adjust(
            &self,
            key: &BucketKey<String>,
            limit: &Limit,
            adjustment: Adjustment,
            expires: Option<Duration>,
        ) -> impl Future<Output = Result<Adjusted, Self::Error>> + Send {
            let transit = *self.transit.lock().unwrap();
            if transit.is_none() {
                let call = Stalled::Adjust(key.clone(), *limit, adjustment, expires);
                self.stalled.lock().unwrap().push(call);
            }
            let (inner, clock, key, limit) =
                (self.inner.clone(), self.clock.clone(), key.clone(), *limit);
            async move {
                let Some(transit) = transit else {
                    return std::future::pending().await;
                };
                clock.advance(transit);
                inner.adjust(&key, &limit, adjustment, expires).await
            }
        }

        fn layers(&self) -> Option<&LayerRegistry> {
            self.inner.layers()
        }
    }

    type Jobs = HierarchicalThrottleLayer<
        String,
        String,
        StallingStore,
        MemoryLocalStore<String>,
        ManualClock,
    >;

    /// 2024-02-29 00:00 UTC, the leap day's start.
    const MIDNIGHT: Duration = Duration::from_secs(1_709_164_800);

    /// A quota of 10 a day on a stalling store, a minute before the leap day.
    fn a_minute_before_the_leap_day() -> (ManualClock, StallingStore, Jobs) {
        let clock = ManualClock::new();
        clock.set(MIDNIGHT - Duration::from_secs(60));
        let store = StallingStore {
            inner: MemoryGlobalStore::with_clock(clock.clone()),
            stalled: Arc::default(),
            clock: clock.clone(),
            transit: Arc::default(),
            taken: Arc::default(),
            answers: Arc::new(Semaphore::new(Semaphore::MAX_PERMITS)),
        };
        let layer = HierarchicalThrottleLayer::builder()
            .key(|job: &String| Some(job.clone()))
            .clock(clock.clone())
            .limit("10 per day at 00:00 UTC".parse::<Limit>().unwrap())
            .global_store(store.clone())
            .cold_start(ColdStart::Exact)
            .batch_policy(FractionOfCapacity::new(0.5).unwrap())
            .build()
            .unwrap();
        (clock, store, layer)
    }

    /// Uses of the job until the first refusal.
    async fn admitted_until_refused(layer: &Jobs) -> u32 {
        let mut admitted = 0;
        while layer.acquire("job".to_owned(), 1).await.is_ok() {
            admitted += 1;
            assert!(admitted <= 100, "never refused");
        }
        admitted
    }

    #[tokio::test(start_paused = true)]
    async fn a_hand_back_the_store_applies_after_the_reset_adds_nothing_to_the_next_window() {
        let (clock, store, layer) = a_minute_before_the_leap_day();
        // Leases a batch of five, of which one token is used.
        assert!(layer.acquire("job".to_owned(), 1).await.is_ok());
        // 1.5 s before midnight the lease is handed back (late enough that the host holds no
        // token of the day into the next, early enough that the hand-back would reach the
        // store before the reset); the store stalls it, and the host gives up on it.
        clock.set(MIDNIGHT - Duration::from_millis(1_500));
        layer.return_unused_leases().await;
        let lost = layer.stats().tokens_lost;
        assert!(lost > 0, "the hand-back timed out with its tokens");
        // On the leap day, a use; then the store wakes and applies the day before's hand-back.
        clock.set(MIDNIGHT + Duration::from_secs(10));
        assert!(layer.acquire("job".to_owned(), 1).await.is_ok());
        assert_eq!(store.resume().await, lost);
        let admitted = 1 + admitted_until_refused(&layer).await;
        assert_eq!(admitted, 10, "the leap day's 10, none of the day before's");
    }

    /// A day of 10 spent in full before midnight; `adjustment` sent to the stalled store a
    /// second before midnight, applied 10 s after it. Returns the requests the new day admits.
    async fn admitted_the_day_after_a_stalled(adjustment: Adjustment) -> u32 {
        let (clock, store, layer) = a_minute_before_the_leap_day();
        assert_eq!(admitted_until_refused(&layer).await, 10);
        clock.set(MIDNIGHT - Duration::from_secs(1));
        let sent = layer.adjust("job", adjustment).await;
        assert!(
            matches!(sent, Err(StoreError::TimedOut(_))),
            "the operator is told the change may land later: {sent:?}"
        );
        clock.set(MIDNIGHT + Duration::from_secs(10));
        assert!(layer.acquire("job".to_owned(), 1).await.is_ok());
        store.resume().await;
        1 + admitted_until_refused(&layer).await
    }

    #[tokio::test(start_paused = true)]
    async fn an_operator_is_told_when_the_store_dropped_a_change_that_came_after_the_reset() {
        let (clock, store, layer) = a_minute_before_the_leap_day();
        *store.transit.lock().unwrap() = Some(Duration::from_millis(20));
        assert_eq!(admitted_until_refused(&layer).await, 10);
        // Sent 100 ms before midnight, it reaches the store before: applied.
        clock.set(MIDNIGHT - Duration::from_millis(100));
        let added = layer.adjust("job", Adjustment::Add(3)).await.unwrap();
        assert_eq!(added[0].tokens, 3);
        assert!(layer.acquire("job".to_owned(), 3).await.is_ok());
        // Sent 10 ms before midnight, it reaches the store 10 ms into the leap day: dropped,
        // and the operator is told so rather than shown the new day's level as its result.
        clock.set(MIDNIGHT - Duration::from_millis(10));
        let late = layer.adjust("job", Adjustment::Add(3)).await;
        assert!(
            matches!(late, Err(StoreError::WindowEnded)),
            "the operator learns the change was dropped: {late:?}"
        );
        assert_eq!(
            admitted_until_refused(&layer).await,
            10,
            "the leap day's own"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_operator_s_change_the_store_applies_after_the_reset_leaves_the_next_window_alone() {
        for adjustment in [Adjustment::Add(5), Adjustment::Reset, Adjustment::Drain] {
            let admitted = admitted_the_day_after_a_stalled(adjustment).await;
            assert_eq!(admitted, 10, "{adjustment:?} was for the day before");
        }
    }

    /// A batch asked for before a reset may bring the old window's tokens: it serves only the
    /// requests that came before the reset, and one that came after waits for a batch of its
    /// own window.
    #[tokio::test(start_paused = true)]
    async fn a_request_after_midnight_is_not_served_from_a_batch_taken_before_it() {
        let (clock, store, layer) = a_minute_before_the_leap_day();
        clock.set(MIDNIGHT - Duration::from_millis(1));
        store.answers.forget_permits(Semaphore::MAX_PERMITS);
        // A request a millisecond before midnight waits for a batch, which the store takes
        // from the day before; the request goes away before the answer comes.
        let before = layer.acquire("job".to_owned(), 1);
        store.taken.notified().await;
        drop(before);
        // A request 3 ms after midnight joins the batch under way.
        clock.set(MIDNIGHT + Duration::from_millis(3));
        let after = layer.acquire("job".to_owned(), 1);
        store.answers.add_permits(Semaphore::MAX_PERMITS);
        assert!(after.await.is_ok());
        // It took one of the leap day's 10, not the day before's token: 9 more, then refused.
        assert_eq!(admitted_until_refused(&layer).await, 9);
    }
}

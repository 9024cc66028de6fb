//! Shaping through an axum `Router` on tokio's paused time: bursts smoothed into the rate, the
//! leaky bucket as a bounded queue, Amazon MWS's quota example, waiters that go away, a fleet
//! of shaping hosts, and `acquire`.

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use futures_util::future::join_all;
use hierarchical_throttle::clock::TokioClock;
use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore, Shaping, key};
use http::{Request, StatusCode};
use tokio::time::Instant;
use tower::ServiceExt;

/// What a request ended as: served or refused, and when (ms since the start).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Served(u64),
    Refused { at: u64, retry_after: u64 },
}

type Global = MemoryGlobalStore<String, TokioClock>;
type Layer = HierarchicalThrottleLayer<
    Request<Body>,
    String,
    Global,
    hierarchical_throttle::MemoryLocalStore<String>,
    TokioClock,
>;

fn layer(limit: Limit, shaping: Shaping, global: &Global) -> Layer {
    HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key(|req: &Request<Body>| key::header_value(req, "x-user"))
        .clock(TokioClock::new())
        .limit(limit)
        .shaping(shaping)
        .global_store(global.clone())
        .build()
        .unwrap()
}

fn app(layer: &Layer) -> Router {
    Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer.clone())
}

async fn send(app: &Router, user: &str, start: Instant) -> Outcome {
    let request = Request::get("/")
        .header("x-user", user)
        .body(Body::empty())
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let at = start.elapsed().as_millis() as u64;
    match response.status() {
        StatusCode::OK => Outcome::Served(at),
        StatusCode::TOO_MANY_REQUESTS => Outcome::Refused {
            at,
            retry_after: response.headers()["retry-after"]
                .to_str()
                .unwrap()
                .parse()
                .unwrap(),
        },
        other => panic!("unexpected {other}"),
    }
}

/// `n` requests of `user` arriving together at `start`.
async fn burst(app: &Router, user: &str, n: usize, start: Instant) -> Vec<Outcome> {
    join_all((0..n).map(|_| send(app, user, start))).await
}

/// TB(1/3 token per ms, 4) of the reference notes.
fn one_per_3ms_burst_4() -> Limit {
    Limit::per(1, Duration::from_millis(3)).burst(4).unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_burst_is_smoothed_into_the_rate_in_arrival_order() {
    let global = MemoryGlobalStore::with_clock(TokioClock::new());
    let start = Instant::now();
    let layer = layer(
        one_per_3ms_burst_4(),
        Shaping::wait(Duration::from_secs(1)),
        &global,
    );
    let app = app(&layer);

    let outcomes = burst(&app, "u1", 8, start).await;
    let served: Vec<_> = outcomes
        .iter()
        .map(|o| match o {
            Outcome::Served(at) => *at,
            refused => panic!("{refused:?}"),
        })
        .collect();
    // The bucket's 4 at once, then one every 3 ms, in the order they came.
    assert_eq!(served, [0, 0, 0, 0, 3, 6, 9, 12]);
    assert_eq!(layer.stats().shaped_waits, 4);
}

#[tokio::test(start_paused = true)]
async fn the_leaky_bucket_as_a_queue_is_bounded_and_refuses_beyond_at_once() {
    let global = MemoryGlobalStore::with_clock(TokioClock::new());
    let start = Instant::now();
    let drip = Limit::per(1, Duration::from_millis(3)).burst(1).unwrap();
    let shaping = Shaping::Wait {
        max: Duration::from_secs(1),
        queue: 3,
    };
    let layer = layer(drip, shaping, &global);
    let app = app(&layer);

    let outcomes = burst(&app, "u1", 6, start).await;
    assert_eq!(
        outcomes,
        [
            Outcome::Served(0),
            Outcome::Served(3),
            Outcome::Served(6),
            Outcome::Served(9),
            // The queue holds 3: the others are refused at once.
            Outcome::Refused {
                at: 0,
                retry_after: 1
            },
            Outcome::Refused {
                at: 0,
                retry_after: 1
            },
        ]
    );
    assert_eq!(layer.stats().shaped_refusals, 2);
}

/// Amazon MWS: quota 15, restore 1 every 2 minutes; 25 submissions at once get 15 through and
/// the other 10 need 20 more minutes. Waiting at most 10 minutes, 5 of them wait, and 5 are
/// refused at once with the time their turn would come.
#[tokio::test(start_paused = true)]
async fn mws_quota_waits_up_to_the_maximum_and_refuses_the_rest_at_once() {
    let global = MemoryGlobalStore::with_clock(TokioClock::new());
    let start = Instant::now();
    let mws = Limit::per(1, Duration::from_secs(120)).burst(15).unwrap();
    let layer = layer(mws, Shaping::wait(Duration::from_secs(600)), &global);
    let app = app(&layer);

    let outcomes = burst(&app, "seller", 25, start).await;
    let mut expected = vec![Outcome::Served(0); 15];
    expected.extend((1..=5).map(|i| Outcome::Served(i * 120_000)));
    expected.extend(
        [Outcome::Refused {
            at: 0,
            retry_after: 720,
        }; 5],
    );
    assert_eq!(outcomes, expected);
}

#[tokio::test(start_paused = true)]
async fn a_waiter_that_goes_away_leaves_its_turn_and_takes_no_tokens() {
    let global = MemoryGlobalStore::with_clock(TokioClock::new());
    let start = Instant::now();
    let drip = Limit::per(1, Duration::from_millis(3)).burst(1).unwrap();
    let layer = layer(drip, Shaping::wait(Duration::from_secs(1)), &global);
    let app = app(&layer);

    let first = send(&app, "u1", start);
    // The second gives up after 1 ms, while it waits for the token due at 3 ms.
    let gives_up = tokio::time::timeout(Duration::from_millis(1), send(&app, "u1", start));
    let third = send(&app, "u1", start);
    let (first, gave_up, third) = tokio::join!(first, gives_up, third);
    assert_eq!(first, Outcome::Served(0));
    assert!(gave_up.is_err(), "timed out while waiting");
    assert_eq!(
        third,
        Outcome::Served(3),
        "took the turn and the token it left"
    );
    assert_eq!(send(&app, "u1", start).await, Outcome::Served(6));
}

#[tokio::test(start_paused = true)]
async fn shaping_hosts_of_a_fleet_never_admit_more_than_the_limit() {
    let global = MemoryGlobalStore::with_clock(TokioClock::new());
    let start = Instant::now();
    let limit = Limit::per_second(10).burst(5).unwrap();
    let hosts: Vec<_> = (0..3)
        .map(|_| {
            app(&layer(
                limit,
                Shaping::wait(Duration::from_secs(2)),
                &global,
            ))
        })
        .collect();

    // Each host gets a burst of 10 at once: 30 requests, 5 at once and 10 a second after.
    let outcomes = join_all(hosts.iter().map(|host| burst(host, "u1", 10, start))).await;
    let mut served: Vec<u64> = outcomes
        .iter()
        .flatten()
        .filter_map(|o| match o {
            Outcome::Served(at) => Some(*at),
            Outcome::Refused { .. } => None,
        })
        .collect();
    served.sort_unstable();
    for (n, at) in (1..).zip(&served) {
        let allowed = 5 + at * 10 / 1000;
        assert!(n <= allowed, "{n} served by {at} ms, allowed {allowed}");
    }
    // Two seconds of waiting serve the bucket's 5 and 20 refilled ones.
    assert_eq!(served.len(), 25, "{outcomes:?}");
    let refused = outcomes.iter().flatten().count() - served.len();
    assert_eq!(refused, 5);
}

#[tokio::test(start_paused = true)]
async fn acquire_waits_for_its_tokens_too() {
    let global = MemoryGlobalStore::with_clock(TokioClock::new());
    let start = Instant::now();
    let drip = Limit::per(1, Duration::from_millis(3)).burst(1).unwrap();
    let layer = layer(drip, Shaping::wait(Duration::from_millis(5)), &global);
    let key = || "job".to_owned();

    assert_eq!(
        layer.acquire(key(), 1).await.map(|a| a.from_leases()),
        Ok(true)
    );
    assert_eq!(
        layer.acquire(key(), 1).await.map(|a| a.from_leases()),
        Ok(true)
    );
    assert_eq!(start.elapsed(), Duration::from_millis(3));
    // Two more at once: the first waits 3 ms, the second would wait 6 ms (> 5): refused now.
    let (a, b) = tokio::join!(layer.acquire(key(), 1), layer.acquire(key(), 1));
    assert_eq!(a.map(|a| a.from_leases()), Ok(true));
    let refused = b.unwrap_err();
    assert_eq!(refused.retry_after, Some(Duration::from_millis(6)));
    assert_eq!(start.elapsed(), Duration::from_millis(6));
}

#[tokio::test(start_paused = true)]
async fn reservations_tell_their_delay_at_once_and_give_up_their_place_when_dropped() {
    let global = MemoryGlobalStore::with_clock(TokioClock::new());
    let start = Instant::now();
    let drip = Limit::per(1, Duration::from_millis(3)).burst(1).unwrap();
    // A layer that refuses its requests: reservations wait all the same, up to their `max`.
    let layer = layer(drip, Shaping::Refuse, &global);
    let max = Duration::from_millis(10);
    let reserve = || layer.reserve("job".to_owned(), 1, max);

    let first = reserve().await.unwrap();
    let second = reserve().await.unwrap();
    let third = reserve().await.unwrap();
    let fourth = reserve().await.unwrap();
    let delays = [&first, &second, &third, &fourth].map(|r| r.delay());
    let ms = Duration::from_millis;
    assert_eq!(delays, [ms(0), ms(3), ms(6), ms(9)]);
    assert_eq!(start.elapsed(), Duration::ZERO, "none of them waited");
    // The fifth would be due at 12 ms: past its 10 ms, refused at once.
    let refused = reserve().await.unwrap_err();
    assert_eq!(refused.retry_after, Some(ms(12)));

    first.await.unwrap();
    drop(second);
    third.await.unwrap();
    assert_eq!(
        start.elapsed(),
        ms(3),
        "the third took the dropped second's turn"
    );
    fourth.await.unwrap();
    assert_eq!(start.elapsed(), ms(6));
}

#[tokio::test(start_paused = true)]
async fn a_reservation_admitted_at_once_gives_its_tokens_back_when_dropped_unused() {
    let global = MemoryGlobalStore::with_clock(TokioClock::new());
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key(|job: &u64| Some(*job))
        .clock(TokioClock::new())
        .quota(
            "fast: 10/s burst 2; slow: 2/min"
                .parse::<hierarchical_throttle::Quota>()
                .unwrap(),
        )
        .global_store(global)
        .build()
        .unwrap();
    let max = Duration::from_secs(1);

    // Two uses fit both limits; the first reservation is dropped without being awaited, so
    // its tokens go back to both, and two more fit.
    let dropped = layer.reserve(7, 1, max).await.unwrap();
    assert_eq!(dropped.delay(), Duration::ZERO);
    drop(dropped);
    for _ in 0..2 {
        let kept = layer.reserve(7, 1, max).await.unwrap();
        assert_eq!(kept.delay(), Duration::ZERO);
        kept.await.unwrap();
    }
    // The slow limit (2 a minute) is spent now: the next is half a minute away, past `max`.
    let refused = layer.reserve(7, 1, max).await.unwrap_err();
    assert_eq!(refused.limit_name, Some("slow"));
}

/// Polls `reservation` once, with a waker that is never called: it is then kept, unpolled.
fn poll_once<F: std::future::Future + Unpin>(future: &mut F) -> std::task::Poll<F::Output> {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    std::pin::Pin::new(future).poll(&mut cx)
}

#[tokio::test(start_paused = true)]
async fn a_reservation_kept_unpolled_never_holds_a_request_past_its_own_wait() {
    let global = MemoryGlobalStore::with_clock(TokioClock::new());
    let start = Instant::now();
    let limit = Limit::per_second(10).burst(1).unwrap();
    let layer = layer(limit, Shaping::wait(Duration::from_millis(200)), &global);
    let app = app(&layer);
    assert_eq!(send(&app, "u1", start).await, Outcome::Served(0));

    // A reservation takes the key's turn, then is kept without being polled again.
    let mut parked = layer
        .reserve("u1".to_owned(), 1, Duration::from_secs(30))
        .await
        .unwrap();
    assert!(poll_once(&mut parked).is_pending());
    // The request behind it is decided within its own 200 ms, on what the bucket then holds.
    assert_eq!(send(&app, "u1", start).await, Outcome::Served(200));

    // A holder past its own deadline does not hold up those behind it at all.
    let mut parked = layer
        .reserve("u2".to_owned(), 1, Duration::from_millis(10))
        .await
        .unwrap();
    assert_eq!(parked.delay(), Duration::ZERO, "admitted at once");
    assert!(poll_once(&mut parked).is_ready());
    let mut parked = layer
        .reserve("u2".to_owned(), 1, Duration::from_millis(100))
        .await
        .unwrap();
    assert!(poll_once(&mut parked).is_pending());
    assert_eq!(send(&app, "u2", start).await, Outcome::Served(300));
    drop(parked);
}

#[tokio::test(start_paused = true)]
async fn shadow_mode_never_waits_never_refuses_and_takes_nothing_it_would_refuse() {
    let global = MemoryGlobalStore::with_clock(TokioClock::new());
    let start = Instant::now();
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key(|req: &Request<Body>| key::header_value(req, "x-user"))
        .clock(TokioClock::new())
        .limit(Limit::per_second(1).burst(1).unwrap())
        .shaping(Shaping::wait(Duration::from_secs(1)))
        .shadow(true)
        .global_store(global.clone())
        .build()
        .unwrap();
    let app = app(&layer);
    for _ in 0..3 {
        assert_eq!(send(&app, "u1", start).await, Outcome::Served(0));
    }
    assert_eq!(layer.stats().shadow_admitted, 2);
    assert_eq!(layer.stats().shaped_waits, 0);
    // Outside tower too: never an error, never a wait.
    assert!(layer.acquire("u1".to_owned(), 1).await.is_ok());
    let reserved = layer
        .reserve("u1".to_owned(), 1, Duration::from_secs(1))
        .await
        .unwrap();
    assert_eq!(reserved.delay(), Duration::ZERO);
    assert!(reserved.await.is_ok());
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(layer.stats().shadow_admitted, 4);
    // The refused uses took nothing: the bucket is refilled after one second, as after one use.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let probe = layer.remaining(&"u1".to_owned());
    assert_eq!(probe[0].tokens, 1);
}

#[tokio::test(start_paused = true)]
async fn users_waiting_on_their_tenant_wake_one_at_a_time_and_count_once() {
    let global = MemoryGlobalStore::with_clock(TokioClock::new());
    let start = Instant::now();
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key(|req: &Request<Body>| key::header_value(req, "x-user"))
        .clock(TokioClock::new())
        .limit(Limit::per_second(100).burst(100).unwrap())
        .level(
            "tenant",
            |req: &Request<Body>| key::header_value(req, "x-tenant"),
            Limit::per_second(10).burst(1).unwrap(),
        )
        .shaping(Shaping::wait(Duration::from_secs(10)))
        .global_store(global.clone())
        .build()
        .unwrap();
    let app = app(&layer);
    let call = |user: usize| {
        let app = app.clone();
        async move {
            let request = Request::get("/")
                .header("x-user", format!("u{user}"))
                .header("x-tenant", "acme")
                .body(Body::empty())
                .unwrap();
            let response = app.oneshot(request).await.unwrap();
            assert_eq!(response.status(), StatusCode::OK);
            start.elapsed().as_millis() as u64
        }
    };
    let mut served = join_all((0..50).map(call)).await;
    served.sort_unstable();
    // The tenant's token every 100 ms, in turn: no user's wait is woken for another's token.
    assert_eq!(served, (0..50).map(|i| i * 100).collect::<Vec<_>>());
    let stats = layer.stats();
    assert_eq!((stats.rejected_cached, stats.rejected_global), (0, 0));
    assert_eq!((stats.shaped_waits, stats.shaped_refusals), (49, 0));
}

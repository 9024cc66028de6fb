//! Limits changed while the fleet runs (`limit_per_key` reading a shared setting), on tokio's
//! paused time: a change applies from each host's next batch, even on a lease that never runs
//! dry, and tokens never cross from one limit's bucket to another's (refunds, hand-backs).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use hierarchical_throttle::clock::{Clock, TokioClock};
use hierarchical_throttle::global::GlobalStore;
use hierarchical_throttle::local::LocalStore;
use hierarchical_throttle::quota::{BucketKey, LeaseKey};
use hierarchical_throttle::{
    HierarchicalThrottleLayer, MemoryGlobalStore, MemoryLocalStore, Quota, key,
};
use http::{Request, Response, StatusCode};
use tokio::sync::Notify;
use tokio::time::Instant;
use tower::ServiceExt;

type Global = MemoryGlobalStore<String, TokioClock>;

/// The quota every key gets, changed by the test while the layer runs.
type Setting = Arc<Mutex<Quota>>;

fn setting(quota: &str) -> Setting {
    Arc::new(Mutex::new(quota.parse().unwrap()))
}

fn set(setting: &Setting, quota: &str) {
    *setting.lock().unwrap() = quota.parse().unwrap();
}

/// A layer keyed by `String`s whose quota is `setting`'s, with leases living `lease_ttl`.
fn keyed_by_string(
    setting: &Setting,
    global: &Global,
    lease_ttl: Duration,
) -> HierarchicalThrottleLayer<String, String, Global, MemoryLocalStore<String>, TokioClock> {
    let read = setting.clone();
    HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key(|k: &String| Some(k.clone()))
        .limit_per_key(move |_: &String| read.lock().unwrap().clone())
        .clock(TokioClock::new())
        .lease_ttl(lease_ttl)
        .global_store(global.clone())
        .build()
        .unwrap()
}

/// Leased tokens this layer holds in `key`'s bucket of slot `slot`.
fn held<Req, G, C, R>(
    layer: &HierarchicalThrottleLayer<Req, String, G, MemoryLocalStore<String>, C, R>,
    key: &str,
    slot: u8,
) -> u64
where
    G: GlobalStore<BucketKey<String>>,
    C: Clock,
{
    let id = LeaseKey::new(key.to_owned(), 0, slot);
    layer
        .local_store()
        .peek_bucket(&id, |b| b.leased_tokens())
        .unwrap_or(0)
}

/// Uses of `key` at `per_second` for `secs` seconds; how many were admitted.
async fn drive<G, L, C, R>(
    layer: &HierarchicalThrottleLayer<String, String, G, L, C, R>,
    key: &str,
    per_second: u64,
    secs: u64,
) -> u64
where
    G: GlobalStore<BucketKey<String>>,
    L: LocalStore<LeaseKey<String>>,
    C: Clock,
{
    let start = Instant::now();
    let gap = Duration::from_secs(1) / per_second as u32;
    let mut admitted = 0;
    for i in 0..per_second * secs {
        tokio::time::sleep_until(start + gap * i as u32).await;
        if layer.acquire(key.to_owned(), 1).await.is_ok() {
            admitted += 1;
        }
    }
    admitted
}

#[tokio::test(start_paused = true)]
async fn a_limit_added_at_run_time_is_enforced_on_a_hot_key_from_its_next_batch() {
    let quota = setting("a: 1000/s burst 1000");
    let global: Global = MemoryGlobalStore::with_clock(TokioClock::new());
    let layer = keyed_by_string(&quota, &global, Duration::from_secs(2));
    // A hot key far below its limit: its lease never runs dry, it is refilled ahead of need.
    assert_eq!(drive(&layer, "k", 300, 1).await, 300);

    set(&quota, "a: 1000/s burst 1000; b: 10/s burst 10");
    let lease = held(&layer, "k", 0);
    let admitted = drive(&layer, "k", 300, 10).await;
    // b allows 10 + 10 x 10 s; at most the lease held at the change goes without it.
    assert!(
        admitted <= 110 + lease,
        "admitted {admitted} with b allowing 110 (+ a lease of {lease})"
    );
    assert!(admitted >= 100, "b's allowance is used: {admitted}");
    let left = layer.remaining(&"k".to_owned());
    assert_eq!(left.len(), 2, "the view shows b too");
    assert!(left[1].tokens < 10, "b was drawn on: {left:?}");
}

/// A service reporting the tokens it used in `x-tokens-used`: a request with `x-hold` says
/// it `started`, and is answered only when told to `go`, having used none; the others at once,
/// having used all.
fn held_response(started: Arc<Notify>, go: Arc<Notify>) -> Router {
    Router::new().route(
        "/",
        get(move |headers: http::HeaderMap| {
            let (started, go) = (started.clone(), go.clone());
            async move {
                let used = match headers.contains_key("x-hold") {
                    true => {
                        started.notify_one();
                        go.notified().await;
                        "0"
                    }
                    false => "10",
                };
                Response::builder()
                    .header("x-tokens-used", used)
                    .body(Body::empty())
                    .unwrap()
            }
        }),
    )
}

fn used(response: &Response<Body>, charged: u64) -> u64 {
    response
        .headers()
        .get("x-tokens-used")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .unwrap_or(charged)
}

#[tokio::test(start_paused = true)]
async fn a_refund_goes_only_to_the_buckets_the_request_drew_on() {
    let quota = setting("a: 100/s burst 100");
    let global: Global = MemoryGlobalStore::with_clock(TokioClock::new());
    let read = quota.clone();
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key(|req: &Request<Body>| key::header_value(req, "x-user"))
        .limit_per_key(move |_: &String| read.lock().unwrap().clone())
        .cost(|_: &Request<Body>| 10)
        .settle(used as fn(&Response<Body>, u64) -> u64)
        .clock(TokioClock::new())
        .lease_ttl(Duration::from_secs(1))
        .global_store(global.clone())
        .build()
        .unwrap();
    let (started, go) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let app = held_response(started.clone(), go.clone()).layer(layer.clone());
    let request = || {
        Request::get("/")
            .header("x-user", "u")
            .body(Body::empty())
            .unwrap()
    };
    // Charged 10 under the one-limit quota; its response comes later.
    let mut held_back = request();
    held_back
        .headers_mut()
        .insert("x-hold", http::HeaderValue::from_static("1"));
    let first = tokio::spawn(app.clone().oneshot(held_back));
    started.notified().await;

    // The key gains limit b, and this host leases b's tokens.
    set(&quota, "a: 100/s burst 100; b: 100/s burst 100");
    tokio::time::sleep(Duration::from_secs(2)).await;
    layer.return_unused_leases().await;
    let second = app.clone().oneshot(request()).await.unwrap();
    assert_eq!(second.status(), StatusCode::OK);
    let b = LeaseKey::new("u".to_owned(), 0, 1);
    assert!(
        layer.local_store().peek_bucket(&b, |_| ()).is_some(),
        "b is drawn on"
    );
    let b_before = held(&layer, "u", 1);

    // The first request used nothing: its 10 go back to a's lease only.
    go.notify_one();
    let response = first.await.unwrap().unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(held(&layer, "u", 1), b_before, "b never gave those tokens");
    assert_eq!(layer.stats().tokens_refunded, 10);
}

#[tokio::test(start_paused = true)]
async fn a_lease_of_a_renamed_limit_is_never_handed_back_to_the_new_one() {
    let quota = setting("a: 100/s burst 100");
    let global: Global = MemoryGlobalStore::with_clock(TokioClock::new());
    let layer = keyed_by_string(&quota, &global, Duration::from_secs(1));

    assert_eq!(drive(&layer, "k", 50, 1).await, 50);
    let lease = held(&layer, "k", 0);
    assert!(lease > 0, "batches sized by demand leave some");
    // What fetches took back out of a's bucket as it refilled around the lease (see
    // `LocalBucket::take_back`) is forfeited too, before the change.
    let forfeited = layer.stats().tokens_forfeited;
    set(&quota, "c: 100/s burst 100");
    // Past the lease time-to-live, and the ten a small lease may be kept for.
    tokio::time::sleep(Duration::from_secs(11)).await;
    layer.return_unused_leases().await;

    let stats = layer.stats();
    assert_eq!(stats.tokens_returned, 0, "c never dispensed them");
    assert_eq!(stats.tokens_forfeited - forfeited, lease);
    let c = BucketKey::new("k".to_owned(), "c").unwrap();
    let limit = "100/s burst 100".parse().unwrap();
    assert_eq!(global.peek(&c, &limit).tokens(), 100, "c untouched");
    // Under its new name the key starts on c's own tokens.
    assert!(layer.acquire("k".to_owned(), 1).await.is_ok());
    assert_eq!(
        global.peek(&c, &limit).tokens(),
        100 - held(&layer, "k", 0) - 1
    );
}

/// A request one bucket refuses is told the longest wait its other buckets are known to need;
/// after a level's limit changed, what the host knew of the limit before says nothing of it.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_refusal_never_tells_a_wait_known_of_a_limit_changed_since() {
    let every_ten_seconds = |name: &str| {
        let limit = hierarchical_throttle::Limit::per(1, Duration::from_secs(10))
            .build()
            .unwrap();
        Quota::new(name, limit).unwrap()
    };
    let tenant = Arc::new(Mutex::new(every_ten_seconds("per-10s")));
    let clock = TokioClock::new();
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key(|job: &(String, String)| Some(job.0.clone()))
        .limit(hierarchical_throttle::Limit::per_second(1).build().unwrap())
        .level_per_key("tenant", |job: &(String, String)| Some(job.1.clone()), {
            let tenant = tenant.clone();
            move |_: &String| tenant.lock().unwrap().clone()
        })
        .clock(clock)
        .global_store(Global::with_clock(clock))
        .build()
        .unwrap();
    let job = |user: &str| layer.keys(user.to_owned(), [("tenant", "acme")]).unwrap();
    layer.acquire_keys(job("alice"), 1).await.unwrap();
    let refused = layer.acquire_keys(job("bob"), 1).await.unwrap_err();
    assert_eq!(
        (
            refused.level,
            refused.limit_name,
            refused.retry_after_secs()
        ),
        (Some("tenant"), Some("per-10s"), Some(10))
    );
    // The tenant's limit renamed: a bucket of its own, full. Alice's own limit refuses her
    // next request, for a second; the tenant's new bucket would serve it.
    *tenant.lock().unwrap() = every_ten_seconds("tier2");
    // Nor does a view of the tenant's limits tell what the host knew of the old one.
    let views = layer.remaining_keys(&job("alice"));
    assert_eq!((views[1].limit_name, views[1].tokens), ("tier2", 1));
    let refused = layer.acquire_keys(job("alice"), 1).await.unwrap_err();
    assert_eq!(
        (
            refused.level,
            refused.limit_name,
            refused.retry_after_secs()
        ),
        (None, Some("default"), Some(1)),
        "{refused:?}"
    );
}

/// A key refused under a limit of one a minute, whose limit is raised to a hundred a second,
/// waits for the new limit's next token (10 ms), not for the old one's (a minute): neither the
/// host's memory of the refusal nor the store's bucket holds it back.
#[tokio::test(start_paused = true)]
async fn a_raised_limit_is_not_held_back_by_the_old_limit_s_wait() {
    let quota = setting("a: 1/min burst 1");
    let global: Global = MemoryGlobalStore::with_clock(TokioClock::new());
    let layer = keyed_by_string(&quota, &global, Duration::from_secs(2));
    let k = || "k".to_owned();
    assert!(layer.acquire(k(), 1).await.is_ok());
    let refused = layer.acquire(k(), 1).await.unwrap_err();
    assert_eq!(refused.retry_after, Some(Duration::from_secs(60)));
    tokio::time::sleep(Duration::from_secs(1)).await;
    set(&quota, "a: 100/s burst 100");
    // The sixtieth of a token accrued in that second is kept: 10 ms less a sixtieth.
    let refused = layer.acquire(k(), 1).await.unwrap_err();
    assert_eq!(refused.retry_after, Some(Duration::from_micros(9_834)));
    tokio::time::sleep(Duration::from_micros(9_834)).await;
    assert!(layer.acquire(k(), 1).await.is_ok());
    // From there on, the new rate (offered exactly: a lease's edges lose a few), not one a
    // minute.
    let admitted = drive(&layer, "k", 100, 1).await;
    assert!((90..=101).contains(&admitted), "{admitted}");
}

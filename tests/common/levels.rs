//! A fleet of layers with several limits and levels: the requests, and a ledger that checks
//! every bucket against its limit at every step.

use std::collections::HashMap;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use hierarchical_throttle::clock::{Clock, ManualClock};
use hierarchical_throttle::global::GlobalStore;
use hierarchical_throttle::quota::BucketKey;
use hierarchical_throttle::{ColdStart, HierarchicalThrottleLayer, Limit, Quota, key};
use http::{Request, StatusCode};
use tower::ServiceExt;

pub fn user(req: &Request<Body>) -> Option<String> {
    key::header_value(req, "x-user")
}

pub fn tenant(req: &Request<Body>) -> Option<String> {
    key::header_value(req, "x-tenant")
}

pub fn route(req: &Request<Body>) -> Option<String> {
    (req.uri().path() == "/bulk").then(|| "bulk".to_owned())
}

pub fn router() -> Router {
    Router::new()
        .route("/", get(|| async { "ok" }))
        .route("/bulk", get(|| async { "ok" }))
}

pub async fn call(
    app: &Router,
    path: &str,
    user: &str,
    tenant: Option<&str>,
) -> http::Response<Body> {
    let mut req = Request::get(path).header("x-user", user);
    if let Some(t) = tenant {
        req = req.header("x-tenant", t);
    }
    app.clone()
        .oneshot(req.body(Body::empty()).unwrap())
        .await
        .unwrap()
}

/// The hosts of the fleet.
const HOSTS: u64 = 4;

/// Counts, per bucket, what a fleet admitted, and checks each against its limit at every step:
/// `capacity + rate x elapsed`, and what each host may admit on credit before the store answers
/// (the default [`ColdStart`]).
struct Ledger {
    admitted: HashMap<String, u64>,
}

impl Ledger {
    fn admit(&mut self, buckets: &[(String, Limit)], elapsed: Duration) {
        for (bucket, limit) in buckets {
            let n = self.admitted.entry(bucket.clone()).or_default();
            *n += 1;
            let credit = HOSTS * ColdStart::default().credit(limit);
            let allowed = limit.capacity() as u128
                + u128::from(credit)
                + elapsed.as_micros() * limit.refill_amount() as u128
                    / limit.refill_period().as_micros();
            assert!(
                u128::from(*n) <= allowed,
                "bucket {bucket} admitted {n}, allowed {allowed} after {elapsed:?}"
            );
        }
    }
}

/// Four hosts with two limits per user, a tenant level and a route level, on one global store:
/// no bucket ever admits more than its limit allows, and every bucket is used.
pub async fn fleet_holds_every_bucket<G>(clock: &ManualClock, global: G)
where
    G: GlobalStore<BucketKey<String>> + Clone,
{
    let user_quota: Quota = "per-second: 5/s burst 5; per-minute: 120/min burst 20"
        .parse()
        .unwrap();
    let tenant_limit = Limit::per_second(12).burst(12).unwrap();
    let route_limit = Limit::per_second(4).burst(4).unwrap();
    let hosts: Vec<Router> = (0..HOSTS)
        .map(|_| {
            let layer = HierarchicalThrottleLayer::builder()
                .key(user)
                .clock(clock.clone())
                .quota(user_quota.clone())
                .level("tenant", tenant, tenant_limit)
                .level("route", route, route_limit)
                .global_store(global.clone())
                .build()
                .unwrap();
            router().layer(layer)
        })
        .collect();
    let mut ledger = Ledger {
        admitted: HashMap::new(),
    };
    let (mut sent, mut served) = (0u64, 0u64);
    let start = clock.now();
    for ms in 0..20_000u64 {
        clock.set(start + Duration::from_millis(ms));
        let elapsed = Duration::from_millis(ms);
        let h = (ms % HOSTS) as usize;
        let u = (ms / 3 % 6) as usize;
        let t = if u < 4 { "acme" } else { "globex" };
        let path = if ms % 7 == 0 { "/bulk" } else { "/" };
        let user_name = format!("u{u}");
        sent += 1;
        let response = call(&hosts[h], path, &user_name, Some(t)).await;
        if response.status() != StatusCode::OK {
            assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
            continue;
        }
        served += 1;
        let mut buckets = vec![
            (
                format!("{user_name}/per-second"),
                user_quota.get("per-second").copied().unwrap(),
            ),
            (
                format!("{user_name}/per-minute"),
                user_quota.get("per-minute").copied().unwrap(),
            ),
            (format!("tenant {t}"), tenant_limit),
        ];
        if path == "/bulk" {
            buckets.push(("route bulk".to_owned(), route_limit));
        }
        ledger.admit(&buckets, elapsed);
    }
    // The users' per-minute limits bind: 6 x (20 + 2/s x 20 s) = 360, and at most a token of
    // credit per host and user: 384 at most.
    assert!((320..=384).contains(&served), "served {served} of {sent}");
    for bucket in [
        "u0/per-minute",
        "tenant acme",
        "tenant globex",
        "route bulk",
    ] {
        assert!(
            ledger.admitted.get(bucket).copied().unwrap_or(0) > 0,
            "{bucket} unused"
        );
    }
}

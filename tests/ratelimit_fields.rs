//! `RateLimit-Policy` and `RateLimit` on every response, through an axum `Router` on a manual
//! clock: the values, the opt-out, shadow mode, several hosts, jitter on `Retry-After`, and a
//! Structured Fields parser reading them for ordinary and extreme limits.

use std::time::Duration;

mod common;

use axum::Router;
use axum::body::Body;
use common::levels::{call, router, tenant, user};
use hierarchical_throttle::clock::ManualClock;
use hierarchical_throttle::{
    HierarchicalThrottleLayer, Limit, MemoryGlobalStore, Quota, RateLimitFields, key,
};
use http::{Request, StatusCode};

fn ten_per_second() -> Limit {
    Limit::per_second(10).burst(10).unwrap()
}

fn app(clock: &ManualClock, global: &MemoryGlobalStore<String, ManualClock>) -> Router {
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key(user)
        .clock(clock.clone())
        .limit(ten_per_second())
        .global_store(global.clone())
        .build()
        .unwrap();
    router().layer(layer)
}

fn field(response: &http::Response<axum::body::Body>, name: &str) -> Option<String> {
    let values: Vec<_> = response
        .headers()
        .get_all(name)
        .iter()
        .map(|v| v.to_str().unwrap().to_owned())
        .collect();
    (!values.is_empty()).then(|| values.join(", "))
}

#[tokio::test]
async fn admitted_responses_tell_the_tokens_left_and_when_more_come() {
    let clock = ManualClock::new();
    let app = app(&clock, &MemoryGlobalStore::with_clock(clock.clone()));

    for left in (0..10).rev() {
        let response = call(&app, "/", "u1", None).await;
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(
            field(&response, "ratelimit-policy").as_deref(),
            Some("\"default\";q=10;qu=\"requests\";w=1")
        );
        // Within the second: what is left, and the nine tokens that refill before it ends
        // (one every 100 ms from 100 ms on).
        assert_eq!(
            field(&response, "ratelimit"),
            Some(format!("\"default\";r={};t=1", left + 9))
        );
    }
    let refused = call(&app, "/", "u1", None).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        field(&refused, "ratelimit").as_deref(),
        Some("\"default\";r=0;t=1")
    );

    // Half a second later, five tokens have refilled: the next response counts them.
    clock.advance(Duration::from_millis(500));
    let response = call(&app, "/", "u1", None).await;
    assert_eq!(
        field(&response, "ratelimit").as_deref(),
        Some("\"default\";r=13;t=1")
    );
}

#[tokio::test]
async fn a_host_counts_what_other_hosts_took_from_the_global_bucket() {
    let clock = ManualClock::new();
    let global = MemoryGlobalStore::with_clock(clock.clone());
    // Batches of exactly what a request needs, so the counts below are exact.
    let host = || {
        let layer = HierarchicalThrottleLayer::builder()
            .cold_start(hierarchical_throttle::ColdStart::Exact)
            .key(user)
            .clock(clock.clone())
            .limit(ten_per_second())
            .batch_policy(|_: &hierarchical_throttle::batch::BatchContext<'_>| 0)
            .global_store(global.clone())
            .build()
            .unwrap();
        (router().layer(layer.clone()), layer)
    };
    let ((a, _), (b, layer_b)) = (host(), host());

    for _ in 0..4 {
        assert_eq!(call(&a, "/", "u1", None).await.status(), StatusCode::OK);
    }
    let on_b = call(&b, "/", "u1", None).await;
    assert_eq!(
        field(&on_b, "ratelimit").as_deref(),
        Some("\"default\";r=14;t=1"),
        "10, less host a's 4 and this one, and 9 more within the second"
    );
    let view = &layer_b.remaining(&"u1".to_owned())[0];
    assert_eq!((view.tokens, view.full_in), (5, Duration::from_millis(500)));
    let global_view = &layer_b.remaining_global(&"u1".to_owned()).await.unwrap()[0];
    assert_eq!(global_view.tokens, 5);
    assert_eq!(global_view.next_in, Duration::from_millis(100));
    clock.advance(Duration::from_millis(250));
    assert_eq!(
        layer_b.remaining(&"u1".to_owned())[0].tokens,
        7,
        "refilled since"
    );
    assert_eq!(
        layer_b.remaining(&"u9".to_owned())[0].tokens,
        10,
        "a key never seen is full"
    );
}

#[tokio::test]
async fn every_limit_at_every_level_is_one_item() {
    let clock = ManualClock::new();
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key(user)
        .clock(clock.clone())
        .quota(
            "per-second: 5/s; per-minute: 20/min"
                .parse::<Quota>()
                .unwrap(),
        )
        .level("tenant", tenant, "default: 100/h".parse::<Quota>().unwrap())
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    let app = router().layer(layer);

    let response = call(&app, "/", "u1", Some("acme")).await;
    assert_eq!(
        field(&response, "ratelimit-policy").as_deref(),
        Some(
            "\"per-second\";q=5;qu=\"requests\";w=1, \"per-minute\";q=20;qu=\"requests\";w=60, \
             \"tenant\";q=100;qu=\"requests\";w=3600"
        )
    );
    assert_eq!(
        field(&response, "ratelimit").as_deref(),
        Some("\"per-second\";r=8;t=1, \"per-minute\";r=38;t=60, \"tenant\";r=198;t=3600")
    );
    // Without a tenant, only the user's limits applied.
    let response = call(&app, "/", "u2", None).await;
    assert_eq!(
        field(&response, "ratelimit").as_deref(),
        Some("\"per-second\";r=8;t=1, \"per-minute\";r=38;t=60")
    );
}

#[tokio::test]
async fn the_fields_can_be_turned_off_for_admitted_responses_but_refusals_keep_them() {
    let clock = ManualClock::new();
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key(user)
        .clock(clock.clone())
        .limit(Limit::per_second(1).burst(1).unwrap())
        .ratelimit_fields(false)
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    let app = router().layer(layer);

    let admitted = call(&app, "/", "u1", None).await;
    assert_eq!(admitted.status(), StatusCode::OK);
    assert_eq!(field(&admitted, "ratelimit"), None);
    assert_eq!(field(&admitted, "ratelimit-policy"), None);
    let refused = call(&app, "/", "u1", None).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        field(&refused, "ratelimit").as_deref(),
        Some("\"default\";r=0;t=1")
    );
}

#[tokio::test]
async fn shadow_mode_serves_the_request_with_the_fields_of_its_refusal() {
    let clock = ManualClock::new();
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key(user)
        .clock(clock.clone())
        .limit(Limit::per_minute(1).burst(1).unwrap())
        .shadow(true)
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    let app = router().layer(layer.clone());

    let first = call(&app, "/", "u1", None).await;
    assert_eq!(
        field(&first, "ratelimit").as_deref(),
        Some("\"default\";r=0;t=60")
    );
    clock.advance(Duration::from_secs(15));
    let would_be_refused = call(&app, "/", "u1", None).await;
    assert_eq!(would_be_refused.status(), StatusCode::OK);
    assert_eq!(would_be_refused.headers().get("retry-after"), None);
    assert_eq!(
        field(&would_be_refused, "ratelimit").as_deref(),
        Some("\"default\";r=0;t=45")
    );
    assert_eq!(
        field(&would_be_refused, "ratelimit-policy").as_deref(),
        Some("\"default\";q=1;qu=\"requests\";w=60")
    );
    assert_eq!(layer.stats().shadow_admitted, 1);
}

#[tokio::test]
async fn jitter_spreads_retry_after_without_ever_shortening_it() {
    let clock = ManualClock::new();
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key(user)
        .clock(clock.clone())
        .limit(Limit::per_minute(1).burst(1).unwrap())
        .retry_after_jitter(Duration::from_secs(30))
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    let app = router().layer(layer);

    assert_eq!(call(&app, "/", "u1", None).await.status(), StatusCode::OK);
    let mut waits = std::collections::BTreeSet::new();
    for _ in 0..50 {
        let refused = call(&app, "/", "u1", None).await;
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        let secs: u64 = field(&refused, "retry-after").unwrap().parse().unwrap();
        assert!(
            (60..=90).contains(&secs),
            "{secs} s is not 60 s plus at most 30 s"
        );
        let t = format!("\"default\";r=0;t={secs}");
        assert_eq!(
            field(&refused, "ratelimit"),
            Some(t),
            "t agrees with Retry-After"
        );
        waits.insert(secs);
    }
    assert!(waits.len() >= 10, "50 refusals spread over only {waits:?}");
}

/// The fields parsed by a Structured Fields parser: lists of strings with their parameters,
/// integers within the 15 digits allowed, for ordinary and extreme limits.
#[tokio::test]
async fn the_fields_are_valid_structured_fields_for_any_limit() {
    let limits = [
        (ten_per_second(), 10),
        (Limit::per_day(100_000).build().unwrap(), 100_000),
        (
            Limit::per_millisecond(1_000_000)
                .burst(Limit::MAX_CAPACITY)
                .unwrap(),
            1_000_000_000,
        ),
        // One token a year, burst 2^53.
        (
            Limit::per(1, Limit::MAX_PERIOD)
                .burst(Limit::MAX_CAPACITY)
                .unwrap(),
            1,
        ),
    ];
    for (limit, q) in limits {
        let clock = ManualClock::new();
        let layer = HierarchicalThrottleLayer::builder()
            .cold_start(hierarchical_throttle::ColdStart::Exact)
            .key(user)
            .clock(clock.clone())
            .quota(
                Quota::new("per-x.y_z", limit)
                    .unwrap()
                    .and("default", limit)
                    .unwrap(),
            )
            .ratelimit_fields(RateLimitFields::draft_11().partition_keys([1; 16]))
            .global_store(MemoryGlobalStore::with_clock(clock.clone()))
            .build()
            .unwrap();
        let app = router().layer(layer);
        let mut responses = Vec::new();
        for _ in 0..4 {
            responses.push(call(&app, "/", "u1", None).await);
        }
        for response in &responses {
            let items = items(response);
            let names: Vec<_> = items.iter().map(|i| i.name.as_str()).collect();
            assert_eq!(names, ["per-x.y_z", "default"], "{items:?}");
            for item in &items {
                assert_eq!(item.q, q, "{limit}");
                assert!(item.t >= 1 && item.w >= 1, "{item:?}");
                assert_eq!(item.unit, "requests");
                assert!(item.pk.is_some(), "{item:?}");
            }
        }
    }
}

/// While the store is down and the host decides alone with its share of the limit, the fields
/// of admitted responses tell what that share holds, not a full bucket: with the key made per
/// request, and borrowed from the request (whose admitted state is read in the lease's take).
#[tokio::test]
async fn fields_follow_the_fallback_share_while_the_store_is_down() {
    let clock = ManualClock::new();
    let store = common::FaultyStore::new(MemoryGlobalStore::with_clock(clock.clone()));
    store.set(common::Fault::Error);
    let builder = || {
        HierarchicalThrottleLayer::builder()
            .cold_start(hierarchical_throttle::ColdStart::Exact)
            .clock(clock.clone())
            .limit(Limit::per_second(10).burst(200).unwrap())
            .failure_policy(hierarchical_throttle::FailurePolicy::local_fallback(2).unwrap())
    };
    let owned = builder().key(user).global_store(store.clone());
    fallback_share_in_the_fields(router().layer(owned.build().unwrap())).await;
    let borrowed = builder()
        .key_ref(|req: &Request<Body>| key::header_str(req, "x-user"))
        .global_store(store);
    fallback_share_in_the_fields(router().layer(borrowed.build().unwrap())).await;
}

async fn fallback_share_in_the_fields(app: Router) {
    let mut left = Vec::new();
    for _ in 0..101 {
        let response = call(&app, "/", "u1", None).await;
        match response.status() {
            StatusCode::OK => left.push(field(&response, "ratelimit").unwrap()),
            refused => {
                assert_eq!(refused, StatusCode::TOO_MANY_REQUESTS);
                break;
            }
        }
    }
    // The host's share, 5/s and 100 of the burst of 200: what is left, and the four tokens
    // that refill within the second (one every 200 ms).
    assert_eq!(left.len(), 100);
    assert_eq!(left[0], r#""default";r=103;t=1"#);
    assert_eq!(left[99], r#""default";r=4;t=1"#);
}

/// One limit as both fields describe it, read by a Structured Fields parser that checks every
/// parameter's type: `q`, `w`, `r`, `t` and `ht-burst` integers of at most 15 digits, `qu` a
/// string, `pk` a byte sequence, and nothing else.
#[derive(Debug, PartialEq, Eq)]
struct Item {
    name: String,
    q: i64,
    unit: String,
    w: i64,
    burst: Option<i64>,
    r: i64,
    t: i64,
    pk: Option<Vec<u8>>,
}

fn parse_list(value: &str) -> Vec<(String, sfv::Parameters)> {
    let list: sfv::List = sfv::Parser::new(value)
        .parse()
        .unwrap_or_else(|e| panic!("{value:?} does not parse: {e}"));
    list.into_iter()
        .map(|entry| {
            let sfv::ListEntry::Item(item) = entry else {
                panic!("{value}: an inner list");
            };
            let name = item.bare_item.as_string().expect("a string").as_str();
            (name.to_owned(), item.params)
        })
        .collect()
}

fn integer(params: &sfv::Parameters, key: &str) -> Option<i64> {
    let value = params.get(key)?;
    let n = i64::from(
        value
            .as_integer()
            .unwrap_or_else(|| panic!("{key}: {value:?}")),
    );
    assert!((0..=999_999_999_999_999).contains(&n), "{key}={n}");
    Some(n)
}

fn items(response: &http::Response<axum::body::Body>) -> Vec<Item> {
    let policy = parse_list(&field(response, "ratelimit-policy").expect("RateLimit-Policy"));
    let state = parse_list(&field(response, "ratelimit").expect("RateLimit"));
    assert_eq!(policy.len(), state.len());
    let pk = |params: &sfv::Parameters| {
        params
            .get("pk")
            .map(|pk| pk.as_byte_sequence().expect("pk: a byte sequence").to_vec())
    };
    policy
        .into_iter()
        .zip(state)
        .map(|((name, p), (state_name, s))| {
            assert_eq!(name, state_name, "the two fields list the same limits");
            for key in p.keys() {
                assert!(
                    ["q", "qu", "w", "ht-burst", "pk"].contains(&key.as_str()),
                    "{key}"
                );
            }
            for key in s.keys() {
                assert!(["r", "t", "pk"].contains(&key.as_str()), "{key}");
            }
            assert_eq!(pk(&p), pk(&s), "one partition key for the limit");
            Item {
                name,
                q: integer(&p, "q").expect("q"),
                unit: p["qu"]
                    .as_string()
                    .expect("qu: a string")
                    .as_str()
                    .to_owned(),
                w: integer(&p, "w").expect("w"),
                burst: integer(&p, "ht-burst"),
                r: integer(&s, "r").expect("r"),
                t: integer(&s, "t").expect("t"),
                pk: pk(&p),
            }
        })
        .collect()
}

/// Requests that each cost one token count `requests`; other costs `tokens`, or the unit the
/// layer names, per limit.
#[tokio::test]
async fn quota_units_say_what_the_tokens_count() {
    let clock = ManualClock::new();
    let build = |fields: Option<RateLimitFields>, cost: bool| {
        let mut builder = HierarchicalThrottleLayer::builder()
            .key(user)
            .clock(clock.clone())
            .quota(
                "per-second: 1000/s; per-day: 1000000/day"
                    .parse::<Quota>()
                    .unwrap(),
            )
            .level("tenant", tenant, Limit::per_minute(5_000).build().unwrap());
        if cost {
            builder = builder
                .cost(|req: &http::Request<axum::body::Body>| req.headers().len() as u64 * 100);
        }
        if let Some(fields) = fields {
            builder = builder.ratelimit_fields(fields);
        }
        router().layer(
            builder
                .global_store(MemoryGlobalStore::with_clock(clock.clone()))
                .build()
                .unwrap(),
        )
    };
    let units = |response: &http::Response<axum::body::Body>| {
        items(response)
            .into_iter()
            .map(|i| (i.name, i.unit))
            .collect::<Vec<_>>()
    };
    let of = |pairs: &[(&str, &str)]| {
        pairs
            .iter()
            .map(|&(n, u)| (n.to_owned(), u.to_owned()))
            .collect::<Vec<_>>()
    };
    let plain = call(&build(None, false), "/", "u1", Some("acme")).await;
    assert_eq!(
        units(&plain),
        of(&[
            ("per-second", "requests"),
            ("per-day", "requests"),
            ("tenant", "requests")
        ])
    );
    let costed = call(&build(None, true), "/", "u1", Some("acme")).await;
    assert_eq!(
        units(&costed),
        of(&[
            ("per-second", "tokens"),
            ("per-day", "tokens"),
            ("tenant", "tokens")
        ])
    );
    let named = RateLimitFields::draft_11()
        .unit("content-bytes")
        .unit_of("per-day", "llm-tokens")
        .unit_of("tenant/default", "requests");
    let named = call(&build(Some(named), true), "/", "u1", Some("acme")).await;
    assert_eq!(
        units(&named),
        of(&[
            ("per-second", "content-bytes"),
            ("per-day", "llm-tokens"),
            ("tenant", "requests")
        ])
    );
    // A unit that a Structured Field string cannot hold is refused when the layer is built.
    let error = HierarchicalThrottleLayer::builder()
        .key(user)
        .limit(ten_per_second())
        .ratelimit_fields(RateLimitFields::draft_11().unit("bytes \"raw\""))
        .global_store(MemoryGlobalStore::new())
        .build()
        .unwrap_err();
    assert!(error.to_string().contains("bytes \"raw\""), "{error}");
    // A unit for a limit the layer does not have is an error too, naming it.
    let error = HierarchicalThrottleLayer::builder()
        .key(user)
        .limit(ten_per_second())
        .ratelimit_fields(RateLimitFields::draft_11().unit_of("per-day", "requests"))
        .global_store(MemoryGlobalStore::new())
        .build()
        .unwrap_err();
    assert!(error.to_string().contains("`per-day`"), "{error}");
}

/// Partition keys are opt-in, the same for a key on every host sharing the secret, apart for
/// other keys and for each level, and never the key itself.
#[tokio::test]
async fn partition_keys_tell_keys_and_levels_apart_without_revealing_them() {
    let clock = ManualClock::new();
    let global = MemoryGlobalStore::with_clock(clock.clone());
    let host = |secret: Option<[u8; 16]>| {
        let fields = match secret {
            Some(secret) => RateLimitFields::draft_11().partition_keys(secret),
            None => RateLimitFields::draft_11(),
        };
        router().layer(
            HierarchicalThrottleLayer::builder()
                .key(user)
                .clock(clock.clone())
                .limit(ten_per_second())
                .level("tenant", tenant, Limit::per_minute(600).build().unwrap())
                .ratelimit_fields(fields)
                .global_store(global.clone())
                .build()
                .unwrap(),
        )
    };
    let pks = |response: http::Response<axum::body::Body>| {
        items(&response)
            .into_iter()
            .map(|i| i.pk.expect("a partition key"))
            .collect::<Vec<_>>()
    };
    let secret = *b"0123456789abcdef";
    let (a, b) = (host(Some(secret)), host(Some(secret)));
    let on_a = pks(call(&a, "/", "alice", Some("acme")).await);
    let on_b = pks(call(&b, "/", "alice", Some("acme")).await);
    assert_eq!(
        on_a, on_b,
        "one partition key per key, whichever host answers"
    );
    assert_eq!(on_a[0].len(), 8);
    assert_ne!(on_a[0], on_a[1], "the user's item and the tenant's");
    let bob = pks(call(&a, "/", "bob", Some("acme")).await);
    assert_ne!(bob[0], on_a[0], "another user");
    assert_eq!(bob[1], on_a[1], "the same tenant");
    let other_secret = pks(call(&host(Some([9; 16])), "/", "alice", Some("acme")).await);
    assert_ne!(other_secret[0], on_a[0]);
    for pk in &on_a {
        assert!(!pk.windows(5).any(|w| w == b"alice" || w == b"acme\0"));
    }
    // Off by default.
    let plain = call(&host(None), "/", "alice", Some("acme")).await;
    assert!(items(&plain).iter().all(|i| i.pk.is_none()));
    // A refusal carries the refused key's partition key too.
    let tight = router().layer(
        HierarchicalThrottleLayer::builder()
            .cold_start(hierarchical_throttle::ColdStart::Exact)
            .key(user)
            .clock(clock.clone())
            .limit(Limit::per_minute(1).build().unwrap())
            .ratelimit_fields(RateLimitFields::draft_11().partition_keys(secret))
            .global_store(MemoryGlobalStore::with_clock(clock.clone()))
            .build()
            .unwrap(),
    );
    let admitted = pks(call(&tight, "/", "carol", None).await);
    let refused = call(&tight, "/", "carol", None).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(pks(refused), admitted);
}

/// Two layers, each with a lone limit, name their items after themselves: a client reads two
/// distinct limits.
#[tokio::test]
async fn every_layer_names_its_items_apart() {
    let clock = ManualClock::new();
    let layer = |name: &str, limit: Limit| {
        HierarchicalThrottleLayer::builder()
            .name(name)
            .key(user)
            .clock(clock.clone())
            .limit(limit)
            .global_store(MemoryGlobalStore::with_clock(clock.clone()))
            .build()
            .unwrap()
    };
    let app = router()
        .layer(layer("per-user", ten_per_second()))
        .layer(layer("fleet", Limit::per_minute(6_000).build().unwrap()));
    let response = call(&app, "/", "u1", None).await;
    let items = items(&response);
    let names: Vec<_> = items.iter().map(|i| i.name.as_str()).collect();
    assert_eq!(names.len(), 2);
    assert!(
        names.contains(&"per-user") && names.contains(&"fleet"),
        "{names:?}"
    );
}

/// A client that accepts `application/problem+json` gets a refusal as problem details, with
/// the draft's `quota-exceeded` type naming the violated limit; others get text.
#[tokio::test]
async fn refusals_answer_problem_details_to_clients_that_accept_them() {
    let clock = ManualClock::new();
    let app = router().layer(
        HierarchicalThrottleLayer::builder()
            .cold_start(hierarchical_throttle::ColdStart::Exact)
            .name("api")
            .key(user)
            .clock(clock.clone())
            .quota("per-minute: 1/min".parse::<Quota>().unwrap())
            .global_store(MemoryGlobalStore::with_clock(clock.clone()))
            .build()
            .unwrap(),
    );
    let send = |accept: Option<&'static str>| {
        let app = app.clone();
        async move {
            let mut request = http::Request::get("/").header("x-user", "u1");
            if let Some(accept) = accept {
                request = request.header("accept", accept);
            }
            let response =
                tower::ServiceExt::oneshot(app, request.body(axum::body::Body::empty()).unwrap())
                    .await
                    .unwrap();
            let content_type = response.headers().get("content-type").cloned();
            let vary = response.headers().get("vary").cloned();
            let status = response.status();
            let body = axum::body::to_bytes(response.into_body(), 4096)
                .await
                .unwrap();
            (status, content_type, vary, body)
        }
    };
    assert_eq!(send(None).await.0, StatusCode::OK);

    let (status, content_type, vary, body) =
        send(Some("application/json, application/problem+json;q=0.9")).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(content_type.unwrap(), "application/problem+json");
    assert_eq!(vary.unwrap(), "accept");
    let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        problem["type"],
        "https://iana.org/assignments/http-problem-types#quota-exceeded"
    );
    assert_eq!(problem["status"], 429);
    assert_eq!(
        problem["violated-policies"],
        serde_json::json!(["api/per-minute"])
    );
    assert_eq!(
        problem["detail"],
        "rate limit exceeded (limit api/per-minute, retry in 60 s)"
    );

    for accept in [
        None,
        Some("text/html"),
        Some("application/problem+json;q=0"),
    ] {
        let (status, content_type, _, body) = send(accept).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(
            content_type.unwrap(),
            "text/plain; charset=utf-8",
            "{accept:?}"
        );
        assert!(body.starts_with(b"rate limit exceeded"), "{accept:?}");
    }
}

/// Refusals other than throttling answer `about:blank` problem details with their status's
/// title, and name no violated policy.
#[tokio::test]
async fn other_refusals_answer_about_blank_problem_details() {
    let clock = ManualClock::new();
    let app = router().layer(
        HierarchicalThrottleLayer::builder()
            .key(user)
            .clock(clock.clone())
            .limit(Limit::per_second(2).build().unwrap())
            .cost(|_: &http::Request<axum::body::Body>| 5)
            .global_store(MemoryGlobalStore::with_clock(clock.clone()))
            .build()
            .unwrap(),
    );
    let request = http::Request::get("/")
        .header("x-user", "u1")
        .header("accept", "application/problem+json")
        .body(axum::body::Body::empty())
        .unwrap();
    let response = tower::ServiceExt::oneshot(app, request).await.unwrap();
    assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
    let body = axum::body::to_bytes(response.into_body(), 4096)
        .await
        .unwrap();
    let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(problem["type"], "about:blank");
    assert_eq!(problem["title"], "Payload Too Large");
    assert_eq!(problem["status"], 413);
    assert!(problem.get("violated-policies").is_none(), "{problem}");
    assert_eq!(
        problem["detail"],
        "request costs 5 tokens but the limit holds at most 2 (limit default)"
    );
}

/// A refusal that names no limit's state (the store failed; the cost is above the capacity),
/// served in shadow mode, tells the key's limits as this host sees them, as any admitted
/// response does.
#[tokio::test]
async fn shadow_mode_tells_the_limits_when_the_refusal_names_no_state() {
    let clock = ManualClock::new();
    let failing = common::FaultyStore::new(MemoryGlobalStore::with_clock(clock.clone()));
    failing.set(common::Fault::Error);
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key(user)
        .cost(|req: &Request<Body>| match req.uri().path() {
            "/bulk" => 11,
            _ => 1,
        })
        .clock(clock.clone())
        .limit(ten_per_second())
        .shadow(true)
        .failure_policy(hierarchical_throttle::FailurePolicy::Reject)
        .global_store(failing.clone())
        .build()
        .unwrap();
    let app = router().layer(layer.clone());

    // The store fails: refused as unavailable, were the layer enforcing.
    let unavailable = call(&app, "/", "u1", None).await;
    assert_eq!(unavailable.status(), StatusCode::OK);
    // Above the capacity of 10: refused whatever the store, were the layer enforcing.
    failing.set(common::Fault::None);
    let above = call(&app, "/bulk", "u2", None).await;
    assert_eq!(above.status(), StatusCode::OK);
    for response in [&unavailable, &above] {
        assert_eq!(
            field(response, "ratelimit-policy").as_deref(),
            Some("\"default\";q=10;qu=\"tokens\";w=1")
        );
        // Neither took a token, and the host holds none of the key: full as far as it knows
        // (its 10, and the 9 that refill within the second).
        assert_eq!(
            field(response, "ratelimit").as_deref(),
            Some("\"default\";r=19;t=1")
        );
    }
    assert_eq!(layer.stats().shadow_admitted, 2);
}

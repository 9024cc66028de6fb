//! The `metrics` feature: the layer's counters reach a Prometheus recorder, served beside a
//! throttled route by `examples/prometheus.rs`'s app, and a scrape shows the right counts.

#[path = "../examples/support/prometheus_app.rs"]
mod prometheus_app;

use std::time::Duration;

use axum::body::Body;
use hierarchical_throttle::Limit;
use hierarchical_throttle::clock::TokioClock;
use hierarchical_throttle::metrics::GLOBAL_CALL_BUCKETS;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use tower::ServiceExt;

/// The value of the sample of `metric` whose labels include every one of `labels`.
fn sample(scrape: &str, metric: &str, labels: &[&str]) -> Option<f64> {
    scrape
        .lines()
        .filter(|line| line.starts_with(&format!("{metric}{{")))
        .find(|line| labels.iter().all(|l| line.contains(l)))
        .and_then(|line| line.rsplit(' ').next()?.parse().ok())
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_scrape_shows_the_layers_decisions_by_outcome() {
    let latency = Matcher::Full("throttle_global_call_seconds".to_owned());
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(latency, GLOBAL_CALL_BUCKETS)
        .unwrap()
        .install_recorder()
        .expect("the only recorder of this test binary");
    let limit = Limit::per_minute(2).burst(2).unwrap();
    let app = prometheus_app::app(handle.clone(), limit, TokioClock::new()).unwrap();
    let call = |key: &str| {
        let request = Request::get("/").header("x-api-key", key);
        app.clone().oneshot(request.body(Body::empty()).unwrap())
    };
    let mut statuses = Vec::new();
    for _ in 0..5 {
        statuses.push(call("k1").await.unwrap().status());
    }
    assert_eq!(statuses.iter().filter(|s| **s == StatusCode::OK).count(), 2);
    // The sweeper publishes every half lease time (1 s).
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let scrape = app
        .clone()
        .oneshot(Request::get("/metrics").body(Body::empty()).unwrap())
        .await
        .unwrap();
    let scrape = String::from_utf8(
        scrape
            .into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec(),
    )
    .unwrap();
    let decisions = |outcome: &str, reason: &str| {
        let labels = [
            "layer=\"api\"",
            &format!("outcome=\"{outcome}\""),
            &format!("reason=\"{reason}\""),
        ];
        sample(&scrape, "throttle_decisions_total", &labels)
    };
    // The first request passes on credit (the default) while its fetch pays for it; the
    // second waits for a batch.
    assert_eq!(decisions("admitted", "on_credit"), Some(1.0), "{scrape}");
    let admitted = decisions("admitted", "local").unwrap_or(0.0)
        + decisions("admitted", "after_fetch").unwrap_or(0.0)
        + decisions("admitted", "on_credit").unwrap_or(0.0);
    let refused = decisions("refused", "throttled_cached").unwrap_or(0.0)
        + decisions("refused", "throttled").unwrap_or(0.0);
    assert_eq!((admitted, refused), (2.0, 3.0), "{scrape}");
    // Each request once, by outcome.
    for (outcome, n) in [
        ("admitted", 2.0),
        ("refused", 3.0),
        ("shadow_admitted", 0.0),
    ] {
        let labels = ["layer=\"api\"", &format!("outcome=\"{outcome}\"")];
        assert_eq!(
            sample(&scrape, "throttle_requests_total", &labels),
            Some(n),
            "{outcome}: {scrape}"
        );
    }
    // One call: its batch paid for the credit and served the waiting request, which emptied
    // the bucket, so the three refusals needed none.
    // The results are a partition: they add up to the calls made.
    assert_eq!(
        sample(&scrape, "throttle_global_calls_total", &["result=\"ok\""]),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &scrape,
            "throttle_global_calls_total",
            &["result=\"error\""]
        ),
        Some(0.0)
    );
    assert_eq!(
        sample(&scrape, "throttle_store_up", &["layer=\"api\""]),
        Some(1.0)
    );
    assert_eq!(
        sample(&scrape, "throttle_local_keys", &["layer=\"api\""]),
        Some(1.0)
    );
    // Each refused request once, by the limit its answer named.
    assert_eq!(
        sample(
            &scrape,
            "throttle_refusals_total",
            &["limit=\"default\"", "reason=\"throttled\""]
        ),
        Some(3.0),
        "{scrape}"
    );
    // Two one-token batches leased, nothing handed back yet.
    assert_eq!(
        sample(&scrape, "throttle_tokens_total", &["kind=\"leased\""]),
        Some(2.0)
    );
    assert_eq!(
        sample(&scrape, "throttle_tokens_total", &["kind=\"returned\""]),
        Some(0.0)
    );
    assert_eq!(
        sample(&scrape, "throttle_waiting", &["layer=\"api\""]),
        Some(0.0)
    );
    for kind in ["unleased", "forfeited"] {
        let kind = format!("kind=\"{kind}\"");
        assert_eq!(
            sample(&scrape, "throttle_tokens_total", &[&kind]),
            Some(0.0)
        );
    }
    // A histogram, which adds up across hosts, and every metric described.
    assert!(
        scrape.contains("throttle_global_call_seconds_bucket{"),
        "{scrape}"
    );
    for metric in [
        "throttle_requests_total",
        "throttle_decisions_total",
        "throttle_refusals_total",
        "throttle_global_calls_total",
        "throttle_global_batches_total",
        "throttle_tokens_total",
        "throttle_global_call_seconds",
        "throttle_store_up",
        "throttle_local_keys",
        "throttle_waiting",
    ] {
        assert!(
            scrape.contains(&format!("# HELP {metric} ")),
            "{metric}: {scrape}"
        );
    }
    assert!(!scrape.contains("k1"), "keys never appear in metrics");

    // A concurrency layer's sweeper publishes its own, under its layer's name.
    let in_flight = concurrency_layer("reports", 1).build().unwrap();
    let running = in_flight.acquire("k1".to_owned()).await.unwrap();
    assert!(in_flight.acquire("k1".to_owned()).await.is_err());
    tokio::time::sleep(Duration::from_millis(60)).await;
    let scrape = handle.render();
    let concurrency =
        |metric: &str, label: &str| sample(&scrape, metric, &["layer=\"reports\"", label]);
    let requests = "throttle_concurrency_requests_total";
    assert_eq!(
        concurrency(requests, "outcome=\"admitted\""),
        Some(1.0),
        "{scrape}"
    );
    assert_eq!(
        concurrency(requests, "outcome=\"refused_full\""),
        Some(1.0),
        "{scrape}"
    );
    assert_eq!(
        concurrency(requests, "outcome=\"refused_unavailable\""),
        Some(0.0)
    );
    assert_eq!(
        concurrency(requests, "outcome=\"shadow_admitted\""),
        Some(0.0)
    );
    let calls = "throttle_concurrency_store_calls_total";
    assert_eq!(concurrency(calls, "result=\"ok\""), Some(2.0), "{scrape}");
    let round_trips = "throttle_concurrency_store_round_trips_total";
    assert_eq!(
        sample(&scrape, round_trips, &["layer=\"reports\""]),
        Some(2.0),
        "{scrape}"
    );
    assert_eq!(
        sample(
            &scrape,
            "throttle_concurrency_in_flight",
            &["layer=\"reports\""]
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(&scrape, "throttle_concurrency_keys", &["layer=\"reports\""]),
        Some(1.0)
    );
    let on_credit = "throttle_concurrency_admitted_on_credit_total";
    assert_eq!(
        sample(&scrape, on_credit, &["layer=\"reports\""]),
        Some(0.0)
    );
    drop(running);

    // With credit, a cold key's request is admitted at once, and counted so.
    let uploads = concurrency_layer("uploads", 4)
        .cold_start(hierarchical_throttle::ColdStart::Credit { share: 0.25 })
        .build()
        .unwrap();
    let uploading = uploads.acquire("k1".to_owned()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(60)).await;
    let scrape = handle.render();
    assert_eq!(
        sample(&scrape, on_credit, &["layer=\"uploads\""]),
        Some(1.0),
        "{scrape}"
    );
    drop(uploading);

    // In shadow mode, a refusal served all the same is counted refused and served.
    let drafts = concurrency_layer("drafts", 1).shadow(true).build().unwrap();
    let drafting = drafts.acquire("k1".to_owned()).await.unwrap();
    let unheld = drafts.acquire("k1".to_owned()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(60)).await;
    let scrape = handle.render();
    for outcome in ["refused_full", "shadow_admitted"] {
        let label = format!("outcome=\"{outcome}\"");
        let drafts = sample(&scrape, requests, &["layer=\"drafts\"", &label]);
        assert_eq!(drafts, Some(1.0), "{outcome}: {scrape}");
    }
    drop((drafting, unheld));
}

/// A concurrency layer named `name`, keyed by `x-api-key`, `max` in flight per key, on tokio's
/// clock and a store of its own: further settings go on top.
fn concurrency_layer(
    name: &str,
    max: u64,
) -> hierarchical_throttle::ConcurrencyBuilder<
    Request<Body>,
    String,
    hierarchical_throttle::MemoryGlobalStore<String, TokioClock>,
    TokioClock,
> {
    hierarchical_throttle::HierarchicalConcurrencyLayer::builder()
        .key(|req: &Request<Body>| hierarchical_throttle::key::header_value(req, "x-api-key"))
        .max_in_flight(max)
        .layer_name(name)
        .store(hierarchical_throttle::MemoryGlobalStore::with_clock(
            TokioClock::new(),
        ))
        .clock(TokioClock::new())
}

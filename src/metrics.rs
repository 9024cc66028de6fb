//! Metrics through the `metrics` crate facade (feature `metrics`), so any exporter works
//! (Prometheus, StatsD, OpenTelemetry).
//!
//! The hot path records nothing: the layer's background sweeper publishes its counters every
//! half lease time, and the slow path records each global call's latency. Labels are the
//! layer's [name](crate::Builder::name) and the outcome; never a key (keys are unbounded).
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | `throttle_requests_total` | counter | `layer`, `outcome` (`admitted`, `refused`, `shadow_admitted`, `exempt`: a partition, each request once) |
//! | `throttle_decisions_total` | counter | `layer`, `outcome` (`admitted`, `refused`, `policy`, `shadow_admitted`, `waited`), `reason` |
//! | `throttle_refusals_total` | counter | `layer`, `limit` (`per-second`, `tenant/per-day`; `none` when no limit refused), `reason` (`throttled`, `cost_above_capacity`, `missing_key`, `store_unavailable`; `shadow`: a limit in [shadow](crate::Builder::shadow_limit) would have refused) |
//! | `throttle_global_calls_total` | counter | `layer`, `result` (`ok`, `error`, `timeout`: a partition, they add up to the calls made) |
//! | `throttle_tokens_total` | counter | `layer`, `kind` (`leased`, `returned`, `lost`, `refunded`, `uncharged`, `unleased`, `forfeited`; see [`ThrottleStats`]) |
//! | `throttle_global_call_seconds` | histogram | `layer` |
//! | `throttle_store_up` | gauge (1: the store answered the last call any layer on it made; 0: it failed, or never answered yet) | `layer` |
//! | `throttle_local_keys` | gauge | `layer` |
//! | `throttle_waiting` | gauge | `layer`: requests waiting for a batch or (shaping) for their tokens |
//! | `throttle_concurrency_requests_total` | counter | `layer`, `outcome` (`admitted`, `refused_full`, `refused_unavailable`, `exempt`, `shadow_admitted`: served without a slot in place of a refusal, in shadow mode) of a [concurrency layer](crate::HierarchicalConcurrencyLayer) |
//! | `throttle_concurrency_admitted_on_credit_total` | counter | `layer`: of the admitted, those admitted at once on [credit](crate::ConcurrencyBuilder::cold_start) |
//! | `throttle_concurrency_store_round_trips_total` | counter | `layer`: batches of slot calls sent to the store (one round trip each) |
//! | `throttle_concurrency_store_calls_total` | counter | `layer`, `result` (`ok`, `failed`: errors and time-outs) |
//! | `throttle_concurrency_in_flight` | gauge | `layer`: requests holding a slot on this host |
//! | `throttle_concurrency_keys` | gauge | `layer`: keys this host keeps slots for |
//!
//! A concurrency layer's sweeper publishes its own every linger (50 ms by default).
//!
//! `throttle_requests_total` counts each request (and each
//! [`acquire`](crate::HierarchicalThrottleLayer::acquire)d use) once, by its outcome;
//! `throttle_decisions_total` counts each bucket's decisions (a request drawing on three
//! limits counts three times); `throttle_refusals_total` counts each refused request once, by
//! the limit its answer names. Every metric is described (`# HELP` in Prometheus).
//!
//! The latency is recorded as a histogram; how it is exported is the exporter's choice. With
//! `metrics-exporter-prometheus`, give it [`GLOBAL_CALL_BUCKETS`] so that it renders a
//! histogram, which can be summed across hosts (without buckets it renders a summary, which
//! cannot):
//!
//! ```ignore
//! use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
//! let handle = PrometheusBuilder::new()
//!     .set_buckets_for_metric(
//!         Matcher::Full("throttle_global_call_seconds".to_owned()),
//!         hierarchical_throttle::metrics::GLOBAL_CALL_BUCKETS,
//!     )?
//!     .install_recorder()?;
//! ```

use std::sync::Once;
use std::time::Duration;

use crate::ThrottleStats;
use crate::stats::RefusalKind;

/// Bucket bounds (seconds) for `throttle_global_call_seconds`: from 0.5 ms (a store on the same
/// host) to 1 s (the longest sensible time-out), about doubling.
pub const GLOBAL_CALL_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0,
];

/// Describes every metric once per process.
fn describe() {
    static DESCRIBED: Once = Once::new();
    DESCRIBED.call_once(|| {
        ::metrics::describe_counter!(
            "throttle_requests_total",
            "Requests decided, once each, by outcome (admitted, refused, shadow_admitted)"
        );
        ::metrics::describe_counter!(
            "throttle_decisions_total",
            "Decisions of each bucket a request drew on, by outcome and reason"
        );
        ::metrics::describe_counter!(
            "throttle_refusals_total",
            "Refused requests, once each, by the limit their answer names and the reason"
        );
        ::metrics::describe_counter!(
            "throttle_global_calls_total",
            "Calls to the global store for tokens, by result (ok, error, timeout)"
        );
        ::metrics::describe_counter!(
            "throttle_global_batches_total",
            "Round trips to the global store: batches of calls (on Redis, scripts run)"
        );
        ::metrics::describe_counter!(
            "throttle_tokens_total",
            "Tokens through this host, by kind (leased, returned, lost, refunded, uncharged, \
             unleased, forfeited)"
        );
        ::metrics::describe_histogram!(
            "throttle_global_call_seconds",
            ::metrics::Unit::Seconds,
            "Latency of each call to the global store for tokens"
        );
        ::metrics::describe_gauge!(
            "throttle_store_up",
            "1 when the global store answered the last call made to it (by any layer on it), 0 \
             when it failed or has not answered yet"
        );
        ::metrics::describe_gauge!(
            "throttle_local_keys",
            "Keys held in this host's local store"
        );
        ::metrics::describe_gauge!(
            "throttle_waiting",
            "Requests waiting for a batch, or (shaping) for their tokens"
        );
    });
}

/// What a sweep publishes.
pub(crate) struct Snapshot<'a> {
    pub(crate) layer: &'a str,
    pub(crate) stats: &'a ThrottleStats,
    pub(crate) refusals: &'a [(RefusalKind, u64)],
    pub(crate) local_keys: usize,
    pub(crate) waiting: u64,
    pub(crate) store_up: bool,
}

/// Publishes a layer's counters (as absolute values) and gauges.
pub(crate) fn publish(snapshot: &Snapshot<'_>) {
    describe();
    let layer = snapshot.layer.to_owned();
    let stats = snapshot.stats;
    let decisions = [
        ("admitted", "local", stats.admitted_local),
        ("admitted", "after_fetch", stats.admitted_after_fetch),
        ("admitted", "on_credit", stats.admitted_on_credit),
        ("refused", "throttled_cached", stats.rejected_cached),
        ("refused", "throttled", stats.rejected_global),
        ("refused", "cost_above_capacity", stats.refused_cost),
        ("refused", "missing_key", stats.missing_key),
        ("refused", "wait_too_long", stats.shaped_refusals),
        ("policy", "store_unavailable", stats.fallback_decisions),
        ("shadow_admitted", "would_refuse", stats.shadow_admitted),
        ("waited", "shaping", stats.shaped_waits),
    ];
    for (outcome, reason, value) in decisions {
        ::metrics::counter!(
            "throttle_decisions_total",
            "layer" => layer.clone(),
            "outcome" => outcome,
            "reason" => reason
        )
        .absolute(value);
    }
    for (outcome, value) in [
        ("admitted", stats.requests_admitted),
        ("refused", stats.requests_refused),
        ("shadow_admitted", stats.shadow_admitted),
        ("exempt", stats.requests_exempt),
    ] {
        ::metrics::counter!("throttle_requests_total", "layer" => layer.clone(), "outcome" => outcome)
            .absolute(value);
    }
    for ((level, limit, reason), value) in snapshot.refusals {
        let limit = match (level, limit) {
            (_, None) => "none".to_owned(),
            (None, Some(limit)) => (*limit).to_owned(),
            (Some(level), Some(limit)) => format!("{level}/{limit}"),
        };
        ::metrics::counter!(
            "throttle_refusals_total",
            "layer" => layer.clone(),
            "limit" => limit,
            "reason" => *reason
        )
        .absolute(*value);
    }
    let failed = stats.global_errors.saturating_add(stats.global_timeouts);
    for (result, value) in [
        ("ok", stats.global_calls.saturating_sub(failed)),
        ("error", stats.global_errors),
        ("timeout", stats.global_timeouts),
    ] {
        ::metrics::counter!("throttle_global_calls_total", "layer" => layer.clone(), "result" => result)
            .absolute(value);
    }
    ::metrics::counter!("throttle_global_batches_total", "layer" => layer.clone())
        .absolute(stats.global_batches);
    for (kind, value) in [
        ("leased", stats.tokens_leased),
        ("returned", stats.tokens_returned),
        ("lost", stats.tokens_lost),
        ("refunded", stats.tokens_refunded),
        ("uncharged", stats.tokens_uncharged),
        ("unleased", stats.tokens_unleased),
        ("forfeited", stats.tokens_forfeited),
    ] {
        ::metrics::counter!("throttle_tokens_total", "layer" => layer.clone(), "kind" => kind)
            .absolute(value);
    }
    ::metrics::gauge!("throttle_store_up", "layer" => layer.clone())
        .set(f64::from(u8::from(snapshot.store_up)));
    ::metrics::gauge!("throttle_local_keys", "layer" => layer.clone())
        .set(snapshot.local_keys as f64);
    ::metrics::gauge!("throttle_waiting", "layer" => layer).set(snapshot.waiting as f64);
}

/// What a concurrency layer's sweep publishes.
pub(crate) struct ConcurrencySnapshot<'a> {
    pub(crate) layer: &'a str,
    pub(crate) admitted: u64,
    pub(crate) admitted_on_credit: u64,
    pub(crate) refused_full: u64,
    pub(crate) refused_unavailable: u64,
    pub(crate) store_calls: u64,
    pub(crate) store_round_trips: u64,
    pub(crate) store_failures: u64,
    pub(crate) exempt: u64,
    pub(crate) shadow_admitted: u64,
    pub(crate) in_flight: u64,
    pub(crate) keys: usize,
}

/// Publishes a concurrency layer's counters (as absolute values) and gauges.
pub(crate) fn publish_concurrency(s: &ConcurrencySnapshot<'_>) {
    describe_concurrency();
    let layer = s.layer.to_owned();
    for (outcome, value) in [
        ("admitted", s.admitted),
        ("refused_full", s.refused_full),
        ("refused_unavailable", s.refused_unavailable),
        ("exempt", s.exempt),
        ("shadow_admitted", s.shadow_admitted),
    ] {
        ::metrics::counter!(
            "throttle_concurrency_requests_total",
            "layer" => layer.clone(),
            "outcome" => outcome
        )
        .absolute(value);
    }
    ::metrics::counter!(
        "throttle_concurrency_admitted_on_credit_total",
        "layer" => layer.clone()
    )
    .absolute(s.admitted_on_credit);
    ::metrics::counter!(
        "throttle_concurrency_store_round_trips_total",
        "layer" => layer.clone()
    )
    .absolute(s.store_round_trips);
    for (result, value) in [
        ("ok", s.store_calls.saturating_sub(s.store_failures)),
        ("failed", s.store_failures),
    ] {
        ::metrics::counter!(
            "throttle_concurrency_store_calls_total",
            "layer" => layer.clone(),
            "result" => result
        )
        .absolute(value);
    }
    ::metrics::gauge!("throttle_concurrency_in_flight", "layer" => layer.clone())
        .set(s.in_flight as f64);
    ::metrics::gauge!("throttle_concurrency_keys", "layer" => layer).set(s.keys as f64);
}

fn describe_concurrency() {
    static DESCRIBED: Once = Once::new();
    DESCRIBED.call_once(|| {
        ::metrics::describe_counter!(
            "throttle_concurrency_requests_total",
            "Requests decided by a concurrency limit, by outcome"
        );
        ::metrics::describe_counter!(
            "throttle_concurrency_admitted_on_credit_total",
            "Requests a concurrency limit admitted at once on credit, beyond the host's holding"
        );
        ::metrics::describe_counter!(
            "throttle_concurrency_store_round_trips_total",
            "Batches of calls a concurrency limit sent to the store for slots, one round trip each"
        );
        ::metrics::describe_counter!(
            "throttle_concurrency_store_calls_total",
            "Calls to the store for concurrency slots, by result (ok, failed)"
        );
        ::metrics::describe_gauge!(
            "throttle_concurrency_in_flight",
            "Requests holding a concurrency slot on this host"
        );
        ::metrics::describe_gauge!(
            "throttle_concurrency_keys",
            "Keys this host keeps concurrency slots for"
        );
    });
}

/// Records one global call's latency.
pub(crate) fn global_call(layer: &str, latency: Duration) {
    describe();
    ::metrics::histogram!("throttle_global_call_seconds", "layer" => layer.to_owned())
        .record(latency.as_secs_f64());
}

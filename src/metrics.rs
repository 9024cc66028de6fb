//! Metrics through the `metrics` crate facade (feature `metrics`), so any exporter works
//! (Prometheus, StatsD, OpenTelemetry).
//!
//! The hot path records nothing: the layer's background sweeper publishes its counters every
//! half lease time, and the slow path records each global call's latency. Labels are the
//! layer's [name](crate::Builder::name) and the outcome; never a key (keys are unbounded).
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | `throttle_decisions_total` | counter | `layer`, `outcome` (`admitted`, `refused`, `policy`, `shadow_admitted`), `reason` |
//! | `throttle_global_calls_total` | counter | `layer`, `result` (`sent`, `error`, `timeout`) |
//! | `throttle_tokens_total` | counter | `layer`, `kind` (`returned`, `lost`) |
//! | `throttle_global_call_seconds` | histogram | `layer` |
//! | `throttle_store_up` | gauge (1 up, 0 backing off) | `layer` |
//! | `throttle_local_keys` | gauge | `layer` |

use std::time::Duration;

use crate::ThrottleStats;

/// Publishes a layer's counters (as absolute values) and gauges.
pub(crate) fn publish(layer: &str, stats: &ThrottleStats, local_keys: usize, store_up: bool) {
    let layer = layer.to_owned();
    let decisions = [
        ("admitted", "local", stats.admitted_local),
        ("admitted", "after_fetch", stats.admitted_after_fetch),
        ("refused", "throttled_cached", stats.rejected_cached),
        ("refused", "throttled", stats.rejected_global),
        ("refused", "cost_above_capacity", stats.refused_cost),
        ("refused", "missing_key", stats.missing_key),
        ("policy", "store_unavailable", stats.fallback_decisions),
        ("shadow_admitted", "would_refuse", stats.shadow_admitted),
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
    for (result, value) in [
        ("sent", stats.global_calls),
        ("error", stats.global_errors),
        ("timeout", stats.global_timeouts),
    ] {
        ::metrics::counter!("throttle_global_calls_total", "layer" => layer.clone(), "result" => result)
            .absolute(value);
    }
    for (kind, value) in [
        ("returned", stats.tokens_returned),
        ("lost", stats.tokens_lost),
    ] {
        ::metrics::counter!("throttle_tokens_total", "layer" => layer.clone(), "kind" => kind)
            .absolute(value);
    }
    ::metrics::gauge!("throttle_store_up", "layer" => layer.clone())
        .set(f64::from(u8::from(store_up)));
    ::metrics::gauge!("throttle_local_keys", "layer" => layer).set(local_keys as f64);
}

/// Records one global call's latency.
pub(crate) fn global_call(layer: &str, latency: Duration) {
    ::metrics::histogram!("throttle_global_call_seconds", "layer" => layer.to_owned())
        .record(latency.as_secs_f64());
}

//! One side of the `layer_overhead` benchmark in a plain loop, for a profiler: `perf record`,
//! or `valgrind --tool=callgrind` (instruction counts, repeatable whatever else the machine is
//! doing; run two iteration counts and subtract to leave out the set-up).
//!
//! Run with: cargo run --release -p hierarchical-throttle-bench --example overhead_profile -- <side> <keys> <iterations>
//!
//! Sides: `unthrottled`, `tower_governor`, `tower_governor_header_name`,
//! `tower_governor_headers` (with its `x-ratelimit-*` headers), `throttled` (`key` with
//! `key::header_value`), `throttled_key_ref` (`key_ref` with `key::header_str`),
//! `throttled_key_bytes` (`key_ref` with `key::header_bytes`), `throttled_key_ref_fields` (the same with the `RateLimit` fields), `throttled_key_bytes_fields` (the README's lead example: `header_bytes` with the fields), `refused_tower_governor_headers` and `refused_throttled_key_bytes` (every request refused),
//! `in_flight` and `in_flight_fields` (a concurrency limit no key reaches, without and with its
//! fields), and `constant_key` (the
//! layer with a key read from nothing: what remains is the layer's own work).

use std::convert::Infallible;
use std::hint::black_box;

use http::Request;
use tower::{Layer, Service};
use tower_governor::governor::GovernorConfigBuilder;

#[path = "../benches/support/sides.rs"]
mod sides;
#[allow(dead_code, reason = "its keys are for the benchmarks over `u64` keys")]
#[path = "../benches/support/mod.rs"]
mod support;

use sides::{ApiKey, ApiKeyByName, Echo, api_key, api_key_bytes, governor, owned_key, requests};
use support::poll_once;

/// Calls `service` `iterations` times over `requests` after the warm-up rounds.
fn run<S>(mut service: S, requests: &[Request<()>], iterations: usize)
where
    S: Service<Request<()>, Error = Infallible> + Clone,
{
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    sides::warm_up(&runtime, &service, requests);
    let _guard = runtime.enter();
    let mut i = 0;
    for _ in 0..iterations {
        i = if i + 1 == requests.len() { 0 } else { i + 1 };
        black_box(poll_once(service.call(black_box(requests[i].clone()))));
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let side = args.get(1).map_or("throttled_key_ref", String::as_str);
    let keys: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(1_000);
    let iterations: usize = args
        .get(3)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1_000_000);
    let requests = requests(keys);
    let by_name = || GovernorConfigBuilder::default().key_extractor(ApiKeyByName);
    match side {
        "unthrottled" => run(Echo, &requests, iterations),
        "tower_governor" => {
            let config = GovernorConfigBuilder::default().key_extractor(ApiKey);
            run(governor(config).layer(Echo), &requests, iterations)
        }
        "tower_governor_header_name" => run(governor(by_name()).layer(Echo), &requests, iterations),
        "tower_governor_headers" => run(
            governor(by_name().use_headers()).layer(Echo),
            &requests,
            iterations,
        ),
        "throttled" => run(
            throttle!(key, owned_key, false).layer(Echo),
            &requests,
            iterations,
        ),
        "throttled_key_ref" => run(
            throttle!(key_ref, api_key, false).layer(Echo),
            &requests,
            iterations,
        ),
        "throttled_key_bytes" => run(
            throttle!(key_ref, api_key_bytes, false).layer(Echo),
            &requests,
            iterations,
        ),
        "throttled_key_ref_fields" => run(
            throttle!(key_ref, api_key, true).layer(Echo),
            &requests,
            iterations,
        ),
        "throttled_key_bytes_fields" => run(
            throttle!(key_ref, api_key_bytes, true).layer(Echo),
            &requests,
            iterations,
        ),
        "refused_tower_governor_headers" => run(
            sides::governor_refusing().layer(Echo),
            &requests,
            iterations,
        ),
        "refused_throttled_key_bytes" => run(
            throttle!(refusing key_ref, api_key_bytes, true).layer(Echo),
            &requests,
            iterations,
        ),
        "in_flight" => run(sides::in_flight(false).layer(Echo), &requests, iterations),
        "in_flight_fields" => run(sides::in_flight(true).layer(Echo), &requests, iterations),
        "constant_key" => run(
            throttle!(key, |_: &Request<()>| Some(7u64), false).layer(Echo),
            &requests,
            iterations,
        ),
        other => {
            eprintln!("unknown side {other}: see the example's header");
            std::process::exit(2);
        }
    }
}

//! What the whole layer adds to a trivial service when the key is a request header, over 1 and
//! 1,000 keys, every request admitted, in the same run: the unthrottled service;
//! tower_governor (GCRA per host) with its key made by `key::header_value` (a `String` per
//! request), the header's name given as text and as a `HeaderName` made once; and this layer
//! with its default rejection: the same `String` key (`key`), the key borrowed from the header
//! as text (`key_ref` with `key::header_str` and a `HeaderName`, a `String` key) and as bytes
//! (`key::header_bytes`, a `CompactKey`), all with the `RateLimit` fields on admitted responses
//! turned off, and the borrowed key (as text, and as bytes: the README's lead example) with them
//! on (the default), beside
//! tower_governor with its own headers on (`use_headers`, the name made once); and both
//! refusing every request (each key over its limit), with their headers (the README's lead
//! example for this layer); and a fleet-wide concurrency limit no key reaches, its `RateLimit`
//! fields on admitted responses off and on. Each iteration clones a prepared request.
//!
//! Run with: cargo bench -p hierarchical-throttle-bench --bench layer_overhead

use std::convert::Infallible;
use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use http::Request;
use tower::{Layer, Service};
use tower_governor::governor::GovernorConfigBuilder;

#[path = "support/sides.rs"]
mod sides;
#[allow(dead_code, reason = "its keys are for the benchmarks over `u64` keys")]
mod support;

use sides::{ApiKey, ApiKeyByName, Echo, api_key, api_key_bytes, governor, owned_key, requests};
use support::poll_once;

/// Measures `service` on `requests` after the warm-up rounds (every key then holds tokens).
fn measure<S>(c: &mut Criterion, name: String, mut service: S, requests: &[Request<()>])
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
    c.bench_function(&name, |b| {
        b.iter(|| {
            i = if i + 1 == requests.len() { 0 } else { i + 1 };
            black_box(poll_once(service.call(black_box(requests[i].clone()))))
        })
    });
}

fn bench(c: &mut Criterion) {
    for keys in [1, 1_000] {
        let requests = requests(keys);
        let name = |side: &str| format!("layer_overhead/{side}/{keys}");
        measure(c, name("unthrottled"), Echo, &requests);
        let side = governor(GovernorConfigBuilder::default().key_extractor(ApiKey)).layer(Echo);
        measure(c, name("tower_governor"), side, &requests);
        let by_name = || GovernorConfigBuilder::default().key_extractor(ApiKeyByName);
        let side = governor(by_name()).layer(Echo);
        measure(c, name("tower_governor_header_name"), side, &requests);
        let side = throttle!(key, owned_key, false).layer(Echo);
        measure(c, name("throttled"), side, &requests);
        let side = throttle!(key_ref, api_key, false).layer(Echo);
        measure(c, name("throttled_key_ref"), side, &requests);
        let side = throttle!(key_ref, api_key_bytes, false).layer(Echo);
        measure(c, name("throttled_key_bytes"), side, &requests);
        let side = governor(by_name().use_headers()).layer(Echo);
        measure(c, name("tower_governor_headers"), side, &requests);
        let side = throttle!(key_ref, api_key, true).layer(Echo);
        measure(c, name("throttled_key_ref_fields"), side, &requests);
        let side = throttle!(key_ref, api_key_bytes, true).layer(Echo);
        measure(c, name("throttled_key_bytes_fields"), side, &requests);
        // A fleet-wide concurrency limit no key reaches: a slot taken and given back with
        // each response, without and with its fields.
        measure(
            c,
            name("in_flight"),
            sides::in_flight(false).layer(Echo),
            &requests,
        );
        measure(
            c,
            name("in_flight_fields"),
            sides::in_flight(true).layer(Echo),
            &requests,
        );
        // Every request refused (each key over its limit after its first request): the
        // answer's cost, with each side's headers.
        let side = sides::governor_refusing().layer(Echo);
        measure(c, name("refused_tower_governor_headers"), side, &requests);
        let side = throttle!(refusing key_ref, api_key_bytes, true).layer(Echo);
        measure(c, name("refused_throttled_key_bytes"), side, &requests);
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);

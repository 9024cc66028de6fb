//! Invalid configuration is an error when the layer is built.

use std::time::Duration;

use hierarchical_throttle::batch::FractionOfCapacity;
use hierarchical_throttle::{
    ConfigError, FailurePolicy, HierarchicalThrottleLayer, Limit, MemoryGlobalStore,
    MemoryLocalStore,
};

fn builder() -> hierarchical_throttle::Builder<
    u32,
    u32,
    hierarchical_throttle::Unset,
    MemoryLocalStore<u32>,
    hierarchical_throttle::clock::MonotonicClock,
    hierarchical_throttle::DefaultRejection,
> {
    HierarchicalThrottleLayer::builder().key(|r: &u32| Some(*r))
}

fn setting(result: Result<impl std::fmt::Debug, ConfigError>) -> &'static str {
    match result {
        Err(ConfigError::InvalidSetting { setting, .. }) => setting,
        other => panic!("expected an invalid setting, got {other:?}"),
    }
}

#[test]
fn a_layer_without_a_limit_is_an_error() {
    let built = builder().global_store(MemoryGlobalStore::new()).build();
    assert_eq!(setting(built), "limit");
}

#[test]
fn out_of_range_settings_are_errors() {
    let limit = Limit::per_second(1).burst(1).unwrap();
    let base = || builder().limit(limit);
    let store = MemoryGlobalStore::new;
    assert_eq!(
        setting(
            base()
                .store_timeout(Duration::ZERO)
                .global_store(store())
                .build()
        ),
        "store_timeout"
    );
    assert_eq!(
        setting(
            base()
                .lease_ttl(Duration::ZERO)
                .global_store(store())
                .build()
        ),
        "lease_ttl"
    );
    assert_eq!(
        setting(
            base()
                .demand_window(0, Duration::from_millis(100))
                .global_store(store())
                .build()
        ),
        "demand_window"
    );
    assert_eq!(
        setting(
            base()
                .demand_window(17, Duration::from_millis(100))
                .global_store(store())
                .build()
        ),
        "demand_window"
    );
    assert_eq!(
        setting(
            base()
                .max_store_backoff(Duration::ZERO)
                .global_store(store())
                .build()
        ),
        "max_store_backoff"
    );
    assert_eq!(
        setting(
            base()
                .global_batch_linger(Duration::from_millis(1_001))
                .global_store(store())
                .build()
        ),
        "global_batch_linger"
    );
    let longest_linger = base().global_batch_linger(Duration::from_secs(1));
    assert!(longest_linger.global_store(store()).build().is_ok());
    assert!(base().global_store(store()).build().is_ok());
}

#[test]
fn absurd_durations_are_errors_not_overflows_at_request_time() {
    let limit = Limit::per_second(1).burst(1).unwrap();
    let base = || builder().limit(limit);
    let store = MemoryGlobalStore::new;
    let huge = Duration::MAX;
    let cases = [
        ("store_timeout", base().store_timeout(huge)),
        ("lease_ttl", base().lease_ttl(huge)),
        ("max_store_backoff", base().max_store_backoff(huge)),
        ("max_reservation", base().max_reservation(huge)),
        ("demand_window", base().demand_window(4, huge)),
        ("global_batch_linger", base().global_batch_linger(huge)),
    ];
    for (name, builder) in cases {
        assert_eq!(setting(builder.global_store(store()).build()), name);
    }
    let longest = Duration::from_secs(3600);
    let ok = base()
        .store_timeout(longest)
        .lease_ttl(longest)
        .max_store_backoff(longest)
        .max_reservation(longest)
        .demand_window(16, longest)
        .global_store(store())
        .build();
    assert!(ok.is_ok());
}

#[test]
fn invalid_policies_and_stores_are_errors() {
    assert!(FractionOfCapacity::new(0.0).is_err());
    assert!(FractionOfCapacity::new(1.5).is_err());
    assert!(FractionOfCapacity::new(f64::NAN).is_err());
    assert!(FailurePolicy::local_fallback(0).is_err());
    assert!(MemoryLocalStore::<u32>::with_max_keys(10).is_err());
}

#[test]
fn errors_explain_themselves() {
    let err = Limit::per_second(0).burst(5).unwrap_err();
    assert_eq!(
        err.to_string(),
        "a limit must refill at least one token per period"
    );
    let err = setting(
        builder()
            .store_timeout(Duration::ZERO)
            .limit(Limit::per_second(1).build().unwrap())
            .global_store(MemoryGlobalStore::new())
            .build(),
    );
    assert_eq!(err, "store_timeout");
}

//! Several layers on one global store (one Redis for several services, or several layers of
//! one app): each layer's name is part of its buckets' identities, so layers of other names
//! never share a bucket; in one process, a second live layer of the same name with other
//! limits is refused at build, where their buckets would collide.

use hierarchical_throttle::clock::ManualClock;
use hierarchical_throttle::quota::BucketKey;
use hierarchical_throttle::{ConfigError, HierarchicalThrottleLayer, Limit, MemoryGlobalStore};

type Store = MemoryGlobalStore<String, ManualClock>;

fn layer(
    name: Option<&str>,
    limit: Limit,
    clock: &ManualClock,
    store: &Store,
) -> Result<
    HierarchicalThrottleLayer<
        String,
        String,
        Store,
        hierarchical_throttle::MemoryLocalStore<String>,
        ManualClock,
    >,
    ConfigError,
> {
    let builder = HierarchicalThrottleLayer::builder()
        .key(|k: &String| Some(k.clone()))
        .limit(limit)
        .clock(clock.clone())
        .global_store(store.clone());
    match name {
        Some(name) => builder.name(name).build(),
        None => builder.build(),
    }
}

#[tokio::test]
async fn layers_of_other_names_never_share_a_bucket() {
    let clock = ManualClock::new();
    let store = MemoryGlobalStore::with_clock(clock.clone());
    let strict = layer(
        Some("login"),
        Limit::per_minute(1).build().unwrap(),
        &clock,
        &store,
    )
    .unwrap();
    let budget = layer(
        Some("llm"),
        Limit::per_minute(10_000).build().unwrap(),
        &clock,
        &store,
    )
    .unwrap();
    let key = || "user-1".to_owned();

    // The strict layer's first use is its own bucket's, full; its second is refused.
    assert!(strict.acquire(key(), 1).await.is_ok());
    assert!(strict.acquire(key(), 1).await.is_err());
    // The budget is untouched by it, and does not clamp it either.
    for _ in 0..100 {
        assert!(budget.acquire(key(), 100).await.is_ok());
    }
    assert!(budget.acquire(key(), 100).await.is_err());
    let login = BucketKey::new(key(), "default")
        .unwrap()
        .in_layer("login")
        .unwrap();
    let llm = BucketKey::new(key(), "default")
        .unwrap()
        .in_layer("llm")
        .unwrap();
    assert_eq!(
        store
            .peek(&login, &Limit::per_minute(1).build().unwrap())
            .tokens(),
        0
    );
    assert_eq!(
        store
            .peek(&llm, &Limit::per_minute(10_000).build().unwrap())
            .tokens(),
        0
    );
}

#[tokio::test]
async fn a_second_layer_of_one_name_with_other_limits_is_refused_at_build() {
    let clock = ManualClock::new();
    let store = MemoryGlobalStore::with_clock(clock.clone());
    let first = layer(None, Limit::per_minute(1).build().unwrap(), &clock, &store).unwrap();
    let second = layer(
        None,
        Limit::per_minute(10_000).build().unwrap(),
        &clock,
        &store,
    );
    match second {
        Err(ConfigError::InvalidSetting { setting, expected }) => {
            assert_eq!(setting, "name");
            assert!(expected.contains(".name()"), "{expected}");
        }
        other => panic!("expected a refusal, got {:?}", other.map(|_| ())),
    }
    // The same limits under the same name share buckets on purpose: hosts of one fleet
    // simulated in one process, or one layer built twice.
    assert!(layer(None, Limit::per_minute(1).build().unwrap(), &clock, &store).is_ok());
    // Named apart, both are fine; and once the first is gone, its name is free again.
    assert!(
        layer(
            Some("bulk"),
            Limit::per_minute(10_000).build().unwrap(),
            &clock,
            &store
        )
        .is_ok()
    );
    drop(first);
    assert!(
        layer(
            None,
            Limit::per_minute(10_000).build().unwrap(),
            &clock,
            &store
        )
        .is_ok()
    );
    // Another store is another namespace.
    let other = MemoryGlobalStore::with_clock(clock.clone());
    assert!(layer(None, Limit::per_minute(5).build().unwrap(), &clock, &other).is_ok());
}

#[test]
fn a_layer_name_is_checked_like_limit_names() {
    let clock = ManualClock::new();
    let store = MemoryGlobalStore::with_clock(clock.clone());
    let limit = Limit::per_minute(1).build().unwrap();
    for bad in ["", "has space", "col:on", "a/b"] {
        assert!(
            matches!(
                layer(Some(bad), limit, &clock, &store),
                Err(ConfigError::Unreadable { .. })
            ),
            "{bad:?}"
        );
    }
}

//! What an operator reads in the logs: a store failure names the layer and the store; a key
//! closure that finds no key (a mistyped header name) warns once, then at most once a minute.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{Fault, FaultyStore, backend, host_builder, send};
use hierarchical_throttle::clock::ManualClock;
use hierarchical_throttle::{Limit, MemoryGlobalStore};
use tower::Layer;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Metadata, Subscriber};

/// Events at warn or above, as `LEVEL field=value ...`.
#[derive(Clone, Default)]
struct Warnings(Arc<Mutex<Vec<String>>>);

struct Fields(String);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.push_str(&format!(" {}={value:?}", field.name()));
    }
}

impl Subscriber for Warnings {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        *metadata.level() <= Level::WARN
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut fields = Fields(event.metadata().level().to_string());
        event.record(&mut fields);
        self.0.lock().unwrap().push(fields.0);
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

impl Warnings {
    fn take(&self) -> Vec<String> {
        std::mem::take(&mut self.0.lock().unwrap())
    }
}

/// Runs `test` on a current-thread runtime with `warnings` capturing its logs.
fn with_warnings(warnings: &Warnings, test: impl std::future::Future<Output = ()>) {
    let _default = tracing::subscriber::set_default(warnings.clone());
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap()
        .block_on(test);
}

#[test]
fn a_store_failure_names_the_layer_and_the_store_once() {
    let warnings = Warnings::default();
    with_warnings(&warnings, async {
        let clock = ManualClock::new();
        let store = FaultyStore::new(MemoryGlobalStore::with_clock(clock.clone()));
        store.set(Fault::Error);
        let layer = host_builder(&clock, Limit::per_second(1).burst(1).unwrap())
            .name("checkout")
            .global_store(store)
            .build()
            .unwrap();
        let mut host = layer.layer(backend());
        for key in ["a", "b", "c"] {
            send(&mut host, key, 1).await;
            clock.advance(Duration::from_millis(60));
        }
    });
    let logged = warnings.take();
    let failures: Vec<_> = logged
        .iter()
        .filter(|l| l.contains("store failed"))
        .collect();
    assert_eq!(failures.len(), 1, "once when it goes down: {logged:?}");
    assert!(failures[0].contains("layer=checkout"), "{}", failures[0]);
    assert!(
        failures[0].contains("store=") && failures[0].contains("FaultyStore"),
        "{}",
        failures[0]
    );
    assert!(failures[0].contains("error=store down"), "{}", failures[0]);
}

#[test]
fn requests_without_a_key_warn_once_then_once_a_minute() {
    let warnings = Warnings::default();
    let clock = ManualClock::new();
    let layer = host_builder(&clock, Limit::per_second(1).burst(1).unwrap())
        .name("api")
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap();
    let mut host = layer.layer(backend());
    with_warnings(&warnings, async {
        for _ in 0..5 {
            common::send_without_key(&mut host).await;
        }
    });
    let logged = warnings.take();
    assert_eq!(logged.len(), 1, "{logged:?}");
    assert!(
        logged[0].contains("no throttle key") && logged[0].contains("layer=api"),
        "{}",
        logged[0]
    );
    clock.advance(Duration::from_secs(60));
    with_warnings(&warnings, async {
        common::send_without_key(&mut host).await;
        common::send_without_key(&mut host).await;
    });
    let logged = warnings.take();
    assert_eq!(logged.len(), 1, "{logged:?}");
    assert!(logged[0].contains("without_key_so_far=6"), "{}", logged[0]);
    assert_eq!(layer.stats().missing_key, 7);
}

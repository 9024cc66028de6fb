//! A key hot on many cores: tokens its lease lends to the cores' reserves are spent exactly,
//! and a request is refused only once none is left anywhere on the host.

mod common;

use common::*;
use hierarchical_throttle::clock::ManualClock;
use hierarchical_throttle::{
    CoreReserves, Limit, MemoryGlobalStore, MemoryLocalStore, RejectionReason,
};

/// Uses of one key from `tasks` tasks on a runtime of four threads, each task until it is
/// refused; returns how many were admitted.
fn race_on_one_key(layer: &HostLayer, tasks: usize) -> u64 {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let tasks: Vec<_> = (0..tasks)
            .map(|_| {
                let layer = layer.clone();
                tokio::spawn(async move {
                    let mut admitted = 0u64;
                    loop {
                        match layer.acquire("hot".to_owned(), 1).await {
                            Ok(_) => admitted += 1,
                            Err(refused) => {
                                assert_eq!(refused.reason, RejectionReason::Throttled);
                                return admitted;
                            }
                        }
                    }
                })
            })
            .collect();
        let mut admitted = 0;
        for task in tasks {
            admitted += task.await.expect("a task that ends");
        }
        admitted
    })
}

#[test]
fn threads_racing_on_one_key_spend_its_capacity_exactly_then_are_refused() {
    for policy in [
        CoreReserves::Always,
        CoreReserves::WhenContended,
        CoreReserves::Off,
    ] {
        // The clock stands still: the bucket's 5,000 tokens are all there is.
        let clock = ManualClock::new();
        let layer = host_builder(&clock, Limit::per_hour(1).burst(5_000).unwrap())
            .global_store(MemoryGlobalStore::with_clock(clock.clone()))
            .local_store(MemoryLocalStore::new().with_core_reserves(policy))
            .build()
            .unwrap();
        let admitted = race_on_one_key(&layer, 8);
        assert_eq!(admitted, 5_000, "{policy:?}");
        let stats = layer.stats();
        assert_eq!(stats.requests_admitted, 5_000, "{policy:?}");
        // Every task was refused once, after the last token was spent.
        assert_eq!(stats.requests_refused, 8, "{policy:?}");
        assert_eq!(
            stats.admitted_local + stats.admitted_after_fetch,
            5_000,
            "{policy:?}"
        );
    }
}

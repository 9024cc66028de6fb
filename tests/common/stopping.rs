//! A host about to stop hands back what it holds: one scenario, run on the in-memory store and
//! on Redis.

use std::time::Duration;

use hierarchical_throttle::batch::FractionOfCapacity;
use hierarchical_throttle::clock::ManualClock;
use hierarchical_throttle::global::GlobalStore;
use hierarchical_throttle::quota::BucketKey;
use hierarchical_throttle::{Limit, RejectionReason};

use super::{HostLayer, Outcome, backend, host_builder, send};

/// Two hosts on `global`, 100 a calendar day, at noon. Host A leases half the day in its first
/// batch and serves one request; stopping, it hands back the 49 it did not use, and host B then
/// admits all the rest of the day, 99, and refuses the next until midnight. Without the
/// hand-back the day would lose A's 49 (B would admit 50).
pub async fn a_stopping_host_hands_back_what_it_holds<G>(clock: &ManualClock, global: G)
where
    G: GlobalStore<BucketKey<String>> + Clone,
{
    let noon = Duration::from_secs(1_732_579_200 + 12 * 3_600);
    clock.set(noon);
    let limit: Limit = "100 per day at 00:00 UTC".parse().unwrap();
    let host = || -> HostLayer<G> {
        host_builder(clock, limit)
            .batch_policy(FractionOfCapacity::new(0.5).unwrap())
            .global_store(global.clone())
            .build()
            .unwrap()
    };
    let (a, b) = (host(), host());
    let level = |layer: &HostLayer<G>| {
        let layer = layer.clone();
        async move { layer.remaining_global("tenant").await.unwrap()[0].tokens }
    };
    let mut a_service = tower::Layer::layer(&a, backend());
    assert_eq!(send(&mut a_service, "tenant", 1).await, Outcome::Served);
    assert_eq!(level(&a).await, 50, "A leased half the day");

    // Through the type-erased handle, as shutdown code holding application state would.
    a.handle().return_all_leases().await;
    assert_eq!(level(&a).await, 99, "A handed back all it did not use");
    assert_eq!(a.stats().tokens_returned, 49);

    let mut b_service = tower::Layer::layer(&b, backend());
    let mut served = 0;
    for _ in 0..99 {
        served += u64::from(send(&mut b_service, "tenant", 1).await == Outcome::Served);
    }
    assert_eq!(served, 99, "the rest of the day, whole");
    let to_midnight = Duration::from_secs(12 * 3_600);
    assert_eq!(
        send(&mut b_service, "tenant", 1).await,
        Outcome::Refused(RejectionReason::Throttled, Some(to_midnight))
    );
    // A works on after it: the day is spent for it too.
    assert!(matches!(
        send(&mut a_service, "tenant", 1).await,
        Outcome::Refused(RejectionReason::Throttled, _)
    ));
}

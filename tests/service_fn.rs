//! The layer around a plain tower `service_fn` (no HTTP), with a rejection that becomes the
//! service's own error.

use std::time::Duration;

use hierarchical_throttle::clock::ManualClock;
use hierarchical_throttle::{
    HierarchicalThrottleLayer, Limit, MemoryGlobalStore, Rejection, RejectionReason,
};
use tower::{Service, ServiceBuilder, ServiceExt, service_fn};

#[derive(Debug, Clone)]
struct Query {
    tenant: u64,
    rows: u64,
}

#[derive(Debug, PartialEq)]
enum DbError {
    Busy { tenant: u64, retry_after: Duration },
    TooLarge(String),
}

#[tokio::test]
async fn a_plain_service_gets_its_own_error_on_rejection() {
    let clock = ManualClock::new();
    let layer = HierarchicalThrottleLayer::builder()
        .key(|q: &Query| Some(q.tenant))
        .cost(|q: &Query| q.rows)
        .clock(clock.clone())
        .limit(Limit::per_second(100).burst(100).unwrap())
        // Batches of exactly what a query needs, so the wait below is the query's own.
        .batch_policy(|_: &hierarchical_throttle::batch::BatchContext<'_>| 0)
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .on_rejection(|_: &Query, r: Rejection<u64>| match r.reason {
            RejectionReason::CostExceedsCapacity { .. } => {
                Err(DbError::TooLarge(r.reason.to_string()))
            }
            _ => Err(DbError::Busy {
                tenant: r.key.unwrap_or_default(),
                retry_after: r.retry_after.unwrap_or_default(),
            }),
        })
        .build()
        .unwrap();
    let mut db = ServiceBuilder::new()
        .layer(layer)
        .service(service_fn(
            |q: Query| async move { Ok::<_, DbError>(q.rows) },
        ));

    let mut run = async |tenant, rows| db.ready().await?.call(Query { tenant, rows }).await;
    assert_eq!(run(7, 60).await, Ok(60));
    assert_eq!(run(7, 40).await, Ok(40));
    assert_eq!(
        run(7, 10).await,
        Err(DbError::Busy {
            tenant: 7,
            retry_after: Duration::from_millis(100)
        })
    );
    assert_eq!(run(8, 100).await, Ok(100), "tenants are limited apart");
    assert_eq!(
        run(8, 101).await,
        Err(DbError::TooLarge(
            "request costs 101 tokens but the limit holds at most 100".into()
        ))
    );
}

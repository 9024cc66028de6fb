//! What the whole layer adds to a trivial service when the key is a request header
//! (`key::header_value`, a `String` per request), over 1 and 1,000 keys, every request
//! admitted: the unthrottled service and the throttled one, in the same run. Each iteration
//! clones a prepared request on both sides.
//!
//! Run with: cargo bench -p hierarchical-throttle-bench --bench layer_overhead

use std::convert::Infallible;
use std::future::{Ready, ready};
use std::hint::black_box;
use std::task::{Context, Poll};
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use hierarchical_throttle::batch::FractionOfCapacity;
use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore, key};
use http::{Request, Response};
use tower::{Layer, Service, ServiceExt};

/// The inner service: answers at once.
#[derive(Clone, Copy)]
struct Echo;

impl Service<Request<()>> for Echo {
    type Response = Response<()>;
    type Error = Infallible;
    type Future = Ready<Result<Response<()>, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Request<()>) -> Self::Future {
        ready(Ok(Response::new(())))
    }
}

fn requests(keys: usize) -> Vec<Request<()>> {
    (0..keys)
        .map(|i| {
            Request::get("/")
                .header("x-api-key", format!("customer-{i:06}"))
                .body(())
                .expect("a valid request")
        })
        .collect()
}

fn poll_once<F: std::future::Future>(future: F) -> Option<F::Output> {
    let mut context = Context::from_waker(std::task::Waker::noop());
    match std::pin::pin!(future).poll(&mut context) {
        Poll::Ready(output) => Some(output),
        Poll::Pending => None,
    }
}

fn limit() -> Limit {
    Limit::per_second(1_000_000)
        .burst(Limit::MAX_CAPACITY)
        .expect("a valid limit")
}

/// Measures `service` on `requests` after one warm-up round (every key then holds tokens).
fn measure<S>(c: &mut Criterion, name: String, mut service: S, requests: &[Request<()>])
where
    S: Service<Request<()>, Response = Response<()>, Error = Infallible> + Clone,
{
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    for request in requests {
        let warm = runtime.block_on(service.clone().oneshot(request.clone()));
        assert!(warm.is_ok());
    }
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
        measure(
            c,
            format!("layer_overhead/unthrottled/{keys}"),
            Echo,
            &requests,
        );
        let by_string = HierarchicalThrottleLayer::builder()
            .key(|req: &Request<()>| key::header_value(req, "x-api-key"))
            .limit(limit())
            .batch_policy(FractionOfCapacity::new(1.0).expect("a fraction"))
            .lease_ttl(Duration::from_secs(3600))
            .global_store(MemoryGlobalStore::new())
            .on_rejection(|_: &Request<()>, _| Ok::<_, Infallible>(Response::new(())))
            .build()
            .expect("a valid layer");
        measure(
            c,
            format!("layer_overhead/throttled/{keys}"),
            by_string.layer(Echo),
            &requests,
        );
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);

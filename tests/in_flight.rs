//! Fleet-wide concurrency limits (`HierarchicalConcurrencyLayer`): slots taken when a request
//! is admitted and given back when its response's body ends, when it is cancelled or when its
//! handler panics; hosts sharing one store never have more than the limit in flight; a host
//! that dies holding slots gives them back when its holding expires; a failing or slow store
//! follows the failure policy. On paused time, on memory and on real Redis servers.

mod common;

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use common::redis_server::{RedisCluster, RedisServer};
use hierarchical_throttle::clock::{Clock, ManualClock, TokioClock};
use hierarchical_throttle::global::redis::RedisGlobalStore;
use hierarchical_throttle::global::slots::{Holding, SlotHold, SlotStore};
use hierarchical_throttle::quota::BucketKey;
use hierarchical_throttle::{
    ConcurrencyBuilder, ConcurrencyStats, ConfigError, DefaultRejection, FailurePolicy,
    HierarchicalConcurrencyLayer, MemoryGlobalStore, MissingKey, Rejection, RejectionReason,
    SlotPermit, key,
};
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use tokio::sync::{Semaphore, mpsc};
use tower::ServiceExt;

type Layer<S, C = TokioClock> = HierarchicalConcurrencyLayer<Request<Body>, String, S, C>;

fn api_key(req: &Request<Body>) -> Option<String> {
    key::header_value(req, "x-api-key")
}

fn request(key: &str) -> Request<Body> {
    Request::get("/")
        .header("x-api-key", key)
        .body(Body::empty())
        .unwrap()
}

/// A host's layer on `store`, keyed by `x-api-key`, `max` in flight per key, on tokio's clock:
/// further settings go on top.
fn host<S>(store: S, max: u64) -> ConcurrencyBuilder<Request<Body>, String, S, TokioClock> {
    HierarchicalConcurrencyLayer::builder()
        .key(api_key)
        .max_in_flight(max)
        .store(store)
        .clock(TokioClock::new())
}

fn layer<S: SlotStore<BucketKey<String>>>(store: S, max: u64) -> Layer<S> {
    host(store, max).build().unwrap()
}

/// The values of the header `name` of `response`, in order.
fn fields(response: &http::Response<impl Sized>, name: &str) -> Vec<String> {
    response
        .headers()
        .get_all(name)
        .iter()
        .map(|v| v.to_str().unwrap().to_owned())
        .collect()
}

/// A host: a Router whose handler reports when it runs and then waits for the host's gate.
struct Host {
    app: Router,
    gate: Arc<Semaphore>,
    entered: mpsc::UnboundedReceiver<()>,
}

impl Host {
    fn new<S>(layer: Layer<S>) -> Self
    where
        S: SlotStore<BucketKey<String>> + Clone,
    {
        let gate = Arc::new(Semaphore::new(0));
        let (tx, entered) = mpsc::unbounded_channel();
        let handler_gate = gate.clone();
        let app = Router::new()
            .route(
                "/",
                get(move || {
                    let (gate, tx) = (handler_gate.clone(), tx.clone());
                    async move {
                        let _ = tx.send(());
                        gate.acquire().await.map(|p| p.forget()).ok();
                        "done"
                    }
                }),
            )
            .layer(layer);
        Self { app, gate, entered }
    }

    /// Sends a request for `key` on a task of its own.
    fn send(&self, key: &str) -> tokio::task::JoinHandle<StatusCode> {
        let app = self.app.clone();
        let req = request(key);
        tokio::spawn(async move {
            app.oneshot(req)
                .await
                .map(|r| r.status())
                .unwrap_or(StatusCode::IM_A_TEAPOT)
        })
    }

    /// Waits until `n` more requests run in the handler.
    async fn running(&mut self, n: usize) {
        for _ in 0..n {
            self.entered.recv().await.expect("the router lives");
        }
    }
}

mod one_host {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_key_runs_at_most_its_limit_and_a_refusal_says_so() {
        let layer = layer(MemoryGlobalStore::with_clock(TokioClock::new()), 2);
        let mut host = Host::new(layer.clone());
        let (a, b) = (host.send("k1"), host.send("k1"));
        host.running(2).await;
        let refused = host.app.clone().oneshot(request("k1")).await.unwrap();
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        let headers = refused.headers();
        assert_eq!(headers["retry-after"], "1");
        assert_eq!(
            headers["ratelimit-policy"],
            r#""concurrency";q=2;qu="concurrent-requests""#
        );
        assert_eq!(headers["ratelimit"], r#""concurrency";r=0;t=1"#);
        let body = refused.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(
            body,
            "too many requests in flight (at most 2) (limit concurrency, retry in 1 s)"
        );
        // Another key has slots of its own.
        let other = host.send("k2");
        host.running(1).await;
        host.gate.add_permits(3);
        for done in [a, b, other] {
            assert_eq!(done.await.unwrap(), StatusCode::OK);
        }
        assert_eq!(layer.in_flight(), 0);
        let again = host.send("k1");
        host.running(1).await;
        host.gate.add_permits(1);
        assert_eq!(again.await.unwrap(), StatusCode::OK);
        let stats = layer.stats();
        assert_eq!((stats.admitted, stats.refused_full), (4, 1));
    }

    #[tokio::test(start_paused = true)]
    async fn x_ratelimit_headers_tell_a_refusal_the_limit_and_the_wait() {
        let answer = DefaultRejection::by_content_type().x_ratelimit_headers(true);
        let store = MemoryGlobalStore::with_clock(TokioClock::new());
        let layer = host(store, 2)
            .retry_after(Duration::from_secs(3))
            .on_rejection(answer)
            .build()
            .unwrap();
        let held = [
            layer.acquire("k".to_owned()).await.unwrap(),
            layer.acquire("k".to_owned()).await.unwrap(),
        ];
        let app = Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(layer);
        let refused = app.clone().oneshot(request("k")).await.unwrap();
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        let told = [
            "x-ratelimit-limit",
            "x-ratelimit-remaining",
            "x-ratelimit-reset",
        ]
        .map(|name| fields(&refused, name));
        assert_eq!(told, [["2"], ["0"], ["3"]]);
        assert_eq!(refused.headers()["retry-after"], "3");
        // An admitted response: the IETF fields alone (no reset to name).
        drop(held);
        let admitted = app.oneshot(request("k")).await.unwrap();
        assert_eq!(admitted.status(), StatusCode::OK);
        assert_eq!(fields(&admitted, "ratelimit"), [r#""concurrency";r=1"#]);
        assert!(admitted.headers().get("x-ratelimit-limit").is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_streamed_body_holds_its_slot_until_it_ends() {
        let (chunks, rx) = mpsc::unbounded_channel::<&'static str>();
        let rx = Arc::new(std::sync::Mutex::new(Some(rx)));
        let stream_layer = layer(MemoryGlobalStore::with_clock(TokioClock::new()), 1);
        let app = Router::new()
            .route(
                "/",
                get(move || {
                    let rx = rx.lock().unwrap().take();
                    async move {
                        let stream = futures_util::stream::unfold(rx, |rx| async move {
                            let mut rx = rx?;
                            let chunk = rx.recv().await?;
                            Some((Ok::<_, Infallible>(chunk), Some(rx)))
                        });
                        Body::from_stream(stream)
                    }
                }),
            )
            .layer(stream_layer.clone());
        let streaming = app.clone().oneshot(request("k")).await.unwrap();
        assert_eq!(streaming.status(), StatusCode::OK);
        // The handler has answered, but the body still streams: the slot is taken.
        assert_eq!(stream_layer.in_flight(), 1);
        let refused = app.clone().oneshot(request("k")).await.unwrap();
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        chunks.send("first").unwrap();
        drop(chunks);
        let body = streaming.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, "first");
        assert_eq!(stream_layer.in_flight(), 0);
        // The next request runs (its handler finds the stream taken and streams nothing).
        let next = app.oneshot(request("k")).await.unwrap();
        assert_eq!(next.status(), StatusCode::OK);
        drop(next);
        assert_eq!(
            stream_layer.in_flight(),
            0,
            "a body dropped unread gives its slot back"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn cancelled_and_panicking_requests_give_their_slots_back() {
        let layer = layer(MemoryGlobalStore::with_clock(TokioClock::new()), 1);
        let mut host = Host::new(layer.clone());
        let cancelled = host.send("k");
        host.running(1).await;
        assert_eq!(layer.in_flight(), 1);
        cancelled.abort();
        assert!(cancelled.await.unwrap_err().is_cancelled());
        assert_eq!(layer.in_flight(), 0);

        let panicking = Router::new()
            .route(
                "/",
                get(|| async {
                    if true {
                        panic!("the handler fails");
                    }
                    "unreachable"
                }),
            )
            .layer(layer.clone());
        let panicked = tokio::spawn(panicking.oneshot(request("k")));
        assert!(panicked.await.unwrap_err().is_panic());
        assert_eq!(layer.in_flight(), 0);
        let after = host.send("k");
        host.running(1).await;
        host.gate.add_permits(1);
        assert_eq!(after.await.unwrap(), StatusCode::OK);
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_without_a_key_follows_the_missing_key_policy() {
        let store = MemoryGlobalStore::with_clock(TokioClock::new());
        let reject = layer(store.clone(), 1);
        let app = Router::new().route("/", get(|| async { "ok" }));
        let no_key = || Request::get("/").body(Body::empty()).unwrap();
        let refused = app.clone().layer(reject).oneshot(no_key()).await.unwrap();
        assert_eq!(refused.status(), StatusCode::BAD_REQUEST);
        let shared: Layer<_> = host(store, 1)
            .missing_key(MissingKey::UseKey("anonymous".to_owned()))
            .build()
            .unwrap();
        let held = shared.acquire("anonymous".to_owned()).await.unwrap();
        let answered = app.layer(shared).oneshot(no_key()).await.unwrap();
        assert_eq!(
            answered.status(),
            StatusCode::TOO_MANY_REQUESTS,
            "the shared key is full"
        );
        drop(held);
    }

    #[tokio::test(start_paused = true)]
    async fn an_exempt_request_runs_beside_a_full_key_and_takes_no_slot() {
        let store = MemoryGlobalStore::with_clock(TokioClock::new());
        let layer: Layer<_> = host(store, 1)
            .exempt(|req: &Request<Body>| req.headers().contains_key("x-internal"))
            .build()
            .unwrap();
        let mut host = Host::new(layer.clone());
        let exempt = |key: Option<&str>| {
            let mut req = Request::get("/").header("x-internal", "1");
            if let Some(key) = key {
                req = req.header("x-api-key", key);
            }
            req.body(Body::empty()).unwrap()
        };
        // k1's one slot held by a request still running.
        let running = host.send("k1");
        host.running(1).await;
        assert_eq!(
            host.app
                .clone()
                .oneshot(request("k1"))
                .await
                .unwrap()
                .status(),
            StatusCode::TOO_MANY_REQUESTS
        );
        // Two exempt requests of k1, and one without a key, run beside it.
        let app = host.app.clone();
        let exempted: Vec<_> = [Some("k1"), Some("k1"), None]
            .into_iter()
            .map(|key| tokio::spawn(app.clone().oneshot(exempt(key))))
            .collect();
        host.running(3).await;
        let probe = layer.acquire("k2".to_owned()).await.unwrap();
        host.gate.add_permits(4);
        for answer in exempted {
            let response = answer.await.unwrap().unwrap();
            assert_eq!(response.status(), StatusCode::OK);
            assert!(response.headers().get("ratelimit").is_none());
            response.into_body().collect().await.unwrap();
        }
        assert_eq!(running.await.unwrap(), StatusCode::OK);
        // The slot k1's running request held is free again, and no exempt one took it.
        let k1 = layer.acquire("k1".to_owned()).await.unwrap();
        assert_eq!(layer.free_slots(&"k1".to_owned(), &k1), 0);
        let stats = layer.stats();
        assert_eq!(stats.requests_exempt, 3);
        assert_eq!((stats.admitted, stats.refused_full), (3, 1));
        drop((k1, probe));
    }

    #[tokio::test(start_paused = true)]
    async fn refusals_are_answered_by_the_layers_own_handler() {
        // An API answering its errors as JSON: full, missing key, and a wait that ran out.
        let store = MemoryGlobalStore::with_clock(TokioClock::new());
        let in_flight = host(store, 1)
            .wait_for_slot(Duration::from_millis(200))
            .on_rejection(|_: &Request<Body>, rejection: Rejection<String>| {
                let why = match rejection.reason {
                    RejectionReason::TooManyInFlight { max } => format!("busy (at most {max})"),
                    other => other.to_string(),
                };
                let key = rejection.key.unwrap_or_default();
                let body = format!(r#"{{"error":"{why}","key":"{key}"}}"#);
                let status = match rejection.reason {
                    RejectionReason::MissingKey => StatusCode::UNAUTHORIZED,
                    _ => StatusCode::SERVICE_UNAVAILABLE,
                };
                let response = http::Response::builder()
                    .status(status)
                    .header("content-type", "application/json")
                    .body(Body::from(body));
                Ok::<_, Infallible>(response.expect("a valid response"))
            })
            .build()
            .unwrap();
        let app = Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(in_flight.clone());
        let body = |response: http::Response<_>| async move {
            let bytes = BodyExt::collect(response.into_body())
                .await
                .unwrap()
                .to_bytes();
            String::from_utf8(bytes.to_vec()).unwrap()
        };

        let held = in_flight.acquire("k1".to_owned()).await.unwrap();
        // Waits its 200 ms for k1's one slot, then is answered by the handler.
        let refused = app.clone().oneshot(request("k1")).await.unwrap();
        assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(refused.headers()["content-type"], "application/json");
        assert_eq!(
            body(refused).await,
            r#"{"error":"busy (at most 1)","key":"k1"}"#
        );
        let no_key = Request::get("/").body(Body::empty()).unwrap();
        let refused = app.clone().oneshot(no_key).await.unwrap();
        assert_eq!(refused.status(), StatusCode::UNAUTHORIZED);
        drop(held);
        let admitted = app.oneshot(request("k1")).await.unwrap();
        assert_eq!(admitted.status(), StatusCode::OK);
        assert_eq!(body(admitted).await, "ok");
        assert_eq!(in_flight.stats().refused_full, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_grpc_call_is_refused_with_resource_exhausted() {
        let layer = layer(MemoryGlobalStore::with_clock(TokioClock::new()), 1);
        let _held = layer.acquire("k".to_owned()).await.unwrap();
        let app = Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(layer);
        let call = Request::get("/")
            .header("x-api-key", "k")
            .header("content-type", "application/grpc")
            .body(Body::empty())
            .unwrap();
        let answer = app.oneshot(call).await.unwrap();
        assert_eq!(answer.status(), StatusCode::OK);
        assert_eq!(answer.headers()["grpc-status"], "8");
    }

    #[tokio::test(start_paused = true)]
    async fn each_key_has_its_tiers_limit_and_a_change_applies_at_run_time() {
        let basic = Arc::new(AtomicU64::new(1));
        let tier = basic.clone();
        let layer: Layer<_> = HierarchicalConcurrencyLayer::builder()
            .key(api_key)
            .max_in_flight_per_key(move |key: &String| match key.as_str() {
                "gold" => 3,
                "banned" => 0,
                _ => tier.load(Ordering::SeqCst),
            })
            .store(MemoryGlobalStore::with_clock(TokioClock::new()))
            .clock(TokioClock::new())
            .build()
            .unwrap();
        let take = |key: &str| layer.acquire(key.to_owned());
        let gold = [
            take("gold").await.unwrap(),
            take("gold").await.unwrap(),
            take("gold").await.unwrap(),
        ];
        let refused = take("gold").await.unwrap_err();
        assert_eq!(refused.reason, RejectionReason::TooManyInFlight { max: 3 });
        let one = take("basic").await.unwrap();
        assert_eq!(
            take("basic").await.unwrap_err().reason,
            RejectionReason::TooManyInFlight { max: 1 }
        );
        assert_eq!(
            take("banned").await.unwrap_err().reason,
            RejectionReason::TooManyInFlight { max: 0 }
        );
        // Raised at run time: the next call for the key asks under the new limit.
        basic.store(2, Ordering::SeqCst);
        assert_eq!(layer.max_in_flight(&"basic".to_owned()), 2);
        let two = take("basic").await.unwrap();
        assert!(take("basic").await.is_err());
        // Lowered below what runs: nothing more is admitted until fewer than the new limit run.
        basic.store(1, Ordering::SeqCst);
        drop(one);
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(
            take("basic").await.unwrap_err().reason,
            RejectionReason::TooManyInFlight { max: 1 }
        );
        drop(two);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let again = take("basic").await.unwrap();
        assert!(take("basic").await.is_err());
        drop((gold, again));
    }

    #[test]
    fn invalid_settings_are_errors_when_built() {
        let store = MemoryGlobalStore::<String>::new();
        let base = || {
            HierarchicalConcurrencyLayer::builder()
                .key(api_key)
                .store(store.clone())
        };
        let setting = |e: Result<Layer<_, _>, ConfigError>| match e {
            Err(ConfigError::InvalidSetting { setting, .. }) => setting,
            other => panic!("expected an invalid setting, got {other:?}"),
        };
        assert_eq!(setting(base().build()), "max_in_flight");
        assert_eq!(
            setting(
                base()
                    .max_in_flight(1)
                    .slot_ttl(Duration::from_millis(100))
                    .build()
            ),
            "slot_ttl"
        );
        assert_eq!(
            setting(base().max_in_flight(1).linger(Duration::ZERO).build()),
            "linger"
        );
        assert_eq!(
            setting(
                base()
                    .max_in_flight(1)
                    .linger(Duration::from_secs(3))
                    .build()
            ),
            "linger"
        );
        assert_eq!(
            setting(
                base()
                    .max_in_flight(1)
                    .retry_after(Duration::from_millis(10))
                    .build()
            ),
            "retry_after"
        );
        for calls in [0, 4_097] {
            let batch = base().max_in_flight(1).store_batch(calls).build();
            assert_eq!(setting(batch), "store_batch", "{calls} calls a round trip");
        }
        assert!(base().max_in_flight(1).store_batch(4_096).build().is_ok());
        let forever = base()
            .max_in_flight(1)
            .store_timeout(Duration::MAX)
            .back_off(Duration::MAX)
            .build();
        assert_eq!(setting(forever), "slot_ttl", "no overflow, an error");
        let past_a_day = base()
            .max_in_flight(1)
            .slot_ttl(Duration::from_secs(86_401))
            .build();
        assert_eq!(setting(past_a_day), "slot_ttl");
        let waits_too_long = base()
            .max_in_flight(1)
            .wait_for_slot(Duration::from_secs(3_601))
            .build();
        assert_eq!(setting(waits_too_long), "wait_for_slot");
        assert!(matches!(
            base().max_in_flight(1).name("no spaces").build(),
            Err(ConfigError::Unreadable { .. } | ConfigError::InvalidSetting { .. })
        ));
        assert!(base().max_in_flight(1).build().is_ok());
    }
}

/// A slot store whose answers take `delay` (applied by the inner store when sent, answered
/// after the delay), or that fails every call while `down`; it publishes what the store last
/// said its host holds (`held`), so that a test can wait for a hand-back to land.
#[derive(Clone)]
struct SlowStore<S> {
    inner: S,
    delay: Arc<AtomicU64>,
    down: Arc<std::sync::atomic::AtomicBool>,
    calls: Arc<AtomicU64>,
    held: Arc<tokio::sync::watch::Sender<Option<u64>>>,
}

impl<S> SlowStore<S> {
    fn new(inner: S, delay: Duration) -> Self {
        Self {
            inner,
            delay: Arc::new(AtomicU64::new(delay.as_micros() as u64)),
            down: Default::default(),
            calls: Default::default(),
            held: Arc::new(tokio::sync::watch::Sender::new(None)),
        }
    }
}

impl<S: SlotStore<BucketKey<String>>> SlotStore<BucketKey<String>> for SlowStore<S> {
    type Error = common::StoreDown;

    async fn hold(
        &self,
        key: &BucketKey<String>,
        max: u64,
        hold: SlotHold,
    ) -> Result<Holding, common::StoreDown> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if self.down.load(Ordering::SeqCst) {
            return Err(common::StoreDown);
        }
        let answer = self
            .inner
            .hold(key, max, hold)
            .await
            .map_err(|_| common::StoreDown);
        if let Ok(holding) = &answer {
            self.held.send_replace(Some(holding.held));
        }
        tokio::time::sleep(Duration::from_micros(self.delay.load(Ordering::SeqCst))).await;
        answer
    }
}

mod waiting_and_failing {
    use super::*;

    #[test]
    fn outside_a_tokio_runtime_the_failure_policy_decides_without_a_panic() {
        let on = |policy| {
            let layer: Layer<_, ManualClock> = HierarchicalConcurrencyLayer::builder()
                .key(api_key)
                .max_in_flight(3)
                .wait_for_slot(Duration::from_secs(1))
                .store(MemoryGlobalStore::<String>::new())
                .clock(ManualClock::new())
                .failure_policy(policy)
                .build()
                .unwrap();
            let mut acquire = std::pin::pin!(layer.acquire("k".to_owned()));
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            match acquire.as_mut().poll(&mut cx) {
                std::task::Poll::Ready(answer) => answer.map(drop).map_err(|r| r.reason),
                std::task::Poll::Pending => panic!("decided at once"),
            }
        };
        assert_eq!(
            on(FailurePolicy::Reject),
            Err(RejectionReason::StoreUnavailable)
        );
        assert_eq!(on(FailurePolicy::local_fallback(3).unwrap()), Ok(()));
    }

    #[test]
    fn a_layer_outliving_its_runtime_sweeps_again_on_the_next() {
        let clock = ManualClock::new();
        let memory = MemoryGlobalStore::with_clock(clock.clone());
        let layer: Layer<_, ManualClock> = HierarchicalConcurrencyLayer::builder()
            .key(api_key)
            .max_in_flight(2)
            .store(memory.clone())
            .clock(clock)
            .build()
            .unwrap();
        let paused = common::paused_runtime;
        // The first runtime starts the sweeper, and ends with it.
        paused().block_on(async {
            drop(layer.acquire("k".to_owned()).await.unwrap());
            tokio::time::sleep(Duration::from_millis(300)).await;
            assert_eq!(
                memory.keys_with_slots_held(),
                0,
                "given back by the first sweeper"
            );
        });
        paused().block_on(async {
            drop(layer.acquire("k".to_owned()).await.unwrap());
            assert_eq!(
                memory.keys_with_slots_held(),
                1,
                "the slot lingers on the host"
            );
            tokio::time::sleep(Duration::from_millis(300)).await;
            assert_eq!(
                memory.keys_with_slots_held(),
                0,
                "given back by a new sweeper"
            );
        });
    }

    /// A manual clock whose coarse reading stays where it was made (allowed: it trails the
    /// time by at most its lag, an hour).
    #[derive(Clone)]
    struct StuckCoarseReading(ManualClock);

    impl Clock for StuckCoarseReading {
        fn now(&self) -> Duration {
            self.0.now()
        }

        fn recent(&self) -> Duration {
            Duration::ZERO
        }

        fn recent_lag(&self) -> Duration {
            Duration::from_secs(3_600)
        }
    }

    #[test]
    fn a_holding_past_its_end_admits_nothing_whatever_the_coarse_clock_says() {
        let clock = ManualClock::new();
        let memory = MemoryGlobalStore::with_clock(clock.clone());
        type Memory = MemoryGlobalStore<String, ManualClock>;
        fn host<C: Clock>(memory: &Memory, clock: C) -> Layer<Memory, C> {
            HierarchicalConcurrencyLayer::builder()
                .key(api_key)
                .max_in_flight(2)
                .store(memory.clone())
                .clock(clock)
                .build()
                .unwrap()
        }
        let stale = host(&memory, StuckCoarseReading(clock.clone()));
        let other = host(&memory, clock.clone());
        let runtime = || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
        };
        // Two slots held and freed; the runtime ends (with the sweeper) before they are given
        // back, so the host still counts on its holding.
        runtime().block_on(async {
            let first = stale.acquire("k".to_owned()).await.unwrap();
            let second = stale.acquire("k".to_owned()).await.unwrap();
            drop((first, second));
        });
        // Past the holding's time to live: the store gives both slots to the other host.
        clock.advance(Duration::from_secs(11));
        runtime().block_on(async {
            let taken = [
                other.acquire("k".to_owned()).await.unwrap(),
                other.acquire("k".to_owned()).await.unwrap(),
            ];
            // The coarse reading (zero) says the holding is current; the time says it ended.
            let refused = stale.acquire("k".to_owned()).await.expect_err("full");
            assert_eq!(refused.reason, RejectionReason::TooManyInFlight { max: 2 });
            drop(taken);
        });
    }

    /// `layer`'s slot for `k`, on a task of its own, with the time it took since `start`.
    fn timed_acquire<S: SlotStore<BucketKey<String>>>(
        layer: &Layer<S>,
        start: tokio::time::Instant,
    ) -> tokio::task::JoinHandle<
        Result<(SlotPermit, Duration), hierarchical_throttle::Rejection<String>>,
    > {
        let layer = layer.clone();
        tokio::spawn(async move {
            let permit = layer.acquire("k".to_owned()).await?;
            Ok((permit, start.elapsed()))
        })
    }

    #[tokio::test(start_paused = true)]
    async fn patient_requests_wait_for_a_slot_freed_here_or_on_another_host() {
        let memory = MemoryGlobalStore::with_clock(TokioClock::new());
        let patient = || -> Layer<_> {
            host(memory.clone(), 1)
                .wait_for_slot(Duration::from_secs(1))
                .build()
                .unwrap()
        };
        let (a, b) = (patient(), patient());
        let start = tokio::time::Instant::now();
        // Freed on the same host: handed over at once.
        let held = a.acquire("k".to_owned()).await.unwrap();
        let waiting = timed_acquire(&a, start);
        tokio::time::sleep(Duration::from_millis(200)).await;
        drop(held);
        let (held, waited) = waiting.await.unwrap().unwrap();
        assert_eq!(waited, Duration::from_millis(200));
        // Freed on another host: found by this host's next ask once it has gone back.
        let start = tokio::time::Instant::now();
        let waiting = timed_acquire(&b, start);
        tokio::time::sleep(Duration::from_millis(300)).await;
        drop(held);
        let (held, waited) = waiting.await.unwrap().unwrap();
        assert!(
            waited > Duration::from_millis(300) && waited <= Duration::from_millis(550),
            "{waited:?}"
        );
        // Nothing freed: refused when the wait runs out, exactly.
        let start = tokio::time::Instant::now();
        let refused = a.acquire("k".to_owned()).await.unwrap_err();
        assert_eq!(refused.reason, RejectionReason::TooManyInFlight { max: 1 });
        assert_eq!(start.elapsed(), Duration::from_secs(1));
        assert_eq!(a.stats().refused_full, 1);
        drop(held);
    }

    #[tokio::test(start_paused = true)]
    async fn a_flood_of_distinct_keys_leaves_nothing_behind() {
        let memory = MemoryGlobalStore::with_clock(TokioClock::new());
        let layer = layer(memory.clone(), 1);
        let floods: Vec<_> = (0..10_000)
            .map(|i| {
                let layer = layer.clone();
                tokio::spawn(async move { layer.acquire(format!("spray-{i}")).await.map(drop) })
            })
            .collect();
        for flood in floods {
            assert!(
                flood.await.unwrap().is_ok(),
                "every key has a slot of its own"
            );
        }
        assert_eq!(layer.keys(), 10_000);
        // Given back within a few sweeps, and the keys forgotten on the host and the store.
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(layer.keys(), 0);
        assert_eq!(memory.keys_with_slots_held(), 0);
        assert_eq!(layer.stats().admitted, 10_000);
    }

    #[tokio::test(start_paused = true)]
    async fn thousands_waiting_on_one_key_get_exactly_the_limit_from_a_few_calls() {
        let store = SlowStore::new(
            MemoryGlobalStore::with_clock(TokioClock::new()),
            Duration::from_millis(20),
        );
        let layer = layer(store.clone(), 10);
        let tries: Vec<_> = (0..2_000)
            .map(|_| {
                let layer = layer.clone();
                tokio::spawn(async move { layer.acquire("hot".to_owned()).await })
            })
            .collect();
        let mut held = Vec::new();
        let mut refused = 0;
        for attempt in tries {
            match attempt.await.unwrap() {
                Ok(permit) => held.push(permit),
                Err(rejection) => {
                    assert_eq!(
                        rejection.reason,
                        RejectionReason::TooManyInFlight { max: 10 }
                    );
                    refused += 1;
                }
            }
        }
        assert_eq!((held.len(), refused), (10, 1_990));
        assert!(
            store.calls.load(Ordering::SeqCst) <= 3,
            "{} calls",
            store.calls.load(Ordering::SeqCst)
        );
        assert_eq!(layer.in_flight(), 10);
    }

    /// Starts an `acquire` for `key` that waits for the store, and cancels it.
    async fn cancel_while_waiting<S: SlotStore<BucketKey<String>>>(layer: &Layer<S>, key: &str) {
        let waiting = {
            let (layer, key) = (layer.clone(), key.to_owned());
            tokio::spawn(async move { layer.acquire(key).await.map(|_| ()) })
        };
        tokio::task::yield_now().await;
        waiting.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_cancelled_while_it_waits_leaves_no_slot_behind() {
        let memory = MemoryGlobalStore::with_clock(TokioClock::new());
        let store = SlowStore::new(memory.clone(), Duration::from_millis(20));
        let layer = layer(store, 1);
        cancel_while_waiting(&layer, "k").await;
        // The call's answer gives the slot to nobody: it goes back to the lease, then to the
        // store once it has lingered.
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(layer.in_flight(), 0);
        assert_eq!(memory.keys_with_slots_held(), 0);
        let permit = layer.acquire("k".to_owned()).await;
        assert!(permit.is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_cancelled_before_it_hears_its_refusal_is_not_counted_refused() {
        let memory = MemoryGlobalStore::with_clock(TokioClock::new());
        let holder = layer(memory.clone(), 1);
        let _held = holder.acquire("k".to_owned()).await.unwrap();
        let host = layer(SlowStore::new(memory, Duration::from_millis(20)), 1);
        cancel_while_waiting(&host, "k").await;
        // The store's answer (full) reaches nobody: neither admitted nor refused.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let stats = host.stats();
        assert_eq!((stats.admitted, stats.refused_full), (0, 0));
        let heard = host.acquire("k".to_owned()).await.unwrap_err();
        assert_eq!(heard.reason, RejectionReason::TooManyInFlight { max: 1 });
        assert_eq!(host.stats().refused_full, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_store_past_its_time_out_is_a_failure_decided_by_the_policy() {
        let store = SlowStore::new(
            MemoryGlobalStore::with_clock(TokioClock::new()),
            Duration::from_millis(200),
        );
        let reject: Layer<_> = host(store.clone(), 4)
            .failure_policy(FailurePolicy::Reject)
            .build()
            .unwrap();
        let refused = reject.acquire("k".to_owned()).await.unwrap_err();
        assert_eq!(refused.reason, RejectionReason::StoreUnavailable);
        assert_eq!(reject.stats().store_failures, 1);
        let app = Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(reject);
        let answer = app.oneshot(request("k")).await.unwrap();
        assert_eq!(
            answer.status(),
            StatusCode::SERVICE_UNAVAILABLE,
            "refused in the back-off, no call"
        );
        let body = answer.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, "store unavailable (limit concurrency, retry in 1 s)");
        assert_eq!(store.calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_host_decides_alone_on_its_share_while_the_store_is_down() {
        let store = SlowStore::new(
            MemoryGlobalStore::with_clock(TokioClock::new()),
            Duration::ZERO,
        );
        store.down.store(true, Ordering::SeqCst);
        let shared: Layer<_> = host(store.clone(), 4)
            .failure_policy(FailurePolicy::local_fallback(2).unwrap())
            .build()
            .unwrap();
        let a = shared.acquire("k".to_owned()).await.unwrap();
        let b = shared.acquire("k".to_owned()).await.unwrap();
        let third = shared.acquire("k".to_owned()).await.unwrap_err();
        assert_eq!(third.reason, RejectionReason::StoreUnavailable);
        // The store is back: the requests running on the fallback are claimed at the store by
        // the next renewal, and new ones ask it again after the back-off.
        store.down.store(false, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_secs(2)).await;
        let c = shared.acquire("k".to_owned()).await.unwrap();
        let d = shared.acquire("k".to_owned()).await.unwrap();
        let full = shared.acquire("k".to_owned()).await.unwrap_err();
        assert_eq!(full.reason, RejectionReason::TooManyInFlight { max: 4 });
        drop((a, b, c, d));
    }
}

/// Hosts on one store: never more than the limit in flight, refusals only when the fleet is
/// full (once idle slots have lingered back), and a dead host's slots back after their TTL.
async fn fleet_holds_the_limit<S>(store: S)
where
    S: SlotStore<BucketKey<String>> + Clone,
{
    let first = SlowStore::new(store.clone(), Duration::ZERO);
    let first_holds = first.held.clone();
    let mut hosts = vec![Host::new(layer(first, 5))];
    hosts.extend((1..3).map(|_| Host::new(layer(store.clone(), 5))));
    let on_first: Vec<_> = (0..4).map(|_| hosts[0].send("tenant")).collect();
    hosts[0].running(4).await;
    let on_second = [hosts[1].send("tenant"), hosts[1].send("tenant")];
    hosts[1].running(1).await;
    let [admitted, refused] = on_second;
    assert_eq!(
        refused.await.unwrap(),
        StatusCode::TOO_MANY_REQUESTS,
        "4 + 1 of 5 run"
    );
    assert_eq!(
        hosts[2].send("tenant").await.unwrap(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // Two of the first host's requests end; their slots linger there, then go back.
    let mut first_holds = first_holds.subscribe();
    hosts[0].gate.add_permits(2);
    let handed_back = first_holds.wait_for(|held| *held == Some(2));
    tokio::time::timeout(Duration::from_secs(5), handed_back)
        .await
        .expect("the first host hands back the two slots within its linger")
        .expect("the first host's store lives");
    let on_third = [
        hosts[2].send("tenant"),
        hosts[2].send("tenant"),
        hosts[2].send("tenant"),
    ];
    hosts[2].running(2).await;
    let [x, y, z] = on_third;
    let mut statuses = Vec::new();
    hosts[0].gate.add_permits(2);
    hosts[1].gate.add_permits(1);
    hosts[2].gate.add_permits(3);
    for done in on_first.into_iter().chain([admitted, x, y, z]) {
        statuses.push(done.await.unwrap());
    }
    let ok = statuses.iter().filter(|s| **s == StatusCode::OK).count();
    assert_eq!(ok, 7, "{statuses:?}: 4 + 1 + 2 of the third host's 3");
}

mod fleet {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn on_memory() {
        fleet_holds_the_limit(MemoryGlobalStore::with_clock(TokioClock::new())).await;
    }

    #[tokio::test]
    async fn on_redis() {
        let server = RedisServer::start();
        let store = server.store().await;
        fleet_on_real_time(store).await;
    }

    #[tokio::test]
    async fn on_a_redis_cluster() {
        let cluster = RedisCluster::start();
        let store: RedisGlobalStore<String> = RedisGlobalStore::connect_cluster(cluster.urls())
            .await
            .unwrap();
        fleet_on_real_time(store).await;
    }

    /// Three hosts, three keys, six requests each at once per key: exactly the limit of each
    /// key admitted, over all hosts.
    async fn fleet_on_real_time(store: RedisGlobalStore<String>) {
        // On real time, a time-out no loaded machine reaches: a failed call would be decided
        // by the failure policy, and this test is about the store's answers.
        let hosts: Vec<Layer<_>> = (0..3)
            .map(|_| {
                host(store.clone(), 4)
                    .store_timeout(Duration::from_secs(1))
                    .build()
                    .unwrap()
            })
            .collect();
        for key in ["alpha", "beta", "gamma"] {
            let tries: Vec<_> = (0..18)
                .map(|i| {
                    let host = hosts[i % 3].clone();
                    tokio::spawn(async move { host.acquire(key.to_owned()).await })
                })
                .collect();
            let mut held = Vec::new();
            for attempt in tries {
                if let Ok(permit) = attempt.await.unwrap() {
                    held.push(permit);
                }
            }
            assert_eq!(held.len(), 4, "key {key}");
        }
    }

    /// Redis a network hop away, then slower than the time-out (its calls applied, their
    /// answers too late), then stalled: the hosts refuse as unavailable (under `Reject`) and
    /// never have more than the limit in flight, before, during or after.
    #[tokio::test]
    async fn on_a_slow_and_stalling_redis() {
        let server = RedisServer::start();
        let proxy = common::proxy::FaultProxy::start(server.port).await;
        let store = RedisGlobalStore::<String>::open(&proxy.url()).unwrap();
        let hosts: Vec<Layer<_>> = (0..3)
            .map(|_| {
                host(store.clone(), 4)
                    .store_timeout(Duration::from_millis(250))
                    .back_off(Duration::from_millis(100))
                    .failure_policy(FailurePolicy::Reject)
                    .build()
                    .unwrap()
            })
            .collect();
        let wave = |hosts: &[Layer<_>]| {
            let tries: Vec<_> = (0..12)
                .map(|i| {
                    let host = hosts[i % 3].clone();
                    tokio::spawn(async move { host.acquire("k".to_owned()).await })
                })
                .collect();
            async move {
                let mut held = Vec::new();
                let mut unavailable = 0;
                for attempt in tries {
                    match attempt.await.unwrap() {
                        Ok(permit) => held.push(permit),
                        Err(r) if r.reason == RejectionReason::StoreUnavailable => unavailable += 1,
                        Err(r) => assert_eq!(r.reason, RejectionReason::TooManyInFlight { max: 4 }),
                    }
                }
                (held, unavailable)
            }
        };
        // The connection made and the script loaded, before the proxy slows down.
        for host in &hosts {
            drop(host.acquire("warm".to_owned()).await.unwrap());
        }
        proxy.latency(Duration::from_millis(10));
        let (held, unavailable) = wave(&hosts).await;
        assert_eq!((held.len(), unavailable), (4, 0), "a hop away, exact");
        drop(held);
        // Slower than the time-out: calls are applied by Redis, answered too late.
        proxy.latency(Duration::from_millis(300));
        let (held, unavailable) = wave(&hosts).await;
        assert!(held.len() <= 4, "{} in flight", held.len());
        assert!(unavailable > 0);
        drop(held);
        proxy.stall(true);
        let (held, unavailable) = wave(&hosts).await;
        assert!(held.len() <= 4 && unavailable > 0);
        drop(held);
        proxy.stall(false);
        proxy.latency(Duration::ZERO);
        // Back: once the hosts' back-offs are over, their calls set the late holdings again
        // (absolute, not added), so a wave is exact; until then none runs past the limit.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let (held, unavailable) = wave(&hosts).await;
            assert!(held.len() <= 4, "{} in flight", held.len());
            if unavailable == 0 {
                assert_eq!(held.len(), 4, "exact again once the store answers");
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "still unavailable 10 s after the store came back"
            );
            drop(held);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A host dies (its runtime shut down) holding two of three slots: the others get them
    /// when its holding expires at the store, not before.
    fn a_dead_hosts_slots_come_back_after_their_time_to_live<S>(
        store: impl Fn() -> S,
        clock: ManualClock,
    ) where
        S: SlotStore<BucketKey<String>> + Clone,
    {
        let host = |store: S| -> Layer<S, ManualClock> {
            HierarchicalConcurrencyLayer::builder()
                .key(api_key)
                .max_in_flight(3)
                .store(store)
                .clock(clock.clone())
                .slot_ttl(Duration::from_secs(10))
                .store_timeout(Duration::from_secs(1))
                .build()
                .unwrap()
        };
        let runtime = || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
        };
        let doomed = runtime();
        let dying = doomed.block_on(async {
            let dying = host(store());
            let held = [
                dying.acquire("k".to_owned()).await.unwrap(),
                dying.acquire("k".to_owned()).await.unwrap(),
            ];
            std::mem::forget(held);
            dying
        });
        doomed.shutdown_background();
        std::mem::forget(dying);
        let survivor_runtime = runtime();
        survivor_runtime.block_on(async {
            let survivor = host(store());
            let one = survivor.acquire("k".to_owned()).await.unwrap();
            let refused = survivor.acquire("k".to_owned()).await.unwrap_err();
            assert_eq!(refused.reason, RejectionReason::TooManyInFlight { max: 3 });
            clock.advance(Duration::from_secs(9));
            assert!(
                survivor.acquire("k".to_owned()).await.is_err(),
                "not yet expired"
            );
            clock.advance(Duration::from_secs(2));
            let two = survivor.acquire("k".to_owned()).await.unwrap();
            let three = survivor.acquire("k".to_owned()).await.unwrap();
            drop((one, two, three));
        });
    }

    #[test]
    fn a_dead_host_on_memory() {
        let clock = ManualClock::new();
        let store = MemoryGlobalStore::with_clock(clock.clone());
        a_dead_hosts_slots_come_back_after_their_time_to_live(|| store.clone(), clock);
    }

    #[test]
    fn a_dead_host_on_redis() {
        let server = RedisServer::start();
        let clock = ManualClock::new();
        clock.set(Duration::from_secs(1_000_000));
        let url = server.url();
        let connect = {
            let clock = clock.clone();
            move || {
                let store = RedisGlobalStore::<String>::open(&url).unwrap();
                store.with_clock_override(clock.clone())
            }
        };
        a_dead_hosts_slots_come_back_after_their_time_to_live(connect, clock);
    }
}

/// A store whose calls, while `holding_back`, are never answered (their host gives up on them
/// at its time-out) and kept, with the limit they were sent under, for a test to apply late.
#[derive(Clone)]
struct LateStore<S> {
    inner: S,
    holding_back: Arc<std::sync::atomic::AtomicBool>,
    held_back: Arc<std::sync::Mutex<Vec<HeldBack>>>,
}

/// A call held back: the key, the limit it was sent under, and the holding it asks for.
type HeldBack = (BucketKey<String>, u64, SlotHold);

impl<S> LateStore<S> {
    fn new(inner: S) -> Self {
        Self {
            inner,
            holding_back: Default::default(),
            held_back: Default::default(),
        }
    }
}

impl<S: SlotStore<BucketKey<String>>> SlotStore<BucketKey<String>> for LateStore<S> {
    type Error = S::Error;

    async fn hold(
        &self,
        key: &BucketKey<String>,
        max: u64,
        hold: SlotHold,
    ) -> Result<Holding, S::Error> {
        if self.holding_back.load(Ordering::SeqCst) {
            let call = (key.clone(), max, hold);
            self.held_back.lock().expect("not poisoned").push(call);
            return std::future::pending().await;
        }
        self.inner.hold(key, max, hold).await
    }
}

/// A host's layer on `store` whose limit per key is `limit` as it is when a call is made.
fn host_limited_by<S>(
    store: S,
    limit: &Arc<AtomicU64>,
) -> ConcurrencyBuilder<Request<Body>, String, S, TokioClock> {
    let limit = limit.clone();
    HierarchicalConcurrencyLayer::builder()
        .key(api_key)
        .max_in_flight_per_key(move |_: &String| limit.load(Ordering::SeqCst))
        .store(store)
        .clock(TokioClock::new())
}

/// A host's call sent under a limit of 2 is lost on its way; the limit is raised to 3 and
/// another host takes the new room; then the store applies the lost call, under the limit it
/// was sent with. It must not take the slot its host's request runs on (had it, a third host's
/// call would find a slot free: 4 in flight of 3).
async fn a_call_applied_late_under_an_older_limit_takes_nothing_its_host_runs<S>(store: S)
where
    S: SlotStore<BucketKey<String>> + Clone,
{
    let limit = Arc::new(AtomicU64::new(2));
    let host = |store| -> Layer<_> {
        host_limited_by(store, &limit)
            .failure_policy(FailurePolicy::Reject)
            .store_timeout(Duration::from_millis(100))
            .build()
            .unwrap()
    };
    let late = LateStore::new(store.clone());
    let (a, b) = (host(late.clone()), host(LateStore::new(store.clone())));
    let take = |layer: &Layer<_>| layer.acquire("k".to_owned());
    let running_on_a = take(&a).await.unwrap();
    late.holding_back.store(true, Ordering::SeqCst);
    let lost = take(&a).await.unwrap_err();
    assert_eq!(lost.reason, RejectionReason::StoreUnavailable);
    limit.store(3, Ordering::SeqCst);
    let on_b = [take(&b).await.unwrap(), take(&b).await.unwrap()];
    let full = RejectionReason::TooManyInFlight { max: 3 };
    assert_eq!(take(&b).await.unwrap_err().reason, full);
    let (key, max, hold) = late.held_back.lock().unwrap()[0].clone();
    assert_eq!(
        (max, hold.want),
        (2, 2),
        "the call sent under the old limit"
    );
    let applied = store.hold(&key, max, hold).await.unwrap();
    assert_eq!(
        applied,
        Holding { held: 1, others: 2 },
        "its host keeps the slot its request runs on"
    );
    assert_eq!(
        take(&b).await.unwrap_err().reason,
        full,
        "3 run: still full"
    );
    drop((running_on_a, on_b));
}

mod limit_raised_under_a_late_call {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn on_memory() {
        let store = MemoryGlobalStore::with_clock(TokioClock::new());
        a_call_applied_late_under_an_older_limit_takes_nothing_its_host_runs(store).await;
    }

    #[tokio::test]
    async fn on_redis() {
        let server = RedisServer::start();
        let store = server.store().await;
        a_call_applied_late_under_an_older_limit_takes_nothing_its_host_runs(store).await;
    }
}

/// Two hosts each run a request of a key when its limit is lowered from 2 to 1, and each hears
/// so from the store (a second request on each is refused as full). Both requests end, so each
/// host holds a slot the other's leaves it no room to use. A host that asks again for its new
/// request gives that slot back instead of keeping it: the first to ask is refused (the other
/// still holds its slot), the second gets the only one. Had each kept its slot, both would be
/// refused, and go on being refused while requests keep coming.
async fn hosts_over_a_lowered_limit_give_back_what_admits_nothing<S>(store: S)
where
    S: SlotStore<BucketKey<String>> + Clone,
{
    let limit = Arc::new(AtomicU64::new(2));
    let host = |store| -> Layer<_> { host_limited_by(store, &limit).build().unwrap() };
    let (a, b) = (host(store.clone()), host(store.clone()));
    let take = |layer: &Layer<_>| layer.acquire("k".to_owned());
    let running = [take(&a).await.unwrap(), take(&b).await.unwrap()];
    limit.store(1, Ordering::SeqCst);
    let full = RejectionReason::TooManyInFlight { max: 1 };
    assert_eq!(take(&a).await.unwrap_err().reason, full);
    assert_eq!(take(&b).await.unwrap_err().reason, full);
    drop(running);
    assert_eq!(
        take(&a).await.unwrap_err().reason,
        full,
        "the other host still holds its slot"
    );
    let admitted = take(&b).await.expect("the slot the first host gave back");
    assert_eq!((a.in_flight(), b.in_flight()), (0, 1));
    drop(admitted);
}

mod limit_lowered_under_two_hosts {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn on_memory() {
        let store = MemoryGlobalStore::with_clock(TokioClock::new());
        hosts_over_a_lowered_limit_give_back_what_admits_nothing(store).await;
    }

    #[tokio::test]
    async fn on_redis() {
        let server = RedisServer::start();
        let store = server.store().await;
        hosts_over_a_lowered_limit_give_back_what_admits_nothing(store).await;
    }
}

/// The store's arithmetic, the same on memory and Redis (the suite that ships with the crate):
/// absolute holdings, expiry, and calls older than the last applied ignored, alone and in
/// batches.
mod stores {
    use super::*;
    use hierarchical_throttle::global::conformance::assert_slot_conformance;

    #[tokio::test]
    async fn memory() {
        let clock = ManualClock::new();
        let store = MemoryGlobalStore::with_clock(clock.clone());
        assert_slot_conformance(&store, &clock).await;
    }

    #[tokio::test]
    async fn redis() {
        let server = RedisServer::start();
        let clock = ManualClock::new();
        let store = server.store_on(&clock).await;
        assert_slot_conformance(&store, &clock).await;
        let mut raw = redis::Client::open(server.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("*")
            .query_async(&mut raw)
            .await
            .unwrap();
        assert_eq!(keys, ["throttle:{slots-conformance}:concurrency:slots"]);
        let _ = clock.now();
    }
}

/// The `RateLimit` fields of admitted responses: the limit, and the slots the host sees free
/// as the response leaves (the request's own still taken).
mod admitted_fields {
    use super::*;

    /// `layer` around a handler that answers at once.
    fn app<S: SlotStore<BucketKey<String>> + Clone>(layer: Layer<S>) -> Router {
        Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(layer)
    }

    #[tokio::test(start_paused = true)]
    async fn an_admitted_response_says_the_limit_and_the_slots_left() {
        let layer = layer(MemoryGlobalStore::with_clock(TokioClock::new()), 3);
        let held = layer.acquire("k".to_owned()).await.unwrap();
        let response = app(layer.clone()).oneshot(request("k")).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(
            fields(&response, "ratelimit-policy"),
            [r#""concurrency";q=3;qu="concurrent-requests""#]
        );
        assert_eq!(
            fields(&response, "ratelimit"),
            [r#""concurrency";r=1"#],
            "3, less the one held and this request's"
        );
        drop((held, response));
        let alone = app(layer).oneshot(request("k")).await.unwrap();
        assert_eq!(fields(&alone, "ratelimit"), [r#""concurrency";r=2"#]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_named_layer_names_its_item_and_the_fields_can_be_turned_off() {
        let store = MemoryGlobalStore::with_clock(TokioClock::new());
        let named = host(store.clone(), 2).layer_name("api").build().unwrap();
        let response = app(named).oneshot(request("k")).await.unwrap();
        assert_eq!(fields(&response, "ratelimit"), [r#""api/concurrency";r=1"#]);
        let off = host(store, 2).ratelimit_fields(false).build().unwrap();
        let response = app(off).oneshot(request("k")).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert!(response.headers().get("ratelimit").is_none());
        assert!(response.headers().get("ratelimit-policy").is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn each_tier_shows_its_own_limit() {
        let tiers = HierarchicalConcurrencyLayer::builder()
            .key(api_key)
            .max_in_flight_per_key(|key: &String| if key == "gold" { 8 } else { 2 })
            .store(MemoryGlobalStore::with_clock(TokioClock::new()))
            .clock(TokioClock::new())
            .build()
            .unwrap();
        for (key, policy, state) in [
            (
                "gold",
                r#""concurrency";q=8;qu="concurrent-requests""#,
                r#""concurrency";r=7"#,
            ),
            (
                "free",
                r#""concurrency";q=2;qu="concurrent-requests""#,
                r#""concurrency";r=1"#,
            ),
        ] {
            let response = app(tiers.clone()).oneshot(request(key)).await.unwrap();
            assert_eq!(fields(&response, "ratelimit-policy"), [policy]);
            assert_eq!(fields(&response, "ratelimit"), [state]);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn under_a_rate_limit_each_layer_adds_its_own_items() {
        let rate = hierarchical_throttle::HierarchicalThrottleLayer::builder()
            .key_ref(|req: &Request<Body>| key::header_bytes(req, "x-api-key"))
            .limit(
                hierarchical_throttle::Limit::per_second(10)
                    .burst(10)
                    .unwrap(),
            )
            .global_store(MemoryGlobalStore::new())
            .build()
            .unwrap();
        let in_flight = layer(MemoryGlobalStore::with_clock(TokioClock::new()), 2);
        let app = Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(in_flight)
            .layer(rate);
        let response = app.oneshot(request("k")).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        let policies = fields(&response, "ratelimit-policy");
        assert_eq!(policies.len(), 2, "{policies:?}");
        assert!(policies.contains(&r#""concurrency";q=2;qu="concurrent-requests""#.to_owned()));
        assert!(
            policies.iter().any(|p| p.starts_with(r#""default";q=10"#)),
            "{policies:?}"
        );
        assert!(fields(&response, "ratelimit").contains(&r#""concurrency";r=1"#.to_owned()));
    }

    /// Two hosts on one store: the second sees what the first holds.
    async fn a_host_sees_what_the_others_hold<S: SlotStore<BucketKey<String>> + Clone>(store: S) {
        let build = || {
            host(store.clone(), 4)
                .store_timeout(Duration::from_secs(1))
                .build()
                .unwrap()
        };
        let (first, second) = (build(), build());
        let held = [
            first.acquire("k".to_owned()).await.unwrap(),
            first.acquire("k".to_owned()).await.unwrap(),
        ];
        let response = app(second.clone()).oneshot(request("k")).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(
            fields(&response, "ratelimit"),
            [r#""concurrency";r=1"#],
            "4, less the first host's 2 and this request"
        );
        // Its body ended, its slot is free again; the same view for slots held by hand.
        drop(response);
        let key = "k".to_owned();
        let mine = second.acquire(key.clone()).await.unwrap();
        assert_eq!(second.free_slots(&key, &mine), 1);
        let another = second.acquire(key.clone()).await.unwrap();
        assert_eq!(second.free_slots(&key, &mine), 0);
        drop(another);
        assert_eq!(second.free_slots(&key, &mine), 1);
        drop((held, mine));
    }

    #[tokio::test(start_paused = true)]
    async fn fleet_on_memory() {
        a_host_sees_what_the_others_hold(MemoryGlobalStore::with_clock(TokioClock::new())).await;
    }

    #[tokio::test]
    async fn fleet_on_redis() {
        let server = RedisServer::start();
        let store = server.store().await;
        a_host_sees_what_the_others_hold(store).await;
    }
}

/// `ColdStart::Credit`: a key not known to be full admits at once beyond its holding, up to
/// its credit, while a call asks the store to hold what runs; once an answer says the fleet is
/// full, no more credit.
mod credit {
    use super::*;
    use hierarchical_throttle::ColdStart;

    /// Half of a limit of 4: two requests of credit per host.
    const HALF: ColdStart = ColdStart::Credit { share: 0.5 };
    /// A store's answer time, within the default time-out of 50 ms.
    const ROUND_TRIP: Duration = Duration::from_millis(30);

    #[tokio::test(start_paused = true)]
    async fn a_cold_keys_first_requests_run_before_the_store_answers() {
        let store = SlowStore::new(MemoryGlobalStore::with_clock(TokioClock::new()), ROUND_TRIP);
        let layer = host(store, 4).cold_start(HALF).build().unwrap();
        let mut host = Host::new(layer.clone());
        let start = tokio::time::Instant::now();
        let (a, b) = (host.send("k"), host.send("k"));
        host.running(2).await;
        assert_eq!(start.elapsed(), Duration::ZERO, "both on credit, at once");
        // The credit is spent: the third waits. The call out when it came asks for one slot;
        // its answer sends the next, for all three.
        let c = host.send("k");
        host.running(1).await;
        assert_eq!(start.elapsed(), ROUND_TRIP * 2);
        let stats = layer.stats();
        assert_eq!((stats.admitted, stats.admitted_on_credit), (3, 2));
        host.gate.add_permits(3);
        for done in [a, b, c] {
            assert_eq!(done.await.unwrap(), StatusCode::OK);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn by_default_a_cold_key_waits_for_the_store() {
        let store = SlowStore::new(MemoryGlobalStore::with_clock(TokioClock::new()), ROUND_TRIP);
        let mut host = Host::new(layer(store, 4));
        let start = tokio::time::Instant::now();
        let a = host.send("k");
        host.running(1).await;
        assert_eq!(start.elapsed(), ROUND_TRIP);
        host.gate.add_permits(1);
        assert_eq!(a.await.unwrap(), StatusCode::OK);
    }

    /// A key whose limit is 0 is refused outright: credit is a share of nothing.
    #[tokio::test(start_paused = true)]
    async fn a_key_limited_to_nothing_gets_no_credit() {
        let layer: Layer<_> = HierarchicalConcurrencyLayer::builder()
            .key(api_key)
            .max_in_flight_per_key(|key: &String| if key == "banned" { 0 } else { 4 })
            .cold_start(hierarchical_throttle::ColdStart::Credit { share: 1.0 })
            .store(MemoryGlobalStore::with_clock(TokioClock::new()))
            .clock(TokioClock::new())
            .build()
            .unwrap();
        let refused = layer.acquire("banned".to_owned()).await.unwrap_err();
        assert_eq!(refused.reason, RejectionReason::TooManyInFlight { max: 0 });
        let admitted = layer.acquire("member".to_owned()).await;
        assert!(admitted.is_ok());
        assert_eq!(
            layer.stats().admitted_on_credit,
            1,
            "the member's, not the banned key's"
        );
    }

    #[test]
    fn a_share_outside_zero_to_one_is_refused_at_build() {
        let built = host(MemoryGlobalStore::new(), 4)
            .cold_start(ColdStart::Credit { share: 1.5 })
            .build();
        assert!(matches!(
            built,
            Err(ConfigError::InvalidSetting {
                setting: "cold_start",
                ..
            })
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn on_memory() {
        credit_stops_where_the_fleet_is_full(MemoryGlobalStore::with_clock(TokioClock::new()))
            .await;
    }

    #[tokio::test]
    async fn on_redis() {
        let server = RedisServer::start();
        let store = server.store().await;
        credit_stops_where_the_fleet_is_full(store).await;
    }

    /// Two hosts, a limit of 2 and one request of credit each: the first host fills the
    /// limit; the second, which knows nothing of the key, admits one on credit (the bound,
    /// `max + hosts x credit`, reached by a key full elsewhere), learns from the answer that
    /// the fleet is full, and refuses the next.
    async fn credit_stops_where_the_fleet_is_full<S>(store: S)
    where
        S: SlotStore<BucketKey<String>> + Clone,
    {
        let on = |store: SlowStore<S>| {
            // A time-out no loaded machine reaches on real time: this test is about answers.
            let built = host(store, 2)
                .cold_start(ColdStart::Credit { share: 0.5 })
                .store_timeout(Duration::from_secs(1))
                .build();
            built.unwrap()
        };
        let (first, second) = (
            SlowStore::new(store.clone(), Duration::ZERO),
            SlowStore::new(store, Duration::ZERO),
        );
        let (first_holds, second_holds) = (first.held.subscribe(), second.held.subscribe());
        let (a, b) = (on(first), on(second));
        let key = || "tenant".to_owned();
        // The store's answer, seen by the store's wrapper (the host notes it just after).
        let settled = |mut holds: tokio::sync::watch::Receiver<Option<u64>>, n: u64| async move {
            let answered = holds.wait_for(|held| *held == Some(n));
            tokio::time::timeout(Duration::from_secs(5), answered)
                .await
                .expect("the store answers")
                .map(|_| ())
                .expect("the store lives");
        };
        let a1 = a.acquire(key()).await.expect("on credit");
        settled(first_holds.clone(), 1).await;
        // On credit too, or after waiting for the store, depending on whether the host had
        // noted the answer: either way the store then holds both.
        let a2 = a.acquire(key()).await.expect("a second slot");
        settled(first_holds, 2).await;
        let b1 = b
            .acquire(key())
            .await
            .expect("on credit: the key is not known full here");
        // The store held nothing for the second host: the fleet was full.
        settled(second_holds, 0).await;
        let refused = b.acquire(key()).await.unwrap_err();
        assert_eq!(refused.reason, RejectionReason::TooManyInFlight { max: 2 });
        assert!((1..=2).contains(&a.stats().admitted_on_credit));
        assert_eq!(b.stats().admitted_on_credit, 1);
        assert_eq!(b.free_slots(&key(), &b1), 0);
        drop((a1, a2, b1));
    }
}

/// Credit never runs past what the last answer left a host: the others hold 8 of 10, so a
/// host with a credit of the whole limit runs 2, and the third request waits and is refused.
#[tokio::test(start_paused = true)]
async fn credit_stops_at_the_slots_the_last_answer_left() {
    let memory = MemoryGlobalStore::with_clock(TokioClock::new());
    let others = layer(memory.clone(), 10);
    let key = || "tenant".to_owned();
    let mut held = Vec::new();
    for _ in 0..8 {
        held.push(others.acquire(key()).await.expect("within the limit"));
    }
    let credited = host(memory, 10)
        .cold_start(hierarchical_throttle::ColdStart::Credit { share: 1.0 })
        .build()
        .unwrap();
    let first = credited.acquire(key()).await.expect("on credit");
    // Until this host has noted the store's answer (8 held elsewhere), it sees 9 free.
    let noted = async {
        while credited.free_slots(&key(), &first) != 1 {
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), noted)
        .await
        .expect("the answer is noted");
    let second = credited.acquire(key()).await.expect("on credit: one left");
    let refused = credited.acquire(key()).await.unwrap_err();
    assert_eq!(refused.reason, RejectionReason::TooManyInFlight { max: 10 });
    assert_eq!(credited.stats().admitted_on_credit, 2);
    drop((first, second, held));
}

/// A host about to stop gives back the slots it keeps free (here for a long linger), and keeps
/// those of its requests still running: another host can then use them at once, not after the
/// holding expires.
/// Shadow mode: a request that gets no slot is counted as refused and served without one,
/// its response telling what its refusal would have (`r=0`); it takes no slot from the others.
mod shadow {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_full_key_is_served_without_a_slot_and_counted() {
        let layer = host(MemoryGlobalStore::with_clock(TokioClock::new()), 1)
            .shadow(true)
            .build()
            .unwrap();
        let held = layer.acquire("k".to_owned()).await.unwrap();
        assert!(held.holds_slot());
        let app = Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(layer.clone());
        let response = app.clone().oneshot(request("k")).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK, "served, not refused");
        assert_eq!(
            fields(&response, "ratelimit-policy"),
            [r#""concurrency";q=1;qu="concurrent-requests""#]
        );
        assert_eq!(fields(&response, "ratelimit"), [r#""concurrency";r=0"#]);
        assert_eq!(
            layer.in_flight(),
            1,
            "the one held; the shadow request holds none"
        );
        // Outside a tower service: a permit that holds no slot.
        let unheld = layer.acquire("k".to_owned()).await.unwrap();
        assert!(!unheld.holds_slot());
        assert_eq!(layer.free_slots(&"k".to_owned(), &unheld), 0);
        drop((response, unheld));
        assert_eq!(layer.in_flight(), 1, "dropping them gave back no slot");
        let stats = layer.stats();
        assert_eq!(
            (stats.admitted, stats.refused_full, stats.shadow_admitted),
            (1, 2, 2),
            "{stats:?}"
        );
        // The slot given back, the next request takes it as any other.
        drop(held);
        let slotted = layer.acquire("k".to_owned()).await.unwrap();
        assert!(slotted.holds_slot());
        assert_eq!(layer.stats().shadow_admitted, 2);
    }

    /// A request without a key, which the default `MissingKey::Reject` refuses, is served.
    #[tokio::test(start_paused = true)]
    async fn a_request_without_a_key_is_served_and_counted() {
        let layer = host(MemoryGlobalStore::with_clock(TokioClock::new()), 1)
            .shadow(true)
            .build()
            .unwrap();
        let app = Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(layer.clone());
        let keyless = Request::get("/").body(Body::empty()).unwrap();
        let response = app.oneshot(keyless).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(layer.stats().shadow_admitted, 1);
    }

    /// A dry run changes nothing a client sees: a layer that would make requests wait for a
    /// slot serves them at once instead.
    #[tokio::test(start_paused = true)]
    async fn no_request_waits_for_a_slot() {
        let layer = host(MemoryGlobalStore::with_clock(TokioClock::new()), 1)
            .wait_for_slot(Duration::from_secs(1))
            .shadow(true)
            .build()
            .unwrap();
        let held = layer.acquire("k".to_owned()).await.unwrap();
        let start = tokio::time::Instant::now();
        let unheld = layer.acquire("k".to_owned()).await.unwrap();
        assert_eq!(start.elapsed(), Duration::ZERO);
        assert!(!unheld.holds_slot());
        assert_eq!(layer.stats().shadow_admitted, 1);
        drop((held, unheld));
    }

    /// A request that waits for the store and hears the fleet is full (another host holds the
    /// slot) is served too, as is one the failure policy refuses while the store is down.
    #[tokio::test(start_paused = true)]
    async fn after_a_wait_for_the_store_and_while_it_fails() {
        let store = SlowStore::new(
            MemoryGlobalStore::with_clock(TokioClock::new()),
            Duration::from_millis(5),
        );
        let build = || {
            host(store.clone(), 1)
                .shadow(true)
                .failure_policy(FailurePolicy::Reject)
                .build()
                .unwrap()
        };
        let (first, second) = (build(), build());
        let held = first.acquire("k".to_owned()).await.unwrap();
        let app = Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(second.clone());
        let full = app.clone().oneshot(request("k")).await.unwrap();
        assert_eq!(full.status(), StatusCode::OK);
        assert_eq!(fields(&full, "ratelimit"), [r#""concurrency";r=0"#]);
        assert_eq!(second.stats().refused_full, 1);
        store.down.store(true, Ordering::SeqCst);
        let down = app.oneshot(request("other")).await.unwrap();
        assert_eq!(down.status(), StatusCode::OK);
        let unheld = second.acquire("third".to_owned()).await.unwrap();
        assert!(!unheld.holds_slot());
        let stats = second.stats();
        assert_eq!(
            (
                stats.refused_unavailable,
                stats.shadow_admitted,
                stats.admitted
            ),
            (2, 3, 0),
            "{stats:?}"
        );
        assert_eq!(second.in_flight(), 0);
        drop((held, full, down, unheld));
    }
}

mod stopping {
    use super::*;

    async fn a_stopping_host_gives_back_its_free_slots<S>(store: S)
    where
        S: SlotStore<BucketKey<String>> + Clone,
    {
        let key = || "tenant".to_owned();
        let stopping = host(store.clone(), 10)
            .slot_ttl(Duration::from_secs(3_600))
            .linger(Duration::from_secs(900))
            .build()
            .unwrap();
        let other = layer(store, 10);
        let mut permits = Vec::new();
        for _ in 0..6 {
            permits.push(stopping.acquire(key()).await.expect("within the limit"));
        }
        let running = permits.pop();
        drop(permits);
        // The stopping host still holds six: the other gets four.
        let mut elsewhere = Vec::new();
        for _ in 0..4 {
            elsewhere.push(other.acquire(key()).await.expect("four left"));
        }
        let full = other.acquire(key()).await.unwrap_err();
        assert_eq!(full.reason, RejectionReason::TooManyInFlight { max: 10 });

        stopping.return_all_slots().await;
        assert_eq!(
            stopping.in_flight(),
            1,
            "its running request keeps its slot"
        );
        for _ in 0..5 {
            elsewhere.push(other.acquire(key()).await.expect("given back"));
        }
        let full = other.acquire(key()).await.unwrap_err();
        assert_eq!(full.reason, RejectionReason::TooManyInFlight { max: 10 });
        drop((running, elsewhere));
    }

    #[tokio::test(start_paused = true)]
    async fn on_memory() {
        a_stopping_host_gives_back_its_free_slots(MemoryGlobalStore::with_clock(TokioClock::new()))
            .await;
    }

    #[tokio::test]
    async fn on_redis() {
        let server = RedisServer::start();
        let store = server.store().await;
        a_stopping_host_gives_back_its_free_slots(store).await;
    }
}

/// Slot calls of all keys made together go to the store as one batch (on Redis, one script
/// per node), each answered on its own.
mod batching {
    use super::*;

    /// A hundred keys' first requests at once: a hundred calls, in one round trip (at most
    /// 128 calls go in one).
    async fn many_cold_keys_share_a_round_trip<S: SlotStore<BucketKey<String>>>(store: S) {
        let layer = host(store, 2)
            .store_timeout(Duration::from_secs(1))
            .build()
            .unwrap();
        let stats = hundred_cold_keys(&layer).await;
        assert_eq!(stats.store_calls, 100);
        assert_eq!(stats.store_round_trips, 1, "{stats:?}");
        assert_eq!(stats.store_failures, 0);
    }

    /// A hundred keys' first requests at once, every one admitted; the stats once all are.
    async fn hundred_cold_keys<S: SlotStore<BucketKey<String>>>(
        layer: &Layer<S>,
    ) -> ConcurrencyStats {
        let tries = (0..100).map(|k| layer.acquire(format!("tenant-{k}")));
        let permits = futures_util::future::join_all(tries).await;
        assert!(permits.iter().all(Result::is_ok), "every key has room");
        layer.stats()
    }

    #[tokio::test(start_paused = true)]
    async fn on_memory() {
        many_cold_keys_share_a_round_trip(MemoryGlobalStore::with_clock(TokioClock::new())).await;
    }

    /// `store_batch` bounds a round trip: a hundred cold keys at 32 calls a round trip take
    /// four (32, 32, 32 and 4), at one call each a hundred; every key is answered either way.
    #[tokio::test(start_paused = true)]
    async fn a_round_trip_carries_at_most_the_store_batch() {
        for (store_batch, round_trips) in [(32, 4), (1, 100), (100, 1)] {
            let layer = host(MemoryGlobalStore::with_clock(TokioClock::new()), 2)
                .store_batch(store_batch)
                .build()
                .unwrap();
            let stats = hundred_cold_keys(&layer).await;
            assert_eq!(
                (stats.store_calls, stats.store_round_trips),
                (100, round_trips),
                "store_batch {store_batch}: {stats:?}"
            );
        }
    }

    #[tokio::test]
    async fn on_redis() {
        let server = RedisServer::start();
        let store = server.store().await;
        many_cold_keys_share_a_round_trip(store).await;
    }

    /// On a Cluster, one round trip holds a script per hash tag, each answered from its own
    /// node: every key gets its own holding, and a key full on one node is refused there.
    #[tokio::test]
    async fn on_a_redis_cluster_each_key_is_answered_from_its_own_node() {
        let cluster = RedisCluster::start();
        let store: RedisGlobalStore<String> = RedisGlobalStore::connect_cluster(cluster.urls())
            .await
            .unwrap();
        let layer = host(store, 1)
            .store_timeout(Duration::from_secs(1))
            .build()
            .unwrap();
        let tries = (0..60).map(|k| layer.acquire(format!("tenant-{}", k % 30)));
        let outcomes = futures_util::future::join_all(tries).await;
        let admitted = outcomes.iter().filter(|o| o.is_ok()).count();
        assert_eq!(admitted, 30, "one of each key's two requests");
        for refused in outcomes.iter().filter_map(|o| o.as_ref().err()) {
            assert_eq!(refused.reason, RejectionReason::TooManyInFlight { max: 1 });
        }
        assert_eq!(layer.stats().store_failures, 0);
    }

    /// A runtime that ends while a batch is queued and its flush not yet run leaves nothing
    /// stuck: on the next runtime, calls go to the store again.
    #[test]
    fn a_batch_whose_runtime_ends_before_it_is_sent_does_not_stall_the_next() {
        let clock = ManualClock::new();
        let memory = MemoryGlobalStore::with_clock(clock.clone());
        let layer: Layer<_, ManualClock> = HierarchicalConcurrencyLayer::builder()
            .key(api_key)
            .max_in_flight(2)
            .store(memory)
            .clock(clock)
            .build()
            .unwrap();
        let paused = common::paused_runtime;
        paused().block_on(async {
            // The request's call task queues its call and schedules the flush; the runtime
            // ends with both pending.
            let waiting = layer.acquire("k".to_owned());
            tokio::select! {
                biased;
                _ = waiting => panic!("no answer can come before the flush runs"),
                () = tokio::task::yield_now() => {}
            }
        });
        paused().block_on(async {
            let permit = layer.acquire("j".to_owned()).await;
            assert!(permit.is_ok());
            let stats = layer.stats();
            assert_eq!(stats.store_failures, 0, "{stats:?}");
            assert!(stats.store_round_trips >= 1, "{stats:?}");
        });
    }
}

//! The layer's types can be named: aliases for the common shapes in struct fields and return
//! types, settle hooks as `fn` pointers or boxed closures, and a handle that names only the
//! key for application state.

use axum::body::Body;
use axum::extract::State;
use axum::routing::{get, post};
use axum::{Router, http::Response};
use hierarchical_throttle::{
    BoxSettle, HierarchicalThrottleLayer, Limit, MemoryGlobalStore, MemorySettlingLayer,
    MemoryThrottleLayer, SettleFn, ThrottleHandle, key,
};
use http::{Request, StatusCode};
use tower::ServiceExt;

type Layer = MemoryThrottleLayer<Request<Body>, String>;

/// Returned from a function, stored in a field.
fn per_user(per_second: u64) -> Layer {
    HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key(|req: &Request<Body>| key::header_value(req, "x-user"))
        .limit(Limit::per_second(per_second).build().unwrap())
        .global_store(MemoryGlobalStore::new())
        .build()
        .unwrap()
}

struct Throttles {
    api: Layer,
}

async fn get_as(app: &Router, user: &str) -> StatusCode {
    let request = Request::get("/").header("x-user", user);
    let response = app
        .clone()
        .oneshot(request.body(Body::empty()).unwrap())
        .await
        .unwrap();
    response.status()
}

#[tokio::test]
async fn an_aliased_layer_is_stored_returned_and_layered() {
    let throttles = Throttles { api: per_user(2) };
    let app = Router::new()
        .route("/", get(|| async { "hi" }))
        .layer(throttles.api.clone());
    assert_eq!(get_as(&app, "u1").await, StatusCode::OK);
    assert_eq!(get_as(&app, "u1").await, StatusCode::OK);
    assert_eq!(get_as(&app, "u1").await, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        throttles.api.stats().requests_refused,
        1,
        "clones share counters"
    );
}

fn used(response: &Response<Body>, charged: u64) -> u64 {
    response
        .headers()
        .get("x-used")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .unwrap_or(charged)
}

/// A settling layer of each hook kind, named, charged 10 per request and settled to 4.
#[tokio::test]
async fn settling_layers_are_nameable_with_fn_pointers_and_boxed_closures() {
    fn build<F: Fn(&Response<Body>, u64) -> u64 + Send + Sync + 'static>(
        settle: F,
    ) -> MemorySettlingLayer<Request<Body>, String, F> {
        HierarchicalThrottleLayer::builder()
            .key(|req: &Request<Body>| key::header_value(req, "x-user"))
            .limit(Limit::per_minute(100).build().unwrap())
            .cost(|_: &Request<Body>| 10)
            .settle(settle)
            .global_store(MemoryGlobalStore::new())
            .build()
            .unwrap()
    }
    let by_fn: MemorySettlingLayer<_, _, SettleFn<Response<Body>>> =
        build(used as SettleFn<Response<Body>>);
    let floor = 1;
    let by_box: MemorySettlingLayer<_, _, BoxSettle<Response<Body>>> =
        build(Box::new(move |response: &Response<Body>, charged| {
            used(response, charged).max(floor)
        }));
    for (name, app) in [
        (
            "fn",
            Router::new()
                .route("/", get(|| async { ([("x-used", "4")], "hi") }))
                .layer(by_fn.clone()),
        ),
        (
            "box",
            Router::new()
                .route("/", get(|| async { ([("x-used", "4")], "hi") }))
                .layer(by_box.clone()),
        ),
    ] {
        assert_eq!(get_as(&app, "u1").await, StatusCode::OK, "{name}");
    }
    assert_eq!(by_fn.stats().tokens_refunded, 6);
    assert_eq!(by_box.stats().tokens_refunded, 6);
}

#[derive(Clone)]
struct App {
    messages: ThrottleHandle<String>,
}

async fn send(State(app): State<App>, body: String) -> StatusCode {
    match app.messages.acquire(body, 1).await {
        Ok(_) => StatusCode::OK,
        Err(_) => StatusCode::TOO_MANY_REQUESTS,
    }
}

/// A handle in axum state decides on the layer's own buckets and counters.
#[tokio::test]
async fn a_handle_in_app_state_shares_the_layers_buckets() {
    let layer = per_user(3);
    let app = Router::new().route("/send", post(send)).with_state(App {
        messages: layer.handle(),
    });
    let post_as = |user: &'static str| {
        app.clone()
            .oneshot(Request::post("/send").body(Body::from(user)).unwrap())
    };
    for _ in 0..3 {
        assert_eq!(post_as("u1").await.unwrap().status(), StatusCode::OK);
    }
    assert_eq!(
        post_as("u1").await.unwrap().status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // The same buckets: the layer refuses u1's next request too.
    let throttled = Router::new()
        .route("/", get(|| async { "hi" }))
        .layer(layer.clone());
    assert_eq!(
        get_as(&throttled, "u1").await,
        StatusCode::TOO_MANY_REQUESTS
    );
    let handle = layer.handle();
    assert_eq!(handle.stats().requests_refused, 2);
    assert_eq!(handle.remaining(&"u1".to_owned())[0].tokens, 0);
    assert!(
        handle
            .keys("u1".to_owned(), vec![("tenant", "t".to_owned())])
            .is_err()
    );
}

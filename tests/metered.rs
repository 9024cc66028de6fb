//! Bodies charged by the byte as they stream: a download quota through an axum `Router`,
//! policed (the stream ends at the limit) and shaped (the stream is paced at the rate), on
//! paused time; frames split into pieces; an upload read in a handler; a fleet of hosts on
//! one store.

use std::num::NonZeroUsize;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::routing::{get, post};
use bytes::Bytes;
use hierarchical_throttle::clock::TokioClock;
use hierarchical_throttle::{
    ColdStart, HierarchicalThrottleLayer, Limit, MemoryGlobalStore, MemoryLocalStore, Rejection,
    Shaping, ThrottleHandle,
};
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;

type Layer = HierarchicalThrottleLayer<
    String,
    String,
    MemoryGlobalStore<String, TokioClock>,
    MemoryLocalStore<String>,
    TokioClock,
>;

/// 1,000 bytes a second per user, a burst of 1,000, on tokio's (paused) clock.
fn bytes_per_user(global: &MemoryGlobalStore<String, TokioClock>, shaping: Shaping) -> Layer {
    HierarchicalThrottleLayer::builder()
        .cold_start(ColdStart::Exact)
        .key(|user: &String| Some(user.clone()))
        .clock(TokioClock::new())
        .limit(Limit::per_second(1_000).burst(1_000).unwrap())
        .shaping(shaping)
        .global_store(global.clone())
        .build()
        .unwrap()
}

/// A body of `chunks` frames of `size` bytes.
fn chunks(chunks: usize, size: usize) -> Body {
    let frames = (0..chunks).map(move |_| Ok::<_, std::io::Error>(Bytes::from(vec![7u8; size])));
    Body::from_stream(futures_util::stream::iter(frames))
}

fn download_app(downloads: ThrottleHandle<String>, frames: usize, size: usize) -> Router {
    Router::new()
        .route(
            "/file",
            get(
                move |State(downloads): State<ThrottleHandle<String>>| async move {
                    Body::new(downloads.meter("alice".to_owned(), chunks(frames, size)))
                },
            ),
        )
        .with_state(downloads)
}

/// Reads `body` frame by frame: the bytes delivered, and the error that ended it.
async fn read(body: Body) -> (usize, Option<axum::Error>) {
    let mut body = body;
    let mut delivered = 0;
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(frame) => delivered += frame.data_ref().map_or(0, Bytes::len),
            Err(error) => return (delivered, Some(error)),
        }
    }
    (delivered, None)
}

#[tokio::test(start_paused = true)]
async fn a_policed_download_ends_where_the_quota_does() {
    let global = MemoryGlobalStore::with_clock(TokioClock::new());
    let layer = bytes_per_user(&global, Shaping::Refuse);
    let app = download_app(layer.handle(), 5, 300);
    let response = app
        .oneshot(Request::get("/file").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let (delivered, error) = read(response.into_body()).await;
    assert_eq!(
        delivered, 900,
        "three frames of 300 within the burst of 1,000"
    );
    let error = error.expect("the fourth frame is refused");
    let source = std::error::Error::source(&error).expect("the refusal");
    let rejection = source
        .downcast_ref::<Rejection<String>>()
        .expect("a Rejection");
    assert_eq!(rejection.key.as_deref(), Some("alice"));
    assert_eq!(layer.stats().requests_refused, 1);
}

#[tokio::test(start_paused = true)]
async fn a_shaped_download_is_paced_at_the_rate() {
    let global = MemoryGlobalStore::with_clock(TokioClock::new());
    let layer = bytes_per_user(&global, Shaping::wait(Duration::from_secs(10)));
    let app = download_app(layer.handle(), 5, 300);
    let started = tokio::time::Instant::now();
    let response = app
        .oneshot(Request::get("/file").body(Body::empty()).unwrap())
        .await
        .unwrap();
    let (delivered, error) = read(response.into_body()).await;
    assert!(error.is_none(), "{error:?}");
    assert_eq!(delivered, 1_500);
    // 500 bytes beyond the burst, at 1,000 a second.
    let took = started.elapsed();
    assert!(
        (Duration::from_millis(500)..Duration::from_millis(600)).contains(&took),
        "{took:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn frames_longer_than_a_piece_are_split_and_charged_piece_by_piece() {
    let global = MemoryGlobalStore::with_clock(TokioClock::new());
    let layer = bytes_per_user(&global, Shaping::wait(Duration::from_secs(10)));
    let piece = NonZeroUsize::new(1_000).unwrap();
    let body = layer
        .meter("bob".to_owned(), chunks(1, 2_500))
        .max_chunk(piece);
    let started = tokio::time::Instant::now();
    let mut sizes = Vec::new();
    let mut body = std::pin::pin!(body);
    while let Some(frame) = body.frame().await {
        sizes.push(frame.unwrap().into_data().unwrap().len());
    }
    assert_eq!(sizes, [1_000, 1_000, 500]);
    assert_eq!(started.elapsed(), Duration::from_millis(1_500));
    // A piece larger than the bucket can never be paid: refused at once.
    let refused = layer
        .meter("carol".to_owned(), chunks(1, 5_000))
        .max_chunk(NonZeroUsize::new(2_000).unwrap());
    let error = refused.collect().await.unwrap_err();
    let rejection = error.downcast_ref::<Rejection<String>>().unwrap();
    assert!(matches!(
        rejection.reason,
        hierarchical_throttle::RejectionReason::CostExceedsCapacity { cost: 2_000, .. }
    ));
}

/// An upload quota: the handler reads the request body through the meter.
#[tokio::test(start_paused = true)]
async fn an_upload_read_through_the_meter_is_refused_past_the_quota() {
    let global = MemoryGlobalStore::with_clock(TokioClock::new());
    let uploads = bytes_per_user(&global, Shaping::Refuse).handle();
    let app = Router::new()
        .route(
            "/upload",
            post(
                |State(uploads): State<ThrottleHandle<String>>, request: Request<Body>| async move {
                    let body = uploads.meter("dave".to_owned(), request.into_body());
                    match body.collect().await {
                        Ok(read) => (StatusCode::OK, read.to_bytes().len().to_string()),
                        Err(_) => (StatusCode::TOO_MANY_REQUESTS, "upload quota".to_owned()),
                    }
                },
            ),
        )
        .with_state(uploads);
    let upload = |size| {
        app.clone()
            .oneshot(Request::post("/upload").body(chunks(4, size)).unwrap())
    };
    let small = upload(200).await.unwrap();
    assert_eq!(small.status(), StatusCode::OK);
    let large = upload(200).await.unwrap();
    assert_eq!(
        large.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "1,600 > 1,000"
    );
}

/// Four hosts stream at once on one store: the bytes delivered fleet-wide stay within the
/// burst and what refills.
#[tokio::test(start_paused = true)]
async fn a_fleet_delivers_no_more_than_the_quota() {
    let global = MemoryGlobalStore::with_clock(TokioClock::new());
    let hosts: Vec<Layer> = (0..4)
        .map(|_| bytes_per_user(&global, Shaping::Refuse))
        .collect();
    let started = tokio::time::Instant::now();
    let streams = hosts.iter().map(|host| {
        let body = Body::new(host.meter("erin".to_owned(), chunks(10, 100)));
        read(body)
    });
    let delivered: usize = futures_util::future::join_all(streams)
        .await
        .into_iter()
        .map(|(bytes, _)| bytes)
        .sum();
    let refilled = started.elapsed().as_millis() as usize;
    assert!(
        delivered <= 1_000 + refilled,
        "{delivered} bytes in {refilled} ms"
    );
    assert!(delivered >= 1_000, "{delivered}: the burst is served");
}

/// Trailers pass free, after the data they follow was paid for; the body ends when its inner
/// body does.
#[tokio::test(start_paused = true)]
async fn trailers_pass_free_and_the_body_ends_with_its_inner_one() {
    let global = MemoryGlobalStore::with_clock(TokioClock::new());
    let layer = bytes_per_user(&global, Shaping::Refuse);
    let mut trailers = http::HeaderMap::new();
    trailers.insert("x-checksum", http::HeaderValue::from_static("abc"));
    let frames = vec![
        Ok::<_, std::io::Error>(http_body::Frame::data(Bytes::from(vec![1u8; 600]))),
        Ok(http_body::Frame::trailers(trailers)),
    ];
    let inner = http_body_util::StreamBody::new(futures_util::stream::iter(frames));
    let body = layer.meter("frank".to_owned(), inner);
    let collected = body.collect().await.unwrap();
    assert_eq!(
        collected.trailers().and_then(|t| t.get("x-checksum")),
        Some(&http::HeaderValue::from_static("abc"))
    );
    assert_eq!(collected.to_bytes().len(), 600);
    // 600 of the 1,000 taken: the trailers cost nothing.
    assert_eq!(layer.remaining("frank")[0].tokens, 400);
}

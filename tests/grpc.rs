//! The layer in front of a real tonic server on a loopback port, called by a real tonic client.

#[path = "../examples/support/echo.rs"]
mod echo;

use std::net::SocketAddr;
use std::time::Duration;

use echo::{CountRequest, EchoClient, EchoRequest, EchoServer};
use hierarchical_throttle::clock::ManualClock;
use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore, key};
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;
use tonic::{Code, Request};
use tower::Layer;

type Body = tonic::body::Body;

/// Limits per `x-api-key` metadata: 3 per second, bursts of 3, on `clock`.
fn throttle(
    clock: &ManualClock,
) -> HierarchicalThrottleLayer<
    http::Request<Body>,
    String,
    MemoryGlobalStore<String, ManualClock>,
    hierarchical_throttle::MemoryLocalStore<String>,
    ManualClock,
> {
    // Each call waits for its batch (no credit), so that no batch is in flight when the test
    // moves its clock on, and the refusal's wait is exact to the microsecond.
    HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key(|req: &http::Request<Body>| key::header_value(req, "x-api-key"))
        .clock(clock.clone())
        .limit(Limit::per_second(3).burst(3).unwrap())
        .global_store(MemoryGlobalStore::with_clock(clock.clone()))
        .build()
        .unwrap()
}

/// Serves `demo.Echo` behind the layer on a free loopback port.
async fn serve(clock: &ManualClock, around_service: bool) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let incoming = TcpIncoming::from(listener);
    let layer = throttle(clock);
    tokio::spawn(async move {
        let served = if around_service {
            Server::builder()
                .add_service(layer.layer(EchoServer))
                .serve_with_incoming(incoming)
                .await
        } else {
            Server::builder()
                .layer(layer)
                .add_service(EchoServer)
                .serve_with_incoming(incoming)
                .await
        };
        served.expect("serve gRPC");
    });
    addr
}

fn say(api_key: &str) -> Request<EchoRequest> {
    let mut req = Request::new(EchoRequest {
        message: "hi".into(),
    });
    req.metadata_mut()
        .insert("x-api-key", api_key.parse().unwrap());
    req
}

/// The `google.rpc.Status` in `grpc-status-details-bin`, decoded independently with prost.
#[derive(Clone, PartialEq, prost::Message)]
struct RpcStatus {
    #[prost(int32, tag = "1")]
    code: i32,
    #[prost(string, tag = "2")]
    message: String,
    #[prost(message, repeated, tag = "3")]
    details: Vec<Any>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Any {
    #[prost(string, tag = "1")]
    type_url: String,
    #[prost(bytes = "vec", tag = "2")]
    value: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct QuotaFailure {
    #[prost(message, repeated, tag = "1")]
    violations: Vec<Violation>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Violation {
    #[prost(string, tag = "1")]
    subject: String,
    #[prost(string, tag = "2")]
    description: String,
}

#[derive(Clone, PartialEq, prost::Message)]
struct RetryInfo {
    #[prost(message, optional, tag = "1")]
    retry_delay: Option<ProtoDuration>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ProtoDuration {
    #[prost(int64, tag = "1")]
    seconds: i64,
    #[prost(int32, tag = "2")]
    nanos: i32,
}

#[tokio::test]
async fn calls_past_the_limit_get_resource_exhausted_with_retry_information() {
    for around_service in [false, true] {
        let clock = ManualClock::new();
        let addr = serve(&clock, around_service).await;
        let mut client = EchoClient::connect(format!("http://{addr}")).await.unwrap();
        for left in (0..3).rev() {
            let reply = client.say(say("k1")).await.expect("within the limit");
            // Admitted calls carry the RateLimit fields as initial metadata: within the
            // second, the tokens left and the two that refill before it ends.
            let state = format!("\"default\";r={};t=1", left + 2);
            assert_eq!(reply.metadata().get("ratelimit").unwrap(), state.as_str());
            assert_eq!(
                reply.metadata().get("ratelimit-policy").unwrap(),
                "\"default\";q=3;qu=\"requests\";w=1"
            );
            assert_eq!(reply.into_inner().message, "hi");
        }
        clock.advance(Duration::from_millis(100));
        let status = client.say(say("k1")).await.expect_err("over the limit");
        assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
        assert_eq!(status.message(), "rate limit exceeded");
        // The next token is due in 233 ms: retry-after rounds up to 1 s.
        assert_eq!(status.metadata().get("retry-after").unwrap(), "1");
        let details: RpcStatus = prost::Message::decode(status.details()).unwrap();
        assert_eq!(
            (details.code, details.message.as_str()),
            (8, "rate limit exceeded")
        );
        assert_eq!(
            details.details[0].type_url,
            "type.googleapis.com/google.rpc.RetryInfo"
        );
        let retry: RetryInfo = prost::Message::decode(&details.details[0].value[..]).unwrap();
        let delay = retry.retry_delay.unwrap();
        assert_eq!((delay.seconds, delay.nanos), (0, 233_334_000));
        // A QuotaFailure names the limit (never the key).
        assert_eq!(
            details.details[1].type_url,
            "type.googleapis.com/google.rpc.QuotaFailure"
        );
        let failure: QuotaFailure = prost::Message::decode(&details.details[1].value[..]).unwrap();
        assert_eq!(failure.violations.len(), 1);
        assert_eq!(failure.violations[0].subject, "default");
        assert_eq!(
            failure.violations[0].description,
            "limit default (3/s) exceeded"
        );
        assert_eq!(
            status.metadata().get("ratelimit").unwrap(),
            "\"default\";r=0;t=1"
        );

        // Another key has its own limit.
        assert!(client.say(say("k2")).await.is_ok());
        // After the wait, calls succeed again.
        clock.advance(Duration::from_millis(234));
        assert!(client.say(say("k1")).await.is_ok());
    }
}

#[tokio::test]
async fn a_streaming_call_is_admitted_or_refused_as_a_whole() {
    let clock = ManualClock::new();
    let addr = serve(&clock, false).await;
    let mut client = EchoClient::connect(format!("http://{addr}")).await.unwrap();
    let count = |n| {
        let mut req = Request::new(CountRequest { n });
        req.metadata_mut()
            .insert("x-api-key", "streamer".parse().unwrap());
        req
    };
    for _ in 0..3 {
        let mut stream = client.count(count(50)).await.unwrap().into_inner();
        let mut received = 0;
        while let Some(reply) = stream.message().await.unwrap() {
            received += 1;
            assert_eq!(reply.message, received.to_string());
        }
        assert_eq!(received, 50, "a stream counts once, whatever its length");
    }
    let status = client
        .count(count(50))
        .await
        .expect_err("the fourth call is over the limit");
    assert_eq!(status.code(), Code::ResourceExhausted);
}

#[tokio::test]
async fn a_call_without_its_key_is_an_invalid_argument() {
    let clock = ManualClock::new();
    let addr = serve(&clock, false).await;
    let mut client = EchoClient::connect(format!("http://{addr}")).await.unwrap();
    let status = client
        .say(Request::new(EchoRequest {
            message: "hi".into(),
        }))
        .await
        .expect_err("no key");
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(status.message(), "request has no throttle key");
}

#[tokio::test]
async fn plain_http_to_the_same_layer_still_gets_429() {
    let clock = ManualClock::new();
    let addr = serve(&clock, false).await;
    let mut grpc = EchoClient::connect(format!("http://{addr}")).await.unwrap();
    for _ in 0..3 {
        grpc.say(say("shared")).await.unwrap();
    }
    // A plain HTTP/2 request (prior knowledge, as the gRPC server speaks h2c).
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let io = hyper_util::rt::TokioIo::new(stream);
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), io)
            .await
            .unwrap();
    tokio::spawn(conn);
    let req = http::Request::post(format!("http://{addr}/demo.Echo/Say"))
        .header("x-api-key", "shared")
        .header("content-type", "application/json")
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .unwrap();
    let response = sender.send_request(req).await.unwrap();
    assert_eq!(response.status(), http::StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(response.headers()["retry-after"], "1");
    assert_eq!(
        response.headers()["ratelimit-policy"],
        "\"default\";q=3;qu=\"requests\";w=1"
    );
    assert!(response.headers().get("grpc-status").is_none());
}

/// A fleet-wide concurrency limit in front of the same server: a call over the key's limit is
/// `RESOURCE_EXHAUSTED` at once, and served again once a slot is free.
#[tokio::test]
async fn a_call_over_its_concurrency_limit_gets_resource_exhausted() {
    let in_flight: hierarchical_throttle::HierarchicalConcurrencyLayer<
        http::Request<Body>,
        String,
        MemoryGlobalStore<String>,
    > = hierarchical_throttle::HierarchicalConcurrencyLayer::builder()
        .key(|req: &http::Request<Body>| key::header_value(req, "x-api-key"))
        .max_in_flight(2)
        .store(MemoryGlobalStore::new())
        .build()
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let incoming = TcpIncoming::from(listener);
    let layer = in_flight.clone();
    tokio::spawn(async move {
        Server::builder()
            .layer(layer)
            .add_service(EchoServer)
            .serve_with_incoming(incoming)
            .await
            .expect("serve gRPC");
    });
    let mut client = EchoClient::connect(format!("http://{addr}")).await.unwrap();
    assert!(client.say(say("k1")).await.is_ok());
    // Both of k1's slots taken by calls still running (held here by hand).
    let running = [
        in_flight.acquire("k1".to_owned()).await.unwrap(),
        in_flight.acquire("k1".to_owned()).await.unwrap(),
    ];
    let refused = client.say(say("k1")).await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted);
    assert_eq!(refused.message(), "too many requests in flight (at most 2)");
    assert!(
        client.say(say("k2")).await.is_ok(),
        "another key has slots of its own"
    );
    drop(running);
    assert!(client.say(say("k1")).await.is_ok());
    assert_eq!(in_flight.stats().refused_full, 1);
}

/// `ClientIp::key` reads the peer from tonic's `TcpConnectInfo`, and the client behind it.
#[test]
fn client_ip_reads_the_peer_of_a_tonic_request() {
    use tonic::transport::server::TcpConnectInfo;
    let client_ip = key::ClientIp::behind_networks(["10.0.0.0/8"]).unwrap();
    let request = |peer: &str| {
        let mut req = http::Request::builder()
            .header("x-forwarded-for", "198.51.100.1, 203.0.113.7")
            .body(())
            .unwrap();
        req.extensions_mut().insert(TcpConnectInfo {
            local_addr: None,
            remote_addr: Some(peer.parse().unwrap()),
        });
        req
    };
    let via_balancer = client_ip.key(&request("10.0.0.5:443"));
    assert_eq!(via_balancer, Some("203.0.113.7".parse().unwrap()));
    let direct = client_ip.key(&request("192.0.2.50:5000"));
    assert_eq!(direct, Some("192.0.2.50".parse().unwrap()));
    assert_eq!(client_ip.key(&http::Request::new(())), None);
}

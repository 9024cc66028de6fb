//! A small gRPC service, `demo.Echo`, written by hand the way tonic's generated code is, so
//! that no `protoc` is needed: `Say` (unary) and `Count` (server streaming).
//!
//! ```proto
//! package demo;
//! service Echo {
//!   rpc Say(EchoRequest) returns (EchoReply);
//!   rpc Count(CountRequest) returns (stream EchoReply);
//! }
//! message EchoRequest { string message = 1; }
//! message CountRequest { uint32 n = 1; }
//! message EchoReply { string message = 1; }
//! ```
#![allow(dead_code)]

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures_util::Stream;
use futures_util::future::BoxFuture;
use http::uri::PathAndQuery;
use tonic::body::Body;
use tonic::transport::Channel;
use tonic::{Request, Response, Status, Streaming};
use tonic_prost::ProstCodec;
use tower::{Service, service_fn};

#[derive(Clone, PartialEq, prost::Message)]
pub struct EchoRequest {
    #[prost(string, tag = "1")]
    pub message: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct CountRequest {
    #[prost(uint32, tag = "1")]
    pub n: u32,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct EchoReply {
    #[prost(string, tag = "1")]
    pub message: String,
}

pub const SAY: &str = "/demo.Echo/Say";
pub const COUNT: &str = "/demo.Echo/Count";

type ReplyStream = Pin<Box<dyn Stream<Item = Result<EchoReply, Status>> + Send>>;

/// The server side of `demo.Echo`.
#[derive(Debug, Clone, Default)]
pub struct EchoServer;

impl tonic::server::NamedService for EchoServer {
    const NAME: &'static str = "demo.Echo";
}

impl Service<http::Request<Body>> for EchoServer {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        Box::pin(async move {
            // A codec per method: each has its own message types.
            Ok(match req.uri().path() {
                SAY => grpc().unary(service_fn(say), req).await,
                COUNT => grpc().server_streaming(service_fn(count), req).await,
                _ => Status::unimplemented("no such method").into_http(),
            })
        })
    }
}

fn grpc<Encode, Decode>() -> tonic::server::Grpc<ProstCodec<Encode, Decode>>
where
    Encode: prost::Message + Send + 'static,
    Decode: prost::Message + Default + Send + 'static,
{
    tonic::server::Grpc::new(ProstCodec::default())
}

async fn say(req: Request<EchoRequest>) -> Result<Response<EchoReply>, Status> {
    Ok(Response::new(EchoReply {
        message: req.into_inner().message,
    }))
}

async fn count(req: Request<CountRequest>) -> Result<Response<ReplyStream>, Status> {
    let n = req.into_inner().n;
    let replies = (1..=n).map(|i| {
        Ok(EchoReply {
            message: i.to_string(),
        })
    });
    Ok(Response::new(Box::pin(futures_util::stream::iter(replies))))
}

/// The client side of `demo.Echo`.
#[derive(Debug, Clone)]
pub struct EchoClient {
    grpc: tonic::client::Grpc<Channel>,
}

impl EchoClient {
    pub async fn connect(url: String) -> Result<Self, tonic::transport::Error> {
        let channel = Channel::from_shared(url)
            .expect("a valid URL")
            .connect()
            .await?;
        Ok(Self {
            grpc: tonic::client::Grpc::new(channel),
        })
    }

    pub async fn say(
        &mut self,
        request: Request<EchoRequest>,
    ) -> Result<Response<EchoReply>, Status> {
        self.ready().await?;
        let codec = ProstCodec::default();
        self.grpc
            .unary(request, PathAndQuery::from_static(SAY), codec)
            .await
    }

    pub async fn count(
        &mut self,
        request: Request<CountRequest>,
    ) -> Result<Response<Streaming<EchoReply>>, Status> {
        self.ready().await?;
        let codec = ProstCodec::default();
        self.grpc
            .server_streaming(request, PathAndQuery::from_static(COUNT), codec)
            .await
    }

    async fn ready(&mut self) -> Result<(), Status> {
        self.grpc
            .ready()
            .await
            .map_err(|e| Status::unavailable(format!("not ready: {e}")))
    }
}

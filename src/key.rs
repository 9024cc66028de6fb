//! Throttle keys: what a request is counted against.
//!
//! The layer's key closure turns a request into `Option<K>`. These helpers read the usual
//! sources; any closure works.

/// What to do with a request whose key closure returned `None`.
///
/// The default is [`Reject`](Self::Reject): otherwise a client could escape its limit by
/// leaving out whatever the key is built from (an API-key header, say).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum MissingKey<K> {
    /// Refuse the request ([`RejectionReason::MissingKey`](crate::RejectionReason): HTTP 400,
    /// gRPC `INVALID_ARGUMENT`).
    #[default]
    Reject,
    /// Serve the request without throttling it.
    Admit,
    /// Count the request against this one shared key.
    UseKey(K),
    /// Refuse the request with this status and message (the body of an HTTP answer, the
    /// `grpc-message` of a gRPC one), for example `401 Unauthorized` and "send your API key in
    /// the x-api-key header".
    RejectWith {
        /// The HTTP status to answer with.
        status: http::StatusCode,
        /// Why, in words for the client.
        message: &'static str,
    },
}

/// The value of header `name`, if present and valid UTF-8.
///
/// ```
/// use hierarchical_throttle::key::header_value;
/// let req = http::Request::builder().header("x-api-key", "k1").body(()).unwrap();
/// assert_eq!(header_value(&req, "x-api-key").as_deref(), Some("k1"));
/// assert_eq!(header_value(&req, "x-tenant"), None);
/// ```
///
/// `name` is a `&str`, or a [`HeaderName`](http::HeaderName) made once
/// (`const API_KEY: HeaderName = HeaderName::from_static("x-api-key")`), which spares parsing
/// and hashing the name's text on every request.
pub fn header_value<B>(
    request: &http::Request<B>,
    name: impl http::header::AsHeaderName,
) -> Option<String> {
    let value = request.headers().get(name)?.to_str().ok()?;
    Some(value.to_owned())
}

/// The path of the request, which for gRPC is the method: `/package.Service/Method`. gRPC
/// metadata are headers: read them with [`header_value`].
pub fn path<B>(request: &http::Request<B>) -> String {
    request.uri().path().to_owned()
}

/// The peer's IP address from axum's `ConnectInfo<SocketAddr>`, which axum sets only when the
/// app is served with `into_make_service_with_connect_info`:
///
/// ```rust,ignore
/// axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await?;
/// ```
///
/// Without it every request has no peer address (and so, with this helper alone, no key): the
/// first such request logs a warning, once per process.
#[cfg(feature = "axum")]
pub fn axum_peer_ip<B>(request: &http::Request<B>) -> Option<std::net::IpAddr> {
    let info = request
        .extensions()
        .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>();
    if info.is_none() {
        warn_once_without_connect_info();
    }
    Some(info?.0.ip())
}

#[cfg(feature = "axum")]
#[cold]
fn warn_once_without_connect_info() {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::warn!(
            "key::axum_peer_ip found no ConnectInfo: serve the app with \
             into_make_service_with_connect_info::<SocketAddr>()"
        );
    }
}

/// The peer's IP address from tonic's `TcpConnectInfo` (present on requests served by
/// `tonic::transport::Server`).
#[cfg(feature = "tonic")]
pub fn tonic_peer_ip<B>(request: &http::Request<B>) -> Option<std::net::IpAddr> {
    let info = request
        .extensions()
        .get::<tonic::transport::server::TcpConnectInfo>()?;
    Some(info.remote_addr()?.ip())
}

//! Throttle keys: what a request is counted against.
//!
//! The layer's key closure turns a request into `Option<K>`
//! ([`key`](crate::Builder::key)), or borrows it from the request
//! ([`key_ref`](crate::Builder::key_ref): `Option<&str>` for a `String` key, say, so that a
//! request served from the host's leased tokens never allocates its key). These helpers read
//! the usual sources; any closure works.

use std::hash::Hash;
use std::marker::PhantomData;

use crate::local::memory::{GroupHit, MemoryLocalStore};

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
    header_str(request, name).map(str::to_owned)
}

/// The value of header `name`, borrowed from the request, if present and valid UTF-8: the key
/// for [`key_ref`](crate::Builder::key_ref), which makes a `String` of it only when the host's
/// leased tokens cannot decide the request alone.
///
/// ```
/// use hierarchical_throttle::key::header_str;
/// let req = http::Request::builder().header("x-api-key", "k1").body(()).unwrap();
/// assert_eq!(header_str(&req, "x-api-key"), Some("k1"));
/// assert_eq!(header_str(&req, "x-tenant"), None);
///
/// // Any UTF-8 text; bytes that are not UTF-8 are no key.
/// let utf8 = http::HeaderValue::from_bytes("clé".as_bytes()).unwrap();
/// let req = http::Request::builder().header("x-api-key", utf8).body(()).unwrap();
/// assert_eq!(header_str(&req, "x-api-key"), Some("clé"));
/// let bytes = http::HeaderValue::from_bytes(b"k\xff").unwrap();
/// let req = http::Request::builder().header("x-api-key", bytes).body(()).unwrap();
/// assert_eq!(header_str(&req, "x-api-key"), None);
/// ```
///
/// `name` is a `&str` or a [`HeaderName`](http::HeaderName), as for [`header_value`].
pub fn header_str<B>(
    request: &http::Request<B>,
    name: impl http::header::AsHeaderName,
) -> Option<&str> {
    // Any UTF-8 text: `HeaderValue::to_str` would refuse all but visible ASCII.
    std::str::from_utf8(request.headers().get(name)?.as_bytes()).ok()
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

/// A closure making a request's key.
pub(crate) type KeyFn<Req, K> = Box<dyn Fn(&Req) -> Option<K> + Send + Sync>;

/// How the layer reads a request's first-level key.
pub(crate) enum KeyReader<Req, K> {
    /// A closure making the key ([`key`](crate::Builder::key)).
    Owned(KeyFn<Req, K>),
    /// A closure borrowing it from the request ([`key_ref`](crate::Builder::key_ref)).
    Borrowed(Box<dyn ReadBorrowed<Req, K>>),
}

impl<Req, K> KeyReader<Req, K> {
    /// The request's key, made.
    pub(crate) fn read(&self, request: &Req) -> Option<K> {
        match self {
            Self::Owned(key) => key(request),
            Self::Borrowed(reader) => reader.owned(request),
        }
    }
}

/// A key closure that borrows its key from the request, with the key's type erased.
pub(crate) trait ReadBorrowed<Req, K>: Send + Sync {
    /// The request's key, made.
    fn owned(&self, request: &Req) -> Option<K>;

    /// Takes `cost` from the request's key's buckets in `store` by the borrowed key; the key
    /// is made only when the store's answer does not settle the request. `None` when the
    /// request has no key.
    fn take(&self, request: &Req, store: &MemoryLocalStore<K>, cost: u64)
    -> Option<BorrowedHit<K>>;
}

/// [`ReadBorrowed::take`]'s answer.
pub(crate) enum BorrowedHit<K> {
    /// Every bucket of the key had the cost and gave it; nothing else to do.
    Admitted,
    /// The store's answer, with the key made for what follows.
    Further(K, GroupHit),
}

/// A closure borrowing a `Q` from the request, for a key of type `Q::Owned`.
pub(crate) struct BorrowKey<F, Q: ?Sized> {
    key: F,
    borrowed: PhantomData<fn(&Q)>,
}

impl<F, Q: ?Sized> BorrowKey<F, Q> {
    pub(crate) fn new(key: F) -> Self {
        Self {
            key,
            borrowed: PhantomData,
        }
    }
}

impl<Req, Q, F> ReadBorrowed<Req, Q::Owned> for BorrowKey<F, Q>
where
    F: for<'r> Fn(&'r Req) -> Option<&'r Q> + Send + Sync,
    Q: Hash + Eq + ToOwned + ?Sized,
    Q::Owned: Hash + Eq,
{
    fn owned(&self, request: &Req) -> Option<Q::Owned> {
        (self.key)(request).map(ToOwned::to_owned)
    }

    #[inline]
    fn take(
        &self,
        request: &Req,
        store: &MemoryLocalStore<Q::Owned>,
        cost: u64,
    ) -> Option<BorrowedHit<Q::Owned>> {
        let key = (self.key)(request)?;
        let hit = store.take_group_by::<Q>(key, 0, cost);
        Some(if hit.is_plain_admission() {
            BorrowedHit::Admitted
        } else {
            BorrowedHit::Further(key.to_owned(), hit)
        })
    }
}

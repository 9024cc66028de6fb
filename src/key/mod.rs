//! Throttle keys: what a request is counted against.
//!
//! The layer's key closure turns a request into `Option<K>`
//! ([`key`](crate::Builder::key)), or borrows it from the request
//! ([`key_ref`](crate::Builder::key_ref): `Option<&[u8]>` for a [`CompactKey`], `Option<&str>`
//! for a `String` one, so that a request served from the host's leased tokens never makes its
//! key). These helpers read the usual sources; any closure works. Behind load balancers,
//! [`ClientIp`] finds the client's address past the proxies you trust.

use std::borrow::Borrow;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::ops::Deref;

use crate::rejection::{Rejection, RejectionReason};

mod client_ip;

pub use client_ip::{ClientIp, ForwardedHeader, IpNetwork};

/// The longest key the header helpers ([`header_bytes`], [`header_str`], [`header_value`])
/// read, in bytes: a longer value is no key (the [`MissingKey`] policy decides, a refusal by
/// default). So a client cannot make every host keep a 256 KB key per request: with the default
/// bounds, keys cost a local store at most 100,000 x 256 bytes (25.6 MB) beside the buckets.
/// Keys a closure of your own makes are as long as it makes them: cap or hash them there.
pub const MAX_KEY_LEN: usize = 256;

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

impl<K: Clone> MissingKey<K> {
    /// What this policy makes of a request without a key: the key to count it against
    /// (`None`: served unthrottled), or its refusal.
    pub(crate) fn resolve(&self) -> Result<Option<K>, Rejection<K>> {
        match self {
            Self::Reject => Err(Rejection::new(None, RejectionReason::MissingKey)),
            Self::RejectWith { status, message } => {
                Err(Rejection::new(None, RejectionReason::MissingKey).answered(*status, message))
            }
            Self::Admit => Ok(None),
            Self::UseKey(key) => Ok(Some(key.clone())),
        }
    }
}

/// The value of header `name`, if present, valid UTF-8 and at most [`MAX_KEY_LEN`] bytes.
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

/// The bytes of header `name`, borrowed from the request, if present: the quickest key for
/// [`key_ref`](crate::Builder::key_ref), kept as a [`CompactKey`] (inline when short) and made
/// only when the host's leased tokens cannot decide the request alone. Any bytes are a key, up
/// to [`MAX_KEY_LEN`]: a longer value is none.
///
/// ```
/// use hierarchical_throttle::key::header_bytes;
/// let req = http::Request::builder().header("x-api-key", "k1").body(()).unwrap();
/// assert_eq!(header_bytes(&req, "x-api-key"), Some(&b"k1"[..]));
/// assert_eq!(header_bytes(&req, "x-tenant"), None);
///
/// // A value longer than MAX_KEY_LEN is no key: the MissingKey policy decides.
/// let long = "k".repeat(hierarchical_throttle::key::MAX_KEY_LEN + 1);
/// let req = http::Request::builder().header("x-api-key", &long).body(()).unwrap();
/// assert_eq!(header_bytes(&req, "x-api-key"), None);
/// ```
///
/// `name` is a `&str` or a [`HeaderName`](http::HeaderName), as for [`header_value`].
pub fn header_bytes<B>(
    request: &http::Request<B>,
    name: impl http::header::AsHeaderName,
) -> Option<&[u8]> {
    let bytes = request.headers().get(name)?.as_bytes();
    (bytes.len() <= MAX_KEY_LEN).then_some(bytes)
}

/// The value of header `name`, borrowed from the request, if present, valid UTF-8 and at most
/// [`MAX_KEY_LEN`] bytes: a key
/// for [`key_ref`](crate::Builder::key_ref) kept as a `String`, made only when the host's
/// leased tokens cannot decide the request alone. [`header_bytes`] is quicker (no UTF-8
/// check, short keys kept inline).
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
    std::str::from_utf8(header_bytes(request, name)?).ok()
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
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub fn axum_peer_ip<B>(request: &http::Request<B>) -> Option<std::net::IpAddr> {
    let ip = axum_connect_info_ip(request);
    if ip.is_none() {
        static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        warn_once(
            &WARNED,
            "key::axum_peer_ip found no ConnectInfo: serve the app with \
             into_make_service_with_connect_info::<SocketAddr>()",
        );
    }
    ip
}

/// The peer's IP address from axum's `ConnectInfo<SocketAddr>`, if the request has one.
#[cfg(feature = "axum")]
fn axum_connect_info_ip<B>(request: &http::Request<B>) -> Option<std::net::IpAddr> {
    let info = request
        .extensions()
        .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()?;
    Some(info.0.ip())
}

/// Logs `message` at warn, the first time `warned` is passed: a key closure that finds no
/// peer address fails on every request, and one line says why.
#[cold]
fn warn_once(warned: &std::sync::atomic::AtomicBool, message: &str) {
    if !warned.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::warn!("{message}");
    }
}

/// The peer's IP address from tonic's `TcpConnectInfo` (present on requests served by
/// `tonic::transport::Server`).
#[cfg(feature = "tonic")]
#[cfg_attr(docsrs, doc(cfg(feature = "tonic")))]
pub fn tonic_peer_ip<B>(request: &http::Request<B>) -> Option<std::net::IpAddr> {
    let info = request
        .extensions()
        .get::<tonic::transport::server::TcpConnectInfo>()?;
    Some(info.remote_addr()?.ip())
}

/// The form a [`key_ref`](crate::Builder::key_ref) closure borrows a key in, and the key made
/// of it when a request goes further than the host's leased tokens.
///
/// `[u8]` makes a [`CompactKey`], `str` a `String`, and any sized type (`u64`, a `TenantId`
/// of yours read from the request's extensions) a clone of itself. Other unsized forms (a
/// `Path`, an `OsStr`) are borrowed as their bytes.
pub trait BorrowedKey: Hash + Eq {
    /// The key the layer keeps. It hashes and compares as its borrowed form.
    type Key: Borrow<Self> + Hash + Eq + Clone;

    /// The key, made.
    fn to_key(&self) -> Self::Key;
}

impl BorrowedKey for [u8] {
    type Key = CompactKey;

    fn to_key(&self) -> CompactKey {
        CompactKey::new(self)
    }
}

impl BorrowedKey for str {
    type Key = String;

    fn to_key(&self) -> String {
        self.to_owned()
    }
}

impl<T: Clone + Hash + Eq> BorrowedKey for T {
    type Key = T;

    fn to_key(&self) -> T {
        self.clone()
    }
}

/// A key of bytes, kept inline when short: up to [`INLINE_LEN`](Self::INLINE_LEN) bytes (a
/// tenant id, an IP address, a short API key) live in the key itself, so finding a key's
/// bucket reads no memory beyond the bucket's entry and tracking a key allocates nothing. A
/// longer key is kept on the heap, as in a `Vec<u8>`. Either way it takes 24 bytes, as a
/// `String` does.
///
/// It hashes, compares and orders as its bytes (`[u8]`), and names a Redis key by them.
///
/// ```
/// use hierarchical_throttle::key::CompactKey;
/// let key = CompactKey::from("customer-42");
/// assert_eq!(key.as_bytes(), b"customer-42");
/// assert_eq!(key, CompactKey::from(b"customer-42".to_vec()));
/// assert_eq!(format!("{key:?}"), r#"CompactKey(b"customer-42")"#);
/// ```
#[derive(Clone)]
pub struct CompactKey(Compact);

#[derive(Clone)]
enum Compact {
    Inline {
        len: u8,
        bytes: [u8; CompactKey::INLINE_LEN],
    },
    Heap(Box<[u8]>),
}

impl CompactKey {
    /// The longest key kept inline, in bytes.
    pub const INLINE_LEN: usize = 22;

    /// The key of these bytes.
    pub fn new(key: &[u8]) -> Self {
        let mut bytes = [0; Self::INLINE_LEN];
        match (bytes.get_mut(..key.len()), u8::try_from(key.len())) {
            (Some(inline), Ok(len)) => {
                inline.copy_from_slice(key);
                Self(Compact::Inline { len, bytes })
            }
            _ => Self(Compact::Heap(key.into())),
        }
    }

    /// The key's bytes.
    #[inline]
    pub fn as_bytes(&self) -> &[u8] {
        match &self.0 {
            Compact::Inline { len, bytes } => &bytes[..usize::from(*len)],
            Compact::Heap(bytes) => bytes,
        }
    }

    /// Whether the key is kept inline (at most [`INLINE_LEN`](Self::INLINE_LEN) bytes).
    pub fn is_inline(&self) -> bool {
        matches!(self.0, Compact::Inline { .. })
    }
}

impl Deref for CompactKey {
    type Target = [u8];

    #[inline]
    fn deref(&self) -> &[u8] {
        self.as_bytes()
    }
}

impl AsRef<[u8]> for CompactKey {
    fn as_ref(&self) -> &[u8] {
        self.as_bytes()
    }
}

impl Borrow<[u8]> for CompactKey {
    #[inline]
    fn borrow(&self) -> &[u8] {
        self.as_bytes()
    }
}

impl PartialEq for CompactKey {
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for CompactKey {}

impl PartialOrd for CompactKey {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for CompactKey {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.as_bytes().cmp(other.as_bytes())
    }
}

impl Hash for CompactKey {
    /// As its bytes, so that a `&[u8]` finds it ([`Borrow`]'s contract).
    #[inline]
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_bytes().hash(state);
    }
}

impl fmt::Debug for CompactKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CompactKey(b\"{}\")", self.as_bytes().escape_ascii())
    }
}

impl From<&[u8]> for CompactKey {
    fn from(key: &[u8]) -> Self {
        Self::new(key)
    }
}

impl<const N: usize> From<&[u8; N]> for CompactKey {
    fn from(key: &[u8; N]) -> Self {
        Self::new(key)
    }
}

impl From<&str> for CompactKey {
    fn from(key: &str) -> Self {
        Self::new(key.as_bytes())
    }
}

impl From<Vec<u8>> for CompactKey {
    /// Keeps a long key's allocation.
    fn from(key: Vec<u8>) -> Self {
        if key.len() <= Self::INLINE_LEN {
            Self::new(&key)
        } else {
            Self(Compact::Heap(key.into_boxed_slice()))
        }
    }
}

impl From<String> for CompactKey {
    /// Keeps a long key's allocation.
    fn from(key: String) -> Self {
        Self::from(key.into_bytes())
    }
}

/// The keys one use draws on, at the layer's first level and at further levels: made by
/// [`HierarchicalThrottleLayer::keys`](crate::HierarchicalThrottleLayer::keys) for
/// [`acquire_keys`](crate::HierarchicalThrottleLayer::acquire_keys),
/// [`reserve_keys`](crate::HierarchicalThrottleLayer::reserve_keys) and
/// [`settle_keys`](crate::HierarchicalThrottleLayer::settle_keys).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keys<K> {
    /// The first bucket of each level's key, the first level's first, by level.
    ids: Vec<crate::quota::LeaseKey<K>>,
}

impl<K> Keys<K> {
    /// Keys sorted by level, the first level's first.
    pub(crate) fn new(ids: Vec<crate::quota::LeaseKey<K>>) -> Self {
        Self { ids }
    }

    /// The first level's key alone.
    pub(crate) fn first_level(key: K) -> Self {
        Self::new(vec![crate::quota::LeaseKey::new(key, 0, 0)])
    }

    /// The key at the layer's first level.
    pub fn first(&self) -> &K {
        // Never empty: made with the first level's key.
        &self.ids[0].key
    }

    pub(crate) fn ids(&self) -> &[crate::quota::LeaseKey<K>] {
        &self.ids
    }

    pub(crate) fn into_ids(self) -> Vec<crate::quota::LeaseKey<K>> {
        self.ids
    }
}

#[cfg(test)]
mod tests {
    use std::hash::BuildHasher;

    use super::*;

    #[test]
    fn a_compact_key_is_the_size_of_a_string() {
        assert_eq!(size_of::<CompactKey>(), size_of::<String>());
    }

    #[test]
    fn short_keys_are_inline_and_long_ones_on_the_heap() {
        for len in 0..=40 {
            let bytes: Vec<u8> = (0..len).map(|i| b'a' + (i % 26) as u8).collect();
            for key in [
                CompactKey::new(&bytes),
                CompactKey::from(bytes.clone()),
                CompactKey::from(bytes.as_slice()),
            ] {
                assert_eq!(key.as_bytes(), bytes.as_slice(), "{len} bytes");
                assert_eq!(
                    key.is_inline(),
                    len <= CompactKey::INLINE_LEN,
                    "{len} bytes"
                );
            }
        }
    }

    #[test]
    fn a_long_key_keeps_its_allocation() {
        let bytes = vec![7u8; CompactKey::INLINE_LEN + 1];
        let at = bytes.as_ptr();
        assert_eq!(CompactKey::from(bytes).as_bytes().as_ptr(), at);
    }

    #[test]
    fn a_key_hashes_compares_and_orders_as_its_bytes() {
        let hasher = foldhash::fast::RandomState::default();
        let keys = [
            &b""[..],
            b"a",
            b"customer-000042",
            &[0xff; 22],
            &[b'x'; 23],
            &[0; 64],
        ];
        for a in keys {
            let key = CompactKey::new(a);
            // Borrow's contract: a `&[u8]` finds its key in a map.
            assert_eq!(hasher.hash_one(&key), hasher.hash_one(a));
            assert_eq!(Borrow::<[u8]>::borrow(&key), a);
            for b in keys {
                assert_eq!(key == CompactKey::new(b), a == b);
                assert_eq!(key.cmp(&CompactKey::new(b)), a.cmp(b));
            }
        }
    }

    #[test]
    fn a_key_shows_its_bytes() {
        assert_eq!(
            format!("{:?}", CompactKey::from("k1")),
            r#"CompactKey(b"k1")"#
        );
        assert_eq!(
            format!("{:?}", CompactKey::from(b"k\xff\"")),
            r#"CompactKey(b"k\xff\"")"#
        );
    }

    #[test]
    fn borrowed_forms_make_their_keys() {
        let bytes: CompactKey = b"k1"[..].to_key();
        assert_eq!(bytes, CompactKey::from("k1"));
        let text: String = "k1".to_key();
        assert_eq!(text, "k1");
        let id: u64 = 7u64.to_key();
        assert_eq!(id, 7);
    }
}

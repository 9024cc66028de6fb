//! Bodies charged by the byte as they stream: upload and download quotas in bytes.

use std::fmt;
use std::hash::Hash;
use std::num::NonZeroUsize;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::clock::Clock;
use crate::future::Acquire;
use crate::global::GlobalStore;
use crate::layer::{HierarchicalThrottleLayer, ThrottleHandle};
use crate::local::LocalStore;
use crate::quota::{BucketKey, LeaseKey};

/// The largest piece of a body charged at once, by default: larger frames are split.
pub const DEFAULT_MAX_CHUNK: NonZeroUsize = match NonZeroUsize::new(16 * 1024) {
    Some(n) => n,
    None => NonZeroUsize::MIN,
};

/// The error of a [`MeteredBody`]'s frames: boxed, as axum's and hyper's bodies carry them.
pub use crate::error::BoxError;

pin_project! {
    /// A body whose data frames are charged to a key, byte for byte, as they stream: each
    /// frame is passed on once its bytes are admitted ([`acquire`](ThrottleHandle::acquire),
    /// with its batches, credit and failure policy), so a download or an upload quota holds
    /// fleet-wide like any other limit. Made by [`ThrottleHandle::meter`] or
    /// [`HierarchicalThrottleLayer::meter`](crate::HierarchicalThrottleLayer::meter).
    ///
    /// When the layer polices ([`Shaping::Refuse`](crate::Shaping), the default), a frame
    /// its key cannot pay for ends the stream with an error whose source is the
    /// [`Rejection`](crate::Rejection) (the bytes before it were delivered); when it shapes
    /// ([`Shaping::wait`](crate::Shaping::wait)), the frame waits for its tokens, so the
    /// stream is paced at the limit's rate. Frames longer than
    /// [`max_chunk`](Self::max_chunk) (16 KiB by default) are split and each piece charged on
    /// its own: give the limit a burst of at least one piece, or every piece is refused for
    /// costing more than the bucket holds. Trailers pass free. Describe the limit's unit as
    /// `content-bytes` in its fields
    /// ([`RateLimitFields::unit`](crate::RateLimitFields::unit)).
    ///
    /// ```
    /// use axum::body::Body;
    /// use http_body_util::BodyExt;
    /// use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// // 1 MB a second per user, a burst of 64 KiB.
    /// let downloads = HierarchicalThrottleLayer::builder()
    ///     .key(|user: &String| Some(user.clone()))
    ///     .limit(Limit::per_second(1_000_000).burst(64 * 1024)?)
    ///     .global_store(MemoryGlobalStore::new())
    ///     .build()?;
    /// let body = downloads.meter("alice".to_owned(), Body::from(vec![0u8; 1000]));
    /// assert_eq!(body.collect().await?.to_bytes().len(), 1000);
    /// # Ok(()) }
    /// ```
    pub struct MeteredBody<B, K> {
        #[pin]
        inner: B,
        handle: ThrottleHandle<K>,
        key: K,
        max_chunk: NonZeroUsize,
        // What is being charged, and the frame it pays for.
        charging: Option<(Acquire<K>, Bytes)>,
        // What is left of a frame split into pieces.
        rest: Bytes,
        refused: bool,
    }
}

impl<B, K> MeteredBody<B, K> {
    pub(crate) fn new(inner: B, handle: ThrottleHandle<K>, key: K) -> Self {
        Self {
            inner,
            handle,
            key,
            max_chunk: DEFAULT_MAX_CHUNK,
            charging: None,
            rest: Bytes::new(),
            refused: false,
        }
    }

    /// The largest piece charged at once: longer frames are split (default
    /// [`DEFAULT_MAX_CHUNK`], 16 KiB).
    pub fn max_chunk(mut self, bytes: NonZeroUsize) -> Self {
        self.max_chunk = bytes;
        self
    }

    /// The body inside.
    pub fn get_ref(&self) -> &B {
        &self.inner
    }

    /// The body inside, mutably.
    pub fn get_mut(&mut self) -> &mut B {
        &mut self.inner
    }

    /// The body inside; what was being charged is dropped (tokens taken for it go back).
    pub fn into_inner(self) -> B {
        self.inner
    }
}

impl<B, K> fmt::Debug for MeteredBody<B, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MeteredBody")
            .field("max_chunk", &self.max_chunk)
            .field("refused", &self.refused)
            .finish_non_exhaustive()
    }
}

impl<B, K> Body for MeteredBody<B, K>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
    K: Hash + Eq + Clone + fmt::Debug + Send + Sync + 'static,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut this = self.project();
        loop {
            if *this.refused {
                return Poll::Ready(None);
            }
            if let Some((acquire, _)) = this.charging.as_mut() {
                let decided = ready!(Pin::new(acquire).poll(cx));
                let paid = this.charging.take().map(|(_, piece)| piece);
                return Poll::Ready(Some(match decided {
                    Ok(_) => Ok(Frame::data(paid.unwrap_or_default())),
                    Err(rejection) => {
                        *this.refused = true;
                        Err(Box::new(rejection) as BoxError)
                    }
                }));
            }
            if !this.rest.is_empty() {
                // A frame within the piece size moves whole: splitting shared bytes would
                // count one more reference to them.
                let piece = match this.rest.len() <= this.max_chunk.get() {
                    true => std::mem::take(this.rest),
                    false => this.rest.split_to(this.max_chunk.get()),
                };
                let cost = u64::try_from(piece.len()).unwrap_or(u64::MAX);
                let acquire = this.handle.acquire(this.key.clone(), cost);
                *this.charging = Some((acquire, piece));
                continue;
            }
            let frame = match ready!(this.inner.as_mut().poll_frame(cx)) {
                None => return Poll::Ready(None),
                Some(Err(error)) => return Poll::Ready(Some(Err(error.into()))),
                Some(Ok(frame)) => frame,
            };
            match frame.into_data() {
                Ok(data) if data.is_empty() => return Poll::Ready(Some(Ok(Frame::data(data)))),
                Ok(data) => *this.rest = data,
                Err(trailers) => return Poll::Ready(Some(Ok(trailers))),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.refused
            || (self.charging.is_none() && self.rest.is_empty() && self.inner.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        match self.refused {
            true => SizeHint::with_exact(0),
            false => self.inner.size_hint(),
        }
    }
}

impl<K: 'static> ThrottleHandle<K> {
    /// `body`, charged to `key` byte for byte as it streams: see [`MeteredBody`].
    pub fn meter<B>(&self, key: K, body: B) -> MeteredBody<B, K> {
        MeteredBody::new(body, self.clone(), key)
    }
}

impl<Req, K, G, L, C, R> HierarchicalThrottleLayer<Req, K, G, L, C, R>
where
    Req: 'static,
    K: Hash + Eq + Clone + Send + Sync + 'static,
    G: GlobalStore<BucketKey<K>>,
    L: LocalStore<LeaseKey<K>>,
    C: Clock,
    R: Send + Sync + 'static,
{
    /// `body`, charged to `key` byte for byte as it streams, on this layer's buckets: see
    /// [`MeteredBody`].
    pub fn meter<B>(&self, key: K, body: B) -> MeteredBody<B, K> {
        self.handle().meter(key, body)
    }
}

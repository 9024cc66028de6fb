//! The response body that holds its request's concurrency slot until it ends.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::in_flight::SlotPermit;

pin_project! {
    /// A response body carrying its request's concurrency slot: the slot is given back when
    /// the body ends (its last frame, an error) or is dropped, so a streamed response counts
    /// as in flight until it has streamed.
    #[derive(Debug)]
    pub struct SlotBody<B> {
        #[pin]
        inner: B,
        permit: Option<SlotPermit>,
    }
}

impl<B> SlotBody<B> {
    pub(crate) fn new(inner: B, permit: Option<SlotPermit>) -> Self {
        Self { inner, permit }
    }

    /// Whether the body still holds its request's slot (never for an exempt or key-less
    /// request, a refusal, or a request served without a slot in shadow mode).
    pub fn holds_slot(&self) -> bool {
        self.permit.as_ref().is_some_and(SlotPermit::holds_slot)
    }

    /// The body inside, giving the slot back.
    pub fn into_inner(self) -> B {
        self.inner
    }
}

impl<B: Default> Default for SlotBody<B> {
    fn default() -> Self {
        Self::new(B::default(), None)
    }
}

impl<B: Body> Body for SlotBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let mut this = self.project();
        let frame = ready!(this.inner.as_mut().poll_frame(cx));
        if !matches!(frame, Some(Ok(_))) || this.inner.is_end_stream() {
            *this.permit = None;
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

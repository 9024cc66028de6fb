//! A rejection handler with a settle hook: how [`Builder::settle`](crate::Builder::settle) adds
//! cost correction to any [`OnRejection`].

use crate::rejection::Rejection;
use crate::remaining::Remaining;
use crate::response::OnRejection;

/// A rejection handler with a settle hook: made by
/// [`Builder::settle`](crate::Builder::settle). It answers rejections and admitted responses
/// as `R` does, and corrects each admitted request's cost from its response with `F`.
#[derive(Debug, Clone)]
pub struct Settle<R, F> {
    inner: R,
    settle: F,
}

impl<R, F> Settle<R, F> {
    pub(crate) fn new(inner: R, settle: F) -> Self {
        Self { inner, settle }
    }
}

impl<R, F, Req, K, Res, E> OnRejection<Req, K, Res, E> for Settle<R, F>
where
    R: OnRejection<Req, K, Res, E>,
    F: Fn(&Res, u64) -> u64 + Send + Sync + 'static,
{
    fn on_rejection(&self, request: &Req, rejection: Rejection<K>) -> Result<Res, E> {
        self.inner.on_rejection(request, rejection)
    }

    fn annotates_admitted(&self) -> bool {
        self.inner.annotates_admitted()
    }

    fn on_admitted(&self, response: &mut Res, remaining: &[Remaining]) {
        self.inner.on_admitted(response, remaining);
    }

    fn settles(&self) -> bool {
        true
    }

    fn settle(&self, response: &Res, charged: u64) -> u64 {
        (self.settle)(response, charged)
    }
}

//! A slot held by a request, and a request's wait for one.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use tokio::sync::oneshot;

use crate::in_flight::{Entry, NoSlot, Verdict};

/// The engine as a permit sees it: where a slot goes back. Type-erased, so that a permit (and
/// the body that carries it) names no key, store or clock.
pub(crate) trait GiveBack: Send + Sync + 'static {
    fn release(&self, entry: &Entry);
}

/// One request's concurrency slot, given back when dropped: when the response's body ends,
/// when the request is cancelled, when its handler panics.
pub struct SlotPermit {
    engine: Arc<dyn GiveBack>,
    entry: Arc<Entry>,
}

impl SlotPermit {
    pub(super) fn new(engine: Arc<dyn GiveBack>, entry: Arc<Entry>) -> Self {
        Self { engine, entry }
    }
}

impl Drop for SlotPermit {
    fn drop(&mut self) {
        self.engine.release(&self.entry);
    }
}

impl fmt::Debug for SlotPermit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlotPermit").finish_non_exhaustive()
    }
}

/// A request's wait for the slot store's answer. Dropped after its slot was given, it gives
/// the slot back; dropped before, it leaves its place to the next request.
pub(crate) struct WaitForSlot {
    engine: Arc<dyn GiveBack>,
    entry: Arc<Entry>,
    verdict: Option<oneshot::Receiver<Verdict>>,
}

impl WaitForSlot {
    pub(super) fn new(
        engine: Arc<dyn GiveBack>,
        entry: Arc<Entry>,
        verdict: oneshot::Receiver<Verdict>,
    ) -> Self {
        Self {
            engine,
            entry,
            verdict: Some(verdict),
        }
    }
}

impl fmt::Debug for WaitForSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WaitForSlot").finish_non_exhaustive()
    }
}

impl Future for WaitForSlot {
    type Output = Result<SlotPermit, NoSlot>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(receiver) = self.verdict.as_mut() else {
            return Poll::Ready(Err(NoSlot::Unavailable));
        };
        // A sender is only dropped unanswered with its lease (the engine dropped): as good as
        // a store that cannot answer.
        let verdict = ready!(Pin::new(receiver).poll(cx)).unwrap_or(Verdict::Unavailable);
        self.verdict = None;
        Poll::Ready(match verdict {
            Verdict::Admitted => Ok(SlotPermit::new(self.engine.clone(), self.entry.clone())),
            Verdict::Full => Err(NoSlot::Full),
            Verdict::Unavailable => Err(NoSlot::Unavailable),
        })
    }
}

impl Drop for WaitForSlot {
    fn drop(&mut self) {
        if let Some(mut receiver) = self.verdict.take() {
            receiver.close();
            if receiver.try_recv() == Ok(Verdict::Admitted) {
                self.engine.release(&self.entry);
            }
        }
    }
}

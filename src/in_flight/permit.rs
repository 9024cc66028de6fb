//! A key's slot lease as the engine keeps it, a slot held by a request, and a request's wait
//! for one.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use tokio::sync::oneshot;

use crate::in_flight::{NoSlot, Verdict, Waiter};
use crate::slots::SlotLease;
use crate::sync::ShardLock;

/// The engine as a key's entry sees it. Type-erased, so that a permit (and the body that
/// carries it) names no key, store or clock.
pub(crate) trait Engine: Send + Sync + 'static {
    fn now(&self) -> u64;
    fn count_admitted(&self);
    /// A request refused after waiting: counted when it hears so (a request gone before it
    /// heard its verdict was neither admitted nor refused).
    fn count_refused(&self, why: NoSlot);
}

/// One key's slot lease, and the engine it belongs to (reached only when a request waits).
pub(crate) struct Entry {
    pub(crate) lease: ShardLock<SlotLease<Waiter>>,
    engine: Weak<dyn Engine>,
}

impl Entry {
    pub(crate) fn new(lease: SlotLease<Waiter>, engine: Weak<dyn Engine>) -> Self {
        Self {
            lease: ShardLock::new(lease),
            engine,
        }
    }

    /// A request holding one of this key's slots ended: the slot goes to the first request
    /// waiting, if any, else back to the lease.
    pub(crate) fn release(&self) {
        let next = self.lease.lock().release(|| self.now());
        if let Some(waiter) = next {
            self.hand_over(waiter);
        }
    }

    /// The engine's time; a key whose engine is gone has no usable slots.
    fn now(&self) -> u64 {
        self.engine
            .upgrade()
            .map_or(u64::MAX, |engine| engine.now())
    }

    /// Counts on the engine, if it is still there.
    fn count(&self, count: impl FnOnce(&dyn Engine)) {
        if let Some(engine) = self.engine.upgrade() {
            count(&*engine);
        }
    }

    /// Gives the slot `waiter` now holds to it; when it has gone, to the next one waiting, or
    /// back to the lease.
    pub(crate) fn hand_over(&self, mut waiter: Waiter) {
        while waiter.send(Verdict::Admitted).is_err() {
            match self.lease.lock().release(|| self.now()) {
                Some(next) => waiter = next,
                None => return,
            }
        }
    }
}

/// One request's concurrency slot, given back when dropped: when the response's body ends,
/// when the request is cancelled, when its handler panics. In shadow mode, a request that
/// would have been refused gets a permit that holds no slot.
pub struct SlotPermit {
    entry: Option<Arc<Entry>>,
}

impl SlotPermit {
    pub(super) fn new(entry: Arc<Entry>) -> Self {
        Self { entry: Some(entry) }
    }

    /// A permit that holds no slot: a refusal served all the same (shadow mode).
    pub(crate) fn unheld() -> Self {
        Self { entry: None }
    }

    /// Whether it holds one of its key's slots (not when shadow mode served a refusal).
    pub fn holds_slot(&self) -> bool {
        self.entry.is_some()
    }

    /// Slots of `max` this host sees free for the key now, this permit's counted as taken
    /// (see [`SlotLease::free`]); none for a permit that holds no slot, as its refusal said.
    pub(crate) fn free(&self, max: u64) -> u64 {
        self.entry
            .as_ref()
            .map_or(0, |entry| entry.lease.lock().free(max, || entry.now()))
    }
}

impl Drop for SlotPermit {
    fn drop(&mut self) {
        if let Some(entry) = &self.entry {
            entry.release();
        }
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
    entry: Arc<Entry>,
    verdict: Option<oneshot::Receiver<Verdict>>,
    /// When a patient request gives up waiting (refused as full).
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl WaitForSlot {
    pub(super) fn new(
        entry: Arc<Entry>,
        verdict: oneshot::Receiver<Verdict>,
        max_wait: Option<Duration>,
    ) -> Self {
        Self {
            entry,
            verdict: Some(verdict),
            // Outside a Tokio runtime no call was made: the failure policy has decided, and
            // there is no timer to wait on.
            deadline: max_wait
                .filter(|_| tokio::runtime::Handle::try_current().is_ok())
                .map(|wait| Box::pin(tokio::time::sleep(wait))),
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
        let answered = Pin::new(receiver)
            .poll(cx)
            .map(|v| v.unwrap_or(Verdict::Unavailable));
        let verdict = match answered {
            Poll::Ready(verdict) => verdict,
            Poll::Pending => {
                let Some(deadline) = self.deadline.as_mut() else {
                    return Poll::Pending;
                };
                ready!(deadline.as_mut().poll(cx));
                // Gave up: a slot given meanwhile goes back when the wait is dropped.
                self.entry
                    .count(|engine| engine.count_refused(NoSlot::Full));
                return Poll::Ready(Err(NoSlot::Full));
            }
        };
        self.verdict = None;
        let why = match verdict {
            Verdict::Admitted => {
                self.entry.count(|engine| engine.count_admitted());
                return Poll::Ready(Ok(SlotPermit::new(self.entry.clone())));
            }
            Verdict::Full => NoSlot::Full,
            Verdict::Unavailable => NoSlot::Unavailable,
        };
        self.entry.count(|engine| engine.count_refused(why));
        Poll::Ready(Err(why))
    }
}

impl Drop for WaitForSlot {
    fn drop(&mut self) {
        if let Some(mut receiver) = self.verdict.take() {
            receiver.close();
            if receiver.try_recv() == Ok(Verdict::Admitted) {
                self.entry.release();
            }
        }
    }
}

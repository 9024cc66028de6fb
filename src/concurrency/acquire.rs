//! The future of [`HierarchicalConcurrencyLayer::acquire`](crate::HierarchicalConcurrencyLayer::acquire).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use crate::in_flight::{NoSlot, SlotPermit, WaitForSlot};
use crate::rejection::Rejection;

/// Makes the refusal of a request that waited for the store and got no slot (in shadow mode,
/// a permit that holds none).
type Refuse<K> = Box<dyn FnOnce(NoSlot) -> Result<SlotPermit, Rejection<K>> + Send + Sync>;

/// A slot for one key, from
/// [`HierarchicalConcurrencyLayer::acquire`](crate::HierarchicalConcurrencyLayer::acquire).
///
/// The decision is made when `acquire` is called, as for the throttle's
/// [`Acquire`](crate::Acquire): ready at once when this host holds a free slot for the key (or
/// the key is refused at once); otherwise it waits for the slot store's answer. Dropped
/// unawaited, it gives back the slot it took; dropped while waiting, it leaves its place to the
/// next request, and a slot given to it meanwhile goes back. Polled again after it has
/// completed, it stays pending.
#[must_use = "dropped unawaited, it gives its slot back at once"]
pub struct AcquireSlot<K> {
    state: State<K>,
}

// Every payload one word or a thin box: a slot taken at once (the common case) is a pointer,
// returned without storing a large future first.
enum State<K> {
    Taken(SlotPermit),
    Refused(Box<Rejection<K>>),
    Waiting(Box<(WaitForSlot, Refuse<K>)>),
    Done,
}

// Nothing in it is pinned: the wait is boxed and `Unpin` itself.
impl<K> Unpin for AcquireSlot<K> {}

impl<K> AcquireSlot<K> {
    pub(crate) fn taken(permit: SlotPermit) -> Self {
        Self {
            state: State::Taken(permit),
        }
    }

    pub(crate) fn refused(rejection: Rejection<K>) -> Self {
        Self {
            state: State::Refused(Box::new(rejection)),
        }
    }

    pub(crate) fn waiting(wait: WaitForSlot, refuse: Refuse<K>) -> Self {
        Self {
            state: State::Waiting(Box::new((wait, refuse))),
        }
    }
}

impl<K> Future for AcquireSlot<K> {
    type Output = Result<SlotPermit, Rejection<K>>;

    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let state = &mut self.get_mut().state;
        if let State::Waiting(waiting) = state {
            let verdict = ready!(Pin::new(&mut waiting.0).poll(cx));
            let State::Waiting(waiting) = std::mem::replace(state, State::Done) else {
                return Poll::Pending;
            };
            let (_, refuse) = *waiting;
            return Poll::Ready(verdict.or_else(refuse));
        }
        match std::mem::replace(state, State::Done) {
            State::Taken(permit) => Poll::Ready(Ok(permit)),
            State::Refused(rejection) => Poll::Ready(Err(*rejection)),
            State::Waiting(_) | State::Done => Poll::Pending,
        }
    }
}

impl<K> std::fmt::Debug for AcquireSlot<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.state {
            State::Taken(_) => "taken",
            State::Refused(_) => "refused",
            State::Waiting(_) => "waiting",
            State::Done => "done",
        };
        f.debug_struct("AcquireSlot")
            .field("state", &state)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::task::Waker;

    use super::*;
    use crate::{HierarchicalConcurrencyLayer, MemoryGlobalStore, RejectionReason};

    #[test]
    fn a_slot_taken_at_once_is_returned_in_two_words() {
        assert!(size_of::<AcquireSlot<String>>() <= 2 * size_of::<usize>());
        // It can be held across an await of a spawned task, or in a shared struct.
        fn send_and_sync<T: Send + Sync>() {}
        send_and_sync::<AcquireSlot<String>>();
    }

    #[tokio::test(start_paused = true)]
    async fn a_completed_acquire_polled_again_stays_pending() {
        let layer = HierarchicalConcurrencyLayer::builder()
            .key(|key: &String| Some(key.clone()))
            .max_in_flight(1)
            .store(MemoryGlobalStore::new())
            .build()
            .unwrap();
        let mut context = Context::from_waker(Waker::noop());
        // The first slot waits for the store: taken once it answers.
        let mut first = layer.acquire("k".to_owned());
        let permit = (&mut first).await.unwrap();
        assert!(Pin::new(&mut first).poll(&mut context).is_pending());
        // The host now holds the key's one slot, in use: refused once the store says so.
        let mut second = layer.acquire("k".to_owned());
        let refused = (&mut second).await.unwrap_err();
        assert_eq!(refused.reason, RejectionReason::TooManyInFlight { max: 1 });
        assert_eq!(refused.key.as_deref(), Some("k"));
        assert!(Pin::new(&mut second).poll(&mut context).is_pending());
        drop(permit);
        // Given back to this host's holding: taken at once, no wait.
        let mut third = layer.acquire("k".to_owned());
        assert!(matches!(
            Pin::new(&mut third).poll(&mut context),
            Poll::Ready(Ok(_))
        ));
        assert!(Pin::new(&mut third).poll(&mut context).is_pending());
        drop(third);
        // Taken when called, given back when dropped unawaited.
        let unawaited = layer.acquire("k".to_owned());
        assert_eq!(layer.in_flight(), 1);
        drop(unawaited);
        assert_eq!(layer.in_flight(), 0);
    }
}

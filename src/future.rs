//! The throttling service's response future.

use std::future::{Future, Ready, ready};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use futures_util::future::BoxFuture;
use pin_project_lite::pin_project;
use tower_service::Service;

use crate::layer::RequestPolicy;
use crate::remaining::Remaining;
use crate::response::{OnRejection, Rejection};

pin_project! {
    /// Response future of [`HierarchicalThrottle`](crate::HierarchicalThrottle): the inner
    /// service's future (whose response may get the `RateLimit` fields), an immediate
    /// rejection, or a wait for a batch from the global store.
    pub struct ResponseFuture<S, Req, K, R>
    where
        S: Service<Req>,
    {
        #[pin]
        state: State<S, Req, K, R>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, Req, K, R>
    where
        S: Service<Req>,
    {
        Called {
            #[pin]
            future: S::Future,
        },
        Annotated {
            #[pin]
            future: S::Future,
            remaining: Vec<Remaining>,
            policy: Arc<RequestPolicy<Req, K, R>>,
        },
        Rejected {
            #[pin]
            response: Ready<Result<S::Response, S::Error>>,
        },
        Waiting {
            decision: Decision<K>,
            parked: Option<Parked<S, Req, K, R>>,
        },
    }
}

/// A waiting request's decision: admitted with the state of its limits for its response (none
/// to add when empty), or refused.
pub(crate) type Decision<K> = BoxFuture<'static, Result<Vec<Remaining>, Rejection<K>>>;

/// A request waiting for its decision, with the ready service that will serve it.
struct Parked<S, Req, K, R> {
    inner: S,
    request: Req,
    policy: Arc<RequestPolicy<Req, K, R>>,
}

impl<S: Service<Req>, Req, K, R> ResponseFuture<S, Req, K, R> {
    #[inline]
    pub(crate) fn called(future: S::Future) -> Self {
        Self {
            state: State::Called { future },
        }
    }

    pub(crate) fn annotated(
        future: S::Future,
        remaining: Vec<Remaining>,
        policy: Arc<RequestPolicy<Req, K, R>>,
    ) -> Self {
        Self {
            state: State::Annotated {
                future,
                remaining,
                policy,
            },
        }
    }

    pub(crate) fn rejected(response: Result<S::Response, S::Error>) -> Self {
        Self {
            state: State::Rejected {
                response: ready(response),
            },
        }
    }

    pub(crate) fn waiting(
        decision: Decision<K>,
        inner: S,
        request: Req,
        policy: Arc<RequestPolicy<Req, K, R>>,
    ) -> Self {
        Self {
            state: State::Waiting {
                decision,
                parked: Some(Parked {
                    inner,
                    request,
                    policy,
                }),
            },
        }
    }
}

impl<S, Req, K, R> Future for ResponseFuture<S, Req, K, R>
where
    S: Service<Req>,
    R: OnRejection<Req, K, S::Response, S::Error>,
{
    type Output = Result<S::Response, S::Error>;

    #[inline(always)]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut state = self.project().state;
        loop {
            match state.as_mut().project() {
                StateProj::Called { future } => return future.poll(cx),
                StateProj::Annotated {
                    future,
                    remaining,
                    policy,
                } => {
                    let mut response = ready!(future.poll(cx))?;
                    policy.on_rejection.on_admitted(&mut response, remaining);
                    return Poll::Ready(Ok(response));
                }
                StateProj::Rejected { response } => return response.poll(cx),
                StateProj::Waiting { decision, parked } => {
                    let next = ready!(Self::poll_decision(decision, parked, cx));
                    state.set(next);
                }
            }
        }
    }
}

impl<S, Req, K, R> ResponseFuture<S, Req, K, R>
where
    S: Service<Req>,
    R: OnRejection<Req, K, S::Response, S::Error>,
{
    /// The state after the decision: kept out of `poll`, so the common case stays small enough
    /// to inline.
    #[inline(never)]
    fn poll_decision(
        decision: &mut Decision<K>,
        parked: &mut Option<Parked<S, Req, K, R>>,
        cx: &mut Context<'_>,
    ) -> Poll<State<S, Req, K, R>> {
        let verdict = ready!(decision.as_mut().poll(cx));
        // Always Some here: it is taken only on the way out of this state.
        let Some(Parked {
            mut inner,
            request,
            policy,
        }) = parked.take()
        else {
            return Poll::Pending;
        };
        Poll::Ready(match verdict {
            Ok(remaining) if remaining.is_empty() => State::Called {
                future: inner.call(request),
            },
            Ok(remaining) => State::Annotated {
                future: inner.call(request),
                remaining,
                policy,
            },
            Err(rejection) => State::Rejected {
                response: ready(policy.on_rejection.on_rejection(&request, rejection)),
            },
        })
    }
}

/// The decision for one use of a key, from
/// [`HierarchicalThrottleLayer::acquire`](crate::HierarchicalThrottleLayer::acquire).
///
/// Ready at once when the host's leased tokens cover the cost or the key is known to be
/// throttled; otherwise it waits for a batch from the global store, at most the store
/// time-out. Polled again after it has completed, it stays pending.
#[must_use = "a decision does nothing unless awaited"]
pub struct Acquire<K> {
    state: AcquireState<K>,
}

enum AcquireState<K> {
    Admitted,
    // Boxed, so that an admission (the common case) moves a small value.
    Rejected(Box<Rejection<K>>),
    Waiting(BoxFuture<'static, Result<(), Rejection<K>>>),
    Done,
}

// Nothing in it is pinned: the waiting future is boxed.
impl<K> Unpin for Acquire<K> {}

impl<K> Acquire<K> {
    #[inline]
    pub(crate) fn admitted() -> Self {
        Self {
            state: AcquireState::Admitted,
        }
    }

    pub(crate) fn rejected(rejection: Rejection<K>) -> Self {
        Self {
            state: AcquireState::Rejected(Box::new(rejection)),
        }
    }

    pub(crate) fn waiting(decision: BoxFuture<'static, Result<(), Rejection<K>>>) -> Self {
        Self {
            state: AcquireState::Waiting(decision),
        }
    }
}

impl<K> Future for Acquire<K> {
    type Output = Result<(), Rejection<K>>;

    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let state = &mut self.get_mut().state;
        if let AcquireState::Waiting(decision) = state {
            let decided = ready!(decision.as_mut().poll(cx));
            *state = AcquireState::Done;
            return Poll::Ready(decided);
        }
        match std::mem::replace(state, AcquireState::Done) {
            AcquireState::Admitted => Poll::Ready(Ok(())),
            AcquireState::Rejected(rejection) => Poll::Ready(Err(*rejection)),
            AcquireState::Waiting(_) | AcquireState::Done => Poll::Pending,
        }
    }
}

impl<K> std::fmt::Debug for Acquire<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.state {
            AcquireState::Admitted => "admitted",
            AcquireState::Rejected(_) => "rejected",
            AcquireState::Waiting(_) => "waiting",
            AcquireState::Done => "done",
        };
        f.debug_struct("Acquire").field("state", &state).finish()
    }
}

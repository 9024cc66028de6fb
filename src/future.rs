//! The throttling service's response future.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use futures_util::future::BoxFuture;
use pin_project_lite::pin_project;
use tower_service::Service;

use crate::policy::RequestPolicy;
use crate::rejection::Rejection;
use crate::remaining::Remaining;
use crate::response::OnRejection;
use crate::throttle::Admitted;
use crate::throttle::{Admission, Corrected};

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
    // The rarer states are boxed, so the whole future is the inner service's future and what
    // follows an admitted response (the state of its limit, for the `RateLimit` fields, which
    // admitted responses carry by default: inline, it costs no allocation per request).
    #[project = StateProj]
    enum State<S, Req, K, R>
    where
        S: Service<Req>,
    {
        Called {
            #[pin]
            future: S::Future,
        },
        After {
            #[pin]
            future: S::Future,
            after: After<Req, K, R>,
        },
        Charging {
            charging: Box<Charging<S::Response, Req, K, R>>,
        },
        Rejected {
            // Taken when polled: polled again, the future stays pending.
            response: Box<Option<Result<S::Response, S::Error>>>,
        },
        Waiting {
            decision: Decision<K>,
            parked: Option<Box<Parked<S, Req, K, R>>>,
        },
    }
}

/// A response waiting for the global store to take what its settled cost lacked.
struct Charging<Res, Req, K, R> {
    charge: BoxFuture<'static, Vec<Remaining>>,
    response: Option<Res>,
    after: After<Req, K, R>,
}

/// A waiting request's decision: admitted, with what follows its response, or refused.
pub(crate) type Decision<K> = BoxFuture<'static, Result<Admission, Rejection<K>>>;

/// An admission with the policy that adds to its response.
pub(crate) struct After<Req, K, R> {
    admission: Admission,
    policy: Arc<RequestPolicy<Req, K, R>>,
}

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

    /// The inner service's future, and what follows its response.
    pub(crate) fn admitted(
        future: S::Future,
        admission: Admission,
        policy: &Arc<RequestPolicy<Req, K, R>>,
    ) -> Self {
        Self {
            state: State::after(future, admission, policy),
        }
    }

    pub(crate) fn rejected(response: Result<S::Response, S::Error>) -> Self {
        Self {
            state: State::Rejected {
                response: Box::new(Some(response)),
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
                parked: Some(Box::new(Parked {
                    inner,
                    request,
                    policy,
                })),
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
                StateProj::After { future, after } => {
                    let response = ready!(future.poll(cx))?;
                    match after.settle(response) {
                        Ok(response) => return Poll::Ready(Ok(response)),
                        Err((charge, response)) => {
                            let after = After {
                                admission: std::mem::take(&mut after.admission),
                                policy: after.policy.clone(),
                            };
                            state.set(State::Charging {
                                charging: Box::new(Charging {
                                    charge,
                                    response: Some(response),
                                    after,
                                }),
                            });
                        }
                    }
                }
                StateProj::Charging { charging } => {
                    charging.after.admission.remaining =
                        ready!(charging.charge.as_mut().poll(cx)).into();
                    // Always Some here: it is taken only on the way out.
                    let Some(mut response) = charging.response.take() else {
                        return Poll::Pending;
                    };
                    charging.after.annotate(&mut response);
                    return Poll::Ready(Ok(response));
                }
                StateProj::Rejected { response } => {
                    return match response.take() {
                        Some(response) => Poll::Ready(response),
                        None => Poll::Pending,
                    };
                }
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
        parked: &mut Option<Box<Parked<S, Req, K, R>>>,
        cx: &mut Context<'_>,
    ) -> Poll<State<S, Req, K, R>> {
        let verdict = ready!(decision.as_mut().poll(cx));
        // Always Some here: it is taken only on the way out of this state.
        let Some(parked) = parked.take() else {
            return Poll::Pending;
        };
        let Parked {
            mut inner,
            request,
            policy,
        } = *parked;
        Poll::Ready(match verdict {
            Ok(admission) => State::after(inner.call(request), admission, &policy),
            Err(rejection) => State::Rejected {
                response: Box::new(Some(policy.on_rejection.on_rejection(&request, rejection))),
            },
        })
    }
}

impl<S: Service<Req>, Req, K, R> State<S, Req, K, R> {
    fn after(
        future: S::Future,
        admission: Admission,
        policy: &Arc<RequestPolicy<Req, K, R>>,
    ) -> Self {
        if admission.is_plain() {
            return State::Called { future };
        }
        let after = After {
            admission,
            policy: policy.clone(),
        };
        State::After { future, after }
    }
}

impl<Req, K, R> After<Req, K, R> {
    /// Settles the request's cost from `response` and adds the state of its limits; or, when
    /// settling left debt to charge to the global store, gives back the charge to wait for
    /// first.
    #[allow(clippy::type_complexity)] // Either the response, or it with what to wait for.
    fn settle<Res, E>(
        &mut self,
        mut response: Res,
    ) -> Result<Res, (BoxFuture<'static, Vec<Remaining>>, Res)>
    where
        R: OnRejection<Req, K, Res, E>,
    {
        if let Some(settling) = self.admission.settle.take() {
            let actual = self.policy.on_rejection.settle(&response, settling.charged);
            match (settling.finish)(actual) {
                Corrected::Done(remaining) => self.admission.remaining = remaining.into(),
                Corrected::Charging(charge) => return Err((charge, response)),
            }
        }
        self.annotate(&mut response);
        Ok(response)
    }

    fn annotate<Res, E>(&self, response: &mut Res)
    where
        R: OnRejection<Req, K, Res, E>,
    {
        if !self.admission.remaining.is_empty() {
            let one_limit = self.policy.one_limit.as_ref();
            let on_rejection = &self.policy.on_rejection;
            self.admission.remaining.with_slice(one_limit, |remaining| {
                on_rejection.on_admitted(response, remaining)
            });
        }
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

// Every payload a thin box, so the whole decision is two words, returned in registers: an
// admission (the common case) is then never stored and reloaded on its way to the caller.
enum AcquireState<K> {
    /// Admitted from leased tokens, at the time given (0: not known).
    Admitted(u64),
    Rejected(Box<Rejection<K>>),
    Waiting(Box<crate::throttle::Decision<K>>),
    Done,
}

// Nothing in it is pinned: the waiting future is boxed.
impl<K> Unpin for Acquire<K> {}

impl<K> Acquire<K> {
    /// Admitted from leased tokens at `at` (see [`Admitted`]'s time).
    #[inline]
    pub(crate) fn admitted(at: u64) -> Self {
        Self {
            state: AcquireState::Admitted(at),
        }
    }

    pub(crate) fn rejected(rejection: Box<Rejection<K>>) -> Self {
        Self {
            state: AcquireState::Rejected(rejection),
        }
    }

    pub(crate) fn waiting(decision: crate::throttle::Decision<K>) -> Self {
        Self {
            state: AcquireState::Waiting(Box::new(decision)),
        }
    }
}

impl<K> Future for Acquire<K> {
    type Output = Result<Admitted, Rejection<K>>;

    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let state = &mut self.get_mut().state;
        if let AcquireState::Waiting(decision) = state {
            let decided = ready!(Pin::as_mut(decision).poll(cx));
            *state = AcquireState::Done;
            return Poll::Ready(decided);
        }
        match std::mem::replace(state, AcquireState::Done) {
            AcquireState::Admitted(at) => Poll::Ready(Ok(Admitted::leased_at(at))),
            AcquireState::Rejected(rejection) => Poll::Ready(Err(*rejection)),
            AcquireState::Waiting(_) | AcquireState::Done => Poll::Pending,
        }
    }
}

impl<K> std::fmt::Debug for Acquire<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.state {
            AcquireState::Admitted(_) => "admitted",
            AcquireState::Rejected(_) => "rejected",
            AcquireState::Waiting(_) => "waiting",
            AcquireState::Done => "done",
        };
        f.debug_struct("Acquire").field("state", &state).finish()
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::future::{Ready, ready};
    use std::task::Waker;

    use axum_core::body::Body;
    use http::{Request, Response, StatusCode};
    use tower::util::{ServiceFn, service_fn};
    use tower_layer::Layer;

    use super::*;
    use crate::{HierarchicalThrottleLayer, Limit, MemoryGlobalStore, key};

    /// A service answering at once: its future is a ready response.
    type Answer = ServiceFn<fn(Request<()>) -> Ready<Result<Response<Body>, Infallible>>>;

    fn answer() -> Answer {
        service_fn(|_| ready(Ok(Response::new(Body::empty()))))
    }

    #[test]
    fn the_future_is_the_inner_one_and_what_follows_an_admitted_response() {
        type Throttled =
            ResponseFuture<Answer, Request<()>, key::CompactKey, crate::DefaultRejection>;
        let inner = size_of::<<Answer as Service<Request<()>>>::Future>();
        let after = size_of::<After<Request<()>, key::CompactKey, crate::DefaultRejection>>();
        // The layer's one limit travels as three numbers, not as its whole description.
        assert!(after <= 64, "{after} bytes follow an admitted response");
        // The rarer states (a refusal, a wait, a charge after settling) stay boxed.
        assert!(size_of::<Throttled>() <= inner + after + size_of::<usize>());
    }

    #[tokio::test]
    async fn a_refusal_polled_again_stays_pending() {
        let layer = HierarchicalThrottleLayer::builder()
            .key_ref(|req: &Request<()>| key::header_bytes(req, "x-api-key"))
            .limit(Limit::per_minute(1).burst(1).unwrap())
            .global_store(MemoryGlobalStore::new())
            .build()
            .unwrap();
        let mut service = layer.layer(answer());
        let request = || {
            Request::get("/")
                .header("x-api-key", "k1")
                .body(())
                .unwrap()
        };
        assert_eq!(
            service.call(request()).await.unwrap().status(),
            StatusCode::OK
        );
        // Refused after asking the global store: the key is now known to be throttled ...
        let asked = service.call(request()).await.unwrap();
        assert_eq!(asked.status(), StatusCode::TOO_MANY_REQUESTS);
        // ... so the next refusal is ready at once.
        let mut context = Context::from_waker(Waker::noop());
        let mut refused = Box::pin(service.call(request()));
        let first = refused.as_mut().poll(&mut context);
        assert!(matches!(first, Poll::Ready(Ok(r)) if r.status() == StatusCode::TOO_MANY_REQUESTS));
        assert!(refused.as_mut().poll(&mut context).is_pending());
    }
}

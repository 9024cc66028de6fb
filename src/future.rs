//! The throttling service's response future.

use std::future::{Future, Ready, ready};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use futures_util::future::BoxFuture;
use pin_project_lite::pin_project;
use tower_service::Service;

use crate::layer::RequestPolicy;
use crate::response::{OnRejection, Rejection};

pin_project! {
    /// Response future of [`HierarchicalThrottle`](crate::HierarchicalThrottle): the inner
    /// service's future, an immediate rejection, or a wait for a batch from the global store.
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
        Rejected {
            #[pin]
            response: Ready<Result<S::Response, S::Error>>,
        },
        Waiting {
            decision: BoxFuture<'static, Result<(), Rejection<K>>>,
            parked: Option<Parked<S, Req, K, R>>,
        },
    }
}

/// A request waiting for its decision, with the ready service that will serve it.
struct Parked<S, Req, K, R> {
    inner: S,
    request: Req,
    policy: Arc<RequestPolicy<Req, K, R>>,
}

impl<S: Service<Req>, Req, K, R> ResponseFuture<S, Req, K, R> {
    pub(crate) fn called(future: S::Future) -> Self {
        Self {
            state: State::Called { future },
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
        decision: BoxFuture<'static, Result<(), Rejection<K>>>,
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

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut state = self.project().state;
        loop {
            let next = match state.as_mut().project() {
                StateProj::Called { future } => return future.poll(cx),
                StateProj::Rejected { response } => return response.poll(cx),
                StateProj::Waiting { decision, parked } => {
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
                    match verdict {
                        Ok(()) => State::Called {
                            future: inner.call(request),
                        },
                        Err(rejection) => State::Rejected {
                            response: ready(policy.on_rejection.on_rejection(&request, rejection)),
                        },
                    }
                }
            };
            state.set(next);
        }
    }
}

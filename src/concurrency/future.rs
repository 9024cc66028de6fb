//! The response future of [`HierarchicalConcurrency`](crate::HierarchicalConcurrency).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use http::Response;
use pin_project_lite::pin_project;
use tower_service::Service;

use crate::concurrency::{AdmittedFields, SlotBody};
use crate::in_flight::{NoSlot, SlotPermit, WaitForSlot};

/// Answers a request refused after its wait (it reads the request's headers); `None` in
/// shadow mode, where the request is served without a slot.
pub(crate) type Refuse<Req, B, E> =
    Box<dyn FnOnce(NoSlot, &Req) -> Option<Result<Response<B>, E>> + Send>;

pin_project! {
    /// The response future of [`HierarchicalConcurrency`](crate::HierarchicalConcurrency):
    /// the wait for a slot when this host had none free, then the inner service's future.
    /// Its response's body holds the slot ([`SlotBody`]).
    pub struct ResponseFuture<S, Req, B>
    where
        S: Service<Req, Response = Response<B>>,
    {
        #[pin]
        state: State<S, Req, B>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, Req, B>
    where
        S: Service<Req, Response = Response<B>>,
    {
        Waiting {
            #[pin]
            wait: WaitForSlot,
            // Taken once the wait ends: what calls the service, or answers the refusal.
            then: Option<(S, Req, Refuse<Req, B, S::Error>)>,
            fields: Option<AdmittedFields>,
        },
        Calling {
            #[pin]
            future: S::Future,
            permit: Option<SlotPermit>,
            fields: Option<AdmittedFields>,
        },
        Answered {
            response: Option<Result<Response<B>, S::Error>>,
        },
    }
}

impl<S, Req, B> ResponseFuture<S, Req, B>
where
    S: Service<Req, Response = Response<B>>,
{
    pub(crate) fn calling(
        future: S::Future,
        permit: Option<SlotPermit>,
        fields: Option<AdmittedFields>,
    ) -> Self {
        Self {
            state: State::Calling {
                future,
                permit,
                fields,
            },
        }
    }

    pub(crate) fn answered(response: Result<Response<B>, S::Error>) -> Self {
        Self {
            state: State::Answered {
                response: Some(response),
            },
        }
    }

    pub(crate) fn waiting(
        wait: WaitForSlot,
        (service, request): (S, Req),
        refuse: Refuse<Req, B, S::Error>,
        fields: Option<AdmittedFields>,
    ) -> Self {
        Self {
            state: State::Waiting {
                wait,
                then: Some((service, request, refuse)),
                fields,
            },
        }
    }
}

impl<S, Req, B> Future for ResponseFuture<S, Req, B>
where
    S: Service<Req, Response = Response<B>>,
{
    type Output = Result<Response<SlotBody<B>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut state = self.project().state;
        loop {
            match state.as_mut().project() {
                StateProj::Waiting { wait, then, fields } => {
                    let verdict = ready!(wait.poll(cx));
                    let Some((mut service, request, refuse)) = then.take() else {
                        // Polled again after it ended: nothing left to answer with.
                        return Poll::Pending;
                    };
                    let (permit, answer) = match verdict {
                        Ok(permit) => (Some(permit), None),
                        Err(no_slot) => (None, refuse(no_slot, &request)),
                    };
                    let next = match answer {
                        Some(response) => State::Answered {
                            response: Some(response),
                        },
                        // Admitted, or served without a slot in shadow mode.
                        None => State::Calling {
                            future: service.call(request),
                            permit,
                            fields: fields.take(),
                        },
                    };
                    state.set(next);
                }
                StateProj::Calling {
                    future,
                    permit,
                    fields,
                } => {
                    let mut response = ready!(future.poll(cx))?;
                    let permit = permit.take();
                    if let Some(fields) = fields.as_ref() {
                        fields.append_to(response.headers_mut(), permit.as_ref());
                    }
                    return Poll::Ready(Ok(response.map(|body| SlotBody::new(body, permit))));
                }
                StateProj::Answered { response } => {
                    let Some(response) = response.take() else {
                        return Poll::Pending;
                    };
                    return Poll::Ready(response.map(|r| r.map(|body| SlotBody::new(body, None))));
                }
            }
        }
    }
}

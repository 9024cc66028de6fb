//! The answers: how a rejection becomes a response (HTTP or gRPC), and what admitted
//! responses are told of their limits. This floor turns the engine's plain decisions
//! ([`Rejection`], [`Remaining`]) into responses; it uses the model below it and nothing of
//! the engine or the tower surface above.

pub mod grpc;
mod headers;
mod http;
mod settle;
mod x_ratelimit;

use ::http::Response;

use crate::rejection::Rejection;
use crate::remaining::Remaining;

pub use self::headers::append_ratelimit_fields;
pub(crate) use self::headers::{
    append_concurrency_fields, concurrency_policy, insert_ratelimit_fields,
};
pub use self::http::{http_problem_response, http_response};
pub use self::settle::Settle;

/// Turns a [`Rejection`] into the wrapped service's response or error, and tells admitted
/// responses what their limits hold.
///
/// Implemented by [`DefaultRejection`] for HTTP and gRPC, and by any closure
/// `Fn(&Request, Rejection<K>) -> Result<Response, Error>` (which adds nothing to admitted
/// responses).
pub trait OnRejection<Req, K, Res, E>: Send + Sync + 'static {
    /// The answer to a refused `request`.
    fn on_rejection(&self, request: &Req, rejection: Rejection<K>) -> Result<Res, E>;

    /// Whether [`on_admitted`](Self::on_admitted) does anything: the throttle reads the
    /// limits' state for admitted responses only when it does. Default: `false`.
    fn annotates_admitted(&self) -> bool {
        false
    }

    /// Adds what the limits a request drew on hold after it (one [`Remaining`] per limit, at
    /// every level) to its response: [`DefaultRejection`] writes the `RateLimit-Policy` and
    /// `RateLimit` fields. In [shadow mode](crate::Builder::shadow), a request that would have
    /// been throttled gets the fields of its refusal (no tokens left, its wait). Default:
    /// nothing.
    fn on_admitted(&self, response: &mut Res, remaining: &[Remaining]) {
        let _ = (response, remaining);
    }

    /// Whether [`settle`](Self::settle) may correct costs: the throttle keeps a request's keys
    /// for it only then. Default: `false`.
    fn settles(&self) -> bool {
        false
    }

    /// The cost an admitted request charged `charged` tokens really had, read from its
    /// response ([`Builder::settle`](crate::Builder::settle)). Default: `charged`.
    fn settle(&self, response: &Res, charged: u64) -> u64 {
        let _ = response;
        charged
    }
}

impl<F, Req, K, Res, E> OnRejection<Req, K, Res, E> for F
where
    F: Fn(&Req, Rejection<K>) -> Result<Res, E> + Send + Sync + 'static,
{
    fn on_rejection(&self, request: &Req, rejection: Rejection<K>) -> Result<Res, E> {
        self(request, rejection)
    }
}

/// The default answer for HTTP and gRPC services: a response, never an error, so the layer
/// keeps the inner service's error type and axum needs no `HandleErrorLayer`.
///
/// It tells gRPC calls from plain HTTP by their `content-type` (`application/grpc…`), so one
/// layer can front a server that serves both; [`DefaultRejection::http`] and
/// [`DefaultRejection::grpc`] force one answer.
///
/// Plain HTTP ([`http_response`]):
///
/// | reason | status | headers |
/// |---|---|---|
/// | throttled | 429 Too Many Requests | `Retry-After`, `RateLimit-Policy`, `RateLimit` |
/// | cost above capacity | 413 Content Too Large | `RateLimit-Policy` |
/// | missing key | 400 Bad Request | |
/// | store unavailable | 503 Service Unavailable | `Retry-After` |
///
/// Admitted responses get `RateLimit-Policy` and `RateLimit` too, one item per limit the
/// request drew on ([`append_ratelimit_fields`]), unless the layer is built with
/// [`ratelimit_fields(false)`](crate::Builder::ratelimit_fields);
/// [`x_ratelimit_headers`](Self::x_ratelimit_headers) adds the de facto `X-RateLimit-*`.
///
/// Bodies say why, in words, when the body type holds text ([`http_response`]), or as problem
/// details ([`http_problem_response`]) to a client whose `Accept` names
/// `application/problem+json`; a [`MissingKey::RejectWith`](crate::MissingKey::RejectWith)
/// sets its own status and words.
///
/// `Retry-After` is in whole seconds rounded up. `RateLimit-Policy` and `RateLimit` follow
/// revision 11 of the IETF draft ([`RateLimitFields`](crate::RateLimitFields)), naming the
/// refusing limit (`"per-day";q=<tokens per window>;qu="requests";w=<window>` and
/// `"per-day";r=0;t=<Retry-After>`; `tenant/per-day` at a further level), with every integer
/// clamped to the 15 digits Structured Fields allow.
///
/// gRPC ([`grpc_response`](crate::grpc::grpc_response)): HTTP 200 with `grpc-status`
/// `RESOURCE_EXHAUSTED` (throttled), `UNAVAILABLE` (store unavailable) or `INVALID_ARGUMENT`
/// (missing key, cost above capacity), a `grpc-message` saying why, and when a retry can
/// succeed, `retry-after` metadata and a `google.rpc.RetryInfo` status detail.
#[derive(Debug, Clone, Copy, Default)]
pub struct DefaultRejection {
    protocol: Protocol,
    x_ratelimit: bool,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Protocol {
    #[default]
    ByContentType,
    Http,
    Grpc,
}

impl DefaultRejection {
    /// Answers gRPC calls as gRPC and everything else as HTTP (the default).
    pub fn by_content_type() -> Self {
        Self::default()
    }

    /// Always answers as plain HTTP.
    pub fn http() -> Self {
        Self {
            protocol: Protocol::Http,
            ..Self::default()
        }
    }

    /// Always answers as gRPC.
    pub fn grpc() -> Self {
        Self {
            protocol: Protocol::Grpc,
            ..Self::default()
        }
    }

    /// Also writes the de facto `X-RateLimit-Limit`, `X-RateLimit-Remaining` and
    /// `X-RateLimit-Reset` headers (off by default), for clients written against them, beside
    /// the IETF fields. They speak of one limit, as those clients expect: the limit's capacity,
    /// the whole tokens left and, in seconds rounded up, how long until what is missing comes
    /// back. On an admitted response that is the limit with the fewest tokens left (of every
    /// layer that writes them), and the reset is when it is full again; on a throttled refusal
    /// it is the refusing limit, with none left, and the reset is its `Retry-After`. Seconds
    /// from now, not a time on the calendar: a client's clock may be off. Admitted responses
    /// get them while the layer's [`RateLimit` fields](crate::Builder::ratelimit_fields) are
    /// on (the default), which is when the limits' state is read. A
    /// [concurrency layer](crate::HierarchicalConcurrencyLayer) answering with it writes them
    /// on a refusal for too many requests in flight (the limit, none left, its `Retry-After`),
    /// not on admitted responses: slots come back when requests end, not at a time a reset
    /// could name.
    pub fn x_ratelimit_headers(mut self, on: bool) -> Self {
        self.x_ratelimit = on;
        self
    }
}

impl<ReqB, K, ResB, E> OnRejection<::http::Request<ReqB>, K, Response<ResB>, E> for DefaultRejection
where
    ResB: Default + 'static,
    K: 'static,
{
    fn on_rejection(
        &self,
        request: &::http::Request<ReqB>,
        rejection: Rejection<K>,
    ) -> Result<Response<ResB>, E> {
        let grpc = match self.protocol {
            Protocol::ByContentType => grpc::is_grpc(request.headers()),
            Protocol::Http => false,
            Protocol::Grpc => true,
        };
        let mut response = if grpc {
            grpc::grpc_response(&rejection)
        } else if self::http::accepts_problem(request.headers()) {
            http_problem_response(&rejection)
        } else {
            http_response(&rejection)
        };
        if self.x_ratelimit {
            x_ratelimit::insert_refused(response.headers_mut(), &rejection);
        }
        Ok(response)
    }

    fn annotates_admitted(&self) -> bool {
        true
    }

    fn on_admitted(&self, response: &mut Response<ResB>, remaining: &[Remaining]) {
        append_ratelimit_fields(response.headers_mut(), remaining);
        if self.x_ratelimit {
            x_ratelimit::insert_admitted(response.headers_mut(), remaining);
        }
    }
}

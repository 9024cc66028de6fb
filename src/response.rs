//! Rejections, and how they become responses.

use std::fmt;
use std::time::Duration;

use http::{HeaderName, HeaderValue, Response, StatusCode, header};

use crate::limit::Limit;
use crate::remaining::Remaining;

/// Why a request was not served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RejectionReason {
    /// The key's tokens are used up, fleet-wide (or, while the global store is unavailable,
    /// on this host's fallback bucket). Retry after [`Rejection::retry_after`].
    Throttled,
    /// The request costs more tokens than the bucket can ever hold: it can never be served.
    CostExceedsCapacity {
        /// The request's cost.
        cost: u64,
        /// The bucket's capacity.
        capacity: u64,
    },
    /// The key closure found no key, and the [`MissingKey`](crate::MissingKey) policy rejects.
    MissingKey,
    /// The global store failed and the [`FailurePolicy`](crate::FailurePolicy) rejects.
    StoreUnavailable,
}

impl fmt::Display for RejectionReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Throttled => f.write_str("rate limit exceeded"),
            Self::CostExceedsCapacity { cost, capacity } => write!(
                f,
                "request costs {cost} tokens but the limit holds at most {capacity}"
            ),
            Self::MissingKey => f.write_str("request has no throttle key"),
            Self::StoreUnavailable => f.write_str("rate limit store unavailable"),
        }
    }
}

/// A request the throttle refused, with everything needed to answer the client.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Rejection<K> {
    /// The request's key, if it had one.
    pub key: Option<K>,
    /// Why it was refused.
    pub reason: RejectionReason,
    /// How long until a retry can succeed, when one can.
    pub retry_after: Option<Duration>,
    /// The refusing limit, when one applies.
    pub limit: Option<Limit>,
    /// The refusing limit's name ([`DEFAULT_NAME`](crate::quota::DEFAULT_NAME) for a layer
    /// given a single [`Limit`]).
    pub limit_name: Option<&'static str>,
    /// The level the refusing limit belongs to; `None` at the layer's first level.
    pub level: Option<&'static str>,
    /// The status to answer with instead of the reason's own, when the layer was told one
    /// ([`MissingKey::RejectWith`](crate::MissingKey::RejectWith)).
    pub status: Option<StatusCode>,
    /// What to tell the client instead of the reason, when the layer was told.
    pub message: Option<&'static str>,
}

impl<K> Rejection<K> {
    pub(crate) fn new(key: Option<K>, reason: RejectionReason) -> Self {
        Self {
            key,
            reason,
            retry_after: None,
            limit: None,
            limit_name: None,
            level: None,
            status: None,
            message: None,
        }
    }

    pub(crate) fn answered(mut self, status: StatusCode, message: &'static str) -> Self {
        self.status = Some(status);
        self.message = Some(message);
        self
    }

    pub(crate) fn of_limit(
        mut self,
        limit: Limit,
        name: &'static str,
        level: Option<&'static str>,
    ) -> Self {
        self.limit = Some(limit);
        self.limit_name = Some(name);
        self.level = level;
        self
    }

    /// The refusing limit's name as `RateLimit-Policy` shows it: `per-second`, or
    /// `tenant/per-second` at a further level.
    pub fn policy_name(&self) -> Option<std::borrow::Cow<'static, str>> {
        Some(crate::quota::scope(self.level, self.limit_name?))
    }

    pub(crate) fn with_retry_after(mut self, wait: Duration) -> Self {
        self.retry_after = Some(wait);
        self
    }

    /// [`retry_after`](Self::retry_after) in whole seconds, rounded up (so never 0 when a wait
    /// is needed), as `Retry-After` wants it.
    pub fn retry_after_secs(&self) -> Option<u64> {
        self.retry_after.map(ceil_secs)
    }
}

impl<K> fmt::Display for Rejection<K> {
    /// The reason, the refusing limit and the wait: `rate limit exceeded (limit per-day,
    /// retry in 3 s)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.reason)?;
        match (self.policy_name(), self.retry_after_secs()) {
            (Some(name), Some(secs)) => write!(f, " (limit {name}, retry in {secs} s)"),
            (Some(name), None) => write!(f, " (limit {name})"),
            (None, Some(secs)) => write!(f, " (retry in {secs} s)"),
            (None, None) => Ok(()),
        }
    }
}

/// So that `?` carries a refusal out of code that uses [`acquire`](crate::HierarchicalThrottleLayer::acquire).
impl<K: fmt::Debug> std::error::Error for Rejection<K> {}

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
/// [`ratelimit_fields(false)`](crate::Builder::ratelimit_fields).
///
/// Bodies say why, in words, when the body type holds text ([`http_response`]); a
/// [`MissingKey::RejectWith`](crate::MissingKey::RejectWith) sets its own status and words.
///
/// `Retry-After` is in whole seconds rounded up. `RateLimit-Policy` and `RateLimit` follow the
/// IETF draft, naming the refusing limit (`"per-day";q=<capacity>;w=<seconds an empty bucket
/// takes to fill>` and `"per-day";r=0;t=<seconds>`; `tenant/per-day` at a further level), with
/// every integer clamped to the 15 digits Structured Fields allow.
///
/// gRPC ([`grpc_response`](crate::grpc::grpc_response)): HTTP 200 with `grpc-status`
/// `RESOURCE_EXHAUSTED` (throttled), `UNAVAILABLE` (store unavailable) or `INVALID_ARGUMENT`
/// (missing key, cost above capacity), a `grpc-message` saying why, and when a retry can
/// succeed, `retry-after` metadata and a `google.rpc.RetryInfo` status detail.
#[derive(Debug, Clone, Copy, Default)]
pub struct DefaultRejection {
    protocol: Protocol,
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
        }
    }

    /// Always answers as gRPC.
    pub fn grpc() -> Self {
        Self {
            protocol: Protocol::Grpc,
        }
    }
}

impl<ReqB, K, ResB, E> OnRejection<http::Request<ReqB>, K, Response<ResB>, E> for DefaultRejection
where
    ResB: Default + 'static,
    K: 'static,
{
    fn on_rejection(
        &self,
        request: &http::Request<ReqB>,
        rejection: Rejection<K>,
    ) -> Result<Response<ResB>, E> {
        let grpc = match self.protocol {
            Protocol::ByContentType => crate::grpc::is_grpc(request.headers()),
            Protocol::Http => false,
            Protocol::Grpc => true,
        };
        Ok(if grpc {
            crate::grpc::grpc_response(&rejection)
        } else {
            http_response(&rejection)
        })
    }

    fn annotates_admitted(&self) -> bool {
        true
    }

    fn on_admitted(&self, response: &mut Response<ResB>, remaining: &[Remaining]) {
        append_ratelimit_fields(response.headers_mut(), remaining);
    }
}

/// Appends `RateLimit-Policy` and `RateLimit` for `remaining`, one list item per limit:
/// `"<name>";q=<capacity>;w=<seconds to fill>` and `"<name>";r=<tokens left>;t=<seconds until
/// more>`. Appended, not replaced: fields from another layer stay, and the lines combine into
/// one list.
pub fn append_ratelimit_fields(headers: &mut http::HeaderMap, remaining: &[Remaining]) {
    if remaining.is_empty() {
        return;
    }
    let policy = match remaining {
        [only] => single_policy(only),
        _ => header_value(list(remaining, POLICY_PARAMS, policy_values)),
    };
    let state = list(remaining, STATE_PARAMS, |r| {
        (r.tokens, ceil_secs(r.next_in))
    });
    headers.append(RATELIMIT_POLICY, policy);
    headers.append(RATELIMIT, header_value(state));
}

const POLICY_PARAMS: [&[u8]; 2] = [b";q=", b";w="];
const STATE_PARAMS: [&[u8]; 2] = [b";r=", b";t="];

/// A `RateLimit-Policy` item's values: `q`, the capacity, and `w`, the seconds an empty bucket
/// takes to fill. A client reads the burst as `q` and the rate as `q/w`; with `w` rounded up,
/// a client pacing itself at `q/w` never runs ahead of the bucket.
fn policy_values(r: &Remaining) -> (u64, u64) {
    (r.limit.capacity(), window_secs(&r.limit))
}

/// `RateLimit-Policy` for one limit. It changes only with the limit, so each thread keeps the
/// last one it wrote and hands out clones of it (a reference count) while the limit is the
/// same.
fn single_policy(r: &Remaining) -> HeaderValue {
    type Last = Option<((Option<&'static str>, &'static str, Limit), HeaderValue)>;
    thread_local! {
        static LAST: std::cell::RefCell<Last> = const { std::cell::RefCell::new(None) };
    }
    let same_name = |a: Option<&str>, b: Option<&str>| match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => std::ptr::eq(a, b),
        _ => false,
    };
    LAST.with_borrow_mut(|last| {
        if let Some(((level, name, limit), value)) = last.as_ref()
            && same_name(*level, r.level)
            && std::ptr::eq(*name, r.limit_name)
            && *limit == r.limit
        {
            return value.clone();
        }
        let value = header_value(list(std::slice::from_ref(r), POLICY_PARAMS, policy_values));
        *last = Some(((r.level, r.limit_name, r.limit), value.clone()));
        value
    })
}

/// A list of items `"<name>";<p1>=<v1>;<p2>=<v2>`, one per limit, with `params` and `values`
/// (`q` and `w` for `RateLimit-Policy`, `r` and `t` for `RateLimit`). Written by hand:
/// `format!` would cost more than the decision whose state it reports.
fn list(
    remaining: &[Remaining],
    params: [&[u8]; 2],
    values: impl Fn(&Remaining) -> (u64, u64),
) -> Vec<u8> {
    let mut out = Vec::with_capacity(40 * remaining.len());
    for (i, r) in remaining.iter().enumerate() {
        if i > 0 {
            out.extend_from_slice(b", ");
        }
        out.push(b'"');
        out.extend_from_slice(r.policy_name().as_bytes());
        out.push(b'"');
        let (first, second) = values(r);
        out.extend_from_slice(params[0]);
        push_integer(&mut out, first);
        out.extend_from_slice(params[1]);
        push_integer(&mut out, second);
    }
    out
}

/// Appends `n` in decimal, capped at the largest Structured Field integer.
fn push_integer(out: &mut Vec<u8>, n: u64) {
    let mut n = sf_integer(n);
    let mut digits = [0u8; 20];
    let mut start = digits.len();
    loop {
        start -= 1;
        // A digit: always below 10.
        digits[start] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[start..]);
}

/// The HTTP response [`DefaultRejection`] gives for `rejection`: its status and headers, and
/// for bodies that can hold text (axum's and hyper's `Body`, `String`, `Vec<u8>`, `Bytes`) why,
/// in words (`rate limit exceeded (limit per-day, retry in 3 s)`); other bodies are empty.
pub fn http_response<K, B: Default + 'static>(rejection: &Rejection<K>) -> Response<B> {
    let status = rejection.status.unwrap_or(match rejection.reason {
        RejectionReason::Throttled => StatusCode::TOO_MANY_REQUESTS,
        RejectionReason::CostExceedsCapacity { .. } => StatusCode::PAYLOAD_TOO_LARGE,
        RejectionReason::MissingKey => StatusCode::BAD_REQUEST,
        RejectionReason::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
    });
    let text = match rejection.message {
        Some(message) => message.to_owned(),
        None => rejection.to_string(),
    };
    let (body, written) = text_body(text);
    let mut response = Response::new(body);
    *response.status_mut() = status;
    let headers = response.headers_mut();
    if written {
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
    }
    if let Some(secs) = rejection.retry_after_secs() {
        headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    insert_ratelimit_fields(headers, rejection);
    response
}

/// A body of type `B` holding `text` if `B` is one of the body types that hold bytes, else
/// `B`'s default; and whether the text went in.
fn text_body<B: Default + 'static>(text: String) -> (B, bool) {
    use std::any::Any;
    let mut slot: Option<B> = None;
    let any: &mut dyn Any = &mut slot;
    if let Some(slot) = any.downcast_mut::<Option<axum_core::body::Body>>() {
        *slot = Some(axum_core::body::Body::from(text));
    } else if let Some(slot) = any.downcast_mut::<Option<String>>() {
        *slot = Some(text);
    } else if let Some(slot) = any.downcast_mut::<Option<Vec<u8>>>() {
        *slot = Some(text.into_bytes());
    } else if let Some(slot) = any.downcast_mut::<Option<bytes::Bytes>>() {
        *slot = Some(bytes::Bytes::from(text));
    }
    match slot {
        Some(body) => (body, true),
        None => (B::default(), false),
    }
}

/// `RateLimit-Policy` for the refusing limit, and for a throttled request `RateLimit` with no
/// tokens left and the seconds until there are.
pub(crate) fn insert_ratelimit_fields<K>(headers: &mut http::HeaderMap, rejection: &Rejection<K>) {
    let (Some(limit), Some(limit_name)) = (rejection.limit, rejection.limit_name) else {
        return;
    };
    let refusing = Remaining {
        limit_name,
        level: rejection.level,
        limit,
        tokens: 0,
        next_in: Duration::ZERO,
        full_in: Duration::ZERO,
    };
    headers.insert(RATELIMIT_POLICY, single_policy(&refusing));
    if let (RejectionReason::Throttled, Some(secs)) =
        (rejection.reason, rejection.retry_after_secs())
    {
        let state = list(std::slice::from_ref(&refusing), STATE_PARAMS, |_| (0, secs));
        headers.insert(RATELIMIT, header_value(state));
    }
}

/// The seconds an empty bucket of `limit` takes to fill, rounded up: `RateLimit-Policy`'s `w`.
/// Computed exactly (a `Duration` of microseconds saturates for the largest limits), then
/// capped at the largest Structured Field integer.
fn window_secs(limit: &Limit) -> u64 {
    let micros = u128::from(limit.capacity()) * limit.refill_period().as_micros();
    let secs = micros.div_ceil(u128::from(limit.refill_amount()) * 1_000_000);
    sf_integer(u64::try_from(secs).unwrap_or(u64::MAX))
}

const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// The largest integer a Structured Field holds (15 digits).
const SF_INTEGER_MAX: u64 = 999_999_999_999_999;

fn sf_integer(n: u64) -> u64 {
    n.min(SF_INTEGER_MAX)
}

fn header_value(s: impl Into<Vec<u8>>) -> HeaderValue {
    // Built only from digits, names and fixed ASCII, so always a valid header value.
    HeaderValue::try_from(s.into()).unwrap_or_else(|_| HeaderValue::from_static(""))
}

/// Whole seconds, rounded up: never 0 for a wait that is not zero.
pub(crate) fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn remaining(level: Option<&'static str>, name: &'static str, limit: Limit) -> Remaining {
        Remaining {
            limit_name: name,
            level,
            limit,
            tokens: 1_234_567,
            next_in: Duration::from_millis(1_500),
            full_in: Duration::from_secs(9),
        }
    }

    fn fields(remaining: &[Remaining]) -> (String, String) {
        let mut headers = http::HeaderMap::new();
        append_ratelimit_fields(&mut headers, remaining);
        let text = |name| headers[name].to_str().unwrap().to_owned();
        (text(&RATELIMIT_POLICY), text(&RATELIMIT))
    }

    /// The policy kept for the last limit is handed out only for that same limit.
    #[test]
    fn fields_follow_each_limit_whatever_came_before() {
        let minute = Limit::per_minute(100).build().unwrap();
        let day = Limit::per_day(5).burst(10).unwrap();
        let a = remaining(None, "default", minute);
        let b = remaining(Some("tenant"), "default", minute);
        let c = remaining(None, "default", day);
        for _ in 0..2 {
            assert_eq!(
                fields(std::slice::from_ref(&a)),
                (
                    r#""default";q=100;w=60"#.to_owned(),
                    r#""default";r=1234567;t=2"#.to_owned()
                )
            );
            assert_eq!(
                fields(std::slice::from_ref(&b)).0,
                r#""tenant/default";q=100;w=60"#
            );
            assert_eq!(
                fields(std::slice::from_ref(&c)).0,
                r#""default";q=10;w=172800"#
            );
        }
        let (policy, state) = fields(&[a, c]);
        assert_eq!(policy, r#""default";q=100;w=60, "default";q=10;w=172800"#);
        // A limit at 1/s whose fill time overflows a microsecond count: `w` is the true fill
        // time, so a client reads the rate `q/w` as 1/s (a saturated count read 54/s).
        let large = Limit::per_second(1).burst(100_000_000_000_000).unwrap();
        assert_eq!(window_secs(&large), 100_000_000_000_000);
        // Past the largest Structured Field integer, `q` and `w` are capped alike: still 1/s.
        let huge = Limit::per_second(1).burst(Limit::MAX_CAPACITY).unwrap();
        assert_eq!(
            fields(&[remaining(None, "default", huge)]).0,
            r#""default";q=999999999999999;w=999999999999999"#
        );
        let slow = Limit::per(1, Limit::MAX_PERIOD)
            .burst(Limit::MAX_CAPACITY)
            .unwrap();
        assert_eq!(window_secs(&slow), SF_INTEGER_MAX);
        assert_eq!(state, r#""default";r=1234567;t=2, "default";r=1234567;t=2"#);
    }

    #[test]
    fn integers_are_written_in_full_up_to_the_structured_field_limit() {
        for (n, text) in [
            (0, "0"),
            (7, "7"),
            (10, "10"),
            (u64::from(u32::MAX), "4294967295"),
            (SF_INTEGER_MAX, "999999999999999"),
            (u64::MAX, "999999999999999"),
        ] {
            let mut out = Vec::new();
            push_integer(&mut out, n);
            assert_eq!(out, text.as_bytes());
        }
    }

    #[test]
    fn a_rejection_says_why_which_limit_and_how_long() {
        let limit = Limit::per_day(10).build().unwrap();
        let throttled = Rejection::new(Some(1), RejectionReason::Throttled)
            .of_limit(limit, "per-day", Some("tenant"))
            .with_retry_after(Duration::from_millis(2500));
        assert_eq!(
            throttled.to_string(),
            "rate limit exceeded (limit tenant/per-day, retry in 3 s)"
        );
        let missing = Rejection::<u64>::new(None, RejectionReason::MissingKey);
        assert_eq!(missing.to_string(), "request has no throttle key");
    }

    #[test]
    fn retry_after_rounds_up_and_is_never_zero_for_a_wait() {
        assert_eq!(ceil_secs(Duration::from_millis(1)), 1);
        assert_eq!(ceil_secs(Duration::from_millis(1000)), 1);
        assert_eq!(ceil_secs(Duration::from_millis(1001)), 2);
        assert_eq!(ceil_secs(Duration::ZERO), 0);
    }
}

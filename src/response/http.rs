//! Plain HTTP answers to rejections.

use http::{HeaderValue, Response, StatusCode, header};

use crate::rejection::{Rejection, RejectionReason};
use crate::response::headers::insert_ratelimit_fields;

/// The HTTP response [`DefaultRejection`](crate::DefaultRejection) gives for `rejection`: its status and headers, and
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

//! Plain HTTP answers to rejections.

use http::{HeaderMap, HeaderValue, Response, StatusCode, header};

use crate::rejection::{Rejection, RejectionReason};
use crate::response::headers::insert_ratelimit_fields;

/// The HTTP response [`DefaultRejection`](crate::DefaultRejection) gives for `rejection`: its status and headers, and
/// for bodies that can hold text (axum's and hyper's `Body`, `String`, `Vec<u8>`, `Bytes`) why,
/// in words (`rate limit exceeded (limit per-day, retry in 3 s)`); other bodies are empty.
pub fn http_response<K, B: Default + 'static>(rejection: &Rejection<K>) -> Response<B> {
    respond(rejection, false)
}

/// [`http_response`] with a problem details body (RFC 9457, `application/problem+json`)
/// instead of text: a throttled request gets the draft's `quota-exceeded` type with the
/// refusing limit in `violated-policies`; other refusals `about:blank` with their status's
/// title. [`DefaultRejection`](crate::DefaultRejection) answers so to clients whose `Accept`
/// names `application/problem+json`.
pub fn http_problem_response<K, B: Default + 'static>(rejection: &Rejection<K>) -> Response<B> {
    respond(rejection, true)
}

fn respond<K, B: Default + 'static>(rejection: &Rejection<K>, problem: bool) -> Response<B> {
    let status = rejection.status.unwrap_or(match rejection.reason {
        RejectionReason::Throttled | RejectionReason::TooManyInFlight { .. } => {
            StatusCode::TOO_MANY_REQUESTS
        }
        RejectionReason::CostExceedsCapacity { .. } => StatusCode::PAYLOAD_TOO_LARGE,
        RejectionReason::MissingKey => StatusCode::BAD_REQUEST,
        RejectionReason::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
    });
    let text = match rejection.message {
        Some(message) => message.to_owned(),
        None => {
            // Room for the usual sentence at once (`to_string` grows it three times).
            let mut text = String::with_capacity(64);
            let _ = std::fmt::Write::write_fmt(&mut text, format_args!("{rejection}"));
            text
        }
    };
    let (text, content_type) = match problem {
        true => (problem_details(rejection, status, &text), PROBLEM_JSON),
        false => (text, "text/plain; charset=utf-8"),
    };
    let (body, written) = text_body(text);
    let mut response = Response::new(body);
    *response.status_mut() = status;
    let headers = response.headers_mut();
    if written {
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    }
    // The body depends on `Accept`: caches must keep the two apart.
    headers.insert(header::VARY, HeaderValue::from_static("accept"));
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

const PROBLEM_JSON: &str = "application/problem+json";

/// Whether `headers` accept a problem details body: an `Accept` media range
/// `application/problem+json` whose weight is not zero.
pub(crate) fn accepts_problem(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .any(|range| {
            let mut parts = range.split(';').map(str::trim);
            let media = parts.next().unwrap_or_default();
            let refused = parts.any(|p| {
                p.strip_prefix("q=")
                    .and_then(|q| q.parse::<f32>().ok())
                    .is_some_and(|q| q <= 0.0)
            });
            media.eq_ignore_ascii_case(PROBLEM_JSON) && !refused
        })
}

/// The problem details object for `rejection`, answered with `status`; `detail` says why in
/// words.
fn problem_details<K>(rejection: &Rejection<K>, status: StatusCode, detail: &str) -> String {
    let mut json = String::with_capacity(256);
    let violated = match (rejection.reason, rejection.policy_name()) {
        (RejectionReason::Throttled | RejectionReason::TooManyInFlight { .. }, Some(name)) => {
            Some(name)
        }
        _ => None,
    };
    match violated {
        Some(_) => json.push_str(
            "{\"type\":\"https://iana.org/assignments/http-problem-types#quota-exceeded\",\
             \"title\":\"Request cannot be satisfied as assigned quota has been exceeded\"",
        ),
        None => {
            json.push_str("{\"type\":\"about:blank\",\"title\":");
            push_json_string(&mut json, status.canonical_reason().unwrap_or("Error"));
        }
    }
    json.push_str(",\"status\":");
    json.push_str(&status.as_u16().to_string());
    json.push_str(",\"detail\":");
    push_json_string(&mut json, detail);
    if let Some(name) = violated {
        json.push_str(",\"violated-policies\":[");
        push_json_string(&mut json, &name);
        json.push(']');
    }
    json.push('}');
    json
}

/// `text` as a JSON string, quoted and escaped.
fn push_json_string(json: &mut String, text: &str) {
    json.push('"');
    for c in text.chars() {
        match c {
            '"' => json.push_str("\\\""),
            '\\' => json.push_str("\\\\"),
            c if u32::from(c) < 0x20 => json.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => json.push(c),
        }
    }
    json.push('"');
}

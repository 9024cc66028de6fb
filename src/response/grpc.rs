//! gRPC answers: a rejected call ends with a gRPC status, not a bare HTTP status.
//!
//! gRPC clients read the outcome of a call from `grpc-status`, not from the HTTP status: tonic
//! maps a bare `429` to `UNAVAILABLE`, which clients retry at once. So a gRPC rejection is a
//! "trailers-only" response: HTTP 200, `content-type: application/grpc`, `grpc-status` and
//! `grpc-message`, plus `retry-after` (seconds, rounded up), the `ratelimit-policy` and
//! `ratelimit` fields as metadata, and a `grpc-status-details-bin` carrying a
//! `google.rpc.Status` with a `google.rpc.RetryInfo` detail and, when throttled, a
//! `google.rpc.QuotaFailure` naming the limit, encoded here without a protobuf dependency.
//! Admitted calls carry `ratelimit-policy` and `ratelimit` as initial metadata.

use http::{HeaderMap, HeaderValue, Response, StatusCode, header};

use crate::rejection::{Rejection, RejectionReason, ceil_secs};
use crate::response::insert_ratelimit_fields;

/// gRPC status codes used for rejections.
const INVALID_ARGUMENT: u32 = 3;
const RESOURCE_EXHAUSTED: u32 = 8;
const UNAVAILABLE: u32 = 14;

/// Whether `headers` belong to a gRPC call (`content-type: application/grpc…`).
pub fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|ct| ct.as_bytes().starts_with(b"application/grpc"))
}

/// The gRPC status code for `reason`: `RESOURCE_EXHAUSTED` when throttled (or too many in flight), `UNAVAILABLE` when
/// the store failed and the policy rejects, `INVALID_ARGUMENT` for a missing key or a cost the
/// limit can never serve (retrying the same call cannot help).
pub fn status_code(reason: &RejectionReason) -> u32 {
    match reason {
        RejectionReason::Throttled | RejectionReason::TooManyInFlight { .. } => RESOURCE_EXHAUSTED,
        RejectionReason::StoreUnavailable => UNAVAILABLE,
        RejectionReason::CostExceedsCapacity { .. } | RejectionReason::MissingKey => {
            INVALID_ARGUMENT
        }
    }
}

/// The trailers-only gRPC response for `rejection`.
pub fn grpc_response<K, B: Default>(rejection: &Rejection<K>) -> Response<B> {
    let code = status_code(&rejection.reason);
    let message = match rejection.message {
        Some(message) => message.to_owned(),
        None => rejection.reason.to_string(),
    };
    let mut response = Response::new(B::default());
    *response.status_mut() = StatusCode::OK;
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    headers.insert("grpc-status", HeaderValue::from(code));
    if let Ok(value) = HeaderValue::try_from(percent_encode(&message)) {
        headers.insert("grpc-message", value);
    }
    if let Some(wait) = rejection.retry_after {
        headers.insert("retry-after", HeaderValue::from(ceil_secs(wait)));
    }
    let details = details(rejection);
    if !details.is_empty() {
        let status = status(code, &message, &details);
        if let Ok(value) = HeaderValue::try_from(base64_unpadded(&status)) {
            headers.insert("grpc-status-details-bin", value);
        }
    }
    insert_ratelimit_fields(headers, rejection);
    response
}

/// `grpc-message` is percent-encoded: everything outside printable ASCII, and `%`.
fn percent_encode(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    for b in message.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The status details for `rejection`, each a `google.protobuf.Any`: a `google.rpc.RetryInfo`
/// when a retry can succeed, and a `google.rpc.QuotaFailure` naming the limit when throttled.
fn details<K>(rejection: &Rejection<K>) -> Vec<Vec<u8>> {
    let mut details = Vec::new();
    if let Some(wait) = rejection.retry_after {
        details.push(any("google.rpc.RetryInfo", &retry_info(wait)));
    }
    if let (RejectionReason::Throttled, Some(name)) = (rejection.reason, rejection.policy_name()) {
        let description = match &rejection.limit {
            Some(limit) => format!("limit {name} ({limit}) exceeded"),
            None => format!("limit {name} exceeded"),
        };
        details.push(any(
            "google.rpc.QuotaFailure",
            &quota_failure(&name, &description),
        ));
    }
    details
}

/// `google.rpc.RetryInfo { retry_delay: google.protobuf.Duration }`.
fn retry_info(wait: std::time::Duration) -> Vec<u8> {
    let mut delay = Vec::new();
    put_varint_field(&mut delay, 1, wait.as_secs());
    put_varint_field(&mut delay, 2, u64::from(wait.subsec_nanos()));
    let mut retry_info = Vec::new();
    put_bytes_field(&mut retry_info, 1, &delay);
    retry_info
}

/// `google.rpc.QuotaFailure { violations: [Violation { subject, description }] }`: the subject
/// is the limit's name, never the key (which may identify a customer).
fn quota_failure(subject: &str, description: &str) -> Vec<u8> {
    let mut violation = Vec::new();
    put_bytes_field(&mut violation, 1, subject.as_bytes());
    put_bytes_field(&mut violation, 2, description.as_bytes());
    let mut failure = Vec::new();
    put_bytes_field(&mut failure, 1, &violation);
    failure
}

/// `google.protobuf.Any { type_url, value }` for a message of type `name`.
fn any(name: &str, value: &[u8]) -> Vec<u8> {
    let mut any = Vec::new();
    put_bytes_field(
        &mut any,
        1,
        format!("type.googleapis.com/{name}").as_bytes(),
    );
    put_bytes_field(&mut any, 2, value);
    any
}

/// `google.rpc.Status { code, message, details }`.
fn status(code: u32, message: &str, details: &[Vec<u8>]) -> Vec<u8> {
    let mut status = Vec::new();
    put_varint_field(&mut status, 1, u64::from(code));
    put_bytes_field(&mut status, 2, message.as_bytes());
    for detail in details {
        put_bytes_field(&mut status, 3, detail);
    }
    status
}

fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// A varint field; zero is the default and is left out, as protobuf encoders do.
fn put_varint_field(out: &mut Vec<u8>, field: u64, value: u64) {
    if value != 0 {
        put_varint(out, field << 3);
        put_varint(out, value);
    }
}

fn put_bytes_field(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
    put_varint(out, (field << 3) | 2);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// Standard base64 without padding, as gRPC binary metadata is sent.
fn base64_unpadded(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &b)| n | u32::from(b) << (16 - 8 * i));
        for i in 0..=chunk.len() {
            out.push(char::from(ALPHABET[(n >> (18 - 6 * i) & 63) as usize]));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_the_rfc_vectors() {
        let cases = [
            ("", ""),
            ("f", "Zg"),
            ("fo", "Zm8"),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg"),
            ("fooba", "Zm9vYmE"),
            ("foobar", "Zm9vYmFy"),
        ];
        for (plain, encoded) in cases {
            assert_eq!(base64_unpadded(plain.as_bytes()), encoded);
        }
    }

    #[test]
    fn varints_and_messages_follow_the_wire_format() {
        let mut out = Vec::new();
        put_varint(&mut out, 300);
        assert_eq!(out, [0xAC, 0x02]);
        assert_eq!(percent_encode("50% ünï"), "50%25 %C3%BCn%C3%AF");
    }

    #[test]
    fn a_missing_key_s_own_words_are_the_grpc_message() {
        let rejection = Rejection::<u64>::new(None, RejectionReason::MissingKey)
            .answered(http::StatusCode::UNAUTHORIZED, "send your API key");
        let response: Response<()> = grpc_response(&rejection);
        assert_eq!(response.headers()["grpc-status"], "3");
        assert_eq!(response.headers()["grpc-message"], "send your API key");
    }

    #[test]
    fn grpc_is_told_apart_by_content_type() {
        let mut headers = HeaderMap::new();
        assert!(!is_grpc(&headers));
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/grpc+proto"),
        );
        assert!(is_grpc(&headers));
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        assert!(!is_grpc(&headers));
    }
}

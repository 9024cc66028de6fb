//! The de facto `X-RateLimit-Limit`, `X-RateLimit-Remaining` and `X-RateLimit-Reset` headers,
//! for clients written against them (GitHub's API, many SDKs, tower_governor's `use_headers`),
//! beside the IETF fields. They describe one limit: on an admitted response the one with the
//! fewest tokens left, on a refusal the refusing one (a concurrency limit's too).

use http::{HeaderMap, HeaderName, HeaderValue};

use crate::rejection::{Rejection, RejectionReason, ceil_secs};
use crate::remaining::Remaining;

const LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
const REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
const RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// On an admitted response: the limit with the fewest tokens left, its capacity, its tokens,
/// and the seconds until it is full again (rounded up). Replaced, not appended: one limit
/// speaks for the request, the tightest of every layer's.
pub(crate) fn insert_admitted(headers: &mut HeaderMap, remaining: &[Remaining]) {
    let tightest = remaining
        .iter()
        .min_by_key(|r| (r.tokens, std::cmp::Reverse(r.full_in)));
    let Some(r) = tightest else {
        return;
    };
    if let Some(earlier) = headers
        .get(&REMAINING)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
        && earlier <= r.tokens
    {
        return;
    }
    insert(headers, r.limit.capacity(), r.tokens, ceil_secs(r.full_in));
}

/// On a throttled refusal: the refusing limit's capacity, none left, and the seconds until the
/// request can pass (its `Retry-After`); on a refusal for too many requests in flight, the
/// concurrency limit in their place. Other refusals get none.
pub(crate) fn insert_refused<K>(headers: &mut HeaderMap, rejection: &Rejection<K>) {
    let limit = match rejection.reason {
        RejectionReason::Throttled => rejection.limit.map(|limit| limit.capacity()),
        RejectionReason::TooManyInFlight { max } => Some(max),
        _ => None,
    };
    let (Some(limit), Some(wait)) = (limit, rejection.retry_after_secs()) else {
        return;
    };
    insert(headers, limit, 0, wait);
}

fn insert(headers: &mut HeaderMap, limit: u64, remaining: u64, reset: u64) {
    headers.insert(LIMIT, HeaderValue::from(limit));
    headers.insert(REMAINING, HeaderValue::from(remaining));
    headers.insert(RESET, HeaderValue::from(reset));
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::limit::Limit;

    fn remaining(name: &'static str, limit: Limit, tokens: u64, full_in: Duration) -> Remaining {
        Remaining::new(name, None, limit, tokens, Duration::ZERO, full_in)
    }

    fn read(headers: &HeaderMap) -> [&str; 3] {
        [&LIMIT, &REMAINING, &RESET].map(|name| headers[name].to_str().unwrap())
    }

    #[test]
    fn an_admitted_response_names_its_tightest_limit() {
        let second = Limit::per_second(10).burst(20).unwrap();
        let day = Limit::per_day(1_000).build().unwrap();
        let mut headers = HeaderMap::new();
        insert_admitted(
            &mut headers,
            &[
                remaining("per-second", second, 12, Duration::from_millis(800)),
                remaining("per-day", day, 7, Duration::from_secs(86_000)),
            ],
        );
        assert_eq!(read(&headers), ["1000", "7", "86000"]);
        // One second and a bit to be full: rounded up.
        let mut headers = HeaderMap::new();
        let limits = [remaining("s", second, 3, Duration::from_millis(1_700))];
        insert_admitted(&mut headers, &limits);
        assert_eq!(read(&headers), ["20", "3", "2"]);
        // A further layer's looser limit leaves the tighter one in place; a tighter one wins.
        insert_admitted(&mut headers, &[remaining("d", day, 500, Duration::ZERO)]);
        assert_eq!(read(&headers), ["20", "3", "2"]);
        insert_admitted(&mut headers, &[remaining("d", day, 1, Duration::ZERO)]);
        assert_eq!(read(&headers), ["1000", "1", "0"]);
    }

    #[test]
    fn a_throttled_refusal_tells_its_limit_and_wait() {
        let limit = Limit::per_minute(100).burst(100).unwrap();
        let mut headers = HeaderMap::new();
        let throttled = Rejection::new(Some(1), RejectionReason::Throttled)
            .of_limit(limit, "per-minute", None)
            .with_retry_after(Duration::from_millis(600));
        insert_refused(&mut headers, &throttled);
        assert_eq!(read(&headers), ["100", "0", "1"]);
        let mut headers = HeaderMap::new();
        insert_refused(
            &mut headers,
            &Rejection::new(Some(1), RejectionReason::MissingKey),
        );
        assert!(headers.is_empty());
    }

    #[test]
    fn a_refusal_for_too_many_in_flight_tells_the_concurrency_limit() {
        let mut headers = HeaderMap::new();
        let full = Rejection::new(Some(1), RejectionReason::TooManyInFlight { max: 8 })
            .with_retry_after(Duration::from_millis(2_500));
        insert_refused(&mut headers, &full);
        assert_eq!(read(&headers), ["8", "0", "3"]);
        // No wait told, no reset to tell: none of them.
        let mut headers = HeaderMap::new();
        let full = Rejection::new(Some(1), RejectionReason::TooManyInFlight { max: 8 });
        insert_refused(&mut headers, &full);
        assert!(headers.is_empty());
    }
}

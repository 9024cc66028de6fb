//! The `RateLimit-Policy` and `RateLimit` fields (IETF draft), written by hand: for admitted
//! responses from the state of their limits, and for refusals from the refusing limit. Shared by
//! the HTTP and gRPC answers.

use std::time::Duration;

use http::{HeaderName, HeaderValue};

use crate::limit::Limit;
use crate::rejection::{Rejection, RejectionReason, ceil_secs};
use crate::remaining::Remaining;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rejection::Rejection;

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

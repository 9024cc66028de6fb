//! The `RateLimit-Policy` and `RateLimit` fields (IETF draft, revision 11), written by hand:
//! for admitted responses from the state of their limits, and for refusals from the refusing
//! limit. Shared by the HTTP and gRPC answers.
//!
//! A token bucket in the draft's terms:
//! - `RateLimit-Policy`: `q` tokens per window `w`, the rate as the limit was written (`100/min`
//!   is `q=100;w=60`; a period under a second or not whole is widened to whole seconds, `q`
//!   rounded down), so that a client pacing itself at `q/w` never runs ahead of the bucket nor
//!   far behind it; the burst, when it is not `q`, as its own parameter `ht-burst`; the unit as
//!   `qu`; the partition key as `pk` when on.
//! - `RateLimit`: the effective window `t` is the policy's `w`, and `r` what the client can use
//!   within it: the tokens left plus those that refill before `t` ends. So `t` is never 0, and
//!   `r/t` stays within the burst plus the rate. A refusal says `r=0` and `t` = `Retry-After`.

use std::time::Duration;

use http::{HeaderName, HeaderValue};

use crate::arith::mul_div;
use crate::limit::Limit;
use crate::rejection::{Rejection, RejectionReason, ceil_secs};
use crate::remaining::Remaining;

/// Appends `RateLimit-Policy` and `RateLimit` for `remaining`, one list item per limit:
/// `"<name>";q=<tokens per window>;qu="<unit>";w=<window>` (with `ht-burst=<capacity>` when it
/// is not `q`, and `pk` when on) and `"<name>";r=<tokens usable within t>;t=<window>`. Appended,
/// not replaced: fields from another layer stay, and the lines combine into one list.
pub fn append_ratelimit_fields(headers: &mut http::HeaderMap, remaining: &[Remaining]) {
    if remaining.is_empty() {
        return;
    }
    let policy = match remaining {
        [only] => single_policy(only),
        _ => field_value(|out| {
            for (i, r) in remaining.iter().enumerate() {
                push_policy_item(out, i, r);
            }
        }),
    };
    let state = field_value(|out| {
        for (i, r) in remaining.iter().enumerate() {
            let (available, window) = service_limit(r);
            push_state_item(out, i, r, available, window);
        }
    });
    headers.append(RATELIMIT_POLICY, policy);
    headers.append(RATELIMIT, state);
}

/// `RateLimit-Policy` for one limit. It changes only with the limit and its names, so each
/// thread keeps the last one it wrote and hands out clones of it (a reference count) while
/// they are the same; items with a partition key are written afresh.
fn single_policy(r: &Remaining) -> HeaderValue {
    type Last = Option<(PolicyOf, HeaderValue)>;
    thread_local! {
        static LAST: std::cell::RefCell<Last> = const { std::cell::RefCell::new(None) };
    }
    let write = || field_value(|out| push_policy_item(out, 0, r));
    if r.partition_key.is_some() {
        return write();
    }
    let of = PolicyOf::new(r);
    LAST.with_borrow_mut(|last| {
        if let Some((seen, value)) = last.as_ref()
            && *seen == of
        {
            return value.clone();
        }
        let value = write();
        *last = Some((of, value.clone()));
        value
    })
}

/// What a one-limit `RateLimit-Policy` is written from: names compared by address (they are
/// interned, or constants).
#[derive(Clone, Copy, PartialEq)]
struct PolicyOf {
    names: [usize; 4],
    limit: Limit,
    written: (u64, Duration),
}

impl PolicyOf {
    fn new(r: &Remaining) -> Self {
        let address = |s: Option<&'static str>| s.map_or(0, |s| s.as_ptr() as usize);
        Self {
            names: [
                address(r.layer),
                address(r.level),
                address(Some(r.limit_name)),
                address(Some(r.unit)),
            ],
            limit: r.limit,
            written: r.limit.written_rate(),
        }
    }
}

/// A `RateLimit-Policy` item, after a comma unless it is the first.
fn push_policy_item(out: &mut Vec<u8>, index: usize, r: &Remaining) {
    let (quota, window) = policy_window(&r.limit);
    push_name(out, index, &r.policy_name());
    out.extend_from_slice(b";q=");
    push_integer(out, quota);
    out.extend_from_slice(b";qu=\"");
    out.extend_from_slice(r.unit.as_bytes());
    out.extend_from_slice(b"\";w=");
    push_integer(out, window);
    push_partition_key(out, r);
    if r.limit.capacity() != quota {
        out.extend_from_slice(b";ht-burst=");
        push_integer(out, r.limit.capacity());
    }
}

/// A `RateLimit` item, after a comma unless it is the first.
fn push_state_item(out: &mut Vec<u8>, index: usize, r: &Remaining, available: u64, window: u64) {
    push_name(out, index, &r.policy_name());
    out.extend_from_slice(b";r=");
    push_integer(out, available);
    out.extend_from_slice(b";t=");
    push_integer(out, window);
    push_partition_key(out, r);
}

fn push_name(out: &mut Vec<u8>, index: usize, name: &str) {
    if index > 0 {
        out.extend_from_slice(b", ");
    }
    out.push(b'"');
    out.extend_from_slice(name.as_bytes());
    out.push(b'"');
}

fn push_partition_key(out: &mut Vec<u8>, r: &Remaining) {
    if let Some(key) = r.partition_key {
        out.extend_from_slice(b";pk=");
        out.extend_from_slice(key.to_string().as_bytes());
    }
}

/// `RateLimit-Policy`'s `q` and `w`: the tokens the limit adds per period as it was written,
/// and that period in seconds. A period under a second, or not a whole number of seconds, is
/// widened to the next whole second and `q` rounded down to what it adds then, so that `q/w`
/// never exceeds the rate (and falls short of it by less than one token per window).
fn policy_window(limit: &Limit) -> (u64, u64) {
    let (amount, period) = limit.written_rate();
    let period = u64::try_from(period.as_micros()).unwrap_or(u64::MAX).max(1);
    let window = period.div_ceil(1_000_000);
    let quota = mul_div(amount, window.saturating_mul(1_000_000), period);
    (sf_integer(quota), sf_integer(window))
}

/// `RateLimit`'s `r` and `t`: within the policy's window, the tokens left and those that
/// refill before it ends (spent as they come, a bucket never fills up on the way); for a
/// refusal, none until its wait is over.
fn service_limit(r: &Remaining) -> (u64, u64) {
    if r.refused {
        return (0, ceil_secs(r.next_in).max(1));
    }
    // A calendar quota's tokens come back all at its reset: what is left, and the time to it.
    if r.limit.calendar().is_some() {
        return (sf_integer(r.tokens), ceil_secs(r.next_in).max(1));
    }
    let (_, window) = policy_window(&r.limit);
    let window_micros = window.saturating_mul(1_000_000);
    // A full bucket refills from its first use: one token's time after it.
    let first = match r.next_in {
        Duration::ZERO => r.limit.time_to_accrue(1),
        next => next,
    };
    let first = u64::try_from(first.as_micros()).unwrap_or(u64::MAX);
    let refilled = match window_micros.checked_sub(first) {
        Some(after_first) if after_first > 0 => {
            r.limit.accrued_in(after_first - 1).saturating_add(1)
        }
        _ => 0,
    };
    (sf_integer(r.tokens.saturating_add(refilled)), window)
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
/// tokens left within the wait: `r=0;t=<Retry-After>`.
pub(crate) fn insert_ratelimit_fields<K>(headers: &mut http::HeaderMap, rejection: &Rejection<K>) {
    if let RejectionReason::TooManyInFlight { max } = rejection.reason {
        return insert_concurrency_fields(headers, rejection, max);
    }
    let (Some(limit), Some(limit_name)) = (rejection.limit, rejection.limit_name) else {
        return;
    };
    let mut refusing = Remaining::new(
        limit_name,
        rejection.level,
        limit,
        0,
        Duration::ZERO,
        Duration::ZERO,
    );
    refusing.layer = rejection.layer;
    refusing.unit = rejection.unit;
    refusing.partition_key = rejection.partition_key;
    headers.insert(RATELIMIT_POLICY, single_policy(&refusing));
    if let (RejectionReason::Throttled, Some(secs)) =
        (rejection.reason, rejection.retry_after_secs())
    {
        let state = field_value(|out| push_state_item(out, 0, &refusing, 0, secs));
        headers.insert(RATELIMIT, state);
    }
}

/// A concurrency limit's refusal: `"<name>";q=<max>;qu="concurrent-requests"` and
/// `"<name>";r=0;t=<Retry-After>`. The draft has no window for it, so the policy has no `w`.
fn insert_concurrency_fields<K>(headers: &mut http::HeaderMap, rejection: &Rejection<K>, max: u64) {
    let Some(name) = rejection.policy_name() else {
        return;
    };
    headers.insert(
        RATELIMIT_POLICY,
        concurrency_policy(&name, max, rejection.unit),
    );
    let state = field_value(|out| {
        push_name(out, 0, &name);
        out.extend_from_slice(b";r=0");
        if let Some(secs) = rejection.retry_after_secs() {
            out.extend_from_slice(b";t=");
            push_integer(out, secs);
        }
    });
    headers.insert(RATELIMIT, state);
}

/// A concurrency limit's fields on an admitted response, after those of other layers: its
/// `policy` ([`concurrency_policy`]) and `"<name>";r=<free>`, the slots this host sees free.
/// No `t`: slots come back when requests end, not at a time.
pub(crate) fn append_concurrency_fields(
    headers: &mut http::HeaderMap,
    name: &str,
    policy: HeaderValue,
    free: u64,
) {
    headers.append(RATELIMIT_POLICY, policy);
    let state = field_value(|out| {
        push_name(out, 0, name);
        out.extend_from_slice(b";r=");
        push_integer(out, free);
    });
    headers.append(RATELIMIT, state);
}

/// A concurrency limit's `RateLimit-Policy`: `"<name>";q=<max>;qu="<unit>"`.
pub(crate) fn concurrency_policy(name: &str, max: u64, unit: &str) -> HeaderValue {
    field_value(|out| {
        push_name(out, 0, name);
        out.extend_from_slice(b";q=");
        push_integer(out, max);
        out.extend_from_slice(b";qu=\"");
        out.extend_from_slice(unit.as_bytes());
        out.push(b'"');
    })
}

const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// The largest integer a Structured Field holds (15 digits).
const SF_INTEGER_MAX: u64 = 999_999_999_999_999;

fn sf_integer(n: u64) -> u64 {
    n.min(SF_INTEGER_MAX)
}

/// A field's value, written by `write` into this thread's scratch buffer and copied out: one
/// allocation of its exact size (a `Vec` with room to spare becomes a `Bytes` through a
/// second allocation).
fn field_value(write: impl FnOnce(&mut Vec<u8>)) -> HeaderValue {
    thread_local! {
        static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    SCRATCH.with_borrow_mut(|out| {
        out.clear();
        write(out);
        // Built only from digits, names and fixed ASCII, so always a valid header value.
        HeaderValue::from_bytes(out).unwrap_or_else(|_| HeaderValue::from_static(""))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fields::PartitionKey;
    use crate::rejection::Rejection;

    fn remaining(level: Option<&'static str>, name: &'static str, limit: Limit) -> Remaining {
        Remaining::new(name, level, limit, 0, Duration::ZERO, Duration::ZERO)
    }

    fn with_state(mut r: Remaining, tokens: u64, next_in: Duration) -> Remaining {
        r.tokens = tokens;
        r.next_in = next_in;
        r
    }

    fn fields(remaining: &[Remaining]) -> (String, String) {
        let mut headers = http::HeaderMap::new();
        append_ratelimit_fields(&mut headers, remaining);
        let text = |name| headers[name].to_str().unwrap().to_owned();
        (text(&RATELIMIT_POLICY), text(&RATELIMIT))
    }

    fn limit(text: &str) -> Limit {
        text.parse().unwrap()
    }

    /// The policy states the rate as written, and the burst apart when it differs: a client
    /// pacing itself at `q/w` never runs ahead of the bucket, nor far behind it.
    #[test]
    fn the_policy_says_the_rate_as_written_and_the_burst_apart() {
        let policy = |text: &str| fields(&[remaining(None, "default", limit(text))]).0;
        let cases = [
            ("100/min", r#""default";q=100;qu="requests";w=60"#),
            (
                "1/s burst 60",
                r#""default";q=1;qu="requests";w=1;ht-burst=60"#,
            ),
            (
                "1000/s burst 10",
                r#""default";q=1000;qu="requests";w=1;ht-burst=10"#,
            ),
            (
                "5/day burst 10",
                r#""default";q=5;qu="requests";w=86400;ht-burst=10"#,
            ),
            (
                "1 per 3ms burst 4",
                r#""default";q=333;qu="requests";w=1;ht-burst=4"#,
            ),
            ("1 per 1500ms", r#""default";q=1;qu="requests";w=2"#),
            (
                "3 per 1500ms",
                r#""default";q=4;qu="requests";w=2;ht-burst=3"#,
            ),
            ("100 per 10s", r#""default";q=100;qu="requests";w=10"#),
        ];
        for _ in 0..2 {
            for (text, expected) in cases {
                assert_eq!(policy(text), expected, "{text}");
            }
        }
        for text in [
            "1000/s burst 10",
            "1 per 3ms",
            "7 per 1500ms",
            "1 per 1001ms",
            "10/day",
            "3 per 7ms",
            "1/us burst 5",
        ] {
            let l = limit(text);
            let (q, w) = policy_window(&l);
            let rate = l.refill_amount() as f64 * 1e6 / l.refill_period().as_micros() as f64;
            let paced = q as f64 / w as f64;
            assert!(paced <= rate * (1.0 + 1e-12), "{text}: {paced} > {rate}");
            assert!(paced >= rate / 2.0, "{text}: {paced} far below {rate}");
        }
        // Past the largest Structured Field integer, integers are capped.
        let huge = Limit::per_second(1).burst(Limit::MAX_CAPACITY).unwrap();
        assert_eq!(
            fields(&[remaining(None, "default", huge)]).0,
            r#""default";q=1;qu="requests";w=1;ht-burst=999999999999999"#
        );
        let slow = Limit::per(1, Limit::MAX_PERIOD).build().unwrap();
        assert_eq!(policy_window(&slow), (1, 366 * 86_400));
    }

    /// `r` is what the client can use within `t`: the tokens left and those that refill
    /// strictly before the window ends.
    #[test]
    fn the_state_counts_what_the_window_brings() {
        let state = |text: &str, tokens, next_in| {
            let r = with_state(remaining(None, "default", limit(text)), tokens, next_in);
            fields(&[r]).1
        };
        let ms = Duration::from_millis;
        // Nine left, one more every 100 ms from 100 ms on: nine more before the second ends.
        assert_eq!(state("10/s", 9, ms(100)), r#""default";r=18;t=1"#);
        // Full: refills start at the first use, one token's time later.
        assert_eq!(state("10/s", 10, Duration::ZERO), r#""default";r=19;t=1"#);
        // 100/min, one every 600 ms, the next in 600 ms: 99 before the minute ends.
        assert_eq!(state("100/min", 40, ms(600)), r#""default";r=139;t=60"#);
        // Empty, the next token in five hours: one within the day.
        assert_eq!(
            state("1/day", 0, Duration::from_secs(5 * 3600)),
            r#""default";r=1;t=86400"#
        );
        // Nothing comes within the window when the next token is due at its end.
        assert_eq!(
            state("1 per 2s", 0, Duration::from_secs(2)),
            r#""default";r=0;t=2"#
        );
        // Never `t=0`, even for limits faster than a second.
        assert_eq!(
            state("1/ms burst 5", 5, Duration::ZERO),
            r#""default";r=1004;t=1"#
        );
        let refusal = Remaining {
            refused: true,
            ..with_state(remaining(None, "default", limit("10/s")), 0, ms(2500))
        };
        assert_eq!(fields(&[refusal]).1, r#""default";r=0;t=3"#);
    }

    /// Every layer and level names its items apart; units and partition keys follow.
    #[test]
    fn items_are_named_by_layer_level_and_limit() {
        let l = limit("10/s");
        let name = |layer, level, limit_name| {
            let mut r = remaining(level, limit_name, l);
            r.layer = layer;
            r.policy_name().into_owned()
        };
        assert_eq!(name(None, None, "default"), "default");
        assert_eq!(name(None, Some("tenant"), "default"), "tenant");
        assert_eq!(name(None, Some("tenant"), "per-day"), "tenant/per-day");
        assert_eq!(name(Some("api"), None, "default"), "api");
        assert_eq!(name(Some("api"), None, "per-day"), "api/per-day");
        assert_eq!(name(Some("api"), Some("tenant"), "default"), "api/tenant");
        assert_eq!(
            name(Some("api"), Some("tenant"), "per-day"),
            "api/tenant/per-day"
        );
        let mut r = with_state(remaining(None, "bytes", l), 10, Duration::ZERO);
        r.unit = "content-bytes";
        r.partition_key = Some(PartitionKey::test([0, 1, 2, 3, 4, 5, 6, 7]));
        assert_eq!(
            fields(&[r]),
            (
                r#""bytes";q=10;qu="content-bytes";w=1;pk=:AAECAwQFBgc=:"#.to_owned(),
                r#""bytes";r=19;t=1;pk=:AAECAwQFBgc=:"#.to_owned()
            )
        );
    }

    /// The policy kept for the last limit is handed out only for that same limit, written
    /// the same way.
    #[test]
    fn a_kept_policy_serves_only_its_own_limit() {
        let a = remaining(None, "default", limit("60/min"));
        let b = remaining(None, "default", limit("1/s burst 60"));
        let mut c = remaining(None, "default", limit("60/min"));
        c.layer = Some("api");
        for _ in 0..2 {
            assert_eq!(
                fields(std::slice::from_ref(&a)).0,
                r#""default";q=60;qu="requests";w=60"#
            );
            assert_eq!(
                fields(std::slice::from_ref(&b)).0,
                r#""default";q=1;qu="requests";w=1;ht-burst=60"#
            );
            assert_eq!(
                fields(std::slice::from_ref(&c)).0,
                r#""api";q=60;qu="requests";w=60"#
            );
        }
        assert_eq!(
            fields(&[a, b]).0,
            r#""default";q=60;qu="requests";w=60, "default";q=1;qu="requests";w=1;ht-burst=60"#
        );
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
        let mut headers = http::HeaderMap::new();
        insert_ratelimit_fields(&mut headers, &throttled);
        assert_eq!(headers[&RATELIMIT], r#""tenant/per-day";r=0;t=3"#);
        assert_eq!(
            headers[&RATELIMIT_POLICY],
            r#""tenant/per-day";q=10;qu="requests";w=86400"#
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

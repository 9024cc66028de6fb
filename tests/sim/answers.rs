//! What clients are told. Each refusal of a run, and each admitted response's state, is
//! answered as `DefaultRejection` answers it (plain HTTP, problem details or gRPC, with or
//! without the `X-RateLimit-*` headers: drawn per seed) and read back as a client reads it:
//! the `RateLimit` fields parsed as Structured Fields, the problem details as JSON. Checked:
//!
//! - the status for the reason (gRPC's in `grpc-status`, under HTTP 200);
//! - `Retry-After` exactly when the refusal has a wait: the wait rounded up to a whole second,
//!   never earlier than the wait and less than a second after it;
//! - a refusal's `RateLimit-Policy` names its limit, with a quota per window that never
//!   exceeds the limit's written rate and falls short of it by less than one token per window;
//!   a throttled one's `RateLimit` says `r=0` and its `Retry-After` as `t`, no other has one;
//! - problem details: a JSON object with the status, naming the refusing limit when throttled;
//! - `X-RateLimit-*`: only when drawn, on a throttled refusal the limit's capacity, none left
//!   and the `Retry-After`; on an admitted response the limit told with the fewest tokens;
//! - an admitted response: one policy and one state per limit told, in order and by name,
//!   none telling fewer tokens than its state holds (a would-be refusal in shadow mode: none).

use std::convert::Infallible;
use std::time::Duration;

use hierarchical_throttle::{
    DefaultRejection, Limit, OnRejection, Rejection, RejectionReason, Remaining,
};
use http::{HeaderMap, Request, Response, StatusCode, header};

use super::rng::Rng;

/// How a seed's clients ask to be answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Text,
    Problem,
    Grpc,
}

/// How a seed's refusals and admitted states are answered and checked (`None`: not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Answers {
    pub protocol: Protocol,
    pub x_ratelimit: bool,
}

/// The largest integer a Structured Field holds.
const SF_MAX: u64 = 999_999_999_999_999;

impl Answers {
    /// Drawn on a stream of its own, so that earlier seeds keep their other draws.
    pub fn draw(seed: u64) -> Option<Self> {
        let mut rng = Rng::new(seed ^ 0xA45E_3E25);
        if rng.chance(0.4) {
            return None;
        }
        let protocol = [Protocol::Text, Protocol::Problem, Protocol::Grpc][rng.below(3) as usize];
        Some(Self {
            protocol,
            x_ratelimit: rng.chance(0.5),
        })
    }

    fn answerer(self) -> DefaultRejection {
        DefaultRejection::by_content_type().x_ratelimit_headers(self.x_ratelimit)
    }

    fn request(self) -> Request<()> {
        let (name, value) = match self.protocol {
            Protocol::Text => (header::ACCEPT, "text/plain, */*"),
            Protocol::Problem => (header::ACCEPT, "application/problem+json"),
            Protocol::Grpc => (header::CONTENT_TYPE, "application/grpc"),
        };
        let mut request = Request::new(());
        request
            .headers_mut()
            .insert(name, http::HeaderValue::from_static(value));
        request
    }

    /// What is wrong with the answer to `rejection`, if anything.
    pub fn wrong_refusal(self, rejection: &Rejection<String>) -> Option<String> {
        let answered: Result<Response<String>, Infallible> = self
            .answerer()
            .on_rejection(&self.request(), rejection.clone());
        let Ok(response) = answered;
        self.check_refusal(rejection, &response)
            .err()
            .map(|wrong| format!("{rejection} answered {response:?}: {wrong}"))
    }

    fn check_refusal(
        self,
        rejection: &Rejection<String>,
        response: &Response<String>,
    ) -> Result<(), String> {
        let headers = response.headers();
        let throttled = rejection.reason == RejectionReason::Throttled;
        check_status(self.protocol, rejection, response)?;
        let told = integer_header(headers, "retry-after")?;
        check_retry_after(rejection.retry_after, told)?;
        let name = rejection.policy_name().map(|n| n.into_owned());
        match (&name, rejection.limit) {
            (Some(name), Some(limit)) => drop(check_policy(headers, &[(name.clone(), limit)])?),
            _ => absent(headers, "ratelimit-policy")?,
        }
        match (throttled, &name, told) {
            (true, Some(name), Some(secs)) => {
                let state = items(headers, "ratelimit", 1)?;
                let [(item, params)] = state.as_slice() else {
                    return Err("not one item in RateLimit".to_owned());
                };
                let (r, t) = (param(params, "r")?, param(params, "t")?);
                if item != name || r != Some(0) || t != Some(secs) {
                    return Err(format!("RateLimit says {item:?} r={r:?} t={t:?}"));
                }
            }
            _ => absent(headers, "ratelimit")?,
        }
        if self.protocol == Protocol::Problem {
            check_problem(response, throttled.then_some(name).flatten())?;
        }
        let x_told = match (self.x_ratelimit && throttled, rejection.limit, told) {
            (true, Some(limit), Some(secs)) => vec![(limit.capacity(), 0, secs)],
            _ => Vec::new(),
        };
        check_x_ratelimit(headers, &x_told)
    }

    /// What is wrong with what an admitted response is told of `remaining`, if anything.
    pub fn wrong_admitted(self, remaining: &[Remaining]) -> Option<String> {
        if remaining.is_empty() {
            // Told of no limit: the run's own check reports it.
            return None;
        }
        let mut response = Response::new(String::new());
        OnRejection::<Request<()>, String, Response<String>, Infallible>::on_admitted(
            &self.answerer(),
            &mut response,
            remaining,
        );
        self.check_admitted(remaining, response.headers())
            .err()
            .map(|wrong| format!("{remaining:?} told {:?}: {wrong}", response.headers()))
    }

    fn check_admitted(self, remaining: &[Remaining], headers: &HeaderMap) -> Result<(), String> {
        let limits: Vec<(String, Limit)> = remaining
            .iter()
            .map(|r| (r.policy_name().into_owned(), r.limit))
            .collect();
        let windows = check_policy(headers, &limits)?;
        let state = items(headers, "ratelimit", remaining.len())?;
        for ((r, (name, params)), window) in remaining.iter().zip(&state).zip(windows) {
            let (told, t) = match (param(params, "r")?, param(params, "t")?) {
                (Some(told), Some(t)) => (told, t),
                (told, t) => return Err(format!("{name}: r={told:?} t={t:?}")),
            };
            let tokens = r.tokens.min(SF_MAX);
            let right = match r.limit.calendar() {
                // A calendar quota's tokens come back all at once, at its reset.
                Some(_) => told == tokens,
                // Or a would-be refusal (shadow mode): none until its wait is over.
                None => (told >= tokens && t == window) || (tokens == 0 && told == 0),
            };
            if *name != r.policy_name() || !right || t == 0 {
                return Err(format!("{name}: r={told} t={t} for {r:?}"));
            }
        }
        // The limit with the fewest tokens speaks; of those, one that is full last.
        let fewest = remaining.iter().map(|r| r.tokens).min();
        let tightest = remaining.iter().filter(|r| Some(r.tokens) == fewest);
        let last_full = tightest.clone().map(|r| r.full_in).max();
        let x_told: Vec<_> = tightest
            .filter(|r| Some(r.full_in) == last_full && self.x_ratelimit)
            .map(|r| (r.limit.capacity(), r.tokens, ceil_secs(r.full_in)))
            .collect();
        check_x_ratelimit(headers, &x_told)
    }
}

fn ceil_secs(wait: Duration) -> u64 {
    wait.as_secs() + u64::from(wait.subsec_nanos() > 0)
}

/// The reason's status, or the one the layer was told to answer with (plain HTTP only: a gRPC
/// client reads `grpc-status`).
fn check_status(
    protocol: Protocol,
    rejection: &Rejection<String>,
    response: &Response<String>,
) -> Result<(), String> {
    let (status, grpc) = match rejection.reason {
        RejectionReason::Throttled | RejectionReason::TooManyInFlight { .. } => {
            (StatusCode::TOO_MANY_REQUESTS, 8)
        }
        RejectionReason::CostExceedsCapacity { .. } => (StatusCode::PAYLOAD_TOO_LARGE, 3),
        RejectionReason::MissingKey => (StatusCode::BAD_REQUEST, 3),
        RejectionReason::StoreUnavailable => (StatusCode::SERVICE_UNAVAILABLE, 14),
        other => return Err(format!("a throttle refused for {other:?}")),
    };
    let (expected, told) = match protocol {
        Protocol::Grpc => (
            (StatusCode::OK, Some(grpc)),
            integer_header(response.headers(), "grpc-status")?,
        ),
        _ => ((rejection.status.unwrap_or(status), None), None),
    };
    if (response.status(), told) != expected {
        return Err(format!(
            "status {} grpc-status {told:?}, not {expected:?}",
            response.status()
        ));
    }
    Ok(())
}

/// `Retry-After` (seconds) exactly when there is a wait: the wait rounded up.
fn check_retry_after(wait: Option<Duration>, told: Option<u64>) -> Result<(), String> {
    let right = match (wait, told) {
        (None, None) => true,
        (Some(wait), Some(secs)) => {
            Duration::from_secs(secs) >= wait
                && secs
                    .checked_sub(1)
                    .is_none_or(|less| Duration::from_secs(less) < wait)
        }
        _ => false,
    };
    match right {
        true => Ok(()),
        false => Err(format!("Retry-After {told:?} for a wait of {wait:?}")),
    }
}

/// One `RateLimit-Policy` item per limit, named as given, with `q` tokens per `w` seconds
/// never above the limit's written rate and less than a token per window below it; the
/// windows, in order.
fn check_policy(headers: &HeaderMap, limits: &[(String, Limit)]) -> Result<Vec<u64>, String> {
    let policy = items(headers, "ratelimit-policy", limits.len())?;
    let mut windows = Vec::new();
    for ((name, limit), (item, params)) in limits.iter().zip(&policy) {
        let (Some(q), Some(w)) = (param(params, "q")?, param(params, "w")?) else {
            return Err(format!("{item}: no q or w"));
        };
        let (amount, period) = limit.written_rate();
        // q / w <= amount / period, and (q + 1) / w > amount / period, in microseconds.
        let period = period.as_micros().max(1);
        let per_window = u128::from(amount) * u128::from(w) * 1_000_000;
        let capped = q == SF_MAX || w == SF_MAX;
        let right = u128::from(q) * period <= per_window
            && (capped || u128::from(q + 1) * period > per_window);
        if item != name || w == 0 || !right {
            return Err(format!(
                "policy {item:?} q={q} w={w} for {name:?} {limit:?}"
            ));
        }
        windows.push(w);
    }
    Ok(windows)
}

/// Problem details: a JSON object with the status, and the refusing limit among the violated
/// policies when throttled.
fn check_problem(response: &Response<String>, violated: Option<String>) -> Result<(), String> {
    let content_type = response.headers().get(header::CONTENT_TYPE);
    if content_type.is_none_or(|c| c != "application/problem+json") {
        return Err(format!("problem details as {content_type:?}"));
    }
    let json: serde_json::Value = serde_json::from_str(response.body())
        .map_err(|e| format!("problem details do not parse: {e}"))?;
    let status = json.get("status").and_then(serde_json::Value::as_u64);
    let policies = json.get("violated-policies").and_then(|p| p.as_array());
    let named = policies.map(|p| p.iter().filter_map(|n| n.as_str()).collect::<Vec<_>>());
    let right = status == Some(u64::from(response.status().as_u16()))
        && named == violated.as_deref().map(|name| vec![name]);
    match right {
        true => Ok(()),
        false => Err(format!("problem details {json} (violated: {violated:?})")),
    }
}

/// The `X-RateLimit-*` headers: one of `told` (limit, remaining, reset), or none when it is
/// empty.
fn check_x_ratelimit(headers: &HeaderMap, told: &[(u64, u64, u64)]) -> Result<(), String> {
    let read = (
        integer_header(headers, "x-ratelimit-limit")?,
        integer_header(headers, "x-ratelimit-remaining")?,
        integer_header(headers, "x-ratelimit-reset")?,
    );
    let right = match read {
        (None, None, None) => told.is_empty(),
        (Some(limit), Some(remaining), Some(reset)) => told.contains(&(limit, remaining, reset)),
        _ => false,
    };
    match right {
        true => Ok(()),
        false => Err(format!("X-RateLimit-* {read:?}, not one of {told:?}")),
    }
}

fn integer_header(headers: &HeaderMap, name: &str) -> Result<Option<u64>, String> {
    let Some(value) = headers.get(name) else {
        return Ok(None);
    };
    let text = value.to_str().map_err(|e| format!("{name}: {e}"))?;
    text.parse()
        .map(Some)
        .map_err(|e| format!("{name}: {text:?}: {e}"))
}

fn absent(headers: &HeaderMap, name: &str) -> Result<(), String> {
    match headers.get(name) {
        None => Ok(()),
        Some(value) => Err(format!("{name}: {value:?} where none belongs")),
    }
}

/// [`list`], which must hold `count` items (one per limit told).
fn items(
    headers: &HeaderMap,
    name: &str,
    count: usize,
) -> Result<Vec<(String, sfv::Parameters)>, String> {
    let items = list(headers, name)?;
    match items.len() == count {
        true => Ok(items),
        false => Err(format!(
            "{} items in {name} for {count} limits",
            items.len()
        )),
    }
}

/// A Structured Fields list of named items, as a client parses it.
fn list(headers: &HeaderMap, name: &str) -> Result<Vec<(String, sfv::Parameters)>, String> {
    let values: Vec<&str> = headers
        .get_all(name)
        .iter()
        .map(|v| v.to_str().map_err(|e| format!("{name}: {e}")))
        .collect::<Result<_, _>>()?;
    if values.is_empty() {
        return Err(format!("no {name}"));
    }
    // Field lines of a list combine, in order, as one list.
    let joined = values.join(", ");
    let parsed: sfv::List = sfv::Parser::new(&joined)
        .parse()
        .map_err(|e| format!("{name}: {joined:?} does not parse: {e}"))?;
    parsed
        .into_iter()
        .map(|entry| match entry {
            sfv::ListEntry::Item(item) => match item.bare_item.as_string() {
                Some(item_name) => Ok((item_name.as_str().to_owned(), item.params)),
                None => Err(format!("{name}: an item not named by a string")),
            },
            sfv::ListEntry::InnerList(_) => Err(format!("{name}: an inner list")),
        })
        .collect()
}

/// A non-negative integer parameter, within what a Structured Field holds.
fn param(params: &sfv::Parameters, key: &str) -> Result<Option<u64>, String> {
    let Some(value) = params.get(key) else {
        return Ok(None);
    };
    let n = value
        .as_integer()
        .map(i64::from)
        .and_then(|n| u64::try_from(n).ok())
        .filter(|&n| n <= SF_MAX);
    match n {
        Some(n) => Ok(Some(n)),
        None => Err(format!("{key}={value:?}")),
    }
}

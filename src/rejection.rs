//! Rejections: why a request was not served, and what its client needs to know. Plain values:
//! the engine makes them, the answers in [`response`](crate::response) turn them into HTTP or
//! gRPC.

use std::fmt;
use std::time::Duration;

use http::StatusCode;

use crate::limit::Limit;

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
    /// The key has as many requests in flight as its concurrency limit allows, fleet-wide
    /// ([`HierarchicalConcurrencyLayer`](crate::HierarchicalConcurrencyLayer)).
    TooManyInFlight {
        /// The most requests the key may have in flight.
        max: u64,
    },
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
            Self::StoreUnavailable => f.write_str("store unavailable"),
            Self::TooManyInFlight { max } => {
                write!(f, "too many requests in flight (at most {max})")
            }
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
    /// The layer's name, when it was [named](crate::Builder::name).
    pub layer: Option<&'static str>,
    /// What the refusing limit's tokens count: its quota unit (`qu`).
    pub unit: &'static str,
    /// The partition key of the refused key, when the layer's fields carry them.
    pub partition_key: Option<crate::fields::PartitionKey>,
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
            layer: None,
            unit: crate::fields::REQUESTS,
            partition_key: None,
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

    /// The refusing limit's name as the `RateLimit` fields show it (see
    /// [`Remaining::policy_name`](crate::Remaining::policy_name)): `per-second`,
    /// `tenant/per-second`, `api/per-second` in a layer named `api`.
    pub fn policy_name(&self) -> Option<std::borrow::Cow<'static, str>> {
        Some(crate::quota::item_name(
            self.layer,
            self.level,
            self.limit_name?,
        ))
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

/// Whole seconds, rounded up: never 0 for a wait that is not zero.
pub(crate) fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

//! Read-only views of what a key's limits hold, without taking anything: for the `RateLimit`
//! fields of admitted responses, and for callers who want to know before they ask.

use std::borrow::Cow;
use std::time::Duration;

use crate::limit::Limit;
use crate::quota::scope;
use crate::rejection::{Rejection, RejectionReason};

/// What one limit of a key holds, without taking anything.
///
/// From [`HierarchicalThrottleLayer::remaining`](crate::HierarchicalThrottleLayer::remaining)
/// (this host's view: its lease plus the global bucket's level at its last answer and what has
/// refilled since; other hosts may have taken some of that since), from
/// [`remaining_global`](crate::HierarchicalThrottleLayer::remaining_global) (the global
/// bucket itself, one call to the store per limit), and in the `RateLimit` fields of admitted
/// responses.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Remaining {
    /// The limit's name ([`DEFAULT_NAME`](crate::quota::DEFAULT_NAME) for a single limit).
    pub limit_name: &'static str,
    /// The level the limit belongs to; `None` at the layer's first level.
    pub level: Option<&'static str>,
    /// The limit.
    pub limit: Limit,
    /// Whole tokens left, at most the capacity.
    pub tokens: u64,
    /// How long until the bucket holds more tokens than now (zero when it is full).
    pub next_in: Duration,
    /// How long until the bucket is full again (zero when it is).
    pub full_in: Duration,
}

impl Remaining {
    /// What a throttled request's refusing limit held: nothing, until its wait is over. `None`
    /// for other refusals.
    pub(crate) fn of_refusal<K>(rejection: &Rejection<K>) -> Option<Self> {
        if rejection.reason != RejectionReason::Throttled {
            return None;
        }
        let limit = rejection.limit?;
        let wait = rejection.retry_after.unwrap_or_default();
        Some(Self {
            limit_name: rejection.limit_name?,
            level: rejection.level,
            limit,
            tokens: 0,
            next_in: wait,
            full_in: wait.max(limit.time_to_accrue(limit.capacity())),
        })
    }

    /// The limit's name as `RateLimit-Policy` shows it: `per-second`, or `tenant/per-second`
    /// at a further level.
    pub fn policy_name(&self) -> Cow<'static, str> {
        scope(self.level, self.limit_name)
    }
}

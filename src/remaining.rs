//! Read-only views of what a key's limits hold, without taking anything: for the `RateLimit`
//! fields of admitted responses, and for callers who want to know before they ask.

use std::borrow::Cow;
use std::time::Duration;

use crate::fields::{PartitionKey, REQUESTS};
use crate::limit::Limit;
use crate::quota::item_name;
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
    /// The limit; while the global store is down and this host decides alone
    /// ([`FailurePolicy::local_fallback`](crate::FailurePolicy::local_fallback)), its share of
    /// it, which is what it holds to then.
    pub limit: Limit,
    /// Whole tokens left, at most the capacity.
    pub tokens: u64,
    /// How long until the bucket holds more tokens than now (zero when it is full).
    pub next_in: Duration,
    /// How long until the bucket is full again (zero when it is).
    pub full_in: Duration,
    /// The layer's name, when it was [named](crate::Builder::name).
    pub layer: Option<&'static str>,
    /// What the limit's tokens count: its quota unit (`qu`), such as `requests`; see
    /// [`RateLimitFields::unit`](crate::RateLimitFields::unit).
    pub unit: &'static str,
    /// The partition key of the request's key at this level, when the layer's fields carry
    /// them ([`RateLimitFields::partition_keys`](crate::RateLimitFields::partition_keys)).
    pub partition_key: Option<PartitionKey>,
    /// A refusal's state (shadow mode): nothing left until the wait is over.
    pub(crate) refused: bool,
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
            layer: rejection.layer,
            unit: rejection.unit,
            partition_key: rejection.partition_key,
            refused: true,
        })
    }

    /// A limit's state with the defaults of an unnamed layer, whose fields carry no partition
    /// keys and whose requests each cost one token.
    pub(crate) fn new(
        limit_name: &'static str,
        level: Option<&'static str>,
        limit: Limit,
        tokens: u64,
        next_in: Duration,
        full_in: Duration,
    ) -> Self {
        Self {
            limit_name,
            level,
            limit,
            tokens,
            next_in,
            full_in,
            layer: None,
            unit: REQUESTS,
            partition_key: None,
            refused: false,
        }
    }

    /// The limit's name as the `RateLimit` fields show it: the layer's name when it was named,
    /// the level's and the limit's, joined by `/` (`per-second`, `tenant/per-second`,
    /// `api/tenant/per-second`); a lone limit's `default` is left out after another name
    /// (`api`, `api/tenant`), so that every layer and level names its items apart.
    pub fn policy_name(&self) -> Cow<'static, str> {
        item_name(self.layer, self.level, self.limit_name)
    }
}

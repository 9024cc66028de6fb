//! Read-only views of what a key's limits hold, without taking anything: for the `RateLimit`
//! fields of admitted responses, and for callers who want to know before they ask.

use std::borrow::Cow;
use std::time::Duration;

use crate::clock::{Clock, micros};
use crate::global::GlobalStore;
use crate::limit::Limit;
use crate::local::{LocalStore, View};
use crate::quota::{BucketKey, LeaseKey, Name, scope};
use crate::throttle::Throttle;

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
    fn new(name: Name, level: Option<Name>, limit: Limit, view: View) -> Self {
        Self {
            limit_name: name.as_str(),
            level: level.map(Name::as_str),
            limit,
            tokens: view.tokens,
            next_in: Duration::from_micros(view.next_in),
            full_in: Duration::from_micros(view.full_in),
        }
    }

    /// What a throttled request's refusing limit held: nothing, until its wait is over. `None`
    /// for other refusals.
    pub(crate) fn of_refusal<K>(rejection: &crate::Rejection<K>) -> Option<Self> {
        if rejection.reason != crate::RejectionReason::Throttled {
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

impl<K, G, L, C> Throttle<K, G, L, C>
where
    K: std::hash::Hash + Eq + Clone + Send + Sync + 'static,
    G: GlobalStore<BucketKey<K>>,
    L: LocalStore<LeaseKey<K>>,
    C: Clock,
{
    /// This host's view of every limit of the key of bucket `id` at its level, appended to
    /// `out`; `id`'s slot is left at the key's first bucket. A bucket this host does not hold
    /// is full as far as it knows (global buckets start full).
    pub(crate) fn remaining_local(&self, id: &mut LeaseKey<K>, now: u64, out: &mut Vec<Remaining>) {
        let Some((level_name, quota)) = self.level_quota(id.level, &id.key) else {
            return;
        };
        let store_up = self.health.is_up(now);
        for (slot, (name, limit)) in (0..).zip(quota.slots_iter()) {
            id.slot = slot;
            let view = self
                .local
                .peek_bucket(id, |bucket| bucket.view(now, &limit, store_up))
                .unwrap_or_else(|| View::full(&limit));
            out.push(Remaining::new(name, level_name, limit, view));
        }
        id.slot = 0;
    }

    /// This host's view of every limit of `keys` (first buckets of their levels).
    pub(crate) fn remaining_of(&self, keys: &mut [LeaseKey<K>]) -> Vec<Remaining> {
        let now = micros(self.clock.now());
        let mut out = Vec::new();
        for id in keys {
            self.remaining_local(id, now, &mut out);
        }
        out
    }

    /// Every limit of `key` at `level` as the global store holds it: one call per limit.
    pub(crate) async fn remaining_global(
        &self,
        level: u8,
        key: &K,
    ) -> Result<Vec<Remaining>, G::Error> {
        let Some((level_name, quota)) = self.level_quota(level, key) else {
            return Ok(Vec::new());
        };
        let mut out = Vec::with_capacity(quota.len());
        for (name, limit) in quota.slots_iter() {
            let bucket = BucketKey::from_parts(key.clone(), self.config.layer, level_name, name);
            let level = self.global.level(&bucket, &limit).await?;
            let view = View {
                tokens: level.tokens.min(limit.capacity()),
                next_in: micros(level.next_in),
                full_in: micros(level.full_in),
            };
            out.push(Remaining::new(name, level_name, limit, view));
        }
        Ok(out)
    }
}

//! Read-only views of what a key's limits hold, as this host sees them or as the global store
//! holds them.

use std::time::Duration;

use crate::clock::{Clock, micros};
use crate::global::BucketLevel;
use crate::limit::Limit;
use crate::local::View;
use crate::quota::{BucketKey, LeaseKey, Name};
use crate::remaining::Remaining;
use crate::throttle::{Global, Key, Local, Throttle};

impl<K: Key, G: Global<K>, L: Local<K>, C: Clock> Throttle<K, G, L, C> {
    /// What limit `name` of `key` (at `level`) holds, as `view` tells it, described as the
    /// layer's fields describe it.
    fn remaining_of_limit(
        &self,
        key: &K,
        name: Name,
        level: Option<Name>,
        limit: Limit,
        view: View,
    ) -> Remaining {
        // While the host decides alone, its share is the limit it holds to.
        let mut remaining = Remaining::new(
            name.as_str(),
            level.map(Name::as_str),
            view.share.unwrap_or(limit),
            view.tokens,
            Duration::from_micros(view.next_in),
            Duration::from_micros(view.full_in),
        );
        remaining.layer = self.config.layer_name();
        let level = level.map(Name::as_str);
        remaining.unit = self.config.unit(level, name.as_str());
        remaining.partition_key = self.partition_key(level, key);
        remaining
    }

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
                .unwrap_or_else(|| View::full_at(&limit, now));
            out.push(self.remaining_of_limit(&id.key, name, level_name, limit, view));
        }
        id.slot = 0;
    }

    /// This host's view of every limit of `keys` (first buckets of their levels).
    pub(crate) fn remaining_of(&self, keys: &mut [LeaseKey<K>]) -> Vec<Remaining> {
        let now = self.now();
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
            out.push(self.remaining_global_of(key, name, level_name, limit, level));
        }
        Ok(out)
    }

    /// What limit `name` of `key` holds in the global store, read as `level`.
    pub(crate) fn remaining_global_of(
        &self,
        key: &K,
        name: Name,
        level_name: Option<Name>,
        limit: Limit,
        level: BucketLevel,
    ) -> Remaining {
        let view = View {
            tokens: level.tokens.min(limit.capacity()),
            next_in: micros(level.next_in),
            full_in: micros(level.full_in),
            share: None,
        };
        self.remaining_of_limit(key, name, level_name, limit, view)
    }
}

//! Read-only views of what a key's limits hold, as this host sees them or as the global store
//! holds them.

use std::sync::Arc;
use std::time::Duration;

use crate::clock::{Clock, micros};
use crate::error::StoreError;
use crate::fields::PartitionKey;
use crate::global::BucketLevel;
use crate::limit::Limit;
use crate::local::View;
use crate::quota::{BucketKey, LeaseKey, Name};
use crate::remaining::Remaining;
use crate::throttle::key::{ReadBorrowed, ViewAt};
use crate::throttle::{
    Check, Global, Key, LimitStates, Local, OneLimitState, QuotaSource, Throttle,
};

/// A request's decision from [`check_borrowed_viewed`](Throttle::check_borrowed_viewed).
pub(crate) enum Viewed<K> {
    /// Admitted by the lease: the state of its limit, for its response.
    Admitted(LimitStates),
    /// Anything else: the decision, and the request's first bucket for what follows it.
    Decided(Check<K>, LeaseKey<K>),
    /// The request has no key.
    NoKey,
}

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
        let partition_key = self.partition_key(level.map(Name::as_str), key);
        self.remaining_with(name, level, limit, view, partition_key)
    }

    /// [`remaining_of_limit`](Self::remaining_of_limit) for a key whose partition key is
    /// `partition_key`.
    fn remaining_with(
        &self,
        name: Name,
        level: Option<Name>,
        limit: Limit,
        view: View,
        partition_key: Option<PartitionKey>,
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
        remaining.partition_key = partition_key;
        remaining
    }

    /// A request on the first level's one limit (the same for every key) whose response
    /// tells that limit's state: [`check_borrowed`](Self::check_borrowed) with the state read
    /// in the same lookup, and no key made while the lease admits it. `None` when this does
    /// not apply: another local store, a quota per key or of several limits, partition keys
    /// in the fields (they hash the key made). `one_limit` is that limit's
    /// [template](Self::one_limit_template), when there is one.
    pub(crate) fn check_borrowed_viewed<Req>(
        self: &Arc<Self>,
        reader: &dyn ReadBorrowed<Req, K>,
        request: &Req,
        cost: u64,
        one_limit: Option<&Remaining>,
    ) -> Option<Viewed<K>> {
        let template = one_limit?;
        let memory = self.memory_store()?;
        let now = self.recent();
        let at = ViewAt {
            now,
            limit: template.limit,
            store_up: self.health.is_up(now),
        };
        let Some((hit, view)) = reader.take_viewed(request, memory, cost, &at) else {
            return Some(Viewed::NoKey);
        };
        if let (true, Some(view)) = (hit.is_plain_admission(), view) {
            return Some(Viewed::Admitted(state_of_the_one_limit(template, view)));
        }
        // Read again only now: the closure borrows from the request, so it finds the same key.
        let Some(key) = reader.owned(request) else {
            return Some(Viewed::NoKey);
        };
        let id = LeaseKey::new(key, 0, 0);
        Some(Viewed::Decided(self.after_group_hit(&id, hit, cost), id))
    }

    /// The state of the first level's limit as the fields describe it, its view to be filled
    /// in, when [`check_borrowed_viewed`](Self::check_borrowed_viewed) applies: the quota is
    /// one limit, the same for every key, and the fields carry no partition keys (they hash
    /// the key made). Worked out once, when the throttle is made.
    pub(crate) fn one_limit_template(&self) -> Option<Remaining> {
        if self.config.fields.has_partition_keys() {
            return None;
        }
        let (name, limit) = self.one_limit_for_every_key()?;
        Some(self.remaining_with(name, None, limit, View::full(&limit), None))
    }

    /// The first level's limit when its quota is one limit, the same for every key.
    fn one_limit_for_every_key(&self) -> Option<(Name, Limit)> {
        match &self.levels.first()?.quota {
            QuotaSource::Fixed(quota) if quota.slots() == 1 => quota.slot(0),
            _ => None,
        }
    }

    /// This host's view of every limit of the key of bucket `id` at its level, appended to
    /// `out`; `id`'s slot is left at the key's first bucket. A bucket this host does not hold
    /// (or holds only another limit's lease of) is full as far as it knows (global buckets
    /// start full).
    pub(crate) fn remaining_local(&self, id: &mut LeaseKey<K>, now: u64, out: &mut Vec<Remaining>) {
        let Some((level_name, quota)) = self.level_quota(id.level, &id.key) else {
            return;
        };
        let store_up = self.health.is_up(now);
        for (slot, (name, limit)) in (0..).zip(quota.slots_iter()) {
            id.slot = slot;
            // A lease of another limit's bucket (the limit was renamed since) knows nothing
            // of this one.
            let view = self
                .local
                .peek_bucket(id, |bucket| {
                    let serves = bucket.holds_tokens_of(name);
                    serves.then(|| bucket.view(now, &limit, store_up))
                })
                .flatten()
                .unwrap_or_else(|| View::full_at(&limit, now));
            out.push(self.remaining_of_limit(&id.key, name, level_name, limit, view));
        }
        id.slot = 0;
    }

    /// This host's view of every limit of `keys` (first buckets of their levels), as of the
    /// clock's recent time (what a response tells needs no more).
    pub(crate) fn remaining_of(&self, keys: &mut [LeaseKey<K>]) -> Vec<Remaining> {
        let now = self.recent();
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
    ) -> Result<Vec<Remaining>, StoreError<G::Error>> {
        let Some((level_name, quota)) = self.level_quota(level, key) else {
            return Ok(Vec::new());
        };
        let mut out = Vec::with_capacity(quota.len());
        for (name, limit) in quota.slots_iter() {
            let bucket = BucketKey::from_parts(key.clone(), self.config.layer, level_name, name);
            let level = self
                .operator_call(self.global.level(&bucket, &limit))
                .await?;
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

/// The state of the layer's one limit ([`Throttle::one_limit_template`]) as `view` tells it:
/// three numbers, filled into the template when the response is annotated; in full while the
/// host decides alone (its share is then the limit it holds to).
fn state_of_the_one_limit(template: &Remaining, view: View) -> LimitStates {
    let state = OneLimitState {
        tokens: view.tokens,
        next_in: view.next_in,
        full_in: view.full_in,
    };
    match view.share {
        None => LimitStates::OfTheOneLimit(state),
        Some(share) => LimitStates::One(Box::new(Remaining {
            limit: share,
            ..state.filled_in(template)
        })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template() -> Remaining {
        let limit = Limit::per_second(10).burst(200).unwrap();
        let mut template =
            Remaining::new("default", None, limit, 200, Duration::ZERO, Duration::ZERO);
        template.layer = Some("api");
        template
    }

    #[test]
    fn the_one_limit_travels_as_its_numbers_and_is_filled_in_as_before() {
        let view = View {
            tokens: 150,
            next_in: 100_000,
            full_in: 5_000_000,
            share: None,
        };
        let LimitStates::OfTheOneLimit(state) = state_of_the_one_limit(&template(), view) else {
            panic!("the three numbers alone");
        };
        let filled = state.filled_in(&template());
        let expected = Remaining {
            tokens: 150,
            next_in: Duration::from_millis(100),
            full_in: Duration::from_secs(5),
            ..template()
        };
        assert_eq!(filled, expected);
    }

    #[test]
    fn while_the_host_decides_alone_its_share_is_the_limit_told() {
        let share = Limit::per_second(5).burst(100).unwrap();
        let view = View {
            tokens: 40,
            next_in: 200_000,
            full_in: 12_000_000,
            share: Some(share),
        };
        let LimitStates::One(state) = state_of_the_one_limit(&template(), view) else {
            panic!("the share is told in full");
        };
        assert_eq!(state.limit, share);
        assert_eq!(state.tokens, 40);
        assert_eq!(state.layer, Some("api"));
    }
}

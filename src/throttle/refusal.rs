//! Refusals on their way out: counted once by limit and reason, given their jitter, or served
//! in shadow mode; admissions counted when final; requests without a key noticed.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::clock::micros;
use crate::limit::Limit;
use crate::quota::Name;
use crate::rejection::{Rejection, RejectionReason};
use crate::remaining::Remaining;
use crate::throttle::{Admission, Admitted, Global, Key, Local, Resolved, Throttle};

use std::time::Duration;

use crate::clock::Clock;
use crate::quota::LeaseKey;

/// Random delays for refusals' waits: a seeded hash of a counter, spread evenly enough for
/// clients to scatter, and no lock.
#[derive(Default)]
pub(super) struct Jitter {
    seed: foldhash::fast::RandomState,
    draws: AtomicU64,
}

impl Jitter {
    /// A delay from 0 to `max` micros, both included.
    fn draw(&self, max: u64) -> u64 {
        let n = self.draws.fetch_add(1, Ordering::Relaxed);
        self.seed.hash_one(n) % max.saturating_add(1)
    }
}

impl<K: Key, G: Global<K>, L: Local<K>, C: Clock> Throttle<K, G, L, C> {
    /// A use of `cost` tokens is admitted, finally, as `admitted`: counts the tokens the
    /// failure policy admitted without a lease (once the use is sure to go ahead, so that one
    /// refused by another bucket, or dropped, counts nothing).
    pub(crate) fn count_admitted(&self, admitted: Admitted, cost: u64) -> Admitted {
        self.stats.requests_admitted.incr();
        self.stamped(self.count_unleased(admitted, cost))
    }

    /// [`count_admitted`](Self::count_admitted) for a use counted as a request already (when
    /// its check admitted it at once): the tokens the failure policy admitted without a lease.
    pub(crate) fn count_unleased(&self, admitted: Admitted, cost: u64) -> Admitted {
        let buckets = u64::from(admitted.policy_buckets());
        if buckets > 0 {
            self.stats.tokens_unleased.add(cost.saturating_mul(buckets));
        }
        admitted
    }

    /// Counts a request exempt from every limit.
    pub(crate) fn count_exempt(&self) {
        self.stats.requests_exempt.incr();
    }

    /// Counts a request without a key, and logs it at warn: the first, then at most one a
    /// minute, so that a key closure that never finds its key (a mistyped header name) shows.
    pub(crate) fn note_missing_key(&self, policy: &str) {
        self.stats.missing_key.incr();
        // Stamped one past the clock, so that 0 means never.
        let stamp = self.now().saturating_add(1);
        let last = self.missing_key_warned_at.load(Ordering::Relaxed);
        let due = last == 0 || stamp.saturating_sub(last) >= MISSING_KEY_WARNING_EVERY;
        let claimed = due
            && self
                .missing_key_warned_at
                .compare_exchange(last, stamp, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok();
        if claimed {
            tracing::warn!(
                layer = %self.config.name,
                policy,
                without_key_so_far = self.stats.missing_key.get(),
                "a request had no throttle key: is the key closure reading what clients send? \
                 (logged at most once a minute; each one is counted in stats().missing_key)"
            );
        } else {
            tracing::debug!(policy, "request without a throttle key");
        }
    }

    /// Serves a request shadow mode would have refused: counted, logged, and when `annotate`
    /// given the `RateLimit` fields of its refusal, or, for a refusal that names no limit's
    /// state (the store failed, the cost is above the capacity), those of the limits of `keys`
    /// as this host sees them, as any admitted response; never settled (it took no tokens).
    pub(crate) fn admit_in_shadow(
        &self,
        rejection: &Rejection<K>,
        annotate: bool,
        keys: Option<Vec<LeaseKey<K>>>,
    ) -> Admission {
        self.count_shadow(rejection);
        let remaining = match annotate {
            true => self.state_in_shadow(rejection, keys),
            false => Vec::new(),
        };
        Admission {
            remaining: remaining.into(),
            settle: None,
        }
    }

    /// What a response admitted in shadow mode tells of its limits (see
    /// [`admit_in_shadow`](Self::admit_in_shadow)).
    fn state_in_shadow(
        &self,
        rejection: &Rejection<K>,
        keys: Option<Vec<LeaseKey<K>>>,
    ) -> Vec<Remaining> {
        let mut described = rejection.clone();
        self.describe(&mut described);
        match (Remaining::of_refusal(&described), keys) {
            (Some(refused), _) => vec![refused],
            (None, Some(mut keys)) => self.remaining_of(&mut keys),
            (None, None) => Vec::new(),
        }
    }
}

/// How often a request without a key is logged at warn, at most (micros).
const MISSING_KEY_WARNING_EVERY: u64 = 60_000_000;

impl<K, G, L, C> Throttle<K, G, L, C> {
    /// The partition key of `key` at `level`, when the layer's fields carry them.
    pub(crate) fn partition_key(
        &self,
        level: Option<&str>,
        key: &K,
    ) -> Option<crate::fields::PartitionKey>
    where
        K: std::hash::Hash,
    {
        self.config
            .fields
            .partition_key(self.config.layer.as_str(), level, key)
    }

    /// Describes a refusal's limit as the layer's fields describe it: the layer's name, the
    /// limit's unit, the key's partition key.
    fn describe(&self, rejection: &mut Rejection<K>)
    where
        K: std::hash::Hash,
    {
        rejection.layer = self.config.layer_name();
        let Some(name) = rejection.limit_name else {
            return;
        };
        let level = rejection.level;
        rejection.unit = self.config.unit(level, name);
        rejection.partition_key = match &rejection.key {
            Some(key) => self.partition_key(level, key),
            None => None,
        };
    }

    /// Counts and logs a refusal that shadow mode turns into an admission.
    pub(super) fn count_shadow(&self, rejection: &Rejection<K>) {
        self.stats.shadow_admitted.incr();
        tracing::debug!(reason = %rejection.reason, "shadow mode: served a use it would refuse");
    }

    /// A refusal for a use outside a tower service: finished on its way to the caller, or in
    /// shadow mode turned into an admission that took nothing.
    pub(crate) fn finish_or_shadow(
        &self,
        mut rejection: Rejection<K>,
    ) -> Result<Admitted, Rejection<K>>
    where
        K: std::hash::Hash,
    {
        if self.config.shadow {
            self.count_shadow(&rejection);
            return Ok(Admitted::SHADOW);
        }
        self.finish_refusal(&mut rejection);
        Err(rejection)
    }

    /// Whether a throttled refusal is counted where it is made: not when it goes on to wait for
    /// its tokens (shaping counts a waiting request once, when its wait ends).
    pub(crate) fn counts_throttled(&self) -> bool {
        self.config.shadow
            || matches!(
                self.config.shaping,
                crate::throttle::shaping::Shaping::Refuse
            )
    }

    /// A refusal on its way to the client: counted once, by its limit and reason, and its wait
    /// given the configured random delay.
    pub(crate) fn finish_refusal(&self, rejection: &mut Rejection<K>)
    where
        K: std::hash::Hash,
    {
        self.describe(rejection);
        self.stats.requests_refused.incr();
        let reason = match rejection.reason {
            RejectionReason::Throttled => "throttled",
            RejectionReason::CostExceedsCapacity { .. } => "cost_above_capacity",
            RejectionReason::MissingKey => "missing_key",
            RejectionReason::StoreUnavailable => "store_unavailable",
            RejectionReason::TooManyInFlight { .. } => "too_many_in_flight",
        };
        self.refusals
            .count((rejection.level, rejection.limit_name, reason));
        let max = micros(self.config.retry_jitter);
        if let (Some(wait), true) = (&mut rejection.retry_after, max > 0) {
            *wait += Duration::from_micros(self.jitter.draw(max));
        }
    }
}

impl Resolved {
    /// A refusal of a request on bucket `id` for `reason`, naming `limit`.
    pub(super) fn rejection<K: Clone>(
        &self,
        id: &LeaseKey<K>,
        reason: RejectionReason,
        limit: Limit,
    ) -> Rejection<K> {
        Rejection::new(Some(id.key.clone()), reason).of_limit(
            limit,
            self.name.as_str(),
            self.level.map(Name::as_str),
        )
    }

    /// Refused until `wait_micros` from now.
    pub(super) fn throttled<K: Clone>(&self, id: &LeaseKey<K>, wait_micros: u64) -> Rejection<K> {
        self.rejection(id, RejectionReason::Throttled, self.limit)
            .with_retry_after(Duration::from_micros(wait_micros.max(1)))
    }

    pub(super) fn cost_rejection<K: Clone>(&self, id: &LeaseKey<K>, cost: u64) -> Rejection<K> {
        let capacity = self.limit.capacity();
        let reason = RejectionReason::CostExceedsCapacity { cost, capacity };
        self.rejection(id, reason, self.limit)
    }
}

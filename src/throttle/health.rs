//! The global store's health: a circuit breaker with back-off, and the failure policy that
//! decides the requests whose call failed.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::clock::micros;
use crate::failure::FailurePolicy;
use crate::rejection::{Rejection, RejectionReason};
use crate::sync::lock;
use crate::throttle::{Admitted, Global, Key, Local, Resolved, Throttle};

use std::time::Duration;

use crate::clock::Clock;
use crate::quota::LeaseKey;

impl<K: Key, G: Global<K>, L: Local<K>, C: Clock> Throttle<K, G, L, C> {
    /// Applies the [`FailurePolicy`] to a request the global store could not decide.
    pub(super) fn decide_on_failure(
        &self,
        id: &LeaseKey<K>,
        cost: u64,
        bucket: &Resolved,
    ) -> Result<Admitted, Rejection<K>> {
        self.stats.fallback_decisions.incr();
        self.apply_failure_policy(id, cost, bucket)
            .map(|()| Admitted::by_policy(id))
    }

    pub(super) fn apply_failure_policy(
        &self,
        id: &LeaseKey<K>,
        cost: u64,
        bucket: &Resolved,
    ) -> Result<(), Rejection<K>> {
        if bucket.shadow {
            // A limit in shadow never refuses, whatever the store does.
            return Ok(());
        }
        let now = self.now();
        let until_probe = self.health.down_until().saturating_sub(now).max(1);
        let limit = &bucket.limit;
        match self.config.failure_policy {
            FailurePolicy::Admit => Ok(()),
            FailurePolicy::Reject => {
                let rejection = bucket.rejection(id, RejectionReason::StoreUnavailable, *limit);
                Err(rejection.with_retry_after(Duration::from_micros(until_probe)))
            }
            FailurePolicy::LocalFallback { expected_hosts } => {
                let share = limit.share(expected_hosts.get());
                let throttled = |wait| {
                    bucket
                        .rejection(id, RejectionReason::Throttled, share)
                        .with_retry_after(Duration::from_micros(wait))
                };
                if cost > share.capacity() && !bucket.shadow {
                    // This host's share can never hold it: it waits for the store instead.
                    return Err(throttled(until_probe));
                }
                let wait = self
                    .local
                    .with_bucket(id, |b| b.take_fallback(&share, now, cost));
                match (wait, bucket.shadow) {
                    (0, _) => Ok(()),
                    (_, true) => {
                        self.refused_in_shadow(id, bucket);
                        Ok(())
                    }
                    (wait, false) => Err(throttled(wait)),
                }
            }
        }
    }

    /// A call sent at `sent_at` failed at `failed_at`: the store's back-off steps. Logged at
    /// warn once when the store goes down (not once per call), naming the layer and the store.
    pub(crate) fn store_failed(&self, sent_at: u64, failed_at: u64, error: &dyn std::fmt::Display) {
        if let Some(registry) = self.global.layers() {
            registry.set_reachable(false);
        }
        let went_down = self
            .health
            .failed(sent_at, failed_at, self.config.max_backoff);
        if went_down {
            tracing::warn!(
                layer = %self.config.name,
                store = %self.store_location,
                %error,
                policy = ?self.config.failure_policy,
                "the global store failed; the failure policy decides until it answers"
            );
        }
    }

    /// A call was answered: the store is up (logged when it was down).
    pub(crate) fn store_answered(&self) {
        if let Some(registry) = self.global.layers() {
            registry.set_reachable(true);
        }
        if self.health.succeeded() {
            tracing::info!(
                layer = %self.config.name,
                store = %self.store_location,
                "the global store answers again"
            );
        }
    }

    /// Whether the global store answered the last call that ended: of any layer on it when
    /// the store keeps a [`LayerRegistry`](crate::global::LayerRegistry), else of this one.
    pub(crate) fn store_reachable(&self) -> bool {
        match self.global.layers() {
            Some(registry) => registry.is_reachable(),
            None => self.health.is_reachable(),
        }
    }
}

/// A circuit breaker over the global store: after a failure, no key calls the store until a
/// back-off has passed (doubling per failure window, up to a maximum). The first call after it
/// is the probe. Calls that were already under way when the circuit opened belong to the same
/// window, so a burst of concurrent failures is one step, not one per call.
#[derive(Debug, Default)]
pub(crate) struct StoreHealth {
    down_until: AtomicU64,
    failures: Mutex<u32>,
    /// The store answered the last call that ended (false until one has).
    reachable: AtomicBool,
}

const FIRST_BACKOFF: Duration = Duration::from_millis(50);

impl StoreHealth {
    /// Whether the store answered the last call that ended: reachability, as an operator
    /// reads it (not whether this layer is backing off).
    pub(crate) fn is_reachable(&self) -> bool {
        self.reachable.load(Ordering::Relaxed)
    }

    pub(crate) fn is_up(&self, now: u64) -> bool {
        now >= self.down_until.load(Ordering::Relaxed)
    }

    fn down_until(&self) -> u64 {
        self.down_until.load(Ordering::Relaxed)
    }

    /// A call was answered; `true` when the store was down until then.
    pub(crate) fn succeeded(&self) -> bool {
        self.reachable.store(true, Ordering::Relaxed);
        if self.down_until.load(Ordering::Relaxed) == 0 {
            return false;
        }
        let mut failures = lock(&self.failures);
        let was_down = *failures > 0;
        *failures = 0;
        self.down_until.store(0, Ordering::Relaxed);
        was_down
    }

    /// A call sent at `sent_at` failed at `now`; `true` when the store goes down with it (the
    /// first failure since it last answered).
    fn failed(&self, sent_at: u64, now: u64, max_backoff: Duration) -> bool {
        self.reachable.store(false, Ordering::Relaxed);
        let mut failures = lock(&self.failures);
        if sent_at < self.down_until.load(Ordering::Relaxed) {
            return false;
        }
        let went_down = *failures == 0;
        let backoff = FIRST_BACKOFF
            .saturating_mul(1 << (*failures).min(16))
            .min(max_backoff);
        *failures = failures.saturating_add(1);
        self.down_until
            .store(now.saturating_add(micros(backoff)), Ordering::Relaxed);
        went_down
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reachability_is_the_last_answer_not_the_back_off() {
        let health = StoreHealth::default();
        assert!(!health.is_reachable(), "never answered yet");
        assert!(!health.succeeded() && health.is_reachable());
        assert!(health.failed(0, 10, Duration::from_secs(1)));
        assert!(!health.is_reachable());
        // The back-off is over, but the store has not answered since: still unreachable.
        assert!(health.is_up(10 + 50_000));
        assert!(!health.is_reachable());
        assert!(health.succeeded());
        assert!(health.is_reachable());
    }
}

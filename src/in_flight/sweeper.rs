//! The sweeper: every linger, it gives back slots unused for a pass or two, renews holdings
//! (and requests in flight) whose time is half gone, and forgets keys with nothing left.

use std::hash::Hash;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use crate::clock::{Clock, micros};
use crate::global::slots::SlotStore;
use crate::in_flight::{Shared, calls};
use crate::quota::BucketKey;

impl<K, S, C> Shared<K, S, C>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    S: SlotStore<BucketKey<K>>,
    C: Clock,
{
    /// Starts the sweeper unless it runs. It holds the engine weakly, so it ends with the
    /// last clone of the layer; if its runtime ends first, the next request starts another.
    pub(super) fn ensure_sweeper(self: &Arc<Self>) {
        if self.sweeper_running.load(Ordering::Relaxed) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.sweeper_running.swap(true, Ordering::AcqRel) {
            return;
        }
        let running = Running(Arc::downgrade(self));
        runtime.spawn(async move {
            let tick = self_tick(&running);
            let mut interval = tokio::time::interval(tick);
            interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                interval.tick().await;
                let Some(shared) = running.0.upgrade() else {
                    return;
                };
                shared.sweep();
            }
        });
    }

    /// One pass over every key.
    pub(super) fn sweep(self: &Arc<Self>) {
        let now = self.now();
        let renew_by = now.saturating_add(micros(self.settings.slot_ttl) / 2);
        let mut calls = Vec::new();
        let (mut admitted, mut in_flight, mut keys) = (0, 0, 0);
        for shard in self.shards.iter() {
            let mut shard = shard.lock();
            admitted += shard.admitted;
            shard.keys.retain(|(key, entry)| {
                let mut lease = entry.lease.lock();
                lease.forget_gone(|waiter| waiter.is_closed());
                if lease.is_idle() {
                    return false;
                }
                in_flight += lease.in_use();
                keys += 1;
                let seq = || self.next_seq();
                if let Some(call) = lease.sweep(now, renew_by, seq) {
                    calls.push((key.clone(), entry.clone(), call));
                }
                true
            });
        }
        for (key, entry, call) in calls {
            calls::spawn(self.clone(), key, entry, call);
        }
        self.publish(admitted, in_flight, keys);
    }

    #[cfg(feature = "metrics")]
    fn publish(&self, admitted_at_once: u64, in_flight: u64, keys: usize) {
        let c = &self.counters;
        crate::metrics::publish_concurrency(&crate::metrics::ConcurrencySnapshot {
            layer: self.settings.layer.as_str(),
            admitted: admitted_at_once + c.admitted.load(Ordering::Relaxed),
            admitted_on_credit: c.on_credit.load(Ordering::Relaxed),
            refused_full: c.refused_full.load(Ordering::Relaxed),
            refused_unavailable: c.refused_unavailable.load(Ordering::Relaxed),
            store_calls: c.store_calls.load(Ordering::Relaxed),
            store_round_trips: c.store_round_trips.load(Ordering::Relaxed),
            store_failures: c.store_failures.load(Ordering::Relaxed),
            exempt: c.exempt.load(Ordering::Relaxed),
            in_flight,
            keys,
        });
    }

    #[cfg(not(feature = "metrics"))]
    fn publish(&self, _admitted_at_once: u64, _in_flight: u64, _keys: usize) {}
}

fn self_tick<K, S, C>(running: &Running<K, S, C>) -> std::time::Duration {
    running
        .0
        .upgrade()
        .map_or(std::time::Duration::from_millis(1), |shared| {
            let settings = &shared.settings;
            settings
                .linger
                .min(settings.slot_ttl / 4)
                .max(std::time::Duration::from_millis(1))
        })
}

/// Marks the sweeper stopped when its task ends, however it ends.
struct Running<K, S, C>(Weak<Shared<K, S, C>>);

impl<K, S, C> Drop for Running<K, S, C> {
    fn drop(&mut self) {
        if let Some(shared) = self.0.upgrade() {
            shared.sweeper_running.store(false, Ordering::Release);
        }
    }
}

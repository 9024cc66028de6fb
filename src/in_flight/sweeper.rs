//! The sweeper: every linger, it gives back slots unused for a pass or two, renews holdings
//! (and requests in flight) whose time is half gone, and forgets keys with nothing left.

use std::hash::Hash;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use crate::clock::{Clock, micros};
use crate::global::slots::SlotStore;
use crate::in_flight::{Entry, Shared, calls};
use crate::quota::BucketKey;
use crate::slots::SlotCall;
use crate::sync::PassPacing;

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
            // The first sweep one tick on: a sweep at once has nothing to renew or give back,
            // and would run at whichever await of its caller the scheduler reached first.
            let mut interval = tokio::time::interval_at(tokio::time::Instant::now() + tick, tick);
            interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                interval.tick().await;
                let Some(shared) = running.0.upgrade() else {
                    return;
                };
                shared.sweep().await;
            }
        });
    }

    /// One pass over every key, yielding at a shard's end as [`PassPacing`] says: in one go, a
    /// pass over many keys would hold its worker thread for milliseconds.
    pub(super) async fn sweep(self: &Arc<Self>) {
        let now = self.now();
        let renew_by = now.saturating_add(micros(self.settings.slot_ttl) / 2);
        let mut pass = Pass::default();
        let mut pacing = PassPacing::default();
        for shard in self.shards.iter() {
            let mut shard = shard.lock();
            pass.admitted += shard.admitted;
            let visited = shard.keys.len();
            shard.keys.retain(|(key, entry)| {
                let mut lease = entry.lease.lock();
                lease.forget_gone(|waiter| waiter.is_closed());
                if lease.is_idle() {
                    return false;
                }
                pass.in_flight += lease.in_use();
                pass.keys += 1;
                let seq = || self.next_seq();
                if let Some(call) = lease.sweep(now, renew_by, seq) {
                    pass.calls.push((key.clone(), entry.clone(), call));
                }
                true
            });
            drop(shard);
            if pacing.visited(visited) {
                // Sent before the yield: a call a lease counts as under way must be under way
                // even if this task is dropped at the yield (its runtime shut down).
                self.spawn_calls(&mut pass.calls);
                tokio::task::yield_now().await;
            }
        }
        self.spawn_calls(&mut pass.calls);
        self.publish(pass.admitted, pass.in_flight, pass.keys);
    }

    fn spawn_calls(self: &Arc<Self>, pending: &mut Vec<(K, Arc<Entry>, SlotCall)>) {
        for (key, entry, call) in pending.drain(..) {
            calls::spawn(self.clone(), key, entry, call);
        }
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
            shadow_admitted: c.shadow_admitted.load(Ordering::Relaxed),
            in_flight,
            keys,
        });
    }

    #[cfg(not(feature = "metrics"))]
    fn publish(&self, _admitted_at_once: u64, _in_flight: u64, _keys: usize) {}
}

/// What one sweep found, and the calls it makes.
struct Pass<K> {
    admitted: u64,
    in_flight: u64,
    keys: usize,
    calls: Vec<(K, Arc<Entry>, SlotCall)>,
}

impl<K> Default for Pass<K> {
    fn default() -> Self {
        Self {
            admitted: 0,
            in_flight: 0,
            keys: 0,
            calls: Vec::new(),
        }
    }
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

#[cfg(test)]
mod tests {
    use futures_util::FutureExt;

    use crate::{HierarchicalConcurrencyLayer, MemoryGlobalStore};

    #[tokio::test(start_paused = true)]
    async fn a_sweep_over_many_keys_lets_other_tasks_run() {
        let layer = HierarchicalConcurrencyLayer::builder()
            .key(|key: &u64| Some(*key))
            .max_in_flight(4)
            .store(MemoryGlobalStore::new())
            .build()
            .unwrap();
        let mut permits = Vec::new();
        for key in 0..5_000 {
            permits.push(layer.acquire(key).await.unwrap());
        }
        let engine = &layer.engine().shared;
        // Not done in one poll: it yields once past every few hundred keys, at a shard's end.
        assert!(engine.sweep().now_or_never().is_none());
        let yields = polls_to_finish(engine.sweep()).await;
        assert!(
            (12..=20).contains(&yields),
            "{yields} yields over 5,000 keys"
        );
        // Every key is still held (each has a request in flight), and all were counted.
        assert_eq!(layer.in_flight(), 5_000);
        drop(permits);
    }

    /// A sweep whose task is dropped at a yield (its runtime shut down, say) has made every
    /// call it set up: no lease is left waiting for an answer to a call never sent.
    #[tokio::test(start_paused = true)]
    async fn a_sweep_dropped_at_a_yield_leaves_no_call_unmade() {
        let clock = crate::clock::ManualClock::new();
        let layer = HierarchicalConcurrencyLayer::builder()
            .key(|key: &u64| Some(*key))
            .max_in_flight(4)
            .store(MemoryGlobalStore::with_clock(clock.clone()))
            .clock(clock.clone())
            .build()
            .unwrap();
        let mut permits = Vec::new();
        for key in 0..5_000 {
            permits.push(layer.acquire(key).await.unwrap());
        }
        // Every holding is past the time it is renewed at: the sweep calls for each key, and
        // is dropped at its first yield, a few hundred keys in.
        clock.advance(std::time::Duration::from_secs(6));
        assert!(layer.engine().shared.sweep().now_or_never().is_none());
        drop(permits);
        // Requests end, holdings run out, sweeps give the slots back: no key is left.
        for _ in 0..20 {
            clock.advance(std::time::Duration::from_secs(2));
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        assert_eq!(
            layer.keys(),
            0,
            "keys left with a call out that was never made"
        );
    }

    /// How many times `future` gave its thread up before it finished.
    async fn polls_to_finish(future: impl std::future::Future<Output = ()>) -> usize {
        let mut future = std::pin::pin!(future);
        let mut pending = 0;
        std::future::poll_fn(|cx| match future.as_mut().poll(cx) {
            std::task::Poll::Ready(()) => std::task::Poll::Ready(()),
            std::task::Poll::Pending => {
                pending += 1;
                std::task::Poll::Pending
            }
        })
        .await;
        pending
    }
}

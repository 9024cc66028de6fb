//! Handing leases back: the background sweep (every half lease time), the leases of evicted
//! buckets, and hand-backs the store did not take; and the counters read on the way.

use std::sync::Weak;
use std::sync::atomic::Ordering;

use futures_util::{StreamExt, stream};

use crate::clock::micros;
use crate::global::{Call, TokenReturn};
use crate::stats::{Counter, ThrottleStats};
use crate::sync::PassPacing;
use crate::throttle::calls::{CallFailure, Due, Reply};
use crate::throttle::hand_backs::{Outgoing, Return};
use crate::throttle::resets::CLOCK_SKEW;
use crate::throttle::{Global, Key, Local, Throttle, TimedOut};

use std::sync::Arc;
use std::time::Duration;

use crate::clock::Clock;
use crate::local::LocalBucket;
use crate::quota::LeaseKey;

/// Hand-backs in flight at once during a sweep, at least: as many as a batch holds, so that the
/// hand-backs of a large sweep fill batches that go at once instead of each waiting out the
/// linger.
const CONCURRENT_RETURNS: usize = 32;

/// A lease a sweep found unused for the lease time-to-live: its tokens are taken out as their
/// hand-back goes to the store.
struct Unused<K> {
    id: LeaseKey<K>,
    /// The key was far from its limit (see [`Return::unhurried`]).
    unhurried: bool,
}

/// A hand-back's tokens while its call is queued or out: counted as lost if it is dropped
/// before the answer (see [`Throttle::hand_back`]).
struct Unsettled<'a> {
    lost: &'a Counter,
    tokens: u64,
}

impl Drop for Unsettled<'_> {
    fn drop(&mut self) {
        if self.tokens > 0 {
            self.lost.add(self.tokens);
        }
    }
}

impl<K: Key, G: Global<K>, L: Local<K>, C: Clock> Throttle<K, G, L, C> {
    /// Sends bucket `id`'s hand-backs kept for the next sweep (once those being collected from
    /// evicted buckets are kept), and waits until none of its hand-backs is on its way to the
    /// store (lingering calls go at once): a fetch sent meanwhile could reach the store first
    /// (see [`hand_backs`](super::hand_backs)).
    pub(super) async fn await_hand_backs(self: &Arc<Self>, id: &LeaseKey<K>) {
        if !self.hand_backs.any() {
            return;
        }
        self.hand_backs.collected().await;
        let kept = self.hand_backs.send_kept_of(id);
        futures_util::future::join_all(kept.into_iter().map(|out| self.hand_back(out))).await;
        self.hand_backs.landed(id, || self.expedite_calls()).await;
    }

    /// Hands back leases not used within the lease time-to-live, those of evicted buckets, and
    /// earlier hand-backs the store did not take.
    pub(crate) async fn return_unused_leases(self: &Arc<Self>) {
        let now = self.now();
        let ttl = micros(self.config.lease_ttl);
        let interval = self.interval(now);
        self.collect_evicted();
        let keeps_small = self.config.keep_small_leases;
        let mut waiting = 0;
        let mut dated = Vec::new();
        let mut unused = Vec::new();
        self.for_each_bucket_yielding(|id, b| {
            self.count_served(b);
            waiting += b.waiting() as u64;
            if b.is_dated() {
                dated.push(id.clone());
            }
            let limit = || self.resolve(id).map(|r| r.limit);
            if b.sweep(now, ttl, keeps_small, interval, limit) > 0 {
                unused.push(Unused {
                    id: id.clone(),
                    // Read now: a lease that gives back everything drops what it knew of the
                    // store.
                    unhurried: b.is_far_from_limit(),
                });
            }
        })
        .await;
        self.waiting_for_batches.store(waiting, Ordering::Relaxed);
        for id in dated {
            self.keep_before_reset(id, now);
        }
        self.send_kept().await;
        // Each lease's unused tokens are taken out only as their hand-back is sent, marked as
        // out under the bucket's lock: a request that finds the lease empty after that has its
        // fetch wait for them to land.
        stream::iter(unused)
            .for_each_concurrent(self.returns_at_once(), |unused| async move {
                let out = self.local.with_bucket(&unused.id, |b| {
                    let taken = b.take_unused(now, ttl, keeps_small, interval);
                    self.stats.tokens_forfeited.add(taken.forfeited);
                    Return::taken(&unused.id, b, taken.back, now, unused.unhurried)
                        .map(|back| self.hand_backs.send(back))
                });
                if let Some(out) = out {
                    self.hand_back(out).await;
                }
            })
            .await;
    }

    /// Hands back every token this host holds, used or not, once the fetches under way have
    /// ended (or two store time-outs and a linger have passed, in case traffic goes on): for a
    /// host about to stop. Buckets with requests waiting for tokens keep theirs.
    pub(crate) async fn return_all_leases(self: &Arc<Self>) {
        let fetches_end_within = self.config.store_timeout * 2 + self.config.global_batch_linger;
        // Traffic that goes on may keep fetches under way: a bounded wait, then what is held.
        let _ = tokio::time::timeout(fetches_end_within, self.fetches.none_left()).await;
        let now = self.now();
        self.collect_evicted();
        self.for_each_bucket_yielding(|id, b| {
            self.count_served(b);
            if b.is_fetching() || b.waiting() > 0 {
                return;
            }
            self.hand_backs.keep(self.hand_back_dropped(id, b, now));
        })
        .await;
        self.send_kept().await;
    }

    /// Runs `f` on every bucket, part by part, yielding as [`PassPacing`] says: in one go, a
    /// pass over a full store (100,000 keys) would hold its worker thread, and the requests
    /// queued on it, for milliseconds. (The default store's parts are its shards, at most 512
    /// keys each; a store of one part, as custom stores are by default, is passed in one go.)
    async fn for_each_bucket_yielding(&self, mut f: impl FnMut(&LeaseKey<K>, &mut LocalBucket)) {
        let mut pacing = PassPacing::default();
        for part in 0..self.local.parts() {
            let mut visited = 0;
            self.local.for_each_bucket_in(part, |id, b| {
                visited += 1;
                f(id, b);
            });
            if pacing.visited(visited) {
                tokio::task::yield_now().await;
            }
        }
    }

    /// Sends the hand-backs kept so far, many at once (those kept again meanwhile, the store
    /// failing, wait for the next pass).
    async fn send_kept(self: &Arc<Self>) {
        // Each taken only as its hand-back starts: the rest stay kept, for their buckets'
        // fetches to send first if they come sooner, and for the next pass if this one ends
        // early (its task dropped, or its runtime shut down).
        let kept = self.hand_backs.kept();
        stream::iter(0..kept)
            .for_each_concurrent(self.returns_at_once(), |_| async move {
                if let Some(out) = self.hand_backs.send_next_kept() {
                    self.hand_back(out).await;
                }
            })
            .await;
    }

    /// How many hand-backs may be under way at once: a batch's worth at least.
    fn returns_at_once(&self) -> usize {
        CONCURRENT_RETURNS.max(self.config.global_batch)
    }

    /// Hands leased tokens back to the global bucket that dispensed them, or keeps them for a
    /// later sweep if the store is backing off or refused them. Tokens of a hand-back that may
    /// have reached the store are never sent twice: they are counted as lost. Tokens of a
    /// bucket the key no longer draws on are forfeited (the limit that would take them back
    /// is not known any more).
    pub(super) async fn hand_back(self: &Arc<Self>, mut out: Outgoing<'_, K>) {
        let Some(back) = out.take() else {
            return;
        };
        let now = self.now();
        if !self.health.is_up(now) {
            self.hand_backs.keep([back]);
            return;
        }
        let Return {
            id,
            dispenser,
            tokens,
            taken_at,
            unhurried,
        } = back;
        let bucket = self.resolve(&id);
        let Some(bucket) = bucket.filter(|b| dispenser == 0 || dispenser == b.name.id()) else {
            self.stats.tokens_forfeited.add(tokens);
            return;
        };
        // An unhurried hand-back lingers for other calls to join its round trip; one the fleet
        // may need (its key near its limit) goes at once.
        let linger = match unhurried {
            true => self.config.global_batch_linger,
            false => Duration::ZERO,
        };
        // A calendar quota's tokens go back only into their own window: a hand-back that could
        // land after the reset (by the store's clock) would add them to the next. The store
        // drops one that lands later than the host waits for it (a stall).
        let lands_by = now
            .saturating_add(micros(linger))
            .saturating_add(micros(self.config.store_timeout))
            .saturating_add(micros(CLOCK_SKEW));
        let calendar = bucket.limit.calendar();
        if calendar.is_some_and(|c| c.resets_between(taken_at, lands_by) > 0) {
            self.stats.tokens_forfeited.add(tokens);
            return;
        }
        let back = TokenReturn {
            tokens,
            expires: bucket.limit.window_expiry(taken_at),
        };
        let key = self.global_key(&id, bucket.name);
        let call = Call::Release {
            key,
            limit: bucket.limit,
            back,
        };
        let due = match unhurried {
            true => Due::Behind {
                since: self.calls.expedites(),
                within: linger,
            },
            false => Due::Now,
        };
        // Dropped while its call is queued or out (its pass's task gone), the hand-back may yet
        // reach the store: its tokens are counted as lost, never sent again.
        let mut unsettled = Unsettled {
            lost: &self.stats.tokens_lost,
            tokens,
        };
        let Reply { sent_at, answer } = self.call_store(call, due).await;
        unsettled.tokens = 0;
        match answer {
            Ok(_) => {
                self.store_answered();
                self.stats.tokens_returned.add(tokens);
            }
            Err(CallFailure::Store {
                error,
                may_have_applied,
            }) => {
                tracing::debug!(%error, tokens, "global release failed");
                self.store_failed(sent_at, self.now(), &error);
                if may_have_applied {
                    self.stats.tokens_lost.add(tokens);
                } else {
                    self.hand_backs.keep([Return {
                        id,
                        dispenser,
                        tokens,
                        taken_at,
                        unhurried,
                    }]);
                }
            }
            Err(CallFailure::TimedOut) => {
                tracing::debug!(tokens, "global release timed out");
                self.store_failed(sent_at, self.now(), &TimedOut(self.config.store_timeout));
                self.stats.tokens_lost.add(tokens);
            }
        }
    }

    /// Keeps `tokens` taken out of bucket `id`'s lease at `now` for the next sweep to hand
    /// back.
    pub(super) fn defer_return(&self, id: LeaseKey<K>, dispenser: u32, tokens: u64, now: u64) {
        self.hand_backs.keep([Return {
            id,
            dispenser,
            tokens,
            taken_at: now,
            unhurried: false,
        }]);
    }

    /// Takes the tokens of dated bucket `id`'s lease out and keeps them to hand back, if its
    /// calendar quota's reset is near (kept under the bucket's lock: a fetch finds them either
    /// in the lease or kept).
    fn keep_before_reset(&self, id: LeaseKey<K>, now: u64) {
        let Some(bucket) = self.resolve(&id) else {
            return;
        };
        if !self.near_reset(&bucket.limit, now) {
            return;
        }
        self.local.with_bucket(&id, |b| {
            let tokens = b.take_usable();
            self.hand_backs
                .keep(Return::taken(&id, b, tokens, now, false));
        });
    }

    /// Counts the requests served by evicted buckets, and keeps their leases for the next sweep
    /// (or their keys' next fetches) to hand back.
    pub(super) fn collect_evicted(&self) {
        self.hand_backs.collect(|| {
            let evicted = self.local.take_evicted();
            if evicted.is_empty() {
                return Vec::new();
            }
            // One clock read for the lot: a key flood evicts many at once.
            let now = self.now();
            let returns = evicted.into_iter().filter_map(|(id, mut bucket)| {
                self.count_served(&mut bucket);
                self.hand_back_dropped(&id, &mut bucket, now)
            });
            returns.collect()
        });
    }

    /// The hand-back of a bucket being dropped (evicted, or the host stopping) at `now`: all
    /// its tokens but those its lease owes the fleet, which are forfeited.
    fn hand_back_dropped(
        &self,
        id: &LeaseKey<K>,
        bucket: &mut LocalBucket,
        now: u64,
    ) -> Option<Return<K>> {
        let limit = self.resolve(id).map(|r| r.limit);
        let taken = bucket.hand_back_all(now, limit.as_ref());
        self.stats.tokens_forfeited.add(taken.forfeited);
        Return::taken(id, bucket, taken.back, now, false)
    }

    /// Counts what `bucket` served from its lease since it was last counted, and the reserved
    /// tokens that lapsed in it (fell due while it held its capacity) as forfeited.
    pub(super) fn count_served(&self, bucket: &mut LocalBucket) {
        self.stats.admitted_local.add(bucket.take_uncounted());
        let lapsed = bucket.take_lapsed();
        if lapsed > 0 {
            self.stats.tokens_forfeited.add(lapsed);
        }
    }

    /// The counters, with every request served so far counted.
    pub(crate) fn stats(&self) -> ThrottleStats {
        self.local.for_each_bucket(|_, b| self.count_served(b));
        self.collect_evicted();
        self.snapshot()
    }

    /// The counters as they are, with the requests the default store counted on its hot path.
    pub(crate) fn snapshot(&self) -> ThrottleStats {
        let mut stats = self.stats.snapshot();
        if let Some(memory) = self.memory_store() {
            stats.requests_admitted = stats
                .requests_admitted
                .saturating_add(memory.admitted_whole());
        }
        stats.requests_admitted = stats
            .requests_admitted
            .saturating_sub(self.requests_withdrawn.get());
        stats
    }

    /// Starts the background task that hands back unused leases every half lease time, unless
    /// it runs. It stops with the last clone of the layer, or with its runtime; the next slow
    /// path then starts it again on its own runtime.
    pub(super) fn start_sweeper(self: &Arc<Self>) {
        if self.sweeper_running.load(Ordering::Relaxed)
            || self.sweeper_running.swap(true, Ordering::Relaxed)
        {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.sweeper_running.store(false, Ordering::Relaxed);
            return;
        };
        let sweeper = Sweeper {
            throttle: Arc::downgrade(self),
        };
        runtime.spawn(sweeper.run());
    }
}

/// The background sweep; marks the sweeper as stopped when it ends, however it ends.
struct Sweeper<K: Key, G: Global<K>, L: Local<K>, C: Clock> {
    throttle: Weak<Throttle<K, G, L, C>>,
}

impl<K: Key, G: Global<K>, L: Local<K>, C: Clock> Sweeper<K, G, L, C> {
    async fn run(self) {
        let Some(period) = self.throttle.upgrade().map(|t| t.config.lease_ttl / 2) else {
            return;
        };
        let period = period.max(Duration::from_millis(1));
        // The first sweep one period on: a sweep at once has nothing to hand back, and would
        // run at whichever await of its caller the scheduler reached first.
        let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            let Some(throttle) = self.throttle.upgrade() else {
                return;
            };
            throttle.global.maintain();
            throttle.return_unused_leases().await;
            // The sweep has just counted every bucket's requests: no second pass over them.
            #[cfg(feature = "metrics")]
            crate::metrics::publish(&crate::metrics::Snapshot {
                layer: &throttle.config.name,
                stats: &throttle.snapshot(),
                refusals: &throttle.refusals.snapshot(),
                local_keys: throttle.local.len(),
                waiting: throttle.waiting_for_batches.load(Ordering::Relaxed)
                    + throttle.shaper.waiting() as u64,
                store_up: throttle.store_reachable(),
            });
        }
    }
}

impl<K: Key, G: Global<K>, L: Local<K>, C: Clock> Drop for Sweeper<K, G, L, C> {
    fn drop(&mut self) {
        if let Some(throttle) = self.throttle.upgrade() {
            throttle.sweeper_running.store(false, Ordering::Relaxed);
        }
    }
}

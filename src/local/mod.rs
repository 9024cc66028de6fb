//! Local stores: the per-host level of the hierarchy.
//!
//! A host keeps one [`LocalBucket`] per key: the tokens leased to it by the global store, when
//! they were leased, the host's recent demand, and whether the key is throttled. A
//! [`LocalStore`] decides where those buckets live and how many; the throttle decides what
//! happens in them.

use crate::batch::{BatchContext, BatchPolicy, DemandHistory};
use crate::bucket::TokenBucket;
use crate::global::TokenRequest;
use crate::limit::Limit;
use crate::throttle::{Fetch, FetchOutcome};

pub mod memory;

/// The per-host cache of local buckets.
///
/// Implementations must be cheap on [`with_bucket`](Self::with_bucket): it runs on every
/// request. They may bound their size; a bucket dropped while it holds leased tokens must be
/// returned by [`take_evicted`](Self::take_evicted), so its tokens go back to the fleet and its
/// counts reach the statistics.
pub trait LocalStore<K>: Send + Sync + 'static {
    /// Runs `f` on `key`'s bucket, creating an empty one first if there is none.
    fn with_bucket<R>(&self, key: &K, f: impl FnOnce(&mut LocalBucket) -> R) -> R;

    /// Runs `f` on every bucket held.
    fn for_each_bucket(&self, f: impl FnMut(&K, &mut LocalBucket));

    /// The buckets evicted since the last call.
    fn take_evicted(&self) -> Vec<(K, LocalBucket)>;

    /// Number of buckets held.
    fn len(&self) -> usize;

    /// Whether no bucket is held.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One key's state on one host. Its fields are the throttle's; a [`LocalStore`] only keeps it.
///
/// What the hot path touches is inline (48 bytes); the rest is boxed, so a large store stays
/// dense in cache.
#[derive(Default)]
pub struct LocalBucket {
    /// Tokens leased from the global store and not used yet.
    tokens: u64,
    /// Of `tokens`, those a batch brought for the requests that were waiting for it: new
    /// arrivals cannot take them, so a waiting request is never starved by later ones.
    reserved: u64,
    /// Start a background fetch when `tokens` falls below this (half the last batch).
    low_water: u64,
    /// Tokens served from the lease since the clock was last read for this key (saturating:
    /// it is emptied on every slow-path visit).
    unrecorded: u32,
    /// Requests served from the lease and not yet added to the statistics (saturating: it is
    /// emptied on every slow-path visit and sweep).
    uncounted: u32,
    cold: Box<Cold>,
    /// Set by the store on every access; cleared by its eviction pass (second chance).
    used: bool,
}

/// The state only the slow path reads.
#[derive(Default)]
struct Cold {
    /// The batch being fetched, awaited by the requests waiting for it.
    fetch: Option<Fetch>,
    /// When the last batch arrived (clock micros).
    leased_at: u64,
    demand: DemandHistory,
    /// The key is throttled until then (clock micros): the global bucket is short until then.
    throttled_until: u64,
    /// Costs of the requests waiting for the next batch: their sum and the largest.
    waiting_total: u64,
    waiting_largest: u64,
    /// The waiting costs the batch in flight was asked for.
    planned: u64,
    /// The host-local bucket used while the global store is unavailable (boxed: rarely there).
    fallback: Option<Box<TokenBucket>>,
}

impl std::fmt::Debug for LocalBucket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalBucket")
            .field("tokens", &self.tokens)
            .field("throttled_until", &self.cold.throttled_until)
            .field("fetching", &self.cold.fetch.is_some())
            .finish_non_exhaustive()
    }
}

/// What happened when a request found its bucket short.
pub(crate) enum Miss {
    Admitted,
    Throttled { until: u64 },
    Wait(Fetch),
}

impl LocalBucket {
    /// Tokens leased to this host and not used yet.
    pub fn leased_tokens(&self) -> u64 {
        self.tokens
    }

    /// Whether a batch for this bucket is being fetched: such a bucket must not be evicted.
    pub fn is_fetching(&self) -> bool {
        self.cold.fetch.is_some()
    }

    /// Marks the bucket as used; see [`take_used_mark`](Self::take_used_mark).
    #[inline]
    pub fn mark_used(&mut self) {
        self.used = true;
    }

    /// Whether the bucket was marked used since the last call, clearing the mark. For stores
    /// that evict least-recently-used buckets first.
    pub fn take_used_mark(&mut self) -> bool {
        std::mem::take(&mut self.used)
    }

    /// The hot path: takes `cost` leased tokens if there are enough, and starts `fetch` ahead
    /// of need when the lease runs below half the last batch. No clock, no allocation, no
    /// shared counter: the request is counted when the bucket is next on the slow path.
    #[inline]
    pub(crate) fn take_leased(&mut self, cost: u64, fetch: impl FnOnce() -> Fetch) -> bool {
        if !self.take(cost, false) {
            return false;
        }
        self.uncounted = self.uncounted.saturating_add(1);
        if self.tokens.saturating_sub(self.reserved) < self.low_water && self.cold.fetch.is_none() {
            self.cold.fetch = Some(fetch());
        }
        true
    }

    /// Takes `cost` tokens: a request that `waited` for a batch may take the tokens reserved for
    /// the waiting requests; any other only those not reserved.
    #[inline]
    fn take(&mut self, cost: u64, waited: bool) -> bool {
        let available = if waited {
            self.tokens
        } else {
            self.tokens.saturating_sub(self.reserved)
        };
        if available < cost {
            return false;
        }
        self.tokens -= cost;
        if waited {
            self.reserved = self.reserved.saturating_sub(cost);
        }
        let cost = u32::try_from(cost).unwrap_or(u32::MAX);
        self.unrecorded = self.unrecorded.saturating_add(cost);
        true
    }

    /// Requests served from the lease since the last call.
    pub(crate) fn take_uncounted(&mut self) -> u64 {
        u64::from(std::mem::take(&mut self.uncounted))
    }

    /// The fetch in flight for this bucket, started with `fetch` if there is none.
    fn join_fetch(&mut self, fetch: impl FnOnce() -> Fetch) -> Fetch {
        self.cold.fetch.get_or_insert_with(fetch).clone()
    }

    /// Moves the tokens served since the last clock read into the demand history.
    fn record_demand(&mut self, interval: u64) {
        self.cold
            .demand
            .record(interval, u64::from(std::mem::take(&mut self.unrecorded)));
    }

    /// A request found too few tokens at `now` (`waited`: after waiting for a batch): serve it
    /// if a batch has arrived meanwhile, reject it if the key is throttled, or join (or start)
    /// the fetch of the next batch.
    pub(crate) fn miss(
        &mut self,
        cost: u64,
        waited: bool,
        now: u64,
        interval: u64,
        fetch: impl FnOnce() -> Fetch,
    ) -> Miss {
        if self.take(cost, waited) {
            self.record_demand(interval);
            return Miss::Admitted;
        }
        self.record_demand(interval);
        if now < self.cold.throttled_until {
            // Refused requests are demand too: batches sized by what was served alone would
            // shrink to single tokens exactly when the key is over its limit.
            self.cold.demand.record(interval, cost);
            return Miss::Throttled {
                until: self.cold.throttled_until,
            };
        }
        self.cold.waiting_total += cost;
        self.cold.waiting_largest = self.cold.waiting_largest.max(cost);
        Miss::Wait(self.join_fetch(fetch))
    }

    /// What to ask the global store for, or `None` when nothing should be asked (the key is
    /// throttled, or the bucket is already full).
    pub(crate) fn plan(
        &mut self,
        now: u64,
        interval: u64,
        limit: &Limit,
        policy: &dyn BatchPolicy,
        intervals: usize,
    ) -> Option<TokenRequest> {
        self.record_demand(interval);
        let waiting_total = std::mem::take(&mut self.cold.waiting_total);
        let waiting_largest = std::mem::take(&mut self.cold.waiting_largest);
        self.cold.planned = waiting_total;
        let room = limit.capacity().saturating_sub(self.tokens);
        if now < self.cold.throttled_until || room == 0 {
            return None;
        }
        // Tokens held now may go to new arrivals before the batch lands: the batch alone must
        // cover the waiting requests, and it is reserved for them when it does.
        let needed = waiting_total;
        let batch = policy.batch_size(&BatchContext {
            limit,
            needed,
            demand: self.cold.demand.recent(),
            intervals,
        });
        let min = waiting_largest.clamp(1, room);
        let want = batch.max(needed).clamp(min, room);
        Some(TokenRequest { min, want })
    }

    /// Takes in a fetch's outcome; returns tokens beyond capacity, to be handed back.
    ///
    /// A refusal throttles the key until the global bucket is due to hold the batch the host
    /// asked for, not merely the next token (a host asking again for every token would make one
    /// global call per request exactly when the fleet is over its limit), but waits at most
    /// `max_batch_wait` micros beyond the next token, so admission stays smooth.
    pub(crate) fn settle(
        &mut self,
        outcome: &FetchOutcome,
        now: u64,
        limit: &Limit,
        max_batch_wait: u64,
    ) -> u64 {
        self.cold.fetch = None;
        // Everyone waiting on this batch: those it was asked for and those who joined since.
        // Whatever it brings is theirs first; those it cannot serve register again.
        let waiting =
            std::mem::take(&mut self.cold.planned) + std::mem::take(&mut self.cold.waiting_total);
        self.cold.waiting_largest = 0;
        let FetchOutcome::Granted { request, grant } = outcome else {
            return 0;
        };
        if grant.granted == 0 {
            let batch_wait = limit.time_to_accrue(request.want.saturating_sub(request.min));
            let batch_wait = crate::clock::micros(batch_wait).min(max_batch_wait);
            let wait = crate::clock::micros(grant.refill_in)
                .saturating_add(batch_wait)
                .max(1);
            self.cold.throttled_until = now.saturating_add(wait);
            return 0;
        }
        self.cold.throttled_until = 0;
        self.cold.leased_at = now;
        self.low_water = grant.granted / 2;
        let tokens = self.tokens + grant.granted;
        self.tokens = tokens.min(limit.capacity());
        // Added to what earlier batches still hold for their waiters: a reservation left by a
        // request that gave up is taken by the next request that waits.
        self.reserved = self.tokens.min(self.reserved + waiting);
        tokens - self.tokens
    }

    /// Takes the leased tokens out if the lease is older than `ttl` micros and no batch is in
    /// flight, so they can be handed back.
    pub(crate) fn take_expired(&mut self, now: u64, ttl: u64) -> u64 {
        if self.cold.fetch.is_some() || now.saturating_sub(self.cold.leased_at) < ttl {
            return 0;
        }
        self.low_water = 0;
        self.reserved = 0;
        std::mem::take(&mut self.tokens)
    }

    /// Takes `cost` from this host's own fallback bucket, shaped `share`. Returns the wait
    /// until it could be served, or zero if it was.
    pub(crate) fn take_fallback(&mut self, share: &Limit, now: u64, cost: u64) -> u64 {
        let bucket = self
            .cold
            .fallback
            .get_or_insert_with(|| Box::new(TokenBucket::full(share, now)));
        let taken = bucket.take(share, now, cost, cost);
        if taken.granted >= cost {
            0
        } else {
            taken.refill_in_micros.max(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::WeightedDemand;
    use crate::global::Grant;
    use futures_util::FutureExt;
    use std::time::Duration;

    fn grant(tokens: u64) -> FetchOutcome {
        FetchOutcome::Granted {
            request: TokenRequest {
                min: 1,
                want: tokens,
            },
            grant: Grant {
                granted: tokens,
                remaining: 0,
                refill_in: Duration::ZERO,
            },
        }
    }

    fn no_fetch() -> Fetch {
        async { FetchOutcome::Skipped }.boxed().shared()
    }

    #[test]
    fn the_hot_part_of_a_bucket_stays_small() {
        assert_eq!(std::mem::size_of::<LocalBucket>(), 48);
    }

    #[test]
    fn batches_follow_the_weighted_demand_of_the_last_intervals() {
        let limit = Limit::per_second(1000).burst(1000).unwrap();
        let mut b = LocalBucket::default();
        // 12 tokens served in interval 0, 6 in interval 1, none yet in interval 2.
        for (interval, served) in [(0, 12), (1, 6)] {
            for _ in 0..served {
                b.settle(&grant(1), 0, &limit, u64::MAX);
                assert!(matches!(
                    b.miss(1, false, 0, interval, no_fetch),
                    Miss::Admitted
                ));
            }
        }
        // x = 3: (3*0 + 2*6 + 1*12) / (1 + 2 + 3) = 4
        let plan = b.plan(0, 2, &limit, &WeightedDemand, 3);
        assert_eq!(plan, Some(TokenRequest { min: 1, want: 4 }));
        // x = 2 weighs only the last two: (2*0 + 1*6) / 3 = 2
        let plan = b.plan(0, 2, &limit, &WeightedDemand, 2);
        assert_eq!(plan, Some(TokenRequest { min: 1, want: 2 }));
    }

    #[test]
    fn a_batch_covers_the_waiting_requests_and_never_exceeds_capacity() {
        let limit = Limit::per_second(10).burst(10).unwrap();
        let mut b = LocalBucket::default();
        for _ in 0..7 {
            let _ = b.miss(2, false, 0, 0, no_fetch);
        }
        // 7 requests of cost 2 wait: they need 14, the bucket holds at most 10.
        assert_eq!(
            b.plan(0, 0, &limit, &WeightedDemand, 3),
            Some(TokenRequest { min: 2, want: 10 })
        );
    }

    #[test]
    fn a_refused_batch_throttles_the_key_until_tokens_are_due() {
        let limit = Limit::per_second(10).burst(10).unwrap();
        let mut b = LocalBucket::default();
        // The host asked for a batch of 3: 1 token is due in 100 ms, the other 2 in 200 more.
        let refused = FetchOutcome::Granted {
            request: TokenRequest { min: 1, want: 3 },
            grant: Grant {
                granted: 0,
                remaining: 0,
                refill_in: Duration::from_millis(100),
            },
        };
        b.settle(&refused, 1_000, &limit, u64::MAX);
        assert!(matches!(
            b.miss(1, false, 300_999, 0, no_fetch),
            Miss::Throttled { until: 301_000 }
        ));
        assert!(matches!(
            b.miss(1, false, 301_000, 0, no_fetch),
            Miss::Wait(_)
        ));
        // With the batch wait capped at 50 ms: 100 + 50 ms.
        b.settle(&refused, 1_000, &limit, 50_000);
        assert!(matches!(
            b.miss(1, false, 1_000, 0, no_fetch),
            Miss::Throttled { until: 151_000 }
        ));
    }
}

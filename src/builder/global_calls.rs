//! The builder's settings of the calls to the global store: how long one may take, how they
//! are batched, what a failure does, and how much a host leases and for how long.

use std::time::Duration;

use crate::batch::{BatchPolicy, MAX_DEMAND_INTERVALS};
use crate::failure::FailurePolicy;
use crate::throttle::MAX_SETTING;

use super::Builder;

impl<Req, K, G, L, C, R> Builder<Req, K, G, L, C, R> {
    /// How long one call to the global store may take; past it, the call counts as failed and
    /// the [`failure_policy`](Self::failure_policy) decides the requests that waited for it.
    /// A slow store that answers in time never hands a request to the failure policy.
    /// Default: 50 ms; 1 ms to 1 hour.
    pub fn store_timeout(mut self, timeout: Duration) -> Self {
        self.check_duration(timeout, "store_timeout");
        self.config.store_timeout = timeout;
        self
    }

    /// How far ahead of the global bucket's refill a host may reserve tokens when the bucket is
    /// empty (Go's `ReserveN` with a maximum future reserve): the host holds its share of the
    /// next tokens, and uses them once due, instead of asking again for every token. Requests
    /// are refused meanwhile with the exact time their tokens are due, so this changes how
    /// often hosts call the store when a key is over its limit, never what is admitted.
    /// Default: 100 ms; zero turns reservations off; at most 1 hour.
    pub fn max_reservation(mut self, ahead: Duration) -> Self {
        self.check(ahead <= MAX_SETTING, "max_reservation", "at most 1 hour");
        self.config.max_reservation = ahead;
        self
    }

    /// The most global calls sent to the store in one round trip. Calls that fall due together
    /// (queued within one scheduler turn, or while a call waits its
    /// [`global_batch_linger`](Self::global_batch_linger): fetches, charges and hand-backs of
    /// any keys) go as one [`call_many`](crate::global::GlobalStore::call_many): on Redis, one
    /// script per node for all their buckets; a queue that reaches this many goes at once. Each
    /// call keeps its own answer, failure and failure policy; a batch has the store time-out.
    /// Default: 128; 1 sends every call on its own; at most 4,096.
    pub fn global_batch(mut self, max_calls: usize) -> Self {
        let valid = (1..=4_096).contains(&max_calls);
        self.check(valid, "global_batch", "1 to 4,096 calls");
        self.config.global_batch = max_calls;
        self
    }

    /// How long a global call that no request waits on may wait for others to join its batch:
    /// the fetch that pays a cold key's credit, and the hand-back of a lease of a key far from
    /// its limit (one whose global bucket was at least half full). A refill fetched before the
    /// lease of a key far from its limit runs dry waits at most half the time the lease lasts
    /// at the key's recent rate on this host, so that the other half is left for the round
    /// trip. A call a request waits on goes with the next scheduler turn and takes every queued
    /// call along; so do charges, the refill of a lease run dry, a reservation ahead for a key
    /// over its limit, and the refills and hand-backs of a key near its limit. A request that
    /// starts waiting on a lingering fetch sends it at once, so no decision waits for the
    /// linger; a cold key's second request within the linger (after its one token of credit)
    /// waits for the fetch, one round trip, instead of being served from it. A host's credit
    /// stays given until its charge is answered, so the bound of
    /// [`ColdStart::Credit`](crate::ColdStart::Credit) is unchanged. Default: 250 ms, so that
    /// a host seeing a few hundred calls a second sends a few round trips a second (tokio's
    /// timers tick in milliseconds: a linger rounds up to the next); zero sends every call
    /// with the scheduler turn it was made in; at most 1 second.
    pub fn global_batch_linger(mut self, linger: Duration) -> Self {
        let valid = linger <= Duration::from_secs(1);
        self.check(valid, "global_batch_linger", "at most 1 second");
        self.config.global_batch_linger = linger;
        self
    }

    /// What to do when the global store fails or times out. Default:
    /// [`FailurePolicy::LocalFallback`] with one expected host (see [`FailurePolicy`]).
    pub fn failure_policy(mut self, policy: FailurePolicy) -> Self {
        self.config.failure_policy = policy;
        self
    }

    /// The longest the throttle leaves a failing global store alone before probing it again
    /// (back-off starts at 50 ms and doubles). Default: 1 s.
    pub fn max_store_backoff(mut self, backoff: Duration) -> Self {
        self.check_duration(backoff, "max_store_backoff");
        self.config.max_backoff = backoff;
        self
    }

    /// How long leased tokens may sit unused on a host before they are handed back, so tokens
    /// stranded on a quiet host return to the fleet. Default: 2 s (two demand intervals: a
    /// batch is sized to last about one).
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.check_duration(ttl, "lease_ttl");
        self.config.lease_ttl = ttl;
        self
    }

    /// The longest a host refuses a key from what the store last told it (the time its next
    /// tokens are due) before asking again, so that a change made by hand
    /// ([`adjust`](crate::HierarchicalThrottleLayer::adjust): a reset) reaches it. Only waits
    /// longer than this are cut short, each by one call with nothing reserved ahead: for a key
    /// over a per-hour or per-day limit that clients keep calling, one call per this long per
    /// host. Default: the [`lease_ttl`](Self::lease_ttl) (2 s); a longer one costs fewer calls
    /// and lets a reset take longer to reach every host. 1 ms to 1 hour.
    pub fn refusal_memory(mut self, memory: Duration) -> Self {
        self.check_duration(memory, "refusal_memory");
        self.config.refusal_memory = Some(memory);
        self
    }

    /// The demand history that sizes batches: `intervals` intervals (1 to 16) of `interval`
    /// each. Default: 10 intervals of 1 s, so a batch is about one second of this host's
    /// demand: a host at 10 requests per second for a key calls the global store about once
    /// per 10 requests, and strands at most a second's worth of tokens when it goes quiet.
    pub fn demand_window(mut self, intervals: usize, interval: Duration) -> Self {
        self.check(
            (1..=MAX_DEMAND_INTERVALS).contains(&intervals),
            "demand_window",
            "1 to 16 intervals",
        );
        self.check(
            (Duration::from_millis(1)..=MAX_SETTING).contains(&interval),
            "demand_window",
            "intervals of 1 ms to 1 hour",
        );
        self.config.demand_intervals = intervals;
        self.config.demand_interval = interval;
        self
    }

    /// Whether a host keeps a small lease for a key far from its limit (the global bucket at
    /// least half full at its last answer): it asks for at least a sixteenth of the capacity
    /// ([`BatchContext::keep`](crate::batch::BatchContext::keep)) and keeps up to that much
    /// unused for ten lease times-to-live, so a key with a few requests a second per host
    /// costs a call per few requests rather than one per request. Default: on. The global
    /// bucket refilling around what hosts keep is taken back at their next fetch, or forfeited
    /// from what they hand back (the README's "windows that start later"). Off, leases follow
    /// demand alone and go back after one time-to-live, and hold nothing after a longer quiet
    /// stretch, for more calls on slow keys.
    pub fn keep_small_leases(mut self, on: bool) -> Self {
        self.config.keep_small_leases = on;
        self
    }

    /// How batches are sized. Default: [`WeightedDemand`](crate::batch::WeightedDemand).
    pub fn batch_policy(mut self, policy: impl BatchPolicy) -> Self {
        self.batch = Box::new(policy);
        self
    }
}

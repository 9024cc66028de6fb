//! Counters of what the throttle decided, for metrics and tests.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

/// A snapshot of a throttle's counters since it was built. All clones of a layer, and every
/// service it wraps, share one set of counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ThrottleStats {
    /// Requests served from tokens already held by this host: no global call.
    pub admitted_local: u64,
    /// Requests served after waiting for a batch from the global store.
    pub admitted_after_fetch: u64,
    /// Requests admitted at once on credit ([`ColdStart::Credit`](crate::ColdStart)), their
    /// tokens charged to the global store behind them.
    pub admitted_on_credit: u64,
    /// Requests rejected at once because their key was cached as throttled.
    pub rejected_cached: u64,
    /// Requests rejected because the global store had too few tokens.
    pub rejected_global: u64,
    /// Requests refused because their cost exceeds the bucket's capacity.
    pub refused_cost: u64,
    /// Requests without a key (handled by the [`MissingKey`](crate::MissingKey) policy).
    pub missing_key: u64,
    /// Calls to the global store to acquire tokens.
    pub global_calls: u64,
    /// Round trips to the global store: the batches the calls above (and hand-backs) went in
    /// ([`global_batch`](crate::Builder::global_batch)); on Redis, the scripts run.
    pub global_batches: u64,
    /// Global calls that returned an error.
    pub global_errors: u64,
    /// Global calls that did not answer within the time-out.
    pub global_timeouts: u64,
    /// Requests decided by the [`FailurePolicy`](crate::FailurePolicy) because the global store
    /// failed, timed out or was backing off.
    pub fallback_decisions: u64,
    /// Unused leased tokens handed back to the global store (expired or evicted leases).
    pub tokens_returned: u64,
    /// Tokens that may have been dispensed or taken back by the global store without this host
    /// learning it: acquires and hand-backs that timed out, or failed after they may have
    /// reached the store, and hand-backs whose task was dropped while their call was queued or
    /// out. An upper bound (an acquire counts what it asked for); they are never sent twice,
    /// so that no token is given back twice.
    pub tokens_lost: u64,
    /// Requests that would have been refused and were served because the layer is in
    /// [shadow mode](crate::Builder::shadow). They are counted among the refusals too.
    pub shadow_admitted: u64,
    /// Tokens refunded to leases by [`settle`](crate::Builder::settle) (responses that cost
    /// less than charged), summed over the buckets.
    pub tokens_refunded: u64,
    /// Tokens a [`settle`](crate::Builder::settle) charged beyond a lease, or admitted on
    /// [credit](crate::ColdStart), that the global store failed to take (it was down or too
    /// slow): use the fleet did not record.
    pub tokens_uncharged: u64,
    /// Tokens the global store dispensed to this host (granted now or reserved ahead).
    pub tokens_leased: u64,
    /// Tokens admitted by the [`FailurePolicy`](crate::FailurePolicy) without a lease (summed
    /// over the buckets it decided): use the global store never dispensed.
    pub tokens_unleased: u64,
    /// Tokens neither used nor handed back: a lease (or a grant, or a refund) of a global
    /// bucket the key no longer draws on after it changed tiers, refunds of tokens the
    /// failure policy admitted (they were never leased), and what a fetch took back out of a
    /// global bucket that refilled around tokens this host held (the README's "windows that
    /// start later"), and tokens that came back to (or fell due into) a lease holding its
    /// capacity. Never given to another bucket.
    pub tokens_forfeited: u64,
    /// Requests that queued to wait for their tokens ([`Shaping::Wait`](crate::Shaping)). The
    /// checks they make while they wait are not counted above: a waiting request is counted
    /// once, when it is admitted or refused.
    pub shaped_waits: u64,
    /// Requests refused at once by [`Shaping::Wait`](crate::Shaping): their tokens were due
    /// later than the wait allows, or their key's queue was full.
    pub shaped_refusals: u64,
    /// Requests (and [`acquire`](crate::HierarchicalThrottleLayer::acquire)d uses) admitted:
    /// once each, whatever the number of buckets they drew on (the counters above count each
    /// bucket's decision). With [`requests_refused`](Self::requests_refused) and
    /// [`shadow_admitted`](Self::shadow_admitted), every request decided is counted once.
    pub requests_admitted: u64,
    /// Requests (and uses) refused, once each, for any reason.
    pub requests_refused: u64,
    /// Refusals a limit in [shadow](crate::Builder::shadow_limit) would have made, per bucket
    /// decision: the requests went on to the other limits (a request another limit refused
    /// at the same time may count too). By limit in `throttle_refusals_total` with reason
    /// `shadow`.
    pub shadow_limit_refusals: u64,
    /// Requests passed through without a decision: [exempt](crate::Builder::exempt) from
    /// every limit. Not counted in any counter above.
    pub requests_exempt: u64,
}

macro_rules! counters {
    ($($name:ident),* $(,)?) => {
        #[derive(Debug, Default)]
        pub(crate) struct Stats {
            $(pub(crate) $name: Counter,)*
        }

        impl Stats {
            pub(crate) fn snapshot(&self) -> ThrottleStats {
                ThrottleStats { $($name: self.$name.get(),)* }
            }
        }
    };
}

counters!(
    admitted_local,
    admitted_after_fetch,
    admitted_on_credit,
    rejected_cached,
    rejected_global,
    refused_cost,
    missing_key,
    global_calls,
    global_batches,
    global_errors,
    global_timeouts,
    fallback_decisions,
    tokens_returned,
    tokens_lost,
    shadow_admitted,
    tokens_refunded,
    tokens_uncharged,
    tokens_leased,
    tokens_unleased,
    tokens_forfeited,
    shaped_waits,
    shaped_refusals,
    requests_admitted,
    requests_refused,
    shadow_limit_refusals,
    requests_exempt,
);

/// Requests refused, by the refusing limit (`per-second`, `tenant/per-day`) and reason: once per
/// request, whatever the number of buckets it drew on. Names are few (configured), so the
/// table stays small; it is split like [`Counter`] so that threads refusing at once rarely
/// meet on a lock.
#[derive(Debug, Default)]
pub(crate) struct RefusalsByLimit {
    stripes: [Padded<std::sync::Mutex<KindCounts>>; STRIPES],
}

/// Counts by kind, hashed with foldhash: every refusal hashes its kind's names, and SipHash
/// showed in refusal-heavy profiles (the keys are the crate's own names, nothing a client
/// chooses).
type KindCounts = HashMap<RefusalKind, u64, foldhash::fast::FixedState>;

/// A refusing limit (its level and name; none for refusals no limit made) and the reason.
pub(crate) type RefusalKind = (Option<&'static str>, Option<&'static str>, &'static str);

impl RefusalsByLimit {
    pub(crate) fn count(&self, kind: RefusalKind) {
        let stripe = STRIPE.with(|s| *s);
        *crate::sync::lock(&self.stripes[stripe].0)
            .entry(kind)
            .or_default() += 1;
    }

    /// Every kind counted so far, with its count.
    #[cfg(feature = "metrics")]
    pub(crate) fn snapshot(&self) -> Vec<(RefusalKind, u64)> {
        let mut all = KindCounts::default();
        for stripe in &self.stripes {
            for (kind, n) in crate::sync::lock(&stripe.0).iter() {
                *all.entry(*kind).or_default() += n;
            }
        }
        all.into_iter().collect()
    }
}

const STRIPES: usize = 8;

/// A counter split over cache lines, so threads counting hot-path decisions do not contend.
#[derive(Debug, Default)]
pub(crate) struct Counter {
    stripes: [Padded<AtomicU64>; STRIPES],
}

#[derive(Debug, Default)]
#[repr(align(128))]
struct Padded<T>(T);

thread_local! {
    static STRIPE: usize = {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        NEXT.fetch_add(1, Ordering::Relaxed) as usize % STRIPES
    };
}

impl Counter {
    pub(crate) fn incr(&self) {
        self.add(1);
    }

    /// Adds `n`, saturating: token counts can be as large as a settled cost (up to
    /// `u64::MAX`), and a counter must never wrap to a small number.
    pub(crate) fn add(&self, n: u64) {
        let stripe = &self.stripes[STRIPE.with(|s| *s)].0;
        if n < 1 << 32 && stripe.load(Ordering::Relaxed) < u64::MAX >> 1 {
            stripe.fetch_add(n, Ordering::Relaxed);
            return;
        }
        let _ = stripe.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
            Some(v.saturating_add(n))
        });
    }

    pub(crate) fn get(&self) -> u64 {
        self.stripes.iter().fold(0u64, |sum, s| {
            sum.saturating_add(s.0.load(Ordering::Relaxed))
        })
    }
}

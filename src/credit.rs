//! What a host does with a request it holds no leased tokens for, before the global store has
//! answered: wait for the answer, or admit on a small credit and charge it behind the response.

use crate::limit::Limit;

/// How a host decides a request its lease cannot serve while the global bucket is not known to
/// be short: the first request of a key on a host, a key too slow to keep a lease, a lease that
/// ran dry.
///
/// With [`Credit`](Self::Credit) (the default), the request is admitted at once, and the tokens
/// are owed until the fetch that asks for them pays; when the global bucket had run dry, they
/// are charged into debt, which the fleet pays before admitting more of that key. A bucket
/// never owes more than its credit on one host, nor more than the global bucket held at that
/// host's last answer (and has refilled since), so a bucket admits at most
/// `capacity + rate × t + hosts × credit` by time `t`, and only keys already exhausted
/// elsewhere reach the last term. [`Exact`](Self::Exact) makes such requests wait for the
/// store, for `capacity + rate × t`.
///
/// Credit is given only while the global store answers: during a back-off the
/// [`FailurePolicy`](crate::FailurePolicy) decides. Credit whose charge fails (the store went
/// down while it was under way) is counted in
/// [`tokens_uncharged`](crate::ThrottleStats::tokens_uncharged).
///
/// A concurrency layer takes the same setting
/// ([`ConcurrencyBuilder::cold_start`](crate::ConcurrencyBuilder::cold_start), exact by
/// default there): the share is of a key's limit of requests in flight.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum ColdStart {
    /// Wait for the global store's answer.
    Exact,
    /// Admit on credit: each bucket may owe up to `share` of its capacity (at least one token)
    /// on each host. `share` is in `(0, 1]`.
    Credit {
        /// The share of a bucket's capacity a host may owe it.
        share: f64,
    },
}

impl Default for ColdStart {
    /// Credit of 1 % of each bucket's capacity, at least one token: for a limit of 100 per
    /// second, one request per host decided at once.
    fn default() -> Self {
        Self::Credit { share: 0.01 }
    }
}

impl ColdStart {
    /// The tokens a bucket of `limit` may owe on one host.
    pub fn credit(&self, limit: &Limit) -> u64 {
        self.credit_of(limit.capacity())
    }

    /// The share of `capacity` (a bucket's, or a concurrency limit's slots) a host may owe,
    /// at least one (none of nothing); none when exact.
    pub(crate) fn credit_of(&self, capacity: u64) -> u64 {
        match *self {
            Self::Exact => 0,
            // The share is checked at build; the product is at most the capacity.
            Self::Credit { share } => ((capacity as f64 * share) as u64).max(1).min(capacity),
        }
    }

    /// Whether the setting is valid: a share in `(0, 1]`.
    pub(crate) fn is_valid(&self) -> bool {
        match *self {
            Self::Exact => true,
            Self::Credit { share } => share > 0.0 && share <= 1.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn credit_is_a_share_of_the_capacity_and_at_least_one_token() {
        let limit = Limit::per_second(100).burst(100).unwrap();
        assert_eq!(ColdStart::default().credit(&limit), 1);
        assert_eq!(ColdStart::Credit { share: 0.1 }.credit(&limit), 10);
        assert_eq!(ColdStart::Credit { share: 1.0 }.credit(&limit), 100);
        let small = Limit::per(3, Duration::from_secs(1)).burst(3).unwrap();
        assert_eq!(ColdStart::Credit { share: 0.01 }.credit(&small), 1);
        assert_eq!(ColdStart::Exact.credit(&limit), 0);
        // A concurrency limit of nothing (a key refused outright) has no credit either.
        assert_eq!(ColdStart::Credit { share: 1.0 }.credit_of(0), 0);
        assert_eq!(ColdStart::Credit { share: 0.01 }.credit_of(3), 1);
    }

    #[test]
    fn a_share_outside_zero_to_one_is_invalid() {
        for share in [0.0, -0.5, 1.5, f64::NAN, f64::INFINITY] {
            assert!(!ColdStart::Credit { share }.is_valid(), "{share}");
        }
        assert!(ColdStart::Credit { share: 1.0 }.is_valid());
        assert!(ColdStart::Exact.is_valid());
    }
}

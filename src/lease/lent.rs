//! Tokens a lease lends to the per-core reserves of its store: still this host's, spent by
//! requests on one core without the key's shared lock, and repaid before anything but such a
//! take looks at the lease again. So every other step of this machine sees the lease as if
//! the lent tokens had been spent, then as if the unspent ones had never left.

use super::LocalBucket;

impl LocalBucket {
    /// Tokens the lease may lend: those above its low water (none of a calendar quota's, which
    /// carry their time), so lending never starts a fetch ahead of need, and an armed lease
    /// (whose next use must start one) lends nothing.
    pub(crate) fn lendable(&self) -> u64 {
        if self.dated {
            return 0;
        }
        self.tokens.saturating_sub(u64::from(self.low_water))
    }

    /// Lends up to `tokens` of the [lendable](Self::lendable) ones, counted as served until
    /// [repaid](Self::repay); returns how many it lent.
    pub(crate) fn lend(&mut self, tokens: u64) -> u64 {
        self.take_up_to(tokens.min(self.lendable()))
    }

    /// Tokens lent come back: `unspent` of them unspent, the others spent by `served` requests
    /// (which count as served from the lease).
    pub(crate) fn repay(&mut self, unspent: u64, served: u64) {
        self.tokens = self.tokens.saturating_add(unspent);
        self.unrecorded = self
            .unrecorded
            .saturating_sub(u32::try_from(unspent).unwrap_or(u32::MAX));
        self.uncounted = self
            .uncounted
            .saturating_add(u32::try_from(served).unwrap_or(u32::MAX));
        if served > 0 {
            self.mark_used();
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::lease::LocalBucket;

    #[test]
    fn a_lease_lends_only_above_its_low_water_and_is_repaid_as_if_unspent_tokens_never_left() {
        let mut bucket = LocalBucket {
            tokens: 40,
            low_water: 20,
            ..LocalBucket::default()
        };
        assert_eq!(bucket.lendable(), 20);
        assert_eq!(bucket.lend(50), 20, "no more than above the low water");
        assert_eq!((bucket.usable_tokens(), bucket.unrecorded), (20, 20));
        assert_eq!(bucket.lend(1), 0);
        // Of the 20 lent, 12 served 12 requests and 8 come back: served (as demand, and in
        // the counts) is what was spent.
        bucket.repay(8, 12);
        assert_eq!((bucket.usable_tokens(), bucket.unrecorded), (28, 12));
        assert_eq!(bucket.take_uncounted(), 12);
        assert!(
            bucket.take_used_mark(),
            "a lease its reserves served was in use"
        );
        bucket.repay(0, 0);
        assert!(!bucket.take_used_mark());
    }

    #[test]
    fn a_calendar_quota_s_lease_lends_nothing() {
        let mut bucket = LocalBucket {
            tokens: 40,
            dated: true,
            ..LocalBucket::default()
        };
        assert_eq!((bucket.lendable(), bucket.lend(10)), (0, 0));
        assert_eq!(bucket.usable_tokens(), 40);
    }
}

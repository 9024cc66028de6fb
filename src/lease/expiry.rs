//! A lease's age at each sweep: what it has left unused for a lease time-to-live goes back to
//! the global bucket. The sweeper notes what would go at its visit and takes it out only as it
//! hands it back, so that a request in between spends those tokens here: taken out at the
//! visit, they could reach the store after a fetch for the same key that a burst sent
//! meanwhile, and be spent twice, once fetched from the refilled bucket and once handed back
//! on top of it.

use std::cell::LazyCell;

use super::{KEEP_TTLS, LocalBucket};
use crate::limit::Limit;

/// What [`LocalBucket::take_unused`] took out of a lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Unused {
    /// To hand back.
    pub(crate) back: u64,
    /// Taken back out of the fleet instead (an overflow no answer took back).
    pub(crate) forfeited: u64,
}

impl LocalBucket {
    /// A sweep's visit at `now` (in demand interval `interval`; sweeps come every half `ttl`):
    /// reserved tokens now due join the lease (up to the capacity: the rest lapses), a paid
    /// debt lets the bucket be evicted again, its demand is recorded, what it holds noted, and
    /// the lease armed if the global bucket of `limit` may overflow around it before the next
    /// sweep ([`arm_for_overflow`](Self::arm_for_overflow)). Returns the tokens
    /// [`take_unused`](Self::take_unused) would take out for a lease `ttl` old; drops the slow
    /// path's state of an unused lease that holds nothing. The sweeper takes them out only as
    /// it hands them back, so that a request in between spends them here instead of fetching
    /// them before they reach the store.
    pub(crate) fn sweep(
        &mut self,
        now: u64,
        ttl: u64,
        keeps_small: bool,
        interval: u64,
        limit: impl FnOnce() -> Option<Limit>,
    ) -> u64 {
        // Looked up only if a step needs it.
        let limit = LazyCell::new(limit);
        self.release_pending(now, || limit.map_or(u64::MAX, |l| l.capacity()));
        if let Some(cold) = self.cold.as_deref_mut()
            && now >= cold.credit_after
        {
            // Its debt is paid: the bucket may be evicted again.
            cold.credit_after = 0;
        }
        self.record_unrecorded(now, interval);
        self.sample_held(now, || *limit);
        self.arm_for_overflow(now.saturating_add(ttl / 2), || *limit);
        let expiring = self.expiring(now, ttl, keeps_small);
        if expiring == 0 {
            self.shed_if_unused(now, ttl, interval);
        }
        expiring
    }

    /// Takes the usable leased tokens out if the lease has not been used for `ttl` micros at
    /// `now` (nor since the last sweep), so they can be handed back: whether or not a batch is
    /// in flight or tokens are reserved ahead (those stay, and age once due); but for a small
    /// lease of a key far from its limit when the host `keeps_small` leases. Of those, the
    /// overflow an armed lease's use noted and no answer took back is forfeited (see
    /// [`unhold`](Self::unhold)). Drops the slow path's state once it holds nothing any more.
    pub(crate) fn take_unused(
        &mut self,
        now: u64,
        ttl: u64,
        keeps_small: bool,
        interval: u64,
    ) -> Unused {
        self.record_unrecorded(now, interval);
        let expired = self.expiring(now, ttl, keeps_small);
        self.tokens -= expired;
        let forfeited = self.unhold(expired);
        self.shed_if_unused(now, ttl, interval);
        Unused {
            back: expired - forfeited,
            forfeited,
        }
    }

    /// A sweep that takes out at once what it finds unused (the sweeper takes it out later,
    /// as it hands it back), handed back at once.
    #[cfg(test)]
    pub(crate) fn take_expired(
        &mut self,
        now: u64,
        ttl: u64,
        keeps_small: bool,
        interval: u64,
    ) -> u64 {
        self.sweep(now, ttl, keeps_small, interval, || None);
        self.take_unused(now, ttl, keeps_small, interval).back
    }

    /// The usable tokens of a lease unused for `ttl` at `now`, but for a small lease kept.
    fn expiring(&self, now: u64, ttl: u64, keeps_small: bool) -> u64 {
        let unused_for = now.saturating_sub(self.cold().leased_at);
        if unused_for < ttl {
            return 0;
        }
        // A small lease of a key far from its limit stays (a while), so that a slow key is not
        // handed back and fetched again every time-to-live.
        let keep = match keeps_small && unused_for < ttl.saturating_mul(KEEP_TTLS) {
            true => u64::from(self.cold().keep),
            false => 0,
        };
        self.tokens.saturating_sub(keep)
    }

    /// Drops the slow path's state of a lease unused for `ttl` at `now` that holds nothing.
    fn shed_if_unused(&mut self, now: u64, ttl: u64, interval: u64) {
        if self.tokens == 0 && now.saturating_sub(self.cold().leased_at) >= ttl {
            self.low_water = 0;
            self.shed_if_idle(now, interval);
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::lease::LocalBucket;
    use crate::lease::tests::grant_leaving;
    use crate::limit::Limit;

    const TTL: u64 = 1_000_000;

    #[test]
    fn a_sweep_notes_what_went_unused_and_leaves_it_in_the_lease() {
        let limit = Limit::per_second(160).burst(160).unwrap();
        let mut b = LocalBucket::default();
        b.settle(&grant_leaving(25, 40), 0, 0, &limit);
        assert_eq!(b.sweep(TTL - 1, TTL, true, 0, || Some(limit)), 0);
        assert_eq!(b.sweep(TTL, TTL, true, 0, || Some(limit)), 25);
        assert_eq!(b.leased_tokens(), 25, "nothing taken yet");
        assert_eq!(b.take_unused(TTL, TTL, true, 0).back, 25);
        assert_eq!(b.leased_tokens(), 0);
        // A take that finds nothing unused sends nothing.
        assert_eq!(b.take_unused(2 * TTL, TTL, true, 0).back, 0);
    }

    #[test]
    fn a_lease_used_between_the_sweep_and_the_take_keeps_its_tokens() {
        let limit = Limit::per_second(160).burst(160).unwrap();
        let mut b = LocalBucket::default();
        b.settle(&grant_leaving(25, 40), 0, 0, &limit);
        assert_eq!(b.sweep(TTL, TTL, true, 0, || Some(limit)), 25);
        // A burst spends some on the hot path, which reads no clock.
        b.take_leased(5);
        assert_eq!(b.take_unused(TTL, TTL, true, 0).back, 0);
        assert_eq!(b.leased_tokens(), 20);
        // In use from the sweep's time on: unused again one time-to-live later.
        assert_eq!(b.take_unused(2 * TTL - 1, TTL, true, 0).back, 0);
        assert_eq!(b.take_unused(2 * TTL, TTL, true, 0).back, 20);
    }
}

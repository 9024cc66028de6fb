//! Calendar quotas on a host: no token of one window is spent in the next. Near a reset, leases
//! hold none of the quota's tokens, and tokens that left a lease (a refund, a use given up) go
//! back into it only when no reset lies between when they were taken and a margin after now.
//! A batch asked for before a reset serves only the requests that came before it
//! (`LocalBucket::settle`).

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::clock::{Clock, micros};
use crate::limit::Limit;
use crate::quota::LeaseKey;
use crate::throttle::{Admitted, Global, Key, Local, Throttle};

/// How far apart a host's clock and the global store's may be, for a calendar quota's resets:
/// hosts stop holding its tokens this much earlier than their own clock says.
pub(super) const CLOCK_SKEW: Duration = Duration::from_secs(1);

impl<K: Key, G: Global<K>, L: Local<K>, C: Clock> Throttle<K, G, L, C> {
    /// How long before a calendar quota's reset a host stops holding its tokens: long enough
    /// that a sweep falls in it (half the lease time-to-live), that a hand-back sent then still
    /// reaches the store before the reset (two store time-outs), whatever the clocks' skew.
    fn quiet_before_reset(&self) -> u64 {
        micros(self.config.lease_ttl / 2 + self.config.store_timeout * 2 + CLOCK_SKEW)
    }

    /// Whether a lease of `limit` must hold none of its tokens at `now`: the limit is a
    /// calendar quota whose reset is near enough that the next sweep could come after the
    /// last moment a hand-back still reaches the store before it (host clocks within
    /// [`CLOCK_SKEW`] of the store's). Its leases then serve only the requests waiting.
    pub(super) fn near_reset(&self, limit: &Limit, now: u64) -> bool {
        let Some(calendar) = limit.calendar() else {
            return false;
        };
        let quiet = self.quiet_before_reset();
        calendar.resets_between(now, now.saturating_add(quiet)) > 0
    }

    /// Whether a lease of `limit` keeps none of the tokens an answer asked for at `now` brings
    /// beyond what the requests waiting take: near a calendar quota's reset, before it (see
    /// [`near_reset`](Self::near_reset)) or just after it (the store's clock may still be in
    /// the window before; see [`may_take_back`](Self::may_take_back)). A batch asked for then
    /// is only what those requests need: more would be taken from the window only to go back
    /// at the next sweep, while this host, told the bucket is empty, refused requests the
    /// window could serve.
    pub(super) fn keeps_no_tokens(&self, limit: &Limit, now: u64) -> bool {
        !self.may_take_back(limit, now, now)
    }

    /// Whether tokens of `limit` that a use took from a lease at about `taken_at` (0: at a
    /// time not known) may go back into it at `now`. A calendar quota's may not when a reset
    /// lies between then and the quiet margin after now: the next window would spend them, or
    /// the lease would hold them into it. "About": a use is timed when it is admitted, which
    /// may follow the taking by a batch's wait, and the store's clock may be ahead of ours.
    pub(crate) fn may_take_back(&self, limit: &Limit, taken_at: u64, now: u64) -> bool {
        let Some(calendar) = limit.calendar() else {
            return true;
        };
        if taken_at == 0 {
            return false;
        }
        let early = micros(self.config.store_timeout * 2 + CLOCK_SKEW);
        let from = taken_at.saturating_sub(early);
        let to = now.saturating_add(self.quiet_before_reset());
        calendar.resets_between(from, to) == 0
    }

    /// Notes that this host leases `limit`'s tokens: once it leases a calendar quota's,
    /// admissions carry their time (see [`stamped`](Self::stamped)).
    pub(super) fn note_limit(&self, limit: &Limit) {
        if limit.calendar().is_some() && !self.leases_calendar_quotas.load(Ordering::Relaxed) {
            self.leases_calendar_quotas.store(true, Ordering::Relaxed);
        }
    }

    /// `admitted`, with the time it was admitted (unless it has one) once this host leases
    /// calendar quotas' tokens: a refund settled after a reset must not go into the lease.
    /// Before that, no lease held such tokens, and the time is left unknown: the clock is not
    /// read on the hot path.
    #[inline]
    pub(crate) fn stamped(&self, admitted: Admitted) -> Admitted {
        let unknown = admitted.admitted_at() == 0;
        match unknown && self.leases_calendar_quotas.load(Ordering::Relaxed) {
            true => admitted.at(self.now()),
            false => admitted,
        }
    }

    /// [`may_take_back`](Self::may_take_back) now: the clock is read only for a calendar
    /// quota.
    pub(crate) fn may_take_back_now(&self, limit: &Limit, taken_at: u64) -> bool {
        limit.calendar().is_none() || self.may_take_back(limit, taken_at, self.now())
    }

    /// Puts the `tokens` a use took from bucket `id` at `taken_at` (`None`: moments ago; see
    /// [`may_take_back`](Self::may_take_back)) back into its lease, or forfeits them; `undo`:
    /// the use was counted as admitted by the lease, and is not. Until this host leases a
    /// calendar quota's tokens, every lease takes its tokens back as they are. A lease holds
    /// at most its limit's capacity: what would go past it overflows, and is forfeited too
    /// ([`LocalBucket::give_back`](crate::lease::LocalBucket::give_back)).
    pub(crate) fn take_back(
        &self,
        id: &LeaseKey<K>,
        tokens: u64,
        taken_at: Option<u64>,
        undo: bool,
    ) {
        let limit = self.resolve(id).map(|bucket| bucket.limit);
        let back = !self.leases_calendar_quotas.load(Ordering::Relaxed)
            || limit.as_ref().is_none_or(|limit| {
                let taken_at = taken_at.unwrap_or_else(|| self.now());
                self.may_take_back_now(limit, taken_at)
            });
        let kept = if back { tokens } else { 0 };
        let capacity = limit.map_or(u64::MAX, |limit| limit.capacity());
        let overflowed = self.local.with_bucket(id, |b| match undo {
            true => b.undo_take(kept, capacity),
            false => b.give_back(kept, capacity),
        });
        self.stats.tokens_forfeited.add(tokens - kept + overflowed);
    }
}

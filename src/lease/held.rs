//! Tokens a lease holds while the global bucket refills around them: a host holding tokens
//! of a key far from its limit, and a global bucket refilled to its capacity meanwhile, could
//! both be spent in one burst. Answers and sweeps note what the lease holds; its next fetch
//! first takes back out of the global bucket what the refill put past `capacity - held`, by
//! this host's estimate, so a burst after a quiet stretch spends at most the capacity.

use crate::bucket::Grant;
use crate::limit::Limit;

use super::LocalBucket;

impl LocalBucket {
    /// Notes what the lease holds at a sweep, while the key is far from its limit (a key near
    /// it keeps nothing, and its lease lasts less than a sweep).
    pub(super) fn sample_held(&mut self) {
        let tokens = u32::try_from(self.tokens).unwrap_or(u32::MAX);
        if let Some(cold) = self.cold.as_deref_mut().filter(|c| c.keep > 0) {
            cold.held_at_sweep_before = cold.held_at_sweep;
            cold.held_at_sweep = tokens;
        }
    }

    /// Notes what the lease holds once an answer has served the requests waiting for it, as a
    /// sweep would (what it held before counts no more: the answer's level already reflects
    /// it): a burst before the next sweep may spend it on top of the refill.
    pub(super) fn sample_held_at_answer(&mut self) {
        self.forget_held();
        self.sample_held();
    }

    /// `handed_back` tokens left the lease otherwise than by being spent: they are not held.
    pub(super) fn unhold(&mut self, handed_back: u64) {
        let handed_back = u32::try_from(handed_back).unwrap_or(u32::MAX);
        if let Some(cold) = self.cold.as_deref_mut() {
            cold.held_at_sweep = cold.held_at_sweep.saturating_sub(handed_back);
            cold.held_at_sweep_before = cold.held_at_sweep_before.saturating_sub(handed_back);
        }
    }

    /// What the lease held before counts no more: it gave up all its tokens otherwise than by
    /// spending them, or an answer came.
    pub(super) fn forget_held(&mut self) {
        if let Some(cold) = self.cold.as_deref_mut() {
            cold.held_at_sweep = 0;
            cold.held_at_sweep_before = 0;
        }
    }

    /// What a fetch sent at `now` takes out of the global bucket before anything else: the
    /// part of its refill since its last answer that, by this host's estimate, went past
    /// `capacity - held`, while the key was far from its limit at that answer. `held` is the
    /// most the lease held at the answer, at the last two sweeps since and now: what it served
    /// since may have been a burst just before this fetch, spent on top of the refill, so it
    /// counts as held. A bucket that stayed short of full loses nothing.
    pub(crate) fn recharge(&self, now: u64, limit: &Limit) -> u64 {
        let cold = self.cold();
        if cold.keep == 0 {
            // Near its limit at the last answer: nothing was noted.
            return 0;
        }
        let held = self
            .tokens
            .max(u64::from(cold.held_at_sweep))
            .max(u64::from(cold.held_at_sweep_before));
        let beyond = self
            .global_estimate(now, limit)
            .saturating_add(held)
            .saturating_sub(limit.capacity());
        held.min(beyond)
    }

    /// What is left of `grant` once it has paid `recharge`, and how much it paid. A grant
    /// short of it pays what it can: the global bucket held less than the estimate, and what
    /// it lacked it never refilled around this lease.
    pub(super) fn pay_recharge(mut grant: Grant, recharge: u64) -> (Grant, u64) {
        let from_granted = grant.granted.min(recharge);
        let from_reserved = grant.reserved.min(recharge - from_granted);
        grant.granted -= from_granted;
        grant.reserved -= from_reserved;
        (grant, from_granted + from_reserved)
    }
}

#[cfg(test)]
mod tests {
    use super::super::fetch::FetchOutcome;
    use super::super::tests::{FOREVER, SECOND, grant_leaving};
    use super::*;

    /// `granted` tokens asked for at `sent_at`, leaving `remaining` in the global bucket.
    fn grant_sent_at(granted: u64, remaining: u64, sent_at: u64) -> FetchOutcome {
        match grant_leaving(granted, remaining) {
            FetchOutcome::Granted {
                grant, from, shape, ..
            } => FetchOutcome::Granted {
                grant,
                sent_at,
                from,
                shape,
            },
            other => other,
        }
    }

    #[test]
    fn a_fetch_takes_back_what_the_global_bucket_refilled_around_tokens_held() {
        let limit = Limit::per_second(160).burst(160).unwrap();
        let ttl = 2_000_000;
        let mut b = LocalBucket::default();
        // 10 leased from a full bucket, which is left 150: together, its capacity.
        b.settle(&grant_leaving(10, 150), 0, 0, &limit);
        // The global bucket refills 4 in 25 ms: past 150, which with the 10 held would be more
        // than its capacity.
        assert_eq!(b.recharge(25_000, &limit), 4);
        // A sweep sees the 10 held still.
        b.take_expired(SECOND / 2, ttl, true, 0);
        assert_eq!(b.recharge(SECOND, &limit), 10, "at most what was held");
        // A burst spends the 10; the fetch it starts takes back the 10 first, then the lease's.
        b.take_up_to(10);
        let plan = b.plan(SECOND, 0, &limit, false, FOREVER).unwrap();
        assert_eq!(plan.recharge, 10);
        // On top of the batch, which the lease gets whole.
        assert_eq!(plan.request(20, std::time::Duration::ZERO).want, 30);
        let settled = b.settle(&grant_sent_at(30, 130, SECOND), SECOND, 0, &limit);
        assert_eq!(settled.forfeited, 10, "taken back out of the global bucket");
        assert_eq!(b.leased_tokens(), 20);
        // Reckoned afresh from the answer: the 20 the lease holds now, past the refill.
        assert_eq!(b.recharge(2 * SECOND, &limit), 20);
    }

    #[test]
    fn a_key_near_its_limit_takes_nothing_back() {
        let limit = Limit::per_second(160).burst(160).unwrap();
        let ttl = 2_000_000;
        let mut b = LocalBucket::default();
        // Under half left: the key is near its limit, and its lease lasts less than a sweep.
        b.settle(&grant_leaving(10, 70), 0, 0, &limit);
        b.take_expired(SECOND / 2, ttl, true, 0);
        assert_eq!(b.recharge(10 * SECOND, &limit), 0);
    }

    #[test]
    fn tokens_handed_back_are_not_taken_back_again() {
        let limit = Limit::per_second(160).burst(160).unwrap();
        let ttl = SECOND;
        let mut b = LocalBucket::default();
        b.settle(&grant_leaving(25, 135), 0, 0, &limit);
        b.take_expired(SECOND / 2, ttl, true, 0);
        assert_eq!(b.recharge(10 * SECOND, &limit), 25);
        // Past the time-to-live all but the 10 kept go back: only those are held.
        assert_eq!(b.take_expired(ttl, ttl, true, 0), 15);
        assert_eq!(b.recharge(10 * SECOND, &limit), 10);
    }
}

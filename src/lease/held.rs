//! Tokens a lease holds while the global bucket refills around them: a host holding tokens
//! of a key gone quiet, and a global bucket refilled to its capacity meanwhile, could both be
//! spent in one burst. Answers and sweeps note what the lease holds; its next fetch first
//! takes back out of the global bucket what the refill put past `capacity - held`, by this
//! host's estimate and by what the answer shows, so a burst after a quiet stretch spends at
//! most the capacity. What a fetch could not take back (other hosts' fetches had spent that
//! refill first: the burst came to every host at once) is owed: the host's next fetches take
//! it out of what they bring, so the fleet is back within the bound over any window longer
//! than about what the hosts held, at the key's rate. Tokens coming back into a lease (a
//! request gone away, undone or refunded) fill it up to the capacity and no further: the rest
//! overflows, as it would in the bucket itself.

use crate::bucket::Grant;
use crate::limit::Limit;

use super::LocalBucket;

impl LocalBucket {
    /// What the lease holds now: its tokens, and those requests took from it and hold while
    /// they wait for another of their buckets.
    fn holding(&self) -> u64 {
        self.tokens
            .saturating_add(u64::from(self.cold().held_by_waiting))
    }

    /// [`holding`](Self::holding), for a sample.
    fn holding_sample(&self) -> u32 {
        u32::try_from(self.holding()).unwrap_or(u32::MAX)
    }

    /// A request took `tokens` from the lease and now waits for another of its buckets: until
    /// it is admitted (or gives them back) they count as held, since the global bucket refills
    /// around them as around the lease's own.
    pub(crate) fn hold_while_waiting(&mut self, tokens: u64) {
        let tokens = u32::try_from(tokens).unwrap_or(u32::MAX);
        let cold = self.cold_mut();
        cold.held_by_waiting = cold.held_by_waiting.saturating_add(tokens);
    }

    /// The request holding `tokens` by [`hold_while_waiting`](Self::hold_while_waiting) is
    /// done waiting: admitted, or about to give them back.
    pub(crate) fn stop_holding(&mut self, tokens: u64) {
        let tokens = u32::try_from(tokens).unwrap_or(u32::MAX);
        if let Some(cold) = self.cold.as_deref_mut() {
            cold.held_by_waiting = cold.held_by_waiting.saturating_sub(tokens);
        }
    }

    /// Whether the lease held tokens lately, or owes a take-back: its next fetch takes back
    /// what the global bucket refilled around them. A store that evicts the bucket keeps it for
    /// its key's return, emptied lease and all: a bucket made afresh would know none of it, and
    /// its fetch would take that refill, on top of the tokens spent just before (see
    /// [`LocalStore`](crate::local::LocalStore)). Also while tokens reserved ahead that fell
    /// due into its full lease are not counted yet.
    pub fn remembers_held(&self) -> bool {
        let cold = self.cold();
        cold.reserved.lapsed() > 0
            || cold.held_at_sweep > 0
            || cold.held_at_sweep_before > 0
            || cold.overflowed > 0
            || cold.take_back_owed > 0
            || cold.held_by_waiting > 0
    }

    /// Notes what the lease holds at a sweep at `now`, having noted what the global bucket of
    /// `limit` may have refilled around what it held since the last ([`note_overflow_if_far`]).
    ///
    /// [`note_overflow_if_far`]: Self::note_overflow_if_far
    pub(super) fn sample_held(&mut self, now: u64, limit: impl FnOnce() -> Option<Limit>) {
        self.note_overflow_if_far(now, limit);
        let tokens = self.holding_sample();
        if let Some(cold) = self.cold.as_deref_mut() {
            cold.held_at_sweep_before = cold.held_at_sweep;
            cold.held_at_sweep = tokens;
        }
    }

    /// A sweep's arming, for a key near its limit at its last answer, whose fetches ahead of
    /// need take back only what their answers prove overflowed ([`take_back`](Self::take_back)):
    /// if the global bucket of `limit` (`None`: the key's quota no longer has it) may refill
    /// past `capacity - held` by `horizon` (the next sweep), the lease's next use starts a
    /// fetch, which notes what overflowed at that moment ([`disarm`](Self::disarm)) and goes on
    /// only if the lease needs tokens. Without it, a burst that spent tokens held around the
    /// refill long before the lease ran low would leave nothing for an answer to see (the
    /// overflow ends with the burst), and the sweeps' samples are kept for two sweeps only.
    /// An armed lease stays so until that fetch (or until it forgets what it held): the
    /// refill only grows, and only a use lowers what it holds.
    pub(super) fn arm_for_overflow(&mut self, horizon: u64, limit: impl FnOnce() -> Option<Limit>) {
        let Some(cold) = self.cold.as_deref() else {
            return;
        };
        // A key far from its limit takes back by the estimate; an armed lease stays so.
        let far = cold.keep > 0 || cold.global_left == super::NO_ANSWER;
        if far || cold.armed != super::NOT_ARMED || self.fetching || self.tokens == 0 {
            return;
        }
        if self.may_overflow_by(horizon, limit) {
            self.cold_mut().armed = self.low_water.min(super::NOT_ARMED - 1);
            self.low_water = u32::MAX;
        }
    }

    /// A sweep's note at `now`, for a key far from its limit (not armed: its fetches take back
    /// by the estimate, from what the lease held at the last two sweeps): what the global
    /// bucket of `limit` refilled past `capacity - held` by this host's estimate, `held` the
    /// most the lease held since the last sweep. A lease that spends some of its tokens on top
    /// of that refill and hands the rest back leaves no fetch to see it; the next answer takes
    /// back what it proves of the note, and a hand-back forfeits it.
    fn note_overflow_if_far(&mut self, now: u64, limit: impl FnOnce() -> Option<Limit>) {
        let Some(cold) = self.cold.as_deref() else {
            return;
        };
        if cold.keep == 0 || cold.global_left == super::NO_ANSWER {
            return;
        }
        if let Some(limit) = limit() {
            self.note_overflow(now, &limit);
        }
    }

    /// An answer's arming, at its arrival, up to the next sweep (`horizon`): as a sweep's
    /// ([`arm_for_overflow`](Self::arm_for_overflow)). A lease that took most of a bucket near
    /// its limit may see it refill past `capacity - held` before the first sweep since the
    /// answer, and a burst then spend that refill on top of the lease.
    pub(crate) fn arm_after_answer(&mut self, horizon: u64, limit: &Limit) {
        self.arm_for_overflow(horizon, || Some(*limit));
    }

    /// Whether the global bucket of `limit` may refill past `capacity - held` by `horizon`, by
    /// this host's estimate.
    fn may_overflow_by(&self, horizon: u64, limit: impl FnOnce() -> Option<Limit>) -> bool {
        let Some(limit) = limit().filter(|l| l.calendar().is_none()) else {
            return false;
        };
        let held = self.holding().min(limit.capacity());
        self.global_estimate(horizon, &limit).saturating_add(held) > limit.capacity()
    }

    /// At the fetch that a lease armed by a sweep ([`arm_for_overflow`](Self::arm_for_overflow))
    /// started, at `now`: notes what the global bucket of `limit` held past `capacity - held`
    /// by this host's estimate, `held` what the lease held from that sweep until the use that
    /// started the fetch (it spent nothing before), for the next answer to take back as far as
    /// it proves it, and disarms the lease. Returns whether the arming alone started the
    /// fetch: the lease is at or above its low water, no request waits for it and it owes
    /// nothing.
    pub(super) fn disarm(&mut self, now: u64, limit: &Limit) -> bool {
        let armed = self.cold().armed;
        if armed == super::NOT_ARMED {
            return false;
        }
        self.note_overflow(now, limit);
        self.low_water = armed;
        let tokens = self.tokens;
        let cold = self.cold_mut();
        cold.armed = super::NOT_ARMED;
        tokens >= u64::from(armed) && cold.waiters.is_empty() && cold.owed == 0
    }

    /// Notes what the global bucket of `limit` held past `capacity - held` at `now`, by this
    /// host's estimate, `held` the most the lease held since the last sweep (nothing of a
    /// calendar quota's: its bucket does not refill around the lease), for the next answer to
    /// take back as far as it proves it.
    fn note_overflow(&mut self, now: u64, limit: &Limit) {
        // Before an answer came, the tokens were taken from nothing.
        if self.cold().global_left == super::NO_ANSWER {
            return;
        }
        let held = match limit.calendar() {
            Some(_) => 0,
            None => self.held_since_sweep(limit),
        };
        let overflow = past_capacity(self.global_estimate(now, limit), held, limit);
        if overflow == 0 {
            return;
        }
        let cold = self.cold_mut();
        cold.overflowed = cold
            .overflowed
            .max(u32::try_from(overflow).unwrap_or(u32::MAX));
    }

    /// The most the lease held since the last sweep, and now.
    fn held_since_sweep(&self, limit: &Limit) -> u64 {
        self.holding()
            .max(u64::from(self.cold().held_at_sweep))
            .min(limit.capacity())
    }

    /// What the overflow noted at armed leases' uses ([`disarm`](Self::disarm)) an answer
    /// received at `now` proves, having found `level` tokens in the global bucket: the estimate
    /// it was reckoned by runs ahead of the bucket by what other hosts took from it since the
    /// last answer (no more at that use than now), so that much of it comes off. With no other
    /// host at the key, all of it stands.
    fn proven_overflow(&self, now: u64, level: u64, limit: &Limit) -> u64 {
        let cold = self.cold();
        if cold.overflowed == 0 {
            return 0;
        }
        let others_took = self.global_estimate(now, limit).saturating_sub(level);
        u64::from(cold.overflowed).saturating_sub(others_took)
    }

    /// Notes what the lease holds once an answer has served the requests waiting for it, as a
    /// sweep would (what it held before counts no more: the answer's level already reflects
    /// it): a burst before the next sweep may spend it on top of the refill. Not what requests
    /// waiting for another bucket hold: most are admitted within a round trip, and counted as
    /// held until the next fetch they would make it take back a refill they were spent before;
    /// a wait across a sweep is sampled there.
    pub(super) fn sample_held_at_answer(&mut self) {
        let tokens = u32::try_from(self.tokens).unwrap_or(u32::MAX);
        if let Some(cold) = self.cold.as_deref_mut() {
            cold.held_at_sweep_before = 0;
            cold.held_at_sweep = tokens;
            // Taken back by the answer, as far as it proved it.
            cold.overflowed = 0;
        }
    }

    /// `due` tokens reserved ahead came into the lease: held on top of what the last sample
    /// saw, which the lease may have spent since.
    pub(super) fn note_due(&mut self, due: u64) {
        let due = u32::try_from(due).unwrap_or(u32::MAX);
        if let Some(cold) = self.cold.as_deref_mut() {
            cold.held_at_sweep = cold.held_at_sweep.saturating_add(due);
        }
    }

    /// Tokens taken for a request came back into the lease (the request went away, another
    /// of its limits refused it, or its cost was refunded): the lease holds at least what it
    /// holds now. Not added up: a take undone again and again holds no more.
    pub(super) fn note_returned(&mut self) {
        let tokens = self.holding_sample();
        if let Some(cold) = self.cold.as_deref_mut() {
            cold.held_at_sweep = cold.held_at_sweep.max(tokens);
        }
    }

    /// Puts back `tokens` taken for a request that went away before it was served: they pay
    /// what the bucket owes for credit first, then go back to the lease, up to `capacity`.
    /// Returns what would have gone past it, which overflows: the fleet's tokens (the global
    /// bucket's and every lease's) never exceed the capacity, so tokens coming back to a lease
    /// that holds it all are lost, as they would be in the bucket itself. Kept, a burst could
    /// spend them on top of a full lease in one instant.
    pub(crate) fn give_back(&mut self, tokens: u64, capacity: u64) -> u64 {
        let rest = match self.cold.as_deref_mut() {
            Some(cold) if cold.owed > 0 => {
                let paid = tokens.min(u64::from(cold.owed));
                cold.owed -= paid as u32;
                tokens - paid
            }
            _ => tokens,
        };
        let kept = rest.min(capacity.saturating_sub(self.tokens));
        self.tokens += kept;
        self.note_returned();
        rest - kept
    }

    /// Undoes a [`take_leased`](Self::take_leased) of `cost` for a request another of its
    /// buckets refused: the tokens go back to the lease as by [`give_back`](Self::give_back)
    /// (what went past `capacity` is returned), and the request is not counted.
    pub(crate) fn undo_take(&mut self, cost: u64, capacity: u64) -> u64 {
        self.uncounted = self.uncounted.saturating_sub(1);
        self.give_back(cost, capacity)
    }

    /// `handed_back` tokens leave the lease unspent, for the global bucket: they are not held.
    /// Returns how many of them are forfeited instead: as many as the overflow noted at an
    /// armed lease's use ([`disarm`](Self::disarm)) that no answer has taken back yet. The
    /// tokens spent since that use spent the overflow too (a window from that use saw the
    /// global bucket's refill on top of everything the lease held), and handed back whole,
    /// the rest would let the bucket hold its capacity again on top of it. Forfeited where
    /// the capacity would cut the hand-back anyway, they cost nothing more.
    pub(super) fn unhold(&mut self, handed_back: u64) -> u64 {
        let Some(cold) = self.cold.as_deref_mut() else {
            return 0;
        };
        let handed_back = u32::try_from(handed_back).unwrap_or(u32::MAX);
        cold.held_at_sweep = cold.held_at_sweep.saturating_sub(handed_back);
        cold.held_at_sweep_before = cold.held_at_sweep_before.saturating_sub(handed_back);
        let forfeited = cold.overflowed.min(handed_back);
        cold.overflowed -= forfeited;
        u64::from(forfeited)
    }

    /// Takes every leased token out to hand back at `now`, reserved ones included: the bucket
    /// is being dropped (evicted, or the host is stopping). As many as the lease owes the fleet
    /// are forfeited instead: what the global bucket of `limit` (`None`: the key's quota no
    /// longer has it) refilled past `capacity - held` by this host's estimate, `held` the most
    /// the lease held since the last sweep (or answer), or more if an armed use noted more, and
    /// what its fetches could not take back. Dropped with the bucket, none of it would come
    /// off what a later fetch brings, and handed back whole, the tokens would let the global bucket
    /// hold its capacity again on top of what they overflowed. The estimate, not only what
    /// uses noted: a lease used slowly holds the most past `capacity - held` between two uses,
    /// which no use sees, and the tokens it spent since then spent that overflow too.
    pub(crate) fn hand_back_all(
        &mut self,
        now: u64,
        limit: Option<&Limit>,
    ) -> super::expiry::Unused {
        if let Some(limit) = limit {
            self.note_overflow(now, limit);
        }
        let cold = self.cold();
        let owed = u64::from(cold.overflowed).saturating_add(u64::from(cold.take_back_owed));
        let tokens = self.take_all_leased();
        let forfeited = owed.min(tokens);
        super::expiry::Unused {
            back: tokens - forfeited,
            forfeited,
        }
    }

    /// What the lease held before counts no more, nor what a fetch could not take back: it
    /// gave up all its tokens otherwise than by spending them (a calendar quota's reset, a
    /// dropped bucket), the lease holds another bucket's tokens, or an operator changed the
    /// global bucket.
    pub(super) fn forget_held(&mut self) {
        if let Some(cold) = self.cold.as_deref_mut() {
            cold.held_at_sweep = 0;
            cold.held_at_sweep_before = 0;
            cold.overflowed = 0;
            cold.take_back_owed = 0;
            if cold.armed != super::NOT_ARMED {
                self.low_water = std::mem::replace(&mut cold.armed, super::NOT_ARMED);
            }
        }
    }

    /// What a fetch sent at `now` takes out of the global bucket before anything else: the
    /// part of its refill since its last answer that, by this host's estimate, went past
    /// `capacity - held`. `held` is the most the lease held at that answer, at the last two
    /// sweeps since and now: what it served since may have been a burst just before this
    /// fetch, spent on top of the refill, so it counts as held. For a key near its limit at
    /// that answer, only a fetch that requests wait on (a burst ran the lease dry) takes back:
    /// fetching ahead of need, the host's estimate (blind to the other hosts, which keep such
    /// a bucket short) would take back what never overflowed. A bucket that stayed short of
    /// full loses nothing. On top: what earlier fetches could not take back. At most the
    /// capacity.
    pub(crate) fn take_back(&self, now: u64, limit: &Limit) -> u64 {
        let held = self.held(limit);
        self.with_owed(self.take_back_of_refill(now, limit, held), limit)
    }

    /// What an answer to a fetch sent at `sent_at`, received at `now`, takes back:
    /// [`take_back`](Self::take_back) then, or, if more, what the answer shows the global
    /// bucket held past `capacity - held` when the call reached it, or what it proves of the
    /// overflow armed leases' uses noted ([`disarm`](Self::disarm)). That is no estimate: a
    /// fetch ahead of need for a key near its limit takes back what the answer proves
    /// overflowed, and nothing else.
    pub(super) fn take_back_at_answer(
        &self,
        sent_at: u64,
        now: u64,
        grant: &Grant,
        limit: &Limit,
    ) -> u64 {
        let held = self.held(limit);
        let level = grant.granted.saturating_add(grant.remaining);
        let seen = past_capacity(level, held, limit);
        let refill = self
            .take_back_of_refill(sent_at, limit, held)
            .max(seen)
            .max(self.proven_overflow(now, level, limit));
        self.with_owed(refill, limit)
    }

    /// `refill` and what earlier fetches could not take back, at most the capacity; nothing
    /// before an answer came (tokens put back into a bucket no answer came to were taken from
    /// nothing).
    fn with_owed(&self, refill: u64, limit: &Limit) -> u64 {
        let cold = self.cold();
        if cold.global_left == super::NO_ANSWER {
            return 0;
        }
        refill
            .saturating_add(u64::from(cold.take_back_owed))
            .min(limit.capacity())
    }

    /// The part of [`take_back`](Self::take_back) the `held` tokens (see [`held`](Self::held))
    /// make, by this host's estimate of the global bucket.
    fn take_back_of_refill(&self, now: u64, limit: &Limit, held: u64) -> u64 {
        let cold = self.cold();
        let ran_dry = !cold.waiters.is_empty() || cold.owed > 0;
        if cold.keep == 0 && !ran_dry {
            return 0;
        }
        past_capacity(self.global_estimate(now, limit), held, limit)
    }

    /// The most the lease held at its last answer, the last two sweeps since and now. Tokens
    /// beyond the capacity (a limit lowered since) go back as excess: they do not count. Nor
    /// does anything a calendar quota's lease holds: its bucket does not refill around it (it
    /// is whole again at its reset, when leases give up the window's tokens).
    fn held(&self, limit: &Limit) -> u64 {
        if limit.calendar().is_some() {
            return 0;
        }
        let cold = self.cold();
        self.holding()
            .max(u64::from(cold.held_at_sweep))
            .max(u64::from(cold.held_at_sweep_before))
            .min(limit.capacity())
    }

    /// What is left of `grant` once it has paid `take_back`, and how much it paid. A grant
    /// short of it pays what it can (see [`owe_take_back`](Self::owe_take_back)).
    pub(super) fn pay_take_back(mut grant: Grant, take_back: u64) -> (Grant, u64) {
        let from_granted = grant.granted.min(take_back);
        let from_reserved = grant.reserved.min(take_back - from_granted);
        grant.granted -= from_granted;
        grant.reserved -= from_reserved;
        (grant, from_granted + from_reserved)
    }

    /// Notes what a fetch could not take back: the global bucket held less than it, other
    /// hosts' fetches having spent the refill this lease's tokens were held around (a burst
    /// at every host at once). The next fetches take it back out of what they bring.
    pub(super) fn owe_take_back(&mut self, unpaid: u64) {
        let unpaid = u32::try_from(unpaid).unwrap_or(u32::MAX);
        if let Some(cold) = self.cold.as_deref_mut() {
            cold.take_back_owed = unpaid;
        }
    }
}

/// What `held` tokens put a global bucket of `limit` holding `level` past its capacity: the
/// fleet's tokens beyond it, at most those held.
fn past_capacity(level: u64, held: u64, limit: &Limit) -> u64 {
    held.min(level.saturating_add(held).saturating_sub(limit.capacity()))
}

#[cfg(test)]
mod tests {
    use super::super::fetch::FetchOutcome;
    use super::super::fetch::Waiter;
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
        assert_eq!(b.take_back(25_000, &limit), 4);
        // A sweep sees the 10 held still.
        b.take_expired(SECOND / 2, ttl, true, 0);
        assert_eq!(b.take_back(SECOND, &limit), 10, "at most what was held");
        // A burst spends the 10; the fetch it starts takes back the 10 first, then the lease's.
        b.take_up_to(10);
        let plan = b.plan(SECOND, 0, &limit, false, FOREVER).unwrap();
        assert_eq!(plan.take_back, 10);
        // On top of the batch, which the lease gets whole.
        assert_eq!(plan.request(20, std::time::Duration::ZERO).want, 30);
        let settled = b.settle(&grant_sent_at(30, 130, SECOND), SECOND, 0, &limit);
        assert_eq!(settled.forfeited, 10, "taken back out of the global bucket");
        assert_eq!(b.leased_tokens(), 20);
        // Reckoned afresh from the answer: the 20 the lease holds now, past the refill.
        assert_eq!(b.take_back(2 * SECOND, &limit), 20);
    }

    #[test]
    fn tokens_requests_hold_while_waiting_for_another_bucket_count_as_held() {
        let limit = Limit::per_second(160).burst(160).unwrap();
        let ttl = 2_000_000;
        let mut b = LocalBucket::default();
        b.settle(&grant_leaving(10, 150), 0, 0, &limit);
        // Requests take the 10 and wait for another of their buckets past two sweeps: the
        // lease is empty, yet they are still to be spent.
        b.take_up_to(10);
        b.hold_while_waiting(10);
        b.take_expired(SECOND / 4, ttl, true, 0);
        b.take_expired(SECOND / 2, ttl, true, 0);
        // The global bucket refilled to its capacity around them: a fetch takes 10 back.
        assert_eq!(b.take_back(SECOND, &limit), 10);
        // Admitted, they are spent: two sweeps later nothing is held.
        b.stop_holding(10);
        b.take_expired(3 * SECOND / 4, ttl, true, 0);
        assert_eq!(b.take_back(SECOND, &limit), 10, "a burst just spent them");
        b.take_expired(SECOND, ttl, true, 0);
        assert_eq!(b.take_back(SECOND, &limit), 0);
    }

    #[test]
    fn a_key_near_its_limit_takes_back_only_for_a_burst_that_ran_its_lease_dry() {
        let limit = Limit::per_second(160).burst(160).unwrap();
        let ttl = 2_000_000;
        let mut b = LocalBucket::default();
        // Under half left: the key is near its limit. It goes quiet, holding 10.
        b.settle(&grant_leaving(10, 70), 0, 0, &limit);
        b.take_expired(SECOND / 2, ttl, true, 0);
        // A fetch ahead of need takes nothing back: other hosts may keep the bucket short.
        assert_eq!(b.take_back(SECOND, &limit), 0);
        // A burst spends the 10 and a request waits: the bucket has refilled 160 since.
        b.take_up_to(10);
        let (waiter, _rx) = Waiter::new(1, SECOND, 2 * SECOND);
        b.miss(1, SECOND, 0, &limit, true, 0, FOREVER, || waiter);
        assert_eq!(b.take_back(SECOND, &limit), 10);
        // 80 refilled by half a second: 150, which with the 10 held is not past the capacity.
        assert_eq!(b.take_back(SECOND / 2, &limit), 0);
    }

    #[test]
    fn what_a_fetch_could_not_take_back_the_next_fetches_take_back() {
        let limit = Limit::per_second(160).burst(160).unwrap();
        let ttl = 2_000_000;
        let mut b = LocalBucket::default();
        b.settle(&grant_leaving(10, 150), 0, 0, &limit);
        b.take_expired(SECOND / 2, ttl, true, 0);
        // A burst at every host spends the 10 held here; other hosts' fetches came first and
        // left the refilled bucket 4 tokens: this fetch takes those back, and owes 6.
        b.take_up_to(10);
        assert_eq!(
            b.plan(SECOND, 0, &limit, false, FOREVER).unwrap().take_back,
            10
        );
        let settled = b.settle(&grant_sent_at(4, 0, SECOND), SECOND, 0, &limit);
        assert_eq!(settled.forfeited, 4);
        assert_eq!(b.leased_tokens(), 0);
        // The next fetch asks for them on top of its batch, and takes them back.
        let later = SECOND + SECOND / 10;
        let plan = b.plan(later, 0, &limit, false, FOREVER).unwrap();
        assert_eq!(plan.take_back, 6);
        let settled = b.settle(&grant_sent_at(20, 0, later), later, 0, &limit);
        assert_eq!(settled.forfeited, 6);
        assert_eq!(b.leased_tokens(), 14);
        assert_eq!(b.take_back(later, &limit), 0, "nothing owed any more");
    }

    #[test]
    fn a_sweep_notes_what_refilled_around_a_far_keys_lease_for_its_hand_back_to_forfeit() {
        // 30 tokens, one per 60 ms; sweeps every 50 ms (a lease time-to-live of 100 ms).
        let limit = Limit::per(1, std::time::Duration::from_millis(60))
            .burst(30)
            .unwrap();
        let ttl = 100_000;
        let sweep = |b: &mut LocalBucket, now: u64| b.sweep(now, ttl, false, 0, || Some(limit));
        let mut b = LocalBucket::default();
        // 11 leased, 18 left: far from its limit (not armed).
        b.settle(&grant_leaving(11, 18), 0, 0, &limit);
        sweep(&mut b, 50_000);
        sweep(&mut b, 100_000);
        // A slow trickle spends 5 once the bucket has refilled past `30 - 11`.
        b.take_up_to(5);
        // The next sweeps see 6 held, and the bucket refilled 2 by 150 ms: one past 30 - 11.
        sweep(&mut b, 150_000);
        sweep(&mut b, 200_000);
        // A fetch now would see none of it by its estimate: the last two sweeps saw 6 held.
        assert_eq!(b.take_back(200_000, &limit), 0);
        // The lease goes unused: its hand-back forfeits what the sweep at 150 ms noted.
        let unused = b.take_unused(250_000, ttl, false, 0);
        assert_eq!((unused.back, unused.forfeited), (5, 1));
    }

    #[test]
    fn a_dropped_bucket_hands_back_its_tokens_less_what_its_lease_owes_the_fleet() {
        let limit = Limit::per_second(100).burst(100).unwrap();
        // An armed use noted 3 past the capacity; evicted, the 74 left go back but for those.
        let mut b = LocalBucket::default();
        burst_after_arming(&mut b, &limit);
        // By the estimate at 93 ms, the same: 9 refilled around the 94 held at the sweep.
        let taken = b.hand_back_all(93 * MS, Some(&limit));
        assert_eq!((taken.back, taken.forfeited), (71, 3));
        assert!(!b.remembers_held(), "nothing left to owe");
        // A fetch could not take back 6 (other hosts had spent the refill); 14 tokens come
        // back into the lease (requests gone away). Dropped before another fetch, it pays them.
        let big = Limit::per_second(160).burst(160).unwrap();
        let mut b = LocalBucket::default();
        b.settle(&grant_leaving(10, 150), 0, 0, &big);
        b.take_expired(SECOND / 2, 2 * SECOND, true, 0);
        b.take_up_to(10);
        assert_eq!(
            b.plan(SECOND, 0, &big, false, FOREVER).unwrap().take_back,
            10
        );
        b.settle(&grant_sent_at(4, 0, SECOND), SECOND, 0, &big);
        b.give_back(14, big.capacity());
        let taken = b.hand_back_all(SECOND, Some(&big));
        assert_eq!((taken.back, taken.forfeited), (8, 6));
    }

    #[test]
    fn a_dropped_bucket_forfeits_the_refill_around_its_lease_that_no_use_noted() {
        let limit = Limit::per_second(100).burst(100).unwrap();
        // The lease took the whole bucket; armed by the answer, its first use (at 1 ms) finds
        // nothing refilled yet and disarms. Used slowly from then, no use notes the refill
        // growing around it.
        let used_slowly = || {
            let mut b = LocalBucket::default();
            b.settle(&grant_leaving(100, 0), 0, 0, &limit);
            b.arm_after_answer(50 * MS, &limit);
            assert_eq!(spend(&mut b, 1), crate::lease::Hit::AdmittedStartFetch);
            assert!(b.plan(MS, 0, &limit, false, FOREVER).is_none());
            b.settle(&FetchOutcome::Skipped, MS, 0, &limit);
            assert_eq!(spend(&mut b, 4), crate::lease::Hit::Admitted);
            b
        };
        // Evicted at 30 ms: 3 refilled around the 100 held since the answer. Handed back
        // whole, the 95 would fill the bucket again, and a burst then would spend 100 on top
        // of the 4 spent since 1 ms (102.9 allowed).
        let taken = used_slowly().hand_back_all(30 * MS, Some(&limit));
        assert_eq!((taken.back, taken.forfeited), (92, 3));
        // Nothing refilled yet at 1 ms: nothing forfeited.
        let taken = used_slowly().hand_back_all(MS, Some(&limit));
        assert_eq!((taken.back, taken.forfeited), (95, 0));
        // A bucket the key no longer draws on: no limit to reckon by.
        let taken = used_slowly().hand_back_all(30 * MS, None);
        assert_eq!((taken.back, taken.forfeited), (95, 0));
    }

    #[test]
    fn an_operators_change_forgives_what_a_fetch_could_not_take_back() {
        let limit = Limit::per_second(160).burst(160).unwrap();
        let mut b = LocalBucket::default();
        b.settle(&grant_leaving(10, 150), 0, 0, &limit);
        b.take_up_to(10);
        b.settle(&grant_sent_at(0, 0, SECOND), SECOND, 0, &limit);
        assert_eq!(b.take_back(SECOND, &limit), 10, "owed");
        // A reset to full, by hand: the bucket is the operator's now.
        let full = crate::bucket::BucketLevel {
            tokens: 160,
            next_in: std::time::Duration::ZERO,
            full_in: std::time::Duration::ZERO,
        };
        b.adjusted(false, &full, SECOND, SECOND);
        assert_eq!(b.take_back(SECOND, &limit), 0);
    }

    #[test]
    fn an_answer_showing_the_bucket_refilled_around_the_lease_takes_that_back() {
        let limit = Limit::per_second(160).burst(160).unwrap();
        let mut b = LocalBucket::default();
        // Near its limit at the answer: a fetch ahead of need asks for nothing back.
        b.settle(&grant_leaving(20, 10), 0, 0, &limit);
        let plan = b.plan(SECOND, 0, &limit, false, FOREVER).unwrap();
        assert_eq!(plan.take_back, 0);
        // Its answer shows 150 in the bucket when the call reached it: with the 20 held, 10
        // past the capacity, taken out of the grant.
        let settled = b.settle(&grant_sent_at(10, 140, SECOND), SECOND, 0, &limit);
        assert_eq!(settled.forfeited, 10);
        assert_eq!(b.leased_tokens(), 20);
        // An answer showing the bucket short of that takes nothing.
        let settled = b.settle(&grant_sent_at(10, 100, SECOND), SECOND, 0, &limit);
        assert_eq!(settled.forfeited, 0);
        assert_eq!(b.leased_tokens(), 30);
    }

    #[test]
    fn reserved_tokens_that_fall_due_count_as_held_on_top_of_the_sample() {
        let limit = Limit::per_second(160).burst(160).unwrap();
        let mut b = LocalBucket::default();
        // 20 now and 6 reserved, due in 10 ms; the answer notes the 20.
        b.settle(&super::super::tests::grant(20, 6, 10, 0), 0, 0, &limit);
        // A burst spends the 20, then the 6 fall due (at the burst's next slow-path visit) and
        // are spent too: 26 held in all while the bucket refilled.
        b.take_up_to(20);
        let (waiter, _rx) = Waiter::new(7, SECOND, FOREVER);
        b.miss(7, SECOND, 0, &limit, true, 0, FOREVER, || waiter);
        b.take_up_to(6);
        assert_eq!(b.take_back(SECOND, &limit), 26);
    }

    #[test]
    fn tokens_given_back_count_as_held_without_adding_up() {
        let limit = Limit::per_second(160).burst(160).unwrap();
        let mut b = LocalBucket::default();
        b.settle(&grant_leaving(20, 140), 0, 0, &limit);
        b.take_up_to(20);
        // A request's 5 come back (it went away), again and again: 5 held, not 15.
        for _ in 0..3 {
            b.give_back(5, u64::MAX);
            b.take_up_to(5);
        }
        b.give_back(5, u64::MAX);
        assert_eq!(
            b.take_back(SECOND, &limit),
            20,
            "the sample at the answer, the larger"
        );
        b.take_expired(SECOND, 2 * SECOND, true, 0);
        b.take_expired(2 * SECOND, 4 * SECOND, true, 0);
        assert_eq!(
            b.take_back(2 * SECOND, &limit),
            5,
            "once the sweeps see only the 5"
        );
    }

    #[test]
    fn tokens_given_back_to_a_lease_holding_its_capacity_overflow() {
        let limit = Limit::per_second(50).burst(50).unwrap();
        let mut b = LocalBucket::default();
        // 45 leased; requests that took tokens of an earlier batch went away meanwhile.
        b.settle(&grant_leaving(45, 0), 0, 0, &limit);
        // Given back: 5 fit, 3 overflow; undone, the same.
        assert_eq!(b.give_back(8, limit.capacity()), 3);
        assert_eq!(b.leased_tokens(), 50);
        assert_eq!(b.undo_take(6, limit.capacity()), 6);
        assert_eq!(b.leased_tokens(), 50);
        // Credit owed is paid first: nothing of it overflows.
        let mut owing = LocalBucket::default();
        super::super::tests::on_credit(&mut owing, 3, 0, 5);
        assert_eq!(owing.owed(), 3);
        assert_eq!(owing.give_back(3, 0), 0);
        assert_eq!(owing.owed(), 0);
    }

    #[test]
    fn reserved_tokens_falling_due_into_a_full_lease_lapse() {
        // 5 tokens, one per 50 ms.
        let limit = Limit::per_second(20).burst(5).unwrap();
        let three_and_two_reserved = || FetchOutcome::Granted {
            grant: Grant {
                granted: 3,
                reserved: 2,
                ready_in: std::time::Duration::from_millis(100),
                remaining: 0,
                refill_in: std::time::Duration::from_millis(150),
            },
            sent_at: 0,
            from: crate::quota::Name::intern("default"),
            shape: 0,
        };
        let mut b = LocalBucket::default();
        b.settle(&three_and_two_reserved(), 0, 0, &limit);
        // A request refused by another of its key's limits gives its 2 back: the lease is full.
        assert_eq!(b.give_back(2, limit.capacity()), 0);
        assert_eq!(b.usable_tokens(), 5);
        // The reserved 2 fall due: the lease holds its capacity and no more, as a bucket
        // refilled while full does; the 2 are counted once, as forfeited.
        b.sweep(200_000, 2 * SECOND, true, 0, || Some(limit));
        assert_eq!(b.usable_tokens(), 5);
        assert_eq!(b.take_lapsed(), 2);
        assert_eq!(b.take_lapsed(), 0);
        assert!(b.remembers_held());
        // A lease that spent meanwhile has room for them: nothing lapses.
        let mut spent = LocalBucket::default();
        spent.settle(&three_and_two_reserved(), 0, 0, &limit);
        spent.give_back(2, limit.capacity());
        spent.take_up_to(4);
        spent.sweep(200_000, 2 * SECOND, true, 0, || Some(limit));
        assert_eq!(spent.usable_tokens(), 3);
        assert_eq!(spent.take_lapsed(), 0);
    }

    #[test]
    fn a_calendar_quota_takes_nothing_back() {
        let day: Limit = "160 per day at 00:00 UTC".parse().unwrap();
        let mut b = LocalBucket::default();
        b.settle(&grant_leaving(20, 140), 0, 0, &day);
        // Its bucket does not refill around the lease: whole again only at its reset.
        let settled = b.settle(&grant_sent_at(0, 160, SECOND), SECOND, 0, &day);
        assert_eq!(settled.forfeited, 0);
        assert_eq!(b.take_back(SECOND, &day), 0);
    }

    #[test]
    fn tokens_beyond_a_lowered_capacity_are_shed_not_taken_back() {
        let limit = Limit::per_second(160).burst(160).unwrap();
        let lowered = Limit::per_second(4).burst(4).unwrap();
        let mut b = LocalBucket::default();
        b.settle(&grant_leaving(10, 0), 0, 0, &limit);
        // The 6 beyond the new capacity go back as excess; none counts against the refill.
        assert_eq!(b.take_back(0, &lowered), 0);
    }

    #[test]
    fn tokens_handed_back_are_not_taken_back_again() {
        let limit = Limit::per_second(160).burst(160).unwrap();
        let ttl = SECOND;
        let mut b = LocalBucket::default();
        b.settle(&grant_leaving(25, 135), 0, 0, &limit);
        b.take_expired(SECOND / 2, ttl, true, 0);
        assert_eq!(b.take_back(10 * SECOND, &limit), 25);
        // Past the time-to-live all but the 10 kept go back: only those are held.
        assert_eq!(b.take_expired(ttl, ttl, true, 0), 15);
        assert_eq!(b.take_back(10 * SECOND, &limit), 10);
    }

    const MS: u64 = 1_000;

    /// Spends `n` tokens one by one on the hot path; returns the last hit.
    fn spend(b: &mut LocalBucket, n: u64) -> crate::lease::Hit {
        (0..n).fold(crate::lease::Hit::Short, |_, _| b.take_leased(1))
    }

    /// A key of 100 a second whose lease took the whole bucket (near its limit: its fetches
    /// ahead take back only what their answers prove), 94 left at a sweep at 50 ms that finds
    /// the bucket may refill past 6 before the next (10 by 100 ms). A burst at 93 ms spends 20
    /// (the first starts a fetch the arming alone asked for: 9 refilled then, 3 past the 6).
    fn burst_after_arming(b: &mut LocalBucket, limit: &Limit) {
        b.settle(&grant_leaving(100, 0), 0, 0, limit);
        spend(b, 6);
        b.sweep(50 * MS, 100 * MS, true, 0, || Some(*limit));
        assert_eq!(spend(b, 1), crate::lease::Hit::AdmittedStartFetch, "armed");
        assert!(
            b.plan(93 * MS, 0, limit, false, FOREVER).is_none(),
            "no tokens needed"
        );
        b.settle(&FetchOutcome::Skipped, 93 * MS, 0, limit);
        assert_eq!(
            spend(b, 19),
            crate::lease::Hit::Admitted,
            "fetches at half its batch again"
        );
    }

    /// [`burst_after_arming`], then sweeps at 100, 150 and 200 ms that see 74 held, no
    /// overflow ahead, and forget the 94. The lease then runs low at 210 ms and plans its
    /// fetch.
    fn burst_around_the_refill(b: &mut LocalBucket, limit: &Limit) {
        burst_after_arming(b, limit);
        for sweep in [100, 150, 200] {
            b.sweep(sweep * MS, 100 * MS, true, 0, || Some(*limit));
        }
        assert_eq!(spend(b, 25), crate::lease::Hit::AdmittedStartFetch);
        let plan = b.plan(210 * MS, 0, limit, false, FOREVER).unwrap();
        assert_eq!(
            plan.take_back, 0,
            "a fetch ahead of need asks for nothing back"
        );
    }

    #[test]
    fn a_burst_on_a_lease_near_its_limit_is_taken_back_by_a_later_answer_as_far_as_it_proves() {
        let limit = Limit::per_second(100).burst(100).unwrap();
        // One host: the answer finds the 21 refilled since the last, as estimated. What the
        // burst spent past the bucket's capacity comes off the grant; without the arming the
        // answer, which sees 21 + 74 held, would take back nothing.
        let mut b = LocalBucket::default();
        burst_around_the_refill(&mut b, &limit);
        let settled = b.settle(&grant_sent_at(21, 0, 210 * MS), 210 * MS, 0, &limit);
        assert_eq!(settled.forfeited, 3);
        assert_eq!(b.leased_tokens(), 49 + 21 - 3);
        // Another host took 2 of that refill: the estimate ran that far ahead of the bucket,
        // and the overflow it noted may have too.
        let mut b = LocalBucket::default();
        burst_around_the_refill(&mut b, &limit);
        let settled = b.settle(&grant_sent_at(19, 0, 210 * MS), 210 * MS, 0, &limit);
        assert_eq!(settled.forfeited, 1);
        // Taken back: the next answer takes nothing for it.
        let settled = b.settle(&grant_sent_at(5, 0, 260 * MS), 260 * MS, 0, &limit);
        assert_eq!(settled.forfeited, 0);
    }

    #[test]
    fn a_lease_handed_back_after_a_burst_forfeits_what_its_armed_use_saw_overflow() {
        let limit = Limit::per_second(100).burst(100).unwrap();
        let ttl = 100 * MS;
        // The burst's first use notes 3 past the capacity; then the key goes quiet.
        let mut b = LocalBucket::default();
        burst_after_arming(&mut b, &limit);
        for sweep in [100, 150] {
            assert_eq!(b.sweep(sweep * MS, ttl, true, 0, || Some(limit)), 0);
        }
        // Unused for a time-to-live, the 74 left go back but for those 3: handed back whole,
        // the bucket (20 refilled by then, 94 with them) would be full again at 260 ms, and a
        // burst then would spend 100 within 167 ms of the 20 (117 allowed).
        assert_eq!(b.sweep(200 * MS, ttl, true, 0, || Some(limit)), 74);
        let taken = b.take_unused(200 * MS, ttl, true, 0);
        assert_eq!((taken.back, taken.forfeited), (71, 3));
        // Taken back once: the next answer takes nothing for it.
        let settled = b.settle(&grant_sent_at(100, 0, 300 * MS), 300 * MS, 0, &limit);
        assert_eq!(settled.forfeited, 0);
    }

    #[test]
    fn an_answer_arms_a_lease_the_bucket_may_overflow_around_before_the_next_sweep() {
        let limit = Limit::per_second(100).burst(100).unwrap();
        // The lease took the whole bucket at 9 ms and holds 98 once its waiters are served
        // (here, as its grant); 4 refill by 51 ms, 2 past the capacity, and a burst then
        // spends 3. Without the answer's arming, the first sweep (at 100 ms) comes too late to
        // see it, and the next answer takes nothing back.
        let answered = |arm: bool| {
            let mut b = LocalBucket::default();
            b.settle(&grant_sent_at(98, 0, 9 * MS), 11 * MS, 0, &limit);
            if arm {
                b.arm_after_answer(61 * MS, &limit);
            }
            let first = spend(&mut b, 1);
            if first == crate::lease::Hit::AdmittedStartFetch {
                assert!(b.plan(51 * MS, 0, &limit, false, FOREVER).is_none());
                b.settle(&FetchOutcome::Skipped, 51 * MS, 0, &limit);
            }
            spend(&mut b, 2);
            // Steady use down to 49, which the sweeps see.
            spend(&mut b, 46);
            for sweep in [100, 150, 200, 250, 300] {
                b.sweep(sweep * MS, 100 * MS, true, 0, || Some(limit));
            }
            // The next answer, at 305 ms, finds the 29 refilled since 9 ms as estimated.
            let settled = b.settle(&grant_sent_at(29, 0, 305 * MS), 307 * MS, 0, &limit);
            (first, settled.forfeited)
        };
        assert_eq!(answered(true), (crate::lease::Hit::AdmittedStartFetch, 2));
        assert_eq!(answered(false), (crate::lease::Hit::Admitted, 0));
    }

    #[test]
    fn only_a_lease_near_its_limit_and_at_risk_of_an_overflow_is_armed() {
        let limit = Limit::per_second(100).burst(100).unwrap();
        let ttl = 100 * MS;
        // Far from its limit: its fetches take back by the estimate; never armed.
        let mut far = LocalBucket::default();
        far.settle(&grant_leaving(40, 60), 0, 0, &limit);
        far.sweep(50 * MS, ttl, true, 0, || Some(limit));
        assert_eq!(spend(&mut far, 1), crate::lease::Hit::Admitted);
        // Near it, but the bucket cannot refill past the 40 held before the next sweep.
        let mut safe = LocalBucket::default();
        safe.settle(&grant_leaving(40, 0), 0, 0, &limit);
        safe.sweep(50 * MS, ttl, true, 0, || Some(limit));
        assert_eq!(spend(&mut safe, 1), crate::lease::Hit::Admitted);
        // Armed, it stays so until its next use (a later sweep saw 70 of the 100 left, 85 with
        // the refill by 150 ms); that use's fetch asks for nothing, and the lease fetches at
        // half its batch again.
        let mut b = LocalBucket::default();
        b.settle(&grant_leaving(100, 0), 0, 0, &limit);
        b.sweep(50 * MS, ttl, true, 0, || Some(limit));
        b.take_up_to(30);
        b.sweep(100 * MS, ttl, true, 0, || Some(limit));
        assert_eq!(spend(&mut b, 1), crate::lease::Hit::AdmittedStartFetch);
        assert!(b.plan(150 * MS, 0, &limit, false, FOREVER).is_none());
        b.settle(&FetchOutcome::Skipped, 150 * MS, 0, &limit);
        assert_eq!(spend(&mut b, 19), crate::lease::Hit::Admitted);
        assert_eq!(spend(&mut b, 1), crate::lease::Hit::AdmittedStartFetch);
        // A limit the key's quota no longer has arms nothing.
        let mut gone = LocalBucket::default();
        gone.settle(&grant_leaving(100, 0), 0, 0, &limit);
        gone.sweep(50 * MS, ttl, true, 0, || None);
        assert_eq!(spend(&mut gone, 1), crate::lease::Hit::Admitted);
    }
}

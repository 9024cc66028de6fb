//! The fetch half of the lease: a request the lease cannot serve finds the key throttled or
//! waits for the one batch in flight; the batch is planned, and its answer settles the waiters
//! in arrival order.

use tokio::sync::oneshot;

use crate::batch::MAX_DEMAND_INTERVALS;
use crate::bucket::{Grant, TokenRequest};
use crate::clock::micros;
use crate::limit::Limit;
use crate::quota::Name;

use super::{LocalBucket, half};

/// A request waiting for a batch: its cost, until when it may wait for further batches, and
/// where its verdict goes.
#[derive(Debug)]
pub(crate) struct Waiter {
    cost: u64,
    /// When it came (clock micros): a calendar quota's batch asked for before a reset serves
    /// only the requests that came before it.
    came_at: u64,
    /// After this (clock micros), a batch that cannot serve it refuses it instead of asking
    /// again. One batch almost always serves it: a batch covers every request that waited for
    /// it when it was asked for.
    deadline: u64,
    verdict: oneshot::Sender<Verdict>,
}

impl Waiter {
    /// A waiter for a request of `cost` tokens that came at `came_at` and may wait for batches
    /// until `deadline`, and the receiver of its verdict.
    pub(crate) fn new(
        cost: u64,
        came_at: u64,
        deadline: u64,
    ) -> (Self, oneshot::Receiver<Verdict>) {
        let (verdict, receiver) = oneshot::channel();
        let waiter = Self {
            cost,
            came_at,
            deadline,
            verdict,
        };
        (waiter, receiver)
    }

    /// Sends `verdict`; gives it back when the request has gone away.
    pub(crate) fn deliver(self, verdict: Verdict) -> Result<(), Verdict> {
        self.verdict.send(verdict)
    }

    pub(crate) fn cost(&self) -> u64 {
        self.cost
    }

    pub(super) fn is_gone(&self) -> bool {
        self.verdict.is_closed()
    }
}

/// The decision for a waiting request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Its tokens were taken from the lease for it: it is admitted (and must give them back if
    /// it has gone away).
    Admitted,
    /// The global bucket is short; its tokens are due at `until` (clock micros).
    Throttled { until: u64 },
    /// The global store failed: the failure policy decides.
    Failed,
    /// The key's quota no longer has this limit: nothing to enforce (no tokens taken).
    Unlimited,
    /// The request costs more than the limit now holds (it was lowered while the request
    /// waited): it can never be served.
    CostAboveCapacity,
}

/// What happened when a request found the lease short.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Miss {
    Admitted,
    /// The key is known to be short until its tokens are due at `until`.
    Throttled {
        until: u64,
    },
    /// The global store is backing off and no batch is in flight: the failure policy decides.
    StoreDown,
    /// Admitted on credit: the tokens are owed until an answer pays for them. With
    /// `start_fetch`, the caller starts the fetch that asks for them.
    Credited {
        start_fetch: bool,
    },
    /// Queued for the batch in flight.
    Joined,
    /// Queued; the caller starts the fetch.
    StartFetch,
}

/// What a fetch asks the global store for, before the batch policy sizes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Tokens the waiting requests need, and what the bucket owes for credit.
    pub(crate) needed: u64,
    /// What the fetch takes back out of the global bucket first, on top of the batch (see
    /// [`LocalBucket::take_back`]).
    pub(crate) take_back: u64,
    /// Tokens the lease has room for, what it owes and what it takes back.
    pub(crate) room: u64,
    /// The least worth asking for: what the lease may keep, while the global bucket is at
    /// least half full (a slow key then fetches a few requests' worth, not one token).
    pub(crate) keep: u64,
    pub(crate) demand: [u32; MAX_DEMAND_INTERVALS],
    /// Requests wait on this batch.
    pub(crate) waited_on: bool,
    /// Tokens the lease holds still.
    pub(crate) left: u64,
    /// Asked only to check a key known short (see [`LocalBucket::short_at`]): nothing is
    /// reserved ahead, so a check never adds to the queue of tokens owed.
    pub(crate) recheck: bool,
}

impl Plan {
    /// How long (micros, at most `linger`) this batch may wait for other calls to join it: not
    /// at all if a request waits on it, if the key is near its limit (nothing to
    /// [keep](Self::keep)), or if it refills a lease run dry or reserves a key's next tokens;
    /// `linger` if it only pays a credit (no lease runs dry meanwhile); for a refill ahead, half
    /// the time the lease lasts at this host's recent rate for the key (the higher of the last
    /// whole interval's and the current one's so far, which catches a burst), so that the other
    /// half is left for the round trip (and for a faster rate). Intervals are `interval`
    /// micros long; `now` is in the interval the demand was last recorded in.
    pub(crate) fn may_wait(&self, linger: u64, now: u64, interval: u64) -> u64 {
        if self.waited_on || self.keep == 0 {
            // A request waits, or the key is near its limit: what the fleet has left goes
            // where it is needed without delay.
            return 0;
        }
        if self.left == 0 {
            // Only a credit to pay: no lease to run dry. A lease run dry, or a reservation
            // ahead for a key over its limit (its next tokens), goes now.
            return if self.needed > 0 { linger } else { 0 };
        }
        let interval = u128::from(interval.max(1));
        let elapsed = (u128::from(now) % interval).max(1);
        let left = u128::from(self.left);
        // `left` tokens last `left * time / served` at `served` per `time`.
        let lasts = |served: u32, time: u128| match served {
            0 => u128::MAX,
            served => left * time / u128::from(served),
        };
        let lasts = lasts(self.demand[0], elapsed).min(lasts(self.demand[1], interval));
        u64::try_from(lasts / 2).map_or(linger, |half| half.min(linger))
    }

    /// The request for a batch of `batch` tokens (what the batch policy asked for), with
    /// tokens reserved up to `max_delay` ahead unless it is a check.
    pub(crate) fn request(&self, batch: u64, max_delay: std::time::Duration) -> TokenRequest {
        TokenRequest {
            min: 1,
            want: batch
                .max(self.needed)
                .saturating_add(self.take_back)
                .clamp(1, self.room),
            max_delay: if self.recheck {
                std::time::Duration::ZERO
            } else {
                max_delay
            },
        }
    }
}

/// How a fetch ended.
#[derive(Debug, Clone, Copy)]
pub(crate) enum FetchOutcome {
    /// The store, asked at `sent_at` (clock micros) for tokens of the limit called `from`,
    /// of shape `shape` (see [`LocalBucket::reshape`]), answered `grant`.
    Granted {
        grant: Grant,
        sent_at: u64,
        from: Name,
        shape: u32,
    },
    /// Nothing was asked: the key is throttled or the lease is full.
    Skipped,
    /// The call failed, timed out, was not made (the store is backing off) or never finished.
    Failed,
}

/// What settling a fetch hands to the throttle.
#[derive(Debug, Default)]
pub(crate) struct Settled {
    /// Verdicts to deliver, once the bucket is released.
    pub(crate) verdicts: Vec<(Waiter, Verdict)>,
    /// Tokens beyond capacity (the limit was lowered), to hand back.
    pub(crate) excess: u64,
    /// Tokens of another global bucket than the fetch's (the key changed tiers while it was
    /// under way): neither usable nor handed back.
    pub(crate) forfeited: u64,
    /// Requests are still waiting: the caller starts another fetch.
    pub(crate) refetch: bool,
    /// Tokens admitted on credit that the answer did not pay for (the global bucket held
    /// fewer): the caller charges them into debt, then calls
    /// [`end_charge`](LocalBucket::end_charge).
    pub(crate) unpaid: u64,
    /// Tokens admitted on credit that no answer will pay for (the fetch failed, or the limit
    /// went away).
    pub(crate) uncharged: u64,
}

impl LocalBucket {
    /// A request of `cost` found too few tokens at `now`: serve it if reserved tokens have
    /// fallen due, refuse it if the global bucket is known to be short (from an answer less
    /// than `memory` micros old: see [`short_at`](Self::short_at)), admit it on `credit`
    /// (tokens this bucket may owe before an answer) while the store is up, or queue the
    /// `waiter` (made only then) for the batch in flight (or for a new one, unless the store is
    /// backing off).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn miss(
        &mut self,
        cost: u64,
        now: u64,
        interval: u64,
        limit: &Limit,
        store_up: bool,
        credit: u64,
        memory: u64,
        waiter: impl FnOnce() -> Waiter,
    ) -> Miss {
        self.release_pending(now, || limit.capacity());
        let admitted = self.take(cost);
        self.record_demand(now, interval);
        if admitted {
            return Miss::Admitted;
        }
        if self.short_at(now, memory) {
            // Refused requests are demand too: batches sized by what was served alone would
            // shrink to single tokens exactly when the key is over its limit.
            self.cold_mut().demand.record(interval, cost);
            return Miss::Throttled {
                until: self.due(cost, now, limit),
            };
        }
        // A key known short whose memory is due for a check is asked about, not credited.
        let rechecking = now < self.cold().next_token_at;
        if store_up && !rechecking && self.take_on_credit(cost, credit, now, interval, limit) {
            let start_fetch = !std::mem::replace(&mut self.fetching, true);
            return Miss::Credited { start_fetch };
        }
        if self.fetching {
            self.cold_mut().waiters.push(waiter());
            return Miss::Joined;
        }
        if !store_up {
            return Miss::StoreDown;
        }
        self.cold_mut().waiters.push(waiter());
        self.fetching = true;
        Miss::StartFetch
    }

    /// What the global bucket holds at `now` by the last answer and what it has refilled
    /// since, not capped at the capacity (none while it is known to be short; the capacity
    /// when no answer came yet): the most it can hold, as other hosts may have taken some
    /// since.
    pub(crate) fn global_estimate(&self, now: u64, limit: &Limit) -> u64 {
        let cold = self.cold();
        let now = now.max(cold.global_seen_at);
        match cold.global_left {
            super::NO_ANSWER => limit.capacity(),
            _ if now < cold.next_token_at => 0,
            // It was short at its answer: its first token came at `next_token_at`.
            _ if cold.next_token_at > cold.global_seen_at => {
                1 + limit.accrued_between(cold.next_token_at, now)
            }
            left => left.saturating_add(limit.accrued_between(cold.global_seen_at, now)),
        }
    }

    /// Takes `cost` on credit if what the bucket would owe stays within `credit`: the lease's
    /// last tokens first, the rest owed. Never ahead of a request already waiting, nor while a
    /// debt from an earlier credit is being charged or may not be paid yet, nor beyond what the
    /// global bucket can hold by the last answer (credit past it would be an over-admission
    /// known in advance: a key that host has seen nearly spent waits for the store instead).
    fn take_on_credit(
        &mut self,
        cost: u64,
        credit: u64,
        now: u64,
        interval: u64,
        limit: &Limit,
    ) -> bool {
        let lacking = cost.saturating_sub(self.tokens);
        let cold = self.cold();
        let owed = u64::from(cold.owed).saturating_add(lacking);
        let credit = credit
            .min(self.global_estimate(now, limit))
            .min(u64::from(u32::MAX));
        let blocked = now < cold.credit_after || !cold.waiters.is_empty();
        if owed > credit || blocked {
            return false;
        }
        self.tokens = 0;
        let cold = self.cold_mut();
        // At most the credit, which fits.
        cold.owed = owed as u32;
        cold.demand.record(interval, cost);
        true
    }

    /// What the fetch in flight should ask for, or `None` when nothing should be asked (the key
    /// is throttled, the lease is full, or a sweep's arming alone started it: see
    /// [`disarm`](Self::disarm)). With `reserving` (the store may reserve ahead), a key over
    /// its limit whose reserved tokens have all come asks for the next ones at once, before
    /// its next token is due: the store reserves them beyond those owed, so its requests go on
    /// being refused from the cache rather than waiting for a batch. A request waiting on a
    /// key known short from an answer `memory` micros old or more asks again.
    pub(crate) fn plan(
        &mut self,
        now: u64,
        interval: u64,
        limit: &Limit,
        reserving: bool,
        memory: u64,
    ) -> Option<Plan> {
        self.release_pending(now, || limit.capacity());
        self.record_demand(now, interval);
        self.cold_mut().waiters.retain_present();
        if self.disarm(now, limit) {
            return None;
        }
        let owed = u64::from(self.cold().owed);
        let take_back = self.take_back(now, limit);
        let needed = self
            .cold()
            .waiters
            .iter()
            .fold(owed, |sum, w| sum.saturating_add(w.cost));
        let cold = self.cold();
        let reserve_next = reserving && cold.reserved.is_empty() && needed == 0;
        // A request that came once the memory of a short key was due for a check asks.
        let short = now < cold.next_token_at;
        let recheck = short && needed > 0 && now >= self.recheck_at(memory);
        if short && !reserve_next && !recheck {
            // No prefetch either until a batch comes: each would be skipped again.
            self.low_water = 0;
            return None;
        }
        // Tokens reserved ahead do not count: they may fall due here later than the global
        // bucket refills (the answer took time to come), and a request must not be refused
        // while the global bucket could serve it.
        let room = limit
            .capacity()
            .saturating_sub(self.tokens)
            .saturating_add(owed)
            .saturating_add(take_back);
        if room == 0 {
            return None;
        }
        let mut demand = [0; MAX_DEMAND_INTERVALS];
        demand.copy_from_slice(self.cold().demand.recent());
        let keep = match self.cold().global_left {
            super::NO_ANSWER => super::keep_of(limit),
            _ => self.cold().keep,
        };
        Some(Plan {
            needed,
            take_back,
            room,
            keep: u64::from(keep),
            demand,
            waited_on: !self.cold().waiters.is_empty(),
            left: self.tokens,
            recheck,
        })
    }

    /// Takes in a fetch's outcome at `now` and decides every waiting request, in arrival order:
    /// those the lease now covers are admitted (their tokens taken for them; of a calendar
    /// quota's batch asked for before a reset, only those that came before it), the others are
    /// left to the failure policy when the fetch failed, kept for another batch while the
    /// global bucket is not known to be short and their deadline has not passed, or refused
    /// with the time their tokens are due.
    /// The tokens it serves are recorded as demand of `interval`, in use at `now`.
    pub(crate) fn settle(
        &mut self,
        outcome: &FetchOutcome,
        now: u64,
        interval: u64,
        limit: &Limit,
    ) -> Settled {
        let mut settled = Settled::default();
        let mut answered = false;
        match *outcome {
            FetchOutcome::Failed => return self.fail_fetch(),
            // Nothing asked: the key is throttled (its waiters are refused below), or the lease
            // was full (refunds can fill it) and is less so once it has served them.
            FetchOutcome::Skipped => {}
            // Tokens of the bucket the key left while the fetch was under way: not this one's
            // (what it owed that bucket was counted as uncharged when it left).
            FetchOutcome::Granted { grant, from, .. } if !self.holds_tokens_of(from) => {
                settled.forfeited = grant.granted.saturating_add(grant.reserved);
                self.forget_held();
            }
            FetchOutcome::Granted {
                grant,
                sent_at,
                from,
                shape,
            } => {
                self.cold_mut().dispenser = from.id();
                settled.forfeited = self.take_grant(&grant, sent_at, now, limit);
                answered = true;
                settled.excess = self.shed_excess(limit);
                if self.cold().shape != shape {
                    // The limit changed while the call was under way: the answer's times are
                    // the old limit's, so the key is not known to be short.
                    self.cold_mut().next_token_at = 0;
                }
            }
        }
        self.fetching = false;
        settled.unpaid = self
            .cold
            .as_deref_mut()
            .map_or(0, |c| u64::from(std::mem::take(&mut c.owed)));
        if settled.unpaid > 0 {
            self.cold_mut().credit_after = super::CHARGING;
        }
        self.release_pending(now, || limit.capacity());
        let throttled = now < self.cold().next_token_at;
        let window_of_batch = Self::window_of_batch(outcome, limit);
        let mut kept = Vec::new();
        for waiter in self.cold_mut().waiters.take() {
            if waiter.is_gone() {
                continue;
            }
            // One that came after a reset the batch was asked for before waits for a batch of
            // its own window: the lease's tokens may be the window's before.
            let in_window = window_of_batch.is_none_or(|ends| waiter.came_at < ends);
            if in_window && self.take(waiter.cost) {
                settled.verdicts.push((waiter, Verdict::Admitted));
            } else if waiter.cost > limit.capacity() {
                // The limit was lowered below its cost while it waited: no batch can serve it.
                settled.verdicts.push((waiter, Verdict::CostAboveCapacity));
            } else if !throttled && now < waiter.deadline {
                // The global bucket is not known to be short: ask again.
                kept.push(waiter);
            } else {
                let until = self.due(waiter.cost, now, limit).max(now.saturating_add(1));
                settled
                    .verdicts
                    .push((waiter, Verdict::Throttled { until }));
            }
        }
        if answered {
            self.sample_held_at_answer();
        }
        if !kept.is_empty() {
            self.cold_mut().waiters.set(kept);
            self.fetching = true;
            settled.refetch = true;
        }
        self.record_unrecorded(now, interval);
        settled
    }

    /// When the window a batch of `limit` was asked for in ends (clock micros), for a calendar
    /// quota's answered batch: by the host's clock, which the stores' is taken to agree with.
    fn window_of_batch(outcome: &FetchOutcome, limit: &Limit) -> Option<u64> {
        let FetchOutcome::Granted { sent_at, .. } = *outcome else {
            return None;
        };
        Some(limit.calendar()?.reset_after(sent_at, 1))
    }

    /// Ends the fetch in flight as failed: every waiting request goes to the failure policy,
    /// and the next request starts a new fetch.
    pub(crate) fn fail_fetch(&mut self) -> Settled {
        self.end_fetch(Verdict::Failed)
    }

    /// Ends the fetch in flight for a limit the key's quota no longer has: every waiting
    /// request passes, taking nothing.
    pub(crate) fn drop_limit(&mut self) -> Settled {
        self.end_fetch(Verdict::Unlimited)
    }

    fn end_fetch(&mut self, verdict: Verdict) -> Settled {
        self.fetching = false;
        let Some(cold) = self.cold.as_deref_mut() else {
            return Settled::default();
        };
        Settled {
            verdicts: cold
                .waiters
                .take()
                .into_iter()
                .map(|w| (w, verdict))
                .collect(),
            uncharged: u64::from(std::mem::take(&mut cold.owed)),
            ..Settled::default()
        }
    }

    /// Adds a grant asked for at `sent_at` and received at `now` to the lease, once it has paid
    /// what the bucket owes for credit, then what it takes back (tokens granted first, then
    /// those reserved ahead). Returns what it took back: tokens taken out, to be forfeited.
    fn take_grant(&mut self, grant: &Grant, sent_at: u64, now: u64, limit: &Limit) -> u64 {
        // From the time the call was sent, so that no request is refused while the global
        // bucket could already admit it.
        let take_back = self.take_back_at_answer(sent_at, now, grant, limit);
        self.note_global(grant, sent_at, now, limit);
        let grant = self.pay_owed(*grant);
        let (grant, taken_back) = Self::pay_take_back(grant, take_back);
        self.owe_take_back(take_back - taken_back);
        if grant.granted > 0 {
            if self.tokens == 0 {
                self.cold_mut().leased_at = now;
            }
            self.dated = limit.calendar().is_some();
            self.tokens = self.tokens.saturating_add(grant.granted);
            self.low_water = half(grant.granted);
        }
        if grant.reserved > 0 {
            // From the time the answer came, so that reserved tokens are never used before the
            // global bucket has refilled them.
            let due = now.saturating_add(micros(grant.ready_in));
            self.cold_mut().reserved.add(due, grant.reserved);
        }
        taken_back
    }

    /// What is left of `grant` once it has paid what the bucket owes.
    fn pay_owed(&mut self, mut grant: Grant) -> Grant {
        let cold = self.cold_mut();
        let owed = u64::from(cold.owed);
        let from_granted = grant.granted.min(owed);
        let from_reserved = grant.reserved.min(owed - from_granted);
        grant.granted -= from_granted;
        grant.reserved -= from_reserved;
        // What is left is less than what was owed, which fit.
        cold.owed = (owed - from_granted - from_reserved) as u32;
        grant
    }

    /// Removes the usable tokens beyond capacity (after a limit was lowered).
    fn shed_excess(&mut self, limit: &Limit) -> u64 {
        let excess = self.tokens.saturating_sub(limit.capacity());
        self.tokens -= excess;
        excess
    }
}

#[cfg(test)]
mod tests {
    use super::{MAX_DEMAND_INTERVALS, Plan};

    const SECOND: u64 = 1_000_000;
    const LINGER: u64 = 5_000;

    /// A batch for a lease holding `left` tokens, having served `current` tokens in this
    /// interval so far and `previous` in the last.
    fn plan(left: u64, current: u32, previous: u32) -> Plan {
        let mut demand = [0; MAX_DEMAND_INTERVALS];
        demand[0] = current;
        demand[1] = previous;
        Plan {
            needed: 0,
            take_back: 0,
            room: 100,
            keep: 1,
            demand,
            waited_on: false,
            left,
            recheck: false,
        }
    }

    #[test]
    fn a_batch_a_request_waits_on_never_waits() {
        let waited_on = Plan {
            waited_on: true,
            ..plan(100, 0, 0)
        };
        assert_eq!(waited_on.may_wait(LINGER, SECOND / 2, SECOND), 0);
    }

    #[test]
    fn a_credits_batch_may_wait_and_a_dry_lease_or_a_reservation_does_not() {
        // A credit to pay, nothing leased: no lease runs dry meanwhile.
        let credit = Plan {
            needed: 1,
            ..plan(0, 1_000, 1_000)
        };
        assert_eq!(credit.may_wait(LINGER, SECOND / 2, SECOND), LINGER);
        // Nothing owed, nothing left: a lease run dry, or the next tokens of a key over its
        // limit, which its requests are refused without meanwhile.
        assert_eq!(plan(0, 0, 0).may_wait(LINGER, SECOND / 2, SECOND), 0);
    }

    #[test]
    fn a_refill_ahead_waits_half_the_time_its_lease_lasts() {
        // 400 a second: 3 tokens last 7.5 ms, 2 last 5 ms.
        let now = 7 * SECOND + SECOND / 2;
        assert_eq!(plan(3, 0, 400).may_wait(LINGER, now, SECOND), 3_750);
        assert_eq!(plan(2, 0, 400).may_wait(LINGER, now, SECOND), 2_500);
        // The same from this interval alone (200 in its first half).
        assert_eq!(plan(3, 200, 0).may_wait(LINGER, now, SECOND), 3_750);
        // The higher of the two rates counts.
        assert_eq!(plan(3, 200, 800).may_wait(LINGER, now, SECOND), 1_875);
        // No more than the linger, however long the lease lasts.
        assert_eq!(plan(1, 3, 5).may_wait(LINGER, now, SECOND), LINGER);
        assert_eq!(plan(5, 0, 0).may_wait(1_000, now, SECOND), 1_000);
        // A slow key's lease (6 tokens at 3 a second last 2 s) waits the default linger.
        assert_eq!(plan(6, 0, 3).may_wait(250_000, now, SECOND), 250_000);
        // A hot key's (40 tokens at 400 a second last 100 ms), half that.
        assert_eq!(plan(40, 0, 400).may_wait(250_000, now, SECOND), 50_000);
        // A key near its limit (its lease keeps nothing) refills, and pays credit, at once.
        for left in [40, 0] {
            let near = Plan {
                keep: 0,
                needed: 1,
                ..plan(left, 0, 400)
            };
            assert_eq!(near.may_wait(250_000, now, SECOND), 0);
        }
    }

    #[test]
    fn a_burst_at_the_start_of_an_interval_refills_at_once() {
        // Six served within the interval's first millisecond: 30 last 5 ms.
        let now = 3 * SECOND + 1_000;
        assert_eq!(plan(30, 6, 0).may_wait(LINGER, now, SECOND), 2_500);
        assert_eq!(plan(1, 6, 0).may_wait(LINGER, now, SECOND), 83);
    }
}

//! One key's lease on one host, as a pure state machine: no I/O, no clock, no locks, no
//! spawns. The throttle reads the clock, calls the global store and delivers the verdicts this
//! machine hands out; everything it decides is here, so it can be tested step by step.

//!
//! This floor uses only the model below it (limits, names, the bucket arithmetic); it holds a
//! oneshot sender per waiting request and nothing else asynchronous.

mod expiry;
mod fallback;
mod fetch;
mod held;
mod lent;
mod reserved;
mod reshape;
mod waiters;

use crate::batch::DemandHistory;
use crate::bucket::{BucketLevel, Grant, TokenBucket};
use crate::clock::micros;
use crate::limit::Limit;
use crate::quota::Name;

use fallback::Fallback;
pub(crate) use fetch::{FetchOutcome, Miss, Plan, Settled, Verdict, Waiter};
use reserved::Reserved;
use waiters::Waiters;

/// One key's state on one host. Its fields are the throttle's; a
/// [`LocalStore`](crate::local::LocalStore) only keeps it.
///
/// What the hot path touches is inline (32 bytes); the rest is boxed, and only held while the
/// key has any: a key that has been quiet for a demand window, with no lease, no throttled
/// period and no fleet estimate short of full, sheds it. So a large store stays small and dense
/// in cache.
#[derive(Default)]
pub struct LocalBucket {
    /// Leased tokens usable now.
    tokens: u64,
    /// Start a background fetch when `tokens` falls below this (half the last batch, at most
    /// `u32::MAX`: a larger batch only starts its prefetch a little early).
    low_water: u32,
    /// Tokens served since the clock was last read for this key (saturating: it is emptied on
    /// every slow-path visit).
    unrecorded: u32,
    /// Requests served from the lease and not yet added to the statistics (saturating: it is
    /// emptied on every slow-path visit and sweep).
    uncounted: u32,
    /// A batch is being fetched (or about to be): at most one per key and host.
    fetching: bool,
    /// Set by the store on every access; cleared by its eviction pass (second chance).
    used: bool,
    /// How many limits the key's quota had when last looked up (kept by a key's first bucket,
    /// so that the hot path finds the others without asking for the quota); 0 while unknown.
    slots: u8,
    /// The lease holds a calendar quota's tokens, which it must not keep past the quota's reset.
    dated: bool,
    cold: Option<Box<Cold>>,
}

/// The state only the slow path reads; `None` in a bucket while it equals [`Cold::IDLE`].
struct Cold {
    /// Requests waiting for the batch being fetched, in arrival order.
    waiters: Waiters,
    /// When the lease was last seen in use, or filled from empty (clock micros): it is handed
    /// back once unused for the lease time-to-live, whatever it reserves meanwhile.
    leased_at: u64,
    demand: DemandHistory,
    /// The global bucket holds no whole token before then (clock micros): requests the lease
    /// cannot serve are refused until then without a global call.
    next_token_at: u64,
    /// Tokens reserved ahead of the global refill, each tranche usable once due.
    reserved: Reserved,
    /// The host-local bucket used while the global store is unavailable (boxed: rarely there).
    fallback: Option<Box<Fallback>>,
    /// Tokens admitted on credit (before the global store answered) that no answer has paid
    /// for yet: at most the credit, and only while a fetch or a debt charge is under way.
    owed: u32,
    /// No credit before then (clock micros): the last answer for credit that found the global
    /// bucket short, plus its wait, counted from when the answer came rather than when the
    /// call was sent, so that a credit never lands on a debt the store has not recovered yet;
    /// [`CHARGING`] while what an answer could not pay is being charged. 0: none.
    credit_after: u64,
    /// Leased tokens the bucket may keep past the lease time-to-live: some when the global
    /// bucket held at least half its capacity at the last answer, none when it did not.
    keep: u32,
    /// Tokens the lease held at the last sweep and at the one before, or at the last answer
    /// (once it served its waiters) and the sweep since, less those handed back since.
    /// The global bucket refills while they are held, so a burst could spend both: the next
    /// fetch first takes out what that refill put in the global bucket past `capacity - held`
    /// ([`LocalBucket::take_back`]).
    held_at_sweep: u32,
    held_at_sweep_before: u32,
    /// The low water to go back to once the lease's next use has noted what the global bucket
    /// held past `capacity - held_at_sweep` ([`NOT_ARMED`]: it is not armed; see
    /// [`LocalBucket::arm_for_overflow`]).
    armed: u32,
    /// What uses of an armed lease found the global bucket held past `capacity - held`, by
    /// this host's estimate: the next answer takes back as much of it as it proves.
    overflowed: u32,
    /// Tokens requests took from the lease and hold while they wait for another of their
    /// buckets: theirs only once admitted, back in the lease if not, so held until then.
    held_by_waiting: u32,
    /// What the last fetch could not take back (the global bucket held less: other hosts'
    /// fetches had spent the refill this lease's tokens were held around): the next fetches
    /// take it out of what they bring.
    take_back_owed: u32,
    /// Which limit (a hash of its name and shape) this bucket was last used for.
    shape: u32,
    /// The global bucket whose tokens the lease holds (its limit's name's [id](Name::id); 0
    /// while unknown): only it may take them back, or be refunded into them.
    dispenser: u32,
    /// Whole tokens the global bucket held at its last answer, and when that came (clock
    /// micros): what the host estimates the fleet has left from. [`NO_ANSWER`] before any
    /// answer (a sentinel, not an `Option`: it keeps this state in a smaller allocation).
    global_left: u64,
    global_seen_at: u64,
    /// From then on (clock micros) the key is not throttled and the fleet estimate is full:
    /// with no lease, no waiter and no demand left in the window, the state can be dropped.
    /// Never before `next_token_at`: both are set together, from the same answer.
    quiet_at: u64,
}

impl Cold {
    const IDLE: Self = Self {
        waiters: Waiters::NONE,
        leased_at: 0,
        demand: DemandHistory::new(),
        next_token_at: 0,
        reserved: Reserved::NONE,
        fallback: None,
        owed: 0,
        credit_after: 0,
        keep: 0,
        held_at_sweep: 0,
        held_at_sweep_before: 0,
        armed: NOT_ARMED,
        overflowed: 0,
        held_by_waiting: 0,
        take_back_owed: 0,
        shape: 0,
        dispenser: 0,
        global_left: NO_ANSWER,
        global_seen_at: 0,
        quiet_at: 0,
    };

    /// Whether dropping this state at `now` (in demand interval `interval`) loses nothing.
    fn is_idle(&self, now: u64, interval: u64) -> bool {
        self.waiters.is_empty()
            && self.owed == 0
            && self.held_by_waiting == 0
            && self.credit_after == 0
            && self.reserved.is_empty()
            && self.reserved.lapsed() == 0
            && self.fallback.as_ref().is_none_or(|f| f.is_full_at(now))
            && now >= self.quiet_at
            && self.demand.is_idle(interval)
    }
}

/// [`Cold::credit_after`] while a credit is being charged: no credit until the charge ends.
pub(crate) const CHARGING: u64 = u64::MAX;

/// A host keeps at most this share of a bucket's capacity past the lease time-to-live, and
/// asks for at least that much in a batch, while the bucket is at least half full.
const KEEP_SHARE: u64 = 16;

/// A kept lease that nothing uses goes back after this many lease times-to-live all the same.
const KEEP_TTLS: u64 = 10;

/// What a bucket may keep past its lease time-to-live, after an answer that left `remaining`
/// tokens in the global bucket of `limit`: a sixteenth of the capacity (at least one token)
/// while at least half of it is left; nothing once the key is close to its limit.
fn keep_after(remaining: u64, limit: &Limit) -> u32 {
    match remaining.saturating_mul(2) >= limit.capacity() {
        true => keep_of(limit),
        false => 0,
    }
}

/// A sixteenth of `limit`'s capacity, at least one token.
fn keep_of(limit: &Limit) -> u32 {
    u32::try_from((limit.capacity() / KEEP_SHARE).max(1)).unwrap_or(u32::MAX)
}

/// [`Cold::armed`] while the lease is not armed.
const NOT_ARMED: u32 = u32::MAX;

/// [`Cold::global_left`] before the global store has answered.
const NO_ANSWER: u64 = u64::MAX;

/// What a bucket without cold state reads.
static IDLE: Cold = Cold::IDLE;

/// What a bucket holds as this host sees it: its lease plus its estimate of the global bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct View {
    /// Tokens estimated left, at most the capacity.
    pub(crate) tokens: u64,
    /// Microseconds until the bucket holds more (zero when full).
    pub(crate) next_in: u64,
    /// Microseconds until the bucket is full again (zero when full).
    pub(crate) full_in: u64,
    /// The host's share of the limit, when the view is of the bucket it decides with alone
    /// while the store is down: what it refills at and holds.
    pub(crate) share: Option<Limit>,
}

impl View {
    /// A bucket this host knows nothing of: full, as a global bucket starts.
    pub(crate) fn full(limit: &Limit) -> Self {
        Self {
            tokens: limit.capacity(),
            next_in: 0,
            full_in: 0,
            share: None,
        }
    }

    /// A full bucket at `now`: a calendar quota's says when it resets next (`next_in`), as its
    /// `RateLimit` field's `t` does, full or not.
    pub(crate) fn full_at(limit: &Limit, now: u64) -> Self {
        let next_in = limit.calendar().map_or(0, |c| c.reset_after(now, 1) - now);
        Self {
            next_in,
            ..Self::full(limit)
        }
    }
}

impl std::fmt::Debug for LocalBucket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalBucket")
            .field("tokens", &self.tokens)
            .field("reserved", &self.cold().reserved.total())
            .field("next_token_at", &self.cold().next_token_at)
            .field("fetching", &self.fetching)
            .field("waiters", &self.cold().waiters.len())
            .finish_non_exhaustive()
    }
}

/// The hot path's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hit {
    Admitted,
    /// Admitted, and the lease ran low: the caller starts a background fetch.
    AdmittedStartFetch,
    Short,
}

impl LocalBucket {
    fn cold(&self) -> &Cold {
        self.cold.as_deref().unwrap_or(&IDLE)
    }

    fn cold_mut(&mut self) -> &mut Cold {
        self.cold.get_or_insert_with(|| Box::new(Cold::IDLE))
    }

    /// Tokens leased to this host and not used yet, including those reserved ahead.
    pub fn leased_tokens(&self) -> u64 {
        self.tokens.saturating_add(self.cold().reserved.total())
    }

    /// Leased tokens usable now: without those reserved ahead, which fall due later.
    pub fn usable_tokens(&self) -> u64 {
        self.tokens
    }

    /// Requests waiting for the batch being fetched.
    pub fn waiting(&self) -> usize {
        self.cold().waiters.len()
    }

    /// Whether a batch for this bucket is being fetched, or it is paying for credit (tokens
    /// it admitted on credit are being charged, or their debt may not be paid yet): such a
    /// bucket must not be evicted (a bucket made afresh would give credit again).
    pub fn is_fetching(&self) -> bool {
        let cold = self.cold();
        self.fetching || cold.credit_after > 0
    }

    /// Whether a local store may evict this bucket: not while it [is
    /// fetching](Self::is_fetching), nor while tokens it reserved are still to come (a bucket
    /// made afresh would reserve again, behind the reservation its predecessor hands back only
    /// later: a key evicted again and again would push its global bucket ever deeper into
    /// debt, its waits ever longer).
    pub fn may_evict(&self) -> bool {
        !self.is_fetching() && self.cold().reserved.is_empty()
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

    /// Requests served from the lease and not counted yet, for stores that drop a bucket.
    pub fn uncounted_requests(&self) -> u64 {
        u64::from(self.uncounted)
    }

    /// The hot path: takes `cost` leased tokens if there are enough, and asks for a fetch ahead
    /// of need when the lease runs below half the last batch. No clock, no allocation.
    #[inline]
    pub(crate) fn take_leased(&mut self, cost: u64) -> Hit {
        if !self.take(cost) {
            return Hit::Short;
        }
        self.uncounted = self.uncounted.saturating_add(1);
        if self.tokens < u64::from(self.low_water) && !self.fetching {
            self.fetching = true;
            return Hit::AdmittedStartFetch;
        }
        Hit::Admitted
    }

    #[inline]
    fn take(&mut self, cost: u64) -> bool {
        if self.tokens < cost {
            return false;
        }
        self.tokens -= cost;
        let cost = u32::try_from(cost).unwrap_or(u32::MAX);
        self.unrecorded = self.unrecorded.saturating_add(cost);
        true
    }

    /// Takes up to `tokens` from the lease (a cost found higher after the response), counting
    /// them as demand; returns how many it took.
    pub(crate) fn take_up_to(&mut self, tokens: u64) -> u64 {
        let taken = tokens.min(self.tokens);
        self.tokens -= taken;
        let recorded = u32::try_from(taken).unwrap_or(u32::MAX);
        self.unrecorded = self.unrecorded.saturating_add(recorded);
        taken
    }

    /// Takes in what an answer, asked at `sent_at` and received at `now`, says of the global
    /// bucket: when its next token is due, and its level. All a charge beyond the lease brings
    /// (its tokens were used already); part of what a batch brings.
    pub(crate) fn note_global(&mut self, grant: &Grant, sent_at: u64, now: u64, limit: &Limit) {
        let next_token_at = sent_at.saturating_add(micros(grant.refill_in));
        let cold = self.cold_mut();
        cold.next_token_at = next_token_at;
        // A batch paying for credit that finds the bucket short: no credit until it refills.
        // While a charge is under way, only the charge's own answer ends it (see
        // `note_charge`): a batch answered meanwhile knows nothing of that debt.
        if !grant.refill_in.is_zero() && cold.owed > 0 && cold.credit_after != CHARGING {
            let after = now.saturating_add(micros(grant.refill_in));
            cold.credit_after = cold.credit_after.max(after);
        }
        cold.keep = keep_after(grant.remaining, limit);
        cold.global_left = grant.remaining.min(NO_ANSWER - 1);
        cold.global_seen_at = now;
        cold.quiet_at = global_full_at(grant.remaining, next_token_at, now, limit);
    }

    /// Notes the answer to the charge of what a batch could not pay for credit: the store has
    /// recovered that debt once the bucket's wait has passed, counted from the answer's arrival;
    /// until then, no credit.
    pub(crate) fn note_charge(&mut self, grant: &Grant, sent_at: u64, now: u64, limit: &Limit) {
        self.note_global(grant, sent_at, now, limit);
        let cold = self.cold_mut();
        if cold.credit_after == CHARGING && !grant.refill_in.is_zero() {
            cold.credit_after = now.saturating_add(micros(grant.refill_in));
        }
    }

    /// Tokens admitted on credit that no answer has paid for yet.
    #[cfg(test)]
    pub(crate) fn owed(&self) -> u64 {
        u64::from(self.cold().owed)
    }

    /// Ends the charge of what an answer could not pay (see [`Settled::unpaid`]): credit may be
    /// given again once the key is not known to be short.
    pub(crate) fn end_charge(&mut self) {
        if let Some(cold) = self.cold.as_deref_mut()
            && cold.credit_after == CHARGING
        {
            cold.credit_after = 0;
        }
    }

    /// Undoes the fetch ahead a [`take_leased`](Self::take_leased) asked for
    /// ([`Hit::AdmittedStartFetch`]), when that take is undone before the fetch is started.
    pub(crate) fn cancel_fetch_ahead(&mut self) {
        self.fetching = false;
    }

    /// Whether the lease holds tokens of the global bucket called `name` (or of no known one:
    /// tokens put back into a bucket that had shed its state).
    pub(crate) fn holds_tokens_of(&self, name: Name) -> bool {
        matches!(self.cold().dispenser, 0) || self.cold().dispenser == name.id()
    }

    /// The global bucket whose tokens the lease holds ([`Name::id`]; 0 when unknown).
    pub(crate) fn dispenser(&self) -> u32 {
        self.cold().dispenser
    }

    /// How many limits the key's quota has; 0 while unknown (a bucket made by a give-back,
    /// a refund or a settle rather than by a request): the throttle then looks it up before
    /// admitting on this bucket alone.
    #[inline]
    pub(crate) fn slots(&self) -> u8 {
        self.slots
    }

    pub(crate) fn set_slots(&mut self, slots: u8) {
        self.slots = slots;
    }

    /// Without taking anything: when a request of `cost` is due, if the lease cannot serve it
    /// at `now` and the global bucket is known to be short; `None` if it might be served.
    pub(crate) fn known_short(
        &mut self,
        cost: u64,
        now: u64,
        limit: &Limit,
        memory: u64,
    ) -> Option<u64> {
        self.release_pending(now, || limit.capacity());
        (self.tokens < cost && self.short_at(now, memory)).then(|| self.due(cost, now, limit))
    }

    /// Whether the global bucket is known to be short at `now`, without asking it: its last
    /// answer said so, less than `memory` micros ago (after that the host asks again, so that a
    /// change to the bucket by hand, a reset, reaches it; a shorter wait ends first anyway).
    pub(crate) fn short_at(&self, now: u64, memory: u64) -> bool {
        now < self.cold().next_token_at && now < self.recheck_at(memory)
    }

    /// When a key known short is asked about again: `memory` micros after the last answer.
    pub(crate) fn recheck_at(&self, memory: u64) -> u64 {
        self.cold().global_seen_at.saturating_add(memory)
    }

    /// A change made to the global bucket by hand, asked at `sent_at` and answered at `now`
    /// with the bucket's `level` after: the lease knows it as it would from an answer, its
    /// times counted from when the call was sent, so no request is refused while the bucket
    /// could already serve it (a bucket left empty is known short until its next token, so no
    /// request is let through on credit meanwhile); with `revoke` (a drain), the lease's
    /// tokens, reserved ones too, are taken out and returned, to be forfeited.
    pub(crate) fn adjusted(
        &mut self,
        revoke: bool,
        level: &BucketLevel,
        sent_at: u64,
        now: u64,
    ) -> u64 {
        let revoked = if revoke { self.take_all_leased() } else { 0 };
        // What the change put in the bucket is the operator's: nothing is taken back for it.
        self.forget_held();
        let cold = self.cold_mut();
        cold.next_token_at = match level.tokens {
            0 => sent_at.saturating_add(micros(level.next_in)),
            _ => 0,
        };
        cold.global_left = level.tokens.min(NO_ANSWER - 1);
        cold.global_seen_at = now;
        cold.quiet_at = sent_at.saturating_add(micros(level.full_in)).max(now);
        revoked
    }

    /// What the bucket holds at `now`, without changing it: the usable lease plus the global
    /// bucket's level at its last answer and what it has refilled since (none while it is
    /// known to be short). Other hosts may have taken some of it since: an estimate, the best
    /// a host has without asking.
    ///
    /// While the store is down (`store_up` false) and this host decides alone with its own
    /// fallback bucket, the view is the lease plus that bucket: what this host can still admit.
    pub(crate) fn view(&self, now: u64, limit: &Limit, store_up: bool) -> View {
        let capacity = limit.capacity();
        let cold = self.cold();
        // A recent reading of the clock may come before the last answer: the view is never of
        // a time before what the bucket knows.
        let now = now.max(cold.global_seen_at);
        let lease = self.tokens.saturating_add(cold.reserved.due_by(now));
        if let (false, Some(fallback)) = (store_up, &cold.fallback) {
            return fallback.view(lease, now);
        }
        let short = now < cold.next_token_at;
        let global = self.global_estimate(now, limit);
        // Tokens admitted on credit will be taken from the global bucket.
        let tokens = lease
            .saturating_add(global)
            .saturating_sub(u64::from(cold.owed))
            .min(capacity);
        if tokens >= capacity {
            return View::full_at(limit, now);
        }
        let lacking = capacity - tokens;
        let (next_in, full_in) = if short {
            let next_in = cold.next_token_at - now;
            let rest = limit.micros_to_accrue(cold.next_token_at, lacking - 1);
            (next_in, next_in.saturating_add(rest))
        } else {
            let full_in = limit.micros_to_accrue(now, lacking);
            (limit.micros_to_accrue(now, 1).min(full_in), full_in)
        };
        View {
            tokens,
            next_in,
            full_in,
            share: None,
        }
    }

    /// Requests served from the lease since the last call.
    pub(crate) fn take_uncounted(&mut self) -> u64 {
        u64::from(std::mem::take(&mut self.uncounted))
    }

    /// [`record_demand`](Self::record_demand) if the hot path served anything since it was
    /// last recorded (a bucket with nothing to record gains no slow-path state).
    fn record_unrecorded(&mut self, now: u64, interval: u64) {
        if self.unrecorded > 0 {
            self.record_demand(now, interval);
        }
    }

    /// Records the tokens served since the clock was last read for this key as demand of
    /// `interval`: a lease that served any was in use at `now`.
    fn record_demand(&mut self, now: u64, interval: u64) {
        let tokens = u64::from(std::mem::take(&mut self.unrecorded));
        let cold = self.cold_mut();
        cold.demand.record(interval, tokens);
        if tokens > 0 {
            cold.leased_at = now;
        }
    }

    /// Moves the tranches reserved ahead into the lease once they are due, up to the limit's
    /// `capacity`: what would go past it lapses ([`Reserved::lapse`]). A lease filled from
    /// empty starts its life then; one that still held tokens keeps its age, so that a lease
    /// nothing uses is handed back even while the host keeps reserving.
    fn release_pending(&mut self, now: u64, capacity: impl FnOnce() -> u64) {
        let Some(cold) = self.cold.as_deref_mut() else {
            return;
        };
        let (tokens, due) = cold.reserved.take_due(now);
        if tokens == 0 {
            return;
        }
        if self.tokens == 0 {
            cold.leased_at = due;
        }
        let joining = tokens.min(capacity().saturating_sub(self.tokens));
        cold.reserved.lapse(tokens - joining);
        self.tokens += joining;
        self.low_water = half(joining);
        self.note_due(joining);
    }

    /// Takes out the count of reserved tokens that lapsed into a full lease since it was last
    /// taken: forfeited, for the statistics.
    pub(crate) fn take_lapsed(&mut self) -> u64 {
        self.cold
            .as_deref_mut()
            .map_or(0, |c| c.reserved.take_lapsed())
    }

    /// When a request of `cost` tokens that the lease cannot serve at `now` can be: when the
    /// tranches reserved ahead hold what it lacks, or when the global bucket has refilled what
    /// they all lack.
    fn due(&self, cost: u64, now: u64, limit: &Limit) -> u64 {
        let (held, cold) = (self.leased_tokens(), self.cold());
        if cost <= held {
            return cold.reserved.covering(cost.saturating_sub(self.tokens));
        }
        // The global bucket's first token is due at `next_token_at`, the rest at its rate.
        let more = cost - held;
        let first = cold.next_token_at.max(now);
        let refilled = first.saturating_add(limit.micros_to_accrue(first, more - 1));
        refilled.max(cold.reserved.last_due())
    }

    /// Whether the global bucket held at least half its capacity at the last answer: tokens
    /// this lease hands back are then not needed by the fleet at once.
    pub(crate) fn is_far_from_limit(&self) -> bool {
        self.cold().keep > 0
    }

    /// Drops the slow path's state when it holds nothing: the bucket then reads exactly as it
    /// did (see [`Cold::is_idle`]).
    fn shed_if_idle(&mut self, now: u64, interval: u64) {
        if self.cold.is_none() || self.fetching {
            return;
        }
        self.record_demand(now, interval);
        if self.cold().is_idle(now, interval) {
            self.cold = None;
        }
    }

    /// Whether the bucket holds state beyond its hot fields (for tests of its shedding).
    #[cfg(test)]
    fn holds_cold_state(&self) -> bool {
        self.cold.is_some()
    }

    /// Whether the lease holds a calendar quota's tokens (see [`take_usable`](Self::take_usable)).
    pub(crate) fn is_dated(&self) -> bool {
        self.dated
    }

    /// Takes every usable leased token out (a calendar quota's reset is near: they must not be
    /// spent after it), and the lease stops being dated.
    pub(crate) fn take_usable(&mut self) -> u64 {
        self.dated = false;
        self.low_water = 0;
        self.forget_held();
        std::mem::take(&mut self.tokens)
    }

    /// Takes every leased token out, reserved ones included: the bucket is being dropped.
    pub(crate) fn take_all_leased(&mut self) -> u64 {
        let reserved = self.cold.as_mut().map_or(0, |c| c.reserved.take_all());
        self.forget_held();
        std::mem::take(&mut self.tokens).saturating_add(reserved)
    }

    /// Takes `cost` from this host's own fallback bucket, shaped `share`. Returns the wait
    /// until it could be served, or zero if it was.
    pub(crate) fn take_fallback(&mut self, share: &Limit, now: u64, cost: u64) -> u64 {
        let fallback = self.cold_mut().fallback.get_or_insert_with(|| {
            Box::new(Fallback {
                share: *share,
                bucket: TokenBucket::full(share, now),
            })
        });
        if fallback.share != *share {
            fallback.reshare(share, now);
        }
        let taken = fallback.bucket.take(share, now, cost, cost);
        if taken.granted >= cost {
            0
        } else {
            taken.refill_in_micros.max(1)
        }
    }
}

/// Half a batch, as a low-water mark.
fn half(batch: u64) -> u32 {
    u32::try_from(batch / 2).unwrap_or(u32::MAX)
}

/// When the global bucket, as an answer received at `seen_at` left it (`left` whole tokens,
/// the next due at `next_token_at`), is full again if no host takes from it.
fn global_full_at(left: u64, next_token_at: u64, seen_at: u64, limit: &Limit) -> u64 {
    let capacity = limit.capacity();
    let (from, lacking) = if next_token_at > seen_at {
        (next_token_at, capacity - 1)
    } else {
        (seen_at, capacity.saturating_sub(left))
    };
    from.saturating_add(limit.micros_to_accrue(from, lacking))
}

#[cfg(test)]
pub(crate) mod tests;
#[cfg(test)]
mod tests_by_hand;
#[cfg(test)]
mod tests_calendar;
#[cfg(test)]
mod tests_views;

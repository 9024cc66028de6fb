//! One key's lease on one host, as a pure state machine: no I/O, no clock, no locks, no
//! spawns. The throttle reads the clock, calls the global store and delivers the verdicts this
//! machine hands out; everything it decides is here, so it can be tested step by step.

use tokio::sync::oneshot;

use crate::batch::{DemandHistory, MAX_DEMAND_INTERVALS};
use crate::bucket::{FullAt, TokenBucket};
use crate::clock::micros;
use crate::global::{Grant, TokenRequest};
use crate::limit::Limit;
use crate::quota::Name;

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
    cold: Option<Box<Cold>>,
}

/// The state only the slow path reads; `None` in a bucket while it equals [`Cold::IDLE`].
struct Cold {
    /// Requests waiting for the batch being fetched, in arrival order.
    waiters: Vec<Waiter>,
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
        waiters: Vec::new(),
        leased_at: 0,
        demand: DemandHistory::new(),
        next_token_at: 0,
        reserved: Reserved::NONE,
        fallback: None,
        shape: 0,
        dispenser: 0,
        global_left: NO_ANSWER,
        global_seen_at: 0,
        quiet_at: 0,
    };

    /// Whether dropping this state at `now` (in demand interval `interval`) loses nothing.
    fn is_idle(&self, now: u64, interval: u64) -> bool {
        self.waiters.is_empty()
            && self.reserved.is_empty()
            && self.fallback.as_ref().is_none_or(|f| f.is_full_at(now))
            && now >= self.quiet_at
            && self.demand.is_idle(interval)
    }
}

/// Tokens reserved ahead of the global refill, in tranches by when each falls due (clock
/// micros), earliest first: a later reservation never delays an earlier one, so tokens
/// reserved while the store is slower than a token interval are used as each falls due.
struct Reserved {
    // A boxed slice, not a `Vec`: the state stays in its allocation class, and tranches are
    // added and released once per batch at most. `None` when empty.
    tranches: Option<Box<[(u64, u64)]>>,
}

/// Tranches kept apart; beyond, the latest two merge (the later due wins, so nothing is used
/// early).
const MAX_TRANCHES: usize = 8;

impl Reserved {
    const NONE: Self = Self { tranches: None };

    fn all(&self) -> &[(u64, u64)] {
        self.tranches.as_deref().unwrap_or(&[])
    }

    fn set(&mut self, tranches: Vec<(u64, u64)>) {
        self.tranches = (!tranches.is_empty()).then(|| tranches.into_boxed_slice());
    }

    fn is_empty(&self) -> bool {
        self.tranches.is_none()
    }

    fn total(&self) -> u64 {
        self.all()
            .iter()
            .fold(0u64, |sum, &(_, tokens)| sum.saturating_add(tokens))
    }

    /// When the last tranche falls due (0 when none is reserved).
    fn last_due(&self) -> u64 {
        self.all().last().map_or(0, |&(due, _)| due)
    }

    fn add(&mut self, due: u64, tokens: u64) {
        let mut tranches = self.all().to_vec();
        let at = tranches.partition_point(|&(d, _)| d <= due);
        match at.checked_sub(1).map(|i| &mut tranches[i]) {
            Some((d, held)) if *d == due => *held = held.saturating_add(tokens),
            _ => tranches.insert(at, (due, tokens)),
        }
        if tranches.len() > MAX_TRANCHES
            && let Some((due, tokens)) = tranches.pop()
            && let Some(last) = tranches.last_mut()
        {
            *last = (due, last.1.saturating_add(tokens));
        }
        self.set(tranches);
    }

    /// Tokens due by `now`, without taking them.
    fn due_by(&self, now: u64) -> u64 {
        self.all()
            .iter()
            .take_while(|&&(due, _)| due <= now)
            .fold(0u64, |sum, &(_, tokens)| sum.saturating_add(tokens))
    }

    /// Takes out the tranches due by `now`: their tokens, and when the last of them fell due.
    fn take_due(&mut self, now: u64) -> (u64, u64) {
        let n = self.all().partition_point(|&(due, _)| due <= now);
        if n == 0 {
            return (0, 0);
        }
        let taken = self.all()[..n]
            .iter()
            .fold((0u64, 0), |(sum, _), &(due, tokens)| {
                (sum.saturating_add(tokens), due)
            });
        let rest = self.all()[n..].to_vec();
        self.set(rest);
        taken
    }

    /// When the tranches hold `tokens` in all (the last one's due when they never do).
    fn covering(&self, tokens: u64) -> u64 {
        let mut sum = 0u64;
        for &(due, held) in self.all() {
            sum = sum.saturating_add(held);
            if sum >= tokens {
                return due;
            }
        }
        self.last_due()
    }

    fn take_all(&mut self) -> u64 {
        let all = self.total();
        self.tranches = None;
        all
    }
}

/// A host's own bucket for a key while the global store is unavailable.
struct Fallback {
    /// The host's share of the limit that the bucket follows.
    share: Limit,
    bucket: TokenBucket,
    /// When it is full again if nothing more is taken (`None`: beyond the clock's range):
    /// from then on it is the same as no bucket, which starts full.
    full_at: Option<FullAt>,
}

impl Fallback {
    fn is_full_at(&self, now: u64) -> bool {
        self.full_at.is_some_and(|at| at.is_full_at(now))
    }

    /// The limit or the expected fleet changed: a bucket of the new `share`, holding what the
    /// old one held at `now` (at most the new capacity).
    fn reshare(&mut self, share: &Limit, now: u64) {
        let mut old = self.bucket;
        old.refill(&self.share, now);
        let lacking = share.capacity().saturating_sub(old.tokens());
        self.share = *share;
        self.bucket = TokenBucket::full(share, now);
        self.bucket.take(share, now, lacking, lacking);
        self.full_at = self.bucket.full_at(share);
    }

    /// What this host can admit alone: `lease` tokens leased before the store went down, and
    /// this bucket's, within `limit`'s capacity.
    fn view(&self, lease: u64, now: u64, limit: &Limit) -> View {
        let level = crate::global::BucketLevel::of(&self.bucket, &self.share, now);
        let tokens = lease.saturating_add(level.tokens).min(limit.capacity());
        View {
            tokens,
            next_in: micros(level.next_in),
            full_in: micros(level.full_in),
        }
    }
}

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
}

impl View {
    /// A bucket this host knows nothing of: full, as a global bucket starts.
    pub(crate) fn full(limit: &Limit) -> Self {
        Self {
            tokens: limit.capacity(),
            next_in: 0,
            full_in: 0,
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

/// A request waiting for a batch: its cost, until when it may wait for further batches, and
/// where its verdict goes.
#[derive(Debug)]
pub(crate) struct Waiter {
    cost: u64,
    /// After this (clock micros), a batch that cannot serve it refuses it instead of asking
    /// again. One batch almost always serves it: a batch covers every request that waited for
    /// it when it was asked for.
    deadline: u64,
    verdict: oneshot::Sender<Verdict>,
}

impl Waiter {
    /// A waiter for a request of `cost` tokens that may wait for batches until `deadline`, and
    /// the receiver of its verdict.
    pub(crate) fn new(cost: u64, deadline: u64) -> (Self, oneshot::Receiver<Verdict>) {
        let (verdict, receiver) = oneshot::channel();
        let waiter = Self {
            cost,
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

    fn is_gone(&self) -> bool {
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
}

/// The hot path's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hit {
    Admitted,
    /// Admitted, and the lease ran low: the caller starts a background fetch.
    AdmittedStartFetch,
    Short,
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
    /// Queued for the batch in flight.
    Joined,
    /// Queued; the caller starts the fetch.
    StartFetch,
}

/// What a fetch asks the global store for, before the batch policy sizes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Tokens the waiting requests need.
    pub(crate) needed: u64,
    /// Tokens the lease has room for.
    pub(crate) room: u64,
    pub(crate) demand: [u32; MAX_DEMAND_INTERVALS],
}

impl Plan {
    /// The request for a batch of `batch` tokens (what the batch policy asked for).
    pub(crate) fn request(&self, batch: u64, max_delay: std::time::Duration) -> TokenRequest {
        TokenRequest {
            min: 1,
            want: batch.max(self.needed).clamp(1, self.room),
            max_delay,
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

    /// Requests waiting for the batch being fetched.
    pub fn waiting(&self) -> usize {
        self.cold().waiters.len()
    }

    /// Whether a batch for this bucket is being fetched: such a bucket must not be evicted.
    pub fn is_fetching(&self) -> bool {
        self.fetching
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
        cold.global_left = grant.remaining.min(NO_ANSWER - 1);
        cold.global_seen_at = now;
        cold.quiet_at = global_full_at(grant.remaining, next_token_at, now, limit);
    }

    /// Puts back `tokens` taken for a request that went away before it was served.
    pub(crate) fn give_back(&mut self, tokens: u64) {
        self.tokens = self.tokens.saturating_add(tokens);
    }

    /// Undoes the fetch ahead a [`take_leased`](Self::take_leased) asked for
    /// ([`Hit::AdmittedStartFetch`]), when that take is undone before the fetch is started.
    pub(crate) fn cancel_fetch_ahead(&mut self) {
        self.fetching = false;
    }

    /// Undoes a [`take_leased`](Self::take_leased) of `cost` for a request another of its
    /// buckets refused: the tokens stay in the lease, and the request is not counted.
    pub(crate) fn undo_take(&mut self, cost: u64) {
        self.give_back(cost);
        self.uncounted = self.uncounted.saturating_sub(1);
    }

    /// Tells the bucket which limit it serves: its `name` and `shape` (a hash of its name and
    /// shape). When the shape changed (a limit was raised or lowered), what the bucket knew of
    /// the global bucket no longer holds: it forgets that the key was throttled. When the name
    /// changed (the key moved to another tier), the lease holds another global bucket's tokens,
    /// which this limit may not use: they are taken out, reserved ones too, and returned as
    /// forfeited.
    pub(crate) fn reshape(&mut self, name: Name, shape: u32) -> u64 {
        let cold = self.cold();
        if cold.shape == shape && cold.dispenser == name.id() {
            return 0;
        }
        let moved = !self.holds_tokens_of(name);
        let forfeited = match moved {
            true => {
                self.low_water = 0;
                self.take_all_leased()
            }
            false => 0,
        };
        let cold = self.cold_mut();
        if moved {
            cold.global_left = NO_ANSWER;
            cold.quiet_at = 0;
        }
        cold.shape = shape;
        cold.next_token_at = 0;
        cold.dispenser = name.id();
        forfeited
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
    pub(crate) fn known_short(&mut self, cost: u64, now: u64, limit: &Limit) -> Option<u64> {
        self.release_pending(now);
        (self.tokens < cost && now < self.cold().next_token_at).then(|| self.due(cost, now, limit))
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
        let lease = self.tokens.saturating_add(cold.reserved.due_by(now));
        if let (false, Some(fallback)) = (store_up, &cold.fallback) {
            return fallback.view(lease, now, limit);
        }
        let short = now < cold.next_token_at;
        let global = match cold.global_left {
            NO_ANSWER => capacity,
            _ if short => 0,
            // It was short at its answer: its first token came at `next_token_at`.
            _ if cold.next_token_at > cold.global_seen_at => {
                1 + limit.accrued_in(now - cold.next_token_at)
            }
            left => left.saturating_add(limit.accrued_in(now.saturating_sub(cold.global_seen_at))),
        };
        let tokens = lease.saturating_add(global).min(capacity);
        if tokens >= capacity {
            return View::full(limit);
        }
        let lacking = capacity - tokens;
        let (next_in, full_in) = if short {
            let next_in = cold.next_token_at - now;
            let rest = micros(limit.time_to_accrue(lacking - 1));
            (next_in, next_in.saturating_add(rest))
        } else {
            let full_in = micros(limit.time_to_accrue(lacking));
            (micros(limit.time_to_accrue(1)).min(full_in), full_in)
        };
        View {
            tokens,
            next_in,
            full_in,
        }
    }

    /// Requests served from the lease since the last call.
    pub(crate) fn take_uncounted(&mut self) -> u64 {
        u64::from(std::mem::take(&mut self.uncounted))
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

    /// Moves the tranches reserved ahead into the lease once they are due. A lease filled from
    /// empty starts its life then; one that still held tokens keeps its age, so that a lease
    /// nothing uses is handed back even while the host keeps reserving.
    fn release_pending(&mut self, now: u64) {
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
        self.tokens = self.tokens.saturating_add(tokens);
        self.low_water = half(tokens);
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
        let rest = micros(limit.time_to_accrue(more - 1));
        let refilled = cold.next_token_at.max(now).saturating_add(rest);
        refilled.max(cold.reserved.last_due())
    }

    /// A request of `cost` found too few tokens at `now`: serve it if reserved tokens have
    /// fallen due, refuse it if the global bucket is known to be short, or queue the `waiter`
    /// (made only then) for the batch in flight (or for a new one, unless the store is backing
    /// off).
    pub(crate) fn miss(
        &mut self,
        cost: u64,
        now: u64,
        interval: u64,
        limit: &Limit,
        store_up: bool,
        waiter: impl FnOnce() -> Waiter,
    ) -> Miss {
        self.release_pending(now);
        let admitted = self.take(cost);
        self.record_demand(now, interval);
        if admitted {
            return Miss::Admitted;
        }
        if now < self.cold().next_token_at {
            // Refused requests are demand too: batches sized by what was served alone would
            // shrink to single tokens exactly when the key is over its limit.
            self.cold_mut().demand.record(interval, cost);
            return Miss::Throttled {
                until: self.due(cost, now, limit),
            };
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

    /// What the fetch in flight should ask for, or `None` when nothing should be asked (the key
    /// is throttled, or the lease is full).
    pub(crate) fn plan(&mut self, now: u64, interval: u64, limit: &Limit) -> Option<Plan> {
        self.release_pending(now);
        self.record_demand(now, interval);
        self.cold_mut().waiters.retain(|w| !w.is_gone());
        let needed = self
            .cold()
            .waiters
            .iter()
            .fold(0u64, |sum, w| sum.saturating_add(w.cost));
        if now < self.cold().next_token_at {
            // No prefetch either until a batch comes: each would be skipped again.
            self.low_water = 0;
            return None;
        }
        // Tokens reserved ahead do not count: they may fall due here later than the global
        // bucket refills (the answer took time to come), and a request must not be refused
        // while the global bucket could serve it.
        let room = limit.capacity().saturating_sub(self.tokens);
        if room == 0 {
            return None;
        }
        let mut demand = [0; MAX_DEMAND_INTERVALS];
        demand.copy_from_slice(self.cold().demand.recent());
        Some(Plan {
            needed,
            room,
            demand,
        })
    }

    /// Takes in a fetch's outcome at `now` and decides every waiting request, in arrival order:
    /// those the lease now covers are admitted (their tokens taken for them), the others are
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
        match *outcome {
            FetchOutcome::Failed => return self.fail_fetch(),
            // Nothing asked: the key is throttled (its waiters are refused below), or the lease
            // was full (refunds can fill it) and is less so once it has served them.
            FetchOutcome::Skipped => {}
            // Tokens of the bucket the key left while the fetch was under way: not this one's.
            FetchOutcome::Granted { grant, from, .. } if !self.holds_tokens_of(from) => {
                settled.forfeited = grant.granted.saturating_add(grant.reserved);
            }
            FetchOutcome::Granted {
                grant,
                sent_at,
                from,
                shape,
            } => {
                self.cold_mut().dispenser = from.id();
                self.take_grant(&grant, sent_at, now, limit);
                settled.excess = self.shed_excess(limit);
                if self.cold().shape != shape {
                    // The limit changed while the call was under way: the answer's times are
                    // the old limit's, so the key is not known to be short.
                    self.cold_mut().next_token_at = 0;
                }
            }
        }
        self.fetching = false;
        self.release_pending(now);
        let throttled = now < self.cold().next_token_at;
        let mut kept = Vec::new();
        for waiter in std::mem::take(&mut self.cold_mut().waiters) {
            if waiter.is_gone() {
                continue;
            }
            if self.take(waiter.cost) {
                settled.verdicts.push((waiter, Verdict::Admitted));
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
        if !kept.is_empty() {
            self.cold_mut().waiters = kept;
            self.fetching = true;
            settled.refetch = true;
        }
        if self.unrecorded > 0 {
            self.record_demand(now, interval);
        }
        settled
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
        Settled {
            verdicts: self.cold.as_mut().map_or_else(Vec::new, |cold| {
                cold.waiters.drain(..).map(|w| (w, verdict)).collect()
            }),
            ..Settled::default()
        }
    }

    /// Adds a grant asked for at `sent_at` and received at `now` to the lease.
    fn take_grant(&mut self, grant: &Grant, sent_at: u64, now: u64, limit: &Limit) {
        // From the time the call was sent, so that no request is refused while the global
        // bucket could already admit it.
        self.note_global(grant, sent_at, now, limit);
        if grant.granted > 0 {
            if self.tokens == 0 {
                self.cold_mut().leased_at = now;
            }
            self.tokens = self.tokens.saturating_add(grant.granted);
            self.low_water = half(grant.granted);
        }
        if grant.reserved > 0 {
            // From the time the answer came, so that reserved tokens are never used before the
            // global bucket has refilled them.
            let due = now.saturating_add(micros(grant.ready_in));
            self.cold_mut().reserved.add(due, grant.reserved);
        }
    }

    /// Removes the usable tokens beyond capacity (after a limit was lowered).
    fn shed_excess(&mut self, limit: &Limit) -> u64 {
        let excess = self.tokens.saturating_sub(limit.capacity());
        self.tokens -= excess;
        excess
    }

    /// Takes the usable leased tokens out if the lease has not been used for `ttl` micros, so
    /// they can be handed back: whether or not a batch is in flight or tokens are reserved
    /// ahead (those stay, and age once due). Drops the slow path's state once it holds nothing
    /// any more (at `now`, in demand interval `interval`).
    pub(crate) fn take_expired(&mut self, now: u64, ttl: u64, interval: u64) -> u64 {
        self.release_pending(now);
        if self.unrecorded > 0 {
            self.record_demand(now, interval);
        }
        if now.saturating_sub(self.cold().leased_at) < ttl {
            return 0;
        }
        self.low_water = 0;
        let expired = std::mem::take(&mut self.tokens);
        self.shed_if_idle(now, interval);
        expired
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

    /// Takes every leased token out, reserved ones included: the bucket is being dropped.
    pub(crate) fn take_all_leased(&mut self) -> u64 {
        let reserved = self.cold.as_mut().map_or(0, |c| c.reserved.take_all());
        std::mem::take(&mut self.tokens).saturating_add(reserved)
    }

    /// Takes `cost` from this host's own fallback bucket, shaped `share`. Returns the wait
    /// until it could be served, or zero if it was.
    pub(crate) fn take_fallback(&mut self, share: &Limit, now: u64, cost: u64) -> u64 {
        let fallback = self.cold_mut().fallback.get_or_insert_with(|| {
            Box::new(Fallback {
                share: *share,
                bucket: TokenBucket::full(share, now),
                full_at: None,
            })
        });
        if fallback.share != *share {
            fallback.reshare(share, now);
        }
        let taken = fallback.bucket.take(share, now, cost, cost);
        fallback.full_at = fallback.bucket.full_at(share);
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
    from.saturating_add(micros(limit.time_to_accrue(lacking)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn limit() -> Limit {
        Limit::per_second(10).burst(10).unwrap()
    }

    const DEADLINE: u64 = 50_000;

    /// `granted` tokens now, `reserved` due in `ready_in_ms`, the next in `refill_in_ms`.
    fn grant(granted: u64, reserved: u64, ready_in_ms: u64, refill_in_ms: u64) -> FetchOutcome {
        FetchOutcome::Granted {
            grant: Grant {
                granted,
                reserved,
                ready_in: Duration::from_millis(ready_in_ms),
                remaining: 0,
                refill_in: Duration::from_millis(refill_in_ms),
            },
            sent_at: 0,
            from: Name::intern("default"),
            shape: 0,
        }
    }

    /// Queues a request of `cost` at `now`; returns the miss and the verdict's receiver.
    fn queue(b: &mut LocalBucket, cost: u64, now: u64) -> (Miss, oneshot::Receiver<Verdict>) {
        let (waiter, rx) = Waiter::new(cost, now + DEADLINE);
        (b.miss(cost, now, 0, &limit(), true, || waiter), rx)
    }

    fn verdicts(settled: &Settled) -> Vec<(u64, Verdict)> {
        settled.verdicts.iter().map(|(w, v)| (w.cost, *v)).collect()
    }

    #[test]
    fn a_view_adds_the_lease_to_the_global_level_and_its_refill_since() {
        let limit = limit(); // 10 per second, burst 10
        let mut b = LocalBucket::default();
        assert_eq!(
            b.view(0, &limit, true),
            View::full(&limit),
            "never asked: full"
        );
        let answer = FetchOutcome::Granted {
            grant: Grant {
                granted: 4,
                reserved: 0,
                ready_in: Duration::ZERO,
                remaining: 3,
                refill_in: Duration::ZERO,
            },
            sent_at: 0,
            from: Name::intern("default"),
            shape: 0,
        };
        b.settle(&answer, 0, 0, &limit);
        b.take_leased(2);
        let view = b.view(0, &limit, true);
        assert_eq!(view.tokens, 2 + 3);
        assert_eq!(view.next_in, 100_000, "one token every 100 ms");
        assert_eq!(view.full_in, 500_000);
        // 250 ms later the global bucket has refilled two more.
        assert_eq!(b.view(250_000, &limit, true).tokens, 7);
        assert_eq!(b.view(2_000_000, &limit, true), View::full(&limit));
    }

    #[test]
    fn a_view_of_a_key_known_short_counts_only_the_lease_until_tokens_are_due() {
        let limit = limit();
        let mut b = LocalBucket::default();
        b.settle(&grant(1, 0, 0, 300), 0, 0, &limit);
        let view = b.view(100_000, &limit, true);
        assert_eq!((view.tokens, view.next_in), (1, 200_000));
        assert_eq!(
            view.full_in,
            200_000 + 800_000,
            "then 8 more at 10 per second"
        );
        assert_eq!(
            b.view(300_000, &limit, true).tokens,
            2,
            "the global bucket's first token"
        );
        assert_eq!(b.view(400_000, &limit, true).tokens, 3);
    }

    #[test]
    fn the_hot_part_of_a_bucket_stays_small() {
        assert!(std::mem::size_of::<LocalBucket>() <= 32);
        // Within glibc's 176-byte chunk class (a 168-byte request and its 8-byte header).
        assert!(std::mem::size_of::<Cold>() <= 168);
    }

    #[test]
    fn one_fetch_per_key_and_everyone_waits_for_it() {
        let mut b = LocalBucket::default();
        let (first, _a) = queue(&mut b, 1, 0);
        let (second, _b) = queue(&mut b, 2, 0);
        assert_eq!((first, second), (Miss::StartFetch, Miss::Joined));
        let plan = b.plan(0, 0, &limit()).unwrap();
        assert_eq!((plan.needed, plan.room), (3, 10));
        assert_eq!(plan.request(0, Duration::ZERO).want, 3);
    }

    #[test]
    fn a_batch_serves_waiters_in_arrival_order_and_keeps_the_rest() {
        let mut b = LocalBucket::default();
        let _rx: Vec<_> = [3, 1, 2].iter().map(|&c| queue(&mut b, c, 0).1).collect();
        let settled = b.settle(&grant(8, 0, 0, 0), 0, 0, &limit());
        let expected = vec![
            (3, Verdict::Admitted),
            (1, Verdict::Admitted),
            (2, Verdict::Admitted),
        ];
        assert_eq!(verdicts(&settled), expected);
        assert_eq!(b.leased_tokens(), 2);
        assert!(!settled.refetch && !b.is_fetching());
    }

    #[test]
    fn a_partial_grant_throttles_the_key_until_its_next_token() {
        let mut b = LocalBucket::default();
        let _rx: Vec<_> = [2, 1, 3].iter().map(|&c| queue(&mut b, c, 0).1).collect();
        // Two tokens were there; the next is due 100 ms after the call was sent.
        let settled = b.settle(&grant(2, 0, 0, 100), 5_000, 0, &limit());
        // The first fits; the second does not (the first took both); the third needs 3 more
        // from the global bucket: the first at 100 ms, two more at 100 ms each.
        assert_eq!(
            verdicts(&settled),
            vec![
                (2, Verdict::Admitted),
                (1, Verdict::Throttled { until: 100_000 }),
                (3, Verdict::Throttled { until: 300_000 }),
            ]
        );
        // Later arrivals are refused without a global call until the token is due, exactly.
        let (miss, _) = queue(&mut b, 1, 99_999);
        assert_eq!(miss, Miss::Throttled { until: 100_000 });
        let (miss, _) = queue(&mut b, 1, 100_000);
        assert_eq!(miss, Miss::StartFetch);
    }

    #[test]
    fn reserved_tokens_are_used_only_once_due() {
        let mut b = LocalBucket::default();
        let (_, _rx) = queue(&mut b, 1, 0);
        // Refused now, but 5 tokens reserved: due 300 ms after the answer came (at 1 ms).
        let settled = b.settle(&grant(0, 5, 300, 400), 1_000, 0, &limit());
        assert_eq!(
            verdicts(&settled),
            vec![(1, Verdict::Throttled { until: 301_000 })]
        );
        assert_eq!(b.leased_tokens(), 5);
        let (miss, _) = queue(&mut b, 5, 300_999);
        assert_eq!(miss, Miss::Throttled { until: 301_000 });
        // A request needing more than is reserved waits for the global bucket's refill too.
        let (miss, _) = queue(&mut b, 7, 300_999);
        assert_eq!(
            miss,
            Miss::Throttled {
                until: 400_000 + 100_000
            }
        );
        let (miss, _) = queue(&mut b, 5, 301_000);
        assert_eq!(miss, Miss::Admitted);
        assert_eq!(b.leased_tokens(), 0);
    }

    #[test]
    fn a_full_grant_keeps_late_joiners_for_the_next_batch() {
        let mut b = LocalBucket::default();
        let (_, _a) = queue(&mut b, 1, 0);
        b.plan(0, 0, &limit());
        let (_, _b) = queue(&mut b, 1, 0);
        let settled = b.settle(&grant(1, 0, 0, 0), 0, 0, &limit());
        assert_eq!(verdicts(&settled), vec![(1, Verdict::Admitted)]);
        assert!(settled.refetch && b.is_fetching());
        assert_eq!(b.plan(0, 0, &limit()).map(|p| p.needed), Some(1));
    }

    #[test]
    fn a_waiter_asks_again_until_its_deadline_then_is_refused() {
        let mut b = LocalBucket::default();
        let (_, _rx) = queue(&mut b, 5, 0);
        for now in [0, DEADLINE - 1] {
            let settled = b.settle(&grant(1, 0, 0, 0), now, 0, &limit());
            assert!(settled.refetch && settled.verdicts.is_empty());
        }
        let settled = b.settle(&grant(1, 0, 0, 0), DEADLINE, 0, &limit());
        // Three tokens held; the global bucket's next is due now, the one after 100 ms later.
        assert_eq!(
            verdicts(&settled),
            vec![(
                5,
                Verdict::Throttled {
                    until: DEADLINE + 100_000
                }
            )]
        );
        assert!(!settled.refetch && !b.is_fetching());
    }

    #[test]
    fn a_failed_fetch_leaves_every_waiter_to_the_failure_policy() {
        let mut b = LocalBucket::default();
        let _rx: Vec<_> = [1, 1].iter().map(|&c| queue(&mut b, c, 0).1).collect();
        let settled = b.settle(&FetchOutcome::Failed, 0, 0, &limit());
        assert_eq!(
            verdicts(&settled),
            vec![(1, Verdict::Failed), (1, Verdict::Failed)]
        );
        assert!(!b.is_fetching());
        // The next request starts a new fetch.
        assert_eq!(queue(&mut b, 1, 0).0, Miss::StartFetch);
    }

    #[test]
    fn a_waiter_that_went_away_takes_nothing() {
        let mut b = LocalBucket::default();
        let (_, gone) = queue(&mut b, 4, 0);
        let (_, _stays) = queue(&mut b, 1, 0);
        drop(gone);
        assert_eq!(b.plan(0, 0, &limit()).map(|p| p.needed), Some(1));
        let settled = b.settle(&grant(5, 0, 0, 0), 0, 0, &limit());
        assert_eq!(verdicts(&settled), vec![(1, Verdict::Admitted)]);
        assert_eq!(b.leased_tokens(), 4);
    }

    #[test]
    fn no_new_fetch_while_the_store_backs_off() {
        let mut b = LocalBucket::default();
        let (waiter, _rx) = Waiter::new(1, DEADLINE);
        assert_eq!(b.miss(1, 0, 0, &limit(), false, || waiter), Miss::StoreDown);
        assert!(!b.is_fetching());
    }

    #[test]
    fn the_lease_runs_low_once_per_batch() {
        let mut b = LocalBucket::default();
        let (_, _rx) = queue(&mut b, 1, 0);
        b.settle(&grant(8, 0, 0, 0), 0, 0, &limit());
        // 7 left, low water 4: the fourth hit leaves 3 and asks for one prefetch.
        let hits: Vec<_> = (0..5).map(|_| b.take_leased(1)).collect();
        assert_eq!(
            hits,
            [
                Hit::Admitted,
                Hit::Admitted,
                Hit::Admitted,
                Hit::AdmittedStartFetch,
                Hit::Admitted
            ]
        );
        assert_eq!(b.take_leased(5), Hit::Short);
    }

    #[test]
    fn a_lowered_limit_sheds_what_the_lease_holds_beyond_it() {
        let mut b = LocalBucket::default();
        let (_, _rx) = queue(&mut b, 1, 0);
        b.settle(&grant(10, 0, 0, 0), 0, 0, &limit());
        let (_, _rx) = queue(&mut b, 20, 0);
        let lower = Limit::per_second(4).burst(4).unwrap();
        let settled = b.settle(&grant(1, 0, 0, 0), 0, 0, &lower);
        assert_eq!(settled.excess, 6);
        assert_eq!(b.leased_tokens(), 4);
    }

    /// Seed 28503: refunds filled the lease past capacity while requests waited, so no batch
    /// was asked for; those the lease could not serve were refused though the global bucket
    /// held their tokens. They wait for the next batch instead.
    #[test]
    fn a_lease_filled_by_refunds_serves_what_it_can_and_asks_for_the_rest() {
        let limit = limit();
        let mut b = LocalBucket::default();
        let (first, _a) = queue(&mut b, 5, 0);
        let (_, _b) = queue(&mut b, 5, 0);
        let (_, _c) = queue(&mut b, 5, 0);
        assert_eq!(first, Miss::StartFetch);
        b.give_back(12);
        assert!(
            b.plan(0, 0, &limit).is_none(),
            "a full lease asks for nothing"
        );
        let settled = b.settle(&FetchOutcome::Skipped, 0, 0, &limit);
        let verdicts: Vec<_> = settled.verdicts.iter().map(|(_, v)| *v).collect();
        assert_eq!(verdicts, [Verdict::Admitted, Verdict::Admitted]);
        assert!(settled.refetch, "the third waits for a batch");
        assert_eq!(b.waiting(), 1);
        assert_eq!(b.plan(0, 0, &limit).map(|p| p.needed), Some(5));
    }

    #[test]
    fn leases_expire_unless_a_batch_is_in_flight_or_reserved() {
        let mut b = LocalBucket::default();
        let (_, _rx) = queue(&mut b, 1, 0);
        b.settle(&grant(6, 0, 0, 0), 0, 0, &limit());
        assert_eq!(b.take_expired(1_999_999, 2_000_000, 1), 0);
        assert_eq!(b.take_expired(2_000_000, 2_000_000, 2), 5);
        assert_eq!(b.leased_tokens(), 0);
    }

    const SECOND: u64 = 1_000_000;

    #[test]
    fn a_quiet_bucket_sheds_its_slow_path_state_and_reads_the_same() {
        let limit = limit();
        let mut b = LocalBucket::default();
        assert!(
            !b.holds_cold_state(),
            "a new bucket holds only its hot fields"
        );
        let (_, _rx) = queue(&mut b, 1, 0);
        // Four granted, one to the waiter; the global bucket is left empty, full at 1 s.
        b.settle(&grant(4, 0, 0, 0), 0, 0, &limit);
        assert!(b.holds_cold_state());
        assert_eq!(b.take_expired(2 * SECOND, 2 * SECOND, 2), 3);
        // The token served is recorded when it was served, as interval 0's demand, which the
        // window holds until interval 16.
        assert_eq!(b.take_expired(15 * SECOND, 2 * SECOND, 15), 0);
        assert!(b.holds_cold_state(), "demand is left in the window");
        assert_eq!(b.take_expired(16 * SECOND, 2 * SECOND, 16), 0);
        assert!(!b.holds_cold_state(), "nothing left to keep");
        assert_eq!(b.view(16 * SECOND, &limit, true), View::full(&limit));
        assert_eq!(b.known_short(1, 16 * SECOND, &limit), None);
    }

    #[test]
    fn a_bucket_keeps_its_slow_path_state_while_anything_is_left() {
        let limit = limit();
        // Throttled: the global bucket's next token is due at 30 s.
        let mut b = LocalBucket::default();
        let (_, _rx) = queue(&mut b, 1, 0);
        b.settle(&grant(0, 0, 0, 30_000), 0, 0, &limit);
        assert_eq!(b.take_expired(29 * SECOND, 2 * SECOND, 29), 0);
        assert!(b.holds_cold_state(), "the key is throttled until 30 s");
        assert_eq!(b.known_short(1, 29 * SECOND, &limit), Some(30 * SECOND));
        // Its first token comes at 30 s, the bucket is full nine tenths of a second later.
        b.take_expired(30 * SECOND + 899_999, 2 * SECOND, 30);
        assert!(b.holds_cold_state(), "the fleet estimate is short of full");
        assert!(b.view(30 * SECOND + 899_999, &limit, true).tokens < limit.capacity());
        b.take_expired(30 * SECOND + 900_000, 2 * SECOND, 30);
        assert!(!b.holds_cold_state());

        // A bucket that used its own fallback bucket (store down) keeps it until it is full
        // again: a token a second, 2 of 4 taken at 0 s, full at 2 s.
        let share = Limit::per_second(1).burst(4).unwrap();
        let mut b = LocalBucket::default();
        assert_eq!(b.take_fallback(&share, 0, 2), 0);
        b.take_expired(2 * SECOND - 1, SECOND, 0);
        assert!(b.holds_cold_state(), "the fallback bucket is refilling");
        b.take_expired(2 * SECOND, SECOND, 0);
        assert!(
            !b.holds_cold_state(),
            "a full fallback bucket is the same as none"
        );
        assert_eq!(
            b.take_fallback(&share, 2 * SECOND, 4),
            0,
            "it starts full again"
        );
        assert_eq!(b.take_fallback(&share, 2 * SECOND, 1), SECOND);

        // Tokens reserved ahead, or a lease not yet expired, are kept.
        let mut b = LocalBucket::default();
        let (_, _rx) = queue(&mut b, 1, 0);
        b.settle(&grant(1, 2, 40_000, 0), 0, 0, &limit);
        assert_eq!(b.take_expired(20 * SECOND, 2 * SECOND, 20), 0);
        assert!(b.holds_cold_state(), "reserved tokens are held");
        assert_eq!(b.leased_tokens(), 2);
    }
}

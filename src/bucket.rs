//! The lazy token bucket: pure arithmetic, no I/O, no clock.
//!
//! A bucket holds whole tokens plus a fraction of the next one, kept as an integer remainder
//! in units of `1 / period_micros` of a token, so refills are exact for every [`Limit`]:
//! `elapsed * amount / period` is split as `q * amount + (r * amount + remainder) / period`
//! with `r < period`, which never overflows and never rounds. The Redis store runs the same
//! steps in Lua; the shared conformance tests hold both to the same answers.

use std::time::Duration;

use crate::clock::micros;
use crate::limit::Limit;

/// The longest wait a bucket reports: 2^53 microseconds, the largest integer every store
/// represents exactly.
pub const MAX_WAIT_MICROS: u64 = 1 << 53;

/// The state of one token bucket at one instant (`updated_micros`).
///
/// Its level may be negative: tokens [reserved](Self::take_or_reserve) ahead of their refill
/// are owed, and the bucket dispenses nothing until they are paid back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenBucket {
    /// Whole tokens; negative while reserved tokens or a settled debt are owed.
    tokens: i64,
    /// Progress towards the next token, in `1 / limit.period_micros()` tokens.
    remainder: u64,
    updated_micros: u64,
    /// Cold permits stored, in `1 / limit.period_micros()` tokens: always 0 without a
    /// [warm-up](Limit::warm_up).
    cold: u64,
}

/// What a [`TokenBucket::take`] dispensed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Taken {
    /// Tokens dispensed now: between `min` and `want`, or zero.
    pub granted: u64,
    /// Tokens reserved ahead of the refill, due in `ready_in_micros` (`granted + reserved`
    /// is at most `want`).
    pub reserved: u64,
    /// Microseconds until the reserved tokens are due (zero when none are).
    pub ready_in_micros: u64,
    /// Whole tokens left in the bucket (zero while reserved tokens are owed).
    pub remaining: u64,
    /// Microseconds until the bucket holds `min` tokens again (zero if it does now).
    pub refill_in_micros: u64,
}

impl TokenBucket {
    /// A full bucket, as every bucket starts.
    pub fn full(limit: &Limit, now_micros: u64) -> Self {
        Self {
            tokens: capacity(limit),
            remainder: 0,
            updated_micros: now_micros,
            cold: limit.cold_max(),
        }
    }

    /// Tokens reserved ahead of the refill and not refilled yet (as of the last update).
    pub fn owed(&self) -> u64 {
        self.tokens.min(0).unsigned_abs()
    }

    /// Whole tokens held (as of the last update); zero while reserved tokens are owed.
    pub fn tokens(&self) -> u64 {
        u64::try_from(self.tokens).unwrap_or(0)
    }

    /// Brings the bucket up to `now_micros`: adds `amount` per `period`, never past capacity.
    /// A time earlier than the last update is treated as no time passing.
    /// With a warm-up, time the bucket spends full stores cold permits, at the refill rate.
    pub fn refill(&mut self, limit: &Limit, now_micros: u64) {
        let elapsed = now_micros.saturating_sub(self.updated_micros);
        // Cold permits of another limit (one the key moved from) count up to this one's store.
        self.cold = self.cold.min(limit.cold_max());
        if limit.cold_max() > 0 {
            self.cool(limit, elapsed);
        }
        let (tokens, remainder) = self.level_after(limit, elapsed);
        self.tokens = tokens;
        self.remainder = remainder;
        self.updated_micros = self.updated_micros.max(now_micros);
    }

    /// Stores the cold permits of the part of `elapsed` the bucket spends full (before the
    /// level is brought up to date).
    fn cool(&mut self, limit: &Limit, elapsed: u64) {
        let to_full = self.micros_until(limit, limit.capacity());
        // At most the warm-up period counts: it fills the store from empty.
        let idle_full = elapsed.saturating_sub(to_full).min(limit.warm_up_micros());
        self.cold = (self.cold + idle_full * limit.refill_amount()).min(limit.cold_max());
    }

    /// The level `elapsed` microseconds after the last update: whole tokens and remainder.
    /// A calendar quota's bucket gains its capacity at each reset (a debt carries over, paid
    /// first) and nothing between.
    fn level_after(&self, limit: &Limit, elapsed: u64) -> (i64, u64) {
        let capacity = capacity(limit);
        if self.tokens >= capacity {
            return (capacity, 0);
        }
        if let Some(calendar) = limit.calendar() {
            let later = self.updated_micros.saturating_add(elapsed);
            let resets = calendar.resets_between(self.updated_micros, later);
            let level = i128::from(self.tokens) + i128::from(resets) * i128::from(capacity);
            // Below capacity, and above the level it rose from.
            return (level.min(i128::from(capacity)) as i64, 0);
        }
        let (a, p) = (
            i128::from(limit.refill_amount()),
            i128::from(limit.period_micros()),
        );
        let elapsed = i128::from(elapsed);
        let (q, r) = (elapsed / p, elapsed % p);
        let sub = i128::from(self.remainder) + r * a;
        let tokens = i128::from(self.tokens) + q * a + sub / p;
        if tokens >= i128::from(capacity) {
            (capacity, 0)
        } else {
            // Both fit: the level only rose from an i64 and stays below capacity < 2^53, and
            // the remainder < p.
            (tokens as i64, (sub % p) as u64)
        }
    }

    /// Refills to `now_micros`, then dispenses up to `want` tokens if at least `min` are there
    /// (`min` of zero is taken as one). Dispenses nothing otherwise.
    pub fn take(&mut self, limit: &Limit, now_micros: u64, min: u64, want: u64) -> Taken {
        self.take_or_reserve(limit, now_micros, min, want, 0)
    }

    /// Like [`take`](Self::take), and besides reserves tokens that the refill brings within
    /// `max_delay_micros` of the tokens already reserved (of now, when none are), up to `want`
    /// in all, as Go's `ReserveN` does: the level goes negative, and
    /// [`Taken::ready_in_micros`] says when the reserved tokens are due. Tokens that are there
    /// are always granted at once, never reserved. When fewer than `min` are there, at least
    /// `min` must fall due within the delay for anything to be reserved.
    ///
    /// Reservations queue: each reaches at most `max_delay_micros` beyond those before it, so a
    /// bucket owes at most that much refill per reserving host (a host holds one reservation at
    /// a time), and a refused host holds its share of the next tokens instead of polling. A
    /// `max_delay_micros` of zero reserves nothing, even behind a debt.
    pub fn take_or_reserve(
        &mut self,
        limit: &Limit,
        now_micros: u64,
        min: u64,
        want: u64,
        max_delay_micros: u64,
    ) -> Taken {
        if limit.cold_max() > 0 {
            return self.take_warming(limit, now_micros, min, want, max_delay_micros);
        }
        self.refill(limit, now_micros);
        let min = min.clamp(1, limit.capacity());
        let want = want.clamp(min, limit.capacity());
        let there = self.tokens();
        let granted = if there >= min { want.min(there) } else { 0 };
        let horizon = self.micros_until(limit, 0).saturating_add(max_delay_micros);
        let due = match max_delay_micros {
            // Never reserving: not even the tokens that come due the moment a debt is paid (a
            // calendar quota's next window comes all at once).
            0 => 0,
            _ => want.min(self.whole_tokens_after(limit, horizon)),
        };
        let extra = due.saturating_sub(granted);
        let reserved = if granted > 0 || extra >= min {
            extra
        } else {
            0
        };
        let ready_in_micros = if reserved > 0 {
            self.micros_until(limit, granted + reserved)
        } else {
            0
        };
        // granted + reserved <= capacity < 2^53: fits, and the level stays above -capacity.
        self.tokens -= (granted + reserved) as i64;
        Taken {
            granted,
            reserved,
            ready_in_micros,
            remaining: self.tokens(),
            refill_in_micros: self.micros_until(limit, min),
        }
    }

    /// [`take_or_reserve`](Self::take_or_reserve) for a limit with a warm-up: the same rules,
    /// with permits priced by [`price`](Self::price) and admitted one after another while a
    /// whole token is there for each (a full bucket admits `min` whatever their price).
    /// Reserved permits are paid one after another as the refill comes, so the level they are
    /// counted against is not capped at the capacity (each is taken before it would be).
    fn take_warming(
        &mut self,
        limit: &Limit,
        now_micros: u64,
        min: u64,
        want: u64,
        max_delay_micros: u64,
    ) -> Taken {
        self.refill(limit, now_micros);
        let min = min.clamp(1, limit.capacity());
        let want = want.clamp(min, limit.capacity());
        let p = i128::from(limit.period_micros());
        let there = self.permits_within(limit, self.units(p), min, want);
        let granted = if there >= min { there } else { 0 };
        let horizon = self.micros_until(limit, 0).saturating_add(max_delay_micros);
        let later = self.units(p) + i128::from(horizon) * i128::from(limit.refill_amount());
        let due = match max_delay_micros {
            0 => 0,
            _ => self.permits_within(limit, later, min, want),
        };
        let extra = due.saturating_sub(granted);
        let reserved = if granted > 0 || extra >= min {
            extra
        } else {
            0
        };
        let ready_in_micros = if reserved > 0 {
            self.micros_until_units(limit, self.required(limit, granted + reserved, min))
        } else {
            0
        };
        self.consume(limit, granted + reserved);
        Taken {
            granted,
            reserved,
            ready_in_micros,
            remaining: self.tokens(),
            refill_in_micros: self.micros_until_units(limit, self.required(limit, min, min)),
        }
    }

    /// The level in `1 / p` tokens.
    fn units(&self, p: i128) -> i128 {
        i128::from(self.tokens) * p + i128::from(self.remainder)
    }

    /// What taking `permits` costs now, in `1 / period` tokens: a token each, and for the cold
    /// permits they take, the warm-up's surcharge.
    fn price(&self, limit: &Limit, permits: u64) -> i128 {
        let unit = i128::from(permits) * i128::from(limit.period_micros());
        let taken = u64::try_from(unit).map_or(self.cold, |u| u.min(self.cold));
        unit + i128::from(surcharge(self.cold, self.cold - taken, limit.cold_max()))
    }

    /// Up to `want` permits a level of `units` admits one after another (each while a whole
    /// token is there once those before it are paid for), and at least `min` when full.
    fn permits_within(&self, limit: &Limit, units: i128, min: u64, want: u64) -> u64 {
        let p = i128::from(limit.period_micros());
        if units < p {
            return 0;
        }
        // The most `m < want` whose price the level covers beyond one token: prices grow with m.
        let (mut lo, mut hi) = (0, want - 1);
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            match self.price(limit, mid) <= units - p {
                true => lo = mid,
                false => hi = mid - 1,
            }
        }
        match units >= i128::from(limit.capacity()) * p {
            true => (lo + 1).max(min),
            false => lo + 1,
        }
    }

    /// The level (in `1 / period` tokens) at which `permits` are admitted (a full bucket
    /// admits `min`).
    fn required(&self, limit: &Limit, permits: u64, min: u64) -> i128 {
        let p = i128::from(limit.period_micros());
        let paid = p + self.price(limit, permits - 1);
        match permits <= min {
            true => paid.min(i128::from(limit.capacity()) * p),
            false => paid,
        }
    }

    /// Pays for `permits`, taking the cold permits among them out of store.
    fn consume(&mut self, limit: &Limit, permits: u64) {
        let p = i128::from(limit.period_micros());
        let units = self.units(p) - self.price(limit, permits);
        let unit = u64::try_from(i128::from(permits) * p).unwrap_or(u64::MAX);
        self.cold -= unit.min(self.cold);
        // The level stays above three capacities of debt, which Limit::warm_up keeps exact.
        self.tokens = i64::try_from(units.div_euclid(p)).unwrap_or(i64::MIN / 2);
        self.remainder = units.rem_euclid(p) as u64;
    }

    /// Whole tokens (at least zero) the bucket holds `elapsed` microseconds after its update.
    fn whole_tokens_after(&self, limit: &Limit, elapsed: u64) -> u64 {
        u64::try_from(self.level_after(limit, elapsed).0).unwrap_or(0)
    }

    /// Refills to `now_micros`, then puts back tokens that were taken and not used, never past
    /// capacity, unless they have expired by `now_micros` (see [`TokenReturn::expires`]).
    pub fn give_back(&mut self, limit: &Limit, now_micros: u64, back: TokenReturn) {
        if back.has_expired(now_micros) {
            return;
        }
        self.refill(limit, now_micros);
        let tokens = i64::try_from(back.tokens.min(limit.capacity())).unwrap_or(i64::MAX);
        self.tokens = self.tokens.saturating_add(tokens).min(capacity(limit));
        if self.tokens == capacity(limit) {
            self.remainder = 0;
        }
    }

    /// Refills to `now_micros`, then applies `adjustment` (an operator's change; see
    /// [`Adjustment`]) unless it `expires` by then (Unix time; `None`: never), as a hand-back
    /// does: a calendar quota's change belongs to the window it was made in. Returns whether
    /// it was applied (`false`: expired, and the bucket left as it was).
    pub fn adjust(
        &mut self,
        limit: &Limit,
        now_micros: u64,
        adjustment: Adjustment,
        expires: Option<Duration>,
    ) -> bool {
        if has_expired(expires, now_micros) {
            return false;
        }
        self.refill(limit, now_micros);
        let capacity = capacity(limit);
        let amount = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        match adjustment {
            Adjustment::Reset => {
                self.tokens = capacity;
                self.remainder = 0;
                self.cold = limit.cold_max();
            }
            Adjustment::Drain => {
                self.tokens = self.tokens.min(0);
                self.remainder = 0;
            }
            Adjustment::Add(n) => self.tokens = self.tokens.saturating_add(amount(n)).min(capacity),
            Adjustment::Remove(n) => {
                self.tokens = self
                    .tokens
                    .min(self.tokens.saturating_sub(amount(n)).max(-capacity));
            }
        }
        if self.tokens == capacity {
            self.remainder = 0;
        }
        true
    }

    /// Microseconds from the last update until the bucket holds `tokens` (capped at capacity),
    /// rounded up, and at most [`MAX_WAIT_MICROS`] (about 285 years).
    pub fn micros_until(&self, limit: &Limit, tokens: u64) -> u64 {
        let tokens = i128::from(tokens.min(limit.capacity()));
        if let Some(calendar) = limit.calendar() {
            let lacking = u64::try_from(tokens - i128::from(self.tokens)).unwrap_or(0);
            if lacking == 0 {
                return 0;
            }
            let at = calendar.reset_after(self.updated_micros, lacking.div_ceil(limit.capacity()));
            return at.saturating_sub(self.updated_micros).min(MAX_WAIT_MICROS);
        }
        self.micros_until_units(limit, tokens * i128::from(limit.period_micros()))
    }

    /// [`micros_until`](Self::micros_until) a level of `units` (in `1 / period` tokens).
    fn micros_until_units(&self, limit: &Limit, units: i128) -> u64 {
        let needed = units - self.units(i128::from(limit.period_micros()));
        if needed <= 0 {
            return 0;
        }
        let a = i128::from(limit.refill_amount());
        let micros = (needed + a - 1) / a;
        u64::try_from(micros).map_or(MAX_WAIT_MICROS, |m| m.min(MAX_WAIT_MICROS))
    }

    /// Whether the bucket is full at `now_micros`: then it is the same as no bucket at all, and a
    /// store may forget it. With a warm-up, full means fully cold too.
    pub fn is_full_at(&self, limit: &Limit, now_micros: u64) -> bool {
        now_micros >= self.full_by(limit)
    }

    /// The first microsecond the bucket [is full](Self::is_full_at) in, if nothing is taken
    /// (saturating).
    pub fn full_by(&self, limit: &Limit) -> u64 {
        let to_cold = limit.cold_max().saturating_sub(self.cold);
        let to_cold = to_cold.div_ceil(limit.refill_amount());
        let to_full = self
            .micros_until(limit, limit.capacity())
            .saturating_add(to_cold);
        self.updated_micros.saturating_add(to_full)
    }
}

/// When a bucket will be full if nothing more is taken: `micros` and `frac / amount` of a
/// microsecond, `amount` being the limit's refill amount (in lowest terms with its period).
///
/// Given its limit (without a warm-up), this one instant is the whole state of a bucket,
/// exactly: its level at
/// any later time is the capacity less the refill still to come. So a store can keep 16 bytes
/// per bucket and still tell, without the limit, whether a bucket is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FullAt {
    micros: u64,
    frac: u64,
}

impl FullAt {
    /// The microsecond the bucket is full in (rounded down): buckets full sooner lack less.
    pub fn micros(&self) -> u64 {
        self.micros
    }

    /// Whether the bucket is full at `now_micros`.
    pub fn is_full_at(&self, now_micros: u64) -> bool {
        now_micros > self.micros || (now_micros == self.micros && self.frac == 0)
    }
}

impl TokenBucket {
    /// When the bucket is full if nothing more is taken; `None` when that is more than
    /// `u64::MAX` microseconds from the clock's start (a limit that takes over 500,000 years
    /// to refill), or when the limit warms up (its cold permits are state of their own).
    pub fn full_at(&self, limit: &Limit) -> Option<FullAt> {
        match (limit.cold_max(), limit.calendar()) {
            (0, None) => self.tokens_full_at(limit),
            _ => None,
        }
    }

    /// This bucket of limit `from` as a bucket of `to` at `now_micros`, for a key whose limit
    /// changed (raised, lowered, another tier under the same name): it keeps its whole tokens
    /// (a debt too), at most the new capacity, and what it had accrued towards its next token
    /// and its cold permits as the same share of a token (none accrued when either limit is a
    /// calendar quota's, whose tokens come only at resets), cold permits up to the new store.
    /// So a raised limit is not held back by the old one's refill, and a lowered one admits at
    /// most its own capacity at once. A bucket full by now is full under `to`: a full bucket
    /// is no state at all (a store may have forgotten it, Redis lets it expire).
    pub fn carried(&self, from: &Limit, to: &Limit, now_micros: u64) -> Self {
        let mut bucket = *self;
        bucket.refill(from, now_micros);
        if from == to {
            return bucket;
        }
        if bucket.is_full_at(from, now_micros) {
            return Self::full(to, now_micros);
        }
        let (p_from, p_to) = (from.period_micros(), to.period_micros());
        bucket.tokens = bucket.tokens.min(capacity(to));
        bucket.remainder = match from.calendar().or(to.calendar()) {
            Some(_) => 0,
            None => rescaled(bucket.remainder, p_from, p_to),
        };
        bucket.cold = rescaled(bucket.cold, p_from, p_to).min(to.cold_max());
        bucket.refill(to, now_micros);
        bucket
    }

    /// When the bucket's tokens are full if nothing more is taken (its cold permits aside).
    fn tokens_full_at(&self, limit: &Limit) -> Option<FullAt> {
        let (a, p) = (
            i128::from(limit.refill_amount()),
            i128::from(limit.period_micros()),
        );
        // In 1/p tokens: what the bucket lacks (at most 2 * capacity * p < 2^107).
        let level = i128::from(self.tokens) * p + i128::from(self.remainder);
        let lacking = (i128::from(capacity(limit)) * p - level).max(0);
        let micros = i128::from(self.updated_micros) + lacking / a;
        Some(FullAt {
            micros: u64::try_from(micros).ok()?,
            frac: u64::try_from(lacking % a).ok()?,
        })
    }

    /// The bucket that is full at `full_at`, as it is at `now_micros`. The inverse of
    /// [`full_at`](Self::full_at): the bucket it gave, refilled to `now_micros`.
    pub fn from_full_at(full_at: FullAt, limit: &Limit, now_micros: u64) -> Self {
        if full_at.is_full_at(now_micros) {
            return Self::full(limit, now_micros);
        }
        let (a, p) = (
            i128::from(limit.refill_amount()),
            i128::from(limit.period_micros()),
        );
        let capacity = i128::from(capacity(limit));
        let lacking =
            (i128::from(full_at.micros) - i128::from(now_micros)) * a + i128::from(full_at.frac);
        let level = capacity * p - lacking;
        Self {
            // Below capacity; above what a debt can reach (only a limit changed since could
            // take it lower). The remainder is below p.
            tokens: i64::try_from(level.div_euclid(p)).unwrap_or(i64::MIN / 2),
            remainder: level.rem_euclid(p) as u64,
            updated_micros: now_micros,
            // Kept from a limit without a warm-up (a key that moved to one): in use, so warm.
            cold: 0,
        }
    }
}

/// The surcharge for taking the cold permits between `lo` and `hi` out of a store of at most
/// `max` (all in `1 / period` tokens): the area above 1 under the line from 1 at `max / 2` to
/// 3 at `max`, rounded up. In doubles, in the order the Redis script computes it, so that both
/// stores agree to the unit (exact while the product stays below 2^53).
fn surcharge(hi: u64, lo: u64, max: u64) -> u64 {
    if 2 * hi <= max {
        return 0;
    }
    let lo = (2 * lo).max(max);
    let (width, height) = (2 * hi - lo, 2 * hi + lo - 2 * max);
    (width as f64 * height as f64 / (2 * max) as f64).ceil() as u64
}

/// `units` of `1 / from` of a token as units of `1 / to` (rounded down): the same share.
fn rescaled(units: u64, from: u64, to: u64) -> u64 {
    (u128::from(units) * u128::from(to) / u128::from(from.max(1))) as u64
}

/// A limit's capacity as a level: capacities are below 2^53, so it always fits.
fn capacity(limit: &Limit) -> i64 {
    i64::try_from(limit.capacity()).unwrap_or(i64::MAX)
}

/// A change an operator makes to a global bucket, as Gubernator's `RESET_REMAINING` and
/// `DRAIN_OVER_LIMIT` or Bucket4j's `reset` and `addTokens` do: to lift a block, to stop a
/// key at once, or to grant or charge tokens by hand. Tokens already leased to hosts are
/// theirs; the change is to what the global bucket holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Adjustment {
    /// Full again, as a bucket never used: tokens owed (reserved ahead, or a settled debt)
    /// are forgiven, and a limit that [warms up](Limit::warm_up) is cold again.
    Reset,
    /// Empty now, refilling from now on; tokens owed stay owed.
    Drain,
    /// This many more tokens, never past capacity.
    Add(u64),
    /// This many fewer, into debt of at most a capacity (requests pay it back before any more
    /// are admitted), as a settled cost is.
    Remove(u64),
}

/// A request for tokens: at least `min`, ideally `want`, of which those not there now may be
/// reserved if they fall due within `max_delay`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenRequest {
    /// Dispense nothing unless at least this many tokens are there, or due within `max_delay`
    /// (at least 1).
    pub min: u64,
    /// Dispense up to this many (at least `min`, at most the capacity).
    pub want: u64,
    /// Reserve, up to `want` in all, the tokens that fall due within this time (zero: never
    /// reserve). Tokens that are there are always dispensed at once.
    pub max_delay: Duration,
}

impl TokenRequest {
    /// At least `min`, up to `want` tokens, now; no reservation.
    pub fn now(min: u64, want: u64) -> Self {
        Self {
            min,
            want,
            max_delay: Duration::ZERO,
        }
    }
}

/// Tokens a host hands back to a global bucket, unused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenReturn {
    /// How many (the bucket keeps them up to its capacity).
    pub tokens: u64,
    /// When they stop counting, as Unix time by the store's clock (`None`: never). A calendar
    /// quota's tokens belong to the window they were leased in: a hand-back that reaches the
    /// store at or after that window's reset (say, from a store that stalled with the call in
    /// its socket buffer) is dropped, so that it never adds to the next window's allowance.
    pub expires: Option<Duration>,
}

impl TokenReturn {
    /// `tokens` that never expire: a rate's.
    pub fn new(tokens: u64) -> Self {
        Self {
            tokens,
            expires: None,
        }
    }

    /// `tokens` that the store drops if they reach it at or after `expires` (Unix time).
    pub fn expiring(tokens: u64, expires: Duration) -> Self {
        Self {
            tokens,
            expires: Some(expires),
        }
    }

    /// Whether the tokens no longer count at `now_micros` (Unix time by the store's clock).
    pub fn has_expired(&self, now_micros: u64) -> bool {
        has_expired(self.expires, now_micros)
    }

    /// [`expires`](Self::expires) in whole Unix microseconds, for a store's wire (0: never).
    pub fn expires_micros(&self) -> u64 {
        expiry_micros(self.expires)
    }
}

/// Whether a call that `expires` (Unix time; `None`: never) no longer counts at `now_micros`
/// (Unix time by the store's clock): a hand-back's or an operator's change of a calendar
/// quota, reaching the store at or after the reset of the window it was made in.
pub fn has_expired(expires: Option<Duration>, now_micros: u64) -> bool {
    expires.is_some_and(|at| now_micros >= micros(at))
}

/// An expiry in whole Unix microseconds, for a store's wire (0: never).
pub fn expiry_micros(expires: Option<Duration>) -> u64 {
    expires.map_or(0, |at| micros(at).max(1))
}

/// A global store's answer to a [`TokenRequest`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// Tokens dispensed to the host, usable now: zero, or between `min` and `want`.
    pub granted: u64,
    /// Tokens reserved for the host ahead of the refill, usable only after `ready_in`
    /// (`granted + reserved` is at most `want`).
    pub reserved: u64,
    /// When the reserved tokens are due (zero when none are).
    pub ready_in: Duration,
    /// Whole tokens left in the global bucket.
    pub remaining: u64,
    /// How long until the global bucket holds `min` tokens again (zero if it does now).
    pub refill_in: Duration,
}

/// A global bucket's level, read without taking anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketLevel {
    /// Whole tokens in the bucket now.
    pub tokens: u64,
    /// How long until it holds one more (zero when it is full).
    pub next_in: Duration,
    /// How long until it is full (zero when it is).
    pub full_in: Duration,
}

impl BucketLevel {
    /// The level of `bucket` at `now_micros` (brought up to date first).
    pub fn of(bucket: &TokenBucket, limit: &Limit, now_micros: u64) -> Self {
        let mut bucket = *bucket;
        bucket.refill(limit, now_micros);
        let tokens = bucket.tokens();
        let next = tokens.saturating_add(1).min(limit.capacity());
        Self {
            tokens,
            next_in: Duration::from_micros(bucket.micros_until(limit, next)),
            full_in: Duration::from_micros(bucket.micros_until(limit, limit.capacity())),
        }
    }
}

/// What an operator's change ([`Adjustment`]) did to a global bucket: the bucket's level
/// after it, and whether it was applied at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Adjusted {
    /// The bucket's level after the change (as it was, when the change was dropped).
    pub level: BucketLevel,
    /// `false` when the change reached the store at or after its expiry and was dropped (a
    /// calendar quota's change that came after the reset of the window it was made in).
    pub applied: bool,
}

impl Adjusted {
    /// Applies `adjustment` to `bucket` at `now_micros` unless it `expires` by then (see
    /// [`TokenBucket::adjust`]), and tells what it did: what a store of buckets in memory
    /// answers.
    pub fn apply(
        bucket: &mut TokenBucket,
        limit: &Limit,
        now_micros: u64,
        adjustment: Adjustment,
        expires: Option<Duration>,
    ) -> Self {
        let applied = bucket.adjust(limit, now_micros, adjustment, expires);
        Self {
            level: BucketLevel::of(bucket, limit, now_micros),
            applied,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn tb() -> Limit {
        Limit::per(1, Duration::from_millis(3)).burst(4).unwrap()
    }

    #[test]
    fn adjustments_reset_drain_add_and_remove_within_their_bounds() {
        let l = tb(); // 1 per 3 ms, burst 4
        let mut b = TokenBucket::full(&l, 0);
        b.take(&l, 0, 1, 3);
        // 2 ms later: 1 token and two thirds of the next.
        b.adjust(&l, 2_000, Adjustment::Drain, None);
        assert_eq!((b.tokens(), b.owed(), b.micros_until(&l, 1)), (0, 0, 3_000));
        b.adjust(&l, 2_000, Adjustment::Add(3), None);
        assert_eq!(b.tokens(), 3);
        b.adjust(&l, 2_000, Adjustment::Add(100), None);
        assert_eq!((b.tokens(), b.is_full_at(&l, 2_000)), (4, true));
        // Into debt of at most a capacity, which the refill pays first.
        b.adjust(&l, 2_000, Adjustment::Remove(100), None);
        assert_eq!((b.tokens(), b.owed()), (0, 4));
        assert_eq!(b.micros_until(&l, 1), 15_000);
        b.adjust(&l, 2_000, Adjustment::Remove(1), None);
        assert_eq!(b.owed(), 4);
        // A drain keeps what is owed; a reset forgives it.
        b.adjust(&l, 5_000, Adjustment::Drain, None);
        assert_eq!((b.owed(), b.micros_until(&l, 0)), (3, 9_000));
        b.adjust(&l, 5_000, Adjustment::Reset, None);
        assert_eq!((b.tokens(), b.is_full_at(&l, 5_000)), (4, true));
    }

    #[test]
    fn fractional_tokens_accumulate_exactly() {
        let l = tb();
        let mut b = TokenBucket::full(&l, 0);
        assert_eq!(b.take(&l, 0, 1, 3).granted, 3);
        b.refill(&l, 2_000);
        assert_eq!((b.tokens(), b.remainder), (1, 2_000));
        assert_eq!(b.micros_until(&l, 2), 1_000);
    }

    #[test]
    fn take_dispenses_between_min_and_want_or_nothing() {
        let l = tb();
        let mut b = TokenBucket::full(&l, 0);
        let t = b.take(&l, 0, 2, 10);
        assert_eq!((t.granted, t.remaining), (4, 0));
        let t = b.take(&l, 1_000, 1, 1);
        assert_eq!((t.granted, t.refill_in_micros), (0, 2_000));
        let t = b.take(&l, 7_000, 3, 3);
        assert_eq!((t.granted, t.remaining, t.refill_in_micros), (0, 2, 2_000));
    }

    #[test]
    fn give_back_never_passes_capacity() {
        let l = tb();
        let mut b = TokenBucket::full(&l, 0);
        b.take(&l, 0, 1, 2);
        b.give_back(&l, 0, TokenReturn::new(5));
        assert_eq!(b.tokens(), 4);
        assert!(b.is_full_at(&l, 0));
    }

    #[test]
    fn give_back_drops_tokens_that_expired() {
        let l = tb();
        let mut b = TokenBucket::full(&l, 0);
        b.take(&l, 0, 3, 3);
        let at = Duration::from_micros(10);
        b.give_back(&l, 9, TokenReturn::expiring(1, at));
        assert_eq!(b.tokens(), 2, "taken back before they expire");
        b.give_back(&l, 10, TokenReturn::expiring(1, at));
        assert_eq!(b.tokens(), 2, "dropped at the instant they expire");
        b.give_back(&l, 11, TokenReturn::new(1));
        assert_eq!(b.tokens(), 3, "tokens that never expire always count");
    }

    #[test]
    fn an_expired_adjustment_changes_nothing() {
        let l = tb();
        let mut b = TokenBucket::full(&l, 0);
        b.take(&l, 0, 4, 4);
        let at = Some(Duration::from_micros(10));
        assert!(!b.adjust(&l, 10, Adjustment::Reset, at));
        assert!(!b.adjust(&l, 11, Adjustment::Add(2), at));
        assert_eq!(
            (b.tokens(), b.micros_until(&l, 1)),
            (0, 3_000),
            "dropped from its expiry on"
        );
        assert!(b.adjust(&l, 9, Adjustment::Add(2), at));
        assert_eq!(b.tokens(), 2, "applied before it expires");
        assert!(b.adjust(&l, 11, Adjustment::Drain, None));
        assert_eq!(b.tokens(), 0, "a change that never expires always applies");
        // What a store answers: the level, and whether the change applied.
        let dropped = Adjusted::apply(&mut b, &l, 12, Adjustment::Reset, at);
        assert_eq!(dropped.level, BucketLevel::of(&b, &l, 12));
        assert!(!dropped.applied);
        assert_eq!(dropped.level.tokens, 0);
    }

    #[test]
    fn no_delay_reserves_nothing_behind_a_debt() {
        // A calendar quota's next window comes all at once when its debt is paid: a request
        // that may not wait must not reserve it.
        let daily = Limit::per_calendar(3, crate::calendar::Period::Day)
            .build()
            .unwrap();
        let (rate, now) = (tb(), 1_000_000);
        for l in [daily, rate] {
            let mut b = TokenBucket::full(&l, now);
            b.take(&l, now, 1, l.capacity());
            b.take_or_reserve(&l, now, 1, 1, MAX_WAIT_MICROS);
            let t = b.take_or_reserve(&l, now, 1, l.capacity(), 0);
            assert_eq!((t.granted, t.reserved), (0, 0), "{l}");
            assert_eq!(b.owed(), 1, "{l}: only the charge is owed");
        }
    }

    #[test]
    fn tokens_there_are_granted_at_once_never_reserved() {
        let l = tb();
        let mut b = TokenBucket::full(&l, 0);
        b.take(&l, 0, 1, 3);
        // One token is there: it is granted now, though three more would be due within 9 ms.
        let t = b.take_or_reserve(&l, 0, 1, 4, 0);
        assert_eq!((t.granted, t.reserved, t.refill_in_micros), (1, 0, 3_000));
        // With a delay, those due within it are reserved besides: two more by 6 ms.
        let mut b = TokenBucket::full(&l, 0);
        b.take(&l, 0, 1, 3);
        let t = b.take_or_reserve(&l, 0, 1, 4, 7_000);
        assert_eq!((t.granted, t.reserved, t.ready_in_micros), (1, 2, 6_000));
        assert_eq!(t.refill_in_micros, 9_000);
    }

    #[test]
    fn an_empty_bucket_reserves_what_falls_due_within_the_delay() {
        let l = tb();
        let mut b = TokenBucket::full(&l, 0);
        b.take(&l, 0, 4, 4);
        // 1 ms later a third of a token is there: tokens 1, 2, 3 are due at 3, 6 and 9 ms.
        let t = b.take_or_reserve(&l, 1_000, 1, 5, 7_000);
        assert_eq!((t.granted, t.reserved, t.ready_in_micros), (0, 2, 5_000));
        // The level is -2 (and a third): the next token is due after those two are paid.
        assert_eq!((t.remaining, t.refill_in_micros), (0, 8_000));
        // A second reservation queues behind the first: the two tokens due within 7 ms of
        // the debt being paid (at 6 ms), so at 9 and 12 ms.
        let t = b.take_or_reserve(&l, 1_000, 1, 5, 7_000);
        assert_eq!(
            (t.reserved, t.ready_in_micros, t.refill_in_micros),
            (2, 11_000, 14_000)
        );
        // Nothing is dispensed before the debt is paid, and the bucket fills up from there.
        assert_eq!(b.take(&l, 14_999, 1, 1).granted, 0);
        assert_eq!(b.take(&l, 15_000, 1, 1).granted, 1);
        assert!(b.is_full_at(&l, 15_000 + 12_000));
    }

    #[test]
    fn a_reservation_needs_min_tokens_within_the_delay() {
        let l = tb();
        let mut b = TokenBucket::full(&l, 0);
        b.take(&l, 0, 4, 4);
        let t = b.take_or_reserve(&l, 0, 2, 4, 5_999);
        assert_eq!((t.granted + t.reserved, t.refill_in_micros), (0, 6_000));
        let t = b.take_or_reserve(&l, 0, 2, 4, 6_000);
        assert_eq!((t.reserved, t.ready_in_micros), (2, 6_000));
    }

    /// Every level a bucket can hold, for limits of whole, fractional and sub-microsecond
    /// rates: kept as the time it is full, it reads back as the bucket refilled, and is full
    /// exactly when the bucket is.
    #[test]
    fn the_time_a_bucket_is_full_is_its_whole_state() {
        let limits = [
            tb(),
            Limit::per_second(10).burst(10).unwrap(),
            Limit::per(7, Duration::from_micros(3)).burst(20).unwrap(),
            Limit::per(3, Duration::from_millis(7)).burst(5).unwrap(),
        ];
        for l in limits {
            let step = (l.period_micros() / l.refill_amount()).max(1);
            for taken in 0..=2 * l.capacity() {
                let mut b = TokenBucket::full(&l, 1_000);
                let (now, want) = (1_000 + step / 3, taken.min(l.capacity()));
                b.take_or_reserve(&l, now, 1, want, 0);
                b.take_or_reserve(&l, now, 1, taken - want, u64::MAX / 4);
                let full_at = b.full_at(&l).unwrap();
                for later in (0..4 * l.capacity() * step).step_by((step / 2).max(1) as usize) {
                    let at = now + later;
                    let mut refilled = b;
                    refilled.refill(&l, at);
                    let read = TokenBucket::from_full_at(full_at, &l, at);
                    assert_eq!(read, refilled, "{l:?}, {taken} taken, at {at}");
                    assert_eq!(
                        full_at.is_full_at(at),
                        b.is_full_at(&l, at),
                        "{l:?} at {at}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_bucket_full_beyond_the_clock_s_range_has_no_compact_form() {
        let l = Limit::per_day(1).burst(Limit::MAX_CAPACITY).unwrap();
        let mut b = TokenBucket::full(&l, 0);
        assert!(b.full_at(&l).is_some());
        b.take(&l, 0, Limit::MAX_CAPACITY, Limit::MAX_CAPACITY);
        assert_eq!(b.full_at(&l), None);
    }

    #[test]
    fn huge_capacity_and_slow_rate_are_exact() {
        let l = Limit::per_day(1).burst(Limit::MAX_CAPACITY).unwrap();
        let mut b = TokenBucket::full(&l, 0);
        b.take(&l, 0, Limit::MAX_CAPACITY, Limit::MAX_CAPACITY);
        let day = 86_400_000_000;
        assert_eq!(b.micros_until(&l, 1), day);
        b.refill(&l, 3 * day - 1);
        assert_eq!(b.tokens(), 2);
        assert_eq!(b.micros_until(&l, 3), 1);
    }

    /// 2 per second warming up over 4 s, capacity 1: Guava's `SmoothWarmingUp` example.
    fn guava() -> Limit {
        Limit::per_second(2)
            .burst(1)
            .unwrap()
            .warm_up(Duration::from_secs(4))
            .unwrap()
    }

    #[test]
    fn a_cold_bucket_spaces_requests_as_guava_s_warming_up_limiter_does() {
        let l = guava();
        let mut b = TokenBucket::full(&l, 0);
        let mut now = 0;
        let mut waits = Vec::new();
        for _ in 0..7 {
            let taken = b.take(&l, now, 1, 1);
            assert_eq!(taken.granted, 1, "admitted at {now}");
            // Nothing more until the wait is over.
            let mut early = b;
            assert_eq!(early.take(&l, now, 1, 1).granted, 0);
            waits.push(taken.refill_in_micros);
            now += taken.refill_in_micros;
        }
        assert_eq!(
            waits,
            [
                1_375_000, 1_125_000, 875_000, 625_000, 500_000, 500_000, 500_000
            ]
        );
    }

    #[test]
    fn idleness_cools_a_warm_bucket_at_the_rate() {
        let l = guava();
        let mut b = TokenBucket::full(&l, 0);
        let mut now = 0;
        // Eight permits take every cold one out of store.
        for _ in 0..8 {
            now += b.take(&l, now, 1, 1).refill_in_micros;
        }
        assert_eq!(b.cold, 0);
        // Full now; 3 s more stores 6 cold permits (2 per second): the next costs the average
        // of the line over [5, 6], 1.75 tokens, so the one after waits 0.875 s.
        now += 3_000_000;
        assert_eq!(b.take(&l, now, 1, 1).refill_in_micros, 875_000);
        // A bucket idle for the warm-up period or longer is as cold as a new one.
        let mut idle = b;
        idle.refill(&l, now + 10_000_000);
        assert!(idle.is_full_at(&l, now + 10_000_000));
        assert_eq!(idle, TokenBucket::full(&l, now + 10_000_000));
    }

    #[test]
    fn a_cold_bucket_admits_a_smaller_burst_one_by_one_or_in_a_batch() {
        let l = Limit::per_second(2)
            .burst(10)
            .unwrap()
            .warm_up(Duration::from_secs(4))
            .unwrap();
        // Prices of the first permits: 2.75, 2.25, 1.75, 1.25, then 1 each; each needs one
        // whole token there: 10 -> 7.25 -> 5 -> 3.25 -> 2 -> 1 -> 0.
        let mut one_by_one = TokenBucket::full(&l, 0);
        let admitted = (0..10)
            .map(|_| one_by_one.take(&l, 0, 1, 1).granted)
            .sum::<u64>();
        assert_eq!(admitted, 6);
        let mut batch = TokenBucket::full(&l, 0);
        let taken = batch.take(&l, 0, 1, 10);
        assert_eq!((taken.granted, batch), (6, one_by_one));
        // Warm, the same bucket bursts its capacity.
        let plain = Limit::per_second(2).burst(10).unwrap();
        assert_eq!(
            TokenBucket::full(&plain, 0).take(&plain, 0, 1, 10).granted,
            10
        );
    }

    #[test]
    fn a_full_cold_bucket_always_grants_the_minimum() {
        let l = Limit::per_second(2)
            .burst(2)
            .unwrap()
            .warm_up(Duration::from_secs(4))
            .unwrap();
        // Two permits at once cost 2.75 + 2.25 tokens: more than the bucket holds, so the
        // full bucket grants them and the refill pays the 3 tokens of debt (1.5 s), then 2 more.
        let mut b = TokenBucket::full(&l, 0);
        let taken = b.take(&l, 0, 2, 2);
        assert_eq!((taken.granted, b.owed()), (2, 3));
        assert_eq!(taken.refill_in_micros, 2_500_000);
        assert_eq!(b.take(&l, 2_500_000, 2, 2).granted, 2);
    }

    #[test]
    fn a_warm_up_never_admits_more_than_its_plain_limit() {
        let warm = Limit::per_second(7)
            .burst(5)
            .unwrap()
            .warm_up(Duration::from_millis(2_500))
            .unwrap();
        let plain = Limit::per_second(7).burst(5).unwrap();
        let (mut w, mut p) = (TokenBucket::full(&warm, 0), TokenBucket::full(&plain, 0));
        let (mut by_warm, mut by_plain, mut now) = (0, 0, 0u64);
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        for _ in 0..5_000 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            now += seed % 400_000;
            let (min, want) = (1 + seed % 3, 1 + seed % 5);
            by_warm += w.take(&warm, now, min, want).granted;
            by_plain += p.take(&plain, now, min, want).granted;
            // Never above the plain bucket's bound: capacity + rate x elapsed.
            assert!(by_warm <= 5 + now * 7 / 1_000_000, "{by_warm} at {now}");
        }
        assert!(by_warm < by_plain, "{by_warm} / {by_plain}");
    }

    #[test]
    fn a_bucket_carried_to_another_limit_keeps_its_tokens_and_its_share_of_a_token() {
        let plain = Limit::per_minute(30).burst(30).unwrap();
        let warm = plain.warm_up(Duration::from_secs(2)).unwrap();
        let raised = Limit::per_second(100).burst(60).unwrap();
        let mut b = TokenBucket::full(&plain, 0);
        b.take(&plain, 0, 1, 29);
        // A second and a half later: 1 token left, and three quarters of the next.
        let now = 1_500_000;
        let moved = b.carried(&plain, &raised, now);
        let p = i128::from(raised.period_micros());
        let share = |b: &TokenBucket, p: i128| i128::from(b.remainder) * 4 / p;
        assert_eq!((moved.tokens, share(&moved, p)), (1, 3), "{moved:?}");
        // Raised: refilled at the new rate from there, not held back by the old one.
        let mut later = moved;
        later.refill(&raised, now + 10_000);
        assert_eq!(later.tokens, 2);
        // Lowered below its level: at most the new capacity.
        let lowered = Limit::per_minute(6).burst(1).unwrap();
        let full = TokenBucket::full(&raised, 0).carried(&raised, &lowered, now);
        assert_eq!((full.tokens, full.remainder), (1, 0));
        // A debt is kept as a debt.
        let mut owing = TokenBucket::full(&plain, 0);
        owing.take(&plain, 0, 1, 30);
        assert_eq!(
            owing.take_or_reserve(&plain, 0, 1, 10, 30_000_000).reserved,
            10
        );
        assert_eq!(owing.carried(&plain, &raised, 0).tokens, -10);
        // A warm bucket's cold permits go only to a limit that stores them. Hosts asking
        // under either limit while a change spreads do not move the level.
        let mut cooling = TokenBucket::full(&warm, 0);
        cooling.take(&warm, 0, 1, 29);
        let warmed = cooling.carried(&warm, &raised, now);
        assert_eq!(warmed.cold, 0);
        let back = warmed.carried(&raised, &warm, now);
        assert_eq!(back.carried(&warm, &raised, now), warmed);
        let mut as_warm = cooling;
        as_warm.refill(&warm, now);
        assert_eq!(cooling.carried(&warm, &warm, now), as_warm);
    }
}

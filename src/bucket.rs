//! The lazy token bucket: pure arithmetic, no I/O, no clock.
//!
//! A bucket holds whole tokens plus a fraction of the next one, kept as an integer remainder
//! in units of `1 / period_micros` of a token, so refills are exact for every [`Limit`]:
//! `elapsed * amount / period` is split as `q * amount + (r * amount + remainder) / period`
//! with `r < period`, which never overflows and never rounds. The Redis store runs the same
//! steps in Lua; the shared conformance tests hold both to the same answers.

use std::time::Duration;

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
    pub fn refill(&mut self, limit: &Limit, now_micros: u64) {
        let elapsed = now_micros.saturating_sub(self.updated_micros);
        self.updated_micros = self.updated_micros.max(now_micros);
        let (tokens, remainder) = self.level_after(limit, elapsed);
        self.tokens = tokens;
        self.remainder = remainder;
    }

    /// The level `elapsed` microseconds after the last update: whole tokens and remainder.
    fn level_after(&self, limit: &Limit, elapsed: u64) -> (i64, u64) {
        let capacity = capacity(limit);
        if self.tokens >= capacity {
            return (capacity, 0);
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
    /// a time), and a refused host holds its share of the next tokens instead of polling.
    pub fn take_or_reserve(
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
        let there = self.tokens();
        let granted = if there >= min { want.min(there) } else { 0 };
        let horizon = self.micros_until(limit, 0).saturating_add(max_delay_micros);
        let due = want.min(self.whole_tokens_after(limit, horizon));
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

    /// Whole tokens (at least zero) the bucket holds `elapsed` microseconds after its update.
    fn whole_tokens_after(&self, limit: &Limit, elapsed: u64) -> u64 {
        u64::try_from(self.level_after(limit, elapsed).0).unwrap_or(0)
    }

    /// Refills to `now_micros`, then puts back `tokens` that were taken and not used, never past
    /// capacity.
    pub fn give_back(&mut self, limit: &Limit, now_micros: u64, tokens: u64) {
        self.refill(limit, now_micros);
        let tokens = i64::try_from(tokens.min(limit.capacity())).unwrap_or(i64::MAX);
        self.tokens = self.tokens.saturating_add(tokens).min(capacity(limit));
        if self.tokens == capacity(limit) {
            self.remainder = 0;
        }
    }

    /// Refills to `now_micros`, then applies `adjustment` (an operator's change): see
    /// [`Adjustment`].
    pub fn adjust(&mut self, limit: &Limit, now_micros: u64, adjustment: Adjustment) {
        self.refill(limit, now_micros);
        let capacity = capacity(limit);
        let amount = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        match adjustment {
            Adjustment::Reset => {
                self.tokens = capacity;
                self.remainder = 0;
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
    }

    /// Microseconds from the last update until the bucket holds `tokens` (capped at capacity),
    /// rounded up, and at most [`MAX_WAIT_MICROS`] (about 285 years).
    pub fn micros_until(&self, limit: &Limit, tokens: u64) -> u64 {
        let tokens = i128::from(tokens.min(limit.capacity()));
        let level = i128::from(self.tokens);
        if level >= tokens {
            return 0;
        }
        let (a, p) = (
            i128::from(limit.refill_amount()),
            i128::from(limit.period_micros()),
        );
        // Positive: tokens - level >= 1 and the remainder < p.
        let needed = (tokens - level) * p - i128::from(self.remainder);
        let micros = (needed + a - 1) / a;
        u64::try_from(micros).map_or(MAX_WAIT_MICROS, |m| m.min(MAX_WAIT_MICROS))
    }

    /// Whether the bucket is full at `now_micros`: then it is the same as no bucket at all, and a
    /// store may forget it.
    pub fn is_full_at(&self, limit: &Limit, now_micros: u64) -> bool {
        let since = now_micros.saturating_sub(self.updated_micros);
        since >= self.micros_until(limit, limit.capacity())
    }
}

/// When a bucket will be full if nothing more is taken: `micros` and `frac / amount` of a
/// microsecond, `amount` being the limit's refill amount (in lowest terms with its period).
///
/// Given its limit, this one instant is the whole state of a bucket, exactly: its level at
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
    /// to refill).
    pub fn full_at(&self, limit: &Limit) -> Option<FullAt> {
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
        }
    }
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
    /// are forgiven.
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
        b.adjust(&l, 2_000, Adjustment::Drain);
        assert_eq!((b.tokens(), b.owed(), b.micros_until(&l, 1)), (0, 0, 3_000));
        b.adjust(&l, 2_000, Adjustment::Add(3));
        assert_eq!(b.tokens(), 3);
        b.adjust(&l, 2_000, Adjustment::Add(100));
        assert_eq!((b.tokens(), b.is_full_at(&l, 2_000)), (4, true));
        // Into debt of at most a capacity, which the refill pays first.
        b.adjust(&l, 2_000, Adjustment::Remove(100));
        assert_eq!((b.tokens(), b.owed()), (0, 4));
        assert_eq!(b.micros_until(&l, 1), 15_000);
        b.adjust(&l, 2_000, Adjustment::Remove(1));
        assert_eq!(b.owed(), 4);
        // A drain keeps what is owed; a reset forgives it.
        b.adjust(&l, 5_000, Adjustment::Drain);
        assert_eq!((b.owed(), b.micros_until(&l, 0)), (3, 9_000));
        b.adjust(&l, 5_000, Adjustment::Reset);
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
        b.give_back(&l, 0, 5);
        assert_eq!(b.tokens(), 4);
        assert!(b.is_full_at(&l, 0));
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
}

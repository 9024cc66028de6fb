//! The lazy token bucket: pure arithmetic, no I/O, no clock.
//!
//! A bucket holds whole tokens plus a fraction of the next one, kept as an integer remainder
//! in units of `1 / period_micros` of a token, so refills are exact for every [`Limit`]:
//! `elapsed * amount / period` is split as `q * amount + (r * amount + remainder) / period`
//! with `r < period`, which never overflows and never rounds. The Redis store runs the same
//! steps in Lua; the shared conformance tests hold both to the same answers.

use crate::limit::Limit;

/// The longest wait a bucket reports: 2^53 microseconds, the largest integer every store
/// represents exactly.
pub const MAX_WAIT_MICROS: u64 = 1 << 53;

/// The state of one token bucket at one instant (`updated_micros`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenBucket {
    tokens: u64,
    /// Progress towards the next token, in `1 / limit.period_micros()` tokens.
    remainder: u64,
    updated_micros: u64,
}

/// What a [`TokenBucket::take`] dispensed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Taken {
    /// Tokens dispensed: between `min` and `want`, or zero.
    pub granted: u64,
    /// Whole tokens left in the bucket.
    pub remaining: u64,
    /// Microseconds until the bucket holds `min` tokens again (zero if it does now).
    pub refill_in_micros: u64,
}

impl TokenBucket {
    /// A full bucket, as every bucket starts.
    pub fn full(limit: &Limit, now_micros: u64) -> Self {
        Self {
            tokens: limit.capacity(),
            remainder: 0,
            updated_micros: now_micros,
        }
    }

    /// Whole tokens held (as of the last update).
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Brings the bucket up to `now_micros`: adds `amount` per `period`, never past capacity.
    /// A time earlier than the last update is treated as no time passing.
    pub fn refill(&mut self, limit: &Limit, now_micros: u64) {
        let elapsed = now_micros.saturating_sub(self.updated_micros);
        self.updated_micros = self.updated_micros.max(now_micros);
        if self.tokens >= limit.capacity() {
            self.tokens = limit.capacity();
            self.remainder = 0;
            return;
        }
        let (a, p) = (
            u128::from(limit.refill_amount()),
            u128::from(limit.period_micros()),
        );
        let elapsed = u128::from(elapsed);
        let (q, r) = (elapsed / p, elapsed % p);
        let sub = u128::from(self.remainder) + r * a;
        let added = q * a + sub / p;
        let tokens = u128::from(self.tokens) + added;
        if tokens >= u128::from(limit.capacity()) {
            self.tokens = limit.capacity();
            self.remainder = 0;
        } else {
            // Both fit: tokens < capacity <= u64::MAX and the remainder < p.
            self.tokens = tokens as u64;
            self.remainder = (sub % p) as u64;
        }
    }

    /// Refills to `now_micros`, then dispenses up to `want` tokens if at least `min` are there
    /// (`min` of zero is taken as one). Dispenses nothing otherwise.
    pub fn take(&mut self, limit: &Limit, now_micros: u64, min: u64, want: u64) -> Taken {
        self.refill(limit, now_micros);
        let min = min.max(1);
        let granted = if self.tokens >= min {
            want.max(min).min(self.tokens)
        } else {
            0
        };
        self.tokens -= granted;
        Taken {
            granted,
            remaining: self.tokens,
            refill_in_micros: self.micros_until(limit, min),
        }
    }

    /// Refills to `now_micros`, then puts back `tokens` that were taken and not used, never past
    /// capacity.
    pub fn give_back(&mut self, limit: &Limit, now_micros: u64, tokens: u64) {
        self.refill(limit, now_micros);
        self.tokens = self.tokens.saturating_add(tokens).min(limit.capacity());
        if self.tokens == limit.capacity() {
            self.remainder = 0;
        }
    }

    /// Microseconds from the last update until the bucket holds `tokens` (capped at capacity),
    /// rounded up, and at most [`MAX_WAIT_MICROS`] (about 285 years).
    pub fn micros_until(&self, limit: &Limit, tokens: u64) -> u64 {
        let tokens = tokens.min(limit.capacity());
        if self.tokens >= tokens {
            return 0;
        }
        let (a, p) = (
            u128::from(limit.refill_amount()),
            u128::from(limit.period_micros()),
        );
        let needed = u128::from(tokens - self.tokens) * p - u128::from(self.remainder);
        u64::try_from(needed.div_ceil(a)).map_or(MAX_WAIT_MICROS, |m| m.min(MAX_WAIT_MICROS))
    }

    /// Whether the bucket is full at `now_micros`: then it is the same as no bucket at all, and a
    /// store may forget it.
    pub fn is_full_at(&self, limit: &Limit, now_micros: u64) -> bool {
        let since = now_micros.saturating_sub(self.updated_micros);
        since >= self.micros_until(limit, limit.capacity())
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
    fn fractional_tokens_accumulate_exactly() {
        let l = tb();
        let mut b = TokenBucket::full(&l, 0);
        assert_eq!(b.take(&l, 0, 1, 3).granted, 3);
        b.refill(&l, 2_000);
        assert_eq!((b.tokens, b.remainder), (1, 2_000));
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

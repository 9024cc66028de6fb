//! Limits: a token bucket's capacity and refill rate.

use std::time::Duration;

use crate::error::ConfigError;

/// A token bucket's shape: it holds at most `capacity` tokens (the burst) and refills at
/// `amount` tokens per `period`, lazily, to the microsecond.
///
/// Built with a rate and a burst, and validated when built, so that an impossible limit is an
/// error at start-up and never a surprise at request time:
///
/// ```
/// use hierarchical_throttle::Limit;
/// use std::time::Duration;
///
/// let api = Limit::per_second(100).burst(200)?;
/// assert_eq!(api.capacity(), 200);
///
/// // One token every 3 ms, at most 4 at once.
/// let tb = Limit::per(1, Duration::from_millis(3)).burst(4)?;
/// assert_eq!(tb.time_to_accrue(1), Duration::from_millis(3));
///
/// assert!(Limit::per_second(0).burst(10).is_err());
/// assert!(Limit::per_second(10).burst(0).is_err());
/// # Ok::<(), hierarchical_throttle::ConfigError>(())
/// ```
///
/// The rate is kept as an exact fraction (`amount / period` in lowest terms), so refills never
/// drift, in memory and in Redis alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Limit {
    capacity: u64,
    /// Tokens added every `per_micros` microseconds, in lowest terms with it.
    amount: u64,
    per_micros: u64,
}

/// A refill rate waiting for its burst; see [`Limit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "call .burst(n) or .build() to make a Limit"]
pub struct LimitBuilder {
    amount: u64,
    period: Duration,
}

/// Largest integer that a 64-bit float (and so Redis's Lua) holds exactly: 2^53.
const EXACT: u128 = 1 << 53;

impl Limit {
    /// The largest capacity a limit may have (2^53 - 1): every store keeps tokens exactly.
    pub const MAX_CAPACITY: u64 = (1 << 53) - 1;
    /// The longest refill period a limit may have.
    pub const MAX_PERIOD: Duration = Duration::from_secs(366 * 24 * 3600);

    /// `amount` tokens per `period`.
    pub fn per(amount: u64, period: Duration) -> LimitBuilder {
        LimitBuilder { amount, period }
    }

    /// `amount` tokens per millisecond.
    pub fn per_millisecond(amount: u64) -> LimitBuilder {
        Self::per(amount, Duration::from_millis(1))
    }

    /// `amount` tokens per second.
    pub fn per_second(amount: u64) -> LimitBuilder {
        Self::per(amount, Duration::from_secs(1))
    }

    /// `amount` tokens per minute.
    pub fn per_minute(amount: u64) -> LimitBuilder {
        Self::per(amount, Duration::from_secs(60))
    }

    /// `amount` tokens per hour.
    pub fn per_hour(amount: u64) -> LimitBuilder {
        Self::per(amount, Duration::from_secs(3600))
    }

    /// `amount` tokens per day.
    pub fn per_day(amount: u64) -> LimitBuilder {
        Self::per(amount, Duration::from_secs(86_400))
    }

    /// The most tokens the bucket holds: the largest burst.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Tokens added per [`refill_period`](Self::refill_period), in lowest terms.
    pub fn refill_amount(&self) -> u64 {
        self.amount
    }

    /// The period over which [`refill_amount`](Self::refill_amount) tokens are added.
    pub fn refill_period(&self) -> Duration {
        Duration::from_micros(self.per_micros)
    }

    /// The period in whole microseconds, the stores' unit.
    pub(crate) fn period_micros(&self) -> u64 {
        self.per_micros
    }

    /// How long an empty bucket takes to accrue `tokens`, rounded up to the microsecond.
    pub fn time_to_accrue(&self, tokens: u64) -> Duration {
        let micros =
            (u128::from(tokens) * u128::from(self.per_micros)).div_ceil(u128::from(self.amount));
        Duration::from_micros(u64::try_from(micros).unwrap_or(u64::MAX))
    }

    /// This limit with capacity and rate divided by `parts` (rounded up, at least one token),
    /// for a host that enforces its share of a fleet-wide limit alone.
    pub(crate) fn share(&self, parts: u64) -> Limit {
        if parts <= 1 {
            return *self;
        }
        // Stretching the period divides the rate exactly and keeps it representable.
        let per_micros = self.per_micros.saturating_mul(parts);
        let (amount, per_micros) = lowest_terms(self.amount, per_micros);
        Limit {
            capacity: self.capacity.div_ceil(parts).max(1),
            amount,
            per_micros,
        }
    }
}

impl LimitBuilder {
    /// The limit with a capacity (largest burst) of `capacity` tokens.
    pub fn burst(self, capacity: u64) -> Result<Limit, ConfigError> {
        let LimitBuilder { amount, period } = self;
        if amount == 0 {
            return Err(ConfigError::ZeroRate);
        }
        if capacity == 0 {
            return Err(ConfigError::ZeroCapacity);
        }
        if capacity > Limit::MAX_CAPACITY {
            return Err(ConfigError::CapacityTooLarge(capacity));
        }
        let whole_micros = period.subsec_nanos() % 1_000 == 0;
        let micros = u64::try_from(period.as_micros()).unwrap_or(u64::MAX);
        if !whole_micros || micros == 0 || period > Limit::MAX_PERIOD {
            return Err(ConfigError::InvalidPeriod(period));
        }
        let (a, p) = lowest_terms(amount, micros);
        // The stores compute `remainder + r * a` (r, remainder < p) and round its quotient by p
        // with one correction step: every intermediate stays below p * (a + 2), kept exact.
        if u128::from(p) * (u128::from(a) + 2) >= EXACT {
            return Err(ConfigError::RateNotExact { amount, period });
        }
        Ok(Limit {
            capacity,
            amount: a,
            per_micros: p,
        })
    }

    /// The limit with a capacity equal to one period's refill.
    pub fn build(self) -> Result<Limit, ConfigError> {
        let amount = self.amount;
        self.burst(amount)
    }
}

fn lowest_terms(a: u64, b: u64) -> (u64, u64) {
    let g = gcd(a, b).max(1);
    (a / g, b / g)
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_kept_in_lowest_terms() {
        let l = Limit::per_second(1_000_000).burst(10).unwrap();
        assert_eq!(
            (l.refill_amount(), l.refill_period()),
            (1, Duration::from_micros(1))
        );
        let l = Limit::per_day(1_000_000_000).burst(1_000_000_000).unwrap();
        assert_eq!(
            l.refill_amount() * 86_400_000_000,
            1_000_000_000 * l.period_micros()
        );
    }

    #[test]
    fn invalid_limits_are_errors() {
        assert_eq!(Limit::per_second(0).burst(1), Err(ConfigError::ZeroRate));
        assert_eq!(
            Limit::per_second(1).burst(0),
            Err(ConfigError::ZeroCapacity)
        );
        assert_eq!(
            Limit::per(1, Duration::ZERO).burst(1),
            Err(ConfigError::InvalidPeriod(Duration::ZERO))
        );
        let sub_micro = Duration::from_nanos(1_500);
        assert_eq!(
            Limit::per(1, sub_micro).burst(1),
            Err(ConfigError::InvalidPeriod(sub_micro))
        );
        assert_eq!(
            Limit::per_second(1).burst(u64::MAX),
            Err(ConfigError::CapacityTooLarge(u64::MAX))
        );
        // A prime amount per day does not reduce: 999_999_937 * 86_400_000_000 > 2^53.
        assert!(matches!(
            Limit::per_day(999_999_937).burst(1),
            Err(ConfigError::RateNotExact { .. })
        ));
    }

    #[test]
    fn shares_divide_rate_and_capacity() {
        let l = Limit::per_second(100).burst(250).unwrap();
        let s = l.share(4);
        assert_eq!(s.capacity(), 63);
        assert_eq!(s.time_to_accrue(25), Duration::from_secs(1));
    }
}

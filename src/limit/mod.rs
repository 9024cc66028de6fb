//! Limits: a token bucket's capacity and refill rate.

use std::time::Duration;

use crate::arith::{mul_div, mul_div_ceil};
use crate::calendar::{Calendar, Period, Zone};
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
/// drift, in memory and in Redis alike. Two limits are equal when they refill alike and hold
/// alike, however they were written (`60/min` equals `1/s`); each prints in the period it was
/// written in.
#[derive(Debug, Clone, Copy)]
pub struct Limit {
    capacity: u64,
    /// Tokens added every `per_micros` microseconds, in lowest terms with it.
    amount: u64,
    per_micros: u64,
    /// The period as it was written (`60/min`: a minute), for printing it back and for
    /// `RateLimit-Policy`'s window; not part of the limit's identity.
    written_micros: u64,
    /// How long a cold bucket takes to reach its rate ([`warm_up`](Self::warm_up)); 0: none.
    warm_up_micros: u64,
    /// A calendar quota's resets ([`per_calendar`](Self::per_calendar)): its whole capacity
    /// comes back at each, nothing between; `amount / per_micros` is then only its nominal rate.
    calendar: Option<Calendar>,
}

impl PartialEq for Limit {
    fn eq(&self, other: &Self) -> bool {
        self.identity() == other.identity()
    }
}

impl Eq for Limit {}

impl std::hash::Hash for Limit {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.identity().hash(state);
    }
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

    /// The period the limit was written with (`100/min`: one minute; `Limit::per(5,
    /// 3 s)`: three seconds), and the tokens it adds over that period.
    pub fn written_rate(&self) -> (u64, Duration) {
        (
            self.written_amount(),
            Duration::from_micros(self.written_micros),
        )
    }

    /// Tokens per written period: exact, since the written period is a whole number of the
    /// reduced one.
    fn written_amount(&self) -> u64 {
        mul_div(self.amount, self.written_micros, self.per_micros)
    }

    /// How long an empty bucket takes to accrue `tokens`, rounded up to the microsecond.
    pub fn time_to_accrue(&self, tokens: u64) -> Duration {
        Duration::from_micros(mul_div_ceil(tokens, self.per_micros, self.amount))
    }

    /// How long an empty bucket takes to accrue the price of `permits` at its highest: three
    /// tokens each while a [warm-up](Self::warm_up) may price them cold, one otherwise.
    /// A calendar quota's: as many of its longest periods as the permits take resets.
    pub(crate) fn time_to_pay(&self, permits: u64) -> Duration {
        if let Some(calendar) = self.calendar {
            let resets = permits.div_ceil(self.capacity);
            return Duration::from_micros(calendar.longest_micros().saturating_mul(resets));
        }
        match self.warm_up_micros {
            0 => self.time_to_accrue(permits),
            _ => self.time_to_accrue(permits.saturating_mul(3)),
        }
    }

    /// Whole tokens an empty bucket accrues in `micros` microseconds (not capped at capacity).
    pub(crate) fn accrued_in(&self, micros: u64) -> u64 {
        mul_div(micros, self.amount, self.per_micros)
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
            written_micros: per_micros,
            // A host's share applies while the store is down, for a short while: at the rate.
            warm_up_micros: 0,
            calendar: self.calendar,
        }
    }

    /// What makes two limits the same: how they hold, refill and warm up.
    fn identity(&self) -> (u64, u64, u64, u64, Option<Calendar>) {
        (
            self.capacity,
            self.amount,
            self.per_micros,
            self.warm_up_micros,
            self.calendar,
        )
    }

    /// This limit, warming up over `period` as Guava's `SmoothWarmingUp` does: a bucket that
    /// has been idle (every bucket at first, and the whole fleet's after a restart of the
    /// store) starts at a third of its rate and reaches the rate after about `period` of use;
    /// idleness cools it down again at the rate it warms.
    ///
    /// The model, with `s` the time one token takes to refill: idle time beyond a full bucket
    /// stores *cold permits*, up to `period / s`. A request that takes a stored permit pays
    /// for it in tokens: 1 while at most half the cold permits are stored, rising linearly to 3
    /// when all are, averaged over the permits it takes; permits beyond those stored cost 1.
    /// A request is admitted when the bucket holds one token for each of its permits as they
    /// come (or when the bucket is full), and the surcharge is paid by the refill before the next
    /// one: a cold bucket admits a smaller burst, at a lower rate, and both grow as it is used.
    /// With a capacity of 1 this is Guava's limiter exactly: 2 per second warming up over 4 s,
    /// fully cold, spaces its first requests by 1.375, 1.125, 0.875 and 0.625 s, then by 0.5.
    ///
    /// ```
    /// use hierarchical_throttle::Limit;
    /// use std::time::Duration;
    ///
    /// let cold_start = Limit::per_second(2).burst(1)?.warm_up(Duration::from_secs(4))?;
    /// assert_eq!(cold_start.warm_up_period(), Some(Duration::from_secs(4)));
    /// assert_eq!(cold_start, "2/s burst 1 warm-up 4s".parse()?);
    /// # Ok::<(), hierarchical_throttle::ConfigError>(())
    /// ```
    ///
    /// Warming up is the global bucket's: hosts lease permits as for any limit, and a host's
    /// share of the limit while the store is down (its fallback) refills at the rate. The
    /// period must be a whole, positive number of microseconds whose cold permits the stores
    /// keep exactly (`period` times the rate below 2^52 in the stores' units, and three
    /// capacities of debt representable); an error says when it is not.
    pub fn warm_up(mut self, period: Duration) -> Result<Limit, ConfigError> {
        let invalid = ConfigError::InvalidSetting {
            setting: "Limit::warm_up",
            expected: "a whole number of microseconds, above zero, at most 366 days, whose \
                       cold permits and a debt of three capacities fit the stores' 53-bit \
                       integers",
        };
        if self.calendar.is_some() {
            return Err(ConfigError::InvalidSetting {
                setting: "Limit::warm_up",
                expected: "a limit that refills at a rate: a calendar quota does not warm up",
            });
        }
        let micros = whole_period_micros(period).ok_or(invalid.clone())?;
        let cold = u128::from(micros) * u128::from(self.amount);
        let debt = (u128::from(self.capacity) * 3 + 1) * u128::from(self.per_micros);
        if cold >= EXACT / 2 || debt >= EXACT {
            return Err(invalid);
        }
        self.warm_up_micros = micros;
        Ok(self)
    }

    /// The period over which a cold bucket reaches its rate; `None` when it starts at the rate.
    pub fn warm_up_period(&self) -> Option<Duration> {
        (self.warm_up_micros > 0).then(|| Duration::from_micros(self.warm_up_micros))
    }

    /// The most cold permits a bucket stores, in `1 / period_micros` tokens (0 without a warm-up).
    pub(crate) fn cold_max(&self) -> u64 {
        self.warm_up_micros * self.amount
    }

    /// The warm-up period in microseconds (0 without one).
    pub(crate) fn warm_up_micros(&self) -> u64 {
        self.warm_up_micros
    }

    /// `amount` per calendar `period`, the whole of it again at each reset (midnight UTC
    /// unless [told otherwise](CalendarQuota::resetting_at)), nothing between: 100,000 requests
    /// a calendar day, a million a month.
    ///
    /// ```
    /// use hierarchical_throttle::{Limit, calendar::Period};
    ///
    /// let daily = Limit::per_calendar(100_000, Period::Day).build()?;
    /// assert_eq!(daily, "100000 per day at 00:00 UTC".parse()?);
    /// let monthly = Limit::per_calendar(1_000_000, Period::Month)
    ///     .resetting_at(9, 0)
    ///     .utc_offset_minutes(120)
    ///     .build()?;
    /// assert_eq!(monthly.to_string(), "1000000 per month at 09:00 UTC+02:00");
    /// # Ok::<(), hierarchical_throttle::ConfigError>(())
    /// ```
    ///
    /// With the `tz` feature, the reset time may be in a zone of the time-zone database,
    /// daylight saving time included (`CalendarQuota::time_zone`,
    /// `"100000 per day at 00:00 Europe/Paris"`).
    ///
    /// The global store's clock decides when a window ends (Redis's `TIME`, or the memory
    /// store's clock placed on Unix time by [`Clock::unix_origin`](crate::clock::Clock::unix_origin)).
    /// Hosts lease its tokens like any limit's, and hand back or drop what they hold shortly
    /// before each reset, so that no token of one window is spent in the next.
    pub fn per_calendar(amount: u64, period: Period) -> CalendarQuota {
        CalendarQuota {
            amount,
            period,
            at: (0, 0),
            zone: Ok(Zone::Fixed(0)),
        }
    }

    /// When a calendar quota resets; `None` for a limit that refills at a rate.
    pub fn calendar(&self) -> Option<Calendar> {
        self.calendar
    }

    /// When a call made at `unix_micros` about this limit's bucket stops counting (as Unix
    /// time): a calendar quota's next reset, since its tokens and changes belong to the window
    /// they were made in; never (`None`) for a rate.
    pub(crate) fn window_expiry(&self, unix_micros: u64) -> Option<Duration> {
        let reset = self.calendar?.reset_after(unix_micros, 1);
        Some(Duration::from_micros(reset))
    }

    /// Tokens the global bucket of this limit gains from `from` to `to` (Unix microseconds)
    /// if nothing is taken, not capped at its capacity: the rate's, or a capacity per reset.
    pub(crate) fn accrued_between(&self, from: u64, to: u64) -> u64 {
        match self.calendar {
            None => self.accrued_in(to.saturating_sub(from)),
            Some(calendar) => calendar
                .resets_between(from, to)
                .saturating_mul(self.capacity),
        }
    }

    /// Microseconds from `now` (Unix) until an empty bucket of this limit holds `tokens`.
    pub(crate) fn micros_to_accrue(&self, now: u64, tokens: u64) -> u64 {
        match self.calendar {
            None => crate::clock::micros(self.time_to_accrue(tokens)),
            Some(_) if tokens == 0 => 0,
            Some(calendar) => {
                let resets = tokens.div_ceil(self.capacity);
                calendar.reset_after(now, resets).saturating_sub(now)
            }
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
        let micros = whole_period_micros(period).ok_or(ConfigError::InvalidPeriod(period))?;
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
            written_micros: micros,
            warm_up_micros: 0,
            calendar: None,
        })
    }

    /// The limit with a capacity equal to one period's refill.
    pub fn build(self) -> Result<Limit, ConfigError> {
        let amount = self.amount;
        self.burst(amount)
    }
}

/// A calendar quota waiting to be built; see [`Limit::per_calendar`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "call .build() to make a Limit"]
pub struct CalendarQuota {
    amount: u64,
    period: Period,
    at: (u8, u8),
    /// The zone chosen, or why the one asked for cannot be (told at build).
    zone: Result<Zone, ConfigError>,
}

impl CalendarQuota {
    /// Resets at `hour:minute` (24-hour clock) instead of midnight.
    pub fn resetting_at(mut self, hour: u8, minute: u8) -> Self {
        self.at = (hour, minute);
        self
    }

    /// The reset time is `minutes` east of UTC (UTC+02:00: 120; UTC-05:00: -300), a fixed
    /// offset (no daylight saving time) of at most 14 hours either way.
    pub fn utc_offset_minutes(mut self, minutes: i16) -> Self {
        self.zone = Zone::fixed(minutes).ok_or(ConfigError::InvalidSetting {
            setting: "CalendarQuota::utc_offset_minutes",
            expected: "an offset of at most 14 hours from UTC, in minutes",
        });
        self
    }

    /// The reset time is in `name`, a zone of the IANA time-zone database (`Europe/Paris`,
    /// `America/New_York`), daylight saving time included: a day at 00:00 in Paris is 23
    /// hours long in March and 25 in October. A reset time the clocks skip (02:30 on the
    /// day they go from 02:00 to 03:00) comes the gap's length later (03:30); one they
    /// repeat comes the first time. The database is bundled into the build, so every host
    /// of a fleet running the same build reads the same rules. `UTC` and offsets written as
    /// `UTC+02:00` are read as [fixed offsets](Self::utc_offset_minutes), as in text.
    #[cfg(feature = "tz")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tz")))]
    pub fn time_zone(mut self, name: &str) -> Self {
        self.zone = text::zone_of(name);
        self
    }

    /// The limit: an error when the amount is zero or above [`Limit::MAX_CAPACITY`], the
    /// time of day or the offset is out of range, or the time zone is unknown.
    pub fn build(self) -> Result<Limit, ConfigError> {
        let (hour, minute) = self.at;
        let calendar = Calendar::new(self.period, hour, minute, self.zone?).ok_or(
            ConfigError::InvalidSetting {
                setting: "CalendarQuota::resetting_at",
                expected: "a time of day from 00:00 to 23:59",
            },
        )?;
        match self.amount {
            0 => return Err(ConfigError::ZeroCapacity),
            amount if amount > Limit::MAX_CAPACITY => {
                return Err(ConfigError::CapacityTooLarge(amount));
            }
            _ => {}
        }
        // The nominal rate (the amount over the period's usual length) only sizes estimates.
        let nominal = calendar.nominal_micros();
        let (amount, per_micros) = lowest_terms(self.amount, nominal);
        Ok(Limit {
            capacity: self.amount,
            amount,
            per_micros,
            written_micros: nominal,
            warm_up_micros: 0,
            calendar: Some(calendar),
        })
    }
}

/// `period` in microseconds, when it is a whole, positive number of them, at most
/// [`Limit::MAX_PERIOD`].
fn whole_period_micros(period: Duration) -> Option<u64> {
    let whole = period.subsec_nanos().is_multiple_of(1_000);
    let micros = u64::try_from(period.as_micros()).ok()?;
    (whole && micros > 0 && period <= Limit::MAX_PERIOD).then_some(micros)
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

mod text;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_zone_outside_the_database_is_an_error_naming_it() {
        let error = "10 per day at 00:00 Europe/Atlantis".parse::<Limit>();
        assert!(matches!(
            error,
            Err(ConfigError::Unreadable { ref part, .. }) if part == "Europe/Atlantis"
        ));
        // A slash in the zone's name is not the rate's.
        let error = "10/day at 00:00 Europe/Atlantis".parse::<Limit>();
        assert!(matches!(
            error,
            Err(ConfigError::Unreadable { ref part, .. }) if part == "Europe/Atlantis"
        ));
        let error = Limit::per_calendar(10, Period::Day)
            .utc_offset_minutes(15 * 60)
            .build();
        assert!(matches!(
            error,
            Err(ConfigError::InvalidSetting {
                setting: "CalendarQuota::utc_offset_minutes",
                ..
            })
        ));
    }

    #[cfg(not(feature = "tz"))]
    #[test]
    fn a_zone_needs_the_tz_feature() {
        let error = "10 per day at 00:00 Europe/Paris"
            .parse::<Limit>()
            .unwrap_err();
        assert!(error.to_string().contains("`tz` feature"), "{error}");
    }

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
    fn limits_read_as_people_write_them_and_print_back() {
        let cases = [
            ("100/s", Limit::per_second(100).build(), "100/s"),
            (
                "100/s burst 200",
                Limit::per_second(100).burst(200),
                "100/s burst 200",
            ),
            ("5000/h", Limit::per_hour(5000).build(), "5000/h"),
            ("100000/day", Limit::per_day(100_000).build(), "100000/day"),
            (
                "100,000 / day",
                Limit::per_day(100_000).build(),
                "100000/day",
            ),
            (
                "15 per 2min",
                Limit::per(15, Duration::from_secs(120)).build(),
                "15 per 2min",
            ),
            (
                "1 per 2 minutes burst 15",
                Limit::per(1, Duration::from_secs(120)).burst(15),
                "1 per 2min burst 15",
            ),
            (
                "3 per 7ms",
                Limit::per(3, Duration::from_millis(7)).build(),
                "3 per 7ms",
            ),
            (
                "1 per 3ms",
                Limit::per(1, Duration::from_millis(3)).build(),
                "1 per 3ms",
            ),
            ("60/min", Limit::per_minute(60).build(), "60/min"),
            (
                "100/10s",
                Limit::per(100, Duration::from_secs(10)).build(),
                "100 per 10s",
            ),
            (
                "1 per 90s",
                Limit::per(1, Duration::from_secs(90)).build(),
                "1 per 90s",
            ),
        ];
        for (text, expected, printed) in cases {
            let limit: Limit = text.parse().unwrap();
            assert_eq!(
                limit.to_string(),
                expected.clone().unwrap().to_string(),
                "{text}"
            );
            assert_eq!(Ok(limit), expected, "{text}");
            assert_eq!(limit.to_string(), printed, "{text}");
            assert_eq!(printed.parse::<Limit>(), Ok(limit), "{printed}");
        }
    }

    /// Equal limits written in other units stay equal (and hash alike), each printing as it
    /// was written.
    #[test]
    fn the_written_unit_is_kept_for_printing_only() {
        use std::hash::BuildHasher;
        let per_minute: Limit = "60/min".parse().unwrap();
        let per_second: Limit = "1/s burst 60".parse().unwrap();
        assert_eq!(per_minute, per_second);
        let hasher = std::collections::hash_map::RandomState::new();
        assert_eq!(hasher.hash_one(per_minute), hasher.hash_one(per_second));
        assert_eq!(per_minute.to_string(), "60/min");
        assert_eq!(per_second.to_string(), "1/s burst 60");
        assert_eq!(per_minute.written_rate(), (60, Duration::from_secs(60)));
        assert_eq!(
            Limit::per(1, Duration::from_millis(3))
                .build()
                .unwrap()
                .written_rate(),
            (1, Duration::from_millis(3))
        );
    }

    #[test]
    fn unreadable_limits_name_the_part() {
        let part = |text: &str| match text.parse::<Limit>() {
            Err(ConfigError::Unreadable { part, .. }) => part,
            other => panic!("{text}: {other:?}"),
        };
        assert_eq!(part("100/fortnight"), "fortnight");
        assert_eq!(part("lots/s"), "lots");
        assert_eq!(part("100/s burst many"), "many");
        assert_eq!(part("100 every s"), "100 every s");
        assert_eq!("0/s".parse::<Limit>(), Err(ConfigError::ZeroRate));
        // Separators only between digits; a zero period never reads as another one.
        assert_eq!(part("100/_s"), "_");
        assert_eq!(part("1__0/s"), "1__0");
        assert_eq!(part("1_/s"), "1_");
        assert_eq!(part(",5/s"), ",5");
        assert_eq!(part("1/0s"), "0s");
        assert_eq!(part("1 per 0 min"), "0 min");
        assert_eq!(part("100/s burst 1__0"), "1__0");
    }

    #[test]
    fn a_count_before_the_unit_is_part_of_the_period() {
        let cases = [
            ("100/10s", Limit::per(100, Duration::from_secs(10)).build()),
            ("100/1s", Limit::per_second(100).build()),
            ("5/2min", Limit::per(5, Duration::from_secs(120)).build()),
            (
                "1000/15min burst 50",
                Limit::per(1000, Duration::from_secs(900)).burst(50),
            ),
            (
                "100/ 10 s",
                Limit::per(100, Duration::from_secs(10)).build(),
            ),
            (
                "100 per 10s",
                Limit::per(100, Duration::from_secs(10)).build(),
            ),
        ];
        for (text, expected) in cases {
            assert_eq!(text.parse::<Limit>(), expected, "{text}");
        }
    }

    #[test]
    fn shares_divide_rate_and_capacity() {
        let l = Limit::per_second(100).burst(250).unwrap();
        let s = l.share(4);
        assert_eq!(s.capacity(), 63);
        assert_eq!(s.time_to_accrue(25), Duration::from_secs(1));
    }

    #[test]
    fn a_warm_up_is_built_read_printed_and_part_of_the_identity() {
        let plain = Limit::per_second(2).burst(1).unwrap();
        let warm = plain.warm_up(Duration::from_secs(4)).unwrap();
        assert_ne!(warm, plain);
        assert_eq!(warm.warm_up_period(), Some(Duration::from_secs(4)));
        assert_eq!(plain.warm_up_period(), None);
        assert_eq!(warm.to_string(), "2/s burst 1 warm-up 4s");
        for text in [
            "2/s burst 1 warm-up 4s",
            "2/s burst 1 warm up 4 s",
            " 2/s burst 1 warm-up 4000ms ",
        ] {
            assert_eq!(text.parse::<Limit>(), Ok(warm), "{text}");
        }
        let minute: Limit = "100/min warm-up 90s".parse().unwrap();
        assert_eq!(minute.to_string(), "100/min warm-up 90s");
        assert_eq!(minute.to_string().parse::<Limit>(), Ok(minute));
        // The share a host falls back to refills at the rate.
        assert_eq!(warm.share(2).warm_up_period(), None);
    }

    #[test]
    fn an_impossible_warm_up_is_an_error() {
        let plain = Limit::per_second(2).burst(1).unwrap();
        for period in [
            Duration::ZERO,
            Duration::from_nanos(1_500),
            Duration::from_secs(367 * 86_400),
        ] {
            assert!(plain.warm_up(period).is_err(), "{period:?}");
        }
        // Cold permits past 2^52 in the stores' units: a thousand per microsecond for a year.
        let fast = Limit::per_millisecond(1_000_000).burst(10).unwrap();
        assert!(fast.warm_up(Duration::from_secs(366 * 86_400)).is_err());
        assert!(fast.warm_up(Duration::from_secs(86_400)).is_ok());
        // Three capacities of debt past 2^53 units.
        let huge = Limit::per_day(1).burst(Limit::MAX_CAPACITY).unwrap();
        assert!(huge.warm_up(Duration::from_secs(1)).is_err());
        let error = "2/s warm-up fortnight".parse::<Limit>().unwrap_err();
        assert!(error.to_string().contains("fortnight"), "{error}");
    }
}

//! Calendar periods: where a calendar quota's windows begin and end, in Unix time.
//!
//! A [calendar quota](crate::Limit::per_calendar) gives its whole allowance again at every
//! reset: each day, week (from Monday) or month (from the 1st) at a time of day in UTC or at
//! a fixed offset from it. Pure arithmetic on Unix microseconds, in the proleptic Gregorian
//! calendar (leap years included, leap seconds not: Unix time has none).

use std::time::Duration;

/// How often a calendar quota resets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Period {
    /// Every day.
    Day,
    /// Every week, on Mondays (ISO 8601 weeks).
    Week,
    /// Every month, on the 1st.
    Month,
}

/// When a calendar quota resets: its period, the time of day, and the offset from UTC that
/// time is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Calendar {
    period: Period,
    /// Minutes after midnight, local time.
    at_minutes: u16,
    /// Minutes east of UTC.
    offset_minutes: i16,
}

const MINUTE: i64 = 60_000_000;
const DAY: i64 = 24 * 60 * MINUTE;
const WEEK: i64 = 7 * DAY;
/// 1970-01-05, the first Monday of Unix time, in days.
const FIRST_MONDAY: i64 = 4;
/// The widest offset from UTC in use (UTC+14:00, UTC-12:00 the other way), in minutes.
const MAX_OFFSET_MINUTES: i16 = 14 * 60;

impl Calendar {
    /// Resets every `period` at `hour:minute`, `offset_minutes` east of UTC; `None` when the
    /// time of day or the offset is out of range.
    pub(crate) fn new(period: Period, hour: u8, minute: u8, offset_minutes: i16) -> Option<Self> {
        let valid = hour < 24 && minute < 60 && offset_minutes.abs() <= MAX_OFFSET_MINUTES;
        valid.then_some(Self {
            period,
            at_minutes: u16::from(hour) * 60 + u16::from(minute),
            offset_minutes,
        })
    }

    /// How often it resets.
    pub fn period(&self) -> Period {
        self.period
    }

    /// The local time of day it resets at: `(hour, minute)`.
    pub fn resets_at(&self) -> (u8, u8) {
        ((self.at_minutes / 60) as u8, (self.at_minutes % 60) as u8)
    }

    /// The offset from UTC of the time it resets at, in minutes east (UTC+02:00: 120).
    pub fn utc_offset_minutes(&self) -> i16 {
        self.offset_minutes
    }

    /// The first reset after `unix_time` (a time since 1970-01-01 00:00 UTC), as one.
    ///
    /// ```
    /// use hierarchical_throttle::{Limit, calendar::Period};
    /// use std::time::Duration;
    ///
    /// let monthly = Limit::per_calendar(1_000, Period::Month).build()?;
    /// let calendar = monthly.calendar().unwrap();
    /// // 2024-02-10 12:00 UTC: the quota resets on 2024-03-01 00:00 UTC.
    /// let reset = calendar.next_reset(Duration::from_secs(1_707_566_400));
    /// assert_eq!(reset, Duration::from_secs(1_709_251_200));
    /// # Ok::<(), hierarchical_throttle::ConfigError>(())
    /// ```
    pub fn next_reset(&self, unix_time: Duration) -> Duration {
        let micros = u64::try_from(unix_time.as_micros()).unwrap_or(u64::MAX);
        Duration::from_micros(self.reset_after(micros, 1))
    }

    /// The reset's distance from midnight UTC, in microseconds.
    pub(crate) fn shift_micros(&self) -> i64 {
        (i64::from(self.at_minutes) - i64::from(self.offset_minutes)) * MINUTE
    }

    /// The period as the stores' scripts number it (1 day, 2 week, 3 month).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn code(&self) -> u8 {
        match self.period {
            Period::Day => 1,
            Period::Week => 2,
            Period::Month => 3,
        }
    }

    /// The period's nominal length in microseconds (a month: 30 days), for estimates only.
    pub(crate) fn nominal_micros(&self) -> u64 {
        let length = match self.period {
            Period::Day => DAY,
            Period::Week => WEEK,
            Period::Month => 30 * DAY,
        };
        length as u64
    }

    /// The period's longest length in microseconds (a month: 31 days).
    pub(crate) fn longest_micros(&self) -> u64 {
        let length = match self.period {
            Period::Day => DAY,
            Period::Week => WEEK,
            Period::Month => 31 * DAY,
        };
        length as u64
    }

    /// The number of the window holding `unix_micros`.
    pub(crate) fn window(&self, unix_micros: u64) -> i64 {
        let local = i64::try_from(unix_micros).unwrap_or(i64::MAX) - self.shift_micros();
        match self.period {
            Period::Day => local.div_euclid(DAY),
            Period::Week => (local - FIRST_MONDAY * DAY).div_euclid(WEEK),
            Period::Month => {
                let (year, month) = civil_from_days(local.div_euclid(DAY));
                year * 12 + i64::from(month) - 1
            }
        }
    }

    /// When window `window` begins, in Unix microseconds (0 before 1970).
    pub(crate) fn start(&self, window: i64) -> u64 {
        let local = match self.period {
            Period::Day => window.saturating_mul(DAY),
            Period::Week => window
                .saturating_mul(WEEK)
                .saturating_add(FIRST_MONDAY * DAY),
            Period::Month => {
                let month = u32::try_from(window.rem_euclid(12)).unwrap_or(0) + 1;
                days_from_civil(window.div_euclid(12), month, 1).saturating_mul(DAY)
            }
        };
        u64::try_from(local.saturating_add(self.shift_micros())).unwrap_or(0)
    }

    /// Resets from `from` (exclusive) to `to` (inclusive).
    pub(crate) fn resets_between(&self, from: u64, to: u64) -> u64 {
        u64::try_from(self.window(to) - self.window(from)).unwrap_or(0)
    }

    /// The `nth` reset after `unix_micros` (the next one for 1).
    pub(crate) fn reset_after(&self, unix_micros: u64, nth: u64) -> u64 {
        let nth = i64::try_from(nth).unwrap_or(i64::MAX);
        self.start(self.window(unix_micros).saturating_add(nth))
    }
}

impl std::fmt::Display for Calendar {
    /// `at 00:00 UTC`, `at 09:30 UTC+02:00`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (hour, minute) = self.resets_at();
        write!(f, "at {hour:02}:{minute:02} UTC")?;
        if self.offset_minutes != 0 {
            let sign = if self.offset_minutes < 0 { '-' } else { '+' };
            let offset = self.offset_minutes.unsigned_abs();
            write!(f, "{sign}{:02}:{:02}", offset / 60, offset % 60)?;
        }
        Ok(())
    }
}

/// Days from 1970-01-01 to the civil date `year-month-day` (H. Hinnant's algorithm).
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let month_from_march = i64::from((month + 9) % 12);
    let day_of_year = (153 * month_from_march + 2) / 5 + i64::from(day) - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

/// The civil year and month (1 to 12) of the day `days` after 1970-01-01.
fn civil_from_days(days: i64) -> (i64, u32) {
    let days = days + 719_468;
    let era = days.div_euclid(146_097);
    let day_of_era = days - era * 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1_460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let month = if month_from_march < 10 {
        month_from_march + 3
    } else {
        month_from_march - 9
    };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Unix microseconds of `year-month-day hour:minute` UTC.
    fn utc(year: i64, month: u32, day: u32, hour: i64, minute: i64) -> u64 {
        let days = days_from_civil(year, month, day);
        (days * DAY + hour * 60 * MINUTE + minute * MINUTE) as u64
    }

    #[test]
    fn civil_dates_round_trip_across_leap_years_and_centuries() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        assert_eq!(
            days_from_civil(2024, 2, 29) + 1,
            days_from_civil(2024, 3, 1)
        );
        assert_eq!(
            days_from_civil(2023, 2, 28) + 1,
            days_from_civil(2023, 3, 1)
        );
        assert_eq!(
            days_from_civil(2100, 2, 28) + 1,
            days_from_civil(2100, 3, 1)
        );
        for days in -800_000..800_000 {
            let (year, month) = civil_from_days(days);
            let first = days_from_civil(year, month, 1);
            assert!((0..31).contains(&(days - first)), "{days}: {year}-{month}");
        }
    }

    #[test]
    fn a_day_resets_at_its_time_of_day_in_its_offset() {
        let midnight = Calendar::new(Period::Day, 0, 0, 0).unwrap();
        let before = utc(2024, 2, 28, 23, 59) + 59_500_000;
        assert_eq!(midnight.reset_after(before, 1), utc(2024, 2, 29, 0, 0));
        assert_eq!(
            midnight.reset_after(utc(2024, 2, 29, 0, 0), 1),
            utc(2024, 3, 1, 0, 0)
        );
        assert_eq!(midnight.resets_between(before, utc(2024, 2, 29, 0, 0)), 1);
        assert_eq!(
            midnight.resets_between(before, utc(2024, 2, 29, 0, 0) - 1),
            0
        );
        // 09:30 at UTC+02:00 is 07:30 UTC; at UTC-05:00, 14:30 UTC.
        let east = Calendar::new(Period::Day, 9, 30, 120).unwrap();
        assert_eq!(
            east.reset_after(utc(2024, 6, 1, 8, 0), 1),
            utc(2024, 6, 2, 7, 30)
        );
        assert_eq!(
            east.reset_after(utc(2024, 6, 1, 7, 0), 1),
            utc(2024, 6, 1, 7, 30)
        );
        let west = Calendar::new(Period::Day, 9, 30, -300).unwrap();
        assert_eq!(
            west.reset_after(utc(2024, 6, 1, 8, 0), 1),
            utc(2024, 6, 1, 14, 30)
        );
        assert_eq!(east.to_string(), "at 09:30 UTC+02:00");
        assert_eq!(west.to_string(), "at 09:30 UTC-05:00");
        assert!(Calendar::new(Period::Day, 24, 0, 0).is_none());
        assert!(Calendar::new(Period::Day, 0, 60, 0).is_none());
        assert!(Calendar::new(Period::Day, 0, 0, 15 * 60).is_none());
    }

    #[test]
    fn a_week_resets_on_mondays() {
        let week = Calendar::new(Period::Week, 0, 0, 0).unwrap();
        // 2024-11-25 is a Monday; 1970-01-01 was a Thursday.
        let thursday = utc(2024, 11, 28, 12, 0);
        assert_eq!(week.reset_after(thursday, 1), utc(2024, 12, 2, 0, 0));
        assert_eq!(week.start(week.window(thursday)), utc(2024, 11, 25, 0, 0));
        assert_eq!(week.reset_after(0, 1), utc(1970, 1, 5, 0, 0));
        assert_eq!(
            week.reset_after(thursday, 2) - week.reset_after(thursday, 1),
            WEEK as u64
        );
    }

    #[test]
    fn a_month_resets_on_the_first_whatever_its_length() {
        let month = Calendar::new(Period::Month, 0, 0, 0).unwrap();
        let lengths = [
            ((2024, 1), 31),
            ((2024, 2), 29),
            ((2023, 2), 28),
            ((2024, 4), 30),
            ((2024, 12), 31),
        ];
        for ((year, m), days) in lengths {
            let first = utc(year, m, 1, 0, 0);
            let next = month.reset_after(first, 1);
            assert_eq!((next - first) / DAY as u64, days, "{year}-{m}");
            assert_eq!(month.reset_after(next - 1, 1), next);
            assert_eq!(month.resets_between(first, next), 1);
        }
        // Across the year, and with an offset: the 1st at 00:00 UTC+01:00 is 23:00 UTC the
        // day before.
        assert_eq!(
            month.reset_after(utc(2024, 12, 15, 0, 0), 1),
            utc(2025, 1, 1, 0, 0)
        );
        let paris = Calendar::new(Period::Month, 0, 0, 60).unwrap();
        assert_eq!(
            paris.reset_after(utc(2024, 2, 29, 22, 0), 1),
            utc(2024, 2, 29, 23, 0)
        );
        assert_eq!(
            paris.reset_after(utc(2024, 2, 29, 23, 0), 1),
            utc(2024, 3, 31, 23, 0)
        );
    }
}

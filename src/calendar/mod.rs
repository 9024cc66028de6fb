//! Calendar periods: where a calendar quota's windows begin and end, in Unix time.
//!
//! A [calendar quota](crate::Limit::per_calendar) gives its whole allowance again at every
//! reset: each day, week (from Monday) or month (from the 1st) at a time of day in UTC, at
//! a fixed offset from it, or (feature `tz`) in a zone of the time-zone database, daylight
//! saving time included. Pure arithmetic on Unix microseconds, in the proleptic Gregorian
//! calendar (leap years included, leap seconds not: Unix time has none).

mod zone;

use std::time::Duration;

#[cfg(feature = "tz")]
pub(crate) use zone::NamedZone;
pub(crate) use zone::Zone;

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

/// When a calendar quota resets: its period, the time of day, and the time zone (or offset
/// from UTC) that time is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Calendar {
    period: Period,
    /// Minutes after midnight, local time.
    at_minutes: u16,
    zone: Zone,
}

const MINUTE: i64 = 60_000_000;
const DAY: i64 = 24 * 60 * MINUTE;
const WEEK: i64 = 7 * DAY;
/// 1970-01-05, the first Monday of Unix time, in days.
const FIRST_MONDAY: i64 = 4;
/// The largest change of a zone's offset its windows allow for: an hour today (half an hour
/// at Lord Howe Island), two in the database's past.
const LONGEST_CHANGE: i64 = 2 * 60 * MINUTE;

impl Calendar {
    /// Resets every `period` at `hour:minute` in `zone`; `None` when the time of day is out
    /// of range.
    pub(crate) fn new(period: Period, hour: u8, minute: u8, zone: Zone) -> Option<Self> {
        (hour < 24 && minute < 60).then_some(Self {
            period,
            at_minutes: u16::from(hour) * 60 + u16::from(minute),
            zone,
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

    /// The fixed offset from UTC of the time it resets at, in minutes east (UTC+02:00: 120);
    /// `None` for a calendar in a time zone (feature `tz`).
    pub fn utc_offset_minutes(&self) -> Option<i16> {
        match self.zone {
            Zone::Fixed(minutes) => Some(minutes),
            #[cfg(feature = "tz")]
            Zone::Named(_) => None,
        }
    }

    /// The zone of the time-zone database the time it resets at is in (`Europe/Paris`);
    /// `None` for a fixed offset.
    #[cfg(feature = "tz")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tz")))]
    pub fn time_zone(&self) -> Option<&'static str> {
        match self.zone {
            Zone::Fixed(_) => None,
            Zone::Named(zone) => Some(zone.name()),
        }
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

    /// The time of day it resets at, in microseconds after local midnight.
    fn at_micros(&self) -> i64 {
        i64::from(self.at_minutes) * MINUTE
    }

    /// What the stores' scripts need of the zone for a call made now (`now`: the host's
    /// Unix microseconds, read only for a zone whose offset changes; the store's clock may
    /// differ by a second): the resets' distance from midnight UTC in microseconds, and for
    /// such a zone `before,change,after`: that distance before the change nearest to now, the
    /// change, and after it.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn script_shift(&self, now: impl FnOnce() -> u64) -> String {
        let at = self.at_micros();
        if self.zone.is_fixed() {
            // One offset everywhere: the time asked at does not matter.
            return (at - self.zone.offsets_near(0).before).to_string();
        }
        let offsets = self
            .zone
            .offsets_near(i64::try_from(now()).unwrap_or(i64::MAX));
        format!(
            "{},{},{}",
            at - offsets.before,
            offsets.change,
            at - offsets.after
        )
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

    /// The period's longest length in microseconds (a month: 31 days; in a zone whose offset
    /// changes, that and the longest change).
    pub(crate) fn longest_micros(&self) -> u64 {
        let length = match self.period {
            Period::Day => DAY,
            Period::Week => WEEK,
            Period::Month => 31 * DAY,
        };
        let change = if self.zone.is_fixed() {
            0
        } else {
            LONGEST_CHANGE
        };
        (length + change) as u64
    }

    /// The number of the window holding `unix_micros`: the one whose start is the latest at
    /// or before it.
    pub(crate) fn window(&self, unix_micros: u64) -> i64 {
        let utc = i64::try_from(unix_micros).unwrap_or(i64::MAX);
        let offset = self.zone.offsets_near(utc).at(utc);
        let guess = self.window_of_local(utc.saturating_add(offset) - self.at_micros());
        if self.zone.is_fixed() {
            return guess;
        }
        // A reset in an hour the clocks repeat or skip puts the local date one window off.
        if self.start(guess + 1) <= unix_micros {
            guess + 1
        } else if self.start(guess) > unix_micros {
            guess - 1
        } else {
            guess
        }
    }

    /// The window a local time (microseconds as if UTC, less the reset's time of day) is in.
    fn window_of_local(&self, local: i64) -> i64 {
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
        let midnight = match self.period {
            Period::Day => window.saturating_mul(DAY),
            Period::Week => window
                .saturating_mul(WEEK)
                .saturating_add(FIRST_MONDAY * DAY),
            Period::Month => {
                let month = u32::try_from(window.rem_euclid(12)).unwrap_or(0) + 1;
                days_from_civil(window.div_euclid(12), month, 1).saturating_mul(DAY)
            }
        };
        let local = midnight.saturating_add(self.at_micros());
        let utc = self.zone.offsets_near(local).instant_of(local);
        u64::try_from(utc).unwrap_or(0)
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
    /// `at 00:00 UTC`, `at 09:30 UTC+02:00`, `at 00:00 Europe/Paris`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (hour, minute) = self.resets_at();
        write!(f, "at {hour:02}:{minute:02} ")?;
        match self.zone {
            Zone::Fixed(0) => f.write_str("UTC"),
            Zone::Fixed(minutes) => {
                let sign = if minutes < 0 { '-' } else { '+' };
                let offset = minutes.unsigned_abs();
                write!(f, "UTC{sign}{:02}:{:02}", offset / 60, offset % 60)
            }
            #[cfg(feature = "tz")]
            Zone::Named(zone) => f.write_str(zone.name()),
        }
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
mod tests;

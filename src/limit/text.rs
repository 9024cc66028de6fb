//! Limits written as text: `100/s burst 200`, `100000 per day at 00:00 UTC`, read by
//! `FromStr` (and serde) and written back by `Display`.

use std::time::Duration;

use super::Limit;
use crate::calendar::{Period, Zone};
use crate::error::ConfigError;

/// Units a limit's period may be written in, with their length in microseconds.
const UNITS: &[(&[&str], u64)] = &[
    (&["us", "µs", "micros", "microsecond", "microseconds"], 1),
    (&["ms", "millis", "millisecond", "milliseconds"], 1_000),
    (&["s", "sec", "secs", "second", "seconds"], 1_000_000),
    (&["m", "min", "mins", "minute", "minutes"], 60_000_000),
    (&["h", "hr", "hour", "hours"], 3_600_000_000),
    (&["d", "day", "days"], 86_400_000_000),
];

impl std::fmt::Display for Limit {
    /// `100/s`, `100/s burst 200`, `30/h burst 15`, `1 per 3ms`: the tokens per period in the
    /// unit the limit was written in, and the burst when it is not one period's worth. It
    /// reads back as the same limit.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(calendar) = self.calendar {
            let period = match calendar.period() {
                Period::Day => "day",
                Period::Week => "week",
                Period::Month => "month",
            };
            return write!(f, "{} per {period} {calendar}", self.capacity);
        }
        let tokens = self.written_amount();
        let (count, unit) = largest_unit(self.written_micros);
        match count {
            1 => write!(f, "{tokens}/{unit}")?,
            _ => write!(f, "{tokens} per {count}{unit}")?,
        }
        if self.capacity != tokens {
            write!(f, " burst {}", self.capacity)?;
        }
        if self.warm_up_micros > 0 {
            let (count, unit) = largest_unit(self.warm_up_micros);
            write!(f, " warm-up {count}{unit}")?;
        }
        Ok(())
    }
}

/// Units a period is printed in, shortest first.
const PRINTED: &[(&str, u64)] = &[
    ("us", 1),
    ("ms", 1_000),
    ("s", 1_000_000),
    ("min", 60_000_000),
    ("h", 3_600_000_000),
    ("day", 86_400_000_000),
];

/// `micros` as a whole count of the largest unit that divides it: `(3, "ms")`, `(2, "min")`.
fn largest_unit(micros: u64) -> (u64, &'static str) {
    PRINTED
        .iter()
        .rev()
        .find(|&&(_, unit)| micros.is_multiple_of(unit))
        .map_or((micros, "us"), |&(name, unit)| (micros / unit, name))
}

impl std::str::FromStr for Limit {
    type Err = ConfigError;

    /// Reads a limit as people write them: `100/s`, `100/s burst 200`, `5000/h`,
    /// `100000/day`, `100/10s` (100 per 10 seconds), `15 per 2min`, `1 per 2 minutes burst 15`.
    /// Without a burst, the capacity is one period's tokens; `warm-up 30s` (or `warm up 30s`)
    /// at the end adds a [warm-up](Limit::warm_up). Numbers may group digits with
    /// single `_` or `,` (`100_000`); a period of zero is an error. Errors name the part that
    /// could not be read.
    ///
    /// ```
    /// use hierarchical_throttle::Limit;
    /// let api: Limit = "100/s burst 200".parse()?;
    /// assert_eq!(api, Limit::per_second(100).burst(200)?);
    /// let quota: Limit = "1 per 2min burst 15".parse()?;
    /// assert_eq!(quota.to_string().parse::<Limit>()?, quota);
    /// assert!("100/fortnight".parse::<Limit>().unwrap_err().to_string().contains("fortnight"));
    /// # Ok::<(), hierarchical_throttle::ConfigError>(())
    /// ```
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let text = text.trim();
        let (text, warm_up) = match text.split_once("warm-up").or(text.split_once("warm up")) {
            Some((limit, period)) => (limit.trim(), Some(duration(period.trim())?)),
            None => (text, None),
        };
        let limit = match calendar_quota(text)? {
            Some(limit) => limit,
            None => rate_and_burst(text)?,
        };
        match warm_up {
            Some(period) => limit.warm_up(period),
            None => Ok(limit),
        }
    }
}

/// `100000 per day at 00:00 UTC`, `1000000 per month`, `5000/week at 09:30 UTC+02:00`: a
/// calendar quota (a period of a week or a month, or a reset time given); `None` for any other
/// limit.
fn calendar_quota(text: &str) -> Result<Option<Limit>, ConfigError> {
    // The reset time first: a zone's name has a `/` of its own.
    let (rest, at) = match text.split_once(" at ") {
        Some((rest, at)) => (rest, Some(at.trim())),
        None => (text, None),
    };
    let Some((amount, unit)) = rest.split_once('/').or(rest.split_once(" per ")) else {
        return Ok(None);
    };
    let unit = unit.trim();
    let period = match unit.split_whitespace().next().unwrap_or_default() {
        "day" | "days" | "d" if at.is_some() => Period::Day,
        "week" | "weeks" => Period::Week,
        "month" | "months" => Period::Month,
        _ => return Ok(None),
    };
    if text.contains("burst") {
        let expected = "no burst: a calendar quota gives its whole amount at each reset";
        return Err(parse_error(text, expected));
    }
    let mut quota = Limit::per_calendar(number(amount.trim())?, period);
    if let Some(at) = at {
        let (hour, minute, zone) = reset_time(at)?;
        quota = quota.resetting_at(hour, minute);
        quota.zone = Ok(zone);
    }
    quota.build().map(Some)
}

/// `00:00 UTC`, `9:30 UTC+02:00`, `09:30 UTC-5`, `23:00` (UTC), `00:00 Europe/Paris`
/// (feature `tz`): a reset's time of day and its zone.
fn reset_time(text: &str) -> Result<(u8, u8, Zone), ConfigError> {
    let expected =
        "a time of day and an optional zone: `00:00 UTC`, `09:30 UTC+02:00`, `00:00 Europe/Paris`";
    let (time, zone) = match text.split_once(char::is_whitespace) {
        Some((time, zone)) => (time, zone.trim()),
        None => (text, "UTC"),
    };
    let (hour, minute) = time
        .split_once(':')
        .and_then(|(h, m)| Some((h.parse::<u8>().ok()?, m.parse::<u8>().ok()?)))
        .ok_or_else(|| parse_error(time, expected))?;
    Ok((hour, minute, zone_of(zone)?))
}

/// `UTC`, `UTC+02:00`, `GMT-5` (fixed offsets of at most 14 hours), or a zone of the
/// time-zone database: `Europe/Paris`, `GMT0` (feature `tz`). One reading for text and for
/// `CalendarQuota::time_zone`, so a limit written out reads back the same.
pub(super) fn zone_of(text: &str) -> Result<Zone, ConfigError> {
    let fixed = text.strip_prefix("UTC").or(text.strip_prefix("GMT"));
    match fixed.and_then(fixed_offset).and_then(Zone::fixed) {
        Some(zone) => Ok(zone),
        None => named_zone(text),
    }
}

/// `` (none), `+02:00`, `-5`: an offset from UTC in minutes east.
fn fixed_offset(text: &str) -> Option<i16> {
    if text.is_empty() {
        return Some(0);
    }
    let (sign, rest) = match text.split_at_checked(1)? {
        ("+", rest) => (1, rest),
        ("-", rest) => (-1, rest),
        _ => return None,
    };
    let (hours, minutes) = rest.split_once(':').unwrap_or((rest, "0"));
    let (hours, minutes) = (hours.parse::<i16>().ok()?, minutes.parse::<i16>().ok()?);
    (minutes < 60 && hours < 15).then_some(sign * (hours * 60 + minutes))
}

/// The zone of the time-zone database named `name`.
#[cfg(feature = "tz")]
fn named_zone(name: &str) -> Result<Zone, ConfigError> {
    crate::calendar::NamedZone::get(name)
        .map(Zone::Named)
        .ok_or_else(|| {
            parse_error(
                name,
                "`UTC`, a fixed offset of at most 14 hours (`UTC+02:00`) or a zone of the IANA time-zone database (`Europe/Paris`)",
            )
        })
}

/// Without the time-zone database, only fixed offsets.
#[cfg(not(feature = "tz"))]
fn named_zone(name: &str) -> Result<Zone, ConfigError> {
    Err(parse_error(
        name,
        "`UTC` or a fixed offset of at most 14 hours (`UTC+02:00`); a zone such as `Europe/Paris` needs the `tz` feature",
    ))
}

/// `100/s burst 200`: a limit without a warm-up.
fn rate_and_burst(text: &str) -> Result<Limit, ConfigError> {
    let (rate, burst) = match text.split_once("burst") {
        Some((rate, burst)) => (rate.trim(), Some(burst.trim())),
        None => (text, None),
    };
    let (amount, period) = match rate.split_once('/') {
        Some(split) => split,
        None => rate
            .split_once(" per ")
            .ok_or_else(|| parse_error(rate, "`<tokens>/<period>` or `<tokens> per <period>`"))?,
    };
    let amount = number(amount.trim())?;
    let period = duration(period.trim())?;
    let builder = Limit::per(amount, period);
    match burst {
        Some(burst) => builder.burst(number(burst)?),
        None => builder.build(),
    }
}

#[cfg(feature = "serde")]
#[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
impl<'de> serde::Deserialize<'de> for Limit {
    /// From the strings [`FromStr`](std::str::FromStr) reads (`"100/s burst 200"`).
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(feature = "serde")]
#[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
impl serde::Serialize for Limit {
    /// As the string [`Display`](std::fmt::Display) prints.
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

fn parse_error(part: &str, expected: &'static str) -> ConfigError {
    ConfigError::Unreadable {
        part: part.to_owned(),
        expected,
    }
}

/// A whole number: digits, with single `_` or `,` separators between them (`100_000`,
/// `100,000`); a separator first, last or doubled is an error, not ignored.
fn number(text: &str) -> Result<u64, ConfigError> {
    let separated = |c: char| matches!(c, '_' | ',');
    let groups_are_digits = text
        .split(separated)
        .all(|group| !group.is_empty() && group.bytes().all(|b| b.is_ascii_digit()));
    let digits: String = text.chars().filter(|&c| !separated(c)).collect();
    match groups_are_digits {
        true => digits.parse().ok(),
        false => None,
    }
    .ok_or_else(|| parse_error(text, "a whole number"))
}

/// `10s`, `2min`, `2 min`, `s`, `1day`: an optional count and a unit. A count of zero is an
/// error: a limit refills over a period that passes.
fn duration(text: &str) -> Result<Duration, ConfigError> {
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '_' || c == ','))
        .unwrap_or(text.len());
    let (count, unit) = text.split_at(split);
    let count = match count {
        "" => 1,
        count => match number(count)? {
            0 => return Err(parse_error(text, "a period longer than zero")),
            count => count,
        },
    };
    let unit = unit.trim();
    let micros = UNITS
        .iter()
        .find(|(names, _)| names.contains(&unit))
        .map(|&(_, micros)| micros)
        .ok_or_else(|| parse_error(unit, "a unit: us, ms, s, min, h or day"))?;
    count
        .checked_mul(micros)
        .map(Duration::from_micros)
        .ok_or_else(|| parse_error(text, "a period of at most 366 days"))
}

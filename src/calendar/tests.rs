use super::*;

/// A calendar at a fixed offset; `None` when out of range.
fn fixed(period: Period, hour: u8, minute: u8, offset_minutes: i16) -> Option<Calendar> {
    Calendar::new(period, hour, minute, Zone::fixed(offset_minutes)?)
}

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
    let midnight = fixed(Period::Day, 0, 0, 0).unwrap();
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
    let east = fixed(Period::Day, 9, 30, 120).unwrap();
    assert_eq!(
        east.reset_after(utc(2024, 6, 1, 8, 0), 1),
        utc(2024, 6, 2, 7, 30)
    );
    assert_eq!(
        east.reset_after(utc(2024, 6, 1, 7, 0), 1),
        utc(2024, 6, 1, 7, 30)
    );
    let west = fixed(Period::Day, 9, 30, -300).unwrap();
    assert_eq!(
        west.reset_after(utc(2024, 6, 1, 8, 0), 1),
        utc(2024, 6, 1, 14, 30)
    );
    assert_eq!(east.to_string(), "at 09:30 UTC+02:00");
    assert_eq!(west.to_string(), "at 09:30 UTC-05:00");
    assert!(fixed(Period::Day, 24, 0, 0).is_none());
    assert!(fixed(Period::Day, 0, 60, 0).is_none());
    assert!(fixed(Period::Day, 0, 0, 15 * 60).is_none());
}

#[test]
fn a_week_resets_on_mondays() {
    let week = fixed(Period::Week, 0, 0, 0).unwrap();
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
    let month = fixed(Period::Month, 0, 0, 0).unwrap();
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
    let paris = fixed(Period::Month, 0, 0, 60).unwrap();
    assert_eq!(
        paris.reset_after(utc(2024, 2, 29, 22, 0), 1),
        utc(2024, 2, 29, 23, 0)
    );
    assert_eq!(
        paris.reset_after(utc(2024, 2, 29, 23, 0), 1),
        utc(2024, 3, 31, 23, 0)
    );
}

#[cfg(feature = "tz")]
mod zones {
    use super::*;

    fn zoned(period: Period, hour: u8, minute: u8, name: &str) -> Calendar {
        let zone = Zone::Named(NamedZone::get(name).expect("a zone of the database"));
        Calendar::new(period, hour, minute, zone).expect("a valid time of day")
    }

    /// Unix microseconds of `year-month-day hour:minute` in `zone`, read as jiff reads it
    /// ("compatible": a skipped time moves forward by the gap, a repeated one is the first).
    fn jiff_local(zone: &str, (year, month, day): (i16, i8, i8), (hour, minute): (i8, i8)) -> u64 {
        let tz = jiff::tz::TimeZone::get(zone).unwrap();
        let at = jiff::civil::date(year, month, day).at(hour, minute, 0, 0);
        let zoned = at.to_zoned_datetime(tz).unwrap();
        zoned.timestamp().as_microsecond() as u64
    }

    #[test]
    fn paris_days_are_23_and_25_hours_long_around_its_changes() {
        let paris = zoned(Period::Day, 0, 0, "Europe/Paris");
        // 2024-03-31 00:00 CET is 2024-03-30 23:00 UTC; 2024-04-01 00:00 CEST is 22:00 UTC.
        let spring = utc(2024, 3, 30, 23, 0);
        assert_eq!(paris.reset_after(spring - 1, 1), spring);
        assert_eq!(paris.reset_after(spring, 1) - spring, 23 * 3_600_000_000);
        // 2024-10-27 00:00 CEST is 2024-10-26 22:00 UTC; the day ends at 23:00 UTC.
        let autumn = utc(2024, 10, 26, 22, 0);
        assert_eq!(paris.reset_after(autumn, 1) - autumn, 25 * 3_600_000_000);
        // An hour before the long day's end is still that day.
        assert_eq!(
            paris.resets_between(autumn, utc(2024, 10, 27, 22, 30)),
            0,
            "no reset at 22:00 UTC, where the morning's offset would put one"
        );
        assert_eq!(paris.resets_between(autumn, utc(2024, 10, 27, 23, 0)), 1);
        assert_eq!(paris.to_string(), "at 00:00 Europe/Paris");
        let debug = format!("{paris:?}");
        assert!(
            debug.contains("Europe/Paris") && debug.len() < 100,
            "{debug}"
        );
    }

    #[test]
    fn a_reset_the_clocks_skip_comes_later_and_one_they_repeat_comes_once() {
        let paris = zoned(Period::Day, 2, 30, "Europe/Paris");
        // 2024-03-31: 02:00 CET jumps to 03:00 CEST; 02:30 does not exist, the reset is at
        // 03:30 CEST (01:30 UTC).
        let skipped = paris.reset_after(utc(2024, 3, 30, 12, 0), 1);
        assert_eq!(skipped, utc(2024, 3, 31, 1, 30));
        // 2024-10-27: 03:00 CEST goes back to 02:00 CET; 02:30 comes at 00:30 and 01:30 UTC,
        // and the day resets at the first only.
        let first = utc(2024, 10, 27, 0, 30);
        assert_eq!(paris.reset_after(first - 1, 1), first);
        assert_eq!(paris.resets_between(first, utc(2024, 10, 27, 1, 30)), 0);
        assert_eq!(paris.resets_between(first, utc(2024, 10, 27, 1, 45)), 0);
        // The next, 2024-10-28 02:30 CET, is 01:30 UTC: a day of 25 hours.
        assert_eq!(paris.reset_after(first, 1), utc(2024, 10, 28, 1, 30));
        // Within the repeated hour, the window is the one begun at its first 02:30.
        let second = utc(2024, 10, 27, 1, 15);
        assert_eq!(paris.start(paris.window(second)), first);
    }

    /// Every window's start and the window of every instant around it, for zones with an
    /// hour's change each way (north and south), a half-hour one, one without changes, and
    /// reset times in, before and after the changed hours, against jiff's own reading of
    /// the database, over two years.
    #[test]
    fn windows_match_the_database_over_two_years() {
        let zones = [
            "Europe/Paris",
            "America/New_York",
            "America/Santiago",
            "Australia/Lord_Howe",
            "Asia/Kolkata",
            "America/St_Johns",
        ];
        let times = [(0, 0), (1, 45), (2, 15), (2, 30), (3, 0), (23, 30)];
        for zone in zones {
            for (hour, minute) in times {
                for period in [Period::Day, Period::Week, Period::Month] {
                    let calendar = zoned(period, hour, minute, zone);
                    let mut at = utc(2024, 1, 1, 0, 0);
                    let mut previous = None;
                    while at < utc(2026, 1, 1, 0, 0) {
                        let window = calendar.window(at);
                        let start = calendar.start(window);
                        let days = (start as i64 + 14 * 3_600_000_000).div_euclid(DAY);
                        let expected = expected_start(zone, period, (hour, minute), start);
                        assert_eq!(start, expected, "{zone} {period:?} {hour}:{minute} {days}");
                        assert!(start <= at && at < calendar.start(window + 1));
                        assert_eq!(calendar.window(start), window);
                        assert_eq!(calendar.window(start - 1), window - 1);
                        if let Some(previous) = previous {
                            assert!(window - previous <= 1, "{zone} skipped a window at {at}");
                        }
                        previous = Some(window);
                        at += 5 * 3_600_000_000;
                    }
                }
            }
        }
    }

    /// The start of the window holding `start` as jiff computes it: the local date `start`
    /// falls on (or the Monday, or the 1st, before it), at the reset's time.
    fn expected_start(zone: &str, period: Period, (hour, minute): (u8, u8), start: u64) -> u64 {
        let tz = jiff::tz::TimeZone::get(zone).unwrap();
        let instant = jiff::Timestamp::from_microsecond(start as i64).unwrap();
        let mut date = instant.to_zoned_datetime(tz).date();
        // A reset moved forward out of a skipped hour may land after its local time: read
        // the date of an hour earlier then.
        let local_minutes = |d: jiff::civil::Date| {
            let at = d.at(hour as i8, minute as i8, 0, 0);
            jiff_local(
                zone,
                (at.year(), at.month(), at.day()),
                (at.hour(), at.minute()),
            )
        };
        if local_minutes(date) > start {
            date = date.yesterday().unwrap();
        }
        let date = match period {
            Period::Day => date,
            Period::Week => {
                let back = date.weekday().to_monday_zero_offset();
                date.checked_sub(jiff::Span::new().days(back)).unwrap()
            }
            Period::Month => date.first_of_month(),
        };
        local_minutes(date)
    }

    #[test]
    fn the_scripts_get_the_change_nearest_the_call() {
        let paris = zoned(Period::Day, 0, 0, "Europe/Paris");
        // Nearest 2024-10-27 01:00 UTC: midnight is 2 h before midnight UTC until then, 1 h
        // after.
        let change = utc(2024, 10, 27, 1, 0) as i64;
        let expected = format!("{},{change},{}", -120 * MINUTE, -60 * MINUTE);
        assert_eq!(paris.script_shift(|| utc(2024, 10, 20, 0, 0)), expected);
        let fixed = fixed(Period::Day, 9, 30, 120).unwrap();
        assert_eq!(fixed.script_shift(|| 0), (450 * MINUTE).to_string());
        // A zone without changes since 1970 is one offset everywhere.
        let kolkata = zoned(Period::Day, 0, 0, "Asia/Kolkata");
        let shift = -330 * MINUTE;
        assert_eq!(
            kolkata.script_shift(|| utc(2024, 10, 20, 0, 0)),
            format!("{shift},{},{shift}", i64::MIN)
        );
    }
}

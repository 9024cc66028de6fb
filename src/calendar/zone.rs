//! Where a calendar's local time stands against UTC: a fixed offset, or a zone of the IANA
//! time-zone database (feature `tz`) whose offset changes (daylight saving time).

/// A calendar's time zone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Zone {
    /// A fixed offset, in minutes east of UTC.
    Fixed(i16),
    /// A zone of the time-zone database.
    #[cfg(feature = "tz")]
    Named(&'static NamedZone),
}

/// The widest offset from UTC in use (UTC+14:00, UTC-12:00 the other way), in minutes.
const MAX_OFFSET_MINUTES: i16 = 14 * 60;

const MINUTE: i64 = 60_000_000;

impl Zone {
    /// A fixed offset of `minutes` east of UTC; `None` past the widest in use.
    pub(crate) fn fixed(minutes: i16) -> Option<Self> {
        (minutes.abs() <= MAX_OFFSET_MINUTES).then_some(Self::Fixed(minutes))
    }

    /// The offsets around the change of offset nearest to `utc` (Unix microseconds): exact
    /// for every time closer to that change than to any other.
    #[cfg_attr(not(feature = "tz"), allow(unused_variables))]
    pub(crate) fn offsets_near(&self, utc: i64) -> Offsets {
        match self {
            Self::Fixed(minutes) => Offsets::fixed(i64::from(*minutes) * MINUTE),
            #[cfg(feature = "tz")]
            Self::Named(zone) => zone.offsets_near(utc),
        }
    }

    /// Whether its offset never changes.
    pub(crate) fn is_fixed(&self) -> bool {
        matches!(self, Self::Fixed(_))
    }
}

/// The offsets from UTC (in microseconds, east positive) around one change: `before` until
/// `change` (Unix microseconds), `after` from it. A fixed offset is the same on both sides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Offsets {
    pub(crate) change: i64,
    pub(crate) before: i64,
    pub(crate) after: i64,
}

impl Offsets {
    fn fixed(offset: i64) -> Self {
        Self {
            change: i64::MIN,
            before: offset,
            after: offset,
        }
    }

    /// The offset in force at `utc`.
    pub(crate) fn at(&self, utc: i64) -> i64 {
        if utc < self.change {
            self.before
        } else {
            self.after
        }
    }

    /// The instant a local time (microseconds as if it were UTC) names. A local time that
    /// comes twice (clocks set back) names its first instant; one skipped (clocks set
    /// forward) names the instant the gap's length after it: RFC 5545's and Temporal's
    /// "compatible" reading, so a reset at 02:30 on a day without 02:30 happens at 03:30.
    pub(crate) fn instant_of(&self, local: i64) -> i64 {
        let early = local.saturating_sub(self.before);
        if early < self.change {
            return early;
        }
        let late = local.saturating_sub(self.after);
        if late >= self.change { late } else { early }
    }
}

#[cfg(feature = "tz")]
pub(crate) use named::NamedZone;

#[cfg(feature = "tz")]
mod named {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};

    use super::Offsets;

    /// A zone of the time-zone database, with its changes of offset from 1970 to 2200 read
    /// once (the database's rules extend its last rule past its table).
    pub(crate) struct NamedZone {
        name: Box<str>,
        /// The offset in force at the Unix epoch, in microseconds.
        first: i64,
        /// Each change: when (Unix microseconds) and the offset from then, in microseconds.
        changes: Vec<(i64, i64)>,
    }

    /// 2200-01-01 00:00 UTC, in Unix seconds: the last change read.
    const LAST_SECOND: i64 = 7_258_118_400;

    impl NamedZone {
        /// The zone named `name` (`Europe/Paris`, or `europe/paris`: the database's own
        /// spelling is kept), read once per process: zones are shared by every limit naming
        /// them and never freed, so there are at most as many as the database has names.
        pub(crate) fn get(name: &str) -> Option<&'static Self> {
            static ZONES: OnceLock<Mutex<HashMap<Box<str>, &'static NamedZone>>> = OnceLock::new();
            let zones = ZONES.get_or_init(Mutex::default);
            let mut zones = zones
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            if let Some(zone) = zones.get(name) {
                return Some(zone);
            }
            let tz = jiff::tz::TimeZone::get(name).ok()?;
            let spelled = tz.iana_name().unwrap_or(name);
            let zone = match zones.get(spelled) {
                Some(zone) => *zone,
                None => {
                    let zone: &'static Self = Box::leak(Box::new(Self::read(spelled, &tz)));
                    zones.insert(spelled.into(), zone);
                    zone
                }
            };
            zones.insert(name.into(), zone);
            Some(zone)
        }

        fn read(name: &str, tz: &jiff::tz::TimeZone) -> Self {
            let micros = |offset: jiff::tz::Offset| i64::from(offset.seconds()) * 1_000_000;
            let changes = tz
                .following(jiff::Timestamp::UNIX_EPOCH)
                .take_while(|change| change.timestamp().as_second() <= LAST_SECOND)
                .map(|change| (change.timestamp().as_microsecond(), micros(change.offset())))
                .collect();
            Self {
                name: name.into(),
                first: micros(tz.to_offset(jiff::Timestamp::UNIX_EPOCH)),
                changes,
            }
        }

        /// Its name in the database.
        pub(crate) fn name(&self) -> &str {
            &self.name
        }

        pub(super) fn offsets_near(&self, utc: i64) -> Offsets {
            let next = self.changes.partition_point(|&(at, _)| at <= utc);
            let nearest = match (next.checked_sub(1), self.changes.get(next)) {
                (None, None) => return Offsets::fixed(self.first),
                (Some(last), None) => last,
                (None, Some(_)) => next,
                (Some(last), Some(&(at, _))) => {
                    if utc - self.changes[last].0 <= at - utc {
                        last
                    } else {
                        next
                    }
                }
            };
            let before = match nearest.checked_sub(1) {
                Some(previous) => self.changes[previous].1,
                None => self.first,
            };
            let (change, after) = self.changes[nearest];
            Offsets {
                change,
                before,
                after,
            }
        }
    }

    // A limit's `Debug` names its zone rather than list hundreds of changes.
    impl std::fmt::Debug for NamedZone {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_tuple("NamedZone").field(&self.name).finish()
        }
    }

    // One zone per name: a name decides equality.
    impl PartialEq for NamedZone {
        fn eq(&self, other: &Self) -> bool {
            self.name == other.name
        }
    }

    impl Eq for NamedZone {}

    impl std::hash::Hash for NamedZone {
        fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
            self.name.hash(state);
        }
    }
}

//! Time sources.
//!
//! The throttle reads time only off the hot path: when a local bucket runs short, when a batch
//! arrives, and when leases are swept. Time is a [`Duration`] since an arbitrary, fixed origin,
//! so a manual clock can start at zero and tests are exact.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

/// A monotonic time source.
///
/// Implementations must never go backwards. The origin is arbitrary but fixed for the clock's
/// lifetime; clones of a clock must share it.
pub trait Clock: Clone + Send + Sync + 'static {
    /// Time elapsed since this clock's origin.
    fn now(&self) -> Duration;

    /// The Unix time of this clock's origin, which places its times on the calendar: the
    /// memory store and the hosts reckon [calendar quotas](crate::Limit::per_calendar)'
    /// resets by it. Default: zero (the clock counts from 1970-01-01 00:00 UTC).
    fn unix_origin(&self) -> Duration {
        Duration::ZERO
    }
}

/// The Unix time now, read once when a clock is made (zero for a system clock set before 1970).
fn unix_now() -> Duration {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
}

/// The default clock: [`Instant`] relative to the moment the clock was created.
#[derive(Debug, Clone, Copy)]
pub struct MonotonicClock {
    origin: Instant,
    unix_origin: Duration,
}

impl MonotonicClock {
    /// A clock whose origin is now (on the calendar: the system's time now).
    pub fn new() -> Self {
        Self {
            origin: Instant::now(),
            unix_origin: unix_now(),
        }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }

    fn unix_origin(&self) -> Duration {
        self.unix_origin
    }
}

/// A clock that moves only when told to, for exact tests and simulations.
///
/// Clones share the same time: advancing one advances all. Its zero is 1970-01-01 00:00 UTC
/// ([`unix_origin`](Clock::unix_origin) is zero): to test a calendar quota's reset, set it to
/// the Unix time the test starts at.
///
/// ```
/// use hierarchical_throttle::clock::{Clock, ManualClock};
/// use std::time::Duration;
///
/// let clock = ManualClock::new();
/// let shared = clock.clone();
/// clock.advance(Duration::from_millis(3));
/// assert_eq!(shared.now(), Duration::from_millis(3));
/// ```
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    nanos: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock standing at zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        self.nanos.fetch_add(duration_nanos(by), Ordering::SeqCst);
    }

    /// Moves the clock to `to`; a time earlier than now is ignored, so the clock stays monotonic.
    pub fn set(&self, to: Duration) {
        self.nanos.fetch_max(duration_nanos(to), Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Duration {
        Duration::from_nanos(self.nanos.load(Ordering::SeqCst))
    }
}

/// Tokio's clock ([`tokio::time::Instant`]), which follows tokio's paused time in tests.
#[derive(Debug, Clone, Copy)]
pub struct TokioClock {
    origin: tokio::time::Instant,
    unix_origin: Duration,
}

impl TokioClock {
    /// A clock whose origin is tokio's now, at 1970-01-01 00:00 UTC on the calendar (as a
    /// [`ManualClock`]'s: runs are the same whenever they run).
    pub fn new() -> Self {
        Self::at_unix_time(Duration::ZERO)
    }

    /// A clock whose origin is tokio's now, placed at `unix_time` on the calendar: for tests
    /// on paused time that cross a calendar quota's reset.
    pub fn at_unix_time(unix_time: Duration) -> Self {
        Self {
            origin: tokio::time::Instant::now(),
            unix_origin: unix_time,
        }
    }
}

impl Default for TokioClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for TokioClock {
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }

    fn unix_origin(&self) -> Duration {
        self.unix_origin
    }
}

fn duration_nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// `clock`'s time now on the calendar, in whole Unix microseconds: the time of every bucket.
pub(crate) fn unix_micros(clock: &impl Clock) -> u64 {
    micros(clock.now().saturating_add(clock.unix_origin()))
}

/// Whole microseconds of `d`, the unit of all bucket arithmetic.
pub(crate) fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

//! Time sources.
//!
//! The throttle reads time only off the hot path: when a local bucket runs short, when a batch
//! arrives, and when leases are swept. Time is a [`Duration`] since an arbitrary, fixed origin,
//! so a manual clock can start at zero and tests are exact.
//!
//! Where a hot path must know the time (whether a concurrency limit's slots are still held,
//! the state the `RateLimit` fields tell), it reads [`Clock::recent`]: on Linux the kernel's
//! coarse monotonic clock, about a seventh of the precise read's cost. A question of safety
//! ("is the holding still valid?") is settled by that reading only when it is further than
//! [`Clock::recent_lag`] from the answer's edge; otherwise the precise time is read.

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

    /// A cheaper reading of [`now`](Clock::now) for hot paths: never later than `now`, and
    /// behind it by at most [`recent_lag`](Clock::recent_lag). Default: `now` itself.
    fn recent(&self) -> Duration {
        self.now()
    }

    /// How far [`recent`](Clock::recent) may trail [`now`](Clock::now). Default: zero.
    fn recent_lag(&self) -> Duration {
        Duration::ZERO
    }

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
///
/// On Linux its [`recent`](Clock::recent) reading is the kernel's coarse monotonic clock
/// (`CLOCK_MONOTONIC_COARSE`: the same clock as of its last tick, 1-10 ms ago, read in a few
/// nanoseconds); its [`recent_lag`](Clock::recent_lag) is [`COARSE_LAG`], five ticks of the
/// slowest common kernel (100 Hz), for a tick the kernel is late with. Elsewhere `recent` is
/// `now`.
#[derive(Debug, Clone, Copy)]
pub struct MonotonicClock {
    origin: Instant,
    unix_origin: Duration,
    /// The origin on the kernel's monotonic clock, read after `origin`: a coarse reading less
    /// this is never later than `now`.
    coarse_origin: Option<Duration>,
}

/// How far [`MonotonicClock`]'s coarse reading may trail its precise one, where it has one.
pub const COARSE_LAG: Duration = Duration::from_millis(50);

impl MonotonicClock {
    /// A clock whose origin is now (on the calendar: the system's time now).
    pub fn new() -> Self {
        let origin = Instant::now();
        Self {
            origin,
            unix_origin: unix_now(),
            coarse_origin: coarse::monotonic(),
        }
    }
}

/// The kernel's monotonic clocks, read through `rustix` (no `unsafe` here).
#[cfg(target_os = "linux")]
mod coarse {
    use rustix::time::{ClockId, Timespec, clock_gettime};
    use std::time::Duration;

    fn duration(t: Timespec) -> Duration {
        let secs = u64::try_from(t.tv_sec).unwrap_or(0);
        let nanos = u32::try_from(t.tv_nsec).unwrap_or(0);
        Duration::new(secs, nanos)
    }

    /// The precise monotonic time, on the clock [`std::time::Instant`] reads.
    pub(super) fn monotonic() -> Option<Duration> {
        Some(duration(clock_gettime(ClockId::Monotonic)))
    }

    /// The monotonic time as of the kernel's last tick.
    pub(super) fn coarse() -> Duration {
        duration(clock_gettime(ClockId::MonotonicCoarse))
    }
}

#[cfg(not(target_os = "linux"))]
mod coarse {
    use std::time::Duration;

    /// No coarse clock: [`MonotonicClock`](super::MonotonicClock)'s `recent` is its `now`.
    pub(super) fn monotonic() -> Option<Duration> {
        None
    }

    pub(super) fn coarse() -> Duration {
        Duration::ZERO
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

    fn recent(&self) -> Duration {
        match self.coarse_origin {
            Some(origin) => coarse::coarse().saturating_sub(origin),
            None => self.now(),
        }
    }

    fn recent_lag(&self) -> Duration {
        match self.coarse_origin {
            Some(_) => COARSE_LAG,
            None => Duration::ZERO,
        }
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

/// `clock`'s [recent](Clock::recent) time on the calendar, in whole Unix microseconds: for
/// what a response tells, not for decisions.
pub(crate) fn unix_recent_micros(clock: &impl Clock) -> u64 {
    micros(clock.recent().saturating_add(clock.unix_origin()))
}

/// The time as a hot path asks about it, in microseconds: "is it before `t`?" is answered by
/// the recent reading when that lies further than the lag from `t`, else by reading the time
/// (once, however often it is asked).
pub(crate) struct Now<F> {
    recent: u64,
    lag: u64,
    read: F,
    exact: Option<u64>,
}

impl<F: FnMut() -> u64> Now<F> {
    /// `recent` is never later than the time `read` returns, and at most `lag` behind it.
    pub(crate) fn new(recent: u64, lag: u64, read: F) -> Self {
        Self {
            recent,
            lag,
            read,
            exact: None,
        }
    }

    /// Whether the time now is before `t`.
    pub(crate) fn is_before(&mut self, t: u64) -> bool {
        if self.recent.saturating_add(self.lag) < t {
            return true;
        }
        if self.recent >= t {
            return false;
        }
        self.exact() < t
    }

    /// The time now, read once however often it is asked.
    pub(crate) fn exact(&mut self) -> u64 {
        *self.exact.get_or_insert_with(&mut self.read)
    }
}

/// The time `now`, known exactly.
#[cfg(test)]
pub(crate) fn exactly(now: u64) -> Now<impl FnMut() -> u64> {
    Now::new(now, 0, move || now)
}

/// Whole microseconds of `d`, the unit of all bucket arithmetic.
pub(crate) fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    #[test]
    fn the_recent_reading_is_never_later_than_now_nor_further_behind_than_its_lag() {
        let clock = MonotonicClock::new();
        for _ in 0..100_000 {
            // Read in this order, a thread preempted between the reads cannot fail either.
            let recent = clock.recent();
            assert!(recent <= clock.now(), "recent {recent:?} ahead of now");
            let now = clock.now();
            let recent = clock.recent();
            assert!(
                recent + clock.recent_lag() >= now,
                "{recent:?} lags {now:?} too far"
            );
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn on_linux_the_default_clock_has_a_coarse_reading() {
        assert_eq!(MonotonicClock::new().recent_lag(), COARSE_LAG);
    }

    #[test]
    fn other_clocks_read_now_for_recent() {
        let clock = ManualClock::new();
        clock.advance(Duration::from_micros(7));
        assert_eq!(clock.recent(), clock.now());
        assert_eq!(clock.recent_lag(), Duration::ZERO);
    }

    fn counted(reads: &Cell<u32>, time: u64) -> impl FnMut() -> u64 + '_ {
        move || {
            reads.set(reads.get() + 1);
            time
        }
    }

    #[test]
    fn a_recent_time_far_from_the_edge_answers_without_reading_the_clock() {
        let reads = Cell::new(0);
        let mut now = Now::new(1_000, 50, counted(&reads, 1_030));
        assert!(now.is_before(1_051));
        assert!(!now.is_before(1_000));
        assert!(!now.is_before(0));
        assert_eq!(reads.get(), 0);
    }

    #[test]
    fn within_the_lag_of_the_edge_the_clock_is_read_once() {
        let reads = Cell::new(0);
        let mut now = Now::new(1_000, 50, counted(&reads, 1_030));
        assert!(now.is_before(1_031));
        assert!(!now.is_before(1_030));
        assert!(!now.is_before(1_001));
        assert!(now.is_before(1_050));
        assert_eq!(now.exact(), 1_030);
        assert_eq!(reads.get(), 1);
    }

    #[test]
    fn an_exact_time_answers_every_question_alike() {
        let mut now = exactly(10);
        assert!(now.is_before(11));
        assert!(!now.is_before(10));
        assert!(!now.is_before(0));
    }
}

//! Time sources.
//!
//! The throttle reads time only off the hot path: when a local bucket runs short, when a batch
//! arrives, and when leases are swept. Time is a [`Duration`] since an arbitrary, fixed origin,
//! so a manual clock can start at zero and tests are exact.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A monotonic time source.
///
/// Implementations must never go backwards. The origin is arbitrary but fixed for the clock's
/// lifetime; clones of a clock must share it.
pub trait Clock: Clone + Send + Sync + 'static {
    /// Time elapsed since this clock's origin.
    fn now(&self) -> Duration;
}

/// The default clock: [`Instant`] relative to the moment the clock was created.
#[derive(Debug, Clone, Copy)]
pub struct MonotonicClock {
    origin: Instant,
}

impl MonotonicClock {
    /// A clock whose origin is now.
    pub fn new() -> Self {
        Self {
            origin: Instant::now(),
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
}

/// A clock that moves only when told to, for exact tests and simulations.
///
/// Clones share the same time: advancing one advances all.
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
}

impl TokioClock {
    /// A clock whose origin is tokio's now.
    pub fn new() -> Self {
        Self {
            origin: tokio::time::Instant::now(),
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
}

fn duration_nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Whole microseconds of `d`, the unit of all bucket arithmetic.
pub(crate) fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

//! Configuration errors, reported when a [`Limit`](crate::Limit) or a layer is built, and the
//! errors of an operator's calls to the global store.

use std::fmt;
use std::time::Duration;

/// An error boxed, as axum's and hyper's bodies carry theirs: a metered body's frames, a
/// type-erased handle's store.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why a limit or a layer could not be built.
///
/// Every invalid setting is caught here, at build time, so that a running service never
/// panics or misbehaves because of its configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigError {
    /// A limit's refill amount was zero: the bucket would never refill.
    ZeroRate,
    /// A limit's capacity (burst) was zero: no request could ever be served.
    ZeroCapacity,
    /// A limit's refill period was not a whole, positive number of microseconds, or longer than
    /// [`Limit::MAX_PERIOD`](crate::Limit::MAX_PERIOD).
    InvalidPeriod(Duration),
    /// A limit's capacity was above [`Limit::MAX_CAPACITY`](crate::Limit::MAX_CAPACITY).
    CapacityTooLarge(u64),
    /// A rate whose exact arithmetic would not fit the stores' 53-bit integers (after reducing
    /// `amount / period` to lowest terms). Choose a rounder rate, such as a whole number per
    /// second or per minute.
    RateNotExact {
        /// Tokens per period.
        amount: u64,
        /// The period.
        period: Duration,
    },
    /// A limit written as text could not be read, a time zone's name is not in the
    /// time-zone database (or needs the `tz` feature), or an IP network could not be read.
    Unreadable {
        /// The part that could not be read.
        part: String,
        /// What was expected there.
        expected: &'static str,
    },
    /// A setting outside its valid range.
    InvalidSetting {
        /// The builder method that was given the value.
        setting: &'static str,
        /// What the setting accepts.
        expected: &'static str,
    },
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ZeroRate => f.write_str("a limit must refill at least one token per period"),
            Self::ZeroCapacity => f.write_str("a limit's capacity (burst) must be at least 1"),
            Self::InvalidPeriod(p) => write!(
                f,
                "a limit's period must be a whole number of microseconds between 1us and 366 days, got {p:?}"
            ),
            Self::CapacityTooLarge(c) => write!(
                f,
                "a limit's capacity must be at most 2^53 - 1 ({}), got {c}",
                (1u64 << 53) - 1
            ),
            Self::RateNotExact { amount, period } => write!(
                f,
                "{amount} tokens per {period:?} cannot be refilled exactly; choose a rounder rate"
            ),
            Self::Unreadable { part, expected } => {
                write!(f, "cannot read `{part}`: expected {expected}")
            }
            Self::InvalidSetting { setting, expected } => {
                write!(f, "invalid `{setting}`: expected {expected}")
            }
        }
    }
}

impl std::error::Error for ConfigError {}

/// Why an operator's call to the global store failed
/// ([`adjust`](crate::HierarchicalThrottleLayer::adjust),
/// [`remaining_global`](crate::HierarchicalThrottleLayer::remaining_global)): the store's
/// error, or no answer within the layer's [store time-out](crate::Builder::store_timeout), as
/// for any call the layer makes, so that a stalled store never holds an operator's tool.
#[derive(Debug)]
#[non_exhaustive]
pub enum StoreError<E> {
    /// The store answered with an error.
    Store(E),
    /// The store did not answer within this time-out. The call may still be applied later
    /// (a stalled store runs what its socket buffer holds when it resumes).
    TimedOut(Duration),
    /// An operator's change to a calendar quota reached the store after the reset of the
    /// window it was made in, and was dropped (by the store's clock): the window it was for has
    /// ended, and the new one is as its reset left it. Send it again to change the new window.
    WindowEnded,
}

impl<E: fmt::Display> fmt::Display for StoreError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Store(error) => write!(f, "the global store failed: {error}"),
            Self::TimedOut(after) => {
                write!(f, "the global store did not answer within {after:?}")
            }
            Self::WindowEnded => write!(
                f,
                "the change reached the global store after the reset of the window it was \
                 made in, and was dropped"
            ),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for StoreError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Store(error) => Some(error),
            Self::TimedOut(_) | Self::WindowEnded => None,
        }
    }
}

//! Global stores: one token bucket per key, shared by every host of a fleet.
//!
//! A [`GlobalStore`] dispenses batches of tokens to hosts and takes back tokens they did not
//! use. It refills lazily by its own clock, so hosts' clocks never matter.

use std::future::Future;
use std::time::Duration;

use crate::limit::Limit;

pub mod memory;
#[cfg(feature = "redis")]
pub mod redis;

/// A request for tokens: at least `min`, ideally `want`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenRequest {
    /// Dispense nothing unless at least this many tokens are there (at least 1).
    pub min: u64,
    /// Dispense up to this many (at least `min`, at most the capacity).
    pub want: u64,
}

/// A global store's answer to a [`TokenRequest`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// Tokens dispensed to the host: zero, or between `min` and `want`.
    pub granted: u64,
    /// Whole tokens left in the global bucket.
    pub remaining: u64,
    /// How long until the global bucket holds `min` tokens again (zero if it does now).
    pub refill_in: Duration,
}

/// The global level of the hierarchy: a token bucket per key, refilled lazily by the store's
/// own clock.
///
/// The limit is passed on every call, so it may differ per key and change at run time.
/// A bucket that has never been seen starts full.
pub trait GlobalStore<K>: Send + Sync + 'static {
    /// Why a call failed. The throttle applies its
    /// [`FailurePolicy`](crate::FailurePolicy) to any error.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Dispenses between `request.min` and `request.want` tokens for `key`, or none when fewer
    /// than `request.min` are there.
    fn acquire(
        &self,
        key: &K,
        limit: &Limit,
        request: TokenRequest,
    ) -> impl Future<Output = Result<Grant, Self::Error>> + Send;

    /// Takes back `tokens` that a host leased for `key` and did not use, never past capacity.
    fn release(
        &self,
        key: &K,
        limit: &Limit,
        tokens: u64,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;
}

//! What the throttle does when the global store fails.

use std::num::NonZeroU64;

/// What to do with a request that needs the global store while the store fails, times out,
/// or is being given time to recover.
///
/// The default is [`LocalFallback`](Self::LocalFallback) with one expected host: each host
/// then enforces the key's whole limit on its own. The service stays up through a store outage,
/// and a single client still cannot flood any one host; the fleet as a whole may admit up to
/// its number of hosts times the limit until the store is back. Set `expected_hosts` to the
/// fleet's size to keep the fleet near its limit, [`Reject`](Self::Reject) where exceeding a
/// limit is worse than refusing service, or [`Admit`](Self::Admit) where availability is all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FailurePolicy {
    /// Admit the request (fail open).
    Admit,
    /// Reject the request with [`RejectionReason::StoreUnavailable`](crate::RejectionReason)
    /// (fail closed): HTTP 503, gRPC `UNAVAILABLE`.
    Reject,
    /// Enforce the key's limit divided by `expected_hosts` with a bucket on this host alone.
    LocalFallback {
        /// How many hosts share the limit.
        expected_hosts: NonZeroU64,
    },
}

impl FailurePolicy {
    /// [`LocalFallback`](Self::LocalFallback) for a fleet of `expected_hosts`; zero is an error.
    pub fn local_fallback(expected_hosts: u64) -> Result<Self, crate::ConfigError> {
        NonZeroU64::new(expected_hosts)
            .map(|expected_hosts| Self::LocalFallback { expected_hosts })
            .ok_or(crate::ConfigError::InvalidSetting {
                setting: "FailurePolicy::local_fallback",
                expected: "at least one host",
            })
    }
}

impl Default for FailurePolicy {
    fn default() -> Self {
        Self::LocalFallback {
            expected_hosts: NonZeroU64::MIN,
        }
    }
}

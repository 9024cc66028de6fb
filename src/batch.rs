//! How many tokens a host asks the global store for at once.
//!
//! A batch is sized by a [`BatchPolicy`] and then clamped by the throttle: never less than what
//! the waiting requests need, never more than the bucket's capacity.

use crate::limit::Limit;

/// The most intervals of demand a host remembers per key.
pub const MAX_DEMAND_INTERVALS: usize = 16;

/// Tokens a host was asked for, for one key, in each of its recent intervals, most recent
/// first: those it served, and those it refused because the key was throttled (so that a
/// throttled key's batches follow its real demand rather than shrinking to single tokens).
///
/// Tokens served from local leases are counted without reading the clock; they are attributed
/// to the interval in which the host next reads it (when a bucket runs low or a batch arrives),
/// which under steady load is the interval they were served in.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DemandHistory {
    /// `served[0]` is the interval numbered `current`.
    served: [u32; MAX_DEMAND_INTERVALS],
    current: u64,
}

impl DemandHistory {
    /// No demand yet.
    pub const fn new() -> Self {
        Self {
            served: [0; MAX_DEMAND_INTERVALS],
            current: 0,
        }
    }

    /// Whether no demand is left in the window once it has moved to interval `interval`.
    pub fn is_idle(&self, interval: u64) -> bool {
        let shift = interval.saturating_sub(self.current);
        let kept =
            MAX_DEMAND_INTERVALS.saturating_sub(usize::try_from(shift).unwrap_or(usize::MAX));
        self.served[..kept].iter().all(|&t| t == 0)
    }

    /// Adds `tokens` to interval number `interval`, moving the window forward if it is new.
    pub fn record(&mut self, interval: u64, tokens: u64) {
        self.advance(interval);
        self.served[0] = self.served[0].saturating_add(u32::try_from(tokens).unwrap_or(u32::MAX));
    }

    fn advance(&mut self, interval: u64) {
        if interval <= self.current {
            return;
        }
        let shift = interval - self.current;
        self.current = interval;
        if shift >= MAX_DEMAND_INTERVALS as u64 {
            self.served = [0; MAX_DEMAND_INTERVALS];
        } else {
            let shift = shift as usize;
            self.served
                .copy_within(0..MAX_DEMAND_INTERVALS - shift, shift);
            self.served[..shift].fill(0);
        }
    }

    /// Tokens served per interval, most recent (the one in progress) first.
    pub fn recent(&self) -> &[u32] {
        &self.served
    }
}

/// The linearly weighted average of `served` (most recent first) over its first `x` entries:
/// `(x*t1 + (x-1)*t2 + ... + 1*tx) / (1 + 2 + ... + x)`, rounded up.
///
/// ```
/// use hierarchical_throttle::batch::weighted_average;
/// // x = 3: (3*6 + 2*3 + 1*0) / 6 = 4
/// assert_eq!(weighted_average(&[6, 3, 0], 3), 4);
/// ```
pub fn weighted_average(served: &[u32], x: usize) -> u64 {
    let x = x.min(served.len());
    if x == 0 {
        return 0;
    }
    let weighted: u64 = served[..x]
        .iter()
        .enumerate()
        .map(|(i, &t)| (x - i) as u64 * u64::from(t))
        .sum();
    let weights = (x * (x + 1) / 2) as u64;
    weighted.div_ceil(weights)
}

/// What a [`BatchPolicy`] sees when it sizes a batch.
#[derive(Debug, Clone, Copy)]
pub struct BatchContext<'a> {
    /// The key's limit.
    pub limit: &'a Limit,
    /// Tokens the requests waiting for this batch need, and those admitted on credit that it
    /// pays for.
    pub needed: u64,
    /// This host's demand for the key, per interval, most recent first.
    pub demand: &'a [u32],
    /// The number of intervals the throttle is configured to weigh.
    pub intervals: usize,
    /// Tokens the lease may keep past its time-to-live: a sixteenth of the capacity (at least
    /// one token) while the global bucket held at least half its capacity at the last answer,
    /// none once the key is near its limit. [`WeightedDemand`] asks for at least this, so that
    /// a slow key fetches a few requests' worth at a time rather than one token. None when the
    /// host keeps no small leases ([`keep_small_leases`](crate::Builder::keep_small_leases)).
    /// The global bucket refills while a host keeps tokens: the host's next fetch takes back
    /// what that refill put past `capacity - kept` by its estimate (on top of the batch this
    /// policy asks for), so one host's burst after a quiet stretch spends at most the
    /// capacity. Across hosts, one whose fetch comes after the bucket ran dry still spends
    /// what it kept; a policy that asks only for [`needed`](Self::needed) holds nothing
    /// between requests, for a call per request (the README's "windows that start later").
    pub keep: u64,
}

/// Sizes the batch a host asks for. The throttle clamps the answer to at least
/// [`BatchContext::needed`] and at most the capacity.
pub trait BatchPolicy: Send + Sync + 'static {
    /// Tokens to ask for.
    fn batch_size(&self, cx: &BatchContext<'_>) -> u64;
}

/// The default: the linearly weighted average of the tokens served per interval over the last
/// `intervals` intervals ([`weighted_average`]), so a batch lasts about one interval; and at
/// least what the lease may keep ([`BatchContext::keep`]) while the key is far from its limit.
#[derive(Debug, Clone, Copy, Default)]
pub struct WeightedDemand;

impl BatchPolicy for WeightedDemand {
    fn batch_size(&self, cx: &BatchContext<'_>) -> u64 {
        weighted_average(cx.demand, cx.intervals).max(cx.keep)
    }
}

/// A fixed fraction of the bucket's capacity, whatever the demand.
#[derive(Debug, Clone, Copy)]
pub struct FractionOfCapacity(f64);

impl FractionOfCapacity {
    /// `fraction` of the capacity, in `(0, 1]`.
    pub fn new(fraction: f64) -> Result<Self, crate::ConfigError> {
        if fraction > 0.0 && fraction <= 1.0 {
            Ok(Self(fraction))
        } else {
            Err(crate::ConfigError::InvalidSetting {
                setting: "FractionOfCapacity::new",
                expected: "a fraction in (0, 1]",
            })
        }
    }
}

impl BatchPolicy for FractionOfCapacity {
    fn batch_size(&self, cx: &BatchContext<'_>) -> u64 {
        (cx.limit.capacity() as f64 * self.0).ceil() as u64
    }
}

impl<F> BatchPolicy for F
where
    F: Fn(&BatchContext<'_>) -> u64 + Send + Sync + 'static,
{
    fn batch_size(&self, cx: &BatchContext<'_>) -> u64 {
        self(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn history_shifts_with_intervals() {
        let mut h = DemandHistory::default();
        h.record(5, 4);
        h.record(5, 1);
        h.record(7, 2);
        assert_eq!(&h.recent()[..4], &[2, 0, 5, 0]);
        h.record(100, 1);
        assert_eq!(&h.recent()[..3], &[1, 0, 0]);
        h.record(99, 1);
        assert_eq!(
            h.recent()[0],
            2,
            "a late record counts in the current interval"
        );
    }
}
